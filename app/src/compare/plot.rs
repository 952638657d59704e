//! The figures of a grid, in `--out`:
//!
//! * `curves_<metric>.svg`: per group, the mean learning curve of the metric against the step,
//!   with a band of ±1 standard error over the seeds, one colour per group (the metric is the
//!   `--metric` when the runs log it after each evaluation, else the test or validation loss);
//! * `final_<metric>.svg`: per group, the mean final value of `--metric` as a bar with a ±1
//!   standard error bar, in the same colours.

use super::CompareReport;
use super::aggregate::CellState;
use super::stats::{CurvePoint, MeanSe, mean_curve};
use moegrad::{Error, Result};
use plotters::prelude::*;
use std::path::{Path, PathBuf};

fn plot_err(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::Io(format!(
        "{}: could not draw the figure: {e}",
        path.display()
    ))
}

fn colour(i: usize) -> RGBColor {
    let c = Palette99::pick(i).to_rgba();
    RGBColor(c.0, c.1, c.2)
}

/// Draws both figures; returns the paths written (a figure with nothing to draw is skipped).
pub fn draw_all(report: &CompareReport) -> Result<Vec<PathBuf>> {
    let mut written = Vec::new();
    let curve_metric = if report.cells.iter().any(|c| {
        c.curve
            .iter()
            .any(|p| p.values.contains_key(&report.metric))
    }) {
        report.metric.clone()
    } else if report.cells.iter().any(|c| c.language_model) {
        "val_loss".to_string()
    } else {
        "test_loss".to_string()
    };
    let path = report.out.join(format!("curves_{curve_metric}.svg"));
    if draw_curves(&path, report, &curve_metric)? {
        written.push(path);
    }
    let path = report.out.join(format!("final_{}.svg", report.metric));
    if draw_bars(&path, report)? {
        written.push(path);
    }
    Ok(written)
}

/// Per group with finished cells: its label and its mean curve.
type GroupCurve = (String, usize, Vec<(f64, MeanSe)>);

fn group_curves(report: &CompareReport, metric: &str) -> Vec<GroupCurve> {
    report
        .groups
        .iter()
        .enumerate()
        .filter_map(|(gi, g)| {
            let curves: Vec<&[CurvePoint]> = g
                .cells
                .iter()
                .map(|&i| &report.cells[i])
                .filter(|c| c.state == CellState::Ok && !c.curve.is_empty())
                .map(|c| c.curve.as_slice())
                .collect();
            if curves.is_empty() {
                return None;
            }
            let mean = mean_curve(&curves, metric);
            (!mean.is_empty()).then(|| (g.label(), gi, mean))
        })
        .collect()
}

/// The learning curves with ±s.e. bands; false when no group has a curve of `metric`.
fn draw_curves(path: &Path, report: &CompareReport, metric: &str) -> Result<bool> {
    let groups = group_curves(report, metric);
    if groups.is_empty() {
        return Ok(false);
    }
    let points = || groups.iter().flat_map(|(_, _, c)| c.iter());
    let x_lo = points().map(|(x, _)| *x).fold(f64::INFINITY, f64::min);
    let x_hi = points().map(|(x, _)| *x).fold(f64::NEG_INFINITY, f64::max);
    let band = |m: &MeanSe| if m.se.is_finite() { m.se } else { 0.0 };
    let y_lo = points()
        .map(|(_, m)| m.mean - band(m))
        .filter(|v| v.is_finite())
        .fold(f64::INFINITY, f64::min);
    let y_hi = points()
        .map(|(_, m)| m.mean + band(m))
        .filter(|v| v.is_finite())
        .fold(f64::NEG_INFINITY, f64::max);
    if !(y_lo.is_finite() && y_hi.is_finite()) {
        return Ok(false);
    }
    let pad = ((y_hi - y_lo) * 0.05).max(1e-6);
    let x_hi = if x_hi > x_lo { x_hi } else { x_lo + 1.0 };
    let file = moegrad::checkpoint::AtomicFile::new(path)?;
    let tmp = file.tmp().to_path_buf();
    let root = SVGBackend::new(&tmp, (900, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| plot_err(path, e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("{metric}: mean ± s.e. over seeds"),
            ("sans-serif", 20),
        )
        .margin(14)
        .x_label_area_size(36)
        .y_label_area_size(60)
        .build_cartesian_2d(x_lo..x_hi, (y_lo - pad)..(y_hi + pad))
        .map_err(|e| plot_err(path, e))?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc(metric)
        .draw()
        .map_err(|e| plot_err(path, e))?;
    for (label, gi, curve) in &groups {
        let c = colour(*gi);
        if curve.len() > 1 && curve.iter().all(|(_, m)| m.se.is_finite()) {
            let mut outline: Vec<(f64, f64)> =
                curve.iter().map(|(x, m)| (*x, m.mean + m.se)).collect();
            outline.extend(curve.iter().rev().map(|(x, m)| (*x, m.mean - m.se)));
            chart
                .draw_series(std::iter::once(Polygon::new(outline, c.mix(0.18).filled())))
                .map_err(|e| plot_err(path, e))?;
        }
        chart
            .draw_series(LineSeries::new(
                curve.iter().map(|(x, m)| (*x, m.mean)),
                c.stroke_width(2),
            ))
            .map_err(|e| plot_err(path, e))?
            .label(label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], c.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE.mix(0.85))
        .draw()
        .map_err(|e| plot_err(path, e))?;
    root.present().map_err(|e| plot_err(path, e))?;
    drop(root);
    file.commit()?;
    Ok(true)
}

/// The bar chart of the final `--metric` with ±s.e. error bars; false when no group has it.
fn draw_bars(path: &Path, report: &CompareReport) -> Result<bool> {
    let bars: Vec<(String, usize, MeanSe)> = report
        .groups
        .iter()
        .enumerate()
        .filter_map(|(gi, g)| {
            let m = g.stats.get(&report.metric)?;
            m.mean.is_finite().then(|| (g.label(), gi, *m))
        })
        .collect();
    if bars.is_empty() {
        return Ok(false);
    }
    let err = |m: &MeanSe| if m.se.is_finite() { m.se } else { 0.0 };
    let hi = bars
        .iter()
        .map(|(_, _, m)| m.mean + err(m))
        .fold(0.0, f64::max);
    let lo = bars
        .iter()
        .map(|(_, _, m)| m.mean - err(m))
        .fold(0.0, f64::min);
    let span = (hi - lo).max(1e-9);
    let file = moegrad::checkpoint::AtomicFile::new(path)?;
    let tmp = file.tmp().to_path_buf();
    let root = SVGBackend::new(&tmp, (900, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| plot_err(path, e))?;
    let n = bars.len() as f64;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("final {}: mean ± s.e. over seeds", report.metric),
            ("sans-serif", 20),
        )
        .margin(14)
        .x_label_area_size(20)
        .y_label_area_size(60)
        .build_cartesian_2d(-0.6..n - 0.4, (lo - 0.05 * span)..(hi + 0.35 * span))
        .map_err(|e| plot_err(path, e))?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .y_desc(report.metric.as_str())
        .draw()
        .map_err(|e| plot_err(path, e))?;
    for (i, (label, gi, m)) in bars.iter().enumerate() {
        let c = colour(*gi);
        let x = i as f64;
        chart
            .draw_series(std::iter::once(Rectangle::new(
                [(x - 0.35, 0.0), (x + 0.35, m.mean)],
                c.filled(),
            )))
            .map_err(|e| plot_err(path, e))?
            .label(format!("{label} (n = {})", m.n))
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], c.filled()));
        if m.se.is_finite() && m.se > 0.0 {
            let (top, bottom) = (m.mean + m.se, m.mean - m.se);
            let whisker = vec![
                vec![(x, bottom), (x, top)],
                vec![(x - 0.1, top), (x + 0.1, top)],
                vec![(x - 0.1, bottom), (x + 0.1, bottom)],
            ];
            chart
                .draw_series(
                    whisker
                        .into_iter()
                        .map(|line| PathElement::new(line, BLACK.stroke_width(2))),
                )
                .map_err(|e| plot_err(path, e))?;
        }
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .border_style(BLACK)
        .background_style(WHITE.mix(0.85))
        .draw()
        .map_err(|e| plot_err(path, e))?;
    root.present().map_err(|e| plot_err(path, e))?;
    drop(root);
    file.commit()?;
    Ok(true)
}
