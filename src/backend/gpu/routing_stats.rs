//! Launcher of `shaders/routing_stats.wgsl`, the GPU end of `RoutingOps::routing_stats`: one
//! training step's routing statistics (the distribution's column sums, the counts per expert,
//! the entropy sum, the logits' square sum and largest magnitude) added into a window's sums in
//! one workgroup, one dispatch per MoE layer and step, with nothing read back. The operands are
//! checked first (`check_routing_stats`: an [`crate::Error`] naming them, never a wgpu
//! validation error).

use super::kernels::{Shader, u32_param};
use super::{GpuBackend, GpuBuffer};
use crate::backend::RoutingStatsDims;
use crate::backend::checks::check_routing_stats;
use crate::{DType, Result};

/// The kernel of `shaders/routing_stats.wgsl`.
pub(crate) static ROUTING_STATS_SHADER: Shader = Shader {
    name: "routing_stats",
    builtin: true,
    source: include_str!("../../../shaders/routing_stats.wgsl"),
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
    ];
    let out = be.alloc(dims.out_len(), DType::F32)?;
    // without a window to add to, binding 1 is `probs` again (never read)
    let acc = acc.unwrap_or(probs);
    be.launch(
        &ROUTING_STATS_SHADER,
        "routing_stats",
        &[acc, probs, logits, routed, kept, &out],
        &params,
        [1, 1, 1],
    )?;
    Ok(out)
}
