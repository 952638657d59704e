//! Layout kernels that move elements without arithmetic (besides `scatter_add`'s sums):
//! `gather` (index_select along an axis), `scatter_add` (its adjoint) and `concat`.

use super::elementwise::strided_copy;
use super::{CpuBackend, CpuBuffer, f32b, f64b, i32b};
use super::{PAR_MIN, buffer_pool, write_chunks, zeroed};
use crate::DType;
use crate::backend::AxisView;
use crate::backend::{LayoutOps, ScatterDims};
use crate::{Error, Result};
use num_traits::Float;
use rayon::prelude::*;
use std::mem::MaybeUninit;

/// Checks every index of `idx` against an axis of size `len` (before any parallel loop).
pub(super) fn check_indices(idx: &[i32], len: usize, what: &str) -> Result<()> {
    match idx.iter().find(|&&i| i < 0 || i as usize >= len) {
        Some(&bad) => Err(Error::Invalid(format!(
            "{what}: index {bad} out of range for an axis of size {len}"
        ))),
        None => Ok(()),
    }
}

pub(super) fn gather_kernel<T: Copy + Send + Sync + Default>(
    x: &[T],
    v: AxisView,
    idx: &[i32],
    s: [usize; 3],
    m: usize,
) -> Result<Vec<T>> {
    let AxisView { outer, len, inner } = v;
    check_indices(idx, len, "gather")?;
    if inner == 0 {
        return Ok(Vec::new());
    }
    // One output row (o, j) of `inner` elements at a time; a shared index per row is a memcpy.
    let row = |r: usize, dst: &mut [MaybeUninit<T>]| {
        let (o, j) = (r / m.max(1), r % m.max(1));
        if s[2] == 0 {
            let k = idx[o * s[0] + j * s[1]] as usize;
            let src = &x[(o * len + k) * inner..(o * len + k + 1) * inner];
            for (d, &v) in dst.iter_mut().zip(src) {
                d.write(v);
            }
        } else {
            for (i, d) in dst.iter_mut().enumerate() {
                let k = idx[o * s[0] + j * s[1] + i * s[2]] as usize;
                d.write(x[(o * len + k) * inner + i]);
            }
        }
    };
    // SAFETY: every row is `inner` long and both branches write all of it.
    Ok(unsafe { write_chunks(outer * m * inner, inner, row) })
}

/// The row case of [`scatter_add_kernel`], one index per source row (index_select's adjoint, the
/// MoE combine `y[t] = Σ_{rows r of t} contrib[r]`): the source rows are grouped by destination
/// row with a counting sort that keeps source order, then every output row is written once, in
/// parallel, as the in-order sum of its sources. No zeroing pass, no per-thread copies; the
/// additions happen in the same order as the serial loop's, so the result is deterministic.
///
/// With `scale`, source row `i` (of `outer · m`) counts `scale[i]` times (the weighted MoE
/// combine of `cpu/moe_combine.rs`): each element is `scale[i] · src` rounded, then summed in
/// the same order, so the result is that of scaling the rows first, bit for bit.
#[allow(clippy::too_many_arguments)]
pub(super) fn scatter_rows<T: Float + Send + Sync>(
    src: &[T],
    scale: Option<&[T]>,
    idx: &[i32],
    s: [usize; 3],
    outer: usize,
    m: usize,
    inner: usize,
    len: usize,
) -> Vec<T> {
    let dest = |o: usize, j: usize| o * len + idx[o * s[0] + j * s[1]] as usize;
    // start[r]..start[r + 1]: where output row r's sources sit in `order`
    let mut start = vec![0usize; outer * len + 1];
    for o in 0..outer {
        for j in 0..m {
            start[dest(o, j) + 1] += 1;
        }
    }
    for r in 0..outer * len {
        start[r + 1] += start[r];
    }
    let mut next = start.clone();
    let mut order = vec![0usize; outer * m];
    for o in 0..outer {
        for j in 0..m {
            let d = dest(o, j);
            order[next[d]] = o * m + j;
            next[d] += 1;
        }
    }
    let source = |i: usize| &src[i * inner..(i + 1) * inner];
    let row = |r: usize, dst: &mut [MaybeUninit<T>]| {
        let sources = &order[start[r]..start[r + 1]];
        let Some((&first, rest)) = sources.split_first() else {
            dst.fill(MaybeUninit::new(T::zero()));
            return;
        };
        match scale {
            None => {
                for (d, &x) in dst.iter_mut().zip(source(first)) {
                    d.write(x);
                }
            }
            Some(w) => {
                for (d, &x) in dst.iter_mut().zip(source(first)) {
                    d.write(w[first] * x);
                }
            }
        }
        // SAFETY: every element of `dst` was written just above.
        let dst = unsafe { &mut *(dst as *mut [MaybeUninit<T>] as *mut [T]) };
        // whole rows added in turn (vectorised): per element the sums of the serial loop, in
        // its order
        for &b in rest {
            match scale {
                None => {
                    for (d, &y) in dst.iter_mut().zip(source(b)) {
                        *d = *d + y;
                    }
                }
                Some(w) => {
                    for (d, &y) in dst.iter_mut().zip(source(b)) {
                        *d = *d + w[b] * y;
                    }
                }
            }
        }
    };
    // SAFETY: every row is `inner` long and each path writes all of it (the source rows it
    // zips with hold `inner` elements).
    unsafe { write_chunks(outer * len * inner, inner, row) }
}

pub(super) fn scatter_add_kernel<T: Float + Send + Sync>(
    src: &[T],
    idx: &[i32],
    s: [usize; 3],
    outer: usize,
    m: usize,
    inner: usize,
    len: usize,
) -> Result<Vec<T>> {
    check_indices(idx, len, "scatter_add")?;
    if s[2] == 0 && inner >= 16 {
        return Ok(scatter_rows(src, None, idx, s, outer, m, inner, len));
    }
    let mut out = zeroed(outer * len * inner);
    if inner == 0 {
        return Ok(out);
    }
    if inner < 16 {
        // scattering single elements (a top-k's chosen values back into [T, n] logits): one
        // serial pass in source order; splitting a few thousand additions over threads, or
        // grouping them by destination, costs more than the additions
        for o in 0..outer {
            for j in 0..m {
                for i in 0..inner {
                    let k = idx[o * s[0] + j * s[1] + i * s[2]] as usize;
                    let d = &mut out[(o * len + k) * inner + i];
                    *d = *d + src[(o * m + j) * inner + i];
                }
            }
        }
        return Ok(out);
    }
    // Each thread owns a band of columns of every output row, so no two threads add into the same
    // element; within a band the additions happen in source order (deterministic).
    let band = if outer * m * inner >= PAR_MIN {
        inner.div_ceil(rayon::current_num_threads().max(1)).max(64)
    } else {
        inner
    };
    let bands: Vec<(usize, usize)> = (0..inner)
        .step_by(band)
        .map(|c| (c, (c + band).min(inner)))
        .collect();
    let columns: Vec<Vec<T>> = bands
        .par_iter()
        .map(|&(c0, c1)| {
            let w = c1 - c0;
            let mut acc = vec![T::zero(); outer * len * w];
            for o in 0..outer {
                for j in 0..m {
                    let src_row = &src[(o * m + j) * inner..(o * m + j + 1) * inner];
                    if s[2] == 0 {
                        // one index for the whole row (index_select's adjoint, the MoE combine):
                        // add the row slice at once, a loop that vectorises
                        let k = idx[o * s[0] + j * s[1]] as usize;
                        let dst = &mut acc[(o * len + k) * w..(o * len + k + 1) * w];
                        for (d, &x) in dst.iter_mut().zip(&src_row[c0..c1]) {
                            *d = *d + x;
                        }
                        continue;
                    }
                    for i in c0..c1 {
                        let k = idx[o * s[0] + j * s[1] + i * s[2]] as usize;
                        let d = &mut acc[(o * len + k) * w + (i - c0)];
                        *d = *d + src_row[i];
                    }
                }
            }
            acc
        })
        .collect();
    for (&(c0, c1), acc) in bands.iter().zip(&columns) {
        let w = c1 - c0;
        for r in 0..outer * len {
            out[r * inner + c0..r * inner + c1].copy_from_slice(&acc[r * w..(r + 1) * w]);
        }
    }
    Ok(out)
}

pub(super) fn concat_kernel<T: Copy>(
    parts: &[&[T]],
    lens: &[usize],
    outer: usize,
    inner: usize,
) -> Vec<T> {
    let total: usize = lens.iter().sum();
    let mut out = buffer_pool::take(outer * total * inner).unwrap_or_default();
    for o in 0..outer {
        for (p, &l) in parts.iter().zip(lens) {
            out.extend_from_slice(&p[o * l * inner..(o + 1) * l * inner]);
        }
    }
    out
}

impl LayoutOps for CpuBackend {
    fn copy_strided(
        &self,
        x: &CpuBuffer,
        shape: &[usize],
        strides: &[usize],
        offset: usize,
    ) -> Result<CpuBuffer> {
        if shape.iter().product::<usize>() == 0 {
            return Ok(any_map!(x, _v => Vec::new()));
        }
        Ok(any_map!(x, v => strided_copy(&v[offset.min(v.len())..], shape, strides)))
    }

    fn concat(
        &self,
        parts: &[&CpuBuffer],
        lens: &[usize],
        outer: usize,
        inner: usize,
    ) -> Result<CpuBuffer> {
        let dtype = crate::backend::checks::check_concat_dtypes(parts)?;
        macro_rules! join {
            ($variant:ident, $wrap:ident) => {{
                let slices: Vec<&[_]> = parts
                    .iter()
                    .map(|p| match p {
                        CpuBuffer::$variant(v) => v.as_slice(),
                        _ => unreachable!("dtype checked above"),
                    })
                    .collect();
                $wrap(concat_kernel(&slices, lens, outer, inner))
            }};
        }
        Ok(match dtype {
            DType::F32 => join!(F32, f32b),
            DType::F64 => join!(F64, f64b),
            DType::I32 => join!(I32, i32b),
            DType::F16 => return Err(super::f16_error("concat")),
        })
    }

    fn gather(
        &self,
        x: &CpuBuffer,
        view: AxisView,
        idx: &CpuBuffer,
        s: [usize; 3],
        m: usize,
    ) -> Result<CpuBuffer> {
        let idx = idx.indices("gather")?;
        Ok(match x {
            CpuBuffer::F32(v) => f32b(gather_kernel(v, view, idx, s, m)?),
            CpuBuffer::F64(v) => f64b(gather_kernel(v, view, idx, s, m)?),
            CpuBuffer::I32(v) => i32b(gather_kernel(v, view, idx, s, m)?),
        })
    }

    fn scatter_add(
        &self,
        src: &CpuBuffer,
        idx: &CpuBuffer,
        s: [usize; 3],
        dims: ScatterDims,
    ) -> Result<CpuBuffer> {
        let ScatterDims {
            outer,
            m,
            inner,
            len,
        } = dims;
        let idx = idx.indices("scatter_add")?;
        match src {
            CpuBuffer::F32(v) => Ok(f32b(scatter_add_kernel(v, idx, s, outer, m, inner, len)?)),
            CpuBuffer::F64(v) => Ok(f64b(scatter_add_kernel(v, idx, s, outer, m, inner, len)?)),
            CpuBuffer::I32(_) => Err(Error::DType(
                "scatter_add needs a float source, got i32".into(),
            )),
        }
    }
}
