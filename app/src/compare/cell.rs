//! Running one cell of a grid: `moegrad train <the cell's flags> --out DIR --json --overwrite`
//! as a child process of the same binary, so that a crash, an abort or a NaN in one cell cannot
//! take the grid down, and `--jobs N` is N children at once.
//!
//! The child's stderr (per-epoch lines, warnings, its one-line error) goes to `DIR/train.log`;
//! its stdout is the final JSON object. When the child ends, its outcome is written atomically
//! (temporary file, then rename) as `DIR/cell.json` ([`CellRecord`]): a cell is finished exactly
//! when that file exists. A child killed by a signal (Ctrl-C, the OOM killer) leaves no record,
//! so the next invocation runs that cell again from scratch.

use super::grid::Cell;
use super::stats::final_metrics;
use moegrad::checkpoint::write_atomic;
use moegrad::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

/// The record of a finished cell in its directory.
pub const RECORD_FILE: &str = "cell.json";
/// The child's stderr, kept in the cell's directory.
pub const LOG_FILE: &str = "train.log";

/// How a finished cell ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CellStatus {
    /// the run finished and its final metrics are finite
    Ok,
    /// the run stopped with an error (bad data, NaN, out of memory) or its metrics are not finite
    Failed,
}

/// What `cell.json` holds: the cell's flags (to recognise it on resume), how it ended, the
/// train run's final JSON and, for a failure, the error line.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CellRecord {
    /// the cell's coordinates, `router=topk seed=1`
    pub cell: String,
    /// the train flags it ran with (without `--out`, `--json`, `--overwrite`)
    pub argv: Vec<String>,
    /// ok or failed
    pub status: CellStatus,
    /// the train run's `--json` object (ok cells)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summary: Option<serde_json::Value>,
    /// the error line (failed cells)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// wall-clock seconds of the child process
    pub wall_seconds: f64,
}

impl CellRecord {
    /// Reads `dir/cell.json`: None when there is none.
    ///
    /// # Errors
    /// A record that exists but cannot be read or parsed (naming the file).
    pub fn read(dir: &Path) -> Result<Option<CellRecord>> {
        let path = dir.join(RECORD_FILE);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::Io(format!("{}: {e}", path.display()))),
        };
        serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| Error::Io(format!("{}: not a cell record: {e}", path.display())))
    }

    /// Writes `dir/cell.json` atomically.
    pub fn write(&self, dir: &Path) -> Result<()> {
        let text = serde_json::to_string_pretty(self)
            .map_err(|e| Error::Invalid(format!("cell record: {e}")))?;
        write_atomic(&dir.join(RECORD_FILE), text.as_bytes())
    }
}

/// The outcome of running a cell.
#[derive(Clone, Debug)]
pub enum Outcome {
    /// the child ended by itself; the record has been written
    Finished(CellRecord),
    /// the child was killed by a signal; nothing was recorded (it runs again next time)
    Interrupted(String),
}

/// The full train flags of a cell: its own, then `--out DIR --json --overwrite` (a cell
/// interrupted earlier left files that a fresh run must replace).
pub fn train_argv(cell: &Cell, dir: &Path) -> Vec<String> {
    let mut argv = cell.argv.clone();
    argv.extend([
        "--out".to_string(),
        dir.display().to_string(),
        "--json".to_string(),
        "--overwrite".to_string(),
    ]);
    argv
}

/// Runs `exe train ...` for `cell` in `dir` and records the outcome. `threads`, when set, is
/// passed to the child as `RAYON_NUM_THREADS` (concurrent jobs share the cores).
///
/// # Errors
/// Only what keeps the child from starting or its record from being written (an unwritable
/// directory, a missing executable); a child that fails is a [`CellStatus::Failed`] record.
pub fn run_cell(exe: &Path, cell: &Cell, dir: &Path, threads: Option<usize>) -> Result<Outcome> {
    let io = |p: &Path, e: std::io::Error| Error::Io(format!("{}: {e}", p.display()));
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    let record_path = dir.join(RECORD_FILE);
    if record_path.exists() {
        // a failed cell run again (--retry-failed): it is unfinished until it ends again
        std::fs::remove_file(&record_path).map_err(|e| io(&record_path, e))?;
    }
    let log_path = dir.join(LOG_FILE);
    let log = std::fs::File::create(&log_path).map_err(|e| io(&log_path, e))?;
    let mut command = Command::new(exe);
    command
        .arg("train")
        .args(train_argv(cell, dir))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log);
    if let Some(t) = threads {
        command.env("RAYON_NUM_THREADS", t.to_string());
    }
    let started = Instant::now();
    let output = command
        .spawn()
        .and_then(|c| c.wait_with_output())
        .map_err(|e| Error::Io(format!("{}: could not run the cell: {e}", exe.display())))?;
    let wall_seconds = started.elapsed().as_secs_f64();
    let Some(code) = output.status.code() else {
        return Ok(Outcome::Interrupted(format!(
            "the train process was killed ({}); the cell runs again on the next invocation",
            output.status
        )));
    };
    let mut record = CellRecord {
        cell: cell.label(),
        argv: cell.argv.clone(),
        status: CellStatus::Failed,
        summary: None,
        error: None,
        wall_seconds,
    };
    if code == 0 {
        let stdout = String::from_utf8_lossy(&output.stdout);
        let last = stdout.lines().rev().find(|l| !l.trim().is_empty());
        match last.map(serde_json::from_str::<serde_json::Value>) {
            Some(Ok(summary)) => {
                match final_metrics(&summary) {
                    Ok(_) => record.status = CellStatus::Ok,
                    Err(e) => record.error = Some(error_text(&e)),
                }
                record.summary = Some(summary);
            }
            _ => {
                record.error = Some(format!(
                    "the train process exited 0 but printed no final JSON object (see {})",
                    log_path.display()
                ))
            }
        }
    } else {
        record.error = Some(error_line(&log_path).unwrap_or_else(|| {
            format!(
                "the train process exited with status {code} (see {})",
                log_path.display()
            )
        }));
    }
    record.write(dir)?;
    Ok(Outcome::Finished(record))
}

/// The message of an error without the kind's prefix.
fn error_text(e: &Error) -> String {
    match e {
        Error::Shape(m)
        | Error::DType(m)
        | Error::Device(m)
        | Error::Axis(m)
        | Error::Invalid(m)
        | Error::Autograd(m)
        | Error::Gradcheck(m)
        | Error::Gpu(m)
        | Error::Io(m)
        | Error::Interrupted(m) => m.clone(),
    }
}

/// The train process's one-line error from its log: the last `moegrad: ` line that is not a
/// warning or a note, else the last line (a panic message, say).
pub fn error_line(log: &Path) -> Option<String> {
    let text = std::fs::read_to_string(log).ok()?;
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    lines
        .iter()
        .rev()
        .find_map(|l| {
            l.strip_prefix("moegrad: ")
                .filter(|m| !m.starts_with("warning:") && !m.starts_with("note:"))
        })
        .or(lines.last().copied())
        .map(str::to_string)
}

/// The directory of `cell` under `out`.
pub fn cell_dir(out: &Path, cell: &Cell) -> PathBuf {
    out.join(&cell.name)
}
