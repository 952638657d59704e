//! Launchers of `shaders/reduce.wgsl`: [`reduce`] (sum, max, min, argmax along one axis) and
//! [`cumsum`]. Each picks the serial kernel (one invocation per output line, the CPU's order of
//! additions) when lines are short or there are many of them, and the workgroup kernel (256
//! invocations share one line) for few long lines.

use super::kernels::{Shader, grid_1d, u32_param};
use super::{GpuBackend, GpuBuffer};
use crate::backend::{AxisView, ReduceOp};
use crate::{DType, Error, Result};

/// The kernels of `shaders/reduce.wgsl`.
pub(crate) static REDUCE: Shader = Shader {
    name: "reduce",
    source: include_str!("../../../shaders/reduce.wgsl"),
};

/// Invocations per workgroup of every kernel in the file.
const WG: u32 = 256;

/// True when one workgroup per line beats one invocation per line.
fn use_rows(lines: usize, len: usize) -> bool {
    len > 128 && lines < 4096
}

/// Checks a float input against its view; returns `(outer, len, inner, lines)` as kernel words.
fn check_view(what: &str, x: &GpuBuffer, view: AxisView) -> Result<[u32; 4]> {
    if x.dtype() != DType::F32 {
        return Err(Error::DType(format!(
            "{what} needs a float tensor, got {}",
            x.dtype()
        )));
    }
    let AxisView { outer, len, inner } = view;
    let total = outer.checked_mul(len).and_then(|v| v.checked_mul(inner));
    if total != Some(x.len()) {
        return Err(Error::Shape(format!(
            "{what}: view [{outer}, {len}, {inner}] does not match a buffer of {} elements",
            x.len()
        )));
    }
    Ok([
        u32_param(outer, "outer size")?,
        u32_param(len, "axis length")?,
        u32_param(inner, "inner size")?,
        u32_param(outer * inner, "number of outputs")?,
    ])
}

/// `Backend::reduce` (entries `reduce_serial` / `reduce_rows`): output `[outer, inner]`, I32 for
/// argmax.
pub(crate) fn reduce(
    be: &GpuBackend,
    op: ReduceOp,
    x: &GpuBuffer,
    view: AxisView,
) -> Result<GpuBuffer> {
    let what = format!("{op:?}");
    let [outer, len, inner, lines] = check_view(&what, x, view)?;
    let (code, dtype) = match op {
        ReduceOp::Sum => (0, DType::F32),
        ReduceOp::Max => (1, DType::F32),
        ReduceOp::Min => (2, DType::F32),
        ReduceOp::ArgMax => (3, DType::I32),
    };
    let out = be.alloc(lines as usize, dtype)?;
    let params = [outer, len, inner, code];
    if use_rows(lines as usize, len as usize) {
        let groups = grid_1d(lines as usize * WG as usize, WG)?;
        be.launch(&REDUCE, "reduce_rows", &[x, &out], &params, groups)?;
    } else {
        let groups = grid_1d(lines as usize, WG)?;
        be.launch(&REDUCE, "reduce_serial", &[x, &out], &params, groups)?;
    }
    Ok(out)
}

/// `Backend::cumsum` (entries `cumsum_serial` / `cumsum_rows`).
pub(crate) fn cumsum(
    be: &GpuBackend,
    x: &GpuBuffer,
    view: AxisView,
    reverse: bool,
) -> Result<GpuBuffer> {
    let [outer, len, inner, lines] = check_view("cumsum", x, view)?;
    let out = be.alloc(x.len(), DType::F32)?;
    let params = [outer, len, inner, reverse as u32];
    if use_rows(lines as usize, len as usize) {
        let groups = grid_1d(lines as usize * WG as usize, WG)?;
        be.launch(&REDUCE, "cumsum_rows", &[x, &out], &params, groups)?;
    } else {
        let groups = grid_1d(lines as usize, WG)?;
        be.launch(&REDUCE, "cumsum_serial", &[x, &out], &params, groups)?;
    }
    Ok(out)
}
