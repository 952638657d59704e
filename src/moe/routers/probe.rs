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
//! left as initialised. Layer-level extras are not applied (SparseMixer's ω is 1).
//!
//! `reinforce` is the exception: its in-layer rule uses a first-order reward (see
//! `estimators.rs`); the probe computes the true score-function estimate
//! `∂L/∂o_t = L(y)·(e_{D_t} − π_t)` with the loss value as reward (spec 1.8), unbiased for ∇₀.

use crate::moe::Routing;
use crate::moe::router::{Router, RouterConfig, build_router};
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
    /// `y_t = Σ_a w_a f[t, e_a]` from `expert_out` `[T, n, d]`, evaluates `loss(y)` (a scalar
    /// tensor built from tracked ops on y) and returns the router's `∂L/∂logits`.
    ///
    /// # Errors
    /// Shapes that do not fit (`logits` not `[T, n]`, `expert_out` not `[T, n, d]`), a loss that
    /// is not a scalar, or any error of the router or the loss.
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
        let y = f.mul(&w)?.index_scatter(0, &routing.token, t)?;
        let l = loss(&y)?;
        if l.numel() != 1 {
            return Err(Error::Shape(format!(
                "gradient probe: the loss must be a scalar, got shape {:?}",
                l.shape()
            )));
        }
        let value = l.item()?;
        let grad = if self.name == "reinforce" {
            let e_d = super::one_hot(&routing.expert.reshape(&[t, 1])?, n, dtype, x.device())?;
            crate::no_grad(|| e_d.sub(&routing.probs.detach())?.mul_scalar(value))?
        } else if l.requires_grad() {
            l.reshape(&[])?.backward()?;
            match x.grad() {
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
