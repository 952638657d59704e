//! The standard layers: Linear, Conv2d, MaxPool2d, AvgPool2d, Flatten, Embedding, LayerNorm and
//! the activation functions as modules. Each is a thin struct over the differentiable ops in
//! `ops/`; the math lives there, the parameters here.

use super::Param;
use super::init::{Init, weight};
use super::module::{Module, join};
use crate::nn::Parameters;
use crate::{DType, Device, Error, Result, Tensor};
use rand_chacha::ChaCha8Rng;

/// `y = x·W + b`, with `W: [in, out]` and `b: [out]` (or `y = x·W` without a bias, as in the
/// projections of Llama-style blocks); `x` is `[..., in]`.
pub struct Linear {
    /// weight `[in, out]`
    pub weight: Param,
    /// bias `[out]`, None for a layer without one
    pub bias: Option<Param>,
}

impl Linear {
    /// A linear layer with Kaiming- or Xavier-uniform weight and zero bias.
    pub fn new(
        inputs: usize,
        outputs: usize,
        init: Init,
        rng: &mut ChaCha8Rng,
        device: Device,
    ) -> Result<Linear> {
        Ok(Linear {
            weight: Param::new(weight(
                init,
                &[inputs, outputs],
                inputs,
                outputs,
                rng,
                device,
            )?)?,
            bias: Some(Param::new(Tensor::zeros(&[outputs], DType::F32, device)?)?),
        })
    }

    /// A linear layer `W: [in, out]` without a bias, its weight drawn N(0, std²).
    pub fn normal_without_bias(
        inputs: usize,
        outputs: usize,
        std: f64,
        rng: &mut ChaCha8Rng,
        device: Device,
    ) -> Result<Linear> {
        Ok(Linear {
            weight: Param::new(super::normal(&[inputs, outputs], std, rng, device)?)?,
            bias: None,
        })
    }

    /// The output width.
    pub fn outputs(&self) -> usize {
        self.weight.get().shape()[1]
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let w = self.weight.get();
        let (inputs, outputs) = (w.shape()[0], w.shape()[1]);
        if x.rank() == 0 || x.shape()[x.rank() - 1] != inputs {
            return Err(Error::Shape(format!(
                "Linear({inputs} → {outputs}) got input of shape {:?}",
                x.shape()
            )));
        }
        let lead = &x.shape()[..x.rank() - 1];
        let rows: usize = lead.iter().product();
        let y = x.reshape(&[rows, inputs])?.matmul(&w)?;
        let y = match &self.bias {
            Some(b) => y.add(&b.get())?,
            None => y,
        };
        let mut shape = lead.to_vec();
        shape.push(outputs);
        y.reshape(&shape)
    }
}

impl Parameters for Linear {
    /// Names `<prefix>.weight` and, with a bias, `<prefix>.bias`.
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(String, &Param)) {
        f(join(prefix, "weight"), &self.weight);
        if let Some(b) = &self.bias {
            f(join(prefix, "bias"), b);
        }
    }
}

/// 2-D convolution with a `[out, in, k, k]` weight (PyTorch layout) and an `[out]` bias.
pub struct Conv2d {
    /// weight `[out_channels, in_channels, k, k]`
    pub weight: Param,
    /// bias `[out_channels]`
    pub bias: Param,
    /// step between windows
    pub stride: usize,
    /// zeros added on every side
    pub padding: usize,
}

impl Conv2d {
    /// A convolution with Kaiming-uniform weight (fan-in `in·k·k`) and zero bias.
    pub fn new(
        in_channels: usize,
        out_channels: usize,
        kernel: usize,
        stride: usize,
        padding: usize,
        rng: &mut ChaCha8Rng,
        device: Device,
    ) -> Result<Conv2d> {
        if stride == 0 || kernel == 0 {
            return Err(Error::Invalid(format!(
                "Conv2d: kernel {kernel} and stride {stride} must be at least 1"
            )));
        }
        let fan_in = in_channels * kernel * kernel;
        let fan_out = out_channels * kernel * kernel;
        let shape = [out_channels, in_channels, kernel, kernel];
        Ok(Conv2d {
            weight: Param::new(weight(
                Init::KaimingUniform,
                &shape,
                fan_in,
                fan_out,
                rng,
                device,
            )?)?,
            bias: Param::new(Tensor::zeros(&[out_channels], DType::F32, device)?)?,
            stride,
            padding,
        })
    }
}

impl Module for Conv2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.conv2d(
            &self.weight.get(),
            Some(&self.bias.get()),
            self.stride,
            self.padding,
        )
    }
}

impl Parameters for Conv2d {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(String, &Param)) {
        f(join(prefix, "weight"), &self.weight);
        f(join(prefix, "bias"), &self.bias);
    }
}

/// Max over `kernel × kernel` windows moved by `stride`.
pub struct MaxPool2d {
    /// window side
    pub kernel: usize,
    /// step between windows
    pub stride: usize,
}

impl Module for MaxPool2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.max_pool2d(self.kernel, self.stride)
    }
}

impl Parameters for MaxPool2d {
    fn visit_params(&self, _: &str, _: &mut dyn FnMut(String, &Param)) {}
}

/// Mean over `kernel × kernel` windows moved by `stride`.
pub struct AvgPool2d {
    /// window side
    pub kernel: usize,
    /// step between windows
    pub stride: usize,
}

impl Module for AvgPool2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.avg_pool2d(self.kernel, self.stride)
    }
}

impl Parameters for AvgPool2d {
    fn visit_params(&self, _: &str, _: &mut dyn FnMut(String, &Param)) {}
}

/// `[B, d1, d2, ...] → [B, d1·d2·...]`.
pub struct Flatten;

impl Module for Flatten {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if x.rank() == 0 {
            return Err(Error::Shape(
                "Flatten needs a batch axis, got a scalar".into(),
            ));
        }
        let b = x.shape()[0];
        x.reshape(&[b, x.numel() / b.max(1)])
    }
}

impl Parameters for Flatten {
    fn visit_params(&self, _: &str, _: &mut dyn FnMut(String, &Param)) {}
}

/// A lookup table: I32 indices `[...]` → rows of a `[num, dim]` weight, `[..., dim]`.
pub struct Embedding {
    /// table `[num_embeddings, dim]`, initialised `U(−1, 1)·√(3/dim)`-like (Xavier on the row)
    pub weight: Param,
}

impl Embedding {
    /// A table of `num` rows of `dim` values.
    pub fn new(num: usize, dim: usize, rng: &mut ChaCha8Rng, device: Device) -> Result<Embedding> {
        Ok(Embedding {
            weight: Param::new(weight(
                Init::XavierUniform,
                &[num, dim],
                1,
                dim,
                rng,
                device,
            )?)?,
        })
    }
}

impl Module for Embedding {
    fn forward(&self, idx: &Tensor) -> Result<Tensor> {
        let w = self.weight.get();
        let n = idx.numel();
        let rows = w.index_select(0, &idx.reshape(&[n])?)?;
        let mut shape = idx.shape().to_vec();
        shape.push(w.shape()[1]);
        rows.reshape(&shape)
    }
}

impl Parameters for Embedding {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(String, &Param)) {
        f(join(prefix, "weight"), &self.weight);
    }
}

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
