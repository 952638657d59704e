//! Dropout: in training, each element is zeroed with probability `p` and the survivors scaled by
//! `1/(1−p)`, so the expected output equals the input; in evaluation it is the identity.
//!
//! The mask comes from the backends' counter-based generator (`random_uniform`), so a given seed
//! draws the same mask on the CPU and the GPU, on the device, without an upload.

use super::Param;
use super::module::Module;
use crate::backend::Storage;
use crate::nn::Parameters;
use crate::{Error, Result, Tensor};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

impl Tensor {
    /// Uniform [0, 1) values of `shape` from the counter-based generator (same on every device).
    pub fn rand_uniform(
        shape: &[usize],
        seed: u64,
        dtype: crate::DType,
        device: crate::Device,
    ) -> Result<Tensor> {
        let n = shape.iter().product();
        Ok(Tensor::from_storage(
            Storage::random_uniform(n, seed, dtype, device.is_gpu())?,
            shape.to_vec(),
        ))
    }

    /// Applies a dropout mask drawn from `seed`: `x · 1[u ≥ p] / (1 − p)`.
    pub fn dropout(&self, p: f64, seed: u64) -> Result<Tensor> {
        let _profile = crate::profile::op("dropout");
        if !(0.0..1.0).contains(&p) {
            return Err(Error::Invalid(format!(
                "dropout probability must be in [0, 1), got {p}"
            )));
        }
        if p == 0.0 {
            return Ok(self.clone());
        }
        let u = Tensor::rand_uniform(self.shape(), seed, self.dtype(), self.device())?;
        let threshold = Tensor::scalar(p, self.dtype(), self.device())?;
        let mask = u.ge(&threshold)?.mul_scalar(1.0 / (1.0 - p))?;
        self.mul(&mask)
    }
}

/// The dropout layer. Each forward call in training mode draws a fresh mask (seed + call count).
pub struct Dropout {
    /// probability of zeroing an element, in [0, 1) (checked by `new`; read with `p()`)
    p: f64,
    seed: u64,
    calls: AtomicU64,
    training: AtomicBool,
}

impl Dropout {
    /// Dropout with probability `p` (in [0, 1)) and a base seed.
    pub fn new(p: f64, seed: u64) -> Result<Dropout> {
        if !(0.0..1.0).contains(&p) {
            return Err(Error::Invalid(format!(
                "dropout probability must be in [0, 1), got {p}"
            )));
        }
        Ok(Dropout {
            p,
            seed,
            calls: AtomicU64::new(0),
            training: AtomicBool::new(true),
        })
    }

    /// The probability of zeroing an element, in [0, 1).
    pub fn p(&self) -> f64 {
        self.p
    }
}

impl Module for Dropout {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if !self.training.load(Ordering::Relaxed) {
            return Ok(x.clone());
        }
        let call = self.calls.fetch_add(1, Ordering::Relaxed);
        x.dropout(
            self.p,
            self.seed
                .wrapping_add(call.wrapping_mul(0x9E37_79B9_7F4A_7C15)),
        )
    }
}

impl Parameters for Dropout {
    fn visit_params(&self, _: &str, _: &mut dyn FnMut(String, &Param)) {}
    fn set_training(&self, training: bool) {
        self.training.store(training, Ordering::Relaxed);
    }
    /// The number of masks drawn so far, named `dropout_calls` (a scalar f64 CPU tensor).
    fn state(&self) -> Result<Vec<(String, Tensor)>> {
        let calls = self.calls.load(Ordering::Relaxed) as f64;
        Ok(vec![(
            "dropout_calls".into(),
            Tensor::from_f64(vec![calls], &[], crate::Device::Cpu)?,
        )])
    }
    fn load_state(&self, name: &str, value: &Tensor) -> Result<()> {
        let count = match value.to_vec_f64() {
            Ok(v) if name == "dropout_calls" && v.len() == 1 => v[0],
            _ => {
                return Err(Error::Invalid(format!(
                    "dropout has one state entry, dropout_calls (one number); got {name:?} of shape {:?}",
                    value.shape()
                )));
            }
        };
        if !(count.is_finite() && count >= 0.0 && count.fract() == 0.0) {
            return Err(Error::Invalid(format!(
                "dropout_calls = {count} is not a count of masks (a whole number ≥ 0)"
            )));
        }
        self.calls.store(count as u64, Ordering::Relaxed);
        Ok(())
    }
}
