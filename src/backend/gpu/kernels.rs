//! The pipeline cache and the one launch helper every GPU op goes through.
//!
//! A kernel is a WGSL entry point in one of the files under `shaders/`, named by a [`Shader`]
//! (`name` + `source` from `include_str!`). [`GpuBackend::launch`] compiles it on first use (the
//! pipeline is cached under shader name + entry point + specialisation constants), binds its
//! buffers and records one dispatch into the pending batch (see `encoder.rs`).
//!
//! **Binding convention**, the same for every kernel: `@group(0) @binding(0)` is the parameter
//! block, a `var<uniform>` struct of `u32`/`i32`/`f32` fields (or `array<vec4<u32>, N>`) of at
//! most 256 bytes, filled from `params: &[u32]` word by word (floats passed as `f32::to_bits`);
//! bindings `1..` are `buffers[0..]` in order, each a storage buffer declared `read` or
//! `read_write` in the shader. The bind group layout of each entry point is derived from the
//! shader itself (with naga): a binding the entry point does not use is simply not bound, and
//! `buffers.len()` must equal the highest binding number the entry uses. A `read_write` buffer
//! may not also appear in another binding of the same launch (that is an error, not a wgpu
//! validation failure).
//!
//! Every kernel reports its grid size; [`grid_1d`] folds a 1-D launch of more than 65535
//! workgroups into x and y, and kernels recover the flat index as
//! `(wg.y · num_workgroups.x + wg.x) · WG + local_index`.

use super::encoder::{Dispatch, StorageBinding};
use super::invocation_order::{Roles, compiled_source, roles_now};
use super::{GpuBackend, GpuBuffer, Inner, ShaderChecks};
use crate::{DType, Error, Result};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use wgpu::naga;

/// A WGSL source file: its name (the cache key) and text (`include_str!("../../../shaders/x.wgsl")`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Shader {
    /// file name without extension, e.g. `"elementwise"`
    pub name: &'static str,
    /// the WGSL text
    pub source: &'static str,
    /// one of moegrad's own kernels, compiled with the process's [`ShaderChecks`]; a kernel
    /// a user writes (`crate::wgsl`) is `false` and always compiled with every check
    pub builtin: bool,
}

/// A built-in WGSL module as the launchers compile it, with each set of override constants they
/// pass: what `backend/tests/shader_backends.rs` translates for Metal, DX12 and Vulkan.
#[cfg(test)]
#[derive(Clone, Debug)]
pub struct BuiltinShader {
    /// the pipeline cache's name: the file name without `.wgsl` (`matmul_subgroup` is
    /// `matmul.wgsl` followed by `matmul_subgroup.wgsl`)
    pub name: &'static str,
    /// the WGSL text the launchers compile
    pub source: &'static str,
    /// whether it is compiled only on adapters with wgpu's SUBGROUP feature
    pub needs_subgroups: bool,
    /// whether it is compiled only on adapters with wgpu's SHADER_F16 feature
    pub needs_f16: bool,
    /// (entry point, override constants) for every specialised pipeline a launcher creates;
    /// an entry point not listed is compiled with none (the shader's defaults), as
    /// [`GpuBackend::launch`] does
    pub specialisations: Vec<(&'static str, Vec<(&'static str, f64)>)>,
}

/// Every shader the GPU backend compiles, with its specialisations (see [`BuiltinShader`]).
#[cfg(test)]
pub fn builtin_shaders() -> Vec<BuiltinShader> {
    use super::{
        attention, conv2d, cross_entropy, elementwise, half, layer_norm, layout, matmul, mse,
        optim, pool2d, random, reduce, rotary, router_sums, routing, sort, swiglu,
    };
    let plain = |s: &Shader| BuiltinShader {
        name: s.name,
        source: s.source,
        needs_subgroups: false,
        needs_f16: false,
        specialisations: Vec::new(),
    };
    let f16 = |s: &Shader| BuiltinShader {
        needs_f16: true,
        ..plain(s)
    };
    let attention_specialisations: Vec<_> = attention::TILED_ENTRIES
        .iter()
        .flat_map(|&entry| attention::specialisations().map(move |c| (entry, c.to_vec())))
        .collect();
    let attention = BuiltinShader {
        specialisations: attention_specialisations.clone(),
        ..plain(&attention::ATTENTION_SHADER)
    };
    vec![
        plain(&elementwise::ELEMENTWISE),
        plain(&reduce::REDUCE),
        plain(&layout::LAYOUT),
        plain(&sort::SORT),
        plain(&sort::SORT_WORDS),
        plain(&random::RANDOM),
        plain(&optim::OPTIM),
        attention,
        plain(&layer_norm::LAYER_NORM_SHADER),
        plain(&swiglu::SWIGLU_SHADER),
        plain(&rotary::ROTARY_SHADER),
        plain(&cross_entropy::CROSS_ENTROPY_SHADER),
        plain(&mse::MSE_SHADER),
        plain(&routing::ROUTING),
        plain(&router_sums::ROUTER_SUMS_SHADER),
        plain(&conv2d::CONV2D_SHADER),
        plain(&pool2d::POOL2D_SHADER),
        plain(&matmul::MATMUL_SHADER),
        plain(&matmul::MATMUL_WIDE_SHADER),
        plain(&matmul::MATMUL_WIDE4_SHADER),
        BuiltinShader {
            needs_subgroups: true,
            ..plain(&matmul::MATMUL_SUBGROUP_SHADER)
        },
        f16(&half::HALF_SHADER),
        f16(&half::MATMUL_F16_SHADER),
        f16(&half::MATMUL_WIDE_F16_SHADER),
        f16(&half::ELEMENTWISE_F16_SHADER),
        f16(&half::LAYOUT_F16_SHADER),
        f16(&half::LAYOUT_F16_ROWS_SHADER),
        f16(&half::REDUCE_F16_SHADER),
        f16(&half::LAYER_NORM_F16_SHADER),
        f16(&half::LAYER_NORM_F16_ROWS_SHADER),
        f16(&half::SWIGLU_F16_SHADER),
        f16(&half::ROTARY_F16_SHADER),
        f16(&half::MATMUL_F16_ROWS_SHADER),
        f16(&half::MATMUL_WIDE_F16_ROWS_SHADER),
        f16(&half::MATMUL_F16_TO_F32_SHADER),
        f16(&half::MATMUL_WIDE_F16_TO_F32_SHADER),
        f16(&half::MATMUL_F16_ELEMENTS_SHADER),
        f16(&half::MATMUL_WIDE_F16_ELEMENTS_SHADER),
        f16(&half::MATMUL_F16_OUTPUT_SHADER),
        f16(&half::MATMUL_WIDE_F16_OUTPUT_SHADER),
        f16(&half::CROSS_ENTROPY_F16_SHADER),
        f16(&half::CONV2D_F16_SHADER),
        f16(&half::CONV2D_F16_ROWS_SHADER),
        f16(&half::POOL2D_F16_SHADER),
        BuiltinShader {
            needs_f16: true,
            specialisations: attention_specialisations,
            ..plain(&half::ATTENTION_F16_SHADER)
        },
    ]
}

/// A parsed and compiled shader file.
struct Module {
    wgpu: wgpu::ShaderModule,
    naga: naga::Module,
    info: naga::valid::ModuleInfo,
}

/// A compiled entry point with the layout of its bind group.
pub(crate) struct Kernel {
    /// `shader.entry`, as the profile names it
    name: Arc<str>,
    pipeline: wgpu::ComputePipeline,
    layout: wgpu::BindGroupLayout,
    /// for binding `b + 1`: `Some(read_only)` when the entry point uses it
    bindings: Vec<Option<bool>>,
    /// bytes of the entry point's parameter block (its uniform struct at binding 0)
    params_size: u64,
}

/// A compiled module's key: shader name, run-time checks, and which invocation plays which role
/// (permuted in tests only, `invocation_order.rs`).
type ModuleKey = (&'static str, ShaderChecks, Roles);

/// Compiled modules by [`ModuleKey`] and pipelines by (shader, entry, specialisation, checks).
#[derive(Default)]
pub(crate) struct KernelCache {
    modules: Mutex<HashMap<ModuleKey, Arc<Module>>>,
    kernels: Mutex<HashMap<String, Arc<Kernel>>>,
}

/// Whether kernel `shader.entry` takes f16 buffers: those of `shaders/half.wgsl`, the f16 builds
/// of `matmul.wgsl` (the mixed ones for the entries mixed precision runs: `matmul_build.rs`),
/// `elementwise.wgsl`, `reduce.wgsl` and `layout.wgsl` (its copies and scatters, and the MoE
/// combine with f32 weights), of the norms, SwiGLU, rotary (f16 heads, f32 tables), attention, cross-entropy,
/// `conv2d.wgsl` (and its f32-weight build) and `pool2d.wgsl`, and `fill`, which writes 32-bit words (two f16 values each, see
/// `elementwise::full`). [`GpuBackend::launch`] refuses an f16 buffer to every other kernel, so
/// that an op without an f16 kernel is an error naming it, never f32 code reading half-words.
fn takes_f16(shader: &str, entry: &str) -> bool {
    matches!(
        (shader, entry),
        ("half", _)
            | ("matmul_f16" | "matmul_wide_f16", _)
            | ("elementwise_f16", _)
            | (
                "layout_f16",
                "copy_strided"
                    | "concat_part"
                    | "gather"
                    | "scatter_add_loop"
                    | "scatter_add_sorted"
                    | "scatter_add_wide"
                    | "scatter_add_columns"
                    | "weighted_scatter_loop"
                    | "weighted_scatter_sorted"
                    | "weighted_gather_slots"
                    | "weighted_scatter_backward"
            )
            | (
                "layout_f16_rows",
                "weighted_scatter_loop"
                    | "weighted_scatter_sorted"
                    | "weighted_gather_slots"
                    | "weighted_scatter_backward"
            )
            | ("reduce_f16", _)
            | ("layer_norm_f16" | "layer_norm_f16_rows", _)
            | ("swiglu_f16", _)
            | ("rotary_f16", _)
            | ("attention_f16", _)
            | ("conv2d_f16" | "conv2d_f16_rows" | "pool2d_f16", _)
            | ("matmul_f16_rows", "matmul" | "grouped_matmul")
            | ("matmul_f16_to_f32", "matmul" | "grouped_weight_grad")
            | ("matmul_f16_elements" | "matmul_f16_output", "matmul")
            | (
                "matmul_wide_f16_rows"
                    | "matmul_wide_f16_to_f32"
                    | "matmul_wide_f16_elements"
                    | "matmul_wide_f16_output",
                "matmul_wide"
            )
            | ("matmul_wide_f16_rows", "grouped_matmul_wide")
            | ("cross_entropy_f16", _)
            | ("elementwise", "fill")
    )
}

/// Bytes of buffers only the pending batch references from which a pool miss submits the batch
/// (see [`GpuBackend::alloc`]).
const FLUSH_FREEABLE: u64 = 32 << 20;

/// Workgroups for a 1-D launch of `n` invocations with `wg` per workgroup, folded into x and y
/// when more than 65535 workgroups are needed (the kernel then skips invocations `>= n`).
pub(crate) fn grid_1d(n: usize, wg: u32) -> Result<[u32; 3]> {
    const MAX: u64 = 65535;
    let groups = (n as u64).div_ceil(wg as u64);
    if groups <= MAX {
        return Ok([groups as u32, 1, 1]);
    }
    let y = groups.div_ceil(MAX);
    if y > MAX {
        return Err(Error::Invalid(format!(
            "a 1-D launch of {n} invocations needs more than 65535² workgroups"
        )));
    }
    Ok([groups.div_ceil(y) as u32, y as u32, 1])
}

/// The index of `n` as a kernel parameter, or an error when it does not fit in a u32.
pub(crate) fn u32_param(n: usize, what: &str) -> Result<u32> {
    u32::try_from(n).map_err(|_| {
        Error::Invalid(format!(
            "{what} = {n} is too large for the GPU kernels (at most {})",
            u32::MAX
        ))
    })
}

fn validation_error<E: std::fmt::Display>(shader: &Shader, e: E) -> Error {
    Error::Gpu(format!("shader {}.wgsl: {e}", shader.name))
}

impl KernelCache {
    fn module(
        &self,
        device: &wgpu::Device,
        shader: &Shader,
        checks: ShaderChecks,
    ) -> Result<Arc<Module>> {
        let key = (shader.name, checks, roles_now(shader));
        if let Some(m) = self
            .modules
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&key)
        {
            return Ok(m.clone());
        }
        let parsed = naga::front::wgsl::parse_str(shader.source).map_err(|e| {
            Error::Gpu(format!(
                "shader {}.wgsl does not parse:\n{}",
                shader.name,
                e.emit_to_string(shader.source)
            ))
        })?;
        let info = naga::valid::Validator::new(
            naga::valid::ValidationFlags::all(),
            naga::valid::Capabilities::all(),
        )
        .validate(&parsed)
        .map_err(|e| {
            Error::Gpu(format!(
                "shader {}.wgsl does not validate:\n{}",
                shader.name,
                e.emit_to_string(shader.source)
            ))
        })?;
        let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
        let descriptor = wgpu::ShaderModuleDescriptor {
            label: Some(shader.name),
            source: wgpu::ShaderSource::Wgsl(compiled_source(shader)?),
        };
        let module = match checks {
            ShaderChecks::Full => device.create_shader_module(descriptor),
            // SAFETY: `checks` is `Full` for every shader but moegrad's own (`Shader::builtin`,
            // see `GpuBackend::launch`). Those have no loop that does not end (the loop
            // counter's purpose), and with `NoLoopCounter` keep the bounds checks and division
            // guards; `Unchecked` is chosen by hand to measure what those cost, and vouches
            // that the built-in kernels index in range and never divide by zero, as their
            // tests on every adapter check.
            _ => unsafe {
                device.create_shader_module_trusted(descriptor, checks.runtime_checks())
            },
        };
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(validation_error(shader, e));
        }
        let m = Arc::new(Module {
            wgpu: module,
            naga: parsed,
            info,
        });
        self.modules
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, m.clone());
        Ok(m)
    }

    /// The (shader name, checks) of every module compiled so far (as written, not with its
    /// invocations permuted).
    #[cfg(test)]
    pub(crate) fn module_keys(&self) -> Vec<(&'static str, ShaderChecks)> {
        let modules = self.modules.lock().unwrap_or_else(|p| p.into_inner());
        modules
            .keys()
            .filter(|k| k.2 == Roles::AsRun)
            .map(|&(name, checks, _)| (name, checks))
            .collect()
    }

    /// How many modules were compiled with their invocations as `roles` says.
    #[cfg(test)]
    pub(crate) fn module_count(&self, roles: Roles) -> usize {
        let modules = self.modules.lock().unwrap_or_else(|p| p.into_inner());
        modules.keys().filter(|k| k.2 == roles).count()
    }

    /// The compiled pipeline of `entry` in `shader` with the given override constants and
    /// run-time checks.
    pub(crate) fn kernel(
        &self,
        device: &wgpu::Device,
        shader: &Shader,
        entry: &str,
        constants: &[(&str, f64)],
        checks: ShaderChecks,
    ) -> Result<Arc<Kernel>> {
        let mut key = format!("{}:{entry}:{}", shader.name, checks.name());
        let roles = roles_now(shader);
        if roles != Roles::AsRun {
            key.push_str(&format!(":{roles:?}"));
        }
        for (k, v) in constants {
            key.push_str(&format!(":{k}={v}"));
        }
        if let Some(k) = self
            .kernels
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&key)
        {
            return Ok(k.clone());
        }
        let module = self.module(device, shader, checks)?;
        let (bindings, params_size) = reflect_bindings(&module.naga, &module.info, shader, entry)?;

        let mut entries = vec![wgpu::BindGroupLayoutEntry {
            binding: 0,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty: wgpu::BufferBindingType::Uniform,
                has_dynamic_offset: true,
                min_binding_size: None,
            },
            count: None,
        }];
        for (i, b) in bindings.iter().enumerate() {
            if let Some(read_only) = *b {
                entries.push(wgpu::BindGroupLayoutEntry {
                    binding: i as u32 + 1,
                    visibility: wgpu::ShaderStages::COMPUTE,
                    ty: wgpu::BindingType::Buffer {
                        ty: wgpu::BufferBindingType::Storage { read_only },
                        has_dynamic_offset: false,
                        min_binding_size: None,
                    },
                    count: None,
                });
            }
        }
        let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
        let layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some(entry),
            entries: &entries,
        });
        let pipeline_layout = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: Some(entry),
            bind_group_layouts: &[Some(&layout)],
            immediate_size: 0,
        });
        let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(entry),
            layout: Some(&pipeline_layout),
            module: &module.wgpu,
            entry_point: Some(entry),
            compilation_options: wgpu::PipelineCompilationOptions {
                constants,
                zero_initialize_workgroup_memory: checks != ShaderChecks::Unchecked,
            },
            cache: None,
        });
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(validation_error(shader, format!("entry {entry}: {e}")));
        }
        let k = Arc::new(Kernel {
            name: format!("{}.{entry}", shader.name).into(),
            pipeline,
            layout,
            bindings,
            params_size,
        });
        self.kernels
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, k.clone());
        Ok(k)
    }
}

/// For each binding `1..=max` of group 0 used by `entry`: `Some(read_only)`, `None` if unused;
/// and the size in bytes of its parameter block (0 when it reads none).
fn reflect_bindings(
    module: &naga::Module,
    info: &naga::valid::ModuleInfo,
    shader: &Shader,
    entry: &str,
) -> Result<(Vec<Option<bool>>, u64)> {
    let (index, _) = module
        .entry_points
        .iter()
        .enumerate()
        .find(|(_, ep)| ep.name == entry && ep.stage == naga::ShaderStage::Compute)
        .ok_or_else(|| {
            Error::Gpu(format!(
                "shader {}.wgsl has no compute entry point {entry}",
                shader.name
            ))
        })?;
    let uses = info.get_entry_point(index);
    let mut out: Vec<Option<bool>> = Vec::new();
    let mut params_size = 0u64;
    for (handle, var) in module.global_variables.iter() {
        let Some(rb) = &var.binding else { continue };
        if uses[handle].is_empty() {
            continue;
        }
        if rb.group != 0 {
            return Err(Error::Gpu(format!(
                "shader {}.wgsl, entry {entry}: only @group(0) is used by moegrad kernels",
                shader.name
            )));
        }
        match (rb.binding, var.space) {
            (0, naga::AddressSpace::Uniform) => {
                params_size = module.types[var.ty]
                    .inner
                    .try_size(module.to_ctx())
                    .map(u64::from)
                    .ok_or_else(|| {
                        Error::Gpu(format!(
                            "shader {}.wgsl, entry {entry}: parameter block of unknown size",
                            shader.name
                        ))
                    })?;
            }
            (0, _) => {
                return Err(Error::Gpu(format!(
                    "shader {}.wgsl: @binding(0) must be the var<uniform> parameter block",
                    shader.name
                )));
            }
            (b, naga::AddressSpace::Storage { access }) => {
                let i = b as usize - 1;
                if out.len() <= i {
                    out.resize(i + 1, None);
                }
                out[i] = Some(!access.contains(naga::StorageAccess::STORE));
            }
            (b, _) => {
                return Err(Error::Gpu(format!(
                    "shader {}.wgsl: @binding({b}) must be a storage buffer",
                    shader.name
                )));
            }
        }
    }
    Ok((out, params_size))
}

impl GpuBackend {
    fn inner(&self) -> &Inner {
        &self.inner
    }

    /// Records one dispatch of `entry` in `shader` over `groups` workgroups: binding 0 gets
    /// `params` (copied into the batch's uniform arena), binding `i + 1` gets `buffers[i]`.
    /// Nothing runs until the batch is submitted; launches run in the order they were made.
    /// A launch with a zero-sized grid does nothing.
    pub(crate) fn launch(
        &self,
        shader: &Shader,
        entry: &str,
        buffers: &[&GpuBuffer],
        params: &[u32],
        groups: [u32; 3],
    ) -> Result<()> {
        self.launch_specialised(shader, entry, &[], buffers, params, groups)
    }

    /// [`GpuBackend::launch`] with WGSL `override` constants set (each distinct set of values is
    /// its own cached pipeline).
    pub(crate) fn launch_specialised(
        &self,
        shader: &Shader,
        entry: &str,
        constants: &[(&str, f64)],
        buffers: &[&GpuBuffer],
        params: &[u32],
        groups: [u32; 3],
    ) -> Result<()> {
        let inner = self.inner();
        let max = inner.ctx.limits.max_compute_workgroups_per_dimension;
        if let Some(&g) = groups.iter().find(|&&g| g > max) {
            return Err(Error::Invalid(format!(
                "{}.{entry}: {g} workgroups in one dimension exceed the device limit {max}",
                shader.name
            )));
        }
        if groups.contains(&0) {
            return Ok(());
        }
        if !takes_f16(shader.name, entry) && buffers.iter().any(|b| b.dtype() == DType::F16) {
            return Err(super::half::no_f16_kernel(&format!(
                "kernel {}.{entry}",
                shader.name
            )));
        }
        let checks = if shader.builtin {
            self.shader_checks()
        } else {
            ShaderChecks::Full
        };
        let kernel = inner
            .kernels
            .kernel(&inner.ctx.device, shader, entry, constants, checks)?;
        if buffers.len() != kernel.bindings.len() {
            return Err(Error::Invalid(format!(
                "{}.{entry} binds {} buffers, {} given",
                shader.name,
                kernel.bindings.len(),
                buffers.len()
            )));
        }
        let mut storage = Vec::with_capacity(buffers.len());
        for (i, (buf, b)) in buffers.iter().zip(&kernel.bindings).enumerate() {
            let Some(read_only) = *b else { continue };
            if !read_only {
                let aliased = buffers.iter().enumerate().any(|(j, o)| {
                    j != i && kernel.bindings[j].is_some() && Arc::ptr_eq(&o.buf, &buf.buf)
                });
                if aliased {
                    return Err(Error::Invalid(format!(
                        "{}.{entry}: the buffer written at binding {} is also bound elsewhere",
                        shader.name,
                        i + 1
                    )));
                }
            }
            storage.push(StorageBinding {
                binding: i as u32 + 1,
                buffer: &buf.buf,
                size: buf.byte_len().max(4),
            });
        }
        let dispatch = Dispatch {
            name: &kernel.name,
            pipeline: &kernel.pipeline,
            layout: &kernel.layout,
            storage: &storage,
            params,
            params_block: kernel.params_size,
            groups,
        };
        inner.batcher.record(&inner.ctx, dispatch)
    }

    /// A pooled device buffer of `len` elements of `dtype` (F32, I32, or F16 where the adapter
    /// has `shader-f16`), contents undefined.
    pub(crate) fn alloc(&self, len: usize, dtype: DType) -> Result<GpuBuffer> {
        if dtype == DType::F64 {
            return Err(Error::DType(
                "the GPU computes in f32; f64 tensors stay on the CPU".into(),
            ));
        }
        if dtype == DType::F16 {
            self.check_f16("an f16 tensor")?;
        }
        let inner = self.inner();
        let bytes = super::byte_len(len, dtype);
        let max = inner.ctx.limits.max_storage_buffer_binding_size;
        if bytes > max || len > u32::MAX as usize {
            return Err(Error::Invalid(format!(
                "a GPU buffer of {len} elements ({bytes} bytes) exceeds the device's \
                 max_storage_buffer_binding_size ({max} bytes)"
            )));
        }
        let (kind, bytes) = (super::buffer_pool::Kind::Storage, bytes.max(4));
        // Buffers the program frees go back to the pool only once the kernels that use them are
        // submitted. Before the driver creates a buffer, the pending batch is submitted when
        // that returns one of this size and the batch holds FLUSH_FREEABLE bytes or more of such
        // buffers: small steps keep one submission, large ones do not grow the pool by a batch.
        if !inner.pool.has_free(kind, bytes) {
            let (held, of_size) = inner.batcher.freeable((kind, inner.pool.class_of(bytes)));
            if of_size && held >= FLUSH_FREEABLE {
                inner.batcher.flush(&inner.ctx);
            }
        }
        let buf = inner.pool.take(kind, bytes)?;
        Ok(GpuBuffer { buf, dtype, len })
    }
}

/// Parses and validates a WGSL source with naga (no optional capabilities), panicking with the
/// compiler's message: what each shader's own test checks before anything else.
/// The `const NAME: u32 = Nu;` declarations of a WGSL source, by name: what the tests that
/// check a shader's named op codes against the Rust launcher's read.
#[cfg(test)]
pub(super) fn wgsl_u32_consts(source: &str) -> std::collections::BTreeMap<String, u32> {
    source
        .lines()
        .filter_map(|l| {
            let rest = l.trim().strip_prefix("const ")?;
            let (name, value) = rest.split_once(": u32 = ")?;
            let value = value.trim_end_matches(';').trim_end_matches('u');
            Some((name.to_string(), value.parse().ok()?))
        })
        .collect()
}

#[cfg(test)]
pub(crate) fn validated_module(src: &str) -> (naga::Module, naga::valid::ModuleInfo) {
    let module =
        naga::front::wgsl::parse_str(src).unwrap_or_else(|e| panic!("{}", e.emit_to_string(src)));
    let info = naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        naga::valid::Capabilities::empty(),
    )
    .validate(&module)
    .unwrap_or_else(|e| panic!("{}", e.emit_to_string(src)));
    (module, info)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_folds_beyond_65535_workgroups() {
        assert_eq!(grid_1d(0, 256).unwrap(), [0, 1, 1]);
        assert_eq!(grid_1d(1, 256).unwrap(), [1, 1, 1]);
        assert_eq!(grid_1d(65535 * 256, 256).unwrap(), [65535, 1, 1]);
        let [x, y, z] = grid_1d(65535 * 256 + 1, 256).unwrap();
        assert_eq!((y, z), (2, 1));
        assert!(x as u64 * y as u64 * 256 > 65535 * 256 && x <= 65535);
        assert!(grid_1d(usize::MAX / 2, 256).is_err());
    }

    /// Every shader file parses and validates, and each entry point's bindings follow the
    /// convention (uniform params at 0, storage buffers after).
    #[test]
    fn shaders_validate_and_follow_the_binding_convention() {
        use super::super::{
            attention, conv2d, cross_entropy, elementwise, layer_norm, layout, mse, optim, pool2d,
            random, reduce, rotary, router_sums, routing, sort, swiglu,
        };
        let files = [
            (&*elementwise::ELEMENTWISE, 5usize),
            (&reduce::REDUCE, 7),
            (&layout::LAYOUT, 11),
            (&sort::SORT, 2),
            (&sort::SORT_WORDS, 2),
            (&random::RANDOM, 1),
            (&optim::OPTIM, 10),
            (&attention::ATTENTION_SHADER, 5),
            (&layer_norm::LAYER_NORM_SHADER, 3),
            (&swiglu::SWIGLU_SHADER, 2),
            (&rotary::ROTARY_SHADER, 1),
            (&cross_entropy::CROSS_ENTROPY_SHADER, 2),
            (&mse::MSE_SHADER, 3),
            (&routing::ROUTING, 11),
            (&router_sums::ROUTER_SUMS_SHADER, 2),
            (&conv2d::CONV2D_SHADER, 3),
            (&pool2d::POOL2D_SHADER, 4),
        ];
        for (shader, entries) in files {
            let (module, info) = validated_module(shader.source);
            assert_eq!(module.entry_points.len(), entries, "{}", shader.name);
            assert!(
                shader.source.starts_with("//"),
                "{} starts with its header comment",
                shader.name
            );
            for ep in &module.entry_points {
                reflect_bindings(&module, &info, shader, &ep.name)
                    .unwrap_or_else(|e| panic!("{}.{}: {e}", shader.name, ep.name));
            }
        }
    }
}
