//! Tutorial chapter 4 (`docs/tutorial/04-custom-router.md`): a router with a gradient rule of
//! its own, written with moegrad's public API only, as a crate of your own would.
//!
//! The router is a **straight-through top-1 with a temperature τ**. Each token goes to the
//! expert `e = argmax θ` of its logits θ. In training the forward combine weight is exactly 1
//! (the hard choice), while the backward pretends the weight was the tempered probability
//! `p_e = softmax(θ/τ)_e`, whose gradient is
//!
//! ```text
//! ∂p_e/∂θ_j = p_e (δ_ej − p_j) / τ
//! ```
//!
//! In evaluation the forward weight is `p_e` itself, so there the rule is the exact gradient of
//! the forward and `gradcheck` can verify it in f64. The example
//! 1. checks the hand-written rule against the tape's own derivative of `softmax(θ/τ)_e`;
//! 2. passes `gradcheck` in f64 through the gate (`x·W + b` → weight);
//! 3. plugs the router into a `MoeLayer` ([`MoeLayer::set_router`]) and trains a few Adam
//!    steps, checking that the router's gate gets a gradient and that the loss goes down.
//!
//! Run with `cargo run --release --example custom_router`.

use moegrad::autograd::custom_op;
use moegrad::gradcheck::{GradcheckOptions, gradcheck};
use moegrad::moe::LinearGate;
use moegrad::moe::{MoeConfig, MoeLayer, Router, RouterConfig, Routing};
use moegrad::nn::{Param, Parameters};
use moegrad::optim::{Adam, Optimizer};
use moegrad::{DType, Device, Error, Result, Tensor, no_grad};

/// One-hot rows `[T, n]` (dtype of `like`) of the `[T, 1]` I32 indices `idx`.
fn one_hot(idx: &Tensor, n: usize, like: &Tensor) -> Result<Tensor> {
    let mut rows = vec![0.0; idx.numel() * n];
    for (t, &e) in idx.to_vec_i32()?.iter().enumerate() {
        rows[t * n + e as usize] = 1.0;
    }
    Tensor::from_f64(rows, &[idx.numel(), n], Device::cpu())?
        .to_dtype(like.dtype())?
        .to_device(like.device())
}

/// The combine weight `[T, 1]` of each token's expert `idx` (`[T, 1]` I32) with the
/// straight-through rule: forward 1 (`hard`) or `p_e` (not `hard`), backward
/// `∂L/∂θ = g · p_e (onehot_e − p) / τ` with `p = softmax(θ/τ)` and `g = ∂L/∂weight`.
pub fn straight_through_weight(
    logits: &Tensor,
    idx: &Tensor,
    tau: f64,
    hard: bool,
) -> Result<Tensor> {
    let n = logits.shape()[1];
    let p = no_grad(|| logits.detach().mul_scalar(1.0 / tau)?.softmax(-1))?;
    let p_e = p.gather(1, idx)?;
    let onehot = one_hot(idx, n, logits)?;
    let forward_value = if hard {
        p_e.full_like(1.0)?
    } else {
        p_e.clone()
    };
    custom_op(
        "straight_through_top1",
        &[logits],
        |_| Ok(forward_value),
        move |ctx| {
            let coefficient = p_e.mul(ctx.grad_output)?.mul_scalar(1.0 / tau)?; // [T, 1]
            Ok(vec![Some(onehot.sub(&p)?.mul(&coefficient)?)])
        },
    )
}

/// The router: a linear gate, top-1 by the logits, straight-through weights at temperature τ.
pub struct StraightThroughTop1 {
    gate: LinearGate,
    tau: f64,
}

impl StraightThroughTop1 {
    /// A router over `cfg.experts` experts for tokens of width `cfg.d`.
    pub fn new(cfg: &RouterConfig, tau: f64, device: Device) -> Result<StraightThroughTop1> {
        if !(tau > 0.0 && tau.is_finite()) {
            return Err(Error::Invalid(format!(
                "straight-through top-1: the temperature must be positive, got {tau}"
            )));
        }
        Ok(StraightThroughTop1 {
            gate: LinearGate::new(cfg, device)?,
            tau,
        })
    }
}

impl Router for StraightThroughTop1 {
    fn name(&self) -> &'static str {
        "st_top1"
    }
    fn route(&self, x: &Tensor) -> Result<Routing> {
        let logits = self.gate.logits(x)?;
        let idx = no_grad(|| logits.argmax(-1, true))?;
        let weight = straight_through_weight(&logits, &idx, self.tau, self.gate.training())?;
        let probs = logits.softmax(-1)?;
        Routing::token_choice(&idx, &weight, None, probs, logits)
    }
    fn estimates_gradient(&self) -> bool {
        true
    }
}

/// The parameter protocol every layer, router and model shares: the gate's weights, its training
/// flag; no step-to-step state (the default `state` / `load_state`: nothing to checkpoint).
impl Parameters for StraightThroughTop1 {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(String, &Param)) {
        self.gate.visit(prefix, f)
    }
    fn set_training(&self, training: bool) {
        self.gate.set_training(training)
    }
}

/// Fails with a message unless `ok`.
fn check(ok: bool, what: impl FnOnce() -> String) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(Error::Invalid(format!("check failed: {}", what())))
    }
}

/// Checks the rule in f64: against the tape's derivative, then with gradcheck through a gate.
fn check_gradient(tau: f64) -> Result<()> {
    let cpu = Device::cpu();
    let (t, d, n) = (6, 5, 4);
    let x = Tensor::rand_uniform(&[t, d], 1, DType::F64, cpu)?.add_scalar(-0.5)?;
    let w = Tensor::rand_uniform(&[d, n], 2, DType::F64, cpu)?.add_scalar(-0.5)?;
    let c = Tensor::rand_uniform(&[t, 1], 3, DType::F64, cpu)?;
    let weight_loss = |w: &Tensor, rule: bool| -> Result<Tensor> {
        let logits = x.matmul(w)?;
        let idx = no_grad(|| logits.argmax(-1, true))?;
        let weight = if rule {
            straight_through_weight(&logits, &idx, tau, false)?
        } else {
            // the same weight written with ordinary ops: the tape derives its gradient
            logits.mul_scalar(1.0 / tau)?.softmax(-1)?.gather(1, &idx)?
        };
        weight.mul(&c)?.sum_all()
    };
    let grad_of = |rule: bool| -> Result<Vec<f64>> {
        let w = w.detach().with_grad()?;
        weight_loss(&w, rule)?.backward()?;
        w.grad()
            .ok_or_else(|| Error::Autograd("the gate weight got no gradient".into()))?
            .to_vec_f64()
    };
    let (by_rule, by_tape) = (grad_of(true)?, grad_of(false)?);
    let diff = by_rule
        .iter()
        .zip(&by_tape)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    check(diff < 1e-12, || {
        format!("the rule and the tape's derivative differ by {diff:e}")
    })?;
    println!("hand-written rule = the tape's derivative of softmax(θ/τ)_e (within {diff:.1e})");
    let report = gradcheck(
        |inputs| weight_loss(&inputs[0], true),
        std::slice::from_ref(&w),
        &GradcheckOptions::default(),
    )?;
    println!("gradcheck passed in f64: {report:?}");
    Ok(())
}

/// The names and handles of a layer's parameters, for the optimizer.
fn named_params(layer: &MoeLayer) -> Vec<(String, Param)> {
    let mut params = Vec::new();
    layer.visit_params("moe", &mut |name, p| params.push((name, p.clone())));
    params
}

/// Trains a small MoE layer with the router on a fixed regression target; returns the first
/// and last loss.
fn train(tau: f64, steps: usize) -> Result<(f64, f64)> {
    let cpu = Device::cpu();
    let (d, experts) = (8, 4);
    let cfg = MoeConfig::new(d, 16, experts, 1);
    let mut layer = MoeLayer::new(&cfg, cpu)?;
    layer.set_router(Box::new(StraightThroughTop1::new(
        &RouterConfig::new(d, experts, 1),
        tau,
        cpu,
    )?))?;
    let x = Tensor::rand_uniform(&[64, d], 11, DType::F32, cpu)?.add_scalar(-0.5)?;
    let teacher = Tensor::rand_uniform(&[d, d], 12, DType::F32, cpu)?.add_scalar(-0.5)?;
    let target = x.matmul(&teacher)?.tanh()?;
    let params = named_params(&layer);
    let mut adam = Adam::new(1e-2)?;
    let (mut first, mut last) = (f64::NAN, f64::NAN);
    for step in 0..steps {
        let out = layer.forward(&x)?;
        let diff = out.y.sub(&target)?;
        let loss = diff.mul(&diff)?.mean_all()?.add(&out.aux_loss)?;
        loss.backward()?;
        if step == 0 {
            first = loss.item()?;
            let gate_grad = params
                .iter()
                .find(|(name, _)| name == "moe.router.weight")
                .and_then(|(_, p)| p.grad())
                .ok_or_else(|| Error::Autograd("the router's gate got no gradient".into()))?;
            let norm = gate_grad.mul(&gate_grad)?.sum_all()?.item()?.sqrt();
            check(norm > 0.0, || "the router's gate gradient is zero".into())?;
            println!("step 0: loss {first:.5}, router gate gradient norm {norm:.3e}");
        }
        last = loss.item()?;
        adam.step(&params, None)?;
    }
    println!("step {}: loss {last:.5}", steps - 1);
    Ok((first, last))
}

fn main() -> Result<()> {
    let tau = 0.5;
    check_gradient(tau)?;
    let (first, last) = train(tau, 40)?;
    check(last < 0.8 * first, || {
        format!("training did not reduce the loss enough: {first:.5} → {last:.5}")
    })?;
    println!("custom_router example: trained {first:.5} → {last:.5}");
    println!("custom_router example: all checks passed");
    Ok(())
}
