//! `deepseek-v3` — DeepSeek-V3's router: sigmoid affinities, an auxiliary-loss-free correction
//! bias used for selection only, and group-limited top-k (DeepSeek-AI, 2024, "DeepSeek-V3
//! Technical Report", arXiv 2412.19437, §2.1.2), exactly as transformers'
//! `DeepseekV3TopkRouter` computes it.
//!
//! For a token x with gate logits `o = x·W` (`[n]`, no bias in DeepSeek's models; the
//! `RouterConfig::gate_bias` setting decides):
//!
//! ```text
//! s_i   = sigmoid(o_i)                                   affinities (weights come from these)
//! c_i   = s_i + b_i                                      b = e_score_correction_bias, selection only
//! G_g   = sum of the 2 largest c_i in group g            n_group groups of n/n_group experts
//! keep the topk_group groups with the largest G_g; c_i = −∞ for experts of the other groups
//! T     = top-k of c                                     (ties: lowest index)
//! w_i   = s_i for i ∈ T;  if norm_topk_prob: w_i /= (Σ_{j∈T} s_j + 1e-20);  w_i *= routed_scaling_factor
//! ```
//!
//! The selection (bias, groups, top-k) carries no gradient; the gate learns through the
//! unbiased `s_i` of the chosen experts (and, with the balance loss, through `probs`).
//!
//! `probs` (the balance loss's `P_i` and the routing statistics) is the affinity normalised per
//! token, `s_i / Σ_j s_j`, as DeepSeek-V3's complementary sequence-wise balance loss (§2.1.2,
//! Eq. 18) defines it. `logits` is `o` (z-loss).
//!
//! The correction bias `b` is router **state**, not a parameter: no optimiser touches it, it
//! starts at zero, is saved in checkpoints ([`Parameters::state`] entry
//! [`DeepSeekV3Router::CORRECTION_BIAS`]) and restored on resume, and is set from outside with
//! [`DeepSeekV3Router::set_correction_bias`] (import from Hugging Face loads
//! `mlp.gate.e_score_correction_bias` into it; `--balance aux-free` updates it by ±u after each
//! training batch according to the load, as the paper does, and `--balance quantile` solves it;
//! see `moe/selection_bias.rs`).

use crate::moe::{
    LinearGate, OptionKind, Router, RouterConfig, RouterOption, RouterSpec, Routing, SelectionBias,
};
use crate::nn::{Param, Parameters};
use crate::{Device, Error, Result, Tensor};

/// The registry entry of `deepseek-v3`.
pub const SPEC: RouterSpec = RouterSpec {
    name: "deepseek-v3",
    summary: "DeepSeek-V3: sigmoid scores, selection bias, group-limited top-k",
    options: &[
        RouterOption {
            key: "n_group",
            kind: OptionKind::Count,
            default: "1",
            help: "number of expert groups; must divide the number of experts",
        },
        RouterOption {
            key: "topk_group",
            kind: OptionKind::Count,
            default: "1",
            help: "groups kept per token (by the sum of their top-2 biased scores), 1..=n_group",
        },
        RouterOption {
            key: "norm_topk_prob",
            kind: OptionKind::Bool,
            default: "true",
            help: "renormalise the k chosen sigmoid scores to sum to 1",
        },
        RouterOption {
            key: "routed_scaling_factor",
            kind: OptionKind::Number,
            default: "1.0",
            help: "factor applied to the weights after normalisation",
        },
    ],
    build: |cfg, device| Ok(Box::new(DeepSeekV3Router::new(cfg, device)?)),
    estimator_lab: None,
};

/// DeepSeek-V3's group-limited sigmoid top-k router.
pub struct DeepSeekV3Router {
    gate: LinearGate,
    k: usize,
    n: usize,
    n_group: usize,
    topk_group: usize,
    norm_topk_prob: bool,
    routed_scaling_factor: f64,
    /// `[n]` F32 on the router's device: the selection-only correction bias (always kept: the
    /// imported models carry one; `--balance aux-free` or `quantile` move it)
    bias: SelectionBias,
}

impl DeepSeekV3Router {
    /// The name of the correction bias in [`Parameters::state`].
    pub const CORRECTION_BIAS: &'static str = "e_score_correction_bias";

    /// Reads and checks the options (each error names the option at fault).
    pub fn new(cfg: &RouterConfig, device: Device) -> Result<DeepSeekV3Router> {
        let n = cfg.experts;
        let k = cfg.k;
        let n_group = cfg.opt_usize("n_group", 1)?;
        let topk_group = cfg.opt_usize("topk_group", 1)?;
        let norm_topk_prob = cfg.opt_bool("norm_topk_prob", true)?;
        let routed_scaling_factor = cfg.opt_f64("routed_scaling_factor", 1.0)?;
        let bad = |m: String| Err(Error::Invalid(format!("deepseek-v3: {m}")));
        if n_group == 0 || !n.is_multiple_of(n_group) {
            return bad(format!(
                "n_group = {n_group} must be ≥ 1 and divide the number of experts {n}"
            ));
        }
        if topk_group == 0 || topk_group > n_group {
            return bad(format!(
                "topk_group = {topk_group} must be in 1..=n_group = {n_group}"
            ));
        }
        let per_group = n / n_group;
        if n_group > 1 && per_group < 2 {
            return bad(format!(
                "n_group = {n_group} leaves {per_group} expert per group; groups are scored by \
                 their top 2, so each needs at least 2 experts"
            ));
        }
        if k == 0 || k > topk_group * per_group {
            return bad(format!(
                "k = {k} must be in 1..=topk_group·(n/n_group) = {}",
                topk_group * per_group
            ));
        }
        Ok(DeepSeekV3Router {
            gate: LinearGate::new(cfg, device)?,
            k,
            n,
            n_group,
            topk_group,
            norm_topk_prob,
            routed_scaling_factor,
            bias: SelectionBias::zeros(n, device)?,
        })
    }

    /// The gate (its weight `[d, n]`, and its bias when [`RouterConfig::gate_bias`]).
    pub fn gate(&self) -> &LinearGate {
        &self.gate
    }

    /// The selection-only correction bias `[n]` (F32, on the router's device).
    pub fn correction_bias(&self) -> Result<Tensor> {
        self.bias.get()
    }

    /// Sets the selection-only correction bias (`e_score_correction_bias`, `[n]`, any float
    /// dtype, any device; stored as F32 on the router's device). Not a parameter: no gradient,
    /// no optimiser; saved in checkpoints as router state.
    pub fn set_correction_bias(&self, bias: &Tensor) -> Result<()> {
        self.bias
            .set(bias, &format!("deepseek-v3: {}", Self::CORRECTION_BIAS))
    }

    /// `[T, n]` 0/1 mask of the experts in each token's `topk_group` best groups.
    fn group_mask(&self, choice: &Tensor) -> Result<Tensor> {
        let t = choice.shape()[0];
        let (g, per) = (self.n_group, self.n / self.n_group);
        let (dt, dev) = (choice.dtype(), choice.device());
        let (top2, _) = choice.reshape(&[t, g, per])?.topk(2)?;
        let group_scores = top2.sum(&[2], false)?; // [T, G]
        let (_, gidx) = group_scores.topk(self.topk_group)?; // [T, topk_group] I32
        let cols = crate::moe::arange_f(g, dt, dev)?.reshape(&[1, 1, g])?;
        let hit = gidx
            .to_dtype(dt)?
            .reshape(&[t, self.topk_group, 1])?
            .eq(&cols)?; // [T, topk_group, G]
        hit.sum(&[1], true)? // [T, 1, G]
            .reshape(&[t, g, 1])?
            .expand(&[t, g, per])?
            .reshape(&[t, self.n])
    }
}

impl Router for DeepSeekV3Router {
    fn name(&self) -> &'static str {
        "deepseek-v3"
    }
    fn reads_tokens_only_through_products(&self) -> bool {
        true
    }
    fn route(&self, x: &Tensor) -> Result<Routing> {
        let logits = self.gate.logits(x)?;
        let scores = logits.sigmoid()?; // [T, n], tracked
        let biased = self.bias.add_to(&scores)?;
        let mut choice = biased.clone();
        if self.n_group > 1 {
            let keep = self.group_mask(&choice)?;
            let drop = keep.eq(&Tensor::scalar(0.0, keep.dtype(), keep.device())?)?;
            choice = choice.masked_fill(&drop, f64::NEG_INFINITY)?;
        }
        let (_, idx) = choice.topk(self.k)?; // [T, k]
        let mut w = scores.gather(1, &idx)?;
        if self.norm_topk_prob {
            w = w.div(&w.sum(&[1], true)?.add_scalar(1e-20)?)?;
        }
        if self.routed_scaling_factor != 1.0 {
            w = w.mul_scalar(self.routed_scaling_factor)?;
        }
        let probs = scores.div(&scores.sum(&[1], true)?)?;
        // quantile balancing reads the cutoffs from the biased scores before the group mask
        Ok(Routing::token_choice(&idx, &w, None, probs, logits)?.with_selection(&self.bias, &biased))
    }
    fn selection_bias(&self) -> Option<&SelectionBias> {
        Some(&self.bias)
    }
}

impl Parameters for DeepSeekV3Router {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(String, &Param)) {
        self.gate.visit(prefix, f)
    }
    fn set_training(&self, training: bool) {
        self.gate.set_training(training)
    }
    fn state(&self) -> Result<Vec<(String, Tensor)>> {
        let mut s = self.gate.state()?;
        s.push((
            Self::CORRECTION_BIAS.to_string(),
            self.correction_bias()?.to_device(Device::Cpu)?,
        ));
        Ok(s)
    }
    fn load_state(&self, name: &str, value: &Tensor) -> Result<()> {
        if name == Self::CORRECTION_BIAS {
            self.set_correction_bias(value)
        } else {
            self.gate.load_state(name, value)
        }
    }
}
