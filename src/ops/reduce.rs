//! Reductions over axes (sum, mean, max, min, argmax) and the prefix sum `cumsum`.
//! A reduction's backward broadcasts the upstream gradient back over the reduced axes.

use crate::backend::ReduceOp;
use crate::shape::{axis_view, normalize_axis};
use crate::{DType, Error, Result, Tensor};

impl Tensor {
    /// One-axis reduction with keepdim, untracked.
    fn reduce_axis_raw(&self, op: ReduceOp, axis: usize) -> Result<Tensor> {
        let mut shape = self.shape().to_vec();
        if shape[axis] == 0 && op != ReduceOp::Sum {
            return Err(Error::Invalid(format!(
                "{op:?} over an empty axis {axis} of shape {:?}",
                self.shape()
            )));
        }
        let out = self.storage().reduce(op, axis_view(&shape, axis))?;
        shape[axis] = 1;
        Ok(Tensor::from_storage(out, shape))
    }

    fn normalize_axes(&self, axes: &[isize]) -> Result<Vec<usize>> {
        let mut out = axes
            .iter()
            .map(|&a| normalize_axis(a, self.rank()))
            .collect::<Result<Vec<_>>>()?;
        out.sort_unstable();
        out.dedup();
        Ok(out)
    }

    fn squeeze_axes(shape: &[usize], axes: &[usize]) -> Vec<usize> {
        shape
            .iter()
            .enumerate()
            .filter(|(i, _)| !axes.contains(i))
            .map(|(_, &d)| d)
            .collect()
    }

    /// Sum over `axes` (negative axes count from the end); `keepdim` keeps them as size 1.
    ///
    /// # Example
    /// ```
    /// use moegrad::{Device, Tensor};
    /// let t = Tensor::from_f32(vec![1.0, 2.0, 3.0, 4.0], &[2, 2], Device::cpu()).unwrap();
    /// assert_eq!(t.sum(&[-1], false).unwrap().to_vec_f32().unwrap(), vec![3.0, 7.0]);
    /// ```
    pub fn sum(&self, axes: &[isize], keepdim: bool) -> Result<Tensor> {
        let _profile = crate::profile::op("sum");
        self.sum_axes(axes, keepdim, false)
    }

    /// [`Tensor::sum`] returned in `dtype`: the value of `self.sum(axes, keepdim)?.to_dtype(dtype)`,
    /// except that an f16 tensor's sum asked for in f32 is the f32 sum as accumulated, not
    /// rounded to f16 first (on the GPU one pass, where sum-then-cast takes three). An f32
    /// parameter's gradient from an f16 upstream gradient, such as a bias's in mixed precision,
    /// is this sum. The backward rule casts the upstream gradient to `self`'s dtype and
    /// broadcasts it, as [`Tensor::sum`]'s does.
    ///
    /// # Errors
    /// Those of [`Tensor::sum`] and [`Tensor::to_dtype`].
    ///
    /// # Example
    /// ```
    /// use moegrad::{DType, Device, Tensor};
    /// let t = Tensor::from_f32(vec![1.0, 2.0, 3.0, 4.0], &[2, 2], Device::cpu()).unwrap();
    /// let s = t.sum_as(&[0], false, DType::F64).unwrap();
    /// assert_eq!(s.dtype(), DType::F64);
    /// assert_eq!(s.to_vec_f64().unwrap(), vec![4.0, 6.0]);
    /// ```
    pub fn sum_as(&self, axes: &[isize], keepdim: bool, dtype: DType) -> Result<Tensor> {
        let _profile = crate::profile::op("sum");
        if self.dtype() == DType::F16 && dtype == DType::F32 && !axes.is_empty() {
            return self.sum_axes(axes, keepdim, true);
        }
        self.sum_axes(axes, keepdim, false)?.to_dtype(dtype)
    }

    /// The sum over `axes`, recorded; with `unrounded` the first reduction keeps what the
    /// backend accumulated (f32 for f16, [`crate::backend::ReduceOps::sum_unrounded`]) and the
    /// later ones sum that. An f16 tensor summed over several axes is summed so too and
    /// rounded to f16 once at the end, not once per axis.
    fn sum_axes(&self, axes: &[isize], keepdim: bool, unrounded: bool) -> Result<Tensor> {
        self.check_float("sum")?;
        let axes = self.normalize_axes(axes)?;
        let round_once = !unrounded && self.dtype() == DType::F16 && axes.len() > 1;
        let unrounded = unrounded || round_once;
        let mut y = self.detach();
        // innermost axis first: a sum along contiguous rows is the fast one (dims are kept
        // until the end, so the other axes keep their numbers)
        for (i, &a) in axes.iter().rev().enumerate() {
            y = if unrounded && i == 0 {
                let mut shape = y.shape().to_vec();
                let out = y.storage().sum_unrounded(axis_view(&shape, a))?;
                shape[a] = 1;
                Tensor::from_storage(out, shape)
            } else {
                y.reduce_axis_raw(ReduceOp::Sum, a)?
            };
        }
        if round_once {
            y = y.to_dtype(DType::F16)?;
        }
        let kept = y.shape().to_vec();
        if !keepdim {
            y = Tensor::from_storage(y.storage().clone(), Tensor::squeeze_axes(&kept, &axes));
        }
        let (in_shape, in_dtype) = (self.shape().to_vec(), self.dtype());
        Ok(Tensor::record(y, "sum", &[self], move |g| {
            let g = g.to_dtype(in_dtype)?;
            Ok(vec![Some(g.reshape(&kept)?.expand(&in_shape)?)])
        }))
    }

    /// Sum of every element (a 0-d tensor).
    pub fn sum_all(&self) -> Result<Tensor> {
        let _profile = crate::profile::op("sum_all");
        let axes: Vec<isize> = (0..self.rank() as isize).collect();
        self.sum(&axes, false)
    }

    /// Mean over `axes`.
    pub fn mean(&self, axes: &[isize], keepdim: bool) -> Result<Tensor> {
        let _profile = crate::profile::op("mean");
        let norm = self.normalize_axes(axes)?;
        let count: usize = norm.iter().map(|&a| self.shape()[a]).product();
        if count == 0 {
            return Err(Error::Invalid(format!(
                "mean over empty axes {axes:?} of shape {:?}",
                self.shape()
            )));
        }
        self.sum(axes, keepdim)?.mul_scalar(1.0 / count as f64)
    }

    /// Mean of every element (a 0-d tensor).
    pub fn mean_all(&self) -> Result<Tensor> {
        let _profile = crate::profile::op("mean_all");
        let axes: Vec<isize> = (0..self.rank() as isize).collect();
        self.mean(&axes, false)
    }

    fn extremum(
        &self,
        axis: isize,
        keepdim: bool,
        op: ReduceOp,
        name: &'static str,
    ) -> Result<Tensor> {
        self.check_float(name)?;
        let a = normalize_axis(axis, self.rank())?;
        let kept = self.reduce_axis_raw(op, a)?;
        let y = if keepdim {
            kept.clone()
        } else {
            Tensor::from_storage(
                kept.storage().clone(),
                Tensor::squeeze_axes(kept.shape(), &[a]),
            )
        };
        let (x, kshape) = (self.detach(), kept.shape().to_vec());
        // The gradient is shared equally among tied extrema (as PyTorch's amax does).
        Ok(Tensor::record(y, name, &[self], move |g| {
            let mask = x.eq(&kept)?;
            let count = mask.sum(&[a as isize], true)?;
            Ok(vec![Some(mask.div(&count)?.mul(&g.reshape(&kshape)?)?)])
        }))
    }

    /// Maximum along `axis`.
    pub fn max(&self, axis: isize, keepdim: bool) -> Result<Tensor> {
        let _profile = crate::profile::op("max");
        self.extremum(axis, keepdim, ReduceOp::Max, "max")
    }

    /// Minimum along `axis`.
    pub fn min(&self, axis: isize, keepdim: bool) -> Result<Tensor> {
        let _profile = crate::profile::op("min");
        self.extremum(axis, keepdim, ReduceOp::Min, "min")
    }

    /// Index (I32) of the first maximum along `axis` (no gradient).
    pub fn argmax(&self, axis: isize, keepdim: bool) -> Result<Tensor> {
        let _profile = crate::profile::op("argmax");
        self.check_float("argmax")?;
        let a = normalize_axis(axis, self.rank())?;
        let y = self.reduce_axis_raw(ReduceOp::ArgMax, a)?;
        if keepdim {
            Ok(y)
        } else {
            Ok(Tensor::from_storage(
                y.storage().clone(),
                Tensor::squeeze_axes(y.shape(), &[a]),
            ))
        }
    }

    /// Inclusive prefix sum along `axis`; its backward is the reversed prefix sum.
    pub fn cumsum(&self, axis: isize) -> Result<Tensor> {
        let _profile = crate::profile::op("cumsum");
        self.check_float("cumsum")?;
        let a = normalize_axis(axis, self.rank())?;
        let view = axis_view(self.shape(), a);
        let y = Tensor::from_storage(self.storage().cumsum(view, false)?, self.shape().to_vec());
        let shape = self.shape().to_vec();
        Ok(Tensor::record(y, "cumsum", &[self], move |g| {
            Ok(vec![Some(Tensor::from_storage(
                g.storage().cumsum(view, true)?,
                shape,
            ))])
        }))
    }
}
