//! Auxiliary losses of the router.
//!
//! * Switch load balancing (Fedus et al. 2021, Eq. 4): `α · n · Σ_i f_i · P_i`, with
//!   `f_i` the fraction of all (valid) assignments routed to expert i — a constant, no gradient,
//!   `Σ f_i = 1` for every k — and `P_i = (1/T) Σ_x p_i(x)` the mean router probability. Uniform
//!   routing gives exactly α at every k, full collapse αn; the loss can go below α, so nothing
//!   asserts it cannot. (Mixtral's and the Switch library's top-k code count the tokens whose
//!   top-k includes expert i, `Σ f_i = k`, so their loss is k times this one; docs/routers.md.)
//!   `∂/∂θ_k(x) = (αn/T) · p_k(x) · (f_k − Σ_i f_i p_i(x))`.
//! * The same loss per sequence (DeepSeek-V3's sequence-wise balance loss, arXiv 2412.19437
//!   Eq. 17–20, in Switch's normalisation): `f_i` and `P_i` of each sequence of L tokens, the
//!   sequences' losses averaged ([`sequence_balance_loss`]); with one sequence it is the loss
//!   above.
//! * Router z-loss (ST-MoE, Zoph et al. 2022): `β · (1/T) Σ_x (log Σ_j e^{θ_j(x)})²`.

use super::Routing;
use crate::backend::BinaryOp;
use crate::{DType, Error, Result, Tensor};

/// `α · n · Σ f_i P_i` for one routing, given the per-expert assignment counts (`[n]`, constant),
/// as one op each way: forward, `f`, the column sums of the router's distribution and their
/// weighted sum in one launch (`RoutingOps::balance_loss`, `shaders/router_sums.wgsl`); backward,
/// `∂/∂p_i(x) = (αn/T) f_i` for every token, one broadcast product. (Composed from tensor ops it
/// was eight launches forward and six backward.)
///
/// # Errors
/// [`Error::Shape`] when the distribution is not `[T, m]` with `m` counts.
pub fn balance_loss(routing: &Routing, routed_per_expert: &Tensor, alpha: f64) -> Result<Tensor> {
    let _profile = crate::profile::op("balance_loss");
    // the losses are of the f32 class (`autocast.rs`): an f16 distribution is summed in f32
    let probs = &match routing.probs.dtype() {
        DType::F16 => routing.probs.to_dtype(DType::F32)?,
        _ => routing.probs.clone(),
    };
    let &[tokens, cols] = probs.shape() else {
        return Err(Error::Shape(format!(
            "balance loss: the router's distribution must be [tokens, experts], got {:?}",
            probs.shape()
        )));
    };
    if routed_per_expert.shape() != [cols] {
        return Err(Error::Shape(format!(
            "balance loss: {:?} counts per expert for a distribution over {cols} experts",
            routed_per_expert.shape()
        )));
    }
    let counts = routed_per_expert.detach().to_dtype(probs.dtype())?;
    let scale = alpha * routing.experts as f64 / tokens as f64;
    let (loss, coef) = probs
        .storage()
        .balance_loss(counts.storage(), (tokens, cols), scale)?;
    let loss = Tensor::from_storage(loss, Vec::new());
    Ok(Tensor::record(loss, "balance_loss", &[probs], move |g| {
        // every token's row of the gradient is g·coef: g and coef read through strides
        let d = g
            .storage()
            .binary(BinaryOp::Mul, &[0, 0], &coef, &[0, 1], &[tokens, cols])?;
        Ok(vec![Some(Tensor::from_storage(d, vec![tokens, cols]))])
    }))
}

/// [`balance_loss`] of each sequence of `seq_len` consecutive tokens, averaged over the
/// sequences: `α · n · (1/S) Σ_s Σ_i f_i^s P_i^s`. `first_only` counts only first choices (as
/// the layer does for routers whose experts per token vary).
///
/// # Errors
/// [`Error::Shape`] when the routing's tokens are not a whole number of sequences.
pub fn sequence_balance_loss(
    routing: &Routing,
    seq_len: usize,
    alpha: f64,
    first_only: bool,
) -> Result<Tensor> {
    let (t, n) = (routing.tokens, routing.experts);
    if seq_len == 0 || !t.is_multiple_of(seq_len) {
        return Err(Error::Shape(format!(
            "sequence-wise balance loss: {t} tokens are not a whole number of sequences of {seq_len}"
        )));
    }
    let s = t / seq_len;
    let f = crate::no_grad(|| {
        let valid = valid_assignments(routing, first_only)?;
        // the (token, expert) cell of each assignment, counted per cell, then per sequence
        let cell = routing
            .token
            .to_dtype(DType::F32)?
            .mul_scalar(n as f64)?
            .add(&routing.expert.to_dtype(DType::F32)?)?
            .to_dtype(DType::I32)?;
        let counts = valid
            .index_scatter(0, &cell, t * n)?
            .reshape(&[s, seq_len, n])?
            .sum(&[1], false)?; // [S, n]
        let total = counts.sum(&[1], true)?.clamp(1.0, f64::INFINITY)?;
        counts.div(&total)
    })?;
    let p_mean = routing.probs.reshape(&[s, seq_len, n])?.mean(&[1], false)?; // [S, n]
    p_mean
        .mul(&f.to_dtype(p_mean.dtype())?)?
        .sum_all()?
        .mul_scalar(alpha * n as f64 / s as f64)
}

/// `[A]` F32: 1 for each valid assignment (only first choices, rank 0, with `first_only`).
pub(crate) fn valid_assignments(r: &Routing, first_only: bool) -> Result<Tensor> {
    let mut valid = r.valid.to_dtype(DType::F32)?;
    if first_only {
        let rank = r.rank.to_dtype(DType::F32)?;
        let first = rank.lt(&Tensor::scalar(0.5, DType::F32, r.token.device())?)?;
        valid = valid.mul(&first)?;
    }
    Ok(valid)
}

/// `β · mean_x (logsumexp θ(x))²`.
pub fn z_loss(routing: &Routing, beta: f64) -> Result<Tensor> {
    let lse = routing.logits.logsumexp(-1, false)?;
    lse.mul(&lse)?.mean_all()?.mul_scalar(beta)
}
