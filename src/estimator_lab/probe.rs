//! One router-gradient estimate for a small problem with fixed expert outputs: what the
//! estimator lab (`moegrad estimators`) and the SparseMixer tests draw, many times, to measure
//! an estimator's bias and variance against the exact gradient.
//!
//! The problem is SparseMixer's simplified layer (§2): per token t, logits `o_t ∈ R^n`, fixed
//! expert outputs `f_{t,i} ∈ R^d`, the layer output `y_t = Σ_{assignments a of t} w_a f_{t,e_a}`
//! and a scalar loss `L = loss(y)`. [`GradientProbe::estimate`] routes the logits with the named
//! router in training mode (one fresh noise draw), forms y, runs `loss`, back-propagates and
//! returns the router's `∂L/∂o` for that draw: whatever the router's own backward rule makes of
//! it (SparseMixer's 2× mid-point rule, straight-through, ReinMax, Switch's ∇₁ only, ...).
//!
//! It works for every router whose logits come from a `LinearGate` (`x·W + b`, parameters named
//! `weight` `[d, n]` and `bias` `[n]`): the probe builds the router with `d = n`, sets
//! `W = I` and `b = 0`, and feeds the logits in as x, so `∂L/∂x = ∂L/∂o`. Other parameters are
//! left as initialised. Layer-level extras are not applied (SparseMixer's ω is 1), except Default
//! MoE's dense term, which the probe adds as the layer does (its router's `d_out` must be the
//! outputs' width d).
//!
//! The loss may be given per token (`[T]`, the loss being their sum). Routers whose gradient is
//! the score function (`reinforce`) need that: the probe adds the router's own surrogate
//! ([`crate::moe::ScoreTerm::surrogate`]) with each token's loss as its reward, exactly as the
//! training loop does, so what it returns is the router's own estimate
//! `∂L/∂o_t = (ℓ_t − b)(e_{D_t} − π_t)`, running baseline b included.

use crate::moe::Routing;
use crate::moe::{Router, RouterConfig, build_router};
use crate::{DType, Device, Error, Result, Tensor};

/// A router set up to turn logits into router-gradient estimates (see the module docs).
pub struct GradientProbe {
    router: Box<dyn Router>,
    name: String,
    experts: usize,
}

/// One draw of an estimator.
#[derive(Clone, Debug)]
pub struct GradientEstimate {
    /// `[T, n]`, the dtype of the logits: the router's `∂L/∂o` for this draw (zeros when the
    /// router passes no gradient to its logits, e.g. `hash`)
    pub grad: Tensor,
    /// the loss value `L(y)` of this draw
    pub loss: f64,
    /// `[T, d]`: the layer output of this draw
    pub y: Tensor,
    /// the routing of this draw: chosen experts, forward weights (SparseMixer's `c·π_D`),
    /// probabilities, metrics
    pub routing: Routing,
    /// valid assignments per token: the experts evaluated (n for `st`, `gumbel-st`, `reinmax`)
    pub experts_per_token: f64,
}

impl GradientProbe {
    /// Builds the router `name` (any of `ROUTER_NAMES` with a linear gate) from `cfg` (its
    /// `experts`, `k`, `jitter`, `seed` and `options`; `d` is replaced by `experts`) on
    /// `device`, in training mode. Draws are reproducible: the i-th call to [`Self::estimate`]
    /// of a probe built with the same seed uses the same noise.
    pub fn new(name: &str, cfg: &RouterConfig, device: Device) -> Result<GradientProbe> {
        let mut cfg = cfg.clone();
        cfg.d = cfg.experts;
        let router = build_router(name, &cfg, device)?;
        let n = cfg.experts;
        let mut missing = vec!["weight", "bias"];
        let mut err = None;
        router.visit_params("", &mut |pname, p| {
            let shape = p.get().shape().to_vec();
            let value = if pname == "weight" && shape == [n, n] {
                let eye: Vec<f32> = (0..n * n)
                    .map(|i| if i / n == i % n { 1.0 } else { 0.0 })
                    .collect();
                Tensor::from_f32(eye, &[n, n], device)
            } else if pname == "bias" && shape == [n] {
                Tensor::zeros(&[n], DType::F32, device)
            } else {
                return;
            };
            missing.retain(|m| *m != pname);
            if let Err(e) = value.and_then(|v| p.set(v)) {
                err = Some(e);
            }
        });
        if let Some(e) = err {
            return Err(e);
        }
        if !missing.is_empty() {
            return Err(Error::Invalid(format!(
                "gradient probe: router {name} has no linear gate (no parameter {} of shape [{n}, {n}] / [{n}])",
                missing.join(", ")
            )));
        }
        router.set_training(true);
        Ok(GradientProbe {
            router,
            name: name.to_string(),
            experts: n,
        })
    }

    /// The router being probed.
    pub fn router(&self) -> &dyn Router {
        self.router.as_ref()
    }

    /// One draw: routes `logits` `[T, n]` (training mode, fresh noise), forms
    /// `y_t = Σ_a w_a f[t, e_a]` from `expert_out` `[T, n, d]`, evaluates `loss(y)` (tracked ops
    /// on y: a scalar, or per-token losses `[T]` whose sum is the loss) and returns the router's
    /// `∂L/∂logits`.
    ///
    /// # Errors
    /// Shapes that do not fit (`logits` not `[T, n]`, `expert_out` not `[T, n, d]`), a loss that
    /// is neither a scalar nor `[T]`, a scalar loss for a score-function router (it needs each
    /// token's loss), or any error of the router or the loss.
    pub fn estimate(
        &self,
        logits: &Tensor,
        expert_out: &Tensor,
        loss: &dyn Fn(&Tensor) -> Result<Tensor>,
    ) -> Result<GradientEstimate> {
        let n = self.experts;
        let ls = logits.shape().to_vec();
        let fs = expert_out.shape().to_vec();
        if ls.len() != 2 || ls[1] != n || fs.len() != 3 || fs[0] != ls[0] || fs[1] != n {
            return Err(Error::Shape(format!(
                "gradient probe ({}): expects logits [T, {n}] and expert outputs [T, {n}, d], got {ls:?} and {fs:?}",
                self.name
            )));
        }
        let (t, d) = (ls[0], fs[2]);
        let dtype = logits.dtype();
        let mut err = None;
        self.router.visit_params("", &mut |_, p| {
            let v = p.get();
            if v.dtype() != dtype
                && let Err(e) = v.to_dtype(dtype).and_then(|c| p.set(c.detach()))
            {
                err = Some(e);
            }
        });
        if let Some(e) = err {
            return Err(e);
        }
        let x = logits.detach().with_grad()?;
        let routing = self.router.route(&x)?;
        let token = routing.token.to_vec_i32()?;
        let expert = routing.expert.to_vec_i32()?;
        let rows: Vec<i32> = token
            .iter()
            .zip(&expert)
            .map(|(&tk, &e)| tk * n as i32 + e)
            .collect();
        let a = rows.len();
        let rows = Tensor::from_i32(rows, &[a], logits.device())?;
        let f = expert_out
            .detach()
            .to_dtype(dtype)?
            .reshape(&[t * n, d])?
            .index_select(0, &rows)?;
        let w = routing
            .weight
            .to_dtype(dtype)?
            .mul(&routing.valid.to_dtype(dtype)?)?
            .reshape(&[a, 1])?;
        let mut y = f.mul(&w)?.index_scatter(0, &routing.token, t)?;
        if let Some(term) = &routing.defaults {
            // Default MoE's layer step on the fixed expert outputs (`moe::MoeLayer`): the running
            // means from this draw's rows, then `d − sg(d)` for the unselected experts
            let valid = routing.valid.to_dtype(dtype)?;
            let (sums, counts) = crate::no_grad(|| {
                let sums = f.detach().mul(&valid.reshape(&[a, 1])?)?.index_scatter(
                    0,
                    &routing.expert,
                    n,
                )?;
                let counts = Tensor::zeros(&[n], dtype, logits.device())?.scatter_add(
                    0,
                    &routing.expert,
                    &valid,
                )?;
                Ok::<_, Error>((sums, counts))
            })?;
            term.outputs.update(&sums, &counts)?;
            let d = term.outputs.dense_term(&term.unselected)?.to_dtype(dtype)?;
            y = y.add(&d.sub(&d.detach())?)?;
        }
        let l = loss(&y)?;
        let per_token = match l.shape() {
            [n] if *n == t && t != 1 => Some(l.clone()),
            _ if l.numel() == 1 => None,
            other => {
                return Err(Error::Shape(format!(
                    "gradient probe: the loss must be a scalar or per-token losses [{t}], got shape {other:?}"
                )));
            }
        };
        let total = l.sum_all()?;
        let value = total.item()?;
        let objective = match &routing.score {
            None => total,
            Some(score) => {
                let token_loss = match &per_token {
                    Some(p) => p.clone(),
                    None if t == 1 => l.reshape(&[1])?,
                    None => {
                        return Err(Error::Invalid(format!(
                            "gradient probe: {} takes the score function, which needs each token's loss: give the loss as per-token values [T] rather than a scalar",
                            self.name
                        )));
                    }
                };
                total.add(&score.surrogate(&token_loss)?)?
            }
        };
        let grad = if objective.requires_grad() {
            objective.backward()?;
            match x.try_grad()? {
                Some(g) => g,
                None => x.zeros_like()?,
            }
        } else {
            x.zeros_like()?
        };
        let kept: f64 = routing.valid.to_vec_f64()?.iter().sum();
        Ok(GradientEstimate {
            grad,
            loss: value,
            y: y.detach(),
            experts_per_token: kept / t.max(1) as f64,
            routing,
        })
    }
}

/// One draw of router `name`'s gradient estimate: [`GradientProbe::new`] then
/// [`GradientProbe::estimate`] once (for many draws keep one probe, whose draws differ).
pub fn estimate_router_gradient(
    name: &str,
    cfg: &RouterConfig,
    logits: &Tensor,
    expert_out: &Tensor,
    loss: &dyn Fn(&Tensor) -> Result<Tensor>,
) -> Result<GradientEstimate> {
    GradientProbe::new(name, cfg, logits.device())?.estimate(logits, expert_out, loss)
}
