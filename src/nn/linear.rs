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

    /// `addend + self.forward(x)`, with its bits: a block's last projection added to the
    /// residual stream `addend`. An `addend` of the output's shape is added by the product's
    /// own kernel ([`Tensor::matmul_add`]: one pass over the output, no add launched); any
    /// other goes through [`Tensor::add`].
    ///
    /// # Errors
    /// Those of [`Module::forward`] and of [`Tensor::add`].
    pub fn forward_add(&self, x: &Tensor, addend: &Tensor) -> Result<Tensor> {
        self.project(x, Some(addend))
    }

    /// `x·W + b`, plus `addend` where given (the modules whose last step is a projection
    /// offer their own `forward_add` through it).
    pub(crate) fn project(&self, x: &Tensor, addend: Option<&Tensor>) -> Result<Tensor> {
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
        let mut shape = lead.to_vec();
        shape.push(outputs);
        if let Some(r) = addend.filter(|r| r.shape() != shape.as_slice()) {
            // an addend that broadcasts (or does not fit): the add on its own
            return r.add(&self.project(x, None)?);
        }
        let x = x.reshape(&[rows, inputs])?;
        let bias = self.bias.as_ref().map(|b| b.get());
        // the bias (and the addend) are added by the product's own kernel (one pass over the
        // output)
        let y = match (&bias, addend) {
            // a 2-D residual as it is: a reshape, even to its own shape, is one more node on
            // the tape (it changes which of the residual's gradients reaches the norm's backward
            // as a pending one, which gives the same bits since that fold rounds as the add does)
            (b, Some(r)) if r.rank() == 2 => x.matmul_add(&w, b.as_ref(), r)?,
            (b, Some(r)) => x.matmul_add(&w, b.as_ref(), &r.reshape(&[rows, outputs])?)?,
            (Some(b), None) => x.matmul_bias(&w, b)?,
            (None, None) => x.matmul(&w)?,
        };
        y.reshape(&shape)
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.project(x, None)
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
