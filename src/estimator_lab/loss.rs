//! The per-token scalar loss `g: R^d → R` of the estimator lab, twice: on the host in f64
//! (value and gradient, for the exact enumeration in [`super::exact`]) and as tensor ops (for
//! [`GradientProbe`](super::GradientProbe), which back-propagates through it).
//!
//! Three shapes, so that the estimators' known strengths and weaknesses show:
//!
//! * `linear`: `g(y) = ⟨b, y⟩ + c₀`. Every first-order rule is exact for ∇₀ here, and ∇₀ = ∇₁.
//! * `quadratic`: `g(y) = ½‖Ay − b‖²`. The mid-point rule (SparseMixer-2rd) is exact for ∇₀.
//! * `logistic`: `g(y) = softplus(⟨a, y⟩ + c₀)`, generic: `g′(0) ≠ 0`, `g″(0) ≠ 0` and every
//!   higher term present, so each rule shows its true order of error.
//!
//! The coefficients (A, a, b) are drawn from the lab's seed, uniform in (−1, 1); `c₀ = 0.3`.

use crate::{Device, Error, Result, Tensor};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::fmt;
use std::str::FromStr;

/// The constant `c₀` of the linear and logistic losses (nonzero, so `g(0) ≠ 0` and the
/// logistic loss has `g″(0) ≠ 0` along a).
const OFFSET: f64 = 0.3;

/// Which loss the lab uses (command-line `--loss`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LossKind {
    /// `⟨b, y⟩ + c₀`
    Linear,
    /// `½‖Ay − b‖²`
    Quadratic,
    /// `softplus(⟨a, y⟩ + c₀)`
    Logistic,
}

/// The accepted names of [`LossKind`], as the command line spells them.
pub const LOSS_NAMES: &[&str] = &["linear", "quadratic", "logistic"];

impl LossKind {
    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            LossKind::Linear => "linear",
            LossKind::Quadratic => "quadratic",
            LossKind::Logistic => "logistic",
        }
    }
}

impl fmt::Display for LossKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for LossKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<LossKind> {
        match s {
            "linear" => Ok(LossKind::Linear),
            "quadratic" => Ok(LossKind::Quadratic),
            "logistic" => Ok(LossKind::Logistic),
            other => Err(Error::Invalid(format!(
                "--loss {other:?}: expected one of {}",
                LOSS_NAMES.join(", ")
            ))),
        }
    }
}

/// A loss with its coefficients, for outputs of width `dim`.
#[derive(Clone, Debug)]
pub struct Loss {
    kind: LossKind,
    dim: usize,
    /// `[d, d]` row-major (quadratic)
    a_mat: Vec<f64>,
    /// `[d]`: the direction of the logistic loss
    a: Vec<f64>,
    /// `[d]`: the slope of the linear loss, the target of the quadratic
    b: Vec<f64>,
}

impl Loss {
    /// The loss `kind` for width `dim`, its coefficients drawn from `seed`.
    pub fn new(kind: LossKind, dim: usize, seed: u64) -> Loss {
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x6c6f_7373);
        let mut draw =
            |len: usize| -> Vec<f64> { (0..len).map(|_| rng.random_range(-1.0..1.0)).collect() };
        let a_mat = draw(dim * dim);
        let a = draw(dim);
        let b = draw(dim);
        Loss {
            kind,
            dim,
            a_mat,
            a,
            b,
        }
    }

    /// Which loss this is.
    pub fn kind(&self) -> LossKind {
        self.kind
    }

    /// `g(y)` for one token's output `y ∈ R^d`.
    pub fn value(&self, y: &[f64]) -> f64 {
        match self.kind {
            LossKind::Linear => dot(&self.b, y) + OFFSET,
            LossKind::Quadratic => {
                let r = self.residual(y);
                0.5 * dot(&r, &r)
            }
            LossKind::Logistic => softplus(dot(&self.a, y) + OFFSET),
        }
    }

    /// `∇g(y) ∈ R^d`.
    pub fn gradient(&self, y: &[f64]) -> Vec<f64> {
        let d = self.dim;
        match self.kind {
            LossKind::Linear => self.b.clone(),
            LossKind::Quadratic => {
                let r = self.residual(y);
                (0..d)
                    .map(|j| (0..d).map(|i| self.a_mat[i * d + j] * r[i]).sum())
                    .collect()
            }
            LossKind::Logistic => {
                let s = sigmoid(dot(&self.a, y) + OFFSET);
                self.a.iter().map(|v| v * s).collect()
            }
        }
    }

    /// `Σ_t g(y_t)` over the rows of `y` `[T, d]`, as tracked tensor ops in y's dtype.
    ///
    /// # Errors
    /// `y` not of shape `[T, d]`, or an error of the ops.
    pub fn tensor(&self, y: &Tensor) -> Result<Tensor> {
        self.per_token(y)?.sum_all()
    }

    /// `g(y_t)` for every row of `y` `[T, d]`: `[T]`, tracked (what a score-function router
    /// takes as each token's reward; [`Loss::tensor`] is its sum).
    ///
    /// # Errors
    /// `y` not of shape `[T, d]`, or an error of the ops.
    pub fn per_token(&self, y: &Tensor) -> Result<Tensor> {
        let d = self.dim;
        let s = y.shape();
        if s.len() != 2 || s[1] != d {
            return Err(Error::Shape(format!(
                "estimator lab loss: expects outputs [T, {d}], got {s:?}"
            )));
        }
        let (dev, dt) = (y.device(), y.dtype());
        let t = s[0];
        let host = |v: Vec<f64>, shape: &[usize]| -> Result<Tensor> {
            Tensor::from_f64(v, shape, Device::cpu())?
                .to_dtype(dt)?
                .to_device(dev)
        };
        match self.kind {
            LossKind::Linear => y
                .matmul(&host(self.b.clone(), &[d, 1])?)?
                .reshape(&[t])?
                .add_scalar(OFFSET),
            LossKind::Quadratic => {
                // r = y·Aᵀ − b, row by row
                let at: Vec<f64> = (0..d * d)
                    .map(|i| self.a_mat[(i % d) * d + i / d])
                    .collect();
                let r = y
                    .matmul(&host(at, &[d, d])?)?
                    .sub(&host(self.b.clone(), &[1, d])?)?;
                r.mul(&r)?.sum(&[-1], false)?.mul_scalar(0.5)
            }
            LossKind::Logistic => y
                .matmul(&host(self.a.clone(), &[d, 1])?)?
                .add_scalar(OFFSET)?
                .softplus()?
                .reshape(&[t]),
        }
    }

    fn residual(&self, y: &[f64]) -> Vec<f64> {
        let d = self.dim;
        (0..d)
            .map(|i| (0..d).map(|j| self.a_mat[i * d + j] * y[j]).sum::<f64>() - self.b[i])
            .collect()
    }
}

/// `⟨x, y⟩`.
pub(crate) fn dot(x: &[f64], y: &[f64]) -> f64 {
    x.iter().zip(y).map(|(a, b)| a * b).sum()
}

fn sigmoid(z: f64) -> f64 {
    1.0 / (1.0 + (-z).exp())
}

fn softplus(z: f64) -> f64 {
    if z > 0.0 {
        z + (-z).exp().ln_1p()
    } else {
        z.exp().ln_1p()
    }
}
