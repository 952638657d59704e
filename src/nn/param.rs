//! [`Param`]: a named slot holding a trainable tensor. Layers read it in `forward`; an optimizer
//! swaps in the updated tensor after each step (on the GPU the new buffer comes from the pool, so
//! a steady-state step allocates nothing).

use crate::autograd::LeafGrad;
use crate::{Error, Result, Tensor};
use std::sync::{Arc, RwLock};

/// A trainable tensor shared by a layer and the optimizer (cloning shares the slot).
#[derive(Clone, Debug)]
pub struct Param(Arc<RwLock<Tensor>>);

impl Param {
    /// Wraps `value` as a leaf that requires grad.
    pub fn new(value: Tensor) -> Result<Param> {
        let leaf = value.detach();
        leaf.set_requires_grad(true)?;
        Ok(Param(Arc::new(RwLock::new(leaf))))
    }

    /// The current value (a leaf that requires grad; its `grad()` is filled by `backward`).
    pub fn get(&self) -> Tensor {
        match self.0.read() {
            Ok(t) => t.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Replaces the value (same shape required). A leaf that already requires grad is stored
    /// as it is (so a caller such as `gradcheck` can own the leaf); anything else is detached
    /// into a fresh leaf with no gradient.
    pub fn set(&self, value: Tensor) -> Result<()> {
        let old = self.get();
        if value.shape() != old.shape() {
            return Err(Error::Shape(format!(
                "parameter update of shape {:?} for a parameter of shape {:?}",
                value.shape(),
                old.shape()
            )));
        }
        let leaf = if value.is_leaf() && value.requires_grad() {
            value
        } else {
            let leaf = value.detach();
            leaf.set_requires_grad(true)?;
            leaf
        };
        match self.0.write() {
            Ok(mut t) => *t = leaf,
            Err(poisoned) => *poisoned.into_inner() = leaf,
        }
        Ok(())
    }

    /// An optimizer's update: takes the parameter's gradient (so the next backward starts from
    /// none, as after PyTorch's `zero_grad(set_to_none=True)`; it may be an expert bank's
    /// deferred gradient, see `autograd/deferred.rs`) and runs `f(param, grad)` on the
    /// parameter's storage in place. Nothing is copied when no one else holds the parameter's
    /// tensor; otherwise `f` runs on a copy that replaces it. Returns false (doing nothing) when
    /// the parameter has no gradient.
    pub(crate) fn update(
        &self,
        f: impl FnOnce(&mut crate::backend::Storage, &LeafGrad) -> Result<()>,
    ) -> Result<bool> {
        let mut guard = match self.0.write() {
            Ok(t) => t,
            Err(poisoned) => poisoned.into_inner(),
        };
        let Some(grad) = guard.take_grad()? else {
            return Ok(false);
        };
        if let Some(inner) = Arc::get_mut(&mut guard.0) {
            f(&mut inner.storage, &grad)?;
            return Ok(true);
        }
        let mut storage = guard.storage().clone();
        f(&mut storage, &grad)?;
        let fresh = Tensor::from_storage(storage, guard.shape().to_vec());
        fresh.set_requires_grad(true)?;
        *guard = fresh;
        Ok(true)
    }

    /// [`Param::update`] for several parameters at once (a multi-tensor optimizer step): takes
    /// each one's gradient and calls `f` once with `(index in params, storage, gradient)` for
    /// every parameter that has one, all storages borrowed together. A parameter whose tensor
    /// someone else holds gets a fresh tensor over the same storage first, so the update
    /// (which copies a shared buffer before writing it) leaves that holder's values alone.
    pub(crate) fn update_many(
        params: &[&Param],
        f: impl FnOnce(&mut [(usize, &mut crate::backend::Storage, LeafGrad)]) -> Result<()>,
    ) -> Result<()> {
        let mut guards = Vec::with_capacity(params.len());
        let mut grads = Vec::with_capacity(params.len());
        for (i, p) in params.iter().enumerate() {
            let mut guard = match p.0.write() {
                Ok(t) => t,
                Err(poisoned) => poisoned.into_inner(),
            };
            let Some(grad) = guard.take_grad()? else {
                continue;
            };
            if Arc::get_mut(&mut guard.0).is_none() {
                let fresh = Tensor::from_storage(guard.storage().clone(), guard.shape().to_vec());
                fresh.set_requires_grad(true)?;
                *guard = fresh;
            }
            guards.push((i, guard));
            grads.push(grad);
        }
        let mut updates = Vec::with_capacity(guards.len());
        for ((i, guard), grad) in guards.iter_mut().zip(grads) {
            let inner = Arc::get_mut(&mut guard.0)
                .ok_or_else(|| Error::Invalid("a parameter's fresh tensor is shared".into()))?;
            updates.push((*i, &mut inner.storage, grad));
        }
        f(&mut updates)
    }

    /// The gradient accumulated on the current value, if any (`None` also when computing a
    /// deferred gradient fails; [`Param::try_grad`] returns that error).
    pub fn grad(&self) -> Option<Tensor> {
        self.get().grad()
    }

    /// The gradient accumulated on the current value, if any, or the error of computing an
    /// expert bank's deferred gradient (see [`Tensor::try_grad`]).
    pub fn try_grad(&self) -> Result<Option<Tensor>> {
        self.get().try_grad()
    }

    /// Freezes the parameter: its current value stops requiring grad, so backward computes no
    /// gradient for it (a later [`Param::set`] makes it trainable again).
    pub fn freeze(&self) -> Result<()> {
        self.get().set_requires_grad(false).map(|_| ())
    }

    /// Forgets the gradient.
    pub fn zero_grad(&self) {
        self.get().zero_grad()
    }
}
