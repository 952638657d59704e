//! The grouped (per-expert) matrix products of an MoE expert bank: `grouped_matmul`
//! (`y[r] = x[r]·W[row_expert[r]]`, rows sorted by expert) and the weight gradient
//! `dW[e] = Σ_{rows r of e} x[r]ᵀ·dy[r]` ([`WeightGradProblem`]), written straight into
//! uninitialised output through [`gemm_uninit`] (`cpu/gemm.rs`), in parallel by expert or by
//! row block.

use super::gemm::{Mat, MatIn, gemm_uninit};
use super::optim::{AdamConsts, OPT_CHUNK, Wide, adam_chunk_wide};
use super::{CpuBuffer, buffer_pool, zeroed};
use crate::backend::GroupedMatmulDims;
use crate::{Error, Result};
use num_traits::Float;
use rayon::prelude::*;
use std::mem::MaybeUninit;

/// Contiguous runs of rows with one expert: `(expert, first_row, end_row)`.
pub(super) fn expert_runs(row_expert: &[i32], experts: usize) -> Vec<(usize, usize, usize)> {
    let mut runs = Vec::new();
    let mut start = 0;
    while start < row_expert.len() {
        let e = row_expert[start];
        let mut end = start + 1;
        while end < row_expert.len() && row_expert[end] == e {
            end += 1;
        }
        if e >= 0 && (e as usize) < experts {
            runs.push((e as usize, start, end));
        }
        start = end;
    }
    runs
}

/// With many small per-expert products, threads take whole experts (each GEMM single-threaded);
/// with few large ones, each GEMM uses every thread.
pub(super) fn per_expert_parallel(runs: usize) -> bool {
    runs >= 2 * rayon::current_num_threads()
}

/// One task of the grouped matmul: a block of rows of one expert (GEMM), or a gap of rows
/// with no expert (zeros).
pub(super) enum RowTask<'a, T> {
    Gemm(usize, usize, &'a mut [MaybeUninit<T>]),
    Zeros(&'a mut [MaybeUninit<T>]),
}

/// `out[r] = x[r]·W[e_r] (+ bias[e_r])`, zeros for rows without an expert; see
/// [`crate::backend::MatmulOps::grouped_matmul`].
pub(super) fn grouped_matmul_kernel<T: Float + Send + Sync + 'static>(
    x: &[T],
    w: &[T],
    bias: Option<&[T]>,
    row_expert: &[i32],
    dims: GroupedMatmulDims,
) -> Vec<T> {
    let GroupedMatmulDims {
        rows,
        k,
        m,
        experts,
        transpose_w,
    } = dims;
    let len = rows * m;
    let mut out: Vec<T> = buffer_pool::take(len).unwrap_or_else(|_| Vec::with_capacity(len));
    // One GEMM per block of rows that share an expert (rows arrive sorted by expert), written
    // into that block's own slice of the output. Long runs are cut into blocks so that the
    // threads take whole single-threaded GEMMs: measured on 2 cores, that is faster than one
    // GEMM split by `gemm`'s own threading, and it serves many small experts alike. The output
    // is not zeroed first: the blocks and the gaps between them (rows with no expert, set to
    // zero) cover every row exactly once.
    let runs = expert_runs(&row_expert[..rows.min(row_expert.len())], experts);
    let block = row_block(rows);
    let mut tasks: Vec<RowTask<T>> = Vec::with_capacity(2 * runs.len() + 1);
    let mut rest: &mut [MaybeUninit<T>] = &mut out.spare_capacity_mut()[..len];
    let mut at = 0;
    for &(e, r0, r1) in &runs {
        let (gap, tail) = std::mem::take(&mut rest).split_at_mut((r0 - at) * m);
        if !gap.is_empty() {
            tasks.push(RowTask::Zeros(gap));
        }
        rest = tail;
        let mut b0 = r0;
        while b0 < r1 {
            let b1 = (b0 + block).min(r1);
            let (part, tail) = std::mem::take(&mut rest).split_at_mut((b1 - b0) * m);
            tasks.push(RowTask::Gemm(e, b0, part));
            rest = tail;
            b0 = b1;
        }
        at = r1;
    }
    if !rest.is_empty() {
        tasks.push(RowTask::Zeros(rest));
    }
    let (rs, cs) = if transpose_w { (1, k) } else { (m, 1) };
    let one = |task: RowTask<T>| match task {
        RowTask::Zeros(part) => part.fill(MaybeUninit::new(T::zero())),
        RowTask::Gemm(e, r0, part) => {
            // rows r0.. of x [rows, k]; expert e's weight [k, m] (read transposed from [m, k])
            let x_rows = MatIn::rows(x, r0, k);
            let w_e = Mat {
                offset: e * k * m,
                rs,
                cs,
            }
            .over(w);
            let r = part.len() / m.max(1);
            // With a bias, each row starts as its expert's bias and the product is added to it
            // (the GEMM's own accumulation: no second pass over the rows).
            if let Some(b) = bias {
                let b = &b[e * m..(e + 1) * m];
                for row in part.chunks_exact_mut(m.max(1)) {
                    for (o, &v) in row.iter_mut().zip(b) {
                        *o = MaybeUninit::new(v);
                    }
                }
            }
            // SAFETY: without a bias there is no accumulation, so `part` may be uninitialised;
            // with one, every element of `part` was initialised just above.
            unsafe {
                gemm_uninit(
                    (part, Mat::rows(0, m)),
                    x_rows,
                    w_e,
                    (r, k, m),
                    bias.is_some(),
                    T::one(),
                    ::gemm::Parallelism::None,
                )
            };
        }
    };
    // one job per task: experts' row counts differ, and rayon's default split of the list into a
    // few contiguous runs of tasks leaves one thread idle at the end (measured on 2 threads with
    // a realistic spread of 16 experts' rows: 166 against 207 GFLOP/s)
    tasks.into_par_iter().with_max_len(1).for_each(one);
    // SAFETY: the tasks covered all `len` elements (gaps, then each run's blocks, then the
    // tail), and each wrote every element of its slice.
    unsafe { out.set_len(len) };
    out
}

/// Rows per task of the grouped matmul: about four tasks per thread over `rows`, at least 64
/// rows (below that a GEMM is mostly packing).
pub(super) fn row_block(rows: usize) -> usize {
    rows.div_ceil(4 * rayon::current_num_threads().max(1))
        .max(64)
}

/// The operands of a grouped weight gradient `dW[e] = Σ_{rows r of e} x[r]ᵀ·dy[r]`: `x` is
/// `[rows, k]`, `dy` is `[rows, m]`, rows sorted by expert (`row_expert`, with `offsets[e]..
/// offsets[e+1]` bounding expert e's rows), and `dW` is `[experts, k, m]`.
pub(super) struct WeightGradProblem<'a, T> {
    x: &'a [T],
    dy: &'a [T],
    row_expert: &'a [i32],
    offsets: &'a [i32],
    k: usize,
    m: usize,
    experts: usize,
}

/// A grouped weight gradient's routing (`row_expert`, `offsets`) as i32 slices, checked to
/// describe `experts` experts.
pub(super) fn expert_routing<'a>(
    row_expert: &'a CpuBuffer,
    offsets: &'a CpuBuffer,
    experts: usize,
    what: &str,
) -> Result<(&'a [i32], &'a [i32])> {
    let re = row_expert.indices(what)?;
    let off = offsets.indices(what)?;
    if off.len() != experts + 1 {
        return Err(Error::Shape(format!(
            "{what}: {} offsets for {experts} experts",
            off.len()
        )));
    }
    Ok((re, off))
}

impl<'a, T: Float + Send + Sync + 'static> WeightGradProblem<'a, T> {
    pub(super) fn new(
        x: &'a [T],
        dy: &'a [T],
        (row_expert, offsets): (&'a [i32], &'a [i32]),
        (k, m, experts): (usize, usize, usize),
    ) -> Self {
        WeightGradProblem {
            x,
            dy,
            row_expert,
            offsets,
            k,
            m,
            experts,
        }
    }

    /// Writes expert `e`'s block `dW[e]` (k·m elements) into `dw`: the first run of e's rows
    /// writes it, the others add to it, and an expert with no rows gets zeros, so `dw` may be
    /// uninitialised and needs no zeroing pass.
    fn expert(&self, e: usize, dw: &mut [MaybeUninit<T>], par: ::gemm::Parallelism) {
        let (k, m) = (self.k, self.m);
        let (lo, hi) = (
            self.offsets[e].max(0) as usize,
            (self.offsets[e + 1].max(0) as usize).min(self.row_expert.len()),
        );
        let mut first = true;
        for (_, r0, r1) in expert_runs(&self.row_expert[lo..hi.max(lo)], self.experts)
            .into_iter()
            .filter(|r| r.0 == e)
        {
            let (r0, r1) = (lo + r0, lo + r1);
            // dW[e] [k, m] = x[r0..r1]ᵀ [k, rows] · dy[r0..r1] [rows, m]
            let (x, dy) = (MatIn::rows(self.x, r0, k).t(), MatIn::rows(self.dy, r0, m));
            // SAFETY: the first product writes all of `dw` (no accumulation); later ones add
            // to what it wrote.
            unsafe {
                gemm_uninit(
                    (dw, Mat::rows(0, m)),
                    x,
                    dy,
                    (k, r1 - r0, m),
                    !first,
                    T::one(),
                    par,
                )
            };
            first = false;
        }
        if first {
            dw.fill(MaybeUninit::new(T::zero()));
        }
    }

    /// Expert `e`'s block written into `scratch` (reused across calls, so a thread's blocks
    /// stay in its cache) and returned.
    fn expert_into<'s>(
        &self,
        e: usize,
        scratch: &'s mut Vec<T>,
        par: ::gemm::Parallelism,
    ) -> &'s [T] {
        let block = self.k * self.m;
        scratch.clear();
        scratch.reserve(block);
        self.expert(e, &mut scratch.spare_capacity_mut()[..block], par);
        // SAFETY: `expert` wrote all `block` elements.
        unsafe { scratch.set_len(block) };
        scratch
    }

    /// All of `dW`, `[experts, k, m]`.
    pub(super) fn all(&self) -> Vec<T> {
        let block = self.k * self.m;
        let len = self.experts * block;
        if block == 0 {
            return zeroed(len);
        }
        let mut out: Vec<T> = buffer_pool::take(len).unwrap_or_else(|_| Vec::with_capacity(len));
        let blocks = &mut out.spare_capacity_mut()[..len];
        if per_expert_parallel(self.experts) {
            blocks
                .par_chunks_mut(block)
                .enumerate()
                // one job per expert: experts' row counts differ, so threads must steal
                // single experts to end together
                .with_max_len(1)
                .for_each(|(e, dw)| self.expert(e, dw, ::gemm::Parallelism::None));
        } else {
            for (e, dw) in blocks.chunks_mut(block).enumerate() {
                self.expert(e, dw, ::gemm::Parallelism::Rayon(0));
            }
        }
        // SAFETY: each of the `experts` blocks of k·m elements was written by `expert`.
        unsafe { out.set_len(len) };
        out
    }

    /// One Adam step on the expert bank `p` (with moments `mo`, `ve`, all `[experts, k, m]`)
    /// whose gradient is `dW`, without ever storing `dW`: each expert's block is computed into
    /// a per-thread scratch and applied while it is still in cache. Element for element this is
    /// `all()` followed by the Adam step (same products, same update), but the 4·k·m-byte
    /// gradient of every expert is neither written to memory nor read back.
    pub(super) fn adam_step<const DECOUPLED: bool>(
        &self,
        p: &mut [T],
        mo: &mut [T],
        ve: &mut [T],
        c: AdamConsts<T>,
    ) {
        let block = self.k * self.m;
        if block == 0 {
            return;
        }
        let wide = Wide::detect();
        if per_expert_parallel(self.experts) {
            p.par_chunks_mut(block)
                .zip(mo.par_chunks_mut(block))
                .zip(ve.par_chunks_mut(block))
                .enumerate()
                .for_each_init(Vec::new, |scratch, (e, ((p, m), v))| {
                    let g = self.expert_into(e, scratch, ::gemm::Parallelism::None);
                    adam_chunk_wide::<T, DECOUPLED>(wide, p, g, m, v, c);
                });
        } else {
            let mut scratch = Vec::new();
            let banks = p
                .chunks_mut(block)
                .zip(mo.chunks_mut(block))
                .zip(ve.chunks_mut(block))
                .enumerate();
            for (e, ((p, m), v)) in banks {
                let g = self.expert_into(e, &mut scratch, ::gemm::Parallelism::Rayon(0));
                p.par_chunks_mut(OPT_CHUNK)
                    .zip(g.par_chunks(OPT_CHUNK))
                    .zip(m.par_chunks_mut(OPT_CHUNK))
                    .zip(v.par_chunks_mut(OPT_CHUNK))
                    .for_each(|(((p, g), m), v)| {
                        adam_chunk_wide::<T, DECOUPLED>(wide, p, g, m, v, c)
                    });
            }
        }
    }
}
