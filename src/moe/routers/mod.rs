//! One file per router, each implementing [`super::Router`] and declaring its registry entry
//! (a `RouterSpec`: name, summary, options, constructor) near the top. The `router_files!` list
//! below is the registry: one line per file declares the module and lists its entries, which
//! `router_registry.rs` serves to the rest of the crate ([`crate::moe::ROUTERS`]). The math of each is in its doc comment, with the paper it comes from;
//! `docs/routers.md` collects them.

/// Declares each router file as a module of `routers` and lists its registry entries, in order,
/// as [`ROUTER_SPECS`]: `file => [SPEC, ...]` is the one line a router file needs.
macro_rules! router_files {
    ($($file:ident => [$($spec:ident),+ $(,)?]),+ $(,)?) => {
        $(pub(crate) mod $file;)+
        /// Every router's registry entry, in the order of the lines below
        /// (`crate::moe::ROUTERS`).
        pub(crate) const ROUTER_SPECS: &[crate::moe::RouterSpec] =
            &[$($($file::$spec,)+)+];
    };
}

// The router registry: one line per router file, `file => [its RouterSpec constants]`.
router_files! {
    softmax => [SPEC],
    topk => [SPEC_TOPK, SPEC_TOPK_NOISY, SPEC_TOPK_UNNORM],
    switch => [SPEC],
    vmoe => [SPEC],
    smoe => [SPEC],
    expert_choice => [SPEC],
    xmoe_cosine => [SPEC],
    hash => [SPEC],
    sparsemixer => [SPEC_HYBRID, SPEC_FIRST_ORDER, SPEC_SECOND_ORDER, SPEC_V2],
    estimators => [SPEC_ST, SPEC_GUMBEL_ST, SPEC_REINFORCE, SPEC_REINMAX],
    moesart => [SPEC],
    dselect_k => [SPEC, SPEC_STATIC],
    threshold => [SPEC],
    deepseek_v3 => [SPEC],
    scored_topk => [SPEC_SIGMOID, SPEC_SOFTPLUS],
    remoe => [SPEC],
    default_moe => [SPEC],
}

pub use deepseek_v3::DeepSeekV3Router;
pub use default_moe::DefaultMoeRouter;
pub use dselect_k::{
    DSELECT_K_OPTIONS, DSelectKKind, DSelectKOptions, DSelectKRouter, UnusedCodes, selector_bits,
    selector_probs, smooth_step,
};
pub use estimators::{Estimator, EstimatorRouter, gumbel_softmax, jvp_softmax};
pub use expert_choice::ExpertChoiceRouter;
pub use hash::HashRouter;
pub use moesart::{MOESART_OPTIONS, MoesartDraw, MoesartOptions, MoesartRouter, MoesartStrategy};
pub use remoe::ReMoeRouter;
pub use scored_topk::{Affinity, ScoredTopK};
pub use smoe::SMoeRouter;
pub use softmax::SoftmaxRouter;
pub use sparsemixer::{
    MASKED_LOGIT, MaskRule, SparseMixerConfig, SparseMixerRouter, SparseMixerVariant,
    gumbel_argmax, gumbel_noise, masked_softmax, one_hot, scale_through, sparsemixer_mask,
};
pub use switch::SwitchRouter;
pub use threshold::{THRESHOLD_OPTIONS, ThresholdOptions, ThresholdRouter};
pub use topk::{TopKKind, TopKRouter};
pub use vmoe::VMoeRouter;
pub use xmoe_cosine::XMoeCosineRouter;
