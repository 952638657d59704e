//! [`Storage`]: the buffer a tensor holds, on whichever device, and the dispatch of each
//! primitive to the backend that owns it. Mixing devices in one call is an error, not a copy.
//!
//! The forwarding is generated: the private `Device` trait finds a backend's buffer in a
//! storage, `IntoStorage` wraps a backend's results back, and the `on_device!` macro expands
//! one body for both devices (on the CPU inside the worker pool). A primitive's `Storage`
//! method is therefore its signature and one `on_device!` call. This file holds those pieces
//! and the basic primitives (elementwise, reductions, matmul, layout, sort, random); the other
//! families forward from `storage/optim.rs`, `storage/moe.rs` and `storage/fused.rs`.

use super::*;
use crate::Result;

/// A buffer on some device: what a tensor holds. Cloning is cheap (shared).
#[derive(Clone, Debug)]
pub(crate) enum Storage {
    /// on the CPU
    Cpu(cpu::CpuBuffer),
    /// on the GPU
    Gpu(gpu::GpuBuffer),
}

/// A backend whose buffers a [`Storage`] holds: how to find its buffer in a storage. With
/// [`IntoStorage`] and the `on_device!` macro below, this is all the forwarding there is: each
/// `Storage` method is one `on_device!` call, written once for both devices.
trait Device: Backend {
    /// This device's buffer in `s`, or a device error naming `what`.
    fn buf<'a>(&self, s: &'a Storage, what: &str) -> Result<&'a Self::Buffer>;
    /// [`Device::buf`] of an optional operand.
    fn opt<'a>(&self, s: Option<&'a Storage>, what: &str) -> Result<Option<&'a Self::Buffer>> {
        s.map(|s| self.buf(s, what)).transpose()
    }
}

impl Device for cpu::CpuBackend {
    fn buf<'a>(&self, s: &'a Storage, what: &str) -> Result<&'a cpu::CpuBuffer> {
        as_cpu(s, what)
    }
}

impl Device for gpu::GpuBackend {
    fn buf<'a>(&self, s: &'a Storage, what: &str) -> Result<&'a gpu::GpuBuffer> {
        as_gpu(s, what)
    }
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

/// What a primitive returns, with each device buffer wrapped in a [`Storage`]: one buffer, a
/// tuple, an optional buffer or a dispatch plan.
trait IntoStorage {
    /// the same shape of result, holding storages
    type Out;
    /// Wraps every buffer.
    fn into_storage(self) -> Self::Out;
}

impl IntoStorage for cpu::CpuBuffer {
    type Out = Storage;
    fn into_storage(self) -> Storage {
        Storage::Cpu(self)
    }
}
impl IntoStorage for gpu::GpuBuffer {
    type Out = Storage;
    fn into_storage(self) -> Storage {
        Storage::Gpu(self)
    }
}
impl<A: IntoStorage> IntoStorage for Option<A> {
    type Out = Option<A::Out>;
    fn into_storage(self) -> Self::Out {
        self.map(A::into_storage)
    }
}
impl<A: IntoStorage, B: IntoStorage> IntoStorage for (A, B) {
    type Out = (A::Out, B::Out);
    fn into_storage(self) -> Self::Out {
        (self.0.into_storage(), self.1.into_storage())
    }
}
impl<A: IntoStorage, B: IntoStorage, C: IntoStorage> IntoStorage for (A, B, C) {
    type Out = (A::Out, B::Out, C::Out);
    fn into_storage(self) -> Self::Out {
        (
            self.0.into_storage(),
            self.1.into_storage(),
            self.2.into_storage(),
        )
    }
}
impl<A: IntoStorage<Out = Storage>> IntoStorage for PlanBuffers<A> {
    type Out = PlanBuffers<Storage>;
    fn into_storage(self) -> PlanBuffers<Storage> {
        PlanBuffers {
            order: self.order.into_storage(),
            position: self.position.into_storage(),
            row_token: self.row_token.into_storage(),
            row_expert: self.row_expert.into_storage(),
            row_expert_clamped: self.row_expert_clamped.into_storage(),
            row_kept: self.row_kept.into_storage(),
            offsets: self.offsets.into_storage(),
            kept_per_expert: self.kept_per_expert.into_storage(),
            routed_per_expert: self.routed_per_expert.into_storage(),
        }
    }
}

/// Runs one primitive on the device of `$self` (a [`Storage`]) or, with `gpu: $flag`, on the
/// GPU when the flag is set and the CPU otherwise. `$body` is written once: it is expanded in
/// both arms with `$be` bound to that arm's backend ([`cpu::CpuBackend`] or
/// [`gpu::GpuBackend`]), takes its operands out of storages with `$be.buf(s, what)?` (a
/// storage on the other device is an error) and returns the backend's result, whose buffers
/// come back wrapped in storages ([`IntoStorage`]). On the CPU the body runs on the worker
/// pool (`cpu::on_pool`, sized by `$len`, by default the length of `$self`).
macro_rules! on_device {
    (gpu: $gpu:expr, $len:expr, |$be:ident| $body:expr) => {
        if $gpu {
            let $be = gpu::GpuBackend::get()?;
            ($body).map(IntoStorage::into_storage)
        } else {
            let $be = cpu::CpuBackend;
            cpu::on_pool($len, || $body).map(IntoStorage::into_storage)
        }
    };
    ($self:expr, $len:expr, |$be:ident| $body:expr) => {
        on_device!(gpu: $self.is_gpu(), $len, |$be| $body)
    };
    ($self:expr, |$be:ident| $body:expr) => {
        on_device!(gpu: $self.is_gpu(), $self.len(), |$be| $body)
    };
}

mod fused;
mod moe;
mod optim;

/// Runs two independent computations on storages of `device`: on the CPU side by side on its
/// threads (`rayon::join` on a worker of the kernel pool, so each one's kernels share the
/// threads with the other's), elsewhere one after the other. Only for work that calls storage
/// ops and builds untracked tensors: the second may run on another thread, without the first
/// one's thread-local state (grad mode, profile scope).
pub(crate) fn side_by_side<A: Send, B: Send>(
    device: crate::Device,
    a: impl FnOnce() -> A + Send,
    b: impl FnOnce() -> B + Send,
) -> (A, B) {
    match device {
        crate::Device::Cpu => cpu::on_pool(usize::MAX, || rayon::join(a, b)),
        _ => (a(), b()),
    }
}

impl Storage {
    /// The storage's device kind.
    pub(crate) fn is_gpu(&self) -> bool {
        matches!(self, Storage::Gpu(_))
    }
    /// The dtype of the elements.
    pub(crate) fn dtype(&self) -> DType {
        match self {
            Storage::Cpu(b) => b.dtype(),
            Storage::Gpu(b) => b.dtype(),
        }
    }
    /// The indices of a CPU I32 buffer, read in place; `None` on the GPU or for another dtype.
    pub(crate) fn cpu_indices(&self) -> Option<&[i32]> {
        match self {
            Storage::Cpu(cpu::CpuBuffer::I32(v)) => Some(v.as_slice()),
            _ => None,
        }
    }
    /// Number of elements.
    pub(crate) fn len(&self) -> usize {
        match self {
            Storage::Cpu(b) => b.len(),
            Storage::Gpu(b) => b.len(),
        }
    }
    /// Uploads host data to the CPU or GPU.
    pub(crate) fn upload(data: &HostData, gpu: bool) -> Result<Storage> {
        if gpu {
            Ok(Storage::Gpu(gpu::GpuBackend::get()?.upload(data)?))
        } else {
            Ok(Storage::Cpu(cpu::CpuBackend.upload(data)?))
        }
    }
    /// Takes host data to the CPU (keeping its vector, no copy) or uploads it to the GPU.
    pub(crate) fn from_host(data: HostData, gpu: bool) -> Result<Storage> {
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
    pub(crate) fn full(len: usize, value: f64, dtype: DType, gpu: bool) -> Result<Storage> {
        if gpu {
            Ok(Storage::Gpu(
                gpu::GpuBackend::get()?.full(len, value, dtype)?,
            ))
        } else {
            Ok(Storage::Cpu(cpu::CpuBackend.full(len, value, dtype)?))
        }
    }
    /// Reads the values back to the host.
    pub(crate) fn download(&self) -> Result<HostData> {
        match self {
            Storage::Cpu(b) => cpu::CpuBackend.download(b),
            Storage::Gpu(b) => gpu::GpuBackend::get()?.download(b),
        }
    }
    /// See [`ElementwiseOps::cast`].
    pub(crate) fn cast(&self, dtype: DType) -> Result<Storage> {
        on_device!(self, |be| be.cast(be.buf(self, "cast")?, dtype))
    }
    /// See [`ElementwiseOps::unary`].
    pub(crate) fn unary(&self, op: UnaryOp) -> Result<Storage> {
        on_device!(self, |be| be.unary(op, be.buf(self, "unary op")?))
    }
    /// GELU (or, with `silu`, SiLU) and its slope in one pass where the backend has that
    /// kernel: the CPU in f32, where both come from one exponential and backward becomes a
    /// plain product. `None` elsewhere (on the GPU a second output would cost a buffer per
    /// layer, and backward's fused pass recomputes the slope instead).
    pub(crate) fn value_and_slope(&self, silu: bool) -> Option<(Storage, Storage)> {
        match self {
            Storage::Cpu(x) => {
                cpu::on_pool(self.len(), || cpu::CpuBackend.value_and_slope(x, silu))
                    .map(|(y, s)| (Storage::Cpu(y), Storage::Cpu(s)))
            }
            Storage::Gpu(_) => None,
        }
    }
    /// See [`ElementwiseOps::binary`].
    pub(crate) fn binary(
        &self,
        op: BinaryOp,
        a_strides: &[usize],
        b: &Storage,
        b_strides: &[usize],
        out_shape: &[usize],
    ) -> Result<Storage> {
        const WHAT: &str = "binary op";
        on_device!(self, |be| be.binary(
            op,
            be.buf(self, WHAT)?,
            a_strides,
            be.buf(b, WHAT)?,
            b_strides,
            out_shape
        ))
    }
    /// See [`ElementwiseOps::where_cond`]; `self` is the condition.
    pub(crate) fn where_cond(
        &self,
        c_strides: &[usize],
        a: &Storage,
        a_strides: &[usize],
        b: &Storage,
        b_strides: &[usize],
        out_shape: &[usize],
    ) -> Result<Storage> {
        const WHAT: &str = "where";
        on_device!(self, |be| {
            let strided = |s, strides| {
                Ok(Strided {
                    buf: be.buf(s, WHAT)?,
                    strides,
                })
            };
            be.where_cond(
                strided(self, c_strides)?,
                strided(a, a_strides)?,
                strided(b, b_strides)?,
                out_shape,
            )
        })
    }
    /// See [`ReduceOps::reduce`].
    pub(crate) fn reduce(&self, op: ReduceOp, view: AxisView) -> Result<Storage> {
        on_device!(self, |be| be.reduce(op, be.buf(self, "reduce")?, view))
    }
    /// See [`ReduceOps::sum_unrounded`].
    pub(crate) fn sum_unrounded(&self, view: AxisView) -> Result<Storage> {
        on_device!(self, |be| be.sum_unrounded(be.buf(self, "sum")?, view))
    }
    /// See [`MatmulOps::matmul`].
    pub(crate) fn matmul(
        &self,
        a_layout: MatLayout,
        (b, b_layout): (&Storage, MatLayout),
        bias: Option<&Storage>,
        dims: MatmulDims,
        out: DType,
    ) -> Result<Storage> {
        const WHAT: &str = "matmul";
        on_device!(self, |be| {
            let bias = bias.map(|t| be.buf(t, WHAT)).transpose()?;
            be.matmul(
                (be.buf(self, WHAT)?, a_layout),
                (be.buf(b, WHAT)?, b_layout),
                bias,
                dims,
                out,
            )
        })
    }
    /// See [`MatmulOps::matmul_plus`]: `pending + (self·b + bias)`.
    pub(crate) fn matmul_plus(
        &self,
        a_layout: MatLayout,
        (b, b_layout): (&Storage, MatLayout),
        bias: Option<&Storage>,
        dims: MatmulDims,
        out: DType,
        pending: &Storage,
    ) -> Result<Storage> {
        const WHAT: &str = "matmul";
        on_device!(self, |be| {
            let bias = bias.map(|t| be.buf(t, WHAT)).transpose()?;
            be.matmul_plus(
                (be.buf(self, WHAT)?, a_layout),
                (be.buf(b, WHAT)?, b_layout),
                bias,
                dims,
                out,
                be.buf(pending, WHAT)?,
            )
        })
    }
    /// See [`MatmulOps::matmul_pair`]: `self·b` (plus the first's pending gradient) and `c·d`
    /// (operands, then layouts, sizes and output dtypes).
    pub(crate) fn matmul_pair(
        &self,
        (a_layout, b, b_layout, dims, out, pending): (
            MatLayout,
            &Storage,
            MatLayout,
            MatmulDims,
            DType,
            Option<&Storage>,
        ),
        (c, c_layout, d, d_layout, dims2, out2): (
            &Storage,
            MatLayout,
            &Storage,
            MatLayout,
            MatmulDims,
            DType,
        ),
    ) -> Result<(Storage, Storage)> {
        const WHAT: &str = "matmul";
        on_device!(self, |be| {
            let first = MatmulProduct::new(
                (be.buf(self, WHAT)?, a_layout),
                (be.buf(b, WHAT)?, b_layout),
                dims,
                out,
                pending.map(|p| be.buf(p, WHAT)).transpose()?,
            );
            let second = MatmulProduct::new(
                (be.buf(c, WHAT)?, c_layout),
                (be.buf(d, WHAT)?, d_layout),
                dims2,
                out2,
                None,
            );
            be.matmul_pair(first, second)
        })
    }
    /// See [`LayoutOps::copy_strided`].
    pub(crate) fn copy_strided(
        &self,
        shape: &[usize],
        strides: &[usize],
        offset: usize,
    ) -> Result<Storage> {
        on_device!(self, |be| be.copy_strided(
            be.buf(self, "copy_strided")?,
            shape,
            strides,
            offset
        ))
    }
    /// See [`LayoutOps::concat`].
    pub(crate) fn concat(
        parts: &[&Storage],
        lens: &[usize],
        outer: usize,
        inner: usize,
    ) -> Result<Storage> {
        let first = parts
            .first()
            .ok_or_else(|| crate::Error::Invalid("concat of no tensors".into()))?;
        let len = lens.iter().sum::<usize>() * outer * inner;
        on_device!(first, len, |be| {
            let parts = parts
                .iter()
                .map(|p| be.buf(p, "concat"))
                .collect::<Result<Vec<_>>>()?;
            be.concat(&parts, lens, outer, inner)
        })
    }
    /// See [`LayoutOps::gather`].
    pub(crate) fn gather(
        &self,
        view: AxisView,
        idx: &Storage,
        idx_strides: [usize; 3],
        m: usize,
    ) -> Result<Storage> {
        const WHAT: &str = "gather";
        on_device!(self, |be| be.gather(
            be.buf(self, WHAT)?,
            view,
            be.buf(idx, WHAT)?,
            idx_strides,
            m
        ))
    }
    /// See [`LayoutOps::scatter_add`]; `self` is the source.
    pub(crate) fn scatter_add(
        &self,
        idx: &Storage,
        idx_strides: [usize; 3],
        outer: usize,
        m: usize,
        inner: usize,
        len: usize,
    ) -> Result<Storage> {
        const WHAT: &str = "scatter_add";
        let dims = ScatterDims {
            outer,
            m,
            inner,
            len,
        };
        on_device!(self, |be| be.scatter_add(
            be.buf(self, WHAT)?,
            be.buf(idx, WHAT)?,
            idx_strides,
            dims
        ))
    }
    /// See [`ReduceOps::cumsum`].
    pub(crate) fn cumsum(&self, view: AxisView, reverse: bool) -> Result<Storage> {
        on_device!(self, |be| be.cumsum(be.buf(self, "cumsum")?, view, reverse))
    }
    /// See [`ReduceOps::argsort`].
    pub(crate) fn argsort(&self, rows: usize, len: usize, descending: bool) -> Result<Storage> {
        on_device!(self, |be| be.argsort(
            be.buf(self, "argsort")?,
            rows,
            len,
            descending
        ))
    }
    /// See [`ReduceOps::argsort_top`].
    pub(crate) fn argsort_top(
        &self,
        rows: usize,
        len: usize,
        k: usize,
        descending: bool,
    ) -> Result<Storage> {
        on_device!(self, |be| be.argsort_top(
            be.buf(self, "argsort_top")?,
            rows,
            len,
            k,
            descending
        ))
    }
    /// See [`ElementwiseOps::random_uniform`].
    pub(crate) fn random_uniform(
        len: usize,
        seed: u64,
        dtype: DType,
        gpu: bool,
    ) -> Result<Storage> {
        on_device!(gpu: gpu, len, |be| be.random_uniform(len, seed, dtype))
    }
}
