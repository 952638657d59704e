//! Neural-network building blocks: [`Parameters`] (the one parameter protocol of layers,
//! routers and models), [`Module`], [`Param`], the standard layers, dropout,
//! initialisation and an MLP builder. Layers hold parameters; the math is in the tensor ops.
//!
//! Every item has one path, `moegrad::nn::Item`; the files are private.

mod attention;
mod dropout;
mod grouped_query_attention;
mod init;
mod latent_attention;
mod layers;
mod mlp;
mod module;
mod param;
mod parameters;
mod rms_norm;
mod rotary;

pub use attention::CausalSelfAttention;
pub use dropout::Dropout;
pub use grouped_query_attention::GroupedQueryAttention;
pub use init::{Init, normal, uniform, weight};
pub use latent_attention::{LatentAttention, QueryProjection};
pub use layers::{Activation, AvgPool2d, Conv2d, Embedding, Flatten, LayerNorm, Linear, MaxPool2d};
pub use mlp::{Mlp, mlp};
pub use module::{Module, Sequential, join, within};
pub use param::Param;
pub use parameters::Parameters;
pub use rms_norm::RmsNorm;
pub use rotary::Rotary;
