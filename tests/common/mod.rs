//! Helpers shared by the integration tests: device selection with the CI rule (GPU tests skip
//! with a printed reason, unless `MOEGRAD_REQUIRE_GPU=1`, which turns a missing adapter into a
//! failure) and small tensor builders.
#![allow(dead_code)]

use moegrad::{Device, Tensor};

/// The GPU, or `None` (after printing why) when there is no adapter and the GPU is not required.
pub fn gpu_or_skip(test: &str) -> Option<Device> {
    match Device::gpu() {
        Ok(d) => Some(d),
        Err(e) => {
            if std::env::var("MOEGRAD_REQUIRE_GPU").as_deref() == Ok("1") {
                panic!("{test}: MOEGRAD_REQUIRE_GPU=1 but no GPU adapter: {e}");
            }
            eprintln!("skipping {test}: no GPU adapter ({e})");
            None
        }
    }
}

/// Every device available here: the CPU, and the GPU when there is one (see [`gpu_or_skip`]).
pub fn devices(test: &str) -> Vec<Device> {
    let mut v = vec![Device::cpu()];
    v.extend(gpu_or_skip(test));
    v
}

/// An f64 CPU tensor.
pub fn f64t(values: &[f64], shape: &[usize]) -> Tensor {
    Tensor::from_f64(values.to_vec(), shape, Device::cpu()).expect("valid test tensor")
}

/// Asserts two slices agree within `atol + rtol·|expected|`, naming the first bad element.
pub fn assert_close(what: &str, got: &[f64], expected: &[f64], atol: f64, rtol: f64) {
    assert_eq!(got.len(), expected.len(), "{what}: lengths differ");
    for (i, (g, e)) in got.iter().zip(expected).enumerate() {
        assert!(
            (g - e).abs() <= atol + rtol * e.abs() || (g.is_nan() && e.is_nan()),
            "{what}: element {i}: got {g}, expected {e} (atol {atol}, rtol {rtol})"
        );
    }
}
