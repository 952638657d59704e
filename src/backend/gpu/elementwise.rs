//! Launchers of `shaders/elementwise.wgsl`, one per entry point: [`full`] (`fill`), [`cast`]
//! (`cast_dtype`), [`unary`], [`binary`] and [`where_cond`]. Each checks dtypes and sizes, plans
//! strided operands with [`super::strided::plan`], and records one launch of 256-invocation
//! workgroups over the output.

use super::kernels::{Shader, grid_1d, u32_param};
use super::strided::plan;
use super::{GpuBackend, GpuBuffer, f64_error};
use crate::backend::{BinaryOp, Strided, UnaryOp};
use crate::{DType, Error, Result};

/// The kernels of `shaders/elementwise.wgsl`.
pub(crate) static ELEMENTWISE: Shader = Shader {
    name: "elementwise",
    source: include_str!("../../../shaders/elementwise.wgsl"),
};

/// Invocations per workgroup of every kernel in the file.
const WG: u32 = 256;

/// An error unless `b` holds f32 (the GPU's float dtype).
pub(crate) fn expect_f32(what: &str, b: &GpuBuffer) -> Result<()> {
    match b.dtype() {
        DType::F32 => Ok(()),
        d => Err(Error::DType(format!(
            "{what} needs a float tensor, got {d}"
        ))),
    }
}

/// `Backend::full`: `len` copies of `value` rounded to `dtype` (entry `fill`).
pub(crate) fn full(be: &GpuBackend, len: usize, value: f64, dtype: DType) -> Result<GpuBuffer> {
    let bits = match dtype {
        DType::F32 => (value as f32).to_bits(),
        DType::I32 => (value as i32) as u32,
        DType::F64 => return Err(f64_error("full")),
    };
    let out = be.alloc(len, dtype)?;
    let n = u32_param(len, "full: length")?;
    be.launch(&ELEMENTWISE, "fill", &[&out], &[n, bits], grid_1d(len, WG)?)?;
    Ok(out)
}

/// `Backend::cast` (entry `cast_dtype`). A cast to the buffer's own dtype shares the buffer (GPU
/// buffers are never written after the kernel that made them).
pub(crate) fn cast(be: &GpuBackend, x: &GpuBuffer, dtype: DType) -> Result<GpuBuffer> {
    let mode = match (x.dtype(), dtype) {
        (_, DType::F64) | (DType::F64, _) => return Err(f64_error("cast")),
        (a, b) if a == b => return Ok(x.clone()),
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

/// The kernel's code and parameters of a unary op.
fn unary_code(op: UnaryOp) -> (u32, f32, f32) {
    match op {
        UnaryOp::Neg => (0, 0.0, 0.0),
        UnaryOp::Exp => (1, 0.0, 0.0),
        UnaryOp::Log => (2, 0.0, 0.0),
        UnaryOp::Sqrt => (3, 0.0, 0.0),
        UnaryOp::Abs => (4, 0.0, 0.0),
        UnaryOp::Relu => (5, 0.0, 0.0),
        UnaryOp::Gelu => (6, 0.0, 0.0),
        UnaryOp::GeluGrad => (7, 0.0, 0.0),
        UnaryOp::Silu => (8, 0.0, 0.0),
        UnaryOp::Tanh => (9, 0.0, 0.0),
        UnaryOp::Sigmoid => (10, 0.0, 0.0),
        UnaryOp::Softplus => (11, 0.0, 0.0),
        UnaryOp::Recip => (12, 0.0, 0.0),
        UnaryOp::Step => (13, 0.0, 0.0),
        UnaryOp::Sign => (14, 0.0, 0.0),
        UnaryOp::Powf(p) => (15, p as f32, 0.0),
        UnaryOp::Clamp(lo, hi) => (16, lo as f32, hi as f32),
        UnaryOp::AddScalar(c) => (17, c as f32, 0.0),
        UnaryOp::MulScalar(c) => (18, c as f32, 0.0),
    }
}

/// `Backend::unary` (entry `unary`).
pub(crate) fn unary(be: &GpuBackend, op: UnaryOp, x: &GpuBuffer) -> Result<GpuBuffer> {
    expect_f32(&format!("{op:?}"), x)?;
    let (code, p0, p1) = unary_code(op);
    let out = be.alloc(x.len(), DType::F32)?;
    let n = u32_param(x.len(), "unary: length")?;
    be.launch(
        &ELEMENTWISE,
        "unary",
        &[x, &out],
        &[n, code, p0.to_bits(), p1.to_bits()],
        grid_1d(x.len(), WG)?,
    )?;
    Ok(out)
}

/// The kernel's code of a binary op (its index in declaration order).
fn binary_code(op: BinaryOp) -> u32 {
    match op {
        BinaryOp::Add => 0,
        BinaryOp::Sub => 1,
        BinaryOp::Mul => 2,
        BinaryOp::Div => 3,
        BinaryOp::Max => 4,
        BinaryOp::Min => 5,
        BinaryOp::Pow => 6,
        BinaryOp::Gt => 7,
        BinaryOp::Ge => 8,
        BinaryOp::Lt => 9,
        BinaryOp::Le => 10,
        BinaryOp::Eq => 11,
        BinaryOp::Ne => 12,
        BinaryOp::GeluBackward => 13,
    }
}

/// `Backend::binary` with broadcasting strides (entry `binary`).
pub(crate) fn binary(
    be: &GpuBackend,
    op: BinaryOp,
    a: &GpuBuffer,
    sa: &[usize],
    b: &GpuBuffer,
    sb: &[usize],
    shape: &[usize],
) -> Result<GpuBuffer> {
    if a.dtype() != DType::F32 || b.dtype() != DType::F32 {
        return Err(Error::DType(format!(
            "{op:?} needs two float tensors of one dtype, got {} and {}",
            a.dtype(),
            b.dtype()
        )));
    }
    let what = format!("{op:?}");
    let p = plan(&what, shape, &[(sa, 0, a.len()), (sb, 0, b.len())])?;
    let out = be.alloc(p.n, DType::F32)?;
    be.launch(
        &ELEMENTWISE,
        "binary",
        &[a, b, &out],
        &p.words(binary_code(op)),
        grid_1d(p.n, WG)?,
    )?;
    Ok(out)
}

/// `Backend::where_cond` (entry `where_cond`).
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
    if [cond, a, b].iter().any(|t| t.dtype() != DType::F32) {
        return Err(Error::DType(format!(
            "where needs a condition and two values of one float dtype, got {}, {} and {}",
            cond.dtype(),
            a.dtype(),
            b.dtype()
        )));
    }
    let p = plan(
        "where",
        shape,
        &[(sc, 0, cond.len()), (sa, 0, a.len()), (sb, 0, b.len())],
    )?;
    let out = be.alloc(p.n, DType::F32)?;
    be.launch(
        &ELEMENTWISE,
        "where_cond",
        &[cond, a, b, &out],
        &p.words(0),
        grid_1d(p.n, WG)?,
    )?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The WGSL constant naming each unary op's code (an exhaustive match: a new `UnaryOp`
    /// does not compile here until it has a name, and then needs that constant in the shader).
    fn unary_wgsl_name(op: UnaryOp) -> &'static str {
        match op {
            UnaryOp::Neg => "UNARY_NEG",
            UnaryOp::Exp => "UNARY_EXP",
            UnaryOp::Log => "UNARY_LOG",
            UnaryOp::Sqrt => "UNARY_SQRT",
            UnaryOp::Abs => "UNARY_ABS",
            UnaryOp::Relu => "UNARY_RELU",
            UnaryOp::Gelu => "UNARY_GELU",
            UnaryOp::GeluGrad => "UNARY_GELU_GRAD",
            UnaryOp::Silu => "UNARY_SILU",
            UnaryOp::Tanh => "UNARY_TANH",
            UnaryOp::Sigmoid => "UNARY_SIGMOID",
            UnaryOp::Softplus => "UNARY_SOFTPLUS",
            UnaryOp::Recip => "UNARY_RECIP",
            UnaryOp::Step => "UNARY_STEP",
            UnaryOp::Sign => "UNARY_SIGN",
            UnaryOp::Powf(_) => "UNARY_POWF",
            UnaryOp::Clamp(..) => "UNARY_CLAMP",
            UnaryOp::AddScalar(_) => "UNARY_ADD_SCALAR",
            UnaryOp::MulScalar(_) => "UNARY_MUL_SCALAR",
        }
    }

    /// The WGSL constant naming each binary op's code (exhaustive, as above).
    fn binary_wgsl_name(op: BinaryOp) -> &'static str {
        match op {
            BinaryOp::Add => "BINARY_ADD",
            BinaryOp::Sub => "BINARY_SUB",
            BinaryOp::Mul => "BINARY_MUL",
            BinaryOp::Div => "BINARY_DIV",
            BinaryOp::Max => "BINARY_MAX",
            BinaryOp::Min => "BINARY_MIN",
            BinaryOp::Pow => "BINARY_POW",
            BinaryOp::Gt => "BINARY_GT",
            BinaryOp::Ge => "BINARY_GE",
            BinaryOp::Lt => "BINARY_LT",
            BinaryOp::Le => "BINARY_LE",
            BinaryOp::Eq => "BINARY_EQ",
            BinaryOp::Ne => "BINARY_NE",
            BinaryOp::GeluBackward => "BINARY_GELU_BACKWARD",
        }
    }

    /// Every Rust op code equals the WGSL constant of the same name, every such constant is a
    /// `case` of the shader's switch, and the shader has no other op constants.
    #[test]
    fn wgsl_op_codes_match_rust() {
        let source = ELEMENTWISE.source;
        let wgsl = super::super::kernels::wgsl_u32_consts(source);
        let unary = [
            UnaryOp::Neg,
            UnaryOp::Exp,
            UnaryOp::Log,
            UnaryOp::Sqrt,
            UnaryOp::Abs,
            UnaryOp::Relu,
            UnaryOp::Gelu,
            UnaryOp::GeluGrad,
            UnaryOp::Silu,
            UnaryOp::Tanh,
            UnaryOp::Sigmoid,
            UnaryOp::Softplus,
            UnaryOp::Recip,
            UnaryOp::Step,
            UnaryOp::Sign,
            UnaryOp::Powf(2.0),
            UnaryOp::Clamp(0.0, 1.0),
            UnaryOp::AddScalar(1.0),
            UnaryOp::MulScalar(2.0),
        ];
        let binary = [
            BinaryOp::Add,
            BinaryOp::Sub,
            BinaryOp::Mul,
            BinaryOp::Div,
            BinaryOp::Max,
            BinaryOp::Min,
            BinaryOp::Pow,
            BinaryOp::Gt,
            BinaryOp::Ge,
            BinaryOp::Lt,
            BinaryOp::Le,
            BinaryOp::Eq,
            BinaryOp::Ne,
            BinaryOp::GeluBackward,
        ];
        let pairs: Vec<(&str, u32)> = unary
            .iter()
            .map(|&op| (unary_wgsl_name(op), unary_code(op).0))
            .chain(
                binary
                    .iter()
                    .map(|&op| (binary_wgsl_name(op), binary_code(op))),
            )
            .collect();
        for (name, code) in &pairs {
            assert_eq!(
                wgsl.get(*name),
                Some(code),
                "shaders/elementwise.wgsl: {name} must be {code}u, as in elementwise.rs"
            );
            assert!(
                source.contains(&format!("case {name}:")),
                "shaders/elementwise.wgsl has no `case {name}:`"
            );
        }
        let op_consts = wgsl
            .keys()
            .filter(|k| k.starts_with("UNARY_") || k.starts_with("BINARY_"))
            .count();
        assert_eq!(op_consts, pairs.len(), "op constants without a Rust op");
    }
}
