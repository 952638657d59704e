//! CPU kernels whose fast paths a tensor op reaches directly, checked through the tensor API:
//! ReLU's gradient at inactive (and NaN) units, and the vectorised f32 `exp` and `ln` within 4
//! ulp of the rounded results on buffers long enough for the parallel path; the dense matmul's
//! threaded paths (strips of rows, strips of columns, the crate's own threading) against a
//! product written out in f64, through the forward and both backward products. The kernels that
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

/// `op(a)·op(b)` in f64 from the definition, `a` `[m, k]` and `b` `[k, n]` row-major.
fn product(a: &[f64], b: &[f64], (m, k, n): (usize, usize, usize)) -> Vec<f64> {
    let mut c = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            c[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
        }
    }
    c
}

fn transpose(x: &[f64], rows: usize, cols: usize) -> Vec<f64> {
    (0..cols * rows)
        .map(|i| x[(i % rows) * cols + i / rows])
        .collect()
}

/// Shapes on every side of the threading thresholds (64³ multiply-adds, 2²⁸): cut by rows
/// (`m ≥ n`), by columns, with sides that are not multiples of the strip alignment, and one
/// large enough for the crate's threading; forward `a·b` and the backward products `g·bᵀ` and
/// `aᵀ·g` (transposed operands read in place), in f32 against f64 sums.
#[test]
fn threaded_matmul_matches_the_definition() {
    use rand::{RngExt, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    for (m, k, n) in [
        (63, 64, 64),
        (300, 70, 33),
        (33, 70, 300),
        (97, 129, 101),
        (768, 128, 128),
        (128, 768, 1024),
        (700, 600, 700),
    ] {
        let a: Vec<f64> = (0..m * k).map(|_| rng.random_range(-1.0..1.0)).collect();
        let b: Vec<f64> = (0..k * n).map(|_| rng.random_range(-1.0..1.0)).collect();
        let g: Vec<f64> = (0..m * n).map(|_| rng.random_range(-1.0..1.0)).collect();
        let t = |v: &[f64], shape: &[usize]| {
            Tensor::from_f64(v.to_vec(), shape, Device::cpu())
                .and_then(|t| t.to_dtype(moegrad::DType::F32))
                .unwrap()
        };
        let (ta, tb) = (t(&a, &[m, k]), t(&b, &[k, n]));
        ta.set_requires_grad(true).unwrap();
        tb.set_requires_grad(true).unwrap();
        let y = ta.matmul(&tb).unwrap();
        y.backward_with(&t(&g, &[m, n])).unwrap();
        let checks = [
            (
                "a·b",
                y.to_vec_f64().unwrap(),
                product(&a, &b, (m, k, n)),
                k,
            ),
            (
                "g·bᵀ",
                ta.grad().unwrap().to_vec_f64().unwrap(),
                product(&g, &transpose(&b, k, n), (m, n, k)),
                n,
            ),
            (
                "aᵀ·g",
                tb.grad().unwrap().to_vec_f64().unwrap(),
                product(&transpose(&a, m, k), &g, (k, m, n)),
                m,
            ),
        ];
        for (what, got, want, depth) in checks {
            // f32 sums of `depth` products of values below 1: a few ulp per term at most
            let tol = 4.0 * f32::EPSILON as f64 * depth as f64;
            for (i, (x, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (x - w).abs() <= tol,
                    "[{m}, {k}]·[{k}, {n}] {what}: element {i} is {x}, expected {w}"
                );
            }
        }
    }
}
