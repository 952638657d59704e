//! The backward walk: order the tape (every tensor after all its consumers, the last-made first,
//! [`walk_order`]), run each node's rule once, sum gradients per tensor in that order (a folding
//! rule adds its input's sum so far itself, see [`super::FoldingFn`]), deposit them on leaves,
//! release the graph. Each rule runs in a profile scope named after its node's op (see
//! `crate::profile`).

use super::no_grad::NoGradGuard;
use super::{Rule, node_of};
use crate::profile::{self, Pass};
use crate::{Error, Result, Tensor};
use std::collections::{BinaryHeap, HashMap, HashSet};

/// The inputs of `t`'s node that require grad (none for a leaf), once per use.
fn grad_inputs(t: &Tensor) -> Result<Vec<Tensor>> {
    let Some(node) = node_of(t) else {
        return Ok(Vec::new());
    };
    let inputs = node
        .inputs
        .lock()
        .map_err(|_| Error::Autograd("graph lock poisoned".into()))?;
    Ok(inputs
        .iter()
        .filter(|i| i.requires_grad())
        .cloned()
        .collect())
}

/// The tensors reachable from `root` in the order the walk visits them: each one after every
/// tensor that consumes it, and among those ready, the one created last first (tensor ids count
/// up as tensors are made, so this is reverse creation order). The order, and with it the order
/// in which a tensor's gradients are summed (its last-made consumer's first), depends only on
/// the order the forward pass made the tensors, not on the order an op lists its inputs: an op
/// that takes its inputs in another order (an add folded into a product, say) leaves every
/// gradient's bits as they were.
fn walk_order(root: &Tensor) -> Result<Vec<Tensor>> {
    // each tensor's inputs and consumers (uses, counted once per input slot), found depth
    // first without recursion so that deep graphs do not overflow the stack
    let mut inputs_of: HashMap<usize, Vec<Tensor>> = HashMap::new();
    let mut consumers: HashMap<usize, usize> = HashMap::new();
    let mut stack = vec![root.clone()];
    let mut seen = HashSet::from([root.id()]);
    while let Some(t) = stack.pop() {
        let inputs = grad_inputs(&t)?;
        for input in &inputs {
            *consumers.entry(input.id()).or_default() += 1;
            if seen.insert(input.id()) {
                stack.push(input.clone());
            }
        }
        inputs_of.insert(t.id(), inputs);
    }
    // Kahn's algorithm, the largest id first among the tensors whose consumers are all done
    let mut ready = BinaryHeap::from([ById(root.clone())]);
    let mut order = Vec::with_capacity(seen.len());
    while let Some(ById(t)) = ready.pop() {
        for input in inputs_of.remove(&t.id()).unwrap_or_default() {
            let left = consumers
                .get_mut(&input.id())
                .ok_or_else(|| Error::Autograd("graph changed during the walk".into()))?;
            *left -= 1;
            if *left == 0 {
                ready.push(ById(input));
            }
        }
        order.push(t);
    }
    Ok(order)
}

/// A tensor ordered by its id (for the walk's heap).
struct ById(Tensor);

impl PartialEq for ById {
    fn eq(&self, other: &Self) -> bool {
        self.0.id() == other.0.id()
    }
}

impl Eq for ById {}

impl PartialOrd for ById {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for ById {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.id().cmp(&other.0.id())
    }
}

/// Propagates `grad` (the gradient of `root`) to every leaf that requires grad.
pub fn backward(root: &Tensor, grad: Tensor) -> Result<()> {
    if !root.requires_grad() {
        return Err(Error::Autograd(
            "backward on a tensor that does not require grad (no input had requires_grad, or it was made under no_grad)".into(),
        ));
    }
    let _no_grad = NoGradGuard::new();
    let tape = {
        let _profile = profile::scope("backward walk (tape)", Pass::Backward);
        walk_order(root)?
    };
    let mut grads: HashMap<usize, Tensor> = HashMap::new();
    grads.insert(root.id(), grad);
    for t in &tape {
        let Some(g) = grads.remove(&t.id()) else {
            continue;
        };
        let Some(node) = node_of(t) else {
            let _profile = profile::scope("accumulate leaf grad", Pass::Backward);
            t.accumulate_grad(g)?;
            continue;
        };
        // the rule and the summing of its gradients into its inputs' count to the node's op
        let _profile = profile::scope(node.profile_op, Pass::Backward);
        let rule = node
            .backward
            .lock()
            .map_err(|_| Error::Autograd("graph lock poisoned".into()))?
            .take();
        let rule = rule.ok_or_else(|| {
            Error::Autograd(format!(
                "the graph through '{}' was already released by an earlier backward(); run the forward pass again",
                node.op
            ))
        })?;
        let inputs = std::mem::take(
            &mut *node
                .inputs
                .lock()
                .map_err(|_| Error::Autograd("graph lock poisoned".into()))?,
        );
        let (input_grads, folded) = match rule {
            Rule::Plain(rule) => (rule(&g)?, None),
            Rule::Folding { input, rule } => {
                // the gradient the input has so far goes into the rule, which adds it
                let pending = inputs
                    .get(input)
                    .filter(|t| t.requires_grad())
                    .and_then(|t| grads.remove(&t.id()));
                let had_pending = pending.is_some();
                (rule(&g, pending)?, had_pending.then_some(input))
            }
        };
        for (i, (input, ig)) in inputs.iter().zip(input_grads).enumerate() {
            let Some(ig) = ig else {
                if folded == Some(i) {
                    return Err(Error::Autograd(format!(
                        "backward of '{}' was handed its input's gradient to fold and returned none",
                        node.op
                    )));
                }
                continue;
            };
            if !input.requires_grad() {
                continue;
            }
            if ig.shape() != input.shape() {
                return Err(Error::Autograd(format!(
                    "backward of '{}' produced a gradient of shape {:?} for an input of shape {:?}",
                    node.op,
                    ig.shape(),
                    input.shape()
                )));
            }
            let total = match grads.remove(&input.id()) {
                Some(prev) => prev.add(&ig)?,
                None => ig,
            };
            grads.insert(input.id(), total);
        }
    }
    Ok(())
}
