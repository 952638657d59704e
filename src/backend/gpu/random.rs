//! Launcher of `shaders/random.wgsl`: [`random_uniform`], bit-identical to the CPU's
//! [`crate::backend::uniform_hash`].

use super::elementwise::cast;
use super::kernels::{Shader, grid_1d, u32_param};
use super::{GpuBackend, GpuBuffer, f64_error};
use crate::{DType, Result};

/// The kernel of `shaders/random.wgsl`.
pub(crate) static RANDOM: Shader = Shader {
    name: "random",
    builtin: true,
    source: include_str!("../../../shaders/random.wgsl"),
};

/// `ElementwiseOps::random_uniform` (entry `random_uniform`): f32 values, cast when I32 is asked for
/// (as on the CPU, which casts its f32 values too).
pub(crate) fn random_uniform(
    be: &GpuBackend,
    len: usize,
    seed: u64,
    dtype: DType,
) -> Result<GpuBuffer> {
    if dtype == DType::F64 {
        return Err(f64_error("random_uniform"));
    }
    let n = u32_param(len, "random_uniform: length")?;
    let out = be.alloc(len, DType::F32)?;
    be.launch(
        &RANDOM,
        "random_uniform",
        &[&out],
        &[n, seed as u32, (seed >> 32) as u32],
        grid_1d(len, 256)?,
    )?;
    cast(be, &out, dtype)
}
