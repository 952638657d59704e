//! Placeholder for the matrix-product launchers (`matmul`, `grouped_matmul`,
//! `grouped_weight_grad`); the real kernels are written separately and replace this file.

use super::{GpuBackend, GpuBuffer};
use crate::backend::{MatLayout, MatmulDims};
use crate::{Error, Result};

fn not_yet() -> Error {
    Error::Device("matmul kernels not written yet".into())
}

/// Batched matrix product (placeholder).
pub(crate) fn matmul(
    _be: &GpuBackend,
    _a: &GpuBuffer,
    _a_layout: MatLayout,
    _b: &GpuBuffer,
    _b_layout: MatLayout,
    _dims: MatmulDims,
) -> Result<GpuBuffer> {
    Err(not_yet())
}

/// Grouped (per-expert) matmul (placeholder).
#[allow(clippy::too_many_arguments)]
pub(crate) fn grouped_matmul(
    _be: &GpuBackend,
    _x: &GpuBuffer,
    _w: &GpuBuffer,
    _row_expert: &GpuBuffer,
    _rows: usize,
    _k: usize,
    _m: usize,
    _experts: usize,
    _transpose_w: bool,
) -> Result<GpuBuffer> {
    Err(not_yet())
}

/// Grouped weight gradient (placeholder).
#[allow(clippy::too_many_arguments)]
pub(crate) fn grouped_weight_grad(
    _be: &GpuBackend,
    _x: &GpuBuffer,
    _dy: &GpuBuffer,
    _row_expert: &GpuBuffer,
    _offsets: &GpuBuffer,
    _k: usize,
    _m: usize,
    _experts: usize,
) -> Result<GpuBuffer> {
    Err(not_yet())
}
