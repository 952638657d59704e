//! `switch` — Switch Transformer top-1 (Fedus et al. 2021; SparseMixer Eq. 8 for the jitter):
//! in training the logits are jittered multiplicatively, `θ̃ = θ ⊙ u`, `u_i ~ U(1−r, 1+r)`,
//! r = 0.1; `p = σ(θ̃)`, `D = argmax θ̃`, `y = p_D · f_D(x)`. Backward:
//! `∂L/∂θ̃_k = ⟨G_y, f_D⟩ p_D (δ_kD − p_k)`, `∂L/∂θ = u ⊙ ∂L/∂θ̃` (only the ∇₁ term).
//! Expert i is never chosen when `θ* − θ_i > r(|θ*| + |θ_i|)`.

use crate::nn::Parameters;
use crate::moe::Routing;
use crate::moe::RouterSpec;
use crate::moe::{LinearGate, Router, RouterConfig, SelectionBias, uniform_noise};
use crate::nn::Param;
use crate::{Device, Result, Tensor};

/// The registry entry of `switch` (see [`crate::moe::ROUTERS`]).
pub(crate) const SPEC: RouterSpec = RouterSpec {
    name: "switch",
    summary: "Switch Transformer top-1 with multiplicative jitter on the logits",
    options: &[],
    build: |cfg, device| Ok(Box::new(SwitchRouter::new(cfg, device)?)),
    estimator_lab: Some(8),
};

/// Top-1 with multiplicative logit jitter.
pub struct SwitchRouter {
    gate: LinearGate,
    jitter: f64,
}

impl SwitchRouter {
    /// A Switch router with the configured jitter r.
    pub fn new(cfg: &RouterConfig, device: Device) -> Result<SwitchRouter> {
        if !(0.0..1.0).contains(&cfg.jitter) {
            return Err(crate::Error::Invalid(format!(
                "switch jitter r must be in [0, 1), got {}",
                cfg.jitter
            )));
        }
        Ok(SwitchRouter {
            gate: LinearGate::new(cfg, device)?,
            jitter: cfg.jitter,
        })
    }
}

impl Router for SwitchRouter {
    fn name(&self) -> &'static str {
        "switch"
    }
    fn reads_tokens_only_through_products(&self) -> bool {
        true
    }
    fn route(&self, x: &Tensor) -> Result<Routing> {
        let logits = self.gate.logits(x)?;
        let jittered = if self.gate.training() && self.jitter > 0.0 {
            let u = uniform_noise(
                &logits,
                1.0 - self.jitter,
                1.0 + self.jitter,
                self.gate.noise_seed(),
            )?;
            logits.mul(&u)?
        } else {
            logits.clone()
        };
        let p = jittered.softmax(-1)?;
        let chosen = self.gate.selection_scores(&jittered)?;
        let (_, idx) = chosen.topk(1)?;
        let g = p.gather(1, &idx)?;
        Ok(self
            .gate
            .mark(Routing::token_choice(&idx, &g, None, p, logits)?, &chosen))
    }
    fn selection_bias(&self) -> Option<&SelectionBias> {
        self.gate.selection.as_ref()
    }
}

impl Parameters for SwitchRouter {
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
