//! XMoE's `threshold` router and dense to sparse against the properties of XMoE's router
//! (Yang et al. 2024; docs/routers.md, `threshold`): 1 — the kept set is the minimal prefix
//! reaching `t`, `t = 0` is top-1, `t = 1`
//! keeps all n even when the prefix sums round to 1 early, the sets are nested in `t`, the top-1
//! is always kept, permutation equivariance and shift invariance; 2 — priorities (rank first,
//! then p); 3 — capacity (≤ C per expert, exactly the top C by priority, dropped contribute 0, a
//! fully dropped token outputs 0, γ ≥ n with t = 1 drops nothing and equals the dense mixture);
//! 4 — the FFN decomposition (Eq. 4) and the decomposed layer reproducing the dense FFN. Also a
//! gradcheck of the whole layer, a proptest over shapes and thresholds, device parity of the
//! routing and the backward, bad options, and `--expert-hidden`.

mod common;

use moegrad::gradcheck::{GradcheckOptions, gradcheck};
use moegrad::moe::{
    Capacity, DispatchPlan, MoeConfig, MoeLayer, Router, RouterConfig, Routing, build_router,
};
use moegrad::moe::{DenseFfn, SplitScale, decompose_ffn};
use moegrad::nn::Parameters;
use moegrad::nn::{Activation, Module, Param};
use moegrad::train::TrainConfig;
use moegrad::{DType, Device, Result, Tensor};
use proptest::prelude::*;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn uniform(shape: &[usize], lo: f64, hi: f64, seed: u64) -> Tensor {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let n = shape.iter().product();
    let v: Vec<f64> = (0..n).map(|_| rng.random_range(lo..hi)).collect();
    Tensor::from_f64(v, shape, Device::cpu()).unwrap()
}

fn options(opts: &[(&str, &str)]) -> std::collections::BTreeMap<String, String> {
    opts.iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect()
}

/// Something that calls a visitor for every named parameter (`|f| layer.visit_params("", f)`).
type Visit<'a> = &'a dyn Fn(&mut dyn FnMut(String, &Param));

fn params_of(visit: Visit) -> Vec<(String, Param)> {
    let mut v = Vec::new();
    visit(&mut |n, p| v.push((n, p.clone())));
    v
}

/// A threshold router with `d = n` whose weight is the identity, in f64: the logits of a token
/// are the token itself, so tests can route given logits.
fn identity_router(n: usize, opts: &[(&str, &str)]) -> Box<dyn Router> {
    let mut cfg = RouterConfig::new(n, n, 1);
    cfg.options = options(opts);
    let r = build_router("threshold", &cfg, Device::cpu()).unwrap();
    let eye: Vec<f64> = (0..n * n)
        .map(|i| if i / n == i % n { 1.0 } else { 0.0 })
        .collect();
    for (_, p) in params_of(&|f| r.visit_params("router", f)) {
        p.set(Tensor::from_f64(eye.clone(), &[n, n], Device::cpu()).unwrap())
            .unwrap();
    }
    r
}

fn softmax_row(z: &[f64]) -> Vec<f64> {
    let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = z.iter().map(|v| (v - m).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|v| v / s).collect()
}

/// The host reference of XMoE's threshold rule: experts by p descending (ties: lowest index), the
/// shortest
/// prefix whose sum reaches `t` (all of them for `t ≥ 1`), cut at `max_k`. Also returns the
/// smallest distance of a prefix sum to `t`, to keep test points away from the boundary.
fn reference(p: &[f64], t: f64, max_k: usize) -> (Vec<usize>, f64) {
    let mut order: Vec<usize> = (0..p.len()).collect();
    order.sort_by(|&a, &b| p[b].partial_cmp(&p[a]).unwrap().then(a.cmp(&b)));
    let mut kept = Vec::new();
    let mut sum = 0.0;
    let mut margin = f64::INFINITY;
    for &i in order.iter().take(max_k) {
        if t < 1.0 && !kept.is_empty() && sum >= t {
            break;
        }
        kept.push(i);
        sum += p[i];
        margin = margin.min((sum - t).abs());
    }
    (kept, margin)
}

/// `(experts, weights)` kept per token, read from a routing (valid slots only, in slot order).
fn kept_of(r: &Routing) -> Vec<Vec<(usize, f64)>> {
    let k = r.len() / r.tokens;
    let (e, w, v) = (
        r.expert.to_vec_i32().unwrap(),
        r.weight.to_vec_f64().unwrap(),
        r.valid.to_vec_f64().unwrap(),
    );
    (0..r.tokens)
        .map(|t| {
            (t * k..(t + 1) * k)
                .filter(|&a| v[a] == 1.0)
                .map(|a| (e[a] as usize, w[a]))
                .collect()
        })
        .collect()
}

fn metric(r: &Routing, name: &str) -> f64 {
    r.metrics
        .iter()
        .find(|(n, _)| *n == name)
        .unwrap_or_else(|| panic!("no metric {name}"))
        .1
        .item()
        .unwrap()
}

#[test]
fn the_kept_set_is_the_minimal_prefix_reaching_t() {
    let n = 7;
    for (scale, seed) in [(0.5, 1), (2.0, 2), (6.0, 3)] {
        let logits = uniform(&[40, n], -scale, scale, seed);
        let z = logits.to_vec_f64().unwrap();
        for t in [0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 0.99, 1.0] {
            let rr = identity_router(n, &[("t", &t.to_string())]);
            let routing = rr.route(&logits).unwrap();
            let kept = kept_of(&routing);
            let mut total = 0.0;
            for (tok, kept) in kept.iter().enumerate() {
                let p = softmax_row(&z[tok * n..(tok + 1) * n]);
                let (want, margin) = reference(&p, t, n);
                total += want.len() as f64;
                if margin < 1e-9 && t > 0.0 && t < 1.0 {
                    continue; // on the boundary: either answer is right
                }
                let got: Vec<usize> = kept.iter().map(|(e, _)| *e).collect();
                assert_eq!(got, want, "t = {t}, token {tok}, p = {p:?}");
                // m minimal: the kept mass reaches t, one fewer does not
                let mass: Vec<f64> = got.iter().map(|&e| p[e]).collect();
                let m = mass.len();
                assert!(m >= 1);
                if t < 1.0 {
                    assert!(mass.iter().sum::<f64>() >= t - 1e-12);
                    assert!(m == 1 || mass[..m - 1].iter().sum::<f64>() < t);
                }
                // raw p, not renormalised
                for ((_, w), pe) in kept.iter().zip(&mass) {
                    assert!((w - pe).abs() < 1e-14);
                }
            }
            assert!(
                (metric(&routing, "experts_per_token") - total / 40.0).abs() < 1e-12,
                "t = {t}"
            );
        }
    }
}

#[test]
fn t0_is_top1_and_t1_keeps_all_even_when_prefix_sums_reach_1_early() {
    let n = 5;
    let z = uniform(&[30, n], -3.0, 3.0, 7);
    let zv = z.to_vec_f64().unwrap();
    let top1 = identity_router(n, &[("t", "0")]);
    for (tok, kept) in kept_of(&top1.route(&z).unwrap()).iter().enumerate() {
        let row = &zv[tok * n..(tok + 1) * n];
        let arg = (0..n)
            .max_by(|&a, &b| row[a].partial_cmp(&row[b]).unwrap())
            .unwrap();
        assert_eq!(kept.len(), 1);
        assert_eq!(kept[0].0, arg);
    }
    let all = identity_router(n, &[("t", "1")]);
    assert!(
        kept_of(&all.route(&z).unwrap())
            .iter()
            .all(|k| k.len() == n)
    );
    // p = (0.5, 0.5, 1e-20): the exclusive sum before the third expert is exactly 1.0, so a
    // plain `s < t` would drop it; t = 1 must keep it (f64 and f32).
    let tiny = (1e-20f64).ln();
    for dtype in [DType::F64, DType::F32] {
        let r = identity_router(3, &[("t", "1")]);
        for (_, p) in params_of(&|f| r.visit_params("router", f)) {
            p.set(p.get().to_dtype(dtype).unwrap()).unwrap();
        }
        let x = Tensor::from_f64(vec![0.0, 0.0, tiny], &[1, 3], Device::cpu())
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let routing = r.route(&x).unwrap();
        let k = kept_of(&routing);
        assert_eq!(k[0].len(), 3, "{dtype:?}: {k:?}");
        let excl = routing.weight.to_vec_f64().unwrap();
        assert_eq!(excl[0] + excl[1], 1.0, "the shortfall case really occurs");
    }
    // max_k caps the slots, also at t = 1
    let capped = identity_router(n, &[("t", "1"), ("max_k", "2")]);
    let routing = capped.route(&z).unwrap();
    assert_eq!(routing.len(), 30 * 2);
    assert!(kept_of(&routing).iter().all(|k| k.len() == 2));
    // max_k above n is the same as n
    let wide = identity_router(n, &[("t", "1"), ("max_k", "50")]);
    assert_eq!(wide.route(&z).unwrap().len(), 30 * n);
}

#[test]
fn sets_are_nested_in_t_and_always_hold_the_top1() {
    let n = 8;
    let z = uniform(&[50, n], -2.0, 2.0, 11);
    let ts = [0.0, 0.2, 0.4, 0.6, 0.8, 0.95, 1.0];
    let sets: Vec<Vec<Vec<usize>>> = ts
        .iter()
        .map(|t| {
            let r = identity_router(n, &[("t", &t.to_string())]);
            kept_of(&r.route(&z).unwrap())
                .into_iter()
                .map(|k| k.into_iter().map(|(e, _)| e).collect())
                .collect()
        })
        .collect();
    for tok in 0..50 {
        for w in sets.windows(2) {
            let (small, big) = (&w[0][tok], &w[1][tok]);
            assert!(small.len() <= big.len());
            assert_eq!(&big[..small.len()], &small[..], "token {tok}: not nested");
            assert_eq!(small[0], sets[0][tok][0], "token {tok}: top-1 missing");
        }
    }
}

#[test]
fn permutation_equivariance_and_shift_invariance() {
    let n = 6;
    let z = uniform(&[25, n], -2.0, 2.0, 13);
    let zv = z.to_vec_f64().unwrap();
    let perm = [3usize, 0, 5, 1, 4, 2]; // column j of the permuted logits is column perm[j]
    let zp: Vec<f64> = (0..25)
        .flat_map(|t| perm.iter().map(move |&j| (t, j)))
        .map(|(t, j)| zv[t * n + j])
        .collect();
    let zp = Tensor::from_f64(zp, &[25, n], Device::cpu()).unwrap();
    let zs = z.add_scalar(3.7).unwrap();
    for t in ["0", "0.5", "0.9", "1"] {
        let r = identity_router(n, &[("t", t)]);
        let base = kept_of(&r.route(&z).unwrap());
        let permuted = kept_of(&r.route(&zp).unwrap());
        let shifted = kept_of(&r.route(&zs).unwrap());
        for tok in 0..25 {
            let mapped: Vec<(usize, f64)> =
                permuted[tok].iter().map(|&(e, w)| (perm[e], w)).collect();
            assert_eq!(mapped.len(), base[tok].len(), "t = {t}, token {tok}");
            for ((ea, wa), (eb, wb)) in mapped.iter().zip(&base[tok]) {
                assert_eq!(ea, eb);
                assert!((wa - wb).abs() < 1e-14);
            }
            assert_eq!(shifted[tok].len(), base[tok].len(), "t = {t}: shift");
            for ((ea, wa), (eb, wb)) in shifted[tok].iter().zip(&base[tok]) {
                assert_eq!(ea, eb);
                assert!((wa - wb).abs() < 1e-12);
            }
        }
    }
}

#[test]
fn unkept_slots_are_invalid_with_zero_weight_and_eval_t_applies_in_evaluation() {
    let n = 6;
    let z = uniform(&[20, n], -2.0, 2.0, 17);
    let r = identity_router(n, &[("t", "0.9"), ("eval_t", "0.3")]);
    let train = r.route(&z).unwrap();
    let (w, v) = (
        train.weight.to_vec_f64().unwrap(),
        train.valid.to_vec_f64().unwrap(),
    );
    assert!(v.contains(&0.0));
    for (w, v) in w.iter().zip(&v) {
        assert!(*v == 1.0 || *w == 0.0);
    }
    r.set_training(false);
    let eval = r.route(&z).unwrap();
    assert!(
        metric(&eval, "experts_per_token") < metric(&train, "experts_per_token"),
        "eval_t = 0.3 keeps fewer than t = 0.9"
    );
    let ref03 = identity_router(n, &[("t", "0.3")]);
    assert_eq!(
        eval.valid.to_vec_f64().unwrap(),
        ref03.route(&z).unwrap().valid.to_vec_f64().unwrap()
    );
}

// ---- priorities and capacity (properties 2 and 3) ----

/// A threshold MoE layer in f64: `d = 5`, experts `5 → 4 → 3`.
fn layer(n: usize, opts: &[(&str, &str)], capacity: Capacity, seed: u64) -> MoeLayer {
    let mut cfg = MoeConfig::new(5, 4, n, 1);
    cfg.d_out = 3;
    cfg.router = "threshold".into();
    cfg.router_options = options(opts);
    cfg.capacity = capacity;
    cfg.eval_capacity = capacity;
    cfg.seed = seed;
    let l = MoeLayer::new(&cfg, Device::cpu()).unwrap();
    for (_, p) in params_of(&|f| l.visit_params("", f)) {
        p.set(p.get().to_dtype(DType::F64).unwrap()).unwrap();
    }
    l
}

fn factor(gamma: f64) -> Capacity {
    Capacity::Factor {
        factor: gamma,
        min_capacity: 0,
    }
}

/// The host reference of the layer under capacity `c`: per expert, the valid assignments
/// ordered by (rank, −p) — XMoE's priority `p − rank` — keep the first `c`.
fn reference_layer(l: &MoeLayer, x: &Tensor, r: &Routing, c: Option<usize>) -> Vec<f64> {
    let all = l.experts().forward(x).unwrap().to_vec_f64().unwrap(); // [n, T, d_out]
    let (t, d_out, n) = (x.shape()[0], l.config().d_out, l.config().experts);
    let (tok, ex, w, v, rank) = (
        r.token.to_vec_i32().unwrap(),
        r.expert.to_vec_i32().unwrap(),
        r.weight.to_vec_f64().unwrap(),
        r.valid.to_vec_f64().unwrap(),
        r.rank.to_vec_f64().unwrap(),
    );
    let mut y = vec![0.0; t * d_out];
    for e in 0..n {
        let mut mine: Vec<usize> = (0..tok.len())
            .filter(|&a| v[a] == 1.0 && ex[a] as usize == e)
            .collect();
        mine.sort_by(|&a, &b| {
            (w[b] - rank[b])
                .partial_cmp(&(w[a] - rank[a]))
                .unwrap()
                .then(a.cmp(&b))
        });
        for &a in mine.iter().take(c.unwrap_or(usize::MAX)) {
            for j in 0..d_out {
                y[tok[a] as usize * d_out + j] += w[a] * all[(e * t + tok[a] as usize) * d_out + j];
            }
        }
    }
    y
}

#[test]
fn priorities_order_rank_first_then_p() {
    let n = 4;
    let l = layer(n, &[("t", "0.8")], factor(1.0), 3);
    let x = uniform(&[24, 5], -1.5, 1.5, 5);
    let r = l.router().route(&x).unwrap();
    let plan = DispatchPlan::build_sized(&r, factor(1.0), r.tokens).unwrap();
    assert_eq!(plan.capacity, Some(6), "C = ⌈γ·T/n⌉ = ⌈24/4⌉ counts tokens");
    let order = plan.order.to_vec_i32().unwrap();
    let offsets = plan.offsets.to_vec_i32().unwrap();
    let (w, rank, ex) = (
        r.weight.to_vec_f64().unwrap(),
        r.rank.to_vec_f64().unwrap(),
        r.expert.to_vec_i32().unwrap(),
    );
    let mut second_choices = 0;
    for e in 0..n {
        let rows = &order[offsets[e] as usize..offsets[e + 1] as usize];
        for pair in rows.windows(2) {
            let (a, b) = (pair[0] as usize, pair[1] as usize);
            assert_eq!(ex[a] as usize, e);
            // every rank-1 assignment outranks every rank-2 one; within a rank, larger p first
            assert!(
                rank[a] < rank[b] || (rank[a] == rank[b] && w[a] >= w[b]),
                "expert {e}: {a} (rank {}, p {}) before {b} (rank {}, p {})",
                rank[a],
                w[a],
                rank[b],
                w[b]
            );
        }
        second_choices += rows.iter().filter(|&&a| rank[a as usize] > 0.0).count();
    }
    assert!(second_choices > 0, "the test needs second choices");
}

#[test]
fn capacity_keeps_exactly_the_top_c_by_priority() {
    let n = 4;
    let x = uniform(&[32, 5], -1.5, 1.5, 19);
    for (t, gamma) in [("0.7", 0.5), ("0.9", 1.0), ("1", 1.25), ("0", 0.75)] {
        let l = layer(n, &[("t", t)], factor(gamma), 23);
        let r = l.router().route(&x).unwrap();
        let c = (gamma * 32.0 / n as f64).ceil() as usize;
        let out = l.forward_routed(&x, std::slice::from_ref(&r)).unwrap();
        let kept = out.stats.kept_per_expert.to_vec_f64().unwrap();
        assert!(
            kept.iter().all(|&k| k <= c as f64),
            "t = {t}: {kept:?} > {c}"
        );
        common::assert_close(
            &format!("t = {t}, γ = {gamma}"),
            &out.y.to_vec_f64().unwrap(),
            &reference_layer(&l, &x, &r, Some(c)),
            1e-12,
            1e-12,
        );
    }
}

#[test]
fn a_fully_dropped_token_outputs_zero_and_gamma_n_with_t1_is_the_dense_mixture() {
    let n = 4;
    // Every token prefers expert 0 strongly (t = 0: top-1); C = ⌈1·8/4⌉ = 2 keeps the two
    // tokens with the largest p_0, the six others output exactly 0.
    let l = layer(n, &[("t", "0")], factor(1.0), 29);
    let mut w = vec![0.0; 5 * n];
    for i in 0..5 {
        w[i * n] = 3.0;
    }
    params_of(&|f| l.router().visit_params("router", f))[0]
        .1
        .set(Tensor::from_f64(w, &[5, n], Device::cpu()).unwrap())
        .unwrap();
    let x = uniform(&[8, 5], 0.2, 1.0, 31);
    let out = l.forward(&x).unwrap();
    let y = out.y.to_vec_f64().unwrap();
    let p0: Vec<f64> = l
        .router()
        .route(&x)
        .unwrap()
        .probs
        .to_vec_f64()
        .unwrap()
        .chunks(n)
        .map(|c| c[0])
        .collect();
    let mut by_p: Vec<usize> = (0..8).collect();
    by_p.sort_by(|&a, &b| p0[b].partial_cmp(&p0[a]).unwrap());
    for (i, &tok) in by_p.iter().enumerate() {
        let row = &y[tok * 3..(tok + 1) * 3];
        if i < 2 {
            assert!(row.iter().any(|&v| v != 0.0), "token {tok} is kept");
        } else {
            assert!(
                row.iter().all(|&v| v == 0.0),
                "token {tok} is dropped: {row:?}"
            );
        }
    }
    assert!((out.stats.read().unwrap().drop_rate - 0.75).abs() < 1e-12);

    // γ = n and t = 1: C = T, nothing dropped, y = Σ_i p_i E_i(x) over all experts.
    let l = layer(n, &[("t", "1")], factor(n as f64), 37);
    let x = uniform(&[16, 5], -1.0, 1.0, 41);
    let out = l.forward(&x).unwrap();
    assert_eq!(out.stats.read().unwrap().drop_rate, 0.0);
    let p = l.router().route(&x).unwrap().probs.to_vec_f64().unwrap();
    let all = l.experts().forward(&x).unwrap().to_vec_f64().unwrap();
    let dense: Vec<f64> = (0..16 * 3)
        .map(|i| {
            let (t, j) = (i / 3, i % 3);
            (0..n)
                .map(|e| p[t * n + e] * all[(e * 16 + t) * 3 + j])
                .sum()
        })
        .collect();
    common::assert_close(
        "γ = n, t = 1",
        &out.y.to_vec_f64().unwrap(),
        &dense,
        1e-12,
        1e-12,
    );
}

#[test]
fn balance_loss_counts_first_choices() {
    // t = 1 makes every expert a member of every token; XMoE's balance loss counts only the
    // top-1 assignment, so with every token preferring expert 0, f = (1, 0, 0, 0).
    let n = 4;
    let mut l = layer(n, &[("t", "1")], Capacity::Dropless, 43);
    let z_loss = l.config().z_loss;
    l.set_loss_weights(0.01, z_loss).unwrap();
    let mut w = vec![0.0; 5 * n];
    for i in 0..5 {
        w[i * n] = 2.0;
    }
    params_of(&|f| l.router().visit_params("router", f))[0]
        .1
        .set(Tensor::from_f64(w, &[5, n], Device::cpu()).unwrap())
        .unwrap();
    let x = uniform(&[10, 5], 0.2, 1.0, 47);
    let out = l.forward(&x).unwrap();
    let p = l.router().route(&x).unwrap().probs;
    let p0_mean = p.mean(&[0], false).unwrap().to_vec_f64().unwrap()[0];
    assert!((out.aux_loss.item().unwrap() - 0.01 * n as f64 * p0_mean).abs() < 1e-12);
}

// ---- the whole layer: gradcheck, proptest ----

fn loss_of(y: &Tensor) -> Result<Tensor> {
    let c = uniform(y.shape(), -1.0, 1.0, 99)
        .to_dtype(y.dtype())?
        .to_device(y.device())?;
    y.mul(&c)?
        .sum_all()?
        .add(&y.mul(y)?.sum_all()?.mul_scalar(0.1)?)
}

#[test]
fn whole_layer_gradcheck_away_from_threshold_boundaries() {
    let n = 5;
    for (opts, gamma) in [
        (vec![("t", "0.5")], Capacity::Dropless),
        (vec![("t", "0.8"), ("max_k", "3")], Capacity::Dropless),
        (vec![("t", "1")], Capacity::Dropless),
        (vec![("t", "0.7")], factor(1.0)),
    ] {
        let proto = layer(n, &opts, gamma, 53);
        let x = uniform(&[7, 5], -1.0, 1.0, 59);
        // The point must be generic: no prefix sum within 1e-3 of t, no tie in p.
        let t: f64 = opts[0].1.parse().unwrap();
        let probs = proto
            .router()
            .route(&x)
            .unwrap()
            .probs
            .to_vec_f64()
            .unwrap();
        for row in probs.chunks(n) {
            let (_, margin) = reference(row, t, n);
            assert!(
                t >= 1.0 || margin > 1e-3,
                "{opts:?}: point near the boundary"
            );
        }
        let mut inputs = vec![x];
        let names: Vec<String> = params_of(&|f| proto.visit_params("", f))
            .into_iter()
            .map(|(name, p)| {
                inputs.push(p.get().detach());
                name
            })
            .collect();
        // nonzero biases: no hidden unit at the ReLU kink
        for (i, name) in names.iter().enumerate() {
            if name.ends_with("b1") || name.ends_with("b2") {
                inputs[i + 1] = uniform(inputs[i + 1].shape(), -0.3, 0.3, 60 + i as u64);
            }
        }
        let f = |v: &[Tensor]| -> Result<Tensor> {
            let l = layer(n, &opts, gamma, 53);
            for ((_, p), value) in params_of(&|f| l.visit_params("", f)).iter().zip(&v[1..]) {
                p.set(value.clone())?;
            }
            loss_of(&l.forward(&v[0])?.y)
        };
        if let Err(e) = gradcheck(f, &inputs, &GradcheckOptions::default()) {
            panic!("{opts:?}: {e}");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    #[test]
    fn routing_and_layer_match_the_reference(tokens in 1usize..12, n in 1usize..9,
                                             t in 0.0f64..1.0, max_k in 1usize..10,
                                             scale in 0.1f64..4.0, seed in 0u64..10_000) {
        let t = if seed % 5 == 0 { 1.0 } else { t };
        let ts = t.to_string();
        let mk = max_k.to_string();
        let l = layer(n, &[("t", &ts), ("max_k", &mk)], Capacity::Dropless, seed);
        let w = params_of(&|f| l.router().visit_params("router", f))[0].1.get();
        params_of(&|f| l.router().visit_params("router", f))[0].1
            .set(w.mul_scalar(scale).unwrap()).unwrap();
        let x = uniform(&[tokens, 5], -1.0, 1.0, seed + 1);
        let r = l.router().route(&x).unwrap();
        prop_assert_eq!(r.len(), tokens * n.min(max_k));
        let p = r.probs.to_vec_f64().unwrap();
        for (tok, kept) in kept_of(&r).iter().enumerate() {
            let row = &p[tok * n..(tok + 1) * n];
            let (want, margin) = reference(row, t, max_k);
            if t < 1.0 && margin < 1e-9 {
                continue;
            }
            let got: Vec<usize> = kept.iter().map(|(e, _)| *e).collect();
            prop_assert_eq!(got, want);
            for (e, w) in kept {
                prop_assert!((w - row[*e]).abs() < 1e-14);
            }
        }
        let y = l.forward_routed(&x, std::slice::from_ref(&r)).unwrap().y.to_vec_f64().unwrap();
        let want = reference_layer(&l, &x, &r, None);
        for (a, b) in y.iter().zip(&want) {
            prop_assert!((a - b).abs() < 1e-12);
        }
    }

    /// Property 4 (Eq. 4): the sum of the splits is the big FFN; with the uniform-router scale,
    /// their mean is.
    #[test]
    fn ffn_equals_the_sum_of_its_splits(d in 1usize..6, n in 1usize..5, hn in 1usize..4,
                                        d_out in 1usize..5, tokens in 1usize..6,
                                        bias in any::<bool>(), gelu in any::<bool>(),
                                        seed in 0u64..10_000) {
        let h = n * hn;
        let w1 = uniform(&[d, h], -1.0, 1.0, seed);
        let w2 = uniform(&[h, d_out], -1.0, 1.0, seed + 1);
        let b1 = uniform(&[h], -0.5, 0.5, seed + 2);
        let b2 = uniform(&[d_out], -0.5, 0.5, seed + 3);
        let activation = if gelu { Activation::Gelu } else { Activation::Relu };
        let ffn = DenseFfn {
            w1: &w1, b1: bias.then_some(&b1), w2: &w2, b2: bias.then_some(&b2), activation,
        };
        let x = uniform(&[tokens, d], -1.0, 1.0, seed + 4);
        let dense = dense_ffn(&ffn, &x).to_vec_f64().unwrap();
        for (scale, weight) in [(SplitScale::Sum, 1.0), (SplitScale::UniformRouter, 1.0 / n as f64)] {
            let bank = decompose_ffn(&ffn, n, scale).unwrap();
            let w1s = bank.w1.get();
            prop_assert_eq!(w1s.shape(), &[n, d, hn][..]);
            let parts = bank.forward(&x).unwrap().to_vec_f64().unwrap(); // [n, T, d_out]
            for i in 0..tokens * d_out {
                let s: f64 = (0..n).map(|e| weight * parts[e * tokens * d_out + i]).sum();
                prop_assert!((s - dense[i]).abs() < 1e-12 * (1.0 + dense[i].abs()),
                             "{:?}: {} vs {}", scale, s, dense[i]);
            }
        }
    }
}

fn dense_ffn(ffn: &DenseFfn, x: &Tensor) -> Tensor {
    let mut h = x.matmul(ffn.w1).unwrap();
    if let Some(b1) = ffn.b1 {
        h = h.add(b1).unwrap();
    }
    let mut y = ffn.activation.apply(&h).unwrap().matmul(ffn.w2).unwrap();
    if let Some(b2) = ffn.b2 {
        y = y.add(b2).unwrap();
    }
    y
}

// ---- dense to sparse ----

#[test]
fn decomposed_layer_with_a_zero_router_and_t1_is_the_dense_ffn() {
    let (d, h, d_out, n) = (6, 12, 4, 4);
    let w1 = uniform(&[d, h], -1.0, 1.0, 61);
    let w2 = uniform(&[h, d_out], -1.0, 1.0, 62);
    let b1 = uniform(&[h], -0.5, 0.5, 63);
    let b2 = uniform(&[d_out], -0.5, 0.5, 64);
    let ffn = DenseFfn {
        w1: &w1,
        b1: Some(&b1),
        w2: &w2,
        b2: Some(&b2),
        activation: Activation::Gelu,
    };
    let x = uniform(&[20, d], -1.0, 1.0, 65);
    let dense = dense_ffn(&ffn, &x).to_vec_f64().unwrap();
    let build = |opts: &[(&str, &str)], capacity: Capacity| {
        let mut cfg = MoeConfig::new(d, h / n, n, 1);
        cfg.d_out = d_out;
        cfg.router = "threshold".into();
        cfg.router_options = options(opts);
        cfg.capacity = capacity;
        cfg.eval_capacity = capacity;
        cfg.activation = Activation::Gelu;
        let mut l = MoeLayer::new(&cfg, Device::cpu()).unwrap();
        l.set_experts(Box::new(
            decompose_ffn(&ffn, n, SplitScale::UniformRouter).unwrap(),
        ))
        .unwrap();
        let w = params_of(&|f| l.router().visit_params("router", f))[0]
            .1
            .get();
        params_of(&|f| l.router().visit_params("router", f))[0]
            .1
            .set(Tensor::zeros(w.shape(), DType::F64, Device::cpu()).unwrap())
            .unwrap();
        l
    };
    for capacity in [Capacity::Dropless, factor(n as f64)] {
        let l = build(&[("t", "1")], capacity);
        let out = l.forward(&x).unwrap();
        common::assert_close(
            &format!("{capacity:?}"),
            &out.y.to_vec_f64().unwrap(),
            &dense,
            1e-12,
            1e-12,
        );
        assert_eq!(out.stats.read().unwrap().drop_rate, 0.0);
    }
    // N must divide h
    let e = decompose_ffn(&ffn, 5, SplitScale::Sum)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("5 experts") && e.contains("12"), "{e}");
    assert!(decompose_ffn(&ffn, 0, SplitScale::Sum).is_err());

    // Once the router has moved away from uniform, lowering t at inference keeps fewer experts.
    let mut last = f64::INFINITY;
    for eval_t in ["1", "0.9", "0.7", "0.5", "0"] {
        let l = build(&[("t", "1"), ("eval_t", eval_t)], Capacity::Dropless);
        params_of(&|f| l.router().visit_params("router", f))[0]
            .1
            .set(uniform(&[d, n], -1.5, 1.5, 66))
            .unwrap();
        l.set_training(false);
        let per_token = l
            .forward(&x)
            .unwrap()
            .stats
            .read()
            .unwrap()
            .experts_per_token;
        assert!(per_token <= last, "eval_t = {eval_t}: {per_token} > {last}");
        match eval_t {
            "1" => assert_eq!(per_token, n as f64),
            "0" => assert_eq!(per_token, 1.0),
            _ => {}
        }
        last = per_token;
    }
    assert!(last < n as f64);
}

// ---- devices ----

/// Routes and back-propagates a threshold layer on `device` (f32 there) from the parameters of
/// the f64 CPU layer `reference`; returns the kept mask, the output and every gradient.
fn run_on(reference: &MoeLayer, device: Device, x: &Tensor) -> (Vec<f64>, Vec<Vec<f64>>) {
    let l = MoeLayer::new(reference.config(), device).unwrap();
    let dtype = if device == Device::cpu() {
        DType::F64
    } else {
        DType::F32
    };
    for ((_, a), (_, b)) in params_of(&|f| reference.visit_params("", f))
        .iter()
        .zip(params_of(&|f| l.visit_params("", f)).iter())
    {
        b.set(a.get().to_dtype(dtype).unwrap().to_device(device).unwrap())
            .unwrap();
    }
    let xd = x
        .to_dtype(dtype)
        .unwrap()
        .to_device(device)
        .unwrap()
        .with_grad()
        .unwrap();
    let r = l.router().route(&xd).unwrap();
    let out = l.forward_routed(&xd, std::slice::from_ref(&r)).unwrap();
    loss_of(&out.y).unwrap().backward().unwrap();
    let mut v = vec![
        r.weight.to_vec_f64().unwrap(),
        r.expert.to_dtype(DType::F32).unwrap().to_vec_f64().unwrap(),
        out.y.to_vec_f64().unwrap(),
        xd.grad().unwrap().to_vec_f64().unwrap(),
        vec![metric(&r, "experts_per_token")],
    ];
    v.extend(params_of(&|f| l.visit_params("", f)).iter().map(|(_, p)| {
        p.grad()
            .map(|g| g.to_vec_f64().unwrap())
            .unwrap_or_default()
    }));
    (r.valid.to_vec_f64().unwrap(), v)
}

/// The GPU (f32) routes, keeps and back-propagates as the f64 CPU reference does. Without an
/// adapter there is nothing to compare the CPU with (it would be compared with itself), so the
/// test says it is skipped (and fails under `MOEGRAD_REQUIRE_GPU=1`).
#[test]
fn routing_and_backward_agree_on_every_device() {
    let Some(gpu) = common::gpu_or_skip("routing_and_backward_agree_on_every_device") else {
        return;
    };
    let n = 6;
    for (t, gamma) in [
        ("0.6", Capacity::Dropless),
        ("0.9", factor(1.0)),
        ("1", factor(2.0)),
    ] {
        let base = layer(n, &[("t", t)], gamma, 71);
        let x = uniform(&[33, 5], -1.0, 1.0, 73);
        let probs = base.router().route(&x).unwrap().probs.to_vec_f64().unwrap();
        let tv: f64 = t.parse().unwrap();
        for row in probs.chunks(n) {
            let (_, margin) = reference(row, tv, n);
            assert!(
                tv >= 1.0 || margin > 1e-4,
                "t = {t}: point too close to the boundary"
            );
        }
        let (valid, want) = run_on(&base, Device::cpu(), &x);
        let (v, got) = run_on(&base, gpu, &x);
        assert_eq!(v, valid, "t = {t}, {gpu:?}: the same slots must be kept");
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            common::assert_close(&format!("t = {t}, {gpu:?}, tensor {i}"), a, b, 2e-4, 2e-3);
        }
    }
}

// ---- bad input ----

#[test]
fn bad_options_are_errors_naming_the_option() {
    let build = |opts: &[(&str, &str)]| {
        let mut cfg = RouterConfig::new(4, 4, 1);
        cfg.options = options(opts);
        build_router("threshold", &cfg, Device::cpu())
            .err()
            .map(|e| e.to_string())
    };
    for (opts, needle) in [
        (vec![("t", "1.5")], "t = 1.5"),
        (vec![("t", "-0.1")], "t = -0.1"),
        (vec![("t", "nan")], "t="),
        (vec![("eval_t", "2")], "eval_t"),
        (vec![("max_k", "0")], "max_k"),
        (vec![("max_k", "two")], "max_k"),
        (vec![("tau", "0.5")], "tau"),
    ] {
        let e = build(&opts).unwrap_or_else(|| panic!("{opts:?} must be rejected"));
        assert!(e.contains(needle), "{opts:?}: {e}");
    }
    assert!(build(&[("t", "0"), ("eval_t", "1"), ("max_k", "9")]).is_none());
    // a wrong token width is an error, not a panic
    let r = identity_router(4, &[]);
    let e = r
        .route(&Tensor::zeros(&[2, 3], DType::F64, Device::cpu()).unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("[2, 3]"), "{e}");
}

#[test]
fn expert_hidden_sets_the_moe_mlp_expert_width() {
    let cfg = TrainConfig {
        model: moegrad::train::ModelKind::MoeMlp,
        router: "threshold".into(),
        experts: 4,
        expert_hidden: 16,
        ..TrainConfig::default()
    };
    cfg.validate().unwrap();
    let model = moegrad::train::build_model(&cfg, 28, 1, Device::cpu()).unwrap();
    let w1 = model
        .named_params()
        .into_iter()
        .find(|(n, _)| n.ends_with("experts.w1"))
        .unwrap()
        .1
        .get();
    assert_eq!(w1.shape(), &[4, 28 * 28, 16]);
    let bad = TrainConfig {
        expert_hidden: 0,
        ..cfg
    };
    let e = bad.validate().unwrap_err().to_string();
    assert!(e.contains("--expert-hidden"), "{e}");
    assert_eq!(TrainConfig::default().expert_hidden, 128);
}
