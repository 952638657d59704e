//! The Top-k family.
//!
//! * `topk` — Shazeer et al. 2017 (MOESART §3, DSelect-k §2): `g = σ(TopK(o, k))`, the softmax
//!   over the k selected logits (renormalised). Backward: for `j ∈ T`,
//!   `∂L/∂o_j = g_j (a_j − Σ_{i∈T} g_i a_i)`, and 0 for `j ∉ T`; with k = 1 the weight is
//!   exactly 1 and the router gets no gradient.
//! * `topk-noisy` — Shazeer's noisy gating: `H = o + ξ ⊙ softplus(x·W_noise)`, `ξ ~ N(0, 1)`
//!   in training only; `g = σ(KeepTopK(H, k))`.
//! * `topk-unnorm` — XMoE Eq. 1–2 (Switch's gate at k = 1): `p = σ(o)` over all n, keep the top k,
//!   **not** renormalised (`Σg < 1`); `∂L/∂o_k = Σ_{i∈T} a_i p_i (δ_ik − p_k)`, nonzero for
//!   unselected k.
//!
//! Ties are broken by the lowest index (stable sort).

use crate::nn::Parameters;
use crate::moe::Routing;
use crate::moe::RouterSpec;
use crate::moe::{LinearGate, Router, RouterConfig, SelectionBias, normal_noise};
use crate::nn::{Param, join};
use crate::{Device, Result, Tensor};

/// The registry entry of `topk` (see [`crate::moe::ROUTERS`]).
pub(crate) const SPEC_TOPK: RouterSpec = RouterSpec {
    name: "topk",
    summary: "Shazeer's Top-k: softmax over the k largest logits",
    options: &[],
    build: |cfg, device| Ok(Box::new(TopKRouter::new(cfg, TopKKind::Shazeer, device)?)),
    estimator_lab: None,
};

/// The registry entry of `topk-noisy`.
pub(crate) const SPEC_TOPK_NOISY: RouterSpec = RouterSpec {
    name: "topk-noisy",
    summary: "Shazeer's noisy Top-k gating: learned Gaussian noise on the logits in training",
    options: &[],
    build: |cfg, device| Ok(Box::new(TopKRouter::new(cfg, TopKKind::Noisy, device)?)),
    estimator_lab: None,
};

/// The registry entry of `topk-unnorm`.
pub(crate) const SPEC_TOPK_UNNORM: RouterSpec = RouterSpec {
    name: "topk-unnorm",
    summary: "softmax over all n, keep the top k, not renormalised (XMoE Eq. 1-2)",
    options: &[],
    build: |cfg, device| {
        Ok(Box::new(TopKRouter::new(
            cfg,
            TopKKind::Unnormalised,
            device,
        )?))
    },
    estimator_lab: None,
};

/// Which Top-k variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TopKKind {
    /// softmax over the selected k (Shazeer)
    Shazeer,
    /// Shazeer with learned Gaussian noise on the logits
    Noisy,
    /// softmax over all n, keep k, no renormalisation (XMoE Eq. 1–2; Switch at k = 1)
    Unnormalised,
}

/// A Top-k router.
pub struct TopKRouter {
    gate: LinearGate,
    kind: TopKKind,
    k: usize,
    noise: Option<Param>,
}

impl TopKRouter {
    /// A Top-k router of the given kind.
    pub fn new(cfg: &RouterConfig, kind: TopKKind, device: Device) -> Result<TopKRouter> {
        let noise = if kind == TopKKind::Noisy {
            Some(Param::new(Tensor::zeros(
                &[cfg.d, cfg.experts],
                crate::DType::F32,
                device,
            )?)?)
        } else {
            None
        };
        Ok(TopKRouter {
            gate: LinearGate::new(cfg, device)?,
            kind,
            k: cfg.k,
            noise,
        })
    }
}

impl Router for TopKRouter {
    fn name(&self) -> &'static str {
        match self.kind {
            TopKKind::Shazeer => "topk",
            TopKKind::Noisy => "topk-noisy",
            TopKKind::Unnormalised => "topk-unnorm",
        }
    }
    fn reads_tokens_only_through_products(&self) -> bool {
        true
    }
    fn route(&self, x: &Tensor) -> Result<Routing> {
        let logits = self.gate.logits(x)?;
        let noisy = match (&self.noise, self.gate.training()) {
            (Some(w_noise), true) => {
                let scale = x.matmul(&w_noise.get())?.softplus()?;
                let xi = normal_noise(&logits, self.gate.noise_seed())?;
                Some(logits.add(&xi.mul(&scale)?)?)
            }
            _ => None,
        };
        let renormalise = self.kind != TopKKind::Unnormalised;
        if self.gate.selection.is_some() {
            // balancing's bias moves the choice only: select by sg(h) + b, weigh by h as below
            let h = noisy.unwrap_or_else(|| logits.clone());
            let chosen = self.gate.selection_scores(&h)?;
            let (_, idx) = chosen.topk(self.k)?;
            let probs = logits.softmax(-1)?;
            let weights = if renormalise {
                h.gather(1, &idx)?.softmax(-1)?
            } else {
                probs.gather(1, &idx)?
            };
            let routing = Routing::token_choice(&idx, &weights, None, probs, logits)?;
            return Ok(self.gate.mark(routing, &chosen));
        }
        // softmax, selection and normalisation are one fused op (one kernel on the GPU)
        let gate = if renormalise {
            logits.topk_gate(noisy.as_ref(), self.k, true)?
        } else {
            logits.topk_gate(None, self.k, false)?
        };
        Routing::token_choice(&gate.idx, &gate.weights, None, gate.probs, logits)
    }
    fn selection_bias(&self) -> Option<&SelectionBias> {
        self.gate.selection.as_ref()
    }
}

impl Parameters for TopKRouter {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(String, &Param)) {
        self.gate.visit(prefix, f);
        if let Some(w) = &self.noise {
            f(join(prefix, "noise_weight"), w);
        }
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
