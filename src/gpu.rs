//! The GPU as a user of the library sees it: what the adapter is ([`info`]), what the backend
//! has done ([`GpuStats`], read with [`crate::Device::gpu_stats`]), the device memory moegrad's
//! buffers hold ([`memory`]), and the choices and capabilities a benchmark or a test needs (the
//! matmul kernel, [`MatmulKernel`]; the run-time checks compiled into the kernels,
//! [`ShaderChecks`]; whether Adam's multi-tensor kernel and timestamp queries are
//! available). Tensors on the GPU need none of it: `Device::gpu()` and the `Tensor` API are
//! enough. The GPU backend itself (buffers, pipelines, the command batches) is internal.
//!
//! Every function opens the process-wide GPU context on its first call, and returns
//! [`crate::Error::Device`] (naming the backends tried) when there is no adapter.
//!
//! # Example
//! ```
//! if let Ok(info) = moegrad::gpu::info() {
//!     println!("{} ({}), matmul kernel {}", info.name, info.backend, info.matmul_kernel);
//!     let mem = moegrad::gpu::memory().unwrap();
//!     assert!(mem.peak_bytes >= mem.in_use_bytes);
//! }
//! ```

use crate::Result;
use crate::backend::gpu::GpuBackend;

pub use crate::backend::gpu::{GpuInfo, GpuStats, MatmulKernel, ShaderChecks, TunedMatmul, info};

/// Bytes of device memory held by moegrad's storage buffers (the GPU buffer pool): checked out
/// now, and the most checked out at once since the context opened or [`reset_peak_memory`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GpuMemory {
    /// bytes of storage buffers in use now (counted by the pool's size classes)
    pub in_use_bytes: u64,
    /// the most bytes in use at once
    pub peak_bytes: u64,
}

/// The device memory in use now and at the peak (see [`GpuMemory`]).
///
/// # Errors
/// [`crate::Error::Device`] when no GPU adapter is available.
pub fn memory() -> Result<GpuMemory> {
    let s = GpuBackend::get()?.pool_stats();
    Ok(GpuMemory {
        in_use_bytes: s.in_use_bytes,
        peak_bytes: s.peak_bytes,
    })
}

/// Restarts the peak of [`memory`] at the bytes in use now (before the part of a run to measure).
///
/// # Errors
/// [`crate::Error::Device`] when no GPU adapter is available.
pub fn reset_peak_memory() -> Result<()> {
    GpuBackend::get()?.reset_peak();
    Ok(())
}

/// Gives the buffer pool's free buffers back to the driver, and empties the bind-group cache
/// that refers to them (PyTorch's `torch.cuda.empty_cache()`); buffers in use are kept. The
/// next allocations create buffers again, so a steady training step would no longer be free of
/// new buffers right after it. A measurement that calls this first sees what a fresh process
/// would: the pool's free buffers decide when a pending batch is submitted early (see
/// `MAX_BATCH` in the encoder), and with it the step's peak memory.
///
/// # Errors
/// [`crate::Error::Device`] without an adapter; [`crate::Error::Gpu`] when wgpu reported an error.
///
/// # Example
/// ```
/// if let Ok(gpu) = moegrad::Device::gpu() {
///     let _x = moegrad::Tensor::zeros(&[1024], moegrad::DType::F32, gpu).unwrap();
///     moegrad::gpu::release_free_memory().unwrap();
///     assert!(moegrad::gpu::memory().unwrap().in_use_bytes >= 4096);
/// }
/// ```
pub fn release_free_memory() -> Result<()> {
    let gpu = GpuBackend::get()?;
    gpu.flush()?;
    gpu.trim_pool();
    Ok(())
}

/// Submits the kernels queued so far without waiting for them ([`crate::Device::synchronize`]
/// waits). Counting the work of one step with [`crate::Device::gpu_stats`] flushes before and
/// after it, so that the submission it causes is counted where it belongs.
///
/// # Errors
/// [`crate::Error::Device`] without an adapter; [`crate::Error::Gpu`] when wgpu reported an error.
///
/// # Example
/// ```
/// use moegrad::{DType, Device, Tensor};
/// if let Ok(gpu) = Device::gpu() {
///     let x = Tensor::full(&[8], 2.0, DType::F32, gpu).unwrap();
///     moegrad::gpu::flush().unwrap();
///     let before = gpu.gpu_stats().unwrap();
///     let _y = x.mul(&x).unwrap();
///     moegrad::gpu::flush().unwrap();
///     let step = gpu.gpu_stats().unwrap().since(&before);
///     assert_eq!((step.dispatches, step.submits), (1, 1));
/// }
/// ```
pub fn flush() -> Result<()> {
    GpuBackend::get()?.flush()
}

/// The kernel choice of the GPU `matmul` now: [`MatmulKernel::Tuned`] on a GPU (large products
/// run the tile kernel timed fastest on it, see [`matmul_tuning`]) and [`MatmulKernel::Auto`]
/// on a software adapter (the wide kernel for large products, the plain one otherwise), unless
/// `MOEGRAD_MATMUL` or [`set_matmul_kernel`] chose another.
///
/// # Errors
/// [`crate::Error::Device`] when no GPU adapter is available.
pub fn matmul_kernel() -> Result<MatmulKernel> {
    Ok(GpuBackend::get()?.matmul_kernel())
}

/// Chooses the GPU `matmul` kernel for the whole process. All compute the same products (to the
/// bit); the choice is for measuring and testing them (`moegrad bench matmul` times each).
///
/// # Errors
/// [`crate::Error::Device`] without an adapter; [`crate::Error::Invalid`] for
/// [`MatmulKernel::Subgroup`] on an adapter without subgroups (see
/// [`subgroup_matmul_available`]).
///
/// # Example
/// ```
/// use moegrad::gpu::{self, MatmulKernel};
/// if let Ok(before) = gpu::matmul_kernel() {
///     gpu::set_matmul_kernel(MatmulKernel::Plain).unwrap();
///     assert_eq!(gpu::matmul_kernel().unwrap(), MatmulKernel::Plain);
///     gpu::set_matmul_kernel(before).unwrap();
/// }
/// ```
pub fn set_matmul_kernel(kernel: MatmulKernel) -> Result<()> {
    GpuBackend::get()?.set_matmul_kernel(kernel)
}

/// What [`MatmulKernel::Tuned`] has measured and chosen so far: one record per size class of
/// product it tuned (the product timed, each candidate kernel's milliseconds per run, the
/// kernel chosen), smallest product first. Empty until a large product has run under `Tuned`.
///
/// # Errors
/// [`crate::Error::Device`] when no GPU adapter is available.
///
/// # Example
/// ```
/// use moegrad::{DType, Device, Tensor};
/// use moegrad::gpu::{self, MatmulKernel};
/// if let Ok(gpu_dev) = Device::gpu() {
///     let before = gpu::matmul_kernel().unwrap();
///     gpu::set_matmul_kernel(MatmulKernel::Tuned).unwrap();
///     // 64 output tiles of 128×128: large enough to be tuned
///     let a = Tensor::full(&[1024, 8], 1.0, DType::F32, gpu_dev).unwrap();
///     let b = Tensor::full(&[8, 1024], 0.5, DType::F32, gpu_dev).unwrap();
///     let c = a.matmul(&b).unwrap();
///     assert_eq!(c.to_vec_f32().unwrap()[0], 4.0);
///     let tuned = gpu::matmul_tuning().unwrap();
///     let record = tuned.iter().find(|t| t.product == [1, 1024, 8, 1024]).unwrap();
///     assert!(record.ms.iter().any(|&(k, _)| k == record.kernel));
///     gpu::set_matmul_kernel(before).unwrap();
/// }
/// ```
pub fn matmul_tuning() -> Result<Vec<TunedMatmul>> {
    Ok(GpuBackend::get()?.matmul_tuning().records())
}

/// The run-time checks wgpu compiles into moegrad's own kernels now:
/// [`ShaderChecks::NoLoopCounter`] (bounds checks and integer-division guards, no loop
/// counter) unless `MOEGRAD_SHADER_CHECKS` or [`set_shader_checks`] chose another. Kernels a
/// user writes ([`crate::wgsl`]) always keep every check.
///
/// # Errors
/// [`crate::Error::Device`] when no GPU adapter is available.
pub fn shader_checks() -> Result<ShaderChecks> {
    Ok(GpuBackend::get()?.shader_checks())
}

/// Chooses the run-time checks of moegrad's kernels compiled from now on, for the whole
/// process; each choice has its own cached pipelines, so every kernel compiles at most once
/// per choice. All compute the same values; the choice is for measuring what the checks cost
/// (`moegrad bench matmul --shader-checks`).
///
/// # Errors
/// [`crate::Error::Device`] when no GPU adapter is available.
///
/// # Example
/// ```
/// use moegrad::gpu::{self, ShaderChecks};
/// if let Ok(before) = gpu::shader_checks() {
///     gpu::set_shader_checks(ShaderChecks::Full).unwrap();
///     assert_eq!(gpu::shader_checks().unwrap(), ShaderChecks::Full);
///     gpu::set_shader_checks(before).unwrap();
/// }
/// ```
pub fn set_shader_checks(checks: ShaderChecks) -> Result<()> {
    GpuBackend::get()?.set_shader_checks(checks);
    Ok(())
}

/// Whether a dispatch reuses the bind group of an earlier dispatch that bound the same buffers
/// (the default, unless `MOEGRAD_BIND_GROUPS=create`), rather than creating its own; see
/// [`GpuStats::bind_groups_created`].
///
/// # Errors
/// [`crate::Error::Device`] when no GPU adapter is available.
pub fn bind_group_reuse() -> Result<bool> {
    Ok(GpuBackend::get()?.bind_groups().reuse())
}

/// Turns bind-group reuse on or off for the whole process (off also drops the cached groups).
/// Both compute the same values; the choice is for measuring what creating a bind group per
/// dispatch costs the host (`moegrad bench gpu-step` reports both).
///
/// # Errors
/// [`crate::Error::Device`] when no GPU adapter is available.
///
/// # Example
/// ```
/// use moegrad::gpu;
/// if let Ok(before) = gpu::bind_group_reuse() {
///     gpu::set_bind_group_reuse(false).unwrap();
///     assert!(!gpu::bind_group_reuse().unwrap());
///     gpu::set_bind_group_reuse(before).unwrap();
/// }
/// ```
pub fn set_bind_group_reuse(reuse: bool) -> Result<()> {
    GpuBackend::get()?.bind_groups().set_reuse(reuse);
    Ok(())
}

/// Whether the adapter can run [`MatmulKernel::Subgroup`]: it has subgroups of 4 to 128
/// invocations (lavapipe: 8; NVIDIA 32; AMD 32 or 64).
///
/// # Errors
/// [`crate::Error::Device`] when no GPU adapter is available.
pub fn subgroup_matmul_available() -> Result<bool> {
    Ok(GpuBackend::get()?.subgroup_matmul_available())
}

/// Whether Adam updates several parameters per dispatch on this adapter (its multi-tensor
/// kernel binds a dozen parameters' buffers at once, which the adapter's storage-buffer limit
/// must allow); otherwise each parameter takes a dispatch of its own.
///
/// # Errors
/// [`crate::Error::Device`] when no GPU adapter is available.
pub fn adam_multi_supported() -> Result<bool> {
    Ok(GpuBackend::get()?.adam_multi_supported())
}

/// Whether the device was opened with timestamp queries, which a profile (`train --profile`,
/// `MOEGRAD_PROFILE=1`) and `moegrad bench gpu-step` need to time each kernel.
///
/// # Errors
/// [`crate::Error::Device`] when no GPU adapter is available.
pub fn has_timestamps() -> Result<bool> {
    Ok(GpuBackend::get()?
        .features()
        .contains(wgpu::Features::TIMESTAMP_QUERY))
}
