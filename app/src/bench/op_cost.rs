//! The fixed cost of one op, apart from its arithmetic: `bench matmul`'s `op_overhead_us`
//! (wall time per tiny `add`, submissions and the device's work included) and, on the GPU, the
//! host's time to record one into the pending batch with bind groups reused and created
//! (`record_us`, see `backend/gpu/bind_group_cache.rs` in the library).

use super::time_per_call;
use moegrad::{DType, Device, Result, Tensor};
use std::time::{Duration, Instant};

/// Microseconds per `add` of two 64-element f32 tensors (launch and bookkeeping cost).
pub fn op_overhead_us(device: Device) -> Result<f64> {
    let a = Tensor::full(&[64], 1.0, DType::F32, device)?;
    let b = Tensor::full(&[64], 2.0, DType::F32, device)?;
    let secs = time_per_call(device, 200, Duration::from_millis(300), || {
        a.add(&b).map(drop)
    })?;
    Ok(secs * 1e6)
}

/// Adds in each chain [`gpu_record_us`] times: fewer than a batch's 256 dispatches, so that
/// nothing is submitted while the clock runs.
pub const RECORD_CHAIN: usize = 200;

/// Host microseconds to record one `add` of two 64-element f32 tensors on the GPU, with bind
/// groups reused and with one created per dispatch: chains of [`RECORD_CHAIN`] adds, each timed
/// from an idle device to the last add recorded (no submission inside), after three untimed
/// chains that settle the pool's buffers; the least of 8 per setting, alternating
/// ([`least_time_each_way`]).
///
/// # Errors
/// No GPU adapter, or an error of an add.
pub fn gpu_record_us(device: Device) -> Result<(f64, f64)> {
    let a = Tensor::full(&[64], 1.0, DType::F32, device)?;
    let b = Tensor::full(&[64], 2.0, DType::F32, device)?;
    let chain = || -> Result<Tensor> {
        let mut x = a.clone();
        for _ in 0..RECORD_CHAIN {
            x = x.add(&b)?;
        }
        Ok(x)
    };
    least_time_each_way(8, || {
        // chains that settle the pool's buffers (and fill the cache when reusing)
        for _ in 0..3 {
            chain()?;
            device.synchronize()?;
        }
        let t = Instant::now();
        let x = chain()?;
        let us = t.elapsed().as_secs_f64() * 1e6 / RECORD_CHAIN as f64;
        device.synchronize()?;
        drop(x);
        Ok(us)
    })
}

/// The least of `rounds` values of `timed` with bind groups reused and the least of as many with
/// them created per dispatch, the two settings alternating round by round; the setting in force
/// before is restored, also on an error. `timed` settles and times one measurement.
///
/// # Errors
/// No GPU adapter, or an error of `timed`.
pub fn least_time_each_way(
    rounds: usize,
    mut timed: impl FnMut() -> Result<f64>,
) -> Result<(f64, f64)> {
    let before = moegrad::gpu::bind_group_reuse()?;
    let mut best = [f64::INFINITY; 2];
    let mut measure = || -> Result<()> {
        for _ in 0..rounds {
            for (i, reuse) in [true, false].into_iter().enumerate() {
                moegrad::gpu::set_bind_group_reuse(reuse)?;
                best[i] = best[i].min(timed()?);
            }
        }
        Ok(())
    };
    let outcome = measure();
    moegrad::gpu::set_bind_group_reuse(before)?;
    outcome.map(|()| (best[0], best[1]))
}
