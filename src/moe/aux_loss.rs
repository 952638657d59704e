//! Auxiliary losses of the router.
//!
//! * Switch load balancing (Fedus et al. 2021, Eq. 4): `α · n · Σ_i f_i · P_i`, with
//!   `f_i` the fraction of all (valid) assignments routed to expert i — a constant, no gradient,
//!   `Σ f_i = 1` for every k — and `P_i = (1/T) Σ_x p_i(x)` the mean router probability. Uniform
//!   routing gives exactly α at every k, full collapse αn; the loss can go below α, so nothing
//!   asserts it cannot. (Mixtral's and the Switch library's top-k code count the tokens whose
//!   top-k includes expert i, `Σ f_i = k`, so their loss is k times this one; docs/routers.md.)
//!   `∂/∂θ_k(x) = (αn/T) · p_k(x) · (f_k − Σ_i f_i p_i(x))`.
//! * Router z-loss (ST-MoE, Zoph et al. 2022): `β · (1/T) Σ_x (log Σ_j e^{θ_j(x)})²`.

use super::Routing;
use crate::{Result, Tensor};

/// `α · n · Σ f_i P_i` for one routing, given the per-expert assignment counts (`[n]`, constant).
pub fn balance_loss(routing: &Routing, routed_per_expert: &Tensor, alpha: f64) -> Result<Tensor> {
    let n = routing.experts as f64;
    let f = crate::no_grad(|| {
        let total = routed_per_expert.sum_all()?.clamp(1.0, f64::INFINITY)?;
        routed_per_expert.div(&total)
    })?;
    let p_mean = routing.probs.mean(&[0], false)?;
    p_mean
        .mul(&f.to_dtype(p_mean.dtype())?)?
        .sum_all()?
        .mul_scalar(alpha * n)
}

/// `β · mean_x (logsumexp θ(x))²`.
pub fn z_loss(routing: &Routing, beta: f64) -> Result<Tensor> {
    let lse = routing.logits.logsumexp(-1, false)?;
    lse.mul(&lse)?.mean_all()?.mul_scalar(beta)
}
