//! The score-function (REINFORCE) gradient of a router that samples its experts, given to the
//! training loop as a surrogate term of the objective.
//!
//! A router that samples expert `D_t ~ π_t = softmax(θ_t)` for each token t makes the objective an
//! expectation, `L(θ) = E_D[Σ_t ℓ_t]`, where `ℓ_t` is token t's own term of the loss (for a mean
//! over T tokens, `ℓ_t = loss_t / T`). The part of its gradient that flows through the *choice* of
//! expert (∇₀ in SparseMixer's decomposition, see docs/routers.md) is, by the log-derivative
//! identity `∇π_i = π_i ∇log π_i` (Williams 1992, "Simple statistical gradient-following
//! algorithms for connectionist reinforcement learning"):
//!
//! ```text
//! ∇₀ = E_D[ Σ_t ℓ_t · ∇_θ log π_{t,D_t} ],      ∂ log π_{t,D} / ∂θ_{t,k} = δ_kD − π_{t,k}
//! ```
//!
//! A backward rule inside the MoE layer cannot form this: it needs the loss value `ℓ_t`, which the
//! layer never sees. So a score-function router hands out `log π_{t,D_t}` (on the tape) as a
//! [`ScoreTerm`], and whoever computes the loss adds the surrogate
//!
//! ```text
//! S = Σ_t (sg(ℓ_t) − b) · (log π_{t,D_t} − sg(log π_{t,D_t}))        (sg: stop-gradient)
//! ```
//!
//! to the objective before `backward` ([`ScoreTerm::surrogate`]). Its value is exactly 0, so the
//! loss a run reports is unchanged; its gradient with respect to `θ_t` is
//! `(ℓ_t − b)(e_{D_t} − π_t)`, the score-function estimate.
//!
//! * **Each token's own loss as its reward.** The whole batch's loss would also be unbiased (the
//!   other tokens' losses do not depend on `D_t`, and `E[∇log π_{t,D_t}] = 0`), but they add
//!   their own noise to every token's estimate; with `ℓ_t` that noise is gone.
//! * **The baseline b** ([`RunningBaseline`]) is a running mean of earlier steps' token losses. It
//!   does not depend on the current draw, so it leaves the expectation unchanged
//!   (`E[b·∇log π_D] = b·∇Σ_i π_i = 0`) while centring the reward, which lowers the variance.
//!   `--router-opt baseline=0` turns it off.
//!
//! Caveat: the per-token reward is unbiased when token t's choice affects only its own loss term.
//! With a capacity limit, one token's choice can push another out of an expert; that effect is not
//! in the estimate (run dropless, the default, for the unbiased estimator).

use crate::{DType, Device, Error, Result, Tensor};
use std::sync::Mutex;

/// A running mean of the per-token loss, used as the REINFORCE baseline: an exponential moving
/// average of each step's mean token loss with decay β (0.9), bias-corrected as Adam's moments are
/// (`b = m / (1 − β^s)` after s updates), so the first step's value is that step's mean. Kept on
/// the device: updating it reads nothing back.
#[derive(Debug)]
pub struct RunningBaseline {
    decay: f64,
    state: Mutex<BaselineState>,
}

#[derive(Debug, Default)]
struct BaselineState {
    /// the un-corrected moving average (a scalar tensor), None before the first update
    average: Option<Tensor>,
    /// updates so far
    updates: u64,
}

impl RunningBaseline {
    /// The decay β of the moving average.
    pub const DECAY: f64 = 0.9;

    /// A baseline with no updates yet (its value is 0 until the first update).
    pub fn new() -> RunningBaseline {
        RunningBaseline {
            decay: Self::DECAY,
            state: Mutex::new(BaselineState::default()),
        }
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, BaselineState>> {
        self.state
            .lock()
            .map_err(|_| Error::Autograd("REINFORCE baseline lock poisoned".into()))
    }

    /// The current value `b` (a scalar tensor of `dtype` on `device`), or None before the first
    /// update (no baseline yet).
    pub fn value(&self, dtype: DType, device: Device) -> Result<Option<Tensor>> {
        let st = self.lock()?;
        match &st.average {
            Some(avg) if st.updates > 0 => {
                let correction = 1.0 - self.decay.powi(st.updates.min(i32::MAX as u64) as i32);
                let b = avg.mul_scalar(1.0 / correction)?;
                Ok(Some(b.to_dtype(dtype)?.to_device(device)?))
            }
            _ => Ok(None),
        }
    }

    /// Folds one step's mean token loss (a scalar tensor, no gradient) into the average.
    pub fn update(&self, mean_token_loss: &Tensor) -> Result<()> {
        if mean_token_loss.numel() != 1 {
            return Err(Error::Shape(format!(
                "REINFORCE baseline: expects a scalar mean loss, got shape {:?}",
                mean_token_loss.shape()
            )));
        }
        let x = mean_token_loss.detach().reshape(&[])?;
        let mut st = self.lock()?;
        let next = crate::no_grad(|| match &st.average {
            None => x.mul_scalar(1.0 - self.decay),
            Some(avg) => avg
                .mul_scalar(self.decay)?
                .add(&x.to_dtype(avg.dtype())?.mul_scalar(1.0 - self.decay)?),
        })?;
        st.average = Some(next);
        st.updates += 1;
        Ok(())
    }

    /// The state a checkpoint keeps, by name: `average` (the un-corrected moving average, a
    /// scalar; 0 before the first update) and `updates` (a scalar f64 count).
    pub fn state(&self) -> Result<Vec<(String, Tensor)>> {
        let st = self.lock()?;
        let average = match &st.average {
            Some(avg) => avg.clone(),
            None => Tensor::scalar(0.0, DType::F64, Device::Cpu)?,
        };
        Ok(vec![
            ("average".to_string(), average),
            (
                "updates".to_string(),
                Tensor::scalar(st.updates as f64, DType::F64, Device::Cpu)?,
            ),
        ])
    }

    /// Restores one entry of [`RunningBaseline::state`].
    pub fn load_state(&self, name: &str, value: &Tensor) -> Result<()> {
        if value.numel() != 1 {
            return Err(Error::Shape(format!(
                "REINFORCE baseline state {name}: expects a scalar, got shape {:?}",
                value.shape()
            )));
        }
        let mut st = self.lock()?;
        match name {
            "average" => st.average = Some(value.detach().reshape(&[])?),
            "updates" => {
                let n = value.item()?;
                if !(n.is_finite() && n >= 0.0 && n.fract() == 0.0) {
                    return Err(Error::Invalid(format!(
                        "REINFORCE baseline state updates = {n} is not a whole number"
                    )));
                }
                st.updates = n as u64;
            }
            other => {
                return Err(Error::Invalid(format!(
                    "REINFORCE baseline has no state {other:?}; it keeps average and updates"
                )));
            }
        }
        Ok(())
    }
}

impl Default for RunningBaseline {
    fn default() -> Self {
        RunningBaseline::new()
    }
}

/// What a score-function router hands to the loss: the log-probability of each token's sampled
/// expert, on the tape, and the router's baseline (see the module docs).
#[derive(Clone, Debug)]
pub struct ScoreTerm {
    /// `[T]`: `log π_{t,D_t}`, tracked (its gradient with respect to the logits is `e_D − π`)
    pub log_prob: Tensor,
    /// the running-mean baseline, None when the router was built with `baseline=0`
    pub baseline: Option<std::sync::Arc<RunningBaseline>>,
}

impl ScoreTerm {
    /// The surrogate `Σ_t (ℓ_t − b)·(log π_{t,D_t} − sg(log π_{t,D_t}))` for the per-token losses
    /// `token_loss` `[T]` (token t's own term of the objective: the objective is their sum, so pass
    /// `loss_t / T` for a mean). Add it to the objective before `backward`: its value is exactly 0
    /// and its gradient is the score-function estimate. `token_loss` is detached here. With a
    /// baseline, `b` is its value before this call, and this call then folds the mean of
    /// `token_loss` into it: call it once per step.
    ///
    /// # Errors
    /// `token_loss` not of shape `[T]` for the T tokens routed.
    pub fn surrogate(&self, token_loss: &Tensor) -> Result<Tensor> {
        let lp = &self.log_prob;
        if token_loss.shape() != lp.shape() {
            return Err(Error::Shape(format!(
                "score-function surrogate: the router sampled experts for {} tokens ({:?}) but got per-token losses of shape {:?}",
                lp.numel(),
                lp.shape(),
                token_loss.shape()
            )));
        }
        let reward = crate::no_grad(|| -> Result<Tensor> {
            let l = token_loss.detach().to_dtype(lp.dtype())?;
            let centred = match &self.baseline {
                Some(b) => match b.value(lp.dtype(), lp.device())? {
                    Some(v) => l.sub(&v)?,
                    None => l.clone(),
                },
                None => l.clone(),
            };
            if let Some(b) = &self.baseline {
                b.update(&l.mean_all()?)?;
            }
            Ok(centred)
        })?;
        // log π − sg(log π): value exactly 0, gradient that of log π
        let score = lp.sub(&lp.detach())?;
        score.mul(&reward)?.sum_all()
    }
}

/// `objective` plus [`ScoreTerm::surrogate`] of every term, all with the same per-token losses
/// `token_loss` (what a training loop adds before `backward`; the value is unchanged).
///
/// # Errors
/// `token_loss` not of the shape the terms' routers sampled for.
pub fn add_surrogates(
    objective: &Tensor,
    terms: &[ScoreTerm],
    token_loss: &Tensor,
) -> Result<Tensor> {
    let mut total = objective.clone();
    for term in terms {
        total = total.add(&term.surrogate(token_loss)?.to_dtype(total.dtype())?)?;
    }
    Ok(total)
}
