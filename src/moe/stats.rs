//! Routing metrics of one forward pass, kept on the device until someone reads them: tokens
//! per expert, drop rate, router entropy and experts per token.

use crate::{Result, Tensor};

/// Per-layer routing statistics (device tensors; read them with [`RoutingStats::read`]).
#[derive(Clone, Debug)]
pub struct RoutingStats {
    /// `[n]` kept assignments per expert
    pub kept_per_expert: Tensor,
    /// the combine weight each expert received over its kept assignments, as the forward pass
    /// left it; [`RoutingStats::weight_per_expert`] sums it when asked
    pub expert_weights: ExpertWeights,
    /// `[n]` routed (valid) assignments per expert, before capacity
    pub routed_per_expert: Tensor,
    /// `[T, n]` the router's distribution over experts for each token (detached); the mean
    /// entropy is computed from it only when asked for ([`RoutingStats::entropy`])
    pub probs: Tensor,
    /// `[T, n]` the router's logits (detached), for the diagnostics' logit RMS and maximum
    pub logits: Tensor,
    /// tokens in the batch
    pub tokens: usize,
    /// the router's own scalar metrics (see `Routing::metrics`)
    pub metrics: Vec<(&'static str, Tensor)>,
}

/// The statistics as host numbers.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct RoutingSummary {
    /// fraction of kept assignments per expert (sums to 1)
    pub expert_load: Vec<f64>,
    /// fraction of routed assignments dropped by capacity
    pub drop_rate: f64,
    /// mean router entropy (nats)
    pub entropy: f64,
    /// kept assignments per token
    pub experts_per_token: f64,
    /// the router's own metrics by name (averaged when several routers report one)
    pub router_metrics: std::collections::BTreeMap<String, f64>,
}

/// The combine weights of one forward pass from which [`RoutingStats::weight_per_expert`] sums
/// each expert's total, on demand: a training step that never reads the total does not pay for
/// it (a multiply and a scatter on the plan path).
#[derive(Clone, Debug)]
pub enum ExpertWeights {
    /// `[n]` the totals themselves
    Summed(Tensor),
    /// `[T, n]` (detached) each token's weight for every expert (the all-experts path, where
    /// nothing is dropped)
    PerToken(Tensor),
    /// a dispatch plan's rows: `weight` `[A]` (detached; in row order, or per slot with
    /// `slot_of_row`), `kept` `[A]` (float 0/1) and `expert` `[A]` (I32 in `0..experts`:
    /// `DispatchPlan::row_expert_clamped`), both in row order
    PerRow {
        /// each row's combine weight, or each slot's
        weight: Tensor,
        /// when `weight` is per slot, each row's slot (`[A]` I32, `DispatchPlan::order`)
        slot_of_row: Option<Tensor>,
        /// whether the row was kept (1) or dropped by capacity or invalid (0)
        kept: Tensor,
        /// the row's expert, clamped to `0..experts`
        expert: Tensor,
        /// the number of experts `n`
        experts: usize,
    },
}

impl RoutingStats {
    /// `[n]` (f32) the combine weight each expert received, summed over its kept assignments.
    pub fn weight_per_expert(&self) -> Result<Tensor> {
        crate::no_grad(|| match &self.expert_weights {
            ExpertWeights::Summed(w) => Ok(w.clone()),
            ExpertWeights::PerToken(w) => w.to_dtype(crate::DType::F32)?.sum(&[0], false),
            ExpertWeights::PerRow {
                weight,
                slot_of_row,
                kept,
                expert,
                experts,
            } => {
                let f32 = crate::DType::F32;
                let weight = match slot_of_row {
                    Some(order) => weight.index_select(0, order)?,
                    None => weight.clone(),
                };
                let kept_w = weight.to_dtype(f32)?.mul(&kept.to_dtype(f32)?)?;
                kept_w.index_scatter(0, expert, *experts)
            }
        })
    }

    /// The mean entropy of the router's distribution over experts, `−(1/T) Σ_t Σ_i p log p`, in
    /// nats (a scalar on the device). Computed on demand: a training step that never reads it
    /// does not pay its passes over `[T, n]`.
    pub fn entropy(&self) -> Result<Tensor> {
        crate::no_grad(|| {
            let p = &self.probs;
            let plogp = p.mul(&p.add_scalar(1e-12)?.log()?)?;
            plogp.sum(&[-1], false)?.mean_all()?.neg()
        })
    }

    /// Reads the statistics back (one small transfer; call it outside the hot loop).
    pub fn read(&self) -> Result<RoutingSummary> {
        let kept = self.kept_per_expert.to_vec_f64()?;
        let routed: f64 = self.routed_per_expert.to_vec_f64()?.iter().sum();
        let total: f64 = kept.iter().sum();
        Ok(RoutingSummary {
            expert_load: kept
                .iter()
                .map(|k| if total > 0.0 { k / total } else { 0.0 })
                .collect(),
            drop_rate: if routed > 0.0 {
                1.0 - total / routed
            } else {
                0.0
            },
            entropy: self.entropy()?.item()?,
            experts_per_token: total / self.tokens.max(1) as f64,
            router_metrics: {
                let mut sums = std::collections::BTreeMap::<String, (f64, f64)>::new();
                for (name, v) in &self.metrics {
                    let e = sums.entry(name.to_string()).or_default();
                    e.0 += v.item()?;
                    e.1 += 1.0;
                }
                sums.into_iter().map(|(k, (s, c))| (k, s / c)).collect()
            },
        })
    }
}
