//! `dselect-k` (per-example) and `dselect-k-static` — the differentiable sparse gate of
//! DSelect-k ("DSelect-k: Differentiable Selection in the Mixture of Experts with Applications
//! to Multi-Task Learning", Hazimeh, Zhao, Chowdhery, Sathiamoorthy, Chen, Mazumder, Hong, Chi,
//! NeurIPS 2021; docs/routers.md, `dselect-k`).
//!
//! # The math
//!
//! **Smooth-step** with width γ > 0:
//! `S(t) = 0` for `t ≤ −γ/2`, `S(t) = −(2/γ³)t³ + (3/(2γ))t + ½` for `|t| ≤ γ/2`, `S(t) = 1` for
//! `t ≥ γ/2`. It is C¹ (`S'(±γ/2) = 0`), `S(0) = ½`, `S(−t) = 1 − S(t)`, and — unlike a
//! sigmoid — reaches 0 and 1 exactly, which is what lets the gate become truly sparse.
//!
//! **Single-expert selector.** With `n` experts and `m = ⌈log₂ n⌉` bits, a selector has `m`
//! logits `z` and puts on code `e ∈ {0, …, 2^m − 1}` the probability
//! `r(z)_e = Π_j [S(z_j) if bit j of e is set, else 1 − S(z_j)]` — the law of an m-bit integer
//! whose bits are independent Bernoulli(S(z_j)). It lies on the simplex; once every `S(z_j)` is
//! 0 or 1 it is one-hot at `e = Σ_j 2^j S(z_j)` (0-based; the paper's `1 + Σ 2^{j−1} S(z_j)`).
//!
//! **Gate.** k selectors `z^(1..k)` mixed by a softmax over k logits α:
//! `q = Σ_{i=1}^k σ(α)_i r(z^(i))`, so `‖q‖₀ ≤ k` once the selectors saturate.
//! * `dselect-k-static` (eq. 6): α ∈ R^k and Z ∈ R^{k×m} are parameters — one gate for every
//!   input (the multi-task setting: one static gate per task).
//! * `dselect-k` (per-example): `α = x·G + b_G`, `z^(i) = x·W^(i) + b_W` (the public code has the
//!   biases); the k·m selector logits come from one matrix `W: [d, k·m]`.
//!
//! **Gradient** (what the tape computes; derived in docs/routers.md, `dselect-k`, and checked
//! by gradcheck). With `a_e = ⟨∂L/∂y, f_e(x)⟩` for the experts that ran and `u = S(z^(i))`:
//! `∂L/∂α_i = σ_i (Σ_e a_e r^(i)_e − Σ_e a_e q_e)` and
//! `∂L/∂z^(i)_j = σ_i S'(z^(i)_j) Σ_e a_e ∂r^(i)_e/∂u_j`, where `∂r_e/∂u_j = ±Π_{l≠j}(…)` is a
//! product of the other factors — the tape forms it from the chain of multiplications, never as
//! `r_e / u_j`, so it is exact at saturation. If `r_e = 0` another factor is 0, so the gate needs
//! `a_e` only for experts in the support of q. Once `|z_j| ≥ γ/2`, `S' = 0` and that logit never
//! moves again: the gate is dense early in training and at most k-sparse later.
//!
//! **Non-power-of-two n.** `2^m > n` codes: option `unused=wrap` (default) maps code `e ≥ n` to
//! expert `e − n`, so q stays exactly on the simplex; `unused=penalty` drops the unused codes
//! (q then sums to the used mass, ≤ 1) and adds `ξ · Σ_i 1 / Σ_{e<n} r^(i)_e` (per example,
//! summed) to the auxiliary loss, pushing the selectors onto real experts (option `xi`, default
//! 1e-2).
//!
//! **Entropy regulariser** (option `entropy = λ`, default 0): `λ Σ_i h(r(z^(i)))` with
//! `h(p) = −Σ_e p_e log(p_e + 10⁻⁶)` (the ε of the public code: finite at saturation, no NaN in
//! backward), summed over the examples of the batch as the paper does (not averaged). It
//! rewards selectors for committing to one code, so the gate saturates sooner.
//!
//! **Initialisation** (the public code): Z and the per-example `W` uniform in `(−γ/100, γ/100)`,
//! α and `G` uniform in `(−0.05, 0.05)`, biases zero — an almost uniform gate (exactly uniform,
//! `1/n`, when everything is zero).
//!
//! # How it maps to the code
//!
//! The selectors are built with tensor ops on the device: `u = S(z)` `[T, k, m]`, then
//! `r = Π_j ((1 − u_j) + (2u_j − 1)·bit_j)` over a constant `[1, 1, 2^m]` bit table, m
//! multiplications; `q = Σ_i σ(α)_i r^(i)`. The routing has `n` slots per token (a static bound:
//! any expert may have weight), sorted by weight so that slot 0 is the largest (capacity
//! priority); a slot is valid only when its weight is nonzero, so the dispatch plan sends
//! zero-weight experts nowhere and they never run — compute falls as the selectors saturate.
//! The router metric `dselect_saturated` is the fraction of selector logits with `|z| ≥ γ/2`.
//!
//! Defaults: γ = 1 (the code's default; the paper also tries 0.1 and 10), k from `--k`
//! (the paper uses 2 and 4).

use crate::nn::Parameters;
use crate::moe::Routing;
use crate::moe::{OptionKind, RouterOption, RouterSpec};
use crate::moe::{Router, RouterConfig};
use crate::nn::{Param, join, uniform};
use crate::{DType, Device, Error, Result, Tensor};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

/// The registry entry of `dselect-k` (see [`crate::moe::ROUTERS`]).
pub(crate) const SPEC: RouterSpec = RouterSpec {
    name: "dselect-k",
    summary: "DSelect-k: k differentiable binary-code selectors per example",
    options: DSELECT_K_OPTION_SPECS,
    build: |cfg, device| {
        Ok(Box::new(DSelectKRouter::new(
            cfg,
            DSelectKKind::PerExample,
            device,
        )?))
    },
    estimator_lab: None,
};

/// The registry entry of `dselect-k-static`.
pub(crate) const SPEC_STATIC: RouterSpec = RouterSpec {
    name: "dselect-k-static",
    summary: "DSelect-k static: the same k selectors for every example",
    options: DSELECT_K_OPTION_SPECS,
    build: |cfg, device| {
        Ok(Box::new(DSelectKRouter::new(
            cfg,
            DSelectKKind::Static,
            device,
        )?))
    },
    estimator_lab: None,
};

/// The options of both DSelect-k routers.
const DSELECT_K_OPTION_SPECS: &[RouterOption] = &[
    RouterOption {
        key: "gamma",
        kind: OptionKind::Number,
        default: "1.0",
        help: "smooth-step width, > 0",
    },
    RouterOption {
        key: "entropy",
        kind: OptionKind::Number,
        default: "0",
        help: "coefficient of the entropy regulariser, >= 0",
    },
    RouterOption {
        key: "unused",
        kind: OptionKind::Choice(&["wrap", "penalty"]),
        default: "wrap",
        help: "codes naming no expert (n not a power of two): wrap around or penalise",
    },
    RouterOption {
        key: "xi",
        kind: OptionKind::Number,
        default: "0.01",
        help: "coefficient of the unused-code penalty, >= 0",
    },
];

/// The options `dselect-k` and `dselect-k-static` accept.
pub const DSELECT_K_OPTIONS: &[&str] = &["gamma", "entropy", "unused", "xi"];

/// What to do with the `2^m − n` codes that name no expert when n is not a power of two.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnusedCodes {
    /// code `e ≥ n` selects expert `e − n` (q stays on the simplex)
    Wrap,
    /// unused codes are dropped and penalised by `ξ Σ_i 1/Σ_{e<n} r^(i)_e`
    Penalty,
}

/// The settings of a DSelect-k gate (`--router-opt key=value`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DSelectKOptions {
    /// smooth-step width γ > 0 (default 1)
    pub gamma: f64,
    /// entropy-regulariser coefficient λ ≥ 0 (default 0: off)
    pub entropy: f64,
    /// unused codes for non-power-of-two n (default wrap)
    pub unused: UnusedCodes,
    /// penalty coefficient ξ ≥ 0 for `unused=penalty` (default 1e-2)
    pub xi: f64,
}

impl Default for DSelectKOptions {
    fn default() -> Self {
        DSelectKOptions {
            gamma: 1.0,
            entropy: 0.0,
            unused: UnusedCodes::Wrap,
            xi: 1e-2,
        }
    }
}

impl DSelectKOptions {
    /// Reads and checks the options of `cfg` for router `name` (unknown keys and bad values are
    /// errors naming the key).
    pub fn from_config(name: &str, cfg: &RouterConfig) -> Result<DSelectKOptions> {
        cfg.check_options(name, DSELECT_K_OPTIONS)?;
        let d = DSelectKOptions::default();
        let unused = match cfg.opt_str("unused", "wrap") {
            "wrap" => UnusedCodes::Wrap,
            "penalty" => UnusedCodes::Penalty,
            other => {
                return Err(Error::Invalid(format!(
                    "router {name}: unused={other:?}: expected wrap or penalty"
                )));
            }
        };
        let o = DSelectKOptions {
            gamma: cfg.opt_f64("gamma", d.gamma)?,
            entropy: cfg.opt_f64("entropy", d.entropy)?,
            unused,
            xi: cfg.opt_f64("xi", d.xi)?,
        };
        if o.gamma <= 0.0 {
            return Err(Error::Invalid(format!(
                "router {name}: gamma={} must be a positive smooth-step width",
                o.gamma
            )));
        }
        for (key, v) in [("entropy", o.entropy), ("xi", o.xi)] {
            if v < 0.0 {
                return Err(Error::Invalid(format!(
                    "router {name}: {key}={v} must be ≥ 0"
                )));
            }
        }
        Ok(o)
    }
}

/// The smooth-step `S(t)` of width γ, elementwise and differentiable (`S' = 0` outside
/// `(−γ/2, γ/2)`); exactly 0 and 1 in the flat parts.
pub fn smooth_step(t: &Tensor, gamma: f64) -> Result<Tensor> {
    let h = gamma / 2.0;
    let c = t.clamp(-h, h)?;
    let cubic = c
        .mul(&c)?
        .mul(&c)?
        .mul_scalar(-2.0 / gamma.powi(3))?
        .add(&c.mul_scalar(1.5 / gamma)?)?
        .add_scalar(0.5)?;
    // Rounding can leave the cubic a hair off 0 or 1 at the knots; the flat parts are set
    // exactly, so a saturated selector gives exact zeros and its experts never run.
    let ones = t.full_like(1.0)?.detach();
    let zeros = t.full_like(0.0)?.detach();
    let high = t.ge(&Tensor::scalar(h, t.dtype(), t.device())?)?;
    let low = t.le(&Tensor::scalar(-h, t.dtype(), t.device())?)?;
    Tensor::where_cond(&high, &ones, &Tensor::where_cond(&low, &zeros, &cubic)?)
}

/// Bits `m = ⌈log₂ n⌉` needed to name `n` experts (at least 1, so that n = 1 still has a code).
pub fn selector_bits(n: usize) -> usize {
    (usize::BITS - (n.max(2) - 1).leading_zeros()) as usize
}

/// The selector distributions `r(S(z))` for selector logits `z: [.., m]` → `[.., 2^m]`: the pmf
/// of an m-bit integer with independent bits `P(bit j) = S(z_j)` (bit 0 least significant).
pub fn selector_probs(z: &Tensor, gamma: f64) -> Result<Tensor> {
    let shape = z.shape().to_vec();
    let m = *shape
        .last()
        .ok_or_else(|| Error::Shape("selector logits need at least one axis".into()))?;
    if m == 0 || m > 16 {
        return Err(Error::Shape(format!(
            "selector logits {shape:?}: the last axis (bits) must be 1..=16"
        )));
    }
    let codes = 1usize << m;
    let u = smooth_step(z, gamma)?;
    let rank = shape.len();
    let mut bit_shape = vec![1; rank];
    bit_shape[rank - 1] = codes;
    let table = bit_table(m, z.dtype(), z.device())?;
    let mut r: Option<Tensor> = None;
    for j in 0..m {
        let bit = table.slice(0, j, j + 1)?.reshape(&bit_shape)?;
        let uj = u.slice(-1, j, j + 1)?;
        // (1 − u_j) + (2u_j − 1)·bit_j: u_j where the bit is set, 1 − u_j elsewhere
        let factor = uj
            .neg()?
            .add_scalar(1.0)?
            .add(&uj.mul_scalar(2.0)?.add_scalar(-1.0)?.mul(&bit)?)?;
        r = Some(match r {
            None => factor,
            Some(prev) => prev.mul(&factor)?,
        });
    }
    r.ok_or_else(|| Error::Shape("selector with no bits".into()))
}

type BitCache = Mutex<HashMap<(usize, DType, Device), Tensor>>;

/// The constant table `bits[j, e]` = bit j of code e, `[m, 2^m]`, made once per (m, dtype,
/// device) so a training step uploads nothing.
fn bit_table(m: usize, dtype: DType, device: Device) -> Result<Tensor> {
    static CACHE: OnceLock<BitCache> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    if let Some(hit) = cache
        .lock()
        .ok()
        .and_then(|c| c.get(&(m, dtype, device)).cloned())
    {
        return Ok(hit);
    }
    let codes = 1usize << m;
    let bits: Vec<f32> = (0..m * codes)
        .map(|i| (((i % codes) >> (i / codes)) & 1) as f32)
        .collect();
    let table = Tensor::from_f32(bits, &[m, codes], Device::Cpu)?
        .to_dtype(dtype)?
        .to_device(device)?;
    if let Ok(mut c) = cache.lock() {
        c.insert((m, dtype, device), table.clone());
    }
    Ok(table)
}

/// The entropy `−Σ_e p_e log(p_e + 10⁻⁶)` over the last axis, summed over all other axes.
fn summed_entropy(p: &Tensor) -> Result<Tensor> {
    p.mul(&p.add_scalar(1e-6)?.log()?)?.sum_all()?.neg()
}

/// Which DSelect-k gate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DSelectKKind {
    /// one gate per input: α and z are linear in x
    PerExample,
    /// one gate for all inputs: α and Z are parameters
    Static,
}

/// A DSelect-k router (see the module docs for the math).
pub struct DSelectKRouter {
    kind: DSelectKKind,
    /// per-example: `G [d, k]`; static: `α [k]`
    alpha: Param,
    /// per-example: `b_G [k]`
    alpha_bias: Option<Param>,
    /// per-example: `W [d, k·m]`; static: `Z [k, m]`
    z: Param,
    /// per-example: `b_W [k·m]`
    z_bias: Option<Param>,
    n: usize,
    k: usize,
    m: usize,
    d: usize,
    options: DSelectKOptions,
}

impl DSelectKRouter {
    /// A DSelect-k gate of the given kind over `cfg.experts` experts with `cfg.k` selectors,
    /// initialised as the public code does (see the module docs).
    ///
    /// # Errors
    /// Unknown options, bad values, `k` outside `1..=n`, `d = 0`.
    pub fn new(cfg: &RouterConfig, kind: DSelectKKind, device: Device) -> Result<DSelectKRouter> {
        let name = match kind {
            DSelectKKind::PerExample => "dselect-k",
            DSelectKKind::Static => "dselect-k-static",
        };
        let options = DSelectKOptions::from_config(name, cfg)?;
        let (n, k, d) = (cfg.experts, cfg.k, cfg.d);
        if k == 0 || k > n || d == 0 {
            return Err(Error::Invalid(format!(
                "router {name}: needs 1 ≤ k ≤ n and d ≥ 1, got k = {k}, n = {n}, d = {d}"
            )));
        }
        let m = selector_bits(n);
        let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed ^ 0x6473_656c);
        let zb = options.gamma / 100.0;
        let (alpha, alpha_bias, z, z_bias) = match kind {
            DSelectKKind::Static => (
                Param::new(uniform(&[k], 0.05, &mut rng, device)?)?,
                None,
                Param::new(uniform(&[k, m], zb, &mut rng, device)?)?,
                None,
            ),
            DSelectKKind::PerExample => (
                Param::new(uniform(&[d, k], 0.05, &mut rng, device)?)?,
                Some(Param::new(Tensor::zeros(&[k], DType::F32, device)?)?),
                Param::new(uniform(&[d, k * m], zb, &mut rng, device)?)?,
                Some(Param::new(Tensor::zeros(&[k * m], DType::F32, device)?)?),
            ),
        };
        Ok(DSelectKRouter {
            kind,
            alpha,
            alpha_bias,
            z,
            z_bias,
            n,
            k,
            m,
            d,
            options,
        })
    }

    /// The settings in use.
    pub fn options(&self) -> DSelectKOptions {
        self.options
    }

    /// The mixing logits α `[T, k]` and selector logits z `[T, k, m]` for tokens `x: [T, d]`
    /// (static: the parameters, broadcast to every token).
    pub fn gate_logits(&self, x: &Tensor) -> Result<(Tensor, Tensor)> {
        if x.rank() != 2 || x.shape()[1] != self.d {
            return Err(Error::Shape(format!(
                "router {} expects tokens [T, {}], got {:?}",
                self.name(),
                self.d,
                x.shape()
            )));
        }
        let t = x.shape()[0];
        let (k, m) = (self.k, self.m);
        match self.kind {
            DSelectKKind::Static => Ok((
                self.alpha.get().reshape(&[1, k])?.expand(&[t, k])?,
                self.z.get().reshape(&[1, k, m])?.expand(&[t, k, m])?,
            )),
            DSelectKKind::PerExample => {
                let bias = |p: &Option<Param>| p.as_ref().map(|b| b.get());
                let mut alpha = x.matmul(&self.alpha.get())?;
                let mut z = x.matmul(&self.z.get())?;
                if let Some(b) = bias(&self.alpha_bias) {
                    alpha = alpha.add(&b)?;
                }
                if let Some(b) = bias(&self.z_bias) {
                    z = z.add(&b)?;
                }
                Ok((alpha, z.reshape(&[t, k, m])?))
            }
        }
    }

    /// The gate `q [T, n]` (weights over the experts), the selector distributions
    /// `r [T, k, 2^m]` and the unused-code penalty `Σ 1/Σ_{e<n} r_e` (None unless
    /// `unused=penalty` and n < 2^m).
    pub fn gate(&self, alpha: &Tensor, z: &Tensor) -> Result<(Tensor, Tensor, Option<Tensor>)> {
        let t = alpha.shape()[0];
        let (n, codes) = (self.n, 1usize << self.m);
        let r = selector_probs(z, self.options.gamma)?;
        let mix = alpha.softmax(-1)?.reshape(&[t, self.k, 1])?;
        let q_codes = r.mul(&mix)?.sum(&[1], false)?; // [T, 2^m]
        if codes == n {
            return Ok((q_codes, r, None));
        }
        let used = q_codes.slice(1, 0, n)?;
        match self.options.unused {
            UnusedCodes::Wrap => {
                // codes n..2^m fold back onto experts 0..2^m − n (2^m < 2n, so they fit)
                let extra = q_codes.slice(1, n, codes)?;
                let pad = Tensor::zeros(&[t, 2 * n - codes], q_codes.dtype(), q_codes.device())?;
                Ok((used.add(&Tensor::concat(&[extra, pad], 1)?)?, r, None))
            }
            UnusedCodes::Penalty => {
                let mass = r.slice(-1, 0, n)?.sum(&[-1], false)?; // [T, k]
                let penalty = mass.add_scalar(1e-12)?.recip()?.sum_all()?;
                Ok((used, r, Some(penalty)))
            }
        }
    }
}

impl Router for DSelectKRouter {
    fn name(&self) -> &'static str {
        match self.kind {
            DSelectKKind::PerExample => "dselect-k",
            DSelectKKind::Static => "dselect-k-static",
        }
    }

    fn route(&self, x: &Tensor) -> Result<Routing> {
        let (alpha, z) = self.gate_logits(x)?;
        let (q, r, penalty) = self.gate(&alpha, &z)?;
        let dtype = q.dtype();
        // n slots per token, the largest weight first; zero weights are not dispatched.
        let (weights, idx) = q.topk(self.n)?;
        let valid = weights
            .detach()
            .gt(&Tensor::scalar(0.0, dtype, q.device())?)?;
        let mut routing = Routing::token_choice(&idx, &weights, Some(&valid), q, alpha)?;

        let mut aux: Option<Tensor> = None;
        let mut add = |term: Tensor| -> Result<()> {
            aux = Some(match aux.take() {
                None => term,
                Some(a) => a.add(&term)?,
            });
            Ok(())
        };
        if self.options.entropy > 0.0 {
            // static: the gate is shared by every token, so its entropy is counted once
            let r_own = match self.kind {
                DSelectKKind::Static => r.slice(0, 0, 1.min(r.shape()[0]))?,
                DSelectKKind::PerExample => r.clone(),
            };
            add(summed_entropy(&r_own)?.mul_scalar(self.options.entropy)?)?;
        }
        if let Some(p) = penalty
            && self.options.xi > 0.0
        {
            let p = match self.kind {
                DSelectKKind::Static => p.mul_scalar(1.0 / x.shape()[0].max(1) as f64)?,
                DSelectKKind::PerExample => p,
            };
            add(p.mul_scalar(self.options.xi)?)?;
        }
        routing.aux_loss = aux;
        let saturated = crate::no_grad(|| {
            z.detach()
                .abs()?
                .ge(&Tensor::scalar(
                    self.options.gamma / 2.0,
                    dtype,
                    z.device(),
                )?)?
                .mean_all()
        })?;
        routing.metrics.push(("dselect_saturated", saturated));
        Ok(routing)
    }
}

impl Parameters for DSelectKRouter {

    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(String, &Param)) {
        match self.kind {
            DSelectKKind::Static => {
                f(join(prefix, "alpha"), &self.alpha);
                f(join(prefix, "z"), &self.z);
            }
            DSelectKKind::PerExample => {
                f(join(prefix, "alpha_weight"), &self.alpha);
                if let Some(b) = &self.alpha_bias {
                    f(join(prefix, "alpha_bias"), b);
                }
                f(join(prefix, "z_weight"), &self.z);
                if let Some(b) = &self.z_bias {
                    f(join(prefix, "z_bias"), b);
                }
            }
        }
    }

    fn set_training(&self, _training: bool) {
        // deterministic: the same gate in training and evaluation
    }
}
