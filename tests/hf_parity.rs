//! Parity with Hugging Face transformers, without Python: `scripts/make_hf_fixtures.py` wrote tiny
//! random models of each family transformers defines (`tests/fixtures/hf/<family>/`: config.json,
//! model.safetensors, and for the MoE families `stacked/model.safetensors`, the same weights in
//! transformers v5's stacked-expert layout) with transformers' logits for fixed ids. Each is
//! imported with `moegrad::lm::import_hf` and must give those logits to 1e-4 (max absolute, f32)
//! on the CPU and, when there is an adapter, on the GPU.
//!
//! The fixtures' settings are awkward on purpose: grouped-query and multi-query attention, odd
//! widths, tied and untied embeddings, `norm_topk_prob` both ways, a gated shared expert, q/k/v
//! biases, q/k RMSNorm, a dense layer among MoE layers, non-default `rope_theta`, and DeepSeek-V3's
//! sigmoid group-limited routing with a nonzero correction bias, a low-rank query and latent
//! attention with values wider than the query/key heads and interleaved rotary columns.

mod common;

use moegrad::lm::import_hf;
use moegrad::{Device, Tensor};
use serde_json::Value;
use std::path::{Path, PathBuf};

use common::{HF_FIXTURES as FAMILIES, hf_fixture as fixture};

/// The fixture's ids `[B, T]` and transformers' logits `[B·T·V]`.
fn expected(dir: &Path) -> (Vec<i32>, [usize; 2], Vec<f64>) {
    let json: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let ids: Vec<Vec<i64>> = serde_json::from_value(json["ids"].clone()).unwrap();
    let shape = [ids.len(), ids[0].len()];
    let flat = ids.into_iter().flatten().map(|v| v as i32).collect();
    let logits: Vec<f64> = serde_json::from_value(json["logits"].clone()).unwrap();
    (flat, shape, logits)
}

/// The worst absolute difference between the imported model's logits and transformers'.
fn max_error(dir: &Path, weights_dir: &Path, device: Device) -> f64 {
    let (ids, shape, want) = expected(dir);
    let imported =
        import_hf(weights_dir, device).unwrap_or_else(|e| panic!("{}: {e}", weights_dir.display()));
    let idx = Tensor::from_i32(ids, &shape, device).unwrap();
    let got = moegrad::no_grad(|| imported.model.forward(&idx))
        .unwrap()
        .logits
        .to_vec_f64()
        .unwrap();
    assert_eq!(got.len(), want.len(), "{}: logits count", dir.display());
    got.iter()
        .zip(&want)
        .map(|(g, w)| (g - w).abs())
        .fold(0.0, f64::max)
}

/// A directory holding the fixture's config.json and its stacked-layout weights.
fn stacked_copy(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("moegrad-hf-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = fixture(name);
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    std::fs::copy(
        src.join("stacked/model.safetensors"),
        dir.join("model.safetensors"),
    )
    .unwrap();
    dir
}

fn check_all(device: Device) {
    for name in FAMILIES {
        let dir = fixture(name);
        let err = max_error(&dir, &dir, device);
        println!("{name} on {device}: max |logit − transformers| = {err:.2e}");
        assert!(err < 1e-4, "{name} on {device}: logits differ by {err}");
        if dir.join("stacked").is_dir() {
            let copy = stacked_copy(name);
            let err = max_error(&dir, &copy, device);
            std::fs::remove_dir_all(&copy).ok();
            println!("{name} (stacked experts) on {device}: {err:.2e}");
            assert!(
                err < 1e-4,
                "{name} stacked on {device}: logits differ by {err}"
            );
        }
    }
}

#[test]
fn imported_models_give_transformers_logits_on_the_cpu() {
    check_all(Device::cpu());
}

#[test]
fn imported_models_give_transformers_logits_on_the_gpu() {
    if let Some(gpu) = common::gpu_or_skip("hf parity on the GPU") {
        check_all(gpu);
    }
}
