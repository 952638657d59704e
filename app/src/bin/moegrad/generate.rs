//! `moegrad generate`: samples text from a language-model checkpoint.

use super::*;

/// `moegrad generate` options.
#[derive(clap::Args)]
pub(super) struct GenerateArgs {
    /// The checkpoint of a language-model run (its out/checkpoint.safetensors).
    #[arg(long)]
    checkpoint: PathBuf,
    /// The text to continue (for a character model every character must be in its
    /// vocabulary; `\n` and `\t` stand for a newline and a tab) [default: a newline].
    #[arg(long, default_value = "\\n")]
    prompt: String,
    /// Tokens to generate (characters for a character model).
    #[arg(long, default_value_t = 300)]
    tokens: usize,
    /// Softmax temperature (> 0).
    #[arg(long, default_value_t = 0.8, allow_negative_numbers = true)]
    temperature: f64,
    /// Sample among the K most likely tokens (0: all).
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    /// Seed of the draws: the same seed gives the same text.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// auto, cpu or gpu.
    #[arg(long, default_value = "auto")]
    device: String,
}

/// Streams text from a language-model checkpoint to stdout.
pub(super) fn run_generate(args: &GenerateArgs) -> Result<()> {
    use std::io::Write;
    let device = Device::from_name(&args.device)?;
    let (model, tokenizer) = moegrad::lm::load_model(&args.checkpoint, device)?;
    // `--prompt` takes the escapes \n and \t, so a newline can be typed
    let prompt = args.prompt.replace("\\n", "\n").replace("\\t", "\t");
    let opts = moegrad::lm::SampleOptions {
        tokens: args.tokens,
        temperature: args.temperature,
        top_k: args.top_k,
        seed: args.seed,
    };
    // refuse a bad prompt before anything is printed
    tokenizer.encode(&prompt)?;
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let _ = write!(out, "{prompt}");
    moegrad::lm::generate(&model, &tokenizer, &prompt, &opts, device, |text| {
        let _ = write!(out, "{text}");
        let _ = out.flush();
    })?;
    let _ = writeln!(out);
    Ok(())
}
