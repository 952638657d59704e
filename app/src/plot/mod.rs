//! The SVG figures the command line draws (plotters): a training run's curves and expert load
//! ([`train`], epochs of image models; [`lm`], evaluation intervals of language models), and
//! each MoE layer's load over the run as a heat map ([`routing`]), and the estimator lab's
//! bias–spread figure ([`estimators`]). Each is redrawn from the run's
//! `metrics.jsonl` or report and written atomically (one SVG writer, `svg`, for every figure);
//! the loss panel of both kinds of run is one function (`draw_loss`).

pub mod estimators;
pub mod lm;
pub mod routing;
pub mod train;

use moegrad::{Error, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use std::path::Path;

/// The error of a figure that could not be drawn, naming its file.
fn plot_err(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::Io(format!("{}: could not draw the plot: {e}", path.display()))
}

/// Writes the figure `draw` paints, `size` pixels on a white ground, to `path` as SVG,
/// atomically (a reader sees the previous figure or the whole new one).
fn svg(
    path: &Path,
    size: (u32, u32),
    draw: impl FnOnce(&DrawingArea<SVGBackend<'_>, Shift>) -> Result<()>,
) -> Result<()> {
    let file = moegrad::checkpoint::AtomicFile::new(path)?;
    let tmp = file.tmp().to_path_buf();
    {
        let root = SVGBackend::new(&tmp, size).into_drawing_area();
        root.fill(&WHITE).map_err(|e| plot_err(path, e))?;
        draw(&root)?;
        root.present().map_err(|e| plot_err(path, e))?;
    }
    file.commit()
}

/// The loss panel of a run's curves: the training loss (blue) and the evaluation loss (red,
/// labelled `eval_name`) of each point `(x, train, eval)`, over `x_range`, with the y axis from 0
/// to a tenth above the largest finite loss. `path` names the figure in errors.
#[allow(clippy::too_many_arguments)]
fn draw_loss(
    area: &DrawingArea<SVGBackend<'_>, Shift>,
    path: &Path,
    title: &str,
    x_range: std::ops::Range<f64>,
    (x_desc, y_desc): (&str, &str),
    eval_name: &str,
    points: &[(f64, f64, f64)],
) -> Result<()> {
    let max_loss = points
        .iter()
        .flat_map(|p| [p.1, p.2])
        .filter(|x| x.is_finite())
        .fold(0.0, f64::max)
        * 1.1;
    let mut chart = ChartBuilder::on(area)
        .caption(format!("{title}: loss"), ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(32)
        .y_label_area_size(48)
        .build_cartesian_2d(x_range, 0.0..max_loss.max(1e-3))
        .map_err(|e| plot_err(path, e))?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .draw()
        .map_err(|e| plot_err(path, e))?;
    for (name, color, pick) in [
        (
            "train",
            BLUE,
            (|p: &(f64, f64, f64)| p.1) as fn(&(f64, f64, f64)) -> f64,
        ),
        (eval_name, RED, |p: &(f64, f64, f64)| p.2),
    ] {
        chart
            .draw_series(LineSeries::new(
                points.iter().map(|p| (p.0, pick(p))),
                color.stroke_width(2),
            ))
            .map_err(|e| plot_err(path, e))?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color));
    }
    series_labels(&mut chart, SeriesLabelPosition::MiddleRight, path)
}

/// Draws the legend box of `chart` (black border, white ground) at `position`.
fn series_labels<'a, DB: DrawingBackend + 'a, CT: CoordTranslate>(
    chart: &mut ChartContext<'a, DB, CT>,
    position: SeriesLabelPosition,
    path: &Path,
) -> Result<()> {
    chart
        .configure_series_labels()
        .position(position)
        .border_style(BLACK)
        .background_style(WHITE)
        .draw()
        .map_err(|e| plot_err(path, e))
}
