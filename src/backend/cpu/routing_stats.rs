//! The CPU end of `RoutingOps::routing_stats`: one training step's routing statistics added
//! into a window's sums (`moe::RoutingWindow::add`). The definitions and the layout of the sums
//! are in `shaders/routing_stats.wgsl`'s header; this file adds in the kernel's order (the
//! columns of `probs` in the same row groups, the 256 partials of the entropy, the squares and
//! the maximum in the same tree), so the two devices differ at most by their `ln`.

use crate::backend::RoutingStatsDims;

/// The invocations of the GPU kernel's one workgroup, whose order of additions this follows.
const WG: usize = 256;

/// The larger of `a` and `b`, NaN when either is NaN.
fn nan_max(a: f32, b: f32) -> f32 {
    if b.is_nan() || b > a { b } else { a }
}

/// Adds `values` (256 partials) in a tree, halving the stride, with `combine`; returns the
/// first.
fn tree(mut values: Vec<f32>, combine: impl Fn(f32, f32) -> f32) -> f32 {
    let mut stride = WG / 2;
    while stride > 0 {
        for i in 0..stride {
            values[i] = combine(values[i], values[i + stride]);
        }
        stride /= 2;
    }
    values[0]
}

/// `out [P + 2n + 3]` from the window's sums `acc` (zeros when `None`) and one step's `probs
/// [T, P]`, `logits [L]`, `routed [n]` and `kept [n]`; the operands' lengths are checked by the
/// caller.
pub(super) fn routing_stats(
    acc: Option<&[f32]>,
    probs: &[f32],
    logits: &[f32],
    (routed, kept): (&[f32], &[f32]),
    dims: RoutingStatsDims,
) -> Vec<f32> {
    let RoutingStatsDims {
        rows,
        cols,
        experts: n,
        ..
    } = dims;
    let before = |i: usize| acc.map_or(0.0, |a| a[i]);
    let mut out = vec![0.0f32; dims.out_len()];
    let mut entropy = vec![0.0f32; WG];
    for base in (0..cols).step_by(WG) {
        let chunk = (cols - base).min(WG);
        let groups = WG / chunk;
        let mut column_sums = vec![0.0f32; WG];
        for (j, sum) in column_sums.iter_mut().enumerate().take(groups * chunk) {
            let col = base + j % chunk;
            for t in (j / chunk..rows).step_by(groups) {
                let v = probs[t * cols + col];
                *sum += v;
                entropy[j] += v * (v + 1e-12).ln();
            }
        }
        for c in 0..chunk {
            let total = (0..groups).fold(0.0f32, |s, g| s + column_sums[c + g * chunk]);
            out[base + c] = before(base + c) + total;
        }
    }
    let mut squares = vec![0.0f32; WG];
    let mut maxima = vec![0.0f32; WG];
    for (i, &v) in logits.iter().enumerate() {
        squares[i % WG] += v * v;
        maxima[i % WG] = nan_max(maxima[i % WG], v.abs());
    }
    for e in 0..n {
        out[cols + e] = before(cols + e) + routed[e];
        out[cols + n + e] = before(cols + n + e) + kept[e];
    }
    let at = cols + 2 * n;
    out[at] = before(at) - tree(entropy, |a, b| a + b);
    out[at + 1] = before(at + 1) + tree(squares, |a, b| a + b);
    out[at + 2] = nan_max(before(at + 2), tree(maxima, nan_max));
    out
}
