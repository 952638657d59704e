//! The selection-only expert bias `b ∈ R^n` that auxiliary-loss-free balancing moves: added to
//! a router's scores when it *chooses* experts, never to the weights it combines them with, and
//! never given a gradient. Two rules set it (docs/routers.md, "Balancing"):
//!
//! * **aux-free** (DeepSeek-V3, arXiv 2412.19437 §2.1.2; Wang et al. 2024, "Auxiliary-Loss-Free
//!   Load Balancing Strategy for Mixture-of-Experts", arXiv 2408.15664): after each training
//!   batch, with `c_i` the tokens routed to expert i (before capacity) and `c̄` their mean,
//!
//!   ```text
//!   b_i ← b_i + u · sign(c̄ − c_i)          then   b ← b − mean(b)
//!   ```
//!
//!   an overloaded expert is pushed down by `u`, an underloaded one up. The mean-centring (as
//!   torchtitan does, pytorch/torchtitan#1506) changes no choice, since every expert of a token
//!   moves together, and keeps `b` from drifting.
//! * **quantile** (Quantile Balancing, Su 2026, kexue.fm/archives/11619; Megatron-LM #5349): the
//!   bias solved once per batch. With `ŝ_tj = s_tj + b_j` the biased scores of the batch's T
//!   tokens, token t's cutoff is its (k+1)-th largest, `α_t`; token t picks expert j exactly when
//!   `b_j > r_tj = α_t − s_tj` (the bias j would need). Expert j gets its balanced share
//!   `q = T·k/n` of the tokens when `b_j` lies between the q-th and (q+1)-th smallest `r_tj`
//!   over t, so
//!
//!   ```text
//!   b_j ← ½ (r_(q) + r_(q+1)) over the tokens of the batch,   q = round(T·k/n)   then centred
//!   ```
//!
//!   (each expert solved with the others' biases held, one Jacobi step of the paper's
//!   alternating solve; where we chose: the midpoint of the two order statistics, no moving
//!   average, the new bias used from the next batch on).
//!
//! Both updates run on the device (no value is read back) and only in training mode.

use crate::{DType, Device, Error, Result, Tensor};
use std::sync::{Arc, Mutex};

/// The selection-only bias of one router, `[n]` F32 on the router's device. Cloning shares it
/// (a [`crate::moe::Routing`] carries a handle so the layer can update the router's bias).
#[derive(Clone, Debug)]
pub struct SelectionBias {
    value: Arc<Mutex<Tensor>>,
    n: usize,
    device: Device,
}

impl SelectionBias {
    /// A zero bias over `n` experts on `device`.
    pub fn zeros(n: usize, device: Device) -> Result<SelectionBias> {
        Ok(SelectionBias {
            value: Arc::new(Mutex::new(Tensor::zeros(&[n], DType::F32, device)?)),
            n,
            device,
        })
    }

    /// A zero bias when the router config asks for one ([`crate::moe::RouterConfig::selection_bias`]).
    pub fn for_config(cfg: &crate::moe::RouterConfig, device: Device) -> Result<Option<Self>> {
        cfg.selection_bias
            .then(|| SelectionBias::zeros(cfg.experts, device))
            .transpose()
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Tensor>> {
        self.value
            .lock()
            .map_err(|_| Error::Invalid("selection bias lock poisoned".into()))
    }

    /// The bias `[n]` (F32, on the router's device).
    pub fn get(&self) -> Result<Tensor> {
        Ok(self.lock()?.clone())
    }

    /// Replaces the bias (`[n]`, any float dtype and device; stored as F32 on the router's
    /// device). Errors name a wrong shape or a value that is not finite (`what` names the bias).
    pub fn set(&self, bias: &Tensor, what: &str) -> Result<()> {
        let b = checked_state(bias, &[self.n], what, self.device)?;
        *self.lock()? = b;
        Ok(())
    }

    /// `sg(scores) + b`: the scores a router selects by (`[T, n]`, detached, in their dtype).
    pub fn add_to(&self, scores: &Tensor) -> Result<Tensor> {
        let b = self.get()?.to_dtype(scores.dtype())?;
        scores.detach().add(&b.reshape(&[1, self.n])?)
    }

    /// The aux-free update from the tokens routed to each expert (`counts`, `[n]`, before
    /// capacity): `b += u·sign(mean(c) − c)`, then centred. On the device, no gradient.
    pub fn update_aux_free(&self, counts: &Tensor, rate: f64) -> Result<()> {
        let mut slot = self.lock()?;
        let next = crate::no_grad(|| {
            let c = counts.detach().to_dtype(DType::F32)?;
            let mean = c.mean_all()?;
            let under = c.lt(&mean)?; // 1 where c_i < c̄
            let over = c.gt(&mean)?;
            let step = under.sub(&over)?.mul_scalar(rate)?; // u·sign(c̄ − c)
            centre(&slot.add(&step)?)
        })?;
        *slot = next;
        Ok(())
    }

    /// The quantile update from one batch's biased selection scores `chosen = s + b` (`[T, n]`,
    /// as the router selected by them) for top-`k` routing (see the module docs).
    ///
    /// # Errors
    /// `k` not in `1..n`, or `chosen` not `[T, n]` with T ≥ 2.
    pub fn update_quantile(&self, chosen: &Tensor, k: usize) -> Result<()> {
        let (t, n) = match chosen.shape() {
            [t, n] if *n == self.n && *t >= 2 => (*t, *n),
            s => {
                return Err(Error::Shape(format!(
                    "quantile balancing: selection scores must be [T ≥ 2, {}], got {s:?}",
                    self.n
                )));
            }
        };
        if k == 0 || k >= n {
            return Err(Error::Invalid(format!(
                "quantile balancing needs 1 ≤ k < n (a token's cutoff is its (k+1)-th score); got k = {k}, n = {n}"
            )));
        }
        let q = ((t * k) as f64 / n as f64)
            .round()
            .clamp(1.0, (t - 1) as f64) as usize;
        let mut slot = self.lock()?;
        let next = crate::no_grad(|| {
            let chosen = chosen.detach().to_dtype(DType::F32)?;
            let (top, _) = chosen.topk(k + 1)?; // [T, k+1], descending
            let cutoff = top.slice(1, k, k + 1)?; // α_t, [T, 1]
            // r_tj = α_t − s_tj = α_t − ŝ_tj + b_j: the bias expert j needs to win token t
            let need = cutoff
                .sub(&chosen)?
                .add(&slot.reshape(&[1, n])?)?
                .transpose(0, 1)?; // [n, T]
            // the q+1 smallest of each row: the largest of −r, negated back
            let (neg, _) = need.neg()?.topk(q + 1)?; // [n, q+1], −r ascending in r
            let lo = neg.slice(1, q - 1, q)?; // −r_(q)
            let hi = neg.slice(1, q, q + 1)?; // −r_(q+1)
            let b = lo.add(&hi)?.mul_scalar(-0.5)?.reshape(&[n])?;
            centre(&b)
        })?;
        *slot = next;
        Ok(())
    }
}

/// `b − mean(b)`.
fn centre(b: &Tensor) -> Result<Tensor> {
    b.sub(&b.mean_all()?)
}

/// A router's step-to-step state restored from `value` (any float dtype and device): checked to
/// have `shape` and finite values (errors name `what`), stored as F32 on `device`. The selection
/// bias and Default MoE's outputs (`default_outputs.rs`) restore through it.
pub(crate) fn checked_state(
    value: &Tensor,
    shape: &[usize],
    what: &str,
    device: Device,
) -> Result<Tensor> {
    if value.shape() != shape {
        return Err(Error::Shape(format!(
            "{what} must have shape {shape:?}, got {:?}",
            value.shape()
        )));
    }
    let values = value
        .to_device(Device::Cpu)?
        .to_dtype(DType::F64)?
        .to_vec_f64()?;
    if values.iter().any(|v| !v.is_finite()) {
        return Err(Error::Invalid(format!(
            "{what} has a value that is not finite"
        )));
    }
    Tensor::from_f64(values, shape, Device::Cpu)?
        .to_dtype(DType::F32)?
        .to_device(device)
}
