//! Tutorial chapter 6 (`docs/tutorial/06-language-model.md`): a character-level GPT whose
//! feed-forward blocks are MoE layers (`moe-gpt`), trained for a few steps on the bundled
//! Shakespeare with the library API of `moegrad::lm`, then sampled. The model is tiny so that
//! the example takes seconds; the chapter gives the `moegrad train` / `moegrad generate`
//! commands for the real thing.
//!
//! Run with `cargo run --release --example tutorial_06_lm`.

use moegrad::data::Tokenizer;
use moegrad::data::text::CharCorpus;
use moegrad::lm::{FeedForward, Gpt, GptConfig, LanguageModel, SampleOptions, generate};
use moegrad::moe::MoeConfig;
use moegrad::nn::Parameters;
use moegrad::optim::Adam;
use moegrad::train::train_step;
use moegrad::{Device, Tensor};
use std::path::Path;

/// Context length, batch size and training steps of this toy run.
const BLOCK: usize = 32;
const BATCH: usize = 8;
const STEPS: u64 = 150;

fn main() -> moegrad::Result<()> {
    let cpu = Device::cpu();
    // 1. The data: the ten plays, a character vocabulary, 90% / 10% split.
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/shakespeare-10-plays.txt.gz");
    let corpus = CharCorpus::load(&path, BLOCK)?;
    let vocab = corpus.vocab_size();
    println!(
        "{}: {} training characters, vocabulary of {vocab}",
        path.display(),
        corpus.train.len()
    );

    // 2. The model: 2 blocks of width 32, 2 heads; every feed-forward block an MoE layer of
    // 4 experts (hidden 32), top-2 routing with the Switch balance loss.
    let mut moe = MoeConfig::new(32, 32, 4, 2);
    moe.balance_loss = 0.01;
    let cfg = GptConfig {
        vocab,
        block: BLOCK,
        layers: 2,
        heads: 2,
        d_model: 32,
        ffn: FeedForward::Moe {
            layer: Box::new(moe),
            every: 1,
            dense_hidden: 128,
        },
        seed: 0,
    };
    cfg.validate()?;
    // LanguageModel holds either architecture (the GPT here, or a Llama-style Decoder)
    let model = LanguageModel::Gpt(Gpt::new(&cfg, cpu)?);
    println!(
        "moe-gpt: {} parameters, {} active per token",
        model.num_params(),
        model.active_params_per_token()
    );

    // 3. Training: each step draws BATCH windows, predicts every next character, and takes
    // one Adam step on the mean cross-entropy plus the balance loss. (The CPU backend runs its
    // large kernels on its own worker threads; the loop needs nothing for that.)
    let params = model.named_params();
    let mut opt = Adam::new(3e-3)?;
    let (first, last_losses) = {
        let mut first = None;
        let mut last_losses = Vec::new();
        for step in 0..STEPS {
            model.set_training(true);
            let (x, y) = corpus.train_batch(BATCH, BLOCK, 1, step);
            let x = Tensor::from_i32(x, &[BATCH, BLOCK], cpu)?;
            let y = Tensor::from_i32(y, &[BATCH * BLOCK], cpu)?;
            let out = train_step(&model, &params, &mut opt, &x, &[y], 1.0)?;
            let ce = out.task_loss.item()?;
            assert!(ce.is_finite(), "step {step}: cross-entropy {ce}");
            first.get_or_insert(ce);
            if step >= STEPS - 10 {
                last_losses.push(ce);
            }
            if step % 10 == 0 || step == STEPS - 1 {
                println!("step {step:3}: cross-entropy {ce:.3}");
            }
        }
        (first, last_losses)
    };
    // At initialisation the model guesses uniformly: about ln V nats per character.
    let first = first.unwrap_or(f64::NAN);
    let uniform = (vocab as f64).ln();
    assert!(
        (first - uniform).abs() < 0.5,
        "initial loss {first} vs ln V = {uniform}"
    );
    let last = last_losses.iter().sum::<f64>() / last_losses.len() as f64;
    assert!(
        last < first - 0.5,
        "training did not learn: {first:.3} -> {last:.3}"
    );
    println!("cross-entropy {first:.3} (ln V = {uniform:.3}) -> {last:.3} over the last 10 steps");

    // 4. Sampling: the model continues a prompt one character at a time.
    let opts = SampleOptions {
        tokens: 80,
        ..SampleOptions::default()
    };
    let tokenizer = Tokenizer::chars(corpus.vocab.clone());
    let text = generate(&model, &tokenizer, "ROMEO:", &opts, cpu, |_| {})?;
    assert_eq!(text.chars().count(), 80);
    assert!(text.chars().all(|c| corpus.vocab.contains(&c)));
    println!("ROMEO:{text}");
    // The same seed gives the same text.
    let again = generate(&model, &tokenizer, "ROMEO:", &opts, cpu, |_| {})?;
    assert_eq!(
        text, again,
        "sampling with a fixed seed must be reproducible"
    );

    println!("tutorial_06_lm: all checks passed");
    Ok(())
}
