//! Batching: a [`Dataset`] of fixed-size float samples with one or more integer label vectors,
//! and an epoch iterator that shuffles with a seeded ChaCha generator (seed and epoch together
//! decide the order, so a resumed run sees exactly the batches an uninterrupted one would).

use crate::{Device, Error, Result, Tensor};
use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

/// Samples stored flat: `features` is `count · sample_shape.product()`, `labels[t]` has `count` entries.
#[derive(Clone, Debug)]
pub struct Dataset {
    /// sample values, row-major
    pub features: Vec<f32>,
    /// shape of one sample (e.g. `[1, 28, 28]`)
    pub sample_shape: Vec<usize>,
    /// one label vector per task
    pub labels: Vec<Vec<i32>>,
}

/// One batch, on the device: `x` is `[b, ...sample_shape]`, `y[t]` is `[b]` (I32).
#[derive(Clone, Debug)]
pub struct Batch {
    /// inputs
    pub x: Tensor,
    /// targets, one per task
    pub y: Vec<Tensor>,
}

impl Dataset {
    /// Checks sizes and builds the dataset.
    pub fn new(
        features: Vec<f32>,
        sample_shape: Vec<usize>,
        labels: Vec<Vec<i32>>,
    ) -> Result<Dataset> {
        let per: usize = sample_shape.iter().product();
        if per == 0 || !features.len().is_multiple_of(per) {
            return Err(Error::Invalid(format!(
                "{} feature values do not split into samples of shape {sample_shape:?}",
                features.len()
            )));
        }
        let count = features.len() / per;
        if let Some(l) = labels.iter().find(|l| l.len() != count) {
            return Err(Error::Invalid(format!(
                "{count} samples but a label vector of length {}",
                l.len()
            )));
        }
        Ok(Dataset {
            features,
            sample_shape,
            labels,
        })
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.features.len() / self.sample_shape.iter().product::<usize>().max(1)
    }

    /// True when there are no samples.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Number of batches per epoch of size `batch` (the last one may be smaller).
    pub fn batches_per_epoch(&self, batch: usize) -> usize {
        self.len().div_ceil(batch.max(1))
    }

    /// The sample order of `epoch`: a permutation fixed by `(seed, epoch)`, or `0..len` unshuffled.
    pub fn order(&self, seed: u64, epoch: usize, shuffle: bool) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.len()).collect();
        if shuffle {
            let mix = seed ^ (epoch as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            order.shuffle(&mut ChaCha8Rng::seed_from_u64(mix));
        }
        order
    }

    /// Gathers the samples `ids` into a batch on `device`.
    pub fn batch(&self, ids: &[usize], device: Device) -> Result<Batch> {
        if ids.is_empty() {
            return Err(Error::Invalid("an empty batch".into()));
        }
        let per: usize = self.sample_shape.iter().product();
        let mut x = Vec::with_capacity(ids.len() * per);
        for &i in ids {
            x.extend_from_slice(&self.features[i * per..(i + 1) * per]);
        }
        let mut shape = vec![ids.len()];
        shape.extend(&self.sample_shape);
        let y = self
            .labels
            .iter()
            .map(|l| Tensor::from_i32(ids.iter().map(|&i| l[i]).collect(), &[ids.len()], device))
            .collect::<Result<Vec<_>>>()?;
        Ok(Batch {
            x: Tensor::from_f32(x, &shape, device)?,
            y,
        })
    }
}
