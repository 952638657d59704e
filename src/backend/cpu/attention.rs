//! The CPU kernels of causal self-attention, the end of `Tensor::causal_attention` and of its
//! backward rule on the CPU (`CpuBackend::attention_forward` / `attention_backward`, and their
//! packed forms, which gather q, k and v from one `[batch, seq, 3, heads, head_dim]` buffer).
//!
//! Every (batch, head) pair is an independent `[T, Dh]` problem. Queries and keys are cut into
//! blocks of [`ATTENTION_BLOCK`] rows, and the scores are only ever held one block pair at a time
//! (`BLOCK × BLOCK` in a per-thread scratch), in the manner of FlashAttention-2:
//!
//! * **forward**, one task per (head, query block): for each key block at or before the query
//!   block (later ones are fully masked and skipped), `S = s·Q_i·K_jᵀ`, the causal mask on the
//!   diagonal block, the online softmax update (running row maximum `m` and sum `l`, the
//!   accumulated output rescaled by `e^{m_old − m_new}`) and `O_i += P·V_j`; at the end
//!   `O_i /= l` and the row log-sum-exp `lse = m + ln l` is saved for backward;
//! * **backward** recomputes each block's probabilities from the saved `lse`,
//!   `P = e^{s·Q_i·K_jᵀ − lse}`, and with `D = rowsum(dO ∘ O)` forms `dS = s·P ∘ (dO_i·V_jᵀ − D)`,
//!   then `dV_j += Pᵀ·dO_i`, `dK_j += dSᵀ·Q_i`, `dQ_i += dS·K_j`. With at least as many heads as
//!   threads one task per head runs every block pair once (the fused path); with fewer heads the
//!   work is split into one task per (head, key block) for `dK`, `dV` and one per (head, query
//!   block) for `dQ`, which recomputes the block scores twice but keeps every thread busy. Both
//!   paths add the same terms in the same order, so they give identical bits.
//!
//! The block products go through the `gemm` crate (`cpu/gemm.rs`). Measured on the 2-core
//! development machine (f32, forward + backward, B·H = 48, T = 64, Dh = 32): 1.4–2.2 ms with
//! `gemm`, 9.2–9.7 ms with plain loops (`examples/attention_bench.rs`); blocks of 16 and 64 rows
//! were no faster than 32 (measured again on its AVX-512 processor: 1.28, 1.00 and 0.97 ms for
//! blocks of 16, 64 and 32). Scale `s = 1/√Dh`.

use super::buffer_pool;
use super::elementwise::strided_copy;
use super::fast_math::ExpFloat;
use super::gemm::{Mat, MatIn, gemm};
use super::{CpuBuffer, f32b, f64b};
use crate::backend::checks::{check_attention_lengths, check_lse_length, check_packed_qkv_length};
use crate::backend::{AttentionDims, AttentionGradOperands, PackedAttentionDims};
use crate::{Error, Result};
use num_traits::Float;
use rayon::prelude::*;

/// Rows of queries (and of keys) per block of the CPU kernels: the scores are computed
/// `ATTENTION_BLOCK × ATTENTION_BLOCK` at a time.
pub(crate) const ATTENTION_BLOCK: usize = 32;

/// `dst = beta·A·B` (or `dst += beta·A·B` with `accumulate`), `A: m×k`, `B: k×n`, `dst` row-major
/// `m×n` with rows `n` apart. Single-threaded: the callers already run one block per thread.
fn gemm_block<T: Float + 'static>(
    dst: &mut [T],
    a: MatIn<T>,
    b: MatIn<T>,
    (m, k, n): (usize, usize, usize),
    accumulate: bool,
    beta: T,
) {
    gemm(
        (dst, Mat::rows(0, n)),
        a,
        b,
        (m, k, n),
        accumulate,
        beta,
        ::gemm::Parallelism::None,
    );
}

/// One (batch, head) pair's slices: `[T, Dh]` matrices and `[T]` row vectors.
struct Head<'a, T> {
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
    /// the upstream gradient dO (backward only)
    d_o: &'a [T],
    /// the forward's row log-sum-exp (backward only)
    lse: &'a [T],
    /// `D = rowsum(dO ∘ O)` (backward only)
    delta: &'a [T],
    seq: usize,
    dh: usize,
    scale: T,
}

/// Per-thread scratch: one block of scores and one of their gradients, and the online-softmax
/// row statistics.
struct Scratch<T> {
    /// scores, then probabilities P
    p: Vec<T>,
    /// dP = dO·Vᵀ, then dS
    ds: Vec<T>,
    /// running row maximum
    m: Vec<T>,
    /// running row sum of e^{S − m}
    l: Vec<T>,
}

impl<T: Float> Scratch<T> {
    fn new() -> Scratch<T> {
        Scratch {
            p: vec![T::zero(); ATTENTION_BLOCK * ATTENTION_BLOCK],
            ds: vec![T::zero(); ATTENTION_BLOCK * ATTENTION_BLOCK],
            m: vec![T::zero(); ATTENTION_BLOCK],
            l: vec![T::zero(); ATTENTION_BLOCK],
        }
    }
}

/// Query rows `i0..i0+rows` and key rows `j0..j0+cols` of a block pair.
#[derive(Clone, Copy)]
struct Block {
    i0: usize,
    rows: usize,
    j0: usize,
    cols: usize,
}

impl Block {
    fn new(qb: usize, kb: usize, seq: usize) -> Block {
        let (i0, j0) = (qb * ATTENTION_BLOCK, kb * ATTENTION_BLOCK);
        Block {
            i0,
            rows: ATTENTION_BLOCK.min(seq - i0),
            j0,
            cols: ATTENTION_BLOCK.min(seq - j0),
        }
    }
    /// How many keys of this block query row `r` sees (the causal mask: key ≤ query).
    fn visible(&self, r: usize) -> usize {
        (self.i0 + r + 1).saturating_sub(self.j0).min(self.cols)
    }
}

/// Number of blocks covering `seq` rows.
fn blocks(seq: usize) -> usize {
    seq.div_ceil(ATTENTION_BLOCK)
}

/// The scale `1/√Dh` in `T`.
fn scale_of<T: Float>(d: AttentionDims) -> T {
    T::from(d.scale()).unwrap_or_else(T::nan)
}

/// Forward: `(o [heads, seq, dh], lse [heads, seq])`. Inputs are `[heads, seq, dh]` slices of
/// exactly `d.elements()` elements (checked by the caller); sizes ≥ 1.
pub(super) fn forward<T: ExpFloat>(
    q: &[T],
    k: &[T],
    v: &[T],
    d: AttentionDims,
) -> (Vec<T>, Vec<T>) {
    let (seq, dh) = (d.seq, d.head_dim);
    let mat = seq * dh;
    let mut o = super::zeroed(d.heads * mat);
    let mut lse = super::zeroed(d.heads * seq);
    let scale = scale_of(d);
    o.par_chunks_mut(mat)
        .zip(lse.par_chunks_mut(seq))
        .enumerate()
        .for_each(|(h, (o_h, lse_h))| {
            let head = Head {
                q: &q[h * mat..(h + 1) * mat],
                k: &k[h * mat..(h + 1) * mat],
                v: &v[h * mat..(h + 1) * mat],
                d_o: &[],
                lse: &[],
                delta: &[],
                seq,
                dh,
                scale,
            };
            // Query blocks in parallel too, so that a few long heads still use every thread.
            o_h.par_chunks_mut(ATTENTION_BLOCK * dh)
                .zip(lse_h.par_chunks_mut(ATTENTION_BLOCK))
                .enumerate()
                .for_each_init(Scratch::new, |s, (qb, (o_i, lse_i))| {
                    forward_block(&head, qb, o_i, lse_i, s)
                });
        });
    (o, lse)
}

/// One query block of the forward pass: `o_i` (zeroed, `[rows, dh]`) and `lse_i` (`[rows]`).
fn forward_block<T: ExpFloat>(
    hd: &Head<T>,
    qb: usize,
    o_i: &mut [T],
    lse_i: &mut [T],
    s: &mut Scratch<T>,
) {
    let dh = hd.dh;
    let rows = lse_i.len();
    let (m, l) = (&mut s.m[..rows], &mut s.l[..rows]);
    m.fill(T::neg_infinity());
    l.fill(T::zero());
    // Key blocks after the query block see only future keys: skipped.
    for kb in 0..=qb {
        let b = Block::new(qb, kb, hd.seq);
        let cols = b.cols;
        let p = &mut s.p[..rows * cols];
        gemm_block(
            p,
            MatIn::rows(hd.q, b.i0, dh),
            MatIn::rows(hd.k, b.j0, dh).t(),
            (rows, dh, cols),
            false,
            hd.scale,
        );
        for r in 0..rows {
            let (seen, hidden) = p[r * cols..(r + 1) * cols].split_at_mut(b.visible(r));
            hidden.fill(T::zero());
            // every row sees key j0 ≤ its query in every block visited, so the maximum is finite
            let new_max = seen.iter().fold(m[r], |a, &x| a.max(x));
            seen.iter_mut().for_each(|x| *x = (*x - new_max).exp_fast());
            let sum = seen.iter().fold(T::zero(), |a, &x| a + x);
            let rescale = (m[r] - new_max).exp(); // 0 on the first block (m = −∞)
            l[r] = l[r] * rescale + sum;
            m[r] = new_max;
            if kb > 0 && rescale != T::one() {
                o_i[r * dh..(r + 1) * dh]
                    .iter_mut()
                    .for_each(|x| *x = *x * rescale);
            }
        }
        gemm_block(
            o_i,
            MatIn::rows(p, 0, cols),
            MatIn::rows(hd.v, b.j0, dh),
            (rows, cols, dh),
            true,
            T::one(),
        );
    }
    for r in 0..rows {
        let inv = l[r].recip();
        o_i[r * dh..(r + 1) * dh]
            .iter_mut()
            .for_each(|x| *x = *x * inv);
        lse_i[r] = m[r] + l[r].ln();
    }
}

/// `NnOps::attention_backward` on the CPU: checks the operands' lengths against `dims` and
/// their dtypes, then runs [`backward`] in f32 or f64.
pub(super) fn backward_buffers(
    operands: AttentionGradOperands<'_, CpuBuffer>,
    dims: AttentionDims,
) -> Result<(CpuBuffer, CpuBuffer, CpuBuffer)> {
    const WHAT: &str = "attention_backward";
    let AttentionGradOperands {
        q,
        k,
        v,
        o,
        lse,
        d_o,
    } = operands;
    check_attention_lengths(
        WHAT,
        &[("q", q), ("k", k), ("v", v), ("o", o), ("dO", d_o)],
        dims,
    )?;
    check_lse_length(WHAT, lse, dims)?;
    match (q, k, v, o, lse, d_o) {
        (
            CpuBuffer::F32(q),
            CpuBuffer::F32(k),
            CpuBuffer::F32(v),
            CpuBuffer::F32(o),
            CpuBuffer::F32(lse),
            CpuBuffer::F32(d_o),
        ) => {
            let operands = AttentionGradOperands {
                q: &q[..],
                k: &k[..],
                v: &v[..],
                o: &o[..],
                lse: &lse[..],
                d_o: &d_o[..],
            };
            let (dq, dk, dv) = backward(operands, dims);
            Ok((f32b(dq), f32b(dk), f32b(dv)))
        }
        (
            CpuBuffer::F64(q),
            CpuBuffer::F64(k),
            CpuBuffer::F64(v),
            CpuBuffer::F64(o),
            CpuBuffer::F64(lse),
            CpuBuffer::F64(d_o),
        ) => {
            let operands = AttentionGradOperands {
                q: &q[..],
                k: &k[..],
                v: &v[..],
                o: &o[..],
                lse: &lse[..],
                d_o: &d_o[..],
            };
            let (dq, dk, dv) = backward(operands, dims);
            Ok((f64b(dq), f64b(dk), f64b(dv)))
        }
        _ => Err(Error::DType(format!(
            "{WHAT} needs float buffers of one dtype, got q {}, k {}, v {}, o {}, lse {}, dO {}",
            q.dtype(),
            k.dtype(),
            v.dtype(),
            o.dtype(),
            lse.dtype(),
            d_o.dtype()
        ))),
    }
}

/// `NnOps::attention_forward_packed` on the CPU: `qkv` `[batch, seq, 3, heads, head_dim]` is
/// gathered into `[3, batch, heads, seq, head_dim]` (one pass over it), [`forward`] runs on the
/// three parts, and `o` is scattered to `[batch, seq, heads, head_dim]`. The GPU kernels read
/// the packed layout in place; on the CPU the two copies are O(T) work per element beside
/// attention's O(T²), and keep one set of block kernels.
pub(super) fn forward_packed_buffer(
    qkv: &CpuBuffer,
    dims: PackedAttentionDims,
) -> Result<(CpuBuffer, CpuBuffer)> {
    const WHAT: &str = "attention_forward_packed";
    check_packed_qkv_length(WHAT, qkv, dims)?;
    match qkv {
        CpuBuffer::F32(x) => {
            let (o, lse) = packed_forward(x, dims);
            Ok((f32b(o), f32b(lse)))
        }
        CpuBuffer::F64(x) => {
            let (o, lse) = packed_forward(x, dims);
            Ok((f64b(o), f64b(lse)))
        }
        _ => Err(Error::DType(format!(
            "{WHAT} needs a float qkv, got {}",
            qkv.dtype()
        ))),
    }
}

/// `NnOps::attention_backward_packed` on the CPU: [`backward`] on `qkv`, `o` and `dO` gathered
/// as in [`forward_packed_buffer`], the gradients scattered back packed like `qkv`.
pub(super) fn backward_packed_buffers(
    qkv: &CpuBuffer,
    (o, lse, d_o): (&CpuBuffer, &CpuBuffer, &CpuBuffer),
    dims: PackedAttentionDims,
) -> Result<CpuBuffer> {
    const WHAT: &str = "attention_backward_packed";
    check_packed_qkv_length(WHAT, qkv, dims)?;
    check_attention_lengths(WHAT, &[("o", o), ("dO", d_o)], dims.flat())?;
    check_lse_length(WHAT, lse, dims.flat())?;
    match (qkv, o, lse, d_o) {
        (CpuBuffer::F32(x), CpuBuffer::F32(o), CpuBuffer::F32(lse), CpuBuffer::F32(d_o)) => {
            Ok(f32b(packed_backward(x, (o, lse, d_o), dims)))
        }
        (CpuBuffer::F64(x), CpuBuffer::F64(o), CpuBuffer::F64(lse), CpuBuffer::F64(d_o)) => {
            Ok(f64b(packed_backward(x, (o, lse, d_o), dims)))
        }
        _ => Err(Error::DType(format!(
            "{WHAT} needs float buffers of one dtype, got qkv {}, o {}, lse {}, dO {}",
            qkv.dtype(),
            o.dtype(),
            lse.dtype(),
            d_o.dtype()
        ))),
    }
}

/// Which way [`repack_qkv`] copies.
#[derive(Clone, Copy)]
enum Repack {
    /// `[batch, seq, 3, heads, head_dim]` → `[3, batch, heads, seq, head_dim]`: q, k and v each
    /// `[batch·heads, seq, head_dim]`, one after another (what [`forward`] and [`backward`] take)
    ToParts,
    /// the inverse, for the gradient
    ToPacked,
}

/// A copy of `x` (q, k, v or their gradients) in the other layout of the two `way` names.
fn repack_qkv<T: Copy + Send + Sync>(x: &[T], d: PackedAttentionDims, way: Repack) -> Vec<T> {
    let PackedAttentionDims {
        batch: b,
        heads: h,
        seq: t,
        head_dim: dh,
    } = d;
    match way {
        Repack::ToParts => {
            let row = 3 * h * dh; // elements from one position to the next
            strided_copy(x, &[3, b, h, t, dh], &[h * dh, t * row, dh, row, 1])
        }
        Repack::ToPacked => {
            let part = b * h * t * dh;
            strided_copy(x, &[b, t, 3, h, dh], &[h * t * dh, dh, part, t * dh, 1])
        }
    }
}

/// `[batch, seq, heads, head_dim]` ↔ `[batch, heads, seq, head_dim]` (the swap of the middle
/// two axes is its own inverse in shape terms: `(n1, n2)` are the input's middle sizes).
fn swap_middle<T: Copy + Send + Sync>(
    x: &[T],
    b: usize,
    (n1, n2): (usize, usize),
    dh: usize,
) -> Vec<T> {
    strided_copy(x, &[b, n2, n1, dh], &[n1 * n2 * dh, dh, n2 * dh, 1])
}

/// [`forward`] on the packed layout: `(o [batch, seq, heads, head_dim], lse)`.
fn packed_forward<T: ExpFloat>(qkv: &[T], d: PackedAttentionDims) -> (Vec<T>, Vec<T>) {
    let gathered = repack_qkv(qkv, d, Repack::ToParts);
    let [q, k, v] = parts(&gathered);
    let (o, lse) = forward(q, k, v, d.flat());
    // o [batch, heads, seq, dh] → [batch, seq, heads, dh]
    let out = swap_middle(&o, d.batch, (d.heads, d.seq), d.head_dim);
    buffer_pool::give(o);
    buffer_pool::give(gathered);
    (out, lse)
}

/// q, k and v: the three equal parts of a gathered `qkv`.
fn parts<T>(qkv: &[T]) -> [&[T]; 3] {
    let n = qkv.len() / 3;
    [&qkv[..n], &qkv[n..2 * n], &qkv[2 * n..]]
}

/// [`backward`] on the packed layout, into one vector packed like `qkv`.
fn packed_backward<T: ExpFloat>(
    qkv: &[T],
    (o, lse, d_o): (&[T], &[T], &[T]),
    d: PackedAttentionDims,
) -> Vec<T> {
    let gathered = repack_qkv(qkv, d, Repack::ToParts);
    let [q, k, v] = parts(&gathered);
    // o and dO [batch, seq, heads, dh] → [batch, heads, seq, dh]
    let o = swap_middle(o, d.batch, (d.seq, d.heads), d.head_dim);
    let d_o = swap_middle(d_o, d.batch, (d.seq, d.heads), d.head_dim);
    let operands = AttentionGradOperands {
        q,
        k,
        v,
        o: &o,
        lse,
        d_o: &d_o,
    };
    let mut grad = super::zeroed(qkv.len());
    let (dq, dkv) = grad.split_at_mut(q.len());
    let (dk, dv) = dkv.split_at_mut(q.len());
    backward_into(operands, d.flat(), [dq, dk, dv]);
    let packed = repack_qkv(&grad, d, Repack::ToPacked);
    for v in [grad, gathered, o, d_o] {
        buffer_pool::give(v);
    }
    packed
}

/// Backward: `(dq, dk, dv)`, each `[heads, seq, dh]`. Inputs are slices of exactly the sizes
/// `d` gives (checked by the caller); sizes ≥ 1.
pub(super) fn backward<T: ExpFloat>(
    operands: AttentionGradOperands<'_, [T]>,
    d: AttentionDims,
) -> (Vec<T>, Vec<T>, Vec<T>) {
    let n = d.heads * d.seq * d.head_dim;
    let (mut dq, mut dk, mut dv) = (super::zeroed(n), super::zeroed(n), super::zeroed(n));
    backward_into(operands, d, [&mut dq, &mut dk, &mut dv]);
    (dq, dk, dv)
}

/// [`backward`] into `[dq, dk, dv]` (zeroed, `[heads, seq, dh]` each).
fn backward_into<T: ExpFloat>(
    operands: AttentionGradOperands<'_, [T]>,
    d: AttentionDims,
    [dq, dk, dv]: [&mut [T]; 3],
) {
    let AttentionGradOperands {
        q,
        k,
        v,
        o,
        lse,
        d_o,
    } = operands;
    let (seq, dh) = (d.seq, d.head_dim);
    let mat = seq * dh;
    // D_i = Σ_c dO_ic·O_ic, one per query row
    let delta: Vec<T> = d_o
        .par_chunks(dh)
        .zip(o.par_chunks(dh))
        .map(|(g, y)| g.iter().zip(y).fold(T::zero(), |acc, (&g, &y)| acc + g * y))
        .collect();
    let scale = scale_of(d);
    let head = |h: usize| Head {
        q: &q[h * mat..(h + 1) * mat],
        k: &k[h * mat..(h + 1) * mat],
        v: &v[h * mat..(h + 1) * mat],
        d_o: &d_o[h * mat..(h + 1) * mat],
        lse: &lse[h * seq..(h + 1) * seq],
        delta: &delta[h * seq..(h + 1) * seq],
        seq,
        dh,
        scale,
    };
    let nb = blocks(seq);
    if d.heads >= rayon::current_num_threads() {
        // Fused: one task per head computes each block pair's P and dS once and uses them for
        // all three gradients.
        dq.par_chunks_mut(mat)
            .zip(dk.par_chunks_mut(mat))
            .zip(dv.par_chunks_mut(mat))
            .enumerate()
            .for_each_init(Scratch::new, |s, (h, ((dq_h, dk_h), dv_h))| {
                let hd = head(h);
                for kb in 0..nb {
                    let (j0, j1) = (
                        kb * ATTENTION_BLOCK * dh,
                        ((kb + 1) * ATTENTION_BLOCK).min(seq) * dh,
                    );
                    for qb in kb..nb {
                        let b = block_grads(&hd, qb, kb, s);
                        let i0 = qb * ATTENTION_BLOCK * dh;
                        key_grads(&hd, b, s, &mut dk_h[j0..j1], &mut dv_h[j0..j1]);
                        query_grads(&hd, b, s, &mut dq_h[i0..i0 + b.rows * dh]);
                    }
                }
            });
    } else {
        // Few heads: dK and dV per (head, key block), dQ per (head, query block).
        dk.par_chunks_mut(mat)
            .zip(dv.par_chunks_mut(mat))
            .enumerate()
            .for_each(|(h, (dk_h, dv_h))| {
                let hd = head(h);
                dk_h.par_chunks_mut(ATTENTION_BLOCK * dh)
                    .zip(dv_h.par_chunks_mut(ATTENTION_BLOCK * dh))
                    .enumerate()
                    .for_each_init(Scratch::new, |s, (kb, (dk_j, dv_j))| {
                        for qb in kb..nb {
                            let b = block_grads(&hd, qb, kb, s);
                            key_grads(&hd, b, s, dk_j, dv_j);
                        }
                    });
            });
        dq.par_chunks_mut(mat).enumerate().for_each(|(h, dq_h)| {
            let hd = head(h);
            dq_h.par_chunks_mut(ATTENTION_BLOCK * dh)
                .enumerate()
                .for_each_init(Scratch::new, |s, (qb, dq_i)| {
                    for kb in 0..=qb {
                        let b = block_grads(&hd, qb, kb, s);
                        query_grads(&hd, b, s, dq_i);
                    }
                });
        });
    }
}

/// Recomputes block pair (`qb`, `kb`)'s probabilities `P = e^{s·Q_i·K_jᵀ − lse_i}` (0 where
/// masked) into `s.p` and its score gradient `dS = s·P ∘ (dO_i·V_jᵀ − D_i)` into `s.ds`, both
/// `[rows, cols]`. The scale of the scores is folded into `dS`, so the products that use it need
/// none.
fn block_grads<T: ExpFloat>(hd: &Head<T>, qb: usize, kb: usize, s: &mut Scratch<T>) -> Block {
    let b = Block::new(qb, kb, hd.seq);
    let (rows, cols, dh) = (b.rows, b.cols, hd.dh);
    let p = &mut s.p[..rows * cols];
    let ds = &mut s.ds[..rows * cols];
    gemm_block(
        p,
        MatIn::rows(hd.q, b.i0, dh),
        MatIn::rows(hd.k, b.j0, dh).t(),
        (rows, dh, cols),
        false,
        hd.scale,
    );
    gemm_block(
        ds,
        MatIn::rows(hd.d_o, b.i0, dh),
        MatIn::rows(hd.v, b.j0, dh).t(),
        (rows, dh, cols),
        false,
        T::one(),
    );
    for r in 0..rows {
        let (lse, delta) = (hd.lse[b.i0 + r], hd.delta[b.i0 + r]);
        let seen = b.visible(r);
        let (p_seen, p_hidden) = p[r * cols..(r + 1) * cols].split_at_mut(seen);
        let (ds_seen, ds_hidden) = ds[r * cols..(r + 1) * cols].split_at_mut(seen);
        for (pc, dc) in p_seen.iter_mut().zip(ds_seen.iter_mut()) {
            *pc = (*pc - lse).exp_fast();
            *dc = *pc * (*dc - delta) * hd.scale;
        }
        p_hidden.fill(T::zero());
        ds_hidden.fill(T::zero());
    }
    b
}

/// `dK_j += dSᵀ·Q_i` and `dV_j += Pᵀ·dO_i` for the block pair `block_grads` just computed;
/// `dk_j`, `dv_j` are key block j's `[cols, dh]` rows.
fn key_grads<T: Float + 'static>(
    hd: &Head<T>,
    b: Block,
    s: &Scratch<T>,
    dk_j: &mut [T],
    dv_j: &mut [T],
) {
    let (rows, cols, dh) = (b.rows, b.cols, hd.dh);
    let p = MatIn::rows(&s.p[..rows * cols], 0, cols).t();
    let ds = MatIn::rows(&s.ds[..rows * cols], 0, cols).t();
    gemm_block(
        dv_j,
        p,
        MatIn::rows(hd.d_o, b.i0, dh),
        (cols, rows, dh),
        true,
        T::one(),
    );
    gemm_block(
        dk_j,
        ds,
        MatIn::rows(hd.q, b.i0, dh),
        (cols, rows, dh),
        true,
        T::one(),
    );
}

/// `dQ_i += dS·K_j` for the block pair `block_grads` just computed; `dq_i` is query block i's
/// `[rows, dh]` rows.
fn query_grads<T: Float + 'static>(hd: &Head<T>, b: Block, s: &Scratch<T>, dq_i: &mut [T]) {
    let (rows, cols, dh) = (b.rows, b.cols, hd.dh);
    let ds = MatIn::rows(&s.ds[..rows * cols], 0, cols);
    gemm_block(
        dq_i,
        ds,
        MatIn::rows(hd.k, b.j0, dh),
        (rows, cols, dh),
        true,
        T::one(),
    );
}
