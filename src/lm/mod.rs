//! Language models: a GPT whose feed-forward blocks may be MoE layers ([`Gpt`]), the Llama-style
//! decoder of the Llama, Mixtral, Qwen2-MoE, OLMoE and DeepSeek-V3 families ([`Decoder`],
//! [`DecoderConfig`], imported from Hugging Face by [`import_hf`]), sampling text from it
//! ([`generate()`]), and training by iterations on a text corpus ([`run()`], which
//! `moegrad train --model gpt|moe-gpt` runs), on characters or subword tokens. The data side
//! (tokenizers, split, windows) is `data/tokenizer.rs`, `data/token_corpus.rs` and
//! `data/text.rs`; the attention op is `ops/attention.rs`.
//!
//! Every item has one path, `moegrad::lm::Item`; the files are private.

mod decoder;
mod decoder_config;
mod generate;
mod gpt;
mod hf_config;
mod hf_export;
mod hf_gpt2;
mod hf_import;
mod hf_names;
mod import_run;
mod init_from;
mod language_model;
mod moe_state;
mod task;
mod train;

pub use decoder::Decoder;
pub use decoder_config::{DecoderConfig, Family, LatentConfig, SparseLayers};
pub use generate::{MAX_TOKENS, SampleOptions, generate};
pub use gpt::{FeedForward, Gpt, GptConfig, GptOutput};
pub use hf_config::{Architecture, MODEL_TYPES, architecture_from_hf, architecture_to_hf};
pub use hf_export::{ExportReport, HfLayout, export_checkpoint, export_hf, tokenizer_json};
pub use hf_import::{HfImport, import_hf};
pub(crate) use hf_names::transpose;
pub use import_run::{ImportReport, import_run};
pub use init_from::{checkpoint_settings, inherit_settings};
pub use language_model::{LanguageModel, decoder_config, model_config};
pub use train::{
    LmSummary, gpt_config, load_checkpoint, load_model, make_optimizer, run, run_observed,
};
