//! Data: the MNIST IDX reader, the MultiMNIST composer, the synthetic generators with a known
//! mixture of experts, batching, and text for the language models (characters, or subword
//! tokens from a tokenizer: [`Tokenizer`], [`TokenCorpus`]); the bundled datasets are built
//! into the binary ([`bundled`]).
//!
//! Every item has one path. Most are `moegrad::data::Item`; three groups keep a module as their
//! namespace because their names read as that module's: [`text`] (`text::encode`,
//! `text::CharCorpus`), [`multimnist`] (`multimnist::compose`, `multimnist::CANVAS`) and
//! [`bundled`] (`bundled::BUNDLED_DIR`).

pub mod bundled;
mod idx;
mod loader;
mod mnist;
pub mod multimnist;
mod synthetic;
pub mod text;
mod token_corpus;
mod tokenizer;

pub use idx::{IdxImages, read_images, read_labels, read_maybe_gzip};
pub use loader::{Batch, Dataset};
pub use mnist::{ImageSet, Mnist};
pub use synthetic::{SYNTHETIC_B_EXPERT_OUT, SYNTHETIC_B_INPUT, SYNTHETIC_B_TRUE, SyntheticB};
pub use token_corpus::TokenCorpus;
pub use tokenizer::{
    MAX_BPE_VOCAB, MAX_FILE_VOCAB, MIN_BPE_VOCAB, TOKENIZER_KEY, TextStream, Tokenizer,
    TokenizerSpec, VOCAB_KEY, pieces,
};
