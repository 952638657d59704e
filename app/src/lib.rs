//! # moegrad-cli
//!
//! The `moegrad` command line's own library, beside the binary in `bin/moegrad/`: what a
//! terminal user sees and what the `moegrad` library leaves out so that it carries no
//! command-line crates:
//! - [`progress`]: the training observer of the command line (progress bars on stderr, the
//!   per-period lines, the plots redrawn after each period) and the estimator lab's bar;
//! - [`plot`]: the SVG figures (plotters) of training runs and of the estimator lab;
//! - [`bench`](mod@bench): the workloads of `moegrad bench` (matmul, MoE, training epochs, the GPU step's
//!   counts), built on the library's public API and its [`moegrad::gpu`] facade;
//! - [`compare`]: grids of training runs (router × seed × settings) run as child processes and
//!   aggregated into tables of mean ± standard error (`moegrad compare`, grids in TOML).

pub mod bench;
pub mod compare;
pub mod plot;
pub mod progress;
