//! Races on workgroup memory, found by running every kernel with its invocations permuted
//! (`backend::gpu::invocation_order`: reversed, then scrambled): training steps of every model
//! family, in f32 and f16-mixed, and the ops with workgroup memory that they do not reach give
//! exactly the same bits all three ways.
//!
//! Lavapipe runs a workgroup's invocations in SIMD groups, always invocation 0's group first,
//! so a kernel in which one invocation reads another's write without a barrier between them
//! can pass every GPU test here and fail on a GPU. With the roles reversed, the group that ran
//! last now runs first; scrambled, neighbouring invocations sit in different SIMD groups, so
//! that a race between them no longer runs in lockstep. A race-free kernel computes the same
//! values in the same order for every role, whichever hardware lane holds it. A difference
//! names the model, the precision and
//! the tensor (loss, or parameter) where the bits first part. The test prints which kernels the
//! workloads ran, so a kernel no workload reaches is seen.

use super::gpu_lock;
use crate::backend::gpu::builtin_shaders;
use crate::backend::gpu::invocation_order::{Roles, applies_to, rewritten, set_roles};
use crate::common;
use crate::nn::Parameters;
use crate::train::{DataKind, ModelKind, TrainConfig};
use crate::{Device, Result, Tensor};
use std::collections::BTreeSet;

/// Compiles the kernels with permuted invocations while it lives (as written again when it is
/// dropped, also if the test panics).
struct PermutedRoles;

impl PermutedRoles {
    fn on(roles: Roles) -> PermutedRoles {
        set_roles(roles);
        PermutedRoles
    }
}

impl Drop for PermutedRoles {
    fn drop(&mut self) {
        set_roles(Roles::AsRun);
    }
}

/// What a workload leaves: (what, its bits), in a fixed order.
type Bits = Vec<(String, Vec<u32>)>;

/// A workload by name: what it runs and leaves.
type Workload = (String, Box<dyn Fn() -> Result<Bits>>);

fn bits_of(t: &Tensor) -> Result<Vec<u32>> {
    Ok(t.to_vec_f32()?.iter().map(|v| v.to_bits()).collect())
}

/// Steps of `cfg` (a language model) on the GPU: each step's loss, then every parameter.
fn language_model_steps(cfg: &TrainConfig, mixed: bool, steps: u64) -> Result<Bits> {
    let path = crate::data::bundled::dir().join("shakespeare-10-plays.txt.gz");
    let corpus = crate::data::text::CharCorpus::load(&path, cfg.block)?;
    let model = crate::lm::LanguageModel::build(cfg, corpus.vocab_size(), Device::Gpu)?;
    let params = model.named_params();
    let mut opt = crate::lm::make_optimizer(cfg, &model)?;
    let scale = match mixed {
        true => Some(crate::optim::LossScale::new(Device::Gpu)?),
        false => None,
    };
    let mut out = Vec::new();
    // the routing diagnostics the training loop keeps (`routing_stats`, one launch per MoE
    // layer and step)
    let mut window = crate::moe::RoutingWindow::new();
    for step in 0..steps {
        let (b, t) = (cfg.batch, cfg.block);
        let (x, y) = corpus.train_batch(b, t, cfg.seed, step);
        let x = Tensor::from_i32(x, &[b, t], Device::Gpu)?;
        let y = Tensor::from_i32(y, &[b * t], Device::Gpu)?;
        let clip = cfg.clip_grad_norm;
        let o = match &scale {
            Some(s) => crate::train::train_step_mixed(&model, &params, &mut opt, &x, &[y], clip, s),
            None => crate::train::train_step(&model, &params, &mut opt, &x, &[y], clip),
        }?;
        out.push((format!("loss of step {step}"), bits_of(&o.task_loss)?));
        window.add(&o.routing)?;
    }
    for (i, sums) in window.layer_sums().into_iter().enumerate() {
        out.push((format!("routing sums of MoE layer {i}"), bits_of(sums)?));
    }
    for (name, p) in &params {
        out.push((name.clone(), bits_of(&p.get())?));
    }
    Ok(out)
}

/// Steps of `cfg` (an image model) on the GPU over the bundled digits.
fn image_model_steps(cfg: &TrainConfig, steps: usize) -> Result<Bits> {
    let data = crate::train::load_data(cfg)?;
    let model = match &data.bank {
        Some(bank) => crate::train::build_synthetic_b(cfg, bank, Device::Gpu)?,
        None => crate::train::build_model(cfg, data.side, data.tasks, Device::Gpu)?,
    };
    let params = model.named_params();
    let mut opt = crate::train::make_optimizer(cfg)?;
    let mut out = Vec::new();
    for step in 0..steps {
        let ids: Vec<usize> = (step * cfg.batch..(step + 1) * cfg.batch).collect();
        let batch = data.train.batch(&ids, Device::Gpu)?;
        let o = crate::train::train_step(
            model.as_ref(),
            &params,
            opt.as_mut(),
            &batch.x,
            &batch.y,
            cfg.clip_grad_norm,
        )?;
        out.push((format!("loss of step {step}"), bits_of(&o.task_loss)?));
    }
    for (name, p) in &params {
        out.push((name.clone(), bits_of(&p.get())?));
    }
    Ok(out)
}

/// `n` values in [-1, 1) from a multiplicative hash of their index and `seed`.
fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| ((i as u32).wrapping_mul(2654435761) ^ seed) % 1000)
        .map(|v| v as f32 / 500.0 - 1.0)
        .collect()
}

/// `n` indices below `bound`, from the same hash.
fn indices(n: usize, bound: usize, seed: u32) -> Vec<i32> {
    (0..n)
        .map(|i| (((i as u32).wrapping_mul(2246822519) ^ seed) % bound as u32) as i32)
        .collect()
}

/// The ops whose large cases no training step above reaches: sorts past one block of workgroup
/// memory, a long running sum and a long sum, and scatters with the index varying along the inner axis and
/// constant along it.
fn tensor_ops(dtype: crate::DType) -> Result<Bits> {
    let gpu = Device::Gpu;
    let floats = |n: usize, seed: u32, shape: &[usize]| {
        Tensor::from_f32(values(n, seed), shape, gpu)?.to_dtype(dtype)
    };
    let f32_bits = |t: &Tensor| bits_of(&t.to_dtype(crate::DType::F32)?);
    let x = floats(2 * 6000, 4, &[2, 6000])?;
    let running = x.cumsum(1)?;
    let total = x.sum(&[1], false)?;
    // 6000 rows of 8 added into 64 rows, the index different in every column
    let src = floats(6000 * 8, 5, &[6000, 8])?;
    let idx = Tensor::from_i32(indices(6000 * 8, 64, 6), &[6000, 8], gpu)?;
    let zeros = Tensor::zeros(&[64, 8], dtype, gpu)?;
    let scattered = zeros.scatter_add(0, &idx, &src)?;
    // 6000 rows of 300 added into 70 by one index per row (an embedding's gradient)
    let rows = floats(6000 * 300, 7, &[6000, 300])?;
    let row_idx = Tensor::from_i32(indices(6000, 70, 8), &[6000], gpu)?;
    let per_row = rows.index_scatter(0, &row_idx, 70)?;
    let mut out = vec![
        ("cumsum".into(), f32_bits(&running)?),
        ("sum".into(), f32_bits(&total)?),
        ("scatter_add".into(), f32_bits(&scattered)?),
        ("index_scatter".into(), f32_bits(&per_row)?),
    ];
    out.extend(differentiated_ops(dtype)?);
    if dtype == crate::DType::F32 {
        let (top, top_index) = x.topk(64)?;
        out.push(("argsort".into(), ints(&x.argsort(false)?)?));
        out.push(("topk".into(), bits_of(&top)?));
        out.push(("topk index".into(), ints(&top_index)?));
    }
    Ok(out)
}

/// Ops with workgroup memory that no training step above runs in `dtype`, forward and
/// backward: a layer norm whose gain and shift are of `dtype` too (in f16 the all-f16 build),
/// a grouped product of `dtype` rows and weights (in f16 the all-f16 build), the MoE combine of
/// `dtype` rows and weights by a sorted index, and the mean squared error over many
/// workgroups' partial sums.
fn differentiated_ops(dtype: crate::DType) -> Result<Bits> {
    let gpu = Device::Gpu;
    let leaf = |n: usize, seed: u32, shape: &[usize]| {
        Tensor::from_f32(values(n, seed), shape, gpu)?
            .to_dtype(dtype)?
            .with_grad()
    };
    // each output weighted differently, so that every gradient element is its own
    let weighted_sum = |y: &Tensor, seed: u32| -> Result<Tensor> {
        let w = Tensor::from_f32(values(y.numel(), seed), y.shape(), gpu)?.to_dtype(dtype)?;
        y.mul(&w)?.to_dtype(crate::DType::F32)?.sum_all()
    };
    let (rows, dim) = (96, 300);
    let x = leaf(rows * dim, 11, &[rows, dim])?;
    let gamma = leaf(dim, 12, &[dim])?;
    let beta = leaf(dim, 13, &[dim])?;
    let normed = x.layer_norm(&gamma, &beta, 1e-5)?;
    weighted_sum(&normed, 14)?.backward()?;
    // 300 rows over 3 experts (120, 0 and 180 rows): [300, 48]·[3, 48, 40]
    let tokens = leaf(300 * 48, 15, &[300, 48])?;
    let bank = leaf(3 * 48 * 40, 16, &[3, 48, 40])?;
    let experts: Vec<i32> = (0..300).map(|r| if r < 120 { 0 } else { 2 }).collect();
    let row_expert = Tensor::from_i32(experts, &[300], gpu)?;
    let offsets = Tensor::from_i32(vec![0, 120, 120, 300], &[4], gpu)?;
    let grouped = tokens.grouped_matmul(&bank, &row_expert, &offsets)?;
    weighted_sum(&grouped, 17)?.backward()?;
    // the MoE combine told no slots: 3000 rows of 40 into 500 tokens sorts the index
    let expert_rows = leaf(3000 * 40, 20, &[3000, 40])?;
    let gate = leaf(3000, 21, &[3000])?;
    let token = Tensor::from_i32(indices(3000, 500, 22), &[3000], gpu)?;
    let combined = expert_rows.weighted_index_scatter(&gate, &token, 500)?;
    weighted_sum(&combined, 23)?.backward()?;
    let prediction = leaf(6000 * 30, 18, &[6000, 30])?;
    let target = Tensor::from_f32(values(6000 * 30, 19), &[6000, 30], gpu)?.to_dtype(dtype)?;
    let mse = prediction.mse(&target)?;
    mse.backward()?;
    let grad = |t: &Tensor| -> Result<Vec<u32>> {
        let g = t
            .grad()
            .ok_or_else(|| crate::Error::Invalid("no gradient".into()))?;
        bits_of(&g.to_dtype(crate::DType::F32)?)
    };
    let f32_bits = |t: &Tensor| bits_of(&t.to_dtype(crate::DType::F32)?);
    Ok(vec![
        ("layer norm".into(), f32_bits(&normed)?),
        ("layer norm dx".into(), grad(&x)?),
        ("layer norm dgamma".into(), grad(&gamma)?),
        ("layer norm dbeta".into(), grad(&beta)?),
        ("grouped product".into(), f32_bits(&grouped)?),
        ("grouped product dx".into(), grad(&tokens)?),
        ("grouped product dw".into(), grad(&bank)?),
        ("combine".into(), f32_bits(&combined)?),
        ("combine drows".into(), grad(&expert_rows)?),
        ("combine dgate".into(), grad(&gate)?),
        ("mse".into(), f32_bits(&mse)?),
        ("mse dprediction".into(), grad(&prediction)?),
    ])
}

/// An I32 tensor's values as bits.
fn ints(t: &Tensor) -> Result<Vec<u32>> {
    Ok(t.to_vec_i32()?.iter().map(|&i| i as u32).collect())
}

/// A product large enough for the wide kernels (`[1024, 64]·[64, 1024]`: 64 tiles of 128×128)
/// in `dtype`, forward and backward, under the matmul kernel `kernel`: the output and both
/// gradients (their sums' bits in f16, whose values are read as f32).
fn wide_product(dtype: crate::DType, kernel: crate::backend::gpu::MatmulKernel) -> Result<Bits> {
    let gpu = crate::backend::gpu::GpuBackend::get()?;
    let before = gpu.matmul_kernel();
    gpu.set_matmul_kernel(kernel)?;
    let run = || -> Result<Bits> {
        let a = Tensor::from_f32(values(1024 * 64, 1), &[1024, 64], Device::Gpu)?
            .to_dtype(dtype)?
            .with_grad()?;
        let b = Tensor::from_f32(values(64 * 1024, 2), &[64, 1024], Device::Gpu)?
            .to_dtype(dtype)?
            .with_grad()?;
        let c = a.matmul(&b)?;
        let w = Tensor::from_f32(values(1024 * 1024, 3), &[1024, 1024], Device::Gpu)?
            .to_dtype(dtype)?;
        c.mul(&w)?.sum_all()?.backward()?;
        let grad = |t: &Tensor| {
            t.grad()
                .ok_or_else(|| crate::Error::Invalid("no gradient".into()))
        };
        let f32_of = |t: Tensor| t.to_dtype(crate::DType::F32);
        Ok(vec![
            ("product".into(), bits_of(&f32_of(c)?)?),
            ("dA".into(), bits_of(&f32_of(grad(&a)?)?)?),
            ("dB".into(), bits_of(&f32_of(grad(&b)?)?)?),
        ])
    };
    let out = run();
    gpu.set_matmul_kernel(before)?;
    out
}

/// A small language model of kind `model`: 2 layers, d = 64, 4 heads, context 32, batch 8.
fn small_language_model(model: ModelKind) -> TrainConfig {
    let family = TrainConfig::language_model(model);
    TrainConfig {
        layers: 2,
        heads: 4,
        d_model: 64,
        block: 32,
        batch: 8,
        expert_hidden: family.expert_hidden.min(64),
        warmup_steps: 2,
        device: "gpu".into(),
        ..family
    }
}

/// Every workload, by name: the language model families (moe-gpt also with dispatch plans past
/// 1024 assignments, dropless and with a capacity, with two wide experts and with the dense
/// router), in both precisions where the adapter has f16, the wide products, the tensor ops and
/// the image models.
fn workloads(f16: bool) -> Vec<Workload> {
    let mut all: Vec<Workload> = Vec::new();
    let sorted_plan = TrainConfig {
        batch: 16,
        block: 64,
        experts: 4,
        k: 2,
        ..small_language_model(ModelKind::MoeGpt)
    };
    // two experts over 2048 tokens: the expert bank's products run the wide grouped kernel
    let wide_experts = TrainConfig {
        batch: 32,
        block: 64,
        experts: 2,
        k: 2,
        expert_hidden: 256,
        ..small_language_model(ModelKind::MoeGpt)
    };
    // the same with a capacity: the plan sorts three-word keys (`sort_words`)
    let capacity_plan = TrainConfig {
        capacity_factor: 1.25,
        ..sorted_plan.clone()
    };
    let dense_router = TrainConfig {
        router: "softmax".into(),
        experts: 4,
        k: 4,
        ..small_language_model(ModelKind::MoeGpt)
    };
    let lms = [
        ("gpt", small_language_model(ModelKind::Gpt)),
        ("moe-gpt", small_language_model(ModelKind::MoeGpt)),
        ("moe-gpt, 2048 assignments", sorted_plan),
        ("moe-gpt, 2048 assignments, capacity 1.25", capacity_plan),
        ("moe-gpt, 2 experts of 2048 rows", wide_experts),
        ("moe-gpt, dense softmax router", dense_router),
        ("mixtral", small_language_model(ModelKind::Mixtral)),
        ("qwen2-moe", small_language_model(ModelKind::Qwen2Moe)),
        ("olmoe", small_language_model(ModelKind::Olmoe)),
        ("deepseek-moe", small_language_model(ModelKind::DeepseekMoe)),
    ];
    for (name, cfg) in lms {
        for mixed in [false, true] {
            if mixed && !f16 {
                continue;
            }
            let precision = if mixed { "f16-mixed" } else { "f32" };
            let cfg = cfg.clone();
            all.push((
                format!("{name} ({precision})"),
                Box::new(move || language_model_steps(&cfg, mixed, 2)),
            ));
        }
    }
    use crate::backend::gpu::MatmulKernel;
    let mut products = vec![
        ("f32", crate::DType::F32, MatmulKernel::Auto),
        ("f32", crate::DType::F32, MatmulKernel::WideVec4),
    ];
    if f16 {
        products.push(("f16", crate::DType::F16, MatmulKernel::Auto));
    }
    for (dtype_name, dtype, kernel) in products {
        all.push((
            format!("[1024, 64]·[64, 1024] in {dtype_name} under {kernel:?}"),
            Box::new(move || wide_product(dtype, kernel)),
        ));
    }
    all.push((
        "tensor ops in f32".into(),
        Box::new(|| tensor_ops(crate::DType::F32)),
    ));
    if f16 {
        all.push((
            "tensor ops in f16".into(),
            Box::new(|| tensor_ops(crate::DType::F16)),
        ));
    }
    use crate::train::OptimizerKind::{Adam, Sgd};
    let images = [
        ("cnn", ModelKind::Cnn, DataKind::Mnist, Adam),
        ("mmoe-cnn", ModelKind::MmoeCnn, DataKind::Multimnist, Adam),
        ("moe-mlp, SGD", ModelKind::MoeMlp, DataKind::Mnist, Sgd),
        ("synthetic-b", ModelKind::MoeMlp, DataKind::SyntheticB, Adam),
    ];
    for (name, model, data, optimizer) in images {
        let cfg = TrainConfig {
            model,
            data,
            optimizer,
            batch: 16,
            train_limit: 64,
            test_limit: 16,
            experts: 4,
            k: 2,
            device: "gpu".into(),
            ..TrainConfig::default()
        };
        all.push((
            name.to_string(),
            Box::new(move || image_model_steps(&cfg, 2)),
        ));
    }
    all
}

/// Runs every workload; returns their bits and the kernels they ran.
fn run_all(f16: bool) -> (Vec<(String, Bits)>, BTreeSet<String>) {
    let mut kernels = BTreeSet::new();
    let mut out = Vec::new();
    for (name, run) in workloads(f16) {
        let ran = super::kernels_of(|| out.push((name.clone(), run().expect(&name))));
        kernels.extend(ran);
    }
    (out, kernels)
}

#[test]
fn every_shader_permutes_to_valid_wgsl() {
    let mut changed = 0;
    for (shader, roles) in builtin_shaders()
        .iter()
        .flat_map(|s| [(s, Roles::Reversed), (s, Roles::Scrambled)])
    {
        if !applies_to(shader.source) {
            continue;
        }
        let text = rewritten(shader.source, roles)
            .unwrap_or_else(|e| panic!("{} {roles:?}: {e}", shader.name));
        let module = naga::front::wgsl::parse_str(&text)
            .unwrap_or_else(|e| panic!("{} {roles:?}:\n{}", shader.name, e.emit_to_string(&text)));
        let info = naga::valid::Validator::new(
            naga::valid::ValidationFlags::all(),
            naga::valid::Capabilities::all(),
        )
        .validate(&module)
        .unwrap_or_else(|e| panic!("{} {roles:?}:\n{}", shader.name, e.emit_to_string(&text)));
        // each entry point with each set of override constants its launchers pass, as wgpu
        // specialises it when it creates the pipeline
        for ep in &module.entry_points {
            let mut sets: Vec<naga::back::PipelineConstants> = shader
                .specialisations
                .iter()
                .filter(|(entry, _)| *entry == ep.name)
                .map(|(_, c)| c.iter().map(|&(k, v)| (k.to_string(), v)).collect())
                .collect();
            if sets.is_empty() {
                sets.push(Default::default());
            }
            for constants in sets {
                let stage = Some((naga::ShaderStage::Compute, ep.name.as_str()));
                if let Err(e) = naga::back::pipeline_constants::process_overrides(
                    &module, &info, stage, &constants,
                ) {
                    panic!(
                        "{}.{} {roles:?}, {constants:?}: {e:?}",
                        shader.name, ep.name
                    );
                }
            }
        }
        let uses_ids = shader.source.contains("@builtin(local_invocation")
            || shader.source.contains("@builtin(global_invocation_id)");
        if uses_ids {
            assert_ne!(
                text, shader.source,
                "{} {roles:?}: nothing changed",
                shader.name
            );
            changed += 1;
        }
    }
    assert!(changed > 60, "only {changed} shader builds rewritten");
}

#[test]
fn training_gives_the_same_bits_with_each_workgroups_invocations_permuted() {
    let test = "training_gives_the_same_bits_with_each_workgroups_invocations_permuted";
    if common::gpu_or_skip(test).is_none() {
        return;
    }
    let _lock = gpu_lock();
    let f16 = crate::gpu::info()
        .expect("adapter info")
        .features
        .iter()
        .any(|f| f == "shader-f16");
    let gpu = crate::backend::gpu::GpuBackend::get().expect("the GPU opened above");
    let (as_run, kernels) = run_all(f16);
    let mut differences = Vec::new();
    for roles in [Roles::Reversed, Roles::Scrambled] {
        let before = gpu.module_count(roles);
        let (permuted, permuted_kernels) = {
            let _permuted = PermutedRoles::on(roles);
            run_all(f16)
        };
        // the run compiled modules of its own, from the rewritten text, and ran the same kernels
        assert!(
            gpu.module_count(roles) > before.max(20),
            "the {roles:?} run compiled {} such modules",
            gpu.module_count(roles)
        );
        assert_eq!(
            kernels, permuted_kernels,
            "the {roles:?} run ran other kernels"
        );
        for ((name, a), (_, b)) in as_run.iter().zip(&permuted) {
            for ((what, x), (_, y)) in a.iter().zip(b) {
                if let Some(i) = x.iter().zip(y).position(|(p, q)| p != q) {
                    differences.push(format!(
                        "{name}: {what}, element {i}: {} as run, {} {roles:?}",
                        f32::from_bits(x[i]),
                        f32::from_bits(y[i])
                    ));
                    break;
                }
            }
        }
    }
    eprintln!(
        "{} workloads, {} kernels, as run, reversed and scrambled: {}",
        as_run.len(),
        kernels.len(),
        kernels.iter().cloned().collect::<Vec<_>>().join(" ")
    );
    let all: BTreeSet<String> = builtin_shaders()
        .iter()
        .flat_map(|s| {
            let module = naga::front::wgsl::parse_str(s.source).expect("a built-in shader parses");
            let name = s.name;
            module
                .entry_points
                .into_iter()
                .map(move |ep| format!("{name}.{}", ep.name))
        })
        .collect();
    eprintln!(
        "not run by these workloads: {}",
        all.difference(&kernels)
            .cloned()
            .collect::<Vec<_>>()
            .join(" ")
    );
    assert!(
        differences.is_empty(),
        "the bits depend on the order a workgroup's invocations run in (a race on workgroup \
         memory, or a missing barrier):\n{}",
        differences.join("\n")
    );
}
