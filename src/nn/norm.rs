//! The normalisation layers over the last axis: [`LayerNorm`] (a learned scale and shift, over
//! the fused `Tensor::layer_norm`) and [`RmsNorm`] (a learned scale, over `Tensor::rms_norm`, the
//! norm of Llama-style blocks); both run the same backend kernels.

use super::Param;
use super::module::{Module, join};
use crate::nn::Parameters;
use crate::{DType, Device, Result, Tensor};

/// Layer normalisation over the last axis: `(x − mean) / √(var + eps) · γ + β` (biased variance).
pub struct LayerNorm {
    /// scale γ `[dim]`, initialised to 1
    pub weight: Param,
    /// shift β `[dim]`, initialised to 0
    pub bias: Param,
    /// added to the variance (default 1e-5)
    pub eps: f64,
}

impl LayerNorm {
    /// LayerNorm over a last axis of size `dim`.
    pub fn new(dim: usize, device: Device) -> Result<LayerNorm> {
        Ok(LayerNorm {
            weight: Param::new(Tensor::ones(&[dim], DType::F32, device)?)?,
            bias: Param::new(Tensor::zeros(&[dim], DType::F32, device)?)?,
            eps: 1e-5,
        })
    }
}

impl Module for LayerNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.layer_norm(&self.weight.get(), &self.bias.get(), self.eps)
    }
}

impl Parameters for LayerNorm {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(String, &Param)) {
        f(join(prefix, "weight"), &self.weight);
        f(join(prefix, "bias"), &self.bias);
    }
}

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
