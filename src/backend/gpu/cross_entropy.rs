//! Launchers of `shaders/cross_entropy.wgsl`, the GPU end of `Tensor::cross_entropy_per_row`:
//! [`cross_entropy_forward`] (per-row loss and log-sum-exp, one workgroup per row) and
//! [`cross_entropy_backward`] (the logits' gradient, one invocation per element). Each checks
//! dtypes and lengths (an [`Error`] naming them, never a panic or a wgpu validation error) and
//! encodes one kernel; nothing is read back, so targets are not range-checked here (the shader
//! gives an out-of-range target's row loss 0 and gradient 0).

use super::kernels::{Shader, grid_1d, u32_param};
use super::{GpuBackend, GpuBuffer};
use crate::{DType, Error, Result};

/// The kernels of `shaders/cross_entropy.wgsl`.
pub(crate) static CROSS_ENTROPY_SHADER: Shader = Shader {
    name: "cross_entropy",
    builtin: true,
    source: include_str!("../../../shaders/cross_entropy.wgsl"),
};

/// The build for logits of `dtype`: f32, or f16 (`half::CROSS_ENTROPY_F16_SHADER`: f16 logits
/// and their gradient, f32 loss, log-sum-exp and arithmetic).
fn shader(dtype: DType) -> &'static Shader {
    match dtype {
        DType::F16 => &super::half::CROSS_ENTROPY_F16_SHADER,
        _ => &CROSS_ENTROPY_SHADER,
    }
}

/// Checks logits f32 `[rows, classes]` and targets i32 `[rows]`; returns `[rows, classes]` as
/// kernel parameters.
fn check(what: &str, logits: &GpuBuffer, targets: &GpuBuffer, classes: usize) -> Result<[u32; 4]> {
    let rows = targets.len();
    if !matches!(logits.dtype(), DType::F32 | DType::F16) || targets.dtype() != DType::I32 {
        return Err(Error::DType(format!(
            "{what}: logits must be f32 (or f16) and targets i32 on the GPU, got {} and {}",
            logits.dtype(),
            targets.dtype()
        )));
    }
    crate::backend::checks::check_cross_entropy_shape(what, logits, targets, classes)?;
    // g_scale 1 and g_stride 1 (the backward sets its own)
    Ok([
        u32_param(rows, "cross_entropy rows")?,
        u32_param(logits.len(), "cross_entropy logits")? / rows as u32,
        1f32.to_bits(),
        1,
    ])
}

/// `NnOps::cross_entropy_forward`: `(loss [rows], lse [rows])`.
///
/// # Errors
/// [`Error::DType`] / [`Error::Shape`] for operands that do not fit; a GPU error from the launch.
pub(crate) fn cross_entropy_forward(
    be: &GpuBackend,
    logits: &GpuBuffer,
    targets: &GpuBuffer,
    classes: usize,
) -> Result<(GpuBuffer, GpuBuffer)> {
    let params = check("cross_entropy", logits, targets, classes)?;
    let rows = targets.len();
    let loss = be.alloc(rows, DType::F32)?;
    let lse = be.alloc(rows, DType::F32)?;
    be.launch(
        shader(logits.dtype()),
        "cross_entropy_forward",
        &[logits, targets, &loss, &lse],
        &params,
        grid_1d(rows * 64, 64)?,
    )?;
    Ok((loss, lse))
}

/// `NnOps::cross_entropy_backward`: `dlogits [rows, classes]` for the upstream gradient
/// `g` `[rows]` or `[1]` (broadcast: `g_stride` 0) times `scale`.
///
/// # Errors
/// As [`cross_entropy_forward`], and for `lse` not f32 `[rows]` or `g` not f32 `[rows]` or
/// `[1]`.
pub(crate) fn cross_entropy_backward(
    be: &GpuBackend,
    (g, scale): (&GpuBuffer, f64),
    logits: &GpuBuffer,
    targets: &GpuBuffer,
    lse: &GpuBuffer,
) -> Result<GpuBuffer> {
    const WHAT: &str = "cross_entropy backward";
    let rows = targets.len();
    let classes = logits.len().checked_div(rows).unwrap_or(0);
    let mut params = check(WHAT, logits, targets, classes)?;
    for (name, b, broadcast) in [("g", g, true), ("lse", lse, false)] {
        if b.dtype() != DType::F32 || !(b.len() == rows || broadcast && b.len() == 1) {
            return Err(Error::Shape(format!(
                "{WHAT}: {name} must be f32 [{rows}]{}, got {} of {} values",
                if broadcast { " or [1]" } else { "" },
                b.dtype(),
                b.len()
            )));
        }
    }
    params[2] = (scale as f32).to_bits();
    params[3] = (g.len() == rows) as u32;
    let dx = be.alloc(logits.len(), logits.dtype())?;
    be.launch(
        shader(logits.dtype()),
        "cross_entropy_backward",
        &[g, logits, targets, lse, &dx],
        &params,
        grid_1d(logits.len(), 256)?,
    )?;
    Ok(dx)
}
