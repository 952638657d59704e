//! The GPU training step made cheap (issue 15), checked on whatever adapter there is (Mesa's
//! lavapipe in CI):
//!
//! * a steady-state step (`moegrad_cli::bench::gpu_step::count_step`) of `moe-mlp`, `cnn` and `gpt`
//!   never waits for the device and creates no buffer and no bind group (nor does a step of the
//!   training loop itself, once a few steps have settled the pool); `moe-mlp` dispatches at most half of the
//!   206 kernels it took before this work, and uploads its batch plus a few kilobytes;
//! * every fused kernel against the CPU: the top-k gate (forward and both backward rules), the
//!   dispatch plan, the multi-tensor Adam (and its state saved and restored), the clipping norm,
//!   and the matmul with and without subgroups;
//! * the fused gate's backward rules by f64 gradcheck on the CPU;
//! * a short `moe-mlp` run on the GPU matches the CPU's losses within 1e-3 relative;
//! * `bench gpu-step` times the step's kernels where the adapter has timestamp queries, and
//!   refuses clearly when there is no adapter; `bench moe`'s timed GPU steps create no bind
//!   group, and `bench matmul` reports the host's cost of recording an op both ways.
//!
//! GPU tests skip with a printed reason without an adapter, and fail when
//! `MOEGRAD_REQUIRE_GPU=1`. The GPU counters are process-wide, so every GPU test here holds
//! [`GPU_LOCK`]: no other kernel runs while a step is being counted.

#[path = "../../tests/common/mod.rs"]
mod common;

use moegrad::gpu::MatmulKernel;
use moegrad::gradcheck::{GradcheckOptions, gradcheck};
use moegrad::moe::{Capacity, DispatchPlan, Routing};
use moegrad::nn::Param;
use moegrad::optim::{Adam, Optimizer, clip_grad_norm};
use moegrad::{DType, Device, Tensor};
use moegrad_cli::bench::gpu_step::{count_step, count_step_with, step_config};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::{Mutex, MutexGuard};

/// Held by every GPU test of this file (the counters see all work of the process).
static GPU_LOCK: Mutex<()> = Mutex::new(());

/// The GPU and the lock, or `None` (after printing why) without an adapter.
fn gpu(test: &str) -> Option<(Device, MutexGuard<'static, ()>)> {
    let d = common::gpu_or_skip(test)?;
    Some((d, GPU_LOCK.lock().unwrap_or_else(|p| p.into_inner())))
}

/// `n` values uniform in `[-spread, spread)` from a fixed seed.
fn values(n: usize, spread: f64, seed: u64) -> Vec<f64> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|_| rng.random_range(-spread..spread) as f32 as f64)
        .collect()
}

fn f32_on(v: &[f64], shape: &[usize], d: Device) -> Tensor {
    Tensor::from_f32(v.iter().map(|&x| x as f32).collect(), shape, d).unwrap()
}

// ---- the steady step ---------------------------------------------------------------------------

/// Counts one steady step of `cfg` and asserts it waited for nothing, created no buffer and read
/// nothing back (`what` names the case).
fn assert_steady(what: &str, cfg: moegrad::train::TrainConfig) {
    let s = count_step_with(cfg).unwrap();
    assert_eq!(s.host_waits, 0, "{what}: the step waited: {s:?}");
    assert_eq!(
        s.buffers_created, 0,
        "{what}: the step created buffers: {s:?}"
    );
    assert_eq!(s.downloaded_bytes, 0, "{what}: the step read back: {s:?}");
    assert_eq!(
        s.bind_groups_created, 0,
        "{what}: the step created bind groups: {s:?}"
    );
    assert!(s.dispatches > 0, "{what}: nothing counted: {s:?}");
}

/// The balancers keep the steady step free of waits and new buffers: the aux-free and quantile
/// bias updates and the sequence-wise and windowed losses all stay on the device.
#[test]
fn a_steady_step_with_each_balancer_never_waits_and_creates_no_buffer() {
    use moegrad::moe::{BalanceMethod, BalanceScope, Balancing};
    let Some((_, _lock)) = gpu("a_steady_step_with_each_balancer_never_waits") else {
        return;
    };
    let cases = [
        ("moe-gpt", BalanceMethod::AuxFree, BalanceScope::Batch),
        ("moe-gpt", BalanceMethod::Quantile, BalanceScope::Batch),
        ("moe-gpt", BalanceMethod::Aux, BalanceScope::Sequence),
        ("moe-mlp", BalanceMethod::Aux, BalanceScope::Global),
    ];
    for (model, method, scope) in cases {
        let mut cfg = step_config(model).unwrap();
        if model == "moe-gpt" {
            (cfg.batch, cfg.block) = (4, 16);
        }
        cfg.balancing = Balancing {
            method,
            scope,
            window: 3,
            ..Balancing::default()
        };
        assert_steady(&format!("{model} {method:?} {scope:?}"), cfg);
    }
}

/// Default MoE's running means and straight-through term, and null experts, stay on the device
/// too: a steady step with either waits for nothing, creates no buffer and reads nothing back.
#[test]
fn a_steady_step_with_default_moe_or_null_experts_never_waits_and_creates_no_buffer() {
    let Some((_, _lock)) = gpu("a_steady_step_with_default_moe_or_null_experts") else {
        return;
    };
    for (model, router, nulls) in [
        ("moe-mlp", "default-moe", 0),
        ("moe-gpt", "default-moe", 0),
        ("moe-mlp", "topk", 2),
        ("moe-gpt", "default-moe", 2),
    ] {
        let mut cfg = step_config(model).unwrap();
        if model == "moe-gpt" {
            (cfg.batch, cfg.block) = (4, 16);
        }
        cfg.router = router.into();
        cfg.null_experts = nulls;
        assert_steady(&format!("{model} {router} with {nulls} null experts"), cfg);
    }
}

/// Dispatches of moe-mlp's steady step before this work (docs/benchmarks.md).
const MOE_MLP_DISPATCHES_BEFORE: u64 = 206;

#[test]
fn a_steady_step_never_waits_and_creates_no_buffer() {
    let Some((_, _lock)) = gpu("a_steady_step_never_waits_and_creates_no_buffer") else {
        return;
    };
    for model in ["moe-mlp", "cnn", "gpt", "moe-gpt"] {
        let s = if model.ends_with("gpt") {
            // the benchmark's gpt / moe-gpt with shorter windows and a smaller batch, to keep
            // lavapipe quick: the same kernels, the same zeros
            let mut cfg = step_config(model).unwrap();
            (cfg.batch, cfg.block) = (4, 16);
            count_step_with(cfg).unwrap()
        } else {
            count_step(model).unwrap()
        };
        assert_eq!(
            s.host_waits, 0,
            "{model}: the step waited for the device: {s:?}"
        );
        assert_eq!(
            s.buffers_created, 0,
            "{model}: the step created buffers: {s:?}"
        );
        assert_eq!(s.downloaded_bytes, 0, "{model}: the step read back: {s:?}");
        assert_eq!(
            s.bind_groups_created, 0,
            "{model}: the step bound buffers no earlier step bound: {s:?}"
        );
        assert!(
            s.dispatches > 0 && s.submits > 0,
            "{model}: nothing counted: {s:?}"
        );
        if model == "moe-mlp" {
            assert!(
                2 * s.dispatches <= MOE_MLP_DISPATCHES_BEFORE,
                "moe-mlp: {} dispatches, more than half of the {MOE_MLP_DISPATCHES_BEFORE} before",
                s.dispatches
            );
            // the batch (64 images of 28×28 f32 and 64 i32 labels) and a few KB of kernel
            // parameters
            let batch = 64 * 784 * 4 + 64 * 4;
            assert!(
                s.uploaded_bytes <= batch + 16 * 1024,
                "moe-mlp uploads {} bytes, more than the batch ({batch}) + 16 KiB",
                s.uploaded_bytes
            );
        }
    }
}

/// A small constant (a zero scalar, the backward's seed) is written with the batch's uploads,
/// not filled by a kernel: no dispatch, its bytes uploaded; a large one is one `fill`.
#[test]
fn small_constants_are_uploads_not_dispatches() {
    let Some((dev, _lock)) = gpu("small_constants_are_uploads_not_dispatches") else {
        return;
    };
    let f16 = moegrad::gpu::info()
        .unwrap()
        .features
        .iter()
        .any(|f| f == "shader-f16");
    dev.synchronize().unwrap();
    dev.reset_gpu_stats();
    let zero = Tensor::zeros(&[], DType::F32, dev).unwrap();
    let ints = Tensor::full(&[256], -3.0, DType::I32, dev).unwrap();
    let halves = f16.then(|| Tensor::full(&[3], 1.5, DType::F16, dev).unwrap());
    // 1200 bytes, past the host's 1 KiB: the fill kernel
    let large = Tensor::full(&[300], 2.0, DType::F32, dev).unwrap();
    let s = dev.gpu_stats().unwrap();
    // f16 goes two to a 32-bit word: 3 values in 8 bytes
    let small_bytes = 4 + 256 * 4 + if f16 { 8 } else { 0 };
    assert_eq!(
        (s.dispatches, s.uploaded_bytes - s.param_bytes),
        (1, small_bytes as u64),
        "{s:?}"
    );
    assert_eq!(zero.to_vec_f32().unwrap(), vec![0.0]);
    assert_eq!(ints.to_vec_i32().unwrap(), vec![-3; 256]);
    if let Some(h) = halves {
        assert_eq!(h.to_vec_f32().unwrap(), vec![1.5; 3]);
    }
    assert_eq!(large.to_vec_f32().unwrap(), vec![2.0; 300]);
}

#[test]
fn counters_see_waits_uploads_and_downloads() {
    let Some((dev, _lock)) = gpu("counters_see_waits_uploads_and_downloads") else {
        return;
    };
    dev.synchronize().unwrap();
    dev.reset_gpu_stats();
    let x = Tensor::from_f32(vec![1.0; 300], &[300], dev).unwrap();
    let y = x.add(&x).unwrap();
    let mid = dev.gpu_stats().unwrap();
    assert_eq!(mid.uploaded_bytes - mid.param_bytes, 1200);
    assert_eq!(
        (mid.dispatches, mid.host_waits, mid.downloaded_bytes),
        (1, 0, 0)
    );
    assert_eq!(y.to_vec_f32().unwrap(), vec![2.0; 300]);
    let end = dev.gpu_stats().unwrap();
    assert_eq!((end.host_waits, end.downloaded_bytes), (1, 1200));
    assert!(end.submits >= 1 && end.param_bytes > 0);
    dev.reset_gpu_stats();
    assert_eq!(dev.gpu_stats().unwrap().dispatches, 0);
}

// ---- the fused gate ----------------------------------------------------------------------------

/// The gate on `dev` (f32), its outputs and the gradients of `Σ c_w·weights + Σ c_p·probs`
/// with respect to the logits and the scores.
fn gate_run(
    dev: Device,
    logits: &[f64],
    scores: Option<&[f64]>,
    (t, n, k): (usize, usize, usize),
    renormalise: bool,
) -> [Vec<f64>; 5] {
    let o = f32_on(logits, &[t, n], dev);
    o.set_requires_grad(true).unwrap();
    let h = scores.map(|s| {
        let h = f32_on(s, &[t, n], dev);
        h.set_requires_grad(true).unwrap();
        h
    });
    let g = o.topk_gate(h.as_ref(), k, renormalise).unwrap();
    let cw = f32_on(&values(t * k, 1.0, 5), &[t, k], dev);
    let cp = f32_on(&values(t * n, 1.0, 6), &[t, n], dev);
    let loss = g
        .weights
        .mul(&cw)
        .unwrap()
        .sum_all()
        .unwrap()
        .add(&g.probs.mul(&cp).unwrap().sum_all().unwrap())
        .unwrap();
    loss.backward().unwrap();
    let grad = |t: &Tensor| {
        t.grad()
            .map(|g| g.to_vec_f64().unwrap())
            .unwrap_or_default()
    };
    [
        g.probs.to_vec_f64().unwrap(),
        g.idx
            .to_vec_i32()
            .unwrap()
            .iter()
            .map(|&i| i as f64)
            .collect(),
        g.weights.to_vec_f64().unwrap(),
        grad(&o),
        h.as_ref().map(grad).unwrap_or_default(),
    ]
}

#[test]
fn topk_gate_matches_the_cpu() {
    let Some((dev, _lock)) = gpu("topk_gate_matches_the_cpu") else {
        return;
    };
    let (t, n, k) = (70, 9, 3);
    let mut logits = values(t * n, 3.0, 1);
    // ties: the lowest index wins on both devices
    logits[..n].copy_from_slice(&[1.0, 2.0, 2.0, 0.5, 2.0, -1.0, 0.0, 0.0, 2.0]);
    let scores = values(t * n, 3.0, 2);
    for (scores, renormalise) in [(None, true), (Some(&scores[..]), true), (None, false)] {
        let cpu = gate_run(Device::cpu(), &logits, scores, (t, n, k), renormalise);
        let gpu = gate_run(dev, &logits, scores, (t, n, k), renormalise);
        let what = |i: usize| {
            format!(
                "scores {} renormalise {renormalise}: output {i}",
                scores.is_some()
            )
        };
        assert_eq!(gpu[1], cpu[1], "{}", what(1));
        if scores.is_none() {
            assert_eq!(
                &cpu[1][..k],
                &[1.0, 2.0, 4.0],
                "ties go to the lowest index"
            );
        }
        for i in [0, 2, 3, 4] {
            common::assert_close(&what(i), &gpu[i], &cpu[i], 1e-6, 1e-5);
        }
    }
}

#[test]
fn topk_gate_gradients_pass_gradcheck() {
    let (t, n, k) = (4, 5, 2);
    let logits = common::f64t(&values(t * n, 2.0, 3), &[t, n]);
    let scores = common::f64t(&values(t * n, 2.0, 4), &[t, n]);
    let cw = common::f64t(&values(t * k, 1.0, 7), &[t, k]);
    let cp = common::f64t(&values(t * n, 1.0, 8), &[t, n]);
    let opts = GradcheckOptions::default();
    // the probabilities and the renormalised weights of noisy scores
    gradcheck(
        |x| {
            let g = x[0].topk_gate(Some(&x[1]), k, true)?;
            g.weights
                .mul(&cw)?
                .sum_all()?
                .add(&g.probs.mul(&cp)?.sum_all()?)
        },
        &[logits.clone(), scores],
        &opts,
    )
    .unwrap();
    // the unnormalised weights
    gradcheck(
        |x| x[0].topk_gate(None, k, false)?.weights.mul(&cw)?.sum_all(),
        &[logits],
        &opts,
    )
    .unwrap();
}

#[test]
fn topk_gate_rejects_bad_input() {
    let d = Device::cpu();
    let o = Tensor::zeros(&[3, 4], DType::F32, d).unwrap();
    assert!(o.topk_gate(None, 0, true).is_err());
    assert!(o.topk_gate(None, 5, true).is_err());
    let wrong = Tensor::zeros(&[3, 5], DType::F32, d).unwrap();
    assert!(o.topk_gate(Some(&wrong), 2, true).is_err());
    assert!(o.topk_gate(Some(&o), 2, false).is_err());
    let flat = Tensor::zeros(&[4], DType::F32, d).unwrap();
    assert!(flat.topk_gate(None, 1, true).is_err());
    let empty = Tensor::zeros(&[0, 4], DType::F32, d).unwrap();
    assert_eq!(empty.topk_gate(None, 2, true).unwrap().idx.shape(), &[0, 2]);
}

// ---- the dispatch plan -------------------------------------------------------------------------

fn plan_on(dev: Device, capacity: Capacity, seed: u64) -> Vec<Vec<f64>> {
    let (t, k, n) = (300, 3, 7);
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    // few distinct weights, so that ties between equal weights are common
    let idx: Vec<i32> = (0..t * k).map(|_| rng.random_range(0..n as i32)).collect();
    let w: Vec<f64> = (0..t * k)
        .map(|_| rng.random_range(0..4) as f64 / 4.0)
        .collect();
    let valid: Vec<f64> = (0..t * k)
        .map(|_| (rng.random_range(0..5) > 0) as u8 as f64)
        .collect();
    let idx = Tensor::from_i32(idx, &[t, k], dev).unwrap();
    let weights = f32_on(&w, &[t, k], dev);
    let valid = f32_on(&valid, &[t, k], dev);
    let probs = Tensor::zeros(&[t, n], DType::F32, dev).unwrap();
    let r = Routing::token_choice(&idx, &weights, Some(&valid), probs.clone(), probs).unwrap();
    let p = DispatchPlan::build(&r, capacity).unwrap();
    [
        &p.order,
        &p.position,
        &p.row_token,
        &p.row_expert,
        &p.row_expert_clamped,
        &p.row_kept,
        &p.offsets,
        &p.kept_per_expert,
        &p.routed_per_expert,
    ]
    .iter()
    .map(|t| t.to_vec_f64().unwrap())
    .collect()
}

#[test]
fn dispatch_plan_matches_the_cpu() {
    let Some((dev, _lock)) = gpu("dispatch_plan_matches_the_cpu") else {
        return;
    };
    let capped = Capacity::Factor {
        factor: 0.8,
        min_capacity: 1,
    };
    for (i, capacity) in [Capacity::Dropless, capped].into_iter().enumerate() {
        let cpu = plan_on(Device::cpu(), capacity, 11 + i as u64);
        let gpu = plan_on(dev, capacity, 11 + i as u64);
        let names = [
            "order",
            "position",
            "row_token",
            "row_expert",
            "row_expert_clamped",
            "row_kept",
            "offsets",
            "kept_per_expert",
            "routed_per_expert",
        ];
        for ((name, g), c) in names.iter().zip(&gpu).zip(&cpu) {
            assert_eq!(g, c, "{capacity:?}: {name}");
        }
        if i == 1 {
            assert!(cpu[7] < cpu[8], "the capacity drops some rows");
        }
    }
}

// ---- the multi-tensor Adam and the clipping norm ---------------------------------------------

/// Named values read back.
type Named = Vec<(String, Vec<f64>)>;

/// 14 parameters (more than one dispatch's 12), every third without weight decay, stepped
/// three times with clipping while a tensor of one of them is held; returns the parameters and
/// the optimizer state afterwards.
fn adam_run(dev: Device) -> (Vec<Vec<f64>>, Named) {
    let shapes: Vec<Vec<usize>> = (0..14).map(|i| vec![1 + i % 4, 3 + 5 * i]).collect();
    let params: Vec<(String, Param)> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let n = s.iter().product();
            let t = f32_on(&values(n, 1.0, 100 + i as u64), s, dev);
            (format!("p{i:02}"), Param::new(t).unwrap())
        })
        .collect();
    let mut opt = Adam::adamw(0.05, 0.1).unwrap();
    opt.no_decay = params.iter().step_by(3).map(|(n, _)| n.clone()).collect();
    // a tensor kept from before the steps must keep its values
    let kept = params[5].1.get();
    let kept_values = kept.to_vec_f64().unwrap();
    for step in 0..3u64 {
        for (i, (_, p)) in params.iter().enumerate() {
            let c = f32_on(
                &values(p.get().numel(), 1.0, 10 * step + i as u64),
                p.get().shape(),
                dev,
            );
            p.get()
                .mul(&c)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
        }
        let scale = clip_grad_norm(&params, 2.0).unwrap().map(|(_, s)| s);
        opt.step(&params, scale.as_ref()).unwrap();
    }
    assert_eq!(
        kept.to_vec_f64().unwrap(),
        kept_values,
        "a held tensor changed"
    );
    let values = params
        .iter()
        .map(|(_, p)| p.get().to_vec_f64().unwrap())
        .collect();
    let state = opt
        .state()
        .into_iter()
        .map(|(n, t)| (n, t.to_vec_f64().unwrap()))
        .collect();
    (values, state)
}

#[test]
fn multi_tensor_adam_with_clipping_matches_the_cpu() {
    let Some((dev, _lock)) = gpu("multi_tensor_adam_with_clipping_matches_the_cpu") else {
        return;
    };
    assert!(moegrad::gpu::adam_multi_supported().unwrap());
    let (cpu, cpu_state) = adam_run(Device::cpu());
    let (gpu, gpu_state) = adam_run(dev);
    for (i, (g, c)) in gpu.iter().zip(&cpu).enumerate() {
        common::assert_close(&format!("parameter {i}"), g, c, 1e-5, 1e-4);
    }
    assert_eq!(gpu_state.len(), 28);
    for ((gn, g), (cn, c)) in gpu_state.iter().zip(&cpu_state) {
        assert_eq!(gn, cn);
        common::assert_close(gn, g, c, 1e-6, 1e-4);
    }
}

#[test]
fn the_clipping_norm_matches_the_cpu_across_chunks() {
    let Some((dev, _lock)) = gpu("the_clipping_norm_matches_the_cpu_across_chunks") else {
        return;
    };
    // 30 gradients (two dispatches of 24), one longer than a workgroup's 4096 elements
    let lens: Vec<usize> = (0..30)
        .map(|i| if i == 7 { 9000 } else { 1 + 37 * i })
        .collect();
    let run = |dev: Device, max_norm: f64| {
        let params: Vec<(String, Param)> = lens
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                let p = Param::new(Tensor::zeros(&[n], DType::F32, dev).unwrap()).unwrap();
                let c = f32_on(&values(n, 1.0, 200 + i as u64), &[n], dev);
                p.get()
                    .mul(&c)
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .backward()
                    .unwrap();
                (format!("g{i}"), p)
            })
            .collect();
        let (norm, scale) = clip_grad_norm(&params, max_norm).unwrap().unwrap();
        (norm.item().unwrap(), scale.item().unwrap())
    };
    for max_norm in [1.0, 1e6] {
        let (cn, cs) = run(Device::cpu(), max_norm);
        let (gn, gs) = run(dev, max_norm);
        assert!((gn - cn).abs() <= 1e-5 * cn, "norm {gn} vs {cn}");
        assert!(
            (gs - cs).abs() <= 1e-5 * cs,
            "scale {gs} vs {cs} (max norm {max_norm})"
        );
    }
}

// ---- the matmul kernels ------------------------------------------------------------------------

#[test]
fn matmul_kernels_match_the_cpu_and_each_other() {
    let Some((dev, _lock)) = gpu("matmul_kernels_match_the_cpu_and_each_other") else {
        return;
    };
    let info = moegrad::gpu::info().unwrap();
    let kernels = if moegrad::gpu::subgroup_matmul_available().unwrap() {
        vec![
            MatmulKernel::Plain,
            MatmulKernel::Wide,
            MatmulKernel::WideVec4,
            MatmulKernel::Subgroup,
        ]
    } else {
        // CI's adapter (lavapipe) offers subgroups of 8, so under MOEGRAD_REQUIRE_GPU=1 a missing
        // subgroup kernel is a failure, not a skip: the kernel would otherwise go unchecked in CI
        assert!(
            std::env::var("MOEGRAD_REQUIRE_GPU").as_deref() != Ok("1"),
            "MOEGRAD_REQUIRE_GPU=1 but the subgroup matmul is not available on \"{}\" \
             (optional features {:?}, subgroup sizes {:?}): the subgroup kernel would go unchecked",
            info.name,
            info.features,
            info.subgroup_sizes
        );
        eprintln!(
            "skipping the subgroup matmul: \"{}\" offers no subgroups of 4 to 128 invocations \
             (optional features {:?}, subgroup sizes {:?}); only the plain matmul is checked",
            info.name, info.features, info.subgroup_sizes
        );
        assert!(moegrad::gpu::set_matmul_kernel(MatmulKernel::Subgroup).is_err());
        vec![
            MatmulKernel::Plain,
            MatmulKernel::Wide,
            MatmulKernel::WideVec4,
        ]
    };
    let before = moegrad::gpu::matmul_kernel().unwrap();
    // unless told otherwise, matmul chooses per product (the subgroup kernel, 1.8× slower than
    // the plain one on the one real GPU measured, is never the default)
    if std::env::var_os("MOEGRAD_MATMUL").is_none() {
        assert_eq!(before, MatmulKernel::Auto, "the default matmul kernel");
        assert_eq!(info.matmul_kernel, "auto");
    }
    let shapes = [
        (1, 1, 1, 1),
        (2, 65, 33, 70),
        (1, 130, 17, 129),
        (3, 5, 300, 2),
        // vec4 layouts, for the wide-vec4 kernel
        (2, 131, 24, 136),
    ];
    let mut results: Vec<Vec<Vec<f64>>> = Vec::new();
    for &kernel in &kernels {
        moegrad::gpu::set_matmul_kernel(kernel).unwrap();
        assert_eq!(moegrad::gpu::matmul_kernel().unwrap(), kernel);
        let mut per_shape = Vec::new();
        for (i, &(b, m, k, n)) in shapes.iter().enumerate() {
            let av = values(b * m * k, 1.0, 300 + i as u64);
            let bv = values(b * k * n, 1.0, 400 + i as u64);
            // B transposed on the device: [b, n, k] read through a permute
            let a = f32_on(&av, &[b, m, k], dev);
            let bt = f32_on(&bv, &[b, n, k], dev).permute(&[0, 2, 1]).unwrap();
            let got = a.matmul(&bt).unwrap().to_vec_f64().unwrap();
            let want = common::f64t(&av, &[b, m, k])
                .matmul(&common::f64t(&bv, &[b, n, k]).permute(&[0, 2, 1]).unwrap())
                .unwrap()
                .to_vec_f64()
                .unwrap();
            common::assert_close(
                &format!("{kernel:?} matmul [{b}, {m}, {k}]·[{k}, {n}]"),
                &got,
                &want,
                1e-4,
                1e-4,
            );
            per_shape.push(got);
        }
        results.push(per_shape);
    }
    moegrad::gpu::set_matmul_kernel(before).unwrap();
    for (kernel, result) in kernels.iter().zip(&results).skip(1) {
        assert_eq!(
            &results[0], result,
            "{kernel:?} and Plain add the same terms in the same order"
        );
    }
}

// ---- a short training run, GPU against CPU ---------------------------------------------------

/// The losses of five `moe-mlp` steps (topk, 8 experts, k = 2) on the bundled MNIST.
fn moe_mlp_losses(dev: Device) -> Vec<f64> {
    let cfg = step_config("moe-mlp").unwrap();
    let mnist = moegrad::data::Mnist::load(std::path::Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../data"
    )))
    .unwrap();
    let model = moegrad::train::build_model(&cfg, 28, 1, dev).unwrap();
    let params = model.named_params();
    let mut opt = Adam::new(cfg.lr).unwrap();
    let b = cfg.batch;
    (0..5)
        .map(|s| {
            let x = &mnist.train.images[s * b * 784..(s + 1) * b * 784];
            let y = &mnist.train.labels[s * b..(s + 1) * b];
            let x = Tensor::from_f32(x.to_vec(), &[b, 1, 28, 28], dev).unwrap();
            let y = Tensor::from_i32(y.to_vec(), &[b], dev).unwrap();
            let out = moegrad::train::train_step(model.as_ref(), &params, &mut opt, &x, &[y], 0.0)
                .unwrap();
            out.loss.item().unwrap()
        })
        .collect()
}

#[test]
fn a_short_moe_mlp_run_on_the_gpu_matches_the_cpu() {
    let Some((dev, _lock)) = gpu("a_short_moe_mlp_run_on_the_gpu_matches_the_cpu") else {
        return;
    };
    let cpu = moe_mlp_losses(Device::cpu());
    let gpu = moe_mlp_losses(dev);
    for (step, (g, c)) in gpu.iter().zip(&cpu).enumerate() {
        assert!(
            (g - c).abs() <= 1e-3 * c.abs(),
            "step {step}: GPU loss {g}, CPU loss {c}: more than 1e-3 apart (relative)"
        );
    }
    assert!(cpu[4] < cpu[0], "the run learns: {cpu:?}");
}

// ---- the command line ------------------------------------------------------------------------

#[test]
fn bench_gpu_step_refuses_without_an_adapter() {
    // WGPU_BACKEND names a backend this build does not have on Linux: no adapter at all
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_moegrad"))
        .args(["bench", "gpu-step", "--json"])
        .env("WGPU_BACKEND", "dx12")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    if cfg!(windows) {
        return;
    }
    assert!(!out.status.success(), "it ran without an adapter: {err}");
    assert!(out.stdout.is_empty(), "it printed a report: {err}");
    assert!(
        err.contains("needs a GPU adapter") && err.lines().count() == 1,
        "unclear refusal: {err}"
    );
}

#[test]
fn adam_state_saved_from_the_flat_moments_resumes_exactly() {
    let Some((dev, _lock)) = gpu("adam_state_saved_from_the_flat_moments_resumes_exactly") else {
        return;
    };
    let make = |seed: u64| -> Vec<(String, Param)> {
        (0..3)
            .map(|i| {
                let t = f32_on(&values(10 + i, 1.0, seed + i as u64), &[10 + i], dev);
                (format!("q{i}"), Param::new(t).unwrap())
            })
            .collect()
    };
    let grads = |params: &[(String, Param)], step: u64| {
        for (i, (_, p)) in params.iter().enumerate() {
            let c = f32_on(
                &values(p.get().numel(), 1.0, 50 + step * 3 + i as u64),
                p.get().shape(),
                dev,
            );
            p.get()
                .mul(&c)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
        }
    };
    let (a, b) = (make(1), make(1));
    let mut first = Adam::new(0.1).unwrap();
    for step in 0..2 {
        grads(&a, step);
        first.step(&a, None).unwrap();
    }
    // a second optimizer restored from the first's state, over parameters with its values
    let state: std::collections::BTreeMap<String, Tensor> = first.state().into_iter().collect();
    let mut second = Adam::new(0.1).unwrap();
    second.load_state(&state, first.steps()).unwrap();
    for ((_, pa), (_, pb)) in a.iter().zip(&b) {
        pb.set(pa.get().detach()).unwrap();
    }
    grads(&a, 2);
    first.step(&a, None).unwrap();
    grads(&b, 2);
    second.step(&b, None).unwrap();
    for ((name, pa), (_, pb)) in a.iter().zip(&b) {
        assert_eq!(
            pa.get().to_vec_f64().unwrap(),
            pb.get().to_vec_f64().unwrap(),
            "{name} after resuming"
        );
    }
}

#[test]
fn bench_gpu_step_times_the_step_where_the_adapter_has_timestamps() {
    let Some((_, _lock)) = gpu("bench_gpu_step_times_the_step_where_the_adapter_has_timestamps")
    else {
        return;
    };
    let r = moegrad_cli::bench::gpu_step::bench_gpu_step(&["moe-mlp"]).unwrap();
    let rec = &r.gpu_step[0];
    // the timed step is not the counted one: the counts keep their zeros
    assert_eq!(
        (rec.host_waits, rec.buffers_created, rec.bind_groups_created),
        (0, 0, 0),
        "{rec:?}"
    );
    // the host's share of a step, with bind groups reused and created, and reuse left on
    let (reused, created) = (
        rec.host_ms.unwrap(),
        rec.host_ms_creating_bind_groups.unwrap(),
    );
    assert!(reused > 0.0 && created > 0.0, "{rec:?}");
    assert!(moegrad::gpu::bind_group_reuse().unwrap());
    let timestamps = moegrad::gpu::info()
        .unwrap()
        .features
        .contains(&"timestamp-query".to_string());
    match rec.gpu_ms {
        Some(ms) => assert!(timestamps && ms > 0.0, "{rec:?}"),
        None => assert!(!timestamps, "the adapter has timestamp queries: {rec:?}"),
    }
    assert!(
        !moegrad::profile::is_enabled(),
        "timing the step left a profile recording"
    );
}

#[test]
fn f16_mixed_steps_keep_the_counts_and_halve_the_activation_bytes() {
    use moegrad::train::Precision;
    let Some((_, _lock)) = gpu("f16_mixed_steps_keep_the_counts_and_halve_the_activation_bytes")
    else {
        return;
    };
    let f16 = moegrad::gpu::info()
        .unwrap()
        .features
        .contains(&"shader-f16".to_string());
    // `gpt` at the baby size: the activations dominate, so f16 halves them (the f16 copies of
    // the weights the products save count against f16-mixed)
    let cfg = step_config("gpt").unwrap();
    if !f16 {
        let cfg = moegrad::train::TrainConfig {
            precision: Precision::F16Mixed,
            ..cfg
        };
        let err = moegrad_cli::bench::gpu_step::measure(cfg, false).err();
        assert!(
            err.is_some_and(|e| e.to_string().contains("SHADER_F16")),
            "f16-mixed without shader-f16 must be refused"
        );
        eprintln!(
            "skipping the f16-mixed figures: this adapter has no shader-f16 (refused, checked)"
        );
        return;
    }
    // one step of `cfg` measured in each precision
    let both = |cfg: &moegrad::train::TrainConfig| {
        let run = |precision| {
            let cfg = moegrad::train::TrainConfig {
                precision,
                ..cfg.clone()
            };
            moegrad_cli::bench::gpu_step::measure(cfg, false).unwrap()
        };
        (run(Precision::F32), run(Precision::F16Mixed))
    };
    let (full, mixed) = both(&cfg);
    let s = mixed.stats;
    assert_eq!(
        (
            s.host_waits,
            s.buffers_created,
            s.downloaded_bytes,
            s.bind_groups_created
        ),
        (0, 0, 0, 0),
        "{s:?}"
    );
    let ratio = |a: u64, b: u64| a as f64 / b as f64;
    let act = ratio(mixed.activation_bytes, full.activation_bytes);
    let bound = ratio(s.bound_bytes, full.stats.bound_bytes);
    let peak = ratio(mixed.peak_bytes, full.peak_bytes);
    eprintln!(
        "gpt f16-mixed / f32: activations {act:.3}, bound bytes {bound:.3}, peak {peak:.3} \
         ({} / {} bytes)",
        mixed.peak_bytes, full.peak_bytes
    );
    assert!(act <= 0.6, "activation bytes {act:.3}× f32's");
    // bound bytes include what stays f32 in both (the master weights, Adam's moments, the
    // loss), a fixed part whose share grows as fusions take activation-sized traffic out of
    // both steps: 0.598 before the residual's gradient was folded into the norm's backward
    // (5.9 MB fewer per f32 step, 2.4 MB per f16 one), 0.602 after
    assert!(bound <= 0.62, "bound bytes {bound:.3}× f32's");
    // the peak likewise: 0.74 before a block's residual was added by its last projection,
    // which took the product's own output out of both peaks (f32 80.1 → 76.0 MB, f16-mixed
    // 59.2 → 57.4 MB: more from the f32 step), 0.756 after
    assert!(peak < 0.77, "peak bytes {peak:.3}× f32's");

    // `cnn`: its activations are the convolutions' and pooling's, which run in f16 since they
    // have f16 builds (before, in f32, mixed precision saved nothing here: 1.0×)
    let (full, mixed) = both(&step_config("cnn").unwrap());
    let act = ratio(mixed.activation_bytes, full.activation_bytes);
    let bound = ratio(mixed.stats.bound_bytes, full.stats.bound_bytes);
    eprintln!("cnn f16-mixed / f32: activations {act:.3}, bound bytes {bound:.3}");
    assert!(act <= 0.6, "cnn activation bytes {act:.3}× f32's");
    assert!(bound <= 0.65, "cnn bound bytes {bound:.3}× f32's");
    assert_eq!(
        (mixed.stats.host_waits, mixed.stats.buffers_created),
        (0, 0),
        "{:?}",
        mixed.stats
    );
}

/// The training loop itself (not the benchmark's step) reaches the steady state: `moegrad train`
/// ends each step with a submit, so each step gets the buffers of the step before, and after a
/// few steps no dispatch creates a bind group (nor a buffer) until the run ends.
#[test]
fn training_steps_settle_to_no_new_bind_groups() {
    let Some((gpu, _lock)) = gpu("training_steps_settle_to_no_new_bind_groups") else {
        return;
    };
    /// The GPU counters after each step.
    struct Counts(Device, Vec<moegrad::gpu::GpuStats>);
    impl moegrad::train::TrainObserver for Counts {
        fn step(&mut self, _loss: Option<&str>) {
            self.1.push(self.0.gpu_stats().unwrap());
        }
    }
    let out = std::env::temp_dir().join(format!("moegrad-settle-{}", std::process::id()));
    let cfg = moegrad::train::TrainConfig {
        out: out.clone(),
        device: "gpu".into(),
        layers: 1,
        heads: 2,
        d_model: 32,
        block: 16,
        batch: 4,
        iters: 32,
        eval_every: 32,
        eval_windows: 4,
        experts: 4,
        k: 2,
        expert_hidden: 32,
        log_every: 1000,
        ..moegrad::train::TrainConfig::language_model(moegrad::train::ModelKind::MoeGpt)
    };
    let mut counts = Counts(gpu, Vec::new());
    moegrad::lm::run_observed(&cfg, moegrad::train::RunOptions::default(), &mut counts).unwrap();
    let _ = std::fs::remove_dir_all(&out);
    let after = &counts.1;
    assert!(after.len() >= 31, "{} steps observed", after.len());
    // steps 17..=31 (the 32nd reads the loss back and evaluates; the bench's warm-up is 16)
    let s = after[30].since(&after[15]);
    assert!(s.dispatches > 1000, "{s:?}");
    assert_eq!(
        (s.bind_groups_created, s.buffers_created, s.host_waits),
        (0, 0, 0),
        "steps 17 to 31 of a run: {s:?}"
    );
}

/// `bench moe`'s timed GPU steps come after enough warm-up that they create no bind group (so
/// the figures are the steady state's), and `bench matmul` reports the host's cost of recording
/// an op both ways, leaving bind-group reuse as it was.
#[test]
fn bench_figures_are_taken_with_settled_bind_groups() {
    let Some((gpu, _lock)) = gpu("bench_figures_are_taken_with_settled_bind_groups") else {
        return;
    };
    let w = moegrad_cli::bench::MoeWorkload {
        tokens: 64,
        d: 16,
        hidden: 32,
        k: 2,
    };
    for (router, n, all) in [("topk", 4, None), ("softmax", 4, Some(false))] {
        let t = moegrad_cli::bench::moe_step(gpu, (router, n, 2), all, w, 3).unwrap();
        assert_eq!(t.bind_groups_created, Some(0), "{router} over {n}: {t:?}");
        assert!(t.dispatches.is_some_and(|d| d > 0), "{t:?}");
    }
    let (reused, created) = moegrad_cli::bench::gpu_record_us(gpu).unwrap();
    assert!(reused > 0.0 && reused.is_finite(), "{reused}");
    assert!(created > 0.0 && created.is_finite(), "{created}");
    assert!(moegrad::gpu::bind_group_reuse().unwrap());
}
