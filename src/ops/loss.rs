//! Losses: cross-entropy with integer targets and the mean squared error (fused ops with their
//! own kernels), and binary cross-entropy with logits (composed from differentiable ops, its
//! gradient following from the pieces).

use crate::backend::Storage;
use crate::{DType, Error, Result, Tensor};

impl Tensor {
    /// Mean cross-entropy of `self` (logits `[N, C]`) against I32 class `targets` `[N]`:
    /// `−(1/N) Σ_n log_softmax(x_n)[t_n]`, the mean of [`Tensor::cross_entropy_per_row`]. On the
    /// CPU a target outside `0..C` is an error; on the GPU it contributes 0 (checking would need
    /// a read-back).
    ///
    /// One op on the tape: forward runs the per-row kernel and takes the mean of its losses;
    /// backward runs the per-row backward kernel once with the scalar upstream gradient times
    /// `1/N` broadcast to every row inside it (the bits the per-row op followed by
    /// [`Tensor::mean_all`] gives, without the scale and broadcast passes between them).
    pub fn cross_entropy(&self, targets: &Tensor) -> Result<Tensor> {
        let _profile = crate::profile::op("cross_entropy");
        let (loss, lse) = self.cross_entropy_rows(targets)?;
        let n = loss.len();
        // the mean of the rows' losses, computed on values off the tape: one node for the whole
        // loss, whose backward broadcasts the scalar upstream gradient inside the kernel
        let scale = 1.0 / n as f64;
        let mean = Tensor::from_storage(loss, vec![n])
            .sum_all()?
            .mul_scalar(scale)?;
        let (xd, td) = (self.detach(), targets.detach());
        Ok(Tensor::record(mean, "cross_entropy", &[self], move |g| {
            let dx = g
                .storage()
                .cross_entropy_backward(scale, xd.storage(), td.storage(), &lse)?;
            Ok(vec![Some(Tensor::from_storage(dx, xd.shape().to_vec()))])
        }))
    }

    /// Cross-entropy of every row, `[N]`: `ℓ_n = lse_n − x_{n,t_n}` with
    /// `lse_n = ln Σ_c e^{x_nc}` (the mean of these is [`Tensor::cross_entropy`]); what a
    /// score-function router takes as each example's reward.
    ///
    /// One fused op (`NnOps::cross_entropy_forward` / `_backward`: `backend/cpu/cross_entropy.rs`,
    /// `shaders/cross_entropy.wgsl`): forward keeps only the row log-sum-exp, and backward
    /// computes `∂ℓ_n/∂x_nc = e^{x_nc − lse_n} − [c = t_n]` from the logits, so the
    /// `[N, C]` log-probabilities are never stored. The backward rule is a kernel, so second
    /// derivatives through this op are not available.
    ///
    /// # Errors
    /// [`Error::Shape`] unless logits are `[N, C]` and targets `[N]` with `N, C ≥ 1`;
    /// [`Error::DType`] for non-float logits or non-I32 targets; [`Error::Invalid`] for a CPU
    /// target outside `0..C`; [`Error::Device`] when they live on different devices.
    pub fn cross_entropy_per_row(&self, targets: &Tensor) -> Result<Tensor> {
        let _profile = crate::profile::op("cross_entropy_per_row");
        let (loss, lse) = self.cross_entropy_rows(targets)?;
        let out = Tensor::from_storage(loss, vec![self.shape()[0]]);
        let (xd, td) = (self.detach(), targets.detach());
        Ok(Tensor::record(out, "cross_entropy", &[self], move |g| {
            let dx = g
                .storage()
                .cross_entropy_backward(1.0, xd.storage(), td.storage(), &lse)?;
            Ok(vec![Some(Tensor::from_storage(dx, xd.shape().to_vec()))])
        }))
    }

    /// The checks of [`Tensor::cross_entropy_per_row`] and its forward kernel: `(loss [N],
    /// lse [N])`, off the tape.
    fn cross_entropy_rows(&self, targets: &Tensor) -> Result<(Storage, Storage)> {
        const WHAT: &str = "cross_entropy";
        if self.rank() != 2 || targets.rank() != 1 || targets.shape()[0] != self.shape()[0] {
            return Err(Error::Shape(format!(
                "{WHAT}: logits must be [N, C] and targets [N], got {:?} and {:?}",
                self.shape(),
                targets.shape()
            )));
        }
        if targets.dtype() != DType::I32 {
            return Err(Error::DType(format!(
                "{WHAT}: targets must be i32 class indices, got {}",
                targets.dtype()
            )));
        }
        self.check_float(WHAT)?;
        if self.shape()[0] == 0 {
            return Err(Error::Invalid("cross_entropy over an empty batch".into()));
        }
        if self.shape()[1] == 0 {
            return Err(Error::Shape(format!(
                "{WHAT}: logits {:?} have no classes",
                self.shape()
            )));
        }
        if self.device() != targets.device() {
            return Err(Error::Device(format!(
                "{WHAT}: logits on {} and targets on {}",
                self.device(),
                targets.device()
            )));
        }
        let classes = self.shape()[1];
        self.storage()
            .cross_entropy_forward(targets.storage(), classes)
    }

    /// Mean squared error `mean((self − target)²)`, a 0-d tensor; shapes must match exactly.
    ///
    /// One fused op (`NnOps::mse_forward` / `_backward`: `backend/cpu/mse.rs`,
    /// `shaders/mse.wgsl`): forward sums the squared differences in one pass (two dispatches on
    /// the GPU: partial sums, then their total), backward is `∂/∂x_i = (2/N)·g·(x_i − t_i)` in one
    /// (and its negation for the target, when the target requires a gradient). An f16
    /// prediction's loss is computed in f32. The backward rule is a kernel, so second
    /// derivatives through this op are not available.
    ///
    /// # Errors
    /// [`Error::Shape`] for different shapes, [`Error::Invalid`] for empty tensors,
    /// [`Error::DType`] for non-float operands or different dtypes, [`Error::Device`] when they
    /// live on different devices.
    ///
    /// # Example
    /// ```
    /// use moegrad::{Device, Tensor};
    /// let x = Tensor::from_f32(vec![1.0, 2.0, 4.0, 0.0], &[4], Device::cpu()).unwrap();
    /// let t = Tensor::from_f32(vec![1.0, 0.0, 1.0, 1.0], &[4], Device::cpu()).unwrap();
    /// // (0² + 2² + 3² + 1²) / 4
    /// assert_eq!(x.mse(&t).unwrap().item().unwrap(), 3.5);
    /// ```
    pub fn mse(&self, target: &Tensor) -> Result<Tensor> {
        let _profile = crate::profile::op("mse");
        const WHAT: &str = "mse";
        if self.shape() != target.shape() {
            return Err(Error::Shape(format!(
                "{WHAT}: prediction {:?} and target {:?} differ",
                self.shape(),
                target.shape()
            )));
        }
        if self.numel() == 0 {
            return Err(Error::Invalid("mse of empty tensors".into()));
        }
        self.check_float(WHAT)?;
        target.check_float(WHAT)?;
        if self.dtype() != target.dtype() {
            return Err(Error::DType(format!(
                "{WHAT}: prediction is {} and target {}",
                self.dtype(),
                target.dtype()
            )));
        }
        if self.device() != target.device() {
            return Err(Error::Device(format!(
                "{WHAT}: prediction on {} and target on {}",
                self.device(),
                target.device()
            )));
        }
        if self.dtype() == DType::F16 {
            // the loss and its sum in f32; the cast's backward brings the gradient back to f16
            return self
                .to_dtype(DType::F32)?
                .mse(&target.to_dtype(DType::F32)?);
        }
        let out = Tensor::from_storage(self.storage().mse_forward(target.storage())?, vec![]);
        let (x, t) = (self.detach(), target.detach());
        let target_grad = target.requires_grad();
        Ok(Tensor::record(out, WHAT, &[self, target], move |g| {
            let dx = Tensor::from_storage(
                g.storage().mse_backward(x.storage(), t.storage())?,
                x.shape().to_vec(),
            );
            let dt = if target_grad { Some(dx.neg()?) } else { None };
            Ok(vec![Some(dx), dt])
        }))
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
