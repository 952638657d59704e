//! Helpers of the f16 tests (`half_precision.rs`, `half_precision_matmul.rs`,
//! `half_precision_nn.rs`, `half_precision_products.rs`, `gpu_moe_combine.rs`): the GPU when it
//! has `shader-f16`, f16-valued random operands, the two f16 values around an f32, the check that
//! an f16 kernel rounded the f32 kernel's result once, and the kernels a closure ran.
//! Included with `#[path = "common/f16_checks.rs"] mod f16_checks;` after `mod common;`.
#![allow(dead_code)]

use crate::common;
use half::f16;
use moegrad::{DType, Device, Error, Tensor};
use rand::RngExt;
use rand_chacha::ChaCha8Rng;

/// The GPU when it has `shader-f16`; `None` (after checking that f16 is refused with a clear
/// error) when it has not, or when there is no adapter.
pub fn f16_gpu(test: &str) -> Option<Device> {
    let dev = common::gpu_or_skip(test)?;
    let features = moegrad::gpu::info().expect("adapter info").features;
    if features.iter().any(|f| f == "shader-f16") {
        return Some(dev);
    }
    let x = Tensor::from_f32(vec![1.0; 4], &[4], dev).unwrap();
    match x.to_dtype(DType::F16) {
        Err(Error::DType(m)) => assert!(m.contains("SHADER_F16"), "{m}"),
        other => panic!("{test}: f16 without shader-f16 gave {other:?}"),
    }
    eprintln!("skipping {test}: this adapter has no shader-f16 (refused with an error, checked)");
    None
}

/// The two f16 values around `x` (equal when f16 holds `x`), as f32.
pub fn f16_neighbours(x: f32) -> (f32, f32) {
    let nearest = f16::from_f32(x);
    let r = nearest.to_f32();
    if r == x || !x.is_finite() || !r.is_finite() {
        return (r, r);
    }
    // the neighbour on the other side of x
    let bits = nearest.to_bits();
    let toward_x = if (x > r) == (r >= 0.0) {
        bits + 1
    } else if bits & 0x7fff == 0 {
        // ±0: the other side is the smallest subnormal of the opposite sign
        (bits ^ 0x8000) + 1
    } else {
        bits - 1
    };
    (r, f16::from_bits(toward_x).to_f32())
}

/// Random values rounded to f16, as f32.
pub fn f16_values(n: usize, rng: &mut ChaCha8Rng) -> Vec<f32> {
    (0..n)
        .map(|_| f16::from_f32(rng.random_range(-2.0f32..2.0)).to_f32())
        .collect()
}

/// The GPU kernels one closure ran, by `shader.entry` name (from a profile).
pub fn kernels_run(f: impl FnOnce()) -> Vec<String> {
    let recording = moegrad::profile::start();
    f();
    let report = recording.finish().expect("a profile");
    report
        .gpu
        .map(|g| g.kernels.into_iter().map(|k| k.kernel).collect())
        .unwrap_or_default()
}

/// `got` (an f16 kernel's output, as f32) is a neighbouring f16 of `want` (the exact value, or
/// the f32 kernel's output for the same operands) at every element: ±inf where `want` is past
/// the largest f16, NaN where it is NaN.
pub fn assert_rounded_once(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if w.is_nan() {
            assert!(g.is_nan(), "{what}[{i}]: {g}, the f32 kernel NaN");
            continue;
        }
        if w.abs() >= 65520.0 {
            assert_eq!(
                g,
                w.signum() * f32::INFINITY,
                "{what}[{i}]: {w} past the largest f16"
            );
            continue;
        }
        let (near, other) = f16_neighbours(w);
        assert!(
            g == near || g == other,
            "{what}[{i}]: {g}, not an f16 neighbour of the f32 kernel's {w}"
        );
    }
}
