//! `remoe` — ReLU routing with an adaptive L1 penalty that sets the sparsity (Wang, Zhu and
//! Chen 2024, "ReMoE: Fully Differentiable Mixture-of-Experts with ReLU Routing", arXiv
//! 2412.14711). No top-k and no softmax: every expert whose gate is positive runs, so the number
//! of experts per token varies, and the routing is differentiable everywhere but at 0.
//!
//! For a token with logits `o = x·W` (`[n]`):
//!
//! ```text
//! g_i  = ReLU(o_i)                               the combine weights; expert i runs iff g_i > 0
//! L1   = (1/T) Σ_t Σ_i f_i · g_ti                the penalty, with the load balancing of §3.4:
//! f_i  = n/(k·T) Σ_t 1[g_ti > 0]                 (a constant; `balanced=false`: f_i = 1)
//! aux  = λ · L1                                  added to the layer's auxiliary loss
//! S    = 1 − (1/(T·n)) Σ_t Σ_i 1[g_ti > 0]       the batch's sparsity
//! λ   ← λ · α^{sign(S_target − S)}               after each training batch (α = 1.2)
//! ```
//!
//! `S_target = 1 − k/n` (`--k` sets the average experts per token, `target_sparsity` overrides
//! it): λ grows while too many gates are open and shrinks while too few are, so the average
//! number of active experts settles near k. λ starts at `lambda0` = 1e-8 (the paper's values) and
//! is router state: no gradient, kept on the device (updated without a read-back), saved in
//! checkpoints as `l1_lambda`. Gradient: `∂g_i/∂o_i = 1[o_i > 0]`, so an expert that is off gets
//! no gradient from the output, only the penalty pushes open gates down.
//!
//! `probs` (statistics, the Switch loss's `P_i` if one is added) is `g / Σ_i g` per token (0 for
//! a token with no open gate). The router reports `remoe_lambda` and `remoe_sparsity` as its own
//! metrics.

use crate::moe::{LinearGate, OptionKind, Router, RouterConfig, RouterOption, RouterSpec, Routing};
use crate::nn::{Param, Parameters};
use crate::{DType, Device, Error, Result, Tensor};
use std::sync::Mutex;

/// The registry entry of `remoe`.
pub(crate) const SPEC: RouterSpec = RouterSpec {
    name: "remoe",
    summary: "ReMoE: ReLU gates, an adaptive L1 penalty holds the average experts per token near k",
    options: &[
        RouterOption {
            key: "target_sparsity",
            kind: OptionKind::Number,
            default: "1 - k/n",
            help: "the fraction of closed gates the penalty steers to, in [0, 1)",
        },
        RouterOption {
            key: "alpha",
            kind: OptionKind::Number,
            default: "1.2",
            help: "λ's multiplicative step per training batch (> 1)",
        },
        RouterOption {
            key: "lambda0",
            kind: OptionKind::Number,
            default: "1e-8",
            help: "λ's initial value (> 0)",
        },
        RouterOption {
            key: "balanced",
            kind: OptionKind::Bool,
            default: "true",
            help: "weight each expert's L1 by its load n/(kT)·count (the paper's load balancing)",
        },
    ],
    build: |cfg, device| Ok(Box::new(ReMoeRouter::new(cfg, device)?)),
    estimator_lab: None,
};

/// ReLU routing with an adaptive L1 penalty.
pub struct ReMoeRouter {
    gate: LinearGate,
    n: usize,
    k: usize,
    target: f64,
    alpha: f64,
    balanced: bool,
    /// λ, a scalar F32 on the router's device
    lambda: Mutex<Tensor>,
    device: Device,
}

impl ReMoeRouter {
    /// The name of λ in [`Parameters::state`].
    pub const LAMBDA: &'static str = "l1_lambda";

    /// Reads and checks the options (each error names the option at fault).
    pub fn new(cfg: &RouterConfig, device: Device) -> Result<ReMoeRouter> {
        let (n, k) = (cfg.experts, cfg.k);
        let target = cfg.opt_f64("target_sparsity", 1.0 - k as f64 / n as f64)?;
        let alpha = cfg.opt_f64("alpha", 1.2)?;
        let lambda0 = cfg.opt_f64("lambda0", 1e-8)?;
        let bad = |m: String| Err(Error::Invalid(format!("remoe: {m}")));
        if !(0.0..1.0).contains(&target) {
            return bad(format!("target_sparsity = {target} must lie in [0, 1)"));
        }
        if alpha <= 1.0 {
            return bad(format!("alpha = {alpha} must be above 1"));
        }
        if lambda0 <= 0.0 {
            return bad(format!("lambda0 = {lambda0} must be positive"));
        }
        Ok(ReMoeRouter {
            gate: LinearGate::new(cfg, device)?,
            n,
            k,
            target,
            alpha,
            balanced: cfg.opt_bool("balanced", true)?,
            lambda: Mutex::new(Tensor::scalar(lambda0, DType::F32, device)?),
            device,
        })
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Tensor>> {
        self.lambda
            .lock()
            .map_err(|_| Error::Invalid("remoe: λ lock poisoned".into()))
    }

    /// The current λ (a scalar F32 tensor on the router's device).
    pub fn lambda(&self) -> Result<Tensor> {
        Ok(self.lock()?.clone())
    }
}

impl Router for ReMoeRouter {
    fn name(&self) -> &'static str {
        "remoe"
    }
    fn reads_tokens_only_through_products(&self) -> bool {
        true
    }
    fn route(&self, x: &Tensor) -> Result<Routing> {
        let logits = self.gate.logits(x)?;
        let (t, n) = (logits.shape()[0], self.n);
        let g = logits.relu()?; // [T, n], tracked
        let (open, sparsity, f) = crate::no_grad(|| {
            let zero = Tensor::scalar(0.0, g.dtype(), g.device())?;
            let open = g.detach().gt(&zero)?; // 1 where the gate is open
            let sparsity = open.mean_all()?.neg()?.add_scalar(1.0)?;
            let f = if self.balanced {
                open.sum(&[0], true)?
                    .mul_scalar(n as f64 / (self.k.max(1) * t.max(1)) as f64)?
            } else {
                Tensor::ones(&[1, n], g.dtype(), g.device())?
            };
            Ok::<_, Error>((open, sparsity, f))
        })?;
        // the expert of every slot is its column: slot tables of n slots per token
        let (_, slot) = crate::moe::slot_tables(t, n, g.device())?;
        let idx = slot.reshape(&[t, n])?;
        let lambda = self.lambda()?;
        let l1 = g.mul(&f)?.sum_all()?.mul_scalar(1.0 / t.max(1) as f64)?;
        let aux = l1.mul(&lambda.to_dtype(l1.dtype())?)?;
        let total = g.sum(&[1], true)?.add_scalar(1e-12)?;
        let probs = g.div(&total)?;
        let mut routing = Routing::token_choice(&idx, &g, Some(&open), probs, logits)?;
        // no gate ranks above another: every open gate counts as a first choice (the layer's
        // capacity priority is then the gate value, and a Switch loss counts every open gate)
        routing.rank = Tensor::zeros(&[t * n], routing.weight.dtype(), g.device())?;
        routing.aux_loss = Some(aux);
        routing.metrics.push(("remoe_lambda", lambda.clone()));
        routing.metrics.push(("remoe_sparsity", sparsity.clone()));
        if self.gate.training() {
            // λ ← λ·α^{sign(S_target − S)}, on the device
            let next = crate::no_grad(|| {
                let s = sparsity.to_dtype(DType::F32)?;
                let target = Tensor::scalar(self.target, DType::F32, s.device())?;
                let sign = s.lt(&target)?.sub(&s.gt(&target)?)?;
                lambda.mul(&sign.mul_scalar(self.alpha.ln())?.exp()?)
            })?;
            *self.lock()? = next;
        }
        Ok(routing)
    }
    fn variable_experts_per_token(&self) -> bool {
        true
    }
}

impl Parameters for ReMoeRouter {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(String, &Param)) {
        self.gate.visit(prefix, f)
    }
    fn set_training(&self, training: bool) {
        self.gate.set_training(training)
    }
    fn state(&self) -> Result<Vec<(String, Tensor)>> {
        let mut s = self.gate.state()?;
        s.push((Self::LAMBDA.into(), self.lambda()?.to_device(Device::Cpu)?));
        Ok(s)
    }
    fn load_state(&self, name: &str, value: &Tensor) -> Result<()> {
        if name != Self::LAMBDA {
            return self.gate.load_state(name, value);
        }
        let v = value.to_vec_f64()?;
        match v.as_slice() {
            [x] if x.is_finite() && *x > 0.0 => {
                *self.lock()? = Tensor::scalar(*x, DType::F32, self.device)?;
                Ok(())
            }
            _ => Err(Error::Invalid(format!(
                "remoe: router state {name} must be one positive number, got {v:?}"
            ))),
        }
    }
}
