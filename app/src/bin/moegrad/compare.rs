//! `moegrad compare`: a grid of `train` runs aggregated into one table. Its own flags
//! ([`CompareArgs`]) mix with `train` flags on the command line; [`compare_words_first`] sorts
//! them apart before clap parses them, and every cell is checked before any runs.

use super::*;

/// `moegrad compare` options; the other flags (after `--`, or mixed in with these) are `train`
/// flags shared by every cell.
#[derive(clap::Args)]
pub(super) struct CompareArgs {
    /// A grid file (TOML, or JSON for a name ending in .json): `routers`, `seeds`, `metric`,
    /// `target`, a `[train]` table of fixed flags, a `[set]` table of axes and `[[variants]]`
    /// (several flags per point); see experiments/*.toml. Flags given here as well replace the
    /// file's: `--grid FILE --seeds 1 --epochs 1` is a quick trial of a shipped grid.
    #[arg(long)]
    grid: Option<PathBuf>,
    /// The router axis, comma-separated (`--routers topk,softmax,moesart`).
    #[arg(long, value_name = "R1,R2,...")]
    routers: Option<String>,
    /// The seed axis, comma-separated (`--seeds 1,2,3`): cells that differ only in the seed
    /// are one group (mean ± s.e.).
    #[arg(long, value_name = "S1,S2,...")]
    seeds: Option<String>,
    /// Any other train flag as an axis (repeatable): `--set k=2,4 --set expert-hidden=64,128`.
    #[arg(long = "set", value_name = "FLAG=V1,V2")]
    set: Vec<String>,
    /// Cells run at once, as separate processes sharing the cores. On a small machine one job
    /// with all threads is usually faster than several.
    #[arg(long, default_value_t = 1)]
    jobs: usize,
    /// Also report the steps (and epochs) each group needed to reach METRIC=VALUE, e.g.
    /// `val_loss=2.0` or `test_accuracy=0.9` (accuracies from below, losses from above).
    #[arg(long, value_name = "METRIC=VALUE")]
    target: Option<String>,
    /// The final metric of the bar chart, and of the learning curves when the runs log it
    /// [default: test_loss; val_loss for the language models].
    #[arg(long)]
    metric: Option<String>,
    /// The grid's directory: one subdirectory per cell (metrics.jsonl, checkpoint, cell.json,
    /// train.log), table.md, table.csv, table.json and the figures.
    #[arg(long, default_value = "runs/compare")]
    out: PathBuf,
    /// Run the cells that failed in an earlier invocation again (by default their recorded
    /// failure is reported).
    #[arg(long)]
    retry_failed: bool,
    /// Do not draw the figures.
    #[arg(long)]
    no_plot: bool,
    /// Check every cell and list them (directory, state, train flags) without running any.
    #[arg(long)]
    dry_run: bool,
    /// Print the report as one JSON object on stdout instead of the markdown table.
    #[arg(long)]
    json: bool,
    /// The train flags every cell shares (compare puts them here; `--` before them is optional).
    #[arg(last = true, value_name = "TRAIN FLAGS", allow_hyphen_values = true)]
    train: Vec<String>,
}

/// `moegrad compare` takes its own flags mixed with train flags. This puts compare's own
/// flags (and their values) first and every other word after `--`, where clap collects them
/// as the train flags; other subcommands' words are returned unchanged.
pub(super) fn compare_words_first(words: Vec<std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    if words.get(1).and_then(|w| w.to_str()) != Some("compare") {
        return words;
    }
    let cmd = Cli::command();
    let Some(sub) = cmd.find_subcommand("compare") else {
        return words;
    };
    // compare's long flags, and whether each takes a value
    let own: Vec<(String, bool)> = sub
        .get_arguments()
        .filter_map(|a| {
            let takes = a.get_action().takes_values();
            a.get_long().map(|l| (l.to_string(), takes))
        })
        .chain([("help".to_string(), false)])
        .collect();
    let mut front: Vec<std::ffi::OsString> = words[..2].to_vec();
    let mut train: Vec<std::ffi::OsString> = Vec::new();
    let mut rest = words[2..].iter();
    while let Some(w) = rest.next() {
        let text = w.to_string_lossy();
        if text == "--" {
            train.extend(rest.by_ref().cloned());
            break;
        }
        if text == "-h" {
            front.push(w.clone());
            continue;
        }
        let name = text
            .strip_prefix("--")
            .map(|n| n.split_once('=').map_or(n, |(a, _)| a));
        match name.and_then(|n| own.iter().find(|(l, _)| l == n)) {
            Some((_, takes)) => {
                front.push(w.clone());
                if *takes
                    && !text.contains('=')
                    && let Some(v) = rest.next()
                {
                    front.push(v.clone());
                }
            }
            None => train.push(w.clone()),
        }
    }
    front.push("--".into());
    front.extend(train);
    front
}

/// Parses and validates one cell's train flags exactly as `moegrad train` would (the same clap
/// parser, defaults and `TrainConfig::validate`), and builds its router once on a tiny input so
/// that a bad `--router-opt` is found too; returns the run's settings.
fn check_train_words(words: &[String]) -> Result<TrainConfig> {
    let argv = ["moegrad", "train"]
        .into_iter()
        .map(String::from)
        .chain(words.iter().cloned());
    let matches = cli_command()
        .try_get_matches_from(argv)
        .map_err(|e| moegrad::Error::Invalid(clap_error_line(&e)))?;
    let cli = Cli::from_arg_matches(&matches)
        .map_err(|e| moegrad::Error::Invalid(clap_error_line(&e)))?;
    let Command::Train(args) = cli.command else {
        return Err(moegrad::Error::Invalid("not a train command".into()));
    };
    let given = flags_given(matches.subcommand_matches("train"));
    let cfg = args.config(&given)?;
    cfg.validate()?;
    if cfg.model.is_moe() {
        let mut router = moegrad::moe::RouterConfig::new(4, cfg.experts, cfg.k);
        router.options = cfg.router_options.clone();
        moegrad::moe::build_router(&cfg.router, &router, Device::cpu())?;
    }
    Ok(cfg)
}

/// Runs `moegrad compare`: the grid from the file and/or the flags, every cell checked before
/// any runs, then the report as a markdown table (or JSON) on stdout.
pub(super) fn run_compare(args: &CompareArgs) -> Result<()> {
    use moegrad_cli::compare::grid::{Grid, split_list};
    let routers = args.routers.as_deref().map(split_list);
    let seeds = args.seeds.as_deref().map(split_list);
    let mut grid = Grid::from_flags(&args.train, routers.as_deref(), seeds.as_deref(), &args.set)?;
    grid.metric = args.metric.clone();
    grid.target = args.target.clone();
    if let Some(path) = &args.grid {
        grid = Grid::from_file(path)?.overridden_by(grid);
    }
    if args.dry_run {
        let plan = moegrad_cli::compare::plan(&grid, &args.out, &check_train_words)?;
        for (c, prior) in plan.cells.iter().zip(&plan.priors) {
            let state = match prior {
                moegrad_cli::compare::resume::Prior::New => "new",
                moegrad_cli::compare::resume::Prior::Finished(_) => "finished",
                moegrad_cli::compare::resume::Prior::Interrupted(_) => "interrupted",
            };
            println!(
                "{:<11} {}  train {}",
                state,
                args.out.join(&c.name).display(),
                c.argv.join(" ")
            );
        }
        let to_run = plan
            .priors
            .iter()
            .filter(|p| p.needs_run(args.retry_failed))
            .count();
        println!(
            "{} cells checked, {to_run} to run; metric {}{}",
            plan.cells.len(),
            plan.metric,
            plan.target
                .as_ref()
                .map(|t| format!(", target {}", t.describe()))
                .unwrap_or_default()
        );
        return Ok(());
    }
    let exe = std::env::current_exe().map_err(|e| {
        moegrad::Error::Io(format!("compare: cannot find the moegrad executable: {e}"))
    })?;
    let opts = moegrad_cli::compare::CompareOptions {
        out: args.out.clone(),
        jobs: args.jobs,
        retry_failed: args.retry_failed,
        progress: true,
        plots: !args.no_plot,
        exe,
    };
    let report = moegrad_cli::compare::run(&grid, &opts, &check_train_words)?;
    if args.json {
        print_json(&moegrad_cli::compare::table::json(&report))?;
    } else {
        print!("{}", moegrad_cli::compare::table::markdown(&report));
        println!(
            "{} cells: {} run now, {} reused, {} failed{}; {:.1} s; tables and figures in {}",
            report.cells.len(),
            report.ran,
            report.reused,
            report.failed(),
            if report.interrupted() > 0 {
                format!(
                    ", {} interrupted (they run again next time)",
                    report.interrupted()
                )
            } else {
                String::new()
            },
            report.wall_seconds,
            report.out.display()
        );
    }
    // the table is out; a failed cell still makes the command fail
    if report.failed() > 0 {
        return Err(moegrad::Error::Invalid(format!(
            "compare: {} of {} cells failed (their errors are above and in each cell's directory under {}); --retry-failed runs them again",
            report.failed(),
            report.cells.len(),
            report.out.display()
        )));
    }
    Ok(())
}
