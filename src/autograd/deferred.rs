//! Deferred (lazy) gradients: a leaf's gradient kept as the recipe that computes it, behind the
//! generic hook [`LazyGrad`], for the case where computing it later is cheaper than storing it.
//! The one recipe today is an expert bank's weight gradient, [`GroupedWeightGrad`].
//!
//! The weight gradient of a grouped matmul, `dW[e] = Σ_{rows r of e} x[r]ᵀ·dy[r]`, has the
//! bank's shape `[n, k, m]`. With many experts it is larger than the two operands it comes from
//! (`n·k·m ≥ R·(k + m)` for `R` rows), so backward keeps `x` and `dy` instead of the gradient
//! and the gradient is computed when it is used:
//!
//! * [`Tensor::grad`](crate::Tensor::grad) (and gradient clipping, and `gradcheck`) computes it
//!   on first read, so a deferred gradient looks like any other;
//! * an optimizer may recognise a recipe it can fuse into its update (through
//!   [`LazyGrad::as_any`]) and otherwise asks for [`LazyGrad::materialize`]: Adam computes the
//!   bank's gradient expert by expert inside its own update (`optim/lazy_grad.rs`, with
//!   [`Storage::grouped_weight_grad_adam_mut`](crate::backend::Storage::grouped_weight_grad_adam_mut)),
//!   so the gradient of a 64-expert bank is never written to memory and read back.
//!
//! Autograd knows no optimizer: it only stores the recipe and computes it when asked.
//!
//! Only CPU banks are deferred: that is where the fused kernel is (a GPU version would be the
//! weight-gradient kernel with Adam as its epilogue, worth writing once a GPU can time it).
//!
//! This is the optimizer-in-backward idea (PyTorch's post-accumulate-grad hooks), done lazily so
//! that the training loop stays `loss.backward(); opt.step(..)`.

use crate::backend::ExpertBankDims;
use crate::{DType, Device, Result, Tensor};
use std::any::Any;

/// A gradient not computed yet: the recipe that computes it when it is used. Autograd stores
/// it in place of the gradient and calls [`LazyGrad::materialize`] when the gradient is read;
/// an optimizer that can do better (compute it inside its own update) recognises the concrete
/// recipe through [`LazyGrad::as_any`].
pub(crate) trait LazyGrad: Send + Sync {
    /// The gradient's shape (that of the leaf).
    fn shape(&self) -> Vec<usize>;
    /// The gradient's dtype.
    fn dtype(&self) -> DType;
    /// The gradient's device.
    fn device(&self) -> Device;
    /// Computes the gradient.
    fn materialize(&self) -> Result<Tensor>;
    /// The recipe itself, for an optimizer to downcast to the recipes it can fuse.
    fn as_any(&self) -> &dyn Any;
}

/// A leaf's accumulated gradient: a tensor, or the recipe that computes it.
pub(crate) enum LeafGrad {
    /// the gradient itself
    Dense(Tensor),
    /// a gradient computed when used
    Lazy(Box<dyn LazyGrad>),
}

impl LeafGrad {
    /// The gradient as a tensor (a deferred one is computed).
    pub(crate) fn to_dense(&self) -> Result<Tensor> {
        match self {
            LeafGrad::Dense(g) => Ok(g.clone()),
            LeafGrad::Lazy(d) => d.materialize(),
        }
    }

    /// The gradient's shape (that of the leaf).
    pub(crate) fn shape(&self) -> Vec<usize> {
        match self {
            LeafGrad::Dense(g) => g.shape().to_vec(),
            LeafGrad::Lazy(d) => d.shape(),
        }
    }

    /// Zeros of the gradient's shape, dtype and device (an optimizer's fresh state).
    pub(crate) fn zeros_like(&self) -> Result<Tensor> {
        match self {
            LeafGrad::Dense(g) => Tensor::zeros_like(g),
            LeafGrad::Lazy(d) => Tensor::zeros(&self.shape(), d.dtype(), d.device()),
        }
    }

    /// This gradient plus `other`, as a tensor.
    pub(crate) fn add(self, other: LeafGrad) -> Result<LeafGrad> {
        Ok(LeafGrad::Dense(self.to_dense()?.add(&other.to_dense()?)?))
    }
}

/// The weight gradient of `x.grouped_matmul(w, row_expert, offsets)` for the upstream gradient
/// `dy`, not yet computed.
pub(crate) struct GroupedWeightGrad {
    /// the rows `[R, k]` (detached)
    pub(crate) x: Tensor,
    /// the upstream gradient `[R, m]`
    pub(crate) dy: Tensor,
    /// `[R]` i32: each row's expert
    pub(crate) row_expert: Tensor,
    /// `[n + 1]` i32: where each expert's rows start
    pub(crate) offsets: Tensor,
    pub(crate) experts: usize,
    pub(crate) k: usize,
    pub(crate) m: usize,
    /// the gradient's dtype, the bank's: that of `x` and `dy`, or f32 from f16 rows (mixed
    /// precision, on the GPU)
    pub(crate) out: DType,
}

impl GroupedWeightGrad {
    /// Whether to defer the gradient of a bank on `device`: where the device has the fused
    /// kernel (the CPU) and keeping `x` and `dy` costs no more memory than the gradient,
    /// `n·k·m ≥ R·(k + m)` (at T = 4096, k = 2, d = 256, hidden 512: from 64 experts on). On the
    /// GPU, Adam on a deferred gradient would only run the two kernels one after the other,
    /// moving the gradient's buffer from backward into the optimizer step for no saving.
    pub(crate) fn worth_deferring(
        device: Device,
        rows: usize,
        (k, m, experts): (usize, usize, usize),
    ) -> bool {
        !device.is_gpu()
            && experts.saturating_mul(k).saturating_mul(m) >= rows.saturating_mul(k + m)
    }

    /// The gradient `[n, k, m]`.
    pub(crate) fn materialize(&self) -> Result<Tensor> {
        let dw = self.x.storage().grouped_weight_grad(
            self.dy.storage(),
            self.row_expert.storage(),
            self.offsets.storage(),
            self.bank(),
            self.out,
        )?;
        Ok(Tensor::from_storage(dw, vec![self.experts, self.k, self.m]))
    }

    /// The bank's sizes `[experts, k, m]`.
    pub(crate) fn bank(&self) -> ExpertBankDims {
        ExpertBankDims {
            k: self.k,
            m: self.m,
            experts: self.experts,
        }
    }
}

impl LazyGrad for GroupedWeightGrad {
    fn shape(&self) -> Vec<usize> {
        vec![self.experts, self.k, self.m]
    }

    fn dtype(&self) -> DType {
        self.out
    }

    fn device(&self) -> Device {
        self.x.device()
    }

    fn materialize(&self) -> Result<Tensor> {
        GroupedWeightGrad::materialize(self)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

#[cfg(test)]
impl GroupedWeightGrad {
    /// A deferred `[1, 1, 1]` bank gradient whose computation fails (f64 rows, f32 upstream),
    /// for the unit tests that check readers of gradients report that error.
    pub(crate) fn uncomputable() -> GroupedWeightGrad {
        let cpu = Device::Cpu;
        let t = |r: Result<Tensor>| r.expect("valid test tensor");
        GroupedWeightGrad {
            x: t(Tensor::from_f64(vec![1.0], &[1, 1], cpu)),
            dy: t(Tensor::from_f32(vec![1.0], &[1, 1], cpu)),
            row_expert: t(Tensor::from_i32(vec![0], &[1], cpu)),
            offsets: t(Tensor::from_i32(vec![0, 1], &[2], cpu)),
            experts: 1,
            k: 1,
            m: 1,
            out: DType::F64,
        }
    }
}
