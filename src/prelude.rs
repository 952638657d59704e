//! What a training program imports: `use moegrad::prelude::*;`.
//!
//! The prelude re-exports, under their one path elsewhere in the crate, the types almost every
//! program names: the [`Tensor`] with its [`Device`] and [`DType`], the crate's [`Result`] and
//! [`Error`], [`no_grad`], the [`Module`] trait, the [`Parameters`] protocol and [`Param`] of
//! `nn`, the MoE layer ([`MoeLayer`], [`MoeConfig`]) with the [`Router`] trait and what a
//! router returns ([`Routing`], built from a [`RouterConfig`]), the optimizers ([`Adam`],
//! [`Sgd`], the [`Optimizer`] trait that gives them `step`), the learning-rate [`Schedule`],
//! [`clip_grad_norm`], and the finite-difference checker ([`gradcheck`] with its
//! [`GradcheckOptions`]). Traits are here so that their methods (`forward`, `named_params`,
//! `set_training`, `step`, `route`) can be called; everything else stays one `use` away in its
//! module (`moegrad::nn::Linear`, `moegrad::moe::routers::SwitchRouter`, `moegrad::data::Mnist`,
//! ...).
//!
//! # Example
//! ```
//! use moegrad::prelude::*;
//! # fn main() -> moegrad::Result<()> {
//! let dev = Device::cpu();
//! let layer = MoeLayer::new(&MoeConfig::new(8, 16, 4, 2), dev)?;
//! let mut params = Vec::new();
//! layer.visit_params("moe", &mut |name, p| params.push((name, p.clone())));
//! let mut opt = Adam::new(1e-3)?;
//! let x = Tensor::full(&[5, 8], 0.5, DType::F32, dev)?;
//! let out = layer.forward(&x)?;
//! let loss = out.y.mul(&out.y)?.mean_all()?.add(&out.aux_loss)?;
//! loss.backward()?;
//! opt.step(&params, None)?;
//! assert_eq!(opt.steps(), 1);
//! # Ok(()) }
//! ```

pub use crate::gradcheck::{GradcheckOptions, gradcheck};
pub use crate::moe::{MoeConfig, MoeLayer, Router, RouterConfig, Routing};
pub use crate::nn::{Module, Param, Parameters};
pub use crate::optim::{Adam, Optimizer, Schedule, Sgd, clip_grad_norm};
pub use crate::{DType, Device, Error, Result, Tensor, no_grad};
