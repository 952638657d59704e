//! `moegrad compare`: the comparisons of the papers behind moegrad as one command. A grid of
//! `moegrad train` runs (router × seed × any other setting) is run cell by cell, each cell in
//! its own directory, and aggregated into one table of mean ± standard error per group of cells
//! that differ only in the seed, with learning curves and a bar chart.
//!
//! The parts, in the order a grid goes through them:
//!
//! * [`grid`]: the grid (from flags or a TOML/JSON file) and its cells;
//! * the caller's check of every cell's train flags (the train command's own parser and
//!   validation), so a bad grid fails before any cell runs, naming the cell;
//! * [`resume`]: what an earlier invocation left in each cell's directory (finished cells are
//!   read, not run again);
//! * [`cell`]: one cell as a child process `moegrad train ... --json`, its outcome recorded
//!   atomically as `cell.json`;
//! * [`stats`] and [`aggregate`]: final metrics, curves, mean ± s.e., steps to a target;
//! * [`table`] and [`plot`]: `table.md`, `table.csv`, `table.json` and the figures in `--out`.

pub mod aggregate;
pub mod cell;
pub mod grid;
pub mod plot;
pub mod resume;
pub mod stats;
pub mod table;

use aggregate::{CellResult, CellState, GroupResult};
use cell::Outcome;
use grid::{Cell, Grid, prefix_error};
use moegrad::train::TrainConfig;
use moegrad::train::out_dir::OutDir;
use moegrad::{Error, Result};
use resume::Prior;
use stats::Target;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Instant;

/// How to run a grid (everything but the grid itself).
#[derive(Clone, Debug)]
pub struct CompareOptions {
    /// the directory of the grid: one subdirectory per cell, the tables and figures
    pub out: PathBuf,
    /// cells run at once (at least 1); each child then gets `cores / jobs` threads unless
    /// `RAYON_NUM_THREADS` is set
    pub jobs: usize,
    /// run failed cells again instead of reporting their recorded failure
    pub retry_failed: bool,
    /// print a line per cell on stderr
    pub progress: bool,
    /// draw the figures
    pub plots: bool,
    /// the `moegrad` executable the cells run (`std::env::current_exe()` for the CLI)
    pub exe: PathBuf,
}

/// Checks one cell's full train flags (as `moegrad train` would parse and validate them) and
/// returns the run's settings; the error says what is wrong with the flags.
pub type CellCheck<'a> = &'a dyn Fn(&[String]) -> Result<TrainConfig>;

/// The outcome of a grid: every cell, every group, and what this invocation did.
#[derive(Clone, Debug)]
pub struct CompareReport {
    /// the grid's directory
    pub out: PathBuf,
    /// the metric of the figures
    pub metric: String,
    /// the target, if one was given
    pub target: Option<Target>,
    /// every cell, in grid order
    pub cells: Vec<CellResult>,
    /// every group, in grid order
    pub groups: Vec<GroupResult>,
    /// cells run by this invocation
    pub ran: usize,
    /// cells read from an earlier invocation
    pub reused: usize,
    /// the files written to `out` (tables, figures)
    pub files: Vec<PathBuf>,
    /// wall-clock seconds of this invocation
    pub wall_seconds: f64,
}

impl CompareReport {
    /// Cells that failed (this time or recorded).
    pub fn failed(&self) -> usize {
        self.cells
            .iter()
            .filter(|c| c.state == CellState::Failed)
            .count()
    }

    /// Cells killed before they finished.
    pub fn interrupted(&self) -> usize {
        self.cells
            .iter()
            .filter(|c| c.state == CellState::Interrupted)
            .count()
    }
}

/// A grid checked and ready to run: its cells with their settings, what an earlier
/// invocation left for each, the figures' metric and the target.
#[derive(Clone, Debug)]
pub struct Plan {
    /// every cell, in grid order
    pub cells: Vec<Cell>,
    /// each cell's settings as train parsed them
    pub configs: Vec<TrainConfig>,
    /// what each cell's directory holds
    pub priors: Vec<Prior>,
    /// the metric of the figures
    pub metric: String,
    /// the target, if one was given
    pub target: Option<Target>,
}

/// Checks a grid without running anything: expands its cells, checks every cell's train flags
/// with `check`, the target and the metric against what the runs will log, and reads what an
/// earlier invocation left in each cell's directory under `out`.
///
/// # Errors
/// A bad grid, target or metric, a cell whose flags `check` refuses, a cell directory that
/// holds a run of other settings or is in use; each names the cell.
pub fn plan(grid: &Grid, out: &Path, check: CellCheck) -> Result<Plan> {
    let cells = grid.cells()?;
    let target = grid.target.as_deref().map(Target::parse).transpose()?;
    let mut configs = Vec::with_capacity(cells.len());
    for c in &cells {
        let dir = cell::cell_dir(out, c);
        let cfg = check(&cell::train_argv(c, &dir))
            .map_err(|e| prefix_error(&format!("compare: cell {}", c.label()), e))?;
        configs.push(cfg);
    }
    // two cells that parse to the same settings (`--seeds 1,01`, `--set k=2,02`) would run
    // the same training twice and count it as two
    let settings: Vec<String> = configs
        .iter()
        .map(|c| {
            let mut c = c.clone();
            c.out = PathBuf::new();
            serde_json::to_string(&c).unwrap_or_default()
        })
        .collect();
    for (i, s) in settings.iter().enumerate() {
        if let Some(j) = settings[..i].iter().position(|t| t == s) {
            return Err(Error::Invalid(format!(
                "compare: cells {} and {} have the same settings once their values are read (the same number written two ways?); give each value once",
                cells[j].label(),
                cells[i].label()
            )));
        }
    }
    let metric = grid
        .metric
        .clone()
        .unwrap_or_else(|| stats::default_metric(&configs[0]).to_string());
    for (c, cfg) in cells.iter().zip(&configs) {
        let curve = stats::curve_metrics(cfg);
        if let Some(t) = &target
            && !curve.contains(&t.metric)
        {
            return Err(Error::Invalid(format!(
                "compare: cell {}: --target {}: a run of --model {} on --data {} logs {} after each evaluation, not {:?}",
                c.label(),
                t.describe(),
                cfg.model.name(),
                cfg.data.name(),
                curve.join(", "),
                t.metric
            )));
        }
        if !curve.contains(&metric) && !stats::SUMMARY_METRICS.contains(&metric.as_str()) {
            return Err(Error::Invalid(format!(
                "compare: cell {}: --metric {metric:?} is not a metric of this run; it has {}, {}",
                c.label(),
                curve.join(", "),
                stats::SUMMARY_METRICS.join(", ")
            )));
        }
    }
    let mut priors = Vec::with_capacity(cells.len());
    for c in &cells {
        priors.push(resume::inspect(&cell::cell_dir(out, c), c)?);
    }
    Ok(Plan {
        cells,
        configs,
        priors,
        metric,
        target,
    })
}

/// Runs a grid: [`plan`] (every cell checked before any runs), claims `opts.out` (locked
/// against a second compare or train there), reads the cells an earlier invocation finished,
/// runs the others (`opts.jobs` at a time), and writes `table.md`, `table.csv`, `table.json`
/// and the figures to `opts.out`.
///
/// # Errors
/// Those of [`plan`], before any cell runs; afterwards only what keeps a child from starting or
/// the tables from being written. A cell that fails is reported in the table.
pub fn run(grid: &Grid, opts: &CompareOptions, check: CellCheck) -> Result<CompareReport> {
    let started = Instant::now();
    if opts.jobs == 0 {
        return Err(Error::Invalid("compare: --jobs must be at least 1".into()));
    }
    let Plan {
        cells,
        configs,
        metric,
        target,
        ..
    } = plan(grid, &opts.out, check)?;

    let lock = OutDir::claim(&opts.out, false, false).map_err(|e| prefix_error("compare", e))?;
    if opts.progress {
        for note in &lock.notes {
            eprintln!("moegrad: note: {note}");
        }
    }
    // read again under the lock: another compare may have finished cells meanwhile
    let mut priors = Vec::with_capacity(cells.len());
    for c in &cells {
        priors.push(resume::inspect(&cell::cell_dir(&opts.out, c), c)?);
    }
    let pending: Vec<usize> = (0..cells.len())
        .filter(|&i| priors[i].needs_run(opts.retry_failed))
        .collect();
    if opts.progress {
        eprintln!(
            "compare: {} cells in {}: {} finished earlier (reused), {} to run{}",
            cells.len(),
            opts.out.display(),
            cells.len() - pending.len(),
            pending.len(),
            if pending.is_empty() {
                String::new()
            } else {
                format!(" ({} at a time)", opts.jobs.min(pending.len()))
            }
        );
        for &i in &pending {
            if let Prior::Interrupted(why) = &priors[i] {
                eprintln!("compare: cell {}: {why}", cells[i].label());
            }
        }
    }
    let outcomes = run_pending(&cells, &pending, opts)?;

    let mut results = Vec::with_capacity(cells.len());
    for (i, (c, prior)) in cells.iter().zip(priors).enumerate() {
        let dir = cell::cell_dir(&opts.out, c);
        let lm = configs[i].model.is_lm();
        let fresh = outcomes
            .iter()
            .find(|(j, _)| *j == i)
            .map(|(_, o)| o.clone());
        let (record, reused) = match (fresh, prior) {
            (Some(Outcome::Finished(r)), _) => (r, false),
            (Some(Outcome::Interrupted(why)), _) => {
                results.push(interrupted(c.clone(), dir, why, lm));
                continue;
            }
            (None, Prior::Finished(r)) => (r, true),
            (None, _) => {
                results.push(interrupted(c.clone(), dir, "not run".into(), lm));
                continue;
            }
        };
        let curve = stats::read_curve(&dir.join("metrics.jsonl"))?;
        results.push(CellResult::from_record(
            c.clone(),
            dir,
            record,
            reused,
            curve,
            lm,
        ));
    }
    let groups = aggregate::group_cells(&results, target.as_ref());
    let mut report = CompareReport {
        out: opts.out.clone(),
        metric,
        target,
        ran: outcomes.len(),
        reused: results.iter().filter(|r| r.reused).count(),
        cells: results,
        groups,
        files: Vec::new(),
        wall_seconds: 0.0,
    };
    report.wall_seconds = started.elapsed().as_secs_f64();
    report.files = table::write_tables(&report)?;
    if opts.plots {
        report.files.extend(plot::draw_all(&report)?);
    }
    drop(lock);
    Ok(report)
}

fn interrupted(cell: Cell, dir: PathBuf, why: String, language_model: bool) -> CellResult {
    CellResult {
        cell,
        dir,
        state: CellState::Interrupted,
        reused: false,
        error: Some(why),
        summary: None,
        metrics: Default::default(),
        curve: Vec::new(),
        wall_seconds: 0.0,
        language_model,
    }
}

/// Runs the cells at `pending`, `opts.jobs` at a time, printing a line as each one ends;
/// returns `(cell index, outcome)` in the order they ended.
fn run_pending(
    cells: &[Cell],
    pending: &[usize],
    opts: &CompareOptions,
) -> Result<Vec<(usize, Outcome)>> {
    if pending.is_empty() {
        return Ok(Vec::new());
    }
    let jobs = opts.jobs.min(pending.len());
    let threads = if jobs > 1 && std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Some((cores / jobs).max(1))
    } else {
        None
    };
    let next = AtomicUsize::new(0);
    let (tx, rx) = mpsc::channel::<(usize, Result<Outcome>)>();
    let mut done = Vec::with_capacity(pending.len());
    let mut first_error = None;
    std::thread::scope(|s| {
        for _ in 0..jobs {
            let tx = tx.clone();
            let next = &next;
            s.spawn(move || {
                loop {
                    let k = next.fetch_add(1, Ordering::SeqCst);
                    let Some(&i) = pending.get(k) else { break };
                    let c = &cells[i];
                    let outcome =
                        cell::run_cell(&opts.exe, c, &cell::cell_dir(&opts.out, c), threads);
                    let stop = outcome.is_err();
                    if tx.send((i, outcome)).is_err() || stop {
                        break;
                    }
                }
            });
        }
        drop(tx);
        for (i, outcome) in rx {
            match outcome {
                Ok(o) => {
                    if opts.progress {
                        eprintln!(
                            "compare: [{}/{}] {}",
                            done.len() + 1,
                            pending.len(),
                            progress_line(&cells[i], &o)
                        );
                    }
                    done.push((i, o));
                }
                Err(e) => {
                    // stop handing out cells; the running ones finish
                    next.store(pending.len(), Ordering::SeqCst);
                    first_error.get_or_insert(e);
                }
            }
        }
    });
    match first_error {
        Some(e) => Err(e),
        None => Ok(done),
    }
}

fn progress_line(c: &Cell, o: &Outcome) -> String {
    match o {
        Outcome::Finished(r) if r.status == cell::CellStatus::Ok => {
            let loss = r.summary.as_ref().and_then(|s| {
                ["val_loss", "test_loss"]
                    .iter()
                    .find_map(|k| s[*k].as_f64().map(|v| format!(", {k} {v:.4}")))
            });
            format!(
                "{}: ok in {:.1} s{}",
                c.label(),
                r.wall_seconds,
                loss.unwrap_or_default()
            )
        }
        Outcome::Finished(r) => format!(
            "{}: FAILED in {:.1} s: {}",
            c.label(),
            r.wall_seconds,
            r.error.as_deref().unwrap_or("(no error line)")
        ),
        Outcome::Interrupted(why) => format!("{}: interrupted: {why}", c.label()),
    }
}
