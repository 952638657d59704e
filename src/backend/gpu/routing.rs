//! Launchers of `shaders/routing.wgsl`, the MoE routing kernels: [`topk_gate`] (a top-k router's
//! softmax, selection and normalisation in one dispatch), [`topk_gate_backward`] and
//! [`softmax_backward`] (its backward rules, one dispatch each), [`softmax_forward`] (the row
//! softmax of `Tensor::softmax`, by the gate's own softmax code), and [`dispatch_plan`] (the
//! whole dispatch plan of an MoE layer, where the composed version took about fifty
//! dispatches): up to [`PLAN_SORT_MAX`] assignments in two, `plan_sort` and `plan_rows`; a
//! larger dropless plan by a counting sort in three ([`plan_by_counting`]); any other by one
//! stable sort of `sort.wgsl` on three-word keys ([`plan_by_sorting`]), since `plan_sort`'s work
//! grows with the square of the assignments.

use super::half::expect_f32;
use super::kernels::{Shader, grid_1d, u32_param};
use super::sort::{KEY_WORDS, sort_key_words};
use super::{GpuBackend, GpuBuffer};
use crate::backend::RoutingOps;
use crate::backend::checks::{
    check_dispatch_plan, check_softmax_backward, check_softmax_forward, check_topk_gate,
};
use crate::backend::{PlanBuffers, check_gate_backward_lengths, check_gate_sizes};
use crate::{DType, Error, Result};

/// The kernels of `shaders/routing.wgsl`.
pub(crate) static ROUTING: Shader = Shader {
    name: "routing",
    builtin: true,
    source: include_str!("../../../shaders/routing.wgsl"),
};

/// Rows per workgroup of the per-row kernels (`topk_gate`, its backward, `softmax_rows`,
/// `softmax_backward`).
const ROW_WG: u32 = 64;
/// Invocations per workgroup of the plan kernels.
const PLAN_WG: u32 = 256;

/// The most assignments whose dispatch plan `plan_sort` orders (O(A²) comparisons, in one
/// dispatch); a larger plan is ordered by one stable sort of three-word keys (O(A log² A),
/// about log₂A dispatches). On an H200, `plan_sort` took 0.29 ms for 1536 assignments and
/// about 130 ms for 262,144 (docs/benchmarks.md).
pub(crate) const PLAN_SORT_MAX: usize = 1024;

/// An error unless every buffer holds i32 indices.
fn expect_i32(what: &str, bufs: &[(&str, &GpuBuffer)]) -> Result<()> {
    match bufs.iter().find(|(_, b)| b.dtype() != DType::I32) {
        None => Ok(()),
        Some((name, b)) => Err(Error::DType(format!(
            "{what}: {name} must hold i32 indices, got {}",
            b.dtype()
        ))),
    }
}

/// `RoutingOps::topk_gate` (entry `topk_gate`): returns `(probs, idx, weights)`.
pub(crate) fn topk_gate(
    be: &GpuBackend,
    logits: &GpuBuffer,
    scores: Option<&GpuBuffer>,
    (rows, n, k): (usize, usize, usize),
    renormalise: bool,
) -> Result<(GpuBuffer, GpuBuffer, GpuBuffer)> {
    const WHAT: &str = "topk_gate";
    let scores = scores.unwrap_or(logits);
    check_topk_gate(WHAT, logits, scores, (rows, n, k))?;
    expect_f32(WHAT, &[("logits", logits), ("scores", scores)])?;
    let probs = be.alloc(rows * n, DType::F32)?;
    let idx = be.alloc(rows * k, DType::I32)?;
    let weights = be.alloc(rows * k, DType::F32)?;
    let params = [
        u32_param(rows, "topk_gate: rows")?,
        u32_param(n, "topk_gate: experts")?,
        u32_param(k, "topk_gate: k")?,
        renormalise as u32,
    ];
    u32_param(rows * n, "topk_gate: rows × experts")?;
    be.launch(
        &ROUTING,
        "topk_gate",
        &[logits, scores, &probs, &idx, &weights],
        &params,
        grid_1d(rows, ROW_WG)?,
    )?;
    Ok((probs, idx, weights))
}

/// An error unless `pending` (when given) is f32 `[rows·n]`, the gradient a backward kernel adds
/// its own into.
fn check_pending(what: &str, pending: Option<&GpuBuffer>, len: usize) -> Result<()> {
    match pending {
        Some(p) if p.dtype() != DType::F32 || p.len() != len => Err(Error::Shape(format!(
            "{what}: the pending gradient must be f32 of {len} values, got {} of {}",
            p.dtype(),
            p.len()
        ))),
        _ => Ok(()),
    }
}

/// `RoutingOps::topk_gate_backward` (entry `topk_gate_backward`).
pub(crate) fn topk_gate_backward(
    be: &GpuBackend,
    (weights, idx, d_weights): (&GpuBuffer, &GpuBuffer, &GpuBuffer),
    probs: Option<&GpuBuffer>,
    pending: Option<&GpuBuffer>,
    (rows, n, k): (usize, usize, usize),
) -> Result<GpuBuffer> {
    const WHAT: &str = "topk_gate backward";
    check_gate_sizes(WHAT, rows, n, k)?;
    let p = probs.unwrap_or(weights);
    expect_f32(
        WHAT,
        &[("weights", weights), ("d_weights", d_weights), ("probs", p)],
    )?;
    expect_i32(WHAT, &[("idx", idx)])?;
    check_gate_backward_lengths(
        WHAT,
        [weights.len(), idx.len(), d_weights.len(), p.len()],
        probs.is_some(),
        (rows, n, k),
    )?;
    check_pending(WHAT, pending, rows * n)?;
    let out = be.alloc(rows * n, DType::F32)?;
    let params = [
        u32_param(rows, "topk_gate backward: rows")?,
        u32_param(n, "topk_gate backward: experts")?,
        u32_param(k, "topk_gate backward: k")?,
        probs.is_some() as u32,
        pending.is_some() as u32,
    ];
    be.launch(
        &ROUTING,
        "topk_gate_backward",
        &[weights, idx, d_weights, p, &out, pending.unwrap_or(p)],
        &params,
        grid_1d(rows, ROW_WG)?,
    )?;
    Ok(out)
}

/// `NnOps::softmax_forward` (entry `softmax_rows`).
pub(crate) fn softmax_forward(
    be: &GpuBackend,
    x: &GpuBuffer,
    rows: usize,
    n: usize,
) -> Result<GpuBuffer> {
    const WHAT: &str = "softmax";
    check_softmax_forward(WHAT, x, rows, n)?;
    expect_f32(WHAT, &[("x", x)])?;
    u32_param(rows * n, "softmax: rows × row length")?;
    let out = be.alloc(rows * n, DType::F32)?;
    let params = [
        u32_param(rows, "softmax: rows")?,
        u32_param(n, "softmax: row length")?,
        0,
        0,
    ];
    // binding 2 is not used by this entry point
    be.launch(
        &ROUTING,
        "softmax_rows",
        &[x, x, &out],
        &params,
        grid_1d(rows, ROW_WG)?,
    )?;
    Ok(out)
}

/// `NnOps::softmax_backward` (entry `softmax_backward`).
pub(crate) fn softmax_backward(
    be: &GpuBackend,
    (y, dy): (&GpuBuffer, &GpuBuffer),
    pending: Option<&GpuBuffer>,
    rows: usize,
    n: usize,
) -> Result<GpuBuffer> {
    const WHAT: &str = "softmax backward";
    check_softmax_backward(WHAT, y, dy, rows, n)?;
    expect_f32(WHAT, &[("y", y), ("dy", dy)])?;
    check_pending(WHAT, pending, rows * n)?;
    let out = be.alloc(rows * n, DType::F32)?;
    let params = [
        u32_param(rows, "softmax backward: rows")?,
        u32_param(n, "softmax backward: row length")?,
        0,
        0,
        pending.is_some() as u32,
    ];
    // bindings 2 and 4 are not used by this entry point (nor 6 without a pending gradient)
    be.launch(
        &ROUTING,
        "softmax_backward",
        &[y, y, dy, y, &out, pending.unwrap_or(y)],
        &params,
        grid_1d(rows, ROW_WG)?,
    )?;
    Ok(out)
}

/// The most counts (`(experts + 1) · ⌈A/256⌉`) a dropless plan may have for
/// [`plan_by_counting`]: one workgroup scans them, 1024 to an invocation at most (and a key
/// must fit in the 24 bits `plan_chunk_counts` keeps for it); a plan with more is sorted.
pub(crate) const COUNT_TABLE_MAX: usize = 1 << 18;

// `plan_keys` writes three words per assignment
const _: () = assert!(KEY_WORDS == 3);

/// Whether a plan of `a` assignments over `n` experts is computed by [`plan_by_counting`]:
/// dropless, past [`PLAN_SORT_MAX`] and within [`COUNT_TABLE_MAX`] counts.
pub(crate) fn plans_by_counting(a: usize, n: usize, capacity: Option<usize>) -> bool {
    capacity.is_none()
        && a > PLAN_SORT_MAX
        && (n + 1).saturating_mul(a.div_ceil(PLAN_WG as usize)) <= COUNT_TABLE_MAX
}

/// The dropless plan of `params[0]` assignments by a stable counting sort: `plan_chunk_counts`
/// counts each key in each chunk of 256 assignments and ranks every assignment among the
/// earlier ones of its key in its chunk, `plan_chunk_scan` turns the counts into where each
/// (key, chunk) starts, and `plan_place` puts every assignment at its start plus its rank and
/// writes the plan's rows: order by (key, index), `plan_sort`'s order without a capacity.
fn plan_by_counting(
    be: &GpuBackend,
    (token, expert, valid): (&GpuBuffer, &GpuBuffer, &GpuBuffer),
    params: &[u32; 4],
    out: &PlanBuffers<GpuBuffer>,
) -> Result<()> {
    let (a, n) = (params[0] as usize, params[1] as usize);
    let chunks = a.div_ceil(PLAN_WG as usize);
    // the counts, then each assignment's key and its rank within its chunk in one word
    let table = be.alloc((n + 1) * chunks + a, DType::I32)?;
    be.launch(
        &ROUTING,
        "plan_chunk_counts",
        &[expert, valid, &table],
        params,
        grid_1d(a, PLAN_WG)?,
    )?;
    be.launch(
        &ROUTING,
        "plan_chunk_scan",
        &[
            &table,
            &out.offsets,
            &out.routed_per_expert,
            &out.kept_per_expert,
        ],
        params,
        [1, 1, 1],
    )?;
    be.launch(
        &ROUTING,
        "plan_place",
        &[
            &table,
            token,
            &out.order,
            &out.position,
            &out.row_token,
            &out.row_expert,
            &out.row_expert_clamped,
            &out.row_kept,
        ],
        params,
        grid_1d(a, PLAN_WG)?,
    )
}

/// The order, offsets and counts of a plan of `params[0]` assignments by one stable sort
/// (`sort.wgsl`'s words build) of the key words `plan_keys` writes, (key, rank ascending,
/// weight descending) with a capacity and (key) without, ties to the lower index: the same
/// order as `plan_sort`'s. The counts come from `plan_counts`.
fn plan_by_sorting(
    be: &GpuBackend,
    (expert, weight, rank, valid): (&GpuBuffer, &GpuBuffer, &GpuBuffer, &GpuBuffer),
    params: &[u32; 4],
    out: &PlanBuffers<GpuBuffer>,
) -> Result<GpuBuffer> {
    let (a, n) = (params[0] as usize, params[1] as usize);
    let words = be.alloc(a * KEY_WORDS, DType::I32)?;
    be.launch(
        &ROUTING,
        "plan_keys",
        &[expert, weight, rank, valid, &words],
        params,
        grid_1d(a, PLAN_WG)?,
    )?;
    let order = sort_key_words(be, &words, 1, a)?;
    be.launch(
        &ROUTING,
        "plan_counts",
        &[
            &order,
            &words,
            &out.offsets,
            &out.routed_per_expert,
            &out.kept_per_expert,
        ],
        params,
        grid_1d(n + 1, PLAN_WG)?,
    )?;
    Ok(order)
}

/// `RoutingOps::dispatch_plan`: entry `plan_sort` then `plan_rows` up to [`PLAN_SORT_MAX`]
/// assignments, else [`plan_by_counting`] when [`plans_by_counting`] says so, else
/// [`plan_by_sorting`] then `plan_rows`.
pub(crate) fn dispatch_plan(
    be: &GpuBackend,
    token: &GpuBuffer,
    expert: &GpuBuffer,
    (weight, rank, valid): (&GpuBuffer, &GpuBuffer, &GpuBuffer),
    experts: usize,
    capacity: Option<usize>,
) -> Result<PlanBuffers<GpuBuffer>> {
    const WHAT: &str = "dispatch_plan";
    expect_i32(WHAT, &[("token", token), ("expert", expert)])?;
    expect_f32(
        WHAT,
        &[("weight", weight), ("rank", rank), ("valid", valid)],
    )?;
    let a = check_dispatch_plan(WHAT, token, [expert, weight, rank, valid], experts)?;
    let n = u32_param(experts, "dispatch_plan: experts")?;
    let cap = match capacity {
        // a capacity of 2³² − 1 or more keeps every row, like none
        Some(c) => u32::try_from(c).unwrap_or(u32::MAX),
        None => u32::MAX,
    };
    // rank and weight order an expert's rows only where a capacity may drop some
    let priority = capacity.is_some() as u32;
    let params = [
        u32_param(a, "dispatch_plan: assignments")?,
        n,
        cap,
        priority,
    ];
    let i32_buf = |len: usize| be.alloc(len, DType::I32);
    let f32_buf = |len: usize| be.alloc(len, DType::F32);
    let by_counting = plans_by_counting(a, experts, capacity);
    let by_sorting = a > PLAN_SORT_MAX && !by_counting;
    let mut out = PlanBuffers {
        // the sorts make the order buffer themselves
        order: i32_buf(if by_sorting { 0 } else { a })?,
        position: i32_buf(a)?,
        row_token: i32_buf(a)?,
        row_expert: i32_buf(a)?,
        row_expert_clamped: i32_buf(a)?,
        row_kept: f32_buf(a)?,
        offsets: i32_buf(experts + 1)?,
        kept_per_expert: f32_buf(experts)?,
        routed_per_expert: f32_buf(experts)?,
    };
    if by_counting {
        // plan_place writes the rows too
        plan_by_counting(be, (token, expert, valid), &params, &out)?;
        return Ok(out);
    }
    if by_sorting {
        out.order = plan_by_sorting(be, (expert, weight, rank, valid), &params, &out)?;
    } else {
        be.launch(
            &ROUTING,
            "plan_sort",
            &[
                expert,
                weight,
                rank,
                valid,
                &out.order,
                &out.offsets,
                &out.routed_per_expert,
                &out.kept_per_expert,
            ],
            &params,
            grid_1d(a + experts + 1, PLAN_WG)?,
        )?;
    }
    be.launch(
        &ROUTING,
        "plan_rows",
        &[
            &out.order,
            token,
            &out.offsets,
            &out.row_token,
            &out.row_expert,
            &out.row_expert_clamped,
            &out.row_kept,
            &out.position,
        ],
        &params,
        grid_1d(a, PLAN_WG)?,
    )?;
    Ok(out)
}

impl RoutingOps for GpuBackend {
    fn weighted_scatter(
        &self,
        rows: (&GpuBuffer, Option<&GpuBuffer>),
        w: Option<&GpuBuffer>,
        idx: &GpuBuffer,
        sizes: (usize, usize),
        slots: Option<(&GpuBuffer, usize)>,
        slot_order: Option<&GpuBuffer>,
    ) -> Result<GpuBuffer> {
        super::moe_combine::weighted_scatter(self, rows, w, idx, sizes, slots, slot_order)
    }

    fn weighted_scatter_backward(
        &self,
        rows: &GpuBuffer,
        w: &GpuBuffer,
        idx: &GpuBuffer,
        dy: &GpuBuffer,
        sizes: (usize, usize),
        slot_order: Option<&GpuBuffer>,
    ) -> Result<(GpuBuffer, GpuBuffer)> {
        super::moe_combine::weighted_scatter_backward(self, rows, w, idx, dy, sizes, slot_order)
    }

    fn topk_gate(
        &self,
        logits: &GpuBuffer,
        scores: Option<&GpuBuffer>,
        rows: usize,
        n: usize,
        k: usize,
        renormalise: bool,
    ) -> Result<(GpuBuffer, GpuBuffer, GpuBuffer)> {
        topk_gate(self, logits, scores, (rows, n, k), renormalise)
    }

    fn topk_gate_backward(
        &self,
        weights: &GpuBuffer,
        idx: &GpuBuffer,
        d_weights: &GpuBuffer,
        (probs, pending): (Option<&GpuBuffer>, Option<&GpuBuffer>),
        sizes: (usize, usize, usize),
    ) -> Result<GpuBuffer> {
        topk_gate_backward(self, (weights, idx, d_weights), probs, pending, sizes)
    }

    fn dispatch_plan(
        &self,
        token: &GpuBuffer,
        expert: &GpuBuffer,
        order_keys: (&GpuBuffer, &GpuBuffer, &GpuBuffer),
        experts: usize,
        capacity: Option<usize>,
    ) -> Result<PlanBuffers<GpuBuffer>> {
        dispatch_plan(self, token, expert, order_keys, experts, capacity)
    }

    fn routing_stats(
        &self,
        acc: Option<&GpuBuffer>,
        probs_logits: (&GpuBuffer, &GpuBuffer),
        routed_kept: (&GpuBuffer, &GpuBuffer),
        dims: crate::backend::RoutingStatsDims,
    ) -> Result<GpuBuffer> {
        super::router_sums::routing_stats(self, acc, probs_logits, routed_kept, dims)
    }

    fn balance_loss(
        &self,
        probs: &GpuBuffer,
        counts: &GpuBuffer,
        sizes: (usize, usize),
        scale: f64,
    ) -> Result<(GpuBuffer, GpuBuffer)> {
        super::router_sums::balance_loss(self, probs, counts, sizes, scale)
    }
}
