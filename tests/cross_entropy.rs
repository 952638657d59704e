//! `Tensor::cross_entropy_per_row` / `cross_entropy`: the fused op against finite differences
//! and against the composed form it replaced (`log_softmax`, then `gather` of the target).
//!
//! * f64 gradcheck (one class, one row, many rows), with weighted rows (upstream gradients
//!   that differ per row);
//! * values and gradients equal to the composed path at fixed shapes, over random shapes
//!   (proptest) and with logits far from 0 (the row maximum is subtracted);
//! * GPU (f32) against CPU (f64) for rows shorter than the workgroup of 64, not a multiple of it
//!   and several times it; an out-of-range target on the GPU gives loss 0 and gradient 0 for
//!   its row; skipped with a printed reason without an adapter unless `MOEGRAD_REQUIRE_GPU=1`;
//! * f32 on the CPU against an f64 reference, forward and backward, with a NaN row and a row of
//!   −∞ among ordinary ones, below and above the size where rows run in parallel;
//! * bad shapes, dtypes, devices and targets give an `Error`.

mod common;

use moegrad::gradcheck::{GradcheckOptions, gradcheck};
use moegrad::{DType, Device, Error, Result, Tensor};
use proptest::prelude::*;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn values(n: usize, offset: f64, spread: f64, seed: u64) -> Vec<f64> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|_| (offset + rng.random_range(-spread..spread)) as f32 as f64)
        .collect()
}

fn targets(rows: usize, classes: usize, seed: u64, device: Device) -> Tensor {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let t: Vec<i32> = (0..rows)
        .map(|_| rng.random_range(0..classes) as i32)
        .collect();
    Tensor::from_i32(t, &[rows], device).unwrap()
}

/// The composed cross-entropy of each row.
fn composed(x: &Tensor, t: &Tensor) -> Result<Tensor> {
    let n = t.numel();
    x.log_softmax(-1)?
        .gather(1, &t.reshape(&[n, 1])?)?
        .reshape(&[n])?
        .neg()
}

/// Per-row losses and the logits' gradient for upstream gradient `up` `[rows]`.
fn run(
    f: impl Fn(&Tensor, &Tensor) -> Result<Tensor>,
    x: &Tensor,
    t: &Tensor,
    up: &[f64],
) -> (Vec<f64>, Vec<f64>) {
    let leaf = x.detach().with_grad().unwrap();
    let y = f(&leaf, t).expect("forward");
    let g = Tensor::from_f64(up.to_vec(), y.shape(), Device::cpu())
        .and_then(|g| g.to_dtype(y.dtype()))
        .and_then(|g| g.to_device(y.device()))
        .unwrap();
    y.backward_with(&g).expect("backward");
    (
        y.to_vec_f64().unwrap(),
        leaf.grad().unwrap().to_vec_f64().unwrap(),
    )
}

fn check_against_composed(rows: usize, classes: usize, offset: f64, seed: u64) {
    let x = common::f64t(&values(rows * classes, offset, 3.0, seed), &[rows, classes]);
    let t = targets(rows, classes, seed + 1, Device::cpu());
    let up = values(rows, 0.0, 1.0, seed + 2);
    let (y, g) = run(|x, t| x.cross_entropy_per_row(t), &x, &t, &up);
    let (y_ref, g_ref) = run(composed, &x, &t, &up);
    let what = format!("[{rows}, {classes}] offset {offset}");
    common::assert_close(&format!("{what}: loss"), &y, &y_ref, 1e-9, 1e-9);
    common::assert_close(&format!("{what}: dlogits"), &g, &g_ref, 1e-9, 1e-9);
}

#[test]
fn gradcheck_in_f64() {
    for (i, (rows, classes)) in [(1, 1), (1, 4), (6, 3), (5, 80)].iter().enumerate() {
        let x = common::f64t(
            &values(rows * classes, 0.0, 2.0, i as u64),
            &[*rows, *classes],
        );
        let t = targets(*rows, *classes, 7 + i as u64, Device::cpu());
        // rows weighted differently, so each row's gradient is checked on its own
        let w = common::f64t(&values(*rows, 1.0, 0.5, 30 + i as u64), &[*rows]);
        gradcheck(
            |v| v[0].cross_entropy_per_row(&t)?.mul(&w)?.sum_all(),
            std::slice::from_ref(&x),
            &GradcheckOptions::default(),
        )
        .unwrap_or_else(|e| panic!("[{rows}, {classes}] per row: {e}"));
        gradcheck(
            |v| v[0].cross_entropy(&t),
            &[x],
            &GradcheckOptions::default(),
        )
        .unwrap_or_else(|e| panic!("[{rows}, {classes}] mean: {e}"));
    }
}

#[test]
fn matches_the_composed_path() {
    for (i, (rows, classes, offset)) in [
        (1, 1, 0.0),
        (3, 2, 0.0),
        (768, 80, 0.0), // the char-LM's logits
        (4, 300, 0.0),
        (5, 17, 1e3), // far from 0: the row maximum keeps the exponentials finite
        (5, 17, -1e3),
    ]
    .iter()
    .enumerate()
    {
        check_against_composed(*rows, *classes, *offset, 50 + 3 * i as u64);
    }
}

/// The CPU's f32 path (vectorised exponential in blocks, lanes, AVX2 where the processor has
/// it) against the definition in f64, forward and backward with a random upstream gradient,
/// with a NaN row (loss NaN) and a row of −∞ (loss NaN: lse = −∞ minus the target's −∞) among
/// ordinary rows, at sizes on both sides of the parallel threshold, with rows shorter than a
/// block of exponentials, several blocks long and with a tail that is not a whole number of
/// lanes.
#[test]
fn f32_rows_match_the_definition_with_special_rows() {
    for (rows, classes) in [(7usize, 13usize), (600, 80), (300, 517)] {
        let mut x = values(rows * classes, 0.0, 4.0, rows as u64);
        x[2 * classes + 5] = f64::NAN;
        for v in &mut x[4 * classes..5 * classes] {
            *v = f64::NEG_INFINITY;
        }
        let t = targets(rows, classes, 3, Device::cpu());
        let tv = t.to_vec_f64().unwrap();
        let up = values(rows, 0.0, 1.0, 7);
        let xs = Tensor::from_f32(
            x.iter().map(|&v| v as f32).collect(),
            &[rows, classes],
            Device::cpu(),
        )
        .unwrap();
        let (got, grad) = run(|x, t| x.cross_entropy_per_row(t), &xs, &t, &up);
        for r in 0..rows {
            let row = &x[r * classes..(r + 1) * classes];
            let m = row.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
            let lse = m + row.iter().map(|&v| (v - m).exp()).sum::<f64>().ln();
            let want = lse - row[tv[r] as usize];
            if r == 2 || r == 4 {
                assert!(
                    got[r].is_nan(),
                    "[{rows}, {classes}] row {r}: {} (want NaN)",
                    got[r]
                );
                continue;
            }
            assert!(
                (got[r] - want).abs() <= 1e-5 * want.abs().max(1.0),
                "[{rows}, {classes}] row {r}: {} against {want}",
                got[r]
            );
            for (c, &v) in row.iter().enumerate() {
                let onehot = if c == tv[r] as usize { 1.0 } else { 0.0 };
                let want = up[r] * ((v - lse).exp() - onehot);
                let got = grad[r * classes + c];
                assert!(
                    (got - want).abs() <= 1e-6 + 1e-5 * want.abs(),
                    "[{rows}, {classes}] dlogits[{r}, {c}]: {got} against {want}"
                );
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    #[test]
    fn random_shapes_match_the_composed_path(
        rows in 1usize..=40,
        classes in 1usize..=70,
        seed in 0u64..1000,
    ) {
        check_against_composed(rows, classes, 0.0, 1000 + seed);
    }
}

/// The mean loss is one op whose backward broadcasts the scalar upstream gradient times 1/N
/// inside the per-row kernel: the loss and the logits' gradient are the bits of the per-row
/// op followed by `mean_all`, on the CPU (f32, f64) and on the GPU (f32), for an upstream
/// gradient other than 1.
#[test]
fn the_mean_gives_the_bits_of_the_per_row_op_and_mean_all() {
    let mut devices = vec![(Device::cpu(), DType::F64), (Device::cpu(), DType::F32)];
    if let Some(gpu) = common::gpu_or_skip("cross_entropy mean on the GPU") {
        devices.push((gpu, DType::F32));
    }
    for (device, dtype) in devices {
        for (i, (rows, classes)) in [(1, 3), (7, 5), (300, 80)].iter().enumerate() {
            let x = common::f64t(
                &values(rows * classes, 0.5, 3.0, 90 + i as u64),
                &[*rows, *classes],
            )
            .to_dtype(dtype)
            .and_then(|x| x.to_device(device))
            .unwrap();
            let t = targets(*rows, *classes, 91 + i as u64, device);
            let up = [-0.75];
            let (y, g) = run(|x, t| x.cross_entropy(t), &x, &t, &up);
            let (y_ref, g_ref) = run(|x, t| x.cross_entropy_per_row(t)?.mean_all(), &x, &t, &up);
            let what = format!("{device} {dtype} [{rows}, {classes}]");
            assert_eq!(y, y_ref, "{what}: loss");
            assert_eq!(g, g_ref, "{what}: dlogits");
        }
    }
}

#[test]
fn gpu_matches_cpu_and_ignores_targets_out_of_range() {
    let Some(gpu) = common::gpu_or_skip("cross_entropy gpu_matches_cpu") else {
        return;
    };
    for (i, (rows, classes)) in [(3, 1), (7, 5), (4, 64), (9, 80), (2, 300)]
        .iter()
        .enumerate()
    {
        let x = common::f64t(
            &values(rows * classes, 0.5, 3.0, 70 + i as u64),
            &[*rows, *classes],
        );
        let t = targets(*rows, *classes, 71 + i as u64, Device::cpu());
        let up = values(*rows, 0.0, 1.0, 72);
        let (xg, tg) = (
            x.to_dtype(DType::F32).unwrap().to_device(gpu).unwrap(),
            t.to_device(gpu).unwrap(),
        );
        let (y, g) = run(|x, t| x.cross_entropy_per_row(t), &xg, &tg, &up);
        let (y_ref, g_ref) = run(|x, t| x.cross_entropy_per_row(t), &x, &t, &up);
        let what = format!("[{rows}, {classes}]");
        common::assert_close(&format!("{what}: GPU loss"), &y, &y_ref, 1e-5, 1e-4);
        common::assert_close(&format!("{what}: GPU dlogits"), &g, &g_ref, 1e-5, 1e-4);
    }
    // out-of-range targets on the GPU: loss 0 and gradient 0 for those rows only
    let x = Tensor::from_f32(vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0], &[3, 2], gpu).unwrap();
    let t = Tensor::from_i32(vec![1, 5, -1], &[3], gpu).unwrap();
    let (y, g) = run(|x, t| x.cross_entropy_per_row(t), &x, &t, &[1.0, 1.0, 1.0]);
    assert!(
        (y[0] - (1.0f64 + (-1.0f64).exp()).ln()).abs() < 1e-6,
        "{y:?}"
    );
    assert_eq!(&y[1..], &[0.0, 0.0]);
    assert!(g[0] != 0.0 && g[1] != 0.0);
    assert_eq!(&g[2..], &[0.0; 4]);
}

#[test]
fn bad_inputs_are_errors() {
    let cpu = Device::cpu();
    let x = Tensor::zeros(&[2, 3], DType::F32, cpu).unwrap();
    let t = Tensor::from_i32(vec![0, 2], &[2], cpu).unwrap();
    assert!(x.cross_entropy_per_row(&t).is_ok());
    let t3 = Tensor::from_i32(vec![0, 1, 2], &[3], cpu).unwrap();
    assert!(matches!(x.cross_entropy_per_row(&t3), Err(Error::Shape(_))));
    let flat = Tensor::zeros(&[6], DType::F32, cpu).unwrap();
    assert!(matches!(
        flat.cross_entropy_per_row(&t),
        Err(Error::Shape(_))
    ));
    let tf = Tensor::zeros(&[2], DType::F32, cpu).unwrap();
    assert!(matches!(x.cross_entropy_per_row(&tf), Err(Error::DType(_))));
    let xi = Tensor::from_i32(vec![0; 6], &[2, 3], cpu).unwrap();
    assert!(matches!(xi.cross_entropy_per_row(&t), Err(Error::DType(_))));
    for bad in [vec![0, 3], vec![-1, 0]] {
        let tb = Tensor::from_i32(bad.clone(), &[2], cpu).unwrap();
        match x.cross_entropy(&tb) {
            Err(Error::Invalid(m)) => assert!(m.contains("target"), "{m}"),
            other => panic!("targets {bad:?}: {other:?}"),
        }
    }
    let none = Tensor::zeros(&[0, 3], DType::F32, cpu).unwrap();
    let t0 = Tensor::from_i32(vec![], &[0], cpu).unwrap();
    assert!(none.cross_entropy(&t0).is_err());
    let no_classes = Tensor::zeros(&[2, 0], DType::F32, cpu).unwrap();
    assert!(matches!(no_classes.cross_entropy(&t), Err(Error::Shape(_))));
    if let Some(gpu) = common::gpu_or_skip("cross_entropy devices") {
        let xg = x.to_device(gpu).unwrap();
        assert!(matches!(xg.cross_entropy(&t), Err(Error::Device(_))));
    }
}
