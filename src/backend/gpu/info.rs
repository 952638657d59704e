//! [`info`]: what the GPU adapter is and what the device was opened with (name, backend,
//! driver, the limits and features the kernels use, the matmul kernel), as `moegrad info`
//! prints it.

use super::GpuBackend;
use crate::Result;

/// What the adapter is and what the device was opened with (see `moegrad info`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct GpuInfo {
    /// adapter name, e.g. "NVIDIA GeForce RTX 3060" or "llvmpipe (LLVM 15.0.6, 256 bits)"
    pub name: String,
    /// wgpu backend: "Vulkan", "Metal", "Dx12", "Gl"
    pub backend: String,
    /// "DiscreteGpu", "IntegratedGpu", "Cpu" (a software rasterizer), ...
    pub device_type: String,
    /// driver name and version
    pub driver: String,
    /// the device limits the kernels use, as requested from the adapter
    pub limits: Vec<(String, u64)>,
    /// optional features the adapter reports and the device enabled (subgroups, f16, timestamps)
    pub features: Vec<String>,
    /// the smallest and largest subgroup the adapter reports (`[0, 0]` without subgroups)
    pub subgroup_sizes: [u32; 2],
    /// the kernel choice of `matmul`: "tuned", "auto", "plain", "wide", "wide-vec4" or "subgroup" (see
    /// [`super::MatmulKernel`])
    pub matmul_kernel: String,
    /// the run-time checks compiled into moegrad's kernels: "full", "no-loop-counter" or
    /// "none" (see [`super::ShaderChecks`])
    pub shader_checks: String,
    /// whether a dispatch reuses the bind group of an earlier one that bound the same buffers
    /// ("reuse", the default) or creates its own ("create"; `MOEGRAD_BIND_GROUPS`)
    pub bind_groups: String,
    /// whether the device stores f16 (wgpu's `SHADER_F16`), which `DType::F16` tensors need
    pub f16: bool,
}

/// Facts about the GPU adapter, opening the context if needed.
///
/// # Errors
/// [`crate::Error::Device`] when no adapter is available (the message names the backends tried).
pub fn info() -> Result<GpuInfo> {
    let be = GpuBackend::get()?;
    let c = &be.inner.ctx;
    let l = &c.limits;
    let limits = vec![
        (
            "max_storage_buffer_binding_size".to_string(),
            l.max_storage_buffer_binding_size,
        ),
        ("max_buffer_size".into(), l.max_buffer_size),
        (
            "max_storage_buffers_per_shader_stage".into(),
            l.max_storage_buffers_per_shader_stage as u64,
        ),
        (
            "max_buffers_per_shader_stage".into(),
            l.max_buffers_and_acceleration_structures_per_shader_stage as u64,
        ),
        (
            "max_compute_workgroup_storage_size".into(),
            l.max_compute_workgroup_storage_size as u64,
        ),
        (
            "max_compute_invocations_per_workgroup".into(),
            l.max_compute_invocations_per_workgroup as u64,
        ),
        (
            "max_compute_workgroups_per_dimension".into(),
            l.max_compute_workgroups_per_dimension as u64,
        ),
        (
            "min_uniform_buffer_offset_alignment".into(),
            l.min_uniform_buffer_offset_alignment as u64,
        ),
    ];
    let driver = match (
        c.adapter_info.driver.is_empty(),
        c.adapter_info.driver_info.is_empty(),
    ) {
        (true, true) => "unknown".to_string(),
        (false, true) => c.adapter_info.driver.clone(),
        (true, false) => c.adapter_info.driver_info.clone(),
        (false, false) => format!("{} {}", c.adapter_info.driver, c.adapter_info.driver_info),
    };
    Ok(GpuInfo {
        name: c.adapter_info.name.clone(),
        backend: format!("{:?}", c.adapter_info.backend),
        device_type: format!("{:?}", c.adapter_info.device_type),
        driver,
        limits,
        features: c.feature_names.clone(),
        subgroup_sizes: if c.features.contains(wgpu::Features::SUBGROUP) {
            [
                c.adapter_info.subgroup_min_size,
                c.adapter_info.subgroup_max_size,
            ]
        } else {
            [0, 0]
        },
        matmul_kernel: be.matmul_kernel().name().to_string(),
        shader_checks: be.shader_checks().name().to_string(),
        bind_groups: if be.bind_groups().reuse() {
            "reuse"
        } else {
            "create"
        }
        .to_string(),
        f16: be.has_f16(),
    })
}
