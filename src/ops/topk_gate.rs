//! `topk_gate`: a top-k router's gate as one op, one kernel on the GPU where the composed version
//! (softmax, top-k by sorting, a gather and a second softmax) took fifteen.
//!
//! For logits `o: [T, n]` and selection scores `h` (the logits, or noisy logits):
//!
//! * `probs = softmax(o)` (the balance loss's `P_i`); backward `∂o = p ⊙ (g − Σ g ⊙ p)`;
//! * `idx` = the `k` largest `h` per row, descending, ties by the lowest index;
//! * `weights` = `softmax(h[idx])` (Shazeer's renormalised gate), backward
//!   `∂h[idx_j] = w_j (a_j − Σ_i w_i a_i)` and zero for unselected experts; or, unnormalised
//!   (XMoE, `h = o`), `weights = probs[idx]`, backward `∂o_c = p_c (a'_c − Σ_j a_j w_j)`, `a'`
//!   being `a` scattered to `idx`.
//!
//! Each output is its own node on the tape, so a loss may use either or both. The rules are one
//! kernel each (`NnOps::softmax_backward`, `RoutingOps::topk_gate_backward`), not tensor ops, so
//! the gate is not twice differentiable.

use crate::{DType, Error, Result, Tensor};

/// The three outputs of [`Tensor::topk_gate`].
#[derive(Clone, Debug)]
pub struct TopkGate {
    /// `[T, n]` the softmax of the logits over all experts (tracked)
    pub probs: Tensor,
    /// `[T, k]` I32: the selected experts, best first
    pub idx: Tensor,
    /// `[T, k]` the combine weights of the selected experts (tracked)
    pub weights: Tensor,
}

impl Tensor {
    /// The gate of a top-k router on logits `self: [T, n]` (see the module docs): selects the
    /// `k` largest `scores` per row (the logits when `scores` is `None`; Shazeer's noisy gate
    /// passes the noisy logits) and weighs them by their softmax (`renormalise`) or by the
    /// probabilities of the logits (`renormalise = false`, which selects by the logits and
    /// takes no `scores`).
    ///
    /// # Errors
    /// [`Error::Shape`] unless the logits are `[T, n]` with `1 ≤ k ≤ n` and the scores have
    /// their shape; [`Error::DType`] / [`Error::Device`] for scores of another dtype or device;
    /// [`Error::Invalid`] for scores with `renormalise = false`.
    ///
    /// # Example
    /// ```
    /// use moegrad::{Device, Tensor};
    /// let o = Tensor::from_f32(vec![0.0, 2.0, 1.0], &[1, 3], Device::cpu()).unwrap();
    /// let g = o.topk_gate(None, 2, true).unwrap();
    /// assert_eq!(g.idx.to_vec_i32().unwrap(), vec![1, 2]);
    /// let w = g.weights.to_vec_f32().unwrap();
    /// assert!((w[0] - 1.0 / (1.0 + (-1.0f32).exp())).abs() < 1e-6);
    /// ```
    pub fn topk_gate(
        &self,
        scores: Option<&Tensor>,
        k: usize,
        renormalise: bool,
    ) -> Result<TopkGate> {
        let _profile = crate::profile::op("topk_gate");
        const WHAT: &str = "topk_gate";
        if self.dtype() == crate::DType::F16
            || scores.is_some_and(|s| s.dtype() == crate::DType::F16)
        {
            // the router is of the f32 class (see `autocast.rs`): f16 logits are cast up
            let logits = crate::autocast::full_precision_operand(self)?;
            let scores = scores
                .map(crate::autocast::full_precision_operand)
                .transpose()?;
            return logits.topk_gate(scores.as_ref(), k, renormalise);
        }
        self.check_float(WHAT)?;
        if self.rank() != 2 {
            return Err(Error::Shape(format!(
                "{WHAT}: logits must be [T, n], got {:?}",
                self.shape()
            )));
        }
        let (t, n) = (self.shape()[0], self.shape()[1]);
        if k == 0 || k > n {
            return Err(Error::Shape(format!(
                "{WHAT}: k = {k} must lie in 1..={n} for logits {:?}",
                self.shape()
            )));
        }
        if let Some(s) = scores {
            self.check_compatible(s, WHAT)?;
            if s.shape() != self.shape() {
                return Err(Error::Shape(format!(
                    "{WHAT}: scores {:?} must have the logits' shape {:?}",
                    s.shape(),
                    self.shape()
                )));
            }
            if !renormalise {
                return Err(Error::Invalid(format!(
                    "{WHAT}: the unnormalised gate selects by the logits; it takes no scores"
                )));
            }
        }
        if t == 0 {
            let probs = Tensor::zeros(&[0, n], self.dtype(), self.device())?;
            let idx = Tensor::zeros(&[0, k], DType::I32, self.device())?;
            let weights = Tensor::zeros(&[0, k], self.dtype(), self.device())?;
            return Ok(TopkGate {
                probs,
                idx,
                weights,
            });
        }
        let sizes = (t, n, k);
        let (p, i, w) =
            self.storage()
                .topk_gate(scores.map(|s| s.storage()), sizes, renormalise)?;
        let probs = Tensor::from_storage(p, vec![t, n]);
        let idx = Tensor::from_storage(i, vec![t, k]);
        let weights = Tensor::from_storage(w, vec![t, k]);

        // Each rule folds the gradient its input already has (the logits get one from the
        // probabilities and one from the weights, in either order) into its kernel.
        let saved_p = probs.clone();
        let probs = Tensor::record_folding(probs, "topk_gate.probs", &[self], 0, move |g, p| {
            let d = super::folded(p, &saved_p, |p| {
                saved_p.storage().softmax_backward(g.storage(), p, t, n)
            })?;
            Ok(vec![Some(d)])
        });
        let (saved_w, saved_i) = (weights.clone(), idx.clone());
        let source = scores.unwrap_or(self);
        // the gradient's shape, dtype and device: the source's (its values are not read)
        let like = source.detach();
        // the unnormalised gate's rule reads the probabilities
        let saved_p = (!renormalise).then(|| probs.detach());
        let weights = Tensor::record_folding(weights, "topk_gate", &[source], 0, move |g, p| {
            let d = super::folded(p, &like, |p| {
                saved_w.storage().topk_gate_backward(
                    saved_i.storage(),
                    g.storage(),
                    (saved_p.as_ref().map(|s| s.storage()), p),
                    sizes,
                )
            })?;
            Ok(vec![Some(d)])
        });
        Ok(TopkGate {
            probs,
            idx,
            weights,
        })
    }
}
