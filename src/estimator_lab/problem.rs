//! The lab's small MoE problem: SparseMixer's simplified layer (§2) with fixed expert outputs.
//!
//! Per token t of T: router logits `θ_t ∈ R^n` and expert outputs `f_{t,i} ∈ R^d`, all drawn
//! once from the seed and then held fixed; the layer samples one expert `D ~ π_t = softmax(θ_t)`
//! and outputs `y_t = π_{t,D} f_{t,D}`; the loss is `g(y_t)` summed over tokens (see
//! [`super::loss`]). The lab studies the gradient of the expected loss with respect to θ.
//!
//! Logits are `offset + scale·z`, expert outputs `ε·z` (plus `shared·m_i`, one vector per
//! expert common to all tokens, when `shared` is set), z iid standard normal. The `offset`
//! changes nothing in the objective (the softmax is shift-invariant) but SparseMixer's mask
//! `θ* − θ_j ≤ r(|θ*| + |θ_j|)` is not shift-invariant: a large offset keeps every expert.

use super::loss::{Loss, LossKind};
use crate::{Device, Result, Tensor};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// How the problem is drawn.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ProblemConfig {
    /// tokens T (default 16)
    pub tokens: usize,
    /// experts n ≥ 2 (default 8)
    pub experts: usize,
    /// output width d (default 4)
    pub dim: usize,
    /// the loss g (default logistic)
    pub loss: LossKind,
    /// standard deviation of the logits (default 1)
    pub scale: f64,
    /// constant added to every logit (default 0; leaves π unchanged, loosens SparseMixer's mask)
    pub offset: f64,
    /// standard deviation ε of the expert outputs (default 1)
    pub eps: f64,
    /// standard deviation of a per-expert component every token's output of that expert shares
    /// (default 0: outputs independent across tokens): `f_{t,i} = shared·m_i + ε·z_{t,i}`
    #[serde(default)]
    pub shared: f64,
    /// seed of the logits, the expert outputs and the loss coefficients
    pub seed: u64,
}

impl Default for ProblemConfig {
    fn default() -> ProblemConfig {
        ProblemConfig {
            tokens: 16,
            experts: 8,
            dim: 4,
            loss: LossKind::Logistic,
            scale: 1.0,
            offset: 0.0,
            eps: 1.0,
            shared: 0.0,
            seed: 0,
        }
    }
}

/// A drawn problem.
#[derive(Clone, Debug)]
pub struct Problem {
    /// how it was drawn
    pub config: ProblemConfig,
    /// `[T·n]` row-major: `θ_{t,i}`
    pub logits: Vec<f64>,
    /// `[T·n·d]` row-major: `f_{t,i}`
    pub outputs: Vec<f64>,
    /// the per-token loss g
    pub loss: Loss,
}

impl Problem {
    /// Draws the problem of `config` (validated by the caller, see
    /// [`super::LabConfig::validate`]).
    pub fn new(config: &ProblemConfig) -> Problem {
        let (t, n, d) = (config.tokens, config.experts, config.dim);
        let mut rng = ChaCha8Rng::seed_from_u64(config.seed);
        let logits = (0..t * n)
            .map(|_| config.offset + config.scale * std_normal(&mut rng))
            .collect();
        let mut outputs: Vec<f64> = (0..t * n * d)
            .map(|_| config.eps * std_normal(&mut rng))
            .collect();
        if config.shared != 0.0 {
            // drawn after everything else, so shared = 0 leaves the problem as it was
            let m: Vec<f64> = (0..n * d).map(|_| std_normal(&mut rng)).collect();
            for (at, f) in outputs.iter_mut().enumerate() {
                let (i, j) = ((at / d) % n, at % d);
                *f += config.shared * m[i * d + j];
            }
        }
        Problem {
            config: config.clone(),
            logits,
            outputs,
            loss: Loss::new(config.loss, d, config.seed),
        }
    }

    /// `π_t = softmax(θ_t)` of token t under `logits` (`[T·n]`).
    pub fn probs(&self, logits: &[f64], t: usize) -> Vec<f64> {
        let n = self.config.experts;
        let row = &logits[t * n..(t + 1) * n];
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = row.iter().map(|v| (v - m).exp()).collect();
        let s: f64 = e.iter().sum();
        e.iter().map(|v| v / s).collect()
    }

    /// Expert i's output for token t, `f_{t,i} ∈ R^d`.
    pub fn output(&self, t: usize, i: usize) -> &[f64] {
        let (n, d) = (self.config.experts, self.config.dim);
        let at = (t * n + i) * d;
        &self.outputs[at..at + d]
    }

    /// The logits as a `[T, n]` f64 tensor on the CPU.
    pub fn logits_tensor(&self) -> Result<Tensor> {
        let c = &self.config;
        Tensor::from_f64(self.logits.clone(), &[c.tokens, c.experts], Device::cpu())
    }

    /// The expert outputs as a `[T, n, d]` f64 tensor on the CPU.
    pub fn outputs_tensor(&self) -> Result<Tensor> {
        let c = &self.config;
        Tensor::from_f64(
            self.outputs.clone(),
            &[c.tokens, c.experts, c.dim],
            Device::cpu(),
        )
    }
}

/// One standard normal draw (Box–Muller).
fn std_normal(rng: &mut ChaCha8Rng) -> f64 {
    let u1: f64 = rng.random_range(f64::EPSILON..1.0);
    let u2: f64 = rng.random_range(0.0..1.0);
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}
