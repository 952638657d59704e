//! What a terminal user sees while moegrad works: [`CliObserver`], the training observer of
//! `moegrad train` (a progress bar per epoch, or one over all iterations of a language model,
//! the line of each finished period, notes, and the plots redrawn from `metrics.jsonl` after
//! each period), and [`LabBar`], the estimator lab's bar. Bars are drawn on stderr by
//! indicatif, which hides them when stderr is not a terminal.

use indicatif::{ProgressBar, ProgressStyle};
use moegrad::Result;
use moegrad::estimator_lab::LabProgress;
use moegrad::train::{Period, PeriodEnd, TrainObserver};

/// A bar styled by `template`, of length `len`.
fn bar(template: &str, len: u64) -> ProgressBar {
    let b = ProgressBar::new(len);
    b.set_style(
        ProgressStyle::with_template(template)
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    b
}

/// The command line's [`TrainObserver`]: bars, lines and plots (see the module docs).
pub struct CliObserver {
    bar: ProgressBar,
}

impl CliObserver {
    /// An observer with no bar yet.
    pub fn new() -> CliObserver {
        CliObserver {
            bar: ProgressBar::hidden(),
        }
    }
}

impl Default for CliObserver {
    fn default() -> Self {
        CliObserver::new()
    }
}

impl TrainObserver for CliObserver {
    fn note(&mut self, line: &str) {
        eprintln!("{line}");
    }

    fn run_start(&mut self, period: Period, steps: u64) {
        // a language model's bar spans the whole run; an image run's, one epoch
        if period == Period::Interval {
            self.bar = bar(
                "iter {pos}/{len} [{bar:30}] {msg} ({elapsed}, eta {eta})",
                steps,
            );
        }
    }

    fn period_start(&mut self, period: Period, number: usize, total: usize, steps: u64) {
        if period == Period::Epoch {
            self.bar = bar("{prefix} [{bar:30}] {pos}/{len} {msg} ({elapsed})", steps);
            self.bar.set_prefix(format!("epoch {number}/{total}"));
        }
    }

    fn step(&mut self, loss: Option<&str>) {
        if let Some(message) = loss {
            self.bar.set_message(message.to_string());
        }
        self.bar.inc(1);
    }

    fn period_end(&mut self, end: &PeriodEnd) -> Result<()> {
        match end.period {
            Period::Epoch => {
                self.bar.finish_and_clear();
                crate::plot::train::draw(end.out, end.metrics, end.title, end.moe)?;
                eprintln!("{}", end.line);
            }
            Period::Interval => {
                crate::plot::lm::draw(end.out, end.metrics, end.title)?;
                self.bar.println(end.line);
            }
        }
        Ok(())
    }

    fn stopped(&mut self) {
        self.bar.abandon();
    }

    fn finished(&mut self) {
        self.bar.finish_and_clear();
    }
}

/// The estimator lab's progress bar: one tick per draw, the estimator measured as its message.
pub struct LabBar(pub ProgressBar);

impl LabBar {
    /// A bar on stderr (`hidden`: none, for `--json`).
    pub fn new(hidden: bool) -> LabBar {
        if hidden {
            LabBar(ProgressBar::hidden())
        } else {
            LabBar(bar(
                "{msg:16} [{bar:30}] {pos}/{len} draws ({elapsed}, ETA {eta})",
                0,
            ))
        }
    }
}

impl LabProgress for LabBar {
    fn start(&mut self, draws: u64) {
        self.0.set_length(draws);
        self.0.set_position(0);
    }
    fn estimator(&mut self, name: &str) {
        self.0.set_message(name.to_string());
    }
    fn draw(&mut self) {
        self.0.inc(1);
    }
}
