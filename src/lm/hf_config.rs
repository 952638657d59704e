//! A transformers `config.json`, read into moegrad's model settings and written from them: the
//! interchange format of the field (its keys are those of `LlamaConfig`, `MixtralConfig`,
//! `Qwen2MoeConfig`, `OlmoeConfig`, `DeepseekV3Config` and `GPT2Config`).
//!
//! * [`architecture_from_hf`]: a `config.json` → a [`DecoderConfig`] or a [`GptConfig`], refusing
//!   by name every setting moegrad does not implement (rope scaling, an activation other than
//!   SiLU, a sliding window shorter than the context, `clip_qkv`, biases on the MLPs, GPT-2's
//!   per-layer attention scaling, …);
//! * [`architecture_to_hf`]: the inverse, for the models the import produced, the runs that
//!   inherit an architecture (`--init-from`) and export. A setting the family's config cannot
//!   say (a Mixtral with q/k/v biases, say) is refused: the written config, read back, must give
//!   the same model.
//!
//! A run keeps the architecture as this JSON (`TrainConfig::architecture`), so an imported or
//! upcycled model is rebuilt from its checkpoint alone.

use super::decoder_config::{DecoderConfig, Family, LatentConfig, SparseLayers};
use super::gpt::{FeedForward, GptConfig};
use crate::moe::{MoeConfig, SharedExpertsConfig};
use crate::nn::Activation;
use crate::{Error, Result};
use serde_json::{Value, json};

/// The `model_type`s moegrad reads.
pub const MODEL_TYPES: [&str; 6] = [
    "llama",
    "mixtral",
    "qwen2_moe",
    "olmoe",
    "deepseek_v3",
    "gpt2",
];

/// A model's shape as a transformers config describes it. (Settings, built once per model: the
/// size difference of the variants does not matter.)
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq)]
pub enum Architecture {
    /// `gpt2` (`GPT2LMHeadModel`): moegrad's `--model gpt`
    Gpt(GptConfig),
    /// the Llama-style families
    Decoder(DecoderConfig),
}

/// The model a transformers `config.json` describes.
///
/// # Errors
/// A missing or malformed field, an unknown `model_type` or a setting moegrad does not
/// implement, each named.
pub fn architecture_from_hf(json: &Value) -> Result<Architecture> {
    match json.get("model_type").and_then(Value::as_str) {
        Some("gpt2") => Ok(Architecture::Gpt(gpt_from_hf(json)?)),
        _ => Ok(Architecture::Decoder(decoder_from_hf(json)?)),
    }
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
pub(super) fn decoder_from_hf(json: &Value) -> Result<DecoderConfig> {
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
                "model_type {other:?} is not one moegrad imports ({})",
                MODEL_TYPES.join(", ")
            )));
        }
    };
    let vocab = f.usize("vocab_size", None)?;
    let mut cfg = DecoderConfig::baby(family, vocab);
    cfg.d_model = f.usize("hidden_size", None)?;
    cfg.layers = f.usize("num_hidden_layers", None)?;
    cfg.heads = f.usize("num_attention_heads", None)?;
    cfg.kv_heads = f.usize("num_key_value_heads", Some(cfg.heads))?;
    // (DeepSeek-V3's head_dim is its rotary width, which latent attention reads from
    // qk_rope_head_dim: moegrad keeps d/H there, as for its own DeepSeek models)
    cfg.head_dim = if family == Family::DeepseekMoe {
        cfg.d_model / cfg.heads.max(1)
    } else {
        f.usize("head_dim", Some(cfg.d_model / cfg.heads.max(1)))?
    };
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

/// GPT-2's config: moegrad's GPT is GPT-2's block (pre-norm, layer norm ε = 1e-5, tanh GELU,
/// learned positions, tied output projection, biases everywhere).
fn gpt_from_hf(json: &Value) -> Result<GptConfig> {
    let f = Fields(json);
    f.refuse_unless(
        "activation_function",
        &["gelu_new".into(), "gelu_pytorch_tanh".into()],
        "moegrad's GPT uses the tanh GELU (gelu_new)",
    )?;
    let eps = f.f64("layer_norm_epsilon", 1e-5)?;
    if eps != 1e-5 {
        return Err(Error::Invalid(format!(
            "layer_norm_epsilon = {eps} is not supported: moegrad's GPT normalises with 1e-5"
        )));
    }
    f.refuse_unless(
        "tie_word_embeddings",
        &[true.into()],
        "moegrad's GPT ties its output projection to the token embedding",
    )?;
    f.refuse_unless(
        "scale_attn_weights",
        &[true.into()],
        "moegrad's attention scales its scores by 1/sqrt(head width)",
    )?;
    f.refuse_unless(
        "scale_attn_by_inverse_layer_idx",
        &[false.into()],
        "moegrad's attention does not scale by the layer number",
    )?;
    f.refuse_unless(
        "add_cross_attention",
        &[false.into()],
        "moegrad's GPT is decoder-only",
    )?;
    let d = f.usize("n_embd", None)?;
    let cfg = GptConfig {
        vocab: f.usize("vocab_size", None)?,
        block: f.usize("n_positions", None)?,
        layers: f.usize("n_layer", None)?,
        heads: f.usize("n_head", None)?,
        d_model: d,
        ffn: FeedForward::Dense {
            hidden: f.usize("n_inner", Some(4 * d))?,
        },
        seed: 0,
    };
    cfg.validate()?;
    Ok(cfg)
}

/// The transformers `config.json` of a model (see the module docs): for a decoder, its
/// family's config class; for a dense GPT, `GPT2Config`.
///
/// # Errors
/// A model the family's config cannot describe (an MoE GPT, which has no transformers class; a
/// setting the family's class lacks), naming what differs.
pub fn architecture_to_hf(arch: &Architecture) -> Result<Value> {
    match arch {
        Architecture::Gpt(g) => gpt_to_hf(g),
        Architecture::Decoder(d) => decoder_to_hf(d),
    }
}

fn gpt_to_hf(g: &GptConfig) -> Result<Value> {
    let FeedForward::Dense { hidden } = g.ffn else {
        return Err(Error::Invalid(
            "--model moe-gpt has no transformers class (GPT-2 has no MoE blocks): train --model mixtral, or upcycle a dense model into it with --init-from".into(),
        ));
    };
    Ok(json!({
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": g.vocab,
        "n_positions": g.block,
        "n_ctx": g.block,
        "n_embd": g.d_model,
        "n_layer": g.layers,
        "n_head": g.heads,
        "n_inner": hidden,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": true,
        "scale_attn_by_inverse_layer_idx": false,
        "reorder_and_upcast_attn": false,
        "tie_word_embeddings": true,
        "torch_dtype": "float32"
    }))
}

fn decoder_to_hf(d: &DecoderConfig) -> Result<Value> {
    let mut j = json!({
        "vocab_size": d.vocab,
        "hidden_size": d.d_model,
        "num_hidden_layers": d.layers,
        "num_attention_heads": d.heads,
        "num_key_value_heads": d.kv_heads,
        "head_dim": d.head_dim,
        "max_position_embeddings": d.block,
        "rms_norm_eps": d.rms_eps,
        "rope_theta": d.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": d.rope_theta},
        "tie_word_embeddings": d.tie_embeddings,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "torch_dtype": "float32"
    });
    let o = j.as_object_mut().expect("a JSON object");
    let mut put = |k: &str, v: Value| {
        o.insert(k.into(), v);
    };
    let moe = d.moe.as_ref();
    let shared = moe.map_or(0, |m| m.shared.count * m.shared.hidden);
    let (model_type, class) = match d.family {
        Family::Llama => ("llama", "LlamaForCausalLM"),
        Family::Mixtral => ("mixtral", "MixtralForCausalLM"),
        Family::Qwen2Moe => ("qwen2_moe", "Qwen2MoeForCausalLM"),
        Family::Olmoe => ("olmoe", "OlmoeForCausalLM"),
        Family::DeepseekMoe => ("deepseek_v3", "DeepseekV3ForCausalLM"),
    };
    put("model_type", model_type.into());
    put("architectures", json!([class]));
    if let Some(m) = moe {
        put("num_experts_per_tok", m.k.into());
        put("router_aux_loss_coef", m.balance_loss.into());
    }
    let renormalised = moe.is_some_and(|m| m.router != "topk-unnorm");
    match (d.family, moe) {
        (Family::Llama, _) => {
            put("intermediate_size", d.ffn_hidden.into());
            put("attention_bias", false.into());
            put("mlp_bias", false.into());
        }
        (Family::Mixtral, Some(m)) => {
            put("intermediate_size", m.hidden.into());
            put("num_local_experts", m.experts.into());
            put("sliding_window", Value::Null);
        }
        (Family::Qwen2Moe, Some(m)) => {
            put("intermediate_size", d.ffn_hidden.into());
            put("moe_intermediate_size", m.hidden.into());
            put("num_experts", m.experts.into());
            put("shared_expert_intermediate_size", shared.into());
            put("decoder_sparse_step", d.sparse_layers.step.into());
            put("mlp_only_layers", json!(d.sparse_layers.dense));
            put("qkv_bias", d.qkv_bias.into());
            put("use_sliding_window", false.into());
            put("norm_topk_prob", renormalised.into());
        }
        (Family::Olmoe, Some(m)) => {
            put("intermediate_size", m.hidden.into());
            put("num_experts", m.experts.into());
            put("attention_bias", false.into());
            put("clip_qkv", Value::Null);
            put("norm_topk_prob", renormalised.into());
        }
        (Family::DeepseekMoe, Some(m)) => {
            let l = d.latent.unwrap_or(LatentConfig {
                q_rank: None,
                kv_rank: 0,
                nope_dim: 0,
                rope_dim: 0,
                v_dim: 0,
            });
            let opt = |key: &str, default: &str| -> String {
                m.router_options
                    .get(key)
                    .cloned()
                    .unwrap_or_else(|| default.into())
            };
            let num = |key: &str, default: &str| -> Result<Value> {
                let text = opt(key, default);
                text.parse::<u64>()
                    .map(Value::from)
                    .or_else(|_| text.parse::<f64>().map(Value::from))
                    .map_err(|_| {
                        Error::Invalid(format!("--router-opt {key}={text} is not a number"))
                    })
            };
            put("intermediate_size", d.ffn_hidden.into());
            put("moe_intermediate_size", m.hidden.into());
            put("n_routed_experts", m.experts.into());
            put("n_shared_experts", (shared / m.hidden.max(1)).into());
            put("n_group", num("n_group", "1")?);
            put("topk_group", num("topk_group", "1")?);
            put(
                "norm_topk_prob",
                (opt("norm_topk_prob", "true") == "true").into(),
            );
            put("routed_scaling_factor", num("routed_scaling_factor", "1")?);
            put("first_k_dense_replace", d.sparse_layers.first_dense.into());
            put("q_lora_rank", l.q_rank.map_or(Value::Null, Value::from));
            put("kv_lora_rank", l.kv_rank.into());
            put("qk_nope_head_dim", l.nope_dim.into());
            put("qk_rope_head_dim", l.rope_dim.into());
            put("v_head_dim", l.v_dim.into());
            // transformers sizes DeepSeek's rotary tables by head_dim
            put("head_dim", l.rope_dim.into());
            put("rope_interleave", false.into());
            put("attention_bias", false.into());
        }
        (family, None) => {
            return Err(Error::Invalid(format!(
                "a {} model without MoE layers has no transformers config of its family",
                family.name()
            )));
        }
    }
    // what the config says must be the model: read it back and compare
    let back = decoder_from_hf(&j)?;
    let differences = architecture_differences(d, &back);
    if !differences.is_empty() {
        return Err(Error::Invalid(format!(
            "transformers' {class} cannot describe this {} model: {}",
            d.family.name(),
            differences.join("; ")
        )));
    }
    Ok(j)
}

/// The settings in which two decoders differ as architectures (training settings such as the
/// capacity, the balance and z-loss weights and the seed are not compared; the router only by
/// what a transformers config can say of it).
pub(super) fn architecture_differences(a: &DecoderConfig, b: &DecoderConfig) -> Vec<String> {
    let mut out = Vec::new();
    let mut diff = |what: &str, x: String, y: String| {
        if x != y {
            out.push(format!("{what} {x} where the config says {y}"));
        }
    };
    diff("family", a.family.name().into(), b.family.name().into());
    for (what, x, y) in [
        ("vocabulary", a.vocab, b.vocab),
        ("context", a.block, b.block),
        ("layers", a.layers, b.layers),
        ("heads", a.heads, b.heads),
        ("kv heads", a.kv_heads, b.kv_heads),
        ("d_model", a.d_model, b.d_model),
        ("head width", a.head_dim, b.head_dim),
    ] {
        diff(what, x.to_string(), y.to_string());
    }
    // (the dense width matters only where a layer is dense)
    if (0..a.layers).any(|i| !a.is_moe_layer(i)) {
        diff(
            "dense FFN width",
            a.ffn_hidden.to_string(),
            b.ffn_hidden.to_string(),
        );
    }
    diff(
        "rope_theta",
        a.rope_theta.to_string(),
        b.rope_theta.to_string(),
    );
    diff("rms_norm_eps", a.rms_eps.to_string(), b.rms_eps.to_string());
    diff(
        "q/k/v biases",
        a.qkv_bias.to_string(),
        b.qkv_bias.to_string(),
    );
    diff("q/k norms", a.qk_norm.to_string(), b.qk_norm.to_string());
    diff(
        "tied embeddings",
        a.tie_embeddings.to_string(),
        b.tie_embeddings.to_string(),
    );
    diff(
        "sparse layers",
        format!("{:?}", a.sparse_layers),
        format!("{:?}", b.sparse_layers),
    );
    diff(
        "latent attention",
        format!("{:?}", a.latent),
        format!("{:?}", b.latent),
    );
    let moe = |c: &DecoderConfig| {
        c.moe.as_ref().map(|m| {
            let options: Vec<_> = m.router_options.iter().collect();
            (
                m.experts,
                m.k,
                m.hidden,
                m.shared.count * m.shared.hidden,
                m.shared.gate,
                m.router == "topk-unnorm",
                format!("{options:?}"),
            )
        })
    };
    let (ma, mb) = (moe(a), moe(b));
    if ma != mb {
        let show = |m: Option<(usize, usize, usize, usize, bool, bool, String)>| match m {
            None => "none".to_string(),
            Some((e, k, h, s, g, unnorm, opts)) => format!(
                "{e} experts of {h}, top-{k}{}, shared width {s}{}{}",
                if unnorm { " (not renormalised)" } else { "" },
                if g { " gated" } else { "" },
                if opts == "[]" {
                    String::new()
                } else {
                    format!(", router options {opts}")
                }
            ),
        };
        out.push(format!(
            "MoE layers: {} where the config says {}",
            show(ma),
            show(mb)
        ));
    }
    out
}
