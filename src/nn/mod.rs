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
mod init;
mod linear;
mod mlp;
mod module;
mod norm;
mod param;
mod parameters;

pub use activation::Activation;
pub use attention::CausalSelfAttention;
pub use conv::{AvgPool2d, Conv2d, Flatten, MaxPool2d};
pub use dropout::Dropout;
pub use embedding::Embedding;
pub use init::{Init, normal, uniform, weight};
pub use linear::Linear;
pub use mlp::mlp;
pub use module::{Module, Sequential, join, within};
pub use norm::LayerNorm;
pub use param::Param;
pub use parameters::Parameters;
