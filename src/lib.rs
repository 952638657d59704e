//! # moegrad
//!
//! A from-scratch, tape-based autodiff engine whose kernels are WGSL compute shaders run through
//! wgpu (Vulkan, Metal, DX12), with a multi-threaded CPU backend beside it, built for training
//! Mixture-of-Experts models.
//!
//! A program usually starts with `use moegrad::prelude::*;` ([`prelude`]: the tensor, the
//! device, the MoE layer, the router trait, the optimizers, ...).
//!
//! The layers, bottom to top (see `docs/architecture.md`):
//! - the backend (private): the primitive kernels on flat buffers, split by op family, with a
//!   CPU and a GPU implementation. What a user needs of it has one public place each:
//!   [`HostData`] (a tensor's values on the host), [`gpu`] (the adapter, its counters and
//!   memory, the matmul kernel choice) and [`memory`] (host memory and the CPU buffer pool).
//! - [`Tensor`]: shared storage + shape + device, and the autograd node that produced it.
//! - [`autograd`]: the graph, the backward walk, [`no_grad`], and [`autograd::custom_op`], the
//!   public way to add an op with a backward rule of one's own.
//! - [`wgsl`]: a WGSL compute kernel of one's own, validated and run on GPU tensors.
//! - `ops`: differentiable ops, each forward beside its backward rule.
//! - [`gradcheck`](mod@gradcheck): the finite-difference checker every op is tested with.
//! - [`profile`]: wall time per op, forward and backward, over a run (`train --profile`).
//! - [`train`]: the training loop of the image models and of the language models ([`lm`]),
//!   reporting to a [`train::TrainObserver`]. The command line (`moegrad`, with its progress
//!   bars, plots and `moegrad compare`) is the `moegrad-cli` crate in `app/`.
//!
//! # Example
//! ```
//! use moegrad::{Device, Tensor};
//! # fn main() -> moegrad::Result<()> {
//! let dev = Device::cpu();
//! let w = Tensor::from_f32(vec![0.5, -1.0, 2.0, 0.0], &[2, 2], dev)?.with_grad()?;
//! let x = Tensor::from_f32(vec![1.0, 2.0], &[1, 2], dev)?;
//! let loss = x.matmul(&w)?.relu()?.sum_all()?;
//! loss.backward()?;
//! assert_eq!(w.grad().unwrap().shape(), &[2, 2]);
//! # Ok(()) }
//! ```

#![warn(missing_docs)]

pub mod autocast;
pub mod autograd;
mod backend;
pub mod checkpoint;
pub mod data;
mod device;
mod dtype;
mod error;
pub mod estimator_lab;
mod export_dir;
pub mod gpu;
pub mod gradcheck;
pub mod info;
pub mod lm;
pub mod memory;
pub mod moe;
pub mod nn;
mod ops;
pub mod optim;
pub mod prelude;
pub mod profile;
pub mod shape;
mod tensor;
pub mod train;
pub mod wgsl;

// The backend's own tests (backend/tests/) share the helpers of the integration tests
// (tests/common/), which name this crate `moegrad` and find one another at the crate root.
#[cfg(test)]
extern crate self as moegrad;
#[cfg(test)]
#[path = "../tests/common/mod.rs"]
mod common;
#[cfg(test)]
#[path = "../tests/common/fold.rs"]
mod fold;
#[cfg(test)]
#[path = "../tests/common/parity.rs"]
mod parity;
#[cfg(test)]
#[path = "../tests/common/property.rs"]
mod property;

pub use autocast::{autocast_f16, full_precision};
pub use autograd::no_grad::{NoGradGuard, is_grad_enabled, no_grad};
pub use backend::HostData;
pub use device::Device;
pub use dtype::DType;
pub use error::{Error, Result};
pub use ops::TopkGate;
pub use tensor::Tensor;
