//! Launchers of `shaders/router_sums.wgsl`, one workgroup each: [`routing_stats`], the GPU end
//! of `RoutingOps::routing_stats` (one training step's routing statistics, the distribution's
//! column sums, the counts per expert, the entropy sum, the logits' square sum and largest
//! magnitude, added into a window's sums: one dispatch per MoE layer and step), and
//! [`balance_loss`], the Switch balance loss' forward. Nothing is read back. The operands are
//! checked first (`check_routing_stats`, `check_balance_loss`: an [`crate::Error`] naming them,
//! never a wgpu validation error).

use super::half::expect_f32;
use super::kernels::{Shader, u32_param};
use super::{GpuBackend, GpuBuffer};
use crate::backend::RoutingStatsDims;
use crate::backend::checks::{check_balance_loss, check_routing_stats};
use crate::{DType, Result};

/// The kernels of `shaders/router_sums.wgsl`.
pub(crate) static ROUTER_SUMS_SHADER: Shader = Shader {
    name: "router_sums",
    builtin: true,
    source: include_str!("../../../shaders/router_sums.wgsl"),
};

/// `RoutingOps::routing_stats`: the new sums `[cols + 2·experts + 3]`.
pub(crate) fn routing_stats(
    be: &GpuBackend,
    acc: Option<&GpuBuffer>,
    (probs, logits): (&GpuBuffer, &GpuBuffer),
    (routed, kept): (&GpuBuffer, &GpuBuffer),
    dims: RoutingStatsDims,
) -> Result<GpuBuffer> {
    const WHAT: &str = "routing statistics";
    check_routing_stats(WHAT, acc, (probs, logits), (routed, kept), dims)?;
    let params = [
        u32_param(dims.rows, "routing statistics tokens")?,
        u32_param(dims.cols, "routing statistics columns")?,
        u32_param(dims.logits, "routing statistics logits")?,
        u32_param(dims.experts, "routing statistics experts")?,
        u32::from(acc.is_some()),
        0,
    ];
    let out = be.alloc(dims.out_len(), DType::F32)?;
    // without a window to add to, binding 1 is `probs` again (never read)
    let acc = acc.unwrap_or(probs);
    be.launch(
        &ROUTER_SUMS_SHADER,
        "routing_stats",
        &[acc, probs, logits, routed, kept, &out],
        &params,
        [1, 1, 1],
    )?;
    Ok(out)
}

/// `RoutingOps::balance_loss`: `(loss [1], coef [cols])`.
pub(crate) fn balance_loss(
    be: &GpuBackend,
    probs: &GpuBuffer,
    counts: &GpuBuffer,
    (rows, cols): (usize, usize),
    scale: f64,
) -> Result<(GpuBuffer, GpuBuffer)> {
    const WHAT: &str = "balance_loss";
    check_balance_loss(WHAT, probs, counts, (rows, cols))?;
    expect_f32(
        WHAT,
        &[("the router's distribution", probs), ("the counts", counts)],
    )?;
    let params = [
        u32_param(rows, "balance loss tokens")?,
        u32_param(cols, "balance loss experts")?,
        0,
        0,
        0,
        (scale as f32).to_bits(),
    ];
    let loss = be.alloc(1, DType::F32)?;
    let coef = be.alloc(cols, DType::F32)?;
    // bindings 1, 3 and 5 are the statistics' operands, unread here
    be.launch(
        &ROUTER_SUMS_SHADER,
        "balance_loss",
        &[probs, probs, probs, counts, probs, &loss, &coef],
        &params,
        [1, 1, 1],
    )?;
    Ok((loss, coef))
}
