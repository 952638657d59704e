//! stub
use super::{GpuBackend, GpuBuffer};
use crate::{DType, Error, Result};
pub(crate) fn random_uniform(_: &GpuBackend, _: usize, _: u64, _: DType) -> Result<GpuBuffer> {
    Err(Error::Device(
        "random_uniform: GPU kernel not written yet".into(),
    ))
}
