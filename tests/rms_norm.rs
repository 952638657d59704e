//! `Tensor::rms_norm` (RMSNorm, the norm of Llama-style blocks): the layer-norm kernels told not
//! to centre, checked
//!
//! * against finite differences in f64 (a row of one value, one row, 3-D inputs);
//! * against an f64 reference written from the definition with plain loops (`y = x/√(mean(x²)+ε)·w`
//!   and its hand-derived gradients), at fixed and random shapes (proptest);
//! * GPU (f32) against CPU (f64) for rows shorter than the workgroup, not a multiple of it,
//!   several times it, and more rows than one grid dimension holds (the folded grid); skipped
//!   with a printed reason without an adapter unless `MOEGRAD_REQUIRE_GPU=1`;
//! * bad shapes, dtypes and eps give an `Error`; no rows give an empty result.

mod common;
#[path = "common/fold.rs"]
mod fold;

use moegrad::gradcheck::{GradcheckOptions, gradcheck};
use moegrad::{DType, Device, Error, Result, Tensor};
use proptest::prelude::*;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// `n` values uniform in `[offset − spread, offset + spread)`, f32-representable.
fn values(n: usize, offset: f64, spread: f64, seed: u64) -> Vec<f64> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|_| (offset + rng.random_range(-spread..spread)) as f32 as f64)
        .collect()
}

/// x `shape` and weight `[dim]` as f64 CPU tensors.
fn inputs(shape: &[usize], seed: u64) -> [Tensor; 2] {
    let n: usize = shape.iter().product();
    let dim = *shape.last().unwrap();
    [
        common::f64t(&values(n, 0.2, 2.0, seed), shape),
        common::f64t(&values(dim, 1.0, 0.5, seed + 1), &[dim]),
    ]
}

/// The definition, row by row in f64: `y = x·r·w` with `r = 1/√(mean(x²) + eps)`, and for the
/// upstream gradient `g` (h = g·w, x̂ = x·r): `dx = r·(h − x̂·mean(h·x̂))`, `dw = Σ_rows g·x̂`.
fn reference(x: &[f64], w: &[f64], g: &[f64], eps: f64) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let dim = w.len();
    let (mut y, mut dx, mut dw) = (vec![0.0; x.len()], vec![0.0; x.len()], vec![0.0; dim]);
    for r in 0..x.len() / dim {
        let row = r * dim..(r + 1) * dim;
        let (xr, gr) = (&x[row.clone()], &g[row.clone()]);
        let ms = xr.iter().map(|v| v * v).sum::<f64>() / dim as f64;
        let rstd = 1.0 / (ms + eps).sqrt();
        let mean_hx = (0..dim).map(|j| gr[j] * w[j] * xr[j] * rstd).sum::<f64>() / dim as f64;
        for j in 0..dim {
            let xhat = xr[j] * rstd;
            y[r * dim + j] = xhat * w[j];
            dx[r * dim + j] = rstd * (gr[j] * w[j] - xhat * mean_hx);
            dw[j] += gr[j] * xhat;
        }
    }
    (y, dx, dw)
}

/// Output and the gradients of x and the weight for the upstream gradient `up`.
fn run(inputs: &[Tensor; 2], eps: f64, up: &[f64]) -> (Vec<f64>, [Vec<f64>; 2]) {
    let leaves = inputs.clone().map(|t| t.detach().with_grad().unwrap());
    let y = leaves[0].rms_norm(&leaves[1], eps).unwrap();
    let g = Tensor::from_f64(up.to_vec(), y.shape(), Device::cpu())
        .and_then(|g| g.to_dtype(y.dtype()))
        .and_then(|g| g.to_device(y.device()))
        .unwrap();
    y.backward_with(&g).unwrap();
    let grads = leaves.map(|t| t.grad().unwrap().to_vec_f64().unwrap());
    (y.to_vec_f64().unwrap(), grads)
}

fn assert_matches_reference(what: &str, x: &[Tensor; 2], eps: f64, tol: f64) {
    let up = values(x[0].numel(), 0.0, 1.0, 99);
    let (y, [dx, dw]) = run(x, eps, &up);
    let (xv, wv) = (x[0].to_vec_f64().unwrap(), x[1].to_vec_f64().unwrap());
    let (y_ref, dx_ref, dw_ref) = reference(&xv, &wv, &up, eps);
    common::assert_close(&format!("{what}: output"), &y, &y_ref, tol, tol);
    common::assert_close(&format!("{what}: dx"), &dx, &dx_ref, tol, tol);
    common::assert_close(&format!("{what}: dweight"), &dw, &dw_ref, tol, tol);
}

#[test]
fn gradcheck_in_f64() {
    for (i, shape) in [vec![1, 1], vec![1, 5], vec![4, 3], vec![2, 3, 7]]
        .iter()
        .enumerate()
    {
        gradcheck(
            |t| t[0].rms_norm(&t[1], 1e-6),
            &inputs(shape, 10 + i as u64),
            &GradcheckOptions::default(),
        )
        .unwrap_or_else(|e| panic!("{shape:?}: {e}"));
    }
}

#[test]
fn matches_the_definition() {
    for (i, shape) in [vec![1, 1], vec![3, 8], vec![2, 5, 130], vec![768, 128]]
        .iter()
        .enumerate()
    {
        let x = inputs(shape, 20 + i as u64);
        assert_matches_reference(&format!("{shape:?}"), &x, 1e-6, 1e-10);
    }
}

#[test]
fn differs_from_layer_norm_when_the_mean_is_not_zero() {
    // the check that the kernels really skip the centring: with a common offset, a layer norm
    // and an RMSNorm of the same row differ
    let x = common::f64t(&[1.0, 2.0, 3.0], &[1, 3]);
    let w = common::f64t(&[1.0; 3], &[3]);
    let rms = x.rms_norm(&w, 0.0).unwrap().to_vec_f64().unwrap();
    let ms: f64 = (1.0 + 4.0 + 9.0) / 3.0;
    common::assert_close(
        "rms",
        &rms,
        &[1.0, 2.0, 3.0].map(|v| v / ms.sqrt()),
        1e-12,
        0.0,
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// Random shapes (rank 1 to 3): values and gradients as the definition.
    #[test]
    fn random_shapes_match_the_definition(
        lead in proptest::collection::vec(1usize..=5, 0..=2),
        dim in 1usize..=40,
        seed in 0u64..1000,
    ) {
        let mut shape = lead.clone();
        shape.push(dim);
        let x = inputs(&shape, 1000 + seed);
        assert_matches_reference(&format!("{shape:?}"), &x, 1e-5, 1e-9);
    }
}

#[test]
fn gpu_matches_cpu() {
    let Some(gpu) = common::gpu_or_skip("rms_norm gpu_matches_cpu") else {
        return;
    };
    // one workgroup per row: past 65,535 rows the grid folds into y
    let folded_rows = fold::MAX_GROUPS + 3;
    for (i, shape) in [
        vec![3, 1],
        vec![5, 64],
        vec![7, 100],
        vec![2, 300],
        vec![folded_rows, 2],
    ]
    .iter()
    .enumerate()
    {
        let what = format!("{shape:?}");
        let x = inputs(shape, 40 + i as u64);
        let up = values(x[0].numel(), 0.0, 1.0, 41);
        let on_gpu = x
            .clone()
            .map(|t| t.to_dtype(DType::F32).unwrap().to_device(gpu).unwrap());
        let (y, grads) = run(&on_gpu, 1e-5, &up);
        let (y_ref, grads_ref) = run(&x, 1e-5, &up);
        common::assert_close(&format!("{what}: GPU output"), &y, &y_ref, 1e-5, 1e-4);
        for (name, (g, r)) in ["dx", "dweight"].iter().zip(grads.iter().zip(&grads_ref)) {
            if *name == "dweight" && shape[0] == folded_rows {
                // one invocation sums each column over all 65,538 rows (the rows fold, the
                // columns do not): lavapipe's loop limiter cuts such loops short (docs/gpu.md,
                // "Some folded grids"), so this sum is checked on real GPUs only
                continue;
            }
            common::assert_close(&format!("{what}: GPU {name}"), g, r, 1e-4, 1e-3);
        }
    }
}

#[test]
fn bad_inputs_are_errors_and_no_rows_give_an_empty_result() -> Result<()> {
    let cpu = Device::cpu();
    let x = Tensor::zeros(&[2, 3], DType::F32, cpu)?;
    let w4 = Tensor::ones(&[4], DType::F32, cpu)?;
    let err = x.rms_norm(&w4, 1e-5).unwrap_err();
    assert!(
        matches!(&err, Error::Shape(m) if m.contains("rms_norm") && m.contains("weight")),
        "{err}"
    );
    let w3 = Tensor::ones(&[3], DType::F32, cpu)?;
    assert!(matches!(
        x.rms_norm(&w3.to_dtype(DType::F64)?, 1e-5),
        Err(Error::DType(_))
    ));
    for eps in [-1.0, f64::NAN] {
        assert!(matches!(x.rms_norm(&w3, eps), Err(Error::Invalid(_))));
    }
    let none = Tensor::zeros(&[0, 3], DType::F32, cpu)?.with_grad()?;
    let w = w3.detach().with_grad()?;
    let y = none.rms_norm(&w, 1e-5)?;
    assert_eq!(y.shape(), &[0, 3]);
    y.sum_all()?.backward()?;
    assert_eq!(w.grad().unwrap().to_vec_f32()?, vec![0.0; 3]);
    Ok(())
}
