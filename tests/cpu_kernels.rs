//! CPU kernels whose fast paths a tensor op reaches directly, checked through the tensor API:
//! ReLU's gradient at inactive (and NaN) units, and the vectorised f32 `exp` and `ln` within 4
//! ulp of the rounded results on buffers long enough for the parallel path. The kernels that
//! need the backend's own interface (sorting, the grouped matmul, reductions, scatters, Adam,
//! GELU) are tested inside the crate, in `src/backend/tests/`.

use moegrad::{Device, Tensor};

#[test]
fn relu_passes_no_gradient_to_inactive_units_even_a_nan_one() {
    let x = Tensor::from_f64(vec![-1.0, 0.0, -0.0, 2.0, 3.0], &[5], Device::cpu()).unwrap();
    x.set_requires_grad(true).unwrap();
    let g = Tensor::from_f64(
        vec![f64::NAN, f64::INFINITY, 1.0, 4.0, f64::NAN],
        &[5],
        Device::cpu(),
    )
    .unwrap();
    x.relu().unwrap().backward_with(&g).unwrap();
    let dx = x.grad().unwrap().to_vec_f64().unwrap();
    assert_eq!(&dx[..4], &[0.0, 0.0, 0.0, 4.0]);
    assert!(
        dx[4].is_nan(),
        "an active unit passes its gradient as it is"
    );
}

/// Distance in units in the last place between two finite f32 of one sign (or both zero).
fn ulps(a: f32, b: f32) -> u32 {
    (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
}

/// The CPU's f32 `exp` on a buffer long enough for the parallel path is within 4 ulp of the
/// rounded `exp` (the scalar function itself is checked over the whole range by the unit tests
/// of `backend/cpu/fast_math.rs`).
#[test]
fn vectorised_exp_is_within_4_ulp_of_the_rounded_exp_on_a_tensor() {
    let xs: Vec<f32> = (0..70_000)
        .map(|i| (i as f32 - 35_000.0) * 0.0025)
        .collect();
    let y = Tensor::from_f32(xs.clone(), &[xs.len()], Device::cpu())
        .and_then(|t| t.exp())
        .and_then(|t| t.to_vec_f32())
        .unwrap();
    for (&x, &y) in xs.iter().zip(&y) {
        assert!(ulps(y, (x as f64).exp() as f32) <= 4, "exp({x}) = {y}");
    }
}

/// The CPU's f32 `ln` through a tensor (the AVX2 loop where the processor has it, else SSE2)
/// is within 4 ulp of the rounded `ln` (the scalar function is checked over every positive
/// float by the unit tests of `backend/cpu/fast_math.rs`).
#[test]
fn vectorised_ln_is_within_4_ulp_of_the_rounded_ln_on_a_tensor() {
    let xs: Vec<f32> = (1..70_000).map(|i| i as f32 * 0.37e-3).collect();
    let y = Tensor::from_f32(xs.clone(), &[xs.len()], Device::cpu())
        .and_then(|t| t.log())
        .and_then(|t| t.to_vec_f32())
        .unwrap();
    for (&x, &y) in xs.iter().zip(&y) {
        assert!(ulps(y, (x as f64).ln() as f32) <= 4, "ln({x}) = {y}");
    }
}
