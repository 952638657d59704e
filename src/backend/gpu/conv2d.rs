//! Launchers of `shaders/conv2d.wgsl`, the GPU end of `Tensor::conv2d` /
//! `Tensor::grouped_conv2d`, one function per entry point (same names):
//!
//! - [`conv2d_forward`]: an implicit GEMM, 16 channels × 64 positions of one image per workgroup;
//! - [`conv2d_input_grad`]: col2im as a gather, one invocation per input pixel, no atomics;
//! - [`conv2d_weight_grad`]: 16 channels × 16 window elements of one bank per workgroup, summed
//!   over that bank's images in order, no atomics.
//!
//! Each launcher checks dtypes, buffer lengths against the sizes and the limits of the kernels
//! (32-bit indexing, at most 1024 taps per channel for the input gradient) and returns an
//! [`Error`] naming them, never a panic or a wgpu validation error. More than 65535 images are
//! split into several launches. Nothing is read back. The shader's header describes the tiling.
//!
//! Three builds of the shader ([`build`]): f32 throughout; f16 images, weights and gradients
//! (`half::CONV2D_F16_SHADER`); and f16 images and image gradients with f32 weights and weight
//! gradients (`half::CONV2D_F16_ROWS_SHADER`), what mixed precision runs: the f32 master weight
//! is read where it is and gets its gradient in f32, summed from the f16 operands without an
//! f16 rounding. Every build sums in f32 in the same order. Banks are i32.

use super::kernels::Shader;
use super::{GpuBackend, GpuBuffer};
use crate::backend::{Conv2dDims, ElementwiseOps};
use crate::{DType, Error, Result};

/// The kernels of `shaders/conv2d.wgsl`.
pub(crate) static CONV2D_SHADER: Shader = Shader {
    name: "conv2d",
    builtin: true,
    source: include_str!("../../../shaders/conv2d.wgsl"),
};

/// The most kernel taps (`KH·KW`) of one channel the input-gradient kernel stages (the shader's
/// `TAP_STAGE`).
pub(super) const CONV2D_MAX_TAPS: usize = 1024;

/// Workgroups a dispatch may have in one dimension (WebGPU's guaranteed minimum).
const MAX_GROUPS: usize = 65_535;

/// The image bank buffer, or a one-element placeholder when every image uses bank 0.
fn bank_buffer(
    be: &GpuBackend,
    image_bank: Option<&GpuBuffer>,
    d: &Conv2dDims,
    what: &str,
) -> Result<GpuBuffer> {
    crate::backend::checks::check_image_bank(what, image_bank, d)?;
    match image_bank {
        None => be.full(1, 0.0, DType::I32),
        Some(b) => Ok(b.clone()),
    }
}

/// Checks the geometry, the 32-bit limits and every operand `(name, buffer, expected length)`.
fn check(what: &str, operands: &[(&str, &GpuBuffer, usize)], d: &Conv2dDims) -> Result<()> {
    let (x, w, y) = d.check(what)?;
    if [x, w, y].iter().any(|&n| n > u32::MAX as usize) || d.window() > u32::MAX as usize {
        return Err(Error::Shape(format!(
            "{what}: {d:?} exceeds the GPU kernels' 32-bit indexing"
        )));
    }
    if x == 0 || w == 0 || y == 0 {
        return Err(Error::Shape(format!(
            "{what}: every size of {d:?} must be at least 1 on the GPU"
        )));
    }
    if d.banks > MAX_GROUPS || d.in_channels > MAX_GROUPS {
        return Err(Error::Shape(format!(
            "{what}: more than {MAX_GROUPS} banks or channels in one launch ({d:?})"
        )));
    }
    let lengths: Vec<_> = operands.iter().map(|&(n, b, e)| (n, b, e)).collect();
    crate::backend::checks::check_lengths(what, &lengths, d)
}

/// The build of `conv2d.wgsl` for images and image gradients of `image`'s dtype and weights and
/// weight gradients of `weight`: f32 and f32, f16 and f16, or f16 and f32 (mixed precision's
/// f32 master weights); anything else is an [`Error::DType`] naming the operands.
fn build(what: &str, (name, image): (&str, &GpuBuffer), weight: DType) -> Result<&'static Shader> {
    match (image.dtype(), weight) {
        (DType::F32, DType::F32) => Ok(&CONV2D_SHADER),
        (DType::F16, DType::F16) => Ok(&super::half::CONV2D_F16_SHADER),
        (DType::F16, DType::F32) => Ok(&super::half::CONV2D_F16_ROWS_SHADER),
        (i, w) => Err(Error::DType(format!(
            "{what}: {name} is {i} and the weight {w}; the GPU convolves f32 images with f32 \
             weights, f16 with f16, or f16 images with f32 weights"
        ))),
    }
}

/// The parameter block (`ConvParams`) for images `image_base..`.
fn params(d: &Conv2dDims, image_base: usize, (has_bank, has_bias): (bool, bool)) -> [u32; 15] {
    [
        d.batch as u32,
        d.in_channels as u32,
        d.height as u32,
        d.width as u32,
        d.out_channels as u32,
        d.kernel_h as u32,
        d.kernel_w as u32,
        d.stride as u32,
        d.padding as u32,
        d.out_h() as u32,
        d.out_w() as u32,
        d.banks as u32,
        image_base as u32,
        has_bank as u32,
        has_bias as u32,
    ]
}

/// Launches `entry` over `[x, y]` workgroups per image, at most 65535 images a launch.
fn launch_per_image(
    be: &GpuBackend,
    shader: &'static Shader,
    entry: &str,
    buffers: &[&GpuBuffer],
    d: &Conv2dDims,
    flags: (bool, bool),
    [gx, gy]: [usize; 2],
) -> Result<()> {
    if gx > MAX_GROUPS || gy > MAX_GROUPS {
        return Err(Error::Shape(format!(
            "{entry}: {d:?} needs more than {MAX_GROUPS} workgroups along one axis"
        )));
    }
    for first in (0..d.batch).step_by(MAX_GROUPS) {
        let count = MAX_GROUPS.min(d.batch - first);
        be.launch(
            shader,
            entry,
            buffers,
            &params(d, first, flags),
            [gx as u32, gy as u32, count as u32],
        )?;
    }
    Ok(())
}

/// `NnOps::conv2d_forward` (entry `conv2d_forward`): `y [B, OC, OH, OW]`, with `bias`
/// (`[OC]`, the weight's dtype) added where given (where not, the weight is bound in its slot,
/// unread).
///
/// # Errors
/// [`Error::DType`] unless `x` and `w` are f32, f16, or f16 and f32 ([`build`]; `y` has
/// `x`'s dtype), `image_bank` i32 and `bias` of `w`'s dtype; [`Error::Shape`] when a length
/// does not match the sizes, a size is 0 or exceeds the kernels' limits; a GPU error from the
/// launch.
pub(crate) fn conv2d_forward(
    be: &GpuBackend,
    x: &GpuBuffer,
    w: &GpuBuffer,
    bias: Option<&GpuBuffer>,
    image_bank: Option<&GpuBuffer>,
    d: Conv2dDims,
) -> Result<GpuBuffer> {
    const WHAT: &str = "conv2d_forward";
    let (xl, wl, yl) = d.check(WHAT)?;
    check(WHAT, &[("x", x, xl), ("w", w, wl)], &d)?;
    if let Some(b) = bias {
        crate::backend::checks::check_lengths(WHAT, &[("bias", b, d.out_channels)], &d)?;
        if b.dtype() != w.dtype() {
            return Err(Error::DType(format!(
                "{WHAT}: the bias is {} and the weight {}; they must have one dtype",
                b.dtype(),
                w.dtype()
            )));
        }
    }
    let shader = build(WHAT, ("x", x), w.dtype())?;
    let bank = bank_buffer(be, image_bank, &d, WHAT)?;
    let y = be.alloc(yl, x.dtype())?;
    let grid = [
        (d.out_h() * d.out_w()).div_ceil(64),
        d.out_channels.div_ceil(16),
    ];
    launch_per_image(
        be,
        shader,
        "conv2d_forward",
        &[x, w, &bank, &y, bias.unwrap_or(w)],
        &d,
        (image_bank.is_some(), bias.is_some()),
        grid,
    )?;
    Ok(y)
}

/// `NnOps::conv2d_input_grad` (entry `conv2d_input_grad`): `dx [B, C, H, W]`.
///
/// # Errors
/// As [`conv2d_forward`] (`dx` has `dy`'s dtype), and [`Error::Invalid`] for a kernel of more than
/// [`CONV2D_MAX_TAPS`] taps.
pub(crate) fn conv2d_input_grad(
    be: &GpuBackend,
    dy: &GpuBuffer,
    w: &GpuBuffer,
    image_bank: Option<&GpuBuffer>,
    d: Conv2dDims,
) -> Result<GpuBuffer> {
    const WHAT: &str = "conv2d_input_grad";
    let (xl, wl, yl) = d.check(WHAT)?;
    check(WHAT, &[("dy", dy, yl), ("w", w, wl)], &d)?;
    let shader = build(WHAT, ("dy", dy), w.dtype())?;
    if d.kernel_h * d.kernel_w > CONV2D_MAX_TAPS {
        return Err(Error::Invalid(format!(
            "{WHAT}: a {}×{} kernel exceeds the GPU kernel's {CONV2D_MAX_TAPS} taps",
            d.kernel_h, d.kernel_w
        )));
    }
    let bank = bank_buffer(be, image_bank, &d, WHAT)?;
    let dx = be.alloc(xl, dy.dtype())?;
    let grid = [(d.height * d.width).div_ceil(256), d.in_channels];
    launch_per_image(
        be,
        shader,
        "conv2d_input_grad",
        &[dy, w, &bank, &dx],
        &d,
        (image_bank.is_some(), false),
        grid,
    )?;
    Ok(dx)
}

/// `NnOps::conv2d_weight_grad` (entry `conv2d_weight_grad`): `dw [G, OC, C, KH, KW]` of dtype
/// `out`, the weight's.
///
/// # Errors
/// As [`conv2d_forward`], and [`Error::DType`] unless `x` and `dy` have one dtype.
pub(crate) fn conv2d_weight_grad(
    be: &GpuBackend,
    x: &GpuBuffer,
    dy: &GpuBuffer,
    image_bank: Option<&GpuBuffer>,
    d: Conv2dDims,
    out: DType,
) -> Result<GpuBuffer> {
    const WHAT: &str = "conv2d_weight_grad";
    let (xl, wl, yl) = d.check(WHAT)?;
    check(WHAT, &[("x", x, xl), ("dy", dy, yl)], &d)?;
    if x.dtype() != dy.dtype() {
        return Err(Error::DType(format!(
            "{WHAT}: x is {} and dy {}; they must have one dtype",
            x.dtype(),
            dy.dtype()
        )));
    }
    let shader = build(WHAT, ("x", x), out)?;
    let bank = bank_buffer(be, image_bank, &d, WHAT)?;
    let dw = be.alloc(wl, out)?;
    let (gx, gy) = (d.window().div_ceil(16), d.out_channels.div_ceil(16));
    if gx > MAX_GROUPS || gy > MAX_GROUPS {
        return Err(Error::Shape(format!(
            "{WHAT}: {d:?} needs more than {MAX_GROUPS} workgroups along one axis"
        )));
    }
    be.launch(
        shader,
        "conv2d_weight_grad",
        &[x, dy, &bank, &dw],
        &params(&d, 0, (image_bank.is_some(), false)),
        [gx as u32, gy as u32, d.banks as u32],
    )?;
    Ok(dw)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shader parses and validates, and has the three entry points the launchers name.
    #[test]
    fn shader_parses_and_validates() {
        let (module, _) = super::super::kernels::validated_module(CONV2D_SHADER.source);
        let names: Vec<&str> = module
            .entry_points
            .iter()
            .map(|e| e.name.as_str())
            .collect();
        for entry in ["conv2d_forward", "conv2d_input_grad", "conv2d_weight_grad"] {
            assert!(
                names.contains(&entry),
                "missing entry point {entry}: {names:?}"
            );
        }
    }
}
