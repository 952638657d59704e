//! [`Embedding`], the lookup table from token indices to rows of a learned weight (the first
//! layer of the language models): `Tensor::index_select`, whose backward scatters the
//! gradient back to the rows that were read.

use super::Param;
use super::init::{Init, weight};
use super::module::{Module, join};
use crate::nn::Parameters;
use crate::{Device, Result, Tensor};
use rand_chacha::ChaCha8Rng;

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
