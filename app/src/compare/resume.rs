//! Resuming a grid: what an earlier invocation left in each cell's directory.
//!
//! * no directory, or an empty one: the cell is new;
//! * `cell.json` with the same train flags: finished (ok or failed), read and not run again
//!   (a failed cell runs again with `--retry-failed`);
//! * files but no `cell.json` (a run that was interrupted), or a `cell.json` that cannot be read:
//!   run again from scratch (the child gets `--overwrite`);
//! * `cell.json` with other train flags: the grid's fixed part changed under the same `--out`;
//!   that is refused before anything runs, naming the cell and the settings that differ, so
//!   that results of different settings are never mixed in one table;
//! * a directory locked by a live train process (an earlier compare was killed but its child
//!   runs on): refused before anything runs, naming the cell and the PID, rather than run and
//!   recorded as a failure.

use super::cell::{CellRecord, CellStatus, LOG_FILE, RECORD_FILE};
use super::grid::{Cell, parse_train_words};
use moegrad::checkpoint::process_is_running;
use moegrad::train::out_dir::LOCK_FILE;
use moegrad::{Error, Result};
use std::path::Path;

/// What a cell's directory holds before this invocation.
#[derive(Clone, Debug)]
pub enum Prior {
    /// nothing: run it
    New,
    /// a finished run of the same flags: reuse it
    Finished(CellRecord),
    /// a run that did not finish (or whose record is unreadable): run it again; the text says
    /// what was found
    Interrupted(String),
}

impl Prior {
    /// Whether the cell must run in this invocation.
    pub fn needs_run(&self, retry_failed: bool) -> bool {
        match self {
            Prior::New | Prior::Interrupted(_) => true,
            Prior::Finished(r) => retry_failed && r.status == CellStatus::Failed,
        }
    }
}

/// Looks at `dir`, the directory of `cell`.
///
/// # Errors
/// A record of the same cell written with other train flags (naming the cell, its directory
/// and the settings that differ), or a directory that cannot be read.
pub fn inspect(dir: &Path, cell: &Cell) -> Result<Prior> {
    if !dir.exists() {
        return Ok(Prior::New);
    }
    let lock = dir.join(LOCK_FILE);
    if let Ok(text) = std::fs::read_to_string(&lock)
        && let Ok(pid) = text.trim().parse::<u32>()
        && process_is_running(pid)
    {
        return Err(Error::Io(format!(
            "compare: cell {} is being run by process {pid} (lock {}), perhaps left by an earlier compare that was stopped; wait for it to finish or stop it",
            cell.label(),
            lock.display()
        )));
    }
    let record = match CellRecord::read(dir) {
        Ok(r) => r,
        Err(e) => {
            return Ok(Prior::Interrupted(format!("{e}; the cell runs again")));
        }
    };
    match record {
        Some(r) if r.argv == cell.argv => Ok(Prior::Finished(r)),
        Some(r) => Err(Error::Invalid(format!(
            "compare: cell {} in {} was run with other settings ({}); a different grid needs another --out (or delete that directory to run the cell again)",
            cell.label(),
            dir.display(),
            differences(&r.argv, &cell.argv)
        ))),
        None => {
            let entries = std::fs::read_dir(dir)
                .map_err(|e| Error::Io(format!("{}: {e}", dir.display())))?
                .count();
            if entries == 0 {
                Ok(Prior::New)
            } else {
                Ok(Prior::Interrupted(format!(
                    "{} has no {RECORD_FILE} (an interrupted run; see its {LOG_FILE}); it runs again from scratch",
                    dir.display()
                )))
            }
        }
    }
}

/// `recorded --epochs 1, now --epochs 2; recorded --lr 0.01, now not set`.
fn differences(recorded: &[String], now: &[String]) -> String {
    let (Ok(a), Ok(b)) = (parse_train_words(recorded), parse_train_words(now)) else {
        return format!("recorded {}, now {}", recorded.join(" "), now.join(" "));
    };
    let mut flags: Vec<&str> = a.iter().chain(&b).map(|s| s.flag.as_str()).collect();
    flags.sort_unstable();
    flags.dedup();
    let show = |side: &[super::grid::Setting], flag: &str| -> String {
        let words: Vec<String> = side
            .iter()
            .filter(|s| s.flag == flag)
            .flat_map(|s| s.words())
            .collect();
        if words.is_empty() {
            format!("no --{flag}")
        } else {
            words.join(" ")
        }
    };
    flags
        .into_iter()
        .filter(|f| show(&a, f) != show(&b, f))
        .map(|f| format!("recorded {}, now {}", show(&a, f), show(&b, f)))
        .collect::<Vec<_>>()
        .join("; ")
}
