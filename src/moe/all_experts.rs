//! The MoE layer's path for routings in which every token uses every expert: `A = T·n`
//! assignments, as the dense `softmax` router makes, the straight-through estimators in
//! training (`st`, `gumbel-st`, `reinmax`) and any top-k router with k = n.
//!
//! The sparse path would sort `T·n` assignments by expert, copy every token `n` times and
//! scatter `n` outputs back per token. Such a router builds its routing with
//! [`crate::moe::Routing::every_expert`], which keeps the combine weights as the matrix
//! `W: [T, n]` ([`crate::moe::Routing::dense`]); with it there is nothing to sort, and the
//! expert bank runs two wide products ([`crate::moe::ExpertNet::forward_all_experts`]):
//!
//! ```text
//! H = act(x · [W1_0 | … | W1_{n−1}] + b1)                    [T, n·h]
//! y = (H ⊙ W, each expert's h columns scaled by its weight) · [W2_0; …; W2_{n−1}] + W · b2
//!   = Σ_e W[t, e] · expert_e(x_t)                             [T, d_out]
//! ```
//!
//! which is what the sparse path computes: the same products on the same rows (`T·n` of them),
//! the sum over experts taken inside the second product instead of by a scatter. The gradients
//! are the same by the same token: `∂W[t, e] = ⟨∂y_t, expert_e(x_t)⟩` is the gradient of the
//! assignment's weight, and the router's own backward rule takes it from there.
//!
//! The path is taken only when it cannot differ from the sparse one: a single routing with
//! dense weights, no null experts, no Default MoE terms, and a capacity of at least `T` rows
//! per expert (nothing can be dropped). [`crate::moe::MoeLayer::set_all_experts_path`] turns
//! it off (to compare the two).

use super::{Capacity, Routing};
use crate::Tensor;

/// The dense weights `[T, n]` when `routing` may take the all-experts path under `capacity`
/// (`counted` is what the capacity is sized by), given the layer's other settings (`plain`: one
/// routing, no null experts, a fixed number of experts per token); None otherwise.
pub(super) fn dense_weights(
    routing: &Routing,
    capacity: Capacity,
    counted: usize,
    plain: bool,
) -> Option<&Tensor> {
    let (t, n) = (routing.tokens, routing.experts);
    let fits = capacity.slots(counted, n).is_none_or(|c| c >= t);
    match &routing.dense {
        Some(w) if plain && fits && routing.defaults.is_none() && w.shape() == [t, n] => Some(w),
        _ => None,
    }
}
