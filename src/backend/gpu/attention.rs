//! Launchers of `shaders/attention.wgsl`, the GPU end of `Tensor::causal_attention`, one
//! function per entry point family:
//!
//! - [`attention_forward`] (entry `attention_forward`): `o` and the row log-sum-exp `lse`;
//! - [`attention_forward_packed`] / [`attention_backward_packed`]: the same kernels reading q,
//!   k and v from one buffer `[batch, seq, 3, heads, head_dim]` packed per position
//!   (`Tensor::causal_attention_packed`: a fused projection's output) where they are, writing
//!   the output `[batch, seq, heads, head_dim]` for the output projection, and the gradient
//!   packed like the input: no permute, slice or concatenation on either side;
//! - [`attention_backward`]: `attention_delta` (`D = rowsum(dO ∘ O)`), then
//!   `attention_backward_kv` (dK, dV, one workgroup per key tile) and `attention_backward_q`
//!   (dQ, one workgroup per query tile). Two kernels instead of one with float atomics: each
//!   output row has exactly one owner, so the result is deterministic.
//!
//! Each launcher checks dtypes, buffer lengths against the sizes and the head dimension against
//! [`ATTENTION_MAX_HEAD_DIM`] (an [`Error`] naming them, never a panic or a wgpu validation
//! error), splits more than 65535 heads into several launches, and encodes the kernels; nothing
//! is read back. The shader's header describes the tiling.

use super::kernels::{Shader, grid_1d};
use super::{GpuBackend, GpuBuffer};
use crate::backend::checks::{check_attention_lengths, check_lse_length, check_packed_qkv_length};
use crate::backend::{AttentionDims, AttentionGradOperands, PackedAttentionDims};
use crate::{DType, Error, Result};

/// The kernels of `shaders/attention.wgsl`.
pub(crate) static ATTENTION_SHADER: Shader = Shader {
    name: "attention",
    builtin: true,
    source: include_str!("../../../shaders/attention.wgsl"),
};

/// Rows of queries (or keys) per workgroup of the GPU kernels, four invocations (lanes) per row
/// that split the other side's rows between them (`attention.wgsl`'s header).
pub(crate) const ATTENTION_TILE: usize = 64;

/// The largest head dimension the GPU kernels take: each invocation keeps its row's vectors
/// (up to four of `Dh` floats) in registers.
pub(crate) const ATTENTION_MAX_HEAD_DIM: usize = 128;

/// Floats of one staged matrix in workgroup memory (the shader's `STAGE_FLOATS`).
const STAGE_FLOATS: usize = 1984;

/// Rows per stage for a head dimension (the shader's `STAGE` constant): as many as fit in
/// [`STAGE_FLOATS`], at most 32.
fn stage_rows(head_dim: usize) -> usize {
    (STAGE_FLOATS / head_dim).min(32)
}

/// The override constants of the tiled entry points for a head dimension: `HEAD_DIM` and
/// `STAGE` (one pipeline each).
fn specialisation(head_dim: usize) -> [(&'static str, f64); 2] {
    [
        ("HEAD_DIM", head_dim as f64),
        ("STAGE", stage_rows(head_dim) as f64),
    ]
}

/// The entry points [`launch_tiles`] launches, each specialised by [`specialisation`]
/// (`attention_delta` runs with the shader's defaults).
pub(crate) const TILED_ENTRIES: [&str; 4] = [
    "attention_forward",
    "attention_backward_kv",
    "attention_backward_kv_packed",
    "attention_backward_q",
];

/// Every set of override constants [`launch_tiles`] can pass: one per head dimension
/// `1..=ATTENTION_MAX_HEAD_DIM` (what `backend/tests/shader_backends.rs` compiles for each
/// backend).
#[cfg(test)]
pub(crate) fn specialisations() -> impl Iterator<Item = [(&'static str, f64); 2]> {
    (1..=ATTENTION_MAX_HEAD_DIM).map(specialisation)
}

/// Workgroups a dispatch may have in one dimension (WebGPU's guaranteed minimum).
const MAX_GROUPS: usize = 65_535;

/// Checks the sizes and that every `[heads, seq, head_dim]` operand is f32 of the right length.
fn check(what: &str, operands: &[(&str, &GpuBuffer)], d: AttentionDims) -> Result<DType> {
    let AttentionDims {
        heads,
        seq,
        head_dim,
    } = d;
    let n = d
        .elements()
        .filter(|&n| n <= u32::MAX as usize)
        .ok_or_else(|| {
            Error::Shape(format!(
                "{what}: [{heads}, {seq}, {head_dim}] exceeds the GPU kernels' 32-bit indexing"
            ))
        })?;
    if n == 0 {
        check_attention_lengths(what, operands, d)?;
        return Ok(operands.first().map_or(DType::F32, |(_, b)| b.dtype()));
    }
    if head_dim > ATTENTION_MAX_HEAD_DIM {
        return Err(Error::Invalid(format!(
            "{what}: head dimension {head_dim} exceeds the GPU kernel's limit of \
             {ATTENTION_MAX_HEAD_DIM} (use more heads, or the CPU)"
        )));
    }
    if seq.div_ceil(ATTENTION_TILE) > MAX_GROUPS {
        return Err(Error::Shape(format!(
            "{what}: sequence length {seq} needs more than {MAX_GROUPS} workgroups of {ATTENTION_TILE} rows"
        )));
    }
    let dtype = super::half::float_operands(what, operands)?;
    check_attention_lengths(what, operands, d)?;
    Ok(dtype)
}

/// The build of `attention.wgsl` for tensors of `dtype` (f32, or f16 with f32 arithmetic).
fn shader(dtype: DType) -> &'static Shader {
    match dtype {
        DType::F16 => &super::half::ATTENTION_F16_SHADER,
        _ => &ATTENTION_SHADER,
    }
}

/// How q, k and v (and their gradients, and the output) are laid out: three `[heads, seq,
/// head_dim]` buffers, or one buffer `[batch, seq, 3, heads, head_dim]` packed per position,
/// bound three times, with the output `[batch, seq, heads, head_dim]`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Qkv {
    Separate,
    /// packed, with this many heads per batch entry
    Packed(usize),
}

impl Qkv {
    /// The shader's `part`, `group`, `qkv_row` and `o_row` (its header's layout table): where
    /// K starts in the buffer bound as k (V at twice it), heads per batch entry, and the
    /// elements between one position's row and the next in q, k, v and in o.
    fn layout_words(self, d: AttentionDims) -> [u32; 4] {
        // every size here is at most the packed buffer's length, checked to fit a u32
        let dh = d.head_dim as u32;
        match self {
            Qkv::Separate => [0, 1, dh, dh],
            Qkv::Packed(heads) => {
                let row = (heads * d.head_dim) as u32;
                [row, heads as u32, 3 * row, row]
            }
        }
    }
}

/// AttnParams: seq, scale, head_base, rows, head_dim, then [`Qkv::layout_words`].
fn params(d: AttentionDims, qkv: Qkv, (head_base, rows): (usize, usize)) -> [u32; 9] {
    let [part, group, qkv_row, o_row] = qkv.layout_words(d);
    [
        d.seq as u32,
        (d.scale() as f32).to_bits(),
        head_base as u32,
        rows as u32,
        d.head_dim as u32,
        part,
        group,
        qkv_row,
        o_row,
    ]
}

/// Launches a tiled entry point, specialised for the head dimension, over
/// `(⌈seq/64⌉, heads)` workgroups, at most 65535 heads a launch. Sizes were checked by [`check`]
/// (every index fits a u32).
fn launch_tiles(
    be: &GpuBackend,
    entry: &str,
    buffers: &[&GpuBuffer],
    (d, qkv): (AttentionDims, Qkv),
    dtype: DType,
) -> Result<()> {
    debug_assert!(
        TILED_ENTRIES.contains(&entry),
        "{entry} is not in TILED_ENTRIES"
    );
    let tiles = d.seq.div_ceil(ATTENTION_TILE) as u32;
    let constants = specialisation(d.head_dim);
    for first in (0..d.heads).step_by(MAX_GROUPS) {
        let count = MAX_GROUPS.min(d.heads - first) as u32;
        let params = params(d, qkv, (first, 0));
        be.launch_specialised(
            shader(dtype),
            entry,
            &constants,
            buffers,
            &params,
            [tiles, count, 1],
        )?;
    }
    Ok(())
}

/// `NnOps::attention_forward` (entry `attention_forward`): `(o [heads, seq, head_dim],
/// lse [heads, seq])` from `q`, `k`, `v` `[heads, seq, head_dim]`.
///
/// # Errors
/// [`Error::DType`] unless every buffer is f32; [`Error::Shape`] when a length does not match the
/// sizes, a size is 0 or exceeds 32-bit indexing; [`Error::Invalid`] when `head_dim` exceeds
/// [`ATTENTION_MAX_HEAD_DIM`]; a GPU error from the launch.
pub(crate) fn attention_forward(
    be: &GpuBackend,
    q: &GpuBuffer,
    k: &GpuBuffer,
    v: &GpuBuffer,
    d: AttentionDims,
) -> Result<(GpuBuffer, GpuBuffer)> {
    let dtype = check("attention_forward", &[("q", q), ("k", k), ("v", v)], d)?;
    forward(be, [q, k, v], (d, Qkv::Separate), dtype)
}

/// `NnOps::attention_forward_packed`: [`attention_forward`] with q, k and v packed per
/// position in `qkv` `[batch, seq, 3, heads, head_dim]`, bound three times and read in place;
/// `o` is `[batch, seq, heads, head_dim]`.
///
/// # Errors
/// As [`attention_forward`], with `qkv` of `3·batch·seq·heads·head_dim` elements.
pub(crate) fn attention_forward_packed(
    be: &GpuBackend,
    qkv: &GpuBuffer,
    d: PackedAttentionDims,
) -> Result<(GpuBuffer, GpuBuffer)> {
    let dtype = check_packed("attention_forward_packed", &[("qkv", qkv)], d)?;
    forward(be, [qkv, qkv, qkv], (d.flat(), Qkv::Packed(d.heads)), dtype)
}

/// The forward launch: `(o, lse)` from the buffers bound as q, k and v.
fn forward(
    be: &GpuBackend,
    [q, k, v]: [&GpuBuffer; 3],
    layout: (AttentionDims, Qkv),
    dtype: DType,
) -> Result<(GpuBuffer, GpuBuffer)> {
    let d = layout.0;
    let o = be.alloc(d.heads * d.seq * d.head_dim, dtype)?;
    let lse = be.alloc(d.heads * d.seq, DType::F32)?;
    launch_tiles(be, "attention_forward", &[q, k, v, &o, &lse], layout, dtype)?;
    Ok((o, lse))
}

/// [`check`] for `operands` led by a packed `("qkv", …)` (`3·batch·seq·heads·head_dim`
/// elements, every index within a u32) and followed by `[batch, seq, heads, head_dim]` ones;
/// their one dtype.
fn check_packed(
    what: &str,
    operands: &[(&str, &GpuBuffer)],
    d: PackedAttentionDims,
) -> Result<DType> {
    let Some(((_, qkv), rest)) = operands.split_first() else {
        return Err(Error::Invalid(format!("{what}: no packed qkv")));
    };
    check_packed_qkv_length(what, *qkv, d)?;
    if qkv.len() > u32::MAX as usize {
        return Err(Error::Shape(format!(
            "{what}: packed q, k, v [{}, {}, 3, {}, {}] exceed the GPU kernels' 32-bit indexing",
            d.batch, d.seq, d.heads, d.head_dim
        )));
    }
    check(what, rest, d.flat())?;
    super::half::float_operands(what, operands)
}

/// `NnOps::attention_backward` (entries `attention_delta`, `attention_backward_kv`,
/// `attention_backward_q`): `(dq, dk, dv)`, each `[heads, seq, head_dim]`.
///
/// # Errors
/// As [`attention_forward`], for every operand (and `lse`, which must be `[heads, seq]`).
pub(crate) fn attention_backward(
    be: &GpuBackend,
    operands: AttentionGradOperands<'_, GpuBuffer>,
    d: AttentionDims,
) -> Result<(GpuBuffer, GpuBuffer, GpuBuffer)> {
    let AttentionGradOperands {
        q,
        k,
        v,
        o,
        lse,
        d_o,
    } = operands;
    let dtype = check(
        "attention_backward",
        &[("q", q), ("k", k), ("v", v), ("o", o), ("dO", d_o)],
        d,
    )?;
    let n = q.len();
    let (dq, dk, dv) = (
        be.alloc(n, dtype)?,
        be.alloc(n, dtype)?,
        be.alloc(n, dtype)?,
    );
    let inputs = ([q, k, v], (o, lse, d_o));
    backward(be, inputs, Grads::Separate([&dq, &dk, &dv]), d, dtype)?;
    Ok((dq, dk, dv))
}

/// `NnOps::attention_backward_packed`: [`attention_backward`] for
/// [`attention_forward_packed`] (`o` and `d_o` `[batch, seq, heads, head_dim]`), the gradient
/// packed like `qkv` (`[batch, seq, 3, heads, head_dim]`) in one buffer bound as dq, dk and
/// dv, each kernel writing only its own parts of it.
///
/// # Errors
/// As [`attention_backward`], with `qkv` of `3·batch·seq·heads·head_dim` elements.
pub(crate) fn attention_backward_packed(
    be: &GpuBackend,
    qkv: &GpuBuffer,
    (o, lse, d_o): (&GpuBuffer, &GpuBuffer, &GpuBuffer),
    d: PackedAttentionDims,
) -> Result<GpuBuffer> {
    let what = "attention_backward_packed";
    let dtype = check_packed(what, &[("qkv", qkv), ("o", o), ("dO", d_o)], d)?;
    let dqkv = be.alloc(qkv.len(), dtype)?;
    let inputs = ([qkv, qkv, qkv], (o, lse, d_o));
    backward(be, inputs, Grads::Packed(&dqkv, d.heads), d.flat(), dtype)?;
    Ok(dqkv)
}

/// The buffers bound as q, k and v, then the forward's output, its lse and the upstream
/// gradient.
type GradInputs<'a> = (
    [&'a GpuBuffer; 3],
    (&'a GpuBuffer, &'a GpuBuffer, &'a GpuBuffer),
);

/// Where the backward writes: three gradient buffers, or one buffer packed per position
/// `[batch, seq, 3, heads, head_dim]` (with this many heads per batch entry).
enum Grads<'a> {
    Separate([&'a GpuBuffer; 3]),
    Packed(&'a GpuBuffer, usize),
}

/// The backward launches into `grads`: `attention_delta`, then `attention_backward_kv` into
/// dk and dv, or `attention_backward_kv_packed` into the packed buffer (bound once per kernel),
/// then `attention_backward_q`.
fn backward(
    be: &GpuBackend,
    ([q, k, v], (o, lse, d_o)): GradInputs<'_>,
    grads: Grads<'_>,
    d: AttentionDims,
    dtype: DType,
) -> Result<()> {
    const WHAT: &str = "attention_backward";
    let rows = d.heads * d.seq; // ≤ heads·seq·head_dim, checked to fit a u32
    if lse.dtype() != DType::F32 {
        return Err(Error::DType(format!(
            "{WHAT}: lse must be f32 on the GPU, got {}",
            lse.dtype()
        )));
    }
    check_lse_length(WHAT, lse, d)?;
    let qkv = match grads {
        Grads::Separate(_) => Qkv::Separate,
        Grads::Packed(_, heads) => Qkv::Packed(heads),
    };
    let delta = be.alloc(rows, DType::F32)?;
    be.launch(
        shader(dtype),
        "attention_delta",
        &[o, d_o, &delta],
        &params(d, qkv, (0, rows)),
        grid_1d(rows, 256)?,
    )?;
    let layout = (d, qkv);
    let dq = match grads {
        Grads::Separate([dq, dk, dv]) => {
            let buffers = [q, k, v, d_o, lse, &delta, dk, dv];
            launch_tiles(be, "attention_backward_kv", &buffers, layout, dtype)?;
            dq
        }
        Grads::Packed(dqkv, _) => {
            let buffers = [q, k, v, d_o, lse, &delta, dqkv];
            launch_tiles(be, "attention_backward_kv_packed", &buffers, layout, dtype)?;
            dqkv
        }
    };
    launch_tiles(
        be,
        "attention_backward_q",
        &[q, k, v, d_o, lse, &delta, dq],
        layout,
        dtype,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shader parses and validates, and has the four entry points the launchers name.
    #[test]
    fn shader_parses_and_validates() {
        let (module, _) = super::super::kernels::validated_module(ATTENTION_SHADER.source);
        let names: Vec<&str> = module
            .entry_points
            .iter()
            .map(|e| e.name.as_str())
            .collect();
        for entry in [
            "attention_forward",
            "attention_delta",
            "attention_backward_kv",
            "attention_backward_q",
        ] {
            assert!(
                names.contains(&entry),
                "missing entry point {entry}: {names:?}"
            );
        }
    }
}
