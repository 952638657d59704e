//! The `reinforce` router is the score-function estimator (Williams 1992): its gradient, formed by
//! the surrogate of its `ScoreTerm` with each token's own loss as the reward, has expectation ∇₀,
//! the exact gradient through the choice of expert. Checked here through the router itself (the
//! public `Router` and `ScoreTerm` API a user's own training loop would call), against ∇₀
//! enumerated by the estimator lab, with and without the running baseline; plus the surrogate's
//! value, the baseline's arithmetic and state, and training with it end to end.

mod common;

use moegrad::estimator_lab::{LossKind, Problem, ProblemConfig, exact_gradient};
use moegrad::moe::{Router, RouterConfig, RunningBaseline, ScoreTerm, build_router};
use moegrad::nn::Parameters;
use moegrad::{DType, Device, Tensor};

/// The `reinforce` router on `n`-wide inputs with an identity gate, so its logits are its input.
fn identity_router(n: usize, options: &[(&str, &str)], seed: u64) -> Box<dyn Router> {
    let mut cfg = RouterConfig::new(n, n, 1);
    cfg.seed = seed;
    for (k, v) in options {
        cfg.options.insert(k.to_string(), v.to_string());
    }
    let router = build_router("reinforce", &cfg, Device::cpu()).unwrap();
    router.visit_params("", &mut |name, p| {
        let v = match name.as_str() {
            "weight" => Tensor::from_f64(
                (0..n * n)
                    .map(|i| if i / n == i % n { 1.0 } else { 0.0 })
                    .collect(),
                &[n, n],
                Device::cpu(),
            ),
            "bias" => Tensor::zeros(&[n], DType::F64, Device::cpu()),
            other => panic!("unexpected parameter {other}"),
        };
        p.set(v.unwrap()).unwrap();
    });
    router.set_training(true);
    router
}

/// One draw through the router: route the logits, form `y_t = w_t f_{t,D_t}`, take the per-token
/// losses, add the score term's surrogate and back-propagate. Returns `∂/∂logits` `[T·n]` and the
/// experts drawn.
fn draw(router: &dyn Router, problem: &Problem) -> (Vec<f64>, Vec<i32>) {
    let c = &problem.config;
    let (t, n, d) = (c.tokens, c.experts, c.dim);
    let x = problem.logits_tensor().unwrap().with_grad().unwrap();
    let routing = router.route(&x).unwrap();
    assert_eq!(routing.len(), t, "one expert per token");
    let experts = routing.expert.to_vec_i32().unwrap();
    let rows: Vec<i32> = experts
        .iter()
        .enumerate()
        .map(|(tok, &e)| (tok * n) as i32 + e)
        .collect();
    let f = problem
        .outputs_tensor()
        .unwrap()
        .reshape(&[t * n, d])
        .unwrap()
        .index_select(0, &Tensor::from_i32(rows, &[t], Device::cpu()).unwrap())
        .unwrap();
    let y = f.mul(&routing.weight.reshape(&[t, 1]).unwrap()).unwrap();
    let per_token = problem.loss.per_token(&y).unwrap();
    let score = routing
        .score
        .as_ref()
        .expect("reinforce hands out a score term");
    let surrogate = score.surrogate(&per_token).unwrap();
    assert_eq!(surrogate.item().unwrap(), 0.0, "the surrogate's value is 0");
    let objective = per_token.sum_all().unwrap().add(&surrogate).unwrap();
    objective.backward().unwrap();
    let g = x
        .try_grad()
        .unwrap()
        .expect("the router's logits get a gradient");
    (g.to_vec_f64().unwrap(), experts)
}

fn lab_problem(loss: LossKind, seed: u64) -> Problem {
    Problem::new(&ProblemConfig {
        tokens: 3,
        experts: 4,
        dim: 3,
        loss,
        scale: 1.0,
        offset: 0.0,
        eps: 1.0,
        shared: 0.0,
        seed,
    })
}

/// Monte Carlo mean of `draws` estimates against `exact`: every component within 4 standard
/// errors (plus a hair for components whose draws are all but constant).
fn assert_unbiased(what: &str, draws: &[Vec<f64>], exact: &[f64]) {
    let m = draws.len() as f64;
    for j in 0..exact.len() {
        let mean = draws.iter().map(|v| v[j]).sum::<f64>() / m;
        let var = draws.iter().map(|v| (v[j] - mean).powi(2)).sum::<f64>() / (m - 1.0);
        let se = (var / m).sqrt();
        assert!(
            (mean - exact[j]).abs() <= 4.0 * se + 1e-12,
            "{what}: component {j}: Monte Carlo mean {mean:.6} vs exact ∇₀ {:.6} ({:.1} s.e., s.e. {se:.2e})",
            exact[j],
            (mean - exact[j]).abs() / se
        );
    }
}

#[test]
fn reinforce_router_is_unbiased_for_nabla0_with_and_without_baseline() {
    for (loss, seed) in [(LossKind::Logistic, 3), (LossKind::Quadratic, 5)] {
        let problem = lab_problem(loss, seed);
        let exact = exact_gradient(&problem);
        for baseline in ["1", "0"] {
            let router = identity_router(4, &[("baseline", baseline)], 11);
            let draws: Vec<Vec<f64>> = (0..20_000).map(|_| draw(&*router, &problem).0).collect();
            let what = format!("{loss} loss, baseline={baseline}");
            assert_unbiased(&what, &draws, &exact.nabla0);
            // and it is not ∇₀ + ∇₁: the estimate does not include the path through π_D
            let m = draws.len() as f64;
            let mean: Vec<f64> = (0..exact.total.len())
                .map(|j| draws.iter().map(|v| v[j]).sum::<f64>() / m)
                .collect();
            let dist = |a: &[f64], b: &[f64]| {
                a.iter()
                    .zip(b)
                    .map(|(x, y)| (x - y).powi(2))
                    .sum::<f64>()
                    .sqrt()
            };
            assert!(
                dist(&mean, &exact.nabla0) < dist(&mean, &exact.total),
                "{what}: the mean is closer to ∇₀ + ∇₁ than to ∇₀"
            );
        }
    }
}

#[test]
fn each_draw_is_the_score_function_of_its_own_token_loss() {
    // With no baseline, one draw's gradient for token t is exactly g(y_t)·(e_D − π_t): the
    // token's own loss, not the batch's.
    let problem = lab_problem(LossKind::Logistic, 7);
    let (t, n, d) = (3, 4, 3);
    let router = identity_router(n, &[("baseline", "0")], 2);
    for _ in 0..20 {
        let (g, experts) = draw(&*router, &problem);
        for tok in 0..t {
            let pi = problem.probs(&problem.logits, tok);
            let e = experts[tok] as usize;
            let y: Vec<f64> = problem.output(tok, e).iter().map(|v| v * pi[e]).collect();
            let reward = problem.loss.value(&y);
            let expected: Vec<f64> = (0..n)
                .map(|k| reward * (if k == e { 1.0 } else { 0.0 } - pi[k]))
                .collect();
            common::assert_close(
                &format!("token {tok}"),
                &g[tok * n..(tok + 1) * n],
                &expected,
                1e-12,
                1e-9,
            );
        }
        assert_eq!(d, problem.config.dim);
    }
}

#[test]
fn baseline_is_a_bias_corrected_running_mean_of_earlier_steps() {
    let b = RunningBaseline::new();
    let dev = Device::cpu();
    assert!(
        b.value(DType::F64, dev).unwrap().is_none(),
        "no baseline before any step"
    );
    let names: Vec<String> = b.state().unwrap().into_iter().map(|(n, _)| n).collect();
    assert_eq!(
        names,
        ["average", "updates"],
        "state is reported from the start"
    );
    let means = [2.0, 4.0, 1.0];
    let mut avg = 0.0;
    for (s, m) in means.iter().enumerate() {
        b.update(&Tensor::scalar(*m, DType::F64, dev).unwrap())
            .unwrap();
        avg = 0.9 * avg + 0.1 * m;
        let corrected = avg / (1.0 - 0.9f64.powi(s as i32 + 1));
        let got = b.value(DType::F64, dev).unwrap().unwrap().item().unwrap();
        assert!(
            (got - corrected).abs() < 1e-12,
            "step {s}: {got} vs {corrected}"
        );
    }
    // the first step's baseline is that step's mean
    let first = RunningBaseline::new();
    first
        .update(&Tensor::scalar(2.5, DType::F64, dev).unwrap())
        .unwrap();
    let v = first
        .value(DType::F64, dev)
        .unwrap()
        .unwrap()
        .item()
        .unwrap();
    assert!((v - 2.5).abs() < 1e-12);
    // state round trip
    let restored = RunningBaseline::new();
    for (name, value) in b.state().unwrap() {
        restored.load_state(&name, &value).unwrap();
    }
    assert_eq!(
        restored
            .value(DType::F64, dev)
            .unwrap()
            .unwrap()
            .item()
            .unwrap(),
        b.value(DType::F64, dev).unwrap().unwrap().item().unwrap()
    );
    assert!(
        restored
            .load_state("nonsense", &Tensor::scalar(1.0, DType::F64, dev).unwrap())
            .is_err()
    );
    assert!(
        restored
            .load_state("updates", &Tensor::scalar(-1.5, DType::F64, dev).unwrap())
            .is_err()
    );
}

#[test]
fn surrogate_uses_the_baseline_of_earlier_steps_then_updates_it() {
    let dev = Device::cpu();
    let logits = Tensor::from_f64(vec![0.5, -0.2, 0.1, 0.3], &[2, 2], dev)
        .unwrap()
        .with_grad()
        .unwrap();
    let d = Tensor::from_i32(vec![0, 1], &[2, 1], dev).unwrap();
    let log_prob = logits
        .log_softmax(-1)
        .unwrap()
        .gather(1, &d)
        .unwrap()
        .reshape(&[2])
        .unwrap();
    let baseline = std::sync::Arc::new(RunningBaseline::new());
    baseline
        .update(&Tensor::scalar(1.0, DType::F64, dev).unwrap())
        .unwrap();
    let term = ScoreTerm {
        log_prob,
        baseline: Some(baseline.clone()),
    };
    let losses = Tensor::from_f64(vec![3.0, 0.5], &[2], dev).unwrap();
    term.surrogate(&losses).unwrap().backward().unwrap();
    let g = logits.grad().unwrap().to_vec_f64().unwrap();
    // token 0: (3 − 1)(e_0 − π_0); token 1: (0.5 − 1)(e_1 − π_1)
    let pi = |a: f64, b: f64| {
        let (ea, eb) = (a.exp(), b.exp());
        (ea / (ea + eb), eb / (ea + eb))
    };
    let (p00, p01) = pi(0.5, -0.2);
    let (p10, p11) = pi(0.1, 0.3);
    let expected = [
        2.0 * (1.0 - p00),
        2.0 * -p01,
        -0.5 * -p10,
        -0.5 * (1.0 - p11),
    ];
    common::assert_close("surrogate gradient", &g, &expected, 1e-12, 1e-9);
    // then the baseline holds the running mean of 1 and this step's mean 1.75
    let avg = 0.9 * 0.1 + 0.1 * 1.75;
    let want = avg / (1.0 - 0.81);
    let got = baseline
        .value(DType::F64, dev)
        .unwrap()
        .unwrap()
        .item()
        .unwrap();
    assert!((got - want).abs() < 1e-12, "{got} vs {want}");
    // per-token losses of the wrong shape are an error naming both shapes
    let err = term
        .surrogate(&Tensor::from_f64(vec![1.0; 3], &[3], dev).unwrap())
        .unwrap_err()
        .to_string();
    assert!(err.contains("[2]") && err.contains("[3]"), "{err}");
}

#[test]
fn reinforce_rejects_unknown_options_and_bad_baseline_values() {
    let mut cfg = RouterConfig::new(4, 4, 1);
    cfg.options.insert("baseline".into(), "maybe".into());
    let err = build_router("reinforce", &cfg, Device::cpu())
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("baseline"), "{err}");
    let mut cfg = RouterConfig::new(4, 4, 1);
    cfg.options.insert("tau".into(), "2".into());
    let err = build_router("reinforce", &cfg, Device::cpu())
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("tau") && err.contains("baseline"), "{err}");
}

#[test]
fn reinforce_trains_a_moe_mlp_through_the_score_term_on_every_device() {
    // The router's gate gets its gradient from the score term: with the surrogate, the gate's
    // gradient is nonzero; the training loop adds it (train::run), and the run learns.
    for dev in common::devices("reinforce_trains_a_moe_mlp_through_the_score_term_on_every_device")
    {
        let cfg = moegrad::train::TrainConfig {
            data: moegrad::train::DataKind::Mnist,
            model: moegrad::train::ModelKind::MoeMlp,
            router: "reinforce".into(),
            experts: 4,
            k: 1,
            epochs: 2,
            batch: 64,
            train_limit: 1024,
            test_limit: 256,
            balance_loss: 0.0,
            device: if dev == Device::cpu() { "cpu" } else { "gpu" }.into(),
            out: std::env::temp_dir().join(format!(
                "moegrad-reinforce-train-{}-{}",
                std::process::id(),
                dev
            )),
            ..Default::default()
        };
        let _ = std::fs::remove_dir_all(&cfg.out);
        let summary = moegrad::train::run(&cfg, Default::default()).unwrap();
        let acc = summary.test_accuracy.as_f64().unwrap();
        assert!(acc > 0.5, "{dev}: test accuracy {acc} after 2 epochs");
        let _ = std::fs::remove_dir_all(&cfg.out);
    }
}

#[test]
fn in_a_moe_layer_the_gate_learns_only_through_the_score_term() {
    use moegrad::moe::{MoeConfig, MoeLayer};
    let mut cfg = MoeConfig::new(6, 8, 4, 1);
    cfg.router = "reinforce".into();
    let layer = MoeLayer::new(&cfg, Device::cpu()).unwrap();
    let x = Tensor::from_f32(
        (0..60)
            .map(|i| ((i * 37 % 17) as f32 - 8.0) / 5.0)
            .collect(),
        &[10, 6],
        Device::cpu(),
    )
    .unwrap();
    let gate_grad = |with_score: bool| -> f64 {
        let mut gate = None;
        layer.visit_params("", &mut |name, p| {
            p.get().zero_grad();
            if name == "router.weight" {
                gate = Some(p.clone());
            }
        });
        let out = layer.forward(&x).unwrap();
        assert_eq!(out.score_terms.len(), 1, "one score term per routing");
        let per_token = out.y.mul(&out.y).unwrap().sum(&[-1], false).unwrap();
        let mut objective = per_token.mean_all().unwrap();
        if with_score {
            let share = per_token.mul_scalar(1.0 / 10.0).unwrap();
            objective = objective
                .add(&out.score_terms[0].surrogate(&share).unwrap())
                .unwrap();
        }
        objective.backward().unwrap();
        match gate.unwrap().get().try_grad().unwrap() {
            None => 0.0,
            Some(g) => g.to_vec_f64().unwrap().iter().map(|v| v.abs()).sum(),
        }
    };
    assert_eq!(
        gate_grad(false),
        0.0,
        "no path from the task loss to the gate but the score term"
    );
    assert!(gate_grad(true) > 0.0, "the score term reaches the gate");
}
