//! The figures of an image run, redrawn after every epoch from `metrics.jsonl` ([`draw`]):
//! `curves.svg`, train and test loss (left) and test accuracy per task (right) against the
//! epoch, and for MoE models `expert_load.svg`, each expert's share of the kept assignments.

use super::{plot_err, series_labels};
use moegrad::Result;
use plotters::coord::Shift;
use plotters::prelude::*;
use std::path::Path;

/// One epoch's figures, as plotted.
#[derive(Clone, Debug)]
pub struct EpochPoint {
    /// 1-based epoch
    pub epoch: usize,
    /// mean training loss
    pub train_loss: f64,
    /// mean test loss
    pub test_loss: f64,
    /// test accuracy per task, in [0, 1]
    pub test_accuracy: Vec<f64>,
}

/// Redraws `curves.svg` in `dir` from the epochs of `metrics`, and `expert_load.svg` as well
/// when `moe`.
pub fn draw(dir: &Path, metrics: &Path, title: &str, moe: bool) -> Result<()> {
    draw_curves(&dir.join("curves.svg"), &read_points(metrics), title)?;
    if moe {
        draw_expert_load(&dir.join("expert_load.svg"), &read_loads(metrics))?;
        let loads = super::routing::read(metrics);
        super::routing::draw_heatmap(&dir.join("routing_heatmap.svg"), &loads, title, "epoch")?;
    }
    Ok(())
}

/// The epochs of `metrics.jsonl` as plotted (none when it cannot be read).
fn read_points(path: &Path) -> Vec<EpochPoint> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Vec::new();
    };
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .map(|v| EpochPoint {
            epoch: v["epoch"].as_u64().unwrap_or(0) as usize,
            train_loss: v["train_loss"].as_f64().unwrap_or(f64::NAN),
            test_loss: v["test_loss"].as_f64().unwrap_or(f64::NAN),
            test_accuracy: match &v["test_accuracy"] {
                serde_json::Value::Array(a) => a.iter().filter_map(|x| x.as_f64()).collect(),
                x => x.as_f64().into_iter().collect(),
            },
        })
        .collect()
}

/// Per epoch of `metrics.jsonl`, the expert load (epochs without one are left out).
fn read_loads(path: &Path) -> Vec<(usize, Vec<f64>)> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Vec::new();
    };
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| {
            let load = v["expert_load"]
                .as_array()?
                .iter()
                .filter_map(|x| x.as_f64())
                .collect();
            Some((v["epoch"].as_u64()? as usize, load))
        })
        .collect()
}

/// Draws the curves to an SVG file.
pub fn draw_curves(path: &Path, points: &[EpochPoint], title: &str) -> Result<()> {
    if points.is_empty() {
        return Ok(());
    }
    super::svg(path, (960, 400), |root| {
        let (left, right) = root.split_horizontally(480);
        let last = points.last().map(|p| p.epoch).unwrap_or(1).max(2) as f64;
        let first = points[0].epoch.min(1) as f64;
        let losses: Vec<(f64, f64, f64)> = points
            .iter()
            .map(|p| (p.epoch as f64, p.train_loss, p.test_loss))
            .collect();
        let axes = ("epoch", "cross-entropy");
        super::draw_loss(&left, path, title, first..last, axes, "test", &losses)?;
        draw_accuracy(&right, path, points, title, first..last)
    })
}

/// The right panel of `curves.svg`: the test accuracy of each task against the epoch.
fn draw_accuracy(
    area: &DrawingArea<SVGBackend<'_>, Shift>,
    path: &Path,
    points: &[EpochPoint],
    title: &str,
    x_range: std::ops::Range<f64>,
) -> Result<()> {
    let lo = points
        .iter()
        .flat_map(|p| p.test_accuracy.iter().copied())
        .fold(1.0, f64::min);
    let mut chart = ChartBuilder::on(area)
        .caption(format!("{title}: test accuracy"), ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(32)
        .y_label_area_size(48)
        .build_cartesian_2d(x_range, (lo - 0.02).clamp(0.0, 0.99)..1.0)
        .map_err(|e| plot_err(path, e))?;
    chart
        .configure_mesh()
        .x_desc("epoch")
        .y_desc("accuracy")
        .draw()
        .map_err(|e| plot_err(path, e))?;
    let tasks = points[0].test_accuracy.len();
    for t in 0..tasks {
        let color = Palette99::pick(t + 2).to_rgba();
        chart
            .draw_series(LineSeries::new(
                points.iter().map(|p| {
                    (
                        p.epoch as f64,
                        p.test_accuracy.get(t).copied().unwrap_or(0.0),
                    )
                }),
                color.stroke_width(2),
            ))
            .map_err(|e| plot_err(path, e))?
            .label(if tasks == 1 {
                "test".to_string()
            } else {
                format!("task {}", t + 1)
            })
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color));
    }
    series_labels(&mut chart, SeriesLabelPosition::MiddleRight, path)
}

/// Draws each expert's share of the kept assignments against the epoch (`expert_load.svg`).
pub fn draw_expert_load(path: &Path, loads: &[(usize, Vec<f64>)]) -> Result<()> {
    let Some((_, first)) = loads.first() else {
        return Ok(());
    };
    let experts = first.len();
    super::svg(path, (640, 400), |root| {
        draw_loads(root, path, loads, experts)
    })
}

/// The expert-load figure of [`draw_expert_load`] on `root`.
fn draw_loads(
    root: &DrawingArea<SVGBackend<'_>, Shift>,
    path: &Path,
    loads: &[(usize, Vec<f64>)],
    experts: usize,
) -> Result<()> {
    let last = loads.last().map(|l| l.0).unwrap_or(1).max(2) as f64;
    let top = loads
        .iter()
        .flat_map(|l| l.1.iter().copied())
        .fold(0.0, f64::max)
        .max(1.0 / experts.max(1) as f64)
        * 1.15;
    let mut chart = ChartBuilder::on(root)
        .caption(
            "expert load (share of kept assignments)",
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(32)
        .y_label_area_size(48)
        .build_cartesian_2d(loads[0].0.min(1) as f64..last, 0.0..top)
        .map_err(|e| plot_err(path, e))?;
    chart
        .configure_mesh()
        .x_desc("epoch")
        .y_desc("share")
        .draw()
        .map_err(|e| plot_err(path, e))?;
    for e in 0..experts {
        let color = Palette99::pick(e).to_rgba();
        chart
            .draw_series(LineSeries::new(
                loads
                    .iter()
                    .map(|(ep, l)| (*ep as f64, l.get(e).copied().unwrap_or(0.0))),
                color.stroke_width(2),
            ))
            .map_err(|e| plot_err(path, e))?
            .label(format!("expert {e}"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color));
    }
    let uniform = 1.0 / experts.max(1) as f64;
    chart
        .draw_series(LineSeries::new(
            [(loads[0].0.min(1) as f64, uniform), (last, uniform)],
            BLACK.stroke_width(1),
        ))
        .map_err(|e| plot_err(path, e))?
        .label("uniform")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], BLACK));
    series_labels(&mut chart, SeriesLabelPosition::MiddleRight, path)
}
