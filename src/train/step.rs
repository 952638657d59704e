//! One optimizer step, the same for every model the trainer runs ([`train_step`]): forward,
//! the task loss (cross-entropy summed over the tasks: the digits of each MultiMNIST image, or
//! the next character of every position of a language model's windows) plus the auxiliary
//! losses, the REINFORCE surrogates of score-function routers, backward, global-norm clipping
//! and the update by any [`Optimizer`].

use super::models::TaskModel;
use crate::moe::RoutingStats;
use crate::optim::{LossScale, Optimizer, clip_grad_norm};
use crate::{Error, Result, Tensor};

/// Summed cross-entropy over the tasks (each a mean over the batch): the task loss of a
/// [`TaskModel`]'s logits, one tensor per task, against the targets of each task.
///
/// # Errors
/// No logits (a model without task heads), or targets [`Tensor::cross_entropy`] rejects.
pub fn task_loss(logits: &[Tensor], targets: &[Tensor]) -> Result<Tensor> {
    sum_over_tasks(logits, targets, Tensor::cross_entropy)
}

/// `per_task(logits, targets)` summed over the tasks.
fn sum_over_tasks(
    logits: &[Tensor],
    targets: &[Tensor],
    per_task: impl Fn(&Tensor, &Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let mut total: Option<Tensor> = None;
    for (l, y) in logits.iter().zip(targets) {
        let ce = per_task(l, y)?;
        total = Some(match total {
            Some(t) => t.add(&ce)?,
            None => ce,
        });
    }
    total.ok_or_else(|| Error::Invalid("a model with no task heads".into()))
}

/// `loss` plus the surrogate of every score-function term (REINFORCE routers, see
/// `moe/score_function.rs`), with each example's own task loss (summed over tasks, divided by
/// the batch size as the mean loss divides it) as its reward.
fn with_score_terms(
    loss: &Tensor,
    terms: &[crate::moe::ScoreTerm],
    logits: &[Tensor],
    targets: &[Tensor],
) -> Result<Tensor> {
    let per_example = crate::no_grad(|| -> Result<Tensor> {
        let total = sum_over_tasks(logits, targets, Tensor::cross_entropy_per_row)?;
        total.mul_scalar(1.0 / total.numel().max(1) as f64)
    })?;
    crate::moe::add_surrogates(loss, terms, &per_example)
}

/// What one training step leaves on the device; nothing of it has been read back.
pub struct StepOutput {
    /// the objective minimised: the task loss plus the auxiliary losses (without the
    /// score-function surrogates, whose value is not a loss)
    pub loss: Tensor,
    /// the summed mean cross-entropy of the tasks
    pub task_loss: Tensor,
    /// the routing statistics of each MoE layer, in order (none for a dense model)
    pub routing: Vec<RoutingStats>,
}

/// One optimizer step of `model` on the batch `x` with targets `y` (one per task): forward,
/// task loss plus auxiliary losses (plus the REINFORCE surrogates), backward, global-norm
/// clipping when `max_grad_norm > 0` (the factor stays on the device) and the update. It
/// waits for nothing and reads nothing back: on the GPU it only records and submits kernels.
pub fn train_step(
    model: &dyn TaskModel,
    params: &[(String, crate::nn::Param)],
    opt: &mut dyn Optimizer,
    x: &Tensor,
    y: &[Tensor],
    max_grad_norm: f64,
) -> Result<StepOutput> {
    step(model, params, opt, x, y, max_grad_norm, None)
}

/// [`train_step`] in mixed precision (`--precision f16-mixed`, GPU only): the forward pass runs
/// inside [`crate::autocast_f16`] (activations and the big products in f16, the router and the
/// losses in f32), backward starts from the loss with `loss_scale`'s scale as its gradient
/// ([`LossScale::backward`]: the gradients of the loss times the scale), and
/// [`LossScale::unscale`] turns the f32 parameter gradients into the optimizer's factor (unscale,
/// clip, or skip the step on an overflow), all on the device. Parameters and the optimizer's
/// state stay f32.
///
/// # Errors
/// As [`train_step`], and an adapter without `SHADER_F16`.
pub fn train_step_mixed(
    model: &dyn TaskModel,
    params: &[(String, crate::nn::Param)],
    opt: &mut dyn Optimizer,
    x: &Tensor,
    y: &[Tensor],
    max_grad_norm: f64,
    loss_scale: &LossScale,
) -> Result<StepOutput> {
    step(model, params, opt, x, y, max_grad_norm, Some(loss_scale))
}

/// The body of [`train_step`] and [`train_step_mixed`].
fn step(
    model: &dyn TaskModel,
    params: &[(String, crate::nn::Param)],
    opt: &mut dyn Optimizer,
    x: &Tensor,
    y: &[Tensor],
    max_grad_norm: f64,
    loss_scale: Option<&LossScale>,
) -> Result<StepOutput> {
    let forward = || -> Result<_> {
        let out = model.forward(x)?;
        let task = task_loss(&out.logits, y)?;
        let loss = match &out.aux_loss {
            Some(aux) => task.add(&aux.to_dtype(task.dtype())?)?,
            None => task.clone(),
        };
        let objective = if out.score_terms.is_empty() {
            loss.clone()
        } else {
            with_score_terms(&loss, &out.score_terms, &out.logits, y)?
        };
        Ok((out, task, loss, objective))
    };
    let (out, task, loss, objective) = match loss_scale {
        Some(_) => crate::autocast_f16(forward)?,
        None => forward()?,
    };
    let scale = match loss_scale {
        Some(ls) => {
            ls.backward(&objective)?;
            ls.unscale(params, max_grad_norm)?
        }
        None => {
            objective.backward()?;
            if max_grad_norm > 0.0 {
                clip_grad_norm(params, max_grad_norm)?
            } else {
                None
            }
        }
    };
    opt.step(params, scale.as_ref().map(|(_, s)| s))?;
    Ok(StepOutput {
        loss,
        task_loss: task,
        routing: out.routing,
    })
}
