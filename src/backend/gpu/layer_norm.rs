//! Launchers of `shaders/layer_norm.wgsl`, the GPU end of `Tensor::layer_norm` and
//! `Tensor::rms_norm` (`LayerNormDims::centered` false; RMSNorm passes `gamma` again for the
//! unread `beta` binding):
//!
//! - [`layer_norm_forward`] (entry `layer_norm_forward`): `y`, `mean`, `rstd`, one workgroup per
//!   row;
//! - [`layer_norm_backward`]: `layer_norm_backward_x` (`dx`, one workgroup per row) and
//!   `layer_norm_backward_params` (`dgamma`, `dbeta`, one workgroup per 8 columns, 32 strands
//!   of rows each, added in a fixed tree: deterministic, no atomics).
//!
//! Each launcher checks dtypes and lengths against the sizes (an [`Error`] naming them, never a
//! panic or a wgpu validation error) and encodes the kernels; nothing is read back. The rows
//! (`x`, `y`, `g`, `dx`) and the parameters (`gamma`, `beta` and their gradients) are each f32
//! or f16, in three builds: all f32, all f16, and f16 rows with f32 parameters (mixed
//! precision, which then never casts a norm's parameters).

use super::kernels::{Shader, grid_1d, u32_param};
use super::{GpuBackend, GpuBuffer};
use crate::backend::LayerNormDims;
use crate::backend::checks::check_layer_norm_lengths;
use crate::{DType, Error, Result};

/// The kernels of `shaders/layer_norm.wgsl`.
pub(crate) static LAYER_NORM_SHADER: Shader = Shader {
    name: "layer_norm",
    builtin: true,
    source: include_str!("../../../shaders/layer_norm.wgsl"),
};

/// Invocations per workgroup (the shader's `WG`).
const WG: u32 = 64;

/// Checks the dtypes and the lengths of `[rows, dim]`, `[dim]` and `[rows]` operands; returns
/// the kernel parameters `[rows, dim, eps bits, centered]` and the dtypes of the rows and of
/// the parameters: the `[rows, dim]` ones all f32 or all f16, the `[dim]` ones all f32 or all
/// f16 (but not f16 parameters with f32 rows), the `[rows]` statistics f32 in every build.
fn check(
    what: &str,
    groups: [(&[(&str, &GpuBuffer)], &str); 3],
    d: LayerNormDims,
) -> Result<([u32; 5], DType, DType)> {
    let LayerNormDims {
        rows,
        dim,
        eps,
        centered,
    } = d;
    rows.checked_mul(dim)
        .filter(|&n| n > 0 && n <= u32::MAX as usize)
        .ok_or_else(|| {
            Error::Shape(format!(
                "{what}: [{rows}, {dim}] must have sizes of at least 1 and fit the GPU kernels' \
                 32-bit indexing"
            ))
        })?;
    let [(matrices, _), (vectors, _), (per_row, _)] = groups;
    let dtype = super::half::float_operands(what, matrices)?;
    let param_dtype = super::half::float_operands(what, vectors)?;
    if dtype == DType::F32 && param_dtype == DType::F16 {
        return Err(Error::DType(format!(
            "{what}: f16 parameters with f32 rows (cast the parameters to f32, or the rows to f16)"
        )));
    }
    for (name, b) in per_row {
        if b.dtype() != DType::F32 {
            return Err(Error::DType(format!(
                "{what}: {name} must be f32 on the GPU (the per-row statistics stay f32), got {}",
                b.dtype()
            )));
        }
    }
    check_layer_norm_lengths(what, matrices, vectors, per_row, d)?;
    let params = [
        u32_param(rows, "layer_norm rows")?,
        u32_param(dim, "layer_norm dim")?,
        (eps as f32).to_bits(),
        u32::from(centered),
        0,
    ];
    Ok((params, dtype, param_dtype))
}

/// The build of `layer_norm.wgsl` for rows of `dtype` and parameters of `param_dtype`.
fn build(dtype: DType, param_dtype: DType) -> &'static Shader {
    match (dtype, param_dtype) {
        (DType::F16, DType::F16) => &super::half::LAYER_NORM_F16_SHADER,
        (DType::F16, _) => &super::half::LAYER_NORM_F16_ROWS_SHADER,
        _ => &LAYER_NORM_SHADER,
    }
}

/// `NnOps::layer_norm_forward`: `(y [rows, dim], mean [rows], rstd [rows])`.
///
/// # Errors
/// [`Error::DType`] for dtypes other than those of the three builds; [`Error::Shape`] for a
/// length that does not match the sizes or a zero size; a GPU error from the launch.
pub(crate) fn layer_norm_forward(
    be: &GpuBackend,
    x: &GpuBuffer,
    gamma: &GpuBuffer,
    beta: &GpuBuffer,
    d: LayerNormDims,
) -> Result<(GpuBuffer, GpuBuffer, GpuBuffer)> {
    let (params, dtype, param_dtype) = check(
        "layer_norm_forward",
        [
            (&[("x", x)], "[rows, dim]"),
            (&[("gamma", gamma), ("beta", beta)], "[dim]"),
            (&[], "[rows]"),
        ],
        d,
    )?;
    let y = be.alloc(x.len(), dtype)?;
    let mean = be.alloc(d.rows, DType::F32)?;
    let rstd = be.alloc(d.rows, DType::F32)?;
    be.launch(
        build(dtype, param_dtype),
        "layer_norm_forward",
        &[x, gamma, beta, &y, &mean, &rstd],
        &params,
        grid_1d(d.rows * WG as usize, WG)?,
    )?;
    Ok((y, mean, rstd))
}

/// `NnOps::layer_norm_backward`: `(dx [rows, dim], dgamma [dim], dbeta [dim])`.
///
/// # Errors
/// As [`layer_norm_forward`], for every operand.
pub(crate) fn layer_norm_backward(
    be: &GpuBackend,
    (g, pending): (&GpuBuffer, Option<&GpuBuffer>),
    x: &GpuBuffer,
    gamma: &GpuBuffer,
    (mean, rstd): (&GpuBuffer, &GpuBuffer),
    d: LayerNormDims,
) -> Result<(GpuBuffer, GpuBuffer, GpuBuffer)> {
    let mut matrices = vec![("g", g), ("x", x)];
    matrices.extend(pending.map(|p| ("the pending gradient", p)));
    let (mut params, dtype, param_dtype) = check(
        "layer_norm_backward",
        [
            (&matrices, "[rows, dim]"),
            (&[("gamma", gamma)], "[dim]"),
            (&[("mean", mean), ("rstd", rstd)], "[rows]"),
        ],
        d,
    )?;
    params[4] = u32::from(pending.is_some());
    let dx = be.alloc(x.len(), dtype)?;
    // without a pending gradient, binding 7 is g again (unread)
    be.launch(
        build(dtype, param_dtype),
        "layer_norm_backward_x",
        &[g, x, gamma, mean, rstd, &dx, pending.unwrap_or(g)],
        &params,
        grid_1d(d.rows * WG as usize, WG)?,
    )?;
    let dgamma = be.alloc(d.dim, param_dtype)?;
    let dbeta = be.alloc(d.dim, param_dtype)?;
    be.launch(
        build(dtype, param_dtype),
        "layer_norm_backward_params",
        &[g, x, mean, rstd, &dgamma, &dbeta],
        &params,
        // one workgroup of 256 per PCOLS = 8 columns
        grid_1d(d.dim.div_ceil(8) * 256, 256)?,
    )?;
    Ok((dx, dgamma, dbeta))
}
