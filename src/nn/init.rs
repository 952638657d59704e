//! Weight initialisation from a seeded ChaCha generator, so the same seed gives the same model.
//!
//! * Kaiming (He) uniform, for layers followed by ReLU: `U(−b, b)`, `b = √(6 / fan_in)`.
//! * Xavier (Glorot) uniform: `U(−b, b)`, `b = √(6 / (fan_in + fan_out))`.

use crate::{Device, Result, Tensor};
use rand::RngExt;
use rand_chacha::ChaCha8Rng;

/// Which initialisation a layer's weight gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Init {
    /// He et al. 2015, for ReLU networks
    KaimingUniform,
    /// Glorot & Bengio 2010
    XavierUniform,
}

/// A tensor of `shape` drawn uniformly from `[-bound, bound)`.
pub fn uniform(
    shape: &[usize],
    bound: f64,
    rng: &mut ChaCha8Rng,
    device: Device,
) -> Result<Tensor> {
    let n = shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| {
            crate::Error::Invalid(format!(
                "a weight of shape {shape:?} has more elements than can be counted"
            ))
        })?;
    let b = bound as f32;
    // allocated fallibly: a weight larger than the machine's memory is an error, not an abort
    let mut values = crate::memory::try_vec(n)?;
    values.extend((0..n).map(|_| {
        if b > 0.0 {
            rng.random_range(-b..b)
        } else {
            0.0
        }
    }));
    Tensor::from_f32(values, shape, device)
}

/// A weight of `shape` with the given fan-in and fan-out.
pub fn weight(
    init: Init,
    shape: &[usize],
    fan_in: usize,
    fan_out: usize,
    rng: &mut ChaCha8Rng,
    device: Device,
) -> Result<Tensor> {
    let bound = match init {
        Init::KaimingUniform => (6.0 / fan_in.max(1) as f64).sqrt(),
        Init::XavierUniform => (6.0 / (fan_in + fan_out).max(1) as f64).sqrt(),
    };
    uniform(shape, bound, rng, device)
}
