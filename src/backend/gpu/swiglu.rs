//! Launchers of `shaders/swiglu.wgsl`, the GPU end of `Tensor::swiglu`: [`swiglu_forward`] and
//! [`swiglu_backward`], one invocation per element of the `[rows, half]` output (the backward
//! writes both halves of its gradient row). Each checks dtypes and lengths (an [`Error`](crate::Error) naming
//! them, never a panic or a wgpu validation error) and encodes one kernel; nothing is read back.

use super::kernels::{Shader, grid_1d, u32_param};
use super::{GpuBackend, GpuBuffer};
use crate::backend::SwiGluDims;
use crate::backend::checks::check_swiglu_lengths;
use crate::{DType, Result};

/// The kernels of `shaders/swiglu.wgsl`.
pub(crate) static SWIGLU_SHADER: Shader = Shader {
    name: "swiglu",
    builtin: true,
    source: include_str!("../../../shaders/swiglu.wgsl"),
};

/// Checks the dtypes (all f32, or all f16: the f16 build) and the lengths; returns the kernel
/// parameters `[rows·half, half]` and the build to run.
fn check(
    what: &str,
    inputs: &[(&str, &GpuBuffer)],
    outputs: &[(&str, &GpuBuffer)],
    d: SwiGluDims,
) -> Result<([u32; 2], DType)> {
    let all: Vec<(&str, &GpuBuffer)> = inputs.iter().chain(outputs).copied().collect();
    let dtype = super::half::float_operands(what, &all)?;
    check_swiglu_lengths(what, inputs, outputs, d)?;
    // the input's 2·rows·half elements are indexed in 32 bits
    u32_param(2 * d.rows * d.half, "swiglu elements")?;
    Ok(([d.rows as u32 * d.half as u32, d.half as u32], dtype))
}

/// The build of `swiglu.wgsl` for tensors of `dtype`.
fn build(dtype: DType) -> &'static Shader {
    match dtype {
        DType::F16 => &super::half::SWIGLU_F16_SHADER,
        _ => &SWIGLU_SHADER,
    }
}

/// `NnOps::swiglu_forward`: `y [rows, half]`.
///
/// # Errors
/// [`Error::DType`](crate::Error::DType) unless `x` is f32 or f16; [`Error::Shape`](crate::Error::Shape) for a length that does not match the
/// sizes or a zero size; a GPU error from the launch.
pub(crate) fn swiglu_forward(be: &GpuBackend, x: &GpuBuffer, d: SwiGluDims) -> Result<GpuBuffer> {
    let (params, dtype) = check("swiglu", &[("x", x)], &[], d)?;
    let y = be.alloc(d.rows * d.half, dtype)?;
    be.launch(
        build(dtype),
        "swiglu_forward",
        &[x, &y],
        &params,
        grid_1d(d.rows * d.half, 256)?,
    )?;
    Ok(y)
}

/// `NnOps::swiglu_backward`: `dx [rows, 2·half]`.
///
/// # Errors
/// As [`swiglu_forward`], for `x` and `g`.
pub(crate) fn swiglu_backward(
    be: &GpuBackend,
    x: &GpuBuffer,
    g: &GpuBuffer,
    d: SwiGluDims,
) -> Result<GpuBuffer> {
    let (params, dtype) = check("swiglu backward", &[("x", x)], &[("g", g)], d)?;
    let dx = be.alloc(x.len(), dtype)?;
    be.launch(
        build(dtype),
        "swiglu_backward",
        &[x, g, &dx],
        &params,
        grid_1d(d.rows * d.half, 256)?,
    )?;
    Ok(dx)
}
