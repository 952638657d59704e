//! `threshold` — the adaptive (threshold-based) router of XMoE: each token takes as many experts
//! as it needs to cover a share `t` of its router probability mass.
//!
//! Yang et al. 2024, "XMoE: Sparse Models with Fine-grained and Adaptive Expert Selection"
//! (docs/routers.md, `threshold`; its properties are tested in `tests/routers_threshold.rs`).
//!
//! # Forward
//!
//! ```text
//! p = softmax(x·W)                 router without bias, W: [d, n]  (f32 on the GPU)
//! i_1, i_2, ..., i_K               experts by p descending (ties: lowest index), K = min(n, max_k)
//! s_j = Σ_{l<j} p_{i_l}            exclusive prefix sum (s_1 = 0)
//! keep rank j  ⟺  s_j < t          rank 1 always kept; t ≥ 1 keeps all K
//! y = Σ_{j kept} p_{i_j} · E_{i_j}(x)        raw p, NOT renormalised
//! ```
//!
//! The kept set is the shortest prefix `i_1..i_m` with `Σ_{j≤m} p_{i_j} ≥ t` (cut at `max_k`):
//! `t = 0` is top-1, `t = 1` sends every token to all experts, and lowering `t` never adds an
//! expert (the sets are nested in `t`). The routing has the static `K` slots per token; the
//! slots past `m` have `valid = 0` and weight 0, so the dispatch plan sends them to its trash
//! expert and they cost nothing. Everything is tensor ops on the device (`topk`, `cumsum`, `lt`):
//! no value is read back.
//!
//! Rank 1's exclusive sum is exactly 0 and every later rank's is at least `p_{i_1} ≥ 1/n`, so the
//! comparison is made with `max(t, 1/(2n))`: that keeps rank 1 at `t = 0` and changes nothing
//! else. `t ≥ 1` keeps every slot without comparing at all, because prefix sums can round up to
//! 1 early: with `p = (0.5, 0.5, 1e-20)` the third exclusive sum is 1.0 and `1.0 < 1` fails.
//!
//! # Gradient
//!
//! Selection carries no gradient ("∇₁ only"), the weights are the raw probabilities, so the
//! backward is that of unnormalised top-k (XMoE Eq. 1–2): with `a_i = ⟨∂L/∂y, E_i(x)⟩`,
//!
//! ```text
//! ∂L/∂θ_k = Σ_{i kept} a_i · p_i · (δ_ik − p_k)      θ = x·W, nonzero for unkept k too
//! ```
//!
//! and the experts get `p_i · ∂L/∂y` on their own rows only.
//!
//! # Capacity and balance
//!
//! XMoE sizes capacity by tokens, `C = ⌈γ·T/n⌉` (the number of experts per token varies), so this
//! router reports [`Router::variable_experts_per_token`] and the layer counts `T` rather than the
//! `T·K` slots. Priority is XMoE's `p − rank`: every first choice before any second choice, then
//! by `p` — the order `DispatchPlan` sorts in. The balance loss counts first choices only (XMoE:
//! "balance loss on the top-1 assignment").
//!
//! # Options (`--router-opt`), defaults from the paper
//!
//! * `t` (default 0.9): the threshold in training, in `[0, 1]`.
//! * `eval_t` (default `t`): the threshold in evaluation — lower it after training with `t = 1`
//!   for dense-to-sparse (XMoE §3.6, see `moe::dense_to_sparse`).
//! * `max_k` (default n): a cap on experts per token (XMoE's code uses 8); the routing has
//!   `min(n, max_k)` slots per token.
//!
//! `k` (`RouterConfig::k`, `--k`) is ignored: the number of experts is set by `t` and `max_k`.
//!
//! # Pitfalls
//!
//! * With few experts and a flat router (a fresh one) `t = 0.9` sends each token to most experts;
//!   the count falls as the router sharpens. The metric `experts_per_token` (kept per token,
//!   before capacity) shows it.
//! * The weights do not sum to 1 (between `t` and 1 for kept sets, less when `max_k` cuts);
//!   the layer's output scale moves with the number of experts kept.
//! * A capacity factor γ counts tokens here: γ = n with `t = 1` is what no drops takes.

use crate::nn::Parameters;
use crate::moe::Routing;
use crate::moe::{OptionKind, RouterOption, RouterSpec};
use crate::moe::{LinearGate, Router, RouterConfig};
use crate::nn::{Param, join};
use crate::{Device, Error, Result, Tensor};

/// The registry entry of `threshold` (see [`crate::moe::ROUTERS`]).
pub(crate) const SPEC: RouterSpec = RouterSpec {
    name: "threshold",
    summary: "XMoE threshold routing: experts by probability until their mass reaches t",
    options: &[
        RouterOption {
            key: "t",
            kind: OptionKind::Number,
            default: "0.9",
            help: "threshold on the cumulative probability in training, in [0, 1]",
        },
        RouterOption {
            key: "eval_t",
            kind: OptionKind::Number,
            default: "t",
            help: "threshold in evaluation, in [0, 1]",
        },
        RouterOption {
            key: "max_k",
            kind: OptionKind::Count,
            default: "n",
            help: "cap on experts per token, at least 1",
        },
    ],
    build: |cfg, device| Ok(Box::new(ThresholdRouter::new(cfg, device)?)),
    estimator_lab: None,
};

/// The option keys the `threshold` router accepts.
pub const THRESHOLD_OPTIONS: &[&str] = &["t", "eval_t", "max_k"];

/// The settings of the `threshold` router, read from `RouterConfig::options`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ThresholdOptions {
    /// threshold on the cumulative probability in training, in `[0, 1]` (default 0.9)
    pub t: f64,
    /// threshold in evaluation, in `[0, 1]` (default `t`)
    pub eval_t: f64,
    /// cap on experts per token, at least 1 (default n)
    pub max_k: usize,
}

impl ThresholdOptions {
    /// Reads and checks the options; an error names the option at fault.
    pub fn from_config(cfg: &RouterConfig) -> Result<ThresholdOptions> {
        cfg.check_options("threshold", THRESHOLD_OPTIONS)?;
        let in_unit = |key: &str, v: f64| {
            if (0.0..=1.0).contains(&v) {
                Ok(v)
            } else {
                Err(Error::Invalid(format!(
                    "router threshold: option {key} = {v} must be in [0, 1]"
                )))
            }
        };
        let t = in_unit("t", cfg.opt_f64("t", 0.9)?)?;
        let eval_t = in_unit("eval_t", cfg.opt_f64("eval_t", t)?)?;
        let max_k = cfg.opt_usize("max_k", cfg.experts)?;
        if max_k == 0 {
            return Err(Error::Invalid(
                "router threshold: option max_k must be at least 1, got 0".into(),
            ));
        }
        Ok(ThresholdOptions { t, eval_t, max_k })
    }
}

/// XMoE's threshold router (see the module documentation).
pub struct ThresholdRouter {
    /// the linear map to logits; only its weight is used (XMoE's router has no bias)
    gate: LinearGate,
    /// the settings
    pub options: ThresholdOptions,
    /// slots per token, `min(n, max_k)`
    slots: usize,
}

impl ThresholdRouter {
    /// A threshold router over `cfg.experts` experts; `cfg.k` is ignored.
    pub fn new(cfg: &RouterConfig, device: Device) -> Result<ThresholdRouter> {
        let options = ThresholdOptions::from_config(cfg)?;
        Ok(ThresholdRouter {
            gate: LinearGate::new(cfg, device)?,
            slots: options.max_k.min(cfg.experts),
            options,
        })
    }

    /// The threshold in force (training or evaluation).
    pub fn threshold(&self) -> f64 {
        if self.gate.training() {
            self.options.t
        } else {
            self.options.eval_t
        }
    }

    /// `[T, K]` 0/1: which ranks of the descending probabilities `sorted` are kept at threshold
    /// `t` (no gradient). Public for the tests and for anyone who wants the rule on its own.
    pub fn keep_mask(sorted: &Tensor, t: f64, experts: usize) -> Result<Tensor> {
        crate::no_grad(|| {
            let p = sorted.detach();
            if t >= 1.0 {
                return Tensor::ones(p.shape(), p.dtype(), p.device());
            }
            let exclusive = p.cumsum(1)?.sub(&p)?;
            let bound = t.max(0.5 / experts.max(1) as f64);
            exclusive.lt(&Tensor::scalar(bound, p.dtype(), p.device())?)
        })
    }
}

impl Router for ThresholdRouter {
    fn name(&self) -> &'static str {
        "threshold"
    }

    fn reads_tokens_only_through_products(&self) -> bool {
        true
    }
    fn route(&self, x: &Tensor) -> Result<Routing> {
        let w = self.gate.weight.get();
        if x.rank() != 2 || x.shape()[1] != w.shape()[0] {
            return Err(Error::Shape(format!(
                "router expects tokens [T, {}], got {:?}",
                w.shape()[0],
                x.shape()
            )));
        }
        let logits = x.matmul(&w)?;
        let probs = logits.softmax(-1)?;
        let (_, idx) = probs.topk(self.slots)?;
        let sorted = probs.gather(1, &idx)?;
        let keep = Self::keep_mask(&sorted, self.threshold(), probs.shape()[1])?;
        let weights = sorted.mul(&keep)?;
        let per_token = crate::no_grad(|| keep.sum(&[1], false)?.mean_all())?;
        let mut routing = Routing::token_choice(&idx, &weights, Some(&keep), probs, logits)?;
        routing.metrics.push(("experts_per_token", per_token));
        Ok(routing)
    }

    fn variable_experts_per_token(&self) -> bool {
        true
    }
}

impl Parameters for ThresholdRouter {

    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(String, &Param)) {
        f(join(prefix, "weight"), &self.gate.weight);
    }

    fn set_training(&self, training: bool) {
        self.gate.set_training(training)
    }
    fn state(&self) -> Result<Vec<(String, Tensor)>> {
        self.gate.state()
    }
    fn load_state(&self, name: &str, value: &Tensor) -> Result<()> {
        self.gate.load_state(name, value)
    }
}
