//! stub
use super::{GpuBackend, GpuBuffer};
use crate::backend::AxisView;
use crate::{Error, Result};
fn todo() -> Error {
    Error::Device("layout: GPU kernel not written yet".into())
}
pub(crate) fn copy_strided(
    _: &GpuBackend,
    _: &GpuBuffer,
    _: &[usize],
    _: &[usize],
    _: usize,
) -> Result<GpuBuffer> {
    Err(todo())
}
pub(crate) fn concat(
    _: &GpuBackend,
    _: &[&GpuBuffer],
    _: &[usize],
    _: usize,
    _: usize,
) -> Result<GpuBuffer> {
    Err(todo())
}
pub(crate) fn gather(
    _: &GpuBackend,
    _: &GpuBuffer,
    _: AxisView,
    _: &GpuBuffer,
    _: [usize; 3],
    _: usize,
) -> Result<GpuBuffer> {
    Err(todo())
}
#[allow(clippy::too_many_arguments)]
pub(crate) fn scatter_add(
    _: &GpuBackend,
    _: &GpuBuffer,
    _: &GpuBuffer,
    _: [usize; 3],
    _: usize,
    _: usize,
    _: usize,
    _: usize,
) -> Result<GpuBuffer> {
    Err(todo())
}
