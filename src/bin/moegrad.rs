//! The `moegrad` command line: `info` (device report) and `bench` (measured workloads).
//! Every error is printed as one line on stderr with a non-zero exit status.

use clap::{Parser, Subcommand, ValueEnum};
use moegrad::{Device, Result};
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "moegrad", version, about = "Tape-based autodiff on wgpu for Mixture-of-Experts training")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the device moegrad would use, the GPU adapter, its limits and optional features.
    Info {
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Run a benchmark and print its figures.
    Bench {
        /// Which workload.
        #[arg(value_enum)]
        workload: Workload,
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
        /// Devices to measure: auto (CPU, plus the GPU when there is one), cpu or gpu.
        #[arg(long, default_value = "auto")]
        device: String,
        /// Square matrix sizes for the matmul workload.
        #[arg(long, value_delimiter = ',', default_values_t = vec![256, 512, 1024])]
        sizes: Vec<usize>,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum Workload {
    /// f32 matmul GFLOP/s and per-op overhead, per device
    Matmul,
}

fn bench_devices(name: &str) -> Result<Vec<Device>> {
    Ok(match name {
        "cpu" => vec![Device::cpu()],
        "gpu" => vec![Device::gpu()?],
        "auto" => {
            let mut v = vec![Device::cpu()];
            match Device::gpu() {
                Ok(g) => v.push(g),
                Err(e) => eprintln!("moegrad: GPU not measured: {e}"),
            }
            v
        }
        other => return Err(moegrad::Error::Invalid(format!("--device {other:?}: expected auto, cpu or gpu"))),
    })
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Info { json } => {
            let r = moegrad::info::device_report()?;
            if json {
                println!("{}", serde_json::to_string_pretty(&r).map_err(|e| moegrad::Error::Invalid(e.to_string()))?);
            } else {
                println!("device:      {}  ({})", r.device, r.reason);
                match (&r.gpu, &r.gpu_error) {
                    (Some(g), _) => {
                        println!("gpu adapter: {} ({}, {}, driver {})", g.name, g.backend, g.device_type, g.driver);
                        println!("gpu limits:");
                        for (k, v) in &g.limits {
                            println!("  {k:<40} {v}");
                        }
                        println!("gpu optional features: {}", if g.features.is_empty() { "none".into() } else { g.features.join(", ") });
                    }
                    (None, Some(e)) => println!("gpu adapter: none ({e})"),
                    (None, None) => println!("gpu adapter: none"),
                }
                println!("cpu:         {} threads, matmul by {}", r.cpu_threads, r.cpu_gemm);
            }
        }
        Command::Bench { workload: Workload::Matmul, json, device, sizes } => {
            if sizes.is_empty() || sizes.contains(&0) {
                return Err(moegrad::Error::Invalid(format!("--sizes {sizes:?}: every size must be at least 1")));
            }
            let r = moegrad::bench::bench_matmul(&bench_devices(&device)?, &sizes)?;
            if json {
                println!("{}", serde_json::to_string(&r).map_err(|e| moegrad::Error::Invalid(e.to_string()))?);
            } else {
                println!("{:<8} {:>6} {:>10}", "device", "size", "GFLOP/s");
                for m in &r.matmul {
                    println!("{:<8} {:>6} {:>10.1}", m.device, m.size, m.gflops);
                }
                for o in &r.op_overhead_us {
                    println!("{:<8} per-op overhead {:>8.2} µs", o.device, o.us);
                }
            }
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("moegrad: {e}");
            ExitCode::FAILURE
        }
    }
}
