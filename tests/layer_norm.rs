//! `Tensor::layer_norm`: the fused op against finite differences and against the same layer
//! norm composed from existing ops (mean, subtract, square, mean, add, sqrt, divide, scale,
//! shift), the form it replaced.
//!
//! * f64 gradcheck on the CPU (a row of one value, one row, 3-D inputs);
//! * values and the three gradients equal to the composed path, at fixed shapes and over random
//!   shapes (proptest), with large offsets too (the variance is taken in two passes);
//! * GPU (f32) against CPU (f64) for rows shorter than the workgroup, not a multiple of it and
//!   several times it; skipped with a printed reason without an adapter unless
//!   `MOEGRAD_REQUIRE_GPU=1`;
//! * bad shapes, dtypes, devices and eps give an `Error`; no rows give an empty result.

mod common;

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

/// x `shape`, gamma and beta `[dim]`, as f64 CPU tensors.
fn inputs(shape: &[usize], offset: f64, seed: u64) -> [Tensor; 3] {
    let n: usize = shape.iter().product();
    let dim = *shape.last().unwrap();
    [
        common::f64t(&values(n, offset, 2.0, seed), shape),
        common::f64t(&values(dim, 1.0, 0.5, seed + 1), &[dim]),
        common::f64t(&values(dim, 0.0, 0.5, seed + 2), &[dim]),
    ]
}

/// The layer norm composed from elementwise ops and reductions.
fn composed(x: &Tensor, gamma: &Tensor, beta: &Tensor, eps: f64) -> Result<Tensor> {
    let mean = x.mean(&[-1], true)?;
    let centred = x.sub(&mean)?;
    let var = centred.mul(&centred)?.mean(&[-1], true)?;
    centred
        .div(&var.add_scalar(eps)?.sqrt()?)?
        .mul(gamma)?
        .add(beta)
}

fn assert_matches_composed(what: &str, inputs: &[Tensor; 3], eps: f64, tol: f64) {
    let up = values(inputs[0].numel(), 0.0, 1.0, 99);
    let (y, grads) = common::run3(|x, g, b| x.layer_norm(g, b, eps), inputs, &up);
    let (y_ref, grads_ref) = common::run3(|x, g, b| composed(x, g, b, eps), inputs, &up);
    common::assert_close(&format!("{what}: output"), &y, &y_ref, tol, tol);
    for (name, (g, r)) in ["dx", "dgamma", "dbeta"]
        .iter()
        .zip(grads.iter().zip(&grads_ref))
    {
        common::assert_close(&format!("{what}: {name}"), g, r, tol, tol);
    }
}

#[test]
fn gradcheck_in_f64() {
    for (i, shape) in [vec![1, 1], vec![1, 5], vec![4, 3], vec![2, 3, 7]]
        .iter()
        .enumerate()
    {
        let eps = if shape.last() == Some(&1) { 1e-2 } else { 1e-5 };
        gradcheck(
            |t| t[0].layer_norm(&t[1], &t[2], eps),
            &inputs(shape, 0.5, 10 + i as u64),
            &GradcheckOptions::default(),
        )
        .unwrap_or_else(|e| panic!("{shape:?}: {e}"));
    }
}

#[test]
fn matches_the_composed_path() {
    for (i, (shape, offset)) in [
        (vec![1, 1], 0.0),
        (vec![3, 8], 0.0),
        (vec![2, 5, 130], 0.0),
        (vec![768, 128], 0.0), // the baby GPT's shape
        (vec![6, 33], 1e4),    // a large common offset: two passes keep the variance exact
    ]
    .iter()
    .enumerate()
    {
        let x = inputs(shape, *offset, 20 + i as u64);
        assert_matches_composed(&format!("{shape:?} offset {offset}"), &x, 1e-5, 1e-9);
    }
}

#[test]
fn f32_matches_f64() {
    let x = inputs(&[37, 70], 0.0, 31);
    let up = values(37 * 70, 0.0, 1.0, 32);
    let as32 = x.clone().map(|t| t.to_dtype(DType::F32).unwrap());
    let (y, grads) = common::run3(|x, g, b| x.layer_norm(g, b, 1e-5), &as32, &up);
    let (y_ref, grads_ref) = common::run3(|x, g, b| x.layer_norm(g, b, 1e-5), &x, &up);
    common::assert_close("f32 output", &y, &y_ref, 1e-5, 1e-4);
    for (g, r) in grads.iter().zip(&grads_ref) {
        common::assert_close("f32 gradient", g, r, 1e-4, 1e-3);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// Random shapes (rank 1 to 3), values and gradients as composed.
    #[test]
    fn random_shapes_match_the_composed_path(
        lead in proptest::collection::vec(1usize..=5, 0..=2),
        dim in 1usize..=40,
        seed in 0u64..1000,
    ) {
        let mut shape = lead.clone();
        shape.push(dim);
        let x = inputs(&shape, 0.3, 1000 + seed);
        let eps = if dim == 1 { 1e-2 } else { 1e-5 };
        assert_matches_composed(&format!("{shape:?}"), &x, eps, 1e-9);
    }
}

#[test]
fn gpu_matches_cpu() {
    let Some(gpu) = common::gpu_or_skip("layer_norm gpu_matches_cpu") else {
        return;
    };
    // rows shorter than the workgroup of 64, one of 1, not a multiple of it, several times it
    for (i, shape) in [
        vec![3, 1],
        vec![5, 7],
        vec![4, 64],
        vec![2, 3, 130],
        vec![96, 128],
        vec![2, 300],
    ]
    .iter()
    .enumerate()
    {
        let what = format!("{shape:?}");
        let x = inputs(shape, 0.5, 40 + i as u64);
        let up = values(x[0].numel(), 0.0, 1.0, 41);
        let on_gpu = x
            .clone()
            .map(|t| t.to_dtype(DType::F32).unwrap().to_device(gpu).unwrap());
        let eps = if shape.last() == Some(&1) { 1e-2 } else { 1e-5 };
        let (y, grads) = common::run3(|x, g, b| x.layer_norm(g, b, eps), &on_gpu, &up);
        let (y_ref, grads_ref) = common::run3(|x, g, b| x.layer_norm(g, b, eps), &x, &up);
        common::assert_close(&format!("{what}: GPU output"), &y, &y_ref, 1e-5, 1e-4);
        for (name, (g, r)) in ["dx", "dgamma", "dbeta"]
            .iter()
            .zip(grads.iter().zip(&grads_ref))
        {
            common::assert_close(&format!("{what}: GPU {name}"), g, r, 1e-4, 1e-3);
        }
    }
}

#[test]
fn bad_inputs_are_errors_and_no_rows_give_an_empty_result() {
    let cpu = Device::cpu();
    let x = Tensor::zeros(&[2, 3], DType::F32, cpu).unwrap();
    let (g3, b3) = (
        Tensor::ones(&[3], DType::F32, cpu).unwrap(),
        Tensor::zeros(&[3], DType::F32, cpu).unwrap(),
    );
    let g4 = Tensor::ones(&[4], DType::F32, cpu).unwrap();
    assert!(matches!(x.layer_norm(&g4, &b3, 1e-5), Err(Error::Shape(_))));
    assert!(matches!(x.layer_norm(&g3, &g4, 1e-5), Err(Error::Shape(_))));
    let empty_axis = Tensor::zeros(&[2, 0], DType::F32, cpu).unwrap();
    let g0 = Tensor::zeros(&[0], DType::F32, cpu).unwrap();
    assert!(matches!(
        empty_axis.layer_norm(&g0, &g0, 1e-5),
        Err(Error::Shape(_))
    ));
    let scalar = Tensor::scalar(1.0, DType::F32, cpu).unwrap();
    assert!(matches!(
        scalar.layer_norm(&g3, &b3, 1e-5),
        Err(Error::Shape(_))
    ));
    let g64 = g3.to_dtype(DType::F64).unwrap();
    assert!(matches!(
        x.layer_norm(&g64, &b3, 1e-5),
        Err(Error::DType(_))
    ));
    let idx = Tensor::from_i32(vec![0; 6], &[2, 3], cpu).unwrap();
    let gi = Tensor::from_i32(vec![0; 3], &[3], cpu).unwrap();
    assert!(matches!(
        idx.layer_norm(&gi, &gi, 1e-5),
        Err(Error::DType(_))
    ));
    for eps in [-1.0, f64::NAN, f64::INFINITY] {
        assert!(
            matches!(x.layer_norm(&g3, &b3, eps), Err(Error::Invalid(_))),
            "eps {eps}"
        );
    }
    // no rows: an empty result, and empty / zero gradients
    let none = Tensor::zeros(&[0, 3], DType::F32, cpu)
        .unwrap()
        .with_grad()
        .unwrap();
    let g = g3.detach().with_grad().unwrap();
    let y = none.layer_norm(&g, &b3, 1e-5).unwrap();
    assert_eq!(y.shape(), &[0, 3]);
    y.sum_all().unwrap().backward().unwrap();
    assert_eq!(g.grad().unwrap().to_vec_f32().unwrap(), vec![0.0; 3]);
    if let Some(gpu) = common::gpu_or_skip("layer_norm devices") {
        let on_gpu = x.to_device(gpu).unwrap();
        assert!(matches!(
            on_gpu.layer_norm(&g3, &b3, 1e-5),
            Err(Error::Device(_))
        ));
    }
}
