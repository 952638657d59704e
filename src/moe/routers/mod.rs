//! One file per router, each implementing [`super::Router`] and declaring its registry entry
//! (a `RouterSpec`: name, summary, options, constructor) near the top; [`super::registry`] lists
//! those entries. The math of each is in its doc comment, with the paper it comes from;
//! `docs/routers.md` collects them.

pub(crate) mod dselect_k;
pub(crate) mod estimators;
pub(crate) mod expert_choice;
pub(crate) mod hash;
pub(crate) mod moesart;
pub mod probe;
pub(crate) mod smoe;
pub(crate) mod softmax;
pub(crate) mod sparsemixer;
pub(crate) mod switch;
pub(crate) mod threshold;
pub(crate) mod topk;
pub(crate) mod vmoe;
pub(crate) mod xmoe_cosine;

pub use dselect_k::{
    DSELECT_K_OPTIONS, DSelectKKind, DSelectKOptions, DSelectKRouter, UnusedCodes, selector_bits,
    selector_probs, smooth_step,
};
pub use estimators::{Estimator, EstimatorRouter, gumbel_softmax, jvp_softmax};
pub use expert_choice::ExpertChoiceRouter;
pub use hash::HashRouter;
pub use moesart::{MOESART_OPTIONS, MoesartDraw, MoesartOptions, MoesartRouter, MoesartStrategy};
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
