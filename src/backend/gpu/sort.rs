//! stub
use super::{GpuBackend, GpuBuffer};
use crate::{Error, Result};
pub(crate) fn argsort(
    _: &GpuBackend,
    _: &GpuBuffer,
    _: usize,
    _: usize,
    _: bool,
) -> Result<GpuBuffer> {
    Err(Error::Device("argsort: GPU kernel not written yet".into()))
}
