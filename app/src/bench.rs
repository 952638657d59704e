//! Benchmarks behind `moegrad bench`: measured workloads that return plain, serialisable records.
//! Timing is wall-clock around a loop, after a warm-up, with the device synchronised before the
//! clock is read; figures are recorded in `docs/benchmarks.md` with the command that made them.
//! `bench train` is the exception: one whole training epoch, timed from its first step, as the
//! PyTorch peer times it (`pytorch_cnn_epoch.py`). `bench gpu-step` counts instead of timing
//! ([`gpu_step`]), and `bench all` ([`bench_all`]) runs every benchmark into one report
//! (docs/gpu.md explains its fields).

pub mod gpu_step;
pub mod moe;
pub mod op_cost;

pub use moe::{
    GPU_WARMUP_STEPS, MoeBench, MoeRecord, MoeSkipped, MoeStepTimes, MoeWorkload, bench_moe,
    moe_step,
};
pub use op_cost::{RECORD_CHAIN, gpu_record_us, op_overhead_us};

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
    /// on the GPU: the GPU matmul's kernel choice ([`moegrad::gpu::MatmulKernel`]), and what
    /// `tuned` timed and chose for the products measured (empty under another choice)
    pub gpu_kernel: Option<String>,
    /// the size classes `tuned` timed, each candidate's milliseconds and its choice
    pub gpu_tuned: Vec<moegrad::gpu::TunedMatmul>,
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
        gpu_kernel: None,
        gpu_tuned: Vec::new(),
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
        if d.is_gpu() {
            out.gpu_kernel = Some(moegrad::gpu::matmul_kernel()?.name().to_string());
            // the classes of the products timed here (n×n·n×n f32, no batch)
            out.gpu_tuned = moegrad::gpu::matmul_tuning()?
                .into_iter()
                .filter(|t| {
                    let [batch, m, k, n] = t.product;
                    batch == 1 && m == k && k == n && sizes.contains(&n)
                })
                .collect();
        }
    }
    Ok(out)
}

/// One GPU matmul measurement with a given kernel.
#[derive(Clone, Debug, Serialize)]
pub struct KernelRecord {
    /// "tuned", "auto", "plain", "wide", "wide-vec4" or "subgroup"
    /// ([`moegrad::gpu::MatmulKernel`])
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
        MatmulKernel::Tuned,
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
