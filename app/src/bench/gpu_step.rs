//! `moegrad bench gpu-step`: what one steady-state training step asks of the GPU.
//!
//! For each model (`moe-mlp` on MNIST-shaped input with the top-2-of-8 router, `cnn`, and the
//! character-level `gpt` and `moe-gpt`), built with the settings `moegrad train` gives it, this
//! runs [`WARMUP_STEPS`] warm-up steps (pipelines compile, the buffer pool fills and settles,
//! the optimizer creates its state), then counts one more step with the GPU backend's counters
//! ([`GpuStats`]): kernel dispatches, queue submissions, host waits, buffers and bind groups the
//! driver created, bytes uploaded and downloaded. The step is the one the training loop runs
//! ([`moegrad::train::train_step`], plus the loop's on-device running sums), without the loss
//! read-back of a `--log-every` step. Each step ends with a flush, as the training loop's do, so
//! its last batch of kernels is submitted (and counted) within it.
//!
//! The inputs are random (seeded) with the shapes of the real data: MNIST-sized images and
//! labels, and a synthetic text with Shakespeare's 65-character vocabulary. Routing sizes come
//! from static bounds, so the counts do not depend on the values. Counts, unlike timings, are
//! the same on every adapter, so they are measured on lavapipe in CI. `gpu_ms` is the sum of
//! the step's kernel times from timestamp queries (the profile's, `backend/gpu/timing.rs`),
//! taken on one more step so that timing does not disturb the counts; `null` without them.

use moegrad::data::Dataset;
use moegrad::data::text::CharCorpus;
use moegrad::gpu::GpuStats;
use moegrad::moe::RoutingWindow;
use moegrad::nn::Parameters;
use moegrad::optim::LossScale;
use moegrad::profile::KernelTime;
use moegrad::train::{ModelKind, Precision, TrainConfig};
use moegrad::{DType, Device, Error, Result, Tensor};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

/// The models `bench gpu-step` measures, by their `--model` names.
pub const GPU_STEP_MODELS: [&str; 4] = ["moe-mlp", "cnn", "gpt", "moe-gpt"];

/// Warm-up steps before the counted one. The first creates the optimizer's state and fills the
/// buffer pool; the next settle which pooled buffer each tensor gets (the pool hands out the
/// free buffer it created first, so each step's buffers become those of the step before), and
/// with them the bind groups: on lavapipe the small `moe-gpt` of the tests created 355, 276,
/// 187, 139, 62, 33, 21, 14, 11, 5, 5, 3, 2, 1 and then no bind groups in its first steps (the
/// slowest to settle of the models and balancers tested; `gpt` took 4 steps).
pub const WARMUP_STEPS: usize = 16;

/// Timed steps of each kind (bind groups reused, created) behind `host_ms`.
pub const HOST_ROUNDS: usize = 3;

/// The counts of one model's steady-state training step.
#[derive(Clone, Debug, Serialize)]
pub struct GpuStepRecord {
    /// the model, as `--model` names it
    pub model: String,
    /// `f32` or `f16-mixed` (`--precision`)
    pub precision: String,
    /// compute dispatches (kernel launches) in the step
    pub dispatches: u64,
    /// command buffers submitted to the queue
    pub submits: u64,
    /// times the host waited for the device (0: the step never stalls the CPU)
    pub host_waits: u64,
    /// device buffers created by the driver (0: every buffer came from the pool)
    pub buffers_created: u64,
    /// bind groups created (0: every dispatch reused the bind group of an earlier step's)
    pub bind_groups_created: u64,
    /// bytes written to the device: the batch, plus the kernels' parameter blocks
    pub uploaded_bytes: u64,
    /// bytes read back to the host
    pub downloaded_bytes: u64,
    /// bytes of the buffers bound to the step's dispatches (each kernel's operands and outputs,
    /// each distinct buffer once per dispatch): the traffic the kernels ask of device memory
    pub bound_bytes: u64,
    /// device bytes the forward pass and the loss keep for backward (saved activations)
    pub activation_bytes: u64,
    /// the most device bytes in use during the step beyond those in use before it
    pub peak_bytes: u64,
    /// GPU milliseconds of the step's kernels from timestamp queries (measured on one more step,
    /// each kernel in a pass of its own); `null` where the adapter has no timestamp queries
    pub gpu_ms: Option<f64>,
    /// the same step kernel by kernel (`shader.entry`, its dispatches and GPU milliseconds),
    /// longest first: where `gpu_ms` goes (empty where `gpu_ms` is `null`)
    pub gpu_kernels: Vec<KernelTime>,
    /// host milliseconds to record and submit one step (from an idle device until the step's
    /// last batch is submitted; the least of [`HOST_ROUNDS`] steps): the CPU's share, which a
    /// real GPU's step cannot go below
    pub host_ms: Option<f64>,
    /// the same with bind-group reuse off (`MOEGRAD_BIND_GROUPS=create`: every dispatch creates
    /// its bind group), measured alternately with `host_ms`
    pub host_ms_creating_bind_groups: Option<f64>,
}

/// The result of `moegrad bench gpu-step`.
#[derive(Clone, Debug, Serialize)]
pub struct GpuStepBench {
    /// one record per model and precision (f16-mixed where the adapter has `shader-f16`)
    pub gpu_step: Vec<GpuStepRecord>,
    /// the precisions not measured, and why
    pub skipped: Vec<String>,
}

/// The GPU, or an error that says `bench gpu-step` needs one.
fn gpu() -> Result<Device> {
    Device::gpu().map_err(|e| {
        Error::Device(format!(
            "bench gpu-step counts the work of a GPU training step and needs a GPU adapter \
             (a software one such as Mesa's lavapipe will do): {e}"
        ))
    })
}

/// The settings `moegrad train --model <model>` uses for the benchmark's models.
pub fn step_config(model: &str) -> Result<TrainConfig> {
    let mut cfg = match model {
        "moe-mlp" => TrainConfig {
            model: ModelKind::MoeMlp,
            router: "topk".into(),
            experts: 8,
            k: 2,
            ..TrainConfig::default()
        },
        "cnn" => TrainConfig {
            model: ModelKind::Cnn,
            ..TrainConfig::default()
        },
        "gpt" => TrainConfig::language_model(ModelKind::Gpt),
        "moe-gpt" => TrainConfig::language_model(ModelKind::MoeGpt),
        other => {
            return Err(Error::Invalid(format!(
                "bench gpu-step: unknown model {other:?}; expected one of {}",
                GPU_STEP_MODELS.join(", ")
            )));
        }
    };
    cfg.device = "gpu".into();
    Ok(cfg)
}

/// A training step that can be run again and again: the model, its optimizer and its data.
trait Stepper {
    /// Runs training step number `step` (uploading its batch).
    fn step(&mut self, step: u64) -> Result<()>;
    /// The model, and the batch of step `step` on the GPU (inputs, one target per task).
    fn batch(&self, step: u64) -> Result<(&dyn moegrad::train::TaskModel, Tensor, Vec<Tensor>)>;
}

/// One step of `model` in the run's precision: [`moegrad::train::train_step`], or
/// [`moegrad::train::train_step_mixed`] with the loss scale under `--precision f16-mixed`.
fn run_step(
    model: &dyn moegrad::train::TaskModel,
    params: &[(String, moegrad::nn::Param)],
    opt: &mut dyn moegrad::optim::Optimizer,
    batch: (&Tensor, &[Tensor]),
    clip: f64,
    scale: Option<&LossScale>,
) -> Result<moegrad::train::StepOutput> {
    let (x, y) = batch;
    match scale {
        Some(s) => moegrad::train::train_step_mixed(model, params, opt, x, y, clip, s),
        None => moegrad::train::train_step(model, params, opt, x, y, clip),
    }
}

/// The loss scale of `--precision f16-mixed` (None in f32), after checking the adapter can.
fn loss_scale(cfg: &TrainConfig, device: Device) -> Result<Option<LossScale>> {
    cfg.precision.check(device)?;
    Ok(match cfg.precision {
        Precision::F16Mixed => Some(LossScale::new(device)?),
        Precision::F32 => None,
    })
}

/// An image model (`moe-mlp`, `cnn`) on random MNIST-shaped batches.
struct ImageStepper {
    model: Box<dyn moegrad::train::TaskModel>,
    params: Vec<(String, moegrad::nn::Param)>,
    opt: Box<dyn moegrad::optim::Optimizer>,
    data: Dataset,
    cfg: TrainConfig,
    scale: Option<LossScale>,
    /// the loop's running sums: training loss and the routing diagnostics' window
    loss_sum: Tensor,
    routing: RoutingWindow,
}

impl ImageStepper {
    fn new(cfg: TrainConfig, device: Device) -> Result<ImageStepper> {
        const SIDE: usize = 28;
        let samples = cfg.batch * (WARMUP_STEPS + 2);
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let features = (0..samples * SIDE * SIDE)
            .map(|_| rng.random_range(0.0f32..1.0))
            .collect();
        let labels = (0..samples).map(|_| rng.random_range(0..10)).collect();
        let data = Dataset::new(features, vec![1, SIDE, SIDE], vec![labels])?;
        let model = moegrad::train::build_model(&cfg, SIDE, 1, device)?;
        let params = model.named_params();
        let opt = moegrad::train::make_optimizer(&cfg)?;
        Ok(ImageStepper {
            model,
            params,
            opt,
            data,
            scale: loss_scale(&cfg, device)?,
            loss_sum: Tensor::zeros(&[], DType::F32, device)?,
            routing: RoutingWindow::new(),
            cfg,
        })
    }
}

impl Stepper for ImageStepper {
    fn step(&mut self, step: u64) -> Result<()> {
        let b = self.cfg.batch;
        let (_, x, y) = self.batch(step)?;
        let out = run_step(
            self.model.as_ref(),
            &self.params,
            self.opt.as_mut(),
            (&x, &y),
            self.cfg.clip_grad_norm,
            self.scale.as_ref(),
        )?;
        // the loop's on-device bookkeeping (see train::run)
        self.loss_sum = moegrad::no_grad(|| {
            self.loss_sum
                .add(&out.task_loss.detach().mul_scalar(b as f64)?)
        })?;
        self.routing.add(&out.routing)
    }

    fn batch(&self, step: u64) -> Result<(&dyn moegrad::train::TaskModel, Tensor, Vec<Tensor>)> {
        let b = self.cfg.batch;
        let first = (step as usize % (self.data.len() / b)) * b;
        let ids: Vec<usize> = (first..first + b).collect();
        let batch = self.data.batch(&ids, Device::Gpu)?;
        Ok((self.model.as_ref(), batch.x, batch.y))
    }
}

/// A language model (`gpt`, `moe-gpt`) on windows of a synthetic text.
struct LmStepper {
    model: moegrad::lm::LanguageModel,
    params: Vec<(String, moegrad::nn::Param)>,
    opt: moegrad::optim::Adam,
    corpus: CharCorpus,
    cfg: TrainConfig,
    scale: Option<LossScale>,
    /// the loop's running sums: training loss and the routing diagnostics' window
    loss_sum: Tensor,
    routing: RoutingWindow,
}

impl LmStepper {
    fn new(cfg: TrainConfig, device: Device) -> Result<LmStepper> {
        // Shakespeare's vocabulary size, 65 characters, in a seeded random text
        let alphabet: Vec<char> = (0..65u32)
            .map(|i| char::from_u32(' ' as u32 + i).unwrap_or(' '))
            .collect();
        let mut rng = ChaCha8Rng::seed_from_u64(12);
        let text: String = (0..20_000)
            .map(|_| alphabet[rng.random_range(0..alphabet.len())])
            .collect();
        let corpus = CharCorpus::from_text(
            &text,
            cfg.block,
            std::path::Path::new("(bench gpu-step text)"),
        )?;
        let model = moegrad::lm::LanguageModel::build(&cfg, corpus.vocab_size(), device)?;
        let params = model.named_params();
        let opt = moegrad::lm::make_optimizer(&cfg, &model)?;
        Ok(LmStepper {
            model,
            params,
            opt,
            corpus,
            scale: loss_scale(&cfg, device)?,
            loss_sum: Tensor::zeros(&[], DType::F32, device)?,
            routing: RoutingWindow::new(),
            cfg,
        })
    }
}

impl Stepper for LmStepper {
    fn step(&mut self, step: u64) -> Result<()> {
        let (_, x, y) = self.batch(step)?;
        let out = run_step(
            &self.model,
            &self.params,
            &mut self.opt,
            (&x, &y),
            self.cfg.clip_grad_norm,
            self.scale.as_ref(),
        )?;
        // the loop's on-device bookkeeping (see lm::run)
        self.loss_sum = moegrad::no_grad(|| {
            self.loss_sum
                .add(&out.task_loss.detach().to_dtype(DType::F32)?)
        })?;
        self.routing.add(&out.routing)
    }

    fn batch(&self, step: u64) -> Result<(&dyn moegrad::train::TaskModel, Tensor, Vec<Tensor>)> {
        let (b, t) = (self.cfg.batch, self.cfg.block);
        let (x, y) = self.corpus.train_batch(b, t, self.cfg.seed, step);
        let x = Tensor::from_i32(x, &[b, t], Device::Gpu)?;
        let y = Tensor::from_i32(y, &[b * t], Device::Gpu)?;
        Ok((&self.model, x, vec![y]))
    }
}

/// The GPU backend's counters over one steady-state training step of `model` (one of
/// [`GPU_STEP_MODELS`]), after [`WARMUP_STEPS`] warm-up steps. The counters are process-wide:
/// other GPU work running at the same time is counted too.
///
/// # Errors
/// No GPU adapter (the message says so), an unknown model, or an error of the step.
pub fn count_step(model: &str) -> Result<GpuStats> {
    count_step_with(step_config(model)?)
}

/// [`count_step`] for a model with other settings (a smaller language model, say, for a quick
/// test: the counts' zeros do not depend on the sizes).
///
/// # Errors
/// No GPU adapter, an image model other than the MNIST ones, or an error of the step.
pub fn count_step_with(cfg: TrainConfig) -> Result<GpuStats> {
    measure_step_with(cfg, false).map(|(stats, _)| stats)
}

/// [`count_step_with`], and with `time` also the GPU milliseconds of the step's kernels from
/// timestamp queries (`None` without them, or while this thread already records a profile).
/// The time comes from one more step than the counted one: timing gives every dispatch a pass
/// of its own and reads the timestamps back, which the counted step must not include.
///
/// # Errors
/// As [`count_step_with`].
pub fn measure_step_with(cfg: TrainConfig, time: bool) -> Result<(GpuStats, Option<f64>)> {
    let m = measure(cfg, time)?;
    Ok((m.stats, m.gpu_ms))
}

/// What [`measure`] finds out about one steady-state step.
pub struct StepFigures {
    /// the counters of the counted step
    pub stats: GpuStats,
    /// its kernels' GPU milliseconds (see [`measure_step_with`])
    pub gpu_ms: Option<f64>,
    /// the same per kernel, longest first ([`GpuStepRecord::gpu_kernels`])
    pub gpu_kernels: Vec<KernelTime>,
    /// host milliseconds to record and submit a step, bind groups reused and created
    /// ([`GpuStepRecord::host_ms`]); measured with `time` only
    pub host_ms: Option<(f64, f64)>,
    /// the most device bytes in use during a step, beyond those in use before it
    pub peak_bytes: u64,
    /// device bytes the forward pass and the loss leave in use for backward: the saved
    /// activations (with f16-mixed, also the f16 copies of the weights the products saved)
    pub activation_bytes: u64,
}

/// Device bytes in use now.
fn in_use() -> Result<u64> {
    Ok(moegrad::gpu::memory()?.in_use_bytes)
}

/// The counts, time and memory of one steady-state training step of `cfg` on the GPU (in its
/// `precision`), after [`WARMUP_STEPS`] warm-up steps.
///
/// # Errors
/// As [`count_step_with`]; `--precision f16-mixed` on an adapter without `shader-f16`.
pub fn measure(cfg: TrainConfig, time: bool) -> Result<StepFigures> {
    let gpu = gpu()?;
    // start from an empty pool, as a fresh process would: what earlier work left on the free
    // lists decides when a batch is submitted early, and so the step's peak memory
    moegrad::gpu::release_free_memory()?;
    let mixed = cfg.precision == Precision::F16Mixed;
    let mut stepper: Box<dyn Stepper> = if cfg.model.is_lm() {
        Box::new(LmStepper::new(cfg, Device::Gpu)?)
    } else {
        Box::new(ImageStepper::new(cfg, Device::Gpu)?)
    };
    for s in 0..WARMUP_STEPS as u64 {
        stepper.step(s)?;
        moegrad::gpu::flush()?;
    }
    let counters = || gpu.gpu_stats().expect("the GPU's counters");
    let before = counters();
    stepper.step(WARMUP_STEPS as u64)?;
    moegrad::gpu::flush()?;
    let counted = counters().since(&before);
    // errors the driver reported late surface here, after the counting
    gpu.synchronize()?;
    // the memory of one more step: its peak, and what its forward pass keeps for backward
    let step = WARMUP_STEPS as u64 + 1;
    let resting = in_use()?;
    moegrad::gpu::reset_peak_memory()?;
    stepper.step(step)?;
    gpu.synchronize()?;
    let peak_bytes = moegrad::gpu::memory()?.peak_bytes.saturating_sub(resting);
    let activation_bytes = {
        let (model, x, y) = stepper.batch(step)?;
        let start = in_use()?;
        let forward = || -> Result<_> {
            let out = model.forward(&x)?;
            let loss = moegrad::train::task_loss(&out.logits, &y)?;
            Ok((out, loss))
        };
        let kept = if mixed {
            moegrad::autocast_f16(forward)?
        } else {
            forward()?
        };
        let held = in_use()?.saturating_sub(start);
        drop(kept);
        held
    };
    gpu.synchronize()?;
    let timestamps = moegrad::gpu::has_timestamps()?;
    let gpu_kernels = if time && timestamps && !moegrad::profile::is_enabled() {
        let recording = moegrad::profile::start();
        {
            let _step = moegrad::profile::step();
            stepper.step(step + 1)?;
        }
        recording
            .finish()
            .and_then(|r| r.gpu)
            .filter(|g| g.timestamps)
            .map(|g| g.kernels)
    } else {
        None
    };
    let gpu_ms = gpu_kernels
        .as_ref()
        .map(|k| k.iter().filter_map(|k| k.ms).sum());
    let host_ms = if time {
        Some(host_times(stepper.as_mut(), step + 2, &gpu)?)
    } else {
        None
    };
    Ok(StepFigures {
        stats: counted,
        gpu_ms,
        gpu_kernels: gpu_kernels.unwrap_or_default(),
        host_ms,
        peak_bytes,
        activation_bytes,
    })
}

/// The least host milliseconds to record and submit a step (from an idle device until the
/// flush returns) over [`HOST_ROUNDS`] steps with bind groups reused, and over as many with them
/// created per dispatch, alternating ([`super::op_cost::least_time_each_way`]); each timed step
/// follows an untimed one that fills the cache again after a round without it. Steps are
/// numbered from `first`.
fn host_times(stepper: &mut dyn Stepper, first: u64, gpu: &Device) -> Result<(f64, f64)> {
    let mut step = first;
    super::op_cost::least_time_each_way(HOST_ROUNDS, || {
        stepper.step(step)?;
        gpu.synchronize()?;
        let t = std::time::Instant::now();
        stepper.step(step + 1)?;
        moegrad::gpu::flush()?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        gpu.synchronize()?;
        step += 2;
        Ok(ms)
    })
}

/// `moegrad bench gpu-step` over `models` (names from [`GPU_STEP_MODELS`]).
///
/// # Errors
/// No GPU adapter, an unknown model, or an error of a step.
pub fn bench_gpu_step(models: &[&str]) -> Result<GpuStepBench> {
    gpu()?;
    for m in models {
        step_config(m)?;
    }
    let mut out = GpuStepBench {
        gpu_step: Vec::new(),
        skipped: Vec::new(),
    };
    let mut precisions = vec![Precision::F32];
    match Precision::F16Mixed.check(Device::Gpu) {
        Ok(()) => precisions.push(Precision::F16Mixed),
        Err(e) => out.skipped.push(format!("f16-mixed: {e}")),
    }
    for &m in models {
        for &precision in &precisions {
            let cfg = TrainConfig {
                precision,
                ..step_config(m)?
            };
            let f = measure(cfg, true)?;
            let s = f.stats;
            out.gpu_step.push(GpuStepRecord {
                model: m.to_string(),
                precision: precision.name().to_string(),
                dispatches: s.dispatches,
                submits: s.submits,
                host_waits: s.host_waits,
                buffers_created: s.buffers_created,
                bind_groups_created: s.bind_groups_created,
                uploaded_bytes: s.uploaded_bytes,
                downloaded_bytes: s.downloaded_bytes,
                bound_bytes: s.bound_bytes,
                activation_bytes: f.activation_bytes,
                peak_bytes: f.peak_bytes,
                gpu_ms: f.gpu_ms,
                gpu_kernels: f.gpu_kernels,
                host_ms: f.host_ms.map(|h| h.0),
                host_ms_creating_bind_groups: f.host_ms.map(|h| h.1),
            });
        }
    }
    Ok(out)
}
