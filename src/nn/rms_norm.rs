//! [`RmsNorm`]: the normalisation layer of Llama-style blocks, a weight over the fused op
//! [`Tensor::rms_norm`] (see `ops/layer_norm.rs` for its math and kernels).

use super::module::join;
use super::{Module, Param, Parameters};
use crate::{DType, Device, Result, Tensor};

/// RMSNorm over the last axis: `x/√(mean(x²) + eps)·weight`, the weight starting at 1
/// (transformers' `LlamaRMSNorm`, `MixtralRMSNorm`, …).
pub struct RmsNorm {
    /// the scale `[dim]`
    pub weight: Param,
    /// added to the mean square (transformers' `rms_norm_eps`)
    pub eps: f64,
}

impl RmsNorm {
    /// An RMSNorm of width `dim` with weight 1.
    ///
    /// # Example
    /// ```
    /// use moegrad::nn::{Module, RmsNorm};
    /// use moegrad::{Device, Tensor};
    /// # fn main() -> moegrad::Result<()> {
    /// let norm = RmsNorm::new(2, 1e-6, Device::cpu())?;
    /// let y = norm.forward(&Tensor::from_f32(vec![3.0, 4.0], &[1, 2], Device::cpu())?)?;
    /// assert!((y.to_vec_f32()?[1] - 4.0 / 12.5f32.sqrt()).abs() < 1e-5);
    /// # Ok(()) }
    /// ```
    pub fn new(dim: usize, eps: f64, device: Device) -> Result<RmsNorm> {
        Ok(RmsNorm {
            weight: Param::new(Tensor::ones(&[dim], DType::F32, device)?)?,
            eps,
        })
    }
}

impl Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.rms_norm(&self.weight.get(), self.eps)
    }
}

impl Parameters for RmsNorm {
    /// Names `<prefix>.weight`.
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(String, &Param)) {
        f(join(prefix, "weight"), &self.weight);
    }
}
