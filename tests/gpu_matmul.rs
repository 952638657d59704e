//! `Tensor::matmul` and `Tensor::grouped_matmul` on the GPU against the CPU in f64: the path a
//! model's forward pass takes through the matrix-product kernels (`shaders/matmul.wgsl`). The
//! kernels' layouts, offsets, grid splits and bad inputs are tested through the backend itself,
//! inside the crate (`src/backend/tests/gpu_matmul.rs`).
//!
//! Without a GPU adapter the test prints "skipping" and returns (a failure under
//! `MOEGRAD_REQUIRE_GPU=1`).

mod common;

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// `n` values uniform in [-1, 1), exactly representable in f32.
fn values(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// `row_expert` for sorted rows with the given count per expert.
fn sorted_experts(counts: &[usize]) -> Vec<i32> {
    counts
        .iter()
        .enumerate()
        .flat_map(|(e, &c)| std::iter::repeat_n(e as i32, c))
        .collect()
}

/// Expert offsets (`n + 1` entries) of sorted rows with the given counts.
fn offsets_of(counts: &[usize]) -> Vec<i32> {
    let mut off = vec![0];
    for &c in counts {
        off.push(off.last().unwrap() + c as i32);
    }
    off
}

/// `(atol, rtol)` for a product summing `terms` terms of inputs in [-1, 1): f32 rounding stays
/// far below it while any indexing mistake is off by O(1).
fn tol(terms: usize) -> (f64, f64) {
    (1e-5 * terms as f64 + 1e-6, 1e-4)
}

/// `Tensor::matmul` (2-D, batched, a 2-D operand shared by a batch) and `Tensor::grouped_matmul`
/// on the GPU against the CPU in f64: the path a model's forward pass takes.
#[test]
fn tensor_api_forward() {
    use moegrad::{DType, Device, Tensor};
    let Some(dev) = common::gpu_or_skip("tensor_api_forward") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(30);
    let mut pair = |shape: &[usize]| {
        let v = values(&mut rng, shape.iter().product());
        let cpu = Tensor::from_f32(v.clone(), shape, Device::cpu())
            .and_then(|t| t.to_dtype(DType::F64))
            .unwrap();
        (cpu, Tensor::from_f32(v, shape, dev).unwrap())
    };
    let cases: [(&[usize], &[usize]); 3] = [
        (&[70, 33], &[33, 65]),
        (&[3, 20, 17], &[3, 17, 9]),
        (&[2, 4, 66, 5], &[5, 70]),
    ];
    for (sa, sb) in cases {
        let ((ac, ag), (bc, bg)) = (pair(sa), pair(sb));
        let expected = ac.matmul(&bc).unwrap();
        let got = ag.matmul(&bg).unwrap();
        assert_eq!(got.shape(), expected.shape());
        let (atol, rtol) = tol(sa[sa.len() - 1]);
        let name = format!("Tensor::matmul {sa:?}·{sb:?}");
        common::assert_close(
            &name,
            &got.to_vec_f64().unwrap(),
            &expected.to_vec_f64().unwrap(),
            atol,
            rtol,
        );
    }
    let counts = [30, 0, 45, 20];
    let re = sorted_experts(&counts);
    let off = offsets_of(&counts);
    let ((xc, xg), (wc, wg)) = (pair(&[re.len(), 24]), pair(&[4, 24, 40]));
    let index = |v: &[i32], d: Device| Tensor::from_i32(v.to_vec(), &[v.len()], d).unwrap();
    let expected = xc
        .grouped_matmul(&wc, &index(&re, Device::cpu()), &index(&off, Device::cpu()))
        .unwrap();
    let got = xg
        .grouped_matmul(&wg, &index(&re, dev), &index(&off, dev))
        .unwrap();
    let (atol, rtol) = tol(24);
    common::assert_close(
        "Tensor::grouped_matmul",
        &got.to_vec_f64().unwrap(),
        &expected.to_vec_f64().unwrap(),
        atol,
        rtol,
    );
}
