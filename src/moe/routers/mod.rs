//! One file per router, each implementing [`super::Router`]. The math of each is in its doc
//! comment, with the paper it comes from; `docs/routers.md` collects them.

mod expert_choice;
mod hash;
mod smoe;
mod softmax;
mod switch;
mod topk;
mod vmoe;
mod xmoe_cosine;

pub use expert_choice::ExpertChoiceRouter;
pub use hash::HashRouter;
pub use smoe::SMoeRouter;
pub use softmax::SoftmaxRouter;
pub use switch::SwitchRouter;
pub use topk::{TopKKind, TopKRouter};
pub use vmoe::VMoeRouter;
pub use xmoe_cosine::XMoeCosineRouter;
