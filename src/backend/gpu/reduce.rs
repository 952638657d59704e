//! Launchers of `shaders/reduce.wgsl`: [`reduce`] (sum, max, min, argmax along one axis) and
//! [`cumsum`]. Each picks the serial kernel (one invocation per output line, the CPU's order of
//! additions) when lines are short or there are many of them, and the workgroup kernel (256
//! invocations share one line) for few long lines. A sum, maximum or minimum is stored in its
//! input's dtype by the kernel itself (`*_values` entries: an f16 tensor's f32 sum is rounded
//! once there, no cast after); argmax and an f16 tensor's unrounded f32 sum write 32-bit words.

use super::half::REDUCE_F16_SHADER;
use super::kernels::{Shader, grid_1d, u32_param};
use super::{GpuBackend, GpuBuffer};
use crate::backend::ReduceOps;
use crate::backend::{AxisView, ReduceOp};
use crate::{DType, Error, Result};

/// The kernels of `shaders/reduce.wgsl`.
pub(crate) static REDUCE: Shader = Shader {
    name: "reduce",
    builtin: true,
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
    if x.dtype() != DType::F32 && x.dtype() != DType::F16 {
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

/// `ReduceParams.op` of `op` in `shaders/reduce.wgsl`, the name of its WGSL constant, and the
/// output dtype. The shader names each code (`const REDUCE_SUM: u32 = 0u;` ...); a unit test below
/// checks them against this table.
fn reduce_code(op: ReduceOp) -> (u32, &'static str, DType) {
    match op {
        ReduceOp::Sum => (0, "REDUCE_SUM", DType::F32),
        ReduceOp::Max => (1, "REDUCE_MAX", DType::F32),
        ReduceOp::Min => (2, "REDUCE_MIN", DType::F32),
        ReduceOp::ArgMax => (3, "REDUCE_ARGMAX", DType::I32),
    }
}

/// The build of `reduce.wgsl` that reads elements of `dtype` (f32, or f16: [`REDUCE_F16_SHADER`]).
fn float_build(dtype: DType) -> &'static Shader {
    match dtype {
        DType::F16 => &REDUCE_F16_SHADER,
        _ => &REDUCE,
    }
}

/// `ReduceOps::reduce`: output `[outer, inner]`, in the input's dtype (an f16 tensor's sum,
/// maximum or minimum, taken in f32, is rounded to f16 once by the kernel: entries
/// `reduce_serial_values` / `reduce_rows_values`), I32 for argmax (`reduce_serial` /
/// `reduce_rows`).
pub(crate) fn reduce(
    be: &GpuBackend,
    op: ReduceOp,
    x: &GpuBuffer,
    view: AxisView,
) -> Result<GpuBuffer> {
    match op {
        ReduceOp::ArgMax => launch_reduce(be, op, x, view, None),
        _ => launch_reduce(be, op, x, view, Some(x.dtype())),
    }
}

/// [`reduce`] without the last rounding: an f16 input's sum stays the f32 the kernel computed
/// (`ReduceOps::sum_unrounded`).
fn sum_unrounded(be: &GpuBackend, x: &GpuBuffer, view: AxisView) -> Result<GpuBuffer> {
    launch_reduce(be, ReduceOp::Sum, x, view, None)
}

/// Runs `op` along the view's axis: with `values = Some(dtype)` the `*_values` entries, which
/// store the result in the input's element type (`dtype`), else the 32-bit entries (f32 bits, or
/// i32 for argmax).
fn launch_reduce(
    be: &GpuBackend,
    op: ReduceOp,
    x: &GpuBuffer,
    view: AxisView,
    values: Option<DType>,
) -> Result<GpuBuffer> {
    let what = format!("{op:?}");
    let [outer, len, inner, lines] = check_view(&what, x, view)?;
    let (code, _, words) = reduce_code(op);
    let out = be.alloc(lines as usize, values.unwrap_or(words))?;
    let params = [outer, len, inner, code];
    let shader = float_build(x.dtype());
    let rows = use_rows(lines as usize, len as usize);
    let (entry, groups) = match (rows, values.is_some()) {
        (true, false) => ("reduce_rows", lines as usize * WG as usize),
        (true, true) => ("reduce_rows_values", lines as usize * WG as usize),
        (false, false) => ("reduce_serial", lines as usize),
        (false, true) => ("reduce_serial_values", lines as usize),
    };
    be.launch(shader, entry, &[x, &out], &params, grid_1d(groups, WG)?)?;
    Ok(out)
}

/// `ReduceOps::cumsum` (entries `cumsum_serial` / `cumsum_rows`).
pub(crate) fn cumsum(
    be: &GpuBackend,
    x: &GpuBuffer,
    view: AxisView,
    reverse: bool,
) -> Result<GpuBuffer> {
    let [outer, len, inner, lines] = check_view("cumsum", x, view)?;
    let out = be.alloc(x.len(), x.dtype())?;
    let params = [outer, len, inner, reverse as u32];
    let shader = float_build(x.dtype());
    if use_rows(lines as usize, len as usize) {
        let groups = grid_1d(lines as usize * WG as usize, WG)?;
        be.launch(shader, "cumsum_rows", &[x, &out], &params, groups)?;
    } else {
        let groups = grid_1d(lines as usize, WG)?;
        be.launch(shader, "cumsum_serial", &[x, &out], &params, groups)?;
    }
    Ok(out)
}

impl ReduceOps for GpuBackend {
    fn reduce(&self, op: ReduceOp, x: &GpuBuffer, view: AxisView) -> Result<GpuBuffer> {
        reduce(self, op, x, view)
    }

    fn sum_unrounded(&self, x: &GpuBuffer, view: AxisView) -> Result<GpuBuffer> {
        sum_unrounded(self, x, view)
    }

    fn cumsum(&self, x: &GpuBuffer, view: AxisView, reverse: bool) -> Result<GpuBuffer> {
        cumsum(self, x, view, reverse)
    }

    fn argsort(
        &self,
        x: &GpuBuffer,
        rows: usize,
        len: usize,
        descending: bool,
    ) -> Result<GpuBuffer> {
        super::sort::argsort(self, x, rows, len, descending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every reduction's code equals the WGSL constant of its name, and the shader defines no
    /// other `REDUCE_*` constant.
    #[test]
    fn wgsl_reduce_codes_match_rust() {
        let wgsl = super::super::kernels::wgsl_u32_consts(REDUCE.source);
        let ops = [
            ReduceOp::Sum,
            ReduceOp::Max,
            ReduceOp::Min,
            ReduceOp::ArgMax,
        ];
        for op in ops {
            let (code, name, _) = reduce_code(op);
            assert_eq!(
                wgsl.get(name),
                Some(&code),
                "shaders/reduce.wgsl: {name} must be {code}u, as in reduce.rs"
            );
        }
        let named = wgsl.keys().filter(|k| k.starts_with("REDUCE_")).count();
        assert_eq!(
            named,
            ops.len(),
            "shaders/reduce.wgsl has REDUCE_ constants reduce.rs lacks"
        );
    }
}
