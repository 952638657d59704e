//! Reverse-mode autodiff: the graph each op records, the backward walk over it, and `no_grad`.
//!
//! Every op that has a tracked input creates a `Node` holding its inputs and a closure, its
//! backward rule, that maps the gradient of the output to gradients of the inputs (written with
//! ordinary tensor ops, so it runs on whichever device the data are on). `backward` orders the
//! tensors reachable from the loss into a tape (each after all its consumers, the last-made
//! first, so the bits do not depend on the order an op lists its inputs), walks it, sums the
//! gradients of tensors used more than once, deposits them on the leaves, and then releases the
//! graph, so memory does not grow from step to step.
//!
//! [`custom_op`] is the public way to add an op with a backward rule of one's own (`custom.rs`).
//!
//! Autograd depends on `tensor`, never the other way: it builds the nodes (`Tensor::record`
//! below), owns the gradient bookkeeping of a tensor (`leaf.rs`) and the tape walk
//! (`backward.rs`), and decides what a tensor's two autograd fields hold; `src/tensor.rs` sees
//! a node only as a `TapeNode` and the gradient slot only as `dyn Any`.

mod backward;
mod custom;
mod deferred;
mod leaf;
// `pub(crate)`: the crate root re-exports its items (`moegrad::no_grad`), their one path
pub(crate) mod no_grad;

pub use backward::backward;
pub use custom::{CustomGrad, custom_op};
pub(crate) use deferred::{GroupedWeightGrad, LazyGrad, LeafGrad};
// src/ops reaches `autograd::NoGradGuard` (issue 25)
pub(crate) use no_grad::{NoGradGuard, is_grad_enabled};

use crate::tensor::{Inner, TapeNode};
use crate::{Result, Tensor};
use std::any::Any;
use std::sync::{Arc, Mutex};

/// Maps the gradient of an op's output to one optional gradient per input.
pub(crate) type BackwardFn = Box<dyn FnOnce(&Tensor) -> Result<Vec<Option<Tensor>>> + Send>;

/// A rule that also receives the gradient one of its inputs has received so far (from the
/// op's consumers walked before it), and returns that input's gradient with it added: a kernel
/// that can add it as it writes saves the tape's separate sum.
pub(crate) type FoldingFn =
    Box<dyn FnOnce(&Tensor, Option<Tensor>) -> Result<Vec<Option<Tensor>>> + Send>;

/// A node's backward rule.
pub(crate) enum Rule {
    /// gradients of the inputs from the output's gradient
    Plain(BackwardFn),
    /// the same, with input `input`'s pending gradient folded into its result
    Folding { input: usize, rule: FoldingFn },
}

/// One recorded op: its name, its inputs and its backward rule (taken when it runs).
pub(crate) struct Node {
    /// op name, for error messages and debugging
    pub op: &'static str,
    /// the op the profile attributes this node's backward rule to: the outermost op open when
    /// the node was recorded (a composed op's own name), else `op` (see `crate::profile`)
    pub(crate) profile_op: &'static str,
    pub(crate) inputs: Mutex<Vec<Tensor>>,
    pub(crate) backward: Mutex<Option<Rule>>,
}

impl TapeNode for Node {
    fn op_name(&self) -> &'static str {
        self.op
    }
}

/// The node of the op that produced `t` (None for leaves and untracked results).
pub(crate) fn node_of(t: &Tensor) -> Option<&Node> {
    let node: &dyn Any = t.0.node.as_deref()?;
    node.downcast_ref::<Node>()
}

/// Frees a long recorded chain without recursing once per node: a graph that was built but never
/// back-propagated (a loss computed only for logging, say) can be hundreds of thousands of nodes
/// deep, and the default recursive drop would overflow the stack.
impl Drop for Node {
    fn drop(&mut self) {
        // The rule first: any tensor it captured is still held by `inputs`, so this frees nothing
        // deep.
        drop(self.backward.get_mut().map(Option::take));
        let mut stack: Vec<Tensor> = match self.inputs.get_mut() {
            Ok(v) => std::mem::take(v),
            Err(_) => return,
        };
        while let Some(t) = stack.pop() {
            // Only the last reference to a tensor frees its node; unwrap it by hand and move the
            // node's inputs onto the stack instead of letting its drop recurse.
            let Ok(mut inner) = Arc::try_unwrap(t.0) else {
                continue;
            };
            let Some(node) = inner.node.take() else {
                continue;
            };
            let node: Arc<dyn Any + Send + Sync> = node;
            let Ok(node) = node.downcast::<Node>() else {
                continue;
            };
            if let Ok(mut node) = Arc::try_unwrap(node) {
                drop(node.backward.get_mut().map(Option::take));
                if let Ok(v) = node.inputs.get_mut() {
                    stack.append(v);
                }
            }
        }
    }
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
        Tensor::record_rule(out, op, inputs, Rule::Plain(Box::new(backward)))
    }

    /// [`Tensor::record`] for a rule that folds the gradient input `input` has received so far
    /// into the gradient it computes for it (see [`FoldingFn`]): the walk hands the rule that
    /// pending gradient (None when there is none yet) and takes the rule's result as the whole
    /// of the input's gradient. The rule must return `pending + its own gradient`, added in that
    /// order, which is the tape's own sum, so folding changes no value.
    pub(crate) fn record_folding(
        out: Tensor,
        op: &'static str,
        inputs: &[&Tensor],
        input: usize,
        backward: impl FnOnce(&Tensor, Option<Tensor>) -> Result<Vec<Option<Tensor>>> + Send + 'static,
    ) -> Tensor {
        let rule = Rule::Folding {
            input,
            rule: Box::new(backward),
        };
        Tensor::record_rule(out, op, inputs, rule)
    }

    fn record_rule(out: Tensor, op: &'static str, inputs: &[&Tensor], rule: Rule) -> Tensor {
        if !is_grad_enabled() || !inputs.iter().any(|t| t.requires_grad()) {
            return out;
        }
        let node = Node {
            op,
            profile_op: crate::profile::current_forward_op().unwrap_or(op),
            inputs: Mutex::new(inputs.iter().map(|t| (*t).clone()).collect()),
            backward: Mutex::new(Some(rule)),
        };
        let inner = Inner {
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
