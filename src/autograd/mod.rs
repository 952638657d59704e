//! Reverse-mode autodiff: the graph each op records, the backward walk over it, and `no_grad`.
//!
//! Every op that has a tracked input creates a [`Node`] holding its inputs and a closure, its
//! backward rule, that maps the gradient of the output to gradients of the inputs (written with
//! ordinary tensor ops, so it runs on whichever device the data are on). `backward` sorts the
//! nodes reachable from the loss into a tape (topological order), walks it in reverse, sums the
//! gradients of tensors used more than once, deposits them on the leaves, and then releases the
//! graph, so memory does not grow from step to step.

mod backward;
mod no_grad;

pub use backward::backward;
pub use no_grad::{NoGradGuard, is_grad_enabled, no_grad};

use crate::{Result, Tensor};
use std::sync::{Arc, Mutex};

/// Maps the gradient of an op's output to one optional gradient per input.
pub type BackwardFn = Box<dyn FnOnce(&Tensor) -> Result<Vec<Option<Tensor>>> + Send>;

/// One recorded op: its name, its inputs and its backward rule (taken when it runs).
pub struct Node {
    /// op name, for error messages and debugging
    pub op: &'static str,
    pub(crate) inputs: Mutex<Vec<Tensor>>,
    pub(crate) backward: Mutex<Option<BackwardFn>>,
}

impl Tensor {
    /// Records `out` (an untracked result) as produced by `op` from `inputs`, with `backward` as
    /// its rule, when gradients are enabled and some input requires grad; otherwise returns `out`
    /// unchanged. The closure may capture `out` itself (it is untracked: no reference cycle).
    pub(crate) fn record(
        out: Tensor,
        op: &'static str,
        inputs: &[&Tensor],
        backward: impl FnOnce(&Tensor) -> Result<Vec<Option<Tensor>>> + Send + 'static,
    ) -> Tensor {
        if !is_grad_enabled() || !inputs.iter().any(|t| t.requires_grad()) {
            return out;
        }
        let node = Node {
            op,
            inputs: Mutex::new(inputs.iter().map(|t| (*t).clone()).collect()),
            backward: Mutex::new(Some(Box::new(backward))),
        };
        let inner = crate::tensor::Inner {
            id: out.0.id,
            storage: out.0.storage.clone(),
            shape: out.0.shape.clone(),
            requires_grad: true.into(),
            node: Some(Arc::new(node)),
            grad: Mutex::new(None),
        };
        Tensor(Arc::new(inner))
    }
}
