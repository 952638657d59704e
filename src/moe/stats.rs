//! Routing metrics of one forward pass, kept on the device until someone reads them: tokens
//! per expert, drop rate, router entropy and experts per token.

use crate::{Result, Tensor};

/// Per-layer routing statistics (device tensors; read them with [`RoutingStats::read`]).
#[derive(Clone, Debug)]
pub struct RoutingStats {
    /// `[n]` kept assignments per expert
    pub kept_per_expert: Tensor,
    /// `[n]` the combine weight each expert received, summed over its kept assignments
    pub weight_per_expert: Tensor,
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

impl RoutingStats {
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
