//! SparseMixer (`sparsemixer`, `-1st`, `-2rd`, `-v2`) and the estimator baselines (`st`,
//! `gumbel-st`, `reinforce`, `reinmax`) against the properties SparseMixer's analysis
//! implies (Liu et al. 2023, §2–3; docs/routers.md and docs/estimators.md), with the
//! exact-enumeration identities: for a small problem every expert
//! choice D (and forward scale c) is enumerated and the expectation formed exactly from the
//! router's own per-draw gradients, weighted by their probabilities. The reference quantities
//! ∇₀ and ∇₁ are computed here on the host from their definitions (SparseMixer Eq. 2).

mod common;

use moegrad::estimator_lab::{GradientProbe, estimate_router_gradient};
use moegrad::gradcheck::{GradcheckOptions, gradcheck};
use moegrad::moe::RouterConfig;
use moegrad::moe::routers::{
    EstimatorRouter, MaskRule, gumbel_argmax, gumbel_softmax, masked_softmax, sparsemixer_mask,
};
use moegrad::moe::{MoeConfig, MoeLayer, build_router};
use moegrad::nn::Param;
use moegrad::nn::Parameters;
use moegrad::{DType, Device, Result, Tensor};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::BTreeMap;

const N: usize = 4;
const D: usize = 3;
/// θ* = 2: experts 0, 1, 2 pass the paper's mask with r = 0.1 (margins 0.235, 0.07), expert 3
/// is masked (gap 1.0 > 0.3).
const THETA: [f64; N] = [2.0, 1.85, 1.7, 1.0];

fn host_rand(len: usize, seed: u64) -> Vec<f64> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..len).map(|_| rng.random_range(-1.0..1.0)).collect()
}

/// A scalar loss of one token's output y ∈ R^D, on the host and as tensor ops.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Loss {
    /// ⟨b, y⟩ + 0.7
    Linear,
    /// ½‖Ay − b‖²
    Quadratic,
    /// softplus(⟨a, y⟩ + 0.3): g'(0) ≠ 0, g''(0) ≠ 0, generic higher terms
    Generic,
    /// ⟨b, y⟩ + ½⟨a, y⟩² + ⅙⟨c, y⟩³
    Cubic,
}

struct Coeffs {
    a: Vec<f64>,
    b: Vec<f64>,
    c: Vec<f64>,
    m: Vec<f64>, // D×D
}

fn coeffs() -> Coeffs {
    Coeffs {
        a: host_rand(D, 1),
        b: host_rand(D, 2),
        c: host_rand(D, 3),
        m: host_rand(D * D, 4),
    }
}

fn dot(x: &[f64], y: &[f64]) -> f64 {
    x.iter().zip(y).map(|(a, b)| a * b).sum()
}

impl Loss {
    fn g(self, k: &Coeffs, y: &[f64]) -> f64 {
        match self {
            Loss::Linear => dot(&k.b, y) + 0.7,
            Loss::Quadratic => {
                let r = resid(k, y);
                0.5 * dot(&r, &r)
            }
            Loss::Generic => softplus(dot(&k.a, y) + 0.3),
            Loss::Cubic => dot(&k.b, y) + 0.5 * dot(&k.a, y).powi(2) + dot(&k.c, y).powi(3) / 6.0,
        }
    }
    fn grad(self, k: &Coeffs, y: &[f64]) -> Vec<f64> {
        match self {
            Loss::Linear => k.b.clone(),
            Loss::Quadratic => {
                let r = resid(k, y);
                (0..D)
                    .map(|j| (0..D).map(|i| k.m[i * D + j] * r[i]).sum())
                    .collect()
            }
            Loss::Generic => {
                let s = 1.0 / (1.0 + (-(dot(&k.a, y) + 0.3)).exp());
                k.a.iter().map(|v| v * s).collect()
            }
            Loss::Cubic => {
                let (ay, cy) = (dot(&k.a, y), dot(&k.c, y));
                (0..D)
                    .map(|j| k.b[j] + ay * k.a[j] + 0.5 * cy * cy * k.c[j])
                    .collect()
            }
        }
    }
    /// Σ_t g(y_t) over the rows of y `[T, D]`, as tensor ops.
    fn tensor(self, k: &Coeffs, y: &Tensor) -> Result<Tensor> {
        let col = |v: &[f64]| Tensor::from_f64(v.to_vec(), &[D, 1], Device::cpu());
        match self {
            Loss::Linear => {
                let t = y.shape()[0] as f64;
                y.matmul(&col(&k.b)?)?.sum_all()?.add_scalar(0.7 * t)
            }
            Loss::Quadratic => {
                let mt: Vec<f64> = (0..D * D).map(|i| k.m[(i % D) * D + i / D]).collect();
                let r = y
                    .matmul(&Tensor::from_f64(mt, &[D, D], Device::cpu())?)?
                    .sub(&Tensor::from_f64(k.b.clone(), &[1, D], Device::cpu())?)?;
                r.mul(&r)?.sum_all()?.mul_scalar(0.5)
            }
            Loss::Generic => y
                .matmul(&col(&k.a)?)?
                .add_scalar(0.3)?
                .softplus()?
                .sum_all(),
            Loss::Cubic => {
                let ay = y.matmul(&col(&k.a)?)?;
                let cy = y.matmul(&col(&k.c)?)?;
                y.matmul(&col(&k.b)?)?
                    .add(&ay.mul(&ay)?.mul_scalar(0.5)?)?
                    .add(&cy.mul(&cy)?.mul(&cy)?.mul_scalar(1.0 / 6.0)?)?
                    .sum_all()
            }
        }
    }
}

fn resid(k: &Coeffs, y: &[f64]) -> Vec<f64> {
    (0..D)
        .map(|i| (0..D).map(|j| k.m[i * D + j] * y[j]).sum::<f64>() - k.b[i])
        .collect()
}

fn softplus(z: f64) -> f64 {
    if z > 0.0 {
        z + (-z).exp().ln_1p()
    } else {
        z.exp().ln_1p()
    }
}

/// The paper's mask and the masked softmax, on the host.
fn host_pi(theta: &[f64], r: f64) -> Vec<f64> {
    let m = theta.iter().cloned().fold(f64::MIN, f64::max);
    let keep: Vec<bool> = theta
        .iter()
        .map(|&t| m - t <= r * (m.abs() + t.abs()))
        .collect();
    let e: Vec<f64> = theta
        .iter()
        .zip(&keep)
        .map(|(&t, &k)| if k { (t - m).exp() } else { 0.0 })
        .collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|v| v / s).collect()
}

/// Expert outputs f_i = ε·F_i, `[N][D]`.
fn experts(eps: f64) -> Vec<Vec<f64>> {
    let v = host_rand(N * D, 9);
    (0..N)
        .map(|i| v[i * D..(i + 1) * D].iter().map(|x| x * eps).collect())
        .collect()
}

fn scaled(f: &[f64], s: f64) -> Vec<f64> {
    f.iter().map(|v| v * s).collect()
}

/// `(∇₀, ∇₁)` with respect to the logits (Eq. 2 and 7): `∂π_i/∂θ_k = π_i(δ_ik − π_k)`.
fn exact_parts(loss: Loss, k: &Coeffs, pi: &[f64], f: &[Vec<f64>]) -> (Vec<f64>, Vec<f64>) {
    let g0 = loss.g(k, &[0.0; D]);
    let mut n0 = vec![0.0; N];
    let mut n1 = vec![0.0; N];
    for i in 0..N {
        let y = scaled(&f[i], pi[i]);
        let v0 = loss.g(k, &y) - g0;
        let v1 = pi[i] * dot(&loss.grad(k, &y), &f[i]);
        for kk in 0..N {
            let dpi = pi[i] * (if i == kk { 1.0 } else { 0.0 } - pi[kk]);
            n0[kk] += v0 * dpi;
            n1[kk] += v1 * dpi;
        }
    }
    (n0, n1)
}

fn cfg_with(n: usize, opts: &[(&str, &str)]) -> RouterConfig {
    let mut c = RouterConfig::new(n, n, 1);
    c.seed = 5;
    c.options = opts
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect::<BTreeMap<_, _>>();
    c
}

/// Every token has logits THETA and expert outputs f.
fn problem(t: usize, eps: f64) -> (Tensor, Tensor) {
    let f = experts(eps);
    let logits = Tensor::from_f64(THETA.repeat(t), &[t, N], Device::cpu()).unwrap();
    let flat: Vec<f64> = (0..t).flat_map(|_| f.iter().flatten().cloned()).collect();
    let out = Tensor::from_f64(flat, &[t, N, D], Device::cpu()).unwrap();
    (logits, out)
}

/// The exact expectation of router `name`'s gradient: draws T tokens at a time until every
/// (D, c) the router can produce has been seen, checks that each (D, c) always gives the same
/// gradient, and weights them by P(D, c) = P(D)·P(c | D) (`prob`, given D, c and whether D is
/// the argmax). Returns E[∂L/∂θ].
fn enumerate(
    name: &str,
    opts: &[(&str, &str)],
    loss: Loss,
    eps: f64,
    prob: &dyn Fn(usize, f64) -> f64,
) -> Vec<f64> {
    let seen = draws_by_choice(name, opts, loss, eps);
    let mut e = vec![0.0; N];
    let mut total = 0.0;
    for ((d, c), g) in &seen {
        let p = prob(*d, *c as f64 / 1e6);
        total += p;
        for j in 0..N {
            e[j] += p * g[j];
        }
    }
    assert!(
        (total - 1.0).abs() < 1e-12,
        "{name}: enumerated (D, c) cover probability {total}, not 1: {:?}",
        seen.keys().collect::<Vec<_>>()
    );
    e
}

/// The router's gradient for every (D, c) it produced (c in millionths), checking that each
/// (D, c) always gives the same gradient.
fn draws_by_choice(
    name: &str,
    opts: &[(&str, &str)],
    loss: Loss,
    eps: f64,
) -> BTreeMap<(usize, i64), Vec<f64>> {
    let k = coeffs();
    let t = 256;
    let (logits, out) = problem(t, eps);
    let probe = GradientProbe::new(name, &cfg_with(N, opts), Device::cpu()).unwrap();
    let mut seen: BTreeMap<(usize, i64), Vec<f64>> = BTreeMap::new();
    for _ in 0..4 {
        let est = probe
            .estimate(&logits, &out, &|y| loss.tensor(&k, y))
            .unwrap();
        let g = est.grad.to_vec_f64().unwrap();
        let ex = est.routing.expert.to_vec_i32().unwrap();
        let w = est.routing.weight.to_vec_f64().unwrap();
        let p = est.routing.probs.to_vec_f64().unwrap();
        for tok in 0..t {
            let d = ex[tok] as usize;
            let c = w[tok] / p[tok * N + d];
            let key = (d, (c * 1e6).round() as i64);
            let row = g[tok * N..(tok + 1) * N].to_vec();
            match seen.get(&key) {
                Some(prev) => common::assert_close(
                    &format!("{name}: draws with the same (D, c) = {key:?}"),
                    &row,
                    prev,
                    1e-12,
                    1e-9,
                ),
                None => {
                    seen.insert(key, row);
                }
            }
        }
    }
    seen
}

fn pi0() -> Vec<f64> {
    host_pi(&THETA, 0.1)
}

/// P(D, c) for each SparseMixer variant (the argmax of THETA is expert 0).
fn prob_of(variant: &str) -> impl Fn(usize, f64) -> f64 {
    let pi = pi0();
    let v = variant.to_string();
    move |d, c| {
        let pc = match v.as_str() {
            "sparsemixer-1st" => f64::from(c == 1.0),
            "sparsemixer-2rd" => f64::from(c == 0.5),
            "sparsemixer" => f64::from(c == if d == 0 { 1.0 } else { 0.5 }),
            "sparsemixer-v2" => {
                if d == 0 {
                    f64::from(c == 1.0)
                } else if c == 1.0 {
                    0.25
                } else if (c - 1.0 / 3.0).abs() < 1e-5 {
                    0.75
                } else {
                    0.0
                }
            }
            _ => 1.0,
        };
        pi[d] * pc
    }
}

fn half(v: &[f64]) -> Vec<f64> {
    v.iter().map(|x| x / 2.0).collect()
}

fn add(a: &[f64], b: &[f64]) -> Vec<f64> {
    a.iter().zip(b).map(|(x, y)| x + y).collect()
}

fn dist(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).powi(2))
        .sum::<f64>()
        .sqrt()
}

fn e_hat(variant: &str, loss: Loss, eps: f64) -> Vec<f64> {
    half(&enumerate(variant, &[], loss, eps, &prob_of(variant)))
}

#[test]
fn nabla0_plus_nabla1_is_the_gradient_of_the_enumerated_loss() {
    let k = coeffs();
    let f = experts(1.0);
    for loss in [Loss::Quadratic, Loss::Generic] {
        let (n0, n1) = exact_parts(loss, &k, &pi0(), &f);
        let lval = |th: &[f64]| {
            let pi = host_pi(th, 0.1);
            (0..N)
                .map(|i| pi[i] * loss.g(&k, &scaled(&f[i], pi[i])))
                .sum::<f64>()
        };
        let h = 1e-6;
        let fd: Vec<f64> = (0..N)
            .map(|j| {
                let (mut p, mut m) = (THETA, THETA);
                p[j] += h;
                m[j] -= h;
                (lval(&p) - lval(&m)) / (2.0 * h)
            })
            .collect();
        common::assert_close(&format!("{loss:?}"), &add(&n0, &n1), &fd, 1e-7, 1e-6);
        // the masked expert's logit gets nothing
        assert_eq!(n0[3], 0.0);
        assert_eq!(n1[3], 0.0);
    }
}

#[test]
fn linear_g_first_order_mid_point_and_hybrid_are_exact_for_nabla0() {
    let k = coeffs();
    let (n0, _) = exact_parts(Loss::Linear, &k, &pi0(), &experts(1.0));
    for v in ["sparsemixer-1st", "sparsemixer-2rd", "sparsemixer"] {
        let e = e_hat(v, Loss::Linear, 1.0);
        common::assert_close(&format!("{v}: E[∇̂] = ∇₀"), &e, &n0, 1e-12, 1e-9);
        assert_eq!(e[3], 0.0, "{v}: masked logit");
    }
}

#[test]
fn quadratic_g_mid_point_is_exact_and_first_order_gives_nabla1() {
    let k = coeffs();
    let (n0, n1) = exact_parts(Loss::Quadratic, &k, &pi0(), &experts(1.0));
    let mid = e_hat("sparsemixer-2rd", Loss::Quadratic, 1.0);
    common::assert_close("E[∇̂_{c≡½}] = ∇₀", &mid, &n0, 1e-12, 1e-9);
    // the tape's total: 2∇₀ for c ≡ ½, 2∇₁ for c ≡ 1
    let first = e_hat("sparsemixer-1st", Loss::Quadratic, 1.0);
    common::assert_close("E[∇̂_{c≡1}] = ∇₁", &first, &n1, 1e-12, 1e-9);
    // the hybrid is not exact for quadratics
    let hybrid = e_hat("sparsemixer", Loss::Quadratic, 1.0);
    assert!(
        dist(&hybrid, &n0) > 1e-4,
        "hybrid should differ from ∇₀: {}",
        dist(&hybrid, &n0)
    );
    assert!(dist(&n0, &n1) > 1e-3, "∇₀ and ∇₁ should differ here");
    // c ≡ 1 gives ∇₁ for a generic g too (it is Switch-style backprop under masked sampling)
    let (_, g1) = exact_parts(Loss::Generic, &k, &pi0(), &experts(1.0));
    let first = e_hat("sparsemixer-1st", Loss::Generic, 1.0);
    common::assert_close("generic g: E[∇̂_{c≡1}] = ∇₁", &first, &g1, 1e-12, 1e-9);
}

/// Least-squares slope of log(err) against log(ε).
fn slope(eps: &[f64], err: &[f64]) -> f64 {
    let xs: Vec<f64> = eps.iter().map(|e| e.ln()).collect();
    let ys: Vec<f64> = err.iter().map(|e| e.ln()).collect();
    let (mx, my) = (
        xs.iter().sum::<f64>() / xs.len() as f64,
        ys.iter().sum::<f64>() / ys.len() as f64,
    );
    let num: f64 = xs.iter().zip(&ys).map(|(x, y)| (x - mx) * (y - my)).sum();
    let den: f64 = xs.iter().map(|x| (x - mx).powi(2)).sum();
    num / den
}

#[test]
fn error_slopes_are_second_and_third_order() {
    let k = coeffs();
    let eps = [0.4, 0.2, 0.1, 0.05];
    let mut errs: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for &e in &eps {
        let (n0, n1) = exact_parts(Loss::Generic, &k, &pi0(), &experts(e));
        for v in ["sparsemixer-1st", "sparsemixer-2rd", "sparsemixer"] {
            let est = e_hat(v, Loss::Generic, e);
            errs.entry(v).or_default().push(dist(&est, &n0));
            // the tape's total 2∇̂ against ∇₀ + ∇₁
            let total: Vec<f64> = est.iter().map(|x| 2.0 * x).collect();
            errs.entry(match v {
                "sparsemixer-1st" => "total-1st",
                "sparsemixer-2rd" => "total-2rd",
                _ => "total-hybrid",
            })
            .or_default()
            .push(dist(&total, &add(&n0, &n1)));
        }
    }
    for (name, want) in [
        ("sparsemixer-1st", 2.0),
        ("sparsemixer-2rd", 3.0),
        ("sparsemixer", 2.0),
        ("total-1st", 2.0),
        ("total-2rd", 2.0),
        ("total-hybrid", 2.0),
    ] {
        let s = slope(&eps, &errs[name]);
        assert!(
            (s - want).abs() < 0.25,
            "{name}: log-log slope {s}, expected {want} (errors {:?})",
            errs[name]
        );
    }
}

#[test]
fn v2_third_order_rule_is_exact_for_cubic_g_off_the_argmax() {
    // For D ≠ argmax, ¼·(c = 1) + ¾·(c = ⅓) integrates a cubic exactly: the enumerated
    // expectation minus the argmax term equals ∇₀ minus its argmax term.
    let k = coeffs();
    let pi = pi0();
    let f = experts(1.0);
    let full = enumerate(
        "sparsemixer-v2",
        &[("top", "1")],
        Loss::Cubic,
        1.0,
        &prob_of("sparsemixer-v2"),
    );
    let at_argmax =
        &draws_by_choice("sparsemixer-v2", &[("top", "1")], Loss::Cubic, 1.0)[&(0, 1_000_000)];
    let e: Vec<f64> = (0..N).map(|j| full[j] - pi[0] * at_argmax[j]).collect();
    let g0 = Loss::Cubic.g(&k, &[0.0; D]);
    let mut want = vec![0.0; N];
    for i in 1..N {
        let v = Loss::Cubic.g(&k, &scaled(&f[i], pi[i])) - g0;
        for j in 0..N {
            want[j] += v * pi[i] * (f64::from(i == j) - pi[j]);
        }
    }
    common::assert_close("v2 off-argmax terms", &e, &want, 1e-12, 1e-9);
}

#[test]
fn straight_through_reinmax_and_reinforce_facts() {
    let k = coeffs();
    let pi: Vec<f64> = {
        let m = THETA.iter().cloned().fold(f64::MIN, f64::max);
        let e: Vec<f64> = THETA.iter().map(|t| (t - m).exp()).collect();
        let s: f64 = e.iter().sum();
        e.iter().map(|v| v / s).collect()
    };
    let f = experts(1.0);
    let (n0, n1) = exact_parts(Loss::Linear, &k, &pi, &f);
    let (logits, out) = problem(64, 1.0);
    // ST with a linear g: every single draw equals ∇₀.
    let st = estimate_router_gradient("st", &cfg_with(N, &[]), &logits, &out, &|y| {
        Loss::Linear.tensor(&k, y)
    })
    .unwrap();
    let g = st.grad.to_vec_f64().unwrap();
    for t in 0..64 {
        common::assert_close("st draw", &g[t * N..(t + 1) * N], &n0, 1e-12, 1e-9);
    }
    assert_eq!(st.experts_per_token, N as f64);
    // ReinMax (τ = 1) with a linear g: E = ∇₀ + ∇₁ (enumerated over D).
    let prob = |d: usize, _c: f64| pi[d];
    let rm = enumerate_dense("reinmax", Loss::Linear, 1.0, &prob);
    common::assert_close("E[reinmax] = ∇₀ + ∇₁", &rm, &add(&n0, &n1), 1e-12, 1e-9);
    // REINFORCE: exact enumeration gives ∇₀ for any g; Monte Carlo mean within 5 s.e.
    for loss in [Loss::Quadratic, Loss::Generic] {
        let (g0, _) = exact_parts(loss, &k, &pi, &f);
        let (l1, o1) = problem(1, 1.0);
        // without the running baseline, one draw is a function of D alone
        let probe = GradientProbe::new(
            "reinforce",
            &cfg_with(N, &[("baseline", "0")]),
            Device::cpu(),
        )
        .unwrap();
        let mut per_d: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
        let mut draws = Vec::new();
        for _ in 0..3000 {
            let e = probe.estimate(&l1, &o1, &|y| loss.tensor(&k, y)).unwrap();
            let d = e.routing.expert.to_vec_i32().unwrap()[0] as usize;
            let gv = e.grad.to_vec_f64().unwrap();
            assert_eq!(e.experts_per_token, 1.0);
            if let Some(prev) = per_d.get(&d) {
                common::assert_close("reinforce same D", &gv, prev, 1e-12, 1e-12);
            }
            per_d.insert(d, gv.clone());
            draws.push(gv);
        }
        assert_eq!(per_d.len(), N, "every expert drawn");
        let mut exact = vec![0.0; N];
        for (d, gv) in &per_d {
            for j in 0..N {
                exact[j] += pi[*d] * gv[j];
            }
        }
        common::assert_close("E[reinforce] = ∇₀", &exact, &g0, 1e-12, 1e-9);
        let m = draws.len() as f64;
        for j in 0..N {
            let mean = draws.iter().map(|v| v[j]).sum::<f64>() / m;
            let sd = (draws.iter().map(|v| (v[j] - mean).powi(2)).sum::<f64>() / m).sqrt();
            assert!(
                (mean - g0[j]).abs() < 5.0 * sd / m.sqrt(),
                "reinforce MC mean {mean} vs ∇₀ {} (s.e. {})",
                g0[j],
                sd / m.sqrt()
            );
        }
    }
    // ST with a generic g: a first-order estimate of ∇₀ (error slope 2).
    let eps = [0.4, 0.2, 0.1, 0.05];
    let errs: Vec<f64> = eps
        .iter()
        .map(|&e| {
            let (g0, _) = exact_parts(Loss::Generic, &k, &pi, &experts(e));
            let prob = |d: usize, _c: f64| pi[d];
            dist(&enumerate_dense_eps("st", Loss::Generic, e, &prob), &g0)
        })
        .collect();
    let s = slope(&eps, &errs);
    assert!((s - 2.0).abs() < 0.25, "st error slope {s} ({errs:?})");
}

fn enumerate_dense(name: &str, loss: Loss, eps: f64, prob: &dyn Fn(usize, f64) -> f64) -> Vec<f64> {
    enumerate_dense_eps(name, loss, eps, prob)
}

/// Like [`enumerate`] for the dense estimators (all n experts routed, D is the one with a
/// nonzero weight).
fn enumerate_dense_eps(
    name: &str,
    loss: Loss,
    eps: f64,
    prob: &dyn Fn(usize, f64) -> f64,
) -> Vec<f64> {
    let k = coeffs();
    let t = 256;
    let (logits, out) = problem(t, eps);
    let probe = GradientProbe::new(name, &cfg_with(N, &[]), Device::cpu()).unwrap();
    let est = probe
        .estimate(&logits, &out, &|y| loss.tensor(&k, y))
        .unwrap();
    let g = est.grad.to_vec_f64().unwrap();
    let w = est.routing.weight.to_vec_f64().unwrap();
    let mut seen: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
    for tok in 0..t {
        let d = (0..N).find(|&j| w[tok * N + j] != 0.0).unwrap();
        let row = g[tok * N..(tok + 1) * N].to_vec();
        if let Some(prev) = seen.get(&d) {
            common::assert_close(&format!("{name}: same D"), &row, prev, 1e-12, 1e-9);
        }
        seen.insert(d, row);
    }
    assert_eq!(seen.len(), N, "{name}: every expert drawn in {t} tokens");
    let mut e = vec![0.0; N];
    for (d, gv) in &seen {
        for j in 0..N {
            e[j] += prob(*d, 1.0) * gv[j];
        }
    }
    e
}

#[test]
fn monte_carlo_mean_of_the_hybrid_converges_to_its_enumerated_expectation() {
    let k = coeffs();
    let exact = enumerate(
        "sparsemixer",
        &[],
        Loss::Generic,
        1.0,
        &prob_of("sparsemixer"),
    );
    let (logits, out) = problem(20_000, 1.0);
    let mut cfg = cfg_with(N, &[]);
    cfg.seed = 77;
    let est = estimate_router_gradient("sparsemixer", &cfg, &logits, &out, &|y| {
        Loss::Generic.tensor(&k, y)
    })
    .unwrap();
    let g = est.grad.to_vec_f64().unwrap();
    let m = 20_000.0;
    for j in 0..N {
        let mean = (0..20_000).map(|t| g[t * N + j]).sum::<f64>() / m;
        let sd = ((0..20_000)
            .map(|t| (g[t * N + j] - mean).powi(2))
            .sum::<f64>()
            / m)
            .sqrt();
        assert!(
            (mean - exact[j]).abs() <= 5.0 * sd / m.sqrt() + 1e-15,
            "component {j}: MC mean {mean}, exact {} (s.e. {})",
            exact[j],
            sd / m.sqrt()
        );
    }
}

#[test]
fn gumbel_max_follows_pi_and_never_picks_a_masked_expert() {
    // θ = (2.0, 1.7, 1.5), r = 0.1: the paper's mask keeps {0, 1}; the code's rule keeps all.
    let t = 1_000_000;
    let theta = Tensor::from_f64([2.0, 1.7, 1.5].repeat(t), &[t, 3], Device::cpu()).unwrap();
    let keep = sparsemixer_mask(&theta, 0.1, MaskRule::Paper).unwrap();
    assert_eq!(keep.to_vec_f64().unwrap()[..3], [1.0, 1.0, 0.0]);
    let d = gumbel_argmax(&theta, Some(&keep), 11)
        .unwrap()
        .to_vec_i32()
        .unwrap();
    let counts: Vec<f64> = (0..3)
        .map(|e| d.iter().filter(|&&v| v == e).count() as f64)
        .collect();
    assert_eq!(counts[2], 0.0, "masked expert drawn");
    let pi = masked_softmax(
        &theta.slice(0, 0, 1).unwrap(),
        &keep.slice(0, 0, 1).unwrap(),
    )
    .unwrap()
    .to_vec_f64()
    .unwrap();
    assert!((pi[0] - 0.5744).abs() < 1e-4, "π₁ = {}", pi[0]);
    // chi-square with 1 degree of freedom; 25 is far beyond the 1e-6 tail (23.9)
    let chi2: f64 = (0..2)
        .map(|e| (counts[e] - t as f64 * pi[e]).powi(2) / (t as f64 * pi[e]))
        .sum();
    assert!(
        chi2 < 25.0,
        "chi-square {chi2}: counts {counts:?} vs π {pi:?}"
    );
    // SparseMixer Eq. 9: θ = (2.0, 1.62), r = 0.1 is masked by the paper's rule, kept by the code's
    let two = Tensor::from_f64(vec![2.0, 1.62], &[1, 2], Device::cpu()).unwrap();
    assert_eq!(
        sparsemixer_mask(&two, 0.1, MaskRule::Paper)
            .unwrap()
            .to_vec_f64()
            .unwrap(),
        vec![1.0, 0.0]
    );
    assert_eq!(
        sparsemixer_mask(&two, 0.1, MaskRule::Code)
            .unwrap()
            .to_vec_f64()
            .unwrap(),
        vec![1.0, 1.0]
    );
}

#[test]
fn gumbel_softmax_tends_to_the_one_hot_sample_as_tau_falls() {
    let t = 2000;
    let theta = Tensor::from_f64(THETA.repeat(t), &[t, N], Device::cpu()).unwrap();
    let d = gumbel_argmax(&theta, None, 3)
        .unwrap()
        .to_vec_i32()
        .unwrap();
    let mut last = 0.0;
    for tau in [1.0, 0.1, 0.01] {
        let s = gumbel_softmax(&theta, tau, 3)
            .unwrap()
            .to_vec_f64()
            .unwrap();
        let mean_max = (0..t).map(|r| s[r * N + d[r] as usize]).sum::<f64>() / t as f64;
        assert!(mean_max > last, "τ = {tau}: {mean_max} ≤ {last}");
        last = mean_max;
    }
    assert!(last > 0.99, "τ = 0.01: mean weight of the sample {last}");
}

#[test]
fn per_draw_rules_of_the_dense_estimators() {
    // Route with a known seed, push an upstream gradient a into the weights, compare the logits'
    // gradient with the formulas of SparseMixer §3 computed here.
    let t = 32;
    let theta_v = host_rand(t * N, 21);
    let a_v = host_rand(t * N, 22);
    for (name, tau) in [("st", 1.0), ("gumbel-st", 0.5), ("reinmax", 2.0)] {
        let mut cfg = cfg_with(N, &[]);
        if name != "st" {
            cfg.options.insert("tau".into(), tau.to_string());
        }
        let r = EstimatorRouter::new(name, &cfg, Device::cpu()).unwrap();
        let theta = Tensor::from_f64(theta_v.clone(), &[t, N], Device::cpu())
            .unwrap()
            .with_grad()
            .unwrap();
        let routing = r.route_logits_seeded(&theta, 1234).unwrap();
        let a = Tensor::from_f64(a_v.clone(), &[t * N], Device::cpu()).unwrap();
        routing.weight.backward_with(&a).unwrap();
        let got = theta.grad().unwrap().to_vec_f64().unwrap();
        let d = gumbel_argmax(&theta, None, 1234)
            .unwrap()
            .to_vec_i32()
            .unwrap();
        let s = gumbel_softmax(&theta, tau, 1234)
            .unwrap()
            .to_vec_f64()
            .unwrap();
        let w = routing.weight.to_vec_f64().unwrap();
        for row in 0..t {
            let th = &theta_v[row * N..(row + 1) * N];
            let m = th.iter().cloned().fold(f64::MIN, f64::max);
            let sm = |scale: f64| {
                let e: Vec<f64> = th.iter().map(|v| ((v - m) * scale).exp()).collect();
                let z: f64 = e.iter().sum();
                e.iter().map(|v| v / z).collect::<Vec<f64>>()
            };
            let pi = sm(1.0);
            let av = &a_v[row * N..(row + 1) * N];
            let u: Vec<f64> = (0..N).map(|i| pi[i] * av[i]).collect();
            let jac = |q: &[f64], v: &[f64]| {
                let qv = dot(q, v);
                (0..N)
                    .map(|i| q[i] * v[i] - q[i] * qv)
                    .collect::<Vec<f64>>()
            };
            let dd = d[row] as usize;
            let e_d: Vec<f64> = (0..N).map(|i| f64::from(i == dd)).collect();
            // forward: π_D at D, 0 elsewhere
            for i in 0..N {
                let want = if i == dd { pi[i] } else { 0.0 };
                assert!(
                    (w[row * N + i] - want).abs() < 1e-14,
                    "{name}: forward weight"
                );
            }
            let want = match name {
                "st" => jac(&pi, &u),
                "gumbel-st" => jac(&s[row * N..(row + 1) * N], &u)
                    .iter()
                    .map(|v| v / tau)
                    .collect(),
                _ => {
                    let pt = sm(1.0 / tau);
                    let tilde: Vec<f64> = (0..N).map(|i| 0.5 * (pt[i] + e_d[i])).collect();
                    let u2: Vec<f64> = u.iter().map(|v| 2.0 * v).collect();
                    let v: Vec<f64> = (0..N).map(|i| e_d[i] * av[i] - 0.5 * u[i]).collect();
                    add(&jac(&tilde, &u2), &jac(&pi, &v))
                }
            };
            common::assert_close(
                &format!("{name} row {row}"),
                &got[row * N..(row + 1) * N],
                &want,
                1e-10,
                1e-9,
            );
        }
    }
}

fn layer(router: &str, n: usize, seed: u64, opts: &[(&str, &str)]) -> MoeLayer {
    let mut cfg = MoeConfig::new(5, 4, n, 1);
    cfg.router = router.into();
    cfg.seed = seed;
    cfg.router_options = opts
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    let l = MoeLayer::new(&cfg, Device::cpu()).unwrap();
    for (_, p) in params(&l) {
        p.set(p.get().to_dtype(DType::F64).unwrap().detach())
            .unwrap();
    }
    l
}

fn params(l: &MoeLayer) -> Vec<(String, Param)> {
    let mut v = Vec::new();
    l.visit_params("", &mut |n, p| v.push((n, p.clone())));
    v
}

fn randn(shape: &[usize], seed: u64) -> Tensor {
    let n = shape.iter().product();
    Tensor::from_f64(host_rand(n, seed), shape, Device::cpu()).unwrap()
}

fn loss_of(y: &Tensor) -> Tensor {
    let c = randn(y.shape(), 99);
    y.mul(&c)
        .unwrap()
        .sum_all()
        .unwrap()
        .add(
            &y.mul(y)
                .unwrap()
                .sum_all()
                .unwrap()
                .mul_scalar(0.1)
                .unwrap(),
        )
        .unwrap()
}

const SPARSE: [&str; 5] = [
    "sparsemixer",
    "sparsemixer-1st",
    "sparsemixer-2rd",
    "sparsemixer-v2",
    "reinforce",
];
const DENSE: [&str; 3] = ["st", "gumbel-st", "reinmax"];

#[test]
fn experts_evaluated_per_token_and_sparse_evaluation_invariance_in_training() {
    for name in SPARSE.iter().chain(&DENSE) {
        let dense = DENSE.contains(name);
        let run = |nan: &[usize]| {
            // a fresh layer each run: the same noise draws
            let l = layer(name, 6, 31, &[]);
            for (pname, p) in params(&l) {
                if pname.starts_with("experts.") && !nan.is_empty() {
                    let mut v = p.get().to_vec_f64().unwrap();
                    let per = v.len() / 6;
                    for &e in nan {
                        v[e * per..(e + 1) * per]
                            .iter_mut()
                            .for_each(|x| *x = f64::NAN);
                    }
                    p.set(Tensor::from_f64(v, p.get().shape(), Device::cpu()).unwrap())
                        .unwrap();
                }
            }
            assert_eq!(l.router().runs_all_experts(), dense, "{name}");
            let x = randn(&[3, 5], 6).with_grad().unwrap();
            let out = l.forward(&x).unwrap();
            let mut objective = loss_of(&out.y);
            // reinforce's gradient comes from its score term, with a per-token reward
            for term in &out.score_terms {
                let reward = out.y.mul(&out.y).unwrap().sum(&[-1], false).unwrap();
                objective = objective.add(&term.surrogate(&reward).unwrap()).unwrap();
            }
            objective.backward().unwrap();
            let s = out.stats.read().unwrap();
            let grads: Vec<Vec<f64>> = params(&l)
                .iter()
                .filter(|(n, _)| !n.starts_with("experts."))
                .map(|(_, p)| p.grad().unwrap().to_vec_f64().unwrap())
                .collect();
            (
                out.y.to_vec_f64().unwrap(),
                x.grad().unwrap().to_vec_f64().unwrap(),
                grads,
                s,
            )
        };
        let (y0, gx0, g0, s) = run(&[]);
        let want = if dense { 6.0 } else { 1.0 };
        assert_eq!(s.experts_per_token, want, "{name}: experts run per token");
        assert_eq!(
            s.router_metrics["experts_evaluated_per_token"], want,
            "{name}: metric"
        );
        if dense {
            continue;
        }
        let used: Vec<usize> = s
            .expert_load
            .iter()
            .enumerate()
            .filter(|(_, v)| **v > 0.0)
            .map(|(e, _)| e)
            .collect();
        let idle: Vec<usize> = (0..6).filter(|e| !used.contains(e)).collect();
        assert!(!idle.is_empty(), "{name}: 3 tokens leave an expert idle");
        let (y1, gx1, g1, _) = run(&idle);
        assert_eq!(y0, y1, "{name}: output changed with NaN in idle experts");
        assert_eq!(gx0, gx1, "{name}: input gradient changed");
        assert_eq!(g0, g1, "{name}: router gradient changed");
    }
}

#[test]
fn first_order_router_gradient_is_twice_plain_autograd_and_matches_inference_at_the_argmax() {
    // θ = (2, 1.7, 1.5): only experts 0 and 1 may be drawn. With c ≡ 1 and ω = 1 the router
    // gradient is exactly 2× plain autograd of y = π_D f_D with the same masked π and D.
    let k = coeffs();
    let t = 64;
    let theta = Tensor::from_f64([2.0, 1.7, 1.5].repeat(t), &[t, 3], Device::cpu()).unwrap();
    let f = Tensor::from_f64(host_rand(t * 3 * D, 8), &[t, 3, D], Device::cpu()).unwrap();
    let est = estimate_router_gradient("sparsemixer-1st", &cfg_with(3, &[]), &theta, &f, &|y| {
        Loss::Generic.tensor(&k, y)
    })
    .unwrap();
    let d = est.routing.expert.reshape(&[t, 1]).unwrap();
    let leaf = theta.detach().with_grad().unwrap();
    let keep = sparsemixer_mask(&theta, 0.1, MaskRule::Paper).unwrap();
    let w = masked_softmax(&leaf, &keep).unwrap().gather(1, &d).unwrap();
    let rows: Vec<i32> = d
        .to_vec_i32()
        .unwrap()
        .iter()
        .enumerate()
        .map(|(tk, e)| (tk * 3) as i32 + e)
        .collect();
    let fd = f
        .reshape(&[t * 3, D])
        .unwrap()
        .index_select(0, &Tensor::from_i32(rows, &[t], Device::cpu()).unwrap())
        .unwrap();
    let y = fd.mul(&w).unwrap();
    Loss::Generic.tensor(&k, &y).unwrap().backward().unwrap();
    let plain: Vec<f64> = leaf
        .grad()
        .unwrap()
        .to_vec_f64()
        .unwrap()
        .iter()
        .map(|v| 2.0 * v)
        .collect();
    common::assert_close(
        "2× autograd",
        &est.grad.to_vec_f64().unwrap(),
        &plain,
        1e-12,
        1e-12,
    );
    let g = est.grad.to_vec_f64().unwrap();
    assert!(
        (0..t).all(|r| g[r * 3 + 2] == 0.0),
        "masked logit got gradient"
    );
    // Training forward at D = argmax equals the inference forward (hybrid: c = 1 there).
    let l = layer("sparsemixer", 3, 3, &[]);
    for (name, p) in params(&l) {
        if name == "router.weight" {
            p.set(p.get().zeros_like().unwrap()).unwrap();
        } else if name == "router.bias" {
            p.set(Tensor::from_f64(vec![2.0, 1.7, 1.5], &[3], Device::cpu()).unwrap())
                .unwrap();
        }
    }
    let x = randn(&[40, 5], 2);
    let tr = l.router().route(&x).unwrap();
    l.set_training(false);
    let ev = l.router().route(&x).unwrap();
    let ev2 = l.router().route(&x).unwrap();
    assert_eq!(
        ev.expert.to_vec_i32().unwrap(),
        vec![0; 40],
        "inference is the argmax"
    );
    assert_eq!(
        ev.weight.to_vec_f64().unwrap(),
        ev2.weight.to_vec_f64().unwrap()
    );
    let (te, tw) = (
        tr.expert.to_vec_i32().unwrap(),
        tr.weight.to_vec_f64().unwrap(),
    );
    let ew = ev.weight.to_vec_f64().unwrap();
    assert!(
        te.contains(&0) && te.contains(&1),
        "both unmasked experts drawn: {te:?}"
    );
    for i in 0..40 {
        if te[i] == 0 {
            assert_eq!(tw[i], ew[i], "token {i}: D = argmax, c = 1");
        } else {
            assert!(
                (tw[i] - 0.5 * (1.0 - ew[i])).abs() < 1e-12,
                "token {i}: mid-point ½π_D"
            );
        }
    }
}

#[test]
fn omega_is_a_trainable_output_scale_and_v2_has_none() {
    let l = layer("sparsemixer", 4, 7, &[("omega_init", "2.0")]);
    let names: Vec<String> = params(&l).into_iter().map(|(n, _)| n).collect();
    assert!(names.contains(&"router.omega".to_string()), "{names:?}");
    let v2 = layer("sparsemixer-v2", 4, 7, &[]);
    assert!(v2.omega().is_none());
    let l1 = layer("sparsemixer", 4, 7, &[]);
    l.set_training(false);
    l1.set_training(false);
    let x = randn(&[5, 5], 3);
    let y2 = l.forward(&x).unwrap().y.to_vec_f64().unwrap();
    let y1 = l1.forward(&x).unwrap().y.to_vec_f64().unwrap();
    let doubled: Vec<f64> = y1.iter().map(|v| 2.0 * v).collect();
    common::assert_close("ω = 2", &y2, &doubled, 1e-12, 1e-12);
}

#[test]
fn v2_top2_picks_two_distinct_experts() {
    let l = layer("sparsemixer-v2", 5, 9, &[("top", "2"), ("jitter", "0.5")]);
    let x = randn(&[50, 5], 4);
    let r = l.router().route(&x).unwrap();
    let ex = r.expert.to_vec_i32().unwrap();
    assert_eq!(ex.len(), 100);
    for t in 0..50 {
        assert_ne!(ex[2 * t], ex[2 * t + 1], "token {t}");
    }
    let out = l.forward(&x).unwrap();
    loss_of(&out.y).backward().unwrap();
}

#[test]
fn gradcheck_of_the_deterministic_parts() {
    let opts = GradcheckOptions::default();
    // the masked softmax, mask fixed
    let theta = randn(&[3, 5], 40).mul_scalar(2.0).unwrap();
    let keep = sparsemixer_mask(&theta, 0.3, MaskRule::Paper).unwrap();
    gradcheck(
        |t| masked_softmax(&t[0], &keep)?.mul(&randn(&[3, 5], 41)),
        &[theta],
        &opts,
    )
    .unwrap();
    // The whole layer in evaluation mode (argmax routing, ω included), at gate logits where the
    // r = 0.1 mask keeps several experts: bias THETA (experts 0, 1, 2 kept, 3 masked) and a gate
    // weight scaled down so that x·W moves no logit by more than 0.045 (within every margin).
    // With small logits only the argmax survives the mask, π_a = 1 and the router gradient is
    // exactly zero on both sides, so the check below asserts it is not.
    for name in SPARSE.iter().chain(&DENSE) {
        let opts_for = |n: &str| -> Vec<(&'static str, &'static str)> {
            if n.starts_with("sparsemixer") && n != "sparsemixer-v2" {
                vec![("omega_init", "1.3")]
            } else {
                vec![]
            }
        };
        let proto = layer(name, 4, 21, &opts_for(name));
        let mut inputs = vec![randn(&[6, 5], 8)];
        let names: Vec<String> = params(&proto).into_iter().map(|(n, _)| n).collect();
        for (pname, p) in params(&proto) {
            inputs.push(if pname == "router.bias" {
                Tensor::from_f64(THETA.to_vec(), &[N], Device::cpu()).unwrap()
            } else if pname == "router.weight" {
                p.get().mul_scalar(0.01).unwrap()
            } else if pname.ends_with("b1") || pname.ends_with("b2") || pname.ends_with("bias") {
                randn(p.get().shape(), 30).mul_scalar(0.3).unwrap()
            } else {
                p.get().detach()
            });
        }
        let build = |t: &[Tensor]| -> Result<MoeLayer> {
            let l = layer(name, 4, 21, &opts_for(name));
            l.set_training(false);
            for (p, v) in params(&l).into_iter().zip(&t[1..]) {
                p.1.set(v.clone())?;
            }
            Ok(l)
        };
        let f = |t: &[Tensor]| -> Result<Tensor> { Ok(loss_of(&build(t)?.forward(&t[0])?.y)) };
        if let Err(e) = gradcheck(f, &inputs, &opts) {
            panic!("{name} (evaluation): {e}");
        }
        // What the check compared: a routing where the mask kept several experts, and a router
        // gradient that is not zero.
        let leaves: Vec<Tensor> = inputs
            .iter()
            .map(|t| t.detach().with_grad().unwrap())
            .collect();
        let l = build(&leaves).unwrap();
        if name.starts_with("sparsemixer") {
            let probs = l
                .router()
                .route(&leaves[0])
                .unwrap()
                .probs
                .to_vec_f64()
                .unwrap();
            for (tok, row) in probs.chunks(N).enumerate() {
                let kept = row.iter().filter(|&&p| p > 0.0).count();
                assert_eq!(kept, 3, "{name}: token {tok} keeps {kept} experts: {row:?}");
            }
        }
        loss_of(&l.forward(&leaves[0]).unwrap().y)
            .backward()
            .unwrap();
        for (pname, leaf) in names.iter().zip(&leaves[1..]) {
            if pname == "router.weight" || pname == "router.bias" {
                let g = leaf.grad().unwrap().to_vec_f64().unwrap();
                let largest = g.iter().fold(0.0f64, |m, v| m.max(v.abs()));
                assert!(largest > 1e-3, "{name}: {pname} gradient is ~0: {g:?}");
            }
        }
    }
}

fn route_direct(
    name: &str,
    cfg: &RouterConfig,
    dev: Device,
    logits: &Tensor,
    training: bool,
) -> moegrad::moe::Routing {
    use moegrad::moe::routers::{SparseMixerRouter, SparseMixerVariant};
    let variant = match name {
        "sparsemixer" => Some(SparseMixerVariant::Hybrid),
        "sparsemixer-1st" => Some(SparseMixerVariant::FirstOrder),
        "sparsemixer-2rd" => Some(SparseMixerVariant::SecondOrder),
        "sparsemixer-v2" => Some(SparseMixerVariant::V2),
        _ => None,
    };
    match variant {
        Some(v) => {
            let r = SparseMixerRouter::new(cfg, v, dev).unwrap();
            r.set_training(training);
            r.route_logits_seeded(logits, 17).unwrap()
        }
        None => {
            let r = EstimatorRouter::new(name, cfg, dev).unwrap();
            r.set_training(training);
            r.route_logits_seeded(logits, 17).unwrap()
        }
    }
}

#[test]
fn gpu_parity_of_the_routers() {
    let devs = common::devices("gpu_parity_of_the_routers");
    if devs.len() < 2 {
        return;
    }
    let gpu = devs[1];
    let theta_v = host_rand(40 * 6, 50);
    for name in SPARSE.iter().chain(&DENSE) {
        for training in [false, true] {
            let cfg = cfg_with(6, &[]);
            let run = |dev: Device| -> (Vec<i32>, Vec<f64>, Vec<f64>) {
                let x = Tensor::from_f64(theta_v.clone(), &[40, 6], Device::cpu())
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap()
                    .to_device(dev)
                    .unwrap()
                    .with_grad()
                    .unwrap();
                // the routers' own logic on given logits (the linear gate is the layer's matmul)
                let routing = route_direct(name, &cfg, dev, &x, training);
                let up = Tensor::from_f64(
                    host_rand(routing.len(), 51),
                    &[routing.len()],
                    Device::cpu(),
                )
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap()
                .to_device(dev)
                .unwrap();
                match &routing.score {
                    // reinforce in training: its gradient is the score term's, `up` the rewards
                    Some(score) => score.surrogate(&up).unwrap().backward().unwrap(),
                    None => routing.weight.backward_with(&up).unwrap(),
                }
                (
                    routing.expert.to_vec_i32().unwrap(),
                    routing.weight.to_vec_f64().unwrap(),
                    x.grad().unwrap().to_vec_f64().unwrap(),
                )
            };
            let (ce, cw, cg) = run(Device::cpu());
            let (ge, gw, gg) = run(gpu);
            assert_eq!(ce, ge, "{name} (training {training}): same experts");
            common::assert_close(&format!("{name} weights"), &gw, &cw, 1e-5, 1e-4);
            common::assert_close(&format!("{name} gradient"), &gg, &cg, 1e-5, 1e-4);
        }
    }
}

/// Router options as `(key, value)` pairs.
type Opts<'a> = &'a [(&'a str, &'a str)];

#[test]
fn bad_options_are_errors_naming_the_setting() {
    let cases: [(&str, Opts, &str); 10] = [
        ("sparsemixer", &[("nope", "1")], "nope"),
        ("sparsemixer", &[("midpoint_prob", "1.5")], "midpoint_prob"),
        ("sparsemixer", &[("mask_rule", "fancy")], "mask_rule"),
        ("sparsemixer-1st", &[("jitter", "1.5")], "jitter"),
        (
            "sparsemixer-2rd",
            &[("midpoint_prob", "0.5")],
            "midpoint_prob",
        ),
        ("sparsemixer-v2", &[("top", "3")], "top"),
        ("sparsemixer", &[("balance_probs", "x")], "balance_probs"),
        ("gumbel-st", &[("tau", "0")], "tau"),
        ("reinmax", &[("tau", "0.5")], "tau"),
        ("st", &[("tau", "1")], "tau"),
    ];
    for (name, opts, word) in cases {
        let e = build_router(name, &cfg_with(4, opts), Device::cpu())
            .err()
            .unwrap_or_else(|| panic!("{name} {opts:?} should fail"))
            .to_string();
        assert!(e.contains(word), "{name} {opts:?}: {e}");
    }
    // the probe checks shapes
    let probe = GradientProbe::new("sparsemixer", &cfg_with(4, &[]), Device::cpu()).unwrap();
    let e = probe
        .estimate(
            &Tensor::zeros(&[2, 4], DType::F64, Device::cpu()).unwrap(),
            &Tensor::zeros(&[2, 3, 2], DType::F64, Device::cpu()).unwrap(),
            &|y| y.sum_all(),
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("[2, 3, 2]"), "{e}");
}

#[test]
fn the_probe_gives_switch_its_nabla1_only_gradient() {
    // Without jitter Switch picks the argmax and its router gradient is plain backprop of
    // g(p_a f_a) with the unmasked softmax p.
    let k = coeffs();
    let (logits, out) = problem(3, 1.0);
    let mut cfg = cfg_with(N, &[]);
    cfg.jitter = 0.0;
    let est = estimate_router_gradient("switch", &cfg, &logits, &out, &|y| {
        Loss::Generic.tensor(&k, y)
    })
    .unwrap();
    assert_eq!(est.experts_per_token, 1.0);
    let leaf = logits.detach().with_grad().unwrap();
    let a = Tensor::from_i32(vec![0; 3], &[3, 1], Device::cpu()).unwrap();
    let w = leaf.softmax(-1).unwrap().gather(1, &a).unwrap();
    let f0 = out.slice(1, 0, 1).unwrap().reshape(&[3, D]).unwrap();
    Loss::Generic
        .tensor(&k, &f0.mul(&w).unwrap())
        .unwrap()
        .backward()
        .unwrap();
    common::assert_close(
        "switch through the probe",
        &est.grad.to_vec_f64().unwrap(),
        &leaf.grad().unwrap().to_vec_f64().unwrap(),
        1e-12,
        1e-12,
    );
}

#[test]
fn balance_probs_option_selects_the_masked_or_the_plain_softmax() {
    let (logits, out) = problem(2, 1.0);
    let probs = |opt: &str| {
        estimate_router_gradient(
            "sparsemixer",
            &cfg_with(N, &[("balance_probs", opt)]),
            &logits,
            &out,
            &|y| y.sum_all(),
        )
        .unwrap()
        .routing
        .probs
        .to_vec_f64()
        .unwrap()
    };
    common::assert_close("masked", &probs("masked")[..N], &pi0(), 1e-12, 1e-12);
    let plain = probs("softmax");
    assert!(plain[3] > 0.0, "the plain softmax keeps the masked expert");
    assert!((plain[..N].iter().sum::<f64>() - 1.0).abs() < 1e-12);
}
