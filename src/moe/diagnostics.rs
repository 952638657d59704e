//! Routing diagnostics: the figures that show an MoE layer's routing balanced or collapsing,
//! summed on the device over a window of training steps ([`RoutingWindow::add`], no host wait)
//! and read back once per window ([`RoutingWindow::read`]); and the collapse alarm
//! ([`CollapseAlarm`]) that the training loop prints when they cross a threshold.
//!
//! Per MoE layer, over the window's `T` tokens, `n` experts, `k` slots per token:
//!
//! | figure | definition | perfectly balanced |
//! |---|---|---|
//! | `load` | kept assignments of expert `e` / all kept assignments (after capacity) | `1/n` each |
//! | `load_before_capacity` | routed assignments of `e` / all routed assignments | `1/n` each |
//! | `load_max_over_ideal` | `n · max_e load_e` | 1 |
//! | `dead_experts` | experts that kept no assignment in the window | 0 |
//! | `top_share` | the most-used expert's kept assignments / `T`: the fraction of tokens that use it | `k/n` |
//! | `routing_entropy_ratio` | `exp(H(p̄))/n`, `p̄` the router's distribution averaged over tokens | 1 |
//! | `token_entropy` | the mean over tokens of `H(p_t)`, nats (low: confident routing) | — |
//! | `logit_rms`, `logit_max` | `√(mean logit²)` and `max |logit|` (what the z-loss bounds) | — |
//! | `drop_rate` | `1 − kept/routed` | 0 |
//! | `experts_per_token` | routed assignments / `T`: the real experts a token is routed to (fewer than k with null experts; varies with `threshold`, `remoe`) | k |
//!
//! A multi-gate layer counts each task's routing of a token as a token of its own.

use super::RoutingStats;
use crate::backend::RoutingStatsDims;
use crate::{DType, Error, Result, Tensor};
use serde::Serialize;

/// One layer's sums over the window, on the device, in one f32 tensor (its layout is
/// `shaders/router_sums.wgsl`'s): the router distribution's column sums, the routed and kept
/// counts per expert, the sum of the tokens' entropies, the logits' square sum and their largest
/// magnitude.
struct LayerSums {
    sums: Tensor,
    /// the sizes of the first step (every later step must have the same columns and experts)
    dims: RoutingStatsDims,
    tokens: usize,
    logits: usize,
}

/// The routing statistics of the steps of a window, summed per MoE layer on the device.
#[derive(Default)]
pub struct RoutingWindow {
    layers: Vec<LayerSums>,
}

/// One MoE layer's diagnostics over a window (see the module docs for each figure).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct LayerDiagnostics {
    /// kept assignments per expert as fractions of all kept (after capacity)
    pub load: Vec<f64>,
    /// routed assignments per expert as fractions of all routed (before capacity)
    pub load_before_capacity: Vec<f64>,
    /// `n · max load` (1: perfectly balanced; `n`: one expert takes everything)
    pub load_max_over_ideal: f64,
    /// experts that kept no assignment in the window
    pub dead_experts: usize,
    /// the fraction of tokens that use the most-used expert (`k/n` when balanced)
    pub top_share: f64,
    /// `exp(H(mean routing distribution)) / n` (1: uniform on average)
    pub routing_entropy_ratio: f64,
    /// the mean per-token entropy of the routing distribution, nats
    pub token_entropy: f64,
    /// root mean square of the router's logits
    pub logit_rms: f64,
    /// largest absolute router logit
    pub logit_max: f64,
    /// fraction of routed assignments dropped by capacity
    pub drop_rate: f64,
    /// real experts each token was routed to, on average (before capacity; null experts do
    /// not count)
    pub experts_per_token: f64,
    /// tokens routed in the window
    pub tokens: usize,
    /// assignments kept (after capacity) in the window
    pub kept_assignments: f64,
    /// assignments routed (before capacity) in the window
    pub routed_assignments: f64,
}

/// The smallest, median and largest value of a figure across the MoE layers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Spread {
    /// the smallest
    pub min: f64,
    /// the median (the mean of the middle two for an even count)
    pub median: f64,
    /// the largest
    pub max: f64,
}

impl Spread {
    /// The spread of `values` (zeros for none).
    pub fn of(values: impl IntoIterator<Item = f64>) -> Spread {
        let mut v: Vec<f64> = values.into_iter().collect();
        if v.is_empty() {
            return Spread::default();
        }
        v.sort_by(f64::total_cmp);
        let m = v.len();
        Spread {
            min: v[0],
            median: if m % 2 == 1 {
                v[m / 2]
            } else {
                (v[m / 2 - 1] + v[m / 2]) / 2.0
            },
            max: v[m - 1],
        }
    }
}

/// Every MoE layer's diagnostics over a window, and their spreads across layers.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct RoutingDiagnostics {
    /// one entry per MoE layer, in order
    pub layers: Vec<LayerDiagnostics>,
    /// `load_max_over_ideal` across layers
    pub load_max_over_ideal: Spread,
    /// `dead_experts` across layers
    pub dead_experts: Spread,
    /// `top_share` across layers
    pub top_share: Spread,
    /// `routing_entropy_ratio` across layers
    pub routing_entropy_ratio: Spread,
    /// `drop_rate` across layers
    pub drop_rate: Spread,
    /// `logit_max` across layers
    pub logit_max: Spread,
    /// `experts_per_token` across layers
    pub experts_per_token: Spread,
}

impl RoutingDiagnostics {
    fn from_layers(layers: Vec<LayerDiagnostics>) -> RoutingDiagnostics {
        let spread = |f: fn(&LayerDiagnostics) -> f64| Spread::of(layers.iter().map(f));
        RoutingDiagnostics {
            load_max_over_ideal: spread(|l| l.load_max_over_ideal),
            dead_experts: spread(|l| l.dead_experts as f64),
            top_share: spread(|l| l.top_share),
            routing_entropy_ratio: spread(|l| l.routing_entropy_ratio),
            drop_rate: spread(|l| l.drop_rate),
            logit_max: spread(|l| l.logit_max),
            experts_per_token: spread(|l| l.experts_per_token),
            layers,
        }
    }

    /// A short form for a progress line: `load/ideal 1.3 · dead 0/8 · H 0.97` (worst layer).
    pub fn short(&self) -> String {
        let n = self.layers.first().map_or(0, |l| l.load.len());
        format!(
            "load/ideal {:.2} · dead {}/{n} · H {:.2}",
            self.load_max_over_ideal.max,
            self.dead_experts.max as usize,
            self.routing_entropy_ratio.min
        )
    }
}

impl RoutingWindow {
    /// An empty window.
    pub fn new() -> RoutingWindow {
        RoutingWindow::default()
    }

    /// Whether no step has been added since the window began.
    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }

    /// Adds one step's statistics (one entry per MoE layer) into the window on the device: per
    /// layer one fused launch (`RoutingOps::routing_stats`) that sums the routing distribution's
    /// columns and its entropy, the logits' squares and their largest magnitude, and adds the
    /// counts per expert. Nothing is read back.
    pub fn add(&mut self, stats: &[RoutingStats]) -> Result<()> {
        crate::no_grad(|| {
            for (i, s) in stats.iter().enumerate() {
                let f32 = |t: &Tensor| t.detach().to_dtype(DType::F32);
                let (probs, logits) = (f32(&s.probs)?, f32(&s.logits)?);
                let (routed, kept) = (f32(&s.routed_per_expert)?, f32(&s.kept_per_expert)?);
                let [rows, cols] = probs.shape() else {
                    return Err(Error::Shape(format!(
                        "routing diagnostics: the router's distribution of MoE layer {i} must be \
                         [tokens, experts], got {:?}",
                        probs.shape()
                    )));
                };
                let dims = RoutingStatsDims {
                    rows: *rows,
                    cols: *cols,
                    logits: logits.numel(),
                    experts: routed.numel(),
                };
                let layer = self.layers.get(i);
                if let Some(l) =
                    layer.filter(|l| (l.dims.cols, l.dims.experts) != (dims.cols, dims.experts))
                {
                    return Err(Error::Shape(format!(
                        "routing diagnostics: MoE layer {i} routed over {} columns and {} experts \
                         earlier in the window, now {} and {}",
                        l.dims.cols, l.dims.experts, dims.cols, dims.experts
                    )));
                }
                let sums = probs.storage().routing_stats(
                    layer.map(|l| l.sums.storage()),
                    logits.storage(),
                    (routed.storage(), kept.storage()),
                    dims,
                )?;
                let sums = Tensor::from_storage(sums, vec![dims.out_len()]);
                match self.layers.get_mut(i) {
                    Some(l) => {
                        l.sums = sums;
                        l.tokens += s.tokens;
                        l.logits += dims.logits;
                    }
                    None => self.layers.push(LayerSums {
                        sums,
                        dims,
                        tokens: s.tokens,
                        logits: dims.logits,
                    }),
                }
            }
            Ok(())
        })
    }

    /// Each MoE layer's sums on the device as they stand (`RoutingOps::routing_stats`'
    /// output), for tests that compare them bit for bit.
    #[cfg(test)]
    pub(crate) fn layer_sums(&self) -> Vec<&Tensor> {
        self.layers.iter().map(|l| &l.sums).collect()
    }

    /// Reads the window back (one small transfer per layer: call it once per window).
    pub fn read(&self) -> Result<RoutingDiagnostics> {
        let mut layers = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            let sums = l.sums.to_vec_f64()?;
            let (cols, n) = (l.dims.cols, l.dims.experts);
            let p_mean: Vec<f64> = sums[..cols]
                .iter()
                .map(|p| p / l.tokens.max(1) as f64)
                .collect();
            let routed = sums[cols..cols + n].to_vec();
            let kept = sums[cols + n..cols + 2 * n].to_vec();
            let [entropy_sum, logit_sq_sum, logit_max] = [0, 1, 2].map(|j| sums[cols + 2 * n + j]);
            let (kept_all, routed_all) = (kept.iter().sum::<f64>(), routed.iter().sum::<f64>());
            let share = |v: &[f64], all: f64| -> Vec<f64> {
                v.iter()
                    .map(|x| if all > 0.0 { x / all } else { 0.0 })
                    .collect()
            };
            let load = share(&kept, kept_all);
            let max_load = load.iter().cloned().fold(0.0, f64::max);
            let max_kept = kept.iter().cloned().fold(0.0, f64::max);
            let h_mean: f64 = -p_mean
                .iter()
                .filter(|&&p| p > 0.0)
                .map(|p| p * p.ln())
                .sum::<f64>();
            layers.push(LayerDiagnostics {
                load_before_capacity: share(&routed, routed_all),
                load_max_over_ideal: max_load * n as f64,
                dead_experts: kept.iter().filter(|&&x| x == 0.0).count(),
                top_share: max_kept / l.tokens.max(1) as f64,
                routing_entropy_ratio: h_mean.exp() / n.max(1) as f64,
                token_entropy: entropy_sum / l.tokens.max(1) as f64,
                logit_rms: (logit_sq_sum / l.logits.max(1) as f64).sqrt(),
                logit_max,
                drop_rate: if routed_all > 0.0 {
                    1.0 - kept_all / routed_all
                } else {
                    0.0
                },
                experts_per_token: routed_all / l.tokens.max(1) as f64,
                tokens: l.tokens,
                kept_assignments: kept_all,
                routed_assignments: routed_all,
                load,
            });
        }
        Ok(RoutingDiagnostics::from_layers(layers))
    }
}

/// When routing counts as collapsed over a window: too many dead experts, or one expert used
/// by too large a share of the tokens.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CollapseAlarm {
    /// alarm when a layer's dead experts are at least this fraction of its experts (> 1: never)
    pub dead_fraction: f64,
    /// alarm when a layer's most-used expert serves more than this fraction of the tokens while
    /// taking at least 1.5 times its fair share 1/n of the assignments (≥ 1: never)
    pub top_share: f64,
}

impl CollapseAlarm {
    /// The alarm's message for `d`, or None when no layer crosses a threshold.
    pub fn check(&self, d: &RoutingDiagnostics) -> Option<String> {
        let bad: Vec<String> = d
            .layers
            .iter()
            .enumerate()
            .filter_map(|(i, l)| {
                let n = l.load.len().max(1);
                let dead = l.dead_experts as f64 >= self.dead_fraction * n as f64 && l.dead_experts > 0;
                // an expert on most tokens is a collapse only if it also takes at least
                // its fair share of the assignments times 1.5: with many experts per token (a router
                // such as remoe early on, or k = n) every expert can serve every token evenly
                let top = l.top_share > self.top_share && l.load_max_over_ideal >= 1.5;
                (dead || top).then(|| {
                    format!(
                        "MoE layer {i}: {} of {n} experts dead, the busiest serves {:.0}% of the tokens",
                        l.dead_experts,
                        100.0 * l.top_share
                    )
                })
            })
            .collect();
        (!bad.is_empty()).then(|| {
            format!(
                "routing has collapsed ({}); balancing (--balance aux with a --balance-loss weight, aux-free or quantile) or a router with noise may help (thresholds: --collapse-dead {}, --collapse-share {})",
                bad.join("; "),
                self.dead_fraction,
                self.top_share
            )
        })
    }
}
