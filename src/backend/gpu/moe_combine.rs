//! The MoE combine on the GPU, `Tensor::weighted_index_scatter`: `y[t] = Σ_{r : idx[r] = t}
//! w[r]·rows[r]` and its backward, one pass each (kernels `weighted_scatter_loop`,
//! `weighted_scatter_sorted` and `weighted_scatter_backward` of `shaders/layout.wgsl`, f32, the
//! f16 build, and the f16-rows build for f16 rows with f32 weights, whose gradient comes back
//! in f32: mixed precision's combine, with the router's weights never cast). Composed from a product and a scatter it would take two passes forward (and
//! an `[A, d]` product in memory) and four backward (a gather, two products, a row sum).
//!
//! The forward is `scatter_add`'s (see `layout.rs`): no atomics, each output element adds its
//! rows in increasing order, either by scanning all rows (few of them, or little work in all) or
//! by binary-searching the stably sorted indices (`sort.rs`: one dispatch up to 2048 rows, six
//! at 8192). Given each output's rows as `slots` (k per output: the plan's `position` for a
//! token-choice routing) it needs no sort: `weighted_gather_slots` reads each output's k rows
//! and adds them in increasing order, one dispatch and the same bits; given an addend as well
//! (an MoE block's residual, `Tensor::weighted_index_scatter_per_slot_add`), it adds it to each
//! rounded sum, the bits of the add that would follow.
//! The backward runs one workgroup per row: the row's gradient `w[r]·dy[idx[r]]` and its
//! weight's gradient `⟨dy[idx[r]], rows[r]⟩`, reduced in workgroup memory. Indices outside
//! `0..len` are not checked here (that would need a read-back): their rows add to no output and
//! get zero gradients, where the CPU returns an error.

use super::half::LAYOUT_F16_ROWS_SHADER;
use super::kernels::{Shader, grid_1d, u32_param};
use super::layout::{SCATTER_LOOP_MAX_M, word_build};
use super::sort::sort_rows;
use super::{GpuBackend, GpuBuffer};
use crate::backend::{ElementwiseOps, LayoutOps, ScatterDims};
use crate::{DType, Error, Result};

/// Invocations per workgroup of the three kernels.
const WG: u32 = 256;

/// `weighted_scatter_loop` is also taken, instead of sorting the index (three more dispatches),
/// while its whole work, outputs × rows, stays below this and each invocation's loop below
/// [`COMBINE_LOOP_LONGEST`]: the combine of a small layer is then one dispatch.
const COMBINE_LOOP_MAX_WORK: usize = 1 << 24;

/// The longest loop one `weighted_scatter_loop` invocation runs under [`COMBINE_LOOP_MAX_WORK`].
const COMBINE_LOOP_LONGEST: usize = 4096;

/// The build of `layout.wgsl` that combines `rows` with weights of `w_dtype`: one float dtype
/// for both (f32, or the f16 build), or f16 rows with f32 weights (the f16-rows build, mixed
/// precision's combine).
fn combine_build(rows: DType, w_dtype: DType) -> &'static Shader {
    match (rows, w_dtype) {
        (DType::F16, DType::F32) => &LAYOUT_F16_ROWS_SHADER,
        _ => word_build(rows),
    }
}

/// Checks `rows [A, d]` float, `w [A]` of its dtype or, for f16 rows, f32 (when given) and
/// `idx [A]` I32, and returns the kernels' params `ScatterParams { outer: 1, len, inner: d, m: A, s0: 0, s1: 1, s2: 0,
/// key_row: 0 }`.
fn params(
    what: &str,
    rows: &GpuBuffer,
    w: Option<&GpuBuffer>,
    idx: &GpuBuffer,
    (d, len): (usize, usize),
) -> Result<[u32; 8]> {
    let w_dtype = w.map_or(rows.dtype(), |w| w.dtype());
    let mixed = rows.dtype() == DType::F16 && w_dtype == DType::F32;
    if !matches!(rows.dtype(), DType::F32 | DType::F16) || !(w_dtype == rows.dtype() || mixed) {
        return Err(Error::DType(format!(
            "{what}: rows and weights must be one float dtype (f32, or f16) or f16 rows with f32 \
             weights, got {} and {w_dtype}",
            rows.dtype(),
        )));
    }
    if idx.dtype() != DType::I32 {
        return Err(crate::backend::checks::indices_dtype_error(
            what,
            idx.dtype(),
        ));
    }
    let a = idx.len();
    if w.is_some_and(|w| w.len() != a) || a.checked_mul(d) != Some(rows.len()) {
        return Err(Error::Shape(format!(
            "{what}: rows of {} values, {} weights and {a} indices do not make [A, {d}], [A], [A]",
            rows.len(),
            w.map_or(a, |w| w.len())
        )));
    }
    let out = len
        .checked_mul(d)
        .ok_or_else(|| Error::Invalid(format!("{what}: output [{len}, {d}] too large")))?;
    u32_param(out, &format!("{what}: output size"))?;
    Ok([
        1,
        u32_param(len, &format!("{what}: output rows"))?,
        u32_param(d, &format!("{what}: row width"))?,
        u32_param(a, &format!("{what}: rows"))?,
        0,
        1,
        0,
        0,
    ])
}

/// `y [len, d]`, `y[t] = Σ_{r : idx[r] = t} w[r]·rows[r]`, each product rounded to the dtype and
/// the sum taken in f32 in increasing `r`. With `slots = Some((s, k))`, `s: [len·k]` I32 lists
/// each output's rows (`s[t·k..t·k+k]` are the rows with `idx = t`, the caller's promise,
/// unchecked here) and no sort runs. Without `w` the rows are added as they are
/// (`index_scatter`'s sum, to the bit; without slots too, it is `scatter_add`). With `addend`
/// (`[len, d]` of the rows' dtype) the output is `addend + y`, `y` rounded first: the bits of
/// the add, written by `weighted_gather_slots` itself where the slots are given (an MoE block's
/// residual), by an add after the other kernels.
///
/// # Errors
/// Rows and weights not of one float dtype, indices or slots not I32, lengths that do not make
/// `[A, d]`, `[A]`, `[A]` (and `[len·k] = [A]` for the slots), an addend not of the output's
/// dtype and size, or sizes past 32-bit indexing.
pub(crate) fn weighted_scatter(
    be: &GpuBackend,
    (rows, addend): (&GpuBuffer, Option<&GpuBuffer>),
    w: Option<&GpuBuffer>,
    idx: &GpuBuffer,
    (d, len): (usize, usize),
    slots: Option<(&GpuBuffer, usize)>,
    slot_order: Option<&GpuBuffer>,
) -> Result<GpuBuffer> {
    const WHAT: &str = "weighted_index_scatter";
    let mut p = params(WHAT, rows, w, idx, (d, len))?;
    let (n, m) = (len * d, idx.len());
    let addend_of = addend.map(|a| (a.dtype(), a.len()));
    crate::backend::checks::check_addend(WHAT, addend_of, (rows.dtype(), n))?;
    if let (Some(a), None) = (addend, slots) {
        // the sum by one of the other kernels, then the add
        let y = weighted_scatter(be, (rows, None), w, idx, (d, len), None, slot_order)?;
        return be.binary(crate::backend::BinaryOp::Add, a, &[1], &y, &[1], &[n]);
    }
    if let Some((s, k)) = slots {
        crate::backend::checks::check_slots(WHAT, s.dtype(), s.len(), (len, k), m)?;
    }
    crate::backend::checks::check_slot_order(
        WHAT,
        slot_order.map(|o| (o.dtype(), o.len())),
        slots.is_some(),
        w.is_some(),
        m,
    )?;
    let out = be.alloc(n, rows.dtype())?;
    if n == 0 {
        return Ok(out);
    }
    if m == 0 {
        // no rows: zeros (plus the addend: the add keeps its bits, −0 + 0 included)
        let zeros = be.full(n, 0.0, rows.dtype())?;
        return match addend {
            Some(a) => be.binary(crate::backend::BinaryOp::Add, a, &[1], &zeros, &[1], &[n]),
            None => Ok(zeros),
        };
    }
    let build = combine_build(rows.dtype(), w.map_or(rows.dtype(), |w| w.dtype()));
    if let Some((s, k)) = slots {
        // each output's k rows, read where they are: params m = k, and key_row (unread by
        // this entry otherwise) 1 when there are no weights (the rows stand in for them)
        p[3] = u32_param(k, &format!("{WHAT}: rows per output"))?;
        p[7] = w.is_none() as u32;
        // s0: the weights are per slot (read through the slots, not by row); s2: the addend
        // is added (binding 7; the rows again, unread, without one)
        p[4] = slot_order.is_some() as u32;
        p[6] = addend.is_some() as u32;
        be.launch(
            build,
            "weighted_gather_slots",
            &[
                rows,
                idx,
                &out,
                s,
                s,
                w.unwrap_or(rows),
                addend.unwrap_or(rows),
            ],
            &p,
            grid_1d(n, WG)?,
        )?;
        return Ok(out);
    }
    let Some(w) = w else {
        // the plain scatter-add of the rows
        let dims = ScatterDims {
            outer: 1,
            m,
            inner: d,
            len,
        };
        return be.scatter_add(rows, idx, [0, 1, 0], dims);
    };
    let small_work = m <= COMBINE_LOOP_LONGEST && n.saturating_mul(m) <= COMBINE_LOOP_MAX_WORK;
    if m <= SCATTER_LOOP_MAX_M || small_work {
        // bindings 4 and 5 (keys, perm) are unread by the loop entry
        be.launch(
            build,
            "weighted_scatter_loop",
            &[rows, idx, &out, idx, idx, w],
            &p,
            grid_1d(n, WG)?,
        )?;
        return Ok(out);
    }
    // the indices are one contiguous row: sort it stably, then each output binary-searches
    let perm = sort_rows(be, idx, 1, m, false)?;
    be.launch(
        build,
        "weighted_scatter_sorted",
        &[rows, idx, &out, idx, &perm, w],
        &p,
        grid_1d(n, WG)?,
    )?;
    Ok(out)
}

/// The gradients `(d_rows, d_w)` of [`weighted_scatter`] for `dy [len, d]`:
/// `d_rows[r] = w[r]·dy[idx[r]]` (`[A, d]`, the rows' dtype), `d_w[r] = ⟨dy[idx[r]], rows[r]⟩`
/// (`[A]`, the weights' dtype; f32 sums).
///
/// # Errors
/// Those of [`weighted_scatter`], and `dy` of another dtype or length.
pub(crate) fn weighted_scatter_backward(
    be: &GpuBackend,
    rows: &GpuBuffer,
    w: &GpuBuffer,
    idx: &GpuBuffer,
    dy: &GpuBuffer,
    (d, len): (usize, usize),
    slot_order: Option<&GpuBuffer>,
) -> Result<(GpuBuffer, GpuBuffer)> {
    const WHAT: &str = "weighted_index_scatter backward";
    let mut p = params(WHAT, rows, Some(w), idx, (d, len))?;
    crate::backend::checks::check_slot_order(
        WHAT,
        slot_order.map(|o| (o.dtype(), o.len())),
        true,
        true,
        idx.len(),
    )?;
    // s0: the weights and their gradients are per slot, row j's at slot_order[j]
    p[4] = slot_order.is_some() as u32;
    if dy.dtype() != rows.dtype() || dy.len() != len * d {
        return Err(Error::Shape(format!(
            "{WHAT}: a gradient of {} {} values for [{len}, {d}] {}",
            dy.len(),
            dy.dtype(),
            rows.dtype()
        )));
    }
    let a = w.len();
    let d_rows = be.alloc(a * d, rows.dtype())?;
    let d_w = be.alloc(a, w.dtype())?;
    if a == 0 {
        return Ok((d_rows, d_w));
    }
    if d == 0 {
        return Ok((d_rows, be.full(a, 0.0, w.dtype())?));
    }
    // one workgroup per row: a 1-D grid of a·WG invocations, folded like any other
    let invocations = a
        .checked_mul(WG as usize)
        .ok_or_else(|| Error::Invalid(format!("{WHAT}: {a} rows are too many")))?;
    be.launch(
        combine_build(rows.dtype(), w.dtype()),
        "weighted_scatter_backward",
        &[rows, idx, dy, w, &d_rows, &d_w, slot_order.unwrap_or(idx)],
        &p,
        grid_1d(invocations, WG)?,
    )?;
    Ok((d_rows, d_w))
}
