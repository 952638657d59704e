//! Character-level language models: a GPT whose feed-forward blocks may be MoE layers
//! ([`gpt`]), sampling text from it ([`generate()`]), and training by iterations on a text corpus
//! ([`train`], which `moegrad train --model gpt|moe-gpt` runs). The data side (vocabulary, split,
//! windows) is `data/text.rs`; the attention op is `ops/attention.rs`.

pub mod generate;
pub mod gpt;
mod task;
pub mod train;

pub use generate::{SampleOptions, generate};
pub use gpt::{FeedForward, Gpt, GptConfig, GptOutput};
