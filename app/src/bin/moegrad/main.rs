//! The `moegrad` command line: `info` (device report), `train` (a training run), `compare` (a
//! grid of training runs aggregated into one table of mean ± standard error), `generate`
//! (text from a language model), `import` (a Hugging Face checkpoint as a run), `export` (a run as one), `logits` (a
//! language model's logits for token ids), `bench` (measured workloads), `estimators` (the estimator
//! lab: router-gradient estimators against the exact gradient of a small problem) and
//! `routers` (every router with its options, from the registry).
//! Every error is printed as one line on stderr with a non-zero exit status.
//!
//! This file holds the command tree ([`Cli`], [`Command`]), the helpers the commands share and
//! `main`; each command group lives in a module of its own, named after it.

mod bench;
mod compare;
mod estimators;
mod generate;
mod import;
mod info;
mod routers;
mod train;

use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};
use moegrad::train::{DataKind, ModelKind, OptimizerKind, RunOptions, TrainConfig};
use moegrad::{Device, Result};
use std::path::PathBuf;
use std::process::ExitCode;

use bench::{BenchArgs, run_bench};
use compare::{CompareArgs, compare_words_first, run_compare};
use estimators::{EstimatorArgs, run_estimators};
use generate::{GenerateArgs, run_generate};
use import::{ExportArgs, ImportArgs, LogitsArgs, run_export, run_import, run_logits};
use info::run_info;
use routers::run_routers;
use train::{TrainArgs, run_train};

/// Counts heap bytes so `bench moe` can report peak memory.
#[global_allocator]
static ALLOC: moegrad::memory::CountingAllocator = moegrad::memory::CountingAllocator;

#[derive(Parser)]
#[command(
    name = "moegrad",
    version,
    about = "Tape-based autodiff on wgpu for Mixture-of-Experts training"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// The subcommands (parsed once, so the size difference between variants does not matter).
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Print the device moegrad would use, the GPU adapter, its limits and optional features.
    Info {
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Train a model on MNIST, MultiMNIST or synthetic-b (epochs), or a character-level GPT on
    /// text (iterations), with a progress bar, metrics, plots and checkpoints.
    Train(TrainArgs),
    /// Run a grid of `train` runs (routers × seeds × other settings), each cell in its own
    /// directory under --out, and print one table of mean ± standard error per group of cells
    /// that differ only in the seed. Every flag that is not one of compare's own is a `train`
    /// flag shared by all cells (`moegrad train --help` lists them): `moegrad compare --data
    /// mnist --model moe-mlp --routers topk,softmax --seeds 1,2 --epochs 1`. A second
    /// invocation with the same --out reads the finished cells instead of running them again
    /// (an interrupted cell runs again); adding routers, seeds or values adds only the new
    /// cells.
    Compare(CompareArgs),
    /// Sample text from a language model trained with `train --model gpt|moe-gpt` (the
    /// vocabulary and the model's settings come from the checkpoint).
    Generate(GenerateArgs),
    /// Import a Hugging Face transformers checkpoint (llama, mixtral, qwen2_moe, olmoe,
    /// deepseek_v3, gpt2) as a moegrad run: its checkpoint samples with `generate`, scores
    /// with `logits` and trains further with `train --init-from`.
    Import(ImportArgs),
    /// Export a language model as a Hugging Face transformers directory (--format hf, which
    /// AutoModelForCausalLM.from_pretrained loads) or an image model for PyTorch (--format
    /// torch: model.py and safetensors); docs/interop.md.
    Export(ExportArgs),
    /// Print a language model's logits for token ids (a JSON file), e.g. to compare with
    /// another implementation.
    Logits(LogitsArgs),
    /// Measure router-gradient estimators (bias, variance, cosine, cost) against the exact
    /// gradient of a small MoE problem, found by enumerating every expert choice
    /// (docs/estimators.md).
    Estimators(EstimatorArgs),
    /// Run a benchmark and print its figures.
    Bench(BenchArgs),
    /// List every router (`--router NAME`) with a one-line description and its `--router-opt`
    /// options: type, default and help (docs/routers.md has the math).
    Routers {
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
}

/// The flags of a subcommand's matches that were set on the command line (not left at their
/// defaults), spelled as there: `--expert-hidden` for the field `expert_hidden`.
fn flags_given(matches: Option<&ArgMatches>) -> Vec<String> {
    let Some(m) = matches else {
        return Vec::new();
    };
    m.ids()
        .filter(|id| m.value_source(id.as_str()) == Some(ValueSource::CommandLine))
        .map(|id| format!("--{}", id.as_str().replace('_', "-")))
        .collect()
}

/// Prints a result (a run's summary, a report, a benchmark) as one JSON object on stdout
/// (`--json`).
fn print_json(summary: &impl serde::Serialize) -> Result<()> {
    let text =
        serde_json::to_string(summary).map_err(|e| moegrad::Error::Invalid(e.to_string()))?;
    print_line(&text);
    Ok(())
}

/// Prints one line on stdout; a reader that has gone away (`moegrad logits --json | head`) ends
/// the output quietly instead of panicking as `println!` would.
fn print_line(text: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stdout().lock(), "{text}");
}

/// Ops shown by `--profile` (the JSON has them all).
const PROFILE_TOP: usize = 15;

/// Prints a run's profile, if it has one, after a blank line.
fn print_profile(
    rows: Option<&[moegrad::profile::ProfileRow]>,
    gpu: Option<&moegrad::profile::GpuProfile>,
) {
    if let Some(rows) = rows {
        println!();
        print!("{}", moegrad::profile::table(rows, gpu, PROFILE_TOP));
    }
}

/// A clap error as one line: what was wrong (with the arguments it lists, for "the following
/// required arguments were not provided:"), plus the allowed values when it lists them.
fn clap_error_line(e: &clap::Error) -> String {
    let text = e.render().to_string();
    let mut lines = text.lines().filter(|l| !l.trim().is_empty());
    let mut first = lines
        .next()
        .unwrap_or("invalid arguments")
        .trim_start_matches("error: ")
        .to_string();
    if first.ends_with(':') {
        // the detail is on the indented lines that follow, up to the usage
        let detail: Vec<&str> = text
            .lines()
            .skip(1)
            .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more"))
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect();
        first = format!("{first} {}", detail.join(", "));
    }
    // `--epochs -1`: a negative number where a count is expected
    if first.contains("invalid digit found in string") && first.contains("'-") {
        first = first.replace(
            "invalid digit found in string",
            "it must be a whole number, 0 or more",
        );
    }
    let values = lines
        .find(|l| l.contains("possible values"))
        .map(|l| format!(" {}", l.trim()))
        .unwrap_or_default();
    format!("{first}{values}")
}

/// The command tree, with every option that takes a value reading a leading `-` as a negative
/// number (so `--epochs -1` is refused for its value, not as an unknown flag `-1`), and every
/// real-valued one taking any value that starts with `-` (`--lr -inf` is refused by the
/// setting's own check, which says what is allowed).
fn cli_command() -> clap::Command {
    fn negatives(a: clap::Arg) -> clap::Arg {
        if !a.get_action().takes_values() {
            a
        } else if a.get_value_parser().type_id() == std::any::TypeId::of::<f64>() {
            a.allow_hyphen_values(true)
        } else {
            a.allow_negative_numbers(true)
        }
    }
    Cli::command().mut_subcommands(|c| {
        c.mut_args(negatives)
            .mut_subcommands(|s| s.mut_args(negatives))
    })
}

fn run(cli: Cli, matches: &ArgMatches) -> Result<()> {
    match cli.command {
        Command::Info { json } => run_info(json),
        Command::Train(args) => run_train(args, matches),
        Command::Estimators(args) => run_estimators(&args),
        Command::Compare(args) => run_compare(&args),
        Command::Generate(args) => run_generate(&args),
        Command::Import(args) => run_import(&args),
        Command::Logits(args) => run_logits(&args),
        Command::Export(args) => run_export(&args),
        Command::Bench(args) => run_bench(args),
        Command::Routers { json } => run_routers(json),
    }
}

/// Mesa's Vulkan drivers load libwayland-client, which prints "error: XDG_RUNTIME_DIR is invalid
/// or not set in the environment." once per probe when that variable is not an absolute path
/// (a container, a cron job, `ssh` without a login session). moegrad draws nothing on screen,
/// so the variable only has to be absolute to keep that line quiet: the system's temporary
/// directory is given when it is missing. (Set before any thread starts, as `set_var` asks.)
fn quiet_wayland_probe() {
    let valid =
        std::env::var_os("XDG_RUNTIME_DIR").is_some_and(|d| std::path::Path::new(&d).is_absolute());
    if !valid {
        // SAFETY: called first thing in `main`, before any other thread exists
        unsafe { std::env::set_var("XDG_RUNTIME_DIR", std::env::temp_dir()) };
    }
}

fn main() -> ExitCode {
    quiet_wayland_probe();
    // parsed through `ArgMatches` so that `train` can tell flags given from defaults
    let parsed = cli_command()
        .try_get_matches_from(compare_words_first(std::env::args_os().collect()))
        .and_then(|m| Cli::from_arg_matches(&m).map(|c| (c, m)));
    let (cli, matches) = match parsed {
        Ok(c) => c,
        Err(e)
            if matches!(
                e.kind(),
                clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion
            ) =>
        {
            e.exit()
        }
        Err(e) if e.kind() == clap::error::ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            e.exit()
        }
        Err(e) => {
            eprintln!("moegrad: {}", clap_error_line(&e));
            return ExitCode::from(2);
        }
    };
    // MOEGRAD_PROFILE=1: a profile of any command, printed on stderr at the end (`train`
    // takes it over and reports it with its results)
    // (a profile records the thread it was enabled on: the worker thread that runs the command)
    let result = moegrad::train::on_worker_thread(|| {
        if moegrad::profile::requested_by_env() {
            moegrad::profile::enable();
        }
        let result = run(cli, &matches);
        if let Some(report) = moegrad::profile::disable() {
            eprint!("{}", report.table(PROFILE_TOP));
        }
        result
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // the shell's code for a process ended by SIGINT
        Err(e @ moegrad::Error::Interrupted(_)) => {
            eprintln!("moegrad: {e}");
            ExitCode::from(130)
        }
        Err(e) => {
            eprintln!("moegrad: {e}");
            ExitCode::FAILURE
        }
    }
}
