//! Launchers of `shaders/layout.wgsl`: [`copy_strided`], [`concat()`] (entry `concat_part`, one
//! launch per part), [`gather`] and [`scatter_add`] (entries `scatter_add_loop`,
//! `scatter_add_wide`, `scatter_add_columns` and `scatter_add_sorted`).
//!
//! **scatter_add without atomics.** WGSL has no f32 atomics, and a compare-and-swap loop would
//! make the order of additions (and so the rounding) depend on scheduling. The four kernels are
//! gather-style instead: each output element is owned by one invocation (by one workgroup in
//! the wide kernel), which adds the source rows that hit it in increasing source order, exactly
//! the CPU's order, so GPU and CPU agree bit for bit and repeated runs are identical.
//! [`scatter_kernel`] picks one of four: `scatter_add_loop` scans all `m` source rows per output
//! (few rows); where the index varies along the inner axis, `scatter_add_wide` gives each output
//! a workgroup that tests 256 rows at a time and adds the hits in order; with one index per
//! source row (`index_select`'s adjoint: an embedding's gradient, an MoE layer's per-expert
//! sums), `scatter_add_columns` gives each output row a workgroup per 256 columns whose
//! invocations walk the staged indices of 256 rows at a time together (small work, or many hits
//! per output, where one invocation per output would walk thousands of dependent reads), and
//! `scatter_add_sorted` first sorts each row of indices with the stable argsort of `sort.rs` and
//! then binary-searches each output's run (many outputs with few hits each).
//!
//! Index values outside `0..len` are not checked on the GPU (that would need a read-back): gather
//! yields 0 for them and scatter_add ignores them, where the CPU returns an error.

use super::half::LAYOUT_F16_SHADER;
use super::kernels::{Shader, grid_1d, u32_param};
use super::sort::sort_rows;
use super::strided::plan;
use super::{GpuBackend, GpuBuffer};
use crate::backend::LayoutOps;
use crate::backend::{AxisView, ScatterDims};
use crate::{DType, Error, Result};

/// The kernels of `shaders/layout.wgsl`.
pub(crate) static LAYOUT: Shader = Shader {
    name: "layout",
    builtin: true,
    source: include_str!("../../../shaders/layout.wgsl"),
};

/// Invocations per workgroup of every kernel in the file.
const WG: u32 = 256;

/// Up to this many source rows, `scatter_add_loop` (one invocation per output scanning every
/// row) runs: a short chain of reads, one dispatch.
pub(super) const SCATTER_LOOP_MAX_M: usize = 32;

/// `scatter_add_columns` (one index per source row: a workgroup per output row and 256 columns,
/// 256 rows' indices staged at a time) is taken while the whole work, outputs × source rows,
/// stays below this: the small scatters of a training step (per-expert sums, a permutation's
/// adjoint, an embedding's gradient) are then one dispatch each, without the long chain of
/// dependent reads one invocation per output would walk.
pub(super) const SCATTER_WIDE_MAX_WORK: usize = 1 << 24;

/// `scatter_add_columns` is also taken past [`SCATTER_WIDE_MAX_WORK`] where each output is hit by
/// this many source rows or more on average (`m ≥` this × outputs per `(o, i)`): the sorted
/// entry would add each output's hits in a chain of three dependent reads each (an MoE layer's
/// per-expert sums over 8192 assignments, at n = 2: two chains of 4096).
pub(super) const SCATTER_WIDE_MIN_HITS: usize = 64;

/// The build of `layout.wgsl` whose copies move elements of `dtype`: 32-bit words (f32, i32),
/// or f16 values (the f16 build, [`LAYOUT_F16_SHADER`]).
pub(super) fn word_build(dtype: DType) -> &'static Shader {
    match dtype {
        DType::F16 => &LAYOUT_F16_SHADER,
        _ => &LAYOUT,
    }
}

/// `LayoutOps::copy_strided` (entry `copy_strided`): a contiguous copy of a strided view, any dtype.
pub(crate) fn copy_strided(
    be: &GpuBackend,
    x: &GpuBuffer,
    shape: &[usize],
    strides: &[usize],
    offset: usize,
) -> Result<GpuBuffer> {
    let p = plan("copy_strided", shape, &[(strides, offset, x.len())])?;
    let out = be.alloc(p.n, x.dtype())?;
    if p.n == 0 {
        return Ok(out);
    }
    let off = u32_param(offset, "copy_strided: offset")?;
    be.launch(
        word_build(x.dtype()),
        "copy_strided",
        &[x, &out],
        &p.words(off),
        grid_1d(p.n, WG)?,
    )?;
    Ok(out)
}

/// `LayoutOps::concat` (entry `concat_part`, one launch per non-empty part).
pub(crate) fn concat(
    be: &GpuBackend,
    parts: &[&GpuBuffer],
    lens: &[usize],
    outer: usize,
    inner: usize,
) -> Result<GpuBuffer> {
    let dtype = crate::backend::checks::check_concat_dtypes(parts)?;
    if parts.len() != lens.len() {
        return Err(Error::Shape(format!(
            "concat: {} parts but {} lengths",
            parts.len(),
            lens.len()
        )));
    }
    for (k, (p, &l)) in parts.iter().zip(lens).enumerate() {
        if outer.checked_mul(l).and_then(|v| v.checked_mul(inner)) != Some(p.len()) {
            return Err(Error::Shape(format!(
                "concat: part {k} should be [{outer}, {l}, {inner}], its buffer holds {}",
                p.len()
            )));
        }
    }
    let total: usize = lens.iter().sum();
    let n = outer
        .checked_mul(total)
        .and_then(|v| v.checked_mul(inner))
        .ok_or_else(|| Error::Invalid("concat: output too large".into()))?;
    let out = be.alloc(n, dtype)?;
    let mut start = 0usize;
    for (p, &l) in parts.iter().zip(lens) {
        if !p.is_empty() {
            be.launch(
                word_build(dtype),
                "concat_part",
                &[p, &out],
                &[
                    u32_param(outer, "concat: outer")?,
                    u32_param(l, "concat: part length")?,
                    u32_param(inner, "concat: inner")?,
                    u32_param(total, "concat: total length")?,
                    u32_param(start, "concat: start")?,
                ],
                grid_1d(p.len(), WG)?,
            )?;
        }
        start += l;
    }
    Ok(out)
}

/// Checks an index buffer read at `o·s0 + j·s1 + i·s2` for `o < outer, j < m, i < inner`.
fn check_index(
    what: &str,
    idx: &GpuBuffer,
    s: [usize; 3],
    outer: usize,
    m: usize,
    inner: usize,
) -> Result<()> {
    if idx.dtype() != DType::I32 {
        return Err(crate::backend::checks::indices_dtype_error(
            what,
            idx.dtype(),
        ));
    }
    if outer == 0 || m == 0 || inner == 0 {
        return Ok(());
    }
    let last = (outer as u128 - 1) * s[0] as u128
        + (m as u128 - 1) * s[1] as u128
        + (inner as u128 - 1) * s[2] as u128;
    if last >= idx.len() as u128 {
        return Err(Error::Shape(format!(
            "{what}: index strides {s:?} over [{outer}, {m}, {inner}] reach element {last}, the \
             index buffer holds {}",
            idx.len()
        )));
    }
    Ok(())
}

/// Kernel words of a stride, zero when its dimension has size 1 (it is never used then).
fn stride_word(size: usize, s: usize, what: &str) -> Result<u32> {
    if size <= 1 { Ok(0) } else { u32_param(s, what) }
}

/// `LayoutOps::gather` (entry `gather`): any dtype for `x`, I32 indices.
pub(crate) fn gather(
    be: &GpuBackend,
    x: &GpuBuffer,
    view: AxisView,
    idx: &GpuBuffer,
    s: [usize; 3],
    m: usize,
) -> Result<GpuBuffer> {
    let AxisView { outer, len, inner } = view;
    if outer.checked_mul(len).and_then(|v| v.checked_mul(inner)) != Some(x.len()) {
        return Err(Error::Shape(format!(
            "gather: view [{outer}, {len}, {inner}] does not match a buffer of {} elements",
            x.len()
        )));
    }
    check_index("gather", idx, s, outer, m, inner)?;
    let n = outer
        .checked_mul(m)
        .and_then(|v| v.checked_mul(inner))
        .ok_or_else(|| Error::Invalid("gather: output too large".into()))?;
    let out = be.alloc(n, x.dtype())?;
    if n == 0 {
        return Ok(out);
    }
    u32_param(n, "gather: output size")?;
    let params = [
        u32_param(outer, "gather: outer")?,
        u32_param(len, "gather: axis length")?,
        u32_param(inner, "gather: inner")?,
        u32_param(m, "gather: index length")?,
        stride_word(outer, s[0], "gather: index stride")?,
        stride_word(m, s[1], "gather: index stride")?,
        stride_word(inner, s[2], "gather: index stride")?,
    ];
    be.launch(
        word_build(x.dtype()),
        "gather",
        &[x, idx, &out],
        &params,
        grid_1d(n, WG)?,
    )?;
    Ok(out)
}

/// `LayoutOps::scatter_add` (entries `scatter_add_loop` / `scatter_add_sorted`): the adjoint of
/// gather, deterministic, in the CPU's order of additions.
pub(crate) fn scatter_add(
    be: &GpuBackend,
    src: &GpuBuffer,
    idx: &GpuBuffer,
    s: [usize; 3],
    dims: ScatterDims,
) -> Result<GpuBuffer> {
    let ScatterDims {
        outer,
        m,
        inner,
        len,
    } = dims;
    if !matches!(src.dtype(), DType::F32 | DType::F16) {
        return Err(Error::DType(format!(
            "scatter_add needs a float source, got {}",
            src.dtype()
        )));
    }
    if outer.checked_mul(m).and_then(|v| v.checked_mul(inner)) != Some(src.len()) {
        return Err(Error::Shape(format!(
            "scatter_add: source [{outer}, {m}, {inner}] does not match a buffer of {} elements",
            src.len()
        )));
    }
    check_index("scatter_add", idx, s, outer, m, inner)?;
    let n = outer
        .checked_mul(len)
        .and_then(|v| v.checked_mul(inner))
        .ok_or_else(|| Error::Invalid("scatter_add: output too large".into()))?;
    let out = be.alloc(n, src.dtype())?;
    if n == 0 {
        return Ok(out);
    }
    u32_param(n, "scatter_add: output size")?;
    let (s0, s1, s2) = (
        stride_word(outer, s[0], "scatter_add: index stride")?,
        stride_word(m, s[1], "scatter_add: index stride")?,
        stride_word(inner, s[2], "scatter_add: index stride")?,
    );
    let mut params = [
        u32_param(outer, "scatter_add: outer")?,
        u32_param(len, "scatter_add: axis length")?,
        u32_param(inner, "scatter_add: inner")?,
        u32_param(m, "scatter_add: source rows")?,
        s0,
        s1,
        s2,
        0,
    ];
    match scatter_kernel(n, m, len, s2 != 0) {
        ScatterKernel::Loop => {
            be.launch(
                word_build(src.dtype()),
                "scatter_add_loop",
                &[src, idx, &out],
                &params,
                grid_1d(n, WG)?,
            )?;
            return Ok(out);
        }
        ScatterKernel::Wide => {
            // one workgroup per output element
            be.launch(
                word_build(src.dtype()),
                "scatter_add_wide",
                &[src, idx, &out],
                &params,
                grid_1d(n, 1)?,
            )?;
            return Ok(out);
        }
        ScatterKernel::Columns => {
            // one workgroup per output row and block of 256 columns
            let rows = outer * len;
            be.launch(
                word_build(src.dtype()),
                "scatter_add_columns",
                &[src, idx, &out],
                &params,
                grid_1d(rows * inner.div_ceil(WG as usize), 1)?,
            )?;
            return Ok(out);
        }
        ScatterKernel::Sorted => {}
    }
    // One key row per o (or a single shared row when s0 = 0): copy the indices contiguously,
    // sort each row stably, then let every output binary-search its run.
    let key_rows = if s0 == 0 { 1 } else { outer };
    let keys = copy_strided(be, idx, &[key_rows, m], &[s[0], s[1]], 0)?;
    let perm = sort_rows(be, &keys, key_rows, m, false)?;
    params[7] = if s0 == 0 { 0 } else { params[3] };
    be.launch(
        word_build(src.dtype()),
        "scatter_add_sorted",
        &[src, idx, &out, &keys, &perm],
        &params,
        grid_1d(n, WG)?,
    )?;
    Ok(out)
}

/// The entry of `layout.wgsl` a scatter-add runs (all three give the CPU's bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ScatterKernel {
    /// `scatter_add_loop`: one invocation per output, scanning every source row
    Loop,
    /// `scatter_add_wide`: one workgroup per output, testing 256 source rows at a time
    Wide,
    /// `scatter_add_columns`: one workgroup per output row and 256 columns, each invocation a
    /// column walking the staged indices of 256 source rows at a time (one index per row)
    Columns,
    /// `scatter_add_sorted`: the index copied and sorted first (a dozen more dispatches at a
    /// few thousand rows), then each output binary-searches its run of hits
    Sorted,
}

/// The kernel for `n` outputs, `m` source rows scattered into `len` entries along the axis, and
/// an index that varies along the inner axis or not: the loop for few rows; where the index
/// varies along the inner axis (which neither the column nor the sorted kernel can take) the
/// wide kernel; for small work or many hits per output the column kernel; else the sorted kernel
/// (many outputs, few hits each).
fn scatter_kernel(n: usize, m: usize, len: usize, index_varies_inner: bool) -> ScatterKernel {
    if m <= SCATTER_LOOP_MAX_M {
        return ScatterKernel::Loop;
    }
    if index_varies_inner {
        return ScatterKernel::Wide;
    }
    let many_hits = m >= SCATTER_WIDE_MIN_HITS.saturating_mul(len.max(1));
    if many_hits || n.saturating_mul(m) <= SCATTER_WIDE_MAX_WORK {
        return ScatterKernel::Columns;
    }
    ScatterKernel::Sorted
}

impl LayoutOps for GpuBackend {
    fn copy_strided(
        &self,
        x: &GpuBuffer,
        shape: &[usize],
        strides: &[usize],
        offset: usize,
    ) -> Result<GpuBuffer> {
        copy_strided(self, x, shape, strides, offset)
    }

    fn concat(
        &self,
        parts: &[&GpuBuffer],
        lens: &[usize],
        outer: usize,
        inner: usize,
    ) -> Result<GpuBuffer> {
        concat(self, parts, lens, outer, inner)
    }

    fn gather(
        &self,
        x: &GpuBuffer,
        view: AxisView,
        idx: &GpuBuffer,
        idx_strides: [usize; 3],
        m: usize,
    ) -> Result<GpuBuffer> {
        gather(self, x, view, idx, idx_strides, m)
    }

    fn scatter_add(
        &self,
        src: &GpuBuffer,
        idx: &GpuBuffer,
        idx_strides: [usize; 3],
        dims: ScatterDims,
    ) -> Result<GpuBuffer> {
        scatter_add(self, src, idx, idx_strides, dims)
    }
}
