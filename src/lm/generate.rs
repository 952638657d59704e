//! Sampling text from a trained language model (`moegrad generate`).
//!
//! The prompt is encoded with the model's tokenizer. Each step runs the model on the last
//! `block` tokens, takes the logits of the last position, divides them by the temperature,
//! keeps the `top_k` largest (0: all), and draws the next token from their softmax with a
//! generator seeded by `seed`: the same model, prompt and seed give the same text on the same
//! device. Tokens are decoded as they are drawn (a byte-level token may end inside a
//! character; its text comes with the token that completes it).

use super::language_model::LanguageModel;
use crate::data::Tokenizer;
use crate::nn::Parameters;
use crate::{Device, Error, Result, Tensor};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The most tokens one call generates (`--tokens`): a million, a few megabytes of text, far
/// more than a model of this size writes coherently.
pub const MAX_TOKENS: usize = 1_000_000;

/// How to sample.
#[derive(Clone, Debug, PartialEq)]
pub struct SampleOptions {
    /// tokens to generate
    pub tokens: usize,
    /// softmax temperature (> 0; below 1 sharpens, above 1 flattens)
    pub temperature: f64,
    /// keep only the k most likely tokens (0: all)
    pub top_k: usize,
    /// seed of the draws
    pub seed: u64,
}

impl Default for SampleOptions {
    fn default() -> Self {
        SampleOptions {
            tokens: 300,
            temperature: 0.8,
            top_k: 40,
            seed: 1,
        }
    }
}

/// The index drawn from `logits` after temperature and top-k, with `u` uniform in [0, 1).
pub fn sample_index(logits: &[f64], temperature: f64, top_k: usize, u: f64) -> usize {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    // largest first; ties by lower index
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    let keep = if top_k == 0 {
        order.len()
    } else {
        top_k.min(order.len())
    };
    let kept = &order[..keep];
    let max = logits[kept[0]] / temperature;
    let weights: Vec<f64> = kept
        .iter()
        .map(|&i| (logits[i] / temperature - max).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    let mut acc = 0.0;
    for (w, &i) in weights.iter().zip(kept) {
        acc += w / total;
        if u < acc {
            return i;
        }
    }
    kept[keep - 1]
}

/// Generates `opts.tokens` tokens after `prompt`, calling `emit` with the text of each as it
/// is drawn, and returns their text. The model is switched to evaluation mode.
///
/// # Errors
/// More than [`MAX_TOKENS`] tokens, an empty prompt, a prompt character outside a character
/// model's vocabulary (named), a temperature that is not a positive finite number, logits that are not finite
/// (weights too large for f32), or an error of the model.
pub fn generate(
    model: &LanguageModel,
    tokenizer: &Tokenizer,
    prompt: &str,
    opts: &SampleOptions,
    device: Device,
    mut emit: impl FnMut(&str),
) -> Result<String> {
    if !(opts.temperature.is_finite() && opts.temperature > 0.0) {
        return Err(Error::Invalid(format!(
            "--temperature must be a positive number, got {}",
            opts.temperature
        )));
    }
    if opts.tokens > MAX_TOKENS {
        return Err(Error::Invalid(format!(
            "--tokens {} is more than the {MAX_TOKENS} tokens generate writes in one call",
            opts.tokens
        )));
    }
    if prompt.is_empty() {
        return Err(Error::Invalid(
            "--prompt is empty: give at least one character to start from".into(),
        ));
    }
    let mut ids = tokenizer.encode(prompt)?;
    if ids.is_empty() {
        return Err(Error::Invalid(format!(
            "--prompt {prompt:?} gives no tokens: the tokenizer drops all of it"
        )));
    }
    let mut stream = tokenizer.stream();
    let mut emitted = String::new();
    let block = model.block();
    let mut rng = ChaCha8Rng::seed_from_u64(opts.seed);
    let mut out = Vec::new();
    model.set_training(false);
    let _guard = crate::NoGradGuard::new();
    for _ in 0..opts.tokens {
        let context = &ids[ids.len().saturating_sub(block)..];
        let t = context.len();
        let x = Tensor::from_i32(context.to_vec(), &[1, t], device)?;
        let logits = model.forward(&x)?.logits.slice(0, t - 1, t)?.to_vec_f64()?;
        if let Some(bad) = logits.iter().find(|l| !l.is_finite()) {
            return Err(Error::Invalid(format!(
                "the model's logits for token {} are not finite ({bad}): its weights overflow f32 arithmetic, so nothing can be sampled (is the checkpoint corrupt?)",
                out.len() + 1
            )));
        }
        let next = sample_index(
            &logits,
            opts.temperature,
            opts.top_k,
            rng.random_range(0.0..1.0),
        );
        ids.push(next as i32);
        if ids.len() > 2 * block {
            ids.drain(..ids.len() - block);
        }
        out.push(next as i32);
        let piece = stream.step(next as i32)?;
        emitted.push_str(&piece);
        emit(&piece);
    }
    // bytes that never completed a character (a byte-level sample can end inside one) come
    // out as the decoder writes them
    let text = tokenizer.decode(&out)?;
    if let Some(rest) = text.strip_prefix(emitted.as_str())
        && !rest.is_empty()
    {
        emit(rest);
    }
    Ok(text)
}
