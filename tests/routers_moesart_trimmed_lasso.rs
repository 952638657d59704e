//! MOESART's trimmed lasso per token (Ibrahim et al. §3.2; docs/routers.md, `moesart`):
//! `R = λ·mean_t Σ_{j∉top-k(g_t)} g_tj`, each token's bottom set taken from its own row of the
//! dense softmax `g`. The value test in `tests/routers_moesart.rs` gives every token the same
//! logits, so a bottom set taken from one token and used for all passes it; here every row is
//! different and so are the bottom sets, and values and gradients are computed on the host.

mod common;

use moegrad::moe::routers::MoesartRouter;
use moegrad::moe::{Router, RouterConfig, build_router};
use moegrad::nn::Param;
use moegrad::{DType, Device, Tensor};
use std::collections::BTreeSet;

/// Rows of probabilities whose bottom sets differ at every k.
const PROBS: [[f64; 5]; 4] = [
    [0.40, 0.25, 0.15, 0.12, 0.08],
    [0.05, 0.10, 0.30, 0.35, 0.20],
    [0.22, 0.03, 0.50, 0.06, 0.19],
    [0.10, 0.45, 0.07, 0.09, 0.29],
];

/// The indices of the `n − k` smallest entries of `row`.
fn bottom_set(row: &[f64], k: usize) -> BTreeSet<usize> {
    let mut idx: Vec<usize> = (0..row.len()).collect();
    idx.sort_by(|&a, &b| row[b].partial_cmp(&row[a]).unwrap());
    idx[k..].iter().copied().collect()
}

#[test]
fn the_trimmed_lasso_takes_each_rows_own_bottom_set() {
    let (t, n) = (PROBS.len(), PROBS[0].len());
    for dev in common::devices("the_trimmed_lasso_takes_each_rows_own_bottom_set") {
        let tol = if dev.is_gpu() { 1e-6 } else { 1e-15 };
        for k in 1..n {
            let sets: Vec<BTreeSet<usize>> = PROBS.iter().map(|r| bottom_set(r, k)).collect();
            assert!(
                sets.iter().collect::<BTreeSet<_>>().len() == t,
                "k = {k}: the rows must have distinct bottom sets"
            );
            let want: f64 = PROBS
                .iter()
                .zip(&sets)
                .map(|(r, s)| s.iter().map(|&j| r[j]).sum::<f64>())
                .sum::<f64>()
                / t as f64;
            let dt = if dev.is_gpu() { DType::F32 } else { DType::F64 };
            let probs = Tensor::from_f64(PROBS.concat(), &[t, n], Device::cpu())
                .unwrap()
                .to_dtype(dt)
                .unwrap()
                .to_device(dev)
                .unwrap()
                .with_grad()
                .unwrap();
            let r = MoesartRouter::trimmed_lasso(&probs, k).unwrap();
            let got = r.item().unwrap();
            assert!(
                (got - want).abs() < tol,
                "{dev}, k = {k}: trimmed lasso {got}, by hand {want}"
            );
            r.backward().unwrap();
            let g = probs.grad().unwrap().to_vec_f64().unwrap();
            let want_g: Vec<f64> = (0..t * n)
                .map(|i| f64::from(sets[i / n].contains(&(i % n))) / t as f64)
                .collect();
            common::assert_close(&format!("{dev}, k = {k}: ∂R/∂g"), &g, &want_g, tol, 0.0);
        }
    }
}

const D: usize = 3;
const N: usize = 5;
const K: usize = 2;
const TAU: f64 = 0.5;
const LAMBDA: f64 = 0.7;

fn params(r: &dyn Router) -> Vec<(String, Param)> {
    let mut v = Vec::new();
    r.visit_params("", &mut |name, p| v.push((name, p.clone())));
    v
}

/// Through the router: distinct tokens, `o = (x·W + b)/τ`, `R = λ·mean_t bottom mass of
/// softmax(o_t)`, and its gradient with respect to `W` and `b`,
/// `∂R/∂o_tl = (λ/T)·g_tl·(1[l ∈ bottom_t] − Σ_{bottom_t} g_t)`, all on the host.
#[test]
fn the_routers_trimmed_lasso_and_its_gradient_are_per_token() {
    let mut cfg = RouterConfig::new(D, N, K);
    cfg.seed = 3;
    for (key, value) in [
        ("tau", TAU.to_string()),
        ("trimmed_lasso", LAMBDA.to_string()),
    ] {
        cfg.options.insert(key.into(), value);
    }
    let router = build_router("moesart", &cfg, Device::cpu()).unwrap();
    let w: Vec<f64> = (0..D * N)
        .map(|i| ((i * 7 % 11) as f64 - 5.0) / 8.0)
        .collect();
    let b: Vec<f64> = (0..N).map(|j| (j as f64 - 2.0) / 10.0).collect();
    for (name, p) in params(router.as_ref()) {
        let v = if name == "weight" { &w } else { &b };
        p.set(Tensor::from_f64(v.clone(), p.get().shape(), Device::cpu()).unwrap())
            .unwrap();
    }
    let t = 9;
    let x: Vec<f64> = (0..t * D)
        .map(|i| ((i * 5 % 13) as f64 - 6.0) / 4.0)
        .collect();
    // the host's logits, softmax and bottom sets
    let g: Vec<Vec<f64>> = (0..t)
        .map(|tok| {
            let o: Vec<f64> = (0..N)
                .map(|j| ((0..D).map(|i| x[tok * D + i] * w[i * N + j]).sum::<f64>() + b[j]) / TAU)
                .collect();
            let m = o.iter().copied().fold(f64::MIN, f64::max);
            let e: Vec<f64> = o.iter().map(|v| (v - m).exp()).collect();
            let s: f64 = e.iter().sum();
            e.iter().map(|v| v / s).collect()
        })
        .collect();
    let sets: Vec<BTreeSet<usize>> = g.iter().map(|r| bottom_set(r, K)).collect();
    let distinct = sets.iter().collect::<BTreeSet<_>>().len();
    assert!(
        distinct >= 3,
        "the tokens must have several bottom sets, got {distinct}"
    );
    let mass: Vec<f64> = g
        .iter()
        .zip(&sets)
        .map(|(r, s)| s.iter().map(|&j| r[j]).sum())
        .collect();
    let want = LAMBDA * mass.iter().sum::<f64>() / t as f64;
    let xt = Tensor::from_f64(x.clone(), &[t, D], Device::cpu()).unwrap();
    let routing = router.route(&xt).unwrap();
    let aux = routing.aux_loss.clone().expect("the trimmed lasso is on");
    let got = aux.item().unwrap();
    assert!(
        (got - want).abs() < 1e-14,
        "trimmed lasso {got}, by hand {want}"
    );
    aux.backward().unwrap();
    // ∂R/∂o_tl, then through o = (x·W + b)/τ
    let d_o: Vec<Vec<f64>> = (0..t)
        .map(|tok| {
            (0..N)
                .map(|l| {
                    let inside = f64::from(sets[tok].contains(&l));
                    LAMBDA / t as f64 * g[tok][l] * (inside - mass[tok]) / TAU
                })
                .collect()
        })
        .collect();
    let want_b: Vec<f64> = (0..N)
        .map(|l| (0..t).map(|tok| d_o[tok][l]).sum())
        .collect();
    let want_w: Vec<f64> = (0..D * N)
        .map(|il| {
            (0..t)
                .map(|tok| x[tok * D + il / N] * d_o[tok][il % N])
                .sum()
        })
        .collect();
    for (name, p) in params(router.as_ref()) {
        let got = p.grad().unwrap().to_vec_f64().unwrap();
        let want = if name == "weight" { &want_w } else { &want_b };
        common::assert_close(&format!("∂R/∂{name}"), &got, want, 1e-14, 1e-12);
    }
}
