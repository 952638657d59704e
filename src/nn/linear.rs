//! [`Linear`], the fully connected layer `y = x·W + b` over the last axis: a thin struct over
//! `Tensor::matmul_bias` (the product with the bias added in its kernel; the math is in `ops/`,
//! the parameters here).

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
        let x = x.reshape(&[rows, inputs])?;
        // the bias is added by the product's own kernel (one pass over the output)
        let y = match &self.bias {
            Some(b) => x.matmul_bias(&w, &b.get())?,
            None => x.matmul(&w)?,
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
