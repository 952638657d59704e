//! [`Storage`]: the buffer a tensor holds, on whichever device, and the dispatch of each
//! primitive to the backend that owns it. Mixing devices in one call is an error, not a copy.
//!
//! This file holds the enum, the device-matching helpers and the forwarding of the basic
//! primitives (elementwise, reductions, matmul, layout, sort, random); the other families
//! forward from `storage/optim.rs`, `storage/moe.rs` and `storage/fused.rs`.

use super::*;
use crate::Result;

/// A buffer on some device: what a tensor holds. Cloning is cheap (shared).
#[derive(Clone, Debug)]
pub enum Storage {
    /// on the CPU
    Cpu(cpu::CpuBuffer),
    /// on the GPU
    Gpu(gpu::GpuBuffer),
}

/// Dispatches one primitive to the backend that owns the storages; mixing devices is an error.
macro_rules! dispatch {
    ($self:expr, $b:ident, $x:ident => $body:expr) => {
        match $self {
            Storage::Cpu($x) => {
                let $b = cpu::CpuBackend;
                cpu::on_pool($x.len(), || $body).map(Storage::Cpu)
            }
            Storage::Gpu($x) => {
                let $b = gpu::GpuBackend::get()?;
                $body.map(Storage::Gpu)
            }
        }
    };
}

fn as_cpu<'a>(s: &'a Storage, what: &str) -> Result<&'a cpu::CpuBuffer> {
    match s {
        Storage::Cpu(b) => Ok(b),
        Storage::Gpu(_) => Err(crate::Error::Device(format!(
            "{what}: operand is on the GPU, expected CPU"
        ))),
    }
}
fn as_gpu<'a>(s: &'a Storage, what: &str) -> Result<&'a gpu::GpuBuffer> {
    match s {
        Storage::Gpu(b) => Ok(b),
        Storage::Cpu(_) => Err(crate::Error::Device(format!(
            "{what}: operand is on the CPU, expected GPU"
        ))),
    }
}

/// Picks the partner storage of the same device as `$self`.
macro_rules! same_dev {
    ($self:expr, $other:expr, $what:expr) => {
        match $self {
            Storage::Cpu(_) => OtherRef::Cpu(as_cpu($other, $what)?),
            Storage::Gpu(_) => OtherRef::Gpu(as_gpu($other, $what)?),
        }
    };
}

enum OtherRef<'a> {
    Cpu(&'a cpu::CpuBuffer),
    Gpu(&'a gpu::GpuBuffer),
}
impl<'a> OtherRef<'a> {
    fn cpu(&self) -> &'a cpu::CpuBuffer {
        match self {
            OtherRef::Cpu(b) => b,
            OtherRef::Gpu(_) => unreachable!("same_dev checked the device"),
        }
    }
    fn gpu(&self) -> &'a gpu::GpuBuffer {
        match self {
            OtherRef::Gpu(b) => b,
            OtherRef::Cpu(_) => unreachable!("same_dev checked the device"),
        }
    }
}

mod fused;
mod moe;
mod optim;

impl Storage {
    /// The storage's device kind.
    pub fn is_gpu(&self) -> bool {
        matches!(self, Storage::Gpu(_))
    }
    /// The dtype of the elements.
    pub fn dtype(&self) -> DType {
        match self {
            Storage::Cpu(b) => b.dtype(),
            Storage::Gpu(b) => b.dtype(),
        }
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Storage::Cpu(b) => b.len(),
            Storage::Gpu(b) => b.len(),
        }
    }
    /// True when the storage holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Uploads host data to the CPU or GPU.
    pub fn upload(data: &HostData, gpu: bool) -> Result<Storage> {
        if gpu {
            Ok(Storage::Gpu(gpu::GpuBackend::get()?.upload(data)?))
        } else {
            Ok(Storage::Cpu(cpu::CpuBackend.upload(data)?))
        }
    }
    /// Takes host data to the CPU (keeping its vector, no copy) or uploads it to the GPU.
    pub fn from_host(data: HostData, gpu: bool) -> Result<Storage> {
        if gpu {
            return Storage::upload(&data, true);
        }
        Ok(Storage::Cpu(match data {
            HostData::F32(v) => cpu::CpuBuffer::F32(std::sync::Arc::new(v.into())),
            HostData::F64(v) => cpu::CpuBuffer::F64(std::sync::Arc::new(v.into())),
            HostData::I32(v) => cpu::CpuBuffer::I32(std::sync::Arc::new(v.into())),
        }))
    }
    /// A filled buffer on the CPU or GPU.
    pub fn full(len: usize, value: f64, dtype: DType, gpu: bool) -> Result<Storage> {
        if gpu {
            Ok(Storage::Gpu(
                gpu::GpuBackend::get()?.full(len, value, dtype)?,
            ))
        } else {
            Ok(Storage::Cpu(cpu::CpuBackend.full(len, value, dtype)?))
        }
    }
    /// Reads the values back to the host.
    pub fn download(&self) -> Result<HostData> {
        match self {
            Storage::Cpu(b) => cpu::CpuBackend.download(b),
            Storage::Gpu(b) => gpu::GpuBackend::get()?.download(b),
        }
    }
    /// See [`Backend::cast`].
    pub fn cast(&self, dtype: DType) -> Result<Storage> {
        dispatch!(self, be, x => be.cast(x, dtype))
    }
    /// See [`Backend::unary`].
    pub fn unary(&self, op: UnaryOp) -> Result<Storage> {
        dispatch!(self, be, x => be.unary(op, x))
    }
    /// GELU and its slope in one pass where the backend has that kernel: the CPU in f32, where
    /// both come from one exponential and backward becomes a plain product. `None` elsewhere
    /// (on the GPU a second output would cost a buffer per layer, and backward's fused pass
    /// recomputes the slope instead).
    pub fn gelu_and_slope(&self) -> Option<(Storage, Storage)> {
        match self {
            Storage::Cpu(x) => cpu::on_pool(self.len(), || cpu::CpuBackend.gelu_and_slope(x))
                .map(|(y, s)| (Storage::Cpu(y), Storage::Cpu(s))),
            Storage::Gpu(_) => None,
        }
    }
    /// See [`Backend::binary`].
    pub fn binary(
        &self,
        op: BinaryOp,
        a_strides: &[usize],
        b: &Storage,
        b_strides: &[usize],
        out_shape: &[usize],
    ) -> Result<Storage> {
        let o = same_dev!(self, b, "binary op");
        match self {
            Storage::Cpu(a) => cpu::on_pool(self.len(), || {
                cpu::CpuBackend.binary(op, a, a_strides, o.cpu(), b_strides, out_shape)
            })
            .map(Storage::Cpu),
            Storage::Gpu(a) => gpu::GpuBackend::get()?
                .binary(op, a, a_strides, o.gpu(), b_strides, out_shape)
                .map(Storage::Gpu),
        }
    }
    /// See [`Backend::where_cond`]; `self` is the condition.
    pub fn where_cond(
        &self,
        c_strides: &[usize],
        a: &Storage,
        a_strides: &[usize],
        b: &Storage,
        b_strides: &[usize],
        out_shape: &[usize],
    ) -> Result<Storage> {
        let oa = same_dev!(self, a, "where");
        let ob = same_dev!(self, b, "where");
        match self {
            Storage::Cpu(c) => cpu::on_pool(self.len(), || {
                cpu::CpuBackend.where_cond(
                    Strided {
                        buf: c,
                        strides: c_strides,
                    },
                    Strided {
                        buf: oa.cpu(),
                        strides: a_strides,
                    },
                    Strided {
                        buf: ob.cpu(),
                        strides: b_strides,
                    },
                    out_shape,
                )
            })
            .map(Storage::Cpu),
            Storage::Gpu(c) => gpu::GpuBackend::get()?
                .where_cond(
                    Strided {
                        buf: c,
                        strides: c_strides,
                    },
                    Strided {
                        buf: oa.gpu(),
                        strides: a_strides,
                    },
                    Strided {
                        buf: ob.gpu(),
                        strides: b_strides,
                    },
                    out_shape,
                )
                .map(Storage::Gpu),
        }
    }
    /// See [`Backend::reduce`].
    pub fn reduce(&self, op: ReduceOp, view: AxisView) -> Result<Storage> {
        dispatch!(self, be, x => be.reduce(op, x, view))
    }
    /// See [`Backend::matmul`].
    pub fn matmul(
        &self,
        a_layout: MatLayout,
        b: &Storage,
        b_layout: MatLayout,
        dims: MatmulDims,
    ) -> Result<Storage> {
        let o = same_dev!(self, b, "matmul");
        match self {
            Storage::Cpu(a) => cpu::on_pool(self.len(), || {
                cpu::CpuBackend.matmul(a, a_layout, o.cpu(), b_layout, dims)
            })
            .map(Storage::Cpu),
            Storage::Gpu(a) => gpu::GpuBackend::get()?
                .matmul(a, a_layout, o.gpu(), b_layout, dims)
                .map(Storage::Gpu),
        }
    }
    /// See [`Backend::copy_strided`].
    pub fn copy_strided(
        &self,
        shape: &[usize],
        strides: &[usize],
        offset: usize,
    ) -> Result<Storage> {
        dispatch!(self, be, x => be.copy_strided(x, shape, strides, offset))
    }
    /// See [`Backend::concat`].
    pub fn concat(
        parts: &[&Storage],
        lens: &[usize],
        outer: usize,
        inner: usize,
    ) -> Result<Storage> {
        let first = parts
            .first()
            .ok_or_else(|| crate::Error::Invalid("concat of no tensors".into()))?;
        match first {
            Storage::Cpu(_) => {
                let v = parts
                    .iter()
                    .map(|p| as_cpu(p, "concat"))
                    .collect::<Result<Vec<_>>>()?;
                cpu::on_pool(lens.iter().sum::<usize>() * outer * inner, || {
                    cpu::CpuBackend.concat(&v, lens, outer, inner)
                })
                .map(Storage::Cpu)
            }
            Storage::Gpu(_) => {
                let v = parts
                    .iter()
                    .map(|p| as_gpu(p, "concat"))
                    .collect::<Result<Vec<_>>>()?;
                gpu::GpuBackend::get()?
                    .concat(&v, lens, outer, inner)
                    .map(Storage::Gpu)
            }
        }
    }
    /// See [`Backend::gather`].
    pub fn gather(
        &self,
        view: AxisView,
        idx: &Storage,
        idx_strides: [usize; 3],
        m: usize,
    ) -> Result<Storage> {
        let o = same_dev!(self, idx, "gather");
        match self {
            Storage::Cpu(x) => cpu::on_pool(self.len(), || {
                cpu::CpuBackend.gather(x, view, o.cpu(), idx_strides, m)
            })
            .map(Storage::Cpu),
            Storage::Gpu(x) => gpu::GpuBackend::get()?
                .gather(x, view, o.gpu(), idx_strides, m)
                .map(Storage::Gpu),
        }
    }
    /// See [`Backend::scatter_add`]; `self` is the source.
    pub fn scatter_add(
        &self,
        idx: &Storage,
        idx_strides: [usize; 3],
        outer: usize,
        m: usize,
        inner: usize,
        len: usize,
    ) -> Result<Storage> {
        let o = same_dev!(self, idx, "scatter_add");
        let dims = ScatterDims {
            outer,
            m,
            inner,
            len,
        };
        match self {
            Storage::Cpu(s) => cpu::on_pool(self.len(), || {
                cpu::CpuBackend.scatter_add(s, o.cpu(), idx_strides, dims)
            })
            .map(Storage::Cpu),
            Storage::Gpu(s) => gpu::GpuBackend::get()?
                .scatter_add(s, o.gpu(), idx_strides, dims)
                .map(Storage::Gpu),
        }
    }
    /// See [`Backend::cumsum`].
    pub fn cumsum(&self, view: AxisView, reverse: bool) -> Result<Storage> {
        dispatch!(self, be, x => be.cumsum(x, view, reverse))
    }
    /// See [`Backend::argsort`].
    pub fn argsort(&self, rows: usize, len: usize, descending: bool) -> Result<Storage> {
        dispatch!(self, be, x => be.argsort(x, rows, len, descending))
    }
    /// See [`Backend::argsort_top`].
    pub fn argsort_top(
        &self,
        rows: usize,
        len: usize,
        k: usize,
        descending: bool,
    ) -> Result<Storage> {
        dispatch!(self, be, x => be.argsort_top(x, rows, len, k, descending))
    }
    /// See [`Backend::random_uniform`].
    pub fn random_uniform(len: usize, seed: u64, dtype: DType, gpu: bool) -> Result<Storage> {
        if gpu {
            Ok(Storage::Gpu(
                gpu::GpuBackend::get()?.random_uniform(len, seed, dtype)?,
            ))
        } else {
            Ok(Storage::Cpu(cpu::on_pool(len, || {
                cpu::CpuBackend.random_uniform(len, seed, dtype)
            })?))
        }
    }
}
