//! [`Storage`]'s Mixture-of-Experts primitives, forwarded to the owning backend: the grouped
//! (per-expert) matmul and its weight gradient, the top-k gate and its backward, the softmax
//! backward, the dispatch plan, the weighted combine and its backward, the routing statistics
//! a training window sums, and the Switch balance loss.

use super::*;

impl Storage {
    /// See [`MatmulOps::grouped_matmul`]; `self` is `x`.
    pub(crate) fn grouped_matmul(
        &self,
        w: &Storage,
        bias: Option<&Storage>,
        row_expert: &Storage,
        dims: GroupedMatmulDims,
    ) -> Result<Storage> {
        const WHAT: &str = "grouped_matmul";
        on_device!(self, |be| be.grouped_matmul(
            be.buf(self, WHAT)?,
            be.buf(w, WHAT)?,
            be.opt(bias, WHAT)?,
            be.buf(row_expert, WHAT)?,
            dims
        ))
    }
    /// See [`MatmulOps::grouped_weight_grad`]; `self` is `x`.
    pub(crate) fn grouped_weight_grad(
        &self,
        dy: &Storage,
        row_expert: &Storage,
        offsets: &Storage,
        bank: ExpertBankDims,
        out: DType,
    ) -> Result<Storage> {
        const WHAT: &str = "grouped_weight_grad";
        on_device!(self, |be| be.grouped_weight_grad(
            be.buf(self, WHAT)?,
            be.buf(dy, WHAT)?,
            be.buf(row_expert, WHAT)?,
            be.buf(offsets, WHAT)?,
            bank,
            out
        ))
    }

    /// See [`MatmulOps::grouped_bias_grad`]; `self` is `dy`.
    pub(crate) fn grouped_bias_grad(
        &self,
        (row_expert, offsets): (&Storage, &Storage),
        sizes: (usize, usize),
        out: DType,
    ) -> Result<Storage> {
        const WHAT: &str = "grouped_bias_grad";
        on_device!(self, |be| be.grouped_bias_grad(
            be.buf(self, WHAT)?,
            (be.buf(row_expert, WHAT)?, be.buf(offsets, WHAT)?),
            sizes,
            out
        ))
    }

    /// See [`RoutingOps::topk_gate`]; `self` is the logits `[rows, n]`. Returns `(probs, idx,
    /// weights)`.
    pub(crate) fn topk_gate(
        &self,
        scores: Option<&Storage>,
        (rows, n, k): (usize, usize, usize),
        renormalise: bool,
    ) -> Result<(Storage, Storage, Storage)> {
        const WHAT: &str = "topk_gate";
        on_device!(self, |be| be.topk_gate(
            be.buf(self, WHAT)?,
            be.opt(scores, WHAT)?,
            rows,
            n,
            k,
            renormalise
        ))
    }
    /// See [`RoutingOps::topk_gate_backward`]; `self` is the gate's weights `[rows, k]`.
    pub(crate) fn topk_gate_backward(
        &self,
        idx: &Storage,
        d_weights: &Storage,
        (probs, pending): (Option<&Storage>, Option<&Storage>),
        sizes: (usize, usize, usize),
    ) -> Result<Storage> {
        const WHAT: &str = "topk_gate backward";
        on_device!(self, |be| be.topk_gate_backward(
            be.buf(self, WHAT)?,
            be.buf(idx, WHAT)?,
            be.buf(d_weights, WHAT)?,
            (be.opt(probs, WHAT)?, be.opt(pending, WHAT)?),
            sizes
        ))
    }
    /// See [`NnOps::softmax_forward`]; `self` is the input `x` `[rows, n]`.
    pub(crate) fn softmax_forward(&self, rows: usize, n: usize) -> Result<Storage> {
        const WHAT: &str = "softmax";
        on_device!(self, |be| be.softmax_forward(be.buf(self, WHAT)?, rows, n))
    }
    /// See [`NnOps::softmax_backward`]; `self` is the softmax output `y` `[rows, n]`.
    /// With `pending`, the gradient the softmax's input already has, added in.
    pub(crate) fn softmax_backward(
        &self,
        dy: &Storage,
        pending: Option<&Storage>,
        rows: usize,
        n: usize,
    ) -> Result<Storage> {
        const WHAT: &str = "softmax backward";
        on_device!(self, |be| be.softmax_backward(
            (be.buf(self, WHAT)?, be.buf(dy, WHAT)?),
            be.opt(pending, WHAT)?,
            rows,
            n
        ))
    }
    /// See [`RoutingOps::dispatch_plan`]; `self` is the token of each assignment.
    pub(crate) fn dispatch_plan(
        &self,
        (expert, weight, rank, valid): (&Storage, &Storage, &Storage, &Storage),
        experts: usize,
        capacity: Option<usize>,
    ) -> Result<PlanBuffers<Storage>> {
        const WHAT: &str = "dispatch_plan";
        on_device!(self, |be| be.dispatch_plan(
            be.buf(self, WHAT)?,
            be.buf(expert, WHAT)?,
            (
                be.buf(weight, WHAT)?,
                be.buf(rank, WHAT)?,
                be.buf(valid, WHAT)?
            ),
            experts,
            capacity
        ))
    }

    /// See [`RoutingOps::routing_stats`]; `self` is `probs`.
    pub(crate) fn routing_stats(
        &self,
        acc: Option<&Storage>,
        logits: &Storage,
        (routed, kept): (&Storage, &Storage),
        dims: RoutingStatsDims,
    ) -> Result<Storage> {
        const WHAT: &str = "routing statistics";
        on_device!(self, |be| be.routing_stats(
            be.opt(acc, WHAT)?,
            (be.buf(self, WHAT)?, be.buf(logits, WHAT)?),
            (be.buf(routed, WHAT)?, be.buf(kept, WHAT)?),
            dims
        ))
    }

    /// See [`RoutingOps::balance_loss`]; `self` is `probs`. Returns `(loss, coef)`.
    pub(crate) fn balance_loss(
        &self,
        counts: &Storage,
        sizes: (usize, usize),
        scale: f64,
    ) -> Result<(Storage, Storage)> {
        const WHAT: &str = "balance_loss";
        on_device!(self, |be| be.balance_loss(
            be.buf(self, WHAT)?,
            be.buf(counts, WHAT)?,
            sizes,
            scale
        ))
    }

    /// See [`RoutingOps::weighted_scatter`]; `self` is `rows`.
    pub(crate) fn weighted_scatter(
        &self,
        addend: Option<&Storage>,
        w: Option<&Storage>,
        idx: &Storage,
        sizes: (usize, usize),
        slots: Option<(&Storage, usize)>,
        slot_order: Option<&Storage>,
    ) -> Result<Storage> {
        const WHAT: &str = "weighted_index_scatter";
        on_device!(self, |be| be.weighted_scatter(
            (
                be.buf(self, WHAT)?,
                match addend {
                    Some(a) => Some(be.buf(a, WHAT)?),
                    None => None,
                }
            ),
            match w {
                Some(w) => Some(be.buf(w, WHAT)?),
                None => None,
            },
            be.buf(idx, WHAT)?,
            sizes,
            match slots {
                Some((s, k)) => Some((be.buf(s, WHAT)?, k)),
                None => None,
            },
            match slot_order {
                Some(o) => Some(be.buf(o, WHAT)?),
                None => None,
            }
        ))
    }
    /// See [`RoutingOps::weighted_scatter_backward`]; `self` is `rows`.
    pub(crate) fn weighted_scatter_backward(
        &self,
        w: &Storage,
        idx: &Storage,
        dy: &Storage,
        sizes: (usize, usize),
        slot_order: Option<&Storage>,
    ) -> Result<(Storage, Storage)> {
        const WHAT: &str = "weighted_index_scatter backward";
        on_device!(self, |be| be.weighted_scatter_backward(
            be.buf(self, WHAT)?,
            be.buf(w, WHAT)?,
            be.buf(idx, WHAT)?,
            be.buf(dy, WHAT)?,
            sizes,
            match slot_order {
                Some(o) => Some(be.buf(o, WHAT)?),
                None => None,
            }
        ))
    }
}
