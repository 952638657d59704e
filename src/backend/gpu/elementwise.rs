//! Launchers of `shaders/elementwise.wgsl`, one per entry point: [`full`] (`fill`, or for a
//! small constant a write with the batch's uploads), [`cast`]
//! (`cast_dtype`), [`unary`], [`binary`] and [`where_cond`]. Each checks dtypes and sizes, plans
//! strided operands with [`super::strided::plan`], and records one launch of 256-invocation
//! workgroups over the output.

use super::half::ELEMENTWISE_F16_SHADER;
use super::kernels::{Shader, grid_1d, u32_param};
use super::strided::plan;
use super::{GpuBackend, GpuBuffer, f64_error};
use crate::backend::ElementwiseOps;
use crate::backend::checks::{binary_dtype_error, where_dtype_error};
use crate::backend::{BinaryOp, Strided, UnaryOp};
use crate::{DType, Error, Result};
use std::sync::LazyLock;

/// The kernels of `shaders/elementwise.wgsl`, followed by the op codes and the `apply_unary` /
/// `apply_binary` functions generated from the table in `backend/elementwise_ops.rs` (built
/// once per process).
pub(crate) static ELEMENTWISE: LazyLock<Shader> = LazyLock::new(|| Shader {
    name: "elementwise",
    builtin: true,
    source: String::leak(format!(
        "{}{}",
        include_str!("../../../shaders/elementwise.wgsl"),
        crate::backend::wgsl_elementwise_ops()
    )),
});

/// Invocations per workgroup of every kernel in the file.
const WG: u32 = 256;

/// The largest constant [`full`] writes from the host instead of filling with a kernel: a
/// training step's zero scalars and the backward's seed become uploads of a few bytes, applied
/// with the batch, rather than dispatches.
const HOST_FULL_MAX_BYTES: usize = 1024;

/// `ElementwiseOps::full`: `len` copies of `value` rounded to `dtype` (entry `fill`).
pub(crate) fn full(be: &GpuBackend, len: usize, value: f64, dtype: DType) -> Result<GpuBuffer> {
    // the kernel fills 32-bit words: an f16 value twice per word
    let (bits, words) = match dtype {
        DType::F32 => ((value as f32).to_bits(), len),
        DType::I32 => ((value as i32) as u32, len),
        DType::F16 => {
            let h = ::half::f16::from_f64(value).to_bits() as u32;
            (h | (h << 16), len.div_ceil(2))
        }
        DType::F64 => return Err(f64_error("full")),
    };
    let out = be.alloc(len, dtype)?;
    if words * 4 <= HOST_FULL_MAX_BYTES {
        be.write_fresh(&out, bytemuck::cast_slice(&vec![bits; words]));
        return Ok(out);
    }
    let n = u32_param(words, "full: length")?;
    be.launch(
        &ELEMENTWISE,
        "fill",
        &[&out],
        &[n, bits],
        grid_1d(words, WG)?,
    )?;
    Ok(out)
}

/// `ElementwiseOps::cast` (entry `cast_dtype`). A cast to the buffer's own dtype shares the buffer (GPU
/// buffers are never written after the kernel that made them).
pub(crate) fn cast(be: &GpuBackend, x: &GpuBuffer, dtype: DType) -> Result<GpuBuffer> {
    let mode = match (x.dtype(), dtype) {
        (_, DType::F64) | (DType::F64, _) => return Err(f64_error("cast")),
        (a, b) if a == b => return Ok(x.clone()),
        (DType::F32, DType::F16) => return super::half::to_f16(be, x),
        (DType::F16, DType::F32) => return super::half::to_f32(be, x),
        (DType::F16, DType::I32) => return cast(be, &super::half::to_f32(be, x)?, dtype),
        (DType::I32, DType::F16) => return super::half::to_f16(be, &cast(be, x, DType::F32)?),
        (DType::F32, DType::I32) => 0,
        _ => 1,
    };
    let out = be.alloc(x.len(), dtype)?;
    let n = u32_param(x.len(), "cast: length")?;
    be.launch(
        &ELEMENTWISE,
        "cast_dtype",
        &[x, &out],
        &[n, mode],
        grid_1d(x.len(), WG)?,
    )?;
    Ok(out)
}

/// The float dtype all of `bufs` share (f32, or f16 for the f16 build of the kernels) and the
/// shader of that build, or `None` when they are not all f32 or all f16.
fn float_build(bufs: &[&GpuBuffer]) -> Option<(DType, &'static Shader)> {
    let dtype = bufs.first()?.dtype();
    if bufs.iter().any(|b| b.dtype() != dtype) {
        return None;
    }
    match dtype {
        DType::F32 => Some((DType::F32, &*ELEMENTWISE)),
        DType::F16 => Some((DType::F16, &*ELEMENTWISE_F16_SHADER)),
        _ => None,
    }
}

/// `ElementwiseOps::unary` (entry `unary`), f32 or f16 (computed in f32, stored in f16).
pub(crate) fn unary(be: &GpuBackend, op: UnaryOp, x: &GpuBuffer) -> Result<GpuBuffer> {
    let Some((dtype, shader)) = float_build(&[x]) else {
        return Err(Error::DType(format!(
            "{op:?} needs a float tensor, got {}",
            x.dtype()
        )));
    };
    let [p0, p1] = op.params().map(|p| p as f32);
    let out = be.alloc(x.len(), dtype)?;
    let n = u32_param(x.len(), "unary: length")?;
    be.launch(
        shader,
        "unary",
        &[x, &out],
        &[n, op.code(), p0.to_bits(), p1.to_bits()],
        grid_1d(x.len(), WG)?,
    )?;
    Ok(out)
}

/// `ElementwiseOps::binary` with broadcasting strides (entry `binary`), both operands f32 or
/// both f16.
pub(crate) fn binary(
    be: &GpuBackend,
    op: BinaryOp,
    a: &GpuBuffer,
    sa: &[usize],
    b: &GpuBuffer,
    sb: &[usize],
    shape: &[usize],
) -> Result<GpuBuffer> {
    let Some((dtype, shader)) = float_build(&[a, b]) else {
        return Err(binary_dtype_error(&format!("{op:?}"), a.dtype(), b.dtype()));
    };
    let what = format!("{op:?}");
    let p = plan(&what, shape, &[(sa, 0, a.len()), (sb, 0, b.len())])?;
    let out = be.alloc(p.n, dtype)?;
    be.launch(
        shader,
        "binary",
        &[a, b, &out],
        &p.words(op.code()),
        grid_1d(p.n, WG)?,
    )?;
    Ok(out)
}

/// `ElementwiseOps::where_cond` (entry `where_cond`), all three f32 or all three f16.
pub(crate) fn where_cond(
    be: &GpuBackend,
    cond: Strided<'_, GpuBuffer>,
    a: Strided<'_, GpuBuffer>,
    b: Strided<'_, GpuBuffer>,
    shape: &[usize],
) -> Result<GpuBuffer> {
    let (
        Strided {
            buf: cond,
            strides: sc,
        },
        Strided {
            buf: a,
            strides: sa,
        },
    ) = (cond, a);
    let Strided {
        buf: b,
        strides: sb,
    } = b;
    let Some((dtype, shader)) = float_build(&[cond, a, b]) else {
        return Err(where_dtype_error(cond.dtype(), a.dtype(), b.dtype()));
    };
    let p = plan(
        "where",
        shape,
        &[(sc, 0, cond.len()), (sa, 0, a.len()), (sb, 0, b.len())],
    )?;
    let out = be.alloc(p.n, dtype)?;
    be.launch(
        shader,
        "where_cond",
        &[cond, a, b, &out],
        &p.words(0),
        grid_1d(p.n, WG)?,
    )?;
    Ok(out)
}

impl ElementwiseOps for GpuBackend {
    fn full(&self, len: usize, value: f64, dtype: DType) -> Result<GpuBuffer> {
        full(self, len, value, dtype)
    }

    fn cast(&self, x: &GpuBuffer, dtype: DType) -> Result<GpuBuffer> {
        cast(self, x, dtype)
    }

    fn unary(&self, op: UnaryOp, x: &GpuBuffer) -> Result<GpuBuffer> {
        unary(self, op, x)
    }

    fn binary(
        &self,
        op: BinaryOp,
        a: &GpuBuffer,
        a_strides: &[usize],
        b: &GpuBuffer,
        b_strides: &[usize],
        out_shape: &[usize],
    ) -> Result<GpuBuffer> {
        binary(self, op, a, a_strides, b, b_strides, out_shape)
    }

    fn where_cond(
        &self,
        cond: Strided<'_, GpuBuffer>,
        a: Strided<'_, GpuBuffer>,
        b: Strided<'_, GpuBuffer>,
        out_shape: &[usize],
    ) -> Result<GpuBuffer> {
        where_cond(self, cond, a, b, out_shape)
    }

    fn random_uniform(&self, len: usize, seed: u64, dtype: DType) -> Result<GpuBuffer> {
        super::random::random_uniform(self, len, seed, dtype)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::elementwise_ops::{binary_wgsl_name, unary_wgsl_name};

    /// The shader file holds neither the op functions nor the op constants (they are generated
    /// from the table in `backend/elementwise_ops.rs`), and the compiled source has a `case` for
    /// every op of the table, with the table's codes.
    #[test]
    fn the_op_functions_and_codes_come_from_the_table_only() {
        let file = include_str!("../../../shaders/elementwise.wgsl");
        for generated in [
            "fn apply_unary",
            "fn apply_binary",
            "case UNARY_",
            "case BINARY_",
        ] {
            assert!(
                !file.contains(generated),
                "shaders/elementwise.wgsl has `{generated}`; it is generated from the op table"
            );
        }
        let own = super::super::kernels::wgsl_u32_consts(file);
        assert!(
            !own.keys()
                .any(|k| k.starts_with("UNARY_") || k.starts_with("BINARY_")),
            "shaders/elementwise.wgsl declares op constants; they come from the Rust table"
        );
        let compiled = super::super::kernels::wgsl_u32_consts(ELEMENTWISE.source);
        assert_eq!(compiled.get("UNARY_NEG"), Some(&UnaryOp::Neg.code()));
        assert_eq!(compiled.get("BINARY_NE"), Some(&BinaryOp::Ne.code()));
        for name in UnaryOp::NAMES.iter().map(|n| unary_wgsl_name(n)) {
            assert!(
                ELEMENTWISE.source.contains(&format!("case {name}:")),
                "{name}"
            );
        }
        for name in BinaryOp::NAMES.iter().map(|n| binary_wgsl_name(n)) {
            assert!(
                ELEMENTWISE.source.contains(&format!("case {name}:")),
                "{name}"
            );
        }
    }
}
