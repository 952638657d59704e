//! A text corpus as a language model trains on it, for any tokenizer ([`TokenCorpus`]): the
//! tokenizer, the training and validation splits as ids, the characters each validation id
//! stands for, and batches of windows.
//!
//! **The split is made on characters, before any tokenizer sees the text**: the first 90% of
//! the characters train, the last 10% validate ([`crate::data::text::split_chars`]), and each
//! part is encoded on its own. So every tokenizer is validated on the same text, and a loss
//! per token becomes bits per character ([`TokenCorpus::chars_in_windows`]) comparable across
//! tokenizers. A BPE is trained on the training part only: the validation text stays unseen.
//!
//! `--tokenizer char` builds exactly the [`CharCorpus`] of `data/text.rs` (vocabulary from the
//! whole text, ids split at the same character), so character runs are unchanged; windows are
//! drawn by the same functions for every tokenizer (`text::train_starts`, `text::val_starts`),
//! counted in tokens.

use super::text::{self, CharCorpus};
use super::tokenizer::{Tokenizer, TokenizerSpec};
use crate::{Error, Result};
use std::path::{Path, PathBuf};

/// A tokenized corpus split for training (see the module docs).
#[derive(Clone, Debug)]
pub struct TokenCorpus {
    /// the text ↔ ids mapping
    pub tokenizer: Tokenizer,
    /// the ids of the first 90% of the characters
    pub train: Vec<i32>,
    /// the ids of the last 10%
    pub val: Vec<i32>,
    /// for each validation id, the characters of the text it stands for (all 1 for `char`)
    pub val_chars: Vec<u32>,
    /// where the text came from
    pub source: PathBuf,
}

fn err(path: &Path, what: impl std::fmt::Display) -> Error {
    Error::Io(format!("{}: {what}", path.display()))
}

impl TokenCorpus {
    /// Reads `path` (UTF-8, plain or gzip), splits it and encodes it as `spec` says, for
    /// windows of `block` tokens.
    ///
    /// # Errors
    /// Everything [`CharCorpus::load`] refuses; a tokenizer that cannot be built (a missing or
    /// malformed `tokenizer.json`, named); a split with fewer than `block + 1` tokens.
    pub fn load(path: &Path, spec: &TokenizerSpec, block: usize) -> Result<TokenCorpus> {
        if *spec == TokenizerSpec::Char {
            return Ok(TokenCorpus::from_chars(CharCorpus::load(path, block)?));
        }
        let text = text::load_text(path)?;
        TokenCorpus::from_text(&text, spec, block, path)
    }

    /// The corpus of a character split (`val_chars` all 1).
    pub fn from_chars(c: CharCorpus) -> TokenCorpus {
        TokenCorpus {
            val_chars: vec![1; c.val.len()],
            tokenizer: Tokenizer::chars(c.vocab),
            train: c.train,
            val: c.val,
            source: c.source,
        }
    }

    /// [`TokenCorpus::load`] on a text in memory; `source` names it in errors.
    ///
    /// # Errors
    /// As [`TokenCorpus::load`].
    pub fn from_text(
        text: &str,
        spec: &TokenizerSpec,
        block: usize,
        source: &Path,
    ) -> Result<TokenCorpus> {
        if *spec == TokenizerSpec::Char {
            return Ok(TokenCorpus::from_chars(CharCorpus::from_text(
                text, block, source,
            )?));
        }
        let tokenizer = Tokenizer::build(spec, split_train(text))?;
        TokenCorpus::with_tokenizer(text, tokenizer, block, source)
    }

    /// [`TokenCorpus::from_text`] with a tokenizer already made (a checkpoint's, for
    /// `--init-from`): a non-character one encodes both splits; a character one must hold every
    /// character of the text.
    ///
    /// # Errors
    /// As [`TokenCorpus::load`]; a character the character tokenizer lacks (named).
    pub fn with_tokenizer(
        text: &str,
        tokenizer: Tokenizer,
        block: usize,
        source: &Path,
    ) -> Result<TokenCorpus> {
        if let Some(vocab) = tokenizer.char_vocab() {
            let corpus = CharCorpus::from_text(text, block, source)?;
            if let Some(c) = corpus.vocab.iter().find(|c| !vocab.contains(c)) {
                return Err(err(
                    source,
                    format!(
                        "the character {c:?} is not in the model's vocabulary of {} characters: a character model reads only the characters it was trained on",
                        vocab.len()
                    ),
                ));
            }
            // the model's ids: each character's place in its own vocabulary
            let remap = |ids: &[i32]| -> Vec<i32> {
                ids.iter()
                    .map(|&i| {
                        let c = corpus.vocab[i as usize];
                        vocab.iter().position(|&v| v == c).unwrap_or(0) as i32
                    })
                    .collect()
            };
            return Ok(TokenCorpus {
                val_chars: vec![1; corpus.val.len()],
                train: remap(&corpus.train),
                val: remap(&corpus.val),
                tokenizer,
                source: corpus.source,
            });
        }
        if block == 0 {
            return Err(Error::Invalid("--block must be at least 1".into()));
        }
        let count = text.chars().count();
        if count == 0 {
            return Err(err(source, "the text is empty"));
        }
        let train_text = split_train(text);
        let val_text = &text[train_text.len()..];
        let train = tokenizer.encode(train_text)?;
        let (val, val_chars) = tokenizer.encode_counting_chars(val_text)?;
        let shortest = train.len().min(val.len());
        if shortest < block + 1 {
            return Err(err(
                source,
                format!(
                    "the 90%/10% split of its {count} characters gives {} tokens for training and {} for validation, and a window of --block {block} needs {} in each (give a longer text or a smaller --block)",
                    train.len(),
                    val.len(),
                    block + 1
                ),
            ));
        }
        Ok(TokenCorpus {
            tokenizer,
            train,
            val,
            val_chars,
            source: source.to_path_buf(),
        })
    }

    /// The vocabulary size V.
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.vocab_size()
    }

    /// Training batch number `step`: `batch` windows of `block` tokens at positions drawn
    /// from `(seed, step)`. Returns `(x, y)`, each `batch·block` ids, row-major `[batch, block]`,
    /// `y` the next token of each position of `x`.
    pub fn train_batch(
        &self,
        batch: usize,
        block: usize,
        seed: u64,
        step: u64,
    ) -> (Vec<i32>, Vec<i32>) {
        let starts = text::train_starts(self.train.len(), batch, block, seed, step);
        text::windows(&self.train, &starts, block)
    }

    /// The fixed validation windows: `count` start positions drawn once from `seed`.
    pub fn val_windows(&self, count: usize, block: usize, seed: u64) -> Vec<usize> {
        text::val_starts(self.val.len(), count, block, seed)
    }

    /// The validation batch of windows starting at `starts`: `(x, y)` as in
    /// [`TokenCorpus::train_batch`].
    pub fn val_batch(&self, starts: &[usize], block: usize) -> (Vec<i32>, Vec<i32>) {
        text::windows(&self.val, starts, block)
    }

    /// The characters the targets of the validation windows at `starts` stand for: the sum,
    /// over the windows, of `val_chars` of ids `s + 1 ..= s + block` (a window's targets).
    /// Bits per character = (mean loss per target · targets) / this / ln 2.
    pub fn chars_in_windows(&self, starts: &[usize], block: usize) -> u64 {
        starts
            .iter()
            .map(|&s| {
                self.val_chars[s + 1..s + block + 1]
                    .iter()
                    .map(|&c| u64::from(c))
                    .sum::<u64>()
            })
            .sum()
    }
}

/// The training split of a text: its first 90% of characters (`text::split_chars`).
fn split_train(text: &str) -> &str {
    let count = text.chars().count();
    let at = text
        .char_indices()
        .nth(crate::data::text::split_chars(count))
        .map_or(text.len(), |(i, _)| i);
    &text[..at]
}
