//! From cells to groups: each cell's result as read back from its directory, and per group of
//! cells that differ only in the seed, the mean ± standard error of every final metric and of
//! the steps to the target.

use super::cell::{CellRecord, CellStatus};
use super::grid::Cell;
use super::stats::{CurvePoint, MeanSe, Target, final_metrics, mean_se};
use serde_json::json;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// How a cell stands after this invocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CellState {
    /// finished with finite metrics
    Ok,
    /// finished with an error (or non-finite metrics)
    Failed,
    /// killed before it finished; it runs again next time
    Interrupted,
}

impl CellState {
    /// `ok`, `failed`, `interrupted`.
    pub fn name(self) -> &'static str {
        match self {
            CellState::Ok => "ok",
            CellState::Failed => "failed",
            CellState::Interrupted => "interrupted",
        }
    }
}

/// One cell's result.
#[derive(Clone, Debug)]
pub struct CellResult {
    /// the cell
    pub cell: Cell,
    /// its directory
    pub dir: PathBuf,
    /// how it stands
    pub state: CellState,
    /// true when read from an earlier invocation's record, false when run now
    pub reused: bool,
    /// the error line of a failed or interrupted cell
    pub error: Option<String>,
    /// the train run's final JSON
    pub summary: Option<serde_json::Value>,
    /// the final metrics (see [`final_metrics`]); empty unless ok
    pub metrics: BTreeMap<String, f64>,
    /// the run's `metrics.jsonl`
    pub curve: Vec<CurvePoint>,
    /// wall-clock seconds of the train process
    pub wall_seconds: f64,
    /// a language-model run (trained by iterations)
    pub language_model: bool,
}

impl CellResult {
    /// The result of a finished cell's record (`reused`: read from an earlier invocation).
    pub fn from_record(
        cell: Cell,
        dir: PathBuf,
        record: CellRecord,
        reused: bool,
        curve: Vec<CurvePoint>,
        language_model: bool,
    ) -> CellResult {
        let mut error = record.error.clone();
        let mut state = match record.status {
            CellStatus::Ok => CellState::Ok,
            CellStatus::Failed => CellState::Failed,
        };
        let metrics = match (&record.summary, state) {
            (Some(s), CellState::Ok) => match final_metrics(s) {
                Ok(m) => m,
                Err(e) => {
                    state = CellState::Failed;
                    error = Some(e.to_string());
                    BTreeMap::new()
                }
            },
            _ => BTreeMap::new(),
        };
        CellResult {
            cell,
            dir,
            state,
            reused,
            error,
            summary: record.summary,
            metrics,
            curve,
            wall_seconds: record.wall_seconds,
            language_model,
        }
    }

    /// `(step, epoch)` at which the cell first reached `target`, from its curve.
    pub fn reached(&self, target: &Target) -> Option<(f64, f64)> {
        target.first_reached(&self.curve)
    }

    /// The cell as a JSON object: name, directory, coordinates, flags, state, the final
    /// metrics and the train run's own JSON.
    pub fn to_json(&self, target: Option<&Target>) -> serde_json::Value {
        let coords: serde_json::Map<String, serde_json::Value> = self
            .cell
            .coords
            .iter()
            .map(|(a, l)| (a.clone(), json!(l)))
            .collect();
        let mut v = json!({
            "name": self.cell.name,
            "dir": self.dir.display().to_string(),
            "settings": coords,
            "argv": self.cell.argv,
            "status": self.state.name(),
            "reused": self.reused,
            "wall_seconds": self.wall_seconds,
            "metrics": self.metrics,
            "summary": self.summary,
            "error": self.error,
        });
        if let Some(t) = target
            && self.state == CellState::Ok
        {
            v["target_reached"] = match self.reached(t) {
                Some((step, epoch)) => json!({"step": step, "epoch": epoch}),
                None => serde_json::Value::Null,
            };
        }
        v
    }
}

/// Steps (and epochs) to a target over a group's seeds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ToTarget {
    /// over the seeds that reached it
    pub steps: MeanSe,
    /// over the seeds that reached it
    pub epochs: MeanSe,
    /// seeds that reached it
    pub reached: usize,
    /// seeds that finished
    pub of: usize,
}

/// Cells that differ only in the seed, aggregated.
#[derive(Clone, Debug)]
pub struct GroupResult {
    /// `(axis, label)` of every axis but the seed
    pub coords: Vec<(String, String)>,
    /// the indices of its cells in the report's cell list
    pub cells: Vec<usize>,
    /// the seeds (cell labels without a seed axis) of the cells that finished ok
    pub seeds: Vec<String>,
    /// the seeds of the cells that failed or were interrupted
    pub failed: Vec<String>,
    /// per final metric, mean ± s.e. over the ok cells that have it
    pub stats: BTreeMap<String, MeanSe>,
    /// with a target: steps and epochs to reach it
    pub to_target: Option<ToTarget>,
}

impl GroupResult {
    /// `router=topk k=2` (`all` for a grid whose only axis is the seed).
    pub fn label(&self) -> String {
        if self.coords.is_empty() {
            return "all".into();
        }
        self.coords
            .iter()
            .map(|(a, l)| format!("{a}={l}"))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// Groups `cells` by their coordinates without the seed, in the order of first appearance.
pub fn group_cells(cells: &[CellResult], target: Option<&Target>) -> Vec<GroupResult> {
    let mut groups: Vec<GroupResult> = Vec::new();
    for (i, c) in cells.iter().enumerate() {
        let key = c.cell.group();
        let g = match groups.iter_mut().position(|g| g.coords == key) {
            Some(p) => &mut groups[p],
            None => {
                groups.push(GroupResult {
                    coords: key,
                    cells: Vec::new(),
                    seeds: Vec::new(),
                    failed: Vec::new(),
                    stats: BTreeMap::new(),
                    to_target: None,
                });
                groups.last_mut().expect("just pushed")
            }
        };
        g.cells.push(i);
        let seed = c.cell.seed().unwrap_or(&c.cell.name).to_string();
        if c.state == CellState::Ok {
            g.seeds.push(seed);
        } else {
            g.failed.push(seed);
        }
    }
    for g in &mut groups {
        let ok: Vec<&CellResult> = g
            .cells
            .iter()
            .map(|&i| &cells[i])
            .filter(|c| c.state == CellState::Ok)
            .collect();
        let mut names: Vec<&String> = ok.iter().flat_map(|c| c.metrics.keys()).collect();
        names.sort();
        names.dedup();
        for name in names {
            let values: Vec<f64> = ok
                .iter()
                .filter_map(|c| c.metrics.get(name).copied())
                .collect();
            g.stats.insert(name.clone(), mean_se(&values));
        }
        if let Some(t) = target {
            let reached: Vec<(f64, f64)> = ok.iter().filter_map(|c| c.reached(t)).collect();
            let steps: Vec<f64> = reached.iter().map(|r| r.0).collect();
            let epochs: Vec<f64> = reached.iter().map(|r| r.1).collect();
            g.to_target = Some(ToTarget {
                steps: mean_se(&steps),
                epochs: mean_se(&epochs),
                reached: reached.len(),
                of: ok.len(),
            });
        }
    }
    groups
}
