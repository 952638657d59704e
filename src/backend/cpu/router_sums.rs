//! The CPU ends of `RoutingOps::routing_stats` (one training step's routing statistics added
//! into a window's sums, `moe::RoutingWindow::add`) and `RoutingOps::balance_loss` (the Switch
//! balance loss' forward). The definitions are in `shaders/router_sums.wgsl`'s header; this file
//! adds in the kernels' order (the columns of `probs` in the same row groups, the 256 partials
//! of each scalar in the same tree), so the two devices differ at most by their `ln`.

use crate::backend::RoutingStatsDims;
use num_traits::Float;

/// The invocations of the GPU kernels' one workgroup, whose order of additions this follows.
const WG: usize = 256;

/// The larger of `a` and `b`, NaN when either is NaN.
fn nan_max(a: f32, b: f32) -> f32 {
    if b.is_nan() || b > a { b } else { a }
}

/// Combines `values` (256 partials) in a tree, halving the stride, with `combine`; returns the
/// first.
fn tree<T: Copy>(mut values: Vec<T>, combine: impl Fn(T, T) -> T) -> T {
    let mut stride = WG / 2;
    while stride > 0 {
        for i in 0..stride {
            values[i] = combine(values[i], values[i + stride]);
        }
        stride /= 2;
    }
    values[0]
}

/// The column sums of `probs [rows, cols]` as the kernels add them (by row groups per chunk of
/// 256 columns), each passed to `column(c, sum)` in order; `element(j, p)` sees every value
/// with the invocation `j` that reads it.
fn column_sums<T: Float>(
    probs: &[T],
    (rows, cols): (usize, usize),
    mut element: impl FnMut(usize, T),
    mut column: impl FnMut(usize, T),
) {
    for base in (0..cols).step_by(WG) {
        let chunk = (cols - base).min(WG);
        let groups = WG / chunk;
        let mut partials = [T::zero(); WG];
        for (j, sum) in partials.iter_mut().enumerate().take(groups * chunk) {
            let col = base + j % chunk;
            for t in (j / chunk..rows).step_by(groups) {
                let v = probs[t * cols + col];
                *sum = *sum + v;
                element(j, v);
            }
        }
        for c in 0..chunk {
            let total = (0..groups).fold(T::zero(), |s, g| s + partials[c + g * chunk]);
            column(base + c, total);
        }
    }
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
    let (cols, n) = (dims.cols, dims.experts);
    let before = |i: usize| acc.map_or(0.0, |a| a[i]);
    let mut out = vec![0.0f32; dims.out_len()];
    let mut entropy = vec![0.0f32; WG];
    column_sums(
        probs,
        (dims.rows, cols),
        |j, v| entropy[j] += v * (v + 1e-12).ln(),
        |c, total| out[c] = before(c) + total,
    );
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

/// The Switch balance loss of `probs [rows, cols]` for the assignment `counts [cols]`:
/// `(loss, coef)` with `coef[e] = scale·counts[e] / max(Σ counts, 1)` and `loss = Σ_e coef[e]·
/// Σ_t probs[t, e]` (its gradient with respect to `probs[t, e]`).
pub(super) fn balance_loss<T: Float>(
    probs: &[T],
    counts: &[T],
    (rows, cols): (usize, usize),
    scale: T,
) -> (T, Vec<T>) {
    let mut partials = vec![T::zero(); WG];
    for (e, &c) in counts.iter().enumerate() {
        partials[e % WG] = partials[e % WG] + c;
    }
    let total = tree(partials, |a, b| a + b).max(T::one());
    let mut coef = vec![T::zero(); cols];
    let mut terms = vec![T::zero(); WG];
    column_sums(
        probs,
        (rows, cols),
        |_, _| {},
        |c, sum| {
            coef[c] = scale * (counts[c] / total);
            terms[c % WG] = terms[c % WG] + coef[c] * sum;
        },
    );
    (tree(terms, |a, b| a + b), coef)
}
