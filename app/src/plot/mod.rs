//! The SVG figures the command line draws (plotters): a training run's curves and expert load
//! ([`train`], epochs of image models; [`lm`], evaluation intervals of language models), and
//! the estimator lab's bias–spread figure ([`estimators`]). Each is redrawn from the run's
//! `metrics.jsonl` or report and written atomically.

pub mod estimators;
pub mod lm;
pub mod train;
