//! The figures of a language-model run, redrawn after every evaluation from `metrics.jsonl`:
//! `curves.svg` (training and validation loss against the iteration) and, for `moe-gpt`,
//! `expert_load_<layer>.svg` per MoE layer (each expert's share of the kept assignments against
//! the evaluation number; `plot::train::draw_expert_load` draws it).

use moegrad::Result;
use std::path::Path;

/// One evaluation's figures as read from `metrics.jsonl`.
struct Point {
    iter: f64,
    train: f64,
    val: f64,
    loads: Vec<Vec<f64>>,
}

fn read(metrics: &Path) -> Vec<Point> {
    let Ok(text) = std::fs::read_to_string(metrics) else {
        return Vec::new();
    };
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .map(|v| Point {
            iter: v["iter"].as_f64().unwrap_or(0.0),
            train: v["train_loss"].as_f64().unwrap_or(f64::NAN),
            val: v["val_loss"].as_f64().unwrap_or(f64::NAN),
            loads: v["expert_load"]
                .as_array()
                .map(|layers| {
                    layers
                        .iter()
                        .map(|l| {
                            l.as_array()
                                .map(|a| a.iter().filter_map(|x| x.as_f64()).collect())
                                .unwrap_or_default()
                        })
                        .collect()
                })
                .unwrap_or_default(),
        })
        .collect()
}

/// Redraws the figures in `dir` from `metrics`.
///
/// # Errors
/// A figure that cannot be written (naming its path).
pub fn draw(dir: &Path, metrics: &Path, title: &str) -> Result<()> {
    let points = read(metrics);
    if points.is_empty() {
        return Ok(());
    }
    let path = dir.join("curves.svg");
    let last = points.last().map(|p| p.iter).unwrap_or(1.0).max(1.0);
    let losses: Vec<(f64, f64, f64)> = points.iter().map(|p| (p.iter, p.train, p.val)).collect();
    super::svg(&path, (640, 400), |root| {
        super::draw_loss(
            root,
            &path,
            title,
            0.0..last,
            ("iteration", "cross-entropy (nats per character)"),
            "validation",
            &losses,
        )
    })?;

    let layers = points[0].loads.len();
    for layer in 0..layers {
        let loads: Vec<(usize, Vec<f64>)> = points
            .iter()
            .enumerate()
            .filter_map(|(i, p)| p.loads.get(layer).map(|l| (i + 1, l.clone())))
            .collect();
        crate::plot::train::draw_expert_load(
            &dir.join(format!("expert_load_{layer}.svg")),
            &loads,
        )?;
    }
    let loads = super::routing::read(metrics);
    super::routing::draw_heatmap(&dir.join("routing_heatmap.svg"), &loads, title, "iteration")
}
