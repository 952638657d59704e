//! Mixture-of-Experts: routers, the dispatch plan, the expert bank, the layer that combines them,
//! auxiliary losses and routing statistics. Read in the order of the data path: `router.rs` and
//! `routers/` → `routing.rs` → `dispatch.rs` → `experts.rs` → `layer.rs`.
//! `dense_to_sparse.rs` splits a dense FFN into experts (XMoE §3.6).

pub mod aux_loss;
pub mod cnn_experts;
pub mod dense_to_sparse;
pub mod dispatch;
pub mod experts;
pub mod layer;
pub mod registry;
pub mod router;
pub mod routers;
pub mod routing;
pub mod score_function;
pub mod stats;

pub use cnn_experts::CnnExpertBank;
pub use dispatch::{Capacity, DispatchPlan};
pub use experts::{ExpertBank, ExpertBankConfig, ExpertNet};
pub use layer::{ExpertKind, MoeConfig, MoeLayer, MoeOutput};
pub use registry::{ROUTER_NAMES, ROUTERS, RouterSpec};
pub use router::{Router, RouterConfig, build_router, parse_router_options};
pub use routing::Routing;
pub use score_function::{RunningBaseline, ScoreTerm};
pub use stats::{RoutingStats, RoutingSummary};
