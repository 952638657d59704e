//! Language models: a GPT whose feed-forward blocks may be MoE layers ([`Gpt`]), sampling text
//! from it ([`generate()`]), and training by iterations on a text corpus ([`run()`], which
//! `moegrad train --model gpt|moe-gpt` runs), on characters or subword tokens. The data side
//! (tokenizers, split, windows) is `data/tokenizer.rs`, `data/token_corpus.rs` and
//! `data/text.rs`; the attention op is `ops/attention.rs`.
//!
//! Every item has one path, `moegrad::lm::Item`; the files are private.

mod generate;
mod gpt;
mod task;
mod train;

pub use generate::{MAX_TOKENS, SampleOptions, generate};
pub use gpt::{FeedForward, Gpt, GptConfig, GptOutput};
pub(crate) use train::make_optimizer;
pub use train::{LmSummary, gpt_config, load_model, run, run_observed};
