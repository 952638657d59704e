//! Launchers of `shaders/optim.wgsl`: the fused [`adam_step`] (Adam and AdamW) and [`sgd_step`]
//! (entries `sgd_plain` and `sgd_momentum`). Hyper-parameters are combined in f64 on the host
//! (`1 − β`, `lr·λ`) and passed as f32.
//!
//! The functional forms write fresh pooled buffers. The `_mut` forms, which the optimizers call,
//! update the parameter and its state where they are (entries `*_in_place`) when no other tensor
//! shares those buffers, so a training step holds no second copy of the parameters and state;
//! when one does (a tensor kept from before the step), they fall back to fresh buffers, as
//! `Arc::make_mut` does on the CPU.

use super::kernels::{Shader, grid_1d, u32_param};
use super::{GpuBackend, GpuBuffer};
use crate::backend::{AdamHyper, SgdHyper};
use crate::{DType, Error, Result};
use std::sync::Arc;

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
    be.launch(
        &OPTIM,
        "adam_step",
        &[param, grad, scale, m, v, &p2, &m2, &v2],
        &adam_params(n, has_scale, h),
        grid_1d(len, 256)?,
    )?;
    Ok((p2, m2, v2))
}

/// `AdamParams` of `shaders/optim.wgsl`.
fn adam_params(n: u32, has_scale: u32, h: AdamHyper) -> [u32; 14] {
    let f = |x: f64| (x as f32).to_bits();
    [
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
    ]
}

/// `SgdParams` of `shaders/optim.wgsl`.
fn sgd_params(n: u32, has_scale: u32, h: SgdHyper) -> [u32; 7] {
    let f = |x: f64| (x as f32).to_bits();
    [
        n,
        has_scale,
        h.nesterov as u32,
        0,
        f(h.lr),
        f(h.momentum),
        f(h.weight_decay),
    ]
}

/// Whether each of `bufs` is the only handle to its pooled buffer, so a kernel may overwrite it
/// in place. The pending batch also holds the buffers its queued kernels use; those kernels were
/// recorded earlier and run earlier, so they do not count: the batch is submitted (dropping its
/// holds) before a buffer is judged shared.
fn exclusive(be: &GpuBackend, bufs: &mut [&mut GpuBuffer]) -> Result<bool> {
    let unique =
        |bufs: &mut [&mut GpuBuffer]| bufs.iter_mut().all(|b| Arc::get_mut(&mut b.buf).is_some());
    if unique(bufs) {
        return Ok(true);
    }
    be.flush()?;
    Ok(unique(bufs))
}

/// [`adam_step`] updating `param`, `m` and `v` where they are (entry `adam_in_place`) when
/// nothing else shares them; otherwise they are replaced by the fresh buffers of [`adam_step`].
pub(crate) fn adam_step_mut(
    be: &GpuBackend,
    param: &mut GpuBuffer,
    grad: &GpuBuffer,
    grad_scale: Option<&GpuBuffer>,
    m: &mut GpuBuffer,
    v: &mut GpuBuffer,
    h: AdamHyper,
) -> Result<()> {
    let (scale, has_scale) = check("adam_step", &[param, grad, m, v], grad, grad_scale)?;
    let len = param.len();
    let n = u32_param(len, "adam_step: length")?;
    if !exclusive(be, &mut [&mut *param, &mut *m, &mut *v])? {
        (*param, *m, *v) = adam_step(be, param, grad, grad_scale, m, v, h)?;
        return Ok(());
    }
    be.launch(
        &OPTIM,
        "adam_in_place",
        &[param, grad, scale, m, v],
        &adam_params(n, has_scale, h),
        grid_1d(len, 256)?,
    )
}

/// [`sgd_step`] updating `param` and `buf` where they are (entries `sgd_plain_in_place`,
/// `sgd_momentum_in_place`) when nothing else shares them; otherwise they are replaced by the
/// fresh buffers of [`sgd_step`].
pub(crate) fn sgd_step_mut(
    be: &GpuBackend,
    param: &mut GpuBuffer,
    grad: &GpuBuffer,
    grad_scale: Option<&GpuBuffer>,
    buf: &mut GpuBuffer,
    h: SgdHyper,
) -> Result<()> {
    let (scale, has_scale) = check("sgd_step", &[param, grad, buf], grad, grad_scale)?;
    let len = param.len();
    let n = u32_param(len, "sgd_step: length")?;
    let params = sgd_params(n, has_scale, h);
    if h.momentum == 0.0 {
        if !exclusive(be, &mut [&mut *param])? {
            (*param, *buf) = sgd_step(be, param, grad, grad_scale, buf, h)?;
            return Ok(());
        }
        return be.launch(
            &OPTIM,
            "sgd_plain_in_place",
            &[param, grad, scale],
            &params,
            grid_1d(len, 256)?,
        );
    }
    if !exclusive(be, &mut [&mut *param, &mut *buf])? {
        (*param, *buf) = sgd_step(be, param, grad, grad_scale, buf, h)?;
        return Ok(());
    }
    be.launch(
        &OPTIM,
        "sgd_momentum_in_place",
        &[param, grad, scale, buf],
        &params,
        grid_1d(len, 256)?,
    )
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
    let (scale, has_scale) = check("sgd_step", &[param, grad, buf], grad, grad_scale)?;
    let len = param.len();
    let n = u32_param(len, "sgd_step: length")?;
    if h.momentum == 0.0 {
        let p2 = be.alloc(len, DType::F32)?;
        be.launch(
            &OPTIM,
            "sgd_plain",
            &[param, grad, scale, &p2],
            &sgd_params(n, has_scale, h),
            grid_1d(len, 256)?,
        )?;
        return Ok((p2, buf.clone()));
    }
    let (p2, b2) = (be.alloc(len, DType::F32)?, be.alloc(len, DType::F32)?);
    be.launch(
        &OPTIM,
        "sgd_momentum",
        &[param, grad, scale, buf, &p2, &b2],
        &sgd_params(n, has_scale, h),
        grid_1d(len, 256)?,
    )?;
    Ok((p2, b2))
}
