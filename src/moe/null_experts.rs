//! Null experts (`MoeConfig::null_experts`, `--null-experts N`; AdaMoE, Zeng et al. 2024, arXiv
//! 2406.13233; MoE++'s zero-computation experts, Jin et al. 2024, arXiv 2410.07348): the router
//! scores `n + N` experts, the last `N` of which output zero at no cost, so a token that picks
//! some of them uses fewer than k real experts. This file holds the two steps the layer takes:
//! [`check_null_experts`] when it is built (which routers can pick a null expert) and
//! [`Routing::without_null_experts`] before each dispatch (null choices become invalid
//! assignments, which the plan skips). The balance loss, z-loss and selection biases see all
//! `n + N`; the experts, capacity and diagnostics see `n` (docs/routers.md, "Null experts").

use super::{MoeConfig, Router, Routing};
use crate::{DType, Error, Result};

impl Routing {
    /// The routing the experts run, for a router that also scores `N` null experts (indices
    /// `n..n+N`, [`crate::moe::MoeConfig::null_experts`]): an assignment to a null expert
    /// becomes invalid (it computes nothing and adds nothing; its weight stays, multiplying a
    /// zero output), `experts` becomes `n`, and `probs`/`logits` keep the real experts' columns,
    /// `probs` renormalised per token, for the diagnostics. No gradient flows through the
    /// changes (the weights are untouched).
    pub fn without_null_experts(mut self, n: usize) -> Result<Routing> {
        let routed = self.experts;
        if n == 0 || n > routed {
            return Err(crate::Error::Invalid(format!(
                "a routing over {routed} experts has no {n} real ones"
            )));
        }
        if n == routed {
            return Ok(self);
        }
        crate::no_grad(|| {
            let ft = self.valid.dtype();
            let e = self.expert.to_dtype(ft)?;
            // 1 for a real expert (e < n), 0 for a null one: min(max(n − e, 0), 1) on whole numbers
            let real = e.neg()?.add_scalar(n as f64)?.clamp(0.0, 1.0)?;
            self.valid = self.valid.mul(&real)?;
            // a null assignment points at expert 0, invalid (the plan skips it)
            self.expert = e.mul(&real)?.to_dtype(DType::I32)?;
            let p = self.probs.detach().slice(1, 0, n)?;
            let mass = p.sum(&[1], true)?.add_scalar(1e-12)?;
            self.probs = p.div(&mass)?;
            self.logits = self.logits.detach().slice(1, 0, n)?;
            Ok::<_, crate::Error>(())
        })?;
        self.experts = n;
        // the real experts alone are no longer every expert of the dense weights
        self.dense = None;
        Ok(self)
    }
}

/// Fails unless `router` can route to null experts (when the config has any): a token-choice
/// router that scores every expert; not `expert-choice` (experts choose tokens), `hash` (a
/// fixed table) or `softmax` (every expert runs, so no token can skip one).
pub(crate) fn check_null_experts(cfg: &MoeConfig, router: &dyn Router) -> Result<()> {
    let name = router.name();
    if cfg.null_experts > 0 && matches!(name, "expert-choice" | "hash" | "softmax") {
        return Err(Error::Invalid(format!(
            "--null-experts {} needs a token-choice router that picks experts per token; {name} {}",
            cfg.null_experts,
            match name {
                "expert-choice" =>
                    "lets each expert choose its tokens, so no token picks a null expert",
                "hash" => "assigns tokens by a fixed table, not by scores",
                _ => "runs every expert for every token",
            }
        )));
    }
    Ok(())
}
