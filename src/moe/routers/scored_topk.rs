//! `sigmoid-topk` and `softplus-topk` — top-k over per-expert *affinities* that do not compete in
//! a softmax, the scoring of DeepSeek-V3 (sigmoid; DeepSeek-AI 2024, arXiv 2412.19437 §2.1.2)
//! and of DeepSeek-V4 (the square root of softplus), without DeepSeek's expert groups
//! (`deepseek-v3` has those). For a token with gate logits `o = x·W`:
//!
//! ```text
//! s_i = σ(o_i)                       sigmoid-topk
//! s_i = √softplus(o_i)               softplus-topk   (softplus floored at 1e-30: a finite slope)
//! T   = top-k of s + b               b: the selection-only bias of --balance aux-free | quantile
//! w_i = s_i / Σ_{j∈T} s_j  (i ∈ T)   renormalised (option normalize, default true); else w_i = s_i
//! ```
//!
//! Because each affinity is its own function of its own logit, raising one expert's score does
//! not lower the others' (as a softmax would), which is why these scores pair with a bias
//! balancer: the bias shifts the choice, the weights stay the affinities. The gradient reaches
//! only the chosen experts' logits: with normalisation `∂w_i/∂s_j = (δ_ij − w_i)/Σ_T s` for
//! `j ∈ T`, times `s'(o_j)` (`σ(1 − σ)`, or `σ(o)/(2√softplus(o))`).
//!
//! `probs`, the balance loss's `P_i` and the statistics' distribution, is `s / Σ_j s_j` over all
//! n experts (the normalised affinity of DeepSeek-V3's sequence-wise loss, Eq. 18); `logits` is
//! `o` (z-loss).

use crate::moe::{
    LinearGate, OptionKind, Router, RouterConfig, RouterOption, RouterSpec, Routing, SelectionBias,
};
use crate::nn::{Param, Parameters};
use crate::{Device, Result, Tensor};

const OPTIONS: &[RouterOption] = &[RouterOption {
    key: "normalize",
    kind: OptionKind::Bool,
    default: "true",
    help: "renormalise the k chosen affinities to sum to 1",
}];

/// The registry entry of `sigmoid-topk`.
pub(crate) const SPEC_SIGMOID: RouterSpec = RouterSpec {
    name: "sigmoid-topk",
    summary: "top-k of sigmoid affinities, weights the chosen affinities (DeepSeek-V3 scoring)",
    options: OPTIONS,
    build: |cfg, device| Ok(Box::new(ScoredTopK::new(cfg, Affinity::Sigmoid, device)?)),
    estimator_lab: None,
};

/// The registry entry of `softplus-topk`.
pub(crate) const SPEC_SOFTPLUS: RouterSpec = RouterSpec {
    name: "softplus-topk",
    summary: "top-k of sqrt(softplus) affinities, weights the chosen affinities (DeepSeek-V4 scoring)",
    options: OPTIONS,
    build: |cfg, device| Ok(Box::new(ScoredTopK::new(cfg, Affinity::SqrtSoftplus, device)?)),
    estimator_lab: None,
};

/// The affinity function of a [`ScoredTopK`] router.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Affinity {
    /// `σ(o)`
    Sigmoid,
    /// `√softplus(o)`
    SqrtSoftplus,
}

impl Affinity {
    /// The affinities of logits `o` (tracked).
    pub fn of(self, o: &Tensor) -> Result<Tensor> {
        match self {
            Affinity::Sigmoid => o.sigmoid(),
            Affinity::SqrtSoftplus => o.softplus()?.clamp(1e-30, f64::INFINITY)?.sqrt(),
        }
    }
}

/// Top-k over independent per-expert affinities.
pub struct ScoredTopK {
    gate: LinearGate,
    affinity: Affinity,
    k: usize,
    normalize: bool,
}

impl ScoredTopK {
    /// A router scoring with `affinity`.
    pub fn new(cfg: &RouterConfig, affinity: Affinity, device: Device) -> Result<ScoredTopK> {
        Ok(ScoredTopK {
            gate: LinearGate::new(cfg, device)?,
            affinity,
            k: cfg.k,
            normalize: cfg.opt_bool("normalize", true)?,
        })
    }

    /// The gate (weight `[d, n]`, bias when [`RouterConfig::gate_bias`]).
    pub fn gate(&self) -> &LinearGate {
        &self.gate
    }
}

impl Router for ScoredTopK {
    fn name(&self) -> &'static str {
        match self.affinity {
            Affinity::Sigmoid => "sigmoid-topk",
            Affinity::SqrtSoftplus => "softplus-topk",
        }
    }
    fn reads_tokens_only_through_products(&self) -> bool {
        true
    }
    fn route(&self, x: &Tensor) -> Result<Routing> {
        let logits = self.gate.logits(x)?;
        let s = self.affinity.of(&logits)?; // [T, n], tracked
        let chosen = self.gate.selection_scores(&s)?;
        let (_, idx) = chosen.topk(self.k)?;
        let mut w = s.gather(1, &idx)?;
        if self.normalize {
            w = w.div(&w.sum(&[1], true)?)?;
        }
        let probs = s.div(&s.sum(&[1], true)?)?;
        let routing = Routing::token_choice(&idx, &w, None, probs, logits)?;
        Ok(self.gate.mark(routing, &chosen))
    }
    fn selection_bias(&self) -> Option<&SelectionBias> {
        self.gate.selection.as_ref()
    }
}

impl Parameters for ScoredTopK {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(String, &Param)) {
        self.gate.visit(prefix, f)
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
