//! The dispatch plan: the assignments of a [`Routing`] sorted by expert, each expert's slice of
//! rows, capacity, priority and dropping — all computed on the device from static sizes (`A`
//! assignments, `n` experts, capacity `C`), with no value read back to the host.
//!
//! 1. Order: the assignments sorted by expert, then by slot, then by weight (descending), then
//!    by index. Within an expert, all first choices come before any second choice, and within a
//!    slot the larger weight first (the priority of Switch/GShard and of XMoE's `p − rank`);
//!    invalid slots go to a trash expert `n` at the end. A dropless plan keeps nothing out, so
//!    it needs no priority: its rows are sorted by expert, then by index (a stable counting
//!    sort).
//! 2. Counting: `counts[e]` per expert; `offsets` is their exclusive prefix sum.
//! 3. Position within the expert `pos = i − offsets[e_i]`; an assignment is kept when
//!    `pos < C` (always, in dropless mode). `C = ⌈γ·A/n⌉`, or `⌈γ·T/n⌉` for routers with a
//!    variable number of experts per token (see `DispatchPlan::build_sized`). Dropped rows get
//!    expert `−1`: the grouped matmul skips them and they contribute zero.
//!
//! All three steps are one backend primitive, `Backend::dispatch_plan` (a counting sort on the
//! CPU; two or three kernels of `shaders/routing.wgsl` on the GPU for most plans, where the same
//! steps written as tensor ops took about fifty dispatches).

use super::Routing;
use super::arange_f;
use crate::{DType, Result, Tensor};

/// How many rows an expert may take.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Capacity {
    /// no limit, nothing dropped (MegaBlocks style)
    Dropless,
    /// `C = max(min_capacity, ceil(factor · A / n))` for `A` assignments over `n` experts
    Factor {
        /// the capacity factor γ
        factor: f64,
        /// a floor on C
        min_capacity: usize,
    },
}

impl Capacity {
    /// The capacity for `assignments` over `experts` (`None` when dropless).
    pub fn slots(&self, assignments: usize, experts: usize) -> Option<usize> {
        match *self {
            Capacity::Dropless => None,
            Capacity::Factor {
                factor,
                min_capacity,
            } => Some(
                ((factor * assignments as f64 / experts.max(1) as f64).ceil() as usize)
                    .max(min_capacity),
            ),
        }
    }
}

/// The plan: rows sorted by expert and what each row is.
#[derive(Clone, Debug)]
pub struct DispatchPlan {
    /// `[A]` I32: sorted position → assignment
    pub order: Tensor,
    /// `[A]` I32: assignment → sorted position (the inverse permutation of `order`)
    pub position: Tensor,
    /// `[A]` I32: the token of each sorted row
    pub row_token: Tensor,
    /// `[A]` I32: the expert of each sorted row, `−1` when dropped or invalid
    pub row_expert: Tensor,
    /// `[A]` I32: the expert of each sorted row clamped to `0..n` (for gathering per-expert biases)
    pub row_expert_clamped: Tensor,
    /// `[A]` float 0/1: whether the sorted row is kept
    pub row_kept: Tensor,
    /// `[n + 1]` I32: where each expert's rows start (sorted order)
    pub offsets: Tensor,
    /// `[n]` float: kept assignments per expert
    pub kept_per_expert: Tensor,
    /// `[n]` float: assignments per expert before capacity (valid ones)
    pub routed_per_expert: Tensor,
    /// the capacity used, if any
    pub capacity: Option<usize>,
}

impl DispatchPlan {
    /// Builds the plan for `routing` under `capacity`, sized by its `A` assignments
    /// (`C = ⌈γ·A/n⌉`).
    pub fn build(routing: &Routing, capacity: Capacity) -> Result<DispatchPlan> {
        DispatchPlan::build_sized(routing, capacity, routing.len())
    }

    /// Builds the plan with the capacity computed from `counted` instead of the number of
    /// assignments, `C = ⌈γ·counted/n⌉`: the layer passes the number of tokens `T` for routers
    /// whose experts per token vary (XMoE's threshold routing sizes capacity by tokens).
    pub fn build_sized(
        routing: &Routing,
        capacity: Capacity,
        counted: usize,
    ) -> Result<DispatchPlan> {
        let _profile = crate::profile::op("dispatch_plan");
        let _guard = crate::NoGradGuard::new();
        let n = routing.experts;
        let a = routing.len();
        let weight = routing.weight.detach();
        let ft = weight.dtype();
        let rank = routing.rank.to_dtype(ft)?;
        let valid = routing.valid.to_dtype(ft)?;
        let cap = capacity.slots(counted, n);
        // one fused primitive: two kernels on the GPU
        let p = routing.token.storage().dispatch_plan(
            (
                routing.expert.storage(),
                weight.storage(),
                rank.storage(),
                valid.storage(),
            ),
            n,
            cap,
        )?;
        let t = |s, len: usize| Tensor::from_storage(s, vec![len]);
        Ok(DispatchPlan {
            order: t(p.order, a),
            position: t(p.position, a),
            row_token: t(p.row_token, a),
            row_expert: t(p.row_expert, a),
            row_expert_clamped: t(p.row_expert_clamped, a),
            row_kept: t(p.row_kept, a),
            offsets: t(p.offsets, n + 1),
            kept_per_expert: t(p.kept_per_expert, n),
            routed_per_expert: t(p.routed_per_expert, n),
            capacity: cap,
        })
    }

    /// A plan whose rows are already in order (`row_expert` sorted, all kept), for running an
    /// expert bank directly on a batch (dense references, tests).
    pub fn identity(row_expert: &Tensor, offsets: Tensor, dtype: DType) -> Result<DispatchPlan> {
        let a = row_expert.numel();
        let dev = row_expert.device();
        let n = offsets.numel() - 1;
        Ok(DispatchPlan {
            order: arange_f(a, DType::F32, dev)?.to_dtype(DType::I32)?,
            position: arange_f(a, DType::F32, dev)?.to_dtype(DType::I32)?,
            row_token: arange_f(a, DType::F32, dev)?.to_dtype(DType::I32)?,
            row_expert: row_expert.clone(),
            row_expert_clamped: row_expert.clone(),
            row_kept: Tensor::ones(&[a], dtype, dev)?,
            offsets,
            kept_per_expert: Tensor::zeros(&[n], DType::F32, dev)?,
            routed_per_expert: Tensor::zeros(&[n], DType::F32, dev)?,
            capacity: None,
        })
    }
}
