//! `softmax`: the dense baseline (MOESART §3, DSelect-k §2). Every token goes to all n experts
//! with weights `g = σ(o)`, `o = x·W + b`. Backward: `∂L/∂o_j = g_j (a_j − Σ_i g_i a_i)` with
//! `a_i = ⟨∂L/∂y, f_i(x)⟩` — autograd of the softmax gives exactly this.

use crate::nn::Parameters;
use crate::moe::Routing;
use crate::moe::RouterSpec;
use crate::moe::{LinearGate, Router, RouterConfig};
use crate::nn::Param;
use crate::{Device, Result, Tensor};

/// The registry entry of `softmax` (see [`crate::moe::ROUTERS`]).
pub(crate) const SPEC: RouterSpec = RouterSpec {
    name: "softmax",
    summary: "dense baseline: every expert, weighted by the softmax of the logits",
    options: &[],
    build: |cfg, device| Ok(Box::new(SoftmaxRouter::new(cfg, device)?)),
    estimator_lab: None,
};

/// Dense softmax gate over all experts.
pub struct SoftmaxRouter {
    gate: LinearGate,
}

impl SoftmaxRouter {
    /// A dense router (k is ignored: every expert runs).
    pub fn new(cfg: &RouterConfig, device: Device) -> Result<SoftmaxRouter> {
        Ok(SoftmaxRouter {
            gate: LinearGate::new(cfg, device)?,
        })
    }
}

impl Router for SoftmaxRouter {
    fn name(&self) -> &'static str {
        "softmax"
    }
    fn reads_tokens_only_through_products(&self) -> bool {
        true
    }
    fn route(&self, x: &Tensor) -> Result<Routing> {
        let logits = self.gate.logits(x)?;
        let g = logits.softmax(-1)?;
        Routing::every_expert(&g, g.clone(), logits)
    }
    fn runs_all_experts(&self) -> bool {
        true
    }
}

impl Parameters for SoftmaxRouter {
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
