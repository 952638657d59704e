//! `moegrad export --format hf`: a language-model checkpoint written as a Hugging Face
//! transformers model directory that `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer`
//! load: `config.json` (the family's `model_type` and fields, `hf_config.rs`),
//! `model.safetensors` (transformers' names and `[out, in]` layouts, F32), `generation_config.json`,
//! `tokenizer.json` and `tokenizer_config.json`. The inverse of the import (`hf_import.rs`,
//! `hf_names.rs`, `hf_gpt2.rs`, whose tables give the names):
//!
//! * every matrix is transposed back to PyTorch's `[out, in]` (GPT-2's `Conv1D` weights stay
//!   `[in, out]`), SwiGLU's side-by-side `[gate | up]` is split into `gate_proj` and `up_proj`;
//! * experts in one of the two layouts transformers reads ([`HfLayout`]): `Legacy`, one tensor
//!   per expert as the Hub's checkpoints (`block_sparse_moe.experts.E.w1.weight` for Mixtral,
//!   `mlp.experts.E.gate_proj.weight` for the others), or `Stacked`, transformers v5's
//!   `mlp.experts.gate_up_proj` `[E, 2I, d]` and `mlp.experts.down_proj` `[E, d, I]`;
//! * a model imported from Hugging Face is written with the config it came with, DeepSeek's
//!   rotary rows interleaved again where it said `rope_interleave`, so `export(import(x))` gives
//!   `x`'s tensors bit for bit; a model trained here gets the config of its architecture.
//!
//! Which routers export (transformers implements one routing rule per family; a router exports
//! where its *inference* rule is that rule):
//!
//! | family | routers | transformers' rule |
//! |---|---|---|
//! | `mixtral` | `topk`, `topk-noisy` | softmax, top-k, renormalised (the noise is training-only; its weights are dropped) |
//! | `qwen2-moe`, `olmoe` | `topk`, `topk-noisy` (`norm_topk_prob` true); `topk-unnorm`, `default-moe`, `switch` at k = 1 (false) | softmax, top-k, renormalised or not |
//! | `deepseek-moe` | `deepseek-v3` | sigmoid, correction bias, group-limited top-k |
//!
//! Every other router (`moesart`, `sparsemixer`, `dselect-k`, `hash`, `threshold`, …) routes by
//! a rule no transformers class computes, and is refused naming it. So are a finite evaluation
//! capacity (transformers drops no token), an MoE GPT (GPT-2 has no MoE blocks: train `mixtral`,
//! or upcycle a dense model into it with `--init-from`) and any setting the family's config
//! cannot say (a Mixtral with shared experts, say).
//!
//! The directory is written under a temporary name beside `out` and renamed into place at the
//! end, so a failure leaves no half-written directory.

use super::decoder_config::{DecoderConfig, Family};
use super::hf_config::{
    Architecture, architecture_differences, architecture_from_hf, architecture_to_hf,
};
use super::hf_names::transpose;
use super::language_model::LanguageModel;
use crate::data::Tokenizer;
use crate::export_dir::{Values, safetensors_bytes, write_dir};
use crate::moe::Capacity;
use crate::nn::Parameters;
use crate::{Error, Result, Tensor};
use serde::Serialize;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// How expert weights are laid out in `model.safetensors`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HfLayout {
    /// one tensor per expert and projection, as the Hub's checkpoints and transformers 4.x
    Legacy,
    /// transformers v5's stacked `mlp.experts.gate_up_proj` and `mlp.experts.down_proj`
    Stacked,
}

/// What an export wrote (`moegrad export --json` prints it).
#[derive(Clone, Debug, Serialize)]
pub struct ExportReport {
    /// the transformers `model_type`
    pub model_type: String,
    /// the transformers class (`architectures[0]`)
    pub class: String,
    /// tensors written
    pub tensors: usize,
    /// the directory written
    pub dir: PathBuf,
}

/// Exports the language model of `model` (with the run settings' architecture JSON, if any, and
/// its tokenizer) as a transformers directory `out` (see the module docs).
///
/// # Errors
/// A router, capacity or setting transformers cannot represent (named); an `out` that exists
/// and is not an empty directory; a failed write.
pub fn export_hf(
    model: &LanguageModel,
    architecture_json: Option<&Value>,
    tokenizer: Option<&Tokenizer>,
    layout: HfLayout,
    out: &Path,
) -> Result<ExportReport> {
    let (config, tensors) = hf_model(model, architecture_json, layout)?;
    let mut files: Vec<(&str, Vec<u8>)> = Vec::new();
    let text = |v: &Value| serde_json::to_vec_pretty(v).map_err(|e| Error::Invalid(e.to_string()));
    files.push(("config.json", text(&config)?));
    files.push(("model.safetensors", safetensors_bytes(&tensors)?));
    files.push((
        "generation_config.json",
        text(&json!({"do_sample": true, "temperature": 0.8, "top_k": 40}))?,
    ));
    if let Some(t) = tokenizer {
        let block = model.block();
        files.push(("tokenizer.json", tokenizer_json(t)?.into_bytes()));
        files.push((
            "tokenizer_config.json",
            text(&json!({
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": block,
                "clean_up_tokenization_spaces": false,
                "add_bos_token": false,
                "add_eos_token": false
            }))?,
        ));
    }
    write_dir(out, &files)?;
    Ok(ExportReport {
        model_type: config["model_type"].as_str().unwrap_or("").into(),
        class: config["architectures"][0].as_str().unwrap_or("").into(),
        tensors: tensors.len(),
        dir: out.to_path_buf(),
    })
}

/// Exports the language-model checkpoint at `checkpoint` (a training run's or an import's) as
/// a transformers directory `out`: [`export_hf`] of its model, architecture and tokenizer.
///
/// # Errors
/// An unreadable checkpoint, and those of [`export_hf`].
pub fn export_checkpoint(checkpoint: &Path, out: &Path, layout: HfLayout) -> Result<ExportReport> {
    let (model, tokenizer) = super::train::load_checkpoint(checkpoint, crate::Device::cpu())?;
    let (cfg, _) = super::init_from::checkpoint_settings(checkpoint)?;
    export_hf(
        &model,
        cfg.architecture.as_ref(),
        tokenizer.as_ref(),
        layout,
        out,
    )
}

/// The config and the tensors (transformers' names) of `model`.
pub(super) fn hf_model(
    model: &LanguageModel,
    architecture_json: Option<&Value>,
    layout: HfLayout,
) -> Result<(Value, BTreeMap<String, Values>)> {
    let arch = exportable(model.architecture())?;
    // a model that came from a transformers config keeps it (it says the same model)
    let config = match architecture_json {
        Some(j) => {
            let back = architecture_from_hf(j)?;
            let same = match (back, &arch) {
                (Architecture::Decoder(mut a), Architecture::Decoder(b)) => {
                    // (the router is the run's: compared above, by what the family can say)
                    if let (Some(ma), Some(mb)) = (a.moe.as_mut(), b.moe.as_ref()) {
                        ma.router = mb.router.clone();
                    }
                    architecture_differences(b, &a).is_empty()
                }
                (Architecture::Gpt(a), Architecture::Gpt(b)) => {
                    a.vocab == b.vocab
                        && a.block == b.block
                        && a.layers == b.layers
                        && a.heads == b.heads
                        && a.d_model == b.d_model
                        && a.ffn == b.ffn
                }
                _ => false,
            };
            if same {
                let mut j = j.clone();
                if let Architecture::Decoder(d) = &arch
                    && let Some(m) = &d.moe
                    && j.get("norm_topk_prob").is_some()
                {
                    j["norm_topk_prob"] = (m.router != "topk-unnorm").into();
                }
                j
            } else {
                architecture_to_hf(&arch)?
            }
        }
        None => architecture_to_hf(&arch)?,
    };
    let interleaved = config["model_type"] == "deepseek_v3"
        && config
            .get("rope_interleave")
            .and_then(Value::as_bool)
            .unwrap_or(true);
    let mut tensors = BTreeMap::new();
    let mut put = |name: String, v: Values| tensors.insert(name, v);
    let params: Vec<(String, Tensor)> = model
        .named_params()
        .into_iter()
        .map(|(n, p)| (n, p.get()))
        .collect();
    match &arch {
        Architecture::Gpt(_) => {
            for (name, t) in &params {
                let hf = super::hf_gpt2::hf_name(name).ok_or_else(|| {
                    Error::Invalid(format!(
                        "moegrad's parameter {name} has no GPT-2 counterpart"
                    ))
                })?;
                put(format!("transformer.{hf}"), host(t)?);
            }
        }
        Architecture::Decoder(d) => {
            for (name, t) in &params {
                decoder_tensor(d, name, t, layout, interleaved, &mut put)?;
            }
            for (name, t) in model.state()? {
                if let Some(scope) = name.strip_suffix(".moe.router.e_score_correction_bias") {
                    put(
                        format!("model.{scope}.mlp.gate.e_score_correction_bias"),
                        host(&t)?,
                    );
                }
            }
        }
    }
    Ok((config, tensors))
}

/// The architecture to export, its router replaced by the name transformers' rule has in its
/// family (see the module docs), or the refusal naming what cannot be represented.
fn exportable(arch: Architecture) -> Result<Architecture> {
    let Architecture::Decoder(mut d) = arch else {
        return Ok(arch);
    };
    let family = d.family;
    if let Some(m) = d.moe.as_mut() {
        let unnormalised = family == Family::Qwen2Moe || family == Family::Olmoe;
        let router = match (family, m.router.as_str(), m.k) {
            (Family::DeepseekMoe, "deepseek-v3", _) => "deepseek-v3",
            (Family::Mixtral | Family::Qwen2Moe | Family::Olmoe, "topk" | "topk-noisy", _) => {
                "topk"
            }
            (_, "topk-unnorm" | "default-moe", _) if unnormalised => "topk-unnorm",
            (_, "switch", 1) if unnormalised => "topk-unnorm",
            (_, other, k) => {
                let allowed = match family {
                    Family::Mixtral => "topk or topk-noisy (softmax, top-k, renormalised)",
                    Family::DeepseekMoe => "deepseek-v3",
                    _ => {
                        "topk, topk-noisy, topk-unnorm, default-moe or switch at k = 1 (softmax, top-k, renormalised or not)"
                    }
                };
                return Err(Error::Invalid(format!(
                    "--router {other} (k = {k}) cannot be exported as a {} model: transformers' class routes by one rule, which {allowed} compute at inference, and {other} does not",
                    family.name()
                )));
            }
        };
        if router != "deepseek-v3" && m.balancing.uses_selection_bias() {
            return Err(Error::Invalid(format!(
                "--balance {}: the run chooses its experts with a selection bias, which transformers' {} gate does not have (only DeepSeek-V3's e_score_correction_bias is one), so the exported model would choose other experts; export a run balanced with --balance aux or none",
                m.balancing.method.name(),
                family.name()
            )));
        }
        if m.null_experts > 0 {
            return Err(Error::Invalid(format!(
                "--null-experts {}: transformers' {} has no null experts (its gate scores only real ones), so the exported model would route differently; export a run without them",
                m.null_experts,
                family.name()
            )));
        }
        m.router = router.into();
        if router != "deepseek-v3" {
            m.router_options.clear();
        }
        if m.eval_capacity != Capacity::Dropless {
            return Err(Error::Invalid(format!(
                "an evaluation capacity ({:?}) drops tokens, which transformers never does: export a run trained with --eval-capacity-factor 0 (dropless)",
                m.eval_capacity
            )));
        }
    }
    Ok(Architecture::Decoder(d))
}

/// A tensor's values on the host as f32.
fn host(t: &Tensor) -> Result<Values> {
    Ok((t.shape().to_vec(), t.to_vec_f32()?))
}

/// Columns `[from, to)` of a row-major `[r, c]` matrix.
fn columns(v: &[f32], r: usize, c: usize, from: usize, to: usize) -> Vec<f32> {
    (0..r)
        .flat_map(|i| v[i * c + from..i * c + to].to_vec())
        .collect()
}

/// moegrad's `[in, out]` matrix as PyTorch's `[out, in]`, its output rows in DeepSeek's
/// interleaved rotary order when `order` is given (row `order[i]` of the result is row `i`).
fn linear_weight(shape: &[usize], v: &[f32], order: Option<&[usize]>) -> Values {
    let (i, o) = (shape[0], shape[1]);
    let t = transpose(v, i, o);
    let t = match order {
        Some(order) => {
            let mut rows = vec![0.0; t.len()];
            for (new, &old) in order.iter().enumerate() {
                rows[old * i..(old + 1) * i].copy_from_slice(&t[new * i..(new + 1) * i]);
            }
            rows
        }
        None => t,
    };
    (vec![o, i], t)
}

/// The interleaving of DeepSeek's rotary rows that the import undid (`hf_names::rope_order`):
/// within each block of `block` rows, moegrad's row `keep + k` (half-split) came from row
/// `keep + 2k` (k < r/2) or `keep + 2(k − r/2) + 1`.
fn rope_order(rows: usize, block: usize, rope: usize) -> Vec<usize> {
    let keep = block - rope;
    (0..rows)
        .map(|i| {
            let (base, j) = (i - i % block, i % block);
            if j < keep {
                return i;
            }
            let k = j - keep;
            base + keep
                + if k < rope / 2 {
                    2 * k
                } else {
                    2 * (k - rope / 2) + 1
                }
        })
        .collect()
}

/// Writes the transformers tensor(s) of the decoder parameter `name`.
fn decoder_tensor(
    d: &DecoderConfig,
    name: &str,
    t: &Tensor,
    layout: HfLayout,
    interleaved: bool,
    put: &mut impl FnMut(String, Values) -> Option<Values>,
) -> Result<()> {
    let (shape, v) = host(t)?;
    let no_counterpart = || {
        Error::Invalid(format!(
            "moegrad's parameter {name} has no transformers counterpart"
        ))
    };
    match name {
        "embed.weight" => {
            put("model.embed_tokens.weight".into(), (shape, v));
            return Ok(());
        }
        "norm.weight" => {
            put("model.norm.weight".into(), (shape, v));
            return Ok(());
        }
        "head.weight" => {
            put("lm_head.weight".into(), linear_weight(&shape, &v, None));
            return Ok(());
        }
        _ => {}
    }
    let (layer, rest) = name
        .strip_prefix("layers.")
        .and_then(|r| r.split_once('.'))
        .ok_or_else(no_counterpart)?;
    let p = format!("model.layers.{layer}");
    let (mlp, expert_names) = match (d.family, layout) {
        (Family::Mixtral, HfLayout::Legacy) => {
            (format!("{p}.block_sparse_moe"), ["w1", "w3", "w2"])
        }
        (Family::Mixtral, HfLayout::Stacked) => (format!("{p}.mlp"), ["w1", "w3", "w2"]),
        _ => (format!("{p}.mlp"), ["gate_proj", "up_proj", "down_proj"]),
    };
    let shared = if d.family == Family::DeepseekMoe {
        format!("{p}.mlp.shared_experts")
    } else {
        format!("{p}.mlp.shared_expert")
    };
    // a SwiGLU MLP's [d, 2I] up and [I, d] down as gate_proj, up_proj, down_proj
    let mut swiglu = |prefix: &str, part: &str, shape: &[usize], v: &[f32]| {
        if part == "up" {
            let (r, c) = (shape[0], shape[1]);
            let half = c / 2;
            put(
                format!("{prefix}.gate_proj.weight"),
                (
                    vec![half, r],
                    transpose(&columns(v, r, c, 0, half), r, half),
                ),
            );
            put(
                format!("{prefix}.up_proj.weight"),
                (
                    vec![half, r],
                    transpose(&columns(v, r, c, half, c), r, half),
                ),
            );
        } else {
            put(
                format!("{prefix}.down_proj.weight"),
                linear_weight(shape, v, None),
            );
        }
    };
    if let Some(l) = d.latent
        && let Some(part) = rest.strip_prefix("attn.")
    {
        let a = format!("{p}.self_attn");
        let qk = l.nope_dim + l.rope_dim;
        let order =
            |rows: usize, block: usize| interleaved.then(|| rope_order(rows, block, l.rope_dim));
        let (hf, order) = match part {
            "q.weight" => ("q_proj.weight", order(d.heads * qk, qk)),
            "q_down.weight" => ("q_a_proj.weight", None),
            "q_norm.weight" => {
                put(format!("{a}.q_a_layernorm.weight"), (shape, v));
                return Ok(());
            }
            "q_up.weight" => ("q_b_proj.weight", order(d.heads * qk, qk)),
            "kv_down.weight" => {
                let rows = l.kv_rank + l.rope_dim;
                ("kv_a_proj_with_mqa.weight", order(rows, rows))
            }
            "kv_norm.weight" => {
                put(format!("{a}.kv_a_layernorm.weight"), (shape, v));
                return Ok(());
            }
            "kv_up.weight" => ("kv_b_proj.weight", None),
            "o.weight" => ("o_proj.weight", None),
            _ => return Err(no_counterpart()),
        };
        put(
            format!("{a}.{hf}"),
            linear_weight(&shape, &v, order.as_deref()),
        );
        return Ok(());
    }
    match rest {
        "attn_norm.weight" => {
            put(format!("{p}.input_layernorm.weight"), (shape, v));
        }
        "ffn_norm.weight" => {
            put(format!("{p}.post_attention_layernorm.weight"), (shape, v));
        }
        "attn.q_norm.weight" | "attn.k_norm.weight" => {
            put(
                format!("{p}.self_attn.{}", &rest["attn.".len()..]),
                (shape, v),
            );
        }
        "mlp.up.weight" => swiglu(&format!("{p}.mlp"), "up", &shape, &v),
        "mlp.down.weight" => swiglu(&format!("{p}.mlp"), "down", &shape, &v),
        "moe.shared.up.weight" => swiglu(&shared, "up", &shape, &v),
        "moe.shared.down.weight" => swiglu(&shared, "down", &shape, &v),
        "moe.shared.gate.weight" => {
            put(
                format!("{p}.mlp.shared_expert_gate.weight"),
                linear_weight(&shape, &v, None),
            );
        }
        "moe.router.weight" => {
            put(
                format!("{mlp}.gate.weight"),
                linear_weight(&shape, &v, None),
            );
        }
        // the training-only noise of topk-noisy
        "moe.router.noise_weight" => {}
        "moe.experts.w1" | "moe.experts.w2" => {
            let (e, r, c) = (shape[0], shape[1], shape[2]);
            let first = rest == "moe.experts.w1";
            let each = |i: usize| &v[i * r * c..(i + 1) * r * c];
            match layout {
                HfLayout::Stacked => {
                    // gate_up_proj [E, 2I, d] (gate rows first) and down_proj [E, d, I]
                    let all: Vec<f32> = (0..e).flat_map(|i| transpose(each(i), r, c)).collect();
                    let which = if first { "gate_up_proj" } else { "down_proj" };
                    put(format!("{p}.mlp.experts.{which}"), (vec![e, c, r], all));
                }
                HfLayout::Legacy => {
                    for i in 0..e {
                        let prefix = format!("{mlp}.experts.{i}");
                        if first {
                            let half = c / 2;
                            put(
                                format!("{prefix}.{}.weight", expert_names[0]),
                                (
                                    vec![half, r],
                                    transpose(&columns(each(i), r, c, 0, half), r, half),
                                ),
                            );
                            put(
                                format!("{prefix}.{}.weight", expert_names[1]),
                                (
                                    vec![half, r],
                                    transpose(&columns(each(i), r, c, half, c), r, half),
                                ),
                            );
                        } else {
                            put(
                                format!("{prefix}.{}.weight", expert_names[2]),
                                (vec![c, r], transpose(each(i), r, c)),
                            );
                        }
                    }
                }
            }
        }
        other => {
            let Some((which, kind)) = other.strip_prefix("attn.").and_then(|x| x.split_once('.'))
            else {
                return Err(no_counterpart());
            };
            if !["q", "k", "v", "o"].contains(&which) {
                return Err(no_counterpart());
            }
            let hf = format!("{p}.self_attn.{which}_proj.{kind}");
            if kind == "weight" {
                put(hf, linear_weight(&shape, &v, None));
            } else {
                put(hf, (shape, v));
            }
        }
    }
    Ok(())
}

/// The `tokenizer.json` of a tokenizer: a Hugging Face one as it is; a character one as a BPE
/// with no merges over the characters (each character one token, ids equal to moegrad's),
/// decoded by concatenation (`Fuse`).
pub fn tokenizer_json(t: &Tokenizer) -> Result<String> {
    if let Some(json) = t.to_json()? {
        return Ok(json);
    }
    let chars = t.char_vocab().unwrap_or(&[]);
    let vocab: serde_json::Map<String, Value> = chars
        .iter()
        .enumerate()
        .map(|(i, c)| (c.to_string(), i.into()))
        .collect();
    let j = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": null,
        "post_processor": null,
        "decoder": {"type": "Fuse"},
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": []
        }
    });
    serde_json::to_string(&j).map_err(|e| Error::Invalid(e.to_string()))
}
