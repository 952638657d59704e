//! [`Precision`], the `--precision` setting: `f32` (the default, every device) or `f16-mixed`
//! (the GPU only, on adapters with `SHADER_F16`): the forward pass under
//! [`crate::autocast_f16`] with f32 master weights, optimizer state and router, and a dynamic
//! loss scale decided on the device ([`crate::optim::LossScale`]). The trainer checks it once,
//! before anything is allocated, and refuses `f16-mixed` where it cannot run (no silent
//! fallback to f32).

use crate::backend::gpu::GpuBackend;
use crate::{Device, Error, Result};
use serde::{Deserialize, Serialize};

/// The arithmetic a training run uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Precision {
    /// everything in f32
    #[default]
    #[serde(rename = "f32")]
    F32,
    /// f16 activations and products with f32 accumulation; f32 parameters, optimizer, router
    /// and losses; dynamic loss scaling (GPU with `SHADER_F16` only)
    #[serde(rename = "f16-mixed")]
    F16Mixed,
}

impl Precision {
    /// Every value, as `--precision` spells it.
    pub const NAMES: [&'static str; 2] = ["f32", "f16-mixed"];

    /// `--precision`'s spelling.
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::F16Mixed => "f16-mixed",
        }
    }

    /// Parses `--precision`.
    ///
    /// # Errors
    /// A value other than those of [`Precision::NAMES`].
    pub fn from_name(name: &str) -> Result<Precision> {
        match name {
            "f32" => Ok(Precision::F32),
            "f16-mixed" => Ok(Precision::F16Mixed),
            other => Err(Error::Invalid(format!(
                "unknown --precision {other:?}; expected {}",
                Precision::NAMES.join(" or ")
            ))),
        }
    }

    /// Checks that a run on `device` can use this precision.
    ///
    /// # Errors
    /// `f16-mixed` on the CPU, or on a GPU adapter without `SHADER_F16` (the message names the
    /// adapter).
    pub fn check(self, device: Device) -> Result<()> {
        match self {
            Precision::F32 => Ok(()),
            Precision::F16Mixed if !device.is_gpu() => Err(Error::Device(
                "--precision f16-mixed trains on the GPU (f16 is a GPU storage format here); \
                 the run's device is the CPU: use --device gpu, or --precision f32"
                    .into(),
            )),
            Precision::F16Mixed => GpuBackend::get()?.check_f16("--precision f16-mixed"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_the_cpu_is_refused() {
        for name in Precision::NAMES {
            assert_eq!(Precision::from_name(name).unwrap().name(), name);
        }
        assert!(Precision::from_name("bf16").is_err());
        let err = Precision::F16Mixed.check(Device::Cpu).unwrap_err();
        assert!(err.to_string().contains("--device gpu"), "{err}");
        Precision::F32.check(Device::Cpu).unwrap();
    }
}
