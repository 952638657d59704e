//! `expert-choice` — Expert Choice routing (Zhou et al. 2022; MOESART §3, reconstructed):
//! `S = softmax over experts of x·W + b` (`[T, n]`); each expert e keeps the `k' = round(T·k/n)`
//! tokens with the largest `S[·, e]`: `G[e, b] = S[b, e]` if b is among them, else 0;
//! `y_b = Σ_e G[e, b] f_e(x_b)`. Every expert processes exactly k' tokens; a token may get
//! 0..n experts; the choice depends on the batch, also at inference.

use crate::nn::Parameters;
use crate::moe::Routing;
use crate::moe::RouterSpec;
use crate::moe::{LinearGate, Router, RouterConfig};
use crate::nn::Param;
use crate::{DType, Device, Error, Result, Tensor};

/// The registry entry of `expert-choice` (see [`crate::moe::ROUTERS`]).
pub(crate) const SPEC: RouterSpec = RouterSpec {
    name: "expert-choice",
    summary: "Expert Choice: each expert picks its top tokens (k per token on average)",
    options: &[],
    build: |cfg, device| Ok(Box::new(ExpertChoiceRouter::new(cfg, device)?)),
    estimator_lab: None,
};

/// Experts pick their top-k' tokens.
pub struct ExpertChoiceRouter {
    gate: LinearGate,
    k: usize,
    experts: usize,
}

impl ExpertChoiceRouter {
    /// k is the average number of experts per token.
    pub fn new(cfg: &RouterConfig, device: Device) -> Result<ExpertChoiceRouter> {
        Ok(ExpertChoiceRouter {
            gate: LinearGate::new(cfg, device)?,
            k: cfg.k,
            experts: cfg.experts,
        })
    }
}

impl Router for ExpertChoiceRouter {
    fn name(&self) -> &'static str {
        "expert-choice"
    }
    fn reads_tokens_only_through_products(&self) -> bool {
        true
    }
    fn route(&self, x: &Tensor) -> Result<Routing> {
        let t = x.shape()[0];
        let n = self.experts;
        let per_expert = ((t * self.k) as f64 / n as f64).round().max(1.0) as usize;
        if per_expert > t {
            return Err(Error::Invalid(format!(
                "expert-choice: k' = {per_expert} exceeds the {t} tokens of the batch"
            )));
        }
        let logits = self.gate.logits(x)?;
        let s = logits.softmax(-1)?;
        let (vals, tok) = s.transpose(0, 1)?.topk(per_expert)?; // [n, k'] each
        let a = n * per_expert;
        let (expert_of_row, _) = crate::moe::slot_tables(n, per_expert, x.device())?;
        let dev = x.device();
        Ok(Routing {
            token: tok.reshape(&[a])?,
            expert: expert_of_row,
            weight: vals.reshape(&[a])?,
            valid: Tensor::ones(&[a], DType::F32, dev)?,
            rank: Tensor::zeros(&[a], DType::F32, dev)?,
            probs: s,
            logits,
            // expert-major: each expert's chosen tokens, in any token order
            slots_per_token: None,
            tokens: t,
            experts: n,
            aux_loss: None,
            metrics: Vec::new(),
            score: None,
            selection: None,
            defaults: None,
            dense: None,
        })
    }
}

impl Parameters for ExpertChoiceRouter {
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
