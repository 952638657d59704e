//! Launchers of `shaders/optim.wgsl`: the fused [`adam_step`] (Adam and AdamW) and [`sgd_step`]
//! (entries `sgd_plain` and `sgd_momentum`). Hyper-parameters are combined in f64 on the host
//! (`1 − β`, `lr·λ`) and passed as f32; each update writes fresh pooled buffers.

use super::kernels::{Shader, grid_1d, u32_param};
use super::{GpuBackend, GpuBuffer};
use crate::backend::{AdamHyper, SgdHyper};
use crate::{DType, Error, Result};

/// The kernels of `shaders/optim.wgsl`.
pub(crate) static OPTIM: Shader = Shader {
    name: "optim",
    source: include_str!("../../../shaders/optim.wgsl"),
};

/// Checks dtypes and lengths; returns the scale buffer to bind (the gradient when there is none)
/// and the `has_scale` flag.
fn check<'a>(
    what: &str,
    bufs: &[&GpuBuffer],
    grad: &'a GpuBuffer,
    grad_scale: Option<&'a GpuBuffer>,
) -> Result<(&'a GpuBuffer, u32)> {
    if bufs.iter().any(|b| b.dtype() != DType::F32) {
        return Err(Error::DType(format!(
            "{what}: parameter, gradient and state must share one float dtype (f32 on the GPU)"
        )));
    }
    let lens: Vec<usize> = bufs.iter().map(|b| b.len()).collect();
    if lens.iter().any(|&l| l != lens[0]) {
        return Err(Error::Shape(format!(
            "{what}: buffers of lengths {lens:?} must be equal"
        )));
    }
    match grad_scale {
        None => Ok((grad, 0)),
        Some(s) if s.len() == 1 && s.dtype() == DType::F32 => Ok((s, 1)),
        Some(s) if s.len() == 1 => Err(Error::DType(format!(
            "{what}: the gradient scale must be f32, got {}",
            s.dtype()
        ))),
        Some(s) => Err(Error::Shape(format!(
            "gradient scale must hold one value, it holds {}",
            s.len()
        ))),
    }
}

/// `Backend::adam_step` (entry `adam_step`): returns the new `(param, m, v)`.
pub(crate) fn adam_step(
    be: &GpuBackend,
    param: &GpuBuffer,
    grad: &GpuBuffer,
    grad_scale: Option<&GpuBuffer>,
    m: &GpuBuffer,
    v: &GpuBuffer,
    h: AdamHyper,
) -> Result<(GpuBuffer, GpuBuffer, GpuBuffer)> {
    let (scale, has_scale) = check("adam_step", &[param, grad, m, v], grad, grad_scale)?;
    let len = param.len();
    let n = u32_param(len, "adam_step: length")?;
    let (p2, m2, v2) = (
        be.alloc(len, DType::F32)?,
        be.alloc(len, DType::F32)?,
        be.alloc(len, DType::F32)?,
    );
    let f = |x: f64| (x as f32).to_bits();
    let params = [
        n,
        has_scale,
        h.decoupled as u32,
        0,
        f(h.lr),
        f(h.beta1),
        f(1.0 - h.beta1),
        f(h.beta2),
        f(1.0 - h.beta2),
        f(h.eps),
        f(h.weight_decay),
        f(h.lr * h.weight_decay),
        f(h.bias_correction1),
        f(h.bias_correction2),
    ];
    be.launch(
        &OPTIM,
        "adam_step",
        &[param, grad, scale, m, v, &p2, &m2, &v2],
        &params,
        grid_1d(len, 256)?,
    )?;
    Ok((p2, m2, v2))
}

/// `Backend::sgd_step` (entries `sgd_plain`, or `sgd_momentum` when momentum ≠ 0): returns the
/// new `(param, buf)`; without momentum the buffer is returned as it was.
pub(crate) fn sgd_step(
    be: &GpuBackend,
    param: &GpuBuffer,
    grad: &GpuBuffer,
    grad_scale: Option<&GpuBuffer>,
    buf: &GpuBuffer,
    h: SgdHyper,
) -> Result<(GpuBuffer, GpuBuffer)> {
    let len = param.len();
    let f = |x: f64| (x as f32).to_bits();
    if h.momentum == 0.0 {
        let (scale, has_scale) = check("sgd_step", &[param, grad, buf], grad, grad_scale)?;
        let n = u32_param(len, "sgd_step: length")?;
        let p2 = be.alloc(len, DType::F32)?;
        be.launch(
            &OPTIM,
            "sgd_plain",
            &[param, grad, scale, &p2],
            &[n, has_scale, 0, 0, f(h.lr), 0, f(h.weight_decay)],
            grid_1d(len, 256)?,
        )?;
        return Ok((p2, buf.clone()));
    }
    let (scale, has_scale) = check("sgd_step", &[param, grad, buf], grad, grad_scale)?;
    let n = u32_param(len, "sgd_step: length")?;
    let (p2, b2) = (be.alloc(len, DType::F32)?, be.alloc(len, DType::F32)?);
    be.launch(
        &OPTIM,
        "sgd_momentum",
        &[param, grad, scale, buf, &p2, &b2],
        &[
            n,
            has_scale,
            h.nesterov as u32,
            0,
            f(h.lr),
            f(h.momentum),
            f(h.weight_decay),
        ],
        grid_1d(len, 256)?,
    )?;
    Ok((p2, b2))
}
