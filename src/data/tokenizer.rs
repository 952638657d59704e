//! Tokenizers for the language models (`moegrad train --tokenizer`): how a text becomes the ids
//! a model reads, and back.
//!
//! * **`char`** (the default): one id per character, the id being the character's place in the
//!   sorted list of the distinct characters of the whole text ([`crate::data::text`]). A
//!   character model never meets an unknown symbol in its own text, but refuses a prompt
//!   character it has never seen.
//! * **`bpe:N`**: a byte-level byte-pair encoding of at most `N` tokens, trained with Hugging
//!   Face's [`tokenizers`] crate (the library GPT-2, Llama and Qwen tokenizers are built
//!   with) on the *training split only*. The text is first seen as UTF-8 bytes, each byte
//!   written as one of 256 printable characters (GPT-2's byte-to-unicode table), and cut into
//!   words by GPT-2's pattern (letters, digits, punctuation, whitespace runs; no space is added
//!   in front). The vocabulary starts as the 256 bytes, so every text can be encoded, whatever
//!   characters it holds; training then adds the most frequent adjacent pair of tokens inside
//!   words, again and again, until there are `N` tokens (fewer if the text runs out of pairs).
//!   Decoding maps the tokens back to bytes and the bytes to UTF-8: encode → decode gives the
//!   text back exactly. A token of `bpe:512` is about 1.9 characters of the bundled
//!   Shakespeare (GPT-2's 50,257 tokens: about 4 of English), so a window of `--block` tokens
//!   sees that much more text than a character model's.
//! * **a `tokenizer.json` file** (any path ending in `.json`): a Hugging Face tokenizer as
//!   `tokenizers` saves it (GPT-2's, Llama's, one trained elsewhere), loaded with
//!   [`tokenizers::Tokenizer::from_file`]. Special tokens are not added when text is encoded.
//!   A tokenizer whose normalizer changes the text (lowercasing, Unicode normalization) or
//!   that maps unknown characters to an unknown token decodes to the text as it saw it, not
//!   to the original.
//!
//! A checkpoint holds its tokenizer, so sampling needs nothing else ([`Tokenizer::annotate`],
//! [`Tokenizer::from_metadata`]): a character model's vocabulary under the metadata key
//! `vocab` (as before tokenizers existed, so older checkpoints still load), any other the
//! tokenizer's JSON under `tokenizer`: the string `tokenizers` reads, so Python gets it back
//! with `safe_open(path, "np").metadata()["tokenizer"]`.
//!
//! To compare models with different tokens, [`Tokenizer::encode_counting_chars`] also says how
//! many characters of the text each token stands for (each character counted once, with the
//! first token that covers it; characters a tokenizer drops go to the next token), so a loss
//! in nats per token can be turned into bits per character.

use crate::{Error, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tokenizers::models::TrainerWrapper;
use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{DecoderWrapper, ModelWrapper, NormalizerWrapper, PostProcessorWrapper};
use tokenizers::{PreTokenizerWrapper, TokenizerImpl};

/// The smallest `bpe:N`: the 256 bytes and at least one merge.
pub const MIN_BPE_VOCAB: usize = 257;

/// The largest `bpe:N` (GPT-2's 50,257 fits; a larger vocabulary trained on a corpus of this
/// size would be mostly unused rows of the output layer).
pub const MAX_BPE_VOCAB: usize = 65_536;

/// The most tokens a `tokenizer.json` may have (Qwen2's 151,646 fits).
pub const MAX_FILE_VOCAB: usize = 1 << 18;

/// The metadata key of a non-character tokenizer's JSON in a checkpoint.
pub const TOKENIZER_KEY: &str = "tokenizer";

/// The metadata key of a character model's vocabulary (its characters, sorted).
pub const VOCAB_KEY: &str = "vocab";

/// The text is encoded in pieces of about this many bytes, so the tokenizer's per-token
/// bookkeeping never holds more than a piece (see [`pieces`]).
const PIECE_BYTES: usize = 1 << 16;

/// Pieces encoded by one call (in parallel by `tokenizers`): 1 MiB of text, whose encodings
/// (about 100 bytes per token while they are built) take some tens of megabytes.
const PIECES_PER_BATCH: usize = 16;

/// What `--tokenizer` asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TokenizerSpec {
    /// one id per character
    Char,
    /// a byte-level BPE of at most this many tokens, trained on the training split
    Bpe(usize),
    /// a Hugging Face `tokenizer.json`
    File(PathBuf),
}

impl TokenizerSpec {
    /// Reads `char`, `bpe:N` or a path ending in `.json`.
    ///
    /// # Errors
    /// Anything else, and `N` outside [[`MIN_BPE_VOCAB`], [`MAX_BPE_VOCAB`]] (each names the
    /// value given). Whether a file exists is checked when it is read, not here.
    pub fn parse(s: &str) -> Result<TokenizerSpec> {
        let bad = |why: String| Err(Error::Invalid(format!("--tokenizer {s:?}: {why}")));
        if s == "char" {
            return Ok(TokenizerSpec::Char);
        }
        if let Some(n) = s.strip_prefix("bpe:") {
            let Ok(n) = n.trim().parse::<usize>() else {
                return bad(format!(
                    "the vocabulary size {n:?} is not a whole number (expected bpe:N, e.g. bpe:512)"
                ));
            };
            if !(MIN_BPE_VOCAB..=MAX_BPE_VOCAB).contains(&n) {
                return bad(format!(
                    "a byte-level BPE's vocabulary must lie between {MIN_BPE_VOCAB} (the 256 bytes and one merge) and {MAX_BPE_VOCAB}, got {n}"
                ));
            }
            return Ok(TokenizerSpec::Bpe(n));
        }
        if s.ends_with(".json") {
            return Ok(TokenizerSpec::File(PathBuf::from(s)));
        }
        bad("expected char, bpe:N (a byte-level BPE of N tokens trained on the text) or the path of a Hugging Face tokenizer.json".into())
    }
}

/// The concrete Hugging Face tokenizer type (`tokenizers::Tokenizer` derefs to it).
type HfImpl = TokenizerImpl<
    ModelWrapper,
    NormalizerWrapper,
    PreTokenizerWrapper,
    PostProcessorWrapper,
    DecoderWrapper,
>;

#[derive(Clone, Debug)]
enum Kind {
    /// the sorted distinct characters; id i is `chars[i]`
    Char(Vec<char>),
    /// a Hugging Face tokenizer and its vocabulary size (largest id + 1)
    Hf(Box<tokenizers::Tokenizer>, usize),
}

/// A text ↔ ids mapping (see the module docs).
#[derive(Clone, Debug)]
pub struct Tokenizer {
    kind: Kind,
}

/// A `tokenizers` error as a moegrad one, naming what was being done.
fn hf_err(what: impl std::fmt::Display, e: impl std::fmt::Display) -> Error {
    Error::Invalid(format!("{what}: {e}"))
}

impl Tokenizer {
    /// The character tokenizer of `vocab` (sorted, distinct).
    pub fn chars(vocab: Vec<char>) -> Tokenizer {
        Tokenizer {
            kind: Kind::Char(vocab),
        }
    }

    /// Trains a byte-level BPE of at most `vocab` tokens on `text` (see the module docs).
    ///
    /// # Errors
    /// `vocab` outside [[`MIN_BPE_VOCAB`], [`MAX_BPE_VOCAB`]], or a failure of `tokenizers`.
    pub fn train_bpe(text: &str, vocab: usize) -> Result<Tokenizer> {
        TokenizerSpec::parse(&format!("bpe:{vocab}"))?;
        let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
            .vocab_size(vocab)
            .min_frequency(0)
            .show_progress(false)
            .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
            .build()
            .into();
        let mut hf: HfImpl = TokenizerImpl::new(BPE::default().into());
        // no space added in front of the text, offsets as they are: encode → decode is exact
        hf.with_pre_tokenizer(Some(ByteLevel::new(false, false, true)));
        hf.with_decoder(Some(ByteLevel::new(false, false, true)));
        hf.train(&mut trainer, pieces(text, PIECE_BYTES))
            .map_err(|e| {
                hf_err(
                    format_args!("training a byte-level BPE of {vocab} tokens"),
                    e,
                )
            })?;
        Tokenizer::from_hf(tokenizers::Tokenizer::from(hf), "the trained BPE")
    }

    /// Loads a Hugging Face `tokenizer.json`.
    ///
    /// # Errors
    /// A file that cannot be read or is not a tokenizer's JSON, or one of more than
    /// [`MAX_FILE_VOCAB`] tokens (each names the file).
    pub fn from_file(path: &Path) -> Result<Tokenizer> {
        let json = std::fs::read_to_string(path).map_err(|e| {
            Error::Io(format!(
                "--tokenizer {}: cannot read the tokenizer file: {e}",
                path.display()
            ))
        })?;
        Tokenizer::from_json(&json, &format!("--tokenizer {}", path.display()))
    }

    /// A Hugging Face tokenizer from its JSON; `source` names where it came from in errors.
    ///
    /// # Errors
    /// JSON that is not a `tokenizers` tokenizer, or more than [`MAX_FILE_VOCAB`] tokens.
    pub fn from_json(json: &str, source: &str) -> Result<Tokenizer> {
        let hf: tokenizers::Tokenizer = json.parse().map_err(|e| {
            hf_err(
                format_args!("{source}: not a Hugging Face tokenizer.json"),
                e,
            )
        })?;
        Tokenizer::from_hf(hf, source)
    }

    fn from_hf(hf: tokenizers::Tokenizer, source: &str) -> Result<Tokenizer> {
        let size = hf
            .get_vocab(true)
            .values()
            .max()
            .map_or(0, |&m| m as usize + 1);
        if size == 0 || size > MAX_FILE_VOCAB {
            return Err(Error::Invalid(format!(
                "{source}: a vocabulary of {size} tokens; a language model here takes 1 to {MAX_FILE_VOCAB}"
            )));
        }
        Ok(Tokenizer {
            kind: Kind::Hf(Box::new(hf), size),
        })
    }

    /// Builds what `spec` asks for; `train_text` is the training split a BPE is trained on.
    ///
    /// # Errors
    /// As [`Tokenizer::train_bpe`] and [`Tokenizer::from_file`]. `Char` is built from the whole
    /// text by [`crate::data::text::CharCorpus`], not here: it is refused.
    pub fn build(spec: &TokenizerSpec, train_text: &str) -> Result<Tokenizer> {
        match spec {
            TokenizerSpec::Char => Err(Error::Invalid(
                "the character tokenizer is built with the corpus (CharCorpus)".into(),
            )),
            TokenizerSpec::Bpe(n) => Tokenizer::train_bpe(train_text, *n),
            TokenizerSpec::File(path) => Tokenizer::from_file(path),
        }
    }

    /// The number of ids (the model's vocabulary size V).
    pub fn vocab_size(&self) -> usize {
        match &self.kind {
            Kind::Char(v) => v.len(),
            Kind::Hf(_, n) => *n,
        }
    }

    /// A character tokenizer's characters (id i is the i-th); `None` for the others.
    pub fn char_vocab(&self) -> Option<&[char]> {
        match &self.kind {
            Kind::Char(v) => Some(v),
            Kind::Hf(..) => None,
        }
    }

    /// The Hugging Face tokenizer's JSON (as `tokenizer.json` holds it); `None` for `char`.
    ///
    /// # Errors
    /// A failure of `tokenizers` to serialise it.
    pub fn to_json(&self) -> Result<Option<String>> {
        match &self.kind {
            Kind::Char(_) => Ok(None),
            Kind::Hf(hf, _) => hf
                .to_string(false)
                .map(Some)
                .map_err(|e| hf_err("serialising the tokenizer", e)),
        }
    }

    /// Stores the tokenizer in a checkpoint's metadata: `vocab` (char) or `tokenizer` (JSON).
    ///
    /// # Errors
    /// As [`Tokenizer::to_json`].
    pub fn annotate(&self, metadata: &mut BTreeMap<String, String>) -> Result<()> {
        match &self.kind {
            Kind::Char(v) => {
                metadata.insert(VOCAB_KEY.into(), v.iter().collect());
            }
            Kind::Hf(..) => {
                metadata.insert(TOKENIZER_KEY.into(), self.to_json()?.unwrap_or_default());
            }
        }
        Ok(())
    }

    /// The tokenizer a checkpoint's metadata holds (`path` names the checkpoint in errors):
    /// its `tokenizer` JSON, or else its `vocab` of characters.
    ///
    /// # Errors
    /// Neither key; a vocabulary that is not sorted distinct characters; JSON that is not a
    /// tokenizer.
    pub fn from_metadata(metadata: &BTreeMap<String, String>, path: &Path) -> Result<Tokenizer> {
        if let Some(json) = metadata.get(TOKENIZER_KEY) {
            return Tokenizer::from_json(
                json,
                &format!("{}: the tokenizer in the metadata", path.display()),
            )
            .map_err(|e| Error::Io(e.to_string()));
        }
        let vocab: Vec<char> = metadata
            .get(VOCAB_KEY)
            .ok_or_else(|| {
                Error::Io(format!(
                    "{}: no vocab or tokenizer in the metadata: not a checkpoint of moegrad train --model gpt|moe-gpt",
                    path.display()
                ))
            })?
            .chars()
            .collect();
        if vocab.is_empty() || vocab.windows(2).any(|w| w[0] >= w[1]) {
            return Err(Error::Io(format!(
                "{}: the vocabulary in the metadata is not a sorted list of distinct characters",
                path.display()
            )));
        }
        Ok(Tokenizer::chars(vocab))
    }

    /// The ids of `text`.
    ///
    /// # Errors
    /// `char`: a character outside the vocabulary (named with its position); a failure of
    /// `tokenizers`.
    pub fn encode(&self, text: &str) -> Result<Vec<i32>> {
        match &self.kind {
            Kind::Char(v) => crate::data::text::encode(v, text),
            Kind::Hf(..) => Ok(self.encode_counting_chars(text)?.0),
        }
    }

    /// The ids of `text`, and for each id the number of characters of `text` it stands for
    /// (summing to the text's length; see the module docs). The text is encoded in pieces of
    /// about 64 KiB cut before a newline that follows a non-space, where the byte-level
    /// pattern splits words anyway, so the ids are those of the whole text at once.
    ///
    /// # Errors
    /// As [`Tokenizer::encode`]; more ids than memory allows.
    pub fn encode_counting_chars(&self, text: &str) -> Result<(Vec<i32>, Vec<u32>)> {
        let hf = match &self.kind {
            Kind::Char(v) => {
                let ids = crate::data::text::encode(v, text)?;
                let ones = vec![1; ids.len()];
                return Ok((ids, ones));
            }
            Kind::Hf(hf, _) => hf,
        };
        let all: Vec<&str> = pieces(text, PIECE_BYTES).collect();
        let mut ids = Vec::new();
        let mut chars: Vec<u32> = Vec::new();
        // characters not yet given to a token (a dropped space, the end of a piece)
        let mut pending = 0u64;
        for batch in all.chunks(PIECES_PER_BATCH) {
            let encodings = hf
                .encode_batch_char_offsets(batch.to_vec(), false)
                .map_err(|e| hf_err("encoding the text", e))?;
            for (piece, enc) in batch.iter().zip(&encodings) {
                let mut covered = 0usize;
                ids.reserve(enc.get_ids().len());
                chars.reserve(enc.get_ids().len());
                for (&id, &(_, end)) in enc.get_ids().iter().zip(enc.get_offsets()) {
                    let own = end.saturating_sub(covered) as u64 + pending;
                    covered = covered.max(end);
                    pending = 0;
                    ids.push(i32::try_from(id).map_err(|_| {
                        Error::Invalid(format!("token id {id} does not fit an i32"))
                    })?);
                    chars.push(u32::try_from(own).unwrap_or(u32::MAX));
                }
                pending += (piece.chars().count() - covered.min(piece.chars().count())) as u64;
            }
        }
        if let Some(last) = chars.last_mut() {
            *last = last.saturating_add(u32::try_from(pending).unwrap_or(u32::MAX));
        }
        Ok((ids, chars))
    }

    /// The text of `ids` (a character tokenizer writes U+FFFD for an id outside it).
    ///
    /// # Errors
    /// A failure of `tokenizers` (an id it does not know).
    pub fn decode(&self, ids: &[i32]) -> Result<String> {
        match &self.kind {
            Kind::Char(v) => Ok(crate::data::text::decode(v, ids)),
            Kind::Hf(hf, _) => {
                let ids: Vec<u32> = ids.iter().map(|&i| i.max(0) as u32).collect();
                hf.decode(&ids, false)
                    .map_err(|e| hf_err("decoding ids", e))
            }
        }
    }

    /// A decoder fed one id at a time that gives back the text as soon as it is whole (a
    /// byte-level token may end inside a character), for streaming samples.
    pub fn stream(&self) -> TextStream<'_> {
        TextStream {
            inner: match &self.kind {
                Kind::Char(v) => Stream::Char(v),
                Kind::Hf(hf, _) => Stream::Hf(Box::new(hf.decode_stream(false))),
            },
        }
    }
}

enum Stream<'a> {
    Char(&'a [char]),
    Hf(
        Box<
            tokenizers::tokenizer::DecodeStream<
                'a,
                ModelWrapper,
                NormalizerWrapper,
                PreTokenizerWrapper,
                PostProcessorWrapper,
                DecoderWrapper,
            >,
        >,
    ),
}

/// [`Tokenizer::stream`]'s decoder.
pub struct TextStream<'a> {
    inner: Stream<'a>,
}

impl TextStream<'_> {
    /// The text `id` completes (empty while a character is still unfinished).
    ///
    /// # Errors
    /// A failure of `tokenizers`.
    pub fn step(&mut self, id: i32) -> Result<String> {
        match &mut self.inner {
            Stream::Char(v) => Ok(crate::data::text::decode(v, &[id])),
            Stream::Hf(s) => Ok(s
                .step(id.max(0) as u32)
                .map_err(|e| hf_err("decoding ids", e))?
                .unwrap_or_default()),
        }
    }
}

/// `text` in pieces of at least `bytes` bytes (the last may be shorter), each cut just before
/// a newline that follows a non-whitespace character: no word of the byte-level pattern
/// spans such a point, so encoding the pieces gives the ids of the whole text. A text with no
/// such point is one piece.
pub fn pieces(text: &str, bytes: usize) -> impl Iterator<Item = &str> + Send {
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let b = rest.as_bytes();
        let mut cut = rest.len();
        let mut i = bytes.max(1);
        while i < b.len() {
            if b[i] == b'\n'
                && rest[..i]
                    .chars()
                    .next_back()
                    .is_some_and(|c| !c.is_whitespace())
            {
                cut = i;
                break;
            }
            i += 1;
        }
        let (head, tail) = rest.split_at(cut);
        rest = tail;
        Some(head)
    })
}
