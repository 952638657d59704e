//! Importing a Hugging Face transformers checkpoint into a moegrad language model: `config.json`
//! becomes a [`DecoderConfig`] (`llama`, `mixtral`, `qwen2_moe`, `olmoe`, `deepseek_v3`) or a
//! GPT's settings (`gpt2`, see `hf_config.rs`), `model.safetensors` (or the shards
//! `model.safetensors.index.json` lists) becomes its parameters (`hf_names.rs`, `hf_gpt2.rs`),
//! in either tensor layout transformers writes:
//!
//! * the per-expert names of the Hub's checkpoints and of `save_pretrained`
//!   (`model.layers.L.block_sparse_moe.experts.E.w1.weight` for Mixtral, with `w1` the gate,
//!   `w3` the up and `w2` the down projection; `model.layers.L.mlp.experts.E.gate_proj.weight`,
//!   `up_proj`, `down_proj` for Qwen2-MoE and OLMoE);
//! * transformers v5's stacked experts (`model.layers.L.mlp.experts.gate_up_proj` `[E, 2I, d]`,
//!   gate rows first, and `mlp.experts.down_proj` `[E, d, I]`).
//!
//! PyTorch's `Linear` stores `[out, in]`, moegrad's `[in, out]`: every matrix is transposed on the
//! way in, and the gate and up projections are placed side by side (`[d, 2I]`, gate first), as
//! moegrad's SwiGLU layers read them. A setting moegrad does not implement (rope scaling, an
//! activation other than SiLU, a sliding window shorter than the context, `clip_qkv`, biases on
//! the MLPs) is refused by name, and a missing, unexpected or mis-shaped tensor is refused naming
//! it, before any parameter is written.

use super::decoder::Decoder;
use super::decoder_config::{DecoderConfig, Family};
use super::gpt::Gpt;
use super::hf_config::{Architecture, architecture_from_hf};
use super::hf_names;
use super::language_model::LanguageModel;
use crate::nn::Parameters;
use crate::{Device, Error, Result, Tensor};
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// One tensor of the checkpoint, on the host in f32.
pub(super) struct HostTensor {
    pub(super) shape: Vec<usize>,
    pub(super) values: Vec<f32>,
}

/// A Hugging Face checkpoint read into a moegrad language model: the model, its `config.json`
/// and the `tokenizer.json` text when the directory has one.
pub struct HfImport {
    /// the model, with the checkpoint's parameters (a [`Decoder`], or a GPT for `gpt2`)
    pub model: LanguageModel,
    /// the `config.json` as read: the model's architecture (`TrainConfig::architecture`)
    pub config_json: Value,
    /// the directory's `tokenizer.json`, if any
    pub tokenizer_json: Option<String>,
}

/// Reads the transformers checkpoint in `dir` (see the module docs) onto `device`.
///
/// # Errors
/// A missing or malformed `config.json`, an unsupported `model_type` or setting (named), a
/// missing, unexpected or mis-shaped tensor (named), an unreadable safetensors file, or a model
/// that does not fit in memory.
pub fn import_hf(dir: &Path, device: Device) -> Result<HfImport> {
    let config_path = dir.join("config.json");
    let text = std::fs::read_to_string(&config_path)
        .map_err(|e| Error::Io(format!("{}: {e}", config_path.display())))?;
    let json: Value = serde_json::from_str(&text)
        .map_err(|e| Error::Io(format!("{}: not valid JSON: {e}", config_path.display())))?;
    let arch = architecture_from_hf(&json)
        .map_err(|e| Error::Invalid(format!("{}: {e}", config_path.display())))?;
    let model = match arch {
        Architecture::Decoder(cfg) => {
            // DeepSeek-V3 lays its rotary columns out in interleaved pairs unless told otherwise
            let interleaved = cfg.family == Family::DeepseekMoe
                && json
                    .get("rope_interleave")
                    .and_then(Value::as_bool)
                    .unwrap_or(true);
            cfg.check_memory(1)?;
            let tensors = read_checkpoint(dir)?;
            let model = Decoder::new(&cfg, device)?;
            load_weights(&model, &cfg, tensors, interleaved, device)?;
            LanguageModel::Decoder(Box::new(model))
        }
        Architecture::Gpt(cfg) => {
            cfg.check_memory(1)?;
            let tensors = read_checkpoint(dir)?;
            let model = Gpt::new(&cfg, device)?;
            super::hf_gpt2::load_weights(&model, tensors, device)?;
            LanguageModel::Gpt(model)
        }
    };
    let tokenizer_path = dir.join("tokenizer.json");
    let tokenizer_json = if tokenizer_path.is_file() {
        Some(
            std::fs::read_to_string(&tokenizer_path)
                .map_err(|e| Error::Io(format!("{}: {e}", tokenizer_path.display())))?,
        )
    } else {
        None
    };
    Ok(HfImport {
        model,
        config_json: json,
        tokenizer_json,
    })
}

/// Every tensor of `model.safetensors`, or of the shards `model.safetensors.index.json` lists.
fn read_checkpoint(dir: &Path) -> Result<BTreeMap<String, HostTensor>> {
    let single = dir.join("model.safetensors");
    let index = dir.join("model.safetensors.index.json");
    let files: Vec<std::path::PathBuf> = if single.is_file() {
        vec![single]
    } else if index.is_file() {
        let text = std::fs::read_to_string(&index)
            .map_err(|e| Error::Io(format!("{}: {e}", index.display())))?;
        let json: Value = serde_json::from_str(&text)
            .map_err(|e| Error::Io(format!("{}: not valid JSON: {e}", index.display())))?;
        let map = json
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| Error::Io(format!("{}: no weight_map object", index.display())))?;
        let names: BTreeSet<&str> = map.values().filter_map(Value::as_str).collect();
        names.into_iter().map(|n| dir.join(n)).collect()
    } else {
        return Err(Error::Io(format!(
            "{}: neither model.safetensors nor model.safetensors.index.json",
            dir.display()
        )));
    };
    let mut out = BTreeMap::new();
    for file in files {
        let size = std::fs::metadata(&file)
            .map_err(|e| Error::Io(format!("{}: {e}", file.display())))?
            .len();
        crate::memory::check_fits(
            &format!("{}: {size} bytes of weights", file.display()),
            size.checked_mul(3),
        )?;
        let bytes =
            std::fs::read(&file).map_err(|e| Error::Io(format!("{}: {e}", file.display())))?;
        let st = SafeTensors::deserialize(&bytes).map_err(|e| {
            Error::Io(format!(
                "{}: not a valid safetensors file: {e}",
                file.display()
            ))
        })?;
        for (name, view) in st.tensors() {
            let values = to_f32(view.dtype(), view.data()).ok_or_else(|| {
                Error::Io(format!(
                    "{}: tensor {name} has dtype {:?}; moegrad imports F32, F16 and BF16 weights",
                    file.display(),
                    view.dtype()
                ))
            })?;
            out.insert(
                name,
                HostTensor {
                    shape: view.shape().to_vec(),
                    values,
                },
            );
        }
    }
    Ok(out)
}

/// Little-endian F32, F16 or BF16 bytes as f32 (None for another dtype).
fn to_f32(dtype: Dtype, bytes: &[u8]) -> Option<Vec<f32>> {
    let halves = || {
        bytes
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
    };
    match dtype {
        Dtype::F32 => Some(
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        ),
        Dtype::BF16 => Some(halves().map(|h| f32::from_bits((h as u32) << 16)).collect()),
        Dtype::F16 => Some(halves().map(f16_to_f32).collect()),
        _ => None,
    }
}

/// IEEE half precision to single (exact: every f16 is an f32).
fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h >> 15) as u32) << 31;
    let exp = ((h >> 10) & 0x1f) as u32;
    let frac = (h & 0x3ff) as u32;
    match exp {
        // zero and the subnormals: frac · 2⁻²⁴
        0 => f32::from_bits(sign) + if sign == 0 { 1.0 } else { -1.0 } * frac as f32 / 16_777_216.0,
        // infinities and NaNs
        0x1f => f32::from_bits(sign | 0x7f80_0000 | (frac << 13)),
        _ => f32::from_bits(sign | ((exp + 127 - 15) << 23) | (frac << 13)),
    }
}

/// Writes every parameter of `model` from `tensors` (see `hf_names.rs` for the mapping); every
/// tensor of the checkpoint must be used, every parameter found, and every shape right.
fn load_weights(
    model: &Decoder,
    cfg: &DecoderConfig,
    tensors: BTreeMap<String, HostTensor>,
    interleaved: bool,
    device: Device,
) -> Result<()> {
    let mut source = hf_names::Source::new(tensors, cfg, interleaved);
    let mut values = Vec::new();
    for (name, p) in model.named_params() {
        let want = p.get().shape().to_vec();
        let (shape, v) = source.take(&name)?;
        if shape != want {
            return Err(Error::Io(format!(
                "the checkpoint gives {name} the shape {shape:?}, but the model its config describes needs {want:?}"
            )));
        }
        values.push((p, shape, v));
    }
    let mut biases = Vec::new();
    if cfg.family == Family::DeepseekMoe {
        for (scope, _) in model.moe_layers_named() {
            let (shape, v) = source.correction_bias(&scope)?;
            biases.push((format!("{scope}.router.e_score_correction_bias"), shape, v));
        }
    }
    source.check_all_used()?;
    for (p, shape, v) in values {
        p.set(Tensor::from_f32(v, &shape, device)?)?;
    }
    for (name, shape, v) in biases {
        model.load_state(&name, &Tensor::from_f32(v, &shape, device)?)?;
    }
    Ok(())
}
