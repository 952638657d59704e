//! GPU parity of the fused kernels as property tests: layer norm, causal attention (plain and
//! packed), cross-entropy, conv2d and the grouped (banked) conv2d, max and average pooling,
//! `topk_gate`, the dispatch plan and the grouped matmul with and without its bias, each forward
//! and (where differentiable) backward.
//!
//! Each property draws random shapes (sizes around the kernels' workgroup and tile edges: 16,
//! 32, 64, 128, 256) and values from a fixed-seed proptest runner with a small case count, runs
//! the op on the CPU in f64 and on the GPU in f32 from the same f32-representable inputs,
//! back-propagates the same random upstream gradient on both, and compares outputs and every
//! float input's gradient (integer outputs such as indices and the plan exactly).
//!
//! The `fold_*` tests run each kernel whose grid can exceed 65,535 workgroups in one dimension
//! once at the smallest shape that does (`fold::smallest_past_limit` finds it from the
//! launcher's own workgroup formula, and asserts it really is past the limit): the
//! 1-D kernels fold their grid into x and y, the tiled ones split it into several launches with
//! a base index; a kernel that indexes only `workgroup_id.x`, or forgets the base, passes every
//! small shape and fails there. The grouped matmul and its weight gradient (past 65,535 column
//! tiles) and attention_delta fold in tests/gpu_parity_props.rs (`split_grouped_matmul_columns`,
//! `folded_attention_delta`: through the `Backend` trait, their cheapest folding shapes). Left
//! out: the dispatch plan's `plan_sort` (O(A²), and it folds only past 16.7 million assignments)
//! and its sort of three-word keys (whose kernels fold in `folded_sort_kernels`), the
//! grouped matmul's row split (4.2 million rows of 64-row tiles take minutes on lavapipe), and
//! the gradients whose kernels walk a whole folded axis in one invocation: layer norm's dγ/dβ
//! and conv2d's weight gradient (see below; docs/gpu.md lists these under "Not verified").
//! On lavapipe a loop of more than about 20,000–65,535 iterations in one invocation is cut
//! short (llvmpipe's loop limiter), so the fold cases keep every per-invocation loop short and
//! leave out the gradients whose kernels walk a whole folded axis.
//!
//! Without a GPU adapter every test prints "skipping" and returns (`MOEGRAD_REQUIRE_GPU=1`
//! makes that a failure). The harness (CPU f64 reference against GPU f32) is
//! `parity::parity_outputs` from `tests/common/parity.rs`, shared with tests/gpu_parity.rs and
//! tests/gpu_parity_props.rs, as is the fixed-seed runner (`tests/common/property.rs`) and the
//! grid limit (`tests/common/fold.rs`).

mod common;
#[path = "common/fold.rs"]
mod fold;
#[path = "common/parity.rs"]
mod parity;
#[path = "common/property.rs"]
mod property;

use fold::smallest_past_limit;
use moegrad::moe::{Capacity, DispatchPlan, Routing};
use moegrad::{DType, Device, Tensor};
use parity::{Tol, parity_outputs};
use property::check_property;
use proptest::prelude::*;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

// ---- tolerances -----------------------------------------------------------------------------

/// Fused kernels accumulating in f32 over up to a few hundred terms.
const FUSED: Tol = Tol {
    atol: 5e-4,
    rtol: 5e-3,
};
/// Fold cases: one or two terms per output, but millions of outputs.
const FOLD: Tol = Tol {
    atol: 1e-4,
    rtol: 1e-3,
};

// ---- shapes and values ----------------------------------------------------------------------

/// A size: small (1–4), or one of `edges` give or take one.
fn size_near(edges: &'static [usize]) -> BoxedStrategy<usize> {
    prop_oneof![
        1usize..=4,
        (prop::sample::select(edges), -1i64..=1).prop_map(|(e, d)| (e as i64 + d).max(1) as usize),
    ]
    .boxed()
}

/// Fixed-seed f32-representable values.
struct Vals(ChaCha8Rng);

impl Vals {
    fn new(seed: u64) -> Vals {
        Vals(ChaCha8Rng::seed_from_u64(seed))
    }
    /// Uniform in `[lo, hi)`, rounded to f32.
    fn uniform(&mut self, n: usize, lo: f64, hi: f64) -> Vec<f64> {
        (0..n)
            .map(|_| self.0.random_range(lo..hi) as f32 as f64)
            .collect()
    }
    /// Multiples of 1/4 in [−2, 2]: many exact ties.
    fn coarse(&mut self, n: usize) -> Vec<f64> {
        (0..n)
            .map(|_| self.0.random_range(-8i32..=8) as f64 / 4.0)
            .collect()
    }
    fn int(&mut self, lo: i64, hi: i64) -> i64 {
        self.0.random_range(lo..=hi)
    }
    fn tensor(&mut self, shape: &[usize], lo: f64, hi: f64) -> Tensor {
        let v = self.uniform(shape.iter().product(), lo, hi);
        Tensor::from_f64(v, shape, Device::cpu()).unwrap()
    }
    fn ints(&mut self, shape: &[usize], lo: i64, hi: i64) -> Tensor {
        let v = (0..shape.iter().product())
            .map(|_| self.int(lo, hi) as i32)
            .collect();
        Tensor::from_i32(v, shape, Device::cpu()).unwrap()
    }
}

fn gpu(test: &str) -> Option<Device> {
    common::gpu_or_skip(test)
}

// ---- layer norm -----------------------------------------------------------------------------

#[test]
fn layer_norm_matches_over_random_shapes() {
    let Some(dev) = gpu("layer_norm_matches_over_random_shapes") else {
        return;
    };
    // rows: one workgroup each; dim: 64 invocations a row, 64 columns a workgroup for dγ, dβ
    let shape = (1usize..=70, size_near(&[64, 128, 192]), any::<u64>());
    check_property("layer_norm", 12, shape, |(rows, dim, seed)| {
        let mut v = Vals::new(seed);
        let x = v.tensor(&[rows, dim], -2.0, 2.0);
        let gamma = v.tensor(&[dim], 0.5, 1.5);
        let beta = v.tensor(&[dim], -1.0, 1.0);
        parity_outputs(
            &format!("layer_norm [{rows}, {dim}]"),
            dev,
            FUSED,
            |t| Ok(vec![t[0].layer_norm(&t[1], &t[2], 1e-5)?]),
            &[x, gamma, beta],
        );
    });
}

#[test]
fn fold_layer_norm_rows_and_columns() {
    let Some(dev) = gpu("fold_layer_norm_rows_and_columns") else {
        return;
    };
    // forward and dx: one workgroup per row, folded into x/y. γ and β are constants here: dγ
    // and dβ are one invocation per column walking every row, a loop that lavapipe (llvmpipe's
    // loop limiter) cuts short past 65,535 iterations. Their own fold (⌈dim/64⌉ workgroups)
    // needs a row of over 4 million columns, which the forward walks in loops past that limit
    // too, so it is not run here.
    let rows = smallest_past_limit("layer_norm rows", |r| r);
    let mut v = Vals::new(1);
    let (gamma, beta) = (v.tensor(&[4], 0.5, 1.5), v.tensor(&[4], -1.0, 1.0));
    let on = |t: &Tensor, like: &Tensor| {
        t.to_dtype(like.dtype())
            .and_then(|t| t.to_device(like.device()))
    };
    parity_outputs(
        &format!("layer_norm [{rows}, 4]"),
        dev,
        FOLD,
        |t| {
            Ok(vec![t[0].layer_norm(
                &on(&gamma, &t[0])?,
                &on(&beta, &t[0])?,
                1e-5,
            )?])
        },
        &[v.tensor(&[rows, 4], -2.0, 2.0)],
    );
}

// ---- attention ------------------------------------------------------------------------------

/// `(B, H, T, Dh, seed)`: T around the 64-row tiles and the 32-row stages; Dh around the stage
/// size's breakpoints (STAGE = min(32, 1984 / Dh)).
fn attention_shapes() -> impl Strategy<Value = (usize, usize, usize, usize, u64)> {
    (
        1usize..=2,
        1usize..=3,
        size_near(&[32, 64, 128]),
        prop::sample::select(vec![1usize, 3, 8, 16, 62, 63, 64, 65, 128]),
        any::<u64>(),
    )
}

#[test]
fn causal_attention_matches_over_random_shapes() {
    let Some(dev) = gpu("causal_attention_matches_over_random_shapes") else {
        return;
    };
    check_property(
        "causal_attention",
        10,
        attention_shapes(),
        |(b, h, t, dh, seed)| {
            let mut v = Vals::new(seed);
            let s = [b, h, t, dh];
            let qkv = [
                v.tensor(&s, -1.5, 1.5),
                v.tensor(&s, -1.5, 1.5),
                v.tensor(&s, -1.0, 1.0),
            ];
            parity_outputs(
                &format!("causal_attention {s:?}"),
                dev,
                FUSED,
                |t| Ok(vec![t[0].causal_attention(&t[1], &t[2])?]),
                &qkv,
            );
        },
    );
}

#[test]
fn packed_attention_matches_over_random_shapes() {
    let Some(dev) = gpu("packed_attention_matches_over_random_shapes") else {
        return;
    };
    check_property(
        "causal_attention_packed",
        8,
        attention_shapes(),
        |(b, h, t, dh, seed)| {
            let s = [b, t, 3, h, dh];
            let qkv = Vals::new(seed).tensor(&s, -1.5, 1.5);
            parity_outputs(
                &format!("causal_attention_packed {s:?}"),
                dev,
                FUSED,
                |t| Ok(vec![t[0].causal_attention_packed()?]),
                &[qkv],
            );
        },
    );
}

#[test]
fn fold_attention_heads_and_delta_rows() {
    let Some(dev) = gpu("fold_attention_heads_and_delta_rows") else {
        return;
    };
    let attn = |t: &[Tensor]| Ok(vec![t[0].causal_attention(&t[1], &t[2])?]);
    // the tiled kernels: (⌈T/64⌉, heads) workgroups, more than 65,535 heads in several launches
    let heads = smallest_past_limit("attention heads", |h| h);
    let mut v = Vals::new(2);
    let s = [1, heads, 2, 2];
    let qkv = [
        v.tensor(&s, -1.5, 1.5),
        v.tensor(&s, -1.5, 1.5),
        v.tensor(&s, -1.0, 1.0),
    ];
    parity_outputs(&format!("causal_attention {s:?}"), dev, FOLD, attn, &qkv);
    // attention_delta folds its 1-D grid past 16.7 million rows (heads·T): the forward and the
    // f64 tape at that size take about a minute on lavapipe, so it runs through the Backend
    // trait's backward alone in tests/gpu_parity_props.rs (`folded_attention_delta`).
}

// ---- cross-entropy --------------------------------------------------------------------------

#[test]
fn cross_entropy_matches_over_random_shapes() {
    let Some(dev) = gpu("cross_entropy_matches_over_random_shapes") else {
        return;
    };
    let shape = (
        1usize..=70,
        size_near(&[64, 128, 256]),
        any::<bool>(),
        any::<u64>(),
    );
    check_property("cross_entropy", 12, shape, |(rows, classes, mean, seed)| {
        let mut v = Vals::new(seed);
        let logits = v.tensor(&[rows, classes], -4.0, 4.0);
        let targets = v.ints(&[rows], 0, classes as i64 - 1);
        parity_outputs(
            &format!("cross_entropy [{rows}, {classes}] mean {mean}"),
            dev,
            FUSED,
            |t| {
                Ok(vec![if mean {
                    t[0].cross_entropy(&t[1])?
                } else {
                    t[0].cross_entropy_per_row(&t[1])?
                }])
            },
            &[logits, targets],
        );
    });
}

#[test]
fn fold_cross_entropy_rows_and_elements() {
    let Some(dev) = gpu("fold_cross_entropy_rows_and_elements") else {
        return;
    };
    // forward: one workgroup per row; backward: one invocation per logit, 256 a workgroup
    let rows = smallest_past_limit("cross_entropy rows", |r| r);
    let classes = smallest_past_limit("cross_entropy logits", |c| (rows * c).div_ceil(256));
    let mut v = Vals::new(3);
    let logits = v.tensor(&[rows, classes], -4.0, 4.0);
    let targets = v.ints(&[rows], 0, classes as i64 - 1);
    parity_outputs(
        &format!("cross_entropy [{rows}, {classes}]"),
        dev,
        FOLD,
        |t| Ok(vec![t[0].cross_entropy_per_row(&t[1])?]),
        &[logits, targets],
    );
}

// ---- convolution ----------------------------------------------------------------------------

/// `(B, C, side, OC, kernel, stride, padding, seed)` with the kernel fitting the padded image;
/// OC around the 16-channel tiles, the side giving 1 to ~200 positions (64 a tile).
fn conv_shapes() -> impl Strategy<Value = (usize, usize, usize, usize, usize, usize, usize, u64)> {
    (
        1usize..=3,
        1usize..=3,
        1usize..=14,
        size_near(&[16, 32]),
        1usize..=3,
        1usize..=2,
        0usize..=1,
        any::<u64>(),
    )
        .prop_map(|(b, c, side, oc, k, s, p, seed)| {
            (b, c, side, oc, k.min(side + 2 * p), s, p, seed)
        })
}

#[test]
fn conv2d_matches_over_random_shapes() {
    let Some(dev) = gpu("conv2d_matches_over_random_shapes") else {
        return;
    };
    let shapes = (conv_shapes(), any::<bool>());
    check_property(
        "conv2d",
        10,
        shapes,
        |((b, c, side, oc, k, s, p, seed), bias)| {
            let mut v = Vals::new(seed);
            let mut inputs = vec![
                v.tensor(&[b, c, side, side], -1.0, 1.0),
                v.tensor(&[oc, c, k, k], -1.0, 1.0),
            ];
            if bias {
                inputs.push(v.tensor(&[oc], -1.0, 1.0));
            }
            parity_outputs(
                &format!(
                    "conv2d x [{b}, {c}, {side}, {side}] w [{oc}, {c}, {k}, {k}] stride {s} padding {p} bias {bias}"
                ),
                dev,
                FUSED,
                |t| Ok(vec![t[0].conv2d(&t[1], t.get(2), s, p)?]),
                &inputs,
            );
        },
    );
}

#[test]
fn grouped_conv2d_matches_over_random_shapes() {
    let Some(dev) = gpu("grouped_conv2d_matches_over_random_shapes") else {
        return;
    };
    let shapes = (conv_shapes(), 1usize..=3);
    check_property(
        "grouped_conv2d",
        10,
        shapes,
        |((b, c, side, oc, k, s, p, seed), banks)| {
            let mut v = Vals::new(seed);
            let inputs = [
                v.tensor(&[b, c, side, side], -1.0, 1.0),
                v.tensor(&[banks, oc, c, k, k], -1.0, 1.0),
                // −1 and `banks` are outside the bank range: zeros, no gradient
                v.ints(&[b], -1, banks as i64),
            ];
            parity_outputs(
                &format!(
                    "grouped_conv2d x [{b}, {c}, {side}, {side}] w [{banks}, {oc}, {c}, {k}, {k}] stride {s} padding {p}"
                ),
                dev,
                FUSED,
                |t| Ok(vec![t[0].grouped_conv2d(&t[1], &t[2], s, p)?]),
                &inputs,
            );
        },
    );
}

#[test]
fn fold_conv2d_images() {
    let Some(dev) = gpu("fold_conv2d_images") else {
        return;
    };
    // forward and dx: (⌈P/64⌉, ⌈OC/16⌉, images) and (⌈H·W/256⌉, C, images) workgroups, more
    // than 65,535 images in several launches. The weights are constants: dW is one workgroup
    // per tile walking every image, a loop that lavapipe (llvmpipe's loop limiter) cuts short
    // past about 20,000 images, and its grid holds no images.
    let batch = smallest_past_limit("conv2d images", |b| b);
    let mut v = Vals::new(4);
    let w = v.tensor(&[2, 2, 1, 2, 2], -1.0, 1.0);
    let banks = v.ints(&[batch], -1, 2);
    let x = v.tensor(&[batch, 1, 2, 2], -1.0, 1.0);
    let on = |t: &Tensor, like: &Tensor| {
        t.to_dtype(like.dtype())
            .and_then(|t| t.to_device(like.device()))
    };
    // the banked form: the plain conv2d is the same kernels with one bank
    parity_outputs(
        &format!("grouped_conv2d x [{batch}, 1, 2, 2]"),
        dev,
        FOLD,
        |t| Ok(vec![t[0].grouped_conv2d(&on(&w, &t[0])?, &t[1], 1, 0)?]),
        &[x.clone(), banks],
    );
}

#[test]
fn fold_plain_conv2d_images() {
    let Some(dev) = gpu("fold_plain_conv2d_images") else {
        return;
    };
    // The plain conv2d (no bank buffer: `has_bank` 0 puts every image on bank 0) over the same
    // grid: (⌈P/64⌉, ⌈OC/16⌉, images) forward and
    // (⌈H·W/256⌉, C, images) for dx, more than 65,535 images in several launches, each told its
    // first image. The weights are constants, as in `fold_conv2d_images` (dW's loop over every
    // image is cut short by lavapipe).
    let batch = smallest_past_limit("plain conv2d images", |b| b);
    let mut v = Vals::new(7);
    let w = v.tensor(&[2, 1, 2, 2], -1.0, 1.0);
    let x = v.tensor(&[batch, 1, 2, 2], -1.0, 1.0);
    let on = |t: &Tensor, like: &Tensor| {
        t.to_dtype(like.dtype())
            .and_then(|t| t.to_device(like.device()))
    };
    parity_outputs(
        &format!("conv2d x [{batch}, 1, 2, 2] w [2, 1, 2, 2]"),
        dev,
        FOLD,
        |t| Ok(vec![t[0].conv2d(&on(&w, &t[0])?, None, 1, 0)?]),
        std::slice::from_ref(&x),
    );
}

// ---- pooling --------------------------------------------------------------------------------

#[test]
fn pooling_matches_over_random_shapes() {
    let Some(dev) = gpu("pooling_matches_over_random_shapes") else {
        return;
    };
    let shapes = (
        1usize..=3,
        1usize..=4,
        1usize..=20,
        1usize..=20,
        1usize..=3,
        1usize..=3,
        any::<bool>(),
        any::<bool>(),
        any::<u64>(),
    )
        .prop_map(|(b, c, h, w, k, s, pad, max, seed)| {
            let k = k.min(h).min(w);
            (b, c, h, w, k, s, if pad { k / 2 } else { 0 }, max, seed)
        });
    check_property("pool2d", 12, shapes, |(b, c, h, w, k, s, p, max, seed)| {
        let mut v = Vals::new(seed);
        // coarse values: ties inside windows, which go to the first maximum on both devices
        let x = Tensor::from_f64(v.coarse(b * c * h * w), &[b, c, h, w], Device::cpu()).unwrap();
        parity_outputs(
            &format!(
                "{} pool [{b}, {c}, {h}, {w}] kernel {k} stride {s} padding {p}",
                if max { "max" } else { "avg" }
            ),
            dev,
            FUSED,
            |t| {
                Ok(vec![if max {
                    t[0].max_pool2d_padded(k, s, p)?
                } else {
                    t[0].avg_pool2d_padded(k, s, p)?
                }])
            },
            &[x],
        );
    });
}

#[test]
fn fold_pooling_outputs_and_inputs() {
    let Some(dev) = gpu("fold_pooling_outputs_and_inputs") else {
        return;
    };
    // forward: one invocation per output, backward: one per input pixel, 256 a workgroup.
    // Kernel 2, stride 1 on 17×17 planes: 256 outputs and 289 inputs a plane.
    let planes = smallest_past_limit("pool2d outputs", |n| (n * 256).div_ceil(256));
    assert!((planes * 289).div_ceil(256) > fold::MAX_GROUPS);
    let x = Vals::new(5).tensor(&[1, planes, 17, 17], -2.0, 2.0);
    // max pooling (the average's entries share the index formula and the launcher)
    parity_outputs(
        &format!("max pool [1, {planes}, 17, 17] kernel 2 stride 1"),
        dev,
        FOLD,
        |t| Ok(vec![t[0].max_pool2d(2, 1)?]),
        std::slice::from_ref(&x),
    );
}

#[test]
fn fold_average_pooling_outputs_and_inputs() {
    let Some(dev) = gpu("fold_average_pooling_outputs_and_inputs") else {
        return;
    };
    // `avg_pool2d_forward` (one invocation per output) and `avg_pool2d_backward` (one per input
    // pixel, summing the at most 4 windows that cover it), 256 a workgroup: entries of their
    // own, so the max pooling case does not cover their index recovery. Kernel 2, stride 1 on
    // 17×17 planes: 256 outputs and 289 inputs a plane.
    let planes = smallest_past_limit("avg pool2d outputs", |n| (n * 256).div_ceil(256));
    assert!((planes * 289).div_ceil(256) > fold::MAX_GROUPS);
    let x = Vals::new(8).tensor(&[1, planes, 17, 17], -2.0, 2.0);
    parity_outputs(
        &format!("avg pool [1, {planes}, 17, 17] kernel 2 stride 1"),
        dev,
        FOLD,
        |t| Ok(vec![t[0].avg_pool2d(2, 1)?]),
        std::slice::from_ref(&x),
    );
}

// ---- topk_gate ------------------------------------------------------------------------------

/// The gate's three outputs: probabilities, indices (exactly) and weights, and the gradients of
/// the logits (and scores) through both float outputs.
fn gate_parity(
    name: &str,
    dev: Device,
    tol: Tol,
    (rows, n, k): (usize, usize, usize),
    v: &mut Vals,
    (noisy, renormalise, coarse): (bool, bool, bool),
) {
    let draw = |v: &mut Vals| {
        let vals = if coarse {
            v.coarse(rows * n)
        } else {
            v.uniform(rows * n, -3.0, 3.0)
        };
        Tensor::from_f64(vals, &[rows, n], Device::cpu()).unwrap()
    };
    let mut inputs = vec![draw(v)];
    if noisy {
        inputs.push(draw(v));
    }
    parity_outputs(
        &format!(
            "{name} [{rows}, {n}] k {k} renormalise {renormalise} scores {noisy} coarse {coarse}"
        ),
        dev,
        tol,
        |t| {
            let g = t[0].topk_gate(t.get(1), k, renormalise)?;
            Ok(vec![g.probs, g.idx, g.weights])
        },
        &inputs,
    );
}

#[test]
fn topk_gate_matches_over_random_sizes() {
    let Some(dev) = gpu("topk_gate_matches_over_random_sizes") else {
        return;
    };
    let sizes = (
        size_near(&[64, 128]),
        1usize..=40,
        1usize..=8,
        0u8..3,
        any::<bool>(),
        any::<u64>(),
    )
        .prop_map(|(rows, n, k, mode, coarse, seed)| (rows, n, k.min(n), mode, coarse, seed));
    check_property(
        "topk_gate",
        16,
        sizes,
        |(rows, n, k, mode, coarse, seed)| {
            // mode 0: renormalised over the logits, 1: over separate scores, 2: unnormalised
            let (noisy, renormalise) = [(false, true), (true, true), (false, false)][mode as usize];
            gate_parity(
                "topk_gate",
                dev,
                FUSED,
                (rows, n, k),
                &mut Vals::new(seed),
                (noisy, renormalise, coarse),
            );
        },
    );
}

#[test]
fn fold_topk_gate_rows() {
    let Some(dev) = gpu("fold_topk_gate_rows") else {
        return;
    };
    // topk_gate, its backward and softmax_backward: one invocation per row, 64 a workgroup
    let rows = smallest_past_limit("topk_gate rows", |r| r.div_ceil(64));
    let mut v = Vals::new(6);
    gate_parity(
        "topk_gate",
        dev,
        FOLD,
        (rows, 3, 2),
        &mut v,
        (true, true, false),
    );
}

#[test]
fn fold_unnormalised_topk_gate_rows() {
    let Some(dev) = gpu("fold_unnormalised_topk_gate_rows") else {
        return;
    };
    // The unnormalised gate (weights are the softmax's probabilities of the k chosen, not
    // renormalised over them): `topk_gate` and `topk_gate_backward` on their other branch, one
    // invocation per row, 64 a workgroup
    let rows = smallest_past_limit("unnormalised topk_gate rows", |r| r.div_ceil(64));
    let mut v = Vals::new(9);
    gate_parity(
        "topk_gate",
        dev,
        FOLD,
        (rows, 3, 2),
        &mut v,
        (false, false, false),
    );
}

// ---- dispatch plan --------------------------------------------------------------------------

/// A routing of `a` assignments over `n` experts (some invalid: expert −1 or n, or valid = 0),
/// with ranks in `0..k` and weights with ties, on `dev` in `dtype`.
fn random_routing(
    v: &mut Vals,
    (tokens, a, n, k): (usize, usize, usize, usize),
    dev: Device,
    dtype: DType,
) -> Routing {
    let ints = |x: Vec<i32>| Tensor::from_i32(x, &[a], dev).unwrap();
    let floats = |x: Vec<f64>| {
        Tensor::from_f64(x, &[a], Device::cpu())
            .and_then(|t| t.to_dtype(dtype))
            .and_then(|t| t.to_device(dev))
            .unwrap()
    };
    let token = (0..a).map(|_| v.int(0, tokens as i64 - 1) as i32).collect();
    let expert = (0..a)
        .map(|_| {
            if v.int(0, 15) == 0 {
                [-1, n as i32][v.int(0, 1) as usize]
            } else {
                v.int(0, n as i64 - 1) as i32
            }
        })
        .collect();
    let weight = (0..a).map(|_| v.int(0, 8) as f64 / 8.0).collect();
    let valid = (0..a)
        .map(|_| if v.int(0, 9) == 0 { 0.0 } else { 1.0 })
        .collect();
    let rank = (0..a).map(|_| v.int(0, k as i64 - 1) as f64).collect();
    let zeros = Tensor::zeros(&[tokens, n], dtype, dev).unwrap();
    Routing {
        token: ints(token),
        expert: ints(expert),
        weight: floats(weight),
        valid: floats(valid),
        rank: floats(rank),
        probs: zeros.clone(),
        logits: zeros,
        // tokens in any order
        slots_per_token: None,
        tokens,
        experts: n,
        aux_loss: None,
        metrics: Vec::new(),
        score: None,
        selection: None,
        defaults: None,
        dense: None,
    }
}

/// Every output of the plan, by name.
fn plan_outputs(p: &DispatchPlan) -> [(&'static str, &Tensor); 9] {
    [
        ("order", &p.order),
        ("position", &p.position),
        ("row_token", &p.row_token),
        ("row_expert", &p.row_expert),
        ("row_expert_clamped", &p.row_expert_clamped),
        ("row_kept", &p.row_kept),
        ("offsets", &p.offsets),
        ("kept_per_expert", &p.kept_per_expert),
        ("routed_per_expert", &p.routed_per_expert),
    ]
}

/// A plan output's exact host values (indices or 0/1 and counts).
fn plan_values(t: &Tensor) -> Vec<f64> {
    match t.dtype() {
        DType::I32 => t.to_vec_i32().unwrap().into_iter().map(f64::from).collect(),
        _ => t.to_vec_f64().unwrap(),
    }
}

/// The plan of a random routing of `a` assignments on the CPU (f64) and on `dev` (f32), every
/// output compared exactly (one at a time: the fold case has 16.7 million rows), and `position`
/// checked as `order`'s inverse.
fn check_plan(
    dev: Device,
    (tokens, a, n, k): (usize, usize, usize, usize),
    capacity: Capacity,
    seed: u64,
) {
    let name = format!("dispatch_plan: {a} assignments, {n} experts, k {k}, {capacity:?}");
    let build = |d: Device, dtype: DType| {
        let r = random_routing(&mut Vals::new(seed), (tokens, a, n, k), d, dtype);
        DispatchPlan::build(&r, capacity).unwrap_or_else(|e| panic!("{name} on {d}: {e}"))
    };
    let pc = build(Device::cpu(), DType::F64);
    // NaN in the buffers the plan's outputs and the counting sort's table will get, so that a
    // word left unwritten shows (a fresh buffer reads as zeros, a lucky count); one of each
    // size for the largest plans, which would otherwise hold gigabytes
    let copies = if a > 1 << 20 { 1 } else { 8 };
    let table = (n + 1) * a.div_ceil(256) + a;
    let poisoned: Vec<Tensor> = [a, table, n + 1]
        .iter()
        .flat_map(|&len| (0..copies).map(move |_| len))
        .map(|len| Tensor::full(&[len], f64::NAN, DType::F32, dev).unwrap())
        .collect();
    drop(poisoned);
    moegrad::gpu::flush().unwrap();
    dev.synchronize().unwrap();
    let pg = build(dev, DType::F32);
    assert_eq!(pc.capacity, pg.capacity, "{name}: capacity");
    for ((what, c), (_, g)) in plan_outputs(&pc).into_iter().zip(plan_outputs(&pg)) {
        let (c, g) = (plan_values(c), plan_values(g));
        assert_eq!(c.len(), g.len(), "{name}: {what}'s length");
        if let Some(at) = c.iter().zip(&g).position(|(c, g)| c != g) {
            panic!(
                "{name}: {what} differs first at {at} (CPU {}, GPU {})",
                c[at], g[at]
            );
        }
    }
    // position is order's inverse permutation (on the CPU, so on the GPU too)
    let (order, position) = (
        pc.order.to_vec_i32().unwrap(),
        pc.position.to_vec_i32().unwrap(),
    );
    for (r, &i) in order.iter().enumerate() {
        assert_eq!(
            position[i as usize], r as i32,
            "{name}: position of assignment {i}"
        );
    }
}

#[test]
fn dispatch_plan_matches_over_random_sizes_and_capacities() {
    let Some(dev) = gpu("dispatch_plan_matches_over_random_sizes_and_capacities") else {
        return;
    };
    // Up to 1024 assignments the plan is one kernel (`plan_sort`); past it a dropless plan is a
    // counting sort over chunks of 256 (3000: a partial last chunk, 4096: whole ones) and a plan
    // with a capacity one sort of three-word keys.
    let sizes = (
        1usize..=40,
        size_near(&[256, 512, 1024, 3000, 4096]),
        1usize..=9,
        1usize..=4,
        prop_oneof![Just(None), (0.2f64..2.5, 0usize..=4).prop_map(Some),],
        any::<u64>(),
    );
    check_property(
        "dispatch_plan",
        32,
        sizes,
        |(tokens, a, n, k, cap, seed)| {
            let capacity = match cap {
                None => Capacity::Dropless,
                Some((factor, min_capacity)) => Capacity::Factor {
                    factor,
                    min_capacity,
                },
            };
            check_plan(dev, (tokens, a, n, k), capacity, seed);
        },
    );
}

/// The dropless plans the counting sort leaves to the sort of three-word keys: more counts than
/// `COUNT_TABLE_MAX` (2¹⁸, `(n + 1)·⌈A/256⌉`): 12 chunks of 30,000 experts; and the counting
/// sort's chunks with few experts and many assignments (every expert in every chunk).
#[test]
fn dropless_dispatch_plans_of_many_experts_and_many_chunks() {
    let Some(dev) = gpu("dropless_dispatch_plans_of_many_experts_and_many_chunks") else {
        return;
    };
    for (i, sizes) in [
        (500, 3000, 30_000, 2),
        (4096, 65_537, 3, 2),
        (64, 1025, 300, 1),
    ]
    .into_iter()
    .enumerate()
    {
        check_plan(dev, sizes, Capacity::Dropless, 40 + i as u64);
    }
}

/// The counting sort's kernels past 65,535 workgroups: `plan_chunk_counts` (one workgroup per
/// chunk of 256 assignments) and `plan_place` (one invocation per assignment) fold their grids
/// at 65,535 · 256 + 1 assignments; over 2 experts the counts stay within `COUNT_TABLE_MAX`.
#[test]
fn fold_dispatch_plan_by_counting() {
    let Some(dev) = gpu("fold_dispatch_plan_by_counting") else {
        return;
    };
    let a = smallest_past_limit("dispatch plan chunks", |a| a.div_ceil(256));
    check_plan(dev, (100_000, a, 2, 2), Capacity::Dropless, 9);
}

// ---- grouped matmul -------------------------------------------------------------------------

/// `(row_expert, offsets)` for `counts[e]` rows of each expert, in order, every `drop`-th row
/// (when `drop > 0`) marked −1 as the plan marks rows dropped by capacity.
fn expert_rows(counts: &[usize], drop: usize) -> (Tensor, Tensor) {
    let mut rows = Vec::new();
    let mut offsets = vec![0i32];
    for (e, &c) in counts.iter().enumerate() {
        for _ in 0..c {
            let dropped = drop > 0 && rows.len() % drop == drop - 1;
            rows.push(if dropped { -1 } else { e as i32 });
        }
        offsets.push(rows.len() as i32);
    }
    let r = rows.len();
    (
        Tensor::from_i32(rows, &[r], Device::cpu()).unwrap(),
        Tensor::from_i32(offsets, &[counts.len() + 1], Device::cpu()).unwrap(),
    )
}

#[test]
fn grouped_matmul_matches_over_random_shapes() {
    let Some(dev) = gpu("grouped_matmul_matches_over_random_shapes") else {
        return;
    };
    let shapes = (
        prop::collection::vec(prop_oneof![Just(0usize), 1usize..=8, 62usize..=66], 1..=5),
        size_near(&[64]),
        size_near(&[64]),
        0usize..=4,
        any::<bool>(),
        any::<u64>(),
    );
    check_property(
        "grouped_matmul",
        10,
        shapes,
        |(counts, k, m, drop, bias, seed)| {
            let n = counts.len();
            let (row_expert, offsets) = expert_rows(&counts, drop);
            let rows = row_expert.numel();
            let mut v = Vals::new(seed);
            let mut inputs = vec![
                v.tensor(&[rows, k], -1.0, 1.0),
                v.tensor(&[n, k, m], -1.0, 1.0),
                row_expert,
                offsets,
            ];
            if bias {
                inputs.push(v.tensor(&[n, m], -1.0, 1.0));
            }
            parity_outputs(
                &format!(
                    "grouped_matmul counts {counts:?} k {k} m {m} drop every {drop} bias {bias}"
                ),
                dev,
                FUSED,
                |t| {
                    Ok(vec![t[0].grouped_matmul_with_bias(
                        &t[1],
                        t.get(4),
                        &t[2],
                        &t[3],
                    )?])
                },
                &inputs,
            );
        },
    );
}
