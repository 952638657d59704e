//! The report of a grid as text: a markdown table (printed, and `table.md`), the same as CSV
//! (`table.csv`) and as JSON (`table.json`, and `--json`), all written atomically to `--out`.
//!
//! One row per group of cells that differ only in the seed: the group's settings, the number of
//! seeds, and mean ± standard error of the final metrics (and of the steps to the target).
//! Failed and interrupted cells are left out of the means and listed below the table with their
//! error lines.

use super::CompareReport;
use super::aggregate::{CellState, GroupResult};
use super::stats::MeanSe;
use moegrad::Result;
use moegrad::checkpoint::write_atomic;
use serde_json::json;
use std::path::PathBuf;

/// The metrics of the markdown table, in this order, when a group has them (the `--metric`
/// comes first); the others, except [`HIDDEN_METRICS`], follow alphabetically.
const METRIC_ORDER: &[&str] = &[
    "test_loss",
    "val_loss",
    "val_bpc",
    "test_accuracy",
    "test_accuracy_1",
    "test_accuracy_2",
    "true_experts_recovered",
    "true_expert_mass",
    "experts_run",
    "train_loss",
    "experts_per_token",
    "drop_rate",
    "dead_experts",
    "load_max_over_ideal",
    "ms_per_iter",
    "seconds",
];

/// Bookkeeping left out of the markdown table (still in the CSV and the JSON).
const HIDDEN_METRICS: &[&str] = &[
    "epochs",
    "iters",
    "steps",
    "params",
    "vocab",
    "active_params_per_token",
    "tokens_per_s",
    "val_ppl",
];

/// The legend printed under the table.
pub const SE_LEGEND: &str = "mean ± s.e. over the seeds that finished; s.e. = sample standard deviation (denominator n − 1) / √n; – where n = 1";

/// `0.9123 ± 0.0041`; the number of decimals follows the size of the mean.
pub fn format_mean_se(m: &MeanSe) -> String {
    if m.n == 0 || !m.mean.is_finite() {
        return "–".into();
    }
    let a = m.mean.abs();
    let decimals = if a >= 1000.0 {
        0
    } else if a >= 100.0 {
        1
    } else if a >= 1.0 {
        3
    } else {
        4
    };
    format_decimals(m, decimals)
}

/// `m` with a fixed number of decimals: `125 ± 7`.
fn format_decimals(m: &MeanSe, decimals: usize) -> String {
    if m.n == 0 || !m.mean.is_finite() {
        return "–".into();
    }
    if m.se.is_finite() {
        format!("{:.*} ± {:.*}", decimals, m.mean, decimals, m.se)
    } else {
        format!("{:.*} ± –", decimals, m.mean)
    }
}

/// The metric columns of the markdown table.
fn table_metrics(report: &CompareReport) -> Vec<String> {
    let mut present: Vec<&String> = report.groups.iter().flat_map(|g| g.stats.keys()).collect();
    present.sort();
    present.dedup();
    let mut out = Vec::new();
    if present.contains(&&report.metric) {
        out.push(report.metric.clone());
    }
    for m in METRIC_ORDER {
        if present.iter().any(|p| p == m) && !out.iter().any(|o| o == m) {
            out.push(m.to_string());
        }
    }
    for p in present {
        if !out.contains(p) && !HIDDEN_METRICS.contains(&p.as_str()) {
            out.push(p.clone());
        }
    }
    out
}

/// The axes of the group columns (every axis but the seed), from the first cell.
fn group_axes(report: &CompareReport) -> Vec<String> {
    report
        .groups
        .first()
        .map(|g| g.coords.iter().map(|(a, _)| a.clone()).collect())
        .unwrap_or_default()
}

fn seeds_cell(g: &GroupResult) -> String {
    if g.failed.is_empty() {
        g.seeds.len().to_string()
    } else {
        format!("{} ({} failed)", g.seeds.len(), g.failed.len())
    }
}

fn md_escape(s: &str) -> String {
    s.replace('|', "\\|").replace('\n', " ")
}

/// The report as a markdown table, with its legend and the failed cells below it.
pub fn markdown(report: &CompareReport) -> String {
    let axes = group_axes(report);
    let metrics = table_metrics(report);
    let lm = report.cells.iter().any(|c| c.language_model);
    let mut header: Vec<String> = axes.clone();
    header.push("seeds".into());
    header.extend(metrics.iter().cloned());
    if let Some(t) = &report.target {
        header.push(format!("steps to {} (reached)", t.describe()));
        if !lm {
            header.push(format!("epochs to {}", t.describe()));
        }
    }
    let mut s = String::new();
    s.push_str(&format!("| {} |\n", header.join(" | ")));
    s.push_str(&format!("|{}\n", "---|".repeat(header.len())));
    for g in &report.groups {
        let mut row: Vec<String> = axes
            .iter()
            .map(|a| {
                g.coords
                    .iter()
                    .find(|(b, _)| b == a)
                    .map(|(_, l)| md_escape(l))
                    .unwrap_or_default()
            })
            .collect();
        row.push(seeds_cell(g));
        if g.seeds.is_empty() {
            row.extend(metrics.iter().map(|_| "failed".to_string()));
        } else {
            row.extend(metrics.iter().map(|m| {
                g.stats
                    .get(m)
                    .map(format_mean_se)
                    .unwrap_or_else(|| "–".into())
            }));
        }
        if let Some(t) = &g.to_target {
            let steps = if t.reached > 0 {
                format_decimals(&t.steps, 0)
            } else {
                "–".into()
            };
            row.push(format!("{steps} ({}/{})", t.reached, t.of));
            if !lm {
                row.push(if t.reached > 0 {
                    format_decimals(&t.epochs, 1)
                } else {
                    "–".into()
                });
            }
        }
        s.push_str(&format!("| {} |\n", row.join(" | ")));
    }
    s.push('\n');
    s.push_str(SE_LEGEND);
    s.push('.');
    if report.target.is_some() {
        s.push_str(" Steps to the target: the first evaluation (once per epoch, or every --eval-every iterations) at or past it, over the seeds that reached it.");
    }
    s.push('\n');
    let bad: Vec<_> = report
        .cells
        .iter()
        .filter(|c| c.state != CellState::Ok)
        .collect();
    if !bad.is_empty() {
        s.push_str("\n| cell | status | error |\n|---|---|---|\n");
        for c in bad {
            s.push_str(&format!(
                "| {} | {} | {} |\n",
                md_escape(&c.cell.label()),
                c.state.name(),
                md_escape(c.error.as_deref().unwrap_or(""))
            ));
        }
    }
    s
}

fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

fn csv_number(x: f64) -> String {
    if x.is_finite() {
        x.to_string()
    } else {
        String::new()
    }
}

/// The report as CSV: one row per group, every metric as `NAME_mean,NAME_se`.
pub fn csv(report: &CompareReport) -> String {
    let axes = group_axes(report);
    let mut metrics: Vec<&String> = report.groups.iter().flat_map(|g| g.stats.keys()).collect();
    metrics.sort();
    metrics.dedup();
    let mut header: Vec<String> = axes.clone();
    header.extend(["seeds".into(), "failed".into()]);
    for m in &metrics {
        header.push(format!("{m}_mean"));
        header.push(format!("{m}_se"));
    }
    if report.target.is_some() {
        header.extend(
            [
                "target_steps_mean",
                "target_steps_se",
                "target_epochs_mean",
                "target_epochs_se",
                "target_reached",
            ]
            .map(String::from),
        );
    }
    let mut s = header
        .iter()
        .map(|h| csv_field(h))
        .collect::<Vec<_>>()
        .join(",");
    s.push('\n');
    for g in &report.groups {
        let mut row: Vec<String> = axes
            .iter()
            .map(|a| {
                g.coords
                    .iter()
                    .find(|(b, _)| b == a)
                    .map(|(_, l)| l.clone())
                    .unwrap_or_default()
            })
            .collect();
        row.push(g.seeds.len().to_string());
        row.push(g.failed.len().to_string());
        for m in &metrics {
            match g.stats.get(*m) {
                Some(v) => {
                    row.push(csv_number(v.mean));
                    row.push(csv_number(v.se));
                }
                None => row.extend([String::new(), String::new()]),
            }
        }
        if let Some(t) = &g.to_target {
            row.extend([
                csv_number(t.steps.mean),
                csv_number(t.steps.se),
                csv_number(t.epochs.mean),
                csv_number(t.epochs.se),
                t.reached.to_string(),
            ]);
        }
        s.push_str(
            &row.iter()
                .map(|f| csv_field(f))
                .collect::<Vec<_>>()
                .join(","),
        );
        s.push('\n');
    }
    s
}

fn number_or_null(x: f64) -> serde_json::Value {
    if x.is_finite() {
        json!(x)
    } else {
        serde_json::Value::Null
    }
}

/// The report as JSON: `{"groups": [{<axis>: <label>, ..., "seeds", "n", "failed", "mean",
/// "se", "steps_to_target"}], "cells": [...], ...}`; an s.e. of one seed is `null`.
pub fn json(report: &CompareReport) -> serde_json::Value {
    let groups: Vec<serde_json::Value> = report
        .groups
        .iter()
        .map(|g| {
            let mut v = serde_json::Map::new();
            for (a, l) in &g.coords {
                v.insert(a.clone(), json!(l));
            }
            v.insert("seeds".into(), json!(g.seeds));
            v.insert("n".into(), json!(g.seeds.len()));
            v.insert("failed".into(), json!(g.failed));
            let mean: serde_json::Map<String, serde_json::Value> = g
                .stats
                .iter()
                .map(|(k, m)| (k.clone(), number_or_null(m.mean)))
                .collect();
            let se: serde_json::Map<String, serde_json::Value> = g
                .stats
                .iter()
                .map(|(k, m)| (k.clone(), number_or_null(m.se)))
                .collect();
            v.insert("mean".into(), json!(mean));
            v.insert("se".into(), json!(se));
            if let Some(t) = &g.to_target {
                v.insert(
                    "to_target".into(),
                    json!({
                        "steps": {"mean": number_or_null(t.steps.mean), "se": number_or_null(t.steps.se)},
                        "epochs": {"mean": number_or_null(t.epochs.mean), "se": number_or_null(t.epochs.se)},
                        "reached": t.reached,
                        "of": t.of,
                    }),
                );
            }
            serde_json::Value::Object(v)
        })
        .collect();
    json!({
        "out": report.out.display().to_string(),
        "metric": report.metric,
        "target": report.target,
        "ran": report.ran,
        "reused": report.reused,
        "failed": report.failed(),
        "interrupted": report.interrupted(),
        "wall_seconds": report.wall_seconds,
        "se": SE_LEGEND,
        "groups": groups,
        "cells": report.cells.iter().map(|c| c.to_json(report.target.as_ref())).collect::<Vec<_>>(),
    })
}

/// Writes `table.md`, `table.csv` and `table.json` to the report's directory (each atomically)
/// and returns their paths.
pub fn write_tables(report: &CompareReport) -> Result<Vec<PathBuf>> {
    let files = [
        ("table.md", markdown(report)),
        ("table.csv", csv(report)),
        (
            "table.json",
            serde_json::to_string_pretty(&json(report)).unwrap_or_default(),
        ),
    ];
    let mut written = Vec::new();
    for (name, text) in files {
        let path = report.out.join(name);
        write_atomic(&path, text.as_bytes())?;
        written.push(path);
    }
    Ok(written)
}
