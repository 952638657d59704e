//! The load-balancing loss `α·n·Σ_i f_i·P_i` with `f_i` the fraction of all routed assignments
//! (`Σ f_i = 1` at every k; docs/routers.md, "Auxiliary losses"): uniform routing gives exactly α
//! for every k, collapse gives αn, and the MoE layer adds exactly that, counting the routed
//! assignments, not those kept after capacity drops (checked against a hand computation).

mod common;

use moegrad::moe::balance_loss;
use moegrad::moe::{Capacity, MoeConfig, MoeLayer, Routing};
use moegrad::{DType, Device, Tensor};

/// A top-k routing of `t` tokens over `n` experts where token `t` takes experts `t, t+1, …,
/// t+k−1 (mod n)`, with probabilities `probs` `[t, n]`; and its assignments per expert.
fn round_robin(t: usize, n: usize, k: usize, probs: Vec<f64>) -> (Routing, Tensor) {
    let dev = Device::cpu();
    let idx: Vec<i32> = (0..t)
        .flat_map(|tok| (0..k).map(move |j| ((tok + j) % n) as i32))
        .collect();
    let mut counts = vec![0.0; n];
    for &e in &idx {
        counts[e as usize] += 1.0;
    }
    let routing = Routing::token_choice(
        &Tensor::from_i32(idx, &[t, k], dev).unwrap(),
        &Tensor::full(&[t, k], 1.0 / k as f64, DType::F64, dev).unwrap(),
        None,
        Tensor::from_f64(probs, &[t, n], dev).unwrap(),
        Tensor::zeros(&[t, n], DType::F64, dev).unwrap(),
    )
    .unwrap();
    (routing, Tensor::from_f64(counts, &[n], dev).unwrap())
}

#[test]
fn uniform_routing_gives_exactly_alpha_at_every_k() {
    let alpha = 0.01;
    for n in [4usize, 8] {
        for k in [1, 2, n / 2, n] {
            let t = 4 * n;
            let (r, counts) = round_robin(t, n, k, vec![1.0 / n as f64; t * n]);
            let loss = balance_loss(&r, &counts, alpha).unwrap().item().unwrap();
            assert_eq!(loss, alpha, "n = {n}, k = {k}");
        }
    }
    // n not a power of two: equal up to rounding
    let (r, counts) = round_robin(12, 6, 2, vec![1.0 / 6.0; 72]);
    let loss = balance_loss(&r, &counts, 0.5).unwrap().item().unwrap();
    assert!((loss - 0.5).abs() < 1e-15, "{loss}");
}

#[test]
fn collapse_gives_alpha_n_and_the_gradient_pushes_towards_balance() {
    // every token on expert 0 with probability 1 − ε there
    let (n, t) = (4, 8);
    let eps = 1e-3;
    let row = [1.0 - 3.0 * eps, eps, eps, eps];
    let probs: Vec<f64> = (0..t).flat_map(|_| row).collect();
    let dev = Device::cpu();
    let routing = Routing::token_choice(
        &Tensor::from_i32(vec![0; t], &[t, 1], dev).unwrap(),
        &Tensor::ones(&[t, 1], DType::F64, dev).unwrap(),
        None,
        Tensor::from_f64(probs, &[t, n], dev)
            .unwrap()
            .with_grad()
            .unwrap(),
        Tensor::zeros(&[t, n], DType::F64, dev).unwrap(),
    )
    .unwrap();
    let counts = Tensor::from_f64(vec![t as f64, 0.0, 0.0, 0.0], &[n], dev).unwrap();
    let alpha = 0.1;
    let loss = balance_loss(&routing, &counts, alpha).unwrap();
    let v = loss.item().unwrap();
    let want = alpha * n as f64 * (1.0 - 3.0 * eps);
    assert!((v - want).abs() < 1e-12, "{v} vs {want}");
    loss.backward().unwrap();
    let g = routing.probs.grad().unwrap().to_vec_f64().unwrap();
    // ∂/∂p_{t,i} = α·n·f_i/T: only the overloaded expert's probability is pushed down
    for tok in 0..t {
        assert!((g[tok * n] - alpha * n as f64 / t as f64).abs() < 1e-12);
        assert!(g[tok * n + 1..(tok + 1) * n].iter().all(|&x| x == 0.0));
    }
}

#[test]
fn the_layer_adds_exactly_alpha_for_a_uniform_router_at_every_k() {
    for k in [1, 2, 4] {
        let mut cfg = MoeConfig::new(6, 8, 8, k);
        cfg.balance_loss = 0.25;
        let layer = MoeLayer::new(&cfg, Device::cpu()).unwrap();
        // a zero gate: every token's probabilities are uniform
        layer.router().visit_params("", &mut |_, p| {
            p.set(Tensor::zeros(p.get().shape(), DType::F32, Device::cpu()).unwrap())
                .unwrap()
        });
        let x = Tensor::from_f32(
            (0..60).map(|i| (i % 7) as f32 - 3.0).collect(),
            &[10, 6],
            Device::cpu(),
        )
        .unwrap();
        let aux = layer.forward(&x).unwrap().aux_loss.item().unwrap();
        assert!((aux - 0.25).abs() < 1e-7, "k = {k}: aux loss {aux}");
    }
}

/// Six tokens, top-2 over four experts with capacity `⌈0.75·12/4⌉ = 3`: expert 0 is routed 6
/// assignments and keeps 3, so the fractions of routed (`[6, 3, 2, 1] / 12`) and of kept
/// (`[3, 3, 2, 1] / 9`) assignments differ, and the skewed probabilities make the loss tell them
/// apart. The layer's loss must use the routed ones (Switch, Eq. 4: f counts what the router
/// sent, before capacity), computed here by hand.
#[test]
fn the_layer_counts_routed_not_kept_assignments_under_capacity_drops() {
    let (t, n, alpha) = (6usize, 4usize, 0.3);
    let idx = vec![0, 1, 0, 2, 0, 1, 0, 3, 1, 0, 2, 0];
    let probs = vec![
        0.5, 0.2, 0.2, 0.1, //
        0.4, 0.1, 0.3, 0.2, //
        0.6, 0.3, 0.05, 0.05, //
        0.45, 0.15, 0.1, 0.3, //
        0.35, 0.4, 0.15, 0.1, //
        0.3, 0.1, 0.5, 0.1,
    ];
    let routed = [6.0, 3.0, 2.0, 1.0];
    let kept = [3.0, 3.0, 2.0, 1.0];
    let p_mean: Vec<f64> = (0..n)
        .map(|i| (0..t).map(|tok| probs[tok * n + i]).sum::<f64>() / t as f64)
        .collect();
    let loss_with = |counts: &[f64; 4]| {
        let total: f64 = counts.iter().sum();
        alpha * n as f64 * (0..n).map(|i| counts[i] / total * p_mean[i]).sum::<f64>()
    };
    let want = loss_with(&routed);
    let with_kept = loss_with(&kept);
    assert!(
        (want - with_kept).abs() > 0.01,
        "the case must tell routed from kept: {want} vs {with_kept}"
    );
    for dev in common::devices("the_layer_counts_routed_not_kept_assignments_under_capacity_drops")
    {
        // the layer's dtype (its aux loss adds the routing's loss to its own f32 zero)
        let dt = DType::F32;
        let float = |v: Vec<f64>, shape: &[usize]| common::tensor_on(v, shape, dt, dev);
        let routing = Routing::token_choice(
            &Tensor::from_i32(idx.clone(), &[t, 2], dev).unwrap(),
            &float(vec![0.5; t * 2], &[t, 2]),
            None,
            float(probs.clone(), &[t, n]),
            float(vec![0.0; t * n], &[t, n]),
        )
        .unwrap();
        let mut cfg = MoeConfig::new(3, 4, n, 2);
        cfg.balance_loss = alpha;
        let capacity = Capacity::Factor {
            factor: 0.75,
            min_capacity: 0,
        };
        (cfg.capacity, cfg.eval_capacity) = (capacity, capacity);
        let layer = MoeLayer::new(&cfg, dev).unwrap();
        let x = Tensor::from_f32(
            (0..t * 3).map(|i| (i % 5) as f32 - 2.0).collect(),
            &[t, 3],
            dev,
        )
        .unwrap();
        let out = layer
            .forward_routed(&x, std::slice::from_ref(&routing))
            .unwrap();
        let drop_rate = out.stats.read().unwrap().drop_rate;
        assert!(
            (drop_rate - 0.25).abs() < 1e-6,
            "{dev}: 3 of 12 assignments dropped, drop rate {drop_rate}"
        );
        let got = out.aux_loss.item().unwrap();
        let tol = 1e-6;
        assert!(
            (got - want).abs() < tol,
            "{dev}: balance loss {got}, by hand from routed counts {want} (from kept counts: {with_kept})"
        );
    }
}

/// A routing of `t` tokens over `n` experts (token t on expert t mod n) whose distribution is
/// `probs`, for calling `balance_loss` on any distribution.
fn routing_with(probs: Tensor) -> Routing {
    let (t, dev) = (probs.shape()[0], probs.device());
    let n = probs.shape()[1];
    let idx: Vec<i32> = (0..t).map(|tok| (tok % n) as i32).collect();
    let logits = Tensor::zeros(probs.shape(), probs.dtype(), dev).unwrap();
    let weights = Tensor::ones(&[t, 1], probs.dtype(), dev).unwrap();
    Routing::token_choice(
        &Tensor::from_i32(idx, &[t, 1], dev).unwrap(),
        &weights,
        None,
        probs,
        logits,
    )
    .unwrap()
}

/// The loss and its gradient `[T, n]` from the definition, in f64: `α·n·Σ_i f_i·P_i` with
/// `f_i = c_i / max(Σ c, 1)`, `P_i` the column means; `∂/∂p_{t,i} = α·n·f_i / T`.
fn loss_from_definition(probs: &[f64], counts: &[f64], t: usize, alpha: f64) -> (f64, Vec<f64>) {
    let n = counts.len();
    let total = counts.iter().sum::<f64>().max(1.0);
    let f: Vec<f64> = counts.iter().map(|c| c / total).collect();
    let p_mean: Vec<f64> = (0..n)
        .map(|i| (0..t).map(|tok| probs[tok * n + i]).sum::<f64>() / t as f64)
        .collect();
    let loss = alpha * n as f64 * (0..n).map(|i| f[i] * p_mean[i]).sum::<f64>();
    let grad = (0..t * n)
        .map(|j| alpha * n as f64 * f[j % n] / t as f64)
        .collect();
    (loss, grad)
}

/// The fused loss (one launch forward, one broadcast product backward) against the definition
/// on every device, over expert counts that are 1, a divisor of 256, not one, and past 256 (the
/// GPU kernel's column chunks), with counts that sum to zero (f = 0: the total is clamped to 1)
/// and an upstream gradient other than 1.
#[test]
fn the_fused_loss_and_its_gradient_match_the_definition_on_every_device() {
    use rand::{RngExt, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
    for dev in
        common::devices("the_fused_loss_and_its_gradient_match_the_definition_on_every_device")
    {
        for (t, n, zero_counts) in [
            (9, 1, false),
            (100, 8, false),
            (33, 3, false),
            (5, 300, false),
            (2, 513, false),
            (64, 6, true),
        ] {
            let probs: Vec<f64> = (0..t * n).map(|_| rng.random_range(0.0..1.0)).collect();
            let counts: Vec<f64> = (0..n)
                .map(|_| {
                    if zero_counts {
                        0.0
                    } else {
                        rng.random_range(0..7) as f64
                    }
                })
                .collect();
            let alpha = 0.03;
            let (want, want_grad) = loss_from_definition(&probs, &counts, t, alpha);
            let dt = if dev.is_gpu() { DType::F32 } else { DType::F64 };
            let p = common::tensor_on(probs.clone(), &[t, n], dt, dev)
                .with_grad()
                .unwrap();
            let c = common::tensor_on(counts.clone(), &[n], dt, dev);
            let loss = balance_loss(&routing_with(p.clone()), &c, alpha).unwrap();
            assert_eq!(loss.shape(), [0usize; 0], "a scalar");
            let got = loss.item().unwrap();
            let tol = if dt == DType::F32 { 1e-5 } else { 1e-12 };
            assert!(
                (got - want).abs() <= tol * want.abs().max(1e-3),
                "{dev} {t}×{n}: loss {got}, by definition {want}"
            );
            loss.mul_scalar(2.5).unwrap().backward().unwrap();
            let g = p.grad().unwrap().to_vec_f64().unwrap();
            for (j, (&gv, &w)) in g.iter().zip(&want_grad).enumerate() {
                assert!(
                    (gv - 2.5 * w).abs() <= tol * (2.5 * w).abs().max(1e-6),
                    "{dev} {t}×{n}: ∂/∂p[{j}] = {gv}, by definition {}",
                    2.5 * w
                );
            }
        }
    }
}

/// The backward rule against finite differences (f64), and shapes that do not fit refused.
#[test]
fn the_fused_loss_passes_gradcheck_and_refuses_bad_shapes() {
    use moegrad::gradcheck::{GradcheckOptions, gradcheck};
    let (t, n) = (7, 5);
    let probs = common::f64t(
        &(0..t * n)
            .map(|i| ((i * 37) % 11) as f64 / 11.0)
            .collect::<Vec<_>>(),
        &[t, n],
    );
    let counts = common::f64t(&[3.0, 0.0, 5.0, 1.0, 5.0], &[n]);
    let f = |x: &[Tensor]| balance_loss(&routing_with(x[0].clone()), &counts, 0.2);
    gradcheck(
        f,
        std::slice::from_ref(&probs),
        &GradcheckOptions::default(),
    )
    .unwrap();
    let four = common::f64t(&[1.0; 4], &[4]);
    let err = balance_loss(&routing_with(probs), &four, 0.2).unwrap_err();
    assert!(err.to_string().contains("counts per expert"), "{err}");
}

/// An f16 distribution (GPU only) is summed in f32, like every auxiliary loss under mixed
/// precision: the loss is f32's for the same (f16-rounded) values and the gradient reaches the
/// f16 probabilities.
#[test]
fn an_f16_distribution_is_summed_in_f32() {
    let Some(dev) = common::gpu_or_skip("an_f16_distribution_is_summed_in_f32") else {
        return;
    };
    let (t, n) = (40, 6);
    let probs: Vec<f64> = (0..t * n).map(|i| ((i * 7) % 13) as f64 / 13.0).collect();
    let counts = common::tensor_on(vec![3.0, 1.0, 0.0, 5.0, 2.0, 9.0], &[n], DType::F32, dev);
    // f16 exists only on the GPU: cast there
    let p16 = common::tensor_on(probs, &[t, n], DType::F32, dev)
        .to_dtype(DType::F16)
        .unwrap()
        .with_grad()
        .unwrap();
    let loss = balance_loss(&routing_with(p16.clone()), &counts, 0.1).unwrap();
    assert_eq!(loss.dtype(), DType::F32);
    let p32 = p16.detach().to_dtype(DType::F32).unwrap();
    let want = balance_loss(&routing_with(p32), &counts, 0.1).unwrap();
    assert_eq!(loss.item().unwrap(), want.item().unwrap());
    loss.backward().unwrap();
    let g = p16.grad().expect("the f16 probabilities get a gradient");
    assert_eq!((g.dtype(), g.shape()), (DType::F16, &[t, n][..]));
}
