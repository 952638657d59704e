//! The image layers: [`Conv2d`], the pooling layers [`MaxPool2d`] and [`AvgPool2d`], and
//! [`Flatten`], which turns a batch of feature maps into rows for a linear head. Each is a thin
//! struct over the tensor ops `conv2d`, `max_pool2d`, `avg_pool2d` and `reshape`.

use super::Param;
use super::init::{Init, weight};
use super::module::{Module, join};
use crate::nn::Parameters;
use crate::{DType, Device, Error, Result, Tensor};
use rand_chacha::ChaCha8Rng;

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
