//! Learning-rate schedules: a linear warm-up followed by a constant or cosine-decaying rate.

use crate::{Error, Result};

/// The shape of the schedule after warm-up.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ScheduleKind {
    /// the base rate throughout
    Constant,
    /// `min + ½(base − min)(1 + cos(π·progress))` over the remaining steps
    Cosine {
        /// the rate reached at the last step
        min_lr: f64,
    },
}

/// A learning-rate schedule over `total_steps` steps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Schedule {
    /// the peak rate
    pub base_lr: f64,
    /// steps of linear warm-up from `base_lr / warmup_steps` to `base_lr`
    pub warmup_steps: u64,
    /// total steps of the run
    pub total_steps: u64,
    /// what follows the warm-up
    pub kind: ScheduleKind,
}

impl Schedule {
    /// Checks the settings.
    pub fn new(
        base_lr: f64,
        warmup_steps: u64,
        total_steps: u64,
        kind: ScheduleKind,
    ) -> Result<Schedule> {
        super::adam::check_lr(base_lr)?;
        if let ScheduleKind::Cosine { min_lr } = kind
            && !(min_lr.is_finite() && (0.0..=base_lr).contains(&min_lr))
        {
            return Err(Error::Invalid(format!(
                "cosine schedule: min_lr {min_lr} must lie in [0, {base_lr}]"
            )));
        }
        Ok(Schedule {
            base_lr,
            warmup_steps,
            total_steps,
            kind,
        })
    }

    /// Parses `constant`, `cosine` (decaying to `min_lr`) as on the command line.
    pub fn from_name(
        name: &str,
        base_lr: f64,
        min_lr: f64,
        warmup_steps: u64,
        total_steps: u64,
    ) -> Result<Schedule> {
        let kind = match name {
            "constant" => ScheduleKind::Constant,
            "cosine" => ScheduleKind::Cosine { min_lr },
            other => {
                return Err(Error::Invalid(format!(
                    "unknown schedule {other:?} (constant, cosine)"
                )));
            }
        };
        Schedule::new(base_lr, warmup_steps, total_steps, kind)
    }

    /// The rate for step `step` (0-based).
    pub fn lr(&self, step: u64) -> f64 {
        if step < self.warmup_steps {
            return self.base_lr * (step + 1) as f64 / self.warmup_steps as f64;
        }
        match self.kind {
            ScheduleKind::Constant => self.base_lr,
            ScheduleKind::Cosine { min_lr } => {
                let span = self.total_steps.saturating_sub(self.warmup_steps).max(1) as f64;
                let progress = ((step - self.warmup_steps) as f64 / span).min(1.0);
                min_lr
                    + 0.5
                        * (self.base_lr - min_lr)
                        * (1.0 + (std::f64::consts::PI * progress).cos())
            }
        }
    }
}
