//! Gradient-norm clipping on the device: the global norm `‖g‖ = √Σ‖g_i‖²` and the factor
//! `min(1, max_norm / (‖g‖ + 1e-6))` are one-element tensors; the optimizer multiplies the
//! gradients by the factor inside its update kernel, so nothing is read back. On the GPU both
//! come from one fused kernel over 24 gradients at a time plus one that forms the factor
//! (`GpuBackend::grad_norm_clip`), where the composed version took three or four small
//! dispatches per parameter. On the CPU the squares are summed in f64 in one parallel pass over
//! the gradients' values ([`cpu_sum_of_squares`]).

use crate::backend::Storage;
use crate::backend::cpu::CpuBuffer;
use crate::backend::gpu::GpuBackend;
use crate::nn::Param;
use crate::{DType, Device, Error, Result, Tensor};

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
        let bufs: Vec<_> = grads
            .iter()
            .filter_map(|g| match g.storage() {
                Storage::Gpu(b) => Some(b),
                Storage::Cpu(_) => None,
            })
            .collect();
        let (norm, scale) = be.grad_norm_clip(&bufs, max_norm)?;
        return Ok(Some((
            Tensor::from_storage(Storage::Gpu(norm), vec![1]),
            Tensor::from_storage(Storage::Gpu(scale), vec![1]),
        )));
    }
    if let Some(total) = cpu_sum_of_squares(&grads) {
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

/// `Σ_i ‖g_i‖²` in f64 when every gradient is a CPU buffer of one float dtype (`None`
/// otherwise): one parallel pass over the host values, where the composed version squared each
/// gradient into a new buffer and then summed it.
fn cpu_sum_of_squares(grads: &[Tensor]) -> Option<f64> {
    use rayon::prelude::*;
    // eight running sums per chunk, so that the loop vectorises and no addition waits for the
    // one before it
    fn sum_sq<T: Copy + Into<f64> + Sync>(v: &[T]) -> f64 {
        let chunk_sum = |c: &[T]| {
            let mut lanes = [0.0f64; 8];
            let whole = c.chunks_exact(8);
            let tail: f64 = whole.remainder().iter().map(|&x| x.into() * x.into()).sum();
            for w in whole {
                for (acc, &x) in lanes.iter_mut().zip(w) {
                    *acc += x.into() * x.into();
                }
            }
            lanes.iter().sum::<f64>() + tail
        };
        v.par_chunks(1 << 14).map(chunk_sum).sum()
    }
    let dtype = grads.first()?.dtype();
    let mut total = 0.0;
    for g in grads {
        total += match (g.storage(), dtype) {
            (Storage::Cpu(CpuBuffer::F32(v)), DType::F32) => sum_sq(v),
            (Storage::Cpu(CpuBuffer::F64(v)), DType::F64) => sum_sq(v),
            _ => return None,
        };
    }
    Some(total)
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
