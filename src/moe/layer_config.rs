//! The settings of an MoE layer ([`MoeConfig`]): sizes, router, capacity, balancing, losses and
//! the expert architecture ([`ExpertKind`]); `layer.rs` builds a [`crate::moe::MoeLayer`] from
//! them.

use super::shared_experts::SharedExpertsConfig;
use super::{Balancing, Capacity, RouterConfig};
use crate::nn::Activation;

/// Settings of an MoE layer.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    /// input width
    pub d: usize,
    /// expert hidden width
    pub hidden: usize,
    /// output width
    pub d_out: usize,
    /// number of experts n
    pub experts: usize,
    /// experts per token k
    pub k: usize,
    /// router name (see `ROUTER_NAMES`)
    pub router: String,
    /// capacity in training
    pub capacity: Capacity,
    /// capacity in evaluation
    pub eval_capacity: Capacity,
    /// expert activation (ReLU, GELU or the gated SwiGLU)
    pub activation: Activation,
    /// Switch balance-loss coefficient α (0: off; used by `balancing.method` aux only)
    pub balance_loss: f64,
    /// how the layer balances its experts' load (the auxiliary loss and its scope, a
    /// selection-only bias, or nothing; `balancing.rs`)
    pub balancing: Balancing,
    /// router z-loss coefficient β (0: off)
    pub z_loss: f64,
    /// Switch jitter r
    pub jitter: f64,
    /// seed of the initialisation and the router noise
    pub seed: u64,
    /// what the experts are
    pub expert_kind: ExpertKind,
    /// router-specific options (see `RouterConfig::options`)
    pub router_options: std::collections::BTreeMap<String, String>,
    /// whether MLP experts have biases (default true)
    pub expert_bias: bool,
    /// whether the router's linear gate has a bias (default true; false in the transformers
    /// families)
    pub gate_bias: bool,
    /// the experts every token uses besides its routed ones (none by default)
    pub shared: SharedExpertsConfig,
    /// null experts (AdaMoE, MoE++): `N` extra router outputs whose expert outputs zero at no
    /// cost, so a token that picks some of them uses fewer real experts (0 by default; see
    /// [`crate::moe::MoeLayer::routed_experts`] and docs/routers.md, "Null experts")
    pub null_experts: usize,
}

/// The expert architecture.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertKind {
    /// two-layer MLPs `d → hidden → d_out`
    Mlp,
    /// the MOESART CNN on `side × side` images (`d = side²`, `d_out = 50`)
    Cnn {
        /// image side
        side: usize,
    },
}

impl MoeConfig {
    /// A dropless top-`k` layer `d → hidden → d` with `experts` ReLU experts.
    pub fn new(d: usize, hidden: usize, experts: usize, k: usize) -> MoeConfig {
        MoeConfig {
            d,
            hidden,
            d_out: d,
            experts,
            k,
            router: "topk".into(),
            capacity: Capacity::Dropless,
            eval_capacity: Capacity::Dropless,
            activation: Activation::Relu,
            balance_loss: 0.0,
            balancing: Balancing::default(),
            z_loss: 0.0,
            jitter: 0.1,
            seed: 0,
            expert_kind: ExpertKind::Mlp,
            router_options: Default::default(),
            expert_bias: true,
            gate_bias: true,
            shared: SharedExpertsConfig::default(),
            null_experts: 0,
        }
    }

    /// The router's settings from these, with the router seeded by `seed` (the layer's own
    /// seed, or another for the extra gates of a multi-gate MoE).
    pub fn router_config(&self, seed: u64) -> RouterConfig {
        RouterConfig {
            d: self.d,
            d_out: self.d_out,
            // the router scores the null experts too
            experts: self.experts + self.null_experts,
            k: self.k,
            jitter: self.jitter,
            seed,
            gate_bias: self.gate_bias,
            selection_bias: self.balancing.uses_selection_bias(),
            options: self.router_options.clone(),
        }
    }
}
