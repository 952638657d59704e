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

/// The exact gradient of the **dense** problem's loss `L(θ) = Σ_t g(Σ_i π_{t,i} f_{t,i})`: the
/// loss of the MoE that runs every expert, whose gradient k-sparse routers approximate
/// (`--problem dense`, docs/estimators.md). Per token, with `a_i = ⟨∇g(y), f_i⟩`,
/// `∂L/∂θ_k = π_k (a_k − Σ_i π_i a_i)`. ∇₀ and ∇₁ belong to the sampled problem: they are left
/// empty.
pub fn dense_gradient(problem: &Problem) -> ExactGradient {
    mixture_gradient(
        problem,
        |pi, _| pi.to_vec(),
        |pi, theta, a| {
            let pa: f64 = pi.iter().zip(a).map(|(p, a)| p * a).sum();
            (0..theta.len()).map(|k| pi[k] * (a[k] - pa)).collect()
        },
    )
}

/// The exact gradient of ReMoE's own loss on the problem, `L(θ) = Σ_t g(Σ_i ReLU(θ_{t,i})
/// f_{t,i})`: `∂L/∂θ_k = 1[θ_k > 0] ⟨∇g(y), f_k⟩` (`remoe` is differentiable: its router gradient
/// should equal this exactly). ∇₀ and ∇₁ are left empty.
pub fn relu_gradient(problem: &Problem) -> ExactGradient {
    mixture_gradient(
        problem,
        |_, theta| theta.iter().map(|v| v.max(0.0)).collect(),
        |_, theta, a| {
            theta
                .iter()
                .zip(a)
                .map(|(v, a)| if *v > 0.0 { *a } else { 0.0 })
                .collect()
        },
    )
}

/// `L = Σ_t g(Σ_i w_i f_i)` with weights `w = weights(π_t, θ_t)` and its gradient
/// `grad(π_t, θ_t, a)` per token, `a_i = ⟨∇g(y_t), f_{t,i}⟩`.
fn mixture_gradient(
    problem: &Problem,
    weights: impl Fn(&[f64], &[f64]) -> Vec<f64>,
    grad: impl Fn(&[f64], &[f64], &[f64]) -> Vec<f64>,
) -> ExactGradient {
    let c = &problem.config;
    let (n, d) = (c.experts, c.dim);
    let mut total = Vec::with_capacity(c.tokens * n);
    let mut loss = 0.0;
    for t in 0..c.tokens {
        let pi = problem.probs(&problem.logits, t);
        let theta = &problem.logits[t * n..(t + 1) * n];
        let w = weights(&pi, theta);
        let y: Vec<f64> = (0..d)
            .map(|j| (0..n).map(|i| w[i] * problem.output(t, i)[j]).sum())
            .collect();
        loss += problem.loss.value(&y);
        let gy = problem.loss.gradient(&y);
        let a: Vec<f64> = (0..n).map(|i| dot(&gy, problem.output(t, i))).collect();
        total.extend(grad(&pi, theta, &a));
    }
    ExactGradient {
        loss,
        total,
        nabla0: Vec::new(),
        nabla1: Vec::new(),
    }
}

/// The expected loss of the **top-2 sampled** problem (`--problem top2`) at `logits` (`[T·n]`):
/// two experts drawn without replacement from `π_t`, the second from the softmax over the rest,
/// `π'_j = π_j / (1 − π_i)`, each weighted by its own probability (SparseMixer-v2's top-2 layer
/// without its mask):
///
/// ```text
/// L(θ) = Σ_t Σ_i Σ_{j≠i} π_i π'_j · g(π_i f_i + π'_j f_j)
/// ```
///
/// n(n−1) ordered pairs per token: exact, no sampling.
pub fn top2_expected_loss(problem: &Problem, logits: &[f64]) -> f64 {
    let c = &problem.config;
    let (n, d) = (c.experts, c.dim);
    (0..c.tokens)
        .map(|t| {
            let pi = problem.probs(logits, t);
            let mut sum = 0.0;
            for i in 0..n {
                let rest = 1.0 - pi[i];
                if rest <= 0.0 {
                    continue;
                }
                for j in (0..n).filter(|&j| j != i) {
                    let pj = pi[j] / rest;
                    let y: Vec<f64> = (0..d)
                        .map(|e| pi[i] * problem.output(t, i)[e] + pj * problem.output(t, j)[e])
                        .collect();
                    sum += pi[i] * pj * problem.loss.value(&y);
                }
            }
            sum
        })
        .sum()
}

/// The gradient of [`top2_expected_loss`] at the problem's logits, by central differences of
/// the enumerated loss (step 1e-5 × (1 + |θ|): error O(h²), about 1e-9 relative on the lab's
/// problems). ∇₀ and ∇₁ are left empty.
pub fn top2_gradient(problem: &Problem) -> ExactGradient {
    let mut logits = problem.logits.clone();
    let total = (0..logits.len())
        .map(|j| {
            let h = 1e-5 * (1.0 + logits[j].abs());
            let x = logits[j];
            logits[j] = x + h;
            let up = top2_expected_loss(problem, &logits);
            logits[j] = x - h;
            let down = top2_expected_loss(problem, &logits);
            logits[j] = x;
            (up - down) / (2.0 * h)
        })
        .collect();
    ExactGradient {
        loss: top2_expected_loss(problem, &problem.logits),
        total,
        nabla0: Vec::new(),
        nabla1: Vec::new(),
    }
}
