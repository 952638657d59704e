//! The sparse MoE layer and the Top-k family of routers against the properties the papers
//! state or imply (docs/routers.md gives each router's formula and paper): simplex and sparsity,
//! sparse-evaluation invariance, gradcheck of
//! the whole layer at generic points, shift invariance, Shazeer's zero gradients, V-MoE/SMoE
//! gradients for unselected experts, noise statistics, Expert Choice's exact load, priority and
//! capacity, the balance loss, Switch's jitter support, ties, GPU parity of dispatch, grouped
//! matmul, combine and their backward, and a block's residual added by the layer
//! (`forward_sequences_add`) with the bits of the add.

mod common;

use moegrad::gradcheck::{GradcheckOptions, gradcheck};
use moegrad::moe::{
    Capacity, DispatchPlan, MoeConfig, MoeLayer, ROUTER_NAMES, Routing, balance_loss,
};
use moegrad::moe::{normal_noise, uniform_noise};
use moegrad::nn::Param;
use moegrad::nn::Parameters;
use moegrad::{DType, Device, Result, Tensor};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn randn(shape: &[usize], seed: u64, dtype: DType) -> Tensor {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let n = shape.iter().product();
    let v: Vec<f64> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
    Tensor::from_f64(v, shape, Device::cpu())
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

fn layer(router: &str, n: usize, k: usize, seed: u64) -> MoeLayer {
    let mut cfg = MoeConfig::new(5, 4, n, k);
    cfg.router = router.into();
    cfg.seed = seed;
    MoeLayer::new(&cfg, Device::cpu()).unwrap()
}

fn params(l: &MoeLayer) -> Vec<(String, Param)> {
    let mut v = Vec::new();
    l.visit_params("", &mut |n, p| v.push((n, p.clone())));
    v
}

/// Converts every parameter to f64 (the layer then computes in f64).
fn to_f64(l: &MoeLayer) {
    for (_, p) in params(l) {
        p.set(p.get().to_dtype(DType::F64).unwrap().detach())
            .unwrap();
    }
}

/// Router weight 0 and bias = `logits`: every token gets these logits.
fn set_logits(l: &MoeLayer, logits: &[f64]) {
    for (name, p) in params(l) {
        let t = p.get();
        if name == "router.weight" {
            p.set(t.zeros_like().unwrap()).unwrap();
        } else if name == "router.bias" {
            p.set(
                Tensor::from_f64(logits.to_vec(), &[logits.len()], Device::cpu())
                    .unwrap()
                    .to_dtype(t.dtype())
                    .unwrap(),
            )
            .unwrap();
        }
    }
}

fn dense_reference(l: &MoeLayer, x: &Tensor, r: &Routing) -> Vec<f64> {
    let all = l.experts().forward(x).unwrap().to_vec_f64().unwrap(); // [n, T, d_out]
    let (t, d_out) = (x.shape()[0], l.config().d_out);
    let (tok, ex, w) = (
        r.token.to_vec_i32().unwrap(),
        r.expert.to_vec_i32().unwrap(),
        r.weight.to_vec_f64().unwrap(),
    );
    let mut y = vec![0.0; t * d_out];
    for a in 0..tok.len() {
        for j in 0..d_out {
            y[tok[a] as usize * d_out + j] +=
                w[a] * all[(ex[a] as usize * t + tok[a] as usize) * d_out + j];
        }
    }
    y
}

#[test]
fn every_router_matches_the_dense_reference() {
    for name in ROUTER_NAMES {
        for training in [false, true] {
            let l = layer(name, 4, 2, 11);
            to_f64(&l);
            l.set_training(training);
            let x = randn(&[9, 5], 3, DType::F64);
            let r = l.router().route(&x).unwrap();
            let y = l
                .forward_routed(&x, std::slice::from_ref(&r))
                .unwrap()
                .y
                .to_vec_f64()
                .unwrap();
            common::assert_close(
                &format!("{name} (training {training})"),
                &y,
                &dense_reference(&l, &x, &r),
                1e-12,
                1e-12,
            );
        }
    }
}

#[test]
fn weights_lie_on_the_simplex_or_below_it_and_are_k_sparse() {
    let x = randn(&[16, 5], 4, DType::F64);
    for name in [
        "softmax",
        "topk",
        "topk-unnorm",
        "vmoe",
        "smoe",
        "xmoe-cosine",
        "switch",
    ] {
        let l = layer(name, 6, 3, 5);
        to_f64(&l);
        l.set_training(false);
        let r = l.router().route(&x).unwrap();
        let per_token = r.len() / 16;
        assert!(
            per_token
                <= if name == "softmax" {
                    6
                } else if name == "switch" {
                    1
                } else {
                    3
                },
            "{name}"
        );
        let w = r.weight.to_vec_f64().unwrap();
        let probs = r.probs.to_vec_f64().unwrap();
        for t in 0..16 {
            let s: f64 = w[t * per_token..(t + 1) * per_token].iter().sum();
            if name == "softmax" || name == "topk" {
                assert!((s - 1.0).abs() < 1e-12, "{name}: token {t} sums to {s}");
            } else {
                // Zero-filled top-k of a softmax: the top-k probability mass, below 1.
                let mut p: Vec<f64> = probs[t * 6..(t + 1) * 6].to_vec();
                p.sort_by(|a, b| b.partial_cmp(a).unwrap());
                let mass: f64 = p[..per_token].iter().sum();
                assert!(
                    (s - mass).abs() < 1e-12 && s < 1.0,
                    "{name}: token {t}: {s} vs top-k mass {mass}"
                );
            }
        }
    }
}

fn loss_of(out: &Tensor) -> Tensor {
    let c = randn(out.shape(), 99, out.dtype());
    out.mul(&c)
        .unwrap()
        .sum_all()
        .unwrap()
        .add(
            &out.mul(out)
                .unwrap()
                .sum_all()
                .unwrap()
                .mul_scalar(0.1)
                .unwrap(),
        )
        .unwrap()
}

#[test]
fn whole_layer_gradcheck_at_generic_points() {
    let opts = GradcheckOptions::default();
    for name in ROUTER_NAMES {
        for training in [false, true] {
            if *name == "hash" && training {
                continue;
            }
            let proto = layer(name, 4, 2, 21);
            // Gradient estimators (SparseMixer, ST, ReinMax, ...) differ from the exact gradient
            // of their sampled forward on purpose: only their evaluation path is checked here.
            if training && proto.router().estimates_gradient() {
                continue;
            }
            let names: Vec<String> = params(&proto).into_iter().map(|(n, _)| n).collect();
            let mut inputs = vec![randn(&[6, 5], 8, DType::F64)];
            inputs.extend(
                params(&proto)
                    .into_iter()
                    .map(|(_, p)| p.get().to_dtype(DType::F64).unwrap().detach()),
            );
            let f = |t: &[Tensor]| -> Result<Tensor> {
                let l = layer(name, 4, 2, 21); // a fresh layer: the same noise draw in every call
                l.set_training(training);
                for (p, v) in params(&l).into_iter().zip(&t[1..]) {
                    p.1.set(v.clone())?;
                }
                let out = l.forward(&t[0])?;
                Ok(loss_of(&out.y))
            };
            // Nonzero biases, so that no hidden unit sits exactly at the ReLU kink.
            for (i, n) in names.iter().enumerate() {
                if n.ends_with("b1") || n.ends_with("b2") || n.ends_with("bias") {
                    inputs[i + 1] = randn(inputs[i + 1].shape(), 30 + i as u64, DType::F64)
                        .mul_scalar(0.3)
                        .unwrap();
                }
            }
            let masked = name.starts_with("sparsemixer");
            if masked {
                sparsemixer_logits_keeping_three_experts(&names, &mut inputs[1..]);
            }
            if let Err(e) = gradcheck(f, &inputs, &opts) {
                panic!("{name} (training {training}): {e}");
            }
            if masked {
                assert_sparsemixer_router_gradient_is_nonzero(name, &names, &inputs, &f);
            }
        }
    }
}

/// SparseMixer's r = 0.1 mask keeps only the argmax at small logits (π_a = 1, so the router
/// gradient is exactly zero on both sides of a gradcheck). Sets the gate bias to logits 2, 1.85,
/// 1.7, 1 (experts 0–2 kept with margins ≥ 0.07, expert 3 masked) and scales the gate weight by
/// 0.01 so that x·W (|x| ≤ 1, d = 5) moves no logit by more than 0.045.
fn sparsemixer_logits_keeping_three_experts(names: &[String], params: &mut [Tensor]) {
    for (n, p) in names.iter().zip(params) {
        if n == "router.bias" {
            *p = Tensor::from_f64(vec![2.0, 1.85, 1.7, 1.0], &[4], Device::cpu()).unwrap();
        } else if n == "router.weight" {
            *p = p.mul_scalar(0.01).unwrap();
        }
    }
}

/// Asserts that the gradcheck of `f` at `inputs` (tokens, then the layer's parameters) compared
/// something: the gate (router.weight, router.bias) gets a gradient that is not ~0 and the mask
/// kept three experts for every token.
fn assert_sparsemixer_router_gradient_is_nonzero(
    name: &str,
    names: &[String],
    inputs: &[Tensor],
    f: &dyn Fn(&[Tensor]) -> Result<Tensor>,
) {
    let leaves: Vec<Tensor> = inputs
        .iter()
        .map(|t| t.detach().with_grad().unwrap())
        .collect();
    f(&leaves).unwrap().backward().unwrap();
    for (n, leaf) in names.iter().zip(&leaves[1..]) {
        if n == "router.weight" || n == "router.bias" {
            let g = leaf.grad().unwrap().to_vec_f64().unwrap();
            let largest = g.iter().fold(0.0f64, |m, v| m.max(v.abs()));
            assert!(largest > 1e-3, "{name}: {n} gradient is ~0: {g:?}");
        }
    }
    let l = layer(name, 4, 2, 21);
    to_f64(&l);
    l.set_training(false);
    for (p, v) in params(&l).into_iter().zip(&inputs[1..]) {
        p.1.set(v.clone()).unwrap();
    }
    let probs = l
        .router()
        .route(&inputs[0])
        .unwrap()
        .probs
        .to_vec_f64()
        .unwrap();
    for (tok, row) in probs.chunks(4).enumerate() {
        let kept = row.iter().filter(|&&p| p > 0.0).count();
        assert_eq!(kept, 3, "{name}: token {tok} keeps {kept} experts: {row:?}");
    }
}

#[test]
fn grouped_matmul_gradcheck_and_zero_gradient_for_idle_experts() {
    // 7 rows over 4 experts, sorted, expert 2 idle, one dropped row (−1).
    let x = randn(&[7, 3], 1, DType::F64);
    let w = randn(&[4, 3, 2], 2, DType::F64);
    let row_expert = Tensor::from_i32(vec![0, 0, 1, 3, 3, 3, -1], &[7], Device::cpu()).unwrap();
    let offsets = Tensor::from_i32(vec![0, 2, 3, 3, 6], &[5], Device::cpu()).unwrap();
    let f = |t: &[Tensor]| t[0].grouped_matmul(&t[1], &row_expert, &offsets);
    gradcheck(f, &[x.clone(), w.clone()], &GradcheckOptions::default()).unwrap();
    let (xg, wg) = (x.detach().with_grad().unwrap(), w.with_grad().unwrap());
    let y = xg.grouped_matmul(&wg, &row_expert, &offsets).unwrap();
    assert!(
        y.to_vec_f64().unwrap()[12..].iter().all(|&v| v == 0.0),
        "dropped row must be zero"
    );
    y.sum_all().unwrap().backward().unwrap();
    let gw = wg.grad().unwrap().to_vec_f64().unwrap();
    assert!(
        gw[12..18].iter().all(|&v| v == 0.0),
        "idle expert 2 must get exactly zero gradient"
    );
    let e = x
        .grouped_matmul(&randn(&[4, 2, 2], 3, DType::F64), &row_expert, &offsets)
        .unwrap_err()
        .to_string();
    assert!(e.contains("[7, 3]") && e.contains("[4, 2, 2]"), "{e}");
}

/// A bank larger than its rows (8 experts of 3×2 = 48 values, 4 rows: 4·(3+2) = 20) keeps its
/// gradient deferred (computed when read, or inside Adam); read, it passes the same check.
#[test]
fn grouped_matmul_gradcheck_with_a_deferred_bank_gradient() {
    let x = randn(&[4, 3], 4, DType::F64);
    let w = randn(&[8, 3, 2], 5, DType::F64);
    let row_expert = Tensor::from_i32(vec![1, 1, 4, 7], &[4], Device::cpu()).unwrap();
    let offsets = Tensor::from_i32(vec![0, 0, 2, 2, 2, 3, 3, 3, 4], &[9], Device::cpu()).unwrap();
    let f = |t: &[Tensor]| t[0].grouped_matmul(&t[1], &row_expert, &offsets);
    gradcheck(f, &[x.clone(), w.clone()], &GradcheckOptions::default()).unwrap();
    let wg = w.with_grad().unwrap();
    x.grouped_matmul(&wg, &row_expert, &offsets)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert!(
        wg.grad_is_deferred(),
        "the bank's gradient was not deferred"
    );
    let gw = wg.grad().unwrap().to_vec_f64().unwrap();
    assert!(
        gw[..6].iter().chain(&gw[12..24]).all(|&v| v == 0.0),
        "idle experts must get exactly zero gradient"
    );
}

#[test]
fn sparse_evaluation_invariance_with_nan_in_unselected_experts() {
    for name in ["topk", "switch", "topk-unnorm", "vmoe", "hash"] {
        let l = layer(name, 6, 2, 31);
        to_f64(&l);
        l.set_training(false);
        let x = randn(&[3, 5], 6, DType::F64);
        assert_idle_experts_untouched(name, &l, &x, 6);
    }
}

/// The same for CNN experts (the grouped convolutions read each expert's filters only for its
/// own images): idle experts get exactly zero gradient, and NaN in them changes nothing.
#[test]
fn cnn_experts_idle_get_zero_gradient_and_ignore_nan() {
    let mut cfg = MoeConfig::new(256, 8, 6, 2);
    cfg.expert_kind = moegrad::moe::ExpertKind::Cnn { side: 16 };
    cfg.d_out = 50;
    cfg.seed = 8;
    let l = MoeLayer::new(&cfg, Device::cpu()).unwrap();
    to_f64(&l);
    l.set_training(false);
    let x = randn(&[2, 256], 15, DType::F64);
    assert_idle_experts_untouched("cnn experts", &l, &x, 6);
}

/// Runs `l` (`n` experts) forward and backward on `x`, checks that the experts no token chose
/// got exactly zero gradient, then fills those experts with NaN and checks that the output, the
/// input gradient and every other gradient are unchanged bit for bit.
fn assert_idle_experts_untouched(name: &str, l: &MoeLayer, x: &Tensor, n: usize) {
    let run = |l: &MoeLayer| {
        for (_, p) in params(l) {
            p.zero_grad();
        }
        let xg = x.detach().with_grad().unwrap();
        let out = l.forward(&xg).unwrap();
        loss_of(&out.y).backward().unwrap();
        let grads: Vec<Vec<f64>> = params(l)
            .iter()
            .map(|(_, p)| p.grad().unwrap().to_vec_f64().unwrap())
            .collect();
        (
            out.y.to_vec_f64().unwrap(),
            xg.grad().unwrap().to_vec_f64().unwrap(),
            grads,
            out.stats,
        )
    };
    let (y0, gx0, g0, stats) = run(l);
    let kept = stats.kept_per_expert.to_vec_f64().unwrap();
    let unused: Vec<usize> = (0..n).filter(|&e| kept[e] == 0.0).collect();
    assert!(
        !unused.is_empty(),
        "{name}: these tokens × k should leave an expert idle"
    );
    // Expert parameters of idle experts got exactly zero gradient.
    for (i, (pname, _)) in params(l).iter().enumerate() {
        if pname.starts_with("experts.") {
            let per = g0[i].len() / n;
            for &e in &unused {
                assert!(
                    g0[i][e * per..(e + 1) * per].iter().all(|&v| v == 0.0),
                    "{name}: {pname} of idle expert {e}"
                );
            }
        }
    }
    // Fill the idle experts with NaN: nothing may change.
    for (pname, p) in params(l) {
        if pname.starts_with("experts.") {
            let mut v = p.get().to_vec_f64().unwrap();
            let per = v.len() / n;
            for &e in &unused {
                v[e * per..(e + 1) * per]
                    .iter_mut()
                    .for_each(|x| *x = f64::NAN);
            }
            p.set(Tensor::from_f64(v, p.get().shape(), Device::cpu()).unwrap())
                .unwrap();
        }
    }
    let (y1, gx1, g1, _) = run(l);
    assert_eq!(y0, y1, "{name}: output changed");
    assert_eq!(gx0, gx1, "{name}: input gradient changed");
    for (i, (pname, _)) in params(l).iter().enumerate() {
        let per = g1[i].len() / if pname.starts_with("experts.") { n } else { 1 };
        let same = g0[i].iter().zip(&g1[i]).enumerate().all(|(j, (a, b))| {
            let idle = pname.starts_with("experts.") && unused.contains(&(j / per));
            if idle { *b == 0.0 } else { a == b }
        });
        assert!(same, "{name}: gradient of {pname} changed");
    }
}

fn router_grad(l: &MoeLayer, x: &Tensor) -> Vec<f64> {
    for (_, p) in params(l) {
        p.zero_grad();
    }
    let out = l.forward(x).unwrap();
    loss_of(&out.y).backward().unwrap();
    params(l)
        .iter()
        .find(|(n, _)| n == "router.bias")
        .map(|(_, p)| p.grad().unwrap().to_vec_f64().unwrap())
        .unwrap()
}

#[test]
fn shift_invariance_and_shazeer_topk_gradients() {
    let x = randn(&[1, 5], 7, DType::F64);
    let logits = [0.3, -0.2, 1.1, 0.05, -0.9];
    for name in ["softmax", "topk"] {
        let l = layer(name, 5, 2, 41);
        to_f64(&l);
        l.set_training(false);
        set_logits(&l, &logits);
        let w0 = l.router().route(&x).unwrap().weight.to_vec_f64().unwrap();
        let g = router_grad(&l, &x);
        assert!(
            g.iter().sum::<f64>().abs() < 1e-12,
            "{name}: Σ ∂L/∂o = {}",
            g.iter().sum::<f64>()
        );
        set_logits(&l, &logits.map(|v| v + 3.7));
        let w1 = l.router().route(&x).unwrap().weight.to_vec_f64().unwrap();
        common::assert_close(&format!("{name} shifted"), &w1, &w0, 1e-12, 0.0);
        if name == "topk" {
            // Selected: experts 2 and 0. Unselected logits get exactly zero gradient.
            for j in [1, 3, 4] {
                assert_eq!(g[j], 0.0, "unselected expert {j}");
            }
            assert!(g[2] != 0.0 && g[0] != 0.0);
        }
    }
    // k = 1: the weight is exactly 1 and the router gets no gradient.
    let l = layer("topk", 5, 1, 42);
    to_f64(&l);
    set_logits(&l, &logits);
    assert_eq!(
        l.router().route(&x).unwrap().weight.to_vec_f64().unwrap(),
        vec![1.0]
    );
    assert!(router_grad(&l, &x).iter().all(|&v| v == 0.0));
    // k = n: Top-k equals the dense softmax.
    let (a, b) = (layer("topk", 5, 5, 43), layer("softmax", 5, 2, 43));
    to_f64(&a);
    to_f64(&b);
    let xs = randn(&[4, 5], 8, DType::F64);
    common::assert_close(
        "k = n",
        &a.forward(&xs).unwrap().y.to_vec_f64().unwrap(),
        &b.forward(&xs).unwrap().y.to_vec_f64().unwrap(),
        1e-12,
        1e-12,
    );
}

#[test]
fn vmoe_smoe_unnormalised_give_gradient_to_unselected_experts_even_at_k1() {
    let x = randn(&[1, 5], 9, DType::F64);
    for name in ["vmoe", "smoe", "topk-unnorm"] {
        let l = layer(name, 5, 1, 51);
        to_f64(&l);
        l.set_training(false);
        set_logits(&l, &[0.3, -0.2, 1.1, 0.05, -0.9]);
        let g = router_grad(&l, &x);
        assert!(g.iter().all(|&v| v != 0.0), "{name}: {g:?}");
    }
}

#[test]
fn noise_statistics() {
    // Standard normal: mean 0 (s.e. 1/√N), variance 1 (s.e. √(2/N)); N = 200k, 5 standard errors.
    let n = 200_000;
    let z = normal_noise(&Tensor::zeros(&[n], DType::F32, Device::cpu()).unwrap(), 3)
        .unwrap()
        .to_vec_f64()
        .unwrap();
    let mean = z.iter().sum::<f64>() / n as f64;
    let var = z.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n as f64;
    assert!(mean.abs() < 5.0 / (n as f64).sqrt(), "mean {mean}");
    assert!(
        (var - 1.0).abs() < 5.0 * (2.0 / n as f64).sqrt(),
        "variance {var}"
    );
    // SMoE's jitter: in [0.98, 1.02), mean 1 (s.e. 0.04/√12/√N).
    let u = uniform_noise(
        &Tensor::zeros(&[n], DType::F32, Device::cpu()).unwrap(),
        0.98,
        1.02,
        4,
    )
    .unwrap()
    .to_vec_f64()
    .unwrap();
    assert!(u.iter().all(|&v| (0.98..1.02).contains(&v)));
    let um = u.iter().sum::<f64>() / n as f64;
    assert!(
        (um - 1.0).abs() < 5.0 * 0.04 / 12f64.sqrt() / (n as f64).sqrt(),
        "jitter mean {um}"
    );
    // V-MoE: with zero logits, log p_i − mean_j log p_j = ε_i − mean ε, std (1/n)·√((n−1)/n).
    let experts = 8;
    let l = layer("vmoe", experts, 2, 61);
    set_logits(&l, &[0.0; 8]);
    let x = Tensor::zeros(&[20_000, 5], DType::F32, Device::cpu()).unwrap();
    let p = l.router().route(&x).unwrap().probs.to_vec_f64().unwrap();
    let mut dev = Vec::new();
    for row in p.chunks(experts) {
        let logs: Vec<f64> = row.iter().map(|v| v.ln()).collect();
        let m = logs.iter().sum::<f64>() / experts as f64;
        dev.extend(logs.iter().map(|v| v - m));
    }
    let sd = (dev.iter().map(|v| v * v).sum::<f64>() / dev.len() as f64).sqrt();
    let expect = (1.0 / experts as f64) * ((experts as f64 - 1.0) / experts as f64).sqrt();
    assert!(
        (sd / expect - 1.0).abs() < 0.02,
        "V-MoE noise std {sd}, expected {expect}"
    );
    // Evaluation mode draws no noise.
    l.set_training(false);
    let a = l
        .router()
        .route(&x.slice(0, 0, 4).unwrap())
        .unwrap()
        .probs
        .to_vec_f64()
        .unwrap();
    assert!(a.iter().all(|&v| (v - 0.125).abs() < 1e-7));
}

#[test]
fn expert_choice_gives_every_expert_exactly_k_prime_tokens() {
    let l = layer("expert-choice", 4, 2, 71);
    let x = randn(&[10, 5], 10, DType::F32);
    let out = l.forward(&x).unwrap();
    // k' = round(10·2/4) = 5
    assert_eq!(
        out.stats.kept_per_expert.to_vec_f64().unwrap(),
        vec![5.0; 4]
    );
}

#[test]
fn switch_jitter_never_selects_an_expert_outside_its_support() {
    // θ = (2.0, 1.7, 1.5), r = 0.1: expert 3 has θ* − θ₃ = 0.5 > 0.1·(2 + 1.5), never chosen.
    let l = layer("switch", 3, 1, 81);
    set_logits(&l, &[2.0, 1.7, 1.5]);
    let x = Tensor::zeros(&[100_000, 5], DType::F32, Device::cpu()).unwrap();
    let r = l.router().route(&x).unwrap();
    let ex = r.expert.to_vec_i32().unwrap();
    let count = |e| ex.iter().filter(|&&v| v == e).count();
    assert_eq!(count(2), 0);
    assert!(
        count(1) > 0 && count(0) > count(1),
        "{} {}",
        count(0),
        count(1)
    );
}

#[test]
fn ties_go_to_the_lowest_index() {
    let l = layer("topk", 5, 2, 91);
    set_logits(&l, &[0.5, 1.0, 1.0, 1.0, 0.5]);
    let x = Tensor::zeros(&[2, 5], DType::F32, Device::cpu()).unwrap();
    assert_eq!(
        l.router().route(&x).unwrap().expert.to_vec_i32().unwrap(),
        vec![1, 2, 1, 2]
    );
}

fn manual_routing(
    experts: &[i32],
    weights: &[f64],
    ranks: &[f64],
    tokens: &[i32],
    n: usize,
    t: usize,
) -> Routing {
    let a = experts.len();
    let dev = Device::cpu();
    Routing {
        token: Tensor::from_i32(tokens.to_vec(), &[a], dev).unwrap(),
        expert: Tensor::from_i32(experts.to_vec(), &[a], dev).unwrap(),
        weight: Tensor::from_f64(weights.to_vec(), &[a], dev).unwrap(),
        valid: Tensor::ones(&[a], DType::F64, dev).unwrap(),
        rank: Tensor::from_f64(ranks.to_vec(), &[a], dev).unwrap(),
        probs: Tensor::full(&[t, n], 1.0 / n as f64, DType::F64, dev).unwrap(),
        logits: Tensor::zeros(&[t, n], DType::F64, dev).unwrap(),
        // tokens in any order
        slots_per_token: None,
        tokens: t,
        experts: n,
        aux_loss: None,
        metrics: Vec::new(),
        score: None,
        selection: None,
        defaults: None,
        dense: None,
    }
}

#[test]
fn priority_and_capacity() {
    // 4 tokens × 2 slots over 2 experts. Expert 0 receives: t0 slot0 (0.6), t1 slot1 (0.45),
    // t2 slot0 (0.7), t3 slot1 (0.2); capacity 2 keeps the two first choices t2, t0 (by weight),
    // so both second choices are dropped even though t1's weight beats nothing of rank 0.
    let experts = [0, 1, 1, 0, 0, 1, 1, 0];
    let weights = [0.6, 0.4, 0.55, 0.45, 0.7, 0.3, 0.8, 0.2];
    let ranks = [0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0];
    let tokens = [0, 0, 1, 1, 2, 2, 3, 3];
    let r = manual_routing(&experts, &weights, &ranks, &tokens, 2, 4);
    let plan = DispatchPlan::build(
        &r,
        Capacity::Factor {
            factor: 0.5,
            min_capacity: 0,
        },
    )
    .unwrap();
    assert_eq!(plan.capacity, Some(2));
    let order = plan.order.to_vec_i32().unwrap();
    let kept = plan.row_kept.to_vec_f64().unwrap();
    let kept_ids: Vec<i32> = order
        .iter()
        .zip(&kept)
        .filter(|(_, k)| **k == 1.0)
        .map(|(o, _)| *o)
        .collect();
    // Expert 0: t2 (a=4), t0 (a=0); expert 1: t3 slot0 (a=6, 0.8), t1 slot0 (a=2, 0.55).
    assert_eq!(kept_ids, vec![4, 0, 6, 2]);
    assert_eq!(plan.kept_per_expert.to_vec_f64().unwrap(), vec![2.0, 2.0]);
    assert_eq!(plan.routed_per_expert.to_vec_f64().unwrap(), vec![4.0, 4.0]);
    // Dropped rows contribute nothing: with capacity 1 token 1 and 3... all second choices go.
    let l = layer("topk", 2, 2, 101);
    to_f64(&l);
    let mut cfg = l.config().clone();
    cfg.capacity = Capacity::Factor {
        factor: 0.25,
        min_capacity: 0,
    };
    let lc = MoeLayer::new(&cfg, Device::cpu()).unwrap();
    to_f64(&lc);
    for ((_, a), (_, b)) in params(&l).iter().zip(params(&lc).iter()) {
        b.set(a.get().detach()).unwrap();
    }
    let x = randn(&[4, 5], 11, DType::F64);
    let y = lc.forward_routed(&x, std::slice::from_ref(&r)).unwrap();
    // capacity ceil(0.25·8/2) = 1: expert 0 keeps t2 only, expert 1 keeps t3 only; t0 and t1 get y = 0.
    let yv = y.y.to_vec_f64().unwrap();
    assert!(
        yv[..10].iter().all(|&v| v == 0.0),
        "tokens whose assignments were all dropped output 0"
    );
    assert!(yv[10..].iter().any(|&v| v != 0.0));
    let s = y.stats.read().unwrap();
    assert!((s.drop_rate - 0.75).abs() < 1e-12);
    // γ ≥ n: nothing dropped, equal to the dropless layer.
    let mut big = cfg.clone();
    big.capacity = Capacity::Factor {
        factor: 2.0,
        min_capacity: 0,
    };
    let lb = MoeLayer::new(&big, Device::cpu()).unwrap();
    to_f64(&lb);
    for ((_, a), (_, b)) in params(&l).iter().zip(params(&lb).iter()) {
        b.set(a.get().detach()).unwrap();
    }
    let yb = lb
        .forward_routed(&x, std::slice::from_ref(&r))
        .unwrap()
        .y
        .to_vec_f64()
        .unwrap();
    let yd = l
        .forward_routed(&x, std::slice::from_ref(&r))
        .unwrap()
        .y
        .to_vec_f64()
        .unwrap();
    assert_eq!(yb, yd);
}

#[test]
fn balance_loss_values_and_gradient() {
    let dev = Device::cpu();
    let n = 4;
    let uniform = manual_routing(&[0, 1, 2, 3], &[1.0; 4], &[0.0; 4], &[0, 1, 2, 3], n, 4);
    let routed = Tensor::from_f64(vec![1.0; 4], &[4], dev).unwrap();
    assert!(
        (balance_loss(&uniform, &routed, 0.01)
            .unwrap()
            .item()
            .unwrap()
            - 0.01)
            .abs()
            < 1e-12
    );
    let mut collapsed = uniform.clone();
    collapsed.probs = Tensor::from_f64([1.0, 0.0, 0.0, 0.0].repeat(4), &[4, 4], dev).unwrap();
    let all0 = Tensor::from_f64(vec![4.0, 0.0, 0.0, 0.0], &[4], dev).unwrap();
    assert!(
        (balance_loss(&collapsed, &all0, 0.01)
            .unwrap()
            .item()
            .unwrap()
            - 0.04)
            .abs()
            < 1e-12
    );
    // Gradient with respect to the logits, f held fixed.
    let logits = randn(&[5, 4], 12, DType::F64);
    let f_counts = Tensor::from_f64(vec![3.0, 1.0, 4.0, 2.0], &[4], dev).unwrap();
    let f = |t: &[Tensor]| {
        let mut r = uniform.clone();
        r.probs = t[0].softmax(-1)?;
        r.tokens = 5;
        balance_loss(&r, &f_counts, 0.01)
    };
    gradcheck(f, &[logits], &GradcheckOptions::default()).unwrap();
}

#[test]
fn bad_configurations_are_errors() {
    let mut cfg = MoeConfig::new(5, 4, 4, 5);
    assert!(
        MoeLayer::new(&cfg, Device::cpu())
            .err()
            .unwrap()
            .to_string()
            .contains("--k 5")
    );
    cfg.k = 2;
    cfg.router = "nope".into();
    let e = MoeLayer::new(&cfg, Device::cpu())
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("nope") && e.contains("topk"), "{e}");
    let l = layer("topk", 4, 2, 1);
    let e = l
        .forward(&Tensor::zeros(&[3, 6], DType::F32, Device::cpu()).unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("[3, 6]"), "{e}");
}

#[test]
fn gpu_parity_of_the_moe_layer() {
    let Some(gpu) = common::gpu_or_skip("gpu_parity_of_the_moe_layer") else {
        return;
    };
    for name in ROUTER_NAMES {
        let cpu_layer = layer(name, 6, 2, 111);
        to_f64(&cpu_layer);
        cpu_layer.set_training(false);
        let mut cfg = cpu_layer.config().clone();
        cfg.capacity = Capacity::Dropless;
        let gpu_layer = MoeLayer::new(&cfg, gpu).unwrap();
        gpu_layer.set_training(false);
        for ((_, c), (_, g)) in params(&cpu_layer).iter().zip(params(&gpu_layer).iter()) {
            g.set(c.get().to_device(gpu).unwrap()).unwrap();
        }
        let x = randn(&[10, 5], 13, DType::F64);
        let run = |l: &MoeLayer, x: &Tensor| {
            let xg = x.detach().with_grad().unwrap();
            let out = l.forward(&xg).unwrap();
            let up = randn(out.y.shape(), 5, DType::F64)
                .to_device(x.device())
                .unwrap()
                .to_dtype(out.y.dtype())
                .unwrap();
            out.y.backward_with(&up).unwrap();
            let mut v = vec![
                out.y.to_vec_f64().unwrap(),
                xg.grad().unwrap().to_vec_f64().unwrap(),
            ];
            // A parameter may get no gradient at all (topk-noisy's noise weights in eval
            // mode): that must agree between devices too, so it is compared as an empty list.
            v.extend(params(l).iter().map(|(_, p)| match p.grad() {
                Some(g) => g.to_vec_f64().unwrap(),
                None => Vec::new(),
            }));
            (v, out.stats.kept_per_expert.to_vec_f64().unwrap())
        };
        let (c, ck) = run(&cpu_layer, &x);
        let (g, gk) = run(&gpu_layer, &x.to_device(gpu).unwrap());
        assert_eq!(ck, gk, "{name}: the same experts must be chosen");
        for (i, (a, b)) in g.iter().zip(&c).enumerate() {
            common::assert_close(&format!("{name}: tensor {i}"), a, b, 2e-4, 2e-3);
        }
    }
}

#[test]
fn cnn_experts_match_their_dense_reference_and_pass_a_directional_gradcheck() {
    let mut cfg = MoeConfig::new(256, 8, 3, 2);
    cfg.expert_kind = moegrad::moe::ExpertKind::Cnn { side: 16 };
    cfg.d_out = 50;
    cfg.seed = 5;
    let l = MoeLayer::new(&cfg, Device::cpu()).unwrap();
    to_f64(&l);
    l.set_training(false);
    let x = randn(&[4, 256], 14, DType::F64);
    let r = l.router().route(&x).unwrap();
    let y = l
        .forward_routed(&x, std::slice::from_ref(&r))
        .unwrap()
        .y
        .to_vec_f64()
        .unwrap();
    common::assert_close(
        "cnn experts",
        &y,
        &dense_reference(&l, &x, &r),
        1e-10,
        1e-10,
    );
    let mut inputs = vec![x];
    inputs.extend(params(&l).into_iter().map(|(_, p)| p.get().detach()));
    let f = |t: &[Tensor]| -> Result<Tensor> {
        let l = MoeLayer::new(&cfg, Device::cpu())?;
        l.set_training(false);
        for (p, v) in params(&l).into_iter().zip(&t[1..]) {
            p.1.set(v.clone())?;
        }
        Ok(loss_of(&l.forward(&t[0])?.y))
    };
    let opts = GradcheckOptions {
        fast_mode: true,
        ..GradcheckOptions::default()
    };
    gradcheck(f, &inputs, &opts).unwrap();
}

/// The router-entropy metric: ln n for a uniform router, and −Σ p ln p of the router's softmax
/// for given logits (every token gets the same logits here, so the mean is that one value).
#[test]
fn router_entropy_metric_is_the_mean_entropy_of_the_routing_distribution() {
    let n = 4;
    let l = layer("topk", n, 2, 3);
    let x = randn(&[6, 5], 4, DType::F32);
    set_logits(&l, &[0.0; 4]);
    let s = l.forward(&x).unwrap().stats.read().unwrap();
    assert!(
        (s.entropy - (n as f64).ln()).abs() < 1e-5,
        "uniform router: entropy {} vs ln {n}",
        s.entropy
    );
    let logits = [1.5, -0.5, 0.25, 2.0];
    set_logits(&l, &logits);
    let z: f64 = logits.iter().map(|v: &f64| v.exp()).sum();
    let want: f64 = logits
        .iter()
        .map(|v| {
            let p = v.exp() / z;
            -p * p.ln()
        })
        .sum();
    let out = l.forward(&x).unwrap();
    assert_eq!(out.stats.probs.shape(), &[6, n]);
    let got = out.stats.read().unwrap().entropy;
    assert!((got - want).abs() < 1e-5, "entropy {got} vs {want}");
}

/// The output and every gradient (tokens, residual, parameters in order) of `backward_with(up)`
/// through a fresh layer (`router`, shared experts when `shared`, in training) on `dev`, with
/// the residual added by `forward_sequences_add` or by an add after `forward_sequences`; and
/// the kernels the forward ran on a GPU.
fn residual_block(
    router: &str,
    shared: bool,
    dev: Device,
    by_the_layer: bool,
) -> (Vec<Vec<f64>>, Option<u64>) {
    let mut cfg = MoeConfig::new(5, 4, 4, 2);
    cfg.router = router.into();
    cfg.seed = 31;
    if shared {
        cfg.shared.count = 1;
        cfg.shared.hidden = 3;
        cfg.shared.gate = true;
    }
    let l = MoeLayer::new(&cfg, dev).unwrap();
    l.set_training(true);
    let on = |seed| randn(&[6, 5], seed, DType::F32).to_device(dev).unwrap();
    let (x, h) = (on(41).with_grad().unwrap(), on(42).with_grad().unwrap());
    let (y, forward) = with_kernel_count(|| {
        if by_the_layer {
            l.forward_sequences_add(&x, 3, &h).unwrap().y
        } else {
            h.add(&l.forward_sequences(&x, 3).unwrap().y).unwrap()
        }
    });
    y.backward_with(&on(43)).unwrap();
    let host = |t: Tensor| t.to_vec_f64().unwrap();
    let mut values = vec![host(y), host(x.grad().unwrap()), host(h.grad().unwrap())];
    for (name, p) in params(&l) {
        let g = p
            .grad()
            .unwrap_or_else(|| panic!("{router}: no gradient for {name}"));
        values.push(host(g));
    }
    (values, forward)
}

/// `f()` and the kernels it ran on this thread's GPU (`None` on the CPU): the dispatch
/// counters are the process's, and tests run side by side, so this counts with the profiler.
fn with_kernel_count<R>(f: impl FnOnce() -> R) -> (R, Option<u64>) {
    moegrad::profile::enable();
    let r = f();
    let report = moegrad::profile::disable().expect("this thread recorded");
    let kernels = report
        .gpu
        .map(|g| g.kernels.iter().map(|k| k.calls).sum::<u64>());
    (r, kernels)
}

/// `forward_sequences_add` (an MoE block's `h + moe(norm(h))`) against the residual added
/// after `forward_sequences`: the output and every gradient to the bit, on the CPU and the GPU,
/// for a token-choice router (the combine adds the residual), with shared experts, for Expert
/// Choice (no slots) and Default MoE (terms after the combine), where an add does; on the GPU
/// the plain case runs one dispatch fewer forward.
#[test]
fn a_residual_added_by_the_layer_has_the_bits_of_the_add() {
    let mut devices = vec![Device::cpu()];
    devices.extend(common::gpu_or_skip(
        "a_residual_added_by_the_layer_has_the_bits_of_the_add",
    ));
    for dev in devices {
        // once before counting: the first forward on a device makes constants kept for later
        residual_block("topk", false, dev, false);
        for (router, shared) in [
            ("topk", false),
            ("topk", true),
            ("expert-choice", false),
            ("default-moe", false),
        ] {
            let (folded, one) = residual_block(router, shared, dev, true);
            let (added, two) = residual_block(router, shared, dev, false);
            for (i, (f, a)) in folded.iter().zip(&added).enumerate() {
                let same =
                    f.len() == a.len() && f.iter().zip(a).all(|(f, a)| f.to_bits() == a.to_bits());
                assert!(
                    same,
                    "{router} (shared {shared}) on {dev}: value {i} differs"
                );
            }
            if let (Some(one), Some(two)) = (one, two) {
                let fewer = if (router, shared) == ("topk", false) {
                    1
                } else {
                    0
                };
                assert_eq!(
                    one + fewer,
                    two,
                    "{router} (shared {shared}): kernels forward"
                );
            }
        }
    }
}

/// The layer's output `layer` (`gate`: Qwen2-MoE's gated shared expert, else DeepSeek's) on
/// `dev` for tokens `x`, with the shared experts' down projection as it is and zeroed (the
/// routed output alone), the shared experts' `g(x)·down(act(up(x)))` composed from their
/// parameters, and the kernels the first forward ran on a GPU.
fn shared_expert_parts(gate: bool, dev: Device) -> (Tensor, Tensor, Tensor, Option<u64>) {
    let mut cfg = MoeConfig::new(5, 4, 4, 2);
    cfg.seed = 17;
    cfg.shared.count = 2;
    cfg.shared.hidden = 3;
    cfg.shared.gate = gate;
    let l = MoeLayer::new(&cfg, dev).unwrap();
    let x = randn(&[6, 5], 18, DType::F32).to_device(dev).unwrap();
    let p = |name: &str| {
        params(&l)
            .into_iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("no parameter {name}"))
            .1
    };
    let (full, kernels) = with_kernel_count(|| l.forward(&x).unwrap().y);
    let hidden = cfg
        .activation
        .apply(&x.matmul(&p("shared.up.weight").get()).unwrap())
        .unwrap();
    let mut shared = hidden.matmul(&p("shared.down.weight").get()).unwrap();
    if gate {
        let g = x.matmul(&p("shared.gate.weight").get()).unwrap();
        shared = shared.mul(&g.sigmoid().unwrap()).unwrap();
    }
    let down = p("shared.down.weight");
    down.set(down.get().zeros_like().unwrap()).unwrap();
    let routed = l.forward(&x).unwrap().y;
    (full, routed, shared, kernels)
}

/// Shared experts add their output to the routed experts' (DeepSeekMoE, Qwen2-MoE): the layer's
/// output is, to the bit, its output with the shared down projection zeroed plus
/// `g(x)·down(act(up(x)))` composed from the parameters, gated and not, on the CPU and the GPU;
/// ungated, the down projection's kernel adds the routed output: the layer runs the kernels of
/// a layer without shared experts and those of an MLP alone, and no add.
#[test]
fn shared_experts_add_their_mlp_to_the_routed_output() {
    let mut devices = vec![Device::cpu()];
    devices.extend(common::gpu_or_skip(
        "shared_experts_add_their_mlp_to_the_routed_output",
    ));
    for dev in devices {
        // once before counting: the first forward on a device makes constants kept for later
        shared_expert_parts(false, dev);
        for gate in [false, true] {
            let (full, routed, shared, kernels) = shared_expert_parts(gate, dev);
            let want = routed.add(&shared).unwrap().to_vec_f32().unwrap();
            let got = full.to_vec_f32().unwrap();
            assert_eq!(got.len(), want.len());
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(
                    g.to_bits(),
                    w.to_bits(),
                    "gate {gate} on {dev}: element {i}: {g} vs {w}"
                );
            }
            if let (Some(with_shared), false) = (kernels, gate) {
                let mut cfg = MoeConfig::new(5, 4, 4, 2);
                cfg.seed = 17;
                let plain = MoeLayer::new(&cfg, dev).unwrap();
                let mut rng = ChaCha8Rng::seed_from_u64(3);
                let mlp = moegrad::nn::Mlp::normal_without_bias(
                    5,
                    6,
                    5,
                    cfg.activation,
                    0.02,
                    &mut rng,
                    dev,
                )
                .unwrap();
                let x = randn(&[6, 5], 18, DType::F32).to_device(dev).unwrap();
                let (_, layer) = with_kernel_count(|| plain.forward(&x).unwrap());
                let (_, alone) =
                    with_kernel_count(|| moegrad::nn::Module::forward(&mlp, &x).unwrap());
                let (layer, alone) = (layer.unwrap(), alone.unwrap());
                assert_eq!(
                    with_shared,
                    layer + alone,
                    "kernels of the ungated layer on {dev}"
                );
            }
        }
    }
}
