//! The wgpu backend: f32 (and i32 index) buffers on the GPU and the WGSL kernels in `shaders/`.
//!
//! How the pieces fit, bottom to top:
//!
//! * `context.rs` opens the adapter, device and queue once per process;
//! * `buffer_pool.rs` recycles device buffers by power-of-two size class ([`PoolStats`]);
//! * `encoder.rs` records every kernel into one pending command encoder and submits in batches
//!   (nothing is read back to the host except by [`BufferOps::download`]);
//! * `kernels.rs` compiles and caches pipelines and holds the one launch helper,
//!   `GpuBackend::launch(shader, entry, buffers, params, groups)`, that every op uses;
//! * `matmul_kernel.rs` names the dense matmul's kernel choices ([`MatmulKernel`]), and
//!   `matmul_tune.rs` times them on this adapter for [`MatmulKernel::Tuned`] ([`TunedMatmul`]);
//! * `shader_checks.rs` says which of wgpu's run-time checks are compiled into the built-in
//!   kernels ([`ShaderChecks`]; by default all but the loop counter);
//! * `info.rs` describes the adapter ([`GpuInfo`], read with [`info()`]);
//! * `stats.rs` counts dispatches, submissions, host waits, buffers created and bytes moved
//!   ([`GpuStats`], read with [`GpuBackend::stats`]);
//! * one launcher file per kernel family, named after its shader: `elementwise.rs`,
//!   `reduce.rs`, `layout.rs`, `sort.rs`, `random.rs`, `optim.rs`, `matmul.rs`, `attention.rs`,
//!   `layer_norm.rs`, `cross_entropy.rs`, `mse.rs`, `routing.rs`, `conv2d.rs` and `pool2d.rs`
//!   launch the
//!   entry points of `shaders/<same name>.wgsl`, one function per primitive;
//! * the family traits are implemented where their launchers are: [`BufferOps`] (upload,
//!   download) in this file, `ElementwiseOps` in `elementwise.rs` (with `random.rs`),
//!   `ReduceOps` in `reduce.rs` (with `sort.rs`), `LayoutOps`, `MatmulOps`, `RoutingOps` and
//!   `OptimOps` in the files of those names, and `NnOps` in `nn.rs`, which forwards to the
//!   fused launchers.
//!
//! [`GpuBackend`] is a cheap handle (an `Arc`) to the process-wide context; [`GpuBuffer`] a cheap
//! handle to one pooled buffer with its dtype and length. The GPU computes in f32: an f64 buffer
//! is a [`Error::DType`]. Work is asynchronous: errors that wgpu reports late (out of memory, a
//! lost device) surface as [`Error::Gpu`] at the next [`GpuBackend::flush`],
//! [`GpuBackend::synchronize`] or download.

mod attention;
pub(crate) mod bind_group_cache;
pub(crate) mod buffer_pool;
mod context;
mod conv2d;
mod cross_entropy;
mod elementwise;
mod encoder;
mod half;
mod info;
pub(crate) mod invocation_order;
mod kernels;
mod layer_norm;
mod layout;
pub(crate) mod matmul;
mod matmul_build;
mod matmul_grouped;
mod matmul_kernel;
mod matmul_tune;
mod moe_combine;
mod mse;
mod nn;
mod optim;
mod pool2d;
mod random;
mod reduce;
mod rotary;
mod router_sums;
mod routing;
mod shader_checks;
mod sort;
mod stats;
mod strided;
mod swiglu;
pub(crate) mod timing;

// limits and tiles the backend's own tests (backend/tests/) pick their sizes around, and the
// shader list backend/tests/shader_backends.rs translates
#[cfg(test)]
pub(crate) use attention::{ATTENTION_MAX_HEAD_DIM, ATTENTION_TILE};
pub use info::{GpuInfo, info};
/// the WGSL source a launch names (user kernels are made in `crate::wgsl`)
pub(crate) use kernels::Shader;
#[cfg(test)]
pub(crate) use kernels::{BuiltinShader, builtin_shaders};
pub use matmul_kernel::MatmulKernel;
pub use matmul_tune::TunedMatmul;
pub(crate) use optim::AdamSlot;
#[cfg(test)]
pub(crate) use optim::{ADAM_MULTI_SLOTS, NORM_SLOTS};
pub use shader_checks::ShaderChecks;
#[cfg(test)]
pub(crate) use sort::{KEY_WORDS, sort_key_words};
pub use stats::GpuStats;

use super::{BufferOps, HostData};
use crate::{DType, Error, Result};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, OnceLock};

/// The process-wide GPU context and its caches.
pub(crate) struct Inner {
    ctx: context::Context,
    pool: Arc<buffer_pool::Pool>,
    batcher: encoder::Batcher,
    kernels: kernels::KernelCache,
    counters: Arc<stats::Counters>,
    /// the kernel `matmul` runs, a [`MatmulKernel`] as its discriminant
    matmul_kernel: AtomicU8,
    /// the tile kernels [`MatmulKernel::Tuned`] chose, by size class
    matmul_tuning: matmul_tune::MatmulTuning,
    /// the run-time checks compiled into the built-in kernels, a [`ShaderChecks`] as its
    /// discriminant
    shader_checks: AtomicU8,
}

/// A handle to the process-wide GPU context (device, queue, buffer pool, pipeline cache,
/// pending batch). Cloning is cheap; every clone drives the same device.
#[derive(Clone)]
pub(crate) struct GpuBackend {
    inner: Arc<Inner>,
}

/// The context, opened on first use; a failure is remembered (the adapter is not probed again).
static GPU: OnceLock<std::result::Result<GpuBackend, String>> = OnceLock::new();

/// A buffer on the GPU: a shared handle to one pooled wgpu buffer, with its dtype (F32 or I32)
/// and length in elements. The pooled buffer goes back to the pool when the last clone drops.
#[derive(Clone)]
pub(crate) struct GpuBuffer {
    buf: Arc<buffer_pool::PooledBuffer>,
    dtype: DType,
    len: usize,
}

impl GpuBuffer {
    /// The dtype of the elements (F32, I32, or F16 on adapters with `shader-f16`).
    pub(crate) fn dtype(&self) -> DType {
        self.dtype
    }
    /// Bytes the elements occupy, rounded up to whole 4-byte words (what wgpu copies and binds):
    /// an f16 buffer of odd length ends with half a word of padding.
    pub(crate) fn byte_len(&self) -> u64 {
        byte_len(self.len, self.dtype)
    }
    /// Number of elements.
    pub(crate) fn len(&self) -> usize {
        self.len
    }
    /// True when the buffer holds no elements.
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// True when `other` is a handle to the same device buffer (a write to one is a write to
    /// the other).
    pub(crate) fn shares_buffer(&self, other: &GpuBuffer) -> bool {
        Arc::ptr_eq(&self.buf, &other.buf)
    }
}

impl std::fmt::Debug for GpuBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GpuBuffer({} × {})", self.len, self.dtype)
    }
}

/// Byte counters of the GPU buffer pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct PoolStats {
    /// bytes of storage buffers checked out now (by size class)
    pub in_use_bytes: u64,
    /// the most checked out at once since the context opened or [`GpuBackend::reset_peak`]
    pub peak_bytes: u64,
}

impl GpuBackend {
    /// The process-wide GPU context, opened on the first call.
    ///
    /// # Errors
    /// [`Error::Device`] when no adapter can be opened; the message names the backends tried.
    /// The failure is remembered, so later calls answer at once.
    pub(crate) fn get() -> Result<GpuBackend> {
        GPU.get_or_init(|| {
            let ctx = context::open().map_err(|e| match e {
                Error::Device(msg) => msg,
                other => other.to_string(),
            })?;
            let counters = Arc::new(stats::Counters::default());
            let pool = buffer_pool::Pool::new(
                ctx.device.clone(),
                ctx.limits.max_buffer_size,
                counters.clone(),
            );
            let reuse = bind_group_cache::reuse_from_env().map_err(|e| e.to_string())?;
            let batcher = encoder::Batcher::new(&ctx, counters.clone(), reuse);
            let subgroups = subgroup_matmul_possible(&ctx);
            let matmul_kernel = match std::env::var("MOEGRAD_MATMUL") {
                // timing kernels on a software adapter would cost seconds and measure a CPU
                Err(_) if ctx.adapter_info.device_type == wgpu::DeviceType::Cpu => {
                    MatmulKernel::Auto
                }
                Err(_) => MatmulKernel::Tuned,
                Ok(name) => match MatmulKernel::from_name(&name).map_err(|e| e.to_string())? {
                    MatmulKernel::Subgroup if !subgroups => {
                        return Err(format!(
                            "MOEGRAD_MATMUL=subgroup, but the adapter \"{}\" offers no subgroups of 4 to 128 invocations",
                            ctx.adapter_info.name
                        ));
                    }
                    chosen => chosen,
                },
            };
            let shader_checks = ShaderChecks::from_env().map_err(|e| e.to_string())?;
            Ok(GpuBackend {
                inner: Arc::new(Inner {
                    ctx,
                    pool,
                    batcher,
                    kernels: kernels::KernelCache::default(),
                    counters,
                    matmul_kernel: AtomicU8::new(matmul_kernel as u8),
                    matmul_tuning: matmul_tune::MatmulTuning::default(),
                    shader_checks: AtomicU8::new(shader_checks as u8),
                }),
            })
        })
        .clone()
        .map_err(Error::Device)
    }

    /// The context if it has been opened (never opens it).
    pub(crate) fn opened() -> Option<GpuBackend> {
        GPU.get()?.as_ref().ok().cloned()
    }

    /// Submits the pending batch of kernels (without waiting for it).
    ///
    /// # Errors
    /// [`Error::Gpu`] when wgpu reported an error since the last check.
    pub(crate) fn flush(&self) -> Result<()> {
        self.inner.batcher.flush(&self.inner.ctx);
        self.inner.ctx.take_error()
    }

    /// Submits the pending batch and waits until the device has finished all work (benchmarks
    /// call it before reading the clock).
    ///
    /// # Errors
    /// [`Error::Gpu`] when wgpu reported an error or the wait failed.
    pub(crate) fn synchronize(&self) -> Result<()> {
        self.inner.batcher.flush(&self.inner.ctx);
        self.inner.counters.host_wait();
        self.inner
            .ctx
            .device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| Error::Gpu(format!("waiting for the GPU: {e}")))?;
        self.inner.ctx.take_error()
    }

    /// The counters of dispatches, submissions, host waits, buffers created and bytes moved
    /// since the context opened or the last [`GpuBackend::reset_stats`]. They are
    /// process-wide: work from every thread counts.
    pub(crate) fn stats(&self) -> GpuStats {
        self.inner.counters.snapshot()
    }

    /// Sets the counters of [`GpuBackend::stats`] back to zero.
    pub(crate) fn reset_stats(&self) {
        self.inner.counters.reset();
    }

    /// Bytes of pooled storage buffers in use now and at the peak.
    pub(crate) fn pool_stats(&self) -> PoolStats {
        let (in_use_bytes, peak_bytes) = self.inner.pool.stats();
        PoolStats {
            in_use_bytes,
            peak_bytes,
        }
    }

    /// Restarts the peak counter of [`GpuBackend::pool_stats`] at the bytes in use now.
    pub(crate) fn reset_peak(&self) {
        self.inner.pool.reset_peak();
    }

    /// Bytes held on the pool's free lists, ready for reuse.
    #[cfg(test)]
    pub fn pool_free_bytes(&self) -> u64 {
        self.inner.pool.free_bytes()
    }

    /// Whether `b` is the only handle to its device buffer apart from the pending batch of
    /// kernels (recorded earlier, so they run first): a kernel may then overwrite it in place.
    pub(crate) fn is_exclusive(&self, b: &GpuBuffer) -> bool {
        self.inner.batcher.only_held_by_batch(&b.buf)
    }

    /// Whether the adapter can run [`MatmulKernel::Subgroup`]: it has the SUBGROUP feature with
    /// subgroups of 4 to 128 invocations (lavapipe: 8; NVIDIA 32; AMD 32 or 64).
    pub(crate) fn subgroup_matmul_available(&self) -> bool {
        subgroup_matmul_possible(&self.inner.ctx)
    }

    /// The kernel `matmul` runs now: [`MatmulKernel::Tuned`] on a GPU, [`MatmulKernel::Auto`] on
    /// a software adapter, unless `MOEGRAD_MATMUL` or [`GpuBackend::set_matmul_kernel`] chose
    /// another.
    pub(crate) fn matmul_kernel(&self) -> MatmulKernel {
        let chosen = self.inner.matmul_kernel.load(Ordering::Relaxed);
        MatmulKernel::ALL
            .into_iter()
            .find(|&k| k as u8 == chosen)
            .unwrap_or(MatmulKernel::Auto)
    }

    /// Chooses the kernel of `matmul` for the whole process (all compute the same products; the
    /// choice is for measuring and testing them).
    ///
    /// # Errors
    /// [`Error::Invalid`] for [`MatmulKernel::Subgroup`] on an adapter without it.
    pub(crate) fn set_matmul_kernel(&self, kernel: MatmulKernel) -> Result<()> {
        if kernel == MatmulKernel::Subgroup && !self.subgroup_matmul_available() {
            return Err(Error::Invalid(format!(
                "the subgroup matmul needs subgroups of 4 to 128 invocations; the adapter \"{}\" has none",
                self.inner.ctx.adapter_info.name
            )));
        }
        self.inner
            .matmul_kernel
            .store(kernel as u8, Ordering::Relaxed);
        Ok(())
    }

    /// Writes `bytes` (a multiple of 4, at most the buffer's size) at the start of `out`, a buffer
    /// just taken from the pool: no kernel of the pending batch uses it (the batch would hold
    /// it), so the write, which wgpu applies at the next submission before its kernels, lands
    /// before any kernel that reads it. Counted as uploaded bytes.
    pub(crate) fn write_fresh(&self, out: &GpuBuffer, bytes: &[u8]) {
        if !bytes.is_empty() {
            self.inner.ctx.queue.write_buffer(out.buf.raw(), 0, bytes);
            self.inner.counters.uploaded(bytes.len() as u64);
        }
    }

    /// The tile kernels [`MatmulKernel::Tuned`] has chosen so far, and what it timed.
    pub(crate) fn matmul_tuning(&self) -> &matmul_tune::MatmulTuning {
        &self.inner.matmul_tuning
    }

    /// The run-time checks compiled into the built-in kernels now:
    /// [`ShaderChecks::NoLoopCounter`] unless `MOEGRAD_SHADER_CHECKS` or
    /// [`GpuBackend::set_shader_checks`] chose another.
    pub(crate) fn shader_checks(&self) -> ShaderChecks {
        let chosen = self.inner.shader_checks.load(Ordering::Relaxed);
        ShaderChecks::ALL
            .into_iter()
            .find(|&c| c as u8 == chosen)
            .unwrap_or(ShaderChecks::Full)
    }

    /// Chooses the run-time checks of the built-in kernels compiled from now on, for the whole
    /// process (pipelines are cached per choice, so switching back costs no compilation).
    pub(crate) fn set_shader_checks(&self, checks: ShaderChecks) {
        self.inner
            .shader_checks
            .store(checks as u8, Ordering::Relaxed);
    }

    /// The bind-group cache (`bind_group_cache.rs`), locked.
    pub(crate) fn bind_groups(
        &self,
    ) -> std::sync::MutexGuard<'_, bind_group_cache::BindGroupCache> {
        let cache = &self.inner.batcher.bind_groups;
        cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The (shader name, checks) of every shader module compiled so far.
    #[cfg(test)]
    pub fn compiled_modules(&self) -> Vec<(&'static str, ShaderChecks)> {
        self.inner.kernels.module_keys()
    }

    /// How many shader modules were compiled with their invocations as `roles` says
    /// (`invocation_order.rs`).
    #[cfg(test)]
    pub(crate) fn module_count(&self, roles: invocation_order::Roles) -> usize {
        self.inner.kernels.module_count(roles)
    }

    /// A pool of its own on this device (empty, with counters of its own), to test the pool.
    #[cfg(test)]
    pub fn private_pool(&self) -> Arc<buffer_pool::Pool> {
        let ctx = &self.inner.ctx;
        let counters = Arc::new(stats::Counters::default());
        buffer_pool::Pool::new(ctx.device.clone(), ctx.limits.max_buffer_size, counters)
    }

    /// Gives the pool's free buffers back to the driver (buffers in use are kept), and empties
    /// the bind-group cache whose entries keep them alive ([`crate::gpu::release_free_memory`]).
    pub fn trim_pool(&self) {
        self.bind_groups().clear();
        self.inner.pool.trim();
    }

    /// The optional wgpu features the device was opened with.
    #[allow(dead_code)]
    pub(crate) fn features(&self) -> wgpu::Features {
        self.inner.ctx.features
    }

    /// The limits the device was opened with.
    #[allow(dead_code)]
    pub(crate) fn limits(&self) -> &wgpu::Limits {
        &self.inner.ctx.limits
    }

    /// Copies `x` into a pooled staging buffer, waits for it and reads it back.
    fn read_back(&self, x: &GpuBuffer) -> Result<Vec<u8>> {
        let bytes = x.byte_len();
        if bytes == 0 {
            self.flush()?;
            return Ok(Vec::new());
        }
        let inner = &self.inner;
        let staging = inner.pool.take(buffer_pool::Kind::Staging, bytes)?;
        let index = inner
            .batcher
            .copy_and_submit(&inner.ctx, &x.buf, &staging, bytes);
        let (tx, rx) = std::sync::mpsc::channel();
        staging
            .raw()
            .map_async(wgpu::MapMode::Read, 0..bytes, move |r| {
                let _ = tx.send(r);
            });
        inner.counters.host_wait();
        inner.counters.downloaded(bytes);
        let data = self.wait_and_read(&staging, index, bytes, rx);
        // Unmapping also cancels a pending map, so the staging buffer goes back to the pool
        // unmapped on every path.
        staging.raw().unmap();
        data
    }

    /// Waits for the submission that fills `staging`, then copies its first `bytes` bytes out.
    fn wait_and_read(
        &self,
        staging: &buffer_pool::PooledBuffer,
        index: wgpu::SubmissionIndex,
        bytes: u64,
        mapped: std::sync::mpsc::Receiver<std::result::Result<(), wgpu::BufferAsyncError>>,
    ) -> Result<Vec<u8>> {
        let device = &self.inner.ctx.device;
        device
            .poll(wgpu::PollType::Wait {
                submission_index: Some(index),
                timeout: None,
            })
            .map_err(|e| Error::Gpu(format!("waiting for a download: {e}")))?;
        self.inner.ctx.take_error()?;
        // The wait runs the map callback; poll once more in case a driver reports it late.
        let status = match mapped.try_recv() {
            Ok(r) => Some(r),
            Err(_) => {
                let _ = device.poll(wgpu::PollType::wait_indefinitely());
                mapped.recv_timeout(std::time::Duration::from_secs(10)).ok()
            }
        };
        match status {
            Some(Ok(())) => {}
            Some(Err(e)) => return Err(Error::Gpu(format!("mapping a download buffer: {e}"))),
            None => return Err(Error::Gpu("a download buffer was never mapped".into())),
        }
        let view = staging
            .raw()
            .get_mapped_range(0..bytes)
            .map_err(|e| Error::Gpu(format!("reading a download buffer: {e}")))?;
        Ok(view.to_vec())
    }
}

/// Whether the device opened with subgroups the subgroup matmul can use (4 to 128 invocations:
/// its 64 A values per row group fit 16 registers, and the subgroups tile a 256-invocation
/// workgroup exactly).
fn subgroup_matmul_possible(ctx: &context::Context) -> bool {
    let info = &ctx.adapter_info;
    ctx.features.contains(wgpu::Features::SUBGROUP)
        && info.subgroup_min_size >= 4
        && info.subgroup_max_size <= 128
        && info.subgroup_min_size <= info.subgroup_max_size
}

/// Bytes of `len` elements of `dtype` in a device buffer, rounded up to whole 4-byte words.
pub(crate) fn byte_len(len: usize, dtype: DType) -> u64 {
    (len as u64)
        .saturating_mul(dtype.size_in_bytes() as u64)
        .next_multiple_of(4)
}

/// An `Error::DType` for an f64 request on the GPU.
fn f64_error(what: &str) -> Error {
    Error::DType(format!(
        "{what}: the GPU computes in f32; keep f64 tensors on the CPU (or cast to f32 first)"
    ))
}

impl BufferOps for GpuBackend {
    type Buffer = GpuBuffer;

    fn upload(&self, data: &HostData) -> Result<GpuBuffer> {
        let (bytes, dtype): (&[u8], DType) = match data {
            HostData::F32(v) => (bytemuck::cast_slice(v), DType::F32),
            HostData::I32(v) => (bytemuck::cast_slice(v), DType::I32),
            HostData::F64(_) => return Err(f64_error("upload")),
        };
        let out = self.alloc(data.len(), dtype)?;
        self.write_fresh(&out, bytes);
        Ok(out)
    }

    fn download(&self, x: &GpuBuffer) -> Result<HostData> {
        let bytes = self.read_back(x)?;
        Ok(match x.dtype {
            DType::F32 => HostData::F32(bytemuck::pod_collect_to_vec(&bytes)),
            DType::I32 => HostData::I32(bytemuck::pod_collect_to_vec(&bytes)),
            DType::F64 => return Err(f64_error("download")),
            // f16 is read back as f32 (every f16 value is one), the host's float type
            DType::F16 => HostData::F32(
                (bytes.chunks_exact(2).take(x.len))
                    .map(|h| ::half::f16::from_le_bytes([h[0], h[1]]).to_f32())
                    .collect(),
            ),
        })
    }
}
