//! `sigmoid-topk` and `softplus-topk` (docs/routers.md): top-k over independent affinities
//! `s = σ(o)` or `s = √softplus(o)`, weights the chosen affinities (renormalised by default).
//!
//! * (P1) the chosen experts are the top-k of `s + b` and the weights are the unbiased chosen
//!   affinities, normalised or not, against an f64 reference written from the definition;
//! * (P2) normalised weights sum to 1 per token; `probs` is `s / Σ s`;
//! * (P3) the router's gradient reaches only the chosen experts' logits;
//! * (P4) an f64 gradcheck of an MoE layer using each (with a nonzero selection bias), w.r.t.
//!   the input and every parameter;
//! * (P5) `softplus-topk`'s slope stays finite where softplus underflows;
//! * GPU (f32) against CPU (f64): routing, output and every gradient.

mod common;

use moegrad::gradcheck::{GradcheckOptions, gradcheck};
use moegrad::moe::{BalanceMethod, Balancing, MoeConfig, MoeLayer, RouterConfig, build_router};
use moegrad::nn::Parameters;
use moegrad::{DType, Device, Result, Tensor};

const ROUTERS: [&str; 2] = ["sigmoid-topk", "softplus-topk"];

use common::uniform_vec;

fn affinity(router: &str, o: f64) -> f64 {
    if router == "sigmoid-topk" {
        1.0 / (1.0 + (-o).exp())
    } else {
        let sp = if o > 30.0 { o } else { o.exp().ln_1p() };
        sp.max(1e-30).sqrt()
    }
}

/// The definition in f64: chosen experts (best first) with their weights.
fn reference(
    router: &str,
    logits: &[f64],
    bias: &[f64],
    k: usize,
    norm: bool,
) -> Vec<(usize, f64)> {
    let s: Vec<f64> = logits.iter().map(|&o| affinity(router, o)).collect();
    let mut order: Vec<usize> = (0..s.len()).collect();
    order.sort_by(|&a, &b| (s[b] + bias[b]).total_cmp(&(s[a] + bias[a])));
    let top = &order[..k];
    let total: f64 = top.iter().map(|&i| s[i]).sum();
    top.iter()
        .map(|&i| (i, if norm { s[i] / total } else { s[i] }))
        .collect()
}

fn router_cfg(d: usize, n: usize, k: usize, norm: bool, seed: u64) -> RouterConfig {
    let mut cfg = RouterConfig::new(d, n, k);
    cfg.seed = seed;
    cfg.selection_bias = true;
    cfg.options.insert("normalize".into(), norm.to_string());
    cfg
}

#[test]
fn p1_p2_routing_matches_the_definition() {
    let (d, n, k, t) = (5, 8, 3, 20);
    for router in ROUTERS {
        for norm in [true, false] {
            let cfg = router_cfg(d, n, k, norm, 4);
            let r = build_router(router, &cfg, Device::cpu()).unwrap();
            let bias = uniform_vec(n, -0.3, 0.3, 5);
            r.selection_bias()
                .unwrap()
                .set(
                    &Tensor::from_f64(bias.clone(), &[n], Device::cpu()).unwrap(),
                    "b",
                )
                .unwrap();
            // f64 weights so the reference comparison is tight
            r.visit_params("", &mut |_, p| {
                p.set(p.get().to_dtype(DType::F64).unwrap()).unwrap()
            });
            let xv = uniform_vec(t * d, -2.0, 2.0, 6);
            let x = common::f64t(&xv, &[t, d]);
            let routing = r.route(&x).unwrap();
            let logits = routing.logits.to_vec_f64().unwrap();
            let (experts, weights, probs) = (
                routing
                    .expert
                    .to_dtype(DType::F64)
                    .unwrap()
                    .to_vec_f64()
                    .unwrap(),
                routing.weight.to_vec_f64().unwrap(),
                routing.probs.to_vec_f64().unwrap(),
            );
            for tok in 0..t {
                let row = &logits[tok * n..(tok + 1) * n];
                let want = reference(router, row, &bias, k, norm);
                for (j, (e, w)) in want.iter().enumerate() {
                    let a = tok * k + j;
                    assert_eq!(experts[a], *e as f64, "{router} token {tok} slot {j}");
                    assert!(
                        (weights[a] - w).abs() < 1e-12,
                        "{router} weight {}",
                        weights[a]
                    );
                }
                if norm {
                    let sum: f64 = weights[tok * k..(tok + 1) * k].iter().sum();
                    assert!((sum - 1.0).abs() < 1e-12, "{router}: {sum}");
                }
                let s: Vec<f64> = row.iter().map(|&o| affinity(router, o)).collect();
                let total: f64 = s.iter().sum();
                for i in 0..n {
                    assert!((probs[tok * n + i] - s[i] / total).abs() < 1e-12);
                }
            }
        }
    }
}

#[test]
fn p3_only_the_chosen_logits_get_a_gradient() {
    let (n, k, t) = (6, 2, 9);
    for router in ROUTERS {
        // an identity gate (d = n, no bias): the logits are the input, so ∂/∂x is ∂/∂o
        let mut cfg = router_cfg(n, n, k, true, 7);
        cfg.gate_bias = false;
        let r = build_router(router, &cfg, Device::cpu()).unwrap();
        let eye: Vec<f64> = (0..n * n)
            .map(|i| if i / n == i % n { 1.0 } else { 0.0 })
            .collect();
        r.visit_params("", &mut |_, p| p.set(common::f64t(&eye, &[n, n])).unwrap());
        let x = common::f64t(&uniform_vec(t * n, -2.0, 2.0, 8), &[t, n])
            .with_grad()
            .unwrap();
        let routing = r.route(&x).unwrap();
        let c = common::f64t(&uniform_vec(t * k, -1.0, 1.0, 9), &[t * k]);
        routing
            .weight
            .mul(&c)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let g = x.grad().unwrap().to_vec_f64().unwrap();
        let experts = routing
            .expert
            .to_dtype(DType::F64)
            .unwrap()
            .to_vec_f64()
            .unwrap();
        let mut nonzero = 0;
        for tok in 0..t {
            for i in 0..n {
                let chosen = experts[tok * k..(tok + 1) * k].contains(&(i as f64));
                let gi = g[tok * n + i];
                if !chosen {
                    assert_eq!(gi, 0.0, "{router}: token {tok}, unchosen expert {i}");
                } else if gi != 0.0 {
                    nonzero += 1;
                }
            }
        }
        assert!(
            nonzero > t,
            "{router}: the chosen logits must get gradients"
        );
    }
}

fn layer_config(router: &str, norm: bool) -> MoeConfig {
    let mut cfg = MoeConfig::new(5, 6, 8, 3);
    cfg.router = router.into();
    cfg.seed = 21;
    cfg.balancing = Balancing {
        method: BalanceMethod::AuxFree,
        ..Balancing::default()
    };
    cfg.router_options
        .insert("normalize".into(), norm.to_string());
    cfg
}

#[test]
fn p4_layer_gradcheck_in_f64() {
    for router in ROUTERS {
        for norm in [true, false] {
            let cfg = layer_config(router, norm);
            let bias = common::f64t(&uniform_vec(8, -0.2, 0.2, 43), &[8]);
            let make = || {
                let l = MoeLayer::new(&cfg, Device::cpu()).unwrap();
                l.load_state("router.selection_bias", &bias).unwrap();
                // evaluation: the bias balancer does not move the bias between evaluations
                l.set_training(false);
                l
            };
            let proto = make();
            let mut inputs = vec![common::f64t(&uniform_vec(7 * 5, -1.0, 1.0, 47), &[7, 5])];
            for (i, (name, p)) in proto.named_params().into_iter().enumerate() {
                let value = if name.ends_with("b1") || name.ends_with("b2") {
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
                common::test_loss(&l.forward(&v[0])?.y)
            };
            if let Err(e) = gradcheck(f, &inputs, &GradcheckOptions::default()) {
                panic!("{router} normalize = {norm}: {e}");
            }
        }
    }
}

#[test]
fn p5_softplus_slope_stays_finite_where_softplus_underflows() {
    let r = build_router(
        "softplus-topk",
        &router_cfg(1, 3, 1, false, 1),
        Device::cpu(),
    )
    .unwrap();
    // weight [1, 3]: logits (−200, 0, 1) for x = 1 (f32: softplus(−200) underflows to 0)
    r.visit_params("", &mut |name, p| {
        if name.ends_with("weight") {
            p.set(Tensor::from_f32(vec![-200.0, 0.0, 1.0], &[1, 3], Device::cpu()).unwrap())
                .unwrap()
        } else {
            p.set(Tensor::zeros(&[3], DType::F32, Device::cpu()).unwrap())
                .unwrap()
        }
    });
    let x = Tensor::from_f32(vec![1.0], &[1, 1], Device::cpu()).unwrap();
    let routing = r.route(&x).unwrap();
    let (p, w) = (
        routing.probs.sum_all().unwrap(),
        routing.weight.sum_all().unwrap(),
    );
    p.add(&w).unwrap().backward().unwrap();
    for (name, p) in r.named_params() {
        let g = p.grad().unwrap().to_vec_f64().unwrap();
        assert!(g.iter().all(|v| v.is_finite()), "{name}: {g:?}");
    }
}

#[test]
fn gpu_matches_cpu() {
    let Some(gpu) = common::gpu_or_skip("scored_topk gpu_matches_cpu") else {
        return;
    };
    for router in ROUTERS {
        let cfg = layer_config(router, true);
        let bias = common::f64t(&uniform_vec(8, -0.2, 0.2, 13), &[8]);
        let x = uniform_vec(33 * 5, -1.0, 1.0, 17);
        let run = |dev: Device, dtype: DType| -> Vec<Vec<f64>> {
            let l = MoeLayer::new(&cfg, dev).unwrap();
            l.load_state("router.selection_bias", &bias).unwrap();
            l.set_training(false);
            for (_, p) in l.named_params() {
                p.set(p.get().to_dtype(dtype).unwrap()).unwrap();
            }
            let xd = common::tensor_on(x.clone(), &[33, 5], dtype, dev)
                .with_grad()
                .unwrap();
            let r = l.router().route(&xd).unwrap();
            let out = l.forward_routed(&xd, std::slice::from_ref(&r)).unwrap();
            common::test_loss(&out.y).unwrap().backward().unwrap();
            let mut v = vec![
                r.expert.to_dtype(DType::F32).unwrap().to_vec_f64().unwrap(),
                r.weight.to_vec_f64().unwrap(),
                r.probs.to_vec_f64().unwrap(),
                out.y.to_vec_f64().unwrap(),
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
        assert_eq!(got[0], want[0], "{router}: the same experts must be chosen");
        for (i, (a, b)) in got.iter().zip(&want).enumerate().skip(1) {
            common::assert_close(&format!("{router} {gpu:?}, tensor {i}"), a, b, 2e-4, 2e-3);
        }
    }
}
