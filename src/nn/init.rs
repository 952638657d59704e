//! Weight initialisation from a seeded ChaCha generator, so the same seed gives the same model.
//!
//! * Kaiming (He) uniform, for layers followed by ReLU: `U(−b, b)`, `b = √(6 / fan_in)`.
//! * Xavier (Glorot) uniform: `U(−b, b)`, `b = √(6 / (fan_in + fan_out))`.
//! * Normal `N(0, σ²)` (GPT-2's `σ = 0.02`), by the Box–Muller transform.

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

/// The number of elements of a weight of `shape`, or an error when it cannot be counted.
fn element_count(shape: &[usize]) -> Result<usize> {
    shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| {
            crate::Error::Invalid(format!(
                "a weight of shape {shape:?} has more elements than can be counted"
            ))
        })
}

/// A tensor of `shape` drawn uniformly from `[-bound, bound)`.
pub fn uniform(
    shape: &[usize],
    bound: f64,
    rng: &mut ChaCha8Rng,
    device: Device,
) -> Result<Tensor> {
    let n = element_count(shape)?;
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

/// A tensor of `shape` drawn from `N(0, std²)` (Box–Muller on the generator's uniforms).
pub fn normal(shape: &[usize], std: f64, rng: &mut ChaCha8Rng, device: Device) -> Result<Tensor> {
    let n = element_count(shape)?;
    let mut values = crate::memory::try_vec(n)?;
    values.extend((0..n).map(|_| {
        let u1: f64 = rng.random_range(f64::EPSILON..1.0);
        let u2: f64 = rng.random_range(0.0..1.0);
        (std * (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
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
