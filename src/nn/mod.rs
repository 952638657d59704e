//! Neural-network building blocks: [`Parameters`] (the one parameter protocol of layers,
//! routers and models), [`Module`], [`Param`], the standard layers, dropout,
//! initialisation and an MLP builder. Layers hold parameters; the math is in the tensor ops.
//!
//! Every item has one path, `moegrad::nn::Item`; the files are private.

mod activation;
mod attention;
mod conv;
mod dropout;
mod embedding;
mod grouped_query_attention;
mod init;
mod latent_attention;
mod linear;
mod mlp;
mod module;
mod norm;
mod param;
mod parameters;
mod rotary;

pub use activation::Activation;
pub use attention::CausalSelfAttention;
pub use conv::{AvgPool2d, Conv2d, Flatten, MaxPool2d};
pub use dropout::Dropout;
pub use embedding::Embedding;
pub use grouped_query_attention::GroupedQueryAttention;
pub use init::{Init, normal, uniform, weight};
pub use latent_attention::{LatentAttention, QueryProjection};
pub use linear::Linear;
pub use mlp::{Mlp, mlp};
pub use module::{Module, Sequential, join, within};
pub use norm::{LayerNorm, RmsNorm};
pub use param::Param;
pub use parameters::Parameters;
pub use rotary::Rotary;
