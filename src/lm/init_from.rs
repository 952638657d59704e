//! `--init-from CHECKPOINT`: a language-model run that starts from another checkpoint's
//! parameters instead of a random draw — a moegrad run or a model brought in by `moegrad
//! import`. Two cases:
//!
//! * **the same model** (`--model` the checkpoint's): every parameter and the routers' state
//!   are copied; the run trains on (fine-tuning an imported model, say) with a fresh optimizer
//!   and schedule.
//! * **sparse upcycling** (Komatsuzaki et al. 2023, "Sparse Upcycling: Training
//!   Mixture-of-Experts from Dense Checkpoints"): a dense `llama` becomes an MoE model of the
//!   `mixtral` or `qwen2-moe` family. Attention, norms and embeddings are copied, and the MoE
//!   layers' routers start fresh. Each expert is a **copy** of the dense FFN of its layer when
//!   `--expert-hidden` equals the dense width; when the expert width divides it (fine-grained
//!   experts, `H = m·h`), expert `e` takes **slice** `e mod m` of the dense FFN (its gate and up
//!   columns `[j·h, (j+1)·h)` and the same rows of the down projection), so every slice is
//!   used. A shared expert is a copy or a slice the same way; its sigmoid gate starts fresh.
//!   With copies and a renormalised top-k router (`mixtral`'s `topk`), the upcycled model
//!   computes exactly the dense model's logits at step 0 (the weights of identical experts sum
//!   to one); slices, an unnormalised router or a shared expert make it a different function
//!   that training then improves.
//!
//! The upcycled model keeps the dense model's attention (its rotary base, norm epsilon, head
//! sizes, no q/k/v biases); the family sets only the MoE blocks. The run stores the resulting
//! architecture as a transformers config (`TrainConfig::architecture`), so its checkpoints
//! rebuild it alone. OLMoE (q/k norms) and DeepSeek (latent attention) have attention a dense
//! `llama` has no weights for: they are refused as upcycling targets.
//!
//! The run's model shape and tokens come from the checkpoint: [`inherit_settings`] fills the
//! settings the user did not give and refuses those that contradict it.

use super::decoder_config::Family;
use super::hf_config::{Architecture, architecture_to_hf};
use super::language_model::{LanguageModel, decoder_config, model_config};
use crate::checkpoint::Checkpoint;
use crate::data::Tokenizer;
use crate::nn::Parameters;
use crate::train::{ModelKind, TrainConfig};
use crate::{DType, Device, Error, Result, Tensor};
use std::collections::BTreeMap;
use std::path::Path;

/// The prefix of the routers' state in a checkpoint (`state.layers.1.moe.router.<name>`).
const STATE_PREFIX: &str = "state.";

/// A checkpoint's run settings and tokenizer, read from its metadata alone (no tensor loaded).
///
/// # Errors
/// A file that is not a language-model checkpoint of moegrad (named).
pub fn checkpoint_settings(path: &Path) -> Result<(TrainConfig, Option<Tokenizer>)> {
    let meta = Checkpoint::read_metadata(path)?;
    settings_from_metadata(&meta, path)
}

/// [`checkpoint_settings`] from metadata already read.
pub(super) fn settings_from_metadata(
    meta: &BTreeMap<String, String>,
    path: &Path,
) -> Result<(TrainConfig, Option<Tokenizer>)> {
    let text = meta.get("config").ok_or_else(|| {
        Error::Io(format!(
            "{}: no config in the metadata: not a checkpoint of a moegrad language model",
            path.display()
        ))
    })?;
    let cfg: TrainConfig = serde_json::from_str(text).map_err(|e| {
        Error::Io(format!(
            "{}: the run configuration in the metadata is malformed: {e}",
            path.display()
        ))
    })?;
    if !cfg.model.is_lm() {
        return Err(Error::Io(format!(
            "{}: a checkpoint of --model {}, not of a language model",
            path.display(),
            cfg.model.name()
        )));
    }
    let has_tokenizer =
        meta.contains_key(crate::data::TOKENIZER_KEY) || meta.contains_key(crate::data::VOCAB_KEY);
    let tokenizer = if has_tokenizer {
        Some(Tokenizer::from_metadata(meta, path)?)
    } else {
        None
    };
    Ok((cfg, tokenizer))
}

/// Completes the settings of a run with `cfg.init_from` set from that checkpoint: each of
/// `--model`, `--tokenizer`, `--layers`, `--heads`, `--kv-heads`, `--d-model` (and, continuing
/// the same model, the MoE flags) not listed in `given` (the flags set on the command line,
/// spelled `--layers`) takes the checkpoint's value, and the architecture is the checkpoint's
/// (or, upcycling a dense `llama`, that architecture with the family's MoE blocks). Library
/// users who set every field themselves pass every flag name, or none to inherit all.
///
/// # Errors
/// An unreadable checkpoint, a checkpoint without a tokenizer, a given setting that
/// contradicts it, or a `--model` it can neither continue nor upcycle into (each named).
pub fn inherit_settings(cfg: &mut TrainConfig, given: &[&str]) -> Result<()> {
    let Some(path) = cfg.init_from.clone() else {
        return Ok(());
    };
    let (src, tokenizer) = checkpoint_settings(&path)?;
    let tokenizer = tokenizer.ok_or_else(|| {
        Error::Invalid(format!(
            "--init-from {}: the checkpoint has no tokenizer (imported without a tokenizer.json), so it cannot be trained on text: import it again with --tokenizer PATH/tokenizer.json",
            path.display()
        ))
    })?;
    let has = |flag: &str| given.contains(&flag);
    if !has("--model") {
        cfg.model = src.model;
    }
    if has("--tokenizer") && cfg.tokenizer != src.tokenizer {
        return Err(Error::Invalid(format!(
            "--tokenizer {} differs from the tokenizer of --init-from {} ({}): a model continues on the tokens it was trained on; leave --tokenizer out",
            cfg.tokenizer,
            path.display(),
            src.tokenizer
        )));
    }
    cfg.tokenizer = src.tokenizer.clone();
    for (flag, mine, theirs) in [
        ("--layers", &mut cfg.layers, src.layers),
        ("--heads", &mut cfg.heads, src.heads),
        ("--kv-heads", &mut cfg.kv_heads, src.kv_heads),
        ("--d-model", &mut cfg.d_model, src.d_model),
    ] {
        if !has(flag) {
            *mine = theirs;
        } else if *mine != theirs {
            return Err(Error::Invalid(format!(
                "{flag} {mine} differs from --init-from {}, which has {theirs}: the model's shape comes from the checkpoint; leave {flag} out",
                path.display()
            )));
        }
    }
    if cfg.model == src.model {
        // the same model: its MoE settings too, unless given
        macro_rules! inherit {
            ($($flag:literal => $field:ident),*) => {$(
                if !has($flag) {
                    cfg.$field = src.$field.clone();
                }
            )*};
        }
        inherit!("--router" => router, "--experts" => experts, "--k" => k,
            "--expert-hidden" => expert_hidden, "--capacity-factor" => capacity_factor,
            "--eval-capacity-factor" => eval_capacity_factor, "--balance-loss" => balance_loss,
            "--z-loss" => z_loss, "--shared-experts" => shared_experts,
            "--shared-hidden" => shared_hidden, "--shared-gate" => shared_gate,
            "--moe-every" => moe_every);
        if !has("--router") && !has("--router-opt") {
            cfg.router_options = src.router_options.clone();
        }
        cfg.architecture = src.architecture.clone();
        return Ok(());
    }
    // upcycling: a dense llama into an MoE family
    let target = cfg.model.family().filter(|f| *f != Family::Llama);
    let allowed = matches!(target, Some(Family::Mixtral | Family::Qwen2Moe));
    if src.model != ModelKind::Llama || !allowed {
        return Err(Error::Invalid(format!(
            "--init-from {} holds a {} model: it continues as --model {} or, from a dense llama, upcycles into --model mixtral or qwen2-moe (olmoe's q/k norms and deepseek-moe's latent attention have no llama weights), not --model {}",
            path.display(),
            src.model.name(),
            src.model.name(),
            cfg.model.name()
        )));
    }
    let Architecture::Decoder(mut arch) = model_config(&src, tokenizer.vocab_size())? else {
        return Err(Error::Invalid(format!(
            "--init-from {}: not a llama architecture",
            path.display()
        )));
    };
    // the target family's MoE blocks (its preset and the run's MoE flags) on the dense model
    let mut run = cfg.clone();
    run.architecture = None;
    let moe = decoder_config(&run, arch.vocab).and_then(|d| d.moe);
    arch.family = target.unwrap_or(Family::Mixtral);
    arch.moe = moe;
    arch.sparse_layers = Default::default();
    if let Some(m) = arch.moe.as_mut() {
        // what a transformers config says of the router; the run's own router still applies
        m.router = if m.router == "topk-unnorm" {
            "topk-unnorm".into()
        } else {
            "topk".into()
        };
        m.router_options.clear();
    }
    arch.validate()?;
    cfg.architecture = Some(architecture_to_hf(&Architecture::Decoder(arch))?);
    Ok(())
}

/// Sets `model`'s parameters (and its routers' state) from the checkpoint `cfg.init_from` (see
/// the module docs): the same name and shape is copied; an MoE layer's experts and shared
/// experts come from the dense FFN of their layer (copies or slices); routers and the shared
/// experts' gates keep their fresh draw.
///
/// # Errors
/// An unreadable checkpoint, or a parameter the checkpoint has no value for (named with the
/// shapes involved).
pub(super) fn init_parameters(
    model: &LanguageModel,
    cfg: &TrainConfig,
    device: Device,
) -> Result<()> {
    let Some(path) = &cfg.init_from else {
        return Ok(());
    };
    let ck = Checkpoint::load(path, device)?;
    if let Some(bad) = ck.first_non_finite()? {
        return Err(Error::Io(format!("{}: {bad}", path.display())));
    }
    let missing = |name: &str, why: String| {
        Error::Invalid(format!(
            "--init-from {}: no value for the model's parameter {name}: {why}",
            path.display()
        ))
    };
    let mut values = Vec::new();
    for (name, p) in model.named_params() {
        let want = p.get().shape().to_vec();
        let value = match ck.tensors.get(&name) {
            Some(t) if t.shape() == want.as_slice() => Some(t.to_dtype(DType::F32)?),
            Some(t) => {
                return Err(missing(
                    &name,
                    format!(
                        "the checkpoint's has shape {:?}, the model needs {want:?}",
                        t.shape()
                    ),
                ));
            }
            None => upcycled(&name, &want, &ck.tensors)
                .transpose()
                .map_err(|e| missing(&name, e.to_string()))?,
        };
        match value {
            Some(v) => values.push((p, v)),
            None if is_fresh(&name) => {}
            None => {
                return Err(missing(
                    &name,
                    "the checkpoint has no parameter of that name (--init-from continues the same model or upcycles a dense llama)".into(),
                ));
            }
        }
    }
    for (p, v) in values {
        p.set(v)?;
    }
    for (name, t) in &ck.tensors {
        if let Some(state) = name.strip_prefix(STATE_PREFIX)
            && cfg.model.name() == model_kind_of(&ck)
        {
            model.load_state(state, t)?;
        }
    }
    Ok(())
}

/// The `--model` of a checkpoint's settings ("" when unreadable).
fn model_kind_of(ck: &Checkpoint) -> String {
    ck.metadata
        .get("config")
        .and_then(|c| serde_json::from_str::<TrainConfig>(c).ok())
        .map_or(String::new(), |c| c.model.name().to_string())
}

/// Parameters an upcycled model draws fresh: its routers and the shared experts' gates.
fn is_fresh(name: &str) -> bool {
    name.contains(".moe.router.") || name.ends_with(".moe.shared.gate.weight")
}

/// The value of an upcycled MoE parameter from the dense FFN of its layer: `experts.w1`
/// `[E, d, 2h]` and `experts.w2` `[E, h, d]` (expert `e` a copy, or slice `e mod m` of a dense
/// FFN `m` times as wide), `shared.up.weight` `[d, 2s]` and `shared.down.weight` `[s, d]`
/// (likewise). None for a parameter that is not one of these.
fn upcycled(
    name: &str,
    want: &[usize],
    tensors: &BTreeMap<String, Tensor>,
) -> Option<Result<Tensor>> {
    let (layer, part) = name.split_once(".moe.")?;
    let up_t = tensors.get(&format!("{layer}.mlp.up.weight"))?;
    let down_t = tensors.get(&format!("{layer}.mlp.down.weight"))?;
    let (d, big) = match up_t.shape() {
        [d, two_big] => (*d, two_big / 2),
        _ => return None,
    };
    let (count, width) = match (part, want) {
        ("experts.w1", [e, dd, two_h]) if *dd == d => (*e, two_h / 2),
        ("experts.w2", [e, h, dd]) if *dd == d => (*e, *h),
        ("shared.up.weight", [dd, two_s]) if *dd == d => (1, two_s / 2),
        ("shared.down.weight", [s, dd]) if *dd == d => (1, *s),
        _ => return None,
    };
    if width == 0 || !big.is_multiple_of(width) {
        let flag = if part.starts_with("shared") {
            "--shared-hidden"
        } else {
            "--expert-hidden"
        };
        return Some(Err(Error::Invalid(format!(
            "an expert of width {width} is neither a copy nor a slice of the dense FFN of width {big}: give {flag} {big} (copies) or a width that divides it (slices)"
        ))));
    }
    let (up, down) = match (up_t.to_vec_f32(), down_t.to_vec_f32()) {
        (Ok(u), Ok(d)) => (u, d),
        (Err(e), _) | (_, Err(e)) => return Some(Err(e)),
    };
    let slices = big / width;
    let mut out = Vec::with_capacity(want.iter().product());
    for e in 0..count {
        let j = e % slices;
        if part.ends_with("w1") || part == "shared.up.weight" {
            // [d, 2H] → [d, 2h]: the gate columns of slice j, then its up columns
            for row in 0..d {
                let r = &up[row * 2 * big..(row + 1) * 2 * big];
                out.extend_from_slice(&r[j * width..(j + 1) * width]);
                out.extend_from_slice(&r[big + j * width..big + (j + 1) * width]);
            }
        } else {
            // [H, d] → [h, d]: the rows of slice j
            out.extend_from_slice(&down[j * width * d..(j + 1) * width * d]);
        }
    }
    Some(Tensor::from_f32(out, want, up_t.device()))
}
