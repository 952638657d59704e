//! `remoe` (docs/routers.md): ReLU gates with an adaptive, load-balanced L1 penalty.
//!
//! * (P1) the routing against an f64 reference from the definition: weights `ReLU(o)`, exactly
//!   the open gates valid, the penalty `λ·(1/T) Σ f_i g_ti` with `f_i = n/(kT)·open_i`;
//! * (P2) λ steps by α up while too few gates are closed and down while too many are, only in
//!   training, and round-trips through the router state;
//! * (P3) closed gates get no gradient from the output; an f64 gradcheck of an MoE layer;
//! * (P4) trained, the average number of open gates settles near k;
//! * GPU (f32) against CPU (f64).

mod common;

use moegrad::gradcheck::{GradcheckOptions, gradcheck};
use moegrad::moe::{MoeConfig, MoeLayer, RouterConfig, build_router};
use moegrad::nn::Parameters;
use moegrad::optim::Optimizer;
use moegrad::{DType, Device, Result, Tensor};

use common::uniform_vec;

fn rcfg(d: usize, n: usize, k: usize, opts: &[(&str, &str)]) -> RouterConfig {
    let mut c = RouterConfig::new(d, n, k);
    c.seed = 5;
    for (key, v) in opts {
        c.options.insert(key.to_string(), v.to_string());
    }
    c
}

fn lambda_of(r: &dyn moegrad::moe::Router) -> f64 {
    let s = r.state().unwrap();
    s.iter()
        .find(|(n, _)| n == "l1_lambda")
        .unwrap()
        .1
        .to_vec_f64()
        .unwrap()[0]
}

#[test]
fn p1_routing_and_penalty_match_the_definition() {
    let (d, n, k, t) = (4, 6, 2, 10);
    for balanced in ["true", "false"] {
        let r = build_router(
            "remoe",
            &rcfg(d, n, k, &[("lambda0", "0.3"), ("balanced", balanced)]),
            Device::cpu(),
        )
        .unwrap();
        r.set_training(false);
        r.visit_params("", &mut |_, p| {
            p.set(p.get().to_dtype(DType::F64).unwrap()).unwrap()
        });
        let x = common::f64t(&uniform_vec(t * d, -2.0, 2.0, 3), &[t, d]);
        let routing = r.route(&x).unwrap();
        let o = routing.logits.to_vec_f64().unwrap();
        let (w, valid, e) = (
            routing.weight.to_vec_f64().unwrap(),
            routing.valid.to_vec_f64().unwrap(),
            routing
                .expert
                .to_dtype(DType::F64)
                .unwrap()
                .to_vec_f64()
                .unwrap(),
        );
        let mut open = vec![0.0; n];
        for tok in 0..t {
            for (i, open_i) in open.iter_mut().enumerate() {
                let a = tok * n + i;
                let g = o[a].max(0.0);
                assert_eq!(e[a], i as f64);
                assert!((w[a] - g).abs() < 1e-12);
                assert_eq!(
                    valid[a],
                    if g > 0.0 { 1.0 } else { 0.0 },
                    "token {tok} expert {i}"
                );
                if g > 0.0 {
                    *open_i += 1.0;
                }
            }
        }
        let f: Vec<f64> = open
            .iter()
            .map(|c| {
                if balanced == "true" {
                    n as f64 / (k * t) as f64 * c
                } else {
                    1.0
                }
            })
            .collect();
        let l1: f64 = (0..t * n).map(|a| f[a % n] * o[a].max(0.0)).sum::<f64>() / t as f64;
        let aux = routing.aux_loss.unwrap().item().unwrap();
        assert!(
            (aux - 0.3 * l1).abs() < 1e-6 * (1.0 + l1),
            "{aux} vs {}",
            0.3 * l1
        );
        // the statistics' distribution: g normalised per token
        let probs = routing.probs.to_vec_f64().unwrap();
        for tok in 0..t {
            let s: f64 = (0..n).map(|i| o[tok * n + i].max(0.0)).sum();
            for i in 0..n {
                let want = if s > 0.0 {
                    o[tok * n + i].max(0.0) / s
                } else {
                    0.0
                };
                assert!((probs[tok * n + i] - want).abs() < 1e-9);
            }
        }
    }
}

#[test]
fn p2_lambda_steps_toward_the_target_in_training_only() {
    let (d, n) = (3, 4);
    let x = common::f64t(&uniform_vec(8 * d, -1.0, 1.0, 4), &[8, d])
        .to_dtype(DType::F32)
        .unwrap();
    // target 0.99: almost every gate must close, so λ grows by α each batch
    let up = build_router(
        "remoe",
        &rcfg(
            d,
            n,
            1,
            &[
                ("target_sparsity", "0.99"),
                ("lambda0", "0.01"),
                ("alpha", "2"),
            ],
        ),
        Device::cpu(),
    )
    .unwrap();
    for step in 1..=3 {
        up.route(&x).unwrap();
        let l = lambda_of(up.as_ref());
        assert!(
            (l - 0.01 * 2f64.powi(step)).abs() < 1e-8,
            "step {step}: {l}"
        );
    }
    // target 0: no gate should close, so λ shrinks
    let down = build_router(
        "remoe",
        &rcfg(
            d,
            n,
            1,
            &[
                ("target_sparsity", "0"),
                ("lambda0", "0.01"),
                ("alpha", "2"),
            ],
        ),
        Device::cpu(),
    )
    .unwrap();
    down.route(&x).unwrap();
    assert!((lambda_of(down.as_ref()) - 0.005).abs() < 1e-9);
    // evaluation leaves λ alone
    down.set_training(false);
    down.route(&x).unwrap();
    assert!((lambda_of(down.as_ref()) - 0.005).abs() < 1e-9);
    // the state round-trips
    let other = build_router("remoe", &rcfg(d, n, 1, &[]), Device::cpu()).unwrap();
    for (name, v) in up.state().unwrap() {
        other.load_state(&name, &v).unwrap();
    }
    assert_eq!(lambda_of(other.as_ref()), lambda_of(up.as_ref()));
    let bad = Tensor::scalar(-1.0, DType::F64, Device::cpu()).unwrap();
    assert!(other.load_state("l1_lambda", &bad).is_err());
}

fn layer_config() -> MoeConfig {
    let mut c = MoeConfig::new(5, 6, 6, 2);
    c.router = "remoe".into();
    c.seed = 8;
    c.balance_loss = 0.05;
    c.router_options.insert("lambda0".into(), "0.2".into());
    c
}

fn loss_of(out: &moegrad::moe::MoeOutput) -> Result<Tensor> {
    let y = &out.y;
    let c = Tensor::from_f64(
        uniform_vec(y.numel(), -1.0, 1.0, 99),
        y.shape(),
        Device::cpu(),
    )?
    .to_dtype(y.dtype())?
    .to_device(y.device())?;
    y.mul(&c)?
        .sum_all()?
        .add(&out.aux_loss.to_dtype(y.dtype())?)
}

#[test]
fn p3_layer_gradcheck_in_f64_and_closed_gates_get_no_output_gradient() {
    let cfg = layer_config();
    let make = || {
        let l = MoeLayer::new(&cfg, Device::cpu()).unwrap();
        l.set_training(false);
        l
    };
    let proto = make();
    let mut inputs = vec![common::f64t(&uniform_vec(7 * 5, -1.0, 1.0, 47), &[7, 5])];
    for (i, (name, p)) in proto.named_params().into_iter().enumerate() {
        let value = if name.ends_with("b1") || name.ends_with("b2") || name.ends_with("bias") {
            Tensor::from_f64(
                uniform_vec(p.get().numel(), -0.3, 0.3, 60 + i as u64),
                p.get().shape(),
                Device::cpu(),
            )
            .unwrap()
        } else {
            p.get().to_dtype(DType::F64).unwrap()
        };
        inputs.push(value);
    }
    let f = |v: &[Tensor]| -> Result<Tensor> {
        let l = make();
        for ((_, p), value) in l.named_params().iter().zip(&v[1..]) {
            p.set(value.clone())?;
        }
        loss_of(&l.forward(&v[0])?)
    };
    if let Err(e) = gradcheck(f, &inputs, &GradcheckOptions::default()) {
        panic!("remoe layer: {e}");
    }
    // an identity gate: the gradient of the output reaches open gates' logits only
    let n = 4;
    let r = build_router("remoe", &rcfg(n, n, 2, &[]), Device::cpu()).unwrap();
    r.set_training(false);
    let eye: Vec<f64> = (0..n * n)
        .map(|i| if i / n == i % n { 1.0 } else { 0.0 })
        .collect();
    r.visit_params("", &mut |name, p| {
        let v = if name.ends_with("weight") {
            common::f64t(&eye, &[n, n])
        } else {
            common::f64t(&[0.0; 4], &[n])
        };
        p.set(v).unwrap()
    });
    let xv = uniform_vec(6 * n, -1.0, 1.0, 5);
    let x = common::f64t(&xv, &[6, n]).with_grad().unwrap();
    let routing = r.route(&x).unwrap();
    let c = common::f64t(&uniform_vec(6 * n, 0.5, 1.0, 6), &[6 * n]);
    routing
        .weight
        .mul(&c)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let g = x.grad().unwrap().to_vec_f64().unwrap();
    for (a, (&xa, &ga)) in xv.iter().zip(&g).enumerate() {
        if xa < 0.0 {
            assert_eq!(ga, 0.0, "closed gate {a} got {ga}");
        } else {
            assert!(ga != 0.0, "open gate {a}");
        }
    }
}

#[test]
fn p4_training_settles_the_open_gates_near_k() {
    // a layer fitting a fixed random map: the penalty has to close gates to reach k = 2 of 8
    let mut c = MoeConfig::new(6, 8, 8, 2);
    c.router = "remoe".into();
    c.seed = 2;
    c.router_options.insert("lambda0".into(), "1e-4".into());
    let l = MoeLayer::new(&c, Device::cpu()).unwrap();
    let params = l.named_params();
    let mut opt = moegrad::optim::Adam::new(1e-2).unwrap();
    let target = common::f64t(&uniform_vec(64 * 6, -1.0, 1.0, 9), &[64, 6])
        .to_dtype(DType::F32)
        .unwrap();
    let mut per_token = Vec::new();
    let mut first = 0.0;
    for step in 0..300 {
        let x = common::f64t(&uniform_vec(64 * 6, -1.0, 1.0, 100 + step), &[64, 6])
            .to_dtype(DType::F32)
            .unwrap();
        let out = l.forward(&x).unwrap();
        let err = out.y.sub(&target).unwrap();
        let loss = err
            .mul(&err)
            .unwrap()
            .mean_all()
            .unwrap()
            .add(&out.aux_loss)
            .unwrap();
        for (_, p) in &params {
            p.zero_grad();
        }
        loss.backward().unwrap();
        opt.step(&params, None).unwrap();
        let kept: f64 = out.stats.kept_per_expert.to_vec_f64().unwrap().iter().sum();
        if step == 0 {
            first = kept / 64.0;
        }
        if step >= 200 {
            per_token.push(kept / 64.0);
        }
    }
    let mean = per_token.iter().sum::<f64>() / per_token.len() as f64;
    // about half the gates start open; the penalty closes them to about k (it cannot open
    // gates, so a task that needs fewer may settle a little below)
    assert!(first > 3.0, "open gates per token at the start {first}");
    assert!((1.0..=2.6).contains(&mean), "open gates per token {mean}");
}

#[test]
fn gpu_matches_cpu() {
    let Some(gpu) = common::gpu_or_skip("remoe gpu_matches_cpu") else {
        return;
    };
    let cfg = layer_config();
    let x = uniform_vec(33 * 5, -1.0, 1.0, 17);
    let run = |dev: Device, dtype: DType| -> Vec<Vec<f64>> {
        let l = MoeLayer::new(&cfg, dev).unwrap();
        l.set_training(false);
        for (_, p) in l.named_params() {
            p.set(p.get().to_dtype(dtype).unwrap()).unwrap();
        }
        let xd = common::tensor_on(x.clone(), &[33, 5], dtype, dev)
            .with_grad()
            .unwrap();
        let out = l.forward(&xd).unwrap();
        loss_of(&out).unwrap().backward().unwrap();
        let mut v = vec![
            out.y.to_vec_f64().unwrap(),
            vec![out.aux_loss.to_vec_f64().unwrap()[0]],
            xd.grad().unwrap().to_vec_f64().unwrap(),
        ];
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
        common::assert_close(&format!("remoe {gpu:?}, tensor {i}"), a, b, 2e-4, 2e-3);
    }
}

#[test]
fn bad_options_are_errors_naming_the_option() {
    for (key, value) in [
        ("target_sparsity", "1"),
        ("alpha", "1"),
        ("lambda0", "0"),
        ("balanced", "maybe"),
    ] {
        let e = match build_router("remoe", &rcfg(3, 4, 1, &[(key, value)]), Device::cpu()) {
            Ok(_) => panic!("{key}={value} accepted"),
            Err(e) => e.to_string(),
        };
        assert!(e.contains(key), "{key}: {e}");
    }
}
