//! Optimizers (SGD with momentum, Adam, AdamW), gradient-norm clipping and learning-rate
//! schedules. Each update is one fused kernel per parameter buffer (`Backend::adam_step` /
//! `sgd_step`, WGSL on the GPU), and clipping stays on the device: the clip factor is a
//! one-element tensor the update kernel multiplies the gradient by, so no value is read back.

mod adam;
mod clip;
mod lazy_grad;
mod loss_scale;
mod schedule;
mod sgd;

pub use adam::Adam;
pub use clip::clip_grad_norm;
pub use loss_scale::LossScale;
pub use schedule::{Schedule, ScheduleKind};
pub use sgd::Sgd;

use crate::nn::Param;
use crate::{Result, Tensor};
use std::collections::BTreeMap;

/// What every optimizer offers: a step over named parameters, a settable learning rate, and its
/// state as named tensors (for checkpoints).
pub trait Optimizer {
    /// Updates every parameter that has a gradient; `grad_scale` (a one-element tensor, e.g. from
    /// [`clip_grad_norm`]) multiplies the gradients first.
    fn step(&mut self, params: &[(String, Param)], grad_scale: Option<&Tensor>) -> Result<()>;
    /// The learning rate the next step uses.
    fn lr(&self) -> f64;
    /// Sets the learning rate (schedules call this every step).
    fn set_lr(&mut self, lr: f64);
    /// Number of steps taken.
    fn steps(&self) -> u64;
    /// The state as named tensors, e.g. `adam.m.layers.0.weight`; the step count is in
    /// [`Optimizer::steps`].
    fn state(&self) -> Vec<(String, Tensor)>;
    /// Restores state saved by [`Optimizer::state`] and the step count.
    fn load_state(&mut self, tensors: &BTreeMap<String, Tensor>, steps: u64) -> Result<()>;
}
