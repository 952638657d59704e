//! SparseMixer: sparse backpropagation for a top-1 router (Liu, Gao, Chen, Han, Gao and Chen,
//! "Sparse Backpropagation for MoE Training", 2023) and its GRIN-era successor SparseMixer-v2
//! (Liu et al., "GRIN: GRadient-INformed MoE", 2024). Command-line names `sparsemixer` (the
//! hybrid), `sparsemixer-1st`, `sparsemixer-2rd` and `sparsemixer-v2`.
//!
//! # The problem
//! With one sampled expert per token, `y = π_D f_D(x)`, `D ~ π`, the gradient of the expected
//! loss splits into (SparseMixer Eq. 2)
//!
//! ```text
//! ∇ = ∇₀ + ∇₁,   ∇₀ = Σ_i (g(π_i f_i) − g(0)) ∂π_i/∂θ,   ∇₁ = E_D[∂g(π_D f_D)/∂θ]
//! ```
//!
//! Plain backprop through the sampled expert (Switch) gives only ∇₁. SparseMixer approximates ∇₀
//! from the one expert that ran, with an ODE step on `t ↦ g(t·π_i f_i)`:
//!
//! * first order (forward Euler): `g(π_i f_i) − g(0) ≈ ⟨g'(π_i f_i), π_i f_i⟩`, error `O(ε²)`;
//! * mid-point (second order): `g(π_i f_i) − g(0) ≈ ⟨g'(π_i f_i / 2), π_i f_i⟩`, error `O(ε³)`,
//!   exact for quadratic g; it needs the forward to output `y = π_D f_D / 2` on that branch.
//!
//! Either estimate has the form of ∇₁, so the router gets twice the plain backprop gradient.
//!
//! # What a token goes through (training; SparseMixer §3 and the public microsoft/SparseMixer code)
//! 1. Mask (no gradient): `Δ_j = 1[θ* − θ_j ≤ r(|θ*| + |θ_j|)]`, `θ* = max θ`, jitter r = 0.1
//!    (paper, Eq. 9); option `mask_rule=code` uses the released code's looser rule
//!    `Δ_j = 1[θ* − θ_j ≤ 2r·max(|θ_j|, θ*)]`. The argmax is always kept.
//! 2. `π = softmax(θ masked to −∞ where Δ = 0)`; masked logits get exactly zero gradient.
//! 3. `D = argmax_j (θ_j + G_j)` over unmasked j, `G` iid Gumbel(0, 1) (Gumbel-max: `D ~ π`);
//!    `a = argmax θ`.
//! 4. Forward scale `c`: `sparsemixer-1st` c ≡ 1; `sparsemixer-2rd` c ≡ ½ (the mid-point);
//!    `sparsemixer` (hybrid) c = 1 if D = a, else ½ with probability `midpoint_prob` (1.0, the
//!    paper; 0.5 reproduces the released code's coin flip) and 1 otherwise.
//! 5. The combine weight is `w = c·π_D` and the layer outputs `y = ω ⊙ (w·f_D(x))`, with the
//!    trainable per-channel scale ω (init 1, one per layer, owned by the layer: see
//!    [`crate::moe::Router::output_scale`]).
//!
//! Backward, with `s = ⟨G_y, ω ⊙ f_D⟩` the gradient that reaches `w`: the router total is
//! `∂L/∂π_D := 2s`, **independent of c** (the code's convention; on the c = ½ branch that is
//! 4× plain autograd), so `∂L/∂θ_k = 2s·π_D(δ_kD − π_k)` and 0 for masked k. The expert and
//! ω get plain autograd: `∂L/∂f_D = c·π_D·ω ⊙ G_y`, `∂L/∂ω = c·π_D·G_y ⊙ f_D`. In code this is
//! one recorded op, [`scale_through`]: value `c·π_D`, backward `2·g` into `π_D`, which autograd
//! of the masked softmax and the gather then turn into the formula above.
//!
//! Writing `∇̂ = s·π_D(e_D − π)`: with linear g, `E[∇̂] = ∇₀` exactly for every c; with
//! quadratic g, `E[∇̂_{c≡½}] = ∇₀` exactly; for experts scaled by ε the errors are `O(ε²)` for
//! c ≡ 1 and the hybrid and `O(ε³)` for c ≡ ½. The tape's total `2∇̂` matches `∇₀ + ∇₁` to
//! `O(ε²)` (tests/routers_sparsemixer.rs checks all of these by exact enumeration).
//!
//! Inference: `D = a`, `w = π_a` (masked π, the mask still applies), plain autograd.
//!
//! # SparseMixer-v2 (`sparsemixer-v2`, option `top=1|2`)
//! Same mask and Gumbel-max sampling; no ω and no factor 2. A non-argmax sample uses the
//! forward scale `c = ⅓` with probability ¾ and 1 otherwise (an argmax sample: c = 1), after the
//! third-order rule `h(1) − h(0) ≈ ¼h'(1) + ¾h'(⅓)` (exact for cubics); the backward is
//! `∂θ = s·π_D(e_D − π)` as if c = 1. Top-2 masks out the first choice, recomputes the mask
//! relative to the largest remaining logit, and samples the second expert from the softmax over
//! what is left, with its own c.
//!
//! The balance loss reads `Routing::probs`: by default the masked π (the released code's
//! choice, with f from the sampled D); option `balance_probs=softmax` gives the unmasked softmax.

use crate::nn::Parameters;
use crate::autograd::custom_op;
use crate::moe::Routing;
use crate::moe::{OptionKind, RouterOption, RouterSpec};
use crate::moe::{LinearGate, Router, RouterConfig, uniform_noise};
use crate::moe::arange_f;
use crate::nn::Param;
use crate::{DType, Device, Error, Result, Tensor};

/// Option `jitter` of the SparseMixer variants that take it (the mask's jitter).
const OPT_JITTER: RouterOption = RouterOption {
    key: "jitter",
    kind: OptionKind::Number,
    default: "0.1",
    help: "jitter r of the mask, in [0, 1)",
};

/// Option `mask_rule` of the SparseMixer variants that take it (which mask rule).
const OPT_MASK_RULE: RouterOption = RouterOption {
    key: "mask_rule",
    kind: OptionKind::Choice(&["paper", "code"]),
    default: "paper",
    help: "the mask as in the paper or as in the released code",
};

/// Option `balance_probs` of the SparseMixer variants that take it (the balance loss's P).
const OPT_BALANCE_PROBS: RouterOption = RouterOption {
    key: "balance_probs",
    kind: OptionKind::Choice(&["masked", "softmax"]),
    default: "masked",
    help: "the balance loss's P: the masked softmax or the plain softmax",
};

/// Option `midpoint_prob` of the hybrid SparseMixer (its mid-point probability).
const OPT_MIDPOINT_PROB: RouterOption = RouterOption {
    key: "midpoint_prob",
    kind: OptionKind::Number,
    default: "1.0",
    help: "probability of the mid-point branch when D is not the argmax, in [0, 1]",
};

/// Option `omega_init` of the SparseMixer variants that take it (the output scale's start).
const OPT_OMEGA_INIT: RouterOption = RouterOption {
    key: "omega_init",
    kind: OptionKind::Number,
    default: "1.0",
    help: "initial value of the output scale omega",
};

/// Option `top` of SparseMixer v2 (its experts per token).
const OPT_TOP: RouterOption = RouterOption {
    key: "top",
    kind: OptionKind::Count,
    default: "k",
    help: "experts per token, 1 or 2",
};

/// The registry entry of `sparsemixer` (see [`crate::moe::ROUTERS`]).
pub(crate) const SPEC_HYBRID: RouterSpec = RouterSpec {
    name: "sparsemixer",
    summary: "SparseMixer (hybrid): Gumbel-max top-1 under a mask, forward scale 1 at the argmax, else 1/2",
    options: &[
        OPT_JITTER,
        OPT_MASK_RULE,
        OPT_BALANCE_PROBS,
        OPT_MIDPOINT_PROB,
        OPT_OMEGA_INIT,
    ],
    build: |cfg, device| {
        Ok(Box::new(SparseMixerRouter::new(
            cfg,
            SparseMixerVariant::Hybrid,
            device,
        )?))
    },
    estimator_lab: Some(0),
};

/// The registry entry of `sparsemixer-1st`.
pub(crate) const SPEC_FIRST_ORDER: RouterSpec = RouterSpec {
    name: "sparsemixer-1st",
    summary: "SparseMixer with forward scale c = 1 (first-order estimate)",
    options: &[
        OPT_JITTER,
        OPT_MASK_RULE,
        OPT_BALANCE_PROBS,
        OPT_OMEGA_INIT,
    ],
    build: |cfg, device| {
        Ok(Box::new(SparseMixerRouter::new(
            cfg,
            SparseMixerVariant::FirstOrder,
            device,
        )?))
    },
    estimator_lab: Some(1),
};

/// The registry entry of `sparsemixer-2rd`.
pub(crate) const SPEC_SECOND_ORDER: RouterSpec = RouterSpec {
    name: "sparsemixer-2rd",
    summary: "SparseMixer with forward scale c = 1/2 (the mid-point, second-order estimate)",
    options: &[
        OPT_JITTER,
        OPT_MASK_RULE,
        OPT_BALANCE_PROBS,
        OPT_OMEGA_INIT,
    ],
    build: |cfg, device| {
        Ok(Box::new(SparseMixerRouter::new(
            cfg,
            SparseMixerVariant::SecondOrder,
            device,
        )?))
    },
    estimator_lab: Some(2),
};

/// The registry entry of `sparsemixer-v2`.
pub(crate) const SPEC_V2: RouterSpec = RouterSpec {
    name: "sparsemixer-v2",
    summary: "SparseMixer v2: top-1 or top-2 sampling, third-order rule",
    options: &[
        OPT_JITTER,
        OPT_MASK_RULE,
        OPT_BALANCE_PROBS,
        OPT_TOP,
    ],
    build: |cfg, device| {
        Ok(Box::new(SparseMixerRouter::new(
            cfg,
            SparseMixerVariant::V2,
            device,
        )?))
    },
    estimator_lab: Some(3),
};

/// The fill value of masked logits (finite, so that every backend handles it; far below any
/// logit plus Gumbel noise).
pub const MASKED_LOGIT: f64 = -1e30;

/// Which rule decides the experts SparseMixer may sample (SparseMixer Eq. 9, docs/routers.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MaskRule {
    /// the paper's Eq. 9: keep j iff `θ* − θ_j ≤ r(|θ*| + |θ_j|)`
    Paper,
    /// the released code: keep j iff `θ* − θ_j ≤ 2r·max(|θ_j|, θ*)` (looser)
    Code,
}

/// The SparseMixer variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SparseMixerVariant {
    /// `sparsemixer`: mid-point when the sample is not the argmax (with `midpoint_prob`)
    Hybrid,
    /// `sparsemixer-1st`: forward Euler, c ≡ 1
    FirstOrder,
    /// `sparsemixer-2rd`: mid-point, c ≡ ½
    SecondOrder,
    /// `sparsemixer-v2`: third-order rule, top-1 or top-2, no ω, no factor 2
    V2,
}

impl SparseMixerVariant {
    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            SparseMixerVariant::Hybrid => "sparsemixer",
            SparseMixerVariant::FirstOrder => "sparsemixer-1st",
            SparseMixerVariant::SecondOrder => "sparsemixer-2rd",
            SparseMixerVariant::V2 => "sparsemixer-v2",
        }
    }
}

/// The settings of a SparseMixer router, read from [`RouterConfig`] and its options.
#[derive(Clone, Debug, PartialEq)]
pub struct SparseMixerConfig {
    /// the variant
    pub variant: SparseMixerVariant,
    /// jitter r of the mask (option `jitter`, default `RouterConfig::jitter` = 0.1)
    pub jitter: f64,
    /// mask rule (option `mask_rule=paper|code`, default paper)
    pub mask_rule: MaskRule,
    /// hybrid only: probability of the mid-point branch when D ≠ argmax (option
    /// `midpoint_prob`, default 1.0 as in the paper; 0.5 as in the released code)
    pub midpoint_prob: f64,
    /// v2 only: experts per token, 1 or 2 (option `top`, default `RouterConfig::k`)
    pub top: usize,
    /// initial value of ω (option `omega_init`, default 1.0; v1 variants only)
    pub omega_init: f64,
    /// `Routing::probs` (the balance loss's P) is the masked π (default) or the plain softmax
    /// (option `balance_probs=masked|softmax`)
    pub balance_masked: bool,
}

impl SparseMixerConfig {
    /// Reads and validates the options (errors name the option and the accepted values).
    pub fn from_router_config(
        cfg: &RouterConfig,
        variant: SparseMixerVariant,
    ) -> Result<SparseMixerConfig> {
        let name = variant.name();
        let mut known = vec!["jitter", "mask_rule", "balance_probs"];
        match variant {
            SparseMixerVariant::Hybrid => known.extend(["midpoint_prob", "omega_init"]),
            SparseMixerVariant::FirstOrder | SparseMixerVariant::SecondOrder => {
                known.push("omega_init")
            }
            SparseMixerVariant::V2 => known.push("top"),
        }
        cfg.check_options(name, &known)?;
        let jitter = cfg.opt_f64("jitter", cfg.jitter)?;
        if !(0.0..1.0).contains(&jitter) {
            return Err(Error::Invalid(format!(
                "{name}: jitter r must be in [0, 1), got {jitter}"
            )));
        }
        let mask_rule = match cfg.opt_str("mask_rule", "paper") {
            "paper" => MaskRule::Paper,
            "code" => MaskRule::Code,
            other => {
                return Err(Error::Invalid(format!(
                    "{name}: mask_rule={other:?}; expected paper or code"
                )));
            }
        };
        let midpoint_prob = cfg.opt_f64("midpoint_prob", 1.0)?;
        if !(0.0..=1.0).contains(&midpoint_prob) {
            return Err(Error::Invalid(format!(
                "{name}: midpoint_prob must be in [0, 1], got {midpoint_prob}"
            )));
        }
        let top = if variant == SparseMixerVariant::V2 {
            let has = cfg.options.contains_key("top");
            let top = cfg.opt_usize("top", cfg.k)?;
            if !(1..=2).contains(&top) {
                return Err(Error::Invalid(format!(
                    "{name}: top must be 1 or 2, got {top}{}",
                    if has {
                        ""
                    } else {
                        " (from --k; set top=1 or top=2)"
                    }
                )));
            }
            if top > cfg.experts {
                return Err(Error::Invalid(format!(
                    "{name}: top={top} needs at least {top} experts, got {}",
                    cfg.experts
                )));
            }
            top
        } else {
            1
        };
        let omega_init = cfg.opt_f64("omega_init", 1.0)?;
        let balance_masked = match cfg.opt_str("balance_probs", "masked") {
            "masked" => true,
            "softmax" => false,
            other => {
                return Err(Error::Invalid(format!(
                    "{name}: balance_probs={other:?}; expected masked or softmax"
                )));
            }
        };
        Ok(SparseMixerConfig {
            variant,
            jitter,
            mask_rule,
            midpoint_prob,
            top,
            omega_init,
            balance_masked,
        })
    }
}

/// A SparseMixer router (any variant; see the module documentation).
pub struct SparseMixerRouter {
    gate: LinearGate,
    config: SparseMixerConfig,
}

impl SparseMixerRouter {
    /// Builds the router of `variant`, reading its options from `cfg` (k is ignored except by
    /// v2, where it is the default of `top`).
    pub fn new(
        cfg: &RouterConfig,
        variant: SparseMixerVariant,
        device: Device,
    ) -> Result<SparseMixerRouter> {
        let config = SparseMixerConfig::from_router_config(cfg, variant)?;
        Ok(SparseMixerRouter {
            gate: LinearGate::new(cfg, device)?,
            config,
        })
    }

    /// The settings in force.
    pub fn config(&self) -> &SparseMixerConfig {
        &self.config
    }

    /// Routes `[T, n]` logits with the noise of `seed` (training) or through the argmax
    /// (evaluation; `seed` unused). [`Router::route`] is the gate followed by this with a fresh
    /// seed from [`LinearGate::noise_seed`].
    pub fn route_logits_seeded(&self, logits: &Tensor, seed: u64) -> Result<Routing> {
        let cfg = &self.config;
        let theta = logits.detach();
        let keep = crate::no_grad(|| sparsemixer_mask(&theta, cfg.jitter, cfg.mask_rule))?;
        let pi = masked_softmax(logits, &keep)?;
        let unmasked = if cfg.balance_masked {
            pi.clone()
        } else {
            logits.softmax(-1)?
        };
        let t = logits.shape()[0];
        let dt = logits.dtype();
        let dev = logits.device();
        if !self.gate.training() {
            let a = theta.argmax(-1, true)?;
            let w = pi.gather(1, &a)?;
            let mut r = Routing::token_choice(&a, &w, None, unmasked, logits.clone())?;
            r.metrics
                .push(("experts_evaluated_per_token", one(dt, dev)?));
            return Ok(r);
        }
        let (d, c) = crate::no_grad(|| -> Result<(Tensor, Tensor)> {
            let d = gumbel_argmax(&theta, Some(&keep), seed)?;
            let a = theta.argmax(-1, true)?;
            let is_a = d.to_dtype(dt)?.eq(&a.to_dtype(dt)?)?;
            let coin = uniform_noise(&is_a, 0.0, 1.0, seed ^ 0x636f_696e)?;
            Ok((d, forward_scale(cfg, &is_a, &coin)?))
        })?;
        let factor = if cfg.variant == SparseMixerVariant::V2 {
            1.0
        } else {
            2.0
        };
        let w1 = scale_through(&pi.gather(1, &d)?, &c, factor)?;
        let midpoint = crate::no_grad(|| c.lt(&Tensor::scalar(1.0, dt, dev)?)?.mean_all())?;
        let (idx, w) = if cfg.top == 2 {
            let (d2, w2) = self.second_choice(logits, &theta, &d, seed)?;
            (Tensor::concat(&[d, d2], 1)?, Tensor::concat(&[w1, w2], 1)?)
        } else {
            (d, w1)
        };
        let mut r = Routing::token_choice(&idx, &w, None, unmasked, logits.clone())?;
        r.metrics.push((
            "experts_evaluated_per_token",
            Tensor::scalar(cfg.top as f64, dt, dev)?,
        ));
        r.metrics.push(("reduced_scale_fraction", midpoint));
        debug_assert_eq!(r.tokens, t);
        Ok(r)
    }

    /// v2's second choice: mask out the first choice `d1`, recompute the mask relative to the
    /// largest remaining logit, sample from the softmax over what is left.
    fn second_choice(
        &self,
        logits: &Tensor,
        theta: &Tensor,
        d1: &Tensor,
        seed: u64,
    ) -> Result<(Tensor, Tensor)> {
        let cfg = &self.config;
        let (dt, dev) = (theta.dtype(), theta.device());
        let n = theta.shape()[1];
        let (keep2, d2, c2) = crate::no_grad(|| -> Result<(Tensor, Tensor, Tensor)> {
            let first = one_hot(d1, n, dt, dev)?;
            let fill = Tensor::scalar(MASKED_LOGIT, dt, dev)?;
            let rest = Tensor::where_cond(&first, &fill, theta)?;
            let not_first = first.mul_scalar(-1.0)?.add_scalar(1.0)?;
            let keep2 = sparsemixer_mask(&rest, cfg.jitter, cfg.mask_rule)?.mul(&not_first)?;
            let d2 = gumbel_argmax(&rest, Some(&keep2), seed ^ 0x7365_636f_6e64)?;
            let a2 = rest.argmax(-1, true)?;
            let is_a = d2.to_dtype(dt)?.eq(&a2.to_dtype(dt)?)?;
            let coin = uniform_noise(&is_a, 0.0, 1.0, seed ^ 0x636f_696e_0032)?;
            Ok((keep2, d2, forward_scale(cfg, &is_a, &coin)?))
        })?;
        let pi2 = masked_softmax(logits, &keep2)?;
        let w2 = scale_through(&pi2.gather(1, &d2)?, &c2, 1.0)?;
        Ok((d2, w2))
    }
}

fn one(dt: DType, dev: Device) -> Result<Tensor> {
    Tensor::scalar(1.0, dt, dev)
}

/// The forward scale c of each token (`[T, 1]`) given whether the sample is the argmax and a
/// uniform coin.
fn forward_scale(cfg: &SparseMixerConfig, is_argmax: &Tensor, coin: &Tensor) -> Result<Tensor> {
    let (dt, dev) = (is_argmax.dtype(), is_argmax.device());
    let not_a = is_argmax.mul_scalar(-1.0)?.add_scalar(1.0)?;
    match cfg.variant {
        SparseMixerVariant::FirstOrder => is_argmax.full_like(1.0),
        SparseMixerVariant::SecondOrder => is_argmax.full_like(0.5),
        SparseMixerVariant::Hybrid => {
            // mid-point iff D ≠ a and coin < midpoint_prob: c = 1 − ½·that
            let p = Tensor::scalar(cfg.midpoint_prob, dt, dev)?;
            let mid = not_a.mul(&coin.lt(&p)?)?;
            mid.mul_scalar(-0.5)?.add_scalar(1.0)
        }
        SparseMixerVariant::V2 => {
            // c = ⅓ iff D ≠ a and coin < ¾: c = 1 − ⅔·that
            let p = Tensor::scalar(0.75, dt, dev)?;
            let third = not_a.mul(&coin.lt(&p)?)?;
            third.mul_scalar(-2.0 / 3.0)?.add_scalar(1.0)
        }
    }
}

/// SparseMixer's sampling mask `Δ` (`[T, n]`, 1.0 = may be sampled) of untracked logits, with
/// jitter `r` and the given rule (see [`MaskRule`]). The row maximum is always kept.
pub fn sparsemixer_mask(theta: &Tensor, r: f64, rule: MaskRule) -> Result<Tensor> {
    let m = theta.max(-1, true)?;
    let gap = m.sub(theta)?;
    let bound = match rule {
        MaskRule::Paper => m.abs()?.add(&theta.abs()?)?.mul_scalar(r)?,
        MaskRule::Code => theta.abs()?.maximum(&m)?.mul_scalar(2.0 * r)?,
    };
    gap.le(&bound)
}

/// `softmax(θ)` over the experts where `keep` is 1, exactly 0 elsewhere; masked logits get
/// exactly zero gradient.
pub fn masked_softmax(logits: &Tensor, keep: &Tensor) -> Result<Tensor> {
    let fill = Tensor::scalar(MASKED_LOGIT, logits.dtype(), logits.device())?;
    Tensor::where_cond(keep, logits, &fill)?.softmax(-1)
}

/// Gumbel noise `−ln(−ln u)` shaped like `like`, `u` uniform from `seed` (clamped away from 0
/// and 1 so the noise is finite).
pub fn gumbel_noise(like: &Tensor, seed: u64) -> Result<Tensor> {
    uniform_noise(like, 0.0, 1.0, seed)?
        .clamp(1e-7, 1.0 - 1e-7)?
        .log()?
        .neg()?
        .log()?
        .neg()
}

/// Gumbel-max sampling: `argmax_j (θ_j + G_j)` over the experts where `keep` is 1 (all when
/// None), `[T, 1]` I32 — a draw from `softmax(θ)` restricted to `keep`. Untracked.
pub fn gumbel_argmax(theta: &Tensor, keep: Option<&Tensor>, seed: u64) -> Result<Tensor> {
    let theta = theta.detach();
    let scores = theta.add(&gumbel_noise(&theta, seed)?)?;
    let scores = match keep {
        Some(k) => Tensor::where_cond(
            k,
            &scores,
            &Tensor::scalar(MASKED_LOGIT, theta.dtype(), theta.device())?,
        )?,
        None => scores,
    };
    scores.argmax(-1, true)
}

/// One-hot rows `[T, n]` (float) of `[T, 1]` I32 indices.
pub fn one_hot(idx: &Tensor, n: usize, dtype: DType, device: Device) -> Result<Tensor> {
    let cols = arange_f(n, dtype, device)?.reshape(&[1, n])?;
    idx.to_dtype(dtype)?.eq(&cols)
}

/// A recorded op whose value is `c ⊙ p` but whose backward is `grad_factor · g` into `p`
/// (c untracked): SparseMixer's forward scale with its straight-through router gradient
/// (`grad_factor` 2 for v1, 1 for v2). `c` broadcasts to `p`'s shape.
pub fn scale_through(p: &Tensor, c: &Tensor, grad_factor: f64) -> Result<Tensor> {
    let scale = |inputs: &[Tensor]| {
        let value = inputs[0].mul(c)?;
        if value.shape() != inputs[0].shape() {
            return Err(Error::Shape(format!(
                "scale_through: scale {:?} does not broadcast to {:?}",
                c.shape(),
                inputs[0].shape()
            )));
        }
        Ok(value)
    };
    custom_op("sparsemixer_scale", &[p], scale, move |ctx| {
        Ok(vec![Some(ctx.grad_output.mul_scalar(grad_factor)?)])
    })
}

impl Router for SparseMixerRouter {
    fn name(&self) -> &'static str {
        self.config.variant.name()
    }
    fn reads_tokens_only_through_products(&self) -> bool {
        true
    }
    fn route(&self, x: &Tensor) -> Result<Routing> {
        let logits = self.gate.logits(x)?;
        let seed = if self.gate.training() {
            self.gate.noise_seed()
        } else {
            0
        };
        self.route_logits_seeded(&logits, seed)
    }
    fn output_scale(&self) -> Option<f64> {
        (self.config.variant != SparseMixerVariant::V2).then_some(self.config.omega_init)
    }
    fn estimates_gradient(&self) -> bool {
        true
    }
}

impl Parameters for SparseMixerRouter {
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
