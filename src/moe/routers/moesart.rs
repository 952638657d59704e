//! `moesart` — sampling-based k-sparse routing (MOESART: "An Effective Sampling-based Router for
//! Sparse Mixture of Experts", Ibrahim, Chen, Hazimeh, Ponomareva, Zhao, Mazumder, 2023).
//!
//! # The math
//!
//! Logits `o = (x·A + b) / τ` (temperature τ > 0), gate `g = σ(o)` over all n experts.
//!
//! **Training.** Draw k experts from `Cat(g)`: counts `r ∈ ℕⁿ`, `Σ r = k`, distinct set
//! `s = {i : r_i > 0}`. By default the draws are **without replacement** (`r_i ∈ {0, 1}`,
//! `|s| = k`); `replacement=true` makes k independent draws. Then an **anchor** `z` is drawn
//! uniformly from the distinct set `s` (a second, independent draw), and the weights are the
//! softmax over `s` of adjusted logits `õ`:
//!
//! | strategy | `õ_i` for `i ∈ s` | weights `g̃` |
//! |---|---|---|
//! | `i`   | `o_i` | `g_i / Σ_{j∈s} g_j` |
//! | `ii`  | `o_i + log r_i` | `∝ r_i g_i` (equal to `i` without replacement) |
//! | `iii` | `o_i + log r_i − log(k g_i)` | `r_i / k`: unbiased with replacement, **zero router gradient** |
//! | `eq3` (default, the paper's eq. 3) | `õ_z = o_z + log r_z`; `õ_i = o_i + log r_i − log((k−1) g_i)` for `i ≠ z` | see below |
//!
//! Closed form of eq. 3: with `D = r_z g_z + (k − r_z)/(k − 1)`, `g̃_z = r_z g_z / D` and
//! `g̃_i = r_i / ((k − 1) D)`. Without replacement this is **`g̃_z = g_z / (1 + g_z)`** and
//! **`g̃_i = 1 / ((k − 1)(1 + g_z))`** for every other `i ∈ s`; the weights sum to 1 over `s`.
//!
//! The MoE output is `y = Σ_{i∈s} g̃_i f_i(x)`; only the experts in `s` run.
//!
//! **Gradient.** With `a_i = ⟨∂L/∂y, f_i(x)⟩` (only for `i ∈ s`), eq. 3 without replacement gives
//! `∂L/∂g_z = (a_z − mean_{i∈s∖z} a_i) / (1 + g_z)²` and, through `g = σ(o)`,
//! `∂L/∂o_j = (∂L/∂g_z) g_z (δ_jz − g_j)` for **all** j (dense over the logits, but it needs only
//! the k expert outputs that were computed); `∂A = (1/τ) xᵀ ∂o`. The `g_i` inside
//! `log((k−1) g_i)` is **not** detached: that is what makes eq. 3 trainable and strategy `iii`
//! exactly untrainable, as the paper says.
//!
//! **Inference** (evaluation mode): the deterministic top-k of `g` (ties to the lowest index)
//! with weights `1/k` each — strategy `iii` with `r_i = 1`. τ does not change the top-k, so
//! inference does not depend on τ.
//!
//! **Trimmed lasso** (paper §3.2, option `trimmed_lasso = λ`, default 0): the regulariser
//! `R = λ Σ_{j>k} T(g)_j = λ (1 − top-k mass of g)`, the mass outside the k largest gate values,
//! averaged over the tokens of the batch and returned as [`Routing::aux_loss`]. Its gradient
//! `∂R/∂o_l = λ g_l (1[l ∈ bottom] − Σ_{j∈bottom} g_j)` (per token, divided by T) needs no
//! expert output and reaches only the router's parameters.
//!
//! # How it maps to the code
//!
//! * [`MoesartDraw::sample`] draws `s` and `z` on the device, with no loop and no host read:
//!   without replacement by **Gumbel-top-k** (the top k of `o_i + G_i`, `G_i = −log(−log u_i)`,
//!   has exactly the law of sequential sampling without replacement, in draw order); with
//!   replacement by one **Gumbel-max** per draw (k independent argmaxes of `o + G`). The uniforms
//!   are kept in `[10⁻⁶, 1 − 10⁻⁶)` so both logarithms stay finite. Counts `r` come from
//!   comparing the k indices pairwise. A duplicate draw keeps its slot but gets `valid = 0` and
//!   weight exactly 0, so the dispatch plan sends it nowhere and no expert runs twice; the first
//!   occurrence carries the count. The anchor is the argmax of k fresh uniforms over the valid
//!   slots, i.e. uniform over the **distinct** set (not over the k draws).
//! * [`MoesartStrategy::relative_logits`] computes `õ − LSE(o)` in log space: with
//!   `ℓ_i = log g_i = o_i − LSE(o)` (a `log_softmax`, finite even when `g_i` underflows), eq. 3
//!   is `ℓ_z + log r_z` at the anchor and the constant `log(r_i / (k−1))` elsewhere — i.e. the
//!   stable form `õ_i = LSE(o) + log(r_i/(k−1))` shifted by `−LSE(o)`, which the softmax over
//!   `s` ignores. `log((k−1) g_i)` is never formed. Every strategy is `c ⊙ ℓ + β` with a 0/1
//!   coefficient `c` and a constant `β`; strategy `iii` has `c = 0`, so its router gradient is
//!   exactly zero, not merely small. Invalid (duplicate) slots are set to −10³⁰ before the softmax.
//! * [`MoesartStrategy::weights`] is the softmax of those over the k slots: the combine weights,
//!   tracked, whose backward (autograd through `softmax`, `gather` and `log_softmax`) is the
//!   rule above.
//! * [`MoesartRouter::trimmed_lasso`] sums the `n − k` smallest gate values per token.
//!
//! Noise is drawn only in training mode, from `LinearGate::noise_seed` (router seed and call
//! count), so runs reproduce and two routers built with the same seed draw the same experts.
//!
//! Options (`--router-opt key=value`): `tau` (default 1.0), `strategy` (`i`, `ii`, `iii`,
//! `eq3`; default `eq3`), `replacement` (default false), `trimmed_lasso` (λ ≥ 0, default 0).
//! k < 2 with eq. 3 is an error at construction (with one expert the weight is one-hot and the
//! router would silently get no gradient).

use crate::nn::Parameters;
use crate::moe::Routing;
use crate::moe::{OptionKind, RouterOption, RouterSpec};
use crate::moe::{LinearGate, Router, RouterConfig};
use crate::moe::arange_f;
use crate::nn::Param;
use crate::{DType, Device, Error, Result, Tensor};

/// The registry entry of `moesart` (see [`crate::moe::ROUTERS`]).
pub(crate) const SPEC: RouterSpec = RouterSpec {
    name: "moesart",
    summary: "MOESART: k experts sampled without replacement, weights adjusted by eq. 3",
    options: &[
        RouterOption {
            key: "tau",
            kind: OptionKind::Number,
            default: "1.0",
            help: "temperature of the sampling softmax, > 0",
        },
        RouterOption {
            key: "strategy",
            kind: OptionKind::Choice(&["i", "ii", "iii", "eq3"]),
            default: "eq3",
            help: "how the sampled logits are adjusted (Table S1)",
        },
        RouterOption {
            key: "replacement",
            kind: OptionKind::Bool,
            default: "false",
            help: "sample with replacement",
        },
        RouterOption {
            key: "trimmed_lasso",
            kind: OptionKind::Number,
            default: "0",
            help: "coefficient of the trimmed-lasso regulariser, >= 0",
        },
    ],
    build: |cfg, device| Ok(Box::new(MoesartRouter::new(cfg, device)?)),
    estimator_lab: None,
};

/// The options `moesart` accepts, as `--router-opt` keys.
pub const MOESART_OPTIONS: &[&str] = &["tau", "strategy", "replacement", "trimmed_lasso"];

/// Value standing in for −∞ on the logits of empty (duplicate) slots: finite, so no kernel ever
/// sees an infinity, and small enough that its softmax weight is exactly 0 in f32 and f64.
const MASKED: f64 = -1e30;

/// Lower bound on the uniforms behind the Gumbel noise (and `1 − EPS` the upper bound).
const EPS: f64 = 1e-6;

/// How the logits of the sampled experts are adjusted before the softmax over `s` (MOESART §3.1
/// and Table S1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoesartStrategy {
    /// (i) `õ_i = o_i`: the softmax renormalised over `s`; biased.
    I,
    /// (ii) `õ_i = o_i + log r_i`: weights `∝ r_i g_i`; biased; equals (i) without replacement.
    II,
    /// (iii) `õ_i = o_i + log r_i − log(k g_i)`: weights `r_i / k`; unbiased with replacement,
    /// but the router gradient is exactly zero.
    III,
    /// eq. (3), the paper's proposal and the default: (ii) at the anchor `z`, (iii) with `k − 1`
    /// elsewhere. Needs k ≥ 2.
    Eq3,
}

impl MoesartStrategy {
    /// Parses `i`, `ii`, `iii` or `eq3` (case-insensitive), naming the accepted values otherwise.
    pub fn parse(s: &str) -> Result<MoesartStrategy> {
        match s.trim().to_ascii_lowercase().as_str() {
            "i" | "1" => Ok(MoesartStrategy::I),
            "ii" | "2" => Ok(MoesartStrategy::II),
            "iii" | "3" => Ok(MoesartStrategy::III),
            "eq3" | "(3)" => Ok(MoesartStrategy::Eq3),
            other => Err(Error::Invalid(format!(
                "router moesart: strategy={other:?} is not one of i, ii, iii, eq3"
            ))),
        }
    }

    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            MoesartStrategy::I => "i",
            MoesartStrategy::II => "ii",
            MoesartStrategy::III => "iii",
            MoesartStrategy::Eq3 => "eq3",
        }
    }

    /// The adjusted logits relative to the log-partition, `õ − LSE(o)`, `[T, k]`, in the stable
    /// log-space form (see the module docs): `c ⊙ log σ(o)_s + β` with constant `c`, `β`;
    /// invalid slots are −10³⁰. Tracked through `logits`.
    ///
    /// # Arguments
    /// * `logits` — `o`, `[T, n]` (already divided by τ)
    /// * `draw` — the sampled experts, counts, validity and anchor
    ///
    /// # Errors
    /// Eq. 3 with k < 2; shapes that do not fit together.
    pub fn relative_logits(self, logits: &Tensor, draw: &MoesartDraw) -> Result<Tensor> {
        let k = draw.check(logits)?;
        let ell = logits.log_softmax(-1)?.gather(1, &draw.experts)?; // log g_i, i ∈ slots
        let log_r = draw.counts.log()?;
        let adjusted = match self {
            MoesartStrategy::I => ell,
            MoesartStrategy::II => ell.add(&log_r)?,
            // c = 0: the gather of log g stays on the tape with an exactly-zero coefficient, so
            // the router's parameters get a (zero) gradient rather than none.
            MoesartStrategy::III => ell
                .mul(&ell.zeros_like()?)?
                .add(&log_r.add_scalar(-(k as f64).ln())?)?,
            MoesartStrategy::Eq3 => {
                if k < 2 {
                    return Err(Error::Invalid(format!(
                        "router moesart: strategy eq3 needs k ≥ 2 (log(k−1) at k = {k})"
                    )));
                }
                // anchor: ℓ_z + log r_z; others: log r_i − log(k−1)
                let others = draw.anchor.neg()?.add_scalar(1.0)?;
                ell.mul(&draw.anchor)?
                    .add(&log_r)?
                    .sub(&others.mul_scalar(((k - 1) as f64).ln())?)?
            }
        };
        if draw.all_valid {
            Ok(adjusted)
        } else {
            adjusted.masked_fill(&draw.valid.neg()?.add_scalar(1.0)?, MASKED)
        }
    }

    /// The combine weights `g̃`, `[T, k]`: the softmax over the slots of
    /// [`MoesartStrategy::relative_logits`]; exactly 0 on invalid (duplicate) slots.
    pub fn weights(self, logits: &Tensor, draw: &MoesartDraw) -> Result<Tensor> {
        self.relative_logits(logits, draw)?.softmax(-1)
    }
}

/// One draw of MOESART's sampler for a batch: k slots per token.
#[derive(Clone, Debug)]
pub struct MoesartDraw {
    /// `[T, k]` I32: the expert of each draw, in draw order
    pub experts: Tensor,
    /// `[T, k]` float: `r` of the slot's expert (how many of the k draws chose it; ≥ 1)
    pub counts: Tensor,
    /// `[T, k]` float 0/1: 1 on the first occurrence of each distinct expert, 0 on repeats
    pub valid: Tensor,
    /// `[T, k]` float 0/1: one-hot of the anchor `z`'s slot (always a valid slot)
    pub anchor: Tensor,
    /// true when every slot is valid (sampling without replacement, or deterministic top-k)
    pub all_valid: bool,
}

impl MoesartDraw {
    /// Draws k experts per row of `logits` (`[T, n]`) from `Cat(σ(logits))` and an anchor
    /// uniform over the distinct ones, from `seed`, on the logits' device. No gradient flows
    /// through the draw.
    ///
    /// # Arguments
    /// * `k` — draws per token, `1 ≤ k ≤ n` (`k ≤ n` is needed only without replacement)
    /// * `replacement` — k independent draws (Gumbel-max each) instead of Gumbel-top-k
    /// * `seed` — the counter-based generator's seed; the same seed gives the same draw
    pub fn sample(logits: &Tensor, k: usize, replacement: bool, seed: u64) -> Result<MoesartDraw> {
        let _guard = crate::NoGradGuard::new();
        let (t, n) = rows_cols(logits)?;
        if k == 0 || (!replacement && k > n) {
            return Err(Error::Invalid(format!(
                "router moesart: cannot draw k = {k} experts out of n = {n} {}",
                if replacement {
                    "with replacement"
                } else {
                    "without replacement"
                }
            )));
        }
        let (dt, dev) = (logits.dtype(), logits.device());
        let o = logits.detach();
        let (gumbel_seed, anchor_seed) = (mix(seed, 1), mix(seed, 2));
        if !replacement {
            // Gumbel-top-k: the top k of o + G in descending order is a sequential draw
            // without replacement, first draw first.
            let keys = o.add(&gumbel(&[t, n], gumbel_seed, dt, dev)?)?;
            let (_, experts) = keys.topk(k)?;
            let ones = Tensor::ones(&[t, k], dt, dev)?;
            let anchor = uniform_slot(&Tensor::rand_uniform(&[t, k], anchor_seed, dt, dev)?)?;
            return Ok(MoesartDraw {
                experts,
                counts: ones.clone(),
                valid: ones,
                anchor,
                all_valid: true,
            });
        }
        // With replacement: k independent Gumbel-max draws, one per slot.
        let keys = o
            .reshape(&[t, 1, n])?
            .add(&gumbel(&[t, k, n], gumbel_seed, dt, dev)?)?;
        let (_, experts) = keys.topk(1)?;
        let experts = experts.reshape(&[t, k])?;
        // same[t, j, l] = 1 when draws j and l chose the same expert
        let e = experts.to_dtype(dt)?;
        let same = e.reshape(&[t, k, 1])?.eq(&e.reshape(&[t, 1, k])?)?;
        let counts = same.sum(&[2], false)?;
        // a slot is valid when no earlier slot chose its expert
        let slot = arange_f(k, dt, dev)?;
        let earlier = slot.reshape(&[1, k])?.lt(&slot.reshape(&[k, 1])?)?; // [j, l] = l < j
        let repeats = same.mul(&earlier.reshape(&[1, k, k])?)?.sum(&[2], false)?;
        let valid = repeats.eq(&Tensor::scalar(0.0, dt, dev)?)?;
        // anchor: uniform over the valid slots = uniform over the distinct experts
        let u = Tensor::rand_uniform(&[t, k], anchor_seed, dt, dev)?;
        let u = Tensor::where_cond(&valid, &u, &Tensor::scalar(-1.0, dt, dev)?)?;
        Ok(MoesartDraw {
            experts,
            counts,
            valid,
            anchor: uniform_slot(&u)?,
            all_valid: false,
        })
    }

    /// The deterministic draw of inference: the top k of `logits` (ties to the lowest index),
    /// each counted once, all valid, anchor on the first slot (unused by strategy `iii`).
    pub fn top_k(logits: &Tensor, k: usize) -> Result<MoesartDraw> {
        let _guard = crate::NoGradGuard::new();
        let (t, _) = rows_cols(logits)?;
        let (dt, dev) = (logits.dtype(), logits.device());
        let (_, experts) = logits.detach().topk(k)?;
        let ones = Tensor::ones(&[t, k], dt, dev)?;
        let first = arange_f(k, dt, dev)?.eq(&Tensor::scalar(0.0, dt, dev)?)?;
        Ok(MoesartDraw {
            experts,
            counts: ones.clone(),
            valid: ones.clone(),
            anchor: ones.mul(&first.reshape(&[1, k])?)?,
            all_valid: true,
        })
    }

    /// Checks the draw against `[T, n]` logits and returns k.
    fn check(&self, logits: &Tensor) -> Result<usize> {
        let (t, _) = rows_cols(logits)?;
        let shape = self.experts.shape();
        let fits = |x: &Tensor| x.shape() == shape && x.dtype() == logits.dtype();
        if shape.len() != 2
            || shape[0] != t
            || !fits(&self.counts)
            || !fits(&self.valid)
            || !fits(&self.anchor)
        {
            return Err(Error::Shape(format!(
                "router moesart: a draw with experts {:?}, counts {:?}, valid {:?}, anchor {:?} \
                 does not fit logits {:?} of {}",
                shape,
                self.counts.shape(),
                self.valid.shape(),
                self.anchor.shape(),
                logits.shape(),
                logits.dtype()
            )));
        }
        Ok(shape[1])
    }
}

fn rows_cols(logits: &Tensor) -> Result<(usize, usize)> {
    match logits.shape() {
        &[t, n] if n > 0 => Ok((t, n)),
        s => Err(Error::Shape(format!(
            "router moesart: logits must be [T, n] with n ≥ 1, got {s:?}"
        ))),
    }
}

/// Splits one seed into independent streams (the generator hashes the seed's high half after
/// the index, so streams must differ there; this splitmix64 step changes both halves).
fn mix(seed: u64, stream: u64) -> u64 {
    let mut z = seed.wrapping_add(stream.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Standard Gumbel noise `−log(−log u)` with `u ∈ [10⁻⁶, 1 − 10⁻⁶)`, drawn on the device.
fn gumbel(shape: &[usize], seed: u64, dtype: DType, device: Device) -> Result<Tensor> {
    Tensor::rand_uniform(shape, seed, dtype, device)?
        .mul_scalar(1.0 - 2.0 * EPS)?
        .add_scalar(EPS)?
        .log()?
        .neg()?
        .log()?
        .neg()
}

/// One-hot `[T, k]` of each row's largest entry (the slot a uniform draw picks).
fn uniform_slot(u: &Tensor) -> Result<Tensor> {
    let k = u.shape()[1];
    let (_, slot) = u.topk(1)?; // [T, 1]
    let slot = slot.to_dtype(u.dtype())?;
    slot.eq(&arange_f(k, u.dtype(), u.device())?.reshape(&[1, k])?)
}

/// MOESART's settings, read from `--router-opt` (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoesartOptions {
    /// temperature τ > 0 of `o = (x·A + b)/τ` (default 1.0; does not change inference)
    pub tau: f64,
    /// the logit adjustment (default [`MoesartStrategy::Eq3`])
    pub strategy: MoesartStrategy,
    /// k independent draws instead of sampling without replacement (default false)
    pub replacement: bool,
    /// λ ≥ 0 of the trimmed-lasso regulariser `λ(1 − top-k mass of g)` (default 0: off)
    pub trimmed_lasso: f64,
}

impl Default for MoesartOptions {
    fn default() -> Self {
        MoesartOptions {
            tau: 1.0,
            strategy: MoesartStrategy::Eq3,
            replacement: false,
            trimmed_lasso: 0.0,
        }
    }
}

impl MoesartOptions {
    /// Reads and checks the options of `cfg` (unknown keys and bad values are errors naming
    /// the key).
    pub fn from_config(cfg: &RouterConfig) -> Result<MoesartOptions> {
        cfg.check_options("moesart", MOESART_OPTIONS)?;
        let d = MoesartOptions::default();
        let opts = MoesartOptions {
            tau: cfg.opt_f64("tau", d.tau)?,
            strategy: MoesartStrategy::parse(cfg.opt_str("strategy", d.strategy.name()))?,
            replacement: cfg.opt_bool("replacement", d.replacement)?,
            trimmed_lasso: cfg.opt_f64("trimmed_lasso", d.trimmed_lasso)?,
        };
        if opts.tau <= 0.0 {
            return Err(Error::Invalid(format!(
                "router moesart: tau={} must be a positive temperature",
                opts.tau
            )));
        }
        if opts.trimmed_lasso < 0.0 {
            return Err(Error::Invalid(format!(
                "router moesart: trimmed_lasso={} must be ≥ 0",
                opts.trimmed_lasso
            )));
        }
        if opts.strategy == MoesartStrategy::Eq3 && cfg.k < 2 {
            return Err(Error::Invalid(format!(
                "router moesart: strategy eq3 needs --k 2 or more, got --k {}: with one sampled \
                 expert the weight is one-hot and the router would get no gradient (use --k ≥ 2, \
                 or strategy=i|ii|iii to accept that)",
                cfg.k
            )));
        }
        Ok(opts)
    }
}

/// The MOESART router (see the module docs for the math).
pub struct MoesartRouter {
    gate: LinearGate,
    k: usize,
    options: MoesartOptions,
}

impl MoesartRouter {
    /// A MOESART router: a linear gate `d → n` (PyTorch's Linear initialisation, zero bias) and
    /// the options of `cfg.options`.
    ///
    /// # Errors
    /// Unknown options, bad values, `k` outside `1..=n`, and k < 2 with strategy eq3.
    pub fn new(cfg: &RouterConfig, device: Device) -> Result<MoesartRouter> {
        let options = MoesartOptions::from_config(cfg)?;
        if cfg.k == 0 || cfg.k > cfg.experts {
            return Err(Error::Invalid(format!(
                "router moesart: --k {} must be between 1 and the number of experts {}",
                cfg.k, cfg.experts
            )));
        }
        Ok(MoesartRouter {
            gate: LinearGate::new(cfg, device)?,
            k: cfg.k,
            options,
        })
    }

    /// The settings in use.
    pub fn options(&self) -> MoesartOptions {
        self.options
    }

    /// `o = (x·A + b)/τ`, `[T, n]`.
    pub fn logits(&self, x: &Tensor) -> Result<Tensor> {
        self.gate.logits(x)?.mul_scalar(1.0 / self.options.tau)
    }

    /// The trimmed-lasso penalty without λ: the mass of the `n − k` smallest entries of each
    /// row of `probs` (`[T, n]`, the dense softmax `g`), averaged over the rows; a tracked scalar.
    /// Summing the small entries, rather than forming `1 − top-k mass`, keeps it accurate when
    /// the gate is nearly k-sparse.
    pub fn trimmed_lasso(probs: &Tensor, k: usize) -> Result<Tensor> {
        let (t, n) = rows_cols(probs)?;
        if k >= n || t == 0 {
            return Tensor::zeros(&[], probs.dtype(), probs.device());
        }
        let order = probs.detach().argsort(true)?.slice(1, k, n)?;
        probs
            .gather(1, &order)?
            .sum_all()?
            .mul_scalar(1.0 / t as f64)
    }
}

impl Router for MoesartRouter {
    fn name(&self) -> &'static str {
        "moesart"
    }

    fn reads_tokens_only_through_products(&self) -> bool {
        true
    }
    fn route(&self, x: &Tensor) -> Result<Routing> {
        let logits = self.logits(x)?;
        let probs = logits.softmax(-1)?;
        let (draw, strategy) = if self.gate.training() {
            let draw = MoesartDraw::sample(
                &logits,
                self.k,
                self.options.replacement,
                self.gate.noise_seed(),
            )?;
            (draw, self.options.strategy)
        } else {
            // inference: top-k, weights 1/k = strategy (iii) with r_i = 1
            (MoesartDraw::top_k(&logits, self.k)?, MoesartStrategy::III)
        };
        let weights = strategy.weights(&logits, &draw)?;
        let valid = (!draw.all_valid).then_some(&draw.valid);
        let mut routing =
            Routing::token_choice(&draw.experts, &weights, valid, probs.clone(), logits)?;
        let lambda = self.options.trimmed_lasso;
        if lambda > 0.0 {
            let mass = MoesartRouter::trimmed_lasso(&probs, self.k)?;
            routing.metrics.push(("moesart_bottom_mass", mass.detach()));
            routing.aux_loss = Some(mass.mul_scalar(lambda)?);
        }
        Ok(routing)
    }
}

impl Parameters for MoesartRouter {

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
