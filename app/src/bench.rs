//! Benchmarks behind `moegrad bench`: measured workloads that return plain, serialisable records.
//! Timing is wall-clock around a loop, after a warm-up, with the device synchronised before the
//! clock is read; figures are recorded in `docs/benchmarks.md` with the command that made them.
//! `bench train` is the exception: one whole training epoch, timed from its first step, as the
//! PyTorch peer times it (`pytorch_cnn_epoch.py`). `bench gpu-step` counts instead of timing
//! ([`gpu_step`]), and `bench all` ([`bench_all`]) runs every benchmark into one report
//! (docs/gpu.md explains its fields).

pub mod gpu_step;
pub mod op_cost;

pub use op_cost::{RECORD_CHAIN, gpu_record_us, op_overhead_us};

use moegrad::nn::Parameters;
use moegrad::{Device, Error, Result, Tensor};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use std::time::{Duration, Instant};

/// One matmul measurement.
#[derive(Clone, Debug, Serialize)]
pub struct MatmulRecord {
    /// "cpu" or "gpu"
    pub device: String,
    /// square matrix size n (an n×n by n×n product)
    pub size: usize,
    /// 2n³ floating-point operations per second, in units of 10⁹
    pub gflops: f64,
}

/// Per-op overhead of a tiny elementwise op.
#[derive(Clone, Debug, Serialize)]
pub struct OverheadRecord {
    /// "cpu" or "gpu"
    pub device: String,
    /// microseconds per op (an add of two 64-element f32 tensors)
    pub us: f64,
    /// GPU: host microseconds to record one such add into the pending batch, nothing submitted
    /// within the timed span (the least of 8 chains of 200), bind groups reused (the default)
    #[serde(skip_serializing_if = "Option::is_none")]
    pub record_us: Option<f64>,
    /// GPU: the same with a bind group created per dispatch (`MOEGRAD_BIND_GROUPS=create`),
    /// measured alternately with `record_us`
    #[serde(skip_serializing_if = "Option::is_none")]
    pub record_us_creating_bind_groups: Option<f64>,
}

/// The result of `moegrad bench matmul`.
#[derive(Clone, Debug, Serialize)]
pub struct MatmulBench {
    /// GFLOP/s per device and size
    pub matmul: Vec<MatmulRecord>,
    /// microseconds per small op, per device
    pub op_overhead_us: Vec<OverheadRecord>,
}

/// A random f32 tensor with values in [-1, 1) (seeded).
pub fn random_f32(shape: &[usize], seed: u64, device: Device) -> Result<Tensor> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let n = shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| Error::Invalid(format!("shape {shape:?}: too many elements to count")))?;
    let mut values = moegrad::memory::try_vec(n)?;
    values.extend((0..n).map(|_| rng.random_range(-1.0f32..1.0)));
    Tensor::from_f32(values, shape, device)
}

/// Runs `step` until at least `min_time` has passed (and at least `min_reps` times) after one
/// warm-up call; returns seconds per call.
pub fn time_per_call(
    device: Device,
    min_reps: usize,
    min_time: Duration,
    mut step: impl FnMut() -> Result<()>,
) -> Result<f64> {
    step()?;
    device.synchronize()?;
    let start = Instant::now();
    let mut reps = 0;
    while reps < min_reps || start.elapsed() < min_time {
        step()?;
        reps += 1;
        if reps % 8 == 0 {
            device.synchronize()?;
        }
    }
    device.synchronize()?;
    Ok(start.elapsed().as_secs_f64() / reps as f64)
}

/// GFLOP/s of an n×n·n×n f32 matmul on `device`.
pub fn matmul_gflops(device: Device, n: usize) -> Result<f64> {
    let a = random_f32(&[n, n], 1, device)?;
    let b = random_f32(&[n, n], 2, device)?;
    let secs = time_per_call(device, 3, Duration::from_millis(600), || {
        a.matmul(&b).map(drop)
    })?;
    Ok(2.0 * (n as f64).powi(3) / secs / 1e9)
}

/// Bytes an n×n·n×n f32 matmul holds: its two operands and the product, `3·n²·4` (`None` past
/// 64 bits).
pub fn matmul_bytes(n: usize) -> Option<u64> {
    (n as u64).checked_mul(n as u64)?.checked_mul(3 * 4)
}

/// `moegrad bench matmul` on every given device and size.
///
/// # Errors
/// A size whose matrices do not fit in memory ([`moegrad::memory::check_fits`], checked for every
/// size before anything is measured), or an error of a device.
pub fn bench_matmul(devices: &[Device], sizes: &[usize]) -> Result<MatmulBench> {
    for &n in sizes {
        moegrad::memory::check_fits(
            &format!("bench matmul --sizes {n} (three {n}×{n} f32 matrices)"),
            matmul_bytes(n),
        )?;
    }
    let mut out = MatmulBench {
        matmul: Vec::new(),
        op_overhead_us: Vec::new(),
    };
    for &d in devices {
        for &n in sizes {
            out.matmul.push(MatmulRecord {
                device: d.to_string(),
                size: n,
                gflops: matmul_gflops(d, n)?,
            });
        }
        let record = if d.is_gpu() {
            Some(gpu_record_us(d)?)
        } else {
            None
        };
        out.op_overhead_us.push(OverheadRecord {
            device: d.to_string(),
            us: op_overhead_us(d)?,
            record_us: record.map(|r| r.0),
            record_us_creating_bind_groups: record.map(|r| r.1),
        });
    }
    Ok(out)
}

/// One MoE training-step measurement.
#[derive(Clone, Debug, Serialize)]
pub struct MoeRecord {
    /// "cpu" or "gpu"
    pub device: String,
    /// "topk" or "softmax"
    pub router: String,
    /// experts
    pub n: usize,
    /// experts per token (n for the dense router)
    pub k: usize,
    /// how the layer ran the experts: "plan" (the dispatch plan and grouped products) or
    /// "all-experts" (the dense router's two wide products, `MoeLayer::set_all_experts_path`);
    /// the dense router is measured both ways
    pub path: String,
    /// median milliseconds per step (forward, backward, Adam)
    pub step_ms: f64,
    /// median milliseconds of the forward pass (routing, dispatch, experts, combine, MSE),
    /// timed in separate steps with the device synchronised after each phase
    pub forward_ms: f64,
    /// median milliseconds of `backward()`, timed like `forward_ms`
    pub backward_ms: f64,
    /// median milliseconds of the Adam step over every parameter, timed like `forward_ms`: the
    /// one phase whose work grows with n whatever the routing, since every expert that received
    /// a token has parameters to update
    pub optimizer_ms: f64,
    /// tokens per second
    pub tokens_per_s: f64,
    /// peak bytes during the step above the bytes held before it (CPU heap; GPU pool)
    pub peak_bytes: usize,
    /// the gradients the step stored: parameter-sized, except that an expert bank whose
    /// gradient is deferred (computed inside Adam, see `autograd/deferred.rs`) stores none
    pub gradient_bytes: usize,
    /// `peak_bytes` minus `gradient_bytes` (Adam updates the parameters and its moments in
    /// place): the activation memory and temporaries, including the rows a deferred gradient
    /// keeps until the optimizer step
    pub activation_bytes: usize,
    /// GPU: kernel dispatches per whole step (forward, backward, Adam); None on the CPU
    pub dispatches: Option<u64>,
    /// GPU: bind groups created over the timed steps (0 once the warm-up has settled the buffer
    /// pool: every dispatch reuses one, see docs/gpu.md); None on the CPU
    pub bind_groups_created: Option<u64>,
}

/// The result of `moegrad bench moe`.
#[derive(Clone, Debug, Serialize)]
pub struct MoeBench {
    /// workload: tokens, width, expert hidden width
    pub workload: String,
    /// one record per device, router and n
    pub moe: Vec<MoeRecord>,
}

/// Heap bytes held now (CPU) or bytes checked out of the GPU pool.
fn bytes_in_use(device: Device) -> usize {
    match device {
        Device::Cpu => moegrad::memory::live_bytes(),
        Device::Gpu => moegrad::gpu::memory()
            .map(|m| m.in_use_bytes as usize)
            .unwrap_or(0),
    }
}

fn peak_in_use(device: Device) -> usize {
    match device {
        Device::Cpu => moegrad::memory::peak_bytes(),
        Device::Gpu => moegrad::gpu::memory()
            .map(|m| m.peak_bytes as usize)
            .unwrap_or(0),
    }
}

fn reset_peak(device: Device) {
    match device {
        Device::Cpu => moegrad::memory::reset_peak(),
        Device::Gpu => {
            // without an adapter there is no GPU peak to reset
            let _ = moegrad::gpu::reset_peak_memory();
        }
    }
}

/// The MoE workload: `tokens` tokens of width `d`, bias-free experts `d → hidden → d`
/// (`x → relu(x·W1)·W2`, as in the PyTorch peer), top-`k`.
#[derive(Clone, Copy, Debug)]
pub struct MoeWorkload {
    /// tokens per step (T)
    pub tokens: usize,
    /// model width (d)
    pub d: usize,
    /// expert hidden width
    pub hidden: usize,
    /// experts per token for the sparse router
    pub k: usize,
}

impl MoeWorkload {
    /// About the bytes one training step with `n` experts, `k` per token, holds: the bank's
    /// weights with their gradients and two Adam moments (`16·n·2·d·hidden`), the input and
    /// target (`2·T·d` floats), and per routed token its dispatched row, hidden activation and
    /// output with their gradients (`2·T·k·(2d + 2·hidden)` floats). `None` past 64 bits.
    pub fn step_bytes(&self, n: usize, k: usize) -> Option<u64> {
        let (t, d, h) = (self.tokens as u64, self.d as u64, self.hidden as u64);
        let bank = (n as u64).checked_mul(2)?.checked_mul(d)?.checked_mul(h)?;
        let io = t.checked_mul(2)?.checked_mul(d)?;
        let rows = t.checked_mul(k as u64)?;
        let per_row = d.checked_add(h)?.checked_mul(4)?;
        let acts = rows.checked_mul(per_row)?;
        bank.checked_mul(4)?
            .checked_add(io)?
            .checked_add(acts)?
            .checked_mul(4)
    }
}

/// What [`moe_step`] measured.
#[derive(Clone, Copy, Debug)]
pub struct MoeStepTimes {
    /// median ms per whole step
    pub step_ms: f64,
    /// median ms of the forward pass, backward pass and optimizer step, each timed with the
    /// device synchronised around it (so on a GPU their sum can exceed `step_ms`)
    pub phases_ms: [f64; 3],
    /// peak bytes above those held before a step
    pub peak_bytes: usize,
    /// bytes of the gradients stored by backward (deferred ones store none)
    pub gradient_bytes: usize,
    /// `peak_bytes` less `gradient_bytes`
    pub activation_bytes: usize,
    /// GPU kernel dispatches per whole step (None on the CPU)
    pub dispatches: Option<u64>,
    /// GPU bind groups created over the timed steps (None on the CPU)
    pub bind_groups_created: Option<u64>,
}

/// Warm-up steps of [`moe_step`] on the GPU: the first compiles pipelines, fills the buffer
/// pool and creates the optimizer's state; the next settle which pooled buffer each tensor
/// gets, so that the timed steps reuse their bind groups (measured on lavapipe: none created
/// over the timed steps of any router or n after 8; the CPU takes 2).
pub const GPU_WARMUP_STEPS: usize = 8;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Times one MoE layer's training step (MSE against a fixed target, backward, Adam) with
/// `router` over `n` experts, `k` per token (`all_experts`: the layer's
/// `set_all_experts_path`): `reps` whole steps, then `reps` steps timed phase by phase.
pub fn moe_step(
    device: Device,
    (router, n, k): (&str, usize, usize),
    all_experts: Option<bool>,
    w: MoeWorkload,
    reps: usize,
) -> Result<MoeStepTimes> {
    let (tokens, d, hidden) = (w.tokens, w.d, w.hidden);
    use moegrad::moe::{MoeConfig, MoeLayer};
    use moegrad::optim::{Adam, Optimizer};
    let mut cfg = MoeConfig::new(d, hidden, n, k);
    cfg.router = router.into();
    // bias-free experts, like the PyTorch peer's
    cfg.expert_bias = false;
    let mut layer = MoeLayer::new(&cfg, device)?;
    layer.set_all_experts_path(all_experts);
    let mut params = Vec::new();
    layer.visit_params("", &mut |name, p| params.push((name, p.clone())));
    // bytes of the gradients backward stored in the last step (a deferred one stores none)
    let mut gradient_bytes = 0;
    let mut opt = Adam::new(1e-3)?;
    let x = random_f32(&[tokens, d], 7, device)?;
    let target = random_f32(&[tokens, d], 8, device)?;
    // one step, with the clock read (after a device sync) between its phases when `clock`
    let mut step = |clock: Option<&mut Vec<[f64; 3]>>| -> Result<()> {
        let sync_now = |on: bool| -> Result<Instant> {
            if on {
                device.synchronize()?;
            }
            Ok(Instant::now())
        };
        let timed = clock.is_some();
        let t0 = sync_now(timed)?;
        let out = layer.forward(&x)?;
        let loss = out.y.mse(&target)?;
        let t1 = sync_now(timed)?;
        loss.backward()?;
        let t2 = sync_now(timed)?;
        gradient_bytes = params
            .iter()
            .map(|(_, p)| p.get())
            .filter(|p| !p.grad_is_deferred())
            .map(|p| p.numel() * 4)
            .sum();
        opt.step(&params, None)?;
        let t3 = sync_now(timed)?;
        if let Some(clock) = clock {
            let ms = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e3;
            clock.push([ms(t0, t1), ms(t1, t2), ms(t2, t3)]);
        }
        Ok(())
    };
    // warm-up: pipelines, pool, optimizer state, and on the GPU the steps that settle which
    // pooled buffer each tensor gets, so the timed steps reuse their bind groups
    let warmups = if device.is_gpu() { GPU_WARMUP_STEPS } else { 2 };
    for _ in 0..warmups {
        step(None)?;
        device.synchronize()?;
    }
    let mut times = Vec::new();
    let mut peak = 0;
    device.reset_gpu_stats();
    for _ in 0..reps.max(1) {
        let before = bytes_in_use(device);
        reset_peak(device);
        let t = Instant::now();
        step(None)?;
        device.synchronize()?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
        peak = peak.max(peak_in_use(device).saturating_sub(before));
    }
    let counts = device.gpu_stats();
    let dispatches = counts.map(|s| s.dispatches / reps.max(1) as u64);
    let bind_groups_created = counts.map(|s| s.bind_groups_created);
    let mut phases = Vec::new();
    for _ in 0..reps.max(1) {
        step(Some(&mut phases))?;
    }
    let phase = |i: usize| median(phases.iter().map(|p| p[i]).collect());
    // The step's parameter-sized allocations are the stored gradients: Adam updates the
    // parameters and its moments in place. The rest of the peak is activations and temporaries.
    Ok(MoeStepTimes {
        step_ms: median(times),
        phases_ms: [phase(0), phase(1), phase(2)],
        peak_bytes: peak,
        gradient_bytes,
        activation_bytes: peak.saturating_sub(gradient_bytes),
        dispatches,
        bind_groups_created,
    })
}

/// `moegrad bench moe` on every device: top-k over `ns` and the dense softmax router over `dense_ns`.
pub fn bench_moe(
    devices: &[Device],
    ns: &[usize],
    dense_ns: &[usize],
    w: MoeWorkload,
) -> Result<MoeBench> {
    let mut out = MoeBench {
        workload: format!(
            "T = {}, d = {}, expert hidden {}, k = {}",
            w.tokens, w.d, w.hidden, w.k
        ),
        moe: Vec::new(),
    };
    // every configuration is checked before the first is measured
    for (dense, list) in [(false, ns), (true, dense_ns)] {
        for &n in list {
            let k = if dense { n } else { w.k.min(n) };
            moegrad::memory::check_fits(
                &format!(
                    "bench moe --tokens {} (n = {n} experts, k = {k}, d = {}, hidden {})",
                    w.tokens, w.d, w.hidden
                ),
                w.step_bytes(n, k),
            )?;
        }
    }
    for &dev in devices {
        // top-k through the plan; the dense router both ways
        for (router, list, paths) in [
            ("topk", ns, &[false][..]),
            ("softmax", dense_ns, &[true, false][..]),
        ] {
            for (&n, &all_experts) in list.iter().flat_map(|n| paths.iter().map(move |p| (n, p))) {
                let kk = if router == "softmax" { n } else { w.k.min(n) };
                let reps = if router == "softmax" && n > 8 { 2 } else { 5 };
                let t = moe_step(dev, (router, n, kk), Some(all_experts), w, reps)?;
                out.moe.push(MoeRecord {
                    device: dev.to_string(),
                    router: router.into(),
                    n,
                    k: kk,
                    path: if all_experts { "all-experts" } else { "plan" }.into(),
                    step_ms: t.step_ms,
                    forward_ms: t.phases_ms[0],
                    backward_ms: t.phases_ms[1],
                    optimizer_ms: t.phases_ms[2],
                    tokens_per_s: w.tokens as f64 / (t.step_ms / 1e3),
                    peak_bytes: t.peak_bytes,
                    gradient_bytes: t.gradient_bytes,
                    activation_bytes: t.activation_bytes,
                    dispatches: t.dispatches,
                    bind_groups_created: t.bind_groups_created,
                });
            }
        }
    }
    Ok(out)
}

/// One GPU matmul measurement with a given kernel.
#[derive(Clone, Debug, Serialize)]
pub struct KernelRecord {
    /// "auto", "plain", "wide", "wide-vec4" or "subgroup" ([`moegrad::gpu::MatmulKernel`])
    pub kernel: String,
    /// the run-time checks compiled into the kernel: "full", "no-loop-counter" or "none"
    /// ([`moegrad::gpu::ShaderChecks`])
    pub checks: String,
    /// square matrix size n
    pub size: usize,
    /// 2n³ floating-point operations per second, in units of 10⁹
    pub gflops: f64,
}

/// GFLOP/s of the GPU matmul with each kernel the adapter can run, compiled with each choice of
/// run-time checks, at each of `sizes`; the kernel and checks in use before are restored.
pub fn gpu_matmul_kernels(sizes: &[usize]) -> Result<Vec<KernelRecord>> {
    use moegrad::gpu::{self, MatmulKernel, ShaderChecks};
    let before = gpu::matmul_kernel()?;
    let checks_before = gpu::shader_checks()?;
    let mut kernels = vec![
        MatmulKernel::Auto,
        MatmulKernel::Plain,
        MatmulKernel::Wide,
        MatmulKernel::WideVec4,
    ];
    if gpu::subgroup_matmul_available()? {
        kernels.push(MatmulKernel::Subgroup);
    }
    let mut out = Vec::new();
    let mut run = || -> Result<()> {
        for checks in ShaderChecks::ALL {
            gpu::set_shader_checks(checks)?;
            for &kernel in &kernels {
                gpu::set_matmul_kernel(kernel)?;
                for &n in sizes {
                    out.push(KernelRecord {
                        kernel: kernel.name().to_string(),
                        checks: checks.name().to_string(),
                        size: n,
                        gflops: matmul_gflops(Device::Gpu, n)?,
                    });
                }
            }
        }
        Ok(())
    };
    let result = run();
    gpu::set_matmul_kernel(before)?;
    gpu::set_shader_checks(checks_before)?;
    result.map(|()| out)
}

/// One model's training epoch (`moegrad bench train`).
#[derive(Clone, Debug, Serialize)]
pub struct TrainRecord {
    /// "cpu" or "gpu"
    pub device: String,
    /// the model, as `train --model` names it
    pub model: String,
    /// examples per step
    pub batch: usize,
    /// training examples in the epoch
    pub examples: usize,
    /// seconds of training: the forward pass, loss, backward pass and Adam step of every batch,
    /// with the device synchronised before the clock stops. The batches are on the device
    /// before it starts (no data loading) and nothing is evaluated.
    pub seconds: f64,
}

/// The result of `moegrad bench train`.
#[derive(Clone, Debug, Serialize)]
pub struct TrainBench {
    /// one record per device and model
    pub train: Vec<TrainRecord>,
}

/// A `bench train` workload: the model `moegrad train` builds with these settings (every other
/// setting at its default: Adam at 1e-3, the top-k router, balance loss 0.01, seed 0).
#[derive(Clone, Copy, Debug)]
pub struct TrainWorkload {
    /// the model
    pub model: moegrad::train::ModelKind,
    /// its dataset
    pub data: moegrad::train::DataKind,
    /// MoE: experts (ignored by dense models)
    pub experts: usize,
    /// MoE: experts per example
    pub k: usize,
}

/// The workloads of `moegrad bench train`, those of the PyTorch peer
/// (`pytorch_cnn_epoch.py`): `cnn` on MNIST, `moe-mlp` on MNIST (top-k, 8 experts, k = 2) and
/// `mmoe-cnn` on MultiMNIST (top-k, 8 experts, k = 4).
pub const TRAIN_WORKLOADS: [TrainWorkload; 3] = {
    use moegrad::train::{DataKind, ModelKind};
    [
        TrainWorkload {
            model: ModelKind::Cnn,
            data: DataKind::Mnist,
            experts: 8,
            k: 2,
        },
        TrainWorkload {
            model: ModelKind::MoeMlp,
            data: DataKind::Mnist,
            experts: 8,
            k: 2,
        },
        TrainWorkload {
            model: ModelKind::MmoeCnn,
            data: DataKind::Multimnist,
            experts: 8,
            k: 4,
        },
    ]
};

impl TrainWorkload {
    /// The run's settings: data from `data_dir`, the first `examples` training examples (0: all),
    /// `batch` per step, on `device`.
    pub fn config(
        &self,
        data_dir: &std::path::Path,
        examples: usize,
        batch: usize,
        device: Device,
    ) -> moegrad::train::TrainConfig {
        moegrad::train::TrainConfig {
            data: self.data,
            data_dir: data_dir.to_path_buf(),
            model: self.model,
            epochs: 1,
            batch,
            device: device.to_string(),
            train_limit: examples,
            experts: self.experts,
            k: self.k,
            ..moegrad::train::TrainConfig::default()
        }
    }
}

/// Times one training epoch of `w` on `device` (see [`TrainRecord::seconds`]).
///
/// # Errors
/// Bad settings (a zero batch), data that cannot be read (naming the file), a model that does
/// not fit in memory, a device error, or a loss that is not finite at the end of the epoch.
pub fn train_epoch(
    device: Device,
    w: TrainWorkload,
    data_dir: &std::path::Path,
    examples: usize,
    batch: usize,
) -> Result<TrainRecord> {
    use moegrad::optim::{Adam, Optimizer};
    use moegrad::train::{build_model, check_memory};
    let cfg = w.config(data_dir, examples, batch, device);
    cfg.validate()?;
    let data = moegrad::train::load_data(&cfg)?;
    let train = &data.train;
    if train.is_empty() {
        return Err(Error::Invalid(format!(
            "bench train: no training examples in {}",
            data_dir.display()
        )));
    }
    check_memory(&cfg, data.side, data.tasks, batch.min(train.len()))?;
    let model = build_model(&cfg, data.side, data.tasks, device)?;
    let params = model.named_params();
    let mut opt = Adam::new(cfg.lr)?;
    let batches = train
        .order(cfg.seed, 0, true)
        .chunks(batch)
        .map(|ids| train.batch(ids, device))
        .collect::<Result<Vec<_>>>()?;
    device.synchronize()?;
    let start = Instant::now();
    let mut last_loss = None;
    for b in &batches {
        let _step = moegrad::profile::step();
        let out = model.forward(&b.x)?;
        if !out.score_terms.is_empty() {
            return Err(Error::Invalid(
                "bench train times routers trained by backpropagation, not REINFORCE".into(),
            ));
        }
        let task = moegrad::train::task_loss(&out.logits, &b.y)?;
        let loss = match &out.aux_loss {
            Some(aux) => task.add(aux)?,
            None => task,
        };
        loss.backward()?;
        opt.step(&params, None)?;
        last_loss = Some(loss);
    }
    device.synchronize()?;
    let seconds = start.elapsed().as_secs_f64();
    // a diverged epoch is no measurement
    if let Some(loss) = last_loss {
        let l = loss.item()?;
        if !l.is_finite() {
            return Err(Error::Invalid(format!(
                "bench train: the loss of {} is {l} after one epoch",
                w.model.name()
            )));
        }
    }
    Ok(TrainRecord {
        device: device.to_string(),
        model: w.model.name().to_string(),
        batch,
        examples: train.len(),
        seconds,
    })
}

/// `moegrad bench train`: one epoch of every workload of [`TRAIN_WORKLOADS`] on every device.
///
/// # Errors
/// As [`train_epoch`]; a zero `batch` is refused before anything runs.
pub fn bench_train(
    devices: &[Device],
    data_dir: &std::path::Path,
    examples: usize,
    batch: usize,
) -> Result<TrainBench> {
    if batch == 0 {
        return Err(Error::Invalid("--batch must be at least 1".into()));
    }
    let mut out = TrainBench { train: Vec::new() };
    for &device in devices {
        for w in TRAIN_WORKLOADS {
            out.train
                .push(train_epoch(device, w, data_dir, examples, batch)?);
        }
    }
    Ok(out)
}

/// The result of `moegrad bench all`: every benchmark in one object, for a user with a real
/// GPU to send back (docs/gpu.md explains the fields).
#[derive(Clone, Debug, Serialize)]
pub struct AllBench {
    /// the GPU adapter measured (`null` when there is none)
    pub adapter: Option<moegrad::gpu::GpuInfo>,
    /// `bench matmul` on the devices measured
    pub matmul: MatmulBench,
    /// `bench moe` on the devices measured
    pub moe: MoeBench,
    /// `bench gpu-step` (`null` without a GPU adapter)
    pub gpu_step: Option<Vec<gpu_step::GpuStepRecord>>,
    /// the GPU matmul's GFLOP/s per kernel (every [`moegrad::gpu::MatmulKernel`] the adapter
    /// can run) and per choice of run-time checks ([`moegrad::gpu::ShaderChecks`]) at each
    /// size, when the GPU is among the devices measured: which kernel and checks should be the
    /// default
    pub gpu_matmul_kernels: Option<Vec<KernelRecord>>,
    /// `bench train`
    pub train: Option<Vec<TrainRecord>>,
    /// why a part is `null`, one line each
    pub skipped: Vec<String>,
}

/// `moegrad bench all`: `bench matmul` (`sizes`) and `bench moe` (`w`, the CLI's lists of
/// experts) on `devices`, `bench gpu-step` on the GPU adapter when there is one (a software
/// adapter included), and `bench train`.
///
/// # Errors
/// An error of a benchmark that ran (a missing GPU adapter is a note in `skipped`, not an error).
pub fn bench_all(
    devices: &[Device],
    sizes: &[usize],
    ns: &[usize],
    dense_ns: &[usize],
    w: MoeWorkload,
    train: (&std::path::Path, usize, usize),
) -> Result<AllBench> {
    let mut skipped = Vec::new();
    let adapter = moegrad::gpu::info().ok();
    let matmul = bench_matmul(devices, sizes)?;
    let gpu_matmul_kernels = match devices.contains(&Device::Gpu) {
        true => Some(gpu_matmul_kernels(sizes)?),
        false => None,
    };
    let moe = bench_moe(devices, ns, dense_ns, w)?;
    let gpu_step = match Device::gpu() {
        Ok(_) => Some(gpu_step::bench_gpu_step(&gpu_step::GPU_STEP_MODELS)?.gpu_step),
        Err(e) => {
            skipped.push(format!("gpu_step: no GPU adapter ({e})"));
            None
        }
    };
    let (data_dir, examples, batch) = train;
    let train = Some(bench_train(devices, data_dir, examples, batch)?.train);
    Ok(AllBench {
        adapter,
        matmul,
        moe,
        gpu_step,
        gpu_matmul_kernels,
        train,
        skipped,
    })
}
