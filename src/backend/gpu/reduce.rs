//! stub
use super::{GpuBackend, GpuBuffer};
use crate::backend::{AxisView, ReduceOp};
use crate::{Error, Result};
pub(crate) fn reduce(_: &GpuBackend, _: ReduceOp, _: &GpuBuffer, _: AxisView) -> Result<GpuBuffer> {
    Err(Error::Device("reduce: GPU kernel not written yet".into()))
}
pub(crate) fn cumsum(_: &GpuBackend, _: &GpuBuffer, _: AxisView, _: bool) -> Result<GpuBuffer> {
    Err(Error::Device("cumsum: GPU kernel not written yet".into()))
}
