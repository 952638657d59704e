//! Index plans for the strided kernels (`binary`, `where_cond`, `copy_strided`): the output shape
//! and each operand's strides, simplified and checked on the host before a launch.
//!
//! [`plan`] drops size-1 dimensions, merges adjacent dimensions that every operand walks
//! contiguously (so a plain contiguous op becomes rank 1), checks that every element each operand
//! addresses lies inside its buffer (a kernel must never read out of bounds) and that the result
//! fits the kernels' fixed maximum rank [`MAX_RANK`] and 32-bit indexing.

use crate::{Error, Result};

/// The largest rank the strided kernels take after simplification.
pub(crate) const MAX_RANK: usize = 8;

/// A simplified launch: the shape and, per operand, its strides (all `u32`, rank ≤ [`MAX_RANK`]).
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Plan {
    /// number of output elements
    pub n: usize,
    /// the simplified output shape
    pub shape: Vec<u32>,
    /// per operand, the strides of the simplified shape
    pub strides: Vec<Vec<u32>>,
}

impl Plan {
    /// The 4-word header `[n, rank, extra, 0]` followed by the shape and each operand's strides,
    /// each padded to [`MAX_RANK`] words: the `w` array of the kernels' params.
    pub(super) fn words(&self, extra: u32) -> Vec<u32> {
        let mut w = vec![self.n as u32, self.shape.len() as u32, extra, 0];
        let pad = |w: &mut Vec<u32>, v: &[u32]| {
            w.extend_from_slice(v);
            w.resize(w.len() + MAX_RANK - v.len(), 0);
        };
        pad(&mut w, &self.shape);
        for s in &self.strides {
            pad(&mut w, s);
        }
        w
    }
}

/// Plans a launch over `shape` with operands `(strides, offset, buffer length)`.
pub(crate) fn plan(
    what: &str,
    shape: &[usize],
    operands: &[(&[usize], usize, usize)],
) -> Result<Plan> {
    for (k, (s, _, _)) in operands.iter().enumerate() {
        if s.len() != shape.len() {
            return Err(Error::Shape(format!(
                "{what}: operand {k} has {} strides for a shape of rank {} ({shape:?})",
                s.len(),
                shape.len()
            )));
        }
    }
    let n = shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .filter(|&n| n <= u32::MAX as usize)
        .ok_or_else(|| {
            Error::Invalid(format!(
                "{what}: shape {shape:?} has more elements than the GPU kernels index (2³²)"
            ))
        })?;
    if n == 0 {
        return Ok(Plan {
            n,
            shape: Vec::new(),
            strides: vec![Vec::new(); operands.len()],
        });
    }
    for (k, &(s, offset, len)) in operands.iter().enumerate() {
        let last = shape
            .iter()
            .zip(s)
            .try_fold(offset as u128, |a, (&d, &st)| {
                Some(a + (d as u128 - 1) * st as u128)
            })
            .unwrap_or(u128::MAX);
        if last >= len as u128 {
            return Err(Error::Shape(format!(
                "{what}: operand {k} (shape {shape:?}, strides {s:?}, offset {offset}) reaches \
                 element {last}, its buffer holds {len}"
            )));
        }
    }
    // Keep the dimensions of size > 1, outermost first, merging a dimension into the one after
    // it when every operand steps over the inner one contiguously.
    let mut dims: Vec<(usize, Vec<usize>)> = Vec::new();
    for d in 0..shape.len() {
        if shape[d] == 1 {
            continue;
        }
        let st: Vec<usize> = operands.iter().map(|(s, _, _)| s[d]).collect();
        if let Some((size, prev)) = dims.last_mut()
            && prev.iter().zip(&st).all(|(&p, &c)| p == c * shape[d])
        {
            *size *= shape[d];
            *prev = st;
            continue;
        }
        dims.push((shape[d], st));
    }
    if dims.len() > MAX_RANK {
        return Err(Error::Invalid(format!(
            "{what}: shape {shape:?} with these strides needs rank {} after merging dimensions; \
             the GPU kernels take at most {MAX_RANK}",
            dims.len()
        )));
    }
    // Every stride below is at most the largest offset, which was checked to be < len ≤ u32::MAX
    // only if len fits; guard anyway.
    let to32 = |v: usize| {
        u32::try_from(v).map_err(|_| {
            Error::Invalid(format!(
                "{what}: stride {v} exceeds the GPU kernels' 32-bit indexing"
            ))
        })
    };
    let shape32 = dims
        .iter()
        .map(|(d, _)| to32(*d))
        .collect::<Result<Vec<_>>>()?;
    let mut strides = Vec::with_capacity(operands.len());
    for k in 0..operands.len() {
        strides.push(
            dims.iter()
                .map(|(_, s)| to32(s[k]))
                .collect::<Result<Vec<_>>>()?,
        );
    }
    Ok(Plan {
        n,
        shape: shape32,
        strides,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_collapses_to_rank_one() {
        let p = plan("t", &[2, 3, 4], &[(&[12, 4, 1], 0, 24), (&[0, 0, 0], 0, 1)]).unwrap();
        assert_eq!(p.shape, vec![24]);
        assert_eq!(p.strides, vec![vec![1], vec![0]]);
    }

    #[test]
    fn broadcast_row_keeps_two_dims_and_drops_ones() {
        let p = plan("t", &[5, 1, 3], &[(&[3, 3, 1], 0, 15), (&[0, 7, 1], 0, 3)]).unwrap();
        assert_eq!(p.shape, vec![5, 3]);
        assert_eq!(p.strides, vec![vec![3, 1], vec![0, 1]]);
        assert_eq!(p.words(9)[..6], [15, 2, 9, 0, 5, 3]);
    }

    #[test]
    fn out_of_bounds_and_rank_errors() {
        assert!(plan("t", &[4], &[(&[2], 0, 7)]).is_ok());
        assert!(plan("t", &[4], &[(&[2], 0, 6)]).is_err());
        assert!(plan("t", &[4], &[(&[2], 1, 7)]).is_err());
        assert!(plan("t", &[4], &[(&[1, 1], 0, 7)]).is_err());
        let shape = [2usize; 9];
        let strides: Vec<usize> = (0..9).map(|d| 1usize << (2 * (8 - d))).collect();
        assert!(plan("t", &shape, &[(&strides, 0, 1 << 20)]).is_err());
        assert_eq!(plan("t", &[0, 3], &[(&[3, 1], 0, 0)]).unwrap().n, 0);
    }
}
