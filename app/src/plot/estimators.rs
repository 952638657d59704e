//! The lab's figure (`estimators.svg`): every estimator as one point, its bias against the
//! spread of a single draw (both relative to ‖∇‖, log-log), coloured by cost (one expert per
//! token or all n). The dashed line is the Monte Carlo noise floor `bias = 2·√(variance/M)`:
//! a point on or below it has no bias the M draws could resolve.

use super::{plot_err, series_labels};
use moegrad::estimator_lab::LabReport;
use moegrad::{Error, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use std::path::Path;

/// Values below this are drawn at it (an exact estimator has bias and spread 0).
const FLOOR: f64 = 1e-6;

/// Checks, before a long run, that the figure can be written at `path`, changing nothing the
/// user has: an existing file is opened for appending (not truncated) and must not be a
/// directory; a new one is created and removed again.
///
/// # Errors
/// The directory does not exist or is not writable, or `path` is a directory or read-only.
pub fn check_writable(path: &Path) -> Result<()> {
    let err = |e: &dyn std::fmt::Display| {
        Error::Io(format!(
            "{}: the figure cannot be written there ({e}); choose another --plot or pass --no-plot",
            path.display()
        ))
    };
    if path.is_dir() {
        return Err(err(&"it is a directory"));
    }
    if path.exists() {
        std::fs::OpenOptions::new()
            .append(true)
            .open(path)
            .map_err(|e| err(&e))?;
        return Ok(());
    }
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(|e| err(&e))?;
    std::fs::remove_file(path).map_err(|e| err(&e))
}

/// Draws `report` as an SVG file at `path`.
///
/// # Errors
/// The file cannot be written.
pub fn draw_estimators(path: &Path, report: &LabReport) -> Result<()> {
    let pts: Vec<(f64, f64, &str, bool)> = report
        .estimators
        .iter()
        .map(|e| {
            (
                e.variance.sqrt().max(FLOOR),
                e.bias.max(FLOOR),
                e.name.as_str(),
                e.experts_per_token > 1.5,
            )
        })
        .collect();
    let span = |vals: &mut dyn Iterator<Item = f64>| {
        let (lo, hi) = vals.fold((f64::INFINITY, 0.0f64), |(l, h), v| (l.min(v), h.max(v)));
        (lo / 3.0, (hi * 3.0).max(lo * 10.0))
    };
    let (x0, x1) = span(&mut pts.iter().map(|p| p.0));
    let (y0, y1) = span(&mut pts.iter().map(|p| p.1));
    super::svg(path, (900, 620), |root| {
        draw_points(root, path, report, &pts, (x0..x1, y0..y1))
    })
}

/// The estimators' figure of [`draw_estimators`] on `root`: the points `(spread, bias, name,
/// dense)` over the log-scaled ranges.
fn draw_points(
    root: &DrawingArea<SVGBackend<'_>, Shift>,
    path: &Path,
    report: &LabReport,
    pts: &[(f64, f64, &str, bool)],
    (xs, ys): (std::ops::Range<f64>, std::ops::Range<f64>),
) -> Result<()> {
    let (x0, x1, y0, y1) = (xs.start, xs.end, ys.start, ys.end);
    let c = &report.config;
    let p = &c.problem;
    let mut chart = ChartBuilder::on(root)
        .caption(
            format!(
                "router-gradient estimators: {} loss, n = {}, T = {}, d = {}, M = {}, jitter {}",
                p.loss, p.experts, p.tokens, p.dim, c.samples, c.jitter
            ),
            ("sans-serif", 18),
        )
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d((x0..x1).log_scale(), (y0..y1).log_scale())
        .map_err(|e| plot_err(path, e))?;
    chart
        .configure_mesh()
        .x_desc("spread of one draw, √variance / ‖∇‖ (log)")
        .y_desc("bias ‖mean − ∇‖ / ‖∇‖ (log)")
        .x_label_formatter(&|v| format!("{v:.0e}"))
        .y_label_formatter(&|v| format!("{v:.0e}"))
        .draw()
        .map_err(|e| plot_err(path, e))?;
    // the noise floor: bias = 2·spread/√M
    let k = 2.0 / (c.samples as f64).sqrt();
    let steps = 40;
    let line: Vec<(f64, f64)> = (0..=steps)
        .map(|i| {
            let x = x0 * (x1 / x0).powf(i as f64 / steps as f64);
            (x, (k * x).clamp(y0, y1))
        })
        .collect();
    chart
        .draw_series(DashedLineSeries::new(
            line,
            6,
            4,
            BLACK.mix(0.6).stroke_width(1),
        ))
        .map_err(|e| plot_err(path, e))?
        .label("noise floor 2·√(variance/M)")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], BLACK.mix(0.6)));
    let sparse = RGBColor(31, 119, 180);
    let dense = RGBColor(214, 39, 40);
    for (is_dense, color, label) in [
        (false, sparse, "one expert per token"),
        (true, dense, "all n experts per token (dense)"),
    ] {
        chart
            .draw_series(
                pts.iter()
                    .filter(|q| q.3 == is_dense)
                    .map(|&(x, y, _, _)| Circle::new((x, y), 6, color.filled())),
            )
            .map_err(|e| plot_err(path, e))?
            .label(label)
            .legend(move |(x, y)| Circle::new((x + 8, y), 5, color.filled()));
    }
    // names beside the points, moved down or up until they overlap no name placed before
    let mut placed: Vec<(i32, i32, i32)> = Vec::new(); // (left, top, width) in pixels
    let line_h = 14;
    for &(x, y, name, _) in pts {
        let (px, py) = chart.backend_coord(&(x, y));
        let width = 8 * name.chars().count() as i32;
        let left = px + 10;
        let clash = |top: i32| {
            placed.iter().any(|&(l, t, w)| {
                left < l + w && l < left + width && top < t + line_h && t < top + line_h
            })
        };
        let top = (0..12)
            .map(|i| py - 16 + if i % 2 == 0 { i / 2 } else { -(i + 1) / 2 } * line_h)
            .find(|&t| !clash(t))
            .unwrap_or(py - 16);
        placed.push((left, top, width));
        root.draw(&Text::new(
            name.to_string(),
            (left, top),
            ("sans-serif", 14),
        ))
        .map_err(|e| plot_err(path, e))?;
    }
    series_labels(&mut chart, SeriesLabelPosition::LowerRight, path)
}
