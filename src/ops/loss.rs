//! Losses, composed from differentiable ops (their gradients follow from the pieces):
//! cross-entropy with integer targets, mean squared error, binary cross-entropy with logits.

use crate::{DType, Error, Result, Tensor};

impl Tensor {
    /// Mean cross-entropy of `self` (logits `[N, C]`) against I32 class `targets` `[N]`:
    /// `−(1/N) Σ_n log_softmax(x_n)[t_n]`. On the CPU a target outside `0..C` is an error; on the
    /// GPU it contributes 0 (checking would need a read-back).
    pub fn cross_entropy(&self, targets: &Tensor) -> Result<Tensor> {
        let _profile = crate::profile::op("cross_entropy");
        self.picked_log_probs(targets)?.mean_all()?.neg()
    }

    /// Cross-entropy of every row, `[N]`: `−log_softmax(x_n)[t_n]` (the mean of these is
    /// [`Tensor::cross_entropy`]); what a score-function router takes as each example's reward.
    pub fn cross_entropy_per_row(&self, targets: &Tensor) -> Result<Tensor> {
        let _profile = crate::profile::op("cross_entropy_per_row");
        let n = targets.numel();
        self.picked_log_probs(targets)?.reshape(&[n])?.neg()
    }

    /// `log_softmax(x_n)[t_n]` as `[N, 1]`, after checking shapes and dtypes.
    fn picked_log_probs(&self, targets: &Tensor) -> Result<Tensor> {
        if self.rank() != 2 || targets.rank() != 1 || targets.shape()[0] != self.shape()[0] {
            return Err(Error::Shape(format!(
                "cross_entropy: logits must be [N, C] and targets [N], got {:?} and {:?}",
                self.shape(),
                targets.shape()
            )));
        }
        if targets.dtype() != DType::I32 {
            return Err(Error::DType(format!(
                "cross_entropy: targets must be i32 class indices, got {}",
                targets.dtype()
            )));
        }
        if self.shape()[0] == 0 {
            return Err(Error::Invalid("cross_entropy over an empty batch".into()));
        }
        let n = self.shape()[0];
        self.log_softmax(-1)?.gather(1, &targets.reshape(&[n, 1])?)
    }

    /// Mean squared error `mean((self − target)²)`; shapes must match exactly.
    pub fn mse(&self, target: &Tensor) -> Result<Tensor> {
        let _profile = crate::profile::op("mse");
        if self.shape() != target.shape() {
            return Err(Error::Shape(format!(
                "mse: prediction {:?} and target {:?} differ",
                self.shape(),
                target.shape()
            )));
        }
        if self.numel() == 0 {
            return Err(Error::Invalid("mse of empty tensors".into()));
        }
        let d = self.sub(target)?;
        d.mul(&d)?.mean_all()
    }

    /// Binary cross-entropy with logits, `mean(softplus(x) − x·y)` (stable for large |x|);
    /// `target` holds probabilities in [0, 1] with the shape of `self`.
    pub fn bce_with_logits(&self, target: &Tensor) -> Result<Tensor> {
        let _profile = crate::profile::op("bce_with_logits");
        if self.shape() != target.shape() {
            return Err(Error::Shape(format!(
                "bce_with_logits: logits {:?} and target {:?} differ",
                self.shape(),
                target.shape()
            )));
        }
        if self.numel() == 0 {
            return Err(Error::Invalid("bce_with_logits of empty tensors".into()));
        }
        self.softplus()?.sub(&self.mul(target)?)?.mean_all()
    }
}
