//! Half precision on the GPU: whether the adapter can store f16 ([`GpuBackend::check_f16`]),
//! the launchers of `shaders/half.wgsl` that convert between f32 and f16 buffers ([`to_f16`],
//! [`to_f32`]: the device end of `Tensor::to_dtype` to and from `DType::F16`), and the f16
//! build of `shaders/matmul.wgsl` ([`MATMUL_F16_SHADER`]).
//!
//! f16 is a storage format here: every f16 kernel computes in f32 and converts once on the way
//! in and once on the way out, with `f16_of` (`shaders/f16_convert.wgsl`), which rounds to a
//! neighbouring f16, gives ±inf past the largest finite one (65504) and keeps NaN. The shaders
//! start with `enable f16;`, so they are only compiled on adapters with wgpu's `SHADER_F16`;
//! elsewhere every f16 request is an error saying so.

use super::kernels::{Shader, grid_1d, u32_param};
use super::{GpuBackend, GpuBuffer};
use crate::{DType, Error, Result};
use std::sync::LazyLock;

/// WGSL's f16 extension and the shared conversion, the start of every f16 shader.
const F16_PRELUDE: &str = concat!(
    "enable f16;\n",
    include_str!("../../../shaders/f16_convert.wgsl")
);

/// The kernels of `shaders/half.wgsl` after [`F16_PRELUDE`].
pub(crate) static HALF_SHADER: LazyLock<Shader> = LazyLock::new(|| Shader {
    name: "half",
    source: String::leak(format!(
        "{F16_PRELUDE}\n{}",
        include_str!("../../../shaders/half.wgsl")
    )),
});

/// The line of `shaders/matmul.wgsl` that makes its `matmul` entry's operands f32, and the block
/// of f32 conversions after it, which the f16 build replaces.
const MATMUL_F32_ELEMENT: &str =
    "alias mm_elem = f32;\nfn mm_store_value(v: f32) -> mm_elem {\n    return v;\n}\n";

/// The same for f16 operands: reads widen to f32 in the loads (`f32(mm_a[i])`), the f32 sums
/// are converted once, when stored.
const MATMUL_F16_ELEMENT: &str =
    "alias mm_elem = f16;\nfn mm_store_value(v: f32) -> mm_elem {\n    return f16_of(v);\n}\n";

/// `shaders/matmul.wgsl` built with f16 operands and output for its `matmul` entry (the other
/// entries are unchanged and not launched from it), accumulating in f32 as the f32 build does.
pub(crate) static MATMUL_F16_SHADER: LazyLock<Shader> = LazyLock::new(|| {
    let f32_source = include_str!("../../../shaders/matmul.wgsl");
    Shader {
        name: "matmul_f16",
        source: String::leak(format!(
            "{F16_PRELUDE}\n{}",
            f32_source.replacen(MATMUL_F32_ELEMENT, MATMUL_F16_ELEMENT, 1)
        )),
    }
});

/// Invocations per workgroup of both kernels of `half.wgsl`.
const WG: u32 = 256;

impl GpuBackend {
    /// Whether the device was opened with wgpu's `SHADER_F16`, which f16 tensors need.
    pub(crate) fn has_f16(&self) -> bool {
        self.inner.ctx.features.contains(wgpu::Features::SHADER_F16)
    }

    /// An error naming the adapter unless it has `SHADER_F16`; `what` says what needed it.
    pub(crate) fn check_f16(&self, what: &str) -> Result<()> {
        if self.has_f16() {
            return Ok(());
        }
        Err(Error::DType(format!(
            "{what} needs half precision on the GPU, and this adapter ({}, {:?}) does not \
             offer wgpu's SHADER_F16 (`moegrad info` lists its features); keep it in f32",
            self.inner.ctx.adapter_info.name, self.inner.ctx.adapter_info.backend
        )))
    }
}

/// The error of an op given f16 operands that has no f16 kernel (yet): which op, and what to do.
pub(crate) fn no_f16_kernel(op: &str) -> Error {
    Error::DType(format!(
        "{op} has no f16 kernel: cast its f16 operands to f32 first (Tensor::to_dtype); f16 \
         kernels exist for the casts and matmul"
    ))
}

/// One launch of `entry` from `x` into a new buffer of `dtype`.
fn convert(be: &GpuBackend, x: &GpuBuffer, entry: &str, dtype: DType) -> Result<GpuBuffer> {
    be.check_f16("a cast between f32 and f16")?;
    let out = be.alloc(x.len(), dtype)?;
    let n = u32_param(x.len(), "cast: length")?;
    be.launch(&HALF_SHADER, entry, &[x, &out], &[n], grid_1d(x.len(), WG)?)?;
    Ok(out)
}

/// An f32 buffer converted to f16 (entry `f32_to_f16`).
pub(crate) fn to_f16(be: &GpuBackend, x: &GpuBuffer) -> Result<GpuBuffer> {
    convert(be, x, "f32_to_f16", DType::F16)
}

/// An f16 buffer converted to f32, exactly (entry `f16_to_f32`).
pub(crate) fn to_f32(be: &GpuBackend, x: &GpuBuffer) -> Result<GpuBuffer> {
    convert(be, x, "f16_to_f32", DType::F32)
}
