//! What a training run reports while it runs, and to whom: the [`TrainObserver`] a trainer
//! calls at each step and at the end of each period (an epoch of an image model, an evaluation
//! interval of a language model), with the notes a run has for its user. The library itself
//! draws and prints nothing: its default observer, [`Silent`], ignores everything; the
//! `moegrad` command line implements the trait with progress bars on stderr and SVG plots.

use crate::Result;
use std::path::Path;

/// The unit a run is trained, evaluated, checkpointed and resumed in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Period {
    /// one pass over the training set (image models, `--epochs`)
    Epoch,
    /// `--eval-every` iterations on random windows (language models, `--iters`)
    Interval,
}

impl Period {
    /// The period's name in messages: "epoch" or "evaluation interval".
    pub fn name(self) -> &'static str {
        match self {
            Period::Epoch => "epoch",
            Period::Interval => "evaluation interval",
        }
    }

    /// `count` periods in words: "1 epoch", "3 evaluation intervals".
    pub fn count(self, count: usize) -> String {
        format!(
            "{count} {}{}",
            self.name(),
            if count == 1 { "" } else { "s" }
        )
    }
}

/// A finished period: its checkpoint is written and its line is in `metrics.jsonl`.
pub struct PeriodEnd<'a> {
    /// what the period is
    pub period: Period,
    /// the period's number, from 1
    pub number: usize,
    /// the number of periods of the whole run
    pub total: usize,
    /// the period's figures as one line of text
    pub line: &'a str,
    /// the run's output directory
    pub out: &'a Path,
    /// its `metrics.jsonl`, one line per finished period
    pub metrics: &'a Path,
    /// a title for the run's figures (model and data)
    pub title: &'a str,
    /// whether the model routes tokens to experts (the metrics then carry `expert_load`)
    pub moe: bool,
}

/// Receives what a training run reports. Every method has a default that does nothing.
pub trait TrainObserver {
    /// A line for the user: the directory the run claimed, a warning, a note.
    fn note(&mut self, line: &str) {
        let _ = line;
    }
    /// The run starts training, with `steps` optimizer steps left in all.
    fn run_start(&mut self, period: Period, steps: u64) {
        let _ = (period, steps);
    }
    /// Period `number` of `total` starts, with `steps` optimizer steps.
    fn period_start(&mut self, period: Period, number: usize, total: usize, steps: u64) {
        let _ = (period, number, total, steps);
    }
    /// One optimizer step is taken; `loss` is a message when the loss was read back at it.
    fn step(&mut self, loss: Option<&str>) {
        let _ = loss;
    }
    /// A period is finished (its checkpoint written); an error stops the run.
    fn period_end(&mut self, end: &PeriodEnd) -> Result<()> {
        let _ = end;
        Ok(())
    }
    /// The run stops on an error or a request.
    fn stopped(&mut self) {}
    /// The run has trained its last period.
    fn finished(&mut self) {}
}

/// The observer that reports nothing (the default of [`super::run`] and
/// [`crate::lm::run`]).
pub struct Silent;

impl TrainObserver for Silent {}
