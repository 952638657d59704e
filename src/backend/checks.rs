//! Device-neutral argument checks of the fused primitives (cross-entropy, layer norm,
//! attention, the grouped matmul's bias, convolution and pooling): buffer lengths against the
//! geometry they are called with, so that a mismatch is an [`crate::Error`] before any kernel
//! indexes a buffer. Both backends call these, generic over [`Operand`], so each message is
//! written once; what only one device needs (the GPU's f32-only dtype, its 32-bit indexing and
//! workgroup limits) stays in that device's launcher.

use super::{cpu::CpuBuffer, gpu::GpuBuffer};
use crate::backend::{AttentionDims, GroupedMatmulDims, LayerNormDims};
use crate::{Error, Result};
use std::fmt::Debug;

/// What a length check sees of a device buffer: its length (never its values).
pub(crate) trait Operand {
    /// Elements in the buffer.
    fn len(&self) -> usize;
}

impl Operand for CpuBuffer {
    fn len(&self) -> usize {
        CpuBuffer::len(self)
    }
}

impl Operand for GpuBuffer {
    fn len(&self) -> usize {
        GpuBuffer::len(self)
    }
}

/// Checks each operand `(name, buffer, expected length)` of a kernel whose geometry is `dims`
/// (printed with `{:?}` in the error: convolution and pooling).
pub(crate) fn check_lengths<B: Operand>(
    what: &str,
    operands: &[(&str, &B, usize)],
    dims: &dyn Debug,
) -> Result<()> {
    for (name, b, expected) in operands {
        if b.len() != *expected {
            return Err(Error::Shape(format!(
                "{what}: {name} holds {} elements, expected {expected} for {dims:?}",
                b.len()
            )));
        }
    }
    Ok(())
}

/// Checks an attention backward's row log-sum-exp `lse`: `[heads, seq]`.
pub(crate) fn check_lse_length<B: Operand>(what: &str, lse: &B, dims: AttentionDims) -> Result<()> {
    let rows = dims.heads * dims.seq; // fits: heads·seq·head_dim was checked, and head_dim ≥ 1
    if lse.len() != rows {
        return Err(Error::Shape(format!(
            "{what}: lse holds {} elements, expected [{}, {}] = {rows}",
            lse.len(),
            dims.heads,
            dims.seq
        )));
    }
    Ok(())
}

/// Checks a cross-entropy's operands on the CPU (logits `[rows, classes]`, I32 targets `[rows]`
/// inside `0..classes`, sizes ≥ 1) and returns the targets. (The range of the targets is
/// data: the GPU kernel checks it where it reads them.)
pub(crate) fn check_cross_entropy<'a>(
    what: &str,
    logits: &CpuBuffer,
    targets: &'a CpuBuffer,
    classes: usize,
) -> Result<&'a [i32]> {
    let t = targets.indices(what)?;
    if t.is_empty() || classes == 0 || t.len().checked_mul(classes) != Some(logits.len()) {
        return Err(Error::Shape(format!(
            "{what}: logits of {} values are not [{} rows, {classes} classes] (sizes ≥ 1)",
            logits.len(),
            t.len()
        )));
    }
    if let Some((r, &bad)) = t
        .iter()
        .enumerate()
        .find(|&(_, &c)| c < 0 || c as usize >= classes)
    {
        return Err(Error::Invalid(format!(
            "{what}: target {bad} of row {r} is not a class in 0..{classes}"
        )));
    }
    Ok(t)
}

/// Checks a layer norm's operands: `[rows, dim]` ones, `[dim]` ones and `[rows]` ones hold that
/// many elements, and no size is zero.
pub(crate) fn check_layer_norm_lengths<B: Operand>(
    what: &str,
    matrices: &[(&str, &B)],
    vectors: &[(&str, &B)],
    per_row: &[(&str, &B)],
    dims: LayerNormDims,
) -> Result<()> {
    let LayerNormDims { rows, dim, .. } = dims;
    let n = rows.checked_mul(dim).filter(|&n| n > 0).ok_or_else(|| {
        Error::Shape(format!(
            "{what}: [{rows}, {dim}] must have sizes of at least 1 and fit in memory"
        ))
    })?;
    let groups = [
        (matrices, n, "[rows, dim]"),
        (vectors, dim, "[dim]"),
        (per_row, rows, "[rows]"),
    ];
    for (operands, want, shape) in groups {
        for (name, b) in operands {
            if b.len() != want {
                return Err(Error::Shape(format!(
                    "{what}: {name} holds {} elements, expected {shape} = {want} for rows {rows}, dim {dim}",
                    b.len()
                )));
            }
        }
    }
    Ok(())
}

/// Checks that each `[heads, seq, head_dim]` operand of an attention kernel holds exactly
/// `dims.elements()` elements and that no size is zero.
pub(crate) fn check_attention_lengths<B: Operand>(
    what: &str,
    operands: &[(&str, &B)],
    dims: AttentionDims,
) -> Result<()> {
    let AttentionDims {
        heads,
        seq,
        head_dim,
    } = dims;
    let n = dims.elements().ok_or_else(|| {
        Error::Shape(format!(
            "{what}: [{heads}, {seq}, {head_dim}] has more than usize::MAX elements"
        ))
    })?;
    if n == 0 {
        return Err(Error::Shape(format!(
            "{what}: sizes [{heads}, {seq}, {head_dim}] must all be at least 1"
        )));
    }
    for (name, b) in operands {
        if b.len() != n {
            return Err(Error::Shape(format!(
                "{what}: {name} holds {} elements, expected [{heads}, {seq}, {head_dim}] = {n}",
                b.len()
            )));
        }
    }
    Ok(())
}

/// Checks a grouped matmul's bias: `[experts, m]` elements, and only without `transpose_w` (the
/// backward product has no bias).
pub(crate) fn check_grouped_bias<B: Operand>(
    what: &str,
    bias: Option<&B>,
    dims: GroupedMatmulDims,
) -> Result<()> {
    let Some(b) = bias else { return Ok(()) };
    if dims.transpose_w {
        return Err(Error::Invalid(format!(
            "{what}: a bias is only added to the forward product, not with transpose_w"
        )));
    }
    if Some(b.len()) != dims.experts.checked_mul(dims.m) {
        return Err(Error::Shape(format!(
            "{what}: bias holds {} elements, expected [{}, {}]",
            b.len(),
            dims.experts,
            dims.m
        )));
    }
    Ok(())
}
