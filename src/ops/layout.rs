//! Ops that move elements without changing them: reshape, permute/transpose, expand, slice,
//! concat. Data stay contiguous: a view is copied by the backend's `copy_strided` kernel.

use crate::backend::Storage;
use crate::shape::{broadcast_strides, contiguous_strides, normalize_axis};
use crate::{Error, Result, Tensor};

impl Tensor {
    /// The same elements with a new shape of equal size (shares the storage).
    pub fn reshape(&self, shape: &[usize]) -> Result<Tensor> {
        let _profile = crate::profile::op("reshape");
        let n: usize = shape.iter().product();
        if n != self.numel() {
            return Err(Error::Shape(format!(
                "reshape: cannot view shape {:?} ({} elements) as {shape:?} ({n} elements)",
                self.shape(),
                self.numel()
            )));
        }
        let y = Tensor::from_storage(self.storage().clone(), shape.to_vec());
        let old = self.shape().to_vec();
        Ok(Tensor::record(y, "reshape", &[self], move |g| {
            Ok(vec![Some(g.reshape(&old)?)])
        }))
    }

    /// Reorders dimensions: output dimension `i` is input dimension `dims[i]`.
    pub fn permute(&self, dims: &[usize]) -> Result<Tensor> {
        let _profile = crate::profile::op("permute");
        let rank = self.rank();
        let mut seen = vec![false; rank];
        if dims.len() != rank
            || dims
                .iter()
                .any(|&d| d >= rank || std::mem::replace(&mut seen[d], true))
        {
            return Err(Error::Axis(format!(
                "permute: {dims:?} is not a permutation of the {rank} axes of shape {:?}",
                self.shape()
            )));
        }
        let strides = contiguous_strides(self.shape());
        let shape: Vec<usize> = dims.iter().map(|&d| self.shape()[d]).collect();
        let pstrides: Vec<usize> = dims.iter().map(|&d| strides[d]).collect();
        let y = Tensor::from_storage(self.storage().copy_strided(&shape, &pstrides, 0)?, shape);
        let mut inverse = vec![0; rank];
        for (i, &d) in dims.iter().enumerate() {
            inverse[d] = i;
        }
        Ok(Tensor::record(y, "permute", &[self], move |g| {
            Ok(vec![Some(g.permute(&inverse)?)])
        }))
    }

    /// Swaps two axes (negative axes count from the end).
    pub fn transpose(&self, a: isize, b: isize) -> Result<Tensor> {
        let _profile = crate::profile::op("transpose");
        let (a, b) = (
            normalize_axis(a, self.rank())?,
            normalize_axis(b, self.rank())?,
        );
        let mut dims: Vec<usize> = (0..self.rank()).collect();
        dims.swap(a, b);
        self.permute(&dims)
    }

    /// Broadcasts to `shape` (NumPy rules), materialising the copy; the gradient is summed back.
    pub fn expand(&self, shape: &[usize]) -> Result<Tensor> {
        let _profile = crate::profile::op("expand");
        if shape == self.shape() {
            return Ok(self.clone());
        }
        let strides = broadcast_strides(self.shape(), shape)?;
        let y = Tensor::from_storage(
            self.storage().copy_strided(shape, &strides, 0)?,
            shape.to_vec(),
        );
        let old = self.shape().to_vec();
        Ok(Tensor::record(y, "expand", &[self], move |g| {
            Ok(vec![Some(g.sum_to_shape(&old)?)])
        }))
    }

    /// Elements `start..end` along `axis`.
    pub fn slice(&self, axis: isize, start: usize, end: usize) -> Result<Tensor> {
        let _profile = crate::profile::op("slice");
        let a = normalize_axis(axis, self.rank())?;
        let len = self.shape()[a];
        if start > end || end > len {
            return Err(Error::Shape(format!(
                "slice {start}..{end} out of range for axis {a} of size {len} (shape {:?})",
                self.shape()
            )));
        }
        let strides = contiguous_strides(self.shape());
        let mut shape = self.shape().to_vec();
        shape[a] = end - start;
        let y = Tensor::from_storage(
            self.storage()
                .copy_strided(&shape, &strides, start * strides[a])?,
            shape,
        );
        let full = self.shape().to_vec();
        Ok(Tensor::record(y, "slice", &[self], move |g| {
            // Pad the gradient with zeros back to the full axis.
            let mut parts = Vec::new();
            let mut before = full.clone();
            before[a] = start;
            let mut after = full.clone();
            after[a] = len - end;
            parts.push(Tensor::zeros(&before, g.dtype(), g.device())?);
            parts.push(g.clone());
            parts.push(Tensor::zeros(&after, g.dtype(), g.device())?);
            Ok(vec![Some(Tensor::concat(&parts, a as isize)?)])
        }))
    }

    /// Joins tensors along `axis`; all other dimensions must agree.
    pub fn concat(tensors: &[Tensor], axis: isize) -> Result<Tensor> {
        let _profile = crate::profile::op("concat");
        let first = tensors
            .first()
            .ok_or_else(|| Error::Invalid("concat of an empty list".into()))?;
        let a = normalize_axis(axis, first.rank())?;
        for t in tensors {
            first.check_compatible(t, "concat")?;
            let same = t.rank() == first.rank()
                && t.shape()
                    .iter()
                    .zip(first.shape())
                    .enumerate()
                    .all(|(i, (x, y))| i == a || x == y);
            if !same {
                let shapes: Vec<_> = tensors.iter().map(|t| t.shape().to_vec()).collect();
                return Err(Error::Shape(format!(
                    "concat along axis {a}: shapes {shapes:?} differ off that axis"
                )));
            }
        }
        let lens: Vec<usize> = tensors.iter().map(|t| t.shape()[a]).collect();
        let outer: usize = first.shape()[..a].iter().product();
        let inner: usize = first.shape()[a + 1..].iter().product();
        let storages: Vec<&Storage> = tensors.iter().map(|t| t.storage()).collect();
        let mut shape = first.shape().to_vec();
        shape[a] = lens.iter().sum();
        let y = Tensor::from_storage(Storage::concat(&storages, &lens, outer, inner)?, shape);
        let refs: Vec<&Tensor> = tensors.iter().collect();
        Ok(Tensor::record(y, "concat", &refs, move |g| {
            let mut start = 0;
            let mut grads = Vec::new();
            for &l in &lens {
                grads.push(Some(g.slice(a as isize, start, start + l)?));
                start += l;
            }
            Ok(grads)
        }))
    }
}
