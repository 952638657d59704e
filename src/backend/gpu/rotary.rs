//! Launcher of `shaders/rotary.wgsl`, the GPU end of `nn::Rotary`: [`rotary`], one invocation
//! per element of `[batch, seq, head_dim]`, forward or (with `RotaryDims::transpose`) the
//! backward rule. It checks dtypes and lengths (an [`Error`](crate::Error) naming them, never a panic or a
//! wgpu validation error) and encodes one kernel; nothing is read back. The tables are f32 in
//! both builds: f32 heads run `shaders/rotary.wgsl`, f16 heads (mixed precision) its f16 build
//! (`half::ROTARY_F16_SHADER`), which reads the f32 tables where they are.

use super::kernels::{Shader, grid_1d, u32_param};
use super::{GpuBackend, GpuBuffer};
use crate::backend::RotaryDims;
use crate::backend::checks::check_rotary_lengths;
use crate::{DType, Error, Result};

/// The kernel of `shaders/rotary.wgsl`.
pub(crate) static ROTARY_SHADER: Shader = Shader {
    name: "rotary",
    builtin: true,
    source: include_str!("../../../shaders/rotary.wgsl"),
};

/// `NnOps::rotary`: `y [batch, seq, head_dim]`.
///
/// # Errors
/// [`Error::DType`](crate::Error::DType) unless the tables are f32 and `x` is f32 or f16; [`Error::Shape`](crate::Error::Shape) for lengths that do not match
/// the sizes, an odd head width, more positions than the tables hold or a zero size; a GPU
/// error from the launch.
pub(crate) fn rotary(
    be: &GpuBackend,
    x: &GpuBuffer,
    cos: &GpuBuffer,
    sin: &GpuBuffer,
    d: RotaryDims,
) -> Result<GpuBuffer> {
    const WHAT: &str = "rotary";
    let shader = build(x, (cos, sin))?;
    let dtype = x.dtype();
    check_rotary_lengths(WHAT, x, (cos, sin), d)?;
    let n = x.len();
    let params = [
        u32_param(n, "rotary elements")?,
        u32_param(d.seq, "rotary positions")?,
        u32_param(d.head_dim, "rotary head width")?,
        u32::from(d.transpose),
    ];
    u32_param(cos.len(), "rotary table elements")?;
    let y = be.alloc(n, dtype)?;
    be.launch(
        shader,
        "rotary",
        &[x, cos, sin, &y],
        &params,
        grid_1d(n, 256)?,
    )?;
    Ok(y)
}

/// The build of `shaders/rotary.wgsl` for heads `x` and tables `(cos, sin)`: f32 heads the f32
/// build, f16 heads the f16 build; the tables are f32 in both.
fn build(x: &GpuBuffer, (cos, sin): (&GpuBuffer, &GpuBuffer)) -> Result<&'static Shader> {
    match (x.dtype(), cos.dtype(), sin.dtype()) {
        (DType::F32, DType::F32, DType::F32) => Ok(&ROTARY_SHADER),
        (DType::F16, DType::F32, DType::F32) => Ok(&super::half::ROTARY_F16_SHADER),
        (x, c, s) => Err(Error::DType(format!(
            "rotary: x is {x}, cos {c} and sin {s}; the GPU rotates f32 or f16 heads with f32 \
             tables"
        ))),
    }
}
