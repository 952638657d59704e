//! `moegrad import --hf DIR --out RUN`: a Hugging Face checkpoint ([`import_hf`]) written as a
//! moegrad run directory, so every command that reads a run reads it: `generate` and `logits`
//! sample and score with it, and `train --init-from RUN/checkpoint.safetensors` trains it
//! further (fine-tuning, or upcycling an imported `llama` into an MoE family).
//!
//! The run's checkpoint holds the parameters under moegrad's names, the routers' state
//! (DeepSeek-V3's correction bias), the tokenizer (`tokenizer.json` of `DIR`, or the one given)
//! and settings whose `architecture` is the `config.json` itself, so the model is rebuilt
//! exactly; the other settings are those of a fresh language-model run (the baby Shakespeare
//! defaults), with the family's router as the config says it. The directory is claimed like a
//! training run's (locked; an earlier run's files refused without `overwrite`), and written only
//! once the whole import has succeeded; a failed write leaves no directory it created behind.

use super::hf_config::Architecture;
use super::hf_import::{HfImport, import_hf};
use crate::checkpoint::Checkpoint;
use crate::data::Tokenizer;
use crate::nn::Parameters;
use crate::train::{ModelKind, TrainConfig, out_dir::OutDir};
use crate::{Device, Error, Result};
use serde::Serialize;
use std::path::{Path, PathBuf};

/// The file name of a run's checkpoint.
const CHECKPOINT_FILE: &str = "checkpoint.safetensors";

/// What `moegrad import` wrote (`--json` prints it).
#[derive(Clone, Debug, Serialize)]
pub struct ImportReport {
    /// the `--model` the checkpoint is (`gpt`, `llama`, `mixtral`, …)
    pub model: String,
    /// the transformers `model_type`
    pub model_type: String,
    /// trainable parameters
    pub params: usize,
    /// the model's vocabulary (rows of its embedding)
    pub vocab: usize,
    /// the tokenizer's size, when a tokenizer was imported
    pub tokenizer_vocab: Option<usize>,
    /// the checkpoint written
    pub checkpoint: PathBuf,
}

/// Imports the transformers checkpoint in `hf_dir` and writes it as the run `out` (see the
/// module docs). `tokenizer` replaces (or supplies) the directory's `tokenizer.json`.
///
/// # Errors
/// Those of [`import_hf`]; a tokenizer that does not load or has more tokens than the model;
/// an `out` that is not a directory, is locked by a live run, or holds an earlier run's files
/// without `overwrite`; a write that fails (each named).
pub fn import_run(
    hf_dir: &Path,
    out: &Path,
    tokenizer: Option<&Path>,
    overwrite: bool,
    device: Device,
) -> Result<ImportReport> {
    let import = import_hf(hf_dir, device)?;
    let tokenizer = match tokenizer {
        Some(path) => Some(Tokenizer::from_file(path)?),
        None => match &import.tokenizer_json {
            Some(json) => Some(Tokenizer::from_json(
                json,
                &format!("{}", hf_dir.join("tokenizer.json").display()),
            )?),
            None => None,
        },
    };
    let cfg = run_settings(&import, hf_dir, tokenizer.as_ref())?;
    let vocab = match import.model.architecture() {
        Architecture::Gpt(g) => g.vocab,
        Architecture::Decoder(d) => d.vocab,
    };
    if let Some(t) = &tokenizer
        && t.vocab_size() > vocab
    {
        return Err(Error::Invalid(format!(
            "the tokenizer has {} tokens, but the model's vocabulary (vocab_size) is {vocab}",
            t.vocab_size()
        )));
    }
    // the checkpoint, in memory, before the directory is touched
    let mut ck = Checkpoint::default();
    for (name, p) in import.model.named_params() {
        ck.tensors.insert(name, p.get());
    }
    for (name, t) in import.model.state()? {
        ck.tensors
            .insert(format!("{}{name}", crate::train::resume::STATE_PREFIX), t);
    }
    let config_json = serde_json::to_string(&cfg).map_err(|e| Error::Invalid(e.to_string()))?;
    ck.metadata.insert("config".into(), config_json);
    ck.metadata
        .insert("imported_from".into(), hf_dir.display().to_string());
    if let Some(t) = &tokenizer {
        t.annotate(&mut ck.metadata)?;
    }
    let created = !out.exists();
    let write = || -> Result<PathBuf> {
        let dir = OutDir::claim(out, false, overwrite)?;
        let path = dir.path().join(CHECKPOINT_FILE);
        ck.save(&path)?;
        Ok(path)
    };
    let checkpoint = write().inspect_err(|_| {
        if created {
            let _ = std::fs::remove_dir_all(out);
        }
    })?;
    Ok(ImportReport {
        model: cfg.model.name().into(),
        model_type: import
            .config_json
            .get("model_type")
            .and_then(|v| v.as_str())
            .unwrap_or("")
            .into(),
        params: import.model.num_params(),
        vocab,
        tokenizer_vocab: tokenizer.as_ref().map(Tokenizer::vocab_size),
        checkpoint,
    })
}

/// The settings an imported model's run records: a fresh language-model run of its family
/// whose sizes and router are the config's and whose architecture is the config itself.
fn run_settings(
    import: &HfImport,
    hf_dir: &Path,
    tokenizer: Option<&Tokenizer>,
) -> Result<TrainConfig> {
    let arch = import.model.architecture();
    let model = match &arch {
        Architecture::Gpt(_) => ModelKind::Gpt,
        Architecture::Decoder(d) => serde_json::from_value(d.family.name().into())
            .map_err(|_| Error::Invalid(format!("no --model is named {}", d.family.name())))?,
    };
    let mut cfg = TrainConfig::language_model(model);
    match &arch {
        Architecture::Gpt(g) => {
            (cfg.layers, cfg.heads, cfg.kv_heads, cfg.d_model) = (g.layers, g.heads, 0, g.d_model);
            cfg.block = cfg.block.min(g.block);
        }
        Architecture::Decoder(d) => {
            (cfg.layers, cfg.heads, cfg.kv_heads, cfg.d_model) =
                (d.layers, d.heads, d.kv_heads, d.d_model);
            cfg.block = cfg.block.min(d.block);
            if let Some(m) = &d.moe {
                cfg.set_moe(m);
            }
        }
    }
    cfg.tokenizer = match tokenizer {
        Some(t) if t.char_vocab().is_some() => "char".into(),
        Some(_) => hf_dir.join("tokenizer.json").display().to_string(),
        // (no tokenizer in the checkpoint: the setting is never read)
        None => "char".into(),
    };
    cfg.architecture = Some(import.config_json.clone());
    let cfg = cfg.with_lm_intervals();
    cfg.validate()?;
    super::language_model::model_config(&cfg, tokenizer.map_or(0, Tokenizer::vocab_size))?;
    Ok(cfg)
}
