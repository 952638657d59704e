//! Every built-in WGSL kernel through the shader compiler of every backend moegrad promises
//! (Metal, DX12, Vulkan), and against WebGPU's default limits, without a GPU.
//!
//! CI runs the kernels only on Vulkan (Mesa's lavapipe). On Metal and DX12 wgpu translates the
//! same WGSL with naga's MSL and HLSL writers, so a construct either writer rejects, or a
//! pipeline that needs more than an adapter offers, would otherwise be found only by a user on
//! that platform. Here each pipeline the crate can create, every shader × compute entry point ×
//! set of override constants its launchers pass (`backend::gpu::builtin_shaders`: the
//! `Shader` statics the launchers compile, attention's constants from the function its launcher
//! calls), goes through what wgpu does before the driver: `process_overrides` for that entry
//! point, then the MSL writer (what wgpu's Metal backend hands to the Metal compiler), the HLSL
//! writer (what its DX12 backend hands to FXC or DXC) and the SPIR-V writer, whose output `spirv-val` checks (Debian's `spirv-tools`, installed by
//! `.ci/run`; without it the SPIR-V check says "skipping", or fails under
//! `MOEGRAD_REQUIRE_GPU=1`). The writers are given the bindings wgpu's backends would assign for
//! the crate's bind group layout (uniform parameter block at binding 0, storage buffers after).
//!
//! What this does not check: that the Metal or DX12 driver compiles the text (no such driver is
//! here), nor anything about results on those backends (docs/gpu.md).

use crate::backend::gpu::{ADAM_MULTI_SLOTS, BuiltinShader, NORM_SLOTS, builtin_shaders};
use naga::back::{hlsl, msl, spv};
use naga::valid::{Capabilities, ModuleInfo, ShaderStages, SubgroupOperationSet, Validator};
use naga::{AddressSpace, Module, ResourceBinding, ShaderStage};
use rayon::prelude::*;
use std::collections::BTreeMap;
use std::io::Write;
use std::process::{Command, Stdio};

/// Shading-language versions of the oldest platforms wgpu takes the crate's kernels to: MSL 2.0
/// (macOS 10.13, wgpu's Metal floor; wgpu 30 offers subgroups on Metal from macOS 10.15, MSL
/// 2.2), HLSL shader model 5.1 (FXC, what wgpu uses on DX12 without dxcompiler.dll; subgroups
/// need wave intrinsics, 6.0 with DXC) and SPIR-V 1.0 (Vulkan 1.0; subgroups need SPIR-V 1.3,
/// Vulkan 1.1).
struct Targets {
    msl: (u8, u8),
    hlsl: hlsl::ShaderModel,
    spirv: (u8, u8),
    spirv_val_env: &'static str,
}

fn targets(shader: &BuiltinShader) -> Targets {
    if shader.needs_f16 {
        // 16-bit types: MSL 2.1's `half`, HLSL's native 16-bit types from SM 6.2, SPIR-V's
        // 16-bit storage (core in 1.3)
        Targets {
            msl: (2, 1),
            hlsl: hlsl::ShaderModel::V6_2,
            spirv: (1, 3),
            spirv_val_env: "vulkan1.1",
        }
    } else if shader.needs_subgroups {
        Targets {
            msl: (2, 2),
            hlsl: hlsl::ShaderModel::V6_0,
            spirv: (1, 3),
            spirv_val_env: "vulkan1.1",
        }
    } else {
        Targets {
            msl: (2, 0),
            hlsl: hlsl::ShaderModel::V5_1,
            spirv: (1, 0),
            spirv_val_env: "vulkan1.0",
        }
    }
}

/// Metal's buffer argument table per stage (Apple's Metal feature set tables): every uniform
/// and storage buffer of an entry point, plus the buffer of array sizes wgpu adds, takes a slot.
const METAL_BUFFER_SLOTS: usize = 31;

/// The module parsed and validated as wgpu validates it on an adapter with the features the
/// shader needs, and no others.
fn validated(shader: &BuiltinShader) -> (Module, ModuleInfo) {
    let module = naga::front::wgsl::parse_str(shader.source)
        .unwrap_or_else(|e| panic!("{}.wgsl: {}", shader.name, e.emit_to_string(shader.source)));
    let mut validator = if shader.needs_subgroups {
        let mut v = Validator::new(
            naga::valid::ValidationFlags::all(),
            Capabilities::SUBGROUP | Capabilities::SUBGROUP_BARRIER,
        );
        v.subgroup_stages(ShaderStages::COMPUTE)
            .subgroup_operations(SubgroupOperationSet::all());
        v
    } else if shader.needs_f16 {
        Validator::new(
            naga::valid::ValidationFlags::all(),
            Capabilities::SHADER_FLOAT16,
        )
    } else {
        Validator::new(naga::valid::ValidationFlags::all(), Capabilities::empty())
    };
    let info = validator
        .validate(&module)
        .unwrap_or_else(|e| panic!("{}.wgsl: {}", shader.name, e.emit_to_string(shader.source)));
    (module, info)
}

/// One pipeline the crate can create.
pub(super) struct Pipeline<'a> {
    pub(super) shader: &'a BuiltinShader,
    module: &'a Module,
    info: &'a ModuleInfo,
    pub(super) entry: String,
    constants: &'a [(&'static str, f64)],
}

impl Pipeline<'_> {
    /// `shader.entry` and its override constants, for messages.
    pub(super) fn name(&self) -> String {
        let mut s = format!("{}.{}", self.shader.name, self.entry);
        if !self.constants.is_empty() {
            let c: Vec<String> = self
                .constants
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            s.push_str(&format!(" [{}]", c.join(", ")));
        }
        s
    }

    /// The module as wgpu hands it to a backend's writer: the overrides applied for this entry
    /// point, everything it does not reach removed.
    pub(super) fn specialised(&self) -> Result<(Module, ModuleInfo), String> {
        let mut constants = naga::back::PipelineConstants::default();
        for &(k, v) in self.constants {
            constants.insert(k.to_string(), v);
        }
        naga::back::pipeline_constants::process_overrides(
            self.module,
            self.info,
            Some((ShaderStage::Compute, &self.entry)),
            &constants,
        )
        .map(|(m, i)| (m.into_owned(), i.into_owned()))
        .map_err(|e| format!("overrides: {e:?}"))
    }
}

/// Every pipeline: each shader's compute entry points, each with every set of override
/// constants its launchers pass, or with none (the shader's defaults) where none is listed.
pub(super) fn pipelines<'a>(
    modules: &'a [(BuiltinShader, Module, ModuleInfo)],
) -> Vec<Pipeline<'a>> {
    let mut out = Vec::new();
    for (shader, module, info) in modules {
        for (entry, _) in &shader.specialisations {
            assert!(
                module.entry_points.iter().any(|ep| ep.name == *entry),
                "{}.{entry}: specialised, but the shader has no such entry point",
                shader.name
            );
        }
        for ep in &module.entry_points {
            assert_eq!(
                ep.stage,
                ShaderStage::Compute,
                "{}.{}",
                shader.name,
                ep.name
            );
            let pipeline = |constants| Pipeline {
                shader,
                module,
                info,
                entry: ep.name.clone(),
                constants,
            };
            let specialised: Vec<&[(&str, f64)]> = shader
                .specialisations
                .iter()
                .filter(|(entry, _)| *entry == ep.name)
                .map(|(_, c)| c.as_slice())
                .collect();
            if specialised.is_empty() {
                out.push(pipeline(&[]));
            }
            out.extend(specialised.into_iter().map(pipeline));
        }
    }
    out
}

pub(super) fn modules() -> Vec<(BuiltinShader, Module, ModuleInfo)> {
    builtin_shaders()
        .into_iter()
        .map(|s| {
            let (m, i) = validated(&s);
            (s, m, i)
        })
        .collect()
}

/// What an entry point binds and uses, read from the specialised module.
#[derive(Debug, Default)]
struct Resources {
    /// (binding, read-only) of each storage buffer, in binding order
    storage: Vec<(u32, bool)>,
    /// bindings of uniform buffers, and the largest one's size in bytes
    uniform: Vec<u32>,
    uniform_bytes: u64,
    /// the largest binding number and group
    max_binding: u32,
    max_group: u32,
    /// bytes of `var<workgroup>` memory
    workgroup_bytes: u64,
    workgroup_size: [u32; 3],
}

fn resources(module: &Module, info: &ModuleInfo, entry: &str) -> Resources {
    let index = module
        .entry_points
        .iter()
        .position(|ep| ep.name == entry)
        .expect("the specialised module keeps its entry point");
    let uses = info.get_entry_point(index);
    let mut layouter = naga::proc::Layouter::default();
    layouter
        .update(module.to_ctx())
        .expect("a validated module has a layout");
    let mut r = Resources {
        workgroup_size: module.entry_points[index].workgroup_size,
        ..Resources::default()
    };
    for (handle, var) in module.global_variables.iter() {
        if uses[handle].is_empty() {
            continue;
        }
        let bytes = u64::from(layouter[var.ty].size);
        match (var.space, &var.binding) {
            (AddressSpace::WorkGroup, _) => r.workgroup_bytes += bytes,
            (AddressSpace::Storage { access }, Some(b)) => {
                r.storage
                    .push((b.binding, !access.contains(naga::StorageAccess::STORE)));
            }
            (AddressSpace::Uniform, Some(b)) => {
                r.uniform.push(b.binding);
                r.uniform_bytes = r.uniform_bytes.max(bytes);
            }
            _ => {}
        }
        if let Some(b) = &var.binding {
            r.max_binding = r.max_binding.max(b.binding);
            r.max_group = r.max_group.max(b.group);
        }
    }
    r.storage.sort();
    r
}

/// The MSL buffer slots wgpu's Metal backend gives the crate's bind group layout: one per
/// binding in order, then the sizes buffer. Returns the map and the slots used.
fn msl_resources(r: &Resources) -> (msl::EntryPointResources, usize) {
    let mut bindings: Vec<(u32, bool)> = r.uniform.iter().map(|&b| (b, true)).collect();
    bindings.extend(&r.storage);
    bindings.sort();
    let mut res = msl::EntryPointResources::default();
    for (slot, &(binding, read_only)) in bindings.iter().enumerate() {
        res.resources.insert(
            ResourceBinding { group: 0, binding },
            msl::BindTarget {
                buffer: Some(slot as u8),
                mutable: !read_only,
                ..Default::default()
            },
        );
    }
    let mut used = bindings.len();
    if !r.storage.is_empty() {
        res.sizes_buffer = Some(used as u8);
        used += 1;
    }
    (res, used)
}

/// The MSL wgpu's Metal backend would hand to the Metal compiler for this pipeline, written for
/// MSL `version`.
fn write_msl(
    p: &Pipeline,
    (m, i): (&Module, &ModuleInfo),
    r: &Resources,
    version: (u8, u8),
) -> Result<String, String> {
    let (resources, slots) = msl_resources(r);
    if slots > METAL_BUFFER_SLOTS {
        return Err(format!(
            "Metal: {slots} buffer slots (with wgpu's sizes buffer), Metal has \
             {METAL_BUFFER_SLOTS}: the pipeline cannot be created there"
        ));
    }
    let options = msl::Options {
        lang_version: version,
        fake_missing_bindings: false,
        per_entry_point_map: BTreeMap::from([(p.entry.clone(), resources)]),
        bounds_check_policies: bounds_checks(),
        ..Default::default()
    };
    let pipeline = msl::PipelineOptions {
        entry_point: Some((ShaderStage::Compute, p.entry.clone())),
        allow_and_force_point_size: false,
        vertex_pulling_transform: false,
        vertex_buffer_mappings: Vec::new(),
        binding_array_length_map: Default::default(),
    };
    msl::write_string(m, i, &options, &pipeline)
        .map(|(text, _)| text)
        .map_err(|e| format!("MSL {:?}: {e}", options.lang_version))
}

/// HLSL registers as wgpu's DX12 backend assigns them: the uniform a CBV (b), read-only storage
/// SRVs (t), read-write storage UAVs (u), then the root constants for `num_workgroups`.
fn write_hlsl(p: &Pipeline, m: &Module, i: &ModuleInfo, r: &Resources) -> Result<(), String> {
    let target = |register: u32| hlsl::BindTarget {
        space: 0,
        register,
        binding_array_size: None,
        dynamic_storage_buffer_offsets_index: None,
        restrict_indexing: true,
    };
    let mut binding_map = hlsl::BindingMap::default();
    for (cbv, &b) in r.uniform.iter().enumerate() {
        binding_map.insert(
            ResourceBinding {
                group: 0,
                binding: b,
            },
            target(cbv as u32),
        );
    }
    let (mut srv, mut uav) = (0, 0);
    for &(b, read_only) in &r.storage {
        let counter = if read_only { &mut srv } else { &mut uav };
        binding_map.insert(
            ResourceBinding {
                group: 0,
                binding: b,
            },
            target(*counter),
        );
        *counter += 1;
    }
    let options = hlsl::Options {
        shader_model: targets(p.shader).hlsl,
        binding_map,
        fake_missing_bindings: false,
        special_constants_binding: Some(target(r.uniform.len() as u32)),
        ..Default::default()
    };
    let pipeline = hlsl::PipelineOptions {
        entry_point: Some((ShaderStage::Compute, p.entry.clone())),
    };
    let mut text = String::new();
    let reflection = hlsl::Writer::new(&mut text, &options, &pipeline)
        .write(m, i, None)
        .map_err(|e| format!("HLSL {:?}: {e}", options.shader_model))?;
    match reflection.entry_point_names.as_slice() {
        [Ok(_)] => Ok(()),
        [Err(e)] => Err(format!("HLSL {:?}: {e}", options.shader_model)),
        other => Err(format!(
            "HLSL: {} entry points written, expected 1",
            other.len()
        )),
    }
}

/// SPIR-V as wgpu's Vulkan backend writes it (the capabilities wgpu grants the features the
/// shader needs, nothing more); `spirv-val` then checks it when `validator` is given.
fn write_spirv(
    p: &Pipeline,
    m: &Module,
    i: &ModuleInfo,
    validator: Option<&str>,
) -> Result<(), String> {
    use spv::Capability as C;
    let t = targets(p.shader);
    let mut capabilities = vec![C::Shader];
    if p.shader.needs_f16 {
        capabilities.extend([
            C::Float16,
            C::StorageBuffer16BitAccess,
            C::UniformAndStorageBuffer16BitAccess,
        ]);
    }
    if p.shader.needs_subgroups {
        capabilities.extend([
            C::GroupNonUniform,
            C::GroupNonUniformVote,
            C::GroupNonUniformArithmetic,
            C::GroupNonUniformBallot,
            C::GroupNonUniformShuffle,
            C::GroupNonUniformShuffleRelative,
            C::GroupNonUniformQuad,
        ]);
    }
    let options = spv::Options {
        lang_version: t.spirv,
        flags: spv::WriterFlags::empty(),
        // Vulkan keeps WGSL's numbers: descriptor set = group, binding = binding
        fake_missing_bindings: true,
        capabilities: Some(capabilities.into_iter().collect()),
        bounds_check_policies: bounds_checks(),
        ..Default::default()
    };
    let pipeline = spv::PipelineOptions {
        shader_stage: ShaderStage::Compute,
        entry_point: p.entry.clone(),
    };
    let words = spv::write_vec(m, i, &options, Some(&pipeline))
        .map_err(|e| format!("SPIR-V {:?}: {e}", t.spirv))?;
    let Some(validator) = validator else {
        return Ok(());
    };
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    let mut child = Command::new(validator)
        .args(["--target-env", t.spirv_val_env, "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("spirv-val: {e}"))?;
    child
        .stdin
        .take()
        .expect("piped stdin")
        .write_all(&bytes)
        .map_err(|e| format!("spirv-val: {e}"))?;
    let out = child
        .wait_with_output()
        .map_err(|e| format!("spirv-val: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "spirv-val --target-env {}: {}{}",
            t.spirv_val_env,
            String::from_utf8_lossy(&out.stdout).trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// `spirv-val` when it runs; `None` (after saying "skipping") when it is missing outside CI.
fn spirv_val() -> Option<&'static str> {
    let found = Command::new("spirv-val")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if found {
        return Some("spirv-val");
    }
    assert!(
        std::env::var("MOEGRAD_REQUIRE_GPU").as_deref() != Ok("1"),
        "MOEGRAD_REQUIRE_GPU=1 but spirv-val (Debian's spirv-tools, installed by .ci/run) is missing"
    );
    eprintln!("skipping the spirv-val check of the SPIR-V: spirv-val is not installed");
    None
}

/// Panics listing every failure, one line each, naming the pipeline.
fn report(what: &str, failures: Vec<String>, checked: usize) {
    assert!(
        failures.is_empty(),
        "{} of {checked} pipelines {what}:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Every pipeline translates with naga's MSL, HLSL and SPIR-V writers, and its SPIR-V passes
/// `spirv-val`.
#[test]
fn every_kernel_compiles_for_metal_dx12_and_vulkan() {
    let validator = spirv_val();
    let modules = modules();
    let pipelines = pipelines(&modules);
    let failures: Vec<String> = pipelines
        .par_iter()
        .flat_map_iter(|p| {
            let (m, i) = match p.specialised() {
                Ok(mi) => mi,
                Err(e) => return vec![format!("{}: {e}", p.name())],
            };
            let r = resources(&m, &i, &p.entry);
            [
                write_msl(p, (&m, &i), &r, targets(p.shader).msl).map(|_| ()),
                write_hlsl(p, &m, &i, &r),
                write_spirv(p, &m, &i, validator),
            ]
            .into_iter()
            .filter_map(|res| res.err().map(|e| format!("{}: {e}", p.name())))
            .collect()
        })
        .collect();
    let entries: usize = modules.iter().map(|(_, m, _)| m.entry_points.len()).sum();
    eprintln!(
        "{} pipelines ({} shaders, {entries} entry points, each with its specialisations) \
         through the MSL, HLSL and SPIR-V writers{}",
        pipelines.len(),
        modules.len(),
        if validator.is_some() {
            ", SPIR-V checked by spirv-val"
        } else {
            ""
        }
    );
    report(
        "do not compile for every backend",
        failures,
        pipelines.len(),
    );
}

/// Every pipeline's MSL, as wgpu writes it on macOS 10.14 and later (MSL 2.1 and up), declares
/// its workgroup size as the most threads per threadgroup. Metal sizes a pipeline's
/// `maxTotalThreadsPerThreadgroup` from its register use, and a dispatch of larger threadgroups
/// is silently not run (wgpu issue 9176): attention's kernels run 256 invocations with arrays
/// of up to 4 × 128 floats each. The attribute makes the Metal compiler fit the declared size.
#[test]
fn every_metal_kernel_declares_its_threadgroup_size() {
    let modules = modules();
    let pipelines = pipelines(&modules);
    let failures: Vec<String> = pipelines
        .par_iter()
        .filter_map(|p| {
            let (m, i) = match p.specialised() {
                Ok(mi) => mi,
                Err(e) => return Some(format!("{}: {e}", p.name())),
            };
            let r = resources(&m, &i, &p.entry);
            let version = targets(p.shader).msl.max((2, 1));
            let [x, y, z] = r.workgroup_size;
            let attribute = format!("[[max_total_threads_per_threadgroup({})]]", x * y * z);
            match write_msl(p, (&m, &i), &r, version) {
                Ok(text) if text.contains(&attribute) => None,
                Ok(_) => Some(format!("{}: the MSL has no {attribute}", p.name())),
                Err(e) => Some(format!("{}: {e}", p.name())),
            }
        })
        .collect();
    report(
        "do not declare their threadgroup size to Metal",
        failures,
        pipelines.len(),
    );
}

/// The entry points allowed above WebGPU's default storage buffers per stage, with the count
/// each binds, from the crate's constants. Each has a fallback the crate takes on an adapter
/// that binds fewer (`adam_multi_supported`, `grad_norm_supported` in
/// `src/backend/gpu/optim.rs`; docs/gpu.md).
fn above_default_storage_buffers() -> [(&'static str, &'static str, usize); 2] {
    [
        ("optim", "adam_multi", 3 + 2 * ADAM_MULTI_SLOTS),
        ("optim", "grad_sumsq", NORM_SLOTS + 1),
    ]
}

/// Every pipeline fits WebGPU's default limits (`wgpu::Limits::default()`): storage and uniform
/// buffers per stage, bindings, workgroup size and invocations, workgroup memory, the uniform
/// block's size; the entry points listed in [`above_default_storage_buffers`] alone may bind
/// more storage buffers, exactly as many as the crate's constants say.
#[test]
fn every_kernel_fits_webgpu_default_limits() {
    let l = wgpu::Limits::default();
    let modules = modules();
    let pipelines = pipelines(&modules);
    let mut failures = Vec::new();
    let mut exceptions_seen = Vec::new();
    // the largest need of any pipeline (outside the exceptions), with its name, for the log
    let (mut most_storage, mut most_workgroup_bytes, mut most_invocations) =
        ((0, String::new()), (0, String::new()), (0, String::new()));
    for p in &pipelines {
        let (m, i) = match p.specialised() {
            Ok(mi) => mi,
            Err(e) => {
                failures.push(format!("{}: {e}", p.name()));
                continue;
            }
        };
        let r = resources(&m, &i, &p.entry);
        let mut fail = |msg: String| failures.push(format!("{}: {msg}", p.name()));
        let allowed = above_default_storage_buffers()
            .into_iter()
            .find(|&(s, e, _)| s == p.shader.name && e == p.entry);
        let [x, y, z] = r.workgroup_size;
        for (most, value) in [
            (
                &mut most_storage,
                if allowed.is_none() {
                    r.storage.len() as u64
                } else {
                    0
                },
            ),
            (&mut most_workgroup_bytes, r.workgroup_bytes),
            (&mut most_invocations, u64::from(x * y * z)),
        ] {
            if value > most.0 {
                *most = (value, p.name());
            }
        }
        match allowed {
            Some((_, _, count)) => {
                exceptions_seen.push(p.name());
                if r.storage.len() != count {
                    fail(format!(
                        "binds {} storage buffers, the crate's constants say {count}",
                        r.storage.len()
                    ));
                }
            }
            None if r.storage.len() > l.max_storage_buffers_per_shader_stage as usize => {
                fail(format!(
                    "{} storage buffers per stage, WebGPU's default limit is {}",
                    r.storage.len(),
                    l.max_storage_buffers_per_shader_stage
                ))
            }
            None => {}
        }
        if r.uniform.len() > l.max_uniform_buffers_per_shader_stage as usize
            || r.uniform.len() > l.max_dynamic_uniform_buffers_per_pipeline_layout as usize
        {
            fail(format!("{} uniform buffers", r.uniform.len()));
        }
        if r.uniform_bytes > l.max_uniform_buffer_binding_size {
            fail(format!(
                "a uniform block of {} bytes, the limit is {}",
                r.uniform_bytes, l.max_uniform_buffer_binding_size
            ));
        }
        if r.max_group >= l.max_bind_groups || r.max_binding >= l.max_bindings_per_bind_group {
            fail(format!(
                "@group({}) @binding({}) exceeds the bind group limits",
                r.max_group, r.max_binding
            ));
        }
        if x > l.max_compute_workgroup_size_x
            || y > l.max_compute_workgroup_size_y
            || z > l.max_compute_workgroup_size_z
            || x * y * z > l.max_compute_invocations_per_workgroup
        {
            fail(format!(
                "workgroup size {x}×{y}×{z}, the limits are {}×{}×{} and {} invocations",
                l.max_compute_workgroup_size_x,
                l.max_compute_workgroup_size_y,
                l.max_compute_workgroup_size_z,
                l.max_compute_invocations_per_workgroup
            ));
        }
        if r.workgroup_bytes > u64::from(l.max_compute_workgroup_storage_size) {
            fail(format!(
                "{} bytes of workgroup memory, WebGPU's default limit is {}",
                r.workgroup_bytes, l.max_compute_workgroup_storage_size
            ));
        }
    }
    for (shader, entry, _) in above_default_storage_buffers() {
        assert!(
            exceptions_seen.contains(&format!("{shader}.{entry}")),
            "{shader}.{entry} is allowed above the default limits but is no pipeline"
        );
    }
    eprintln!(
        "{} pipelines; the most storage buffers outside {:?}: {} ({}); the most workgroup \
         memory: {} bytes ({}); the largest workgroup: {} invocations ({})",
        pipelines.len(),
        above_default_storage_buffers().map(|(s, e, n)| format!("{s}.{e} binds {n}")),
        most_storage.0,
        most_storage.1,
        most_workgroup_bytes.0,
        most_workgroup_bytes.1,
        most_invocations.0,
        most_invocations.1
    );
    report(
        "do not fit WebGPU's default limits",
        failures,
        pipelines.len(),
    );
}

/// Every file under `shaders/` is part of some shader the crate compiles, so none escapes the
/// tests above.
#[test]
fn every_shader_file_is_checked() {
    let shaders = builtin_shaders();
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/shaders");
    for entry in std::fs::read_dir(dir).expect("shaders/") {
        let path = entry.expect("a directory entry").path();
        if path.extension().is_none_or(|e| e != "wgsl") {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("a WGSL file");
        assert!(
            shaders.iter().any(|s| s.source.contains(text.as_str())),
            "{} is in no shader of backend::gpu::builtin_shaders",
            path.display()
        );
    }
}

/// The bounds checks wgpu asks of every backend's writer: indices and buffer accesses clamped
/// (`Restrict`), binding arrays unchecked (moegrad's kernels have none).
fn bounds_checks() -> naga::proc::BoundsCheckPolicies {
    let restrict = naga::proc::BoundsCheckPolicy::Restrict;
    naga::proc::BoundsCheckPolicies {
        index: restrict,
        buffer: restrict,
        image_load: restrict,
        binding_array: naga::proc::BoundsCheckPolicy::Unchecked,
    }
}
