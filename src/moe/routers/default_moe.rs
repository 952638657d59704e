//! `default-moe` — Top-k routing whose router gets a dense gradient at sparse cost (Panda,
//! Baherwani, Sarwar, Therien, Chakraborty and Goldstein 2025, "Dense Backpropagation Improves
//! Training for Sparse Mixture-of-Experts", arXiv 2504.12463). For a token with gate logits
//! `o = x·W`:
//!
//! ```text
//! π   = softmax(o)                         over all n experts
//! A   = top-k of π (of π + b with a selection bias)
//! y   = Σ_{i ∈ A} π_i · E_i(x)             the forward pass: top-k, not renormalised
//! ∂L/∂π_i = g · E_i(x)                     i ∈ A   (exact, as in top-k)
//! ∂L/∂π_i = g · Ê_i                        i ∉ A   (the default output stands in for E_i(x))
//! ```
//!
//! with `g = ∂L/∂y` and `Ê_i` the exponential moving average of expert i's outputs over the
//! batches it ran on (`default_outputs.rs`: decay β, option `beta`, 0.9 by default). Plain top-k
//! gives the unselected `π_i` no gradient at all; here every expert's probability learns, as if
//! the layer were dense with each missing expert answering its running mean. Where we chose: the
//! defaults enter the backward pass only (the layer adds `d − sg(d)`, `d = Σ_{i ∉ A} π_i Ê_i`, so
//! the forward output is exactly top-k's and evaluation equals training's model); the average is
//! taken after capacity (rows an expert computed) and updated before the batch's backward (the
//! batch's own means are in it); an expert that has never run answers 0.
//!
//! The backward differs on purpose from the exact gradient of the forward pass, so the router
//! [`Router::estimates_gradient`]; in evaluation mode it is plain `topk-unnorm`. `probs` is `π`,
//! `logits` is `o`.

use crate::moe::{
    DefaultOutputs, LinearGate, OptionKind, Router, RouterConfig, RouterOption, RouterSpec,
    Routing, SelectionBias,
};
use crate::nn::{Param, Parameters};
use crate::{Device, Error, Result, Tensor};

/// The registry entry of `default-moe`.
pub(crate) const SPEC: RouterSpec = RouterSpec {
    name: "default-moe",
    summary: "Default MoE: top-k, unselected experts' running-mean outputs give the router a dense gradient",
    options: &[RouterOption {
        key: "beta",
        kind: OptionKind::Number,
        default: "0.9",
        help: "decay of the default outputs' moving average, in [0, 1)",
    }],
    build: |cfg, device| Ok(Box::new(DefaultMoeRouter::new(cfg, device)?)),
    estimator_lab: None,
};

/// Top-k routing with Default MoE's dense router gradient.
pub struct DefaultMoeRouter {
    gate: LinearGate,
    k: usize,
    defaults: DefaultOutputs,
}

impl DefaultMoeRouter {
    /// The name of the default outputs `[n, m]` in [`Parameters::state`].
    pub const DEFAULT_OUTPUTS: &'static str = "default_outputs";

    /// Reads and checks `beta`.
    pub fn new(cfg: &RouterConfig, device: Device) -> Result<DefaultMoeRouter> {
        if cfg.k == 0 || cfg.k > cfg.experts {
            return Err(Error::Invalid(format!(
                "default-moe needs 1 ≤ k ≤ n, got k = {}, n = {}",
                cfg.k, cfg.experts
            )));
        }
        Ok(DefaultMoeRouter {
            gate: LinearGate::new(cfg, device)?,
            k: cfg.k,
            defaults: DefaultOutputs::new(
                cfg.experts,
                cfg.d_out,
                cfg.opt_f64("beta", 0.9)?,
                device,
            )?,
        })
    }

    /// The default outputs (shared with every routing this router returns).
    pub fn defaults(&self) -> &DefaultOutputs {
        &self.defaults
    }

    /// The gate (weight `[d, n]`, bias when [`RouterConfig::gate_bias`]).
    pub fn gate(&self) -> &LinearGate {
        &self.gate
    }
}

impl Router for DefaultMoeRouter {
    fn name(&self) -> &'static str {
        "default-moe"
    }
    fn reads_tokens_only_through_products(&self) -> bool {
        true
    }
    fn route(&self, x: &Tensor) -> Result<Routing> {
        let logits = self.gate.logits(x)?;
        // π (tracked), the chosen experts and their weights π_i: `topk-unnorm`'s fused gate, or
        // with a selection bias the same composed from a softmax, a top-k of π + b and a gather
        let (probs, idx, weights, chosen) = if self.gate.selection.is_none() {
            let g = logits.topk_gate(None, self.k, false)?;
            (g.probs, g.idx, g.weights, None)
        } else {
            let probs = logits.softmax(-1)?;
            let chosen = self.gate.selection_scores(&probs)?;
            let (_, idx) = chosen.topk(self.k)?;
            let weights = probs.gather(1, &idx)?;
            (probs, idx, weights, Some(chosen))
        };
        let mut routing = Routing::token_choice(&idx, &weights, None, probs.clone(), logits)?;
        if self.gate.training() {
            // U = π with the chosen experts zeroed: the probabilities the defaults answer for
            let unselected = crate::no_grad(|| {
                let (t, n) = (probs.shape()[0], probs.shape()[1]);
                let (dt, dev) = (probs.dtype(), probs.device());
                let chosen = Tensor::zeros(&[t, n], dt, dev)?.scatter_add(
                    1,
                    &idx,
                    &Tensor::ones(&[t, self.k], dt, dev)?,
                )?;
                chosen.neg()?.add_scalar(1.0)
            })?;
            routing.defaults = Some(crate::moe::DefaultTerm {
                unselected: probs.mul(&unselected)?,
                outputs: self.defaults.clone(),
            });
        }
        Ok(match &chosen {
            Some(c) => self.gate.mark(routing, c),
            None => routing,
        })
    }
    fn estimates_gradient(&self) -> bool {
        true
    }
    fn selection_bias(&self) -> Option<&SelectionBias> {
        self.gate.selection.as_ref()
    }
}

impl Parameters for DefaultMoeRouter {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(String, &Param)) {
        self.gate.visit(prefix, f)
    }
    fn set_training(&self, training: bool) {
        self.gate.set_training(training)
    }
    fn state(&self) -> Result<Vec<(String, Tensor)>> {
        let mut s = self.gate.state()?;
        s.push((
            Self::DEFAULT_OUTPUTS.into(),
            self.defaults.get()?.to_device(Device::Cpu)?,
        ));
        Ok(s)
    }
    fn load_state(&self, name: &str, value: &Tensor) -> Result<()> {
        if name == Self::DEFAULT_OUTPUTS {
            self.defaults
                .set(value, "default-moe's router state default_outputs")
        } else {
            self.gate.load_state(name, value)
        }
    }
}
