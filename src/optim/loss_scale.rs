//! [`LossScale`]: dynamic loss scaling for mixed-precision training, decided on the device.
//!
//! In f16 a gradient below 2⁻²⁴ flushes to zero and one above 65504 overflows to infinity.
//! Multiplying the loss by a scale `s` before backward lifts the small gradients into f16's
//! range; the optimizer then multiplies the f32 parameter gradients by `1/s` (Micikevicius et
//! al. 2018, "Mixed Precision Training", §3.2). The scale is dynamic, as in PyTorch's
//! `GradScaler`: a step whose gradients hold an inf or NaN is skipped and `s` halves; after
//! `growth_interval` good steps in a row `s` doubles (at most 2²⁴, at least 1).
//!
//! Everything stays on the GPU: one kernel (`loss_scale_factor` in `shaders/optim.wgsl`) sums
//! the squared gradients (the same partial sums gradient clipping uses), detects the overflow
//! by the sum's bits, updates `s` and the counts in place, and writes the factor the update
//! kernels multiply the gradients by: `clip / s`, or −1, which makes every update kernel leave
//! the parameters and the optimizer's moments as they are. The host never waits; the skipped
//! steps are read when the trainer logs ([`LossScale::skipped_steps`]).
//!
//! PyTorch's `GradScaler` skips `optimizer.step()` on the host, so Adam's step count leaves
//! the skipped steps out. Here the host never learns that a step was skipped, so the factor
//! carries the count instead: it holds two values, the factor and the steps skipped so far,
//! and Adam's kernels take their bias corrections for `t − skipped` steps (computed on the
//! device). As in a PyTorch loop that calls `scheduler.step()` every iteration, the
//! learning-rate schedule still advances on a skipped step.

use crate::backend::Storage;
use crate::backend::gpu::GpuBackend;
use crate::nn::Param;
use crate::{DType, Device, Error, Result, Tensor};

/// The dynamic loss scale and its counts, on the GPU.
pub struct LossScale {
    /// `[]` f32: the current scale `s`, written in place by the update kernel
    scale: Tensor,
    /// `[2]` f32: good steps in a row, skipped steps
    counts: Tensor,
    growth_interval: u32,
}

impl LossScale {
    /// PyTorch `GradScaler`'s defaults: start at 2¹⁶, double after 2000 good steps.
    pub const INITIAL: f64 = 65536.0;
    /// Good steps in a row before the scale doubles.
    pub const GROWTH_INTERVAL: u32 = 2000;

    /// A loss scale starting at [`LossScale::INITIAL`] on `device`.
    ///
    /// # Errors
    /// A device other than the GPU (half precision is a GPU storage format).
    pub fn new(device: Device) -> Result<LossScale> {
        LossScale::with(Self::INITIAL, Self::GROWTH_INTERVAL, device)
    }

    /// A loss scale starting at `initial` that doubles after `growth_interval` good steps.
    ///
    /// # Errors
    /// A device other than the GPU, or `initial` not a finite number ≥ 1.
    pub fn with(initial: f64, growth_interval: u32, device: Device) -> Result<LossScale> {
        if !device.is_gpu() {
            return Err(Error::Device(
                "loss scaling is for f16-mixed training, which runs on the GPU only".into(),
            ));
        }
        if !(initial.is_finite() && initial >= 1.0) {
            return Err(Error::Invalid(format!(
                "the initial loss scale must be a finite number of at least 1, got {initial}"
            )));
        }
        Ok(LossScale {
            scale: Tensor::from_f32(vec![initial as f32], &[], device)?,
            counts: Tensor::zeros(&[2], DType::F32, device)?,
            growth_interval: growth_interval.max(1),
        })
    }

    /// Back-propagates `loss · s` from `loss` (no gradient flows to `s`): the walk starts with
    /// `s` itself as `loss`'s gradient, which is what the product's backward would hand `loss`
    /// (`1 · s`, exactly), so no product is recorded and neither it nor its backward runs.
    ///
    /// # Errors
    /// A loss that is not a scalar on the GPU, or an error of the backward pass.
    pub fn backward(&self, loss: &Tensor) -> Result<()> {
        if loss.numel() != 1 || !loss.device().is_gpu() {
            return Err(Error::Shape(format!(
                "loss scaling: the loss must be one value on the GPU, got {:?} on {}",
                loss.shape(),
                loss.device()
            )));
        }
        let seed = self.scale.to_dtype(loss.dtype())?.reshape(loss.shape())?;
        loss.backward_with(&seed)
    }

    /// After [`LossScale::backward`]: the unscaled global gradient norm (`[1]`)
    /// and the gradient scale to hand the optimizer (`[2]`: the factor the gradients are
    /// multiplied by, `clip / s` with clipping to `max_grad_norm` when it is > 0, or −1, a
    /// skipped step, when a gradient overflowed; then the steps skipped so far, which Adam's
    /// bias corrections leave out), both on the device; the scale and counts are updated.
    /// `None` when no parameter has a gradient.
    ///
    /// # Errors
    /// Gradients not f32 on the GPU, or an error computing one.
    pub fn unscale(
        &self,
        params: &[(String, Param)],
        max_grad_norm: f64,
    ) -> Result<Option<(Tensor, Tensor)>> {
        let _guard = crate::NoGradGuard::new();
        let _profile = crate::profile::scope("loss scale", crate::profile::Pass::Optimizer);
        let (Storage::Gpu(scale), Storage::Gpu(counts)) =
            (self.scale.storage(), self.counts.storage())
        else {
            return Err(Error::Device("loss scaling: the state left the GPU".into()));
        };
        let mut grads = Vec::with_capacity(params.len());
        for (name, p) in params {
            if let Some(mut g) = p.try_grad()? {
                let shares_scale = match g.storage() {
                    Storage::Gpu(b) if g.dtype() == DType::F32 => b.shares_buffer(scale),
                    _ => {
                        return Err(Error::Device(format!(
                            "loss scaling: the gradient of {name} is {} on {}; f16-mixed keeps \
                             f32 parameters on the GPU",
                            g.dtype(),
                            g.device()
                        )));
                    }
                };
                if shares_scale {
                    // the backward's seed reached this parameter unchanged (the loss adds it
                    // as it is): the kernel below rewrites the scale in place, so the
                    // parameter gets a copy of its own (x · 1 is x, bit for bit)
                    g = g.mul_scalar(1.0)?;
                    p.zero_grad();
                    p.get().accumulate_grad(g.clone())?;
                }
                grads.push(g);
            }
        }
        if grads.is_empty() {
            return Ok(None);
        }
        let bufs = super::clip::gpu_buffers(&grads);
        let (norm, factor) = GpuBackend::get()?.loss_scale_factor(
            &bufs,
            max_grad_norm.max(0.0),
            self.growth_interval,
            scale,
            counts,
        )?;
        Ok(Some((
            Tensor::from_storage(Storage::Gpu(norm), vec![1]),
            Tensor::from_storage(Storage::Gpu(factor), vec![2]),
        )))
    }

    /// The current scale (reads it back: for logs and tests, not for every step).
    ///
    /// # Errors
    /// A failed read-back.
    pub fn scale(&self) -> Result<f64> {
        self.scale.item()
    }

    /// The state a checkpoint keeps, by name: `scale` (`[]`) and `counts` (`[2]`: good steps in
    /// a row, skipped steps), so that a resumed run goes on with the scale it had reached.
    pub fn state(&self) -> Vec<(String, Tensor)> {
        vec![
            ("scale".into(), self.scale.clone()),
            ("counts".into(), self.counts.clone()),
        ]
    }

    /// Restores one entry of [`LossScale::state`].
    ///
    /// # Errors
    /// An unknown name, a tensor of the wrong shape or dtype, or a scale that is not a finite
    /// number ≥ 1.
    pub fn load_state(&mut self, name: &str, value: &Tensor) -> Result<()> {
        let (slot, shape): (&mut Tensor, &[usize]) = match name {
            "scale" => (&mut self.scale, &[]),
            "counts" => (&mut self.counts, &[2]),
            other => {
                return Err(Error::Invalid(format!(
                    "the loss scale has no state {other:?} (it keeps scale and counts)"
                )));
            }
        };
        if value.shape() != shape || value.dtype() != DType::F32 {
            return Err(Error::Shape(format!(
                "loss scale {name}: expected f32 {shape:?}, got {} {:?}",
                value.dtype(),
                value.shape()
            )));
        }
        let host = value.to_vec_f32()?;
        if name == "scale" && !host.iter().all(|s| s.is_finite() && *s >= 1.0) {
            return Err(Error::Invalid(format!(
                "loss scale {host:?} is not a finite number of at least 1"
            )));
        }
        // a fresh buffer of its own: the update kernel writes it in place
        *slot = Tensor::from_f32(host, shape, slot.device())?;
        Ok(())
    }

    /// The steps skipped so far because a gradient overflowed (reads it back).
    ///
    /// # Errors
    /// A failed read-back.
    pub fn skipped_steps(&self) -> Result<u64> {
        Ok(self.counts.to_vec_f32()?[1] as u64)
    }
}
