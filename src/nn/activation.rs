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
        }
    }
    /// Parses `relu`, `gelu`, `silu`, `tanh` or `sigmoid`.
    pub fn from_name(name: &str) -> Result<Activation> {
        Ok(match name {
            "relu" => Activation::Relu,
            "gelu" => Activation::Gelu,
            "silu" => Activation::Silu,
            "tanh" => Activation::Tanh,
            "sigmoid" => Activation::Sigmoid,
            other => {
                return Err(Error::Invalid(format!(
                    "unknown activation {other:?} (relu, gelu, silu, tanh, sigmoid)"
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
