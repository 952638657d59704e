//! Gradient-norm clipping on the device: the global norm `‖g‖ = √Σ‖g_i‖²` and the factor
//! `min(1, max_norm / (‖g‖ + 1e-6))` are one-element tensors; the optimizer multiplies the
//! gradients by the factor inside its update kernel, so nothing is read back. On the GPU both
//! come from one fused kernel over 24 gradients at a time plus one that forms the factor
//! (`GpuBackend::grad_norm_clip`), where the composed version took three or four small
//! dispatches per parameter. On the CPU the squares are summed in f64 in one parallel pass over
//! the gradients' values (`CpuBackend::grad_sum_of_squares`).

use crate::backend::Storage;
use crate::backend::cpu::CpuBackend;
use crate::backend::gpu::GpuBackend;
use crate::nn::Param;
use crate::{DType, Device, Error, Result, Tensor};

/// The GPU buffers of `grads` (those on the GPU; the callers check that all are).
pub(super) fn gpu_buffers(grads: &[Tensor]) -> Vec<&crate::backend::gpu::GpuBuffer> {
    grads
        .iter()
        .filter_map(|g| match g.storage() {
            Storage::Gpu(b) => Some(b),
            Storage::Cpu(_) => None,
        })
        .collect()
}

/// Returns `(norm, scale)` for the gradients of `params` (both one-element tensors on the
/// parameters' device), or `None` when no parameter has a gradient. An error while computing a
/// gradient (an expert bank's deferred gradient) is returned, not read as a missing gradient.
pub fn clip_grad_norm(
    params: &[(String, Param)],
    max_norm: f64,
) -> Result<Option<(Tensor, Tensor)>> {
    if !(max_norm.is_finite() && max_norm > 0.0) {
        return Err(Error::Invalid(format!(
            "max gradient norm must be a finite positive number, got {max_norm}"
        )));
    }
    let _guard = crate::NoGradGuard::new();
    let _profile = crate::profile::scope("clip grad norm", crate::profile::Pass::Optimizer);
    let mut grads = Vec::with_capacity(params.len());
    for (_, p) in params {
        if let Some(g) = p.try_grad()? {
            grads.push(g);
        }
    }
    if grads.is_empty() {
        return Ok(None);
    }
    let on_gpu = grads
        .iter()
        .all(|g| matches!(g.storage(), Storage::Gpu(_)) && g.dtype() == DType::F32);
    if on_gpu
        && let Ok(be) = GpuBackend::get()
        && be.grad_norm_supported()
    {
        let (norm, scale) = be.grad_norm_clip(&gpu_buffers(&grads), max_norm)?;
        return Ok(Some((
            Tensor::from_storage(Storage::Gpu(norm), vec![1]),
            Tensor::from_storage(Storage::Gpu(scale), vec![1]),
        )));
    }
    let on_cpu: Vec<_> = grads
        .iter()
        .filter_map(|g| match g.storage() {
            Storage::Cpu(b) => Some(b),
            Storage::Gpu(_) => None,
        })
        .collect();
    if on_cpu.len() == grads.len()
        && let Some(total) = CpuBackend.grad_sum_of_squares(&on_cpu)
    {
        let dtype = grads[0].dtype();
        let norm = total.sqrt();
        let scale = (max_norm / (norm + 1e-6)).clamp(0.0, 1.0);
        return Ok(Some((
            Tensor::scalar(norm, dtype, Device::Cpu)?.reshape(&[1])?,
            Tensor::scalar(scale, dtype, Device::Cpu)?.reshape(&[1])?,
        )));
    }
    let mut total: Option<Tensor> = None;
    for g in grads {
        let sq = g.mul(&g)?.sum_all()?;
        total = Some(match total {
            Some(t) => t.add(&sq)?,
            None => sq,
        });
    }
    let Some(total) = total else { return Ok(None) };
    let norm = total.sqrt()?.reshape(&[1])?;
    // scale = min(1, max_norm / (norm + 1e-6))
    let scale = norm
        .add_scalar(1e-6)?
        .recip()?
        .mul_scalar(max_norm)?
        .clamp(0.0, 1.0)?;
    Ok(Some((norm, scale)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::autograd::GroupedWeightGrad;

    #[test]
    fn an_error_while_computing_a_gradient_is_returned() {
        let bank =
            Param::new(Tensor::from_f64(vec![0.0], &[1, 1, 1], Device::Cpu).unwrap()).unwrap();
        bank.get()
            .accumulate_deferred(GroupedWeightGrad::uncomputable())
            .unwrap();
        let err = clip_grad_norm(&[("bank".into(), bank)], 1.0).unwrap_err();
        assert!(
            err.to_string().contains("grouped_weight_grad"),
            "expected the deferred gradient's error, got: {err}"
        );
    }
}
