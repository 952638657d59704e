//! Mixture-of-Experts: routers, the dispatch plan, the expert bank, the layer that combines them,
//! auxiliary losses and routing statistics. Read in the order of the data path:
//! `router_trait.rs` (the [`Router`] trait) and `routers/` (the routers, one a file, listed in
//! `router_registry.rs`) → `routing_output.rs` (the [`Routing`] a router returns) →
//! `dispatch.rs` → `experts.rs` → `layer.rs` (with `all_experts.rs`, its path when every token
//! uses every expert). `dense_to_sparse.rs` splits a dense FFN into
//! experts (XMoE §3.6).
//!
//! Every item has one path, `moegrad::moe::Item` (the routers: `moegrad::moe::routers::Item`);
//! the files are private.

mod all_experts;
mod aux_loss;
mod balancing;
mod cnn_experts;
mod default_outputs;
mod dense_to_sparse;
mod diagnostics;
mod dispatch;
mod experts;
mod layer;
mod layer_config;
mod null_experts;
mod router_registry;
mod router_trait;
pub mod routers;
mod routing_output;
mod score_function;
mod selection_bias;
mod shared_experts;
mod stats;

pub use aux_loss::{balance_loss, sequence_balance_loss, z_loss};
pub use balancing::{BalanceMethod, BalanceScope, Balancing};
pub use cnn_experts::{CNN_EXPERT_OUT, CnnExpertBank};
pub use default_outputs::DefaultOutputs;
pub use dense_to_sparse::{DenseFfn, SplitScale, decompose_ffn};
pub use diagnostics::{CollapseAlarm, LayerDiagnostics, RoutingDiagnostics, RoutingWindow, Spread};
pub use dispatch::{Capacity, DispatchPlan};
pub use experts::{ExpertBank, ExpertBankConfig, ExpertNet};
pub use layer::{MoeLayer, MoeOutput};
pub use layer_config::{ExpertKind, MoeConfig};
pub use router_registry::{
    BIASABLE_ROUTERS, LAB_ROUTER_NAMES, OptionKind, ROUTER_NAMES, ROUTERS, RouterOption,
    RouterSpec, build_router, find_router,
};
pub use router_trait::{
    LinearGate, Router, RouterConfig, normal_noise, parse_router_options, route_in_f32,
    uniform_noise,
};
pub use routing_output::{DefaultTerm, Routing, Selection};
pub(crate) use routing_output::{arange_f, slot_tables};
pub use score_function::{RunningBaseline, ScoreTerm, add_surrogates};
pub use selection_bias::SelectionBias;
pub use shared_experts::{SharedExperts, SharedExpertsConfig};
pub use stats::{ExpertWeights, RoutingStats, RoutingSummary};
