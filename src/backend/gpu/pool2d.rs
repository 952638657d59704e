//! Launchers of `shaders/pool2d.wgsl`, the GPU end of `Tensor::max_pool2d` /
//! `Tensor::avg_pool2d` and of their backward rules: [`pool2d_forward`] launches
//! `max_pool2d_forward` (values and argmax) or `avg_pool2d_forward`, one invocation per output;
//! [`pool2d_backward`] launches `max_pool2d_backward` or `avg_pool2d_backward`, one invocation
//! per input pixel gathering from the outputs whose windows cover it (no atomics).
//!
//! Each launcher checks the geometry, dtypes and buffer lengths (an [`Error`] naming them, never
//! a panic or a wgpu validation error); nothing is read back. f32 images run the f32 build, f16
//! ones its f16 build (`half::POOL2D_F16_SHADER`: f32 comparisons and sums, one rounding per
//! output); the output and the gradient have the input's dtype. (`pool.rs` beside this file is the
//! buffer pool, unrelated.)

use super::kernels::{Shader, grid_1d};
use super::{GpuBackend, GpuBuffer};
use crate::backend::{Pool2dDims, PoolKind};
use crate::{DType, Error, Result};

/// The kernels of `shaders/pool2d.wgsl`.
pub(crate) static POOL2D_SHADER: Shader = Shader {
    name: "pool2d",
    builtin: true,
    source: include_str!("../../../shaders/pool2d.wgsl"),
};

/// The build of `pool2d.wgsl` for images of `x`'s dtype (`name` names it): f32 or f16, else an
/// [`Error::DType`].
fn build(what: &str, name: &str, x: &GpuBuffer) -> Result<&'static Shader> {
    match x.dtype() {
        DType::F32 => Ok(&POOL2D_SHADER),
        DType::F16 => Ok(&super::half::POOL2D_F16_SHADER),
        other => Err(Error::DType(format!(
            "{what}: {name} must be f32 or f16 on the GPU, got {other}"
        ))),
    }
}

/// Checks each operand `(name, buffer, dtype, expected length)`.
fn check(what: &str, d: &Pool2dDims, operands: &[(&str, &GpuBuffer, DType, usize)]) -> Result<()> {
    for (name, b, dtype, _) in operands {
        if b.dtype() != *dtype {
            return Err(Error::DType(format!(
                "{what}: {name} must be {dtype} on the GPU, got {}",
                b.dtype()
            )));
        }
    }
    let lengths: Vec<_> = operands.iter().map(|&(n, b, _, e)| (n, b, e)).collect();
    crate::backend::checks::check_lengths(what, &lengths, d)
}

/// The checked `(input, output)` lengths of `d` on the GPU: at least 1, at most `u32::MAX`.
fn lengths(what: &str, d: &Pool2dDims) -> Result<(usize, usize)> {
    let (i, o) = d.check(what)?;
    if i == 0 || o == 0 || i > u32::MAX as usize || o > u32::MAX as usize {
        return Err(Error::Shape(format!(
            "{what}: {d:?} must hold between 1 and {} elements on the GPU",
            u32::MAX
        )));
    }
    Ok((i, o))
}

/// The parameter block (`PoolParams`) with `n` invocations.
fn params(d: &Pool2dDims, n: usize) -> [u32; 9] {
    [
        d.planes as u32,
        d.height as u32,
        d.width as u32,
        d.kernel as u32,
        d.stride as u32,
        d.padding as u32,
        d.out_h() as u32,
        d.out_w() as u32,
        n as u32,
    ]
}

/// `NnOps::pool2d_forward` (entries `max_pool2d_forward`, `avg_pool2d_forward`): `y` and, for
/// max pooling, `argmax`, both `[planes, OH, OW]`.
///
/// # Errors
/// [`Error::DType`] unless `x` is f32 or f16; [`Error::Shape`] for a bad geometry or length; a GPU error
/// from the launch.
pub(crate) fn pool2d_forward(
    be: &GpuBackend,
    kind: PoolKind,
    x: &GpuBuffer,
    d: Pool2dDims,
) -> Result<(GpuBuffer, Option<GpuBuffer>)> {
    const WHAT: &str = "pool2d_forward";
    let (il, ol) = lengths(WHAT, &d)?;
    let shader = build(WHAT, "x", x)?;
    check(WHAT, &d, &[("x", x, x.dtype(), il)])?;
    let y = be.alloc(ol, x.dtype())?;
    let grid = grid_1d(ol, 256)?;
    match kind {
        PoolKind::Max => {
            let arg = be.alloc(ol, DType::I32)?;
            be.launch(
                shader,
                "max_pool2d_forward",
                &[x, &y, &arg],
                &params(&d, ol),
                grid,
            )?;
            Ok((y, Some(arg)))
        }
        PoolKind::Avg => {
            be.launch(
                shader,
                "avg_pool2d_forward",
                &[x, &y],
                &params(&d, ol),
                grid,
            )?;
            Ok((y, None))
        }
    }
}

/// `NnOps::pool2d_backward` (entries `max_pool2d_backward`, `avg_pool2d_backward`):
/// `dx [planes, H, W]`.
///
/// # Errors
/// As [`pool2d_forward`], and [`Error::Invalid`] for max pooling without an `argmax`.
pub(crate) fn pool2d_backward(
    be: &GpuBackend,
    kind: PoolKind,
    dy: &GpuBuffer,
    argmax: Option<&GpuBuffer>,
    d: Pool2dDims,
) -> Result<GpuBuffer> {
    const WHAT: &str = "pool2d_backward";
    let (il, ol) = lengths(WHAT, &d)?;
    let shader = build(WHAT, "dy", dy)?;
    check(WHAT, &d, &[("dy", dy, dy.dtype(), ol)])?;
    let dx = be.alloc(il, dy.dtype())?;
    let grid = grid_1d(il, 256)?;
    match (kind, argmax) {
        (PoolKind::Max, None) => Err(crate::backend::checks::missing_argmax_error(WHAT)),
        (PoolKind::Max, Some(arg)) => {
            check(WHAT, &d, &[("argmax", arg, DType::I32, ol)])?;
            be.launch(
                shader,
                "max_pool2d_backward",
                &[dy, arg, &dx],
                &params(&d, il),
                grid,
            )?;
            Ok(dx)
        }
        (PoolKind::Avg, _) => {
            be.launch(
                shader,
                "avg_pool2d_backward",
                &[dy, &dx],
                &params(&d, il),
                grid,
            )?;
            Ok(dx)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shader parses and validates, and has the four entry points the launchers name.
    #[test]
    fn shader_parses_and_validates() {
        let (module, _) = super::super::kernels::validated_module(POOL2D_SHADER.source);
        let names: Vec<&str> = module
            .entry_points
            .iter()
            .map(|e| e.name.as_str())
            .collect();
        for entry in [
            "max_pool2d_forward",
            "avg_pool2d_forward",
            "max_pool2d_backward",
            "avg_pool2d_backward",
        ] {
            assert!(
                names.contains(&entry),
                "missing entry point {entry}: {names:?}"
            );
        }
    }
}
