//! GPT-2's tensor names mapped onto moegrad's GPT (`--model gpt`), used by `hf_import.rs`.
//! GPT-2 stores its projections as `Conv1D` weights, already `[in, out]` as moegrad's are, so
//! nothing is transposed:
//!
//! | moegrad                          | transformers (`GPT2LMHeadModel`)                 |
//! |----------------------------------|--------------------------------------------------|
//! | `tok_emb.weight` `[V, d]`        | `transformer.wte.weight` (also the output layer) |
//! | `pos_emb` `[block, d]`           | `transformer.wpe.weight`                         |
//! | `blocks.L.ln1.{weight,bias}`     | `transformer.h.L.ln_1.*`                         |
//! | `blocks.L.attn.qkv.*` `[d, 3d]`  | `transformer.h.L.attn.c_attn.*` (q, k, v blocks) |
//! | `blocks.L.attn.proj.*`           | `transformer.h.L.attn.c_proj.*`                  |
//! | `blocks.L.ln2.*`                 | `transformer.h.L.ln_2.*`                         |
//! | `blocks.L.mlp.fc.*`              | `transformer.h.L.mlp.c_fc.*`                     |
//! | `blocks.L.mlp.proj.*`            | `transformer.h.L.mlp.c_proj.*`                   |
//! | `ln_f.*`                         | `transformer.ln_f.*`                             |
//!
//! Checkpoints saved without the `transformer.` prefix (the original `gpt2` on the Hub) read
//! the same; the causal-mask buffers older checkpoints carry (`attn.bias`, `attn.masked_bias`)
//! and a tied `lm_head.weight` equal to `wte` are skipped.

use super::gpt::Gpt;
use super::hf_import::HostTensor;
use crate::nn::Parameters;
use crate::{Device, Error, Result, Tensor};
use std::collections::{BTreeMap, BTreeSet};

/// GPT-2's name of moegrad's GPT parameter `name`, without the `transformer.` prefix.
pub(super) fn hf_name(name: &str) -> Option<String> {
    match name {
        "tok_emb.weight" => return Some("wte.weight".into()),
        "pos_emb" => return Some("wpe.weight".into()),
        _ => {}
    }
    if let Some(rest) = name.strip_prefix("ln_f.") {
        return Some(format!("ln_f.{rest}"));
    }
    let (layer, rest) = name.strip_prefix("blocks.")?.split_once('.')?;
    let (module, kind) = rest.rsplit_once('.')?;
    let hf = match module {
        "ln1" => "ln_1",
        "ln2" => "ln_2",
        "attn.qkv" => "attn.c_attn",
        "attn.proj" => "attn.c_proj",
        "mlp.fc" => "mlp.c_fc",
        "mlp.proj" => "mlp.c_proj",
        _ => return None,
    };
    Some(format!("h.{layer}.{hf}.{kind}"))
}

/// Writes every parameter of `model` from GPT-2's `tensors`; every tensor must be used (but
/// the skipped ones of the module docs), every parameter found and every shape right.
pub(super) fn load_weights(
    model: &Gpt,
    tensors: BTreeMap<String, HostTensor>,
    device: Device,
) -> Result<()> {
    // one naming: without the prefix
    let tensors: BTreeMap<String, HostTensor> = tensors
        .into_iter()
        .map(|(k, v)| (k.strip_prefix("transformer.").unwrap_or(&k).to_string(), v))
        .collect();
    let mut used = BTreeSet::new();
    let mut values = Vec::new();
    for (name, p) in model.named_params() {
        let hf = hf_name(&name).ok_or_else(|| {
            Error::Io(format!(
                "moegrad's parameter {name} has no GPT-2 counterpart (an MoE GPT cannot be read from gpt2)"
            ))
        })?;
        let t = tensors.get(&hf).ok_or_else(|| {
            Error::Io(format!(
                "the checkpoint has no tensor transformer.{hf} (for moegrad's {name})"
            ))
        })?;
        let want = p.get().shape().to_vec();
        if t.shape != want {
            return Err(Error::Io(format!(
                "the checkpoint gives transformer.{hf} the shape {:?}, but the model its config describes needs {want:?}",
                t.shape
            )));
        }
        used.insert(hf);
        values.push((p, want, t.values.clone()));
    }
    for (name, t) in &tensors {
        let skipped = name.ends_with(".attn.bias")
            || name.ends_with(".attn.masked_bias")
            || (name == "lm_head.weight"
                && tensors.get("wte.weight").map(|w| &w.values) == Some(&t.values));
        if !used.contains(name) && !skipped {
            return Err(Error::Io(format!(
                "the checkpoint's tensor {name} belongs to no parameter of the model its config describes"
            )));
        }
    }
    for (p, shape, v) in values {
        p.set(Tensor::from_f32(v, &shape, device)?)?;
    }
    Ok(())
}
