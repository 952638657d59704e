//! `RoutingOps::routing_stats`, the one launch per MoE layer and step that adds a step's routing
//! statistics into a window's sums (`moe::RoutingWindow`): against an f64 reference written
//! from the definitions in `shaders/router_sums.wgsl`'s header, on the CPU and, one test body,
//! on the GPU; the GPU against the CPU (the same order of additions: the same bits but for `ln`
//! in the entropy, and FMA contraction in the squares); shapes whose columns are 1, a divisor of
//! 256, not one, and past 256 (the kernel's column chunks); a window of several steps; NaN in
//! the logits; and bad operands as errors. Also the balance loss' operand checks
//! (`RoutingOps::balance_loss`, whose values `tests/balance_loss.rs` checks through the tensor
//! op).

use super::gpu_matmul::gpu;
use crate::backend::cpu::CpuBackend;
use crate::backend::{HostData, RoutingOps, RoutingStatsDims};
use crate::{Error, Result};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// One step's operands, on the host.
struct Step {
    probs: Vec<f32>,
    logits: Vec<f32>,
    routed: Vec<f32>,
    kept: Vec<f32>,
    dims: RoutingStatsDims,
}

/// A step of `rows` tokens over `cols` columns: rows of a distribution (some exact zeros, as
/// a top-k router's), logits in [-6, 6), counts of small integers.
fn step(rng: &mut ChaCha8Rng, rows: usize, cols: usize, logits: usize) -> Step {
    let mut probs = Vec::with_capacity(rows * cols);
    for _ in 0..rows {
        let raw: Vec<f32> = (0..cols)
            .map(|_| {
                if rng.random_bool(0.2) {
                    0.0
                } else {
                    rng.random_range(0.0f32..1.0)
                }
            })
            .collect();
        let total: f32 = raw.iter().sum::<f32>().max(1e-6);
        probs.extend(raw.iter().map(|v| v / total));
    }
    let experts = cols.saturating_sub(1).max(1);
    let count = |rng: &mut ChaCha8Rng| {
        (0..experts)
            .map(|_| rng.random_range(0..9) as f32)
            .collect()
    };
    Step {
        probs,
        logits: (0..logits)
            .map(|_| rng.random_range(-6.0f32..6.0))
            .collect(),
        routed: count(rng),
        kept: count(rng),
        dims: RoutingStatsDims {
            rows,
            cols,
            logits,
            experts,
        },
    }
}

/// The sums after `steps`, in f64, from the definitions.
fn reference(steps: &[Step]) -> Vec<f64> {
    let d = steps[0].dims;
    let (cols, n) = (d.cols, d.experts);
    let mut out = vec![0.0f64; d.out_len()];
    for s in steps {
        for (i, &p) in s.probs.iter().enumerate() {
            let p = p as f64;
            out[i % cols] += p;
            out[cols + 2 * n] -= p * (p + 1e-12).ln();
        }
        for e in 0..n {
            out[cols + e] += s.routed[e] as f64;
            out[cols + n + e] += s.kept[e] as f64;
        }
        for &l in &s.logits {
            out[cols + 2 * n + 1] += (l as f64) * (l as f64);
            out[cols + 2 * n + 2] = out[cols + 2 * n + 2].max((l as f64).abs());
        }
    }
    out
}

/// The sums after `steps` on backend `be`, the first step without a window to add to.
fn run<B: RoutingOps>(be: &B, steps: &[Step]) -> Result<Vec<f32>> {
    let up = |v: &[f32]| be.upload(&HostData::F32(v.to_vec()));
    let mut acc: Option<B::Buffer> = None;
    for s in steps {
        let (probs, logits) = (up(&s.probs)?, up(&s.logits)?);
        let (routed, kept) = (up(&s.routed)?, up(&s.kept)?);
        acc = Some(be.routing_stats(acc.as_ref(), (&probs, &logits), (&routed, &kept), s.dims)?);
    }
    match be.download(&acc.expect("at least one step"))? {
        HostData::F32(v) => Ok(v),
        other => panic!("the sums must be f32, got {other:?}"),
    }
}

/// Every size the kernel treats apart: one column (256 row groups), 8 and 64 (divisors of
/// 256), 3 and 100 (not), 256 (one row group), 300 and 513 (two and three column chunks); one
/// token; more logits than probabilities and fewer.
const SHAPES: [(usize, usize, usize); 9] = [
    (37, 1, 40),
    (1000, 8, 8000),
    (5, 3, 1),
    (257, 64, 300),
    (129, 100, 12_900),
    (3, 256, 768),
    (1, 300, 300),
    (17, 513, 40),
    (4096, 2, 8192),
];

/// Each sum within `tol` (relative to the reference's size, with a floor of 1) of the
/// reference.
fn assert_close(what: &str, got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g as f64 - w).abs() <= tol * w.abs().max(1.0),
            "{what}: sum {i} is {g}, expected {w}"
        );
    }
}

/// Both backends against the f64 definitions, over a window of three steps.
#[test]
fn sums_match_the_definitions_on_each_device() {
    let gpu = gpu("sums_match_the_definitions_on_each_device");
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    for (rows, cols, logits) in SHAPES {
        let steps: Vec<Step> = (0..3).map(|_| step(&mut rng, rows, cols, logits)).collect();
        let want = reference(&steps);
        // f32 sums of up to 24,576 terms of at most 1 (36 for the squares): a few ulps each
        let what = format!("CPU, {rows}×{cols}, {logits} logits");
        assert_close(&what, &run(&CpuBackend, &steps).unwrap(), &want, 2e-5);
        if let Some((be, _lock)) = &gpu {
            let what = format!("GPU, {rows}×{cols}, {logits} logits");
            assert_close(&what, &run(be, &steps).unwrap(), &want, 2e-5);
        }
    }
}

/// The GPU adds in the CPU's order: the column sums, the counts and the maximum are the CPU's
/// bits; the entropy (`ln`) and the squares (a driver may fuse `s + v·v`) agree to rounding.
#[test]
fn gpu_adds_in_the_cpu_order() {
    let Some((be, _lock)) = gpu("gpu_adds_in_the_cpu_order") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(8);
    for (rows, cols, logits) in SHAPES {
        let steps: Vec<Step> = (0..2).map(|_| step(&mut rng, rows, cols, logits)).collect();
        let (g, c) = (run(&be, &steps).unwrap(), run(&CpuBackend, &steps).unwrap());
        let d = steps[0].dims;
        let at = d.cols + 2 * d.experts;
        let what = format!("{rows}×{cols}, {logits} logits");
        assert_eq!(g[..at], c[..at], "{what}: column sums and counts");
        assert_eq!(g[at + 2], c[at + 2], "{what}: the largest |logit|");
        for j in [at, at + 1] {
            let scale = c[j].abs().max(1.0);
            assert!(
                (g[j] - c[j]).abs() <= 1e-5 * scale,
                "{what}: sum {j}: {} against {}",
                g[j],
                c[j]
            );
        }
    }
}

/// A NaN logit makes the largest magnitude NaN, in the step it appears and in every later one
/// (a window that saw a diverging router says so), on both devices.
#[test]
fn a_nan_logit_shows_in_the_window() {
    let gpu = gpu("a_nan_logit_shows_in_the_window");
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let mut steps: Vec<Step> = (0..3).map(|_| step(&mut rng, 20, 4, 80)).collect();
    steps[1].logits[41] = f32::NAN;
    let at = steps[0].dims.cols + 2 * steps[0].dims.experts;
    let mut results = vec![("CPU", run(&CpuBackend, &steps).unwrap())];
    if let Some((be, _lock)) = &gpu {
        results.push(("GPU", run(be, &steps).unwrap()));
    }
    for (dev, got) in results {
        assert!(
            got[at + 2].is_nan(),
            "{dev}: largest |logit| {}",
            got[at + 2]
        );
        assert!(got[at + 1].is_nan(), "{dev}: square sum {}", got[at + 1]);
        assert!(
            !got[at].is_nan(),
            "{dev}: the entropy does not read the logits"
        );
    }
}

/// Operands that do not fit the sizes, or are not f32, are errors naming them on both devices.
#[test]
fn bad_operands_are_errors() {
    let gpu = gpu("bad_operands_are_errors");
    let mut rng = ChaCha8Rng::seed_from_u64(10);
    let s = step(&mut rng, 6, 4, 24);
    fn check<B: RoutingOps>(be: &B, s: &Step) {
        let up = |v: &[f32]| be.upload(&HostData::F32(v.to_vec())).unwrap();
        let (probs, logits, routed, kept) =
            (up(&s.probs), up(&s.logits), up(&s.routed), up(&s.kept));
        let call = |acc: Option<&B::Buffer>, probs: &B::Buffer, dims| {
            be.routing_stats(acc, (probs, &logits), (&routed, &kept), dims)
        };
        let wrong_rows = RoutingStatsDims { rows: 7, ..s.dims };
        let err = call(None, &probs, wrong_rows)
            .err()
            .expect("7 rows of 4 from 24 values");
        assert!(
            matches!(err, Error::Shape(ref m) if m.contains("probs holds 24")),
            "{err}"
        );
        let short_acc = up(&[0.0; 5]);
        let err = call(Some(&short_acc), &probs, s.dims)
            .err()
            .expect("5 sums for 17");
        assert!(
            matches!(err, Error::Shape(ref m) if m.contains("window's sums")),
            "{err}"
        );
        let none = RoutingStatsDims {
            experts: 0,
            ..s.dims
        };
        assert!(matches!(call(None, &probs, none), Err(Error::Shape(_))));
        let ints = be.upload(&HostData::I32(vec![0; 24])).unwrap();
        let err = call(None, &ints, s.dims).err().expect("i32 probabilities");
        assert!(
            matches!(err, Error::DType(ref m) if m.contains("probs must be f32")),
            "{err}"
        );
    }
    check(&CpuBackend, &s);
    if let Some((be, _lock)) = &gpu {
        check(be, &s);
    }
}

/// The balance loss' operands: a distribution of the wrong length, counts of another dtype or
/// length, and no tokens are errors naming them, on both devices, before any launch.
#[test]
fn balance_loss_refuses_bad_operands() {
    let gpu = gpu("balance_loss_refuses_bad_operands");
    fn check<B: RoutingOps>(be: &B) {
        let up = |v: &[f32]| be.upload(&HostData::F32(v.to_vec())).unwrap();
        let (probs, counts) = (up(&[0.25; 12]), up(&[1.0, 2.0, 3.0, 0.0]));
        let (loss, coef) = be.balance_loss(&probs, &counts, (3, 4), 0.5).unwrap();
        let host = |b| match be.download(b).unwrap() {
            HostData::F32(v) => v,
            other => panic!("f32 expected, got {other:?}"),
        };
        // f = [1, 2, 3, 0] / 6, column sums 0.75: loss = 0.5 · 0.75 · Σ f = 0.375
        assert!((host(&loss)[0] - 0.375).abs() < 1e-6);
        assert_eq!(host(&coef).len(), 4);
        let shape = |r: Result<(B::Buffer, B::Buffer)>, says: &str| match r {
            Err(Error::Shape(m)) => assert!(m.contains(says), "{m}"),
            Err(e) => panic!("a shape error expected, got {e}"),
            Ok(_) => panic!("accepted: {says}"),
        };
        shape(
            be.balance_loss(&probs, &counts, (4, 4), 0.5),
            "the router's distribution holds 12",
        );
        shape(
            be.balance_loss(&probs, &up(&[1.0; 3]), (3, 4), 0.5),
            "the counts per expert holds 3",
        );
        shape(
            be.balance_loss(&probs, &counts, (0, 4), 0.5),
            "at least one token",
        );
        let ints = be.upload(&HostData::I32(vec![1; 4])).unwrap();
        match be.balance_loss(&probs, &ints, (3, 4), 0.5) {
            Err(Error::DType(m)) => assert!(m.contains("one dtype"), "{m}"),
            Err(e) => panic!("a dtype error expected, got {e}"),
            Ok(_) => panic!("i32 counts accepted"),
        }
    }
    check(&CpuBackend);
    if let Some((be, _lock)) = &gpu {
        check(be);
    }
}
