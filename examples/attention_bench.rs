//! Times causal self-attention on the CPU, forward + backward in f32: the fused op
//! (`Tensor::causal_attention`) against the same attention composed from existing ops (matmul,
//! masked softmax, matmul), at the nanoGPT "baby" shape (B = 12, H = 4, T = 64, Dh = 32) and at
//! longer and narrower ones. Prints the median milliseconds of each. With the argument `gpu` the
//! same runs happen on the GPU (waiting for the device before the clock is read).
//!
//! `cargo run --release --example attention_bench [gpu]`

use moegrad::{DType, Device, Result, Tensor};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::time::Instant;

fn random(shape: &[usize], rng: &mut ChaCha8Rng, dev: Device) -> Result<Tensor> {
    let n = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    Tensor::from_f32(v, shape, dev)
}

fn composed(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let dh = q.shape()[3] as f64;
    q.matmul(&k.transpose(-1, -2)?)?
        .mul_scalar(1.0 / dh.sqrt())?
        .masked_fill(mask, f64::NEG_INFINITY)?
        .softmax(-1)?
        .matmul(v)
}

/// Median milliseconds of one forward + backward of `f` over `reps` runs after a warm-up.
fn time(reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..3 {
        f()?;
    }
    let mut ms: Vec<f64> = (0..reps)
        .map(|_| {
            let t0 = Instant::now();
            f().map(|()| t0.elapsed().as_secs_f64() * 1e3)
        })
        .collect::<Result<_>>()?;
    ms.sort_by(f64::total_cmp);
    Ok(ms[reps / 2])
}

fn main() -> Result<()> {
    let dev = if std::env::args().any(|a| a == "gpu") {
        Device::gpu()?
    } else {
        Device::cpu()
    };
    println!(
        "device: {dev}, CPU threads: {}",
        rayon::current_num_threads()
    );
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    for shape in [
        [12, 4, 64, 32],
        [12, 4, 256, 32],
        [2, 4, 256, 32],
        [1, 1, 512, 64],
    ] {
        let t = shape[2];
        let [q, k, v] =
            [0, 1, 2].map(|_| random(&shape, &mut rng, dev).and_then(|x| x.with_grad()));
        let (q, k, v) = (q?, k?, v?);
        let up = random(&shape, &mut rng, dev)?;
        let future: Vec<f32> = (0..t * t)
            .map(|ij| if ij % t > ij / t { 1.0 } else { 0.0 })
            .collect();
        let mask = Tensor::from_f32(future, &[t, t], dev)?.to_dtype(DType::F32)?;
        let reps = if t > 128 { 21 } else { 101 };
        let fused = time(reps, || {
            q.causal_attention(&k, &v)?.backward_with(&up)?;
            dev.synchronize()
        })?;
        let fused_fwd = time(reps, || {
            moegrad::no_grad(|| q.causal_attention(&k, &v))?;
            dev.synchronize()
        })?;
        let reference = time(reps, || {
            composed(&q, &k, &v, &mask)?.backward_with(&up)?;
            dev.synchronize()
        })?;
        println!(
            "{shape:?}: fused fwd+bwd {fused:.3} ms (fwd {fused_fwd:.3} ms), composed fwd+bwd \
             {reference:.3} ms, speed-up {:.1}x",
            reference / fused
        );
    }
    Ok(())
}
