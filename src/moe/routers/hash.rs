//! `hash` — a fixed, untrained assignment in the spirit of Hash Layers (Roller et al. 2021; XMoE
//! §1.6): each token goes to one expert chosen by a fixed function of its input, with weight 1,
//! and the router has no parameters and no gradient. Inputs here are vectors, not token ids, so
//! the hash is the argmax of a fixed random projection (a locality-sensitive hash): the same
//! input always lands on the same expert.

use crate::nn::Parameters;
use crate::moe::Routing;
use crate::moe::RouterSpec;
use crate::moe::{Router, RouterConfig};
use crate::nn::{Param, uniform};
use crate::{Device, Result, Tensor};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// The registry entry of `hash` (see [`crate::moe::ROUTERS`]).
pub(crate) const SPEC: RouterSpec = RouterSpec {
    name: "hash",
    summary: "hash routing: a fixed random expert per token, weight 1, no parameters",
    options: &[],
    build: |cfg, device| Ok(Box::new(HashRouter::new(cfg, device)?)),
    estimator_lab: None,
};

/// Fixed random-projection hashing, top-1, weight 1.
pub struct HashRouter {
    projection: Tensor,
}

impl HashRouter {
    /// A hash router with a projection drawn from the seed (not a parameter).
    pub fn new(cfg: &RouterConfig, device: Device) -> Result<HashRouter> {
        let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed ^ 0x6861_7368);
        Ok(HashRouter {
            projection: uniform(&[cfg.d, cfg.experts], 1.0, &mut rng, device)?,
        })
    }
}

impl Router for HashRouter {
    fn name(&self) -> &'static str {
        "hash"
    }
    fn route(&self, x: &Tensor) -> Result<Routing> {
        let xd = x.detach();
        let scores = xd.matmul(&self.projection.to_dtype(x.dtype())?)?;
        let (_, idx) = scores.topk(1)?;
        let t = x.shape()[0];
        let ones = Tensor::ones(&[t, 1], x.dtype(), x.device())?;
        let probs = scores.eq(&scores.max(-1, true)?)?; // one-hot of the hashed expert
        Routing::token_choice(&idx, &ones, None, probs, scores)
    }
}

impl Parameters for HashRouter {
    fn visit_params(&self, _: &str, _: &mut dyn FnMut(String, &Param)) {}
    fn set_training(&self, _: bool) {}
}
