//! Null experts (`MoeConfig::null_experts`, `--null-experts N`; AdaMoE, Zeng et al. 2024; MoE++,
//! Jin et al. 2024): the router scores n + N experts; a token's choices among the N null ones
//! output zero and cost nothing, so it uses between 0 and k real experts.
//!
//! * (N1) the output is `Σ_{chosen real i} w_i E_i(x)` with the router's weights over all its
//!   choices (an f64 reference from the definition), and some token did choose a null expert;
//! * (N2) null choices cost nothing: the plan keeps exactly the real assignments, and the
//!   diagnostics' `experts_per_token` counts them;
//! * (N3) the Switch loss counts every routed expert, nulls included: `α(n+N) Σ f_i P_i`;
//! * (N4) an f64 gradcheck of the layer with null experts, w.r.t. the input and every
//!   parameter;
//! * (N5) a selection bias covers the null experts too; refused routers name the reason;
//! * GPU (f32) against CPU (f64).

mod common;
#[path = "common/moe_f64.rs"]
mod moe_f64;

use common::uniform_vec;
use moe_f64::MoeF64;
use moegrad::gradcheck::{GradcheckOptions, gradcheck};
use moegrad::moe::{BalanceMethod, Balancing, MoeConfig, MoeLayer};
use moegrad::nn::Parameters;
use moegrad::{DType, Device, Result, Tensor};

const D: usize = 4;
const H: usize = 5;
const N: usize = 4; // real experts
const NULLS: usize = 3;
const K: usize = 2;
const T: usize = 16;

fn config(router: &str, balancing: Balancing) -> MoeConfig {
    let mut cfg = MoeConfig::new(D, H, N, K);
    cfg.router = router.into();
    cfg.seed = 7;
    cfg.null_experts = NULLS;
    cfg.balancing = balancing;
    cfg.balance_loss = 0.01;
    cfg
}

fn aux() -> Balancing {
    Balancing {
        method: BalanceMethod::Aux,
        ..Balancing::default()
    }
}

fn layer(dev: Device, dtype: DType, seed: u64) -> MoeLayer {
    let l = MoeLayer::new(&config("topk", aux()), dev).unwrap();
    common::fill_params_uniform(&l, (-0.9, 0.9), seed, dtype, dev);
    l
}

fn x_values(seed: u64) -> Vec<f64> {
    uniform_vec(T * D, -2.0, 2.0, seed)
}

/// Per token: the chosen experts (of n + N) with their renormalised weights, π over n + N, and
/// the output from the real ones.
struct Reference {
    chosen: Vec<Vec<(usize, f64)>>,
    pi: Vec<Vec<f64>>,
    y: Vec<f64>,
}

fn reference(l: &MoeLayer, x: &[f64]) -> Reference {
    let layer = MoeF64::of(l, (D, H, D), N + NULLS);
    let mut out = Reference {
        chosen: vec![],
        pi: vec![],
        y: vec![],
    };
    for t in 0..T {
        let xt = &x[t * D..(t + 1) * D];
        let o = layer.logits(xt);
        out.pi.push(moe_f64::softmax(&o));
        let mut order: Vec<usize> = (0..N + NULLS).collect();
        order.sort_by(|&a, &c| o[c].total_cmp(&o[a]));
        let top: Vec<f64> = order[..K].iter().map(|&i| o[i]).collect();
        let w = moe_f64::softmax(&top);
        let chosen: Vec<(usize, f64)> = order[..K].iter().copied().zip(w).collect();
        let mut y = vec![0.0; D];
        // a null expert (index ≥ N) outputs zero
        for &(i, wt) in chosen.iter().filter(|(i, _)| *i < N) {
            for (yc, e) in y.iter_mut().zip(layer.expert(i, xt)) {
                *yc += wt * e;
            }
        }
        out.y.extend(y);
        out.chosen.push(chosen);
    }
    out
}

#[test]
fn n1_output_uses_only_the_chosen_real_experts() {
    let l = layer(Device::cpu(), DType::F64, 13);
    let x = x_values(11);
    let r = reference(&l, &x);
    let reals: Vec<usize> = r
        .chosen
        .iter()
        .map(|c| c.iter().filter(|(i, _)| *i < N).count())
        .collect();
    assert!(
        reals.iter().any(|&c| c < K),
        "no token chose a null expert: {reals:?}"
    );
    assert!(reals.contains(&K), "every token chose a null expert");
    let out = l.forward(&common::f64t(&x, &[T, D])).unwrap();
    common::assert_close("y", &out.y.to_vec_f64().unwrap(), &r.y, 1e-12, 1e-12);
}

#[test]
fn n2_null_choices_cost_nothing_and_are_counted() {
    let l = layer(Device::cpu(), DType::F64, 20);
    let x = x_values(21);
    let r = reference(&l, &x);
    let real: usize = r
        .chosen
        .iter()
        .map(|c| c.iter().filter(|(i, _)| *i < N).count())
        .sum();
    assert!(real < T * K, "no null choice in this batch");
    let routing = l.router().route(&common::f64t(&x, &[T, D])).unwrap();
    assert_eq!(
        routing.experts,
        N + NULLS,
        "the router scores the null experts"
    );
    let dispatched = routing.clone().without_null_experts(N).unwrap();
    let plan =
        moegrad::moe::DispatchPlan::build(&dispatched, moegrad::moe::Capacity::Dropless).unwrap();
    let kept: f64 = plan.row_kept.to_vec_f64().unwrap().iter().sum();
    assert_eq!(kept as usize, real, "rows computed = real assignments");
    let per_expert: f64 = plan.kept_per_expert.to_vec_f64().unwrap().iter().sum();
    assert_eq!(per_expert as usize, real);
    let out = l.forward(&common::f64t(&x, &[T, D])).unwrap();
    let mut window = moegrad::moe::RoutingWindow::new();
    window.add(std::slice::from_ref(&out.stats)).unwrap();
    let per_token = window.read().unwrap().layers[0].experts_per_token;
    assert!(
        (per_token - real as f64 / T as f64).abs() < 1e-6,
        "{per_token}"
    );
    // the statistics describe the n real experts
    assert_eq!(out.stats.kept_per_expert.shape(), [N]);
    assert_eq!(out.stats.probs.shape(), [T, N]);
}

#[test]
fn n3_switch_loss_counts_every_routed_expert() {
    let l = layer(Device::cpu(), DType::F64, 30);
    let x = x_values(31);
    let r = reference(&l, &x);
    let routed = N + NULLS;
    let mut f = vec![0.0; routed];
    for c in &r.chosen {
        for &(i, _) in c {
            f[i] += 1.0 / (T * K) as f64;
        }
    }
    let p: Vec<f64> = (0..routed)
        .map(|i| r.pi.iter().map(|pi| pi[i]).sum::<f64>() / T as f64)
        .collect();
    let want = 0.01 * routed as f64 * (0..routed).map(|i| f[i] * p[i]).sum::<f64>();
    let got = l
        .forward(&common::f64t(&x, &[T, D]))
        .unwrap()
        .aux_loss
        .item()
        .unwrap();
    assert!((got - want).abs() < 1e-12, "{got} vs {want}");
}

#[test]
fn n4_layer_gradcheck_in_f64() {
    let proto = layer(Device::cpu(), DType::F64, 40);
    let mut inputs = vec![common::f64t(&x_values(41), &[T, D])];
    inputs.extend(proto.named_params().into_iter().map(|(_, p)| p.get()));
    let f = |v: &[Tensor]| -> Result<Tensor> {
        let l = MoeLayer::new(&config("topk", aux()), Device::cpu())?;
        for ((_, p), value) in l.named_params().iter().zip(&v[1..]) {
            p.set(value.clone())?;
        }
        let out = l.forward(&v[0])?;
        common::test_loss(&out.y)?.add(&out.aux_loss)
    };
    gradcheck(f, &inputs, &GradcheckOptions::default()).unwrap();
}

#[test]
fn n5_bias_covers_null_experts_and_refusals_name_the_reason() {
    let free = Balancing {
        method: BalanceMethod::AuxFree,
        ..Balancing::default()
    };
    let l = MoeLayer::new(&config("topk", free), Device::cpu()).unwrap();
    let bias = l
        .state()
        .unwrap()
        .into_iter()
        .find(|(n, _)| n == "router.selection_bias")
        .unwrap()
        .1;
    assert_eq!(bias.shape(), [N + NULLS]);
    l.forward(
        &Tensor::from_f64(x_values(51), &[T, D], Device::cpu())
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap(),
    )
    .unwrap();
    for router in ["expert-choice", "hash", "softmax"] {
        let err = MoeLayer::new(&config(router, aux()), Device::cpu())
            .err()
            .unwrap_or_else(|| panic!("{router} was accepted with null experts"))
            .to_string();
        assert!(
            err.contains("--null-experts") && err.contains(router),
            "{err}"
        );
    }
}

#[test]
fn gpu_matches_cpu() {
    let Some(gpu) = common::gpu_or_skip("null_experts gpu_matches_cpu") else {
        return;
    };
    for t in [T, 45] {
        let run = |dev: Device, dtype: DType| -> Vec<Vec<f64>> {
            let l = layer(dev, dtype, 60);
            let x = common::tensor_on(uniform_vec(t * D, -2.0, 2.0, 61), &[t, D], dtype, dev)
                .with_grad()
                .unwrap();
            let out = l.forward(&x).unwrap();
            let c = common::tensor_on(uniform_vec(t * D, -1.0, 1.0, 62), &[t, D], dtype, dev);
            out.y
                .mul(&c)
                .unwrap()
                .sum_all()
                .unwrap()
                .add(&out.aux_loss)
                .unwrap()
                .backward()
                .unwrap();
            let mut v = vec![
                out.y.to_vec_f64().unwrap(),
                vec![out.aux_loss.item().unwrap()],
                x.grad().unwrap().to_vec_f64().unwrap(),
                out.stats.kept_per_expert.to_vec_f64().unwrap(),
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
            common::assert_close(&format!("T = {t}, tensor {i}"), a, b, 2e-4, 2e-3);
        }
    }
}
