//! stub
use super::{GpuBackend, GpuBuffer};
use crate::backend::{AdamHyper, SgdHyper};
use crate::{Error, Result};
pub(crate) fn adam_step(
    _: &GpuBackend,
    _: &GpuBuffer,
    _: &GpuBuffer,
    _: Option<&GpuBuffer>,
    _: &GpuBuffer,
    _: &GpuBuffer,
    _: AdamHyper,
) -> Result<(GpuBuffer, GpuBuffer, GpuBuffer)> {
    Err(Error::Device(
        "adam_step: GPU kernel not written yet".into(),
    ))
}
pub(crate) fn sgd_step(
    _: &GpuBackend,
    _: &GpuBuffer,
    _: &GpuBuffer,
    _: Option<&GpuBuffer>,
    _: &GpuBuffer,
    _: SgdHyper,
) -> Result<(GpuBuffer, GpuBuffer)> {
    Err(Error::Device("sgd_step: GPU kernel not written yet".into()))
}
