//! Character-level text for language models: a UTF-8 corpus (plain or gzip), its vocabulary (the
//! sorted distinct characters), a train/validation split (the first 90% / the last 10%), and
//! batches of random windows.
//!
//! A batch of `B` windows of `block` characters gives inputs `x [B, block]` and targets
//! `y [B, block]` shifted by one (`y[b, t] = x[b, t + 1]`), both as I32 character ids. Training
//! windows start at positions drawn uniformly from a generator seeded by `(seed, step)`, so step s
//! sees the same batch whether or not the run was resumed. Validation uses a fixed set of windows
//! drawn once from the seed ([`CharCorpus::val_windows`]): every evaluation of every run with the
//! same seed sees the same text.
//!
//! `--data shakespeare` is `data/shakespeare-10-plays.txt.gz` (1,271,402 characters, 80 symbols;
//! built into the binary, see [`crate::data::bundled`]); `--data text --data-file PATH` is any
//! UTF-8 file, read with at most [`BYTES_PER_TEXT_BYTE`] bytes of memory per byte of text.
//!
//! This is `--tokenizer char`; the other tokenizers (`data/tokenizer.rs`) split the text at the
//! same character ([`split_chars`]) and draw their windows, counted in tokens, with the same
//! functions (`train_starts`, `val_starts`, `windows`; see `data/token_corpus.rs`).

use crate::{Error, Result};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::path::{Path, PathBuf};

/// The most distinct characters a corpus may have (the model's output layer is `[d, V]`; a text
/// with more symbols is usually not what a character model is meant for, e.g. binary data).
pub const MAX_VOCAB: usize = 4096;

/// The largest corpus read, in bytes after unpacking (1 GiB).
pub const MAX_TEXT_BYTES: u64 = 1 << 30;

/// The bundled Shakespeare file's name inside the data directory.
pub const SHAKESPEARE_FILE: &str = "shakespeare-10-plays.txt.gz";

/// Bytes of memory a corpus takes per byte of its text while it is built: the text itself and
/// one 4-byte id per character (ASCII's worst case). [`CharCorpus::load`] reads at most the
/// memory limit divided by this.
pub const BYTES_PER_TEXT_BYTE: u64 = 5;

/// Reads the UTF-8 text of `path` (plain or gzip) in chunks, refusing it at the first invalid
/// byte, at the first NUL byte (binary data such as `/dev/zero`, not text), or once it holds
/// more than `cap` bytes, so a wrong file costs at most one chunk past the point where it went
/// wrong.
fn read_text(path: &Path, cap: u64) -> Result<String> {
    use std::io::Read;
    let (mut stream, gzip) = crate::data::idx::open(path)?;
    let mut bytes: Vec<u8> = Vec::new();
    let mut chunk = vec![0u8; 1 << 20];
    // bytes before `checked` are valid UTF-8 (a character cut by a chunk's end is checked
    // with the next chunk)
    let mut checked = 0usize;
    loop {
        let n = stream
            .read(&mut chunk)
            .map_err(|e| crate::data::idx::read_err(path, gzip, e))?;
        if n == 0 {
            break;
        }
        if (bytes.len() + n) as u64 > cap {
            return Err(err(
                path,
                format!(
                    "holds more than {cap} bytes{}, the most a corpus may have here ({} by the memory limit: {} bytes of memory per byte of text)",
                    if gzip { " once unpacked" } else { "" },
                    if cap < MAX_TEXT_BYTES {
                        "set"
                    } else {
                        "capped"
                    },
                    BYTES_PER_TEXT_BYTE
                ),
            ));
        }
        bytes.extend_from_slice(&chunk[..n]);
        match std::str::from_utf8(&bytes[checked..]) {
            Ok(_) => checked = bytes.len(),
            Err(e) if e.error_len().is_none() => checked += e.valid_up_to(),
            Err(e) => {
                return Err(err(
                    path,
                    format!(
                        "not UTF-8 text (invalid byte at offset {})",
                        checked + e.valid_up_to()
                    ),
                ));
            }
        }
        let start = bytes.len() - n;
        if let Some(i) = bytes[start..].iter().position(|&b| b == 0) {
            return Err(err(
                path,
                format!("a NUL byte at offset {}: binary data, not text", start + i),
            ));
        }
    }
    String::from_utf8(bytes).map_err(|e| {
        err(
            path,
            format!(
                "not UTF-8 text (it ends inside a character, at offset {})",
                e.utf8_error().valid_up_to()
            ),
        )
    })
}

/// A character corpus split for training.
#[derive(Clone, Debug)]
pub struct CharCorpus {
    /// the vocabulary: sorted distinct characters; id i is `vocab[i]`
    pub vocab: Vec<char>,
    /// the first 90% of the text, as ids
    pub train: Vec<i32>,
    /// the last 10%, as ids
    pub val: Vec<i32>,
    /// where the text came from
    pub source: PathBuf,
}

fn err(path: &Path, what: impl std::fmt::Display) -> Error {
    Error::Io(format!("{}: {what}", path.display()))
}

impl CharCorpus {
    /// Reads `path` (UTF-8, plain or gzip) and splits it for windows of `block` characters.
    ///
    /// # Errors
    /// A file that cannot be read, corrupt gzip, more than [`MAX_TEXT_BYTES`], text that is not
    /// UTF-8, and everything [`CharCorpus::from_text`] refuses; each names the file.
    pub fn load(path: &Path, block: usize) -> Result<CharCorpus> {
        let text = load_text(path)?;
        CharCorpus::from_text(&text, block, path)
    }

    /// Builds the vocabulary of `text` and splits it 90/10 for windows of `block` characters.
    ///
    /// # Errors
    /// `block` = 0, an empty text, a vocabulary over [`MAX_VOCAB`], or a split shorter than
    /// `block + 1` characters (each names `source`).
    pub fn from_text(text: &str, block: usize, source: &Path) -> Result<CharCorpus> {
        if block == 0 {
            return Err(Error::Invalid("--block must be at least 1".into()));
        }
        // the vocabulary from one pass that marks each character seen, then the ids from a
        // second: no copy of the text as characters (4 bytes each) is ever made
        let mut seen = vec![false; char::MAX as usize + 1];
        let mut count = 0usize;
        for c in text.chars() {
            seen[c as usize] = true;
            count += 1;
        }
        if count == 0 {
            return Err(err(source, "the text is empty"));
        }
        let vocab: Vec<char> = (0..seen.len() as u32)
            .filter(|&c| seen[c as usize])
            .filter_map(char::from_u32)
            .collect();
        drop(seen);
        if vocab.len() > MAX_VOCAB {
            return Err(err(
                source,
                format!(
                    "{} distinct characters, more than the {MAX_VOCAB} a character model here takes",
                    vocab.len()
                ),
            ));
        }
        let mut ids = crate::memory::try_vec::<i32>(count)?;
        ids.extend(
            text.chars()
                .map(|c| vocab.binary_search(&c).map(|i| i as i32).unwrap_or(0)),
        );
        let split = split_chars(count);
        let val = ids.split_off(split);
        let train = ids;
        let shortest = train.len().min(val.len());
        if shortest < block + 1 {
            return Err(err(
                source,
                format!(
                    "{} characters: the 90%/10% split leaves {} for training and {} for validation, and a window of --block {block} needs {} in each (give a longer text or a smaller --block)",
                    count,
                    train.len(),
                    val.len(),
                    block + 1
                ),
            ));
        }
        Ok(CharCorpus {
            vocab,
            train,
            val,
            source: source.to_path_buf(),
        })
    }

    /// The vocabulary size V.
    pub fn vocab_size(&self) -> usize {
        self.vocab.len()
    }

    /// The ids of `text`.
    ///
    /// # Errors
    /// A character outside the vocabulary (the error names it and its position).
    pub fn encode(&self, text: &str) -> Result<Vec<i32>> {
        encode(&self.vocab, text)
    }

    /// The text of `ids` (ids outside the vocabulary become U+FFFD).
    pub fn decode(&self, ids: &[i32]) -> String {
        decode(&self.vocab, ids)
    }

    /// Training batch number `step`: `batch` windows of `block` characters at positions drawn
    /// from `(seed, step)`. Returns `(x, y)`, each `batch·block` ids, row-major `[batch, block]`.
    pub fn train_batch(
        &self,
        batch: usize,
        block: usize,
        seed: u64,
        step: u64,
    ) -> (Vec<i32>, Vec<i32>) {
        let starts = train_starts(self.train.len(), batch, block, seed, step);
        windows(&self.train, &starts, block)
    }

    /// The fixed validation windows: `count` start positions drawn once from `seed` (the same
    /// for every evaluation of every run with this seed).
    pub fn val_windows(&self, count: usize, block: usize, seed: u64) -> Vec<usize> {
        val_starts(self.val.len(), count, block, seed)
    }

    /// The validation batch of windows starting at `starts`: `(x, y)` as in
    /// [`CharCorpus::train_batch`].
    pub fn val_batch(&self, starts: &[usize], block: usize) -> (Vec<i32>, Vec<i32>) {
        windows(&self.val, starts, block)
    }
}

/// The ids of `text` in `vocab` (sorted).
///
/// # Errors
/// A character outside the vocabulary, named with its position.
pub fn encode(vocab: &[char], text: &str) -> Result<Vec<i32>> {
    text.chars()
        .enumerate()
        .map(|(i, c)| {
            vocab.binary_search(&c).map(|id| id as i32).map_err(|_| {
                Error::Invalid(format!(
                    "character {c:?} (U+{:04X}) at position {i} is not in the model's vocabulary of {} characters",
                    c as u32,
                    vocab.len()
                ))
            })
        })
        .collect()
}

/// The text of `ids` in `vocab` (ids outside it become U+FFFD).
pub fn decode(vocab: &[char], ids: &[i32]) -> String {
    ids.iter()
        .map(|&i| {
            usize::try_from(i)
                .ok()
                .and_then(|i| vocab.get(i))
                .copied()
                .unwrap_or('\u{FFFD}')
        })
        .collect()
}

/// Reads the UTF-8 text of `path` (plain or gzip) for a corpus: at most [`MAX_TEXT_BYTES`],
/// and at most the memory limit divided by [`BYTES_PER_TEXT_BYTE`] (the text, then one 4-byte
/// id per character).
///
/// # Errors
/// A file that cannot be read, corrupt gzip, a text over the cap, text that is not UTF-8 or
/// holds a NUL byte; each names the file.
pub fn load_text(path: &Path) -> Result<String> {
    let limit = crate::memory::memory_limit()?;
    let cap = MAX_TEXT_BYTES.min(limit.bytes / BYTES_PER_TEXT_BYTE);
    read_text(path, cap)
}

/// Where the training split of a text of `chars` characters ends: the first 90% of its
/// characters train, the rest validate (every tokenizer splits here, so the validation text is
/// the same whatever the tokens; see `data/token_corpus.rs`).
pub fn split_chars(chars: usize) -> usize {
    chars * 9 / 10
}

/// The starts of training batch `step`'s `batch` windows of `block` ids in a split of `len`
/// ids, drawn from `(seed, step)`.
pub(crate) fn train_starts(
    len: usize,
    batch: usize,
    block: usize,
    seed: u64,
    step: u64,
) -> Vec<usize> {
    let mut rng = ChaCha8Rng::seed_from_u64(
        seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ step.wrapping_add(0x7472_6169_6e00),
    );
    (0..batch)
        .map(|_| rng.random_range(0..len - block))
        .collect()
}

/// The starts of `count` fixed validation windows of `block` ids in a split of `len` ids,
/// drawn once from `seed`.
pub(crate) fn val_starts(len: usize, count: usize, block: usize, seed: u64) -> Vec<usize> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x7661_6c69_6400);
    (0..count)
        .map(|_| rng.random_range(0..len - block))
        .collect()
}

/// Inputs and next-character targets of the windows of `data` at `starts`.
pub(crate) fn windows(data: &[i32], starts: &[usize], block: usize) -> (Vec<i32>, Vec<i32>) {
    let mut x = Vec::with_capacity(starts.len() * block);
    let mut y = Vec::with_capacity(starts.len() * block);
    for &s in starts {
        x.extend_from_slice(&data[s..s + block]);
        y.extend_from_slice(&data[s + 1..s + block + 1]);
    }
    (x, y)
}
