//! Differentiable ops. Each file holds one family; each op computes its forward pass through the
//! backend primitives and records, right beside it, the rule that pushes the gradient back.
//!
//! Backward rules are written with ordinary tensor ops (they run under `no_grad`), so one rule
//! serves every device.

mod arithmetic;
mod attention;
mod conv;
mod conv_unfolded;
mod elementwise;
mod grouped;
mod index;
mod layer_norm;
mod layout;
mod loss;
pub(crate) mod matmul;
mod reduce;
mod softmax;
mod sort;
mod swiglu;
mod topk_gate;
mod weighted_index_scatter;

pub use topk_gate::TopkGate;

use crate::backend::{BinaryOp, UnaryOp};
use crate::shape::{broadcast_shapes, broadcast_strides};
use crate::{Error, Result, Tensor};

impl Tensor {
    /// Errors unless `other` has this tensor's dtype and device; `op` names the call.
    pub(crate) fn check_compatible(&self, other: &Tensor, op: &str) -> Result<()> {
        self.check_same_device(other, op)?;
        if self.dtype() != other.dtype() {
            return Err(Error::DType(format!(
                "{op}: operands of different dtypes ({} {:?} and {} {:?})",
                self.dtype(),
                self.shape(),
                other.dtype(),
                other.shape()
            )));
        }
        Ok(())
    }

    /// Errors unless `other` is on this tensor's device; `op` names the call.
    pub(crate) fn check_same_device(&self, other: &Tensor, op: &str) -> Result<()> {
        if self.device() != other.device() {
            return Err(Error::Device(format!(
                "{op}: operands on different devices ({} {:?} and {} {:?})",
                self.device(),
                self.shape(),
                other.device(),
                other.shape()
            )));
        }
        Ok(())
    }

    /// Errors unless this is a float tensor.
    pub(crate) fn check_float(&self, op: &str) -> Result<()> {
        if self.dtype().is_float() {
            Ok(())
        } else {
            Err(Error::DType(format!(
                "{op} needs a float tensor, got {} of shape {:?}",
                self.dtype(),
                self.shape()
            )))
        }
    }

    /// Untracked elementwise op.
    pub(crate) fn map_unary(&self, op: UnaryOp) -> Result<Tensor> {
        self.check_float(&format!("{op:?}"))?;
        Ok(Tensor::from_storage(
            self.storage().unary(op)?,
            self.shape().to_vec(),
        ))
    }

    /// Untracked broadcasting binary op.
    pub(crate) fn map_binary(&self, other: &Tensor, op: BinaryOp) -> Result<Tensor> {
        let name = format!("{op:?}").to_lowercase();
        self.check_compatible(other, &name)?;
        self.check_float(&name)?;
        let shape = broadcast_shapes(self.shape(), other.shape()).map_err(|_| {
            Error::Shape(format!(
                "{name}: shapes {:?} and {:?} cannot be broadcast together",
                self.shape(),
                other.shape()
            ))
        })?;
        let sa = broadcast_strides(self.shape(), &shape)?;
        let sb = broadcast_strides(other.shape(), &shape)?;
        Ok(Tensor::from_storage(
            self.storage()
                .binary(op, &sa, other.storage(), &sb, &shape)?,
            shape,
        ))
    }

    /// Sums a broadcast gradient back down to `shape` (the inverse of broadcasting).
    pub(crate) fn sum_to_shape(&self, shape: &[usize]) -> Result<Tensor> {
        if self.shape() == shape {
            return Ok(self.clone());
        }
        let lead = self.rank() - shape.len();
        let mut axes: Vec<isize> = (0..lead as isize).collect();
        for (i, &d) in shape.iter().enumerate() {
            if d == 1 && self.shape()[lead + i] != 1 {
                axes.push((lead + i) as isize);
            }
        }
        self.sum(&axes, true)?.reshape(shape)
    }
}

/// A folding rule's gradient (`Tensor::record_folding`): the gradient of `like`'s shape that
/// `kernel` computes, with `pending` (the gradient its input already has) added, handed to the
/// kernel when it matches `like`'s shape, dtype and device (the sum in one launch) and added
/// after it otherwise.
pub(crate) fn folded(
    pending: Option<Tensor>,
    like: &Tensor,
    kernel: impl FnOnce(Option<&crate::backend::Storage>) -> Result<crate::backend::Storage>,
) -> Result<Tensor> {
    let fits = |p: &&Tensor| {
        p.shape() == like.shape() && p.dtype() == like.dtype() && p.device() == like.device()
    };
    let foldable = pending.as_ref().filter(fits);
    let d = Tensor::from_storage(
        kernel(foldable.map(|p| p.storage()))?,
        like.shape().to_vec(),
    );
    match (foldable, &pending) {
        (None, Some(p)) => p.add(&d),
        _ => Ok(d),
    }
}
