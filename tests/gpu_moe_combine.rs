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
//!   another order) within the sums' rounding;
//! - mixed precision's f16 rows with f32 weights, read unrounded, against the definition as the
//!   kernels round it: the output and the rows' gradient to the bit, the weights' gradient in f32
//!   within an f32 sum's rounding.
//!
//! - given each output's rows (`weighted_index_scatter_by_slots`, the GPU's `weighted_gather_slots`
//!   kernel, no sort): the plain combine's output and gradients to the bit, on the GPU in f32
//!   and f16 and on the CPU, k = 1 to 5 rows per output in any order, the grid folded; slots
//!   that break the promise rejected on the CPU, and of the wrong length on both; likewise
//!   `index_select_by_slots` against `index_select`, whose backward the same kernel computes
//!   unweighted;
//! - with the weights per slot (`weighted_index_scatter_per_slot`, the MoE layer's combine):
//!   the plain combine's bits again, the weights' gradient per slot; a slot order that is not
//!   the slots' inverse refused on the CPU;
//! - with a residual added (`weighted_index_scatter_per_slot_add`, an MoE block's output): the
//!   output and every gradient to the bit of the combine then `add`, in f32, f16 and mixed
//!   precision, on both devices, the grid folded; one kernel forward on the GPU where the two
//!   ops take two; an f32 residual beside f16 rows, or one that broadcasts, handed to `add`.
//!
//! Skipped with a printed reason without an adapter unless `MOEGRAD_REQUIRE_GPU=1` (and the f16
//! case without `shader-f16`).

mod common;
#[path = "common/f16_checks.rs"]
mod f16_checks;

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
    run_with(
        c,
        v,
        (dev, dtype),
        if composed {
            Combine::Composed
        } else {
            Combine::Fused
        },
    )
}

/// How [`run_with`] combines.
enum Combine<'a> {
    /// `rows·w`, then `index_scatter`
    Composed,
    /// `weighted_index_scatter`
    Fused,
    /// `weighted_index_scatter_by_slots` with these slots
    BySlots(&'a [i32]),
    /// `weighted_index_scatter_per_slot` with these slots: the weights handed over per slot
    /// (`w[slots[s]]` at `s`) and their gradient put back in row order for comparison
    PerSlot(&'a [i32]),
}

/// [`run`], with the combine chosen.
fn run_with(c: &Case, v: &Values, (dev, dtype): (Device, DType), how: Combine) -> [Vec<f64>; 3] {
    let on = |x: &[f64], shape: &[usize]| place(x, shape, dev, dtype).with_grad().unwrap();
    let w_given: Vec<f64> = match how {
        Combine::PerSlot(slots) => slots.iter().map(|&r| v.w[r as usize]).collect(),
        _ => v.w.clone(),
    };
    let (rows, w) = (on(&v.rows, &[c.a, c.d]), on(&w_given, &[c.a]));
    let idx = Tensor::from_i32(v.idx.clone(), &[c.a], dev).unwrap();
    let y = match how {
        Combine::Composed => rows
            .mul(&w.reshape(&[c.a, 1]).unwrap())
            .unwrap()
            .index_scatter(0, &idx, c.len)
            .unwrap(),
        Combine::Fused => rows.weighted_index_scatter(&w, &idx, c.len).unwrap(),
        Combine::BySlots(slots) => {
            let slots = Tensor::from_i32(slots.to_vec(), &[slots.len()], dev).unwrap();
            rows.weighted_index_scatter_by_slots(&w, &idx, c.len, &slots)
                .unwrap()
        }
        Combine::PerSlot(slots) => {
            let mut order = vec![0; slots.len()];
            for (s, &r) in slots.iter().enumerate() {
                order[r as usize] = s as i32;
            }
            let order = Tensor::from_i32(order, &[slots.len()], dev).unwrap();
            let slots = Tensor::from_i32(slots.to_vec(), &[slots.len()], dev).unwrap();
            rows.weighted_index_scatter_per_slot(&w, &idx, c.len, &slots, &order)
                .unwrap()
        }
    };
    assert_eq!(y.dtype(), dtype);
    let up = place(&v.up, &[c.len, c.d], dev, dtype);
    y.backward_with(&up).unwrap();
    let grad = |t: &Tensor| t.grad().unwrap().to_vec_f64().unwrap();
    let mut d_w = grad(&w);
    if let Combine::PerSlot(slots) = how {
        let per_slot = d_w.clone();
        for (s, &r) in slots.iter().enumerate() {
            d_w[r as usize] = per_slot[s];
        }
    }
    [y.to_vec_f64().unwrap(), grad(&rows), d_w]
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
    let Some(gpu) = f16_checks::f16_gpu("f16_combine_rounds_as_its_composition") else {
        return;
    };
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

/// `x` rounded to the nearest f16, as an f32.
fn f16_round(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

/// Mixed precision's combine (f16 rows, f32 weights) by its definition as the kernels round it:
/// each product `w[r]·rows[r, i]` taken in f32 and rounded to f16, the products summed in f32 in
/// increasing `r` and the sum rounded to f16; the rows' gradient `f16(w[r]·up[idx[r], i])`; the
/// weights' gradient in f64, `Σ_i f16(up[idx[r], i]·rows[r, i])`, with each one's absolute sum.
fn mixed_reference(c: &Case, v: &Values, w: &[f32]) -> ([Vec<f64>; 2], [Vec<f64>; 2]) {
    let f = |x: f64| x as f32;
    let mut y = vec![0f32; c.len * c.d];
    let mut d_rows = vec![0.0; c.a * c.d];
    let (mut d_w, mut d_w_abs) = (vec![0.0; c.a], vec![0.0; c.a]);
    for r in 0..c.a {
        let t = v.idx[r] as usize;
        for i in 0..c.d {
            let (row, up) = (f(v.rows[r * c.d + i]), f(v.up[t * c.d + i]));
            y[t * c.d + i] += f16_round(w[r] * row);
            d_rows[r * c.d + i] = f16_round(w[r] * up) as f64;
            let term = f16_round(up * row) as f64;
            d_w[r] += term;
            d_w_abs[r] += term.abs();
        }
    }
    let y = y.into_iter().map(|x| f16_round(x) as f64).collect();
    ([y, d_rows], [d_w, d_w_abs])
}

/// The output and gradients of mixed precision's combine on `gpu`: `v`'s rows and upstream
/// gradient in f16, the weights `w` in f32, through `weighted_index_scatter` or, with slots,
/// `weighted_index_scatter_per_slot` (the weights' gradient put back in row order). Checks the
/// dtypes: the output and the rows' gradient f16, the weights' gradient f32.
fn run_mixed(c: &Case, v: &Values, w: &[f32], gpu: Device, slots: Option<&[i32]>) -> [Vec<f64>; 3] {
    let rows = place(&v.rows, &[c.a, c.d], gpu, DType::F16)
        .with_grad()
        .unwrap();
    let given: Vec<f64> = match slots {
        Some(s) => s.iter().map(|&r| w[r as usize] as f64).collect(),
        None => w.iter().map(|&x| x as f64).collect(),
    };
    let wt = common::tensor_on(given, &[c.a], DType::F32, gpu)
        .with_grad()
        .unwrap();
    let idx = Tensor::from_i32(v.idx.clone(), &[c.a], gpu).unwrap();
    let y = match slots {
        None => rows.weighted_index_scatter(&wt, &idx, c.len).unwrap(),
        Some(s) => {
            let mut order = vec![0; s.len()];
            for (slot, &r) in s.iter().enumerate() {
                order[r as usize] = slot as i32;
            }
            let order = Tensor::from_i32(order, &[s.len()], gpu).unwrap();
            let s = Tensor::from_i32(s.to_vec(), &[s.len()], gpu).unwrap();
            rows.weighted_index_scatter_per_slot(&wt, &idx, c.len, &s, &order)
                .unwrap()
        }
    };
    y.backward_with(&place(&v.up, &[c.len, c.d], gpu, DType::F16))
        .unwrap();
    let (d_rows, d_w) = (rows.grad().unwrap(), wt.grad().unwrap());
    assert_eq!(
        (y.dtype(), d_rows.dtype(), d_w.dtype()),
        (DType::F16, DType::F16, DType::F32)
    );
    let mut d_w = d_w.to_vec_f64().unwrap();
    if let Some(s) = slots {
        let per_slot = d_w.clone();
        for (slot, &r) in s.iter().enumerate() {
            d_w[r as usize] = per_slot[slot];
        }
    }
    [y.to_vec_f64().unwrap(), d_rows.to_vec_f64().unwrap(), d_w]
}

/// Mixed precision's combine, f16 rows with the router's f32 weights read as they are (not
/// values f16 holds), through the loop, sorted and per-slot kernels: the output and the rows'
/// gradient to the bit of [`mixed_reference`], and the weights' gradient in f32 within an f32
/// sum's rounding (the f16 rounding of a weight, of a product with one, or of the gradient
/// would be off by up to 2⁻¹¹ of it).
#[test]
fn f16_rows_combine_f32_weights_unrounded() {
    let Some(gpu) = f16_checks::f16_gpu("f16_rows_combine_f32_weights_unrounded") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(77);
    let mut cases: Vec<(Case, Values, Option<Vec<i32>>)> =
        [(20, 7, 9, 6), (30, 300, 5, 5), (5000, 3, 40, 37)]
            .into_iter()
            .map(|(a, d, len, hit)| {
                let c = Case { a, d, len, hit };
                let v = draw(&c, &mut rng);
                (c, v, None)
            })
            .collect();
    for (len, k, d) in [(40, 3, 5), (4096, 2, 4)] {
        let (c, v, slots) = slotted(len, k, d, &mut rng);
        cases.push((c, v, Some(slots)));
    }
    for (c, v, slots) in &cases {
        let w: Vec<f32> = (0..c.a).map(|_| rng.random_range(0.01f32..1.0)).collect();
        let got = run_mixed(c, v, &w, gpu, slots.as_deref());
        let ([y, d_rows], [d_w, d_w_abs]) = mixed_reference(c, v, &w);
        let what = |name: &str| {
            let how = if slots.is_some() {
                "per slot"
            } else {
                "by row"
            };
            format!("{name} of [{}, {}] onto {} ({how})", c.a, c.d, c.len)
        };
        for (name, g, e) in [("y", &got[0], &y), ("d_rows", &got[1], &d_rows)] {
            let differ = g
                .iter()
                .zip(e)
                .position(|(g, e)| g.to_bits() != e.to_bits());
            assert!(differ.is_none(), "{} differs at {differ:?}", what(name));
        }
        for (r, (g, (e, s))) in got[2].iter().zip(d_w.iter().zip(&d_w_abs)).enumerate() {
            let bound = 1e-6 * s + 1e-9;
            assert!((g - e).abs() <= bound, "{}[{r}]: {g} vs {e}", what("d_w"));
        }
    }
}

/// A combine with `k` rows per output in a random order: `idx[slots[t·k + j]] = t`.
fn slotted(len: usize, k: usize, d: usize, rng: &mut ChaCha8Rng) -> (Case, Values, Vec<i32>) {
    let c = Case {
        a: len * k,
        d,
        len,
        hit: len,
    };
    let mut v = draw(&c, rng);
    let mut slots: Vec<i32> = (0..c.a as i32).collect();
    for i in (1..slots.len()).rev() {
        slots.swap(i, rng.random_range(0..=i));
    }
    for (i, &r) in slots.iter().enumerate() {
        v.idx[r as usize] = (i / k) as i32;
    }
    (c, v, slots)
}

/// Leaves a buffer of `n` NaNs in the GPU's pool, the next taken of its size.
fn poison(dev: Device, n: usize) {
    if dev.is_gpu() {
        drop(Tensor::full(&[n], f64::NAN, DType::F32, dev).unwrap());
        moegrad::gpu::flush().unwrap();
        dev.synchronize().unwrap();
    }
}

/// Runs `compare` on each case of `k` rows per output in a shuffled order (the plain combine's
/// loop kernel, its sorted kernel at 8192 rows, rows wider than a workgroup, and 66,000 · 256
/// outputs, past 65,535 workgroups of 256: the grid folds), on the GPU in f32 and f16 and on the
/// CPU, with NaN first in the buffer the output will get, so that an element left unwritten
/// shows (the by-slots run comes first: the plain run's output, with the same values, is not
/// yet in the pool). `compare` returns `(name, plain, by slots)`, which must agree to the bit.
fn check_slotted_cases(
    gpu: Device,
    seed: u64,
    compare: impl Fn(&Case, &Values, &[i32], (Device, DType)) -> Vec<(&'static str, Vec<f64>, Vec<f64>)>,
) {
    let f16 = moegrad::gpu::info()
        .expect("adapter info")
        .features
        .iter()
        .any(|f| f == "shader-f16");
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    for (len, k, d) in [
        (9, 1, 7),
        (40, 3, 5),
        (64, 5, 300),
        (4096, 2, 4),
        (66_000, 1, 256),
    ] {
        let (c, v, slots) = slotted(len, k, d, &mut rng);
        let mut devices = vec![(gpu, DType::F32), (Device::cpu(), DType::F32)];
        if f16 && c.a * c.d < 1 << 20 {
            devices.push((gpu, DType::F16));
        }
        for (dev, dtype) in devices {
            poison(dev, c.len * c.d);
            for (name, p, s) in compare(&c, &v, &slots, (dev, dtype)) {
                let differ = p
                    .iter()
                    .zip(&s)
                    .position(|(p, s)| p.to_bits() != s.to_bits());
                assert!(
                    differ.is_none() && p.len() == s.len(),
                    "{dtype} {name} on {dev} of {len} × {k} rows of {d}: by slots and plain \
                     differ at {differ:?}"
                );
            }
        }
    }
}

#[test]
fn combine_by_slots_gives_the_plain_combines_bits() {
    let Some(gpu) = common::gpu_or_skip("combine_by_slots_gives_the_plain_combines_bits") else {
        return;
    };
    check_slotted_cases(gpu, 73, |c, v, slots, on| {
        against_plain(c, v, on, Combine::BySlots(slots))
    });
}

/// `(name, plain, how)` for the output and both gradients of the combine `how` and of the plain
/// one (`how` runs first: see [`check_slotted_cases`]).
fn against_plain(
    c: &Case,
    v: &Values,
    on: (Device, DType),
    how: Combine,
) -> Vec<(&'static str, Vec<f64>, Vec<f64>)> {
    let other = run_with(c, v, on, how);
    let plain = run_with(c, v, on, Combine::Fused);
    NAMES
        .iter()
        .zip(plain)
        .zip(other)
        .map(|((&name, p), s)| (name, p, s))
        .collect()
}

/// Weights handed over per slot, read through the slots (the layer's combine: no gather of the
/// weights into row order, whose backward was another gather): the plain combine's bits again,
/// the weights' gradient per slot.
#[test]
fn combine_with_weights_per_slot_gives_the_plain_combines_bits() {
    let Some(gpu) =
        common::gpu_or_skip("combine_with_weights_per_slot_gives_the_plain_combines_bits")
    else {
        return;
    };
    check_slotted_cases(gpu, 75, |c, v, slots, on| {
        against_plain(c, v, on, Combine::PerSlot(slots))
    });
}

/// A slot order that is not the slots' inverse is refused on the CPU, and one of the wrong
/// length or dtype on both devices.
#[test]
fn a_slot_order_that_breaks_the_promise_is_refused() {
    let Some(gpu) = common::gpu_or_skip("a_slot_order_that_breaks_the_promise_is_refused") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(76);
    let (c, v, slots) = slotted(4, 2, 3, &mut rng);
    let mut order = vec![0; slots.len()];
    for (s, &r) in slots.iter().enumerate() {
        order[r as usize] = s as i32;
    }
    let combine = |dev: Device, order: &[i32]| {
        let rows = place(&v.rows, &[c.a, c.d], dev, DType::F32);
        let w = place(&v.w, &[c.a], dev, DType::F32);
        let idx = Tensor::from_i32(v.idx.clone(), &[c.a], dev).unwrap();
        let slots = Tensor::from_i32(slots.clone(), &[slots.len()], dev).unwrap();
        let order = Tensor::from_i32(order.to_vec(), &[order.len()], dev).unwrap();
        rows.weighted_index_scatter_per_slot(&w, &idx, c.len, &slots, &order)
    };
    for dev in [gpu, Device::cpu()] {
        assert!(combine(dev, &order).is_ok(), "{dev}: the promise kept");
        let e = combine(dev, &order[..7]).unwrap_err().to_string();
        assert!(e.contains("slot order must be i32 [8]"), "{dev}: {e}");
    }
    let mut swapped = order.clone();
    swapped.swap(0, 1);
    let e = combine(Device::cpu(), &swapped).unwrap_err().to_string();
    assert!(e.contains("the slot order gives row 0"), "{e}");
}

#[test]
fn slots_that_break_the_promise_are_refused() {
    let Some(gpu) = common::gpu_or_skip("slots_that_break_the_promise_are_refused") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(74);
    let (c, v, slots) = slotted(4, 2, 3, &mut rng);
    let combine = |dev: Device, slots: &[i32]| {
        let rows = place(&v.rows, &[c.a, c.d], dev, DType::F32);
        let w = place(&v.w, &[c.a], dev, DType::F32);
        let idx = Tensor::from_i32(v.idx.clone(), &[c.a], dev).unwrap();
        let slots = Tensor::from_i32(slots.to_vec(), &[slots.len()], dev).unwrap();
        rows.weighted_index_scatter_by_slots(&w, &idx, c.len, &slots)
    };
    for dev in [gpu, Device::cpu()] {
        assert!(combine(dev, &slots).is_ok(), "{dev}: the promise kept");
        // one slot short, or one too many: the slots do not cover the rows once each
        let e = combine(dev, &slots[..7]).unwrap_err().to_string();
        assert!(e.contains("7 slots"), "{dev}: {e}");
        let e = combine(dev, &[&slots[..], &[0]].concat())
            .unwrap_err()
            .to_string();
        assert!(e.contains("9 slots"), "{dev}: {e}");
    }
    // output 0 given a row of output 1, and a row listed twice: the CPU reads and refuses them
    let mut swapped = slots.clone();
    swapped.swap(0, 2);
    swapped[1] = swapped[3];
    let e = combine(Device::cpu(), &swapped).unwrap_err().to_string();
    assert!(e.contains("slot 0 lists row"), "{e}");
    let mut twice = slots.clone();
    twice[1] = twice[0];
    let e = combine(Device::cpu(), &twice).unwrap_err().to_string();
    assert!(
        e.contains("slot 1 lists row") && e.contains("listed before"),
        "{e}"
    );
}

/// `x[idx]` (rows `[len, d]` picked `A = len·k` times) and the gradient of `sum(y ⊙ up)` in `x`,
/// with or without the slots.
fn select_with(
    (c, v): (&Case, &Values),
    slots: Option<&[i32]>,
    up: &[f64],
    (dev, dtype): (Device, DType),
) -> [Vec<f64>; 2] {
    // the case's rows serve as x: its first len·d values
    let x = place(&v.rows[..c.len * c.d], &[c.len, c.d], dev, dtype)
        .with_grad()
        .unwrap();
    let idx = Tensor::from_i32(v.idx.clone(), &[c.a], dev).unwrap();
    let y = match slots {
        Some(s) => {
            let s = Tensor::from_i32(s.to_vec(), &[s.len()], dev).unwrap();
            x.index_select_by_slots(&idx, &s).unwrap()
        }
        None => x.index_select(0, &idx).unwrap(),
    };
    y.backward_with(&place(up, &[c.a, c.d], dev, dtype))
        .unwrap();
    [
        y.to_vec_f64().unwrap(),
        x.grad().unwrap().to_vec_f64().unwrap(),
    ]
}

#[test]
fn index_select_by_slots_gives_index_selects_bits() {
    let Some(gpu) = common::gpu_or_skip("index_select_by_slots_gives_index_selects_bits") else {
        return;
    };
    check_slotted_cases(gpu, 75, |c, v, slots, on| {
        // the upstream gradient of the a selected rows, values f16 holds
        let mut rng = ChaCha8Rng::seed_from_u64(c.a as u64);
        let up: Vec<f64> = (0..c.a * c.d)
            .map(|_| half::f16::from_f32(rng.random_range(-2.0f32..2.0)).to_f64())
            .collect();
        let by_slots = select_with((c, v), Some(slots), &up, on);
        let plain = select_with((c, v), None, &up, on);
        ["y", "dx"]
            .into_iter()
            .zip(plain)
            .zip(by_slots)
            .map(|((name, p), s)| (name, p, s))
            .collect()
    });
}

/// Where [`residual_combine`] runs: the device, the rows' dtype and the weights'.
type Placement = (Device, DType, DType);

/// The residual [`residual_combine`] adds: its values, shape and dtype.
type Residual<'a> = (&'a [f64], &'a [usize], DType);

/// The output and the gradients (rows, weights per slot, residual) of `sum(y ⊙ up)` for
/// `y = residual + combine`, the combine per slot: added by the combine
/// (`weighted_index_scatter_per_slot_add`) or by `add` after it. Rows, residual and upstream
/// gradient in `dtype`, the weights in `w_dtype`; the residual of `h_shape`. Also returns the
/// kernels the forward ran (on the GPU).
fn residual_combine(
    (c, v, slots): (&Case, &Values, &[i32]),
    (dev, dtype, w_dtype): Placement,
    (h, h_shape, h_dtype): Residual,
    by_the_combine: bool,
) -> (Vec<(&'static str, Vec<f64>)>, Option<u64>) {
    let rows = place(&v.rows, &[c.a, c.d], dev, dtype).with_grad().unwrap();
    let given: Vec<f64> = slots.iter().map(|&r| v.w[r as usize]).collect();
    let w = place(&given, &[c.a], dev, w_dtype).with_grad().unwrap();
    let residual = place(h, h_shape, dev, h_dtype).with_grad().unwrap();
    let idx = Tensor::from_i32(v.idx.clone(), &[c.a], dev).unwrap();
    let mut order = vec![0; slots.len()];
    for (s, &r) in slots.iter().enumerate() {
        order[r as usize] = s as i32;
    }
    let order = Tensor::from_i32(order, &[slots.len()], dev).unwrap();
    let s = Tensor::from_i32(slots.to_vec(), &[slots.len()], dev).unwrap();
    // this thread's kernels (the dispatch counters are the process's, and tests run side by side)
    moegrad::profile::enable();
    let combine = || {
        if by_the_combine {
            rows.weighted_index_scatter_per_slot_add(&w, &idx, c.len, &s, &order, &residual)
        } else {
            rows.weighted_index_scatter_per_slot(&w, &idx, c.len, &s, &order)
                .and_then(|y| residual.add(&y))
        }
    };
    // an f32 residual beside f16 rows: the add promotes under mixed precision (as in a model's
    // first block)
    let y = if h_dtype == dtype {
        combine()
    } else {
        moegrad::autocast_f16(combine)
    }
    .unwrap();
    let report = moegrad::profile::disable().expect("this thread recorded");
    let forward = report
        .gpu
        .map(|g| g.kernels.iter().map(|k| k.calls).sum::<u64>());
    y.backward_with(&place(&v.up, &[c.len, c.d], dev, y.dtype()))
        .unwrap();
    let grad = |t: &Tensor| t.grad().unwrap().to_vec_f64().unwrap();
    let values = vec![
        ("y", y.to_vec_f64().unwrap()),
        ("d_rows", grad(&rows)),
        ("d_w", grad(&w)),
        ("d_residual", grad(&residual)),
    ];
    (values, forward)
}

/// An MoE block's residual added by the combine's kernel (`weighted_gather_slots` with its
/// addend): the output and every gradient to the bit of the combine then `add`, on the GPU in
/// f32 and f16 and on the CPU, over the slotted cases (the grid folded past 65,535 workgroups,
/// NaN first in the output's buffer); on the GPU, one dispatch forward where the two ops take
/// two.
#[test]
fn a_residual_added_by_the_combine_has_the_bits_of_the_add() {
    let Some(gpu) = common::gpu_or_skip("a_residual_added_by_the_combine_has_the_bits_of_the_add")
    else {
        return;
    };
    check_slotted_cases(gpu, 77, |c, v, slots, (dev, dtype)| {
        let mut rng = ChaCha8Rng::seed_from_u64(c.a as u64 + 1);
        let h: Vec<f64> = (0..c.len * c.d)
            .map(|_| half::f16::from_f32(rng.random_range(-2.0f32..2.0)).to_f64())
            .collect();
        let on = (dev, dtype, dtype);
        let h = (&h[..], &[c.len, c.d][..], dtype);
        let (folded, one) = residual_combine((c, v, slots), on, h, true);
        let (added, two) = residual_combine((c, v, slots), on, h, false);
        if dev.is_gpu() {
            assert_eq!((one, two), (Some(1), Some(2)), "{dtype}: kernels forward");
        }
        added
            .into_iter()
            .zip(folded)
            .map(|((name, a), (_, f))| (name, a, f))
            .collect()
    });
}

/// Mixed precision's combine with its residual: f16 rows and residual, the router's f32
/// weights (the f16-rows build's `weighted_gather_slots`); and residuals the combine does not
/// add itself, an f32 one beside f16 rows and one that broadcasts (`[d]`), which the op hands
/// to `add`: in every case the bits of the combine then the add.
#[test]
fn a_mixed_precision_residual_or_one_that_broadcasts_has_the_bits_of_the_add() {
    let Some(gpu) = f16_checks::f16_gpu("a_mixed_precision_residual_has_the_bits_of_the_add")
    else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(78);
    for (len, k, d) in [(40, 3, 5), (64, 5, 300), (4096, 2, 4)] {
        let (c, v, slots) = slotted(len, k, d, &mut rng);
        let h: Vec<f64> = (0..c.len * c.d)
            .map(|_| half::f16::from_f32(rng.random_range(-2.0f32..2.0)).to_f64())
            .collect();
        let full = [c.len, c.d];
        let cases: [(&str, Placement, Residual); 4] = [
            (
                "f16 rows, f32 weights, f16 residual",
                (gpu, DType::F16, DType::F32),
                (&h, &full, DType::F16),
            ),
            (
                "f16 rows, f32 weights, f32 residual",
                (gpu, DType::F16, DType::F32),
                (&h, &full, DType::F32),
            ),
            (
                "f32, a [d] residual (GPU)",
                (gpu, DType::F32, DType::F32),
                (&h[..c.d], &[c.d], DType::F32),
            ),
            (
                "f32, a [d] residual (CPU)",
                (Device::cpu(), DType::F32, DType::F32),
                (&h[..c.d], &[c.d], DType::F32),
            ),
        ];
        for (what, on, h) in cases {
            let (folded, _) = residual_combine((&c, &v, &slots), on, h, true);
            let (added, _) = residual_combine((&c, &v, &slots), on, h, false);
            for ((name, a), (_, f)) in added.iter().zip(&folded) {
                let same =
                    a.len() == f.len() && a.iter().zip(f).all(|(a, f)| a.to_bits() == f.to_bits());
                assert!(same, "{what}, {len} × {k} rows of {d}: {name} differs");
            }
        }
    }
}
