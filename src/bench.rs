//! Benchmarks behind `moegrad bench`: measured workloads that return plain, serialisable records.
//! Timing is wall-clock around a loop, after a warm-up, with the device synchronised before the
//! clock is read; figures are recorded in `docs/benchmarks.md` with the command that made them.

use crate::{DType, Device, Result, Tensor};
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
    let n = shape.iter().product();
    Tensor::from_f32(
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect(),
        shape,
        device,
    )
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

/// Microseconds per `add` of two 64-element f32 tensors (launch and bookkeeping cost).
pub fn op_overhead_us(device: Device) -> Result<f64> {
    let a = Tensor::full(&[64], 1.0, DType::F32, device)?;
    let b = Tensor::full(&[64], 2.0, DType::F32, device)?;
    let secs = time_per_call(device, 200, Duration::from_millis(300), || {
        a.add(&b).map(drop)
    })?;
    Ok(secs * 1e6)
}

/// `moegrad bench matmul` on every given device and size.
pub fn bench_matmul(devices: &[Device], sizes: &[usize]) -> Result<MatmulBench> {
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
        out.op_overhead_us.push(OverheadRecord {
            device: d.to_string(),
            us: op_overhead_us(d)?,
        });
    }
    Ok(out)
}
