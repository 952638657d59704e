//! The primitives a device provides, split by op family, and [`Backend`], the trait that
//! names all of them.
//!
//! Each family trait lives in its own file under `family/`: [`BufferOps`] (the buffer type,
//! upload and download: the base of every other family), [`ElementwiseOps`], [`ReduceOps`],
//! [`LayoutOps`], [`MatmulOps`], [`NnOps`], [`RoutingOps`] and [`OptimOps`]. Each backend
//! implements a family in its file of the same name (`cpu/<family>.rs`, `gpu/<family>.rs`).
//! Code generic over a device bounds on [`Backend`]; a concrete backend's methods are called
//! with the family trait in scope.

mod buffer;
mod elementwise;
mod layout;
mod matmul;
mod nn;
mod optim;
mod reduce;
mod routing;

pub(crate) use buffer::BufferOps;
pub(crate) use elementwise::ElementwiseOps;
pub(crate) use layout::LayoutOps;
pub(crate) use matmul::{MatmulOps, MatmulProduct};
pub(crate) use nn::NnOps;
pub(crate) use optim::OptimOps;
pub(crate) use reduce::ReduceOps;
pub(crate) use routing::RoutingOps;

/// The primitives a device provides: every family trait. Buffers are flat and contiguous; each
/// knows its dtype and length.
///
/// Index buffers (`idx` arguments, argsort and argmax outputs) are [`DType::I32`]. Index values are
/// checked by the caller to lie in range before they reach a kernel, where that is cheap; kernels
/// must still never read or write out of bounds (they clamp or skip).
///
/// It has no methods of its own: a type that implements all eight families is a `Backend`
/// (the blanket impl below), so a new backend implements the family traits and nothing else.
///
/// [`DType::I32`]: crate::DType::I32
pub(crate) trait Backend:
    BufferOps + ElementwiseOps + ReduceOps + LayoutOps + MatmulOps + NnOps + RoutingOps + OptimOps
{
}

impl<B> Backend for B where
    B: BufferOps
        + ElementwiseOps
        + ReduceOps
        + LayoutOps
        + MatmulOps
        + NnOps
        + RoutingOps
        + OptimOps
{
}
