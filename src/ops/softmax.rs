//! softmax, log_softmax and logsumexp along an axis, computed stably (the row maximum is
//! subtracted first) with hand-written backward rules. softmax is one fused kernel each way
//! (the row softmax of `NnOps`, which the top-k gate's probabilities share); log_softmax and
//! logsumexp are composed from reductions and elementwise ops:
//!
//! * softmax `y = e^(x−m) / Σ e^(x−m)`:  `∂x = y ⊙ (g − Σ g⊙y)`
//! * log_softmax `y = x − m − ln Σ e^(x−m)`:  `∂x = g − softmax(x) · Σ g`
//! * logsumexp `y = m + ln Σ e^(x−m)`:  `∂x = g · softmax(x)`

use crate::shape::normalize_axis;
use crate::{DType, Result, Tensor};

/// The untracked pieces of a softmax along one axis (all keepdim where reduced).
struct Shifted {
    /// `x − m`
    z: Tensor,
    /// `e^(x − m)`
    e: Tensor,
    /// `Σ e^(x − m)`
    total: Tensor,
    /// `m`, the maximum along the axis
    m: Tensor,
}

impl Tensor {
    /// Untracked pieces shared by the three ops: `(x − m, e^(x−m), Σ e^(x−m))` with `m` the
    /// maximum along `axis` (keepdim), and `m`.
    fn shifted_exp(&self, axis: usize) -> Result<Shifted> {
        let _guard = crate::autograd::NoGradGuard::new();
        let x = self.detach();
        let m = x.max(axis as isize, true)?;
        let z = x.sub(&m)?;
        let e = z.exp()?;
        let total = e.sum(&[axis as isize], true)?;
        Ok(Shifted { z, e, total, m })
    }

    /// Softmax along `axis`: one fused kernel forward and one backward
    /// (`NnOps::softmax_forward` / `softmax_backward`) over the rows of the last axis; another
    /// axis is moved last and back, and f16 values are computed in f32 and cast back.
    ///
    /// # Example
    /// ```
    /// use moegrad::{Device, Tensor};
    /// let x = Tensor::from_f32(vec![0.0, 0.0], &[1, 2], Device::cpu()).unwrap();
    /// assert_eq!(x.softmax(-1).unwrap().to_vec_f32().unwrap(), vec![0.5, 0.5]);
    /// ```
    pub fn softmax(&self, axis: isize) -> Result<Tensor> {
        let _profile = crate::profile::op("softmax");
        self.check_float("softmax")?;
        let a = normalize_axis(axis, self.rank())?;
        let last = self.rank() - 1;
        if a != last {
            let moved = self.transpose(a as isize, last as isize)?;
            return moved.softmax(-1)?.transpose(a as isize, last as isize);
        }
        if self.dtype() == DType::F16 {
            return self.to_dtype(DType::F32)?.softmax(-1)?.to_dtype(DType::F16);
        }
        let n = self.shape()[last];
        let rows = self.numel() / n.max(1);
        if rows == 0 || n == 0 {
            return Ok(Tensor::record(self.detach(), "softmax", &[self], |g| {
                Ok(vec![Some(g.clone())])
            }));
        }
        let y = self.storage().softmax_forward(rows, n)?;
        let y = Tensor::from_storage(y, self.shape().to_vec());
        let saved = y.clone();
        // the gradient the input already has is folded into the kernel
        Ok(Tensor::record_folding(
            y,
            "softmax",
            &[self],
            0,
            move |g, p| {
                let d = super::folded(p, &saved, |p| {
                    saved.storage().softmax_backward(g.storage(), p, rows, n)
                })?;
                Ok(vec![Some(d)])
            },
        ))
    }

    /// log(softmax) along `axis`, without forming the softmax (stable for very negative logits).
    pub fn log_softmax(&self, axis: isize) -> Result<Tensor> {
        let _profile = crate::profile::op("log_softmax");
        self.check_float("log_softmax")?;
        let a = normalize_axis(axis, self.rank())?;
        let sh = self.shifted_exp(a)?;
        let y = crate::no_grad(|| sh.z.sub(&sh.total.log()?))?;
        let saved = y.clone();
        Ok(Tensor::record(y, "log_softmax", &[self], move |g| {
            let total = g.sum(&[a as isize], true)?;
            Ok(vec![Some(g.sub(&saved.exp()?.mul(&total)?)?)])
        }))
    }

    /// `ln Σ e^x` along `axis`.
    pub fn logsumexp(&self, axis: isize, keepdim: bool) -> Result<Tensor> {
        let _profile = crate::profile::op("logsumexp");
        self.check_float("logsumexp")?;
        let a = normalize_axis(axis, self.rank())?;
        let sh = self.shifted_exp(a)?;
        let kept = crate::no_grad(|| sh.m.add(&sh.total.log()?))?; // keepdim
        let kshape = kept.shape().to_vec();
        let y = if keepdim {
            kept
        } else {
            let mut s = self.shape().to_vec();
            s.remove(a);
            kept.reshape(&s)?
        };
        let probs = crate::no_grad(|| sh.e.div(&sh.total))?;
        Ok(Tensor::record(y, "logsumexp", &[self], move |g| {
            Ok(vec![Some(probs.mul(&g.reshape(&kshape)?)?)])
        }))
    }
}
