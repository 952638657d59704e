//! `vmoe` — V-MoE (Riquelme et al. 2021; MOESART §3): `g = TopK(σ(o + ε), k)`, zero-filled and
//! **not** renormalised, `ε_i ~ N(0, 1/n²)` per logit per token in training only. Backward with
//! `p = σ(o + ε)`: `∂L/∂o_j = p_j (a_j·1[j∈T] − Σ_{i∈T} p_i a_i)` — nonzero for unselected j, and
//! a router gradient even at k = 1.

use crate::nn::Parameters;
use crate::moe::Routing;
use crate::moe::RouterSpec;
use crate::moe::{LinearGate, Router, RouterConfig, SelectionBias, normal_noise};
use crate::nn::Param;
use crate::{Device, Result, Tensor};

/// The registry entry of `vmoe` (see [`crate::moe::ROUTERS`]).
pub(crate) const SPEC: RouterSpec = RouterSpec {
    name: "vmoe",
    summary: "V-MoE: top-k of the softmax with additive N(0, 1/n^2) noise",
    options: &[],
    build: |cfg, device| Ok(Box::new(VMoeRouter::new(cfg, device)?)),
    estimator_lab: None,
};

/// V-MoE's noisy, unnormalised top-k.
pub struct VMoeRouter {
    gate: LinearGate,
    k: usize,
    noise_std: f64,
}

impl VMoeRouter {
    /// Noise std 1/n.
    pub fn new(cfg: &RouterConfig, device: Device) -> Result<VMoeRouter> {
        Ok(VMoeRouter {
            gate: LinearGate::new(cfg, device)?,
            k: cfg.k,
            noise_std: 1.0 / cfg.experts as f64,
        })
    }
}

impl Router for VMoeRouter {
    fn name(&self) -> &'static str {
        "vmoe"
    }
    fn reads_tokens_only_through_products(&self) -> bool {
        true
    }
    fn route(&self, x: &Tensor) -> Result<Routing> {
        let logits = self.gate.logits(x)?;
        let noisy = if self.gate.training() {
            logits
                .add(&normal_noise(&logits, self.gate.noise_seed())?.mul_scalar(self.noise_std)?)?
        } else {
            logits.clone()
        };
        let p = noisy.softmax(-1)?;
        let chosen = self.gate.selection_scores(&p)?;
        let (_, idx) = chosen.topk(self.k)?;
        let g = p.gather(1, &idx)?;
        Ok(self
            .gate
            .mark(Routing::token_choice(&idx, &g, None, p, logits)?, &chosen))
    }
    fn selection_bias(&self) -> Option<&SelectionBias> {
        self.gate.selection.as_ref()
    }
}

impl Parameters for VMoeRouter {
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
