//! Devices: where a tensor lives and whose kernels run on it.
//!
//! [`Device::cpu`] always works. [`Device::gpu`] opens the process-wide wgpu context (Vulkan, Metal
//! or DX12) and fails with a message naming what was tried. [`Device::best`] picks the GPU when
//! there is one and otherwise the CPU, and says which on stderr. The environment variable
//! `MOEGRAD_DEVICE=cpu|gpu` overrides the choice.

use crate::backend::gpu;
use crate::{Error, Result};

/// A compute device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    /// the CPU backend (f32 and f64, multi-threaded)
    Cpu,
    /// the wgpu backend (f32)
    Gpu,
}

impl Device {
    /// The CPU.
    pub fn cpu() -> Device {
        Device::Cpu
    }

    /// The GPU, or an error naming the backends tried when no adapter is found.
    ///
    /// # Example
    /// ```
    /// match moegrad::Device::gpu() {
    ///     Ok(d) => println!("using {d}"),
    ///     Err(e) => println!("no GPU: {e}"),
    /// }
    /// ```
    pub fn gpu() -> Result<Device> {
        gpu::GpuBackend::get().map(|_| Device::Gpu)
    }

    /// Chooses a device and explains the choice in one line: `MOEGRAD_DEVICE` (`cpu`, `gpu` or
    /// `auto`) if set, else the GPU when a hardware adapter is found, else the CPU (a software
    /// adapter such as Mesa's lavapipe counts as none: it is used only when asked for).
    pub fn choose() -> Result<(Device, String)> {
        match std::env::var("MOEGRAD_DEVICE")
            .ok()
            .as_deref()
            .map(str::trim)
        {
            Some("cpu") => Ok((Device::Cpu, "CPU (MOEGRAD_DEVICE=cpu)".into())),
            Some("gpu") => {
                let d = Device::gpu()?;
                Ok((d, format!("GPU {} (MOEGRAD_DEVICE=gpu)", adapter_line())))
            }
            None | Some("") | Some("auto") => match Device::gpu() {
                // A software rasteriser (Mesa's llvmpipe, WARP) is an adapter but not a GPU: the
                // CPU backend is far faster, so `auto` takes it only when asked for by name.
                Ok(_) if is_software_adapter() => Ok((
                    Device::Cpu,
                    format!(
                        "CPU (the only adapter, {}, is a software renderer; set \
                         MOEGRAD_DEVICE=gpu to use it anyway)",
                        adapter_line()
                    ),
                )),
                Ok(d) => Ok((d, format!("GPU {}", adapter_line()))),
                Err(e) => Ok((
                    Device::Cpu,
                    format!("CPU (no GPU: {e}); falling back to the CPU backend"),
                )),
            },
            Some(other) => Err(Error::Device(format!(
                "MOEGRAD_DEVICE={other:?} is not one of cpu, gpu, auto"
            ))),
        }
    }

    /// The GPU if there is one, else the CPU; prints the choice to stderr once per call.
    pub fn best() -> Result<Device> {
        let (d, why) = Device::choose()?;
        eprintln!("moegrad: using {why}");
        Ok(d)
    }

    /// Parses `cpu`, `gpu` or `auto` (as on the command line).
    pub fn from_name(name: &str) -> Result<Device> {
        match name {
            "cpu" => Ok(Device::Cpu),
            "gpu" => Device::gpu(),
            "auto" => Device::best(),
            other => Err(Error::Device(format!(
                "unknown device {other:?}; expected cpu, gpu or auto"
            ))),
        }
    }

    /// True for the GPU.
    pub fn is_gpu(self) -> bool {
        self == Device::Gpu
    }

    /// The GPU backend's counters (dispatches, submissions, host waits, buffers created, bytes
    /// uploaded and downloaded) since the context opened or the last
    /// [`Device::reset_gpu_stats`]; `None` on the CPU. The counters are process-wide.
    ///
    /// # Example
    /// ```
    /// use moegrad::{DType, Device, Tensor};
    /// if let Ok(gpu) = Device::gpu() {
    ///     let x = Tensor::full(&[4], 1.0, DType::F32, gpu).unwrap();
    ///     gpu.reset_gpu_stats();
    ///     let y = x.add(&x).unwrap();
    ///     assert!(gpu.gpu_stats().unwrap().dispatches >= 1); // the add
    ///     y.to_vec_f32().unwrap(); // a download: the host waits for the device
    ///     assert!(gpu.gpu_stats().unwrap().host_waits >= 1);
    /// }
    /// assert!(Device::cpu().gpu_stats().is_none());
    /// ```
    pub fn gpu_stats(self) -> Option<gpu::GpuStats> {
        match self {
            Device::Cpu => None,
            Device::Gpu => gpu::GpuBackend::get().ok().map(|g| g.stats()),
        }
    }

    /// Sets the counters of [`Device::gpu_stats`] back to zero (a no-op on the CPU).
    pub fn reset_gpu_stats(self) {
        if let (Device::Gpu, Ok(g)) = (self, gpu::GpuBackend::get()) {
            g.reset_stats();
        }
    }

    /// Waits until every kernel queued on this device has finished (a no-op on the CPU).
    /// Benchmarks call it before reading the clock: GPU work is queued and submitted in
    /// batches, so without it a timer would measure the queueing, not the kernels.
    ///
    /// # Errors
    /// On the GPU, an [`Error`] if the backend cannot be opened or the wait fails.
    ///
    /// # Example
    /// ```
    /// use moegrad::{DType, Device, Tensor};
    /// # fn main() -> moegrad::Result<()> {
    /// let devices = [Some(Device::cpu()), Device::gpu().ok()];
    /// for dev in devices.into_iter().flatten() {
    ///     let x = Tensor::full(&[256], 1.0, DType::F32, dev)?;
    ///     let start = std::time::Instant::now();
    ///     let _y = x.mul(&x)?; // queued on the GPU, computed at once on the CPU
    ///     dev.synchronize()?; // the product has been computed when this returns
    ///     let _elapsed = start.elapsed();
    /// }
    /// # Ok(()) }
    /// ```
    pub fn synchronize(self) -> Result<()> {
        match self {
            Device::Cpu => Ok(()),
            Device::Gpu => gpu::GpuBackend::get()?.synchronize(),
        }
    }
}

fn is_software_adapter() -> bool {
    gpu::info().is_ok_and(|i| i.device_type == "Cpu")
}

fn adapter_line() -> String {
    match gpu::info() {
        Ok(i) => format!("\"{}\" ({}, {})", i.name, i.backend, i.device_type),
        Err(_) => String::from("(adapter details unavailable)"),
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Device::Cpu => "cpu",
            Device::Gpu => "gpu",
        })
    }
}
