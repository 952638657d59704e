//! GPU parity of the MoE layer in training mode, with capacity and drops: the existing layer
//! parity test (tests/moe.rs) runs in evaluation mode and dropless, so training-mode routing
//! (the routers' noise) and the capacity that drops assignments were never compared across
//! devices.
//!
//! The same layer (the CPU's parameters copied to the GPU) routes the same tokens on the CPU in
//! f64 and on the GPU in f32, in training mode, under a capacity factor γ that drops
//! assignments (γ·A/n non-integral, so the ceiling matters). The routers' noise is drawn on the
//! device from a counter-based hash of the seed and the element index, the same bits on both
//! devices; [`uniforms_are_the_same_bits_on_both_devices`] checks that precondition, and both
//! layers start with their noise counters at zero, so both routings see the same uniforms.
//! Compared: the routing (experts and tokens of every assignment, exactly), the dispatch plan
//! (order, kept or dropped per row, offsets, counts, exactly), the output, the auxiliary loss
//! (balance and z-loss), the statistics, and the gradients of the input and of every parameter
//! for one random upstream gradient. Sizes, k and γ are drawn by a fixed-seed proptest runner
//! with a small case count.
//!
//! Without a GPU adapter the tests print "skipping" and return (`MOEGRAD_REQUIRE_GPU=1` makes
//! that a failure).

mod common;

use moegrad::moe::{Capacity, DispatchPlan, MoeConfig, MoeLayer};
use moegrad::nn::Param;
use moegrad::nn::Parameters;
use moegrad::{DType, Device, Tensor};
use proptest::prelude::*;
use proptest::test_runner::{RngAlgorithm, TestRng, TestRunner};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Routers compared, with whether they take k > 1: plain top-k, Switch (top-1 with jitter
/// noise in training), Shazeer's noisy top-k (Gaussian noise from two uniform draws) and
/// SparseMixer (sampled experts).
const ROUTERS: [(&str, bool); 4] = [
    ("topk", true),
    ("switch", false),
    ("topk-noisy", true),
    ("sparsemixer", false),
];

fn params(l: &MoeLayer) -> Vec<(String, Param)> {
    let mut v = Vec::new();
    l.visit_params("", &mut |n, p| v.push((n, p.clone())));
    v
}

fn host(values: Vec<f64>, shape: &[usize]) -> Tensor {
    Tensor::from_f64(values, shape, Device::cpu()).unwrap()
}

/// Everything one training-mode forward and backward produces, as host values by name.
/// Integer results (routing, plan) are exact; the rest is compared within a tolerance.
struct Outcome {
    exact: Vec<(String, Vec<f64>)>,
    close: Vec<(String, Vec<f64>)>,
}

fn run(layer: &MoeLayer, x: &Tensor, up: &Tensor) -> Outcome {
    let ints =
        |t: &Tensor| -> Vec<f64> { t.to_vec_i32().unwrap().into_iter().map(f64::from).collect() };
    let xg = x.detach().with_grad().unwrap();
    let routing = layer.router().route(&xg).unwrap();
    let counted = if layer.router().variable_experts_per_token() {
        routing.tokens
    } else {
        routing.len()
    };
    let plan = DispatchPlan::build_sized(&routing, layer.config().capacity, counted).unwrap();
    let mut exact = vec![
        ("routing.token".to_string(), ints(&routing.token)),
        ("routing.expert".into(), ints(&routing.expert)),
        ("routing.valid".into(), routing.valid.to_vec_f64().unwrap()),
        ("plan.order".into(), ints(&plan.order)),
        ("plan.row_expert".into(), ints(&plan.row_expert)),
        ("plan.row_kept".into(), plan.row_kept.to_vec_f64().unwrap()),
        ("plan.offsets".into(), ints(&plan.offsets)),
    ];
    let out = layer
        .forward_routed(&xg, std::slice::from_ref(&routing))
        .unwrap();
    exact.push((
        "stats.kept_per_expert".into(),
        out.stats.kept_per_expert.to_vec_f64().unwrap(),
    ));
    exact.push((
        "stats.routed_per_expert".into(),
        out.stats.routed_per_expert.to_vec_f64().unwrap(),
    ));
    let u = up
        .to_dtype(out.y.dtype())
        .unwrap()
        .to_device(x.device())
        .unwrap();
    let loss = out.y.mul(&u).unwrap().sum_all().unwrap();
    let loss = loss
        .add(&out.aux_loss.to_dtype(loss.dtype()).unwrap())
        .unwrap();
    loss.backward().unwrap();
    let mut close = vec![
        ("y".to_string(), out.y.to_vec_f64().unwrap()),
        ("aux_loss".into(), out.aux_loss.to_vec_f64().unwrap()),
        (
            "stats.weight_per_expert".into(),
            out.stats.weight_per_expert().unwrap().to_vec_f64().unwrap(),
        ),
        (
            "routing.weight".into(),
            routing.weight.to_vec_f64().unwrap(),
        ),
        ("grad x".into(), xg.grad().unwrap().to_vec_f64().unwrap()),
    ];
    // a parameter without a gradient must have none on both devices: an empty list
    close.extend(params(layer).into_iter().map(|(name, p)| {
        let g = p
            .grad()
            .map(|g| g.to_vec_f64().unwrap())
            .unwrap_or_default();
        (format!("grad {name}"), g)
    }));
    Outcome { exact, close }
}

/// One case: `router` over `t` tokens, `n` experts, `k` per token, capacity factor `factor`.
/// Returns the assignments kept and routed (valid) in the case, so a caller can require drops.
fn layer_parity(
    gpu: Device,
    router: &str,
    (t, n, k): (usize, usize, usize),
    factor: f64,
    seed: u64,
) -> (f64, f64) {
    let mut cfg = MoeConfig::new(6, 5, n, k);
    cfg.router = router.into();
    cfg.seed = seed;
    cfg.capacity = Capacity::Factor {
        factor,
        min_capacity: 0,
    };
    cfg.balance_loss = 0.01;
    cfg.z_loss = 0.001;
    let name = format!("{router}: T {t}, n {n}, k {k}, γ {factor}");
    let cpu_layer = MoeLayer::new(&cfg, Device::cpu()).unwrap();
    for (_, p) in params(&cpu_layer) {
        p.set(p.get().to_dtype(DType::F64).unwrap().detach())
            .unwrap();
    }
    let gpu_layer = MoeLayer::new(&cfg, gpu).unwrap();
    for ((_, c), (_, g)) in params(&cpu_layer).iter().zip(&params(&gpu_layer)) {
        g.set(
            c.get()
                .to_dtype(DType::F32)
                .unwrap()
                .to_device(gpu)
                .unwrap(),
        )
        .unwrap();
    }
    cpu_layer.set_training(true);
    gpu_layer.set_training(true);

    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x7e57);
    let mut draw = |len: usize| -> Vec<f64> {
        (0..len)
            .map(|_| rng.random_range(-1.0f64..1.0) as f32 as f64)
            .collect()
    };
    let x = host(draw(t * 6), &[t, 6]);
    let up = host(draw(t * 6), &[t, 6]);
    let c = run(&cpu_layer, &x, &up);
    let g = run(
        &gpu_layer,
        &x.to_dtype(DType::F32).unwrap().to_device(gpu).unwrap(),
        &up,
    );
    for ((what, vc), (_, vg)) in c.exact.iter().zip(&g.exact) {
        assert_eq!(vc, vg, "{name}: {what} differs");
    }
    for ((what, vc), (_, vg)) in c.close.iter().zip(&g.close) {
        common::assert_close(&format!("{name}: {what}"), vg, vc, 3e-4, 3e-3);
    }
    let total = |what: &str| -> f64 {
        let (_, v) = c.exact.iter().find(|(w, _)| w == what).unwrap();
        v.iter().sum()
    };
    (
        total("stats.kept_per_expert"),
        total("stats.routed_per_expert"),
    )
}

#[test]
fn uniforms_are_the_same_bits_on_both_devices() {
    let Some(gpu) = common::gpu_or_skip("uniforms_are_the_same_bits_on_both_devices") else {
        return;
    };
    for (len, seed) in [(1usize, 0u64), (300, 7), (1000, u64::MAX - 3)] {
        let c = Tensor::rand_uniform(&[len], seed, DType::F32, Device::cpu()).unwrap();
        let g = Tensor::rand_uniform(&[len], seed, DType::F32, gpu).unwrap();
        let bits = |t: &Tensor| -> Vec<u32> {
            t.to_vec_f32()
                .unwrap()
                .into_iter()
                .map(f32::to_bits)
                .collect()
        };
        assert_eq!(bits(&c), bits(&g), "{len} uniforms from seed {seed}");
    }
}

#[test]
fn training_mode_layer_with_drops_matches_across_devices() {
    let Some(gpu) = common::gpu_or_skip("training_mode_layer_with_drops_matches_across_devices")
    else {
        return;
    };
    let cases = (
        0..ROUTERS.len(),
        1usize..=40,
        2usize..=8,
        1usize..=3,
        // γ·A/n is almost never integral for these
        0.3f64..1.6,
        any::<u64>(),
    );
    let config = ProptestConfig {
        cases: 12,
        max_shrink_iters: 32,
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    let mut runner = TestRunner::new_with_rng(
        config,
        TestRng::from_seed(RngAlgorithm::ChaCha, b"moe training-mode parity, drops."),
    );
    let result = runner.run(&cases, |(r, t, n, k, factor, seed)| {
        let (router, multi) = ROUTERS[r];
        let k = if multi { k.min(n) } else { 1 };
        layer_parity(gpu, router, (t, n, k), factor, seed);
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    // one fixed case where capacity certainly drops: 40 tokens, k = 2 over 4 experts at γ = 0.55
    // (C = ⌈0.55·80/4⌉ = 11 slots for 80 assignments, 44 kept at most), for every router
    for (router, multi) in ROUTERS {
        let k = if multi { 2 } else { 1 };
        let (kept, routed) = layer_parity(gpu, router, (40, 4, k), 0.55, 5);
        assert!(
            kept < routed,
            "{router}: capacity dropped nothing ({kept} of {routed} kept)"
        );
    }
}
