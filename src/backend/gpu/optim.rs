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
use crate::backend::OptimOps;
use crate::backend::{AdamHyper, SgdHyper};
use crate::{DType, Error, Result};

/// The kernels of `shaders/optim.wgsl`.
pub(crate) static OPTIM: Shader = Shader {
    name: "optim",
    builtin: true,
    source: include_str!("../../../shaders/optim.wgsl"),
};

/// Checks dtypes and lengths; returns the scale buffer to bind (the gradient when there is none)
/// and the `has_scale` flag: 0, or the scale's length (1: a factor; 2: a factor and the steps a
/// loss scale skipped, which Adam's bias corrections leave out).
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
    crate::backend::checks::check_same_lengths(what, bufs)?;
    match grad_scale {
        None => Ok((grad, 0)),
        Some(s) if (s.len() == 1 || s.len() == 2) && s.dtype() == DType::F32 => {
            Ok((s, s.len() as u32))
        }
        Some(s) if s.len() <= 2 => Err(Error::DType(format!(
            "{what}: the gradient scale must be f32, got {}",
            s.dtype()
        ))),
        Some(s) => Err(crate::backend::checks::grad_scale_length_error(s.len())),
    }
}

/// `OptimOps::adam_step` (entry `adam_step`): returns the new `(param, m, v)`.
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
fn adam_params(n: u32, has_scale: u32, h: AdamHyper) -> [u32; 16] {
    let f = |x: f64| (x as f32).to_bits();
    [
        n,
        has_scale,
        h.decoupled as u32,
        u32::try_from(h.step).unwrap_or(u32::MAX),
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
        f(h.beta1.ln()),
        f(h.beta2.ln()),
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
/// recorded earlier and run earlier, so they do not count (and nothing needs submitting to find
/// out, see [`GpuBackend::is_exclusive`]).
fn exclusive(be: &GpuBackend, bufs: &mut [&mut GpuBuffer]) -> Result<bool> {
    Ok(bufs.iter().all(|b| be.is_exclusive(b)))
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

/// `OptimOps::sgd_step` (entries `sgd_plain`, or `sgd_momentum` when momentum ≠ 0): returns the
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

/// Parameters one `adam_multi` dispatch updates (matches `ADAM_SLOTS` in the shader).
pub(crate) const ADAM_MULTI_SLOTS: usize = 12;

/// Storage buffers `adam_multi` binds: the scale, the two moment buffers and a (gradient,
/// parameter) pair per slot.
const ADAM_MULTI_BINDINGS: u32 = 3 + 2 * ADAM_MULTI_SLOTS as u32;

/// One parameter of a multi-tensor Adam step: its buffer (updated in place), its gradient, where
/// its moments start in the optimizer's flat moment buffers, and whether it takes weight decay.
pub(crate) struct AdamSlot<'a> {
    /// the parameter, f32
    pub param: &'a mut GpuBuffer,
    /// its gradient, f32, as long as the parameter
    pub grad: &'a GpuBuffer,
    /// the offset of its moments in `m` and `v`, in elements
    pub offset: usize,
    /// false for parameters exempt from weight decay
    pub decay: bool,
}

/// Whether the device binds enough storage buffers per shader stage for [`adam_multi_mut`]'s
/// one-dispatch path (devices with fewer take one dispatch per parameter).
pub(crate) fn adam_multi_supported(be: &GpuBackend) -> bool {
    let l = be.limits();
    l.max_storage_buffers_per_shader_stage >= ADAM_MULTI_BINDINGS
        // the storage buffers and the parameter block
        && l.max_buffers_and_acceleration_structures_per_shader_stage > ADAM_MULTI_BINDINGS
}

/// Makes `b` the only handle to its buffer, copying it into a fresh one when another tensor
/// shares it, so a kernel may overwrite it.
fn make_exclusive(be: &GpuBackend, b: &mut GpuBuffer) -> Result<()> {
    if !be.is_exclusive(b) {
        *b = super::layout::copy_strided(be, b, &[b.len()], &[1], 0)?;
    }
    Ok(())
}

/// The multi-tensor Adam step (entry `adam_multi`): every slot's parameter is updated in place,
/// its moments in `m` and `v` (`[total]`, the optimizer's flat buffers) at its offset; one
/// dispatch per [`ADAM_MULTI_SLOTS`] parameters. A parameter (or moment buffer) another tensor
/// shares is first copied, so that tensor keeps its values.
///
/// # Errors
/// Dtypes other than f32, a gradient of another length than its parameter, moments that do not
/// hold a slot's segment, or a device without the bindings ([`adam_multi_supported`]).
pub(crate) fn adam_multi_mut(
    be: &GpuBackend,
    slots: &mut [AdamSlot<'_>],
    m: &mut GpuBuffer,
    v: &mut GpuBuffer,
    grad_scale: Option<&GpuBuffer>,
    h: AdamHyper,
) -> Result<()> {
    const WHAT: &str = "adam_multi";
    if m.dtype() != DType::F32 || v.dtype() != DType::F32 || m.len() != v.len() {
        return Err(Error::DType(format!(
            "{WHAT}: the moments must be two f32 buffers of one length, got {} × {} and {} × {}",
            m.len(),
            m.dtype(),
            v.len(),
            v.dtype()
        )));
    }
    for (i, s) in slots.iter().enumerate() {
        check(WHAT, &[s.param, s.grad], s.grad, None)?;
        if s.offset
            .checked_add(s.param.len())
            .is_none_or(|end| end > m.len())
        {
            return Err(Error::Shape(format!(
                "{WHAT}: parameter {i} of {} elements at moment offset {} overruns the {} moments",
                s.param.len(),
                s.offset,
                m.len()
            )));
        }
    }
    let (_, has_scale) = match slots.first() {
        Some(s) => check(WHAT, &[s.grad], s.grad, grad_scale)?,
        None => return Ok(()),
    };
    if !adam_multi_supported(be) {
        return Err(Error::Invalid(format!(
            "{WHAT}: the device binds {} storage buffers per shader stage, the kernel needs {ADAM_MULTI_BINDINGS} (take one adam_step per parameter instead)",
            be.limits().max_storage_buffers_per_shader_stage
        )));
    }
    make_exclusive(be, m)?;
    make_exclusive(be, v)?;
    for s in slots.iter_mut() {
        make_exclusive(be, s.param)?;
    }
    for group in slots.chunks(ADAM_MULTI_SLOTS) {
        let mut table = [0u32; 4 * ADAM_MULTI_SLOTS];
        let mut total = 0usize;
        for (j, s) in group.iter().enumerate() {
            table[4 * j] = u32_param(total, "adam_multi: elements")?;
            table[4 * j + 1] = u32_param(s.param.len(), "adam_multi: parameter length")?;
            table[4 * j + 2] = u32_param(s.offset, "adam_multi: moment offset")?;
            table[4 * j + 3] = s.decay as u32;
            total += s.param.len();
        }
        let n = u32_param(total, "adam_multi: elements")?;
        // unused slots (len 0) bind the first slot's gradient and fresh one-element buffers
        let spare: Vec<GpuBuffer> = (group.len()..ADAM_MULTI_SLOTS)
            .map(|_| be.alloc(1, DType::F32))
            .collect::<Result<_>>()?;
        let scale = grad_scale.unwrap_or(group[0].grad);
        let mut buffers: Vec<&GpuBuffer> = vec![scale, &*m, &*v];
        for s in group {
            buffers.push(s.grad);
            buffers.push(&*s.param);
        }
        for p in &spare {
            buffers.push(group[0].grad);
            buffers.push(p);
        }
        let mut params = adam_params(n, has_scale, h).to_vec();
        params.extend(table);
        be.launch(
            &OPTIM,
            "adam_multi",
            &buffers,
            &params,
            grid_1d(total, 256)?,
        )?;
    }
    Ok(())
}

/// Gradients one `grad_sumsq` dispatch reads (matches `NORM_SLOTS` in the shader).
pub(crate) const NORM_SLOTS: usize = 24;

/// Elements one `grad_sumsq` workgroup sums (matches `NORM_CHUNK`).
const NORM_CHUNK: usize = 4096;

/// Whether the device binds the `NORM_SLOTS` gradients and the partial sums of `grad_sumsq`.
pub(crate) fn grad_norm_supported(be: &GpuBackend) -> bool {
    let l = be.limits();
    let storage = NORM_SLOTS as u32 + 1;
    l.max_storage_buffers_per_shader_stage >= storage
        && l.max_buffers_and_acceleration_structures_per_shader_stage > storage
}

/// The partial sums of squares of `grads` (entry `grad_sumsq`, one dispatch per
/// [`NORM_SLOTS`] gradients) and how many there are: the first half of [`grad_norm_clip`] and
/// [`loss_scale_factor`].
fn grad_sumsq_partials(
    be: &GpuBackend,
    grads: &[&GpuBuffer],
    what: &str,
) -> Result<(GpuBuffer, usize)> {
    if let Some(g) = grads.iter().find(|g| g.dtype() != DType::F32) {
        return Err(Error::DType(format!(
            "{what}: gradients must be f32 on the GPU, got {}",
            g.dtype()
        )));
    }
    if !grad_norm_supported(be) {
        return Err(Error::Invalid(format!(
            "{what}: the device binds {} storage buffers per shader stage, the fused norm needs {}",
            be.limits().max_storage_buffers_per_shader_stage,
            NORM_SLOTS + 1
        )));
    }
    let groups: Vec<&[&GpuBuffer]> = grads.chunks(NORM_SLOTS).collect();
    let totals: Vec<usize> = groups
        .iter()
        .map(|g| g.iter().map(|b| b.len()).sum())
        .collect();
    let partial_count: usize = totals.iter().map(|t| t.div_ceil(NORM_CHUNK)).sum();
    let partials = be.alloc(partial_count.max(1), DType::F32)?;
    let mut written = 0usize;
    for (group, &total) in groups.iter().zip(&totals) {
        if total == 0 {
            continue;
        }
        let mut params = vec![
            u32_param(total, "clip_grad_norm: elements")?,
            u32_param(written, "clip_grad_norm: partial sums")?,
            0,
            0,
        ];
        let mut start = 0usize;
        let mut buffers: Vec<&GpuBuffer> = vec![&partials];
        for s in 0..NORM_SLOTS {
            match group.get(s) {
                Some(g) => {
                    params.extend([
                        u32_param(start, "clip_grad_norm: elements")?,
                        g.len() as u32,
                    ]);
                    start += g.len();
                    buffers.push(g);
                }
                None => {
                    params.extend([0, 0]);
                    buffers.push(group[0]);
                }
            }
        }
        let workgroups = total.div_ceil(NORM_CHUNK);
        be.launch(
            &OPTIM,
            "grad_sumsq",
            &buffers,
            &params,
            grid_1d(workgroups * 256, 256)?,
        )?;
        written += workgroups;
    }
    Ok((partials, written))
}

/// The global norm `‖g‖ = √Σ‖g_i‖²` of `grads` and the clip factor
/// `clamp(max_norm / (‖g‖ + 1e-6), 0, 1)`, as two one-element buffers (entries `grad_sumsq`, one
/// dispatch per [`NORM_SLOTS`] gradients, and `grad_clip_scale`). Nothing is read back.
///
/// # Errors
/// A gradient that is not f32, or a device without the bindings ([`grad_norm_supported`]).
pub(crate) fn grad_norm_clip(
    be: &GpuBackend,
    grads: &[&GpuBuffer],
    max_norm: f64,
) -> Result<(GpuBuffer, GpuBuffer)> {
    let (partials, written) = grad_sumsq_partials(be, grads, "clip_grad_norm")?;
    let norm = be.alloc(1, DType::F32)?;
    let scale = be.alloc(1, DType::F32)?;
    be.launch(
        &OPTIM,
        "grad_clip_scale",
        &[&partials, &norm, &scale],
        &[
            u32_param(written, "clip_grad_norm: partial sums")?,
            0,
            (max_norm as f32).to_bits(),
            0,
        ],
        [1, 1, 1],
    )?;
    Ok((norm, scale))
}

/// Mixed precision's step decision (entry `loss_scale_factor`): from the *scaled* gradients
/// `grads`, the unscaled global norm (`[1]`) and the gradient scale the optimizer takes
/// (`[2]`: the factor `clip / scale`, or −1, "skip", when a gradient is inf or NaN; and the
/// steps skipped so far, which Adam's bias corrections leave out); the loss scale `scale`
/// (`[1]`) and `counts` (`[2]`: good steps in a row, skipped steps) are updated in place.
/// `max_norm` 0 clips nothing. Nothing is read back.
///
/// # Errors
/// As [`grad_norm_clip`], and state buffers of the wrong length or dtype.
pub(crate) fn loss_scale_factor(
    be: &GpuBackend,
    grads: &[&GpuBuffer],
    max_norm: f64,
    growth_interval: u32,
    scale: &GpuBuffer,
    counts: &GpuBuffer,
) -> Result<(GpuBuffer, GpuBuffer)> {
    const WHAT: &str = "loss_scale";
    if scale.len() != 1 || counts.len() != 2 || scale.dtype() != DType::F32 {
        return Err(Error::Shape(format!(
            "{WHAT}: the state is an f32 scale [1] and counts [2], got {} [{}] and [{}]",
            scale.dtype(),
            scale.len(),
            counts.len()
        )));
    }
    let (partials, written) = grad_sumsq_partials(be, grads, WHAT)?;
    let norm = be.alloc(1, DType::F32)?;
    let factor = be.alloc(2, DType::F32)?;
    be.launch(
        &OPTIM,
        "loss_scale_factor",
        &[&partials, &norm, &factor, scale, counts],
        &[
            u32_param(written, "loss_scale: partial sums")?,
            0,
            (max_norm as f32).to_bits(),
            growth_interval.max(1),
        ],
        [1, 1, 1],
    )?;
    Ok((norm, factor))
}

/// The optimizers' entry points on the handle (the fused steps above, and the multi-tensor
/// Adam and gradient-norm kernels).
impl GpuBackend {
    /// The optimizers' Adam update, written into `param`, `m` and `v` where they are when no other
    /// tensor shares them (fresh buffers replace them otherwise).
    ///
    /// # Errors
    /// As [`crate::backend::OptimOps::adam_step`]: dtypes other than f32, unequal lengths, or a
    /// gradient scale that is not one f32.
    pub(crate) fn adam_step_mut(
        &self,
        param: &mut GpuBuffer,
        grad: &GpuBuffer,
        grad_scale: Option<&GpuBuffer>,
        m: &mut GpuBuffer,
        v: &mut GpuBuffer,
        h: AdamHyper,
    ) -> Result<()> {
        adam_step_mut(self, param, grad, grad_scale, m, v, h)
    }

    /// The optimizers' SGD update, written into `param` and `buf` where they are when no other
    /// tensor shares them (fresh buffers replace them otherwise).
    ///
    /// # Errors
    /// As [`crate::backend::OptimOps::sgd_step`].
    pub(crate) fn sgd_step_mut(
        &self,
        param: &mut GpuBuffer,
        grad: &GpuBuffer,
        grad_scale: Option<&GpuBuffer>,
        buf: &mut GpuBuffer,
        h: SgdHyper,
    ) -> Result<()> {
        sgd_step_mut(self, param, grad, grad_scale, buf, h)
    }

    /// Whether this device can run [`GpuBackend::adam_multi_mut`] (it binds 27 storage buffers
    /// per shader stage; WebGPU's minimum is 8).
    pub(crate) fn adam_multi_supported(&self) -> bool {
        adam_multi_supported(self)
    }

    /// The multi-tensor Adam step: every slot's parameter updated in place with its moments
    /// in the flat buffers `m` and `v` at its offset, [`ADAM_MULTI_SLOTS`] parameters per
    /// dispatch (so one dispatch for a small model).
    ///
    /// # Errors
    /// Dtypes other than f32, a gradient of another length than its parameter, moments that do
    /// not hold a slot's segment, or a device without the bindings
    /// ([`GpuBackend::adam_multi_supported`]).
    pub(crate) fn adam_multi_mut(
        &self,
        slots: &mut [AdamSlot<'_>],
        m: &mut GpuBuffer,
        v: &mut GpuBuffer,
        grad_scale: Option<&GpuBuffer>,
        h: AdamHyper,
    ) -> Result<()> {
        adam_multi_mut(self, slots, m, v, grad_scale, h)
    }

    /// Whether this device can run [`GpuBackend::grad_norm_clip`] (it binds 25 storage buffers
    /// per shader stage).
    pub(crate) fn grad_norm_supported(&self) -> bool {
        grad_norm_supported(self)
    }

    /// Gradient clipping's global norm `√Σ‖g_i‖²` over `grads` and the factor
    /// `clamp(max_norm / (norm + 1e-6), 0, 1)`, as one-element buffers computed on the device
    /// in one dispatch per [`NORM_SLOTS`] gradients plus one.
    ///
    /// # Errors
    /// A gradient that is not f32, or a device without the bindings
    /// ([`GpuBackend::grad_norm_supported`]).
    pub(crate) fn grad_norm_clip(
        &self,
        grads: &[&GpuBuffer],
        max_norm: f64,
    ) -> Result<(GpuBuffer, GpuBuffer)> {
        grad_norm_clip(self, grads, max_norm)
    }

    /// [`loss_scale_factor`]: mixed precision's step decision, on the device.
    pub(crate) fn loss_scale_factor(
        &self,
        grads: &[&GpuBuffer],
        max_norm: f64,
        growth_interval: u32,
        scale: &GpuBuffer,
        counts: &GpuBuffer,
    ) -> Result<(GpuBuffer, GpuBuffer)> {
        loss_scale_factor(self, grads, max_norm, growth_interval, scale, counts)
    }
}

impl OptimOps for GpuBackend {
    fn adam_step(
        &self,
        param: &GpuBuffer,
        grad: &GpuBuffer,
        grad_scale: Option<&GpuBuffer>,
        m: &GpuBuffer,
        v: &GpuBuffer,
        h: AdamHyper,
    ) -> Result<(GpuBuffer, GpuBuffer, GpuBuffer)> {
        adam_step(self, param, grad, grad_scale, m, v, h)
    }

    fn sgd_step(
        &self,
        param: &GpuBuffer,
        grad: &GpuBuffer,
        grad_scale: Option<&GpuBuffer>,
        buf: &GpuBuffer,
        h: SgdHyper,
    ) -> Result<(GpuBuffer, GpuBuffer)> {
        sgd_step(self, param, grad, grad_scale, buf, h)
    }
}
