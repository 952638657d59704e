//! Sorting along the last axis: `argsort` (indices, no gradient) and `topk` (values
//! differentiable through a gather of the chosen positions, indices not). Ties keep index order,
//! so the lowest index wins, as routers need.

use crate::{Error, Result, Tensor};

impl Tensor {
    fn rows_and_len(&self, op: &str) -> Result<(usize, usize)> {
        self.check_float(op)?;
        if self.rank() == 0 {
            return Err(Error::Shape(format!(
                "{op} needs at least one axis, got a scalar"
            )));
        }
        let len = self.shape()[self.rank() - 1];
        Ok((self.numel() / len.max(1), len))
    }

    /// Indices (I32) that sort each row of the last axis, stable; `descending` for largest first.
    pub fn argsort(&self, descending: bool) -> Result<Tensor> {
        let _profile = crate::profile::op("argsort");
        let (rows, len) = self.rows_and_len("argsort")?;
        Ok(Tensor::from_storage(
            self.storage().argsort(rows, len, descending)?,
            self.shape().to_vec(),
        ))
    }

    /// The `k` largest values of each row of the last axis, in descending order, and their I32
    /// indices (ties: lowest index first). Gradients flow to the chosen values only.
    ///
    /// # Example
    /// ```
    /// use moegrad::{Device, Tensor};
    /// let x = Tensor::from_f32(vec![0.1, 0.7, 0.2], &[1, 3], Device::cpu()).unwrap();
    /// let (v, i) = x.topk(2).unwrap();
    /// assert_eq!(i.to_vec_i32().unwrap(), vec![1, 2]);
    /// assert_eq!(v.to_vec_f32().unwrap(), vec![0.7, 0.2]);
    /// ```
    pub fn topk(&self, k: usize) -> Result<(Tensor, Tensor)> {
        let _profile = crate::profile::op("topk");
        let (rows, len) = self.rows_and_len("topk")?;
        if k > len {
            return Err(Error::Invalid(format!(
                "topk: k = {k} exceeds the last axis of shape {:?}",
                self.shape()
            )));
        }
        let mut shape = self.shape().to_vec();
        if let Some(last) = shape.last_mut() {
            *last = k;
        }
        let idx = Tensor::from_storage(self.storage().argsort_top(rows, len, k, true)?, shape);
        let values = self.gather(-1, &idx)?;
        Ok((values, idx))
    }
}
