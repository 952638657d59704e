//! Shape arithmetic shared by every op: broadcasting, strides, axis normalisation.
//!
//! Tensors in moegrad are always contiguous and row-major; a view (transpose, expand, slice) is
//! described here by strides and materialised by the backend's `copy_strided`.

use crate::backend::AxisView;
use crate::{Error, Result};

/// Row-major strides of a contiguous tensor of `shape`.
pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![0; shape.len()];
    let mut acc = 1;
    for d in (0..shape.len()).rev() {
        strides[d] = acc;
        acc *= shape[d];
    }
    strides
}

/// The shape two operands broadcast to (NumPy rules: align on the right; sizes equal or one of them 1).
pub fn broadcast_shapes(a: &[usize], b: &[usize]) -> Result<Vec<usize>> {
    let rank = a.len().max(b.len());
    let mut out = vec![0; rank];
    for i in 0..rank {
        let da = if i < rank - a.len() {
            1
        } else {
            a[i - (rank - a.len())]
        };
        let db = if i < rank - b.len() {
            1
        } else {
            b[i - (rank - b.len())]
        };
        out[i] = if da == db || db == 1 {
            da
        } else if da == 1 {
            db
        } else {
            return Err(Error::Shape(format!(
                "shapes {a:?} and {b:?} cannot be broadcast together"
            )));
        };
    }
    Ok(out)
}

/// Strides that read a contiguous tensor of `src` shape as if it had `out` shape (stride 0 on
/// broadcast dimensions). `src` must broadcast to `out`.
pub fn broadcast_strides(src: &[usize], out: &[usize]) -> Result<Vec<usize>> {
    if src.len() > out.len() {
        return Err(Error::Shape(format!(
            "cannot broadcast shape {src:?} to {out:?}"
        )));
    }
    let base = contiguous_strides(src);
    let lead = out.len() - src.len();
    let mut strides = vec![0; out.len()];
    for (i, &d) in src.iter().enumerate() {
        if d == out[lead + i] {
            strides[lead + i] = if d == 1 { 0 } else { base[i] };
        } else if d != 1 {
            return Err(Error::Shape(format!(
                "cannot broadcast shape {src:?} to {out:?}"
            )));
        }
    }
    Ok(strides)
}

/// Turns a possibly negative axis into an index in `0..rank`.
pub fn normalize_axis(axis: isize, rank: usize) -> Result<usize> {
    let r = rank as isize;
    let a = if axis < 0 { axis + r } else { axis };
    if a < 0 || a >= r {
        Err(Error::Axis(format!(
            "axis {axis} is out of range for a tensor of rank {rank}"
        )))
    } else {
        Ok(a as usize)
    }
}

/// The `[outer, len, inner]` view of `shape` around `axis`.
pub fn axis_view(shape: &[usize], axis: usize) -> AxisView {
    AxisView {
        outer: shape[..axis].iter().product(),
        len: shape[axis],
        inner: shape[axis + 1..].iter().product(),
    }
}

/// Number of elements of a shape.
pub fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}
