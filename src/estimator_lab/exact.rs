//! The exact router gradient of the lab's problem, by enumerating every expert choice.
//!
//! The objective (SparseMixer Eq. 1, summed over tokens) is
//!
//! ```text
//! L(θ) = Σ_t E_{D∼π_t}[g(π_{t,D} f_{t,D})] = Σ_t Σ_i π_{t,i} · g(π_{t,i} f_{t,i}),   π_t = softmax(θ_t)
//! ```
//!
//! and its gradient splits (Eq. 2, with Eq. 7's baseline `g(0)`, which changes nothing since
//! `Σ_i ∂π_i/∂θ = 0`) into
//!
//! ```text
//! ∇₀ = Σ_i (g(π_i f_i) − g(0)) · ∂π_i/∂θ          (how the choice probabilities move the loss)
//! ∇₁ = Σ_i π_i · ⟨∇g(π_i f_i), f_i⟩ · ∂π_i/∂θ     (= E_D[∂g(π_D f_D)/∂θ], backprop through the chosen expert)
//! ```
//!
//! with `∂π_i/∂θ_k = π_i(δ_ik − π_k)`, token by token. n terms per token: exact, no sampling.

use super::loss::dot;
use super::problem::Problem;

/// The exact gradient and its two parts, each `[T·n]` row-major over (token, expert).
#[derive(Clone, Debug)]
pub struct ExactGradient {
    /// `L(θ)`, the enumerated expected loss
    pub loss: f64,
    /// `∇₀ + ∇₁ = ∂L/∂θ`
    pub total: Vec<f64>,
    /// `∇₀`, the part through the choice probabilities
    pub nabla0: Vec<f64>,
    /// `∇₁`, the part through the chosen expert's scale `π_D`
    pub nabla1: Vec<f64>,
}

/// `L(θ)` of `problem` at `logits` (`[T·n]`), enumerating every expert choice.
pub fn expected_loss(problem: &Problem, logits: &[f64]) -> f64 {
    let c = &problem.config;
    (0..c.tokens)
        .map(|t| {
            let pi = problem.probs(logits, t);
            (0..c.experts)
                .map(|i| pi[i] * problem.loss.value(&scaled(problem.output(t, i), pi[i])))
                .sum::<f64>()
        })
        .sum()
}

/// The exact gradient of [`expected_loss`] at the problem's own logits, with ∇₀ and ∇₁.
pub fn exact_gradient(problem: &Problem) -> ExactGradient {
    let c = &problem.config;
    let n = c.experts;
    let g0 = problem.loss.value(&vec![0.0; c.dim]);
    let mut nabla0 = vec![0.0; c.tokens * n];
    let mut nabla1 = vec![0.0; c.tokens * n];
    let mut loss = 0.0;
    for t in 0..c.tokens {
        let pi = problem.probs(&problem.logits, t);
        for i in 0..n {
            let f = problem.output(t, i);
            let y = scaled(f, pi[i]);
            let gy = problem.loss.value(&y);
            loss += pi[i] * gy;
            let v0 = gy - g0;
            let v1 = pi[i] * dot(&problem.loss.gradient(&y), f);
            for k in 0..n {
                let dpi = pi[i] * (f64::from(u8::from(i == k)) - pi[k]);
                nabla0[t * n + k] += v0 * dpi;
                nabla1[t * n + k] += v1 * dpi;
            }
        }
    }
    let total = nabla0.iter().zip(&nabla1).map(|(a, b)| a + b).collect();
    ExactGradient {
        loss,
        total,
        nabla0,
        nabla1,
    }
}

fn scaled(f: &[f64], s: f64) -> Vec<f64> {
    f.iter().map(|v| v * s).collect()
}
