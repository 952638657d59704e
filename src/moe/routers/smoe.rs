//! `smoe` — SMoE with Switch-style multiplicative jitter on the router **input** (MOESART §3):
//! `g = TopK(σ(A(x ⊙ ε) + b), k)`, zero-filled, not renormalised, `ε ~ U(0.98, 1.02)`
//! elementwise, training only. Backward as V-MoE (nonzero for unselected experts).

use crate::nn::Parameters;
use crate::moe::Routing;
use crate::moe::RouterSpec;
use crate::moe::{LinearGate, Router, RouterConfig, SelectionBias, uniform_noise};
use crate::nn::Param;
use crate::{Device, Result, Tensor};

/// The registry entry of `smoe` (see [`crate::moe::ROUTERS`]).
pub(crate) const SPEC: RouterSpec = RouterSpec {
    name: "smoe",
    summary: "SMoE: top-k of the softmax with multiplicative noise on the input",
    options: &[],
    build: |cfg, device| Ok(Box::new(SMoeRouter::new(cfg, device)?)),
    estimator_lab: None,
};

/// Top-k over a softmax of jittered inputs.
pub struct SMoeRouter {
    gate: LinearGate,
    k: usize,
}

impl SMoeRouter {
    /// An SMoE router.
    pub fn new(cfg: &RouterConfig, device: Device) -> Result<SMoeRouter> {
        Ok(SMoeRouter {
            gate: LinearGate::new(cfg, device)?,
            k: cfg.k,
        })
    }
}

impl Router for SMoeRouter {
    fn name(&self) -> &'static str {
        "smoe"
    }
    fn route(&self, x: &Tensor) -> Result<Routing> {
        let xin = if self.gate.training() {
            x.mul(&uniform_noise(x, 0.98, 1.02, self.gate.noise_seed())?)?
        } else {
            x.clone()
        };
        let logits = self.gate.logits(&xin)?;
        let p = logits.softmax(-1)?;
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

impl Parameters for SMoeRouter {
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
