//! [`Activation`]: the activation functions as a value a builder takes (`nn::mlp`, the MoE
//! experts) and as a parameterless module.

use super::Param;
use super::module::Module;
use crate::nn::Parameters;
use crate::{Error, Result, Tensor};

/// Activation functions, as a value (for builders) and as a module.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// max(x, 0)
    Relu,
    /// GELU (tanh approximation)
    Gelu,
    /// x·σ(x)
    Silu,
    /// tanh
    Tanh,
    /// logistic σ
    Sigmoid,
    /// the gated unit of Llama-style MLPs: `silu(a) ⊙ b` over the two halves `[a | b]` of its
    /// input, so the layer before it is twice as wide as the hidden width
    /// ([`Activation::input_width`], [`Tensor::swiglu`])
    SwiGlu,
}

impl Activation {
    /// Applies the function.
    pub fn apply(self, x: &Tensor) -> Result<Tensor> {
        match self {
            Activation::Relu => x.relu(),
            Activation::Gelu => x.gelu(),
            Activation::Silu => x.silu(),
            Activation::Tanh => x.tanh(),
            Activation::Sigmoid => x.sigmoid(),
            Activation::SwiGlu => x.swiglu(),
        }
    }
    /// The width of the input that gives `hidden` outputs: `2·hidden` for the gated
    /// [`Activation::SwiGlu`] (gate and up side by side), `hidden` for the elementwise ones.
    pub fn input_width(self, hidden: usize) -> usize {
        match self {
            Activation::SwiGlu => 2 * hidden,
            _ => hidden,
        }
    }
    /// Parses `relu`, `gelu`, `silu`, `tanh`, `sigmoid` or `swiglu`.
    pub fn from_name(name: &str) -> Result<Activation> {
        Ok(match name {
            "relu" => Activation::Relu,
            "gelu" => Activation::Gelu,
            "silu" => Activation::Silu,
            "tanh" => Activation::Tanh,
            "sigmoid" => Activation::Sigmoid,
            "swiglu" => Activation::SwiGlu,
            other => {
                return Err(Error::Invalid(format!(
                    "unknown activation {other:?} (relu, gelu, silu, tanh, sigmoid, swiglu)"
                )));
            }
        })
    }
}

impl Module for Activation {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.apply(x)
    }
}

impl Parameters for Activation {
    fn visit_params(&self, _: &str, _: &mut dyn FnMut(String, &Param)) {}
}
