//! `routing_heatmap.svg`: each MoE layer's expert load over the run as a heat map, redrawn with
//! the other figures from `metrics.jsonl` (the `routing.layers[i].load` of each epoch or
//! evaluation interval, `moe::RoutingDiagnostics`). One panel per layer, top to bottom; in each,
//! x is the epoch or iteration, y the expert, and the colour the expert's load over the ideal
//! share 1/n: white at 1 (balanced), blue toward 0 (an idle or dead expert, darkest at 0), red
//! above 1 (darkest at `HOT` times the ideal or more). A collapse reads as one red row over
//! blue ones.

use super::plot_err;
use moegrad::Result;
use plotters::prelude::*;
use std::path::Path;

/// Load over the ideal at which the colour is darkest red.
pub const HOT: f64 = 4.0;

/// The loads of one evaluation point: its step (epoch or iteration) and, per layer, each
/// expert's share of the kept assignments.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadPoint {
    /// the epoch (image models) or iteration (language models)
    pub step: f64,
    /// `[layer][expert]` shares, each layer's summing to 1
    pub layers: Vec<Vec<f64>>,
}

/// The points of `metrics.jsonl` that carry routing diagnostics (none when it cannot be read).
pub fn read(path: &Path) -> Vec<LoadPoint> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Vec::new();
    };
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| {
            let step = v["iter"].as_f64().or_else(|| v["epoch"].as_f64())?;
            let layers: Vec<Vec<f64>> = v["routing"]["layers"]
                .as_array()?
                .iter()
                .map(|l| {
                    l["load"]
                        .as_array()
                        .map(|a| a.iter().filter_map(|x| x.as_f64()).collect())
                        .unwrap_or_default()
                })
                .collect();
            (!layers.is_empty()).then_some(LoadPoint { step, layers })
        })
        .collect()
}

/// The colour of a load `ratio` = share / (1/n): white at 1, blue below, red above.
pub fn colour(ratio: f64) -> RGBColor {
    let ratio = if ratio.is_finite() {
        ratio.max(0.0)
    } else {
        0.0
    };
    let mix = |t: f64, to: (f64, f64, f64)| {
        let t = t.clamp(0.0, 1.0);
        let c = |w: f64| (255.0 + (w - 255.0) * t).round() as u8;
        RGBColor(c(to.0), c(to.1), c(to.2))
    };
    if ratio <= 1.0 {
        mix(1.0 - ratio, (33.0, 102.0, 172.0))
    } else {
        mix((ratio - 1.0) / (HOT - 1.0), (178.0, 24.0, 43.0))
    }
}

/// Draws the heat map of `points` to `path` (nothing without points).
/// `x_label` names the step (`epoch` or `iteration`).
pub fn draw_heatmap(path: &Path, points: &[LoadPoint], title: &str, x_label: &str) -> Result<()> {
    let Some(first) = points.first() else {
        return Ok(());
    };
    let layers = first.layers.len();
    let experts = first.layers.iter().map(|l| l.len()).max().unwrap_or(0);
    if experts == 0 {
        return Ok(());
    }
    let panel = 60 + 14 * experts.min(40) as u32;
    let height = 50 + panel * layers as u32;
    super::svg(path, (720, height), |root| {
        let (top, body) = root.split_vertically(40);
        top.titled(
            &format!("{title}: expert load / ideal (white 1, blue idle, red ≥ {HOT})"),
            ("sans-serif", 16),
        )
        .map_err(|e| plot_err(path, e))?;
        let panels = body.split_evenly((layers, 1));
        // cells span from one point's step to the next; the last one as wide as the one before
        let edges: Vec<f64> = {
            let mut e: Vec<f64> = points.iter().map(|p| p.step).collect();
            let last = *e.last().unwrap_or(&1.0);
            let width = if e.len() > 1 {
                last - e[e.len() - 2]
            } else {
                1.0
            };
            e.insert(0, (points[0].step - width).max(0.0));
            e
        };
        for (layer, area) in panels.iter().enumerate() {
            let mut chart = ChartBuilder::on(area)
                .caption(format!("MoE layer {layer}"), ("sans-serif", 14))
                .margin(6)
                .x_label_area_size(28)
                .y_label_area_size(56)
                .build_cartesian_2d(edges[0]..edges[edges.len() - 1], 0.0..experts as f64)
                .map_err(|e| plot_err(path, e))?;
            chart
                .configure_mesh()
                .disable_mesh()
                .x_desc(x_label)
                .y_desc("expert")
                .y_labels(experts.min(16) + 1)
                .y_label_formatter(&|y| format!("{}", *y as usize))
                .draw()
                .map_err(|e| plot_err(path, e))?;
            let cells = points.iter().enumerate().flat_map(|(i, p)| {
                let loads = p.layers.get(layer).cloned().unwrap_or_default();
                let n = loads.len().max(1) as f64;
                let (x0, x1) = (edges[i], edges[i + 1]);
                loads.into_iter().enumerate().map(move |(e, share)| {
                    Rectangle::new(
                        [(x0, e as f64), (x1, e as f64 + 1.0)],
                        colour(share * n).filled(),
                    )
                })
            });
            chart.draw_series(cells).map_err(|e| plot_err(path, e))?;
        }
        Ok(())
    })
}
