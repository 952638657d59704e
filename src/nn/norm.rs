//! [`LayerNorm`], normalisation over the last axis with a learned scale and shift: a thin
//! struct over the fused `Tensor::layer_norm` (its kernels are in the backends).

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
