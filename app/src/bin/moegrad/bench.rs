//! `moegrad bench`: the workloads ([`Workload`]), their flags ([`BenchArgs`]) and the tables
//! they print (docs/benchmarks.md).

use super::*;

/// `moegrad bench` options.
#[derive(clap::Args)]
pub(super) struct BenchArgs {
    /// Which workload.
    #[arg(value_enum)]
    pub(super) workload: Workload,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub(super) json: bool,
    /// Devices to measure: auto (CPU, plus the GPU when there is one), cpu or gpu.
    #[arg(long, default_value = "auto")]
    pub(super) device: String,
    /// Square matrix sizes for the matmul workload, separated by spaces or commas
    /// (`--sizes 512 1024` or `--sizes 512,1024`).
    #[arg(long, num_args = 1.., value_delimiter = ',', default_values_t = vec![256, 512, 1024])]
    pub(super) sizes: Vec<usize>,
    /// Tokens per step for the moe workload.
    #[arg(long, default_value_t = 4096)]
    pub(super) tokens: usize,
    /// moe workload: the numbers of experts the top-k router is measured over, separated by
    /// spaces or commas.
    #[arg(long, num_args = 0.., value_delimiter = ',', default_values_t = MOE_BENCH_EXPERTS.0.to_vec())]
    pub(super) experts: Vec<usize>,
    /// moe workload: the numbers of experts the dense softmax router is measured over (both
    /// paths); the flag alone, with no number, measures none.
    #[arg(long, num_args = 0.., value_delimiter = ',', default_values_t = MOE_BENCH_EXPERTS.1.to_vec())]
    pub(super) dense_experts: Vec<usize>,
    /// train workload: use only the first N training examples (0: all 8,000 of the bundled
    /// MNIST subset).
    #[arg(long, default_value_t = 0)]
    pub(super) examples: usize,
    /// train workload: examples per step.
    #[arg(long, default_value_t = 64)]
    pub(super) batch: usize,
    /// train workload: directory with the MNIST IDX files [default: the bundled copy].
    #[arg(long, default_value = moegrad::data::bundled::BUNDLED_DIR, hide_default_value = true)]
    pub(super) data_dir: PathBuf,
}

#[derive(Clone, Copy, ValueEnum)]
pub(super) enum Workload {
    /// f32 matmul GFLOP/s and per-op overhead, per device
    Matmul,
    /// one MoE layer's training step (T = 4096, d = 256, hidden 512, k = 2) for n = 2..64, and the dense softmax router
    Moe,
    /// one training epoch (training time only: no data loading, no evaluation) of cnn (mnist), moe-mlp (mnist, topk, 8 experts, k = 2) and mmoe-cnn (multimnist, topk, 8 experts, k = 4)
    Train,
    /// what one steady-state training step of moe-mlp, cnn, gpt and moe-gpt asks of the GPU:
    /// dispatches, submissions, host waits, buffers created, bytes moved (any adapter,
    /// lavapipe included)
    GpuStep,
    /// every benchmark (matmul, moe, gpu-step, train) in one JSON report (docs/gpu.md)
    All,
}

/// The expert counts `bench moe` measures: top-k over the first list, the dense softmax router
/// over the second.
const MOE_BENCH_EXPERTS: (&[usize], &[usize]) = (&[2, 4, 8, 16, 32, 64], &[2, 8, 64]);

/// The MoE benchmark's workload for `--tokens`.
fn moe_workload(tokens: usize) -> Result<moegrad_cli::bench::MoeWorkload> {
    if tokens == 0 {
        return Err(moegrad::Error::Invalid(
            "--tokens must be at least 1".into(),
        ));
    }
    Ok(moegrad_cli::bench::MoeWorkload {
        tokens,
        d: 256,
        hidden: 512,
        k: 2,
    })
}

/// Checks `--experts` and `--dense-experts` of the MoE benchmark.
fn check_experts(experts: &[usize], dense: &[usize]) -> Result<()> {
    if experts.contains(&0) || dense.contains(&0) {
        return Err(moegrad::Error::Invalid(format!(
            "--experts {experts:?} --dense-experts {dense:?}: every number of experts must be at \
             least 1"
        )));
    }
    if experts.is_empty() && dense.is_empty() {
        return Err(moegrad::Error::Invalid(
            "--experts and --dense-experts are both empty: nothing to measure".into(),
        ));
    }
    Ok(())
}

/// Checks `--sizes` of the matmul benchmark.
fn check_sizes(sizes: &[usize]) -> Result<()> {
    if sizes.is_empty() || sizes.contains(&0) {
        return Err(moegrad::Error::Invalid(format!(
            "--sizes {sizes:?}: every size must be at least 1"
        )));
    }
    Ok(())
}

fn bench_devices(name: &str) -> Result<Vec<Device>> {
    Ok(match name {
        "cpu" => vec![Device::cpu()],
        "gpu" => vec![Device::gpu()?],
        "auto" => {
            let mut v = vec![Device::cpu()];
            // the GPU when `auto` would train on it (a software adapter is not timed)
            match Device::choose() {
                Ok((Device::Gpu, _)) => v.push(Device::Gpu),
                Ok((_, why)) => eprintln!("moegrad: GPU not measured: {why}"),
                Err(e) => eprintln!("moegrad: GPU not measured: {e}"),
            }
            v
        }
        other => {
            return Err(moegrad::Error::Invalid(format!(
                "--device {other:?}: expected auto, cpu or gpu"
            )));
        }
    })
}

/// Runs `moegrad bench WORKLOAD` and prints its figures (a table, or JSON with `--json`).
pub(super) fn run_bench(args: BenchArgs) -> Result<()> {
    let BenchArgs {
        workload,
        json,
        device,
        sizes,
        tokens,
        experts,
        dense_experts,
        examples,
        batch,
        data_dir,
    } = args;
    match workload {
        Workload::Moe => {
            let w = moe_workload(tokens)?;
            check_experts(&experts, &dense_experts)?;
            let r = moegrad_cli::bench::bench_moe(
                &bench_devices(&device)?,
                &experts,
                &dense_experts,
                w,
            )?;
            if json {
                print_json(&r)?;
            } else {
                println!("{}", r.workload);
                println!(
                    "{:<6} {:<8} {:<11} {:>4} {:>4} {:>10} {:>8} {:>8} {:>8} {:>12} {:>12} {:>8} {:>14} {:>10}",
                    "device",
                    "router",
                    "path",
                    "n",
                    "k",
                    "step ms",
                    "fwd ms",
                    "bwd ms",
                    "adam ms",
                    "tokens/s",
                    "peak MB",
                    "grad MB",
                    "activation MB",
                    "dispatches"
                );
                for m in &r.moe {
                    println!(
                        "{:<6} {:<8} {:<11} {:>4} {:>4} {:>10.1} {:>8.1} {:>8.1} {:>8.1} {:>12.0} {:>12.1} {:>8.1} {:>14.1} {:>10}",
                        m.device,
                        m.router,
                        m.path,
                        m.n,
                        m.k,
                        m.step_ms,
                        m.forward_ms,
                        m.backward_ms,
                        m.optimizer_ms,
                        m.tokens_per_s,
                        m.peak_bytes as f64 / 1e6,
                        m.gradient_bytes as f64 / 1e6,
                        m.activation_bytes as f64 / 1e6,
                        m.dispatches.map_or("-".into(), |d| d.to_string())
                    );
                }
                for s in &r.skipped {
                    println!(
                        "{:<6} {:<8} {:<11} {:>4} {:>4} not run: {}",
                        s.device, s.router, s.path, s.n, s.k, s.reason
                    );
                }
            }
        }
        Workload::Train => {
            let r = moegrad_cli::bench::bench_train(
                &bench_devices(&device)?,
                &data_dir,
                examples,
                batch,
            )?;
            if json {
                print_json(&r)?;
            } else {
                println!(
                    "{:<6} {:<9} {:>6} {:>9} {:>9} {:>10} {:>11}",
                    "device", "model", "batch", "examples", "seconds", "ms/step", "examples/s"
                );
                for t in &r.train {
                    let steps = t.examples.div_ceil(t.batch.max(1)).max(1);
                    println!(
                        "{:<6} {:<9} {:>6} {:>9} {:>9.2} {:>10.1} {:>11.0}",
                        t.device,
                        t.model,
                        t.batch,
                        t.examples,
                        t.seconds,
                        1e3 * t.seconds / steps as f64,
                        t.examples as f64 / t.seconds.max(1e-9)
                    );
                }
            }
        }
        Workload::Matmul => {
            check_sizes(&sizes)?;
            let r = moegrad_cli::bench::bench_matmul(&bench_devices(&device)?, &sizes)?;
            if json {
                print_json(&r)?;
            } else {
                println!("{:<8} {:>6} {:>10}", "device", "size", "GFLOP/s");
                for m in &r.matmul {
                    println!("{:<8} {:>6} {:>10.1}", m.device, m.size, m.gflops);
                }
                if let Some(kernel) = &r.gpu_kernel {
                    println!("gpu      matmul kernel: {kernel}");
                }
                for t in &r.gpu_tuned {
                    let times: Vec<String> =
                        t.ms.iter()
                            .map(|(k, ms)| format!("{} {ms:.3} ms", k.name()))
                            .collect();
                    println!(
                        "gpu      tuned at {}: {} ({})",
                        t.product[1],
                        t.kernel.name(),
                        times.join(", ")
                    );
                }
                for o in &r.op_overhead_us {
                    println!("{:<8} per-op overhead {:>8.2} µs", o.device, o.us);
                    if let (Some(reused), Some(created)) =
                        (o.record_us, o.record_us_creating_bind_groups)
                    {
                        println!(
                            "{:<8} host time to record an op {reused:>8.2} µs ({created:.2} µs creating its bind group)",
                            o.device
                        );
                    }
                }
            }
        }
        Workload::GpuStep => {
            if device != "auto" && device != "gpu" {
                return Err(moegrad::Error::Invalid(format!(
                    "bench gpu-step counts GPU work: --device {device} does not apply (use gpu or leave it out)"
                )));
            }
            let r = moegrad_cli::bench::gpu_step::bench_gpu_step(
                &moegrad_cli::bench::gpu_step::GPU_STEP_MODELS,
            )?;
            if json {
                print_json(&r)?;
            } else {
                println!(
                    "{:<8} {:<9} {:>10} {:>8} {:>10} {:>15} {:>11} {:>14} {:>16} {:>10} {:>8} {:>8} {:>10} {:>8} {:>17}",
                    "model",
                    "precision",
                    "dispatches",
                    "submits",
                    "host waits",
                    "buffers created",
                    "bind groups",
                    "uploaded bytes",
                    "downloaded bytes",
                    "bound MB",
                    "act MB",
                    "peak MB",
                    "GPU ms",
                    "host ms",
                    "host ms, no reuse"
                );
                let mb = |b: u64| format!("{:.1}", b as f64 / 1e6);
                let ms = |t: Option<f64>| t.map_or("-".to_string(), |ms| format!("{ms:.2}"));
                for m in &r.gpu_step {
                    println!(
                        "{:<8} {:<9} {:>10} {:>8} {:>10} {:>15} {:>11} {:>14} {:>16} {:>10} {:>8} {:>8} {:>10} {:>8} {:>17}",
                        m.model,
                        m.precision,
                        m.dispatches,
                        m.submits,
                        m.host_waits,
                        m.buffers_created,
                        m.bind_groups_created,
                        m.uploaded_bytes,
                        m.downloaded_bytes,
                        mb(m.bound_bytes),
                        mb(m.activation_bytes),
                        mb(m.peak_bytes),
                        ms(m.gpu_ms),
                        ms(m.host_ms),
                        ms(m.host_ms_creating_bind_groups)
                    );
                }
                // where each step's GPU time goes: its five longest kernels
                for m in r.gpu_step.iter().filter(|m| !m.gpu_kernels.is_empty()) {
                    let top: Vec<String> = m
                        .gpu_kernels
                        .iter()
                        .take(5)
                        .map(|k| format!("{} {} ({}×)", k.kernel, ms(k.ms), k.calls))
                        .collect();
                    println!(
                        "{} {}, longest kernels (ms): {}",
                        m.model,
                        m.precision,
                        top.join(", ")
                    );
                }
                for s in &r.skipped {
                    println!("not measured: {s}");
                }
            }
        }
        Workload::All => {
            check_sizes(&sizes)?;
            let w = moe_workload(tokens)?;
            let r = moegrad_cli::bench::bench_all(
                &bench_devices(&device)?,
                &sizes,
                MOE_BENCH_EXPERTS.0,
                MOE_BENCH_EXPERTS.1,
                w,
                (&data_dir, examples, batch),
            )?;
            if json {
                print_json(&r)?;
            } else {
                // one report, meant to be saved and sent: the text form is the same JSON,
                // indented
                let text = serde_json::to_string_pretty(&r)
                    .map_err(|e| moegrad::Error::Invalid(e.to_string()))?;
                println!("{text}");
            }
        }
    }
    Ok(())
}
