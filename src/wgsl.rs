//! Your own WGSL compute kernel on GPU tensors: [`WgslKernel`].
//!
//! moegrad's built-in GPU ops are WGSL entry points under `shaders/`, launched through the GPU
//! backend's one launcher (`backend/gpu/kernels.rs`). This module lets code outside the crate
//! use that same launcher, safely: the shader is parsed and validated (with naga, as wgpu does)
//! when the kernel is made, its bindings are checked against the convention below, and every
//! launch checks the tensors it is given. A shader that does not compile, an entry point that is
//! missing, a binding of the wrong kind, a CPU tensor or a count that does not match all come back
//! as an [`Error`], never as a panic or a lost device. Together with
//! [`crate::autograd::custom_op`] it gives a differentiable op a GPU kernel of its own
//! (`examples/custom_op.rs`, `docs/tutorial/02-new-op.md`).
//!
//! **Binding convention** (that of every moegrad kernel), all in `@group(0)`:
//! * `@binding(0)`: optional `var<uniform>` parameter block, filled word by word from the `params`
//!   given to [`WgslKernel::run`] (`u32`s; pass an `f32` as `f32::to_bits`), at most 256 bytes;
//! * `@binding(1)` to `@binding(n)`: the `n` input tensors, `var<storage, read>`;
//! * `@binding(n + 1)`: the output, `var<storage, read_write>`, a new tensor filled with zeros
//!   before the kernel runs.
//!
//! The entry point must use every one of these storage bindings. Reads and writes out of bounds
//! are clamped by wgpu's bounds checks, so a wrong index gives wrong values, not corrupt memory;
//! a kernel that never ends, though, can still make the driver reset the device.

use crate::backend::Storage;
use crate::backend::gpu::{GpuBackend, Shader};
use crate::{DType, Error, Result, Tensor};
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use wgpu::naga;

/// A validated WGSL compute entry point that reads `n` tensors and writes one.
///
/// # Example
/// Doubles a tensor on the GPU (the GPU part is skipped when there is no adapter):
/// ```
/// use moegrad::wgsl::WgslKernel;
/// use moegrad::{DType, Device, Tensor};
/// # fn main() -> moegrad::Result<()> {
/// let double = WgslKernel::new(
///     "double",
///     "@group(0) @binding(1) var<storage, read> x: array<f32>;
///      @group(0) @binding(2) var<storage, read_write> y: array<f32>;
///      @compute @workgroup_size(64)
///      fn main(@builtin(global_invocation_id) id: vec3<u32>) {
///          if id.x < arrayLength(&x) { y[id.x] = 2.0 * x[id.x]; }
///      }",
///     "main",
/// )?;
/// assert_eq!(double.inputs(), 1);
/// if let Ok(gpu) = Device::gpu() {
///     let x = Tensor::from_f32(vec![1.0, 2.0, 3.0], &[3], gpu)?;
///     let y = double.run(&[&x], &[3], DType::F32, &[], [1, 1, 1])?;
///     assert_eq!(y.to_vec_f32()?, vec![2.0, 4.0, 6.0]);
/// }
/// // a shader that does not compile is an error, not a panic
/// assert!(WgslKernel::new("bad", "fn main( {", "main").is_err());
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct WgslKernel {
    shader: Shader,
    entry: String,
    inputs: usize,
    workgroup_size: [u32; 3],
}

/// User shaders by (name, source): each distinct one is given a `'static` name and text once
/// (the GPU backend's pipeline cache keys on them and keeps them for the life of the process).
static USER_SHADERS: OnceLock<Mutex<HashMap<(String, String), Shader>>> = OnceLock::new();

impl WgslKernel {
    /// Parses and validates `source`, and checks that `entry` is a compute entry point that
    /// follows the binding convention of this module. Needs no GPU.
    ///
    /// # Errors
    /// [`Error::Gpu`] naming the shader, with naga's message and the offending line, when the
    /// source does not parse or validate, `entry` is not a compute entry point, or its bindings
    /// break the convention (the message says which binding and why).
    pub fn new(name: &str, source: &str, entry: &str) -> Result<WgslKernel> {
        let module = naga::front::wgsl::parse_str(source).map_err(|e| {
            Error::Gpu(format!(
                "WGSL kernel '{name}' does not parse:\n{}",
                e.emit_to_string(source)
            ))
        })?;
        let info = naga::valid::Validator::new(
            naga::valid::ValidationFlags::all(),
            naga::valid::Capabilities::all(),
        )
        .validate(&module)
        .map_err(|e| {
            Error::Gpu(format!(
                "WGSL kernel '{name}' does not validate:\n{}",
                e.emit_to_string(source)
            ))
        })?;
        let (index, ep) = module
            .entry_points
            .iter()
            .enumerate()
            .find(|(_, ep)| ep.name == entry && ep.stage == naga::ShaderStage::Compute)
            .ok_or_else(|| {
                Error::Gpu(format!(
                    "WGSL kernel '{name}' has no @compute entry point named {entry:?}"
                ))
            })?;
        let storage = storage_bindings(name, &module, &info, index)?;
        let inputs = check_convention(name, &storage)?;
        let shader = {
            let mut shaders = USER_SHADERS
                .get_or_init(Default::default)
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let count = shaders.len();
            *shaders
                .entry((name.to_string(), source.to_string()))
                .or_insert_with(|| Shader {
                    // unique, and unlike any built-in shader's name
                    name: Box::leak(format!("user{count}.{name}").into_boxed_str()),
                    source: Box::leak(source.to_string().into_boxed_str()),
                    // a user's kernel keeps every run-time check wgpu compiles in
                    builtin: false,
                })
        };
        Ok(WgslKernel {
            shader,
            entry: entry.to_string(),
            inputs,
            workgroup_size: ep.workgroup_size,
        })
    }

    /// How many input tensors the kernel reads (bindings `1..=n`).
    pub fn inputs(&self) -> usize {
        self.inputs
    }

    /// The entry point's `@workgroup_size` (x, y, z), to size the grid given to
    /// [`WgslKernel::run`].
    pub fn workgroup_size(&self) -> [u32; 3] {
        self.workgroup_size
    }

    /// Runs the kernel over `groups` workgroups on `inputs` (GPU tensors, in binding order) and
    /// returns the output: a new GPU tensor of `output_shape` and `output_dtype` (F32 or I32),
    /// zero before the kernel runs. `params` fill the uniform block at binding 0. The result is
    /// untracked; wrap the call in [`crate::autograd::custom_op`] to give it a gradient.
    ///
    /// # Errors
    /// [`Error::Invalid`] when the number of inputs is not [`WgslKernel::inputs`], or `groups`
    /// or `params` exceed the device's limits; [`Error::Device`] for a CPU input or when no GPU
    /// can be opened; [`Error::DType`] for an F64 output; [`Error::Gpu`] when wgpu rejects the
    /// shader or its pipeline.
    pub fn run(
        &self,
        inputs: &[&Tensor],
        output_shape: &[usize],
        output_dtype: DType,
        params: &[u32],
        groups: [u32; 3],
    ) -> Result<Tensor> {
        let name = self.shader.name;
        if inputs.len() != self.inputs {
            return Err(Error::Invalid(format!(
                "WGSL kernel '{name}' reads {} input(s), {} given",
                self.inputs,
                inputs.len()
            )));
        }
        if output_dtype == DType::F64 {
            return Err(Error::DType(format!(
                "WGSL kernel '{name}': the GPU computes in f32 and i32, not f64"
            )));
        }
        let len = output_shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .ok_or_else(|| {
                Error::Invalid(format!(
                    "WGSL kernel '{name}': an output of shape {output_shape:?} has more elements \
                     than can be counted"
                ))
            })?;
        let mut buffers = Vec::with_capacity(inputs.len() + 1);
        for (i, t) in inputs.iter().enumerate() {
            match t.storage() {
                Storage::Gpu(b) => buffers.push(b),
                Storage::Cpu(_) => {
                    return Err(Error::Device(format!(
                        "WGSL kernel '{name}': input {i} (shape {:?}) is on the CPU; move it with \
                         to_device(Device::gpu()?)",
                        t.shape()
                    )));
                }
            }
        }
        let gpu = GpuBackend::get()?;
        let output = Storage::full(len, 0.0, output_dtype, true)?;
        let Storage::Gpu(out) = &output else {
            return Err(Error::Device(format!(
                "WGSL kernel '{name}': the output was not made on the GPU"
            )));
        };
        buffers.push(out);
        gpu.launch(&self.shader, &self.entry, &buffers, params, groups)?;
        Ok(Tensor::from_storage(output, output_shape.to_vec()))
    }
}

/// The storage bindings the entry point uses, as `(binding, writable)`, after checking that the
/// only other binding is the uniform block at 0 and that all are in group 0.
fn storage_bindings(
    name: &str,
    module: &naga::Module,
    info: &naga::valid::ModuleInfo,
    entry_index: usize,
) -> Result<Vec<(u32, bool)>> {
    let uses = info.get_entry_point(entry_index);
    let mut storage = Vec::new();
    for (handle, var) in module.global_variables.iter() {
        let Some(rb) = &var.binding else { continue };
        if uses[handle].is_empty() {
            continue;
        }
        let at = format!(
            "WGSL kernel '{name}', @group({}) @binding({})",
            rb.group, rb.binding
        );
        if rb.group != 0 {
            return Err(Error::Gpu(format!("{at}: only @group(0) is bound")));
        }
        match (rb.binding, var.space) {
            (0, naga::AddressSpace::Uniform) => {}
            (0, _) => {
                return Err(Error::Gpu(format!(
                    "{at}: binding 0 is the var<uniform> parameter block"
                )));
            }
            (b, naga::AddressSpace::Storage { access }) => {
                storage.push((b, access.contains(naga::StorageAccess::STORE)));
            }
            (_, _) => {
                return Err(Error::Gpu(format!(
                    "{at}: bindings from 1 on must be var<storage> buffers"
                )));
            }
        }
    }
    storage.sort_unstable();
    Ok(storage)
}

/// Checks that the storage bindings are `1..=n+1`, the first `n` read-only and the last
/// writable; returns `n`.
fn check_convention(name: &str, storage: &[(u32, bool)]) -> Result<usize> {
    let Some(&(last, last_writable)) = storage.last() else {
        return Err(Error::Gpu(format!(
            "WGSL kernel '{name}' uses no storage buffer; it must write its output to the \
             var<storage, read_write> at the last binding"
        )));
    };
    for (i, &(b, writable)) in storage.iter().enumerate() {
        if b != i as u32 + 1 {
            return Err(Error::Gpu(format!(
                "WGSL kernel '{name}': the storage bindings used are {:?}; they must be 1, 2, ... \
                 with none skipped",
                storage.iter().map(|s| s.0).collect::<Vec<_>>()
            )));
        }
        if writable && b != last {
            return Err(Error::Gpu(format!(
                "WGSL kernel '{name}': @binding({b}) is an input and must be var<storage, read>"
            )));
        }
    }
    if !last_writable {
        return Err(Error::Gpu(format!(
            "WGSL kernel '{name}': the output @binding({last}) must be var<storage, read_write>"
        )));
    }
    Ok(storage.len() - 1)
}
