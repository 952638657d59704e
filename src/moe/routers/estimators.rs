//! The gradient-estimator baselines SparseMixer is compared with (SparseMixer §3;
//! docs/routers.md, SparseMixer and the gradient-estimator baselines): `st` (straight-through),
//! `gumbel-st` (straight-through Gumbel-softmax), `reinforce`
//! (the score function; Williams 1992) and `reinmax` (Liu et al. 2023, "Bridging Discrete and
//! Backpropagation: Straight-Through and Beyond").
//!
//! All four sample one expert per token, `D ~ π = softmax(θ)` by Gumbel-max
//! (`D = argmax_j θ_j + G_j`, G iid Gumbel(0, 1)), and output `y = π_D f_D(x)`. They differ in the
//! router gradient. With `a_i = ⟨G_y, f_i(x)⟩` (what the combine hands back to expert i's weight)
//! and `u_i = π_i a_i = ⟨G_y, π_i f_i⟩`, and `J(q, v) = q ⊙ v − q⟨q, v⟩` (the softmax Jacobian
//! at q applied to v):
//!
//! * `st`: `∂θ = J(π, u)`, i.e. `∂θ_k = π_k(u_k − Σ_j π_j u_j)` — the backward of the softmax
//!   applied to the gradient of the one-hot sample. A first-order estimate of ∇₀ (exact for a
//!   linear loss); it does not include ∇₁.
//! * `gumbel-st` (option `tau`, default 1): `S = softmax((θ + G)/τ)` with the same G that
//!   picked D; `∂θ = (1/τ)·J(S, u)`.
//! * `reinmax` (option `tau` ≥ 1, default 1): `π̃ = (softmax(θ/τ) + e_D)/2`;
//!   `∂θ = J(π̃, 2u) + J(π, −½u + e_D ⊙ a)` (the last term is plain backprop through the
//!   scale π_D, ReinMax's `G_π`).
//! * `reinforce` (option `baseline`, default 1): the score function,
//!   `∂θ_t = (ℓ_t − b)(e_{D_t} − π_t)` with `ℓ_t` token t's own loss term and `b` a running-mean
//!   baseline (none with `baseline=0`); unbiased for ∇₀. The forward weight `π_D` is a constant
//!   (no ∇₁ path). The loss value is not visible to a backward rule inside the layer, so the
//!   router hands `log π_{t,D_t}` to the loss as a [`ScoreTerm`] and the training loop adds its
//!   surrogate (see `moe/score_function.rs`); without that term the router gets no gradient from
//!   the task loss at all (its balance and z-losses still reach it).
//!
//! **Cost.** `st`, `gumbel-st` and `reinmax` need `a_i` for every expert: in training they
//! route every token to all n experts (the weight is `π_D` for D and exactly 0 for the others,
//! so only expert D's parameters get gradient, but all n run) and report
//! `experts_evaluated_per_token = n`; [`Router::runs_all_experts`] is true. `reinforce` runs the
//! sampled expert only (1 per token). In evaluation all four route to `a = argmax θ` with weight
//! `π_a` and plain autograd (one expert per token).

use crate::nn::Parameters;
use super::sparsemixer::{gumbel_noise, one_hot};
use crate::autograd::custom_op;
use crate::moe::Routing;
use crate::moe::{OptionKind, RouterOption, RouterSpec};
use crate::moe::{LinearGate, Router, RouterConfig};
use crate::moe::{RunningBaseline, ScoreTerm};
use crate::nn::Param;
use crate::{Device, Error, Result, Tensor};
use std::sync::Arc;

/// The registry entry of `st` (see [`crate::moe::ROUTERS`]).
pub(crate) const SPEC_ST: RouterSpec = RouterSpec {
    name: "st",
    summary: "straight-through: hard Gumbel-max top-1 forward, softmax backward",
    options: &[],
    build: |cfg, device| Ok(Box::new(EstimatorRouter::new("st", cfg, device)?)),
    estimator_lab: Some(4),
};

/// The registry entry of `gumbel-st`.
pub(crate) const SPEC_GUMBEL_ST: RouterSpec = RouterSpec {
    name: "gumbel-st",
    summary: "Gumbel straight-through: hard top-1 forward, tempered Gumbel-softmax backward",
    options: &[RouterOption {
        key: "tau",
        kind: OptionKind::Number,
        default: "1.0",
        help: "temperature of the Gumbel-softmax, > 0",
    }],
    build: |cfg, device| Ok(Box::new(EstimatorRouter::new("gumbel-st", cfg, device)?)),
    estimator_lab: Some(5),
};

/// The registry entry of `reinforce`.
pub(crate) const SPEC_REINFORCE: RouterSpec = RouterSpec {
    name: "reinforce",
    summary: "REINFORCE: sampled top-1, score-function gradient",
    options: &[RouterOption {
        key: "baseline",
        kind: OptionKind::Bool,
        default: "true",
        help: "subtract a running-mean baseline from the reward",
    }],
    build: |cfg, device| Ok(Box::new(EstimatorRouter::new("reinforce", cfg, device)?)),
    estimator_lab: Some(6),
};

/// The registry entry of `reinmax`.
pub(crate) const SPEC_REINMAX: RouterSpec = RouterSpec {
    name: "reinmax",
    summary: "ReinMax: hard top-1 forward, second-order (Heun) straight-through backward",
    options: &[RouterOption {
        key: "tau",
        kind: OptionKind::Number,
        default: "1.0",
        help: "temperature, at least 1",
    }],
    build: |cfg, device| Ok(Box::new(EstimatorRouter::new("reinmax", cfg, device)?)),
    estimator_lab: Some(7),
};

/// Which estimator.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Estimator {
    /// straight-through
    StraightThrough,
    /// straight-through Gumbel-softmax with temperature τ
    GumbelSt {
        /// temperature τ > 0
        tau: f64,
    },
    /// the score function `(ℓ_t − b)(e_D − π)`, through a [`ScoreTerm`]
    Reinforce {
        /// subtract a running-mean baseline from the reward
        baseline: bool,
    },
    /// ReinMax with temperature τ ≥ 1
    ReinMax {
        /// temperature τ ≥ 1
        tau: f64,
    },
}

impl Estimator {
    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            Estimator::StraightThrough => "st",
            Estimator::GumbelSt { .. } => "gumbel-st",
            Estimator::Reinforce { .. } => "reinforce",
            Estimator::ReinMax { .. } => "reinmax",
        }
    }
    /// Whether the estimator needs every expert's output (all but `reinforce`).
    pub fn is_dense(self) -> bool {
        !matches!(self, Estimator::Reinforce { .. })
    }
    /// The estimator called `name`, with its options read from `cfg` (`tau` for `gumbel-st`
    /// and `reinmax`, `baseline` for `reinforce`; `st` takes none).
    pub fn from_config(name: &str, cfg: &RouterConfig) -> Result<Estimator> {
        match name {
            "st" => {
                cfg.check_options(name, &[])?;
                Ok(Estimator::StraightThrough)
            }
            "reinforce" => {
                cfg.check_options(name, &["baseline"])?;
                Ok(Estimator::Reinforce {
                    baseline: cfg.opt_bool("baseline", true)?,
                })
            }
            "gumbel-st" => {
                cfg.check_options(name, &["tau"])?;
                let tau = cfg.opt_f64("tau", 1.0)?;
                if tau <= 0.0 {
                    return Err(Error::Invalid(format!(
                        "gumbel-st: tau must be positive, got {tau}"
                    )));
                }
                Ok(Estimator::GumbelSt { tau })
            }
            "reinmax" => {
                cfg.check_options(name, &["tau"])?;
                let tau = cfg.opt_f64("tau", 1.0)?;
                if tau < 1.0 {
                    return Err(Error::Invalid(format!(
                        "reinmax: tau must be at least 1, got {tau}"
                    )));
                }
                Ok(Estimator::ReinMax { tau })
            }
            other => Err(Error::Invalid(format!(
                "unknown estimator {other:?}; expected st, gumbel-st, reinforce or reinmax"
            ))),
        }
    }
}

/// A router whose training-mode backward is one of the estimators (see the module docs).
pub struct EstimatorRouter {
    gate: LinearGate,
    estimator: Estimator,
    experts: usize,
    /// `reinforce`'s running-mean baseline (None for the others and with `baseline=0`)
    baseline: Option<Arc<RunningBaseline>>,
}

impl EstimatorRouter {
    /// The router `name` (`st`, `gumbel-st`, `reinforce`, `reinmax`); k is ignored (one sampled
    /// expert per token).
    pub fn new(name: &str, cfg: &RouterConfig, device: Device) -> Result<EstimatorRouter> {
        let estimator = Estimator::from_config(name, cfg)?;
        Ok(EstimatorRouter {
            gate: LinearGate::new(cfg, device)?,
            estimator,
            experts: cfg.experts,
            baseline: match estimator {
                Estimator::Reinforce { baseline: true } => Some(Arc::new(RunningBaseline::new())),
                _ => None,
            },
        })
    }

    /// The estimator.
    pub fn estimator(&self) -> Estimator {
        self.estimator
    }

    /// Routes `[T, n]` logits with the noise of `seed` (training) or through the argmax
    /// (evaluation). [`Router::route`] is the gate followed by this with a fresh seed.
    pub fn route_logits_seeded(&self, logits: &Tensor, seed: u64) -> Result<Routing> {
        let (dt, dev) = (logits.dtype(), logits.device());
        let t = logits.shape()[0];
        let n = self.experts;
        if !self.gate.training() {
            let probs = logits.softmax(-1)?;
            let a = logits.detach().argmax(-1, true)?;
            let w = probs.gather(1, &a)?;
            let mut r = Routing::token_choice(&a, &w, None, probs.detach(), logits.clone())?;
            r.metrics
                .push(("experts_evaluated_per_token", Tensor::scalar(1.0, dt, dev)?));
            return Ok(r);
        }
        let theta = logits.detach();
        let (pi, g, d, e_d) = crate::no_grad(|| -> Result<_> {
            let pi = theta.softmax(-1)?;
            let g = gumbel_noise(&theta, seed)?;
            let d = theta.add(&g)?.argmax(-1, true)?;
            let e_d = one_hot(&d, n, dt, dev)?;
            Ok((pi, g, d, e_d))
        })?;
        if let Estimator::Reinforce { .. } = self.estimator {
            // forward weight π_D as a constant; the router's gradient is the score term's
            let pi_d = crate::no_grad(|| pi.gather(1, &d))?;
            let log_prob = logits.log_softmax(-1)?.gather(1, &d)?.reshape(&[t])?;
            // tracked probabilities, so the balance loss reaches the router
            let probs = logits.softmax(-1)?;
            let mut r = Routing::token_choice(&d, &pi_d, None, probs, logits.clone())?;
            r.score = Some(ScoreTerm {
                log_prob,
                baseline: self.baseline.clone(),
            });
            r.metrics
                .push(("experts_evaluated_per_token", Tensor::scalar(1.0, dt, dev)?));
            return Ok(r);
        }
        let extra = crate::no_grad(|| -> Result<Option<Tensor>> {
            Ok(match self.estimator {
                Estimator::GumbelSt { tau } => {
                    Some(theta.add(&g)?.mul_scalar(1.0 / tau)?.softmax(-1)?)
                }
                Estimator::ReinMax { tau } => Some(
                    theta
                        .mul_scalar(1.0 / tau)?
                        .softmax(-1)?
                        .add(&e_d)?
                        .mul_scalar(0.5)?,
                ),
                _ => None,
            })
        })?;
        let estimator = self.estimator;
        let (pi_s, e_s) = (pi.clone(), e_d.clone());
        let w = custom_op(
            estimator.name(),
            &[logits],
            |_| e_d.mul(&pi),
            move |ctx| {
                let a = ctx.grad_output;
                let u = pi_s.mul(a)?;
                let grad = match (estimator, &extra) {
                    (Estimator::GumbelSt { tau }, Some(s)) => {
                        jvp_softmax(s, &u)?.mul_scalar(1.0 / tau)?
                    }
                    (Estimator::ReinMax { .. }, Some(tilde)) => {
                        let first = jvp_softmax(tilde, &u.mul_scalar(2.0)?)?;
                        let v = e_s.mul(a)?.sub(&u.mul_scalar(0.5)?)?;
                        first.add(&jvp_softmax(&pi_s, &v)?)?
                    }
                    _ => jvp_softmax(&pi_s, &u)?,
                };
                Ok(vec![Some(grad)])
            },
        )?;
        let mut r = Routing::every_expert(&w, pi, logits.clone())?;
        r.metrics.push((
            "experts_evaluated_per_token",
            Tensor::scalar(n as f64, dt, dev)?,
        ));
        Ok(r)
    }
}

/// `J(q, v) = q ⊙ v − q·⟨q, v⟩` row by row (`[T, n]`): the softmax's Jacobian at q applied to v.
pub fn jvp_softmax(q: &Tensor, v: &Tensor) -> Result<Tensor> {
    let qv = q.mul(v)?;
    qv.sub(&q.mul(&qv.sum(&[-1], true)?)?)
}

/// The straight-through Gumbel-softmax relaxation `S_τ = softmax((θ + G)/τ)` with G drawn
/// from `seed` as [`gumbel_noise`] draws it (untracked). As τ → 0 each row tends to the
/// one-hot of the Gumbel-max sample.
pub fn gumbel_softmax(theta: &Tensor, tau: f64, seed: u64) -> Result<Tensor> {
    crate::no_grad(|| {
        let theta = theta.detach();
        theta
            .add(&gumbel_noise(&theta, seed)?)?
            .mul_scalar(1.0 / tau)?
            .softmax(-1)
    })
}

impl Router for EstimatorRouter {
    fn name(&self) -> &'static str {
        self.estimator.name()
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
    fn runs_all_experts(&self) -> bool {
        self.estimator.is_dense()
    }
    fn estimates_gradient(&self) -> bool {
        true
    }
}

impl Parameters for EstimatorRouter {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(String, &Param)) {
        self.gate.visit(prefix, f)
    }
    fn set_training(&self, training: bool) {
        self.gate.set_training(training)
    }
    /// The gate's noise counter, and for `reinforce` with a baseline its running mean as
    /// `baseline.average` and `baseline.updates`.
    fn state(&self) -> Result<Vec<(String, Tensor)>> {
        let mut state = self.gate.state()?;
        if let Some(b) = &self.baseline {
            for (name, t) in b.state()? {
                state.push((format!("{BASELINE_PREFIX}{name}"), t));
            }
        }
        Ok(state)
    }
    fn load_state(&self, name: &str, value: &Tensor) -> Result<()> {
        match (name.strip_prefix(BASELINE_PREFIX), &self.baseline) {
            (Some(entry), Some(b)) => b.load_state(entry, value),
            _ => self.gate.load_state(name, value),
        }
    }
}

/// Where `reinforce`'s baseline state sits among the router's state names.
const BASELINE_PREFIX: &str = "baseline.";
