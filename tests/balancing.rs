//! Balancing as its own setting (docs/routers.md, "Balancing"): the aux-free and quantile bias
//! updates against hand computations and an f64 reference written from their definitions (CPU
//! and GPU), their properties (the bias moves a fixed skewed load toward uniform in a bounded
//! number of updates, never receives a gradient, is restored exactly from the state), the
//! sequence-wise and windowed balance losses by hand, the routers that take a bias (the list
//! `BIASABLE_ROUTERS` held to what each router does: a bias moves the choice and not the
//! weights), and the refusals.

mod common;

use common::devices;
use moegrad::moe::{
    BIASABLE_ROUTERS, BalanceMethod, BalanceScope, Balancing, MoeConfig, MoeLayer, ROUTER_NAMES,
    RouterConfig, Routing, SelectionBias, balance_loss, build_router, sequence_balance_loss,
};
use moegrad::nn::Parameters;
use moegrad::{DType, Device, Tensor};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn on(values: Vec<f64>, shape: &[usize], dev: Device) -> Tensor {
    Tensor::from_f64(values, shape, Device::Cpu)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .to_device(dev)
        .unwrap()
}

fn read(t: &Tensor) -> Vec<f64> {
    t.to_device(Device::Cpu)
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_vec_f64()
        .unwrap()
}

/// Tokens per expert when each row of `scores + bias` picks its `k` largest (ties: lowest index).
fn loads(scores: &[f64], bias: &[f64], t: usize, k: usize) -> Vec<f64> {
    let n = bias.len();
    let mut c = vec![0.0; n];
    for row in scores.chunks(n).take(t) {
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&a, &b| (row[b] + bias[b]).total_cmp(&(row[a] + bias[a])));
        for &j in &order[..k] {
            c[j] += 1.0;
        }
    }
    c
}

/// The quantile update from its definition, in f64: cutoff α_t = the (k+1)-th largest of
/// `s_t + b`, `r_tj = α_t − s_tj`, `b_j` = midpoint of the q-th and (q+1)-th smallest `r_tj`
/// over t with `q = round(T·k/n)`, then centred.
fn quantile_reference(scores: &[f64], bias: &[f64], t: usize, k: usize) -> Vec<f64> {
    let n = bias.len();
    let cutoff: Vec<f64> = scores
        .chunks(n)
        .map(|row| {
            let mut biased: Vec<f64> = row.iter().zip(bias).map(|(s, b)| s + b).collect();
            biased.sort_by(|a, b| b.total_cmp(a));
            biased[k]
        })
        .collect();
    let q = ((t * k) as f64 / n as f64)
        .round()
        .clamp(1.0, (t - 1) as f64) as usize;
    let b: Vec<f64> = (0..n)
        .map(|j| {
            let mut need: Vec<f64> = (0..t).map(|i| cutoff[i] - scores[i * n + j]).collect();
            need.sort_by(f64::total_cmp);
            0.5 * (need[q - 1] + need[q])
        })
        .collect();
    let mean = b.iter().sum::<f64>() / n as f64;
    b.iter().map(|v| v - mean).collect()
}

/// A skewed score matrix: every token prefers the low-numbered experts.
fn skewed(t: usize, n: usize, seed: u64) -> Vec<f64> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..t * n)
        .map(|i| rng.random_range(-1.0..1.0) + 2.0 * (1.0 - (i % n) as f64 / n as f64))
        .collect()
}

#[test]
fn aux_free_update_by_hand() {
    for dev in devices("aux_free_update_by_hand") {
        let u = 0.01;
        let b = SelectionBias::zeros(3, dev).unwrap();
        // loads 5, 1, 2 (mean 8/3): expert 0 down by u, 1 and 2 up, then centred
        b.update_aux_free(&on(vec![5.0, 1.0, 2.0], &[3], dev), u)
            .unwrap();
        let got = read(&b.get().unwrap());
        let want = [-4.0 * u / 3.0, 2.0 * u / 3.0, 2.0 * u / 3.0];
        common::assert_close("aux-free step", &got, &want, 1e-8, 0.0);
        // an expert exactly at the mean does not move (sign 0) before centring
        b.update_aux_free(&on(vec![2.0, 2.0, 2.0], &[3], dev), u)
            .unwrap();
        common::assert_close("at the mean", &read(&b.get().unwrap()), &want, 1e-8, 0.0);
    }
}

#[test]
fn aux_free_moves_a_skewed_load_toward_uniform_in_bounded_updates() {
    let (t, n, k, u) = (256, 8, 2, 0.02);
    let s = skewed(t, n, 1);
    let ideal = (t * k) as f64 / n as f64;
    let start = loads(&s, &[0.0; 8], t, k);
    let start_max = start.iter().cloned().fold(0.0, f64::max) / ideal;
    assert!(start_max > 2.5, "the scores must start skewed: {start:?}");
    for dev in devices("aux_free_moves_a_skewed_load_toward_uniform") {
        let scores = on(s.clone(), &[t, n], dev);
        let b = SelectionBias::zeros(n, dev).unwrap();
        let mut worst = f64::INFINITY;
        for step in 0..200 {
            let chosen = b.add_to(&scores).unwrap();
            let bias = read(&b.get().unwrap());
            let c = loads(&s, &bias, t, k);
            worst = c.iter().cloned().fold(0.0, f64::max) / ideal;
            if step >= 150 {
                assert!(
                    worst < 1.3,
                    "update {step}: load/ideal {worst}, loads {c:?}"
                );
            }
            let (_, idx) = chosen.topk(k).unwrap();
            let counts = Tensor::zeros(&[n], DType::F32, dev)
                .unwrap()
                .scatter_add(
                    0,
                    &idx.reshape(&[t * k]).unwrap(),
                    &Tensor::ones(&[t * k], DType::F32, dev).unwrap(),
                )
                .unwrap();
            common::assert_close("device counts", &read(&counts), &c, 0.0, 0.0);
            b.update_aux_free(&counts, u).unwrap();
            let sum: f64 = read(&b.get().unwrap()).iter().sum();
            assert!(sum.abs() < 1e-5, "the bias stays centred: {sum}");
        }
        assert!(worst < 1.3, "{worst}");
    }
}

#[test]
fn quantile_update_matches_the_definition_and_balances_a_skewed_load() {
    for dev in devices("quantile_update_matches_the_definition") {
        for (t, n, k, seed) in [
            (12, 4, 1, 3u64),
            (64, 8, 2, 4),
            (200, 16, 4, 5),
            (9, 3, 2, 6),
        ] {
            let s = skewed(t, n, seed);
            let scores = on(s.clone(), &[t, n], dev);
            let b = SelectionBias::zeros(n, dev).unwrap();
            let mut bias = vec![0.0; n];
            for step in 0..3 {
                let want = quantile_reference(&s, &bias, t, k);
                b.update_quantile(&b.add_to(&scores).unwrap(), k).unwrap();
                bias = read(&b.get().unwrap());
                common::assert_close(
                    &format!("quantile T={t} n={n} k={k} step {step}"),
                    &bias,
                    &want,
                    1e-5,
                    1e-5,
                );
            }
            if t >= 64 {
                let c = loads(&s, &bias, t, k);
                let ideal = (t * k) as f64 / n as f64;
                let worst = c.iter().cloned().fold(0.0, f64::max) / ideal;
                assert!(worst < 1.35, "T={t} n={n} k={k}: {c:?}");
            }
        }
    }
}

#[test]
fn quantile_solves_one_expert_exactly_when_the_others_are_held() {
    // T = 4 tokens, n = 2 experts, k = 1: q = 2. Expert 1's need r_t1 = α_t − s_t1 where α_t is
    // the 2nd largest (the smaller) biased score; b = 0.
    let s = vec![
        3.0, 0.0, // α = 0, r = (0−3, 0−0) = (−3, 0)
        1.0, 2.0, // α = 1, r = (0, −1)
        0.5, 0.0, // α = 0, r = (−0.5, 0)
        0.0, 4.0, // α = 0, r = (0, −4)
    ];
    // expert 0's r: −3, 0, −0.5, 0 → sorted −3, −0.5, 0, 0 → midpoint of 2nd and 3rd: −0.25
    // expert 1's r: 0, −1, 0, −4 → sorted −4, −1, 0, 0 → −0.5; centred: 0.125, −0.125
    let b = SelectionBias::zeros(2, Device::Cpu).unwrap();
    b.update_quantile(&on(s, &[4, 2], Device::Cpu), 1).unwrap();
    common::assert_close(
        "by hand",
        &read(&b.get().unwrap()),
        &[0.125, -0.125],
        1e-7,
        0.0,
    );
}

#[test]
fn sequence_and_batch_balance_losses_by_hand() {
    let dev = Device::cpu();
    // 2 sequences of 2 tokens, n = 2, top-1: sequence 0 sends both tokens to expert 0, sequence
    // 1 one to each
    let idx = Tensor::from_i32(vec![0, 0, 0, 1], &[4, 1], dev).unwrap();
    let probs = vec![0.9, 0.1, 0.7, 0.3, 0.6, 0.4, 0.2, 0.8];
    let r = Routing::token_choice(
        &idx,
        &Tensor::ones(&[4, 1], DType::F64, dev).unwrap(),
        None,
        Tensor::from_f64(probs, &[4, 2], dev).unwrap(),
        Tensor::zeros(&[4, 2], DType::F64, dev).unwrap(),
    )
    .unwrap();
    let alpha = 0.1;
    // sequence 0: f = (1, 0), P = (0.8, 0.2): Σ f P = 0.8; sequence 1: f = (½, ½), P = (0.4,
    // 0.6): 0.5. Loss = α·n·(0.8 + 0.5)/2
    let seq = sequence_balance_loss(&r, 2, alpha, false)
        .unwrap()
        .item()
        .unwrap();
    assert!((seq - alpha * 2.0 * 0.65).abs() < 1e-12, "{seq}");
    // one sequence of 4 is the batch loss: f = (¾, ¼), P = (0.6, 0.4): 0.45 + 0.1
    let counts = Tensor::from_f64(vec![3.0, 1.0], &[2], dev).unwrap();
    let batch = balance_loss(&r, &counts, alpha).unwrap().item().unwrap();
    let one = sequence_balance_loss(&r, 4, alpha, false)
        .unwrap()
        .item()
        .unwrap();
    assert!((batch - alpha * 2.0 * 0.55).abs() < 1e-12, "{batch}");
    assert!((one - batch).abs() < 1e-12, "{one} vs {batch}");
    // not a whole number of sequences
    let e = sequence_balance_loss(&r, 3, alpha, false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("4 tokens") && e.contains("3"), "{e}");
}

fn layer(router: &str, balancing: Balancing, n: usize, k: usize, dev: Device) -> MoeLayer {
    let mut cfg = MoeConfig::new(6, 8, n, k);
    cfg.router = router.into();
    cfg.balancing = balancing;
    cfg.balance_loss = 0.1;
    cfg.seed = 11;
    MoeLayer::new(&cfg, dev).unwrap()
}

fn tokens(t: usize, seed: u64, dev: Device) -> Tensor {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    on(
        (0..t * 6).map(|_| rng.random_range(-1.0..1.0)).collect(),
        &[t, 6],
        dev,
    )
}

fn bias_of(l: &MoeLayer) -> Vec<f64> {
    read(&l.router().selection_bias().unwrap().get().unwrap())
}

#[test]
fn the_layer_moves_the_bias_in_training_only_without_a_gradient_and_resumes_exactly() {
    for dev in devices("the_layer_moves_the_bias") {
        for method in [BalanceMethod::AuxFree, BalanceMethod::Quantile] {
            let bal = Balancing {
                method,
                rate: 0.05,
                ..Balancing::default()
            };
            let a = layer("topk", bal, 4, 2, dev);
            // no aux loss with a bias balancer
            let x = tokens(16, 1, dev);
            let out = a.forward(&x).unwrap();
            assert_eq!(out.aux_loss.item().unwrap(), 0.0, "{method:?}");
            let moved = bias_of(&a);
            assert!(moved.iter().any(|v| *v != 0.0), "{method:?}: {moved:?}");
            // the bias is no parameter and gets no gradient
            out.y.sum_all().unwrap().backward().unwrap();
            let bias = a.router().selection_bias().unwrap().get().unwrap();
            assert!(bias.grad().is_none());
            let names: Vec<String> = a.named_params().into_iter().map(|p| p.0).collect();
            assert!(names.iter().all(|n| !n.contains("selection")), "{names:?}");
            // evaluation routes with the bias and does not move it
            a.set_training(false);
            a.forward(&tokens(16, 2, dev)).unwrap();
            assert_eq!(bias_of(&a), moved);
            a.set_training(true);
            // a second layer restored from the first's state continues exactly
            for step in 0..3 {
                a.forward(&tokens(16, 10 + step, dev)).unwrap();
            }
            let b = layer("topk", bal, 4, 2, dev);
            for (name, p) in a.named_params() {
                let q = b
                    .named_params()
                    .into_iter()
                    .find(|(m, _)| *m == name)
                    .unwrap()
                    .1;
                q.set(p.get().clone()).unwrap();
            }
            for (name, v) in a.state().unwrap() {
                b.load_state(&name, &v).unwrap();
            }
            assert_eq!(bias_of(&a), bias_of(&b));
            for step in 0..3 {
                let x = tokens(16, 20 + step, dev);
                let (ya, yb) = (a.forward(&x).unwrap().y, b.forward(&x).unwrap().y);
                assert_eq!(read(&ya), read(&yb), "{method:?} step {step}");
                assert_eq!(bias_of(&a), bias_of(&b), "{method:?} step {step}");
            }
        }
    }
}

#[test]
fn the_global_scope_counts_over_its_window_and_resumes() {
    let dev = Device::cpu();
    let bal = Balancing {
        scope: BalanceScope::Global,
        window: 2,
        ..Balancing::default()
    };
    let l = layer("topk", bal, 4, 1, dev);
    let window = |l: &MoeLayer| -> (Vec<f64>, f64) {
        let s = l.state().unwrap();
        let get = |n: &str| read(&s.iter().find(|(m, _)| m == n).unwrap().1);
        (get(MoeLayer::WINDOW_COUNTS), get(MoeLayer::WINDOW_STEPS)[0])
    };
    let counts_of = |x: &Tensor| read(&l.forward(x).unwrap().stats.routed_per_expert);
    let (x1, x2, x3) = (tokens(10, 1, dev), tokens(10, 2, dev), tokens(10, 3, dev));
    let c1 = counts_of(&x1);
    assert_eq!(window(&l), (c1.clone(), 1.0));
    let c2 = counts_of(&x2);
    let sum: Vec<f64> = c1.iter().zip(&c2).map(|(a, b)| a + b).collect();
    assert_eq!(window(&l), (sum.clone(), 2.0));
    // the window's loss uses f from the summed counts
    let probs = l.router().route(&x2).unwrap();
    let want = balance_loss(&probs, &Tensor::from_f64(sum, &[4], dev).unwrap(), 0.1)
        .unwrap()
        .item()
        .unwrap();
    // (x2 again would add a third batch: recompute from a layer restored to the same window)
    let m = layer("topk", bal, 4, 1, dev);
    let (c, _) = window(&l);
    m.load_state(
        MoeLayer::WINDOW_COUNTS,
        &Tensor::from_f64(c, &[4], dev).unwrap(),
    )
    .unwrap();
    m.load_state(
        MoeLayer::WINDOW_STEPS,
        &Tensor::scalar(1.0, DType::F64, dev).unwrap(),
    )
    .unwrap();
    // a window of 1 batch so far plus x2's counts: the restored sum plus c2
    let restored = read(&m.forward(&x2).unwrap().aux_loss);
    let c12: Vec<f64> = window(&l).0.iter().zip(&c2).map(|(a, b)| a + b).collect();
    let want2 = balance_loss(&probs, &Tensor::from_f64(c12, &[4], dev).unwrap(), 0.1)
        .unwrap()
        .item()
        .unwrap();
    assert!(
        (restored[0] - want2).abs() < 1e-6,
        "{restored:?} vs {want2}"
    );
    assert!(want.is_finite());
    // the third batch starts a new window
    let c3 = counts_of(&x3);
    assert_eq!(window(&l), (c3, 1.0));
}

#[test]
fn biasable_routers_are_exactly_those_whose_bias_moves_the_choice_and_not_the_weights() {
    let dev = Device::cpu();
    let (d, n, k, t) = (6, 4, 2, 12);
    let x = tokens(t, 5, dev);
    for &name in ROUTER_NAMES {
        let mut cfg = RouterConfig::new(d, n, if name == "switch" { 1 } else { k });
        cfg.selection_bias = true;
        cfg.seed = 3;
        let router = match build_router(name, &cfg, dev) {
            Ok(r) => r,
            Err(e) => panic!("{name}: {e}"),
        };
        let listed = BIASABLE_ROUTERS.contains(&name);
        assert_eq!(router.selection_bias().is_some(), listed, "{name}");
        if !listed {
            continue;
        }
        router.set_training(false);
        let kk = cfg.k;
        let plain = router.route(&x).unwrap();
        let bias = router.selection_bias().unwrap();
        // a constant bias changes nothing: same experts, same weights
        bias.set(&Tensor::full(&[n], 3.0, DType::F32, dev).unwrap(), "b")
            .unwrap();
        let same = router.route(&x).unwrap();
        assert_eq!(read(&plain.expert), read(&same.expert), "{name}");
        assert_eq!(read(&plain.weight), read(&same.weight), "{name}");
        // a large bias on the last expert puts it in every token's choice, and the weights stay
        // those of the unbiased scores (the probabilities are unchanged)
        bias.set(
            &Tensor::from_f64(vec![0.0, 0.0, 0.0, 1e3], &[n], dev).unwrap(),
            "b",
        )
        .unwrap();
        let pushed = router.route(&x).unwrap();
        let experts = read(&pushed.expert);
        for tok in 0..t {
            assert!(
                experts[tok * kk..(tok + 1) * kk].contains(&3.0),
                "{name}: token {tok} chose {:?}",
                &experts[tok * kk..(tok + 1) * kk]
            );
        }
        assert_eq!(read(&plain.probs), read(&pushed.probs), "{name}");
        // tokens whose own choice already held the last expert keep their experts and weights
        // (the bias reorders the slots, not the weights)
        let (pe, pw, qw) = (
            read(&plain.expert),
            read(&plain.weight),
            read(&pushed.weight),
        );
        let mut unchanged = 0;
        for tok in 0..t {
            let slots = tok * kk..(tok + 1) * kk;
            if !pe[slots.clone()].contains(&3.0) {
                continue;
            }
            unchanged += 1;
            for a in slots.clone() {
                let b = slots
                    .clone()
                    .find(|&b| experts[b] == pe[a])
                    .unwrap_or_else(|| panic!("{name}: token {tok} lost expert {}", pe[a]));
                assert!(
                    (pw[a] - qw[b]).abs() < 1e-6,
                    "{name}: token {tok}, expert {}: weight {} became {}",
                    pe[a],
                    pw[a],
                    qw[b]
                );
            }
        }
        assert!(
            unchanged > 0,
            "{name}: no token chose the last expert unbiased"
        );
        assert!(pushed.selection.is_some(), "{name}");
    }
}

#[test]
fn bad_balancing_is_refused_naming_the_setting() {
    let dev = Device::cpu();
    let err = |router: &str, bal: Balancing, n: usize, k: usize| {
        let mut cfg = MoeConfig::new(6, 8, n, k);
        cfg.router = router.into();
        cfg.balancing = bal;
        match MoeLayer::new(&cfg, dev) {
            Ok(_) => panic!("{router} {bal:?} was accepted"),
            Err(e) => e.to_string(),
        }
    };
    let free = Balancing {
        method: BalanceMethod::AuxFree,
        ..Balancing::default()
    };
    let e = err("sparsemixer", free, 4, 1);
    assert!(e.contains("sparsemixer") && e.contains("aux-free"), "{e}");
    let e = err("expert-choice", free, 4, 1);
    assert!(e.contains("expert-choice"), "{e}");
    let q = Balancing {
        method: BalanceMethod::Quantile,
        ..Balancing::default()
    };
    let e = err("topk", q, 4, 4);
    assert!(e.contains("k < n"), "{e}");
    let e = err(
        "topk",
        Balancing {
            window: 0,
            ..Balancing::default()
        },
        4,
        2,
    );
    assert!(e.contains("--balance-window"), "{e}");
    let e = err("topk", Balancing { rate: -1.0, ..free }, 4, 2);
    assert!(e.contains("--balance-rate"), "{e}");
    let e = err(
        "topk",
        Balancing {
            scope: BalanceScope::Sequence,
            ..free
        },
        4,
        2,
    );
    assert!(e.contains("--balance-scope"), "{e}");
}

#[test]
fn the_sequence_loss_on_the_gpu_matches_the_cpu() {
    let Some(gpu) = common::gpu_or_skip("the_sequence_loss_on_the_gpu_matches_the_cpu") else {
        return;
    };
    let bal = Balancing {
        scope: BalanceScope::Sequence,
        ..Balancing::default()
    };
    let (cpu_layer, gpu_layer) = (
        layer("topk", bal, 8, 2, Device::Cpu),
        layer("topk", bal, 8, 2, gpu),
    );
    for (t, l) in [(24usize, 6usize), (40, 8), (36, 36)] {
        let x = tokens(t, t as u64, Device::Cpu);
        let a = cpu_layer.forward_sequences(&x, l).unwrap().aux_loss;
        let b = gpu_layer
            .forward_sequences(&x.to_device(gpu).unwrap(), l)
            .unwrap()
            .aux_loss;
        common::assert_close(&format!("T={t} L={l}"), &read(&b), &read(&a), 1e-6, 1e-5);
        // several sequences differ from one: the scope is really applied
        let whole = cpu_layer.forward(&x).unwrap().aux_loss;
        if l < t {
            assert!((read(&a)[0] - read(&whole)[0]).abs() > 1e-6, "T={t} L={l}");
        }
    }
}
