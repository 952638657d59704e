//! Neural-network building blocks: [`Module`], [`Param`], the standard layers, dropout,
//! initialisation and an MLP builder. Layers hold parameters; the math is in the tensor ops.
//!
//! Every item has one path, `moegrad::nn::Item`; the files are private.

mod attention;
mod dropout;
mod init;
mod layers;
mod mlp;
mod module;
mod param;

pub use attention::CausalSelfAttention;
pub use dropout::Dropout;
pub use init::{Init, normal, uniform, weight};
pub use layers::{Activation, AvgPool2d, Conv2d, Embedding, Flatten, LayerNorm, Linear, MaxPool2d};
pub use mlp::mlp;
pub use module::{Module, Sequential, join, within};
pub use param::Param;
