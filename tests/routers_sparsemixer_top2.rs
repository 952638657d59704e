//! SparseMixer-v2 with `top=2` by exact enumeration, as `tests/routers_sparsemixer.rs` does for
//! top-1 (docs/routers.md, "SparseMixer-v2"; `src/moe/routers/sparsemixer.rs`).
//!
//! Top-2 samples the first expert `D₁ ~ π` (the masked softmax), then masks `D₁` out,
//! recomputes the mask relative to the largest remaining logit and samples `D₂ ~ π²`, the
//! softmax over what is left; each slot has its own forward scale c (1 at that slot's argmax,
//! else ⅓ with probability ¾ and 1 otherwise) and the weights are `c₁·π_{D₁}`, `c₂·π²_{D₂}`.
//! The backward of each slot is `s·π_D(e_D − π)` as if c = 1, with `s = ⟨∂L/∂y, f_D⟩` and that
//! slot's own softmax. Everything here is computed on the host from those definitions:
//!
//! * every draw's weights, output and router gradient equal the host formulas for its
//!   (D₁, c₁, D₂, c₂) — this pins down the second slot's softmax (π², not π or the unmasked
//!   softmax);
//! * the enumerated law `P(D₁, c₁, D₂, c₂) = π_{D₁}·P(c₁|D₁)·π²_{D₂}·P(c₂|D₂)` sums to 1, every
//!   (D₁, c₁, D₂, c₂) drawn has positive probability under it and every one with positive
//!   probability is drawn, and the drawn frequencies lie within 5 standard errors of it (fixed
//!   seed, so the test is deterministic).
//!
//! Two kinds of token with distinct logits make the first and second masks differ, so a second
//! choice sampled with the first mask, or from the unmasked softmax, is caught.

use moegrad::estimator_lab::GradientProbe;
use moegrad::moe::RouterConfig;
use moegrad::{Device, Result, Tensor};
use std::collections::BTreeMap;

const N: usize = 4;
const D: usize = 3;
/// the mask's jitter r (the default)
const R: f64 = 0.1;
/// Token kinds. A: the mask keeps {0, 1}; after D₁ = 0 the recomputed mask keeps {1, 2} (the
/// first mask minus D₁ would keep {1} only). B: the mask keeps {1, 2, 3}, and each D₁ leaves two.
const THETA: [[f64; N]; 2] = [[3.0, 2.5, 2.2, 1.9], [0.4, 1.2, 1.0, 1.1]];
/// tokens per kind in one draw
const PER_KIND: usize = 512;
const DRAWS: usize = 4;
/// the loss `Σ_t ⟨A, y_t⟩ + ½‖y_t‖²`, so `∂L/∂y_t = A + y_t`
const A: [f64; D] = [0.3, -0.5, 0.8];
/// expert outputs `f_i`, the same for every token
const F: [[f64; D]; N] = [
    [0.9, -0.2, 0.4],
    [-0.6, 0.7, 0.1],
    [0.2, 0.5, -0.8],
    [-0.3, -0.9, 0.6],
];

/// The paper's mask over the entries `allowed`, relative to their largest logit.
fn mask(theta: &[f64; N], allowed: &[bool; N]) -> [bool; N] {
    let m = (0..N)
        .filter(|&j| allowed[j])
        .map(|j| theta[j])
        .fold(f64::MIN, f64::max);
    std::array::from_fn(|j| allowed[j] && m - theta[j] <= R * (m.abs() + theta[j].abs()))
}

/// The softmax of `theta` over `keep`, 0 elsewhere.
fn softmax_over(theta: &[f64; N], keep: &[bool; N]) -> [f64; N] {
    let m = (0..N)
        .filter(|&j| keep[j])
        .map(|j| theta[j])
        .fold(f64::MIN, f64::max);
    let e: [f64; N] = std::array::from_fn(|j| if keep[j] { (theta[j] - m).exp() } else { 0.0 });
    let s: f64 = e.iter().sum();
    e.map(|v| v / s)
}

/// The argmax of `theta` over `allowed` (the lowest index on a tie).
fn argmax_over(theta: &[f64; N], allowed: &[bool; N]) -> usize {
    (0..N)
        .filter(|&j| allowed[j])
        .fold(None, |best: Option<usize>, j| match best {
            Some(b) if theta[b] >= theta[j] => Some(b),
            _ => Some(j),
        })
        .unwrap()
}

/// `(π, π²)` of a token of logits `theta` whose first choice is `d1`, and the two argmaxes.
fn slot_softmaxes(theta: &[f64; N], d1: usize) -> ([f64; N], [f64; N], usize, usize) {
    let all = [true; N];
    let pi = softmax_over(theta, &mask(theta, &all));
    let mut rest = all;
    rest[d1] = false;
    let pi2 = softmax_over(theta, &mask(theta, &rest));
    (pi, pi2, argmax_over(theta, &all), argmax_over(theta, &rest))
}

/// P(c | D) for v2: c = 1 at the argmax, else ⅓ with probability ¾ and 1 with ¼.
fn p_scale(d: usize, argmax: usize, c: f64) -> f64 {
    let third = (c - 1.0 / 3.0).abs() < 1e-9;
    match (d == argmax, c == 1.0, third) {
        (true, true, _) => 1.0,
        (false, true, _) => 0.25,
        (false, false, true) => 0.75,
        _ => 0.0,
    }
}

/// A draw's key: `(D₁, c₁ in thousandths, D₂, c₂ in thousandths)`.
type Key = (usize, i64, usize, i64);

fn milli(c: f64) -> i64 {
    (c * 1000.0).round() as i64
}

/// The enumerated law of (D₁, c₁, D₂, c₂) for logits `theta`: every key with positive probability.
fn law(theta: &[f64; N]) -> BTreeMap<Key, f64> {
    let mut out = BTreeMap::new();
    for d1 in 0..N {
        let (pi, pi2, a, a2) = slot_softmaxes(theta, d1);
        for (d2, &p2) in pi2.iter().enumerate() {
            for c1 in [1.0, 1.0 / 3.0] {
                for c2 in [1.0, 1.0 / 3.0] {
                    let p = pi[d1] * p_scale(d1, a, c1) * p2 * p_scale(d2, a2, c2);
                    if p > 0.0 {
                        out.insert((d1, milli(c1), d2, milli(c2)), p);
                    }
                }
            }
        }
    }
    out
}

/// The host's weights, output and router gradient of one token of kind `theta` with draw
/// `(d1, c1, d2, c2)`.
fn host_draw(
    theta: &[f64; N],
    d1: usize,
    c1: f64,
    d2: usize,
    c2: f64,
) -> ([f64; 2], Vec<f64>, Vec<f64>) {
    let (pi, pi2, _, _) = slot_softmaxes(theta, d1);
    let (w1, w2) = (c1 * pi[d1], c2 * pi2[d2]);
    let y: Vec<f64> = (0..D).map(|j| w1 * F[d1][j] + w2 * F[d2][j]).collect();
    let gy: Vec<f64> = (0..D).map(|j| A[j] + y[j]).collect();
    let s = |d: usize| (0..D).map(|j| gy[j] * F[d][j]).sum::<f64>();
    let (s1, s2) = (s(d1), s(d2));
    let grad = (0..N)
        .map(|k| {
            s1 * pi[d1] * (f64::from(k == d1) - pi[k])
                + s2 * pi2[d2] * (f64::from(k == d2) - pi2[k])
        })
        .collect();
    ([w1, w2], y, grad)
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 + 1e-10 * b.abs()
}

#[test]
fn v2_top2_draws_match_the_host_formulas_and_the_enumerated_law() {
    let t = 2 * PER_KIND;
    let kind = |tok: usize| tok % 2;
    let logits: Vec<f64> = (0..t).flat_map(|tok| THETA[kind(tok)]).collect();
    let logits = Tensor::from_f64(logits, &[t, N], Device::cpu()).unwrap();
    let f: Vec<f64> = (0..t).flat_map(|_| F.iter().flatten().copied()).collect();
    let f = Tensor::from_f64(f, &[t, N, D], Device::cpu()).unwrap();
    let a: Vec<f64> = (0..t).flat_map(|_| A).collect();
    let a = Tensor::from_f64(a, &[t, D], Device::cpu()).unwrap();
    let loss = |y: &Tensor| -> Result<Tensor> {
        y.mul(&a)?
            .sum_all()?
            .add(&y.mul(y)?.sum_all()?.mul_scalar(0.5)?)
    };
    let mut cfg = RouterConfig::new(N, N, 1);
    cfg.seed = 23;
    cfg.options.insert("top".into(), "2".into());
    let probe = GradientProbe::new("sparsemixer-v2", &cfg, Device::cpu()).unwrap();
    let mut counts: [BTreeMap<Key, f64>; 2] = Default::default();
    for _ in 0..DRAWS {
        let est = probe.estimate(&logits, &f, &loss).unwrap();
        let ex = est.routing.expert.to_vec_i32().unwrap();
        let w = est.routing.weight.to_vec_f64().unwrap();
        let y = est.y.to_vec_f64().unwrap();
        let g = est.grad.to_vec_f64().unwrap();
        assert_eq!(ex.len(), 2 * t, "two assignments per token");
        for tok in 0..t {
            let theta = &THETA[kind(tok)];
            let (d1, d2) = (ex[2 * tok] as usize, ex[2 * tok + 1] as usize);
            let (pi, pi2, _, _) = slot_softmaxes(theta, d1);
            assert!(
                pi[d1] > 0.0 && pi2[d2] > 0.0,
                "token {tok}: drew ({d1}, {d2}), which the masks exclude"
            );
            // the forward scales the draw used, read off its weights; they must be 1 or ⅓
            let (c1, c2) = (w[2 * tok] / pi[d1], w[2 * tok + 1] / pi2[d2]);
            for (slot, c) in [(1, c1), (2, c2)] {
                assert!(
                    close(c, 1.0) || close(c, 1.0 / 3.0),
                    "token {tok} (kind {}), draw ({d1}, {d2}): slot {slot}'s weight is {} = {c}·π{slot}_D: \
                     not the masked softmax of that slot times 1 or ⅓",
                    kind(tok),
                    w[2 * tok + slot - 1]
                );
            }
            let (c1, c2) = (
                if close(c1, 1.0) { 1.0 } else { 1.0 / 3.0 },
                if close(c2, 1.0) { 1.0 } else { 1.0 / 3.0 },
            );
            let (_, want_y, want_g) = host_draw(theta, d1, c1, d2, c2);
            for j in 0..D {
                assert!(
                    close(y[tok * D + j], want_y[j]),
                    "token {tok}: y[{j}] {} vs {}",
                    y[tok * D + j],
                    want_y[j]
                );
            }
            for k in 0..N {
                assert!(
                    close(g[tok * N + k], want_g[k]),
                    "token {tok}, draw ({d1}, {c1:.3}, {d2}, {c2:.3}): ∂L/∂θ_{k} {} vs host {}",
                    g[tok * N + k],
                    want_g[k]
                );
            }
            *counts[kind(tok)]
                .entry((d1, milli(c1), d2, milli(c2)))
                .or_default() += 1.0;
        }
    }
    let draws = (PER_KIND * DRAWS) as f64;
    for (k, theta) in THETA.iter().enumerate() {
        let law = law(theta);
        let total: f64 = law.values().sum();
        assert!(
            (total - 1.0).abs() < 1e-12,
            "kind {k}: the law sums to {total}"
        );
        for key in counts[k].keys() {
            assert!(
                law.contains_key(key),
                "kind {k}: drew {key:?}, of probability 0"
            );
        }
        for (key, &p) in &law {
            let seen = counts[k].get(key).copied().unwrap_or(0.0);
            let se = (draws * p * (1.0 - p)).sqrt();
            assert!(
                (seen - draws * p).abs() <= 5.0 * se + 1.0,
                "kind {k}: {key:?} drawn {seen} times in {draws}, expected {:.1} ± {se:.1}",
                draws * p
            );
        }
    }
}
