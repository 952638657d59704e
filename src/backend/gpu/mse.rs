//! Launchers of `shaders/mse.wgsl`, the GPU end of `Tensor::mse`: [`mse_forward`] (the mean of
//! `(x − t)²`: partial sums of a fixed number of workgroups, then one workgroup adds them, two
//! dispatches) and [`mse_backward`] (`dx = (2/N)·g·(x − t)`, one invocation per element). f32
//! only: `Tensor::mse` computes an f16 prediction's loss in f32. Operands are checked (an
//! [`Error`] naming them, never a panic or a wgpu validation error); nothing is read back.

use super::kernels::{Shader, grid_1d, u32_param};
use super::{GpuBackend, GpuBuffer};
use crate::backend::checks::check_mse;
use crate::{DType, Error, Result};

/// The kernels of `shaders/mse.wgsl`.
pub(crate) static MSE_SHADER: Shader = Shader {
    name: "mse",
    builtin: true,
    source: include_str!("../../../shaders/mse.wgsl"),
};

/// Invocations per workgroup of every kernel in the file.
const WG: usize = 256;

/// The most workgroups `mse_partials` runs (so `mse_finish` adds at most this many sums, two per
/// invocation); a longer input is walked in strides of `MAX_PARTIALS · 256` elements.
const MAX_PARTIALS: usize = 512;

/// Checks the operands (f32 on the GPU); returns the params `[n, partials]`.
fn check(what: &str, x: &GpuBuffer, t: &GpuBuffer, g: Option<&GpuBuffer>) -> Result<[u32; 2]> {
    check_mse(what, x, t, g)?;
    if x.dtype() != DType::F32 {
        return Err(Error::DType(format!(
            "{what}: the GPU kernel takes f32, got {} (Tensor::mse casts f16 to f32)",
            x.dtype()
        )));
    }
    let partials = x.len().div_ceil(WG).min(MAX_PARTIALS);
    Ok([u32_param(x.len(), "mse elements")?, partials as u32])
}

/// `NnOps::mse_forward`: `[1]`, the mean of `(x − t)²`.
pub(crate) fn mse_forward(be: &GpuBackend, x: &GpuBuffer, t: &GpuBuffer) -> Result<GpuBuffer> {
    let params = check("mse", x, t, None)?;
    let partials = be.alloc(params[1] as usize, DType::F32)?;
    be.launch(
        &MSE_SHADER,
        "mse_partials",
        &[x, t, &partials],
        &params,
        [params[1], 1, 1],
    )?;
    let out = be.alloc(1, DType::F32)?;
    be.launch(
        &MSE_SHADER,
        "mse_finish",
        &[&partials, &out],
        &params,
        [1, 1, 1],
    )?;
    Ok(out)
}

/// `NnOps::mse_backward`: `dx [N]` for the upstream gradient `g` `[1]`.
pub(crate) fn mse_backward(
    be: &GpuBackend,
    g: &GpuBuffer,
    x: &GpuBuffer,
    t: &GpuBuffer,
) -> Result<GpuBuffer> {
    let params = check("mse backward", x, t, Some(g))?;
    let dx = be.alloc(x.len(), DType::F32)?;
    be.launch(
        &MSE_SHADER,
        "mse_backward",
        &[g, x, t, &dx],
        &params,
        grid_1d(x.len(), WG as u32)?,
    )?;
    Ok(dx)
}
