//! TEMPORARY stand-in for the GPU backend while it is written in a separate branch.
use super::*;
use crate::{DType, Error, Result};
/// GPU buffer (stand-in).
#[derive(Clone, Debug)]
pub struct GpuBuffer {
    dtype: DType,
    len: usize,
}
impl GpuBuffer {
    /// dtype
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// len
    pub fn len(&self) -> usize {
        self.len
    }
    /// empty
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}
/// GPU backend (stand-in).
#[derive(Clone)]
pub struct GpuBackend;
/// Adapter facts.
#[allow(missing_docs)]
#[derive(Debug, Clone, serde::Serialize)]
pub struct GpuInfo {
    pub name: String,
    pub backend: String,
    pub device_type: String,
    pub driver: String,
    pub limits: Vec<(String, u64)>,
    pub features: Vec<String>,
}
/// Adapter facts.
pub fn info() -> Result<GpuInfo> {
    Err(Error::Device("no GPU backend built".into()))
}
/// Pool counters (stand-in).
#[allow(missing_docs)]
#[derive(Clone, Copy, Debug, Default)]
pub struct PoolStats {
    pub in_use_bytes: u64,
    pub peak_bytes: u64,
}
impl GpuBackend {
    /// stats
    pub fn pool_stats(&self) -> PoolStats {
        PoolStats::default()
    }
    /// reset
    pub fn reset_peak(&self) {}
    /// get
    pub fn get() -> Result<GpuBackend> {
        Err(Error::Device("no GPU backend built (stand-in)".into()))
    }
    /// flush
    pub fn flush(&self) -> Result<()> {
        Ok(())
    }
    /// synchronize
    pub fn synchronize(&self) -> Result<()> {
        Ok(())
    }
}
fn no() -> Error {
    Error::Device("stand-in".into())
}
impl Backend for GpuBackend {
    type Buffer = GpuBuffer;
    fn upload(&self, _: &HostData) -> Result<GpuBuffer> {
        Err(no())
    }
    fn download(&self, _: &GpuBuffer) -> Result<HostData> {
        Err(no())
    }
    fn full(&self, _: usize, _: f64, _: DType) -> Result<GpuBuffer> {
        Err(no())
    }
    fn cast(&self, _: &GpuBuffer, _: DType) -> Result<GpuBuffer> {
        Err(no())
    }
    fn unary(&self, _: UnaryOp, _: &GpuBuffer) -> Result<GpuBuffer> {
        Err(no())
    }
    fn binary(
        &self,
        _: BinaryOp,
        _: &GpuBuffer,
        _: &[usize],
        _: &GpuBuffer,
        _: &[usize],
        _: &[usize],
    ) -> Result<GpuBuffer> {
        Err(no())
    }
    fn where_cond(
        &self,
        _: &GpuBuffer,
        _: &[usize],
        _: &GpuBuffer,
        _: &[usize],
        _: &GpuBuffer,
        _: &[usize],
        _: &[usize],
    ) -> Result<GpuBuffer> {
        Err(no())
    }
    fn reduce(&self, _: ReduceOp, _: &GpuBuffer, _: AxisView) -> Result<GpuBuffer> {
        Err(no())
    }
    fn matmul(
        &self,
        _: &GpuBuffer,
        _: MatLayout,
        _: &GpuBuffer,
        _: MatLayout,
        _: MatmulDims,
    ) -> Result<GpuBuffer> {
        Err(no())
    }
    fn copy_strided(&self, _: &GpuBuffer, _: &[usize], _: &[usize], _: usize) -> Result<GpuBuffer> {
        Err(no())
    }
    fn concat(&self, _: &[&GpuBuffer], _: &[usize], _: usize, _: usize) -> Result<GpuBuffer> {
        Err(no())
    }
    fn gather(
        &self,
        _: &GpuBuffer,
        _: AxisView,
        _: &GpuBuffer,
        _: [usize; 3],
        _: usize,
    ) -> Result<GpuBuffer> {
        Err(no())
    }
    fn scatter_add(
        &self,
        _: &GpuBuffer,
        _: &GpuBuffer,
        _: [usize; 3],
        _: usize,
        _: usize,
        _: usize,
        _: usize,
    ) -> Result<GpuBuffer> {
        Err(no())
    }
    fn cumsum(&self, _: &GpuBuffer, _: AxisView, _: bool) -> Result<GpuBuffer> {
        Err(no())
    }
    fn argsort(&self, _: &GpuBuffer, _: usize, _: usize, _: bool) -> Result<GpuBuffer> {
        Err(no())
    }
    fn grouped_matmul(
        &self,
        _: &GpuBuffer,
        _: &GpuBuffer,
        _: &GpuBuffer,
        _: usize,
        _: usize,
        _: usize,
        _: usize,
        _: bool,
    ) -> Result<GpuBuffer> {
        Err(no())
    }
    fn grouped_weight_grad(
        &self,
        _: &GpuBuffer,
        _: &GpuBuffer,
        _: &GpuBuffer,
        _: &GpuBuffer,
        _: usize,
        _: usize,
        _: usize,
    ) -> Result<GpuBuffer> {
        Err(no())
    }
    fn random_uniform(&self, _: usize, _: u64, _: DType) -> Result<GpuBuffer> {
        Err(no())
    }
    fn adam_step(
        &self,
        _: &GpuBuffer,
        _: &GpuBuffer,
        _: Option<&GpuBuffer>,
        _: &GpuBuffer,
        _: &GpuBuffer,
        _: AdamHyper,
    ) -> Result<(GpuBuffer, GpuBuffer, GpuBuffer)> {
        Err(no())
    }
    fn sgd_step(
        &self,
        _: &GpuBuffer,
        _: &GpuBuffer,
        _: Option<&GpuBuffer>,
        _: &GpuBuffer,
        _: SgdHyper,
    ) -> Result<(GpuBuffer, GpuBuffer)> {
        Err(no())
    }
}
