//! CPU backend (stub while the GPU backend is developed in parallel).
use super::*;
use std::sync::Arc;
/// CPU buffer.
#[derive(Clone, Debug)]
pub enum CpuBuffer { F32(Arc<Vec<f32>>), F64(Arc<Vec<f64>>), I32(Arc<Vec<i32>>) }
impl CpuBuffer {
    /// dtype
    pub fn dtype(&self) -> DType { match self { CpuBuffer::F32(_) => DType::F32, CpuBuffer::F64(_) => DType::F64, CpuBuffer::I32(_) => DType::I32 } }
    /// len
    pub fn len(&self) -> usize { match self { CpuBuffer::F32(v) => v.len(), CpuBuffer::F64(v) => v.len(), CpuBuffer::I32(v) => v.len() } }
}
/// CPU backend.
pub struct CpuBackend;
