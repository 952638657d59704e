//! `default-moe` (docs/routers.md; Panda et al. 2025, arXiv 2504.12463): top-k of `π =
//! softmax(o)`, weights `π_i` not renormalised, and in training a dense router gradient in which
//! each unselected expert answers its running-mean output `Ê_i`.
//!
//! * (P1) the forward pass is exactly top-k's: bit for bit `topk-unnorm`'s output, in training
//!   and in evaluation, and against an f64 reference from the definition;
//! * (P2) the default outputs are the EMA of each expert's kept rows, `Ê ← βÊ + (1−β)·mean`,
//!   untouched for an expert that ran on nothing and in evaluation (f64 reference);
//! * (P3) the router's gradient is `∂L/∂π_i = g·E_i(x)` for chosen experts and `g·Ê_i` for the
//!   others, through the softmax (f64 reference from the definition), and the experts' gradients
//!   are top-k's;
//! * (P4) with β = 0 and experts that answer constants, it equals the dense MoE's exact gradient;
//! * (P5) the vectors are router state: saved, restored exactly, a wrong shape refused;
//! * (P6) in evaluation the layer's backward is the exact gradient (an f64 gradcheck);
//! * GPU (f32) against CPU (f64): output, every gradient and the updated vectors.

mod common;
#[path = "common/moe_f64.rs"]
mod moe_f64;

use common::uniform_vec;
use moe_f64::MoeF64;
use moegrad::gradcheck::{GradcheckOptions, gradcheck};
use moegrad::moe::{BalanceMethod, Balancing, MoeConfig, MoeLayer};
use moegrad::nn::Parameters;
use moegrad::{DType, Device, Result, Tensor};

const D: usize = 5;
const H: usize = 6;
const N: usize = 6;
const K: usize = 2;
const T: usize = 9;

fn config(router: &str, beta: f64) -> MoeConfig {
    let mut cfg = MoeConfig::new(D, H, N, K);
    cfg.router = router.into();
    cfg.seed = 31;
    cfg.balancing = Balancing {
        method: BalanceMethod::None,
        ..Balancing::default()
    };
    if router == "default-moe" {
        cfg.router_options.insert("beta".into(), beta.to_string());
    }
    cfg
}

/// A layer on `dev` in `dtype` with every parameter (biases too) drawn from `seed`.
fn layer(router: &str, beta: f64, dev: Device, dtype: DType, seed: u64) -> MoeLayer {
    let l = MoeLayer::new(&config(router, beta), dev).unwrap();
    common::fill_params_uniform(&l, (-0.8, 0.8), seed, dtype, dev);
    l
}

/// The `c` of `common::test_loss` (`L = Σ c⊙y + 0.1·Σ y²`, so `g = ∂L/∂y = c + 0.2·y`) for
/// outputs `[T, D]`.
fn coefficients() -> Vec<f64> {
    uniform_vec(T * D, -1.0, 1.0, 99)
}

/// The definition in f64, from a layer's parameters: per token the logits, π, the chosen
/// experts (best first) and every expert's output `E_i(x)`.
struct Reference {
    pi: Vec<Vec<f64>>,
    chosen: Vec<Vec<usize>>,
    outputs: Vec<Vec<Vec<f64>>>, // [t][i][d]
    y: Vec<Vec<f64>>,
}

fn reference(l: &MoeLayer, x: &[f64]) -> Reference {
    let layer = MoeF64::of(l, (D, H, D), N);
    let mut r = Reference {
        pi: vec![],
        chosen: vec![],
        outputs: vec![],
        y: vec![],
    };
    for t in 0..T {
        let xt = &x[t * D..(t + 1) * D];
        let pi = moe_f64::softmax(&layer.logits(xt));
        let mut order: Vec<usize> = (0..N).collect();
        order.sort_by(|&a, &b| pi[b].total_cmp(&pi[a]));
        let outs: Vec<Vec<f64>> = (0..N).map(|i| layer.expert(i, xt)).collect();
        let chosen = order[..K].to_vec();
        let y = (0..D)
            .map(|c| chosen.iter().map(|&i| pi[i] * outs[i][c]).sum())
            .collect();
        r.pi.push(pi);
        r.chosen.push(chosen);
        r.outputs.push(outs);
        r.y.push(y);
    }
    r
}

/// `Ê` after one update from `old` with this batch (`[N][D]`).
fn ema(r: &Reference, old: &[Vec<f64>], beta: f64) -> Vec<Vec<f64>> {
    (0..N)
        .map(|i| {
            let rows: Vec<usize> = (0..T).filter(|&t| r.chosen[t].contains(&i)).collect();
            if rows.is_empty() {
                return old[i].clone();
            }
            (0..D)
                .map(|c| {
                    let mean =
                        rows.iter().map(|&t| r.outputs[t][i][c]).sum::<f64>() / rows.len() as f64;
                    beta * old[i][c] + (1.0 - beta) * mean
                })
                .collect()
        })
        .collect()
}

fn table(l: &MoeLayer) -> Vec<f64> {
    l.state()
        .unwrap()
        .into_iter()
        .find(|(n, _)| n == "router.default_outputs")
        .expect("the default outputs are in the layer's state")
        .1
        .to_vec_f64()
        .unwrap()
}

fn x_values(seed: u64) -> Vec<f64> {
    uniform_vec(T * D, -1.5, 1.5, seed)
}

#[test]
fn p1_forward_is_exactly_topk() {
    let x = x_values(5);
    for training in [true, false] {
        let run = |router: &str| {
            let l = layer(router, 0.9, Device::cpu(), DType::F32, 40);
            l.set_training(training);
            let xt = common::tensor_on(x.clone(), &[T, D], DType::F32, Device::cpu());
            l.forward(&xt).unwrap().y.to_vec_f64().unwrap()
        };
        assert_eq!(
            run("default-moe"),
            run("topk-unnorm"),
            "training = {training}"
        );
    }
    let l = layer("default-moe", 0.9, Device::cpu(), DType::F64, 40);
    let y = l.forward(&common::f64t(&x, &[T, D])).unwrap().y;
    let want: Vec<f64> = reference(&l, &x).y.concat();
    common::assert_close("y", &y.to_vec_f64().unwrap(), &want, 1e-12, 1e-12);
}

#[test]
fn p2_default_outputs_are_the_running_mean_of_each_experts_rows() {
    let beta = 0.7;
    let l = layer("default-moe", beta, Device::cpu(), DType::F64, 50);
    assert_eq!(table(&l), vec![0.0; N * D], "the vectors start at zero");
    let mut want = vec![vec![0.0; D]; N];
    let mut some_expert_idle = false;
    for (step, seed) in [61u64, 62, 63].into_iter().enumerate() {
        let x = x_values(seed);
        let r = reference(&l, &x);
        some_expert_idle |= (0..N).any(|i| (0..T).all(|t| !r.chosen[t].contains(&i)));
        want = ema(&r, &want, beta);
        l.forward(&common::f64t(&x, &[T, D])).unwrap();
        common::assert_close(
            &format!("Ê after step {step}"),
            &table(&l),
            &want.concat(),
            1e-6,
            1e-6,
        );
    }
    // x far off to one side: experts 0..N see lopsided routing; at least one expert never ran
    // in some batch above or the check "idle experts keep their vector" proved nothing
    let lopsided = layer("default-moe", beta, Device::cpu(), DType::F64, 50);
    let x: Vec<f64> = (0..T * D).map(|i| 3.0 + 0.01 * i as f64).collect();
    let r = reference(&lopsided, &x);
    some_expert_idle |= (0..N).any(|i| (0..T).all(|t| !r.chosen[t].contains(&i)));
    lopsided.forward(&common::f64t(&x, &[T, D])).unwrap();
    common::assert_close(
        "Ê on a lopsided batch",
        &table(&lopsided),
        &ema(&r, &vec![vec![0.0; D]; N], beta).concat(),
        1e-6,
        1e-6,
    );
    assert!(some_expert_idle, "no batch left an expert idle");
    // evaluation leaves the vectors alone
    let before = table(&l);
    l.set_training(false);
    l.forward(&common::f64t(&x_values(64), &[T, D])).unwrap();
    assert_eq!(table(&l), before);
}

/// `∂L/∂W_gate` from the definition: `∂L/∂π_i = g·E_i` (chosen) or `g·Ê_i` (others), then
/// `∂L/∂o = π ⊙ (v − π·v)` and `∂L/∂W = xᵀ ∂L/∂o`.
fn reference_gate_grad(r: &Reference, x: &[f64], defaults: &[Vec<f64>]) -> (Vec<f64>, Vec<f64>) {
    let c = coefficients();
    let mut dw = vec![0.0; D * N];
    let mut db = vec![0.0; N];
    for t in 0..T {
        let g: Vec<f64> = (0..D).map(|j| c[t * D + j] + 0.2 * r.y[t][j]).collect();
        let v: Vec<f64> = (0..N)
            .map(|i| {
                let e = if r.chosen[t].contains(&i) {
                    &r.outputs[t][i]
                } else {
                    &defaults[i]
                };
                (0..D).map(|j| g[j] * e[j]).sum()
            })
            .collect();
        let pv: f64 = (0..N).map(|i| r.pi[t][i] * v[i]).sum();
        for i in 0..N {
            let d_o = r.pi[t][i] * (v[i] - pv);
            db[i] += d_o;
            for j in 0..D {
                dw[j * N + i] += x[t * D + j] * d_o;
            }
        }
    }
    (dw, db)
}

#[test]
fn p3_router_gradient_is_the_dense_one_with_defaults_for_unselected_experts() {
    let beta = 0.5;
    let l = layer("default-moe", beta, Device::cpu(), DType::F64, 70);
    // one batch to give the vectors values, then the batch whose gradient is checked
    let x0 = x_values(71);
    let mut defaults = ema(&reference(&l, &x0), &vec![vec![0.0; D]; N], beta);
    l.forward(&common::f64t(&x0, &[T, D])).unwrap();
    let x = x_values(72);
    let r = reference(&l, &x);
    defaults = ema(&r, &defaults, beta); // the batch's own means are in Ê when it backpropagates
    let out = l.forward(&common::f64t(&x, &[T, D])).unwrap();
    common::test_loss(&out.y).unwrap().backward().unwrap();
    let (dw, db) = reference_gate_grad(&r, &x, &defaults);
    common::assert_close(
        "∂L/∂W_gate",
        &common::param_grad(&l, "router.weight"),
        &dw,
        1e-6,
        1e-5,
    );
    common::assert_close(
        "∂L/∂b_gate",
        &common::param_grad(&l, "router.bias"),
        &db,
        1e-6,
        1e-5,
    );
    // the unselected experts' term is really there: plain top-k's gradient differs
    let (dw_topk, _) = reference_gate_grad(&r, &x, &vec![vec![0.0; D]; N]);
    let gap = dw
        .iter()
        .zip(&dw_topk)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(
        gap > 1e-3,
        "the defaults changed the gradient by only {gap}"
    );
    // the experts' gradients are top-k's (same parameters, same batch)
    let plain = layer("topk-unnorm", beta, Device::cpu(), DType::F64, 70);
    let out = plain.forward(&common::f64t(&x, &[T, D])).unwrap();
    common::test_loss(&out.y).unwrap().backward().unwrap();
    for name in ["experts.w1", "experts.b1", "experts.w2", "experts.b2"] {
        common::assert_close(
            name,
            &common::param_grad(&l, name),
            &common::param_grad(&plain, name),
            1e-12,
            1e-10,
        );
    }
}

#[test]
fn p4_constant_experts_with_beta_zero_give_the_dense_gradient() {
    // E_i(x) = b2_i: with w2 = 0 every expert answers its bias, so Ê_i = b2_i after any batch
    // in which expert i ran (β = 0), and Default MoE's router gradient is the dense MoE's
    let make = |router: &str| {
        let l = layer(router, 0.0, Device::cpu(), DType::F64, 80);
        for (name, p) in l.named_params() {
            if name == "router.weight" {
                // a sharper router, so that every expert wins some token
                p.set(p.get().mul_scalar(4.0).unwrap()).unwrap();
            }
            if name == "experts.w2" {
                p.set(Tensor::zeros(p.get().shape(), DType::F64, Device::cpu()).unwrap())
                    .unwrap();
            }
        }
        l
    };
    let l = make("default-moe");
    // batches until every expert has run once (checked), so each has its vector
    let mut ran = [false; N];
    for seed in 200..230 {
        let x0 = x_values(seed);
        for chosen in reference(&l, &x0).chosen {
            chosen.iter().for_each(|&i| ran[i] = true);
        }
        l.forward(&common::f64t(&x0, &[T, D])).unwrap();
        if ran.iter().all(|&r| r) {
            break;
        }
    }
    assert!(ran.iter().all(|&r| r), "some expert never ran: {ran:?}");
    let x = x_values(82);
    let out = l.forward(&common::f64t(&x, &[T, D])).unwrap();
    // the dense MoE's loss, with the same y in value: L(y_sparse + Σ_{i∉A} π_i b2_i − sg(·))
    common::test_loss(&out.y).unwrap().backward().unwrap();
    let dense = make("softmax");
    let xt = common::f64t(&x, &[T, D]);
    let yd = dense.forward(&xt).unwrap().y;
    let ys = make("topk-unnorm").forward(&xt).unwrap().y;
    // loss at the sparse output, gradient through the dense one: g is evaluated at y_sparse
    let surrogate = yd.sub(&yd.detach()).unwrap().add(&ys.detach()).unwrap();
    common::test_loss(&surrogate).unwrap().backward().unwrap();
    common::assert_close(
        "∂L/∂W_gate (dense)",
        &common::param_grad(&l, "router.weight"),
        &common::param_grad(&dense, "router.weight"),
        1e-6,
        1e-5,
    );
}

#[test]
fn p5_default_outputs_are_saved_and_restored() {
    let a = layer("default-moe", 0.9, Device::cpu(), DType::F32, 90);
    let b = layer("default-moe", 0.9, Device::cpu(), DType::F32, 90);
    for seed in [91, 92] {
        a.forward(&common::tensor_on(
            x_values(seed),
            &[T, D],
            DType::F32,
            Device::cpu(),
        ))
        .unwrap();
    }
    for (name, value) in a.state().unwrap() {
        b.load_state(&name, &value).unwrap();
    }
    assert_eq!(table(&a), table(&b));
    // the next training step is the same in both
    let step = |l: &MoeLayer| {
        let x = common::tensor_on(x_values(93), &[T, D], DType::F32, Device::cpu());
        let out = l.forward(&x).unwrap();
        common::test_loss(&out.y).unwrap().backward().unwrap();
        (common::param_grad(l, "router.weight"), table(l))
    };
    assert_eq!(step(&a), step(&b));
    let err = b
        .load_state(
            "router.default_outputs",
            &Tensor::zeros(&[N + 1, D], DType::F32, Device::cpu()).unwrap(),
        )
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("default_outputs") && err.contains("[7, 5]"),
        "{err}"
    );
    let err = moegrad::moe::build_router(
        "default-moe",
        &{
            let mut c = moegrad::moe::RouterConfig::new(D, N, K);
            c.options.insert("beta".into(), "1".into());
            c
        },
        Device::cpu(),
    )
    .err()
    .unwrap()
    .to_string();
    assert!(err.contains("beta"), "{err}");
}

#[test]
fn p6_evaluation_gradient_is_exact() {
    let proto = layer("default-moe", 0.9, Device::cpu(), DType::F64, 100);
    let mut inputs = vec![common::f64t(&x_values(101), &[T, D])];
    inputs.extend(proto.named_params().into_iter().map(|(_, p)| p.get()));
    let f = |v: &[Tensor]| -> Result<Tensor> {
        let l = MoeLayer::new(&config("default-moe", 0.9), Device::cpu())?;
        l.set_training(false);
        for ((_, p), value) in l.named_params().iter().zip(&v[1..]) {
            p.set(value.clone())?;
        }
        common::test_loss(&l.forward(&v[0])?.y)
    };
    gradcheck(f, &inputs, &GradcheckOptions::default()).unwrap();
}

#[test]
fn gpu_matches_cpu() {
    let Some(gpu) = common::gpu_or_skip("default_moe gpu_matches_cpu") else {
        return;
    };
    for t in [T, 37] {
        let run = |dev: Device, dtype: DType| -> Vec<Vec<f64>> {
            let l = layer("default-moe", 0.8, dev, dtype, 110);
            let mut v = vec![];
            for seed in [111u64, 112] {
                let x = common::tensor_on(uniform_vec(t * D, -1.5, 1.5, seed), &[t, D], dtype, dev)
                    .with_grad()
                    .unwrap();
                let out = l.forward(&x).unwrap();
                let c = common::tensor_on(uniform_vec(t * D, -1.0, 1.0, 9), &[t, D], dtype, dev);
                out.y
                    .mul(&c)
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .backward()
                    .unwrap();
                v.push(out.y.to_vec_f64().unwrap());
                v.push(x.grad().unwrap().to_vec_f64().unwrap());
                v.push(table(&l));
            }
            v.extend(
                l.named_params()
                    .iter()
                    .map(|(_, p)| p.grad().unwrap().to_vec_f64().unwrap()),
            );
            v
        };
        let want = run(Device::cpu(), DType::F64);
        let got = run(gpu, DType::F32);
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            common::assert_close(&format!("T = {t}, tensor {i}"), a, b, 2e-4, 2e-3);
        }
    }
}
