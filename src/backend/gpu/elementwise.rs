//! Launchers of `shaders/elementwise.wgsl`: fill, cast, unary and broadcasting binary ops, where.

use super::kernels::{Shader, grid_1d, u32_param};
use super::{GpuBackend, GpuBuffer};
use crate::backend::{BinaryOp, UnaryOp};
use crate::{DType, Error, Result};

/// The kernels of `shaders/elementwise.wgsl`.
pub(crate) static ELEMENTWISE: Shader = Shader {
    name: "elementwise",
    source: include_str!("../../../shaders/elementwise.wgsl"),
};

/// Invocations per workgroup of every 1-D kernel in the file.
const WG: u32 = 256;

/// `full`: a new buffer of `len` copies of `value` (rounded to `dtype`), entry `fill`.
pub(crate) fn full(be: &GpuBackend, len: usize, value: f64, dtype: DType) -> Result<GpuBuffer> {
    let bits = match dtype {
        DType::F32 => (value as f32).to_bits(),
        DType::I32 => (value as i32) as u32,
        DType::F64 => return Err(super::f64_error("full")),
    };
    let out = be.alloc(len, dtype)?;
    let n = u32_param(len, "full: length")?;
    be.launch(&ELEMENTWISE, "fill", &[&out], &[n, bits], grid_1d(len, WG)?)?;
    Ok(out)
}

fn todo(what: &str) -> Error {
    Error::Device(format!("{what}: GPU kernel not written yet"))
}

pub(crate) fn cast(_be: &GpuBackend, _x: &GpuBuffer, _dtype: DType) -> Result<GpuBuffer> {
    Err(todo("cast"))
}
pub(crate) fn unary(_be: &GpuBackend, _op: UnaryOp, _x: &GpuBuffer) -> Result<GpuBuffer> {
    Err(todo("unary"))
}
pub(crate) fn binary(
    _be: &GpuBackend,
    _op: BinaryOp,
    _a: &GpuBuffer,
    _sa: &[usize],
    _b: &GpuBuffer,
    _sb: &[usize],
    _shape: &[usize],
) -> Result<GpuBuffer> {
    Err(todo("binary"))
}
#[allow(clippy::too_many_arguments)]
pub(crate) fn where_cond(
    _be: &GpuBackend,
    _c: &GpuBuffer,
    _sc: &[usize],
    _a: &GpuBuffer,
    _sa: &[usize],
    _b: &GpuBuffer,
    _sb: &[usize],
    _shape: &[usize],
) -> Result<GpuBuffer> {
    Err(todo("where"))
}
