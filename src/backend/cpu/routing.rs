//! The CPU kernels of the MoE routing primitives, the ends of `Tensor::topk_gate` (a top-k
//! router's softmax, selection and normalisation in one pass), of its backward rules, and of
//! `moe::DispatchPlan` (`CpuBackend::topk_gate`, `topk_gate_backward`, `softmax_forward`,
//! `softmax_backward`, `dispatch_plan`). The WGSL kernels of `shaders/routing.wgsl` compute the same things on the
//! GPU; both order values as `argsort` does (NaN as the smallest value, −0 as +0, ties by the
//! lowest index), so the two backends select the same experts and sort the same rows.

use super::{CpuBackend, f64b};
use super::{CpuBuffer, f32b, i32b, sort_key, sort_key_f32};
use crate::Error;
use crate::Result;
use crate::backend::PlanBuffers;
use crate::backend::checks::{
    check_balance_loss, check_dispatch_plan, check_routing_stats, check_topk_gate,
};
use crate::backend::{RoutingOps, RoutingStatsDims, check_gate_backward_lengths, check_gate_sizes};
use num_traits::Float;
use rayon::prelude::*;

/// Rows per rayon task (the per-row work is small: a few passes over `n` values).
const ROWS_PER_TASK: usize = 64;

/// The order key of a float, as `argsort` orders values (NaN as −∞, −0 as +0): in f32 for f32
/// buffers (the GPU's key), in f64 otherwise.
fn order_key<T: Float>(v: T) -> u64 {
    if std::mem::size_of::<T>() == 4 {
        sort_key_f32(v.to_f32().unwrap_or(f32::NAN)) as u64
    } else {
        sort_key(v.to_f64().unwrap_or(f64::NAN))
    }
}

/// Up to this k, [`top_k_columns`] keeps a sorted list of the best so far; above it, it sorts.
const INSERTION_MAX_K: usize = 16;

/// Leaves in `order` the columns of the `k` largest `scores`, descending by [`order_key`], ties
/// to the lower column: the first `k` of a stable descending sort. `keys` is scratch.
fn top_k_columns<T: Float>(scores: &[T], k: usize, order: &mut Vec<usize>, keys: &mut Vec<u64>) {
    order.clear();
    keys.clear();
    if k <= INSERTION_MAX_K {
        // each column in turn goes into the sorted list of the best so far; a later column
        // never beats an equal key, so only a strictly larger one moves in
        for (c, &sc) in scores.iter().enumerate() {
            let key = order_key(sc);
            if order.len() == k && key <= keys[k - 1] {
                continue;
            }
            let at = keys.iter().position(|&kk| kk < key).unwrap_or(keys.len());
            if order.len() == k {
                order.pop();
                keys.pop();
            }
            order.insert(at, c);
            keys.insert(at, key);
        }
        return;
    }
    keys.extend(scores.iter().map(|&v| order_key(v)));
    order.extend(0..scores.len());
    let cmp = |&a: &usize, &b: &usize| keys[b].cmp(&keys[a]).then_with(|| a.cmp(&b));
    if k < scores.len() {
        order.select_nth_unstable_by(k, cmp);
    }
    order[..k].sort_unstable_by(cmp);
    order.truncate(k);
}

/// `(probs, idx, weights)` of the fused top-k gate (see `RoutingOps::topk_gate`).
pub(super) fn topk_gate<T: Float + Send + Sync>(
    logits: &[T],
    scores: Option<&[T]>,
    (rows, n, k): (usize, usize, usize),
    renormalise: bool,
) -> (Vec<T>, Vec<i32>, Vec<T>) {
    let scores = scores.unwrap_or(logits);
    let mut probs = super::zeroed(rows * n);
    let mut idx = super::zeroed::<i32>(rows * k);
    let mut weights = super::zeroed(rows * k);
    let row_task = |r: usize,
                    p: &mut [T],
                    ix: &mut [i32],
                    w: &mut [T],
                    order: &mut Vec<usize>,
                    keys: &mut Vec<u64>| {
        softmax_row(&logits[r * n..(r + 1) * n], p);
        let s = &scores[r * n..(r + 1) * n];
        top_k_columns(s, k, order, keys);
        for (slot, &c) in ix.iter_mut().zip(order.iter()) {
            *slot = c as i32;
        }
        if renormalise {
            let top = order[..k]
                .iter()
                .fold(T::neg_infinity(), |a, &c| a.max(s[c]));
            let mut sum = T::zero();
            for (wj, &c) in w.iter_mut().zip(order.iter()) {
                *wj = (s[c] - top).exp();
                sum = sum + *wj;
            }
            for wj in w.iter_mut() {
                *wj = *wj / sum;
            }
        } else {
            for (wj, &c) in w.iter_mut().zip(order.iter()) {
                *wj = p[c];
            }
        }
    };
    probs
        .par_chunks_mut(n * ROWS_PER_TASK)
        .zip(idx.par_chunks_mut(k * ROWS_PER_TASK))
        .zip(weights.par_chunks_mut(k * ROWS_PER_TASK))
        .enumerate()
        .for_each(|(task, ((p, ix), w))| {
            let (mut order, mut keys) = (Vec::with_capacity(n), Vec::with_capacity(n));
            for (i, ((p, ix), w)) in p
                .chunks_mut(n)
                .zip(ix.chunks_mut(k))
                .zip(w.chunks_mut(k))
                .enumerate()
            {
                row_task(task * ROWS_PER_TASK + i, p, ix, w, &mut order, &mut keys);
            }
        });
    (probs, idx, weights)
}

/// The gradient of the gate's weights (see `RoutingOps::topk_gate_backward`), `[rows, n]`.
pub(super) fn topk_gate_backward<T: Float + Send + Sync>(
    weights: &[T],
    idx: &[i32],
    d_weights: &[T],
    probs: Option<&[T]>,
    (rows, n, k): (usize, usize, usize),
) -> Vec<T> {
    let mut out = super::zeroed(rows * n);
    out.par_chunks_mut(n).enumerate().for_each(|(r, d)| {
        let (w, ix, a) = (
            &weights[r * k..(r + 1) * k],
            &idx[r * k..(r + 1) * k],
            &d_weights[r * k..(r + 1) * k],
        );
        let dot = w.iter().zip(a).fold(T::zero(), |s, (&wj, &aj)| s + wj * aj);
        // the selected experts in range, with their weight and upstream gradient
        let selected = ix
            .iter()
            .zip(w.iter().zip(a))
            .filter_map(|(&c, (&wj, &aj))| {
                Some((usize::try_from(c).ok().filter(|&c| c < n)?, wj, aj))
            });
        match probs {
            None => {
                for (c, wj, aj) in selected {
                    d[c] = wj * (aj - dot);
                }
            }
            Some(p) => {
                let p = &p[r * n..(r + 1) * n];
                for (dc, &pc) in d.iter_mut().zip(p) {
                    *dc = -pc * dot;
                }
                for (c, _, aj) in selected {
                    d[c] = d[c] + p[c] * aj;
                }
            }
        }
    });
    out
}

/// `y = e^(x − m) / Σ e^(x − m)` for one row `x`, `m` its maximum: the softmax of
/// [`softmax_rows`] and of the top-k gate's probabilities.
fn softmax_row<T: Float>(x: &[T], y: &mut [T]) {
    let m = x.iter().fold(T::neg_infinity(), |a, &b| a.max(b));
    let mut total = T::zero();
    for (yc, &xc) in y.iter_mut().zip(x) {
        *yc = (xc - m).exp();
        total = total + *yc;
    }
    for yc in y.iter_mut() {
        *yc = *yc / total;
    }
}

/// The softmax of each row of `[rows, n]` (see `NnOps::softmax_forward`).
pub(super) fn softmax_rows<T: Float + Send + Sync>(x: &[T], n: usize) -> Vec<T> {
    let mut y = super::zeroed(x.len());
    y.par_chunks_mut(n * ROWS_PER_TASK)
        .zip(x.par_chunks(n * ROWS_PER_TASK))
        .for_each(|(y, x)| {
            for (y, x) in y.chunks_mut(n).zip(x.chunks(n)) {
                softmax_row(x, y);
            }
        });
    y
}

/// `y ⊙ (dy − Σ dy ⊙ y)` per row of `[rows, n]`.
pub(super) fn softmax_backward<T: Float + Send + Sync>(y: &[T], dy: &[T], n: usize) -> Vec<T> {
    let mut out = super::zeroed(y.len());
    out.par_chunks_mut(n).enumerate().for_each(|(r, d)| {
        let (y, g) = (&y[r * n..(r + 1) * n], &dy[r * n..(r + 1) * n]);
        let dot = y.iter().zip(g).fold(T::zero(), |s, (&a, &b)| s + a * b);
        for ((dc, &yc), &gc) in d.iter_mut().zip(y).zip(g) {
            *dc = yc * (gc - dot);
        }
    });
    out
}

/// `pending + out` elementwise when `pending` is given (a backward rule's output with the
/// gradient its input already has folded in, the bits of the tape's add), `out` otherwise.
///
/// # Errors
/// `pending` of another dtype or length than `out`.
pub(super) fn fold_pending(
    what: &str,
    out: CpuBuffer,
    pending: Option<&CpuBuffer>,
) -> Result<CpuBuffer> {
    fn add<T: Float>(out: &mut [T], p: &[T]) {
        for (o, &p) in out.iter_mut().zip(p) {
            *o = p + *o;
        }
    }
    let Some(p) = pending else {
        return Ok(out);
    };
    match (out, p) {
        // the output was just made: not shared, so make_mut copies nothing
        (CpuBuffer::F32(mut o), CpuBuffer::F32(p)) if o.len() == p.len() => {
            add(&mut std::sync::Arc::make_mut(&mut o)[..], p);
            Ok(CpuBuffer::F32(o))
        }
        (CpuBuffer::F64(mut o), CpuBuffer::F64(p)) if o.len() == p.len() => {
            add(&mut std::sync::Arc::make_mut(&mut o)[..], p);
            Ok(CpuBuffer::F64(o))
        }
        (o, p) => Err(Error::Shape(format!(
            "{what}: the pending gradient must be {} of {} values, got {} of {}",
            o.dtype(),
            o.len(),
            p.dtype(),
            p.len()
        ))),
    }
}

/// The dispatch plan (see `RoutingOps::dispatch_plan`).
pub(super) fn dispatch_plan<T: Float>(
    token: &[i32],
    expert: &[i32],
    (weight, rank, valid): (&[T], &[T], &[T]),
    n: usize,
    capacity: Option<usize>,
) -> PlanBuffers<CpuBuffer> {
    let a = token.len();
    let key = |i: usize| match usize::try_from(expert[i]) {
        Ok(e) if e < n && valid[i] != T::zero() => e,
        _ => n,
    };
    let keys: Vec<usize> = (0..a).map(key).collect();
    let mut counts = vec![0usize; n + 1];
    for &k in &keys {
        counts[k] += 1;
    }
    // A counting sort by expert (index order within an expert), then, where a capacity may drop
    // rows, each expert's rows sorted by rank ascending, weight descending (NaN last), index
    // ascending, with the keys computed once per row rather than once per comparison. A
    // dropless plan keeps index order. `start[e]` is where expert e's rows begin (the trash
    // expert n last).
    let mut start = vec![0usize; n + 2];
    for e in 0..=n {
        start[e + 1] = start[e] + counts[e];
    }
    let mut by_expert: Vec<(u64, std::cmp::Reverse<u64>, usize)> =
        vec![(0, std::cmp::Reverse(0), 0); a];
    let mut next = start.clone();
    for (i, &k) in keys.iter().enumerate() {
        by_expert[next[k]] = (
            order_key(rank[i]),
            std::cmp::Reverse(order_key(weight[i])),
            i,
        );
        next[k] += 1;
    }
    if capacity.is_some() {
        for e in 0..=n {
            // the index is part of the key, so no two keys are equal and an unstable sort is
            // exact
            by_expert[start[e]..start[e + 1]].sort_unstable();
        }
    }
    let order: Vec<usize> = by_expert.iter().map(|&(_, _, i)| i).collect();
    let offsets = &start[..=n];
    let cap = capacity.unwrap_or(usize::MAX);
    let mut row_token = Vec::with_capacity(a);
    let mut row_expert = Vec::with_capacity(a);
    let mut row_expert_clamped = Vec::with_capacity(a);
    let mut row_kept = Vec::with_capacity(a);
    for (s, &i) in order.iter().enumerate() {
        let k = keys[i];
        let kept = k < n && s - offsets[k] < cap;
        row_token.push(token[i]);
        row_expert.push(if kept { k as i32 } else { -1 });
        row_expert_clamped.push(k.min(n.max(1) - 1) as i32);
        row_kept.push(if kept { 1.0 } else { 0.0 });
    }
    let mut position = vec![0; a];
    for (s, &i) in order.iter().enumerate() {
        position[i] = s as i32;
    }
    PlanBuffers {
        order: i32b(order.iter().map(|&i| i as i32).collect()),
        position: i32b(position),
        row_token: i32b(row_token),
        row_expert: i32b(row_expert),
        row_expert_clamped: i32b(row_expert_clamped),
        row_kept: f32b(row_kept),
        offsets: i32b(offsets.iter().map(|&o| o as i32).collect()),
        kept_per_expert: f32b(counts[..n].iter().map(|&c| c.min(cap) as f32).collect()),
        routed_per_expert: f32b(counts[..n].iter().map(|&c| c as f32).collect()),
    }
}

impl RoutingOps for CpuBackend {
    fn weighted_scatter(
        &self,
        rows: (&CpuBuffer, Option<&CpuBuffer>),
        w: Option<&CpuBuffer>,
        idx: &CpuBuffer,
        sizes: (usize, usize),
        slots: Option<(&CpuBuffer, usize)>,
        slot_order: Option<&CpuBuffer>,
    ) -> Result<CpuBuffer> {
        super::moe_combine::weighted_scatter(rows, w, idx, sizes, slots, slot_order)
    }

    fn weighted_scatter_backward(
        &self,
        rows: &CpuBuffer,
        w: &CpuBuffer,
        idx: &CpuBuffer,
        dy: &CpuBuffer,
        sizes: (usize, usize),
        slot_order: Option<&CpuBuffer>,
    ) -> Result<(CpuBuffer, CpuBuffer)> {
        super::moe_combine::weighted_scatter_backward(rows, w, idx, dy, sizes, slot_order)
    }

    fn topk_gate(
        &self,
        logits: &CpuBuffer,
        scores: Option<&CpuBuffer>,
        rows: usize,
        n: usize,
        k: usize,
        renormalise: bool,
    ) -> Result<(CpuBuffer, CpuBuffer, CpuBuffer)> {
        const WHAT: &str = "topk_gate";
        let scores_buf = scores.unwrap_or(logits);
        check_topk_gate(WHAT, logits, scores_buf, (rows, n, k))?;
        let dims = (rows, n, k);
        match (logits, scores_buf) {
            (CpuBuffer::F32(l), CpuBuffer::F32(s)) => {
                let s = scores.map(|_| s.as_slice());
                let (p, i, w) = topk_gate(l, s, dims, renormalise);
                Ok((f32b(p), i32b(i), f32b(w)))
            }
            (CpuBuffer::F64(l), CpuBuffer::F64(s)) => {
                let s = scores.map(|_| s.as_slice());
                let (p, i, w) = topk_gate(l, s, dims, renormalise);
                Ok((f64b(p), i32b(i), f64b(w)))
            }
            (l, s) => Err(Error::DType(format!(
                "{WHAT} needs float logits and scores of one dtype, got {} and {}",
                l.dtype(),
                s.dtype()
            ))),
        }
    }

    fn topk_gate_backward(
        &self,
        weights: &CpuBuffer,
        idx: &CpuBuffer,
        d_weights: &CpuBuffer,
        (probs, pending): (Option<&CpuBuffer>, Option<&CpuBuffer>),
        (rows, n, k): (usize, usize, usize),
    ) -> Result<CpuBuffer> {
        const WHAT: &str = "topk_gate backward";
        check_gate_sizes(WHAT, rows, n, k)?;
        let idx = idx.indices(WHAT)?;
        let p_buf = probs.unwrap_or(weights);
        check_gate_backward_lengths(
            WHAT,
            [weights.len(), idx.len(), d_weights.len(), p_buf.len()],
            probs.is_some(),
            (rows, n, k),
        )?;
        let dims = (rows, n, k);
        let out = match (weights, d_weights, p_buf) {
            (CpuBuffer::F32(w), CpuBuffer::F32(a), CpuBuffer::F32(p)) => Ok(f32b(
                topk_gate_backward(w, idx, a, probs.map(|_| p.as_slice()), dims),
            )),
            (CpuBuffer::F64(w), CpuBuffer::F64(a), CpuBuffer::F64(p)) => Ok(f64b(
                topk_gate_backward(w, idx, a, probs.map(|_| p.as_slice()), dims),
            )),
            _ => Err(Error::DType(format!(
                "{WHAT} needs float weights, gradient and probabilities of one dtype, got {}, {}, {}",
                weights.dtype(),
                d_weights.dtype(),
                p_buf.dtype()
            ))),
        }?;
        fold_pending(WHAT, out, pending)
    }

    fn dispatch_plan(
        &self,
        token: &CpuBuffer,
        expert: &CpuBuffer,
        (weight, rank, valid): (&CpuBuffer, &CpuBuffer, &CpuBuffer),
        experts: usize,
        capacity: Option<usize>,
    ) -> Result<PlanBuffers<CpuBuffer>> {
        const WHAT: &str = "dispatch_plan";
        let (token_i, expert_i) = (token.indices(WHAT)?, expert.indices(WHAT)?);
        check_dispatch_plan(WHAT, token, [expert, weight, rank, valid], experts)?;
        let (token, expert) = (token_i, expert_i);
        match (weight, rank, valid) {
            (CpuBuffer::F32(w), CpuBuffer::F32(r), CpuBuffer::F32(v)) => {
                Ok(dispatch_plan(token, expert, (w, r, v), experts, capacity))
            }
            (CpuBuffer::F64(w), CpuBuffer::F64(r), CpuBuffer::F64(v)) => {
                Ok(dispatch_plan(token, expert, (w, r, v), experts, capacity))
            }
            _ => Err(Error::DType(format!(
                "{WHAT} needs float weight, rank and valid of one dtype, got {}, {}, {}",
                weight.dtype(),
                rank.dtype(),
                valid.dtype()
            ))),
        }
    }

    fn routing_stats(
        &self,
        acc: Option<&CpuBuffer>,
        (probs, logits): (&CpuBuffer, &CpuBuffer),
        (routed, kept): (&CpuBuffer, &CpuBuffer),
        dims: RoutingStatsDims,
    ) -> Result<CpuBuffer> {
        const WHAT: &str = "routing statistics";
        check_routing_stats(WHAT, acc, (probs, logits), (routed, kept), dims)?;
        fn f32s(b: &CpuBuffer) -> Result<&[f32]> {
            match b {
                CpuBuffer::F32(v) => Ok(v.as_slice()),
                other => Err(Error::DType(format!(
                    "{WHAT}: f32 expected, got {}",
                    other.dtype()
                ))),
            }
        }
        let acc = acc.map(f32s).transpose()?;
        Ok(f32b(super::router_sums::routing_stats(
            acc,
            f32s(probs)?,
            f32s(logits)?,
            (f32s(routed)?, f32s(kept)?),
            dims,
        )))
    }

    fn balance_loss(
        &self,
        probs: &CpuBuffer,
        counts: &CpuBuffer,
        sizes: (usize, usize),
        scale: f64,
    ) -> Result<(CpuBuffer, CpuBuffer)> {
        const WHAT: &str = "balance_loss";
        check_balance_loss(WHAT, probs, counts, sizes)?;
        match (probs, counts) {
            (CpuBuffer::F32(p), CpuBuffer::F32(c)) => {
                let (loss, coef) = super::router_sums::balance_loss(p, c, sizes, scale as f32);
                Ok((f32b(vec![loss]), f32b(coef)))
            }
            (CpuBuffer::F64(p), CpuBuffer::F64(c)) => {
                let (loss, coef) = super::router_sums::balance_loss(p, c, sizes, scale);
                Ok((f64b(vec![loss]), f64b(coef)))
            }
            (p, c) => Err(Error::DType(format!(
                "{WHAT}: f32 or f64 of one dtype, got {} and {}",
                p.dtype(),
                c.dtype()
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gate_selects_the_largest_with_ties_by_index_and_renormalises() {
        let logits = [1.0f64, 3.0, 3.0, f64::NAN, 0.5, 2.0];
        let (p, idx, w) = topk_gate(&logits[..3], None, (1, 3, 2), true);
        assert_eq!(idx, vec![1, 2]);
        assert!((w[0] - 0.5).abs() < 1e-15 && (w[1] - 0.5).abs() < 1e-15);
        let s: f64 = p.iter().sum();
        assert!((s - 1.0).abs() < 1e-15);
        // NaN sorts as the smallest value: never picked before a number
        let (_, idx, w) = topk_gate(&logits[3..], None, (1, 3, 2), false);
        assert_eq!(idx, vec![2, 1]);
        assert!(w.iter().all(|v| v.is_nan()), "the row's softmax is NaN");
    }

    #[test]
    fn plan_sorts_by_expert_rank_and_weight_and_applies_capacity() {
        // 4 assignments over 2 experts: (expert, weight, rank, valid)
        let token = [0, 0, 1, 1];
        let expert = [1, 0, 1, 1];
        let weight = [0.2f32, 0.8, 0.3, 0.9];
        let rank = [0.0f32, 1.0, 0.0, 1.0];
        let valid = [1.0f32, 1.0, 1.0, 0.0];
        let p = dispatch_plan(&token, &expert, (&weight, &rank, &valid), 2, Some(1));
        let ints = |b: &CpuBuffer| match b {
            CpuBuffer::I32(v) => v.to_vec(),
            other => panic!("expected i32, got {:?}", other.dtype()),
        };
        let floats = |b: &CpuBuffer| match b {
            CpuBuffer::F32(v) => v.to_vec(),
            other => panic!("expected f32, got {:?}", other.dtype()),
        };
        // expert 0: assignment 1; expert 1: rank 0 by weight desc: 2 (0.3) then 0 (0.2);
        // assignment 3 is invalid (trash)
        assert_eq!(ints(&p.order), vec![1, 2, 0, 3]);
        assert_eq!(ints(&p.row_token), vec![0, 1, 0, 1]);
        assert_eq!(ints(&p.row_expert), vec![0, 1, -1, -1]);
        assert_eq!(ints(&p.row_expert_clamped), vec![0, 1, 1, 1]);
        assert_eq!(floats(&p.row_kept), vec![1.0, 1.0, 0.0, 0.0]);
        assert_eq!(ints(&p.offsets), vec![0, 1, 3]);
        assert_eq!(floats(&p.kept_per_expert), vec![1.0, 1.0]);
        assert_eq!(floats(&p.routed_per_expert), vec![1.0, 2.0]);
    }

    #[test]
    fn dropless_plan_keeps_index_order_within_an_expert() {
        // the inputs of the test above, without a capacity: no priority, so expert 1's rows
        // are assignments 0 then 2 (index order), though 2 has the larger weight
        let token = [0, 0, 1, 1];
        let expert = [1, 0, 1, 1];
        let weight = [0.2f32, 0.8, 0.3, 0.9];
        let rank = [0.0f32, 1.0, 0.0, 1.0];
        let valid = [1.0f32, 1.0, 1.0, 0.0];
        let p = dispatch_plan(&token, &expert, (&weight, &rank, &valid), 2, None);
        let ints = |b: &CpuBuffer| match b {
            CpuBuffer::I32(v) => v.to_vec(),
            other => panic!("expected i32, got {:?}", other.dtype()),
        };
        assert_eq!(ints(&p.order), vec![1, 0, 2, 3]);
        assert_eq!(ints(&p.position), vec![1, 0, 2, 3]);
        assert_eq!(ints(&p.row_expert), vec![0, 1, 1, -1]);
        assert_eq!(ints(&p.offsets), vec![0, 1, 3]);
    }

    #[test]
    fn top_k_columns_are_the_first_k_of_a_stable_descending_sort() {
        use rand::{RngExt, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let (mut order, mut keys) = (Vec::new(), Vec::new());
        for n in [1usize, 2, 5, 16, 17, 40] {
            for _ in 0..20 {
                // few distinct values, so ties are common; NaN and both zeros among them
                let scores: Vec<f32> = (0..n)
                    .map(|_| match rng.random_range(0..8) {
                        0 => f32::NAN,
                        1 => -0.0,
                        2 => 0.0,
                        v => v as f32 - 4.0,
                    })
                    .collect();
                let mut sorted: Vec<usize> = (0..n).collect();
                sorted.sort_by_key(|&c| std::cmp::Reverse(order_key(scores[c])));
                for k in 1..=n {
                    top_k_columns(&scores, k, &mut order, &mut keys);
                    assert_eq!(order, sorted[..k], "n {n}, k {k}, scores {scores:?}");
                }
            }
        }
    }
}
