//! `xmoe-cosine` — the low-dimensional hypersphere router of X-MoE (Chi et al. 2022; MOESART §3,
//! reconstructed): project the token to `n/2` dimensions, `h = P·x`, score each expert by a
//! cosine with a learnable temperature, `s_i = a_iᵀh / (‖a_i‖ ‖h‖ τ)`, `τ = exp(log τ)`
//! learnable (initial τ = 0.07, our choice: the papers do not fix it), and keep
//! `g = TopK(σ(s), k)`, zero-filled, not renormalised. Gradients reach P, A and τ through the
//! cosine scores.

use crate::nn::Parameters;
use crate::moe::Routing;
use crate::moe::RouterSpec;
use crate::moe::{Router, RouterConfig, SelectionBias};
use crate::nn::{Param, join, uniform};
use crate::{DType, Device, Result, Tensor};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::sync::atomic::{AtomicBool, Ordering};

/// The registry entry of `xmoe-cosine` (see [`crate::moe::ROUTERS`]).
pub(crate) const SPEC: RouterSpec = RouterSpec {
    name: "xmoe-cosine",
    summary: "XMoE cosine router: top-k of scaled cosine scores in a low-dimensional space",
    options: &[],
    build: |cfg, device| Ok(Box::new(XMoeCosineRouter::new(cfg, device)?)),
    estimator_lab: None,
};

/// Cosine router on a low-dimensional hypersphere.
pub struct XMoeCosineRouter {
    /// projection `[d, n/2]`
    pub proj: Param,
    /// expert embeddings `[n/2, n]`
    pub experts_emb: Param,
    /// log τ, `[1]`
    pub log_temp: Param,
    k: usize,
    /// the selection-only bias, when balancing asks for one
    selection: Option<SelectionBias>,
    training: AtomicBool,
}

impl XMoeCosineRouter {
    /// A cosine router of dimension `max(n/2, 1)`.
    pub fn new(cfg: &RouterConfig, device: Device) -> Result<XMoeCosineRouter> {
        let dh = (cfg.experts / 2).max(1);
        let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed ^ 0x786d_6f65);
        Ok(XMoeCosineRouter {
            proj: Param::new(uniform(
                &[cfg.d, dh],
                1.0 / (cfg.d as f64).sqrt(),
                &mut rng,
                device,
            )?)?,
            experts_emb: Param::new(uniform(
                &[dh, cfg.experts],
                1.0 / (dh as f64).sqrt(),
                &mut rng,
                device,
            )?)?,
            log_temp: Param::new(Tensor::full(&[1], 0.07f64.ln(), DType::F32, device)?)?,
            k: cfg.k,
            selection: SelectionBias::for_config(cfg, device)?,
            training: AtomicBool::new(true),
        })
    }
}

impl Router for XMoeCosineRouter {
    fn name(&self) -> &'static str {
        "xmoe-cosine"
    }
    fn reads_tokens_only_through_products(&self) -> bool {
        true
    }
    fn route(&self, x: &Tensor) -> Result<Routing> {
        let h = x.matmul(&self.proj.get())?; // [T, dh]
        let a = self.experts_emb.get(); // [dh, n]
        let h_norm = h.mul(&h)?.sum(&[1], true)?.add_scalar(1e-12)?.sqrt()?; // [T, 1]
        let a_norm = a.mul(&a)?.sum(&[0], true)?.add_scalar(1e-12)?.sqrt()?; // [1, n]
        let cos = h.matmul(&a)?.div(&h_norm)?.div(&a_norm)?;
        let logits = cos.div(&self.log_temp.get().exp()?)?;
        let p = logits.softmax(-1)?;
        let chosen = match &self.selection {
            Some(b) => b.add_to(&p)?,
            None => p.detach(),
        };
        let (_, idx) = chosen.topk(self.k)?;
        let g = p.gather(1, &idx)?;
        let routing = Routing::token_choice(&idx, &g, None, p, logits)?;
        Ok(match &self.selection {
            Some(b) => routing.with_selection(b, &chosen),
            None => routing,
        })
    }
    fn selection_bias(&self) -> Option<&SelectionBias> {
        self.selection.as_ref()
    }
}

impl Parameters for XMoeCosineRouter {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(String, &Param)) {
        f(join(prefix, "proj"), &self.proj);
        f(join(prefix, "experts"), &self.experts_emb);
        f(join(prefix, "log_temperature"), &self.log_temp);
    }
    fn set_training(&self, training: bool) {
        self.training.store(training, Ordering::Relaxed)
    }
    fn state(&self) -> Result<Vec<(String, Tensor)>> {
        Ok(match &self.selection {
            Some(b) => vec![(
                crate::moe::LinearGate::SELECTION_BIAS.to_string(),
                b.get()?.to_device(Device::Cpu)?,
            )],
            None => Vec::new(),
        })
    }
    fn load_state(&self, name: &str, value: &Tensor) -> Result<()> {
        match &self.selection {
            Some(b) if name == crate::moe::LinearGate::SELECTION_BIAS => {
                b.set(value, "router state selection_bias")
            }
            _ => Err(crate::Error::Invalid(format!(
                "router xmoe-cosine has no state named {name:?}"
            ))),
        }
    }
}
