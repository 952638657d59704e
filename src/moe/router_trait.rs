//! The [`Router`] trait every router implements and what routers are built from: the settings
//! they share ([`RouterConfig`], with the `--router-opt` parsing), the linear gate most of them
//! start with ([`LinearGate`]) and the noise they draw on the device. The routers themselves
//! are in `routers/`, one a file; the registry that builds one by its command-line name is
//! `router_registry.rs`; what a router returns is `routing_output.rs`. Adding a router means
//! adding one file with a struct that implements `Router` and its `RouterSpec`, and one line in
//! the registry list of `routers/mod.rs` (docs/adding-a-router.md).

use super::{Routing, SelectionBias};
use crate::nn::{Param, Parameters};
use crate::{DType, Device, Error, Result, Tensor};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Settings shared by the routers (each router reads what applies to it).
#[derive(Clone, Debug, PartialEq)]
pub struct RouterConfig {
    /// input width d
    pub d: usize,
    /// the experts' output width (`d` unless the layer says otherwise; Default MoE's vectors
    /// have it)
    pub d_out: usize,
    /// number of experts n
    pub experts: usize,
    /// experts per token k (Expert Choice: average experts per token, k' = round(T·k/n))
    pub k: usize,
    /// Switch's multiplicative jitter r on the logits (default 0.1, training only)
    pub jitter: f64,
    /// seed of the router's initialisation and of its noise
    pub seed: u64,
    /// whether the linear gate has a bias (true by default; false in the transformers families,
    /// whose `gate` is `Linear(d, n, bias=False)`)
    pub gate_bias: bool,
    /// whether the router keeps a selection-only bias for auxiliary-loss-free balancing
    /// (`--balance aux-free` or `quantile` set it; see `selection_bias.rs`); false by default
    pub selection_bias: bool,
    /// router-specific settings by name (`--router-opt key=value` on the command line), read
    /// with [`RouterConfig::opt_f64`] and friends; a router rejects keys it does not know with
    /// [`RouterConfig::check_options`]
    pub options: std::collections::BTreeMap<String, String>,
}

impl RouterConfig {
    /// Defaults for `experts` experts of width `d`, top-`k`.
    pub fn new(d: usize, experts: usize, k: usize) -> RouterConfig {
        RouterConfig {
            d,
            d_out: d,
            experts,
            k,
            jitter: 0.1,
            seed: 0,
            gate_bias: true,
            selection_bias: false,
            options: Default::default(),
        }
    }

    /// Fails unless every option is one of `known` (naming the router, the bad key and the
    /// keys it accepts).
    pub fn check_options(&self, router: &str, known: &[&str]) -> Result<()> {
        match self.options.keys().find(|k| !known.contains(&k.as_str())) {
            None => Ok(()),
            Some(bad) => Err(Error::Invalid(format!(
                "router {router} has no option {bad:?}; it accepts {}",
                if known.is_empty() {
                    "none".to_string()
                } else {
                    known.join(", ")
                }
            ))),
        }
    }
    /// A numeric option, or `default` when not given; a value that is not a finite number is an
    /// error naming the key.
    pub fn opt_f64(&self, key: &str, default: f64) -> Result<f64> {
        match self.options.get(key) {
            None => Ok(default),
            Some(v) => match v.trim().parse::<f64>() {
                Ok(x) if x.is_finite() => Ok(x),
                _ => Err(Error::Invalid(format!(
                    "router option {key}={v:?} is not a finite number"
                ))),
            },
        }
    }
    /// A whole-number option, or `default`.
    pub fn opt_usize(&self, key: &str, default: usize) -> Result<usize> {
        match self.options.get(key) {
            None => Ok(default),
            Some(v) => v.trim().parse::<usize>().map_err(|_| {
                Error::Invalid(format!(
                    "router option {key}={v:?} is not a non-negative integer"
                ))
            }),
        }
    }
    /// A true/false option (`true`, `false`, `1`, `0`), or `default`.
    pub fn opt_bool(&self, key: &str, default: bool) -> Result<bool> {
        match self.options.get(key).map(|v| v.trim()) {
            None => Ok(default),
            Some("true" | "1" | "yes") => Ok(true),
            Some("false" | "0" | "no") => Ok(false),
            Some(v) => Err(Error::Invalid(format!(
                "router option {key}={v:?} is not true or false"
            ))),
        }
    }
    /// A text option, or `default`.
    pub fn opt_str<'a>(&'a self, key: &str, default: &'a str) -> &'a str {
        self.options.get(key).map(|v| v.trim()).unwrap_or(default)
    }
}

/// Parses `key=value` pairs (the `--router-opt` arguments) into router options.
pub fn parse_router_options(
    pairs: &[String],
) -> Result<std::collections::BTreeMap<String, String>> {
    pairs
        .iter()
        .map(|p| match p.split_once('=') {
            Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_string(), v.to_string())),
            _ => Err(Error::Invalid(format!(
                "--router-opt {p:?} is not of the form key=value"
            ))),
        })
        .collect()
}

/// `router.route(x)` in f32 even under mixed precision (Switch's selective precision, see
/// `autocast.rs`): f16 tokens are cast up, and the router's products, softmax, top-k and
/// auxiliary losses run in f32. Every model routes through this (or [`crate::moe::MoeLayer`]'s
/// `route`, which calls it); outside [`crate::autocast_f16`] it is `router.route(x)`.
///
/// A router whose [`Router::reads_tokens_only_through_products`] is true is handed f16 tokens
/// as they are: its products read them into f32 (see [`crate::full_precision`]), with the bits
/// of the cast, without the cast forward, the f32 copy kept for backward, or the cast of the
/// tokens' gradient back to f16.
///
/// # Errors
/// The router's own errors.
pub fn route_in_f32(router: &dyn Router, x: &Tensor) -> Result<Routing> {
    if crate::autocast::low_precision().is_none() && x.dtype() != crate::DType::F16 {
        return router.route(x);
    }
    let x = if router.reads_tokens_only_through_products() && x.device().is_gpu() {
        x.clone()
    } else {
        crate::autocast::full_precision_operand(x)?
    };
    crate::full_precision(|| router.route(&x))
}

/// A router: maps token representations `[T, d]` to a [`Routing`]. Its parameters, training
/// flag (noise on or off) and step-to-step state (a noise counter, a running baseline, saved in
/// checkpoints so a resumed run continues exactly) are the [`Parameters`] protocol every part of
/// a model shares.
pub trait Router: Parameters {
    /// The name used on the command line.
    fn name(&self) -> &'static str;
    /// Routes a batch. Noise, if any, is drawn only in training mode.
    fn route(&self, x: &Tensor) -> Result<Routing>;
    /// True for routers whose weights need every expert's output (dense estimators, softmax).
    fn runs_all_experts(&self) -> bool {
        false
    }
    /// True for routers whose [`Router::route`] uses the tokens `x` only as the left operand of
    /// [`Tensor::matmul`] or [`Tensor::matmul_bias`] with 2-D f32 right operands (a gate's
    /// weight), besides their shape and device, as [`LinearGate::logits`] does. Under mixed
    /// precision [`route_in_f32`] then hands such a router the f16 tokens as they are, which
    /// its products read into f32; others (the default) get the tokens cast to f32 first. The
    /// results are the same bits either way (`tests/router_f16_tokens.rs` checks every router
    /// that says so).
    fn reads_tokens_only_through_products(&self) -> bool {
        false
    }
    /// `Some(ω₀)` for routers whose layer multiplies its output by a trainable per-channel scale
    /// `ω ∈ R^{d_out}` initialised to ω₀ (SparseMixer's ω, one per layer, shared by all
    /// experts): the layer owns it as the parameter `router.omega`. None (the default) for the
    /// others.
    fn output_scale(&self) -> Option<f64> {
        None
    }
    /// True for routers whose training-mode backward is a gradient *estimator* that differs on
    /// purpose from the exact gradient of the sampled forward (SparseMixer's 2× rule,
    /// straight-through, ReinMax, ...): a finite-difference check applies to them only in
    /// evaluation mode. False (the default) for the others.
    fn estimates_gradient(&self) -> bool {
        false
    }
    /// True for routers whose number of experts per token varies (XMoE's threshold routing):
    /// the layer then sizes capacity by tokens, `C = ⌈γ·T/n⌉` as XMoE does (docs/routers.md,
    /// `threshold`),
    /// instead of by the `T·K` slots, and its balance loss counts first choices only (the
    /// top-1 assignment). False (the default) for the others.
    fn variable_experts_per_token(&self) -> bool {
        false
    }
    /// The selection-only bias this router adds to the scores it chooses experts by, which
    /// `--balance aux-free` and `quantile` move (`selection_bias.rs`); None (the default) for
    /// routers that keep none. A router that keeps one marks each [`Routing`] with the biased
    /// scores ([`Routing::with_selection`]).
    fn selection_bias(&self) -> Option<&SelectionBias> {
        None
    }
}

/// What most routers share: a linear map to logits, a training flag and a noise counter.
pub struct LinearGate {
    /// `[d, n]`
    pub weight: Param,
    /// `[n]`, None without a bias ([`RouterConfig::gate_bias`])
    pub bias: Option<Param>,
    /// the selection-only bias, when the config asks for one ([`RouterConfig::selection_bias`])
    pub selection: Option<SelectionBias>,
    training: AtomicBool,
    calls: AtomicU64,
    seed: u64,
}

impl LinearGate {
    /// The name of the noise counter in [`LinearGate::state`].
    pub const NOISE_CALLS: &'static str = "noise_calls";
    /// The name of the selection-only bias in [`LinearGate::state`].
    pub const SELECTION_BIAS: &'static str = "selection_bias";

    /// A gate `d → n` initialised `U(−1/√d, 1/√d)` (PyTorch's Linear default) with zero bias.
    pub fn new(cfg: &RouterConfig, device: Device) -> Result<LinearGate> {
        if cfg.experts == 0 || cfg.d == 0 {
            return Err(Error::Invalid(format!(
                "router needs d ≥ 1 and n ≥ 1, got d = {}, n = {}",
                cfg.d, cfg.experts
            )));
        }
        let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed ^ 0x726f_7574);
        Ok(LinearGate {
            weight: Param::new(crate::nn::uniform(
                &[cfg.d, cfg.experts],
                1.0 / (cfg.d as f64).sqrt(),
                &mut rng,
                device,
            )?)?,
            bias: cfg
                .gate_bias
                .then(|| Param::new(Tensor::zeros(&[cfg.experts], DType::F32, device)?))
                .transpose()?,
            selection: SelectionBias::for_config(cfg, device)?,
            training: AtomicBool::new(true),
            calls: AtomicU64::new(0),
            seed: cfg.seed,
        })
    }
    /// `x·W + b` (or `x·W` without a bias), `[T, n]`.
    pub fn logits(&self, x: &Tensor) -> Result<Tensor> {
        let w = self.weight.get();
        if x.rank() != 2 || x.shape()[1] != w.shape()[0] {
            return Err(Error::Shape(format!(
                "router expects tokens [T, {}], got {:?}",
                w.shape()[0],
                x.shape()
            )));
        }
        match &self.bias {
            Some(b) => x.matmul_bias(&w, &b.get()),
            None => x.matmul(&w),
        }
    }
    /// The scores to choose experts by: `sg(scores) + b` with a selection bias, else `scores`
    /// detached.
    pub fn selection_scores(&self, scores: &Tensor) -> Result<Tensor> {
        match &self.selection {
            Some(b) => b.add_to(scores),
            None => Ok(scores.detach()),
        }
    }
    /// Marks a routing with the biased scores it was chosen by (a no-op without a bias).
    pub fn mark(&self, routing: Routing, chosen: &Tensor) -> Routing {
        match &self.selection {
            Some(b) => routing.with_selection(b, chosen),
            None => routing,
        }
    }
    /// Whether the router is in training mode.
    pub fn training(&self) -> bool {
        self.training.load(Ordering::Relaxed)
    }
    /// Sets the mode.
    pub fn set_training(&self, on: bool) {
        self.training.store(on, Ordering::Relaxed)
    }
    /// A fresh seed for this call's noise (seed and call count; reproducible run to run).
    pub fn noise_seed(&self) -> u64 {
        let c = self.calls.fetch_add(1, Ordering::Relaxed);
        self.seed
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .wrapping_add(c.wrapping_mul(0xD1B5_4A32_D192_ED03))
    }
    /// Names `<prefix>.weight` and, with a bias, `<prefix>.bias`.
    pub fn visit(&self, prefix: &str, f: &mut dyn FnMut(String, &Param)) {
        f(crate::nn::join(prefix, "weight"), &self.weight);
        if let Some(b) = &self.bias {
            f(crate::nn::join(prefix, "bias"), b);
        }
    }
    /// The gate's step-to-step state for [`Parameters::state`]: the number of noise draws so far
    /// ([`LinearGate::noise_seed`] calls), as a scalar f64 CPU tensor named
    /// [`LinearGate::NOISE_CALLS`] (f64 holds every count below 2⁵³ exactly).
    /// With a selection bias, also [`LinearGate::SELECTION_BIAS`] (`[n]` F32).
    pub fn state(&self) -> Result<Vec<(String, Tensor)>> {
        let calls = self.calls.load(Ordering::Relaxed) as f64;
        let mut s = vec![(
            Self::NOISE_CALLS.to_string(),
            Tensor::from_f64(vec![calls], &[], Device::Cpu)?,
        )];
        if let Some(b) = &self.selection {
            s.push((
                Self::SELECTION_BIAS.to_string(),
                b.get()?.to_device(Device::Cpu)?,
            ));
        }
        Ok(s)
    }
    /// Restores an entry of [`LinearGate::state`]. Errors name what is wrong: a name other
    /// than [`LinearGate::NOISE_CALLS`], or a value that is not one whole number in `0..2⁵³`.
    pub fn load_state(&self, name: &str, value: &Tensor) -> Result<()> {
        if name == Self::SELECTION_BIAS {
            return match &self.selection {
                Some(b) => b.set(value, "router state selection_bias"),
                None => Err(Error::Invalid(
                    "the checkpoint has a router selection bias (a run balanced with --balance aux-free or quantile) but this router keeps none; resume with the same --balance".into(),
                )),
            };
        }
        if name != Self::NOISE_CALLS {
            return Err(Error::Invalid(format!(
                "a router gate has no state named {name:?} (it has {})",
                Self::NOISE_CALLS
            )));
        }
        let v = match value.to_vec_f64() {
            Ok(v) if v.len() == 1 => v[0],
            _ => {
                return Err(Error::Invalid(format!(
                    "router state {name}: expected one number, got a {:?} tensor of shape {:?}",
                    value.dtype(),
                    value.shape()
                )));
            }
        };
        if !(v.is_finite() && v >= 0.0 && v.fract() == 0.0 && v < 9_007_199_254_740_992.0) {
            return Err(Error::Invalid(format!(
                "router state {name} = {v} is not a count of noise draws (a whole number ≥ 0)"
            )));
        }
        self.calls.store(v as u64, Ordering::Relaxed);
        Ok(())
    }
}

/// Uniform noise in `[lo, hi)` with the shape, dtype and device of `like`, drawn on the device
/// from `seed`.
pub fn uniform_noise(like: &Tensor, lo: f64, hi: f64, seed: u64) -> Result<Tensor> {
    Tensor::rand_uniform(like.shape(), seed, like.dtype(), like.device())?
        .mul_scalar(hi - lo)?
        .add_scalar(lo)
}

/// Standard normal noise shaped like `like` (Box–Muller on two uniform draws, on the device).
pub fn normal_noise(like: &Tensor, seed: u64) -> Result<Tensor> {
    let u1 = uniform_noise(like, 1e-7, 1.0, seed)?;
    let u2 = uniform_noise(like, 0.0, 1.0, seed ^ 0x5555_5555_5555_5555)?;
    // Box–Muller: √(−2 ln u1) · cos(2π u2); cos is built from elementary ops (see cos_2pi).
    let r = u1.log()?.mul_scalar(-2.0)?.sqrt()?;
    r.mul(&cos_2pi(&u2)?)
}

/// `cos(2πu)` for `u ∈ [0, 1)` from elementary ops (range-reduced Taylor series).
fn cos_2pi(u: &Tensor) -> Result<Tensor> {
    // Map to t = 2πu − π ∈ [−π, π): cos(2πu) = −cos(t); then cos(t) = 1 − 2 sin²(t/2) with
    // s = t/2 ∈ [−π/2, π/2) and sin s by its Taylor series to s¹³ (error < 6e-9).
    let s = u
        .mul_scalar(std::f64::consts::PI)?
        .add_scalar(-std::f64::consts::FRAC_PI_2)?;
    let s2 = s.mul(&s)?;
    let mut term = s.clone();
    let mut sin = s.clone();
    for n in 1..7 {
        let denom = ((2 * n) * (2 * n + 1)) as f64;
        term = term.mul(&s2)?.mul_scalar(-1.0 / denom)?;
        sin = sin.add(&term)?;
    }
    // −cos(t) = −(1 − 2 sin²(s)) = 2 sin² − 1
    sin.mul(&sin)?.mul_scalar(2.0)?.add_scalar(-1.0)
}
