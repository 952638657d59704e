//! The MoE layer's all-experts path (`src/moe/all_experts.rs`): routings in which every token
//! uses every expert (the dense `softmax` router, the straight-through estimators in training)
//! run as two wide products with no dispatch plan.
//!
//! - On every device, the wide path gives what the plan gives (the CPU's plan in f64 is the
//!   reference): the output, the auxiliary losses, the routing statistics and the gradients of
//!   the input and of every parameter, over random sizes, both activations (ReLU, the gated
//!   SwiGLU), with and without biases, in training and evaluation. The profile shows which
//!   path ran, so a wide path that silently fell back to the plan fails.
//! - In f64 on the CPU its output is the definition `y_t = Σ_e softmax(x_t·W_g + b_g)_e ·
//!   expert_e(x_t)`, and its gradients pass a finite-difference check.
//! - It is not taken where it could differ from the plan (a capacity below T rows per expert),
//!   and by default it runs on the GPU only.
//!
//! Without a GPU adapter the GPU cases print "skipping" (`MOEGRAD_REQUIRE_GPU=1` makes that a
//! failure).

mod common;
#[path = "common/moe_f64.rs"]
mod moe_f64;

use moe_f64::{MoeF64, softmax};
use moegrad::gradcheck::{GradcheckOptions, gradcheck};
use moegrad::moe::{Capacity, MoeConfig, MoeLayer};
use moegrad::nn::{Activation, Param, Parameters};
use moegrad::{DType, Device, Result, Tensor};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn params(l: &MoeLayer) -> Vec<(String, Param)> {
    let mut v = Vec::new();
    l.visit_params("", &mut |n, p| v.push((n, p.clone())));
    v
}

/// A layer of `router` over `n` experts `d → hidden → d` with the given activation and biases,
/// balance and z losses on, on `device` in `dtype` (parameters cast from the same f32 draw, so
/// layers built alike hold the same values on every device).
fn layer(
    router: &str,
    (d, hidden, n): (usize, usize, usize),
    (activation, bias): (Activation, bool),
    device: Device,
    dtype: DType,
) -> MoeLayer {
    let mut cfg = MoeConfig::new(d, hidden, n, n);
    cfg.router = router.into();
    cfg.activation = activation;
    cfg.expert_bias = bias;
    cfg.balance_loss = 0.01;
    cfg.z_loss = 0.001;
    cfg.seed = 11;
    let l = MoeLayer::new(&cfg, device).unwrap();
    for (i, (name, p)) in params(&l).into_iter().enumerate() {
        let mut v = p.get().to_vec_f64().unwrap();
        // nonzero biases, so that no hidden unit sits at a kink and the bias paths matter
        if name.ends_with("b1") || name.ends_with("b2") {
            v = common::uniform_vec(v.len(), -0.3, 0.3, 40 + i as u64);
        }
        p.set(common::tensor_on(v, p.get().shape(), dtype, device))
            .unwrap();
    }
    l
}

/// Everything one forward and backward gives, by name, and whether the dispatch plan ran.
struct Outcome {
    values: Vec<(String, Vec<f64>)>,
    planned: bool,
}

fn run(l: &MoeLayer, x: &Tensor, up: &Tensor) -> Outcome {
    let xg = x.detach().with_grad().unwrap();
    let recording = moegrad::profile::start();
    let out = l.forward(&xg).unwrap();
    let u = up.to_dtype(out.y.dtype()).unwrap();
    let loss = out.y.mul(&u).unwrap().sum_all().unwrap();
    let loss = loss
        .add(&out.aux_loss.to_dtype(loss.dtype()).unwrap())
        .unwrap();
    loss.backward().unwrap();
    let report = recording.finish().expect("the profile recorded");
    let planned = report.rows().iter().any(|r| r.op == "dispatch_plan");
    let mut values = vec![
        ("y".to_string(), out.y.to_vec_f64().unwrap()),
        ("aux_loss".into(), out.aux_loss.to_vec_f64().unwrap()),
        (
            "stats.kept_per_expert".into(),
            out.stats.kept_per_expert.to_vec_f64().unwrap(),
        ),
        (
            "stats.routed_per_expert".into(),
            out.stats.routed_per_expert.to_vec_f64().unwrap(),
        ),
        (
            "stats.weight_per_expert".into(),
            out.stats.weight_per_expert().unwrap().to_vec_f64().unwrap(),
        ),
        ("grad x".into(), xg.grad().unwrap().to_vec_f64().unwrap()),
    ];
    values.extend(params(l).into_iter().map(|(name, p)| {
        let g = p
            .grad()
            .map(|g| g.to_vec_f64().unwrap())
            .unwrap_or_default();
        (format!("grad {name}"), g)
    }));
    Outcome { values, planned }
}

/// Routers whose routings use every expert (the estimators only in training).
const ROUTERS: [(&str, &[bool]); 4] = [
    ("softmax", &[true, false]),
    ("st", &[true]),
    ("gumbel-st", &[true]),
    ("reinmax", &[true]),
];

#[test]
fn the_wide_path_matches_the_plan_on_every_device() {
    let mut rng = ChaCha8Rng::seed_from_u64(2026);
    for device in common::devices("the_wide_path_matches_the_plan_on_every_device") {
        let (dtype, atol, rtol): (DType, f64, f64) = match device {
            Device::Cpu => (DType::F64, 1e-10, 1e-9),
            Device::Gpu => (DType::F32, 3e-4, 3e-3),
        };
        for (router, modes) in ROUTERS {
            for &training in modes {
                for form in [(Activation::Relu, true), (Activation::SwiGlu, false)] {
                    let t = rng.random_range(1..40usize);
                    let n = rng.random_range(1..7usize);
                    let (d, hidden) = (rng.random_range(1..9usize), rng.random_range(1..11usize));
                    let name = format!(
                        "{router} on {device} (training {training}, {:?}, T {t}, n {n}, d {d}, \
                         hidden {hidden})",
                        form.0
                    );
                    let x = common::uniform_vec(t * d, -1.0, 1.0, rng.random());
                    let up = common::uniform_vec(t * d, -1.0, 1.0, rng.random());
                    // the reference: the plan, on the CPU in f64
                    let mut reference =
                        layer(router, (d, hidden, n), form, Device::cpu(), DType::F64);
                    reference.set_all_experts_path(Some(false));
                    reference.set_training(training);
                    let want = run(
                        &reference,
                        &common::f64t(&x, &[t, d]),
                        &common::f64t(&up, &[t, d]),
                    );
                    assert!(want.planned, "{name}: the reference did not use the plan");
                    let mut wide = layer(router, (d, hidden, n), form, device, dtype);
                    wide.set_all_experts_path(Some(true));
                    wide.set_training(training);
                    let got = run(
                        &wide,
                        &common::tensor_on(x, &[t, d], dtype, device),
                        &common::tensor_on(up, &[t, d], dtype, device),
                    );
                    assert!(!got.planned, "{name}: the wide path built a dispatch plan");
                    for ((what, g), (_, w)) in got.values.iter().zip(&want.values) {
                        // the layer sums the weights per expert in f32 on every device
                        let (atol, rtol) = if what == "stats.weight_per_expert" {
                            (atol.max(1e-5), rtol.max(1e-6))
                        } else {
                            (atol, rtol)
                        };
                        common::assert_close(&format!("{name}: {what}"), g, w, atol, rtol);
                    }
                }
            }
        }
    }
}

#[test]
fn the_wide_path_follows_the_definition_in_f64() {
    let (t, d, hidden, n) = (9, 5, 7, 4);
    let mut l = layer(
        "softmax",
        (d, hidden, n),
        (Activation::Relu, true),
        Device::cpu(),
        DType::F64,
    );
    l.set_all_experts_path(Some(true));
    let x = common::uniform_vec(t * d, -1.0, 1.0, 5);
    let got = l.forward(&common::f64t(&x, &[t, d])).unwrap();
    let reference = MoeF64::of(&l, (d, hidden, d), n);
    let mut want = Vec::new();
    for row in x.chunks(d) {
        let p = softmax(&reference.logits(row));
        let mut y = vec![0.0; d];
        for (e, pe) in p.iter().enumerate() {
            for (yc, oc) in y.iter_mut().zip(reference.expert(e, row)) {
                *yc += pe * oc;
            }
        }
        want.extend(y);
    }
    common::assert_close(
        "softmax layer, wide path",
        &got.y.to_vec_f64().unwrap(),
        &want,
        1e-12,
        1e-12,
    );
}

#[test]
fn the_wide_path_passes_gradcheck() {
    let (t, d, hidden, n) = (5, 4, 3, 3);
    for form in [(Activation::Relu, true), (Activation::SwiGlu, true)] {
        let proto = layer("softmax", (d, hidden, n), form, Device::cpu(), DType::F64);
        let mut inputs = vec![common::f64t(
            &common::uniform_vec(t * d, -1.0, 1.0, 8),
            &[t, d],
        )];
        inputs.extend(params(&proto).into_iter().map(|(_, p)| p.get()));
        let up = common::f64t(&common::uniform_vec(t * d, -1.0, 1.0, 9), &[t, d]);
        let f = |v: &[Tensor]| -> Result<Tensor> {
            let mut l = layer("softmax", (d, hidden, n), form, Device::cpu(), DType::F64);
            l.set_all_experts_path(Some(true));
            for ((_, p), value) in params(&l).into_iter().zip(&v[1..]) {
                p.set(value.clone())?;
            }
            let out = l.forward(&v[0])?;
            out.y.mul(&up)?.sum_all()?.add(&out.aux_loss)
        };
        if let Err(e) = gradcheck(f, &inputs, &GradcheckOptions::default()) {
            panic!("{:?}: {e}", form.0);
        }
    }
}

#[test]
fn the_plan_runs_where_the_wide_path_could_differ_and_by_default_on_the_cpu() {
    let (t, d, hidden, n) = (12, 4, 6, 3);
    let x = common::uniform_vec(t * d, -1.0, 1.0, 3);
    let up = common::uniform_vec(t * d, -1.0, 1.0, 4);
    let build = |device: Device, dtype: DType, capacity: Capacity, path: Option<bool>| {
        let mut cfg = MoeConfig::new(d, hidden, n, n);
        cfg.router = "softmax".into();
        cfg.capacity = capacity;
        cfg.seed = 11;
        let mut l = MoeLayer::new(&cfg, device).unwrap();
        for (_, p) in params(&l) {
            p.set(p.get().to_dtype(dtype).unwrap()).unwrap();
        }
        l.set_all_experts_path(path);
        l
    };
    let cpu = |l: &MoeLayer| run(l, &common::f64t(&x, &[t, d]), &common::f64t(&up, &[t, d]));
    // γ = 0.5: C = ⌈0.5·T·n/n⌉ = 6 < T, assignments are dropped; the plan runs even when asked
    // for the wide path, and the output is the plan's
    let half = Capacity::Factor {
        factor: 0.5,
        min_capacity: 0,
    };
    let asked = cpu(&build(Device::cpu(), DType::F64, half, Some(true)));
    assert!(
        asked.planned,
        "γ = 0.5 drops assignments: the plan must run"
    );
    let planned = cpu(&build(Device::cpu(), DType::F64, half, Some(false)));
    for ((what, a), (_, p)) in asked.values.iter().zip(&planned.values) {
        common::assert_close(what, a, p, 0.0, 0.0);
    }
    let kept: f64 = asked.values[2].1.iter().sum();
    assert!(kept < (t * n) as f64, "γ = 0.5 kept all {kept} assignments");
    // γ = 1: C = T, nothing can be dropped, and the wide path runs
    let whole = Capacity::Factor {
        factor: 1.0,
        min_capacity: 0,
    };
    assert!(!cpu(&build(Device::cpu(), DType::F64, whole, Some(true))).planned);
    // the default: the plan on the CPU, the wide path on the GPU
    assert!(cpu(&build(Device::cpu(), DType::F64, Capacity::Dropless, None)).planned);
    if let Some(gpu) = common::gpu_or_skip("the wide path by default on the GPU") {
        let l = build(gpu, DType::F32, Capacity::Dropless, None);
        let on_gpu = run(
            &l,
            &common::tensor_on(x.clone(), &[t, d], DType::F32, gpu),
            &common::tensor_on(up.clone(), &[t, d], DType::F32, gpu),
        );
        assert!(!on_gpu.planned, "the GPU's default is the wide path");
    }
}

/// Bad input is an error naming the shapes: `Routing::every_expert` with weights that are not
/// `[T, n]` or probabilities of another shape, and an expert bank's wide products with weights
/// that are not `[T, n]`.
#[test]
fn bad_shapes_are_errors_that_name_them() {
    use moegrad::moe::{ExpertBank, ExpertBankConfig, ExpertNet, Routing};
    let cpu = Device::cpu();
    let t = |shape: &[usize]| Tensor::ones(shape, DType::F32, cpu).unwrap();
    let e = Routing::every_expert(&t(&[6]), t(&[6]), t(&[6])).unwrap_err();
    assert!(e.to_string().contains("[6]"), "{e}");
    let e = Routing::every_expert(&t(&[3, 4]), t(&[3, 5]), t(&[3, 4])).unwrap_err();
    assert!(e.to_string().contains("[3, 5]"), "{e}");
    let cfg = ExpertBankConfig {
        experts: 4,
        d: 8,
        hidden: 6,
        d_out: 8,
        activation: Activation::Relu,
        bias: true,
    };
    let bank = ExpertBank::new(cfg, &mut ChaCha8Rng::seed_from_u64(0), cpu).unwrap();
    let e = bank
        .forward_all_experts(&t(&[3, 8]), &t(&[3, 5]))
        .unwrap_err();
    assert!(e.to_string().contains("[3, 5]"), "{e}");
    assert!(
        bank.forward_all_experts(&t(&[3, 8]), &t(&[3, 4]))
            .unwrap()
            .is_some()
    );
}
