//! Importing a Hugging Face transformers checkpoint into a [`Decoder`]: `config.json` becomes a
//! [`DecoderConfig`], `model.safetensors` (or the shards `model.safetensors.index.json` lists)
//! becomes its parameters, in either tensor layout transformers writes:
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
use super::decoder_config::{DecoderConfig, Family, LatentConfig, SparseLayers};
use super::hf_names;
use crate::moe::{MoeConfig, SharedExpertsConfig};
use crate::nn::{Activation, Parameters};
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

/// A Hugging Face checkpoint read into a [`Decoder`]: the model, and the `tokenizer.json` text
/// when the directory has one.
pub struct HfImport {
    /// the model, with the checkpoint's parameters
    pub model: Decoder,
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
    let cfg = config_from_hf(&json)
        .map_err(|e| Error::Invalid(format!("{}: {e}", config_path.display())))?;
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
        tokenizer_json,
    })
}

/// The config fields read as a number, a whole number or a flag; a missing field takes
/// `default` (None: required).
struct Fields<'a>(&'a Value);

impl Fields<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }
    fn usize(&self, key: &str, default: Option<usize>) -> Result<usize> {
        match self.get(key) {
            Some(v) => v
                .as_u64()
                .map(|n| n as usize)
                .ok_or_else(|| Error::Invalid(format!("{key} = {v} is not a whole number"))),
            None => default.ok_or_else(|| Error::Invalid(format!("{key} is missing"))),
        }
    }
    fn f64(&self, key: &str, default: f64) -> Result<f64> {
        match self.get(key) {
            Some(v) => v
                .as_f64()
                .ok_or_else(|| Error::Invalid(format!("{key} = {v} is not a number"))),
            None => Ok(default),
        }
    }
    fn bool(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            Some(v) => v
                .as_bool()
                .ok_or_else(|| Error::Invalid(format!("{key} = {v} is not true or false"))),
            None => Ok(default),
        }
    }
    /// Refuses `key` when set to anything but `allowed` values (or null).
    fn refuse_unless(&self, key: &str, allowed: &[Value], why: &str) -> Result<()> {
        match self.get(key) {
            Some(v) if !allowed.contains(v) => Err(Error::Invalid(format!(
                "{key} = {v} is not supported: {why}"
            ))),
            _ => Ok(()),
        }
    }
}

/// The [`DecoderConfig`] of a transformers `config.json`.
fn config_from_hf(json: &Value) -> Result<DecoderConfig> {
    let f = Fields(json);
    let model_type = json
        .get("model_type")
        .and_then(Value::as_str)
        .ok_or_else(|| Error::Invalid("model_type is missing".into()))?;
    let family = match model_type {
        "llama" => Family::Llama,
        "mixtral" => Family::Mixtral,
        "qwen2_moe" => Family::Qwen2Moe,
        "olmoe" => Family::Olmoe,
        "deepseek_v3" => Family::DeepseekMoe,
        other => {
            return Err(Error::Invalid(format!(
                "model_type {other:?} is not one moegrad imports (llama, mixtral, qwen2_moe, olmoe, deepseek_v3)"
            )));
        }
    };
    let vocab = f.usize("vocab_size", None)?;
    let mut cfg = DecoderConfig::baby(family, vocab);
    cfg.d_model = f.usize("hidden_size", None)?;
    cfg.layers = f.usize("num_hidden_layers", None)?;
    cfg.heads = f.usize("num_attention_heads", None)?;
    cfg.kv_heads = f.usize("num_key_value_heads", Some(cfg.heads))?;
    cfg.head_dim = f.usize("head_dim", Some(cfg.d_model / cfg.heads.max(1)))?;
    cfg.block = f.usize("max_position_embeddings", None)?;
    cfg.rms_eps = f.f64("rms_norm_eps", 1e-6)?;
    cfg.tie_embeddings = f.bool("tie_word_embeddings", false)?;
    // rope: transformers 5 nests it in rope_parameters, 4.x has rope_theta and rope_scaling
    let rope = json.get("rope_parameters").filter(|v| !v.is_null());
    let rope_type = rope
        .and_then(|r| r.get("rope_type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    if rope_type != "default" {
        return Err(Error::Invalid(format!(
            "rope_parameters.rope_type = {rope_type:?} is not supported: moegrad's rotary positions are the default (unscaled) kind"
        )));
    }
    f.refuse_unless(
        "rope_scaling",
        &[],
        "moegrad's rotary positions are unscaled",
    )?;
    cfg.rope_theta = match rope
        .and_then(|r| r.get("rope_theta"))
        .and_then(Value::as_f64)
    {
        Some(theta) => theta,
        None => f.f64("rope_theta", 10_000.0)?,
    };
    f.refuse_unless("hidden_act", &["silu".into()], "moegrad's SwiGLU uses SiLU")?;
    f.refuse_unless("mlp_bias", &[false.into()], "moegrad's MLPs have no bias")?;
    let expert_width = |key: &str| f.usize(key, None);
    let moe = |hidden: usize, experts_key: &str, router: &str, balance: f64| -> Result<MoeConfig> {
        let mut m = MoeConfig::new(cfg.d_model, hidden, f.usize(experts_key, None)?, 1);
        m.k = f.usize("num_experts_per_tok", None)?;
        m.router = router.into();
        m.activation = Activation::SwiGlu;
        m.expert_bias = false;
        m.gate_bias = false;
        m.balance_loss = f.f64("router_aux_loss_coef", balance)?;
        Ok(m)
    };
    let norm_topk = |default: bool| -> Result<&'static str> {
        Ok(if f.bool("norm_topk_prob", default)? {
            "topk"
        } else {
            "topk-unnorm"
        })
    };
    match family {
        Family::Llama => {
            f.refuse_unless(
                "attention_bias",
                &[false.into()],
                "moegrad's llama attention has no biases",
            )?;
            cfg.ffn_hidden = f.usize("intermediate_size", None)?;
        }
        Family::Mixtral => {
            if let Some(w) = f.get("sliding_window").and_then(Value::as_u64)
                && w > 0
                && (w as usize) < cfg.block
            {
                return Err(Error::Invalid(format!(
                    "sliding_window = {w} is not supported: moegrad attends over the whole context (max_position_embeddings {})",
                    cfg.block
                )));
            }
            cfg.moe = Some(moe(
                expert_width("intermediate_size")?,
                "num_local_experts",
                "topk",
                0.01,
            )?);
        }
        Family::Qwen2Moe => {
            if f.bool("use_sliding_window", false)? {
                return Err(Error::Invalid(
                    "use_sliding_window = true is not supported: moegrad attends over the whole context".into(),
                ));
            }
            cfg.ffn_hidden = f.usize("intermediate_size", None)?;
            cfg.qkv_bias = f.bool("qkv_bias", true)?;
            let mut m = moe(
                expert_width("moe_intermediate_size")?,
                "num_experts",
                norm_topk(false)?,
                0.001,
            )?;
            let shared = f.usize("shared_expert_intermediate_size", Some(0))?;
            if shared > 0 {
                m.shared = SharedExpertsConfig {
                    count: 1,
                    hidden: shared,
                    gate: true,
                };
            }
            cfg.moe = Some(m);
            let dense: Vec<usize> = match f.get("mlp_only_layers") {
                Some(Value::Array(items)) => items
                    .iter()
                    .map(|v| v.as_u64().map(|n| n as usize))
                    .collect::<Option<_>>()
                    .ok_or_else(|| {
                        Error::Invalid("mlp_only_layers is not a list of layer numbers".into())
                    })?,
                Some(v) => {
                    return Err(Error::Invalid(format!(
                        "mlp_only_layers = {v} is not a list"
                    )));
                }
                None => Vec::new(),
            };
            cfg.sparse_layers = SparseLayers {
                first_dense: 0,
                step: f.usize("decoder_sparse_step", Some(1))?,
                dense,
            };
        }
        Family::DeepseekMoe => {
            f.refuse_unless(
                "attention_bias",
                &[false.into()],
                "moegrad's latent attention has no biases",
            )?;
            cfg.ffn_hidden = f.usize("intermediate_size", None)?;
            let hidden = expert_width("moe_intermediate_size")?;
            let mut m = moe(hidden, "n_routed_experts", "deepseek-v3", 0.0)?;
            let options = [
                ("n_group", f.usize("n_group", Some(1))?.to_string()),
                ("topk_group", f.usize("topk_group", Some(1))?.to_string()),
                (
                    "norm_topk_prob",
                    f.bool("norm_topk_prob", true)?.to_string(),
                ),
                (
                    "routed_scaling_factor",
                    f.f64("routed_scaling_factor", 1.0)?.to_string(),
                ),
            ];
            for (key, value) in options {
                m.router_options.insert(key.into(), value);
            }
            m.shared = SharedExpertsConfig {
                count: f.usize("n_shared_experts", Some(0))?,
                hidden,
                gate: false,
            };
            cfg.moe = Some(m);
            cfg.sparse_layers = SparseLayers {
                first_dense: f.usize("first_k_dense_replace", Some(0))?,
                ..SparseLayers::default()
            };
            cfg.latent = Some(LatentConfig {
                q_rank: match f.get("q_lora_rank") {
                    Some(_) => Some(f.usize("q_lora_rank", None)?),
                    None => None,
                },
                kv_rank: f.usize("kv_lora_rank", None)?,
                nope_dim: f.usize("qk_nope_head_dim", None)?,
                rope_dim: f.usize("qk_rope_head_dim", None)?,
                v_dim: f.usize("v_head_dim", None)?,
            });
        }
        Family::Olmoe => {
            f.refuse_unless("clip_qkv", &[], "moegrad does not clip q, k and v")?;
            f.refuse_unless(
                "attention_bias",
                &[false.into()],
                "moegrad's OLMoE attention has no biases",
            )?;
            cfg.qk_norm = true;
            cfg.moe = Some(moe(
                expert_width("intermediate_size")?,
                "num_experts",
                norm_topk(false)?,
                0.01,
            )?);
        }
    }
    cfg.validate()?;
    Ok(cfg)
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
