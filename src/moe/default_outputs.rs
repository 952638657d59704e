//! The default outputs `Ê ∈ R^{n×m}` of Default MoE (Panda, Baherwani et al. 2025, "Dense
//! Backpropagation Improves Training for Sparse Mixture-of-Experts", arXiv 2504.12463): one
//! vector per expert, the exponential moving average of what that expert has output, which
//! stands in for the experts a token did not use when the router's gradient is formed.
//!
//! After each training batch, with `B_i` the rows expert i computed in that batch (kept after
//! capacity) and `β` the decay (`beta`, 0.9 by default),
//!
//! ```text
//! Ê_i ← β·Ê_i + (1 − β)·(1/|B_i|) Σ_{x ∈ B_i} E_i(x)      for every expert with |B_i| > 0
//! ```
//!
//! (an expert that ran on no row keeps its vector; every vector starts at 0). The layer then adds
//! to its output, for each token t with unselected experts `Ā_t`,
//!
//! ```text
//! d_t = Σ_{i ∈ Ā_t} π_ti · Ê_i          y_t ← y_t + d_t − sg(d_t)
//! ```
//!
//! which is zero in the forward pass (the output is exactly the top-k output) and gives the
//! router's probabilities the dense gradient `∂L/∂π_ti = g_t · Ê_i` for the experts the token did
//! not use, beside the exact `g_t · E_i(x_t)` for the ones it did. The router that produces
//! `π` and `Ā` is `default-moe` (`routers/default_moe.rs`); the layer's step is
//! [`add_default_terms`], which calls [`DefaultOutputs::update`] and [`DefaultOutputs::dense_term`]. Everything runs on the device,
//! in training mode only; the vectors are router state (saved in checkpoints), not parameters.

use super::{DefaultTerm, DispatchPlan, Routing};
use crate::{DType, Device, Error, Result, Tensor};
use std::sync::{Arc, Mutex};

/// The default output of each of `n` experts, `[n, m]` F32 on the router's device (`m` the
/// experts' output width). Cloning shares it (a [`crate::moe::Routing`] carries a handle so the
/// layer can update the router's vectors).
#[derive(Clone, Debug)]
pub struct DefaultOutputs {
    table: Arc<Mutex<Tensor>>,
    beta: f64,
    n: usize,
    m: usize,
    device: Device,
}

impl DefaultOutputs {
    /// Zero vectors for `n` experts of output width `m`, decay `beta` in `[0, 1)`.
    pub fn new(n: usize, m: usize, beta: f64, device: Device) -> Result<DefaultOutputs> {
        if !(0.0..1.0).contains(&beta) {
            return Err(Error::Invalid(format!(
                "default-moe: beta = {beta} must lie in [0, 1)"
            )));
        }
        if n == 0 || m == 0 {
            return Err(Error::Invalid(format!(
                "default-moe needs n ≥ 1 experts of width m ≥ 1, got n = {n}, m = {m}"
            )));
        }
        Ok(DefaultOutputs {
            table: Arc::new(Mutex::new(Tensor::zeros(&[n, m], DType::F32, device)?)),
            beta,
            n,
            m,
            device,
        })
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Tensor>> {
        self.table
            .lock()
            .map_err(|_| Error::Invalid("default outputs lock poisoned".into()))
    }

    /// The EMA decay β.
    pub fn beta(&self) -> f64 {
        self.beta
    }

    /// The vectors `[n, m]` (F32, on the router's device).
    pub fn get(&self) -> Result<Tensor> {
        Ok(self.lock()?.clone())
    }

    /// Replaces the vectors (`[n, m]`, any float dtype and device; stored as F32 on the
    /// router's device). Errors name a wrong shape or a value that is not finite.
    pub fn set(&self, table: &Tensor, what: &str) -> Result<()> {
        let t = super::selection_bias::checked_state(table, &[self.n, self.m], what, self.device)?;
        *self.lock()? = t;
        Ok(())
    }

    /// The EMA update from one batch: `sums` `[n, m]` the sum of each expert's output rows and
    /// `counts` `[n]` how many rows it computed (see the module docs). On the device, no
    /// gradient.
    pub fn update(&self, sums: &Tensor, counts: &Tensor) -> Result<()> {
        let n = self.n;
        if sums.shape() != [n, self.m] || counts.shape() != [n] {
            return Err(Error::Shape(format!(
                "default-moe: expert sums must be [{n}, {}] with counts [{n}], got {:?} and {:?}",
                self.m,
                sums.shape(),
                counts.shape()
            )));
        }
        let mut slot = self.lock()?;
        let next = crate::no_grad(|| {
            let old = slot.clone();
            let c = counts.detach().to_dtype(DType::F32)?.reshape(&[n, 1])?;
            let mean = sums
                .detach()
                .to_dtype(DType::F32)?
                .div(&c.clamp(1.0, f64::INFINITY)?)?;
            let moved = old
                .mul_scalar(self.beta)?
                .add(&mean.mul_scalar(1.0 - self.beta)?)?;
            let ran = c.clamp(0.0, 1.0)?; // [n, 1]: 1 where the expert ran (counts are whole numbers)
            // ran·moved + (1 − ran)·old, broadcast over the m columns
            moved.sub(&old)?.mul(&ran)?.add(&old)
        })?;
        *slot = next;
        Ok(())
    }

    /// `d = U · Ê` (`[T, m]`): each token's unselected probabilities `unselected` (`[T, n]`,
    /// tracked: `π` with the chosen experts zeroed) times the default outputs (constants).
    /// Before the first update the vectors are zero and so is `d`.
    pub fn dense_term(&self, unselected: &Tensor) -> Result<Tensor> {
        let table = self.get()?;
        unselected.matmul(&table.to_dtype(unselected.dtype())?)
    }
}

/// Default MoE's step (`default_outputs.rs`), for the routings that carry a [`DefaultTerm`]:
/// updates their default outputs from the rows the experts just computed (`out`, kept rows
/// only) and adds `d − sg(d)`, `d = U·Ê`, to their tokens' rows of `y` — zero in value, the
/// unselected experts' share of the router gradient in the backward pass.
pub(crate) fn add_default_terms(
    y: Tensor,
    routings: &[Routing],
    out: &Tensor,
    plan: &DispatchPlan,
    (n, nulls): (usize, usize),
) -> Result<Tensor> {
    if routings.iter().all(|r| r.defaults.is_none()) {
        return Ok(y);
    }
    let (a, m) = (out.shape()[0], out.shape()[1]);
    // per routed expert; a null expert never computes a row, so its default stays 0
    let (sums, counts) = crate::no_grad(|| {
        let kept = plan.row_kept.to_dtype(out.dtype())?.reshape(&[a, 1])?;
        let sums = out
            .detach()
            .mul(&kept)?
            .index_scatter(0, &plan.row_expert_clamped, n)?;
        if nulls == 0 {
            return Ok((sums, plan.kept_per_expert.clone()));
        }
        let zeros =
            |shape: &[usize], like: &Tensor| Tensor::zeros(shape, like.dtype(), like.device());
        Ok::<_, Error>((
            Tensor::concat(&[sums.clone(), zeros(&[nulls, m], &sums)?], 0)?,
            Tensor::concat(
                &[
                    plan.kept_per_expert.clone(),
                    zeros(&[nulls], &plan.kept_per_expert)?,
                ],
                0,
            )?,
        ))
    })?;
    let mut parts = Vec::with_capacity(routings.len());
    for r in routings {
        parts.push(match &r.defaults {
            Some(DefaultTerm {
                unselected,
                outputs,
            }) => {
                outputs.update(&sums, &counts)?;
                let d = outputs.dense_term(unselected)?.to_dtype(y.dtype())?;
                d.sub(&d.detach())?
            }
            None => Tensor::zeros(&[r.tokens, m], y.dtype(), y.device())?,
        });
    }
    let straight_through = if parts.len() == 1 {
        parts.remove(0)
    } else {
        Tensor::concat(&parts, 0)?
    };
    y.add(&straight_through)
}
