//! The figures of a language-model run, redrawn after every evaluation from `metrics.jsonl`:
//! `curves.svg` (training and validation loss against the iteration) and, for `moe-gpt`,
//! `expert_load_<layer>.svg` per MoE layer (each expert's share of the kept assignments against
//! the evaluation number; `plot::train::draw_expert_load` draws it).

use moegrad::{Error, Result};
use plotters::prelude::*;
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

fn plot_err(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::Io(format!("{}: could not draw the plot: {e}", path.display()))
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
    let file = moegrad::checkpoint::AtomicFile::new(&path)?;
    let tmp = file.tmp().to_path_buf();
    let root = SVGBackend::new(&tmp, (640, 400)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| plot_err(&path, e))?;
    let last = points.last().map(|p| p.iter).unwrap_or(1.0).max(1.0);
    let max_loss = points
        .iter()
        .flat_map(|p| [p.train, p.val])
        .filter(|x| x.is_finite())
        .fold(0.0, f64::max)
        * 1.1;
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("{title}: loss"), ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(32)
        .y_label_area_size(48)
        .build_cartesian_2d(0.0..last, 0.0..max_loss.max(1e-3))
        .map_err(|e| plot_err(&path, e))?;
    chart
        .configure_mesh()
        .x_desc("iteration")
        .y_desc("cross-entropy (nats per character)")
        .draw()
        .map_err(|e| plot_err(&path, e))?;
    for (name, color, pick) in [
        ("train", BLUE, (|p: &Point| p.train) as fn(&Point) -> f64),
        ("validation", RED, |p: &Point| p.val),
    ] {
        chart
            .draw_series(LineSeries::new(
                points.iter().map(|p| (p.iter, pick(p))),
                color.stroke_width(2),
            ))
            .map_err(|e| plot_err(&path, e))?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color));
    }
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE)
        .draw()
        .map_err(|e| plot_err(&path, e))?;
    root.present().map_err(|e| plot_err(&path, e))?;
    drop(root);
    file.commit()?;

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
    Ok(())
}
