//! The backward walk: build the tape (reverse topological order), run each node's rule once,
//! sum gradients per tensor (a folding rule adds its input's sum so far itself, see
//! [`super::FoldingFn`]), deposit them on leaves, release the graph. Each rule runs in a
//! profile scope named after its node's op (see `crate::profile`).

use super::no_grad::NoGradGuard;
use super::{Rule, node_of};
use crate::profile::{self, Pass};
use crate::{Error, Result, Tensor};
use std::collections::{HashMap, HashSet};

/// Nodes reachable from `root`, inputs before the ops that consume them (iterative DFS, so deep
/// graphs do not overflow the stack).
fn topological_order(root: &Tensor) -> Result<Vec<Tensor>> {
    let mut order = Vec::new();
    let mut seen = HashSet::new();
    let mut stack: Vec<(Tensor, bool)> = vec![(root.clone(), false)];
    while let Some((t, children_done)) = stack.pop() {
        if children_done {
            order.push(t);
            continue;
        }
        if !seen.insert(t.id()) {
            continue;
        }
        stack.push((t.clone(), true));
        if let Some(node) = node_of(&t) {
            let inputs = node
                .inputs
                .lock()
                .map_err(|_| Error::Autograd("graph lock poisoned".into()))?;
            for input in inputs
                .iter()
                .filter(|i| i.requires_grad() && !seen.contains(&i.id()))
            {
                stack.push((input.clone(), false));
            }
        }
    }
    Ok(order)
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
        topological_order(root)?
    };
    let mut grads: HashMap<usize, Tensor> = HashMap::new();
    grads.insert(root.id(), grad);
    for t in tape.iter().rev() {
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
