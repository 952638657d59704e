//! Indexing along an axis with I32 indices: `gather` (one index per output element),
//! `index_select` (whole slices picked by a 1-D index) and `scatter_add` (their adjoint).
//! The backward of a gather is a scatter-add of the gradient, and vice versa; except for
//! `permute_rows`, a reordering by a permutation whose inverse is known, whose backward is a
//! gather by that inverse.

use crate::shape::{axis_view, contiguous_strides, normalize_axis};
use crate::{DType, Error, Result, Tensor};

impl Tensor {
    pub(super) fn check_index_tensor(&self, idx: &Tensor, op: &str) -> Result<()> {
        if idx.dtype() != DType::I32 {
            return Err(Error::DType(format!(
                "{op}: indices must be i32, got {} of shape {:?}",
                idx.dtype(),
                idx.shape()
            )));
        }
        if idx.device() != self.device() {
            return Err(Error::Device(format!(
                "{op}: indices on {}, tensor on {}",
                idx.device(),
                self.device()
            )));
        }
        Ok(())
    }

    /// Strides that read a contiguous index tensor of `shape` as `[outer, m, inner]` around `axis`.
    fn idx_strides(shape: &[usize], axis: usize) -> [usize; 3] {
        let s = contiguous_strides(shape);
        let inner: usize = shape[axis + 1..].iter().product();
        let m = shape[axis];
        [m * inner, s.get(axis).copied().unwrap_or(1), 1]
    }

    /// `out[.., j, ..] = self[.., idx[.., j, ..], ..]` along `axis`: `idx` has the rank of `self`
    /// and the same sizes on every other axis (like `torch.gather`). Differentiable in `self`.
    pub fn gather(&self, axis: isize, idx: &Tensor) -> Result<Tensor> {
        let _profile = crate::profile::op("gather");
        self.check_index_tensor(idx, "gather")?;
        let a = normalize_axis(axis, self.rank())?;
        let ok = idx.rank() == self.rank()
            && (0..self.rank()).all(|d| d == a || idx.shape()[d] == self.shape()[d]);
        if !ok {
            return Err(Error::Shape(format!(
                "gather along axis {a}: index shape {:?} must match tensor shape {:?} on every other axis",
                idx.shape(),
                self.shape()
            )));
        }
        let view = axis_view(self.shape(), a);
        let m = idx.shape()[a];
        let strides = Tensor::idx_strides(idx.shape(), a);
        let y = Tensor::from_storage(
            self.storage().gather(view, idx.storage(), strides, m)?,
            idx.shape().to_vec(),
        );
        let (idx_saved, len) = (idx.clone(), view.len);
        let in_shape = self.shape().to_vec();
        Ok(Tensor::record(y, "gather", &[self], move |g| {
            let out = g.storage().scatter_add(
                idx_saved.storage(),
                strides,
                view.outer,
                m,
                view.inner,
                len,
            )?;
            Ok(vec![Some(Tensor::from_storage(out, in_shape))])
        }))
    }

    /// Picks whole slices along `axis` by a 1-D I32 index (rows of a matrix with `axis = 0`).
    pub fn index_select(&self, axis: isize, idx: &Tensor) -> Result<Tensor> {
        let _profile = crate::profile::op("index_select");
        self.check_index_tensor(idx, "index_select")?;
        let a = normalize_axis(axis, self.rank())?;
        if idx.rank() != 1 {
            return Err(Error::Shape(format!(
                "index_select: index must be 1-D, got shape {:?}",
                idx.shape()
            )));
        }
        let view = axis_view(self.shape(), a);
        let m = idx.shape()[0];
        let mut shape = self.shape().to_vec();
        shape[a] = m;
        let y = Tensor::from_storage(
            self.storage().gather(view, idx.storage(), [0, 1, 0], m)?,
            shape,
        );
        let (idx_saved, in_shape) = (idx.clone(), self.shape().to_vec());
        Ok(Tensor::record(y, "index_select", &[self], move |g| {
            let out = g.storage().scatter_add(
                idx_saved.storage(),
                [0, 1, 0],
                view.outer,
                m,
                view.inner,
                view.len,
            )?;
            Ok(vec![Some(Tensor::from_storage(out, in_shape))])
        }))
    }

    /// The adjoint of [`Tensor::index_select`]: a tensor of `len` entries along `axis` in which
    /// entry `r` is the sum of the entries `j` of `self` with `idx[j] = r` (zero where none
    /// points). `idx` is 1-D with one index per entry of `self` along `axis`. This is how an MoE
    /// layer combines expert outputs into tokens (`y[t] = Σ rows routed from t`) without
    /// materialising a full index tensor. Differentiable in `self` (an index_select of the
    /// gradient).
    ///
    /// ```
    /// # use moegrad::{Device, Tensor};
    /// let rows = Tensor::from_f32(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[3, 2], Device::cpu())?;
    /// let idx = Tensor::from_i32(vec![1, 0, 1], &[3], Device::cpu())?;
    /// let y = rows.index_scatter(0, &idx, 2)?;
    /// assert_eq!(y.to_vec_f64()?, vec![3.0, 4.0, 6.0, 8.0]);
    /// # Ok::<(), moegrad::Error>(())
    /// ```
    pub fn index_scatter(&self, axis: isize, idx: &Tensor, len: usize) -> Result<Tensor> {
        let _profile = crate::profile::op("index_scatter");
        self.check_index_tensor(idx, "index_scatter")?;
        self.check_float("index_scatter")?;
        let a = normalize_axis(axis, self.rank())?;
        if idx.rank() != 1 || idx.shape()[0] != self.shape()[a] {
            return Err(Error::Shape(format!(
                "index_scatter along axis {a}: index of shape {:?} must be 1-D with one entry per \
                 row of {:?}",
                idx.shape(),
                self.shape()
            )));
        }
        let view = axis_view(self.shape(), a);
        let m = view.len;
        let mut shape = self.shape().to_vec();
        shape[a] = len;
        let out =
            self.storage()
                .scatter_add(idx.storage(), [0, 1, 0], view.outer, m, view.inner, len)?;
        let y = Tensor::from_storage(out, shape);
        let idx_saved = idx.clone();
        Ok(Tensor::record(y, "index_scatter", &[self], move |g| {
            Ok(vec![Some(g.index_select(a as isize, &idx_saved)?)])
        }))
    }

    /// `self` plus `src` added at `idx` along `axis` (like `torch.Tensor.scatter_add`): `idx` and
    /// `src` share a shape that matches `self` on every other axis; repeated indices accumulate.
    /// Differentiable in `self` (identity) and `src` (a gather of the gradient).
    pub fn scatter_add(&self, axis: isize, idx: &Tensor, src: &Tensor) -> Result<Tensor> {
        if let Some((base, src)) = crate::autocast::matched_operands(self, src)? {
            return base.scatter_add(axis, idx, &src);
        }
        let _profile = crate::profile::op("scatter_add");
        self.check_index_tensor(idx, "scatter_add")?;
        self.check_compatible(src, "scatter_add")?;
        self.check_float("scatter_add")?;
        let a = normalize_axis(axis, self.rank())?;
        let ok = idx.shape() == src.shape()
            && idx.rank() == self.rank()
            && (0..self.rank()).all(|d| d == a || idx.shape()[d] == self.shape()[d]);
        if !ok {
            return Err(Error::Shape(format!(
                "scatter_add along axis {a}: index {:?} and source {:?} must be equal and match {:?} off that axis",
                idx.shape(),
                src.shape(),
                self.shape()
            )));
        }
        let view = axis_view(self.shape(), a);
        let m = idx.shape()[a];
        let strides = Tensor::idx_strides(idx.shape(), a);
        let scattered = Tensor::from_storage(
            src.storage().scatter_add(
                idx.storage(),
                strides,
                view.outer,
                m,
                view.inner,
                view.len,
            )?,
            self.shape().to_vec(),
        );
        let y = crate::no_grad(|| self.detach().add(&scattered))?;
        let idx_saved = idx.clone();
        Ok(Tensor::record(y, "scatter_add", &[self, src], move |g| {
            Ok(vec![
                Some(g.clone()),
                Some(g.gather(a as isize, &idx_saved)?),
            ])
        }))
    }

    /// The rows of `self` (its entries along axis 0) reordered: `y[r] = self[order[r]]`, where
    /// `order` is a permutation of `0..len` and `inverse` is its inverse (`inverse[order[r]] =
    /// r`). The same values as [`Tensor::index_select`]`(0, order)`; the gradient is
    /// `dx[i] = dy[inverse[i]]`, another reordering, where `index_select`'s backward must
    /// scatter-add (on the GPU: sort the index, or scan it for every output). The MoE layer
    /// reorders its combine weights into the dispatch plan's row order this way
    /// (`DispatchPlan::order` and `position`).
    ///
    /// ```
    /// # use moegrad::{Device, Tensor};
    /// let x = Tensor::from_f32(vec![10.0, 20.0, 30.0], &[3], Device::cpu())?.with_grad()?;
    /// let order = Tensor::from_i32(vec![2, 0, 1], &[3], Device::cpu())?;
    /// let inverse = Tensor::from_i32(vec![1, 2, 0], &[3], Device::cpu())?;
    /// let y = x.permute_rows(&order, &inverse)?;
    /// assert_eq!(y.to_vec_f64()?, vec![30.0, 10.0, 20.0]);
    /// y.mul(&Tensor::from_f32(vec![1.0, 2.0, 3.0], &[3], Device::cpu())?)?.sum_all()?.backward()?;
    /// assert_eq!(x.grad().unwrap().to_vec_f64()?, vec![2.0, 3.0, 1.0]);
    /// # Ok::<(), moegrad::Error>(())
    /// ```
    ///
    /// # Errors
    /// A shape error unless `order` and `inverse` are 1-D with one entry per row; a dtype or
    /// device error as [`Tensor::index_select`]'s. On the CPU, an error naming the first entry
    /// where `inverse` does not invert `order` (a read of both); the GPU does not check (that
    /// would need a read-back): there a wrong inverse gives a wrong gradient.
    pub fn permute_rows(&self, order: &Tensor, inverse: &Tensor) -> Result<Tensor> {
        self.permute_rows_with(order, inverse, true)
    }

    /// [`Tensor::permute_rows`], checking on the CPU that `inverse` inverts `order` when
    /// `check_inverse` (the backward, which swaps a pair already checked, does not read it again).
    fn permute_rows_with(
        &self,
        order: &Tensor,
        inverse: &Tensor,
        check_inverse: bool,
    ) -> Result<Tensor> {
        let _profile = crate::profile::op("permute_rows");
        let Some(&rows) = self.shape().first() else {
            return Err(Error::Shape(
                "permute_rows: a scalar has no rows to reorder".into(),
            ));
        };
        for (name, idx) in [("order", order), ("inverse", inverse)] {
            self.check_index_tensor(idx, "permute_rows")?;
            if idx.shape() != [rows] {
                return Err(Error::Shape(format!(
                    "permute_rows: {name} of shape {:?} must be [{rows}], one entry per row of {:?}",
                    idx.shape(),
                    self.shape()
                )));
            }
        }
        // on the CPU, read both index lists in place (no copy in a training step)
        let host = (
            order.storage().cpu_indices(),
            inverse.storage().cpu_indices(),
        );
        if let (true, (Some(o), Some(inv))) = (check_inverse, host) {
            let inverts = |r: usize| {
                let i = usize::try_from(o[r]).ok().filter(|&i| i < rows);
                i.is_some_and(|i| inv[i] == r as i32)
            };
            if let Some(r) = (0..rows).find(|&r| !inverts(r)) {
                return Err(Error::Invalid(format!(
                    "permute_rows: inverse does not invert order at row {r} (order[{r}] = {})",
                    o[r]
                )));
            }
        }
        let view = axis_view(self.shape(), 0);
        let y = Tensor::from_storage(
            self.storage()
                .gather(view, order.storage(), [0, 1, 0], rows)?,
            self.shape().to_vec(),
        );
        let (order, inverse) = (order.clone(), inverse.clone());
        Ok(Tensor::record(y, "permute_rows", &[self], move |g| {
            Ok(vec![Some(g.permute_rows_with(&inverse, &order, false)?)])
        }))
    }
}
