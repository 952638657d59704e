//! `moegrad import`: a Hugging Face transformers checkpoint written as a moegrad run
//! (`moegrad::lm::import_run`), and `moegrad logits`: a language model's logits for token ids.

use super::*;
use moegrad::nn::Parameters;

/// `moegrad import` options.
#[derive(clap::Args)]
pub(super) struct ImportArgs {
    /// The transformers checkpoint: a directory with config.json and model.safetensors (or the
    /// shards model.safetensors.index.json lists), and tokenizer.json when there is one. Reads
    /// llama, mixtral, qwen2_moe, olmoe, deepseek_v3 and gpt2 (docs/families.md).
    #[arg(long)]
    hf: PathBuf,
    /// The run directory to write (its checkpoint.safetensors is what generate, logits and
    /// train --init-from read).
    #[arg(long)]
    out: PathBuf,
    /// A tokenizer.json to use instead of (or where there is no) DIR/tokenizer.json.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Replace an earlier run's files in --out.
    #[arg(long)]
    overwrite: bool,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

/// Runs `moegrad import`.
pub(super) fn run_import(args: &ImportArgs) -> Result<()> {
    // the import only moves tensors: the CPU holds them wherever the run trains later
    let report = moegrad::lm::import_run(
        &args.hf,
        &args.out,
        args.tokenizer.as_deref(),
        args.overwrite,
        Device::cpu(),
    )?;
    if args.json {
        return print_json(&report);
    }
    println!(
        "imported {} ({}) as --model {}: {} parameters, vocabulary {}, {}; wrote {}",
        args.hf.display(),
        report.model_type,
        report.model,
        report.params,
        report.vocab,
        match report.tokenizer_vocab {
            Some(n) => format!("tokenizer of {n} tokens"),
            None => "no tokenizer (generate needs one: --tokenizer PATH)".into(),
        },
        report.checkpoint.display()
    );
    Ok(())
}

/// `moegrad logits` options.
#[derive(clap::Args)]
pub(super) struct LogitsArgs {
    /// A language-model checkpoint (a training run's or an import's checkpoint.safetensors).
    #[arg(long)]
    checkpoint: PathBuf,
    /// A JSON file of token ids: one sequence `[1, 2, 3]` or several of one length
    /// `[[1, 2], [3, 4]]`.
    #[arg(long, required_unless_present = "text", conflicts_with = "text")]
    ids: Option<PathBuf>,
    /// A text to encode with the checkpoint's tokenizer instead of --ids (`\n` stands for a
    /// newline); the JSON output's `ids` are its tokens.
    #[arg(long)]
    text: Option<String>,
    /// Print every logit as one JSON object `{"shape": [B, T, V], "logits": [[[...]]]}`;
    /// without it, each position's five most likely next tokens.
    #[arg(long)]
    json: bool,
    /// auto, cpu or gpu.
    #[arg(long, default_value = "cpu")]
    device: String,
}

/// The sequences of an ids file (see [`LogitsArgs::ids`]), checked: not empty, one length,
/// every id in `0..vocab`, no longer than `block`.
fn read_ids(path: &std::path::Path, vocab: usize, block: usize) -> Result<Vec<Vec<i32>>> {
    let bad = |why: String| moegrad::Error::Invalid(format!("{}: {why}", path.display()));
    let text = std::fs::read_to_string(path)
        .map_err(|e| moegrad::Error::Io(format!("{}: {e}", path.display())))?;
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
    let as_ids = |v: &serde_json::Value| -> Option<Vec<i64>> {
        v.as_array()?
            .iter()
            .map(serde_json::Value::as_i64)
            .collect()
    };
    let rows: Vec<Vec<i64>> = match value.as_array() {
        Some(items) if items.iter().all(serde_json::Value::is_array) && !items.is_empty() => items
            .iter()
            .map(as_ids)
            .collect::<Option<_>>()
            .ok_or_else(|| bad("expected lists of whole numbers".into()))?,
        Some(_) => {
            vec![as_ids(&value).ok_or_else(|| {
                bad("expected a list of token ids, or a list of such lists".into())
            })?]
        }
        None => return Err(bad("expected a list of token ids".into())),
    };
    let t = rows[0].len();
    if t == 0 || rows.iter().any(|r| r.len() != t) {
        return Err(bad(format!(
            "every sequence needs the same length of at least 1, got lengths {:?}",
            rows.iter().map(Vec::len).collect::<Vec<_>>()
        )));
    }
    if t > block {
        return Err(bad(format!(
            "a sequence of {t} ids is longer than the model's context of {block}"
        )));
    }
    if let Some(id) = rows.iter().flatten().find(|&&i| i < 0 || i >= vocab as i64) {
        return Err(bad(format!(
            "token id {id} is outside the model's vocabulary 0..{vocab}"
        )));
    }
    Ok(rows
        .into_iter()
        .map(|r| r.into_iter().map(|i| i as i32).collect())
        .collect())
}

/// Runs `moegrad logits`.
pub(super) fn run_logits(args: &LogitsArgs) -> Result<()> {
    let device = Device::from_name(&args.device)?;
    let (model, tokenizer) = moegrad::lm::load_checkpoint(&args.checkpoint, device)?;
    let vocab = match model.architecture() {
        moegrad::lm::Architecture::Gpt(g) => g.vocab,
        moegrad::lm::Architecture::Decoder(d) => d.vocab,
    };
    let rows = match (&args.ids, &args.text) {
        (Some(path), _) => read_ids(path, vocab, model.block())?,
        (None, text) => {
            let text = text.as_deref().unwrap_or("").replace("\\n", "\n");
            let tokenizer = tokenizer.as_ref().ok_or_else(|| {
                moegrad::Error::Invalid(format!(
                    "{}: the checkpoint has no tokenizer to encode --text with: give --ids",
                    args.checkpoint.display()
                ))
            })?;
            let ids = tokenizer.encode(&text)?;
            if ids.is_empty() || ids.len() > model.block() {
                return Err(moegrad::Error::Invalid(format!(
                    "--text encodes to {} tokens; the model takes 1 to {}",
                    ids.len(),
                    model.block()
                )));
            }
            vec![ids]
        }
    };
    let (b, t) = (rows.len(), rows[0].len());
    let idx = moegrad::Tensor::from_i32(rows.concat(), &[b, t], device)?;
    model.set_training(false);
    let logits = moegrad::no_grad(|| model.forward(&idx))?
        .logits
        .to_vec_f32()?;
    if args.json {
        let nested: Vec<Vec<&[f32]>> = logits
            .chunks(t * vocab)
            .map(|seq| seq.chunks(vocab).collect())
            .collect();
        return print_json(&serde_json::json!({
            "shape": [b, t, vocab],
            "ids": rows,
            "logits": nested,
        }));
    }
    let show = |id: usize| match &tokenizer {
        Some(tok) => format!("{:?}", tok.decode(&[id as i32]).unwrap_or_default()),
        None => format!("#{id}"),
    };
    for (s, seq) in logits.chunks(t * vocab).enumerate() {
        for (p, row) in seq.chunks(vocab).enumerate() {
            let mut order: Vec<usize> = (0..vocab).collect();
            order.sort_by(|&i, &j| row[j].total_cmp(&row[i]));
            let top: Vec<String> = order
                .iter()
                .take(5)
                .map(|&i| format!("{} {:.3}", show(i), row[i]))
                .collect();
            print_line(&format!(
                "sequence {s}, position {p} (id {}): next {}",
                rows[s][p],
                top.join(", ")
            ));
        }
    }
    Ok(())
}

/// `moegrad export` options.
#[derive(clap::Args)]
pub(super) struct ExportArgs {
    /// A run's checkpoint.safetensors (or an import's): a language model for --format hf, an
    /// image model for --format torch.
    #[arg(long)]
    checkpoint: PathBuf,
    /// hf: a language model as a Hugging Face transformers model directory (config.json,
    /// model.safetensors, generation_config.json, tokenizer.json, tokenizer_config.json) that
    /// AutoModelForCausalLM.from_pretrained and AutoTokenizer load. torch: an image model (mlp,
    /// cnn, moe-mlp, moe-cnn, mmoe-cnn) as model.py (its nn.Module, routers at inference),
    /// config.json and model.safetensors with PyTorch's names and [out, in] layouts.
    #[arg(long, value_enum)]
    format: ExportFormat,
    /// The directory to write: new, or empty (written under a temporary name and renamed, so a
    /// failure leaves nothing behind).
    #[arg(long)]
    out: PathBuf,
    /// How experts are stored: legacy (one tensor per expert and projection, as the Hub's
    /// checkpoints) or stacked (transformers v5's mlp.experts.gate_up_proj / down_proj).
    #[arg(long, value_enum, default_value = "legacy")]
    hf_layout: LayoutArg,
    /// --format torch: also write test_data.safetensors (the test split as the model sees it)
    /// and moegrad_eval.json (moegrad's test accuracy on it), for
    /// scripts/check_torch_export.py; reads the run's data.
    #[arg(long)]
    test_data: bool,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Copy, ValueEnum)]
enum ExportFormat {
    Hf,
    Torch,
}

#[derive(Clone, Copy, ValueEnum)]
enum LayoutArg {
    Legacy,
    Stacked,
}

/// Runs `moegrad export`.
pub(super) fn run_export(args: &ExportArgs) -> Result<()> {
    if let ExportFormat::Torch = args.format {
        let report = moegrad::train::export_torch(&args.checkpoint, &args.out, args.test_data)?;
        if args.json {
            return print_json(&report);
        }
        let accuracy = match &report.test_accuracy {
            Some(acc) => format!(
                "; moegrad's test accuracy on the {} examples of test_data.safetensors: {}",
                report.test_examples.unwrap_or(0),
                acc.iter()
                    .map(|a| format!("{:.2}%", 100.0 * a))
                    .collect::<Vec<_>>()
                    .join(" / ")
            ),
            None => String::new(),
        };
        println!(
            "exported {} (--model {}{}) for PyTorch: {} tensors, model.py and config.json in {}{accuracy}",
            args.checkpoint.display(),
            report.model,
            report
                .router
                .as_ref()
                .map(|r| format!(", --router {r}"))
                .unwrap_or_default(),
            report.tensors,
            report.dir.display()
        );
        return Ok(());
    }
    if args.test_data {
        return Err(moegrad::Error::Invalid(
            "--test-data goes with --format torch (an image model's test split)".into(),
        ));
    }
    let layout = match args.hf_layout {
        LayoutArg::Legacy => moegrad::lm::HfLayout::Legacy,
        LayoutArg::Stacked => moegrad::lm::HfLayout::Stacked,
    };
    let report = moegrad::lm::export_checkpoint(&args.checkpoint, &args.out, layout)?;
    if args.json {
        return print_json(&report);
    }
    println!(
        "exported {} as {} ({}): {} tensors in {}",
        args.checkpoint.display(),
        report.class,
        report.model_type,
        report.tensors,
        report.dir.display()
    );
    Ok(())
}
