//! Launcher of `shaders/rotary.wgsl`, the GPU end of `nn::Rotary`: [`rotary`], one invocation
//! per element of `[batch, seq, head_dim]`, forward or (with `RotaryDims::transpose`) the
//! backward rule. It checks dtypes and lengths (an [`Error`](crate::Error) naming them, never a panic or a
//! wgpu validation error) and encodes one kernel; nothing is read back.

use super::kernels::{Shader, grid_1d, u32_param};
use super::{GpuBackend, GpuBuffer};
use crate::backend::RotaryDims;
use crate::backend::checks::check_rotary_lengths;
use crate::{DType, Result};

/// The kernel of `shaders/rotary.wgsl`.
pub(crate) static ROTARY_SHADER: Shader = Shader {
    name: "rotary",
    builtin: true,
    source: include_str!("../../../shaders/rotary.wgsl"),
};

/// `NnOps::rotary`: `y [batch, seq, head_dim]`.
///
/// # Errors
/// [`Error::DType`](crate::Error::DType) unless every buffer is f32; [`Error::Shape`](crate::Error::Shape) for lengths that do not match
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
    let dtype = super::half::float_operands(WHAT, &[("x", x), ("cos", cos), ("sin", sin)])?;
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
    let shader = match dtype {
        DType::F16 => &*super::half::ROTARY_F16_SHADER,
        _ => &ROTARY_SHADER,
    };
    be.launch(
        shader,
        "rotary",
        &[x, cos, sin, &y],
        &params,
        grid_1d(n, 256)?,
    )?;
    Ok(y)
}
