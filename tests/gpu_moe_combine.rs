//! The MoE combine's GPU kernels (`Tensor::weighted_index_scatter`, `src/backend/gpu/moe_combine.rs`):
//! `y[t] = Σ_{r : idx[r] = t} w[r]·rows[r]` in one pass forward (the per-output loop over few
//! rows, or the sorted index over many) and one backward (a workgroup per row).
//!
//! - f32 against the definition in f64 on the CPU, output and both gradients, with rows wider
//!   than a workgroup (the backward's column loop), repeated indices, outputs nothing hits, and
//!   grids folded past 65,535 workgroups (the backward's rows; the forward's outputs, through
//!   both of its kernels);
//! - f16 against the same op composed in f16 (`rows·w`, then `index_scatter`), which the kernels
//!   round as: the output and the rows' gradient to the bit, the weights' gradient (a sum in
//!   another order) within the sums' rounding.
//!
//! Skipped with a printed reason without an adapter unless `MOEGRAD_REQUIRE_GPU=1` (and the f16
//! case without `shader-f16`).

mod common;

use moegrad::{DType, Device, Tensor};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A combine problem: `a` rows of width `d` onto `len` outputs; indices in `0..hit`.
struct Case {
    a: usize,
    d: usize,
    len: usize,
    hit: usize,
}

struct Values {
    rows: Vec<f64>,
    w: Vec<f64>,
    idx: Vec<i32>,
    up: Vec<f64>,
}

fn draw(c: &Case, rng: &mut ChaCha8Rng) -> Values {
    // values f16 holds exactly, so the f16 case starts from the f32 case's operands
    let mut v = |n: usize| -> Vec<f64> {
        (0..n)
            .map(|_| half::f16::from_f32(rng.random_range(-2.0f32..2.0)).to_f64())
            .collect()
    };
    let (rows, w, up) = (v(c.a * c.d), v(c.a), v(c.len * c.d));
    let idx = (0..c.a)
        .map(|_| rng.random_range(0..c.hit as i32))
        .collect();
    Values { rows, w, idx, up }
}

/// `x` as a tensor in `dtype` on `dev` (f16 only exists on the GPU: cast there).
fn place(x: &[f64], shape: &[usize], dev: Device, dtype: DType) -> Tensor {
    common::tensor_on(x.to_vec(), shape, DType::F32, dev)
        .to_dtype(dtype)
        .unwrap()
}

/// Output and gradients (rows, weights) of `sum(y ⊙ up)` with `y` the combine, on `dev` in
/// `dtype`, composed (`rows·w` then `index_scatter`) or fused.
fn run(c: &Case, v: &Values, dev: Device, dtype: DType, composed: bool) -> [Vec<f64>; 3] {
    let on = |x: &[f64], shape: &[usize]| place(x, shape, dev, dtype).with_grad().unwrap();
    let (rows, w) = (on(&v.rows, &[c.a, c.d]), on(&v.w, &[c.a]));
    let idx = Tensor::from_i32(v.idx.clone(), &[c.a], dev).unwrap();
    let y = if composed {
        rows.mul(&w.reshape(&[c.a, 1]).unwrap())
            .unwrap()
            .index_scatter(0, &idx, c.len)
            .unwrap()
    } else {
        rows.weighted_index_scatter(&w, &idx, c.len).unwrap()
    };
    assert_eq!(y.dtype(), dtype);
    let up = place(&v.up, &[c.len, c.d], dev, dtype);
    y.backward_with(&up).unwrap();
    let grad = |t: &Tensor| t.grad().unwrap().to_vec_f64().unwrap();
    [y.to_vec_f64().unwrap(), grad(&rows), grad(&w)]
}

/// The definition in f64: the output, and the gradients `w[r]·up[idx[r]]` and
/// `⟨up[idx[r]], rows[r]⟩`, with the absolute sums each is a sum of (for tolerances).
fn reference(c: &Case, v: &Values) -> [Vec<f64>; 3] {
    let mut y = vec![0.0; c.len * c.d];
    let mut d_rows = vec![0.0; c.a * c.d];
    let mut d_w = vec![0.0; c.a];
    for r in 0..c.a {
        let t = v.idx[r] as usize;
        for i in 0..c.d {
            y[t * c.d + i] += v.w[r] * v.rows[r * c.d + i];
            d_rows[r * c.d + i] = v.w[r] * v.up[t * c.d + i];
            d_w[r] += v.up[t * c.d + i] * v.rows[r * c.d + i];
        }
    }
    [y, d_rows, d_w]
}

const NAMES: [&str; 3] = ["y", "d_rows", "d_w"];

#[test]
fn f32_combine_on_the_gpu_matches_its_definition() {
    let Some(gpu) = common::gpu_or_skip("f32_combine_on_the_gpu_matches_its_definition") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(71);
    for c in [
        // the loop kernel: few rows, some outputs unhit
        Case {
            a: 20,
            d: 7,
            len: 9,
            hit: 6,
        },
        // rows wider than a workgroup (the backward walks the columns 256 at a time)
        Case {
            a: 30,
            d: 300,
            len: 5,
            hit: 5,
        },
        // the sorted kernel: more rows than the loop takes
        Case {
            a: 5000,
            d: 3,
            len: 40,
            hit: 37,
        },
        // more rows than 65,535 workgroups: the backward's grid folds
        Case {
            a: 66_000,
            d: 1,
            len: 10,
            hit: 10,
        },
        // more outputs than 65,535 workgroups of 256: the forward's grid folds, through the
        // loop kernel (at most 32 rows) and the sorted one (more, with outputs × rows past 2²⁴)
        Case {
            a: 20,
            d: 256,
            len: 66_000,
            hit: 66_000,
        },
        Case {
            a: 40,
            d: 256,
            len: 66_000,
            hit: 66_000,
        },
    ] {
        let v = draw(&c, &mut rng);
        let got = run(&c, &v, gpu, DType::F32, false);
        let want = reference(&c, &v);
        // each output sums up to `a` products of magnitude ≤ 4 in f32
        let tol = 1e-6 * (c.a.max(c.d) as f64) * 4.0;
        for ((name, g), w) in NAMES.iter().zip(&got).zip(&want) {
            common::assert_close(
                &format!("{name} of [{}, {}] onto {}", c.a, c.d, c.len),
                g,
                w,
                tol,
                1e-5,
            );
        }
    }
}

#[test]
fn f16_combine_rounds_as_its_composition() {
    let Some(gpu) = common::gpu_or_skip("f16_combine_rounds_as_its_composition") else {
        return;
    };
    let features = moegrad::gpu::info().expect("adapter info").features;
    if !features.iter().any(|f| f == "shader-f16") {
        eprintln!("skipping f16_combine_rounds_as_its_composition: no shader-f16");
        return;
    }
    let mut rng = ChaCha8Rng::seed_from_u64(72);
    for c in [
        Case {
            a: 20,
            d: 7,
            len: 9,
            hit: 6,
        },
        Case {
            a: 30,
            d: 300,
            len: 5,
            hit: 5,
        },
        Case {
            a: 5000,
            d: 3,
            len: 40,
            hit: 37,
        },
    ] {
        let v = draw(&c, &mut rng);
        let fused = run(&c, &v, gpu, DType::F16, false);
        let composed = run(&c, &v, gpu, DType::F16, true);
        let what = |name: &str| format!("f16 {name} of [{}, {}] onto {}", c.a, c.d, c.len);
        assert_eq!(fused[0], composed[0], "{}", what("y"));
        assert_eq!(fused[1], composed[1], "{}", what("d_rows"));
        // d_w: the same f16-rounded products summed in f32 in another order, rounded once
        let abs_sums = reference(
            &c,
            &Values {
                rows: v.rows.iter().map(|x| x.abs()).collect(),
                w: v.w.clone(),
                idx: v.idx.clone(),
                up: v.up.iter().map(|x| x.abs()).collect(),
            },
        );
        for (r, ((f, e), s)) in fused[2]
            .iter()
            .zip(&composed[2])
            .zip(&abs_sums[2])
            .enumerate()
        {
            let bound = 2f64.powi(-10) * (e.abs() + 1e-4) + 1e-6 * s;
            assert!((f - e).abs() <= bound, "{}[{r}]: {f} vs {e}", what("d_w"));
        }
    }
}
