//! Opening the GPU: the wgpu instance, the adapter, the logical device and its queue.
//!
//! [`open`] runs once per process (the [`super::GpuBackend`] keeps the result in a `OnceLock`).
//! It tries Vulkan, Metal and DX12, or the backends `WGPU_BACKEND` names (e.g. `vulkan`, or
//! `gl` to opt into wgpu's GL backend), asks for the limits the kernels need, each raised
//! only as far as the adapter offers, enables the optional features the adapter reports
//! (subgroups, f16) and installs an error handler that records wgpu errors instead of panicking;
//! [`Context::take_error`] hands the first recorded error back as an [`Error::Gpu`] at the next
//! flush or download.

use crate::{Error, Result};
use std::sync::{Arc, Mutex};

/// Optional features enabled when the adapter has them; nothing requires them (kernels have a
/// fallback), they are reported by `gpu::info()` and may be used by specialised kernels.
const OPTIONAL_FEATURES: [(wgpu::Features, &str); 3] = [
    (wgpu::Features::SUBGROUP, "subgroup"),
    (wgpu::Features::SHADER_F16, "shader-f16"),
    (wgpu::Features::TIMESTAMP_QUERY, "timestamp-query"),
];

/// The device, its queue and what was learnt about the adapter when it was opened.
pub(crate) struct Context {
    /// the logical device
    pub device: wgpu::Device,
    /// its queue (all work is submitted here, in order)
    pub queue: wgpu::Queue,
    /// adapter name, backend, driver
    pub adapter_info: wgpu::AdapterInfo,
    /// the limits the device was created with
    pub limits: wgpu::Limits,
    /// the optional features found and enabled
    pub features: wgpu::Features,
    /// names of the optional features found
    pub feature_names: Vec<String>,
    /// the first wgpu error not caught by an error scope, waiting to be reported
    errors: Arc<Mutex<Option<String>>>,
}

impl Context {
    /// Returns (and clears) the first wgpu error recorded since the last call.
    pub(crate) fn take_error(&self) -> Result<()> {
        let mut slot = self.errors.lock().unwrap_or_else(|p| p.into_inner());
        match slot.take() {
            Some(msg) => Err(Error::Gpu(msg)),
            None => Ok(()),
        }
    }
}

/// The names of the wgpu backends in a set, for messages.
fn backend_names(b: wgpu::Backends) -> String {
    let all = [
        (wgpu::Backends::VULKAN, "vulkan"),
        (wgpu::Backends::METAL, "metal"),
        (wgpu::Backends::DX12, "dx12"),
        (wgpu::Backends::GL, "gl"),
        (wgpu::Backends::BROWSER_WEBGPU, "webgpu"),
    ];
    let names: Vec<&str> = all
        .iter()
        .filter(|(f, _)| b.contains(*f))
        .map(|&(_, n)| n)
        .collect();
    if names.is_empty() {
        "none".into()
    } else {
        names.join(", ")
    }
}

/// The limits the kernels need: WebGPU's downlevel defaults, with the ones that bound problem
/// sizes and kernel shapes raised to whatever the adapter offers.
fn required_limits(adapter: &wgpu::Limits) -> wgpu::Limits {
    let mut l = wgpu::Limits::downlevel_defaults();
    l.max_storage_buffers_per_shader_stage = adapter.max_storage_buffers_per_shader_stage;
    l.max_buffers_and_acceleration_structures_per_shader_stage =
        adapter.max_buffers_and_acceleration_structures_per_shader_stage;
    l.max_storage_buffer_binding_size = adapter.max_storage_buffer_binding_size;
    l.max_buffer_size = adapter.max_buffer_size;
    l.max_uniform_buffer_binding_size = adapter.max_uniform_buffer_binding_size;
    l.max_dynamic_uniform_buffers_per_pipeline_layout =
        adapter.max_dynamic_uniform_buffers_per_pipeline_layout;
    l.max_compute_workgroup_storage_size = adapter.max_compute_workgroup_storage_size;
    l.max_compute_invocations_per_workgroup = adapter.max_compute_invocations_per_workgroup;
    l.max_compute_workgroup_size_x = adapter.max_compute_workgroup_size_x;
    l.max_compute_workgroup_size_y = adapter.max_compute_workgroup_size_y;
    l.max_compute_workgroup_size_z = adapter.max_compute_workgroup_size_z;
    l.max_compute_workgroups_per_dimension = adapter.max_compute_workgroups_per_dimension;
    l.min_uniform_buffer_offset_alignment = adapter.min_uniform_buffer_offset_alignment;
    l.min_storage_buffer_offset_alignment = adapter.min_storage_buffer_offset_alignment;
    l
}

/// Opens the first adapter wgpu offers (high-performance preferred) and creates the device.
/// Never panics: a panic inside the driver stack is caught and returned as an error.
pub(crate) fn open() -> Result<Context> {
    match std::panic::catch_unwind(open_inner) {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            Err(Error::Device(format!("opening the GPU panicked: {msg}")))
        }
    }
}

fn open_inner() -> Result<Context> {
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle_from_env();
    if std::env::var_os("WGPU_BACKEND").is_none() {
        // Vulkan, Metal and DX12 only, unless WGPU_BACKEND names another: wgpu's GL backend
        // serialises every call through one context lock that panics when threads contend for
        // it (seen with Mesa's llvmpipe under the parallel test runner), and GL compute is a
        // compatibility path moegrad does not target.
        desc.backends = wgpu::Backends::PRIMARY;
    }
    let tried = desc.backends & wgpu::Instance::enabled_backend_features();
    if tried.is_empty() {
        return Err(Error::Device(format!(
            "no GPU adapter: no usable wgpu backend (WGPU_BACKEND selects {}, this build has {})",
            backend_names(desc.backends),
            backend_names(wgpu::Instance::enabled_backend_features())
        )));
    }
    let instance = wgpu::Instance::new(desc);
    let options = wgpu::RequestAdapterOptions {
        power_preference: wgpu::PowerPreference::from_env()
            .unwrap_or(wgpu::PowerPreference::HighPerformance),
        ..Default::default()
    };
    let adapter = pollster::block_on(instance.request_adapter(&options)).map_err(|e| {
        Error::Device(format!(
            "no GPU adapter found (backends tried: {}): {e}",
            backend_names(tried)
        ))
    })?;
    let adapter_info = adapter.get_info();
    let limits = required_limits(&adapter.limits());
    let mut features = wgpu::Features::empty();
    let mut feature_names = Vec::new();
    for (f, name) in OPTIONAL_FEATURES {
        if adapter.features().contains(f) {
            features |= f;
            feature_names.push(name.to_string());
        }
    }
    let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
        label: Some("moegrad"),
        required_features: features,
        required_limits: limits.clone(),
        ..Default::default()
    }))
    .map_err(|e| {
        Error::Device(format!(
            "GPU adapter \"{}\" ({:?}) refused a device: {e}",
            adapter_info.name, adapter_info.backend
        ))
    })?;
    let errors: Arc<Mutex<Option<String>>> = Arc::new(Mutex::new(None));
    let sink = errors.clone();
    device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
        let mut slot = sink.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            *slot = Some(e.to_string());
        }
    }));
    Ok(Context {
        device,
        queue,
        adapter_info,
        limits,
        features,
        feature_names,
        errors,
    })
}
