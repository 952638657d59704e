//! `moegrad info`: which device moegrad would use and what it knows about it.

use crate::backend::gpu;
use crate::{Device, Result};
use serde::Serialize;

/// Facts about the devices, as printed by `moegrad info`.
#[derive(Clone, Debug, Serialize)]
pub struct DeviceReport {
    /// the device `Device::best()` would choose: "cpu" or "gpu"
    pub device: String,
    /// why it was chosen (or why the GPU was not)
    pub reason: String,
    /// the GPU adapter, when one was found
    pub gpu: Option<gpu::GpuInfo>,
    /// why no GPU adapter is available, when none is
    pub gpu_error: Option<String>,
    /// CPU worker threads (rayon)
    pub cpu_threads: usize,
    /// the CPU matmul library
    pub cpu_gemm: String,
}

/// Collects the report (honours `MOEGRAD_DEVICE`).
pub fn device_report() -> Result<DeviceReport> {
    let (device, reason) = Device::choose()?;
    let (gpu, gpu_error) = match gpu::info() {
        Ok(i) => (Some(i), None),
        Err(e) => (None, Some(e.to_string())),
    };
    Ok(DeviceReport {
        device: device.to_string(),
        reason,
        gpu,
        gpu_error,
        cpu_threads: rayon::current_num_threads(),
        cpu_gemm: "gemm 0.19 (f32/f64, rayon-parallel)".into(),
    })
}
