//! Device-neutral argument checks of the fused primitives (cross-entropy, layer norm,
//! attention, SwiGLU, the rotary embedding, the grouped matmul's bias, convolution and pooling): buffer lengths against the
//! geometry they are called with, so that a mismatch is an [`crate::Error`] before any kernel
//! indexes a buffer. Both backends call these, generic over [`Operand`], so each message is
//! written once; what only one device needs (the GPU's f32-only dtype, its 32-bit indexing and
//! workgroup limits) stays in that device's launcher.

use super::{cpu::CpuBuffer, gpu::GpuBuffer};
use crate::backend::{
    AttentionDims, Conv2dDims, GroupedMatmulDims, LayerNormDims, PackedAttentionDims, RotaryDims,
    RoutingStatsDims, SwiGluDims,
};
use crate::{DType, Error, Result};
use std::fmt::Debug;

/// What a check sees of a device buffer: its length and dtype (never its values).
pub(crate) trait Operand {
    /// Elements in the buffer.
    fn len(&self) -> usize;
    /// The buffer's dtype.
    fn dtype(&self) -> DType;
}

impl Operand for CpuBuffer {
    fn len(&self) -> usize {
        CpuBuffer::len(self)
    }
    fn dtype(&self) -> DType {
        CpuBuffer::dtype(self)
    }
}

impl Operand for GpuBuffer {
    fn len(&self) -> usize {
        GpuBuffer::len(self)
    }
    fn dtype(&self) -> DType {
        GpuBuffer::dtype(self)
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

/// Checks a packed `qkv` (`NnOps::attention_forward_packed`): `[batch, seq, 3, heads,
/// head_dim]`, q, k and v side by side at each position.
pub(crate) fn check_packed_qkv_length<B: Operand>(
    what: &str,
    qkv: &B,
    dims: PackedAttentionDims,
) -> Result<()> {
    let PackedAttentionDims {
        batch,
        heads,
        seq,
        head_dim,
    } = dims;
    let n = batch
        .checked_mul(heads)
        .and_then(|bh| bh.checked_mul(seq))
        .and_then(|n| n.checked_mul(head_dim))
        .and_then(|n| n.checked_mul(3));
    if n.is_none() {
        return Err(Error::Shape(format!(
            "{what}: packed q, k, v [{batch}, {seq}, 3, {heads}, {head_dim}] overflow the address space"
        )));
    }
    // the sizes (each at least 1), with no operand
    check_attention_lengths::<B>(what, &[], dims.flat())?;
    if n != Some(qkv.len()) {
        return Err(Error::Shape(format!(
            "{what}: qkv holds {} elements, expected [{batch}, {seq}, 3, {heads}, {head_dim}]",
            qkv.len()
        )));
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

/// Checks the operands of the mean squared error: `x` and `t` (and the upstream gradient `g`,
/// when given) float of one dtype, `x` and `t` of one length ≥ 1 and `g` of one element.
pub(crate) fn check_mse<B: Operand>(what: &str, x: &B, t: &B, g: Option<&B>) -> Result<()> {
    let float = |d: DType| matches!(d, DType::F32 | DType::F64 | DType::F16);
    let dtypes_match = x.dtype() == t.dtype() && g.is_none_or(|g| g.dtype() == x.dtype());
    if !float(x.dtype()) || !dtypes_match {
        return Err(Error::DType(format!(
            "{what}: prediction and target must be float of one dtype (the gradient too), got \
             {}, {}{}",
            x.dtype(),
            t.dtype(),
            g.map(|g| format!(" and {}", g.dtype())).unwrap_or_default()
        )));
    }
    if x.len() != t.len() || x.len() == 0 {
        return Err(Error::Shape(format!(
            "{what}: prediction of {} values and target of {} (equal and ≥ 1)",
            x.len(),
            t.len()
        )));
    }
    if let Some(g) = g.filter(|g| g.len() != 1) {
        return Err(Error::Shape(format!(
            "{what}: the upstream gradient holds {} values, expected one",
            g.len()
        )));
    }
    Ok(())
}

/// Checks that cross-entropy logits are `[rows, classes]` for `rows` targets, sizes ≥ 1.
pub(crate) fn check_cross_entropy_shape<B: Operand>(
    what: &str,
    logits: &B,
    targets: &B,
    classes: usize,
) -> Result<()> {
    let rows = targets.len();
    if rows == 0 || classes == 0 || rows.checked_mul(classes) != Some(logits.len()) {
        return Err(Error::Shape(format!(
            "{what}: logits of {} values are not [{rows} rows, {classes} classes] (sizes ≥ 1)",
            logits.len()
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
    check_cross_entropy_shape(what, logits, targets, classes)?;
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

/// Checks a SwiGLU's operands: `[rows, 2·half]` ones (the input and its gradient) and
/// `[rows, half]` ones (the output's gradient), and that no size is zero.
pub(crate) fn check_swiglu_lengths<B: Operand>(
    what: &str,
    inputs: &[(&str, &B)],
    outputs: &[(&str, &B)],
    dims: SwiGluDims,
) -> Result<()> {
    let SwiGluDims { rows, half } = dims;
    let n = rows
        .checked_mul(half)
        .and_then(|n| n.checked_mul(2))
        .filter(|&n| n > 0)
        .ok_or_else(|| {
            Error::Shape(format!(
                "{what}: [{rows}, 2·{half}] must have sizes of at least 1 and fit in memory"
            ))
        })?;
    let mut operands: Vec<(&str, &B, usize)> = inputs.iter().map(|&(w, b)| (w, b, n)).collect();
    operands.extend(outputs.iter().map(|&(w, b)| (w, b, n / 2)));
    check_lengths(what, &operands, &dims)
}

/// Checks a rotary embedding's operands: `x` of `batch·seq·head_dim` elements, the tables of
/// `table_rows·head_dim`, an even head width, `seq ≤ table_rows` and no zero size.
pub(crate) fn check_rotary_lengths<B: Operand>(
    what: &str,
    x: &B,
    (cos, sin): (&B, &B),
    dims: RotaryDims,
) -> Result<()> {
    let RotaryDims {
        batch,
        seq,
        head_dim,
        table_rows,
        ..
    } = dims;
    let n = batch
        .checked_mul(seq)
        .and_then(|n| n.checked_mul(head_dim))
        .filter(|&n| n > 0);
    let table = table_rows.checked_mul(head_dim);
    let (Some(n), Some(table)) = (n, table) else {
        return Err(Error::Shape(format!(
            "{what}: {dims:?} must have sizes of at least 1 and fit in memory"
        )));
    };
    if !head_dim.is_multiple_of(2) || seq > table_rows {
        return Err(Error::Shape(format!(
            "{what}: {dims:?} needs an even head width and at most table_rows positions"
        )));
    }
    check_lengths(
        what,
        &[("x", x, n), ("cos", cos, table), ("sin", sin, table)],
        &dims,
    )
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

/// Checks a dense product's bias (`MatmulOps::matmul`): `[n]`, of the dtype `b` (the weight)
/// has.
pub(crate) fn check_matmul_bias<B: Operand>(
    what: &str,
    bias: Option<&B>,
    n: usize,
    b: DType,
) -> Result<()> {
    let Some(bias) = bias else { return Ok(()) };
    if bias.len() != n {
        return Err(Error::Shape(format!(
            "{what}: bias holds {} elements, expected [{n}] (one per output column)",
            bias.len()
        )));
    }
    if bias.dtype() != b {
        return Err(Error::DType(format!(
            "{what}: the bias is {}, the weight {b}: they must match",
            bias.dtype()
        )));
    }
    Ok(())
}

/// The error of a binary kernel (`what` is the op, `{op:?}` or `matmul`) given operands that
/// are not two floats of one dtype.
pub(crate) fn binary_dtype_error(what: &str, a: DType, b: DType) -> Error {
    Error::DType(format!(
        "{what} needs two float tensors of one dtype, got {a} and {b}"
    ))
}

/// The error of `where_cond` given operands that are not three floats of one dtype.
pub(crate) fn where_dtype_error(cond: DType, a: DType, b: DType) -> Error {
    Error::DType(format!(
        "where needs a condition and two values of one float dtype, got {cond}, {a} and {b}"
    ))
}

/// Checks the slots of a combine given each output's rows (`RoutingOps::weighted_scatter`):
/// `slots` I32 values, `len·k` of them, one per row of `rows`.
pub(crate) fn check_slots(
    what: &str,
    dtype: DType,
    slots: usize,
    (len, k): (usize, usize),
    rows: usize,
) -> Result<()> {
    if dtype != DType::I32 {
        return Err(Error::DType(format!(
            "{what}: slots must be i32, got {dtype}"
        )));
    }
    if len.checked_mul(k) != Some(rows) || slots != rows {
        return Err(Error::Shape(format!(
            "{what}: {slots} slots listing {k} rows for each of {len} outputs do not cover the \
             {rows} rows once each"
        )));
    }
    Ok(())
}

/// Checks a combine's slot order (each row's slot, the slots' inverse): I32 `[rows]`, given only
/// with slots and weights (which it says are per slot).
pub(crate) fn check_slot_order(
    what: &str,
    order: Option<(DType, usize)>,
    has_slots: bool,
    has_weights: bool,
    rows: usize,
) -> Result<()> {
    let Some((dtype, len)) = order else {
        return Ok(());
    };
    if !has_slots || !has_weights {
        return Err(Error::Invalid(format!(
            "{what}: a slot order (weights per slot) needs slots and weights"
        )));
    }
    if dtype != DType::I32 || len != rows {
        return Err(Error::Shape(format!(
            "{what}: the slot order must be i32 [{rows}], one slot per row, got {dtype} of {len}"
        )));
    }
    Ok(())
}

/// Checks a combine's addend (the residual `RoutingOps::weighted_scatter` adds to its output):
/// the output's dtype and `out_len` values.
pub(crate) fn check_addend(
    what: &str,
    addend: Option<(DType, usize)>,
    out: (DType, usize),
) -> Result<()> {
    match addend {
        Some(a) if a != out => Err(Error::Shape(format!(
            "{what}: the addend must be {} of {} values, the output's dtype and size, got {} of {}",
            out.0, out.1, a.0, a.1
        ))),
        _ => Ok(()),
    }
}

/// The error of an index operand that is not I32.
pub(crate) fn indices_dtype_error(what: &str, got: DType) -> Error {
    Error::DType(format!("{what}: indices must be i32, got {got}"))
}

/// Checks that every part of a concatenation has the dtype of the first; returns it.
pub(crate) fn check_concat_dtypes<B: Operand>(parts: &[&B]) -> Result<DType> {
    let dtype = parts.first().map(|p| p.dtype()).unwrap_or(DType::F32);
    if parts.iter().any(|p| p.dtype() != dtype) {
        return Err(Error::DType(
            "concat: all tensors must share one dtype".into(),
        ));
    }
    Ok(dtype)
}

/// Checks that an optimizer step's buffers (parameter, gradient, state) have one length.
pub(crate) fn check_same_lengths<B: Operand>(what: &str, bufs: &[&B]) -> Result<()> {
    let lens: Vec<usize> = bufs.iter().map(|b| b.len()).collect();
    if lens.iter().any(|&l| l != lens[0]) {
        return Err(Error::Shape(format!(
            "{what}: buffers of lengths {lens:?} must be equal"
        )));
    }
    Ok(())
}

/// The error of a gradient scale that is not one value (a factor) or two (a factor and the
/// steps a loss scale skipped).
pub(crate) fn grad_scale_length_error(len: usize) -> Error {
    Error::Shape(format!(
        "gradient scale must hold one value (a factor) or two (a factor and the steps skipped), it holds {len}"
    ))
}

/// Checks a grouped convolution's `image_bank`: required when there is more than one weight
/// bank, I32, one entry per image.
pub(crate) fn check_image_bank<B: Operand>(
    what: &str,
    image_bank: Option<&B>,
    d: &Conv2dDims,
) -> Result<()> {
    match image_bank {
        None if d.banks != 1 => Err(Error::Invalid(format!(
            "{what}: {} weight banks need an image_bank index",
            d.banks
        ))),
        None => Ok(()),
        Some(b) if b.dtype() != DType::I32 => Err(Error::DType(format!(
            "{what}: image_bank must be i32, got {}",
            b.dtype()
        ))),
        Some(b) if b.len() != d.batch => Err(Error::Shape(format!(
            "{what}: image_bank holds {} entries for {} images",
            b.len(),
            d.batch
        ))),
        Some(_) => Ok(()),
    }
}

/// The error of a max-pooling backward called without the forward's argmax.
pub(crate) fn missing_argmax_error(what: &str) -> Error {
    Error::Invalid(format!(
        "{what}: max pooling needs the argmax of its forward pass"
    ))
}

/// Checks a dispatch plan's sizes: at least one expert, `assignments` indexable by an i32.
pub(crate) fn check_dispatch_sizes(what: &str, experts: usize, assignments: usize) -> Result<()> {
    if experts == 0 || i32::try_from(assignments).is_err() {
        return Err(Error::Shape(format!(
            "{what}: needs at least one expert and fewer than 2³¹ assignments, got {experts} experts, {assignments} assignments"
        )));
    }
    Ok(())
}

/// Checks a top-k gate's operands (`RoutingOps::topk_gate`): the sizes as
/// [`super::check_gate_sizes`] wants them, and the logits and the selection scores, both
/// `[rows, n]`.
pub(crate) fn check_topk_gate<B: Operand>(
    what: &str,
    logits: &B,
    scores: &B,
    (rows, n, k): (usize, usize, usize),
) -> Result<()> {
    super::check_gate_sizes(what, rows, n, k)?;
    super::check_lengths(
        what,
        &[
            ("logits", logits.len(), rows * n),
            ("scores", scores.len(), rows * n),
        ],
    )
}

/// Checks one step's routing statistics (`RoutingOps::routing_stats`): every operand f32, `probs`
/// `[rows, cols]`, the logits of `dims.logits` values, `routed` and `kept` of `dims.experts`,
/// and the window's sums, when given, of [`RoutingStatsDims::out_len`]; every size ≥ 1 and the
/// GPU kernel's indices in 32 bits.
pub(crate) fn check_routing_stats<B: Operand>(
    what: &str,
    acc: Option<&B>,
    (probs, logits): (&B, &B),
    (routed, kept): (&B, &B),
    dims: RoutingStatsDims,
) -> Result<()> {
    let mut operands = vec![
        ("probs", probs),
        ("logits", logits),
        ("routed", routed),
        ("kept", kept),
    ];
    operands.extend(acc.map(|a| ("the window's sums", a)));
    if let Some((name, b)) = operands.iter().find(|(_, b)| b.dtype() != DType::F32) {
        return Err(Error::DType(format!(
            "{what}: {name} must be f32 (the statistics are summed in f32), got {}",
            b.dtype()
        )));
    }
    let out_len = dims.out_len();
    if [dims.rows, dims.cols, dims.logits, dims.experts].contains(&0) {
        return Err(Error::Shape(format!(
            "{what}: needs at least one token, one column, one logit and one expert, got {dims:?}"
        )));
    }
    if dims
        .rows
        .checked_mul(dims.cols)
        .is_none_or(|n| n > u32::MAX as usize)
        || dims.logits > u32::MAX as usize
        || out_len > u32::MAX as usize
    {
        return Err(Error::Shape(format!(
            "{what}: {dims:?} is past 2³² values in one operand"
        )));
    }
    let mut lengths = vec![
        ("probs", probs.len(), dims.rows * dims.cols),
        ("logits", logits.len(), dims.logits),
        ("routed", routed.len(), dims.experts),
        ("kept", kept.len(), dims.experts),
    ];
    lengths.extend(acc.map(|a| ("the window's sums", a.len(), out_len)));
    super::check_lengths(what, &lengths)
}

/// Checks the Switch balance loss' operands (`RoutingOps::balance_loss`): `probs [rows, cols]`
/// and `counts [cols]` float of one dtype, sizes ≥ 1.
pub(crate) fn check_balance_loss<B: Operand>(
    what: &str,
    probs: &B,
    counts: &B,
    (rows, cols): (usize, usize),
) -> Result<()> {
    if !matches!(probs.dtype(), DType::F32 | DType::F64) || counts.dtype() != probs.dtype() {
        return Err(Error::DType(format!(
            "{what}: the router's distribution and the counts must be f32 or f64 of one dtype, \
             got {} and {}",
            probs.dtype(),
            counts.dtype()
        )));
    }
    if rows == 0 || cols == 0 || rows.checked_mul(cols).is_none_or(|n| n > u32::MAX as usize) {
        return Err(Error::Shape(format!(
            "{what}: needs at least one token and one expert, and fewer than 2³² probabilities, \
             got {rows} tokens × {cols} experts"
        )));
    }
    super::check_lengths(
        what,
        &[
            ("the router's distribution", probs.len(), rows * cols),
            ("the counts per expert", counts.len(), cols),
        ],
    )
}

/// Checks a row softmax's input (`NnOps::softmax_forward`): `rows, n ≥ 1` and `x` of `rows·n`
/// elements.
pub(crate) fn check_softmax_forward<B: Operand>(
    what: &str,
    x: &B,
    rows: usize,
    n: usize,
) -> Result<()> {
    super::check_gate_sizes(what, rows, n, 1)?;
    super::check_lengths(what, &[("x", x.len(), rows * n)])
}

/// Checks a softmax backward's operands (`NnOps::softmax_backward`): `rows, n ≥ 1`, and the
/// output `y` and its gradient `dy`, both `[rows, n]`.
pub(crate) fn check_softmax_backward<B: Operand>(
    what: &str,
    y: &B,
    dy: &B,
    rows: usize,
    n: usize,
) -> Result<()> {
    super::check_gate_sizes(what, rows, n, 1)?;
    super::check_lengths(
        what,
        &[("y", y.len(), rows * n), ("dy", dy.len(), rows * n)],
    )
}

/// Checks a dispatch plan's operands (`RoutingOps::dispatch_plan`): `expert`, `weight`, `rank`
/// and `valid` as long as `token`, and the sizes ([`check_dispatch_sizes`]). Returns the number
/// of assignments.
pub(crate) fn check_dispatch_plan<B: Operand>(
    what: &str,
    token: &B,
    [expert, weight, rank, valid]: [&B; 4],
    experts: usize,
) -> Result<usize> {
    let a = token.len();
    super::check_lengths(
        what,
        &[
            ("expert", expert.len(), a),
            ("weight", weight.len(), a),
            ("rank", rank.len(), a),
            ("valid", valid.len(), a),
        ],
    )?;
    check_dispatch_sizes(what, experts, a)?;
    Ok(a)
}

#[cfg(test)]
mod tests {
    use crate::backend::cpu::CpuBackend;
    use crate::backend::{BufferOps, HostData, NnOps, RoutingOps};

    fn f32s(be: &CpuBackend, n: usize) -> crate::backend::cpu::CpuBuffer {
        be.upload(&HostData::F32(vec![0.5; n])).unwrap()
    }
    fn i32s(be: &CpuBackend, n: usize) -> crate::backend::cpu::CpuBuffer {
        be.upload(&HostData::I32(vec![0; n])).unwrap()
    }

    /// Each bundled check names the operand whose length is off (the GPU launchers call the
    /// same functions; `gpu_parity_fused` runs their good paths).
    #[test]
    fn the_bundled_routing_checks_name_the_operand_at_fault() {
        let be = CpuBackend;
        let (a, n) = (6, 3);
        let (w, r, v) = (f32s(&be, a), f32s(&be, a), f32s(&be, a - 1));
        let err = be
            .dispatch_plan(&i32s(&be, a), &i32s(&be, a), (&w, &r, &v), n, None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("valid holds 5 elements, expected 6"), "{err}");

        let err = be
            .softmax_backward((&f32s(&be, 2 * n), &f32s(&be, 2 * n + 1)), None, 2, n)
            .unwrap_err()
            .to_string();
        assert!(err.contains("dy holds 7 elements, expected 6"), "{err}");

        let (logits, scores) = (f32s(&be, 2 * n), f32s(&be, 2 * n - 1));
        let err = be
            .topk_gate(&logits, Some(&scores), 2, n, 2, true)
            .unwrap_err()
            .to_string();
        assert!(err.contains("scores holds 5 elements, expected 6"), "{err}");
        let err = be
            .topk_gate(&logits, None, 2, n, 4, true)
            .unwrap_err()
            .to_string();
        assert!(err.contains("1 ≤ k ≤ n"), "{err}");
    }
}
