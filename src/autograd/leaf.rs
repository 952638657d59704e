//! Autograd's `impl Tensor`: the gradient bookkeeping of a tensor, which parameters require a
//! gradient, the gradient `backward` accumulates on them, and the `backward` calls themselves.
//!
//! A tensor has two fields autograd owns (`requires_grad` and the gradient slot, see
//! `src/tensor.rs`); `tensor.rs` does not look into the slot, so this file is where a leaf's
//! gradient is read and written. The slot holds a [`LeafGrad`]: a tensor, or the recipe that
//! computes it (`deferred.rs`).

use super::deferred::{GroupedWeightGrad, LeafGrad};
use crate::{Error, Result, Tensor};
use std::any::Any;
use std::sync::MutexGuard;
use std::sync::atomic::Ordering;

/// A tensor's gradient slot, locked.
type GradSlot<'a> = MutexGuard<'a, Option<Box<dyn Any + Send>>>;

/// Locks `t`'s gradient slot.
fn lock_grad(t: &Tensor) -> Result<GradSlot<'_>> {
    t.0.grad
        .lock()
        .map_err(|_| Error::Autograd("gradient lock poisoned".into()))
}

/// What the slot holds, as the [`LeafGrad`] autograd put there.
fn as_leaf_grad(stored: &mut Box<dyn Any + Send>) -> Result<&mut LeafGrad> {
    stored
        .downcast_mut::<LeafGrad>()
        .ok_or_else(|| Error::Autograd("a tensor's gradient slot holds no gradient".into()))
}

/// [`as_leaf_grad`], taking the value out.
fn into_leaf_grad(stored: Box<dyn Any + Send>) -> Result<LeafGrad> {
    stored
        .downcast::<LeafGrad>()
        .map(|g| *g)
        .map_err(|_| Error::Autograd("a tensor's gradient slot holds no gradient".into()))
}

impl Tensor {
    /// Marks a leaf as a parameter whose gradient `backward` should accumulate; returns `self`
    /// for chaining. Errors on an op output (its flag follows from its inputs) or on an I32 tensor.
    pub fn set_requires_grad(&self, on: bool) -> Result<&Tensor> {
        if self.0.node.is_some() {
            return Err(Error::Autograd(
                "requires_grad can only be set on a leaf tensor; call detach() first".into(),
            ));
        }
        if on && !self.dtype().is_float() {
            return Err(Error::Autograd(format!(
                "only float tensors can require grad, this one is {}",
                self.dtype()
            )));
        }
        self.0.requires_grad.store(on, Ordering::Relaxed);
        Ok(self)
    }

    /// Builder form of [`Tensor::set_requires_grad`]`(true)`.
    ///
    /// # Example
    /// ```
    /// use moegrad::{Device, Tensor};
    /// let w = Tensor::from_f32(vec![3.0], &[1], Device::cpu()).unwrap().with_grad().unwrap();
    /// let loss = w.mul(&w).unwrap().sum_all().unwrap();
    /// loss.backward().unwrap();
    /// assert_eq!(w.grad().unwrap().to_vec_f32().unwrap(), vec![6.0]);
    /// ```
    pub fn with_grad(self) -> Result<Tensor> {
        self.set_requires_grad(true)?;
        Ok(self)
    }

    /// The gradient accumulated by `backward` (leaves that require grad). An expert bank's
    /// gradient may have been kept as the recipe that computes it (see
    /// `autograd/deferred.rs`); it is computed here on first read (None if that fails; use
    /// [`Tensor::try_grad`] to see the error).
    pub fn grad(&self) -> Option<Tensor> {
        self.try_grad().ok().flatten()
    }

    /// [`Tensor::grad`], with the error of computing a deferred gradient.
    pub fn try_grad(&self) -> Result<Option<Tensor>> {
        let mut slot = lock_grad(self)?;
        let Some(stored) = slot.as_mut() else {
            return Ok(None);
        };
        let grad = as_leaf_grad(stored)?;
        if let LeafGrad::Dense(g) = grad {
            return Ok(Some(g.clone()));
        }
        let g = grad.to_dense()?;
        *grad = LeafGrad::Dense(g.clone());
        Ok(Some(g))
    }

    /// Whether the accumulated gradient is an expert bank's deferred gradient, not yet computed
    /// (see `autograd/deferred.rs`; reading it with [`Tensor::grad`] computes it).
    pub fn grad_is_deferred(&self) -> bool {
        self.0.grad.lock().is_ok_and(|g| {
            g.as_ref()
                .and_then(|stored| stored.downcast_ref::<LeafGrad>())
                .is_some_and(|g| matches!(g, LeafGrad::Lazy(_)))
        })
    }

    /// Forgets the accumulated gradient.
    pub fn zero_grad(&self) {
        if let Ok(mut g) = self.0.grad.lock() {
            *g = None;
        }
    }

    /// Adds `g` to this leaf's gradient (the backward walk's last step).
    pub(crate) fn accumulate_grad(&self, g: Tensor) -> Result<()> {
        self.accumulate(LeafGrad::Dense(g))
    }

    /// Deposits an expert bank's weight gradient as its recipe (computed when used).
    pub(crate) fn accumulate_deferred(&self, g: GroupedWeightGrad) -> Result<()> {
        self.accumulate(LeafGrad::Lazy(Box::new(g)))
    }

    fn accumulate(&self, g: LeafGrad) -> Result<()> {
        let mut slot = lock_grad(self)?;
        let total = match slot.take() {
            Some(old) => into_leaf_grad(old)?.add(g)?,
            None => g,
        };
        *slot = Some(Box::new(total));
        Ok(())
    }

    /// Takes the accumulated gradient out (an optimizer's step), leaving none.
    pub(crate) fn take_grad(&self) -> Result<Option<LeafGrad>> {
        lock_grad(self)?.take().map(into_leaf_grad).transpose()
    }

    /// Back-propagates from this scalar (one-element) tensor with upstream gradient 1.
    pub fn backward(&self) -> Result<()> {
        if self.numel() != 1 {
            return Err(Error::Autograd(format!(
                "backward() needs a scalar, this tensor has shape {:?}; use backward_with(grad)",
                self.shape()
            )));
        }
        let one = self.full_like(1.0)?;
        super::backward(self, one)
    }

    /// Back-propagates with an explicit upstream gradient of this tensor's shape.
    pub fn backward_with(&self, grad: &Tensor) -> Result<()> {
        if grad.shape() != self.shape()
            || grad.dtype() != self.dtype()
            || grad.device() != self.device()
        {
            return Err(Error::Autograd(format!(
                "upstream gradient {:?} {} on {} does not match the tensor {:?} {} on {}",
                grad.shape(),
                grad.dtype(),
                grad.device(),
                self.shape(),
                self.dtype(),
                self.device()
            )));
        }
        super::backward(self, grad.detach())
    }
}
