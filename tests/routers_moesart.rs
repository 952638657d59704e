//! The `moesart` router against the properties of MOESART (Ibrahim et al.; docs/routers.md,
//! `moesart`):
//! simplex and |s| = k, sparse-evaluation invariance through the whole MoE layer, gradchecks of
//! the router and of a whole layer (f64, CPU, draws fixed by seed), shift invariance, the closed
//! forms of eq. 3 and its gradient against the log-space implementation, strategy (iii)'s zero
//! gradient, Monte-Carlo means against the exact-enumeration table, the sampler's law, degenerate
//! cases, inference, the trimmed lasso, configuration errors, and GPU parity.
//!
//! Statistical tests use fixed seeds and bounds of 5 standard errors (or a chi-square bound of
//! `df + 6·√(2·df)`), so they are deterministic and still fail when the law is wrong.

mod common;

use moegrad::gradcheck::{GradcheckOptions, gradcheck};
use moegrad::moe::routers::{MoesartDraw, MoesartStrategy};
use moegrad::moe::{MoeConfig, MoeLayer, Router, RouterConfig, build_router};
use moegrad::nn::Param;
use moegrad::nn::Parameters;
use moegrad::{DType, Device, Error, Result, Tensor};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

const D: usize = 5;

fn randn(shape: &[usize], seed: u64) -> Tensor {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let n = shape.iter().product();
    let v: Vec<f64> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
    Tensor::from_f64(v, shape, Device::cpu()).unwrap()
}

fn config(n: usize, k: usize, opts: &[(&str, &str)], seed: u64) -> RouterConfig {
    let mut cfg = RouterConfig::new(D, n, k);
    cfg.seed = seed;
    cfg.options = opts
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    cfg
}

fn params(r: &dyn Router) -> Vec<(String, Param)> {
    let mut v = Vec::new();
    r.visit_params("router", &mut |n, p| v.push((n, p.clone())));
    v
}

/// A MOESART router in f64 on the CPU.
fn router(n: usize, k: usize, opts: &[(&str, &str)], seed: u64) -> Box<dyn Router> {
    let r = build_router("moesart", &config(n, k, opts, seed), Device::cpu()).unwrap();
    for (_, p) in params(r.as_ref()) {
        p.set(p.get().to_dtype(DType::F64).unwrap()).unwrap();
    }
    r
}

/// Router weight 0 and bias `logits`: every token gets logits `logits / τ`.
fn set_logits(r: &dyn Router, logits: &[f64]) {
    for (name, p) in params(r) {
        if name == "router.weight" {
            p.set(p.get().zeros_like().unwrap()).unwrap();
        } else {
            p.set(Tensor::from_f64(logits.to_vec(), &[logits.len()], Device::cpu()).unwrap())
                .unwrap();
        }
    }
}

fn grad_of(p: &Param) -> Vec<f64> {
    match p.grad() {
        Some(g) => g.to_vec_f64().unwrap(),
        None => vec![0.0; p.get().numel()],
    }
}

fn softmax(o: &[f64]) -> Vec<f64> {
    let m = o.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = o.iter().map(|v| (v - m).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|v| v / s).collect()
}

const STRATEGIES: [&str; 4] = ["i", "ii", "iii", "eq3"];

// ---- 1, 2: simplex and sparsity -------------------------------------------------------------

#[test]
fn weights_lie_on_the_simplex_and_s_has_k_distinct_experts() {
    let (n, k, t) = (6, 3, 64);
    let x = randn(&[t, D], 1).mul_scalar(3.0).unwrap();
    for strategy in STRATEGIES {
        for replacement in ["false", "true"] {
            let r = router(
                n,
                k,
                &[("strategy", strategy), ("replacement", replacement)],
                2,
            );
            let out = r.route(&x).unwrap();
            assert_eq!(out.len(), t * k);
            let (e, w, v) = (
                out.expert.to_vec_i32().unwrap(),
                out.weight.to_vec_f64().unwrap(),
                out.valid.to_vec_f64().unwrap(),
            );
            let mut distinct_total = 0;
            for tok in 0..t {
                let sl = tok * k..(tok + 1) * k;
                let sum: f64 = w[sl.clone()].iter().sum();
                assert!(
                    (sum - 1.0).abs() < 1e-12,
                    "{strategy}/{replacement}: Σ = {sum}"
                );
                let mut seen = Vec::new();
                for a in sl {
                    assert!(w[a] >= 0.0 && (0..n as i32).contains(&e[a]));
                    if v[a] == 1.0 {
                        assert!(!seen.contains(&e[a]), "a distinct expert repeated");
                        seen.push(e[a]);
                    } else {
                        // a repeated draw: no weight, and its expert was drawn before
                        assert_eq!(w[a], 0.0);
                        assert!(seen.contains(&e[a]));
                    }
                }
                if replacement == "false" {
                    assert_eq!(seen.len(), k, "without replacement |s| = k");
                }
                distinct_total += seen.len();
            }
            if replacement == "true" {
                assert!(distinct_total < t * k, "some token should draw a duplicate");
            }
        }
    }
}

// ---- 3: sparse-evaluation invariance ---------------------------------------------------------

fn loss_of(out: &Tensor) -> Tensor {
    let c = randn(out.shape(), 99).to_dtype(out.dtype()).unwrap();
    let sq = out
        .mul(out)
        .unwrap()
        .sum_all()
        .unwrap()
        .mul_scalar(0.1)
        .unwrap();
    out.mul(&c).unwrap().sum_all().unwrap().add(&sq).unwrap()
}

fn moe_config(n: usize, k: usize, opts: &[(&str, &str)]) -> MoeConfig {
    let mut cfg = MoeConfig::new(D, 4, n, k);
    cfg.router = "moesart".into();
    cfg.seed = 7;
    cfg.router_options = config(n, k, opts, 0).options;
    cfg
}

fn layer_params(l: &MoeLayer) -> Vec<(String, Param)> {
    let mut v = Vec::new();
    l.visit_params("", &mut |n, p| v.push((n, p.clone())));
    v
}

/// A fresh layer (so the router draws the same experts) holding `values`.
fn layer_with(cfg: &MoeConfig, values: &[Tensor]) -> MoeLayer {
    let l = MoeLayer::new(cfg, Device::cpu()).unwrap();
    for ((_, p), v) in layer_params(&l).iter().zip(values) {
        p.set(v.detach()).unwrap();
    }
    l
}

#[test]
fn sparse_evaluation_invariance_with_nan_in_unselected_experts() {
    let n = 8;
    for replacement in ["false", "true"] {
        let cfg = moe_config(
            n,
            3,
            &[("replacement", replacement), ("trimmed_lasso", "0.1")],
        );
        let proto = MoeLayer::new(&cfg, Device::cpu()).unwrap();
        let mut values: Vec<Tensor> = layer_params(&proto)
            .iter()
            .map(|(_, p)| p.get().to_dtype(DType::F64).unwrap())
            .collect();
        let names: Vec<String> = layer_params(&proto).into_iter().map(|(n, _)| n).collect();
        let x = randn(&[3, D], 6);
        let run = |values: &[Tensor]| {
            let l = layer_with(&cfg, values);
            let xg = x.detach().with_grad().unwrap();
            let out = l.forward(&xg).unwrap();
            loss_of(&out.y)
                .add(&out.aux_loss)
                .unwrap()
                .backward()
                .unwrap();
            let grads: Vec<Vec<f64>> = layer_params(&l).iter().map(|(_, p)| grad_of(p)).collect();
            (
                out.y.to_vec_f64().unwrap(),
                xg.grad().unwrap().to_vec_f64().unwrap(),
                grads,
                out.stats,
            )
        };
        let (y0, gx0, g0, stats) = run(&values);
        let kept = stats.kept_per_expert.to_vec_f64().unwrap();
        let used: f64 = kept.iter().sum();
        if replacement == "false" {
            assert_eq!(used, 9.0, "3 tokens × k = 3 distinct experts each run");
        } else {
            assert!((3.0..=9.0).contains(&used), "{used}");
        }
        assert!(
            kept.iter().all(|&c| c <= 3.0),
            "no expert runs twice per token"
        );
        let unused: Vec<usize> = (0..n).filter(|&e| kept[e] == 0.0).collect();
        assert!(!unused.is_empty(), "an expert should stay idle");
        for (i, name) in names.iter().enumerate() {
            if name.starts_with("experts.") {
                let per = g0[i].len() / n;
                for &e in &unused {
                    assert!(
                        g0[i][e * per..(e + 1) * per].iter().all(|&v| v == 0.0),
                        "{name} of idle expert {e}"
                    );
                }
                // idle experts' parameters become NaN: nothing may change
                let mut v = values[i].to_vec_f64().unwrap();
                for &e in &unused {
                    v[e * per..(e + 1) * per].fill(f64::NAN);
                }
                values[i] = Tensor::from_f64(v, values[i].shape(), Device::cpu()).unwrap();
            }
        }
        let (y1, gx1, g1, _) = run(&values);
        assert_eq!(y0, y1, "replacement {replacement}: output changed");
        assert_eq!(
            gx0, gx1,
            "replacement {replacement}: input gradient changed"
        );
        for (i, name) in names.iter().enumerate() {
            let per = g1[i].len() / if name.starts_with("experts.") { n } else { 1 };
            for (j, (a, b)) in g0[i].iter().zip(&g1[i]).enumerate() {
                let idle = name.starts_with("experts.") && unused.contains(&(j / per));
                assert!(
                    if idle { *b == 0.0 } else { a == b },
                    "replacement {replacement}: gradient of {name}[{j}] changed: {a} → {b}"
                );
            }
        }
    }
}

// ---- 4: finite differences -------------------------------------------------------------------

#[test]
fn router_gradcheck_for_every_strategy_with_and_without_replacement() {
    let (n, k, t) = (5, 3, 6);
    let coef = randn(&[t * k], 17);
    for strategy in STRATEGIES {
        for replacement in ["false", "true"] {
            let opts = [
                ("strategy", strategy),
                ("replacement", replacement),
                ("trimmed_lasso", "0.3"),
                ("tau", "0.7"),
            ];
            let proto = router(n, k, &opts, 23);
            let mut inputs = vec![randn(&[t, D], 24).mul_scalar(2.0).unwrap()];
            inputs.extend(params(proto.as_ref()).iter().map(|(_, p)| p.get()));
            inputs[2] = randn(&[n], 25).mul_scalar(0.5).unwrap();
            let f = |v: &[Tensor]| -> Result<Tensor> {
                let r = router(n, k, &opts, 23); // a fresh router: the same draw every call
                for ((_, p), val) in params(r.as_ref()).iter().zip(&v[1..]) {
                    p.set(val.clone())?;
                }
                let out = r.route(&v[0])?;
                let aux = out.aux_loss.clone().expect("trimmed lasso on");
                out.weight.mul(&coef)?.sum_all()?.add(&aux)
            };
            if let Err(e) = gradcheck(f, &inputs, &GradcheckOptions::default()) {
                panic!("strategy {strategy}, replacement {replacement}: {e}");
            }
        }
    }
}

#[test]
fn whole_layer_gradcheck_in_training_mode() {
    for replacement in ["false", "true"] {
        let cfg = moe_config(
            4,
            2,
            &[("replacement", replacement), ("trimmed_lasso", "0.05")],
        );
        let proto = MoeLayer::new(&cfg, Device::cpu()).unwrap();
        let mut inputs = vec![randn(&[6, D], 8)];
        for (i, (name, p)) in layer_params(&proto).iter().enumerate() {
            // nonzero biases keep hidden units away from the ReLU kink
            inputs.push(
                if name.ends_with("b1") || name.ends_with("b2") || name.ends_with("bias") {
                    randn(p.get().shape(), 30 + i as u64)
                        .mul_scalar(0.3)
                        .unwrap()
                } else {
                    p.get().to_dtype(DType::F64).unwrap()
                },
            );
        }
        let f = |v: &[Tensor]| -> Result<Tensor> {
            let l = MoeLayer::new(&cfg, Device::cpu())?;
            for ((_, p), val) in layer_params(&l).iter().zip(&v[1..]) {
                p.set(val.clone())?;
            }
            let out = l.forward(&v[0])?;
            loss_of(&out.y).add(&out.aux_loss)
        };
        if let Err(e) = gradcheck(f, &inputs, &GradcheckOptions::default()) {
            panic!("replacement {replacement}: {e}");
        }
    }
}

// ---- 5: shift invariance ---------------------------------------------------------------------

#[test]
fn shift_invariance_of_weights_and_zero_sum_logit_gradient() {
    let logits = [0.3, -0.2, 1.1, 0.05, -0.9];
    let x = Tensor::zeros(&[40, D], DType::F64, Device::cpu()).unwrap();
    let coef = randn(&[40 * 3], 3);
    for strategy in STRATEGIES {
        for replacement in ["false", "true"] {
            let opts = [("strategy", strategy), ("replacement", replacement)];
            let run = |shift: f64| {
                let r = router(5, 3, &opts, 41);
                set_logits(r.as_ref(), &logits.map(|v| v + shift));
                let out = r.route(&x).unwrap();
                out.weight
                    .mul(&coef)
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .backward()
                    .unwrap();
                let bias = params(r.as_ref())[1].1.clone();
                (
                    out.expert.to_vec_i32().unwrap(),
                    out.weight.to_vec_f64().unwrap(),
                    grad_of(&bias),
                )
            };
            let (e0, w0, g0) = run(0.0);
            let (e1, w1, _) = run(3.7);
            let what = format!("{strategy}/{replacement}");
            assert_eq!(e0, e1, "{what}: the same experts after a shift");
            common::assert_close(&what, &w1, &w0, 1e-12, 0.0);
            let s: f64 = g0.iter().sum();
            assert!(s.abs() < 1e-12, "{what}: Σ ∂L/∂o = {s}");
            if strategy != "iii" {
                assert!(g0.iter().any(|&v| v != 0.0), "{what}: router is trained");
            }
        }
    }
}

// ---- 9: closed forms and the gradient of eq. 3 ----------------------------------------------

struct Sampled {
    g: Vec<f64>,
    experts: Vec<i32>,
    counts: Vec<f64>,
    valid: Vec<f64>,
    anchor: Vec<f64>,
}

fn sample_rows(
    t: usize,
    n: usize,
    k: usize,
    replacement: bool,
    seed: u64,
) -> (Tensor, Sampled, MoesartDraw) {
    let logits = randn(&[t, n], seed).mul_scalar(2.5).unwrap();
    let draw = MoesartDraw::sample(&logits, k, replacement, seed + 1).unwrap();
    let g = logits.softmax(-1).unwrap().to_vec_f64().unwrap();
    let s = Sampled {
        g,
        experts: draw.experts.to_vec_i32().unwrap(),
        counts: draw.counts.to_vec_f64().unwrap(),
        valid: draw.valid.to_vec_f64().unwrap(),
        anchor: draw.anchor.to_vec_f64().unwrap(),
    };
    (logits, s, draw)
}

#[test]
fn closed_forms_match_the_log_space_implementation() {
    let (t, n) = (300, 6);
    for (k, replacement) in [(2, false), (3, false), (4, false), (3, true), (4, true)] {
        let (logits, s, draw) = sample_rows(t, n, k, replacement, 50 + k as u64);
        for strategy in [
            MoesartStrategy::I,
            MoesartStrategy::II,
            MoesartStrategy::III,
            MoesartStrategy::Eq3,
        ] {
            let w = strategy
                .weights(&logits, &draw)
                .unwrap()
                .to_vec_f64()
                .unwrap();
            for tok in 0..t {
                let g = &s.g[tok * n..(tok + 1) * n];
                let sl = tok * k..(tok + 1) * k;
                let z = sl.clone().find(|&a| s.anchor[a] == 1.0).unwrap();
                assert_eq!(s.valid[z], 1.0, "the anchor is a distinct expert");
                assert_eq!(s.anchor[sl.clone()].iter().sum::<f64>(), 1.0);
                let (gz, rz) = (g[s.experts[z] as usize], s.counts[z]);
                let mass: f64 = sl
                    .clone()
                    .filter(|&a| s.valid[a] == 1.0)
                    .map(|a| g[s.experts[a] as usize])
                    .sum();
                let weighted: f64 = sl
                    .clone()
                    .filter(|&a| s.valid[a] == 1.0)
                    .map(|a| s.counts[a] * g[s.experts[a] as usize])
                    .sum();
                let kf = k as f64;
                let dd = rz * gz + (kf - rz) / (kf - 1.0);
                for a in sl {
                    let (gi, ri) = (g[s.experts[a] as usize], s.counts[a]);
                    let expect = if s.valid[a] == 0.0 {
                        0.0
                    } else {
                        match strategy {
                            MoesartStrategy::I => gi / mass,
                            MoesartStrategy::II => ri * gi / weighted,
                            MoesartStrategy::III => ri / kf,
                            MoesartStrategy::Eq3 if !replacement => {
                                if a == z {
                                    gz / (1.0 + gz)
                                } else {
                                    1.0 / ((kf - 1.0) * (1.0 + gz))
                                }
                            }
                            MoesartStrategy::Eq3 => {
                                if a == z {
                                    rz * gz / dd
                                } else {
                                    ri / ((kf - 1.0) * dd)
                                }
                            }
                        }
                    };
                    assert!(
                        (w[a] - expect).abs() < 1e-13,
                        "k {k}, replacement {replacement}, {strategy:?}: slot {a}: {} vs {expect}",
                        w[a]
                    );
                }
            }
        }
    }
}

#[test]
fn routed_eq3_weights_have_an_anchor_and_equal_non_anchor_weights() {
    let (n, k, t) = (6, 3, 50);
    let r = router(n, k, &[], 5);
    let x = randn(&[t, D], 61).mul_scalar(3.0).unwrap();
    let out = r.route(&x).unwrap();
    let (e, w, p) = (
        out.expert.to_vec_i32().unwrap(),
        out.weight.to_vec_f64().unwrap(),
        out.probs.to_vec_f64().unwrap(),
    );
    for tok in 0..t {
        let ws = &w[tok * k..(tok + 1) * k];
        let found = (0..k).filter(|&z| {
            let gz = p[tok * n + e[tok * k + z] as usize];
            (ws[z] - gz / (1.0 + gz)).abs() < 1e-13
                && (0..k)
                    .filter(|&i| i != z)
                    .all(|i| (ws[i] - 1.0 / ((k as f64 - 1.0) * (1.0 + gz))).abs() < 1e-13)
        });
        assert!(found.count() >= 1, "token {tok}: {ws:?}");
    }
}

#[test]
fn eq3_router_gradient_matches_its_closed_form() {
    let (t, n) = (40, 5);
    for (k, replacement) in [(2, false), (3, false), (3, true), (4, true)] {
        let (logits, s, draw) = sample_rows(t, n, k, replacement, 70 + k as u64);
        let a = randn(&[t, k], 71);
        let leaf = logits.detach().with_grad().unwrap();
        let w = MoesartStrategy::Eq3.weights(&leaf, &draw).unwrap();
        w.mul(&a).unwrap().sum_all().unwrap().backward().unwrap();
        let grad = leaf.grad().unwrap().to_vec_f64().unwrap();
        let av = a.to_vec_f64().unwrap();
        let kf = k as f64;
        for tok in 0..t {
            let g = &s.g[tok * n..(tok + 1) * n];
            let sl: Vec<usize> = (tok * k..(tok + 1) * k).collect();
            let z = *sl.iter().find(|&&i| s.anchor[i] == 1.0).unwrap();
            let ez = s.experts[z] as usize;
            let (gz, rz) = (g[ez], s.counts[z]);
            let dd = rz * gz + (kf - rz) / (kf - 1.0);
            // ∂L/∂g_z = r_z[(k − r_z) a_z − Σ_{i∈s∖z} r_i a_i] / ((k−1) D²)
            let others: f64 = sl
                .iter()
                .filter(|&&i| i != z && s.valid[i] == 1.0)
                .map(|&i| s.counts[i] * av[i])
                .sum();
            let dgz = rz * ((kf - rz) * av[z] - others) / ((kf - 1.0) * dd * dd);
            if !replacement {
                let mean = others / (kf - 1.0);
                let simple = (av[z] - mean) / ((1.0 + gz) * (1.0 + gz));
                assert!((dgz - simple).abs() < 1e-12);
            }
            for j in 0..n {
                let expect = dgz * gz * (f64::from(u8::from(j == ez)) - g[j]);
                let got = grad[tok * n + j];
                assert!(
                    (got - expect).abs() < 1e-12,
                    "k {k}, replacement {replacement}, token {tok}, logit {j}: {got} vs {expect}"
                );
            }
        }
    }
}

// ---- 10: strategy (iii) ----------------------------------------------------------------------

#[test]
fn strategy_iii_weights_are_r_over_k_with_exactly_zero_router_gradient() {
    for replacement in [false, true] {
        let (n, k, t) = (5, 4, 60);
        let r = router(
            n,
            k,
            &[
                ("strategy", "iii"),
                ("replacement", if replacement { "true" } else { "false" }),
            ],
            8,
        );
        let x = randn(&[t, D], 81).mul_scalar(2.0).unwrap();
        let out = r.route(&x).unwrap();
        out.weight
            .mul(&randn(&[t * k], 82))
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        for (name, p) in params(r.as_ref()) {
            let g = p.grad().expect("the router stays on the tape");
            assert!(
                g.to_vec_f64().unwrap().iter().all(|&v| v == 0.0),
                "{name}: strategy (iii) must give exactly zero router gradient"
            );
        }
        // Σ_{j∈s} e^{õ_j} = Σ_l e^{o_l}: the relative logits õ − LSE(o) exponentiate to 1.
        let (logits, s, draw) = sample_rows(t, n, k, replacement, 83);
        let rel = MoesartStrategy::III
            .relative_logits(&logits, &draw)
            .unwrap()
            .to_vec_f64()
            .unwrap();
        let w = MoesartStrategy::III
            .weights(&logits, &draw)
            .unwrap()
            .to_vec_f64()
            .unwrap();
        for tok in 0..t {
            let mut sum = 0.0;
            for a in tok * k..(tok + 1) * k {
                if s.valid[a] == 1.0 {
                    sum += rel[a].exp();
                    assert!((w[a] - s.counts[a] / k as f64).abs() < 1e-15);
                }
            }
            assert!((sum - 1.0).abs() < 1e-14, "token {tok}: {sum}");
        }
    }
}

// ---- 11, 12: Monte Carlo against exact enumeration ------------------------------------------

/// E[g̃] by enumerating every draw sequence and anchor, with the paper's adjusted logits written
/// naively (`o_i + log r_i − log((k−1) g_i)`, ...), independently of the implementation.
fn enumerate(g: &[f64], k: usize, replacement: bool, strategy: &str) -> Vec<f64> {
    let mut mean = vec![0.0; g.len()];
    let mut seq = Vec::new();
    fn rec(
        g: &[f64],
        k: usize,
        replacement: bool,
        strategy: &str,
        seq: &mut Vec<usize>,
        prob: f64,
        mean: &mut [f64],
    ) {
        if seq.len() == k {
            let mut r = vec![0.0f64; g.len()];
            seq.iter().for_each(|&i| r[i] += 1.0);
            let s: Vec<usize> = (0..g.len()).filter(|&i| r[i] > 0.0).collect();
            for &z in &s {
                let adj: Vec<f64> = s
                    .iter()
                    .map(|&i| {
                        let (o, kf) = (g[i].ln(), k as f64);
                        match strategy {
                            "i" => o,
                            "ii" => o + r[i].ln(),
                            "iii" => o + r[i].ln() - (kf * g[i]).ln(),
                            _ if i == z => o + r[i].ln(),
                            _ => o + r[i].ln() - ((kf - 1.0) * g[i]).ln(),
                        }
                    })
                    .collect();
                let w = softmax(&adj);
                for (j, &i) in s.iter().enumerate() {
                    mean[i] += prob / s.len() as f64 * w[j];
                }
            }
            return;
        }
        let used: f64 = seq.iter().map(|&i| g[i]).sum();
        for i in 0..g.len() {
            if !replacement && seq.contains(&i) {
                continue;
            }
            let p = if replacement {
                g[i]
            } else {
                g[i] / (1.0 - used)
            };
            seq.push(i);
            rec(g, k, replacement, strategy, seq, prob * p, mean);
            seq.pop();
        }
    }
    rec(g, k, replacement, strategy, &mut seq, 1.0, &mut mean);
    mean
}

fn bias(mean: &[f64], g: &[f64]) -> f64 {
    mean.iter()
        .zip(g)
        .map(|(a, b)| (a - b).powi(2))
        .sum::<f64>()
        .sqrt()
}

#[test]
fn the_enumeration_reproduces_the_spec_table() {
    let g = [0.4, 0.3, 0.2, 0.1];
    let rows: [(&str, bool, [f64; 4], f64); 7] = [
        ("i", true, [0.4678, 0.3099, 0.1680, 0.0543], 0.0883),
        ("ii", true, [0.4678, 0.3099, 0.1680, 0.0543], 0.0883),
        ("eq3", true, [0.4239, 0.3014, 0.1881, 0.0865], 0.0299),
        ("i", false, [0.4567, 0.3128, 0.1735, 0.0570], 0.0770),
        ("ii", false, [0.4567, 0.3128, 0.1735, 0.0570], 0.0770),
        ("iii", false, [0.3579, 0.3042, 0.2206, 0.1173], 0.0501),
        ("eq3", false, [0.3929, 0.3044, 0.2034, 0.0993], 0.0091),
    ];
    for (strategy, replacement, table, b) in rows {
        let m = enumerate(&g, 2, replacement, strategy);
        common::assert_close(strategy, &m, &table, 6e-5, 0.0);
        assert!(
            (bias(&m, &g) - b).abs() < 6e-5,
            "{strategy}: bias {}",
            bias(&m, &g)
        );
    }
    common::assert_close(
        "iii with replacement",
        &enumerate(&g, 2, true, "iii"),
        &g,
        1e-15,
        0.0,
    );
    // eq. 3 is not uniformly less biased: k = 3 without replacement on a peaked g.
    let g6 = [0.6, 0.2, 0.1, 0.05, 0.03, 0.02];
    assert!((bias(&enumerate(&g6, 3, false, "eq3"), &g6) - 0.2095).abs() < 6e-5);
    assert!((bias(&enumerate(&g6, 3, false, "i"), &g6) - 0.1103).abs() < 6e-5);
}

/// Per-expert Monte-Carlo mean of g̃ and its standard error over `tokens` tokens routed in one
/// batch with logits `log g`.
fn monte_carlo(
    g: &[f64],
    k: usize,
    opts: &[(&str, &str)],
    tokens: usize,
    seed: u64,
) -> (Vec<f64>, Vec<f64>) {
    let n = g.len();
    let r = router(n, k, opts, seed);
    set_logits(r.as_ref(), &g.iter().map(|v| v.ln()).collect::<Vec<_>>());
    let x = Tensor::zeros(&[tokens, D], DType::F64, Device::cpu()).unwrap();
    let out = moegrad::no_grad(|| r.route(&x)).unwrap();
    let (e, w) = (
        out.expert.to_vec_i32().unwrap(),
        out.weight.to_vec_f64().unwrap(),
    );
    let (mut sum, mut sq) = (vec![0.0; n], vec![0.0; n]);
    let mut row = vec![0.0; n];
    for tok in 0..tokens {
        row.fill(0.0);
        for a in tok * k..(tok + 1) * k {
            row[e[a] as usize] += w[a];
        }
        for i in 0..n {
            sum[i] += row[i];
            sq[i] += row[i] * row[i];
        }
    }
    let nt = tokens as f64;
    let mean: Vec<f64> = sum.iter().map(|s| s / nt).collect();
    let se = (0..n)
        .map(|i| ((sq[i] / nt - mean[i] * mean[i]).max(0.0) / nt).sqrt())
        .collect();
    (mean, se)
}

fn assert_within_se(what: &str, mean: &[f64], se: &[f64], exact: &[f64], z: f64) {
    for i in 0..mean.len() {
        assert!(se[i] > 0.0, "{what}: no spread at {i}");
        assert!(
            (mean[i] - exact[i]).abs() < z * se[i],
            "{what}: expert {i}: Monte Carlo {} vs exact {} ({:.1} standard errors)",
            mean[i],
            exact[i],
            (mean[i] - exact[i]).abs() / se[i]
        );
    }
}

#[test]
fn monte_carlo_means_match_the_enumeration_for_every_strategy() {
    let g = [0.4, 0.3, 0.2, 0.1];
    let tokens = 100_000;
    for (seed, replacement) in [(1u64, false), (2, true)] {
        for strategy in STRATEGIES {
            let repl = if replacement { "true" } else { "false" };
            let (mean, se) = monte_carlo(
                &g,
                2,
                &[("strategy", strategy), ("replacement", repl)],
                tokens,
                seed,
            );
            let exact = enumerate(&g, 2, replacement, strategy);
            assert_within_se(&format!("{strategy}/{repl}"), &mean, &se, &exact, 5.0);
            // The biased strategies are measurably away from g (the test has power).
            if strategy == "i" {
                assert!(bias(&mean, &g) > 0.05);
            }
        }
    }
    // (iii) with replacement is unbiased (E[g̃] = g); without replacement E[g̃_i] = π_i / k.
    let (mean, se) = monte_carlo(
        &g,
        2,
        &[("strategy", "iii"), ("replacement", "true")],
        tokens,
        3,
    );
    assert_within_se("iii/true = g", &mean, &se, &g, 5.0);
    let pi_over_k = [0.3579, 0.3042, 0.2206, 0.1173];
    let (mean, se) = monte_carlo(&g, 2, &[("strategy", "iii")], tokens, 4);
    let exact = enumerate(&g, 2, false, "iii");
    assert_within_se("iii/false = π/k", &mean, &se, &exact, 5.0);
    common::assert_close("π/k", &exact, &pi_over_k, 6e-5, 0.0);
    // k = 3 on a peaked g, and with replacement at k = 3 where (i) and (ii) differ.
    let g6 = [0.6, 0.2, 0.1, 0.05, 0.03, 0.02];
    let (mean, se) = monte_carlo(&g6, 3, &[], 60_000, 5);
    assert_within_se(
        "eq3 k = 3",
        &mean,
        &se,
        &enumerate(&g6, 3, false, "eq3"),
        5.0,
    );
    let g3 = [0.5, 0.3, 0.2];
    for strategy in ["i", "ii", "eq3"] {
        let (mean, se) = monte_carlo(
            &g3,
            3,
            &[("strategy", strategy), ("replacement", "true")],
            60_000,
            6,
        );
        let exact = enumerate(&g3, 3, true, strategy);
        assert_within_se(
            &format!("{strategy} with replacement, k = 3"),
            &mean,
            &se,
            &exact,
            5.0,
        );
    }
    let (ei, eii) = (enumerate(&g3, 3, true, "i"), enumerate(&g3, 3, true, "ii"));
    assert!(
        (ei[0] - eii[0]).abs() > 0.01,
        "(i) and (ii) differ for k = 3: {ei:?} {eii:?}"
    );
}

// ---- 13: the sampler -------------------------------------------------------------------------

fn chi_square(counts: &[f64], probs: &[f64], total: f64) -> f64 {
    counts
        .iter()
        .zip(probs)
        .filter(|(_, p)| **p > 0.0)
        .map(|(c, p)| (c - total * p).powi(2) / (total * p))
        .sum()
}

fn chi_bound(cells: usize) -> f64 {
    let df = (cells - 1) as f64;
    df + 6.0 * (2.0 * df).sqrt()
}

fn draw_rows(
    g: &[f64],
    rows: usize,
    k: usize,
    replacement: bool,
    seed: u64,
) -> (Vec<i32>, Vec<f64>, Vec<f64>) {
    let logits: Vec<f64> = (0..rows).flat_map(|_| g.iter().map(|v| v.ln())).collect();
    let logits = Tensor::from_f64(logits, &[rows, g.len()], Device::cpu()).unwrap();
    let d = MoesartDraw::sample(&logits, k, replacement, seed).unwrap();
    (
        d.experts.to_vec_i32().unwrap(),
        d.valid.to_vec_f64().unwrap(),
        d.anchor.to_vec_f64().unwrap(),
    )
}

#[test]
fn gumbel_top_k_has_the_law_of_sequential_sampling_without_replacement() {
    let g = [0.4, 0.3, 0.2, 0.1];
    let (rows, k) = (200_000, 3);
    let (e, _, anchor) = draw_rows(&g, rows, k, false, 11);
    let (mut first, mut triples, mut pairs) = (vec![0.0; 4], vec![0.0; 64], vec![0.0; 16]);
    let mut anchor_slot = vec![0.0; k];
    for r in 0..rows {
        let s = &e[r * k..(r + 1) * k];
        assert!(
            s[0] != s[1] && s[0] != s[2] && s[1] != s[2],
            "row {r}: duplicates {s:?}"
        );
        first[s[0] as usize] += 1.0;
        pairs[(s[0] * 4 + s[1]) as usize] += 1.0;
        triples[(s[0] * 16 + s[1] * 4 + s[2]) as usize] += 1.0;
        (0..k).for_each(|j| anchor_slot[j] += anchor[r * k + j]);
    }
    let total = rows as f64;
    let c = chi_square(&first, &g, total);
    assert!(c < chi_bound(4), "first draw ≈ g: χ² = {c}");
    // ordered pairs: g_a g_b / (1 − g_a)
    let mut p2 = vec![0.0; 16];
    let mut p3 = vec![0.0; 64];
    for a in 0..4 {
        for b in (0..4).filter(|&b| b != a) {
            p2[a * 4 + b] = g[a] * g[b] / (1.0 - g[a]);
            for c in (0..4).filter(|&c| c != a && c != b) {
                p3[a * 16 + b * 4 + c] = g[a] * g[b] / (1.0 - g[a]) * g[c] / (1.0 - g[a] - g[b]);
            }
        }
    }
    let c = chi_square(&pairs, &p2, total);
    assert!(c < chi_bound(12), "ordered pairs: χ² = {c}");
    let c = chi_square(&triples, &p3, total);
    assert!(c < chi_bound(24), "ordered triples: χ² = {c}");
    // A wrong law (with replacement, g_a g_b renormalised) is rejected by the same test.
    let mut wrong = vec![0.0; 16];
    let off: f64 = (0..4).map(|a| g[a] * (1.0 - g[a])).sum();
    for a in 0..4 {
        for b in (0..4).filter(|&b| b != a) {
            wrong[a * 4 + b] = g[a] * g[b] / off;
        }
    }
    assert!(chi_square(&pairs, &wrong, total) > 10.0 * chi_bound(12));
    // the anchor is uniform over the k slots
    let c = chi_square(&anchor_slot, &[1.0 / 3.0; 3], total);
    assert!(c < chi_bound(3), "anchor: χ² = {c}");
}

#[test]
fn sampling_with_replacement_draws_independently_and_anchors_on_distinct_experts() {
    let g = [0.5, 0.3, 0.2];
    let (rows, k) = (150_000, 3);
    let (e, valid, anchor) = draw_rows(&g, rows, k, true, 12);
    let total = rows as f64;
    let mut per_slot = vec![vec![0.0; 3]; k];
    let mut pairs = vec![0.0; 9];
    // among draws with exactly two distinct experts, how often the anchor is the doubled one
    let (mut two, mut anchor_on_double) = (0.0f64, 0.0f64);
    for r in 0..rows {
        let s = &e[r * k..(r + 1) * k];
        (0..k).for_each(|j| per_slot[j][s[j] as usize] += 1.0);
        pairs[(s[0] * 3 + s[1]) as usize] += 1.0;
        let v = &valid[r * k..(r + 1) * k];
        let z = (0..k).find(|&j| anchor[r * k + j] == 1.0).unwrap();
        assert_eq!(v[z], 1.0, "the anchor sits on a valid slot");
        let distinct = v.iter().sum::<f64>();
        for j in 0..k {
            let seen_before = (0..j).any(|l| s[l] == s[j]);
            assert_eq!(
                v[j] == 1.0,
                !seen_before,
                "validity marks first occurrences"
            );
        }
        if distinct == 2.0 {
            two += 1.0;
            let ez = s[z];
            if s.iter().filter(|&&x| x == ez).count() == 2 {
                anchor_on_double += 1.0;
            }
        }
    }
    for (j, slot) in per_slot.iter().enumerate() {
        let c = chi_square(slot, &g, total);
        assert!(c < chi_bound(3), "slot {j}: χ² = {c}");
    }
    let p2: Vec<f64> = (0..9).map(|i| g[i / 3] * g[i % 3]).collect();
    let c = chi_square(&pairs, &p2, total);
    assert!(c < chi_bound(9), "independent pairs: χ² = {c}");
    // z is uniform over the distinct set (1/2), not over the draws (2/3)
    let frac = anchor_on_double / two;
    let se = (0.25 / two).sqrt();
    assert!(
        (frac - 0.5).abs() < 5.0 * se,
        "anchor on the doubled expert: {frac}"
    );
    assert!((frac - 2.0 / 3.0).abs() > 20.0 * se);
}

// ---- 14: degenerate cases --------------------------------------------------------------------

#[test]
fn degenerate_cases_give_one_hot_weights_zero_gradient_and_no_nan() {
    let x = randn(&[20, D], 91);
    // k = 1 (allowed for i, ii, iii): weight exactly 1, router gradient exactly 0.
    for strategy in ["i", "ii", "iii"] {
        for replacement in ["false", "true"] {
            let r = router(
                4,
                1,
                &[("strategy", strategy), ("replacement", replacement)],
                9,
            );
            let out = r.route(&x).unwrap();
            assert!(out.weight.to_vec_f64().unwrap().iter().all(|&w| w == 1.0));
            out.weight
                .mul(&randn(&[20], 92))
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            for (name, p) in params(r.as_ref()) {
                assert!(grad_of(&p).iter().all(|&v| v == 0.0), "{strategy}: {name}");
            }
        }
    }
    // With replacement, a duplicate-only draw (s = {z}): one-hot, zero router gradient.
    let r = router(4, 2, &[("replacement", "true")], 10);
    set_logits(r.as_ref(), &[40.0, 0.0, 0.0, 0.0]);
    let zeros = Tensor::zeros(&[50, D], DType::F64, Device::cpu()).unwrap();
    let out = r.route(&zeros).unwrap();
    assert!(
        out.valid
            .to_vec_f64()
            .unwrap()
            .chunks(2)
            .all(|v| v == [1.0, 0.0])
    );
    assert!(
        out.weight
            .to_vec_f64()
            .unwrap()
            .chunks(2)
            .all(|w| w == [1.0, 0.0])
    );
    out.weight
        .mul(&randn(&[100], 93))
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    for (name, p) in params(r.as_ref()) {
        assert!(
            grad_of(&p).iter().all(|&v| v == 0.0),
            "duplicate-only: {name}"
        );
    }
    // Extreme logits (g_i underflows to 0 for some sampled i) stay finite in f64 and f32.
    for dtype in [DType::F64, DType::F32] {
        for (strategy, replacement) in [
            ("eq3", "false"),
            ("eq3", "true"),
            ("i", "false"),
            ("iii", "true"),
        ] {
            let r = build_router(
                "moesart",
                &config(
                    4,
                    3,
                    &[
                        ("strategy", strategy),
                        ("replacement", replacement),
                        ("trimmed_lasso", "1"),
                    ],
                    11,
                ),
                Device::cpu(),
            )
            .unwrap();
            for (name, p) in params(r.as_ref()) {
                let v = if name == "router.weight" {
                    p.get().zeros_like().unwrap()
                } else {
                    Tensor::from_f64(vec![800.0, -800.0, 0.0, 400.0], &[4], Device::cpu()).unwrap()
                };
                p.set(v.to_dtype(dtype).unwrap()).unwrap();
            }
            let xz = Tensor::zeros(&[30, D], dtype, Device::cpu()).unwrap();
            let out = r.route(&xz).unwrap();
            let w = out.weight.to_vec_f64().unwrap();
            assert!(
                w.iter().all(|v| v.is_finite()),
                "{strategy}/{replacement} {dtype}: {w:?}"
            );
            let loss = out
                .weight
                .mul(&randn(&[90], 94).to_dtype(dtype).unwrap())
                .unwrap()
                .sum_all()
                .unwrap()
                .add(&out.aux_loss.unwrap())
                .unwrap();
            loss.backward().unwrap();
            for (name, p) in params(r.as_ref()) {
                assert!(
                    grad_of(&p).iter().all(|v| v.is_finite()),
                    "{strategy} {dtype}: {name}"
                );
            }
        }
    }
}

// ---- 15: inference ---------------------------------------------------------------------------

#[test]
fn inference_is_the_mean_of_the_top_k_deterministic_and_independent_of_tau() {
    let (n, k, t) = (6, 3, 25);
    let x = randn(&[t, D], 101).mul_scalar(2.0).unwrap();
    let mut reference: Option<(Vec<i32>, Vec<f64>)> = None;
    for tau in ["0.2", "1", "5"] {
        let r = router(n, k, &[("tau", tau)], 12);
        r.set_training(false);
        let a = r.route(&x).unwrap();
        let b = r.route(&x).unwrap();
        let (e, w) = (
            a.expert.to_vec_i32().unwrap(),
            a.weight.to_vec_f64().unwrap(),
        );
        assert_eq!(e, b.expert.to_vec_i32().unwrap(), "deterministic");
        assert_eq!(w, b.weight.to_vec_f64().unwrap());
        assert!(
            w.iter().all(|&v| (v - 1.0 / 3.0).abs() < 1e-15),
            "weights 1/k"
        );
        // the experts are the top k of the logits, largest first
        let o = a.logits.to_vec_f64().unwrap();
        for tok in 0..t {
            let mut order: Vec<usize> = (0..n).collect();
            order.sort_by(|&i, &j| o[tok * n + j].partial_cmp(&o[tok * n + i]).unwrap());
            let top: Vec<i32> = order[..k].iter().map(|&i| i as i32).collect();
            assert_eq!(&e[tok * k..(tok + 1) * k], top.as_slice());
        }
        match &reference {
            None => reference = Some((e, w)),
            Some((e0, w0)) => {
                assert_eq!(&e, e0, "τ = {tau} changed the experts");
                assert_eq!(&w, w0);
            }
        }
    }
    // Through the whole layer: the output is the mean of the k selected experts' outputs.
    let cfg = moe_config(n, k, &[]);
    let l = MoeLayer::new(&cfg, Device::cpu()).unwrap();
    for (_, p) in layer_params(&l) {
        p.set(p.get().to_dtype(DType::F64).unwrap()).unwrap();
    }
    l.set_training(false);
    let y = l.forward(&x).unwrap().y.to_vec_f64().unwrap();
    let all = l.experts().forward(&x).unwrap().to_vec_f64().unwrap(); // [n, T, d]
    let e = l.router().route(&x).unwrap().expert.to_vec_i32().unwrap();
    for tok in 0..t {
        for j in 0..D {
            let mean: f64 = (0..k)
                .map(|s| all[(e[tok * k + s] as usize * t + tok) * D + j])
                .sum::<f64>()
                / k as f64;
            assert!((y[tok * D + j] - mean).abs() < 1e-12);
        }
    }
}

// ---- 16: trimmed lasso -----------------------------------------------------------------------

#[test]
fn trimmed_lasso_value_gradient_and_reach() {
    let (n, k, lambda) = (5, 2, 0.7);
    let logits = [0.3, -0.2, 1.1, 0.05, -0.9];
    let r = router(n, k, &[("trimmed_lasso", "0.7")], 13);
    set_logits(r.as_ref(), &logits);
    let x = Tensor::zeros(&[8, D], DType::F64, Device::cpu()).unwrap();
    let out = r.route(&x).unwrap();
    let g = softmax(&logits);
    let mut sorted = g.clone();
    sorted.sort_by(|a, b| b.partial_cmp(a).unwrap());
    let top: f64 = sorted[..k].iter().sum();
    let aux = out.aux_loss.clone().unwrap();
    assert!((aux.item().unwrap() - lambda * (1.0 - top)).abs() < 1e-14);
    let (_, mass) = out
        .metrics
        .iter()
        .find(|(m, _)| *m == "moesart_bottom_mass")
        .unwrap();
    assert!((mass.item().unwrap() - (1.0 - top)).abs() < 1e-14);
    // ∂R/∂o_l = λ g_l (1[l ∈ bottom] − Σ_bottom g): the top-k set here is {2, 0}.
    aux.backward().unwrap();
    let bottom_mass = 1.0 - top;
    let gb = grad_of(&params(r.as_ref())[1].1);
    for l in 0..n {
        let in_bottom = if l == 2 || l == 0 { 0.0 } else { 1.0 };
        let expect = lambda * g[l] * (in_bottom - bottom_mass);
        assert!(
            (gb[l] - expect).abs() < 1e-14,
            "logit {l}: {} vs {expect}",
            gb[l]
        );
    }
    // No regulariser by default.
    assert!(router(n, k, &[], 13).route(&x).unwrap().aux_loss.is_none());
    // In a layer the regulariser's gradient reaches only the router's parameters.
    let cfg = moe_config(n, k, &[("trimmed_lasso", "0.5")]);
    let l = MoeLayer::new(&cfg, Device::cpu()).unwrap();
    let out = l
        .forward(&randn(&[7, D], 111).to_dtype(DType::F32).unwrap())
        .unwrap();
    out.aux_loss.backward().unwrap();
    for (name, p) in layer_params(&l) {
        let g = grad_of(&p);
        if name.starts_with("router.") {
            assert!(
                g.iter().any(|&v| v != 0.0),
                "{name} gets the regulariser's gradient"
            );
        } else {
            assert!(g.iter().all(|&v| v == 0.0), "{name} must not");
        }
    }
}

// ---- configuration errors --------------------------------------------------------------------

fn build_err(n: usize, k: usize, opts: &[(&str, &str)]) -> String {
    match build_router("moesart", &config(n, k, opts, 0), Device::cpu()) {
        Ok(_) => panic!("moesart {opts:?} with k = {k} should be rejected"),
        Err(e) => {
            assert!(matches!(e, Error::Invalid(_)), "{e:?}");
            e.to_string()
        }
    }
}

#[test]
fn k_below_two_with_eq3_and_bad_options_are_errors() {
    let e = build_err(4, 1, &[]);
    assert!(
        e.contains("eq3") && e.contains("--k 1") && e.contains("gradient"),
        "{e}"
    );
    let e = build_err(4, 1, &[("strategy", "eq3")]);
    assert!(e.contains("eq3"), "{e}");
    assert!(
        build_router(
            "moesart",
            &config(4, 1, &[("strategy", "ii")], 0),
            Device::cpu()
        )
        .is_ok()
    );
    let e = build_err(4, 2, &[("temperature", "2")]);
    assert!(
        e.contains("temperature") && e.contains("tau") && e.contains("trimmed_lasso"),
        "{e}"
    );
    for (key, value) in [
        ("tau", "0"),
        ("tau", "-1"),
        ("tau", "abc"),
        ("strategy", "iv"),
        ("replacement", "maybe"),
        ("trimmed_lasso", "-0.1"),
        ("trimmed_lasso", "nan"),
    ] {
        let e = build_err(4, 2, &[(key, value)]);
        assert!(e.contains(key), "{key}={value}: {e}");
    }
    let e = build_err(4, 5, &[]);
    assert!(e.contains("--k 5"), "{e}");
    // the sampler checks its own arguments
    let logits = randn(&[2, 3], 1);
    assert!(MoesartDraw::sample(&logits, 4, false, 0).is_err());
    assert!(MoesartDraw::sample(&logits, 4, true, 0).is_ok());
    let d = MoesartDraw::sample(&logits, 2, false, 0).unwrap();
    assert!(
        MoesartStrategy::Eq3
            .weights(&randn(&[3, 3], 2), &d)
            .is_err()
    );
    let one = MoesartDraw::sample(&logits, 1, false, 0).unwrap();
    assert!(MoesartStrategy::Eq3.weights(&logits, &one).is_err());
}

// ---- GPU parity ------------------------------------------------------------------------------

#[test]
fn device_parity_of_weights_and_backward() {
    let (n, k, t) = (6, 3, 16);
    let x = randn(&[t, D], 121).mul_scalar(2.0).unwrap();
    let up = randn(&[t * k], 122);
    let run = |r: &dyn Router, dev: Device, dtype: DType| {
        let xs = x
            .to_dtype(dtype)
            .unwrap()
            .to_device(dev)
            .unwrap()
            .with_grad()
            .unwrap();
        let out = r.route(&xs).unwrap();
        let c = up.to_dtype(dtype).unwrap().to_device(dev).unwrap();
        let aux = out.aux_loss.clone().unwrap();
        out.weight
            .mul(&c)
            .unwrap()
            .sum_all()
            .unwrap()
            .add(&aux)
            .unwrap()
            .backward()
            .unwrap();
        let mut v = vec![
            out.weight.to_vec_f64().unwrap(),
            xs.grad().unwrap().to_vec_f64().unwrap(),
        ];
        v.extend(params(r).iter().map(|(_, p)| grad_of(p)));
        (out.expert.to_vec_i32().unwrap(), v)
    };
    for dev in common::devices("device_parity_of_weights_and_backward") {
        for training in [false, true] {
            for replacement in ["false", "true"] {
                let opts = [
                    ("replacement", replacement),
                    ("trimmed_lasso", "0.2"),
                    ("tau", "0.8"),
                ];
                let reference = router(n, k, &opts, 14);
                reference.set_training(training);
                let on_dev = build_router("moesart", &config(n, k, &opts, 14), dev).unwrap();
                on_dev.set_training(training);
                for ((_, a), (_, b)) in params(reference.as_ref())
                    .iter()
                    .zip(&params(on_dev.as_ref()))
                {
                    b.set(
                        a.get()
                            .to_dtype(DType::F32)
                            .unwrap()
                            .to_device(dev)
                            .unwrap(),
                    )
                    .unwrap();
                }
                let (e0, v0) = run(reference.as_ref(), Device::cpu(), DType::F64);
                let (e1, v1) = run(on_dev.as_ref(), dev, DType::F32);
                let what = format!("{dev} training {training} replacement {replacement}");
                assert_eq!(e0, e1, "{what}: the same experts must be drawn");
                for (i, (a, b)) in v1.iter().zip(&v0).enumerate() {
                    common::assert_close(&format!("{what}: tensor {i}"), a, b, 2e-4, 2e-3);
                }
            }
        }
    }
}
