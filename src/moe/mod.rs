//! Mixture-of-Experts: routers, the dispatch plan, the expert bank, the layer that combines them,
//! auxiliary losses and routing statistics. Read in the order of the data path:
//! `router_trait.rs` (the [`Router`] trait) and `routers/` (the routers, one a file, listed in
//! `router_registry.rs`) → `routing_output.rs` (the [`Routing`] a router returns) →
//! `dispatch.rs` → `experts.rs` → `layer.rs`. `dense_to_sparse.rs` splits a dense FFN into
//! experts (XMoE §3.6).
//!
//! Every item has one path, `moegrad::moe::Item` (the routers: `moegrad::moe::routers::Item`);
//! the files are private.

mod aux_loss;
// `pub(crate)` while src/train reaches `moe::cnn_experts::CNN_EXPERT_OUT` (issue 25)
pub(crate) mod cnn_experts;
mod dense_to_sparse;
mod dispatch;
mod experts;
mod layer;
mod router_registry;
mod router_trait;
pub mod routers;
mod routing_output;
// `pub(crate)` while src/train and src/lm reach `moe::score_function::add_surrogates` (issue 25)
pub(crate) mod score_function;
mod stats;

pub use aux_loss::{balance_loss, z_loss};
pub use cnn_experts::{CNN_EXPERT_OUT, CnnExpertBank};
pub use dense_to_sparse::{DenseFfn, SplitScale, decompose_ffn};
pub use dispatch::{Capacity, DispatchPlan};
pub use experts::{ExpertBank, ExpertBankConfig, ExpertNet};
pub use layer::{ExpertKind, MoeConfig, MoeLayer, MoeOutput};
pub use router_registry::{
    LAB_ROUTER_NAMES, OptionKind, ROUTER_NAMES, ROUTERS, RouterOption, RouterSpec, build_router,
    find_router,
};
pub use router_trait::{
    LinearGate, Router, RouterConfig, normal_noise, parse_router_options, uniform_noise,
};
pub use routing_output::Routing;
pub(crate) use routing_output::{arange_f, slot_tables};
pub use score_function::{RunningBaseline, ScoreTerm, add_surrogates};
pub use stats::{RoutingStats, RoutingSummary};

/// The registry's path before issue 25, still named by `src/bin/moegrad/routers.rs` and
/// `src/estimator_lab/estimators.rs`; the same items are [`crate::moe::ROUTERS`] and friends.
/// Remove once those files use the flat names.
#[doc(hidden)]
pub mod registry {
    pub use super::{LAB_ROUTER_NAMES, ROUTERS, RouterSpec};
}

/// The router trait file's path before issue 25, still named by
/// `src/estimator_lab/estimators.rs`; the same item is [`crate::moe::RouterConfig`]. Remove once
/// that file uses the flat name.
pub(crate) mod router {
    pub(crate) use super::RouterConfig;
}
