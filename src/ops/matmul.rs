//! Matrix products: 2-D `[m,k]·[k,n]` and batched `[..., m, k]·[..., k, n]` (a 2-D operand is
//! shared across the other's batch). The backward passes `dA = dC·Bᵀ` and `dB = Aᵀ·dC` reuse the
//! same kernel with swapped strides instead of copying a transpose.

use crate::backend::{MatLayout, MatmulDims};
use crate::{Error, Result, Tensor};

/// Layout of a contiguous `[batch, rows, cols]` operand, optionally read transposed.
fn layout(rows: usize, cols: usize, batched: bool, transposed: bool) -> MatLayout {
    let (row_stride, col_stride) = if transposed { (1, cols) } else { (cols, 1) };
    MatLayout {
        offset: 0,
        batch_stride: if batched { rows * cols } else { 0 },
        row_stride,
        col_stride,
    }
}

/// One operand of [`Tensor::matmul_raw`]: a contiguous `[.., rows, cols]` tensor, read as it is
/// or transposed, with a matrix per batch entry (`batched`) or one shared by all.
#[derive(Clone, Copy)]
struct RawOperand<'a> {
    t: &'a Tensor,
    transposed: bool,
    batched: bool,
}

impl<'a> RawOperand<'a> {
    /// `t` read as it is.
    fn plain(t: &'a Tensor, batched: bool) -> RawOperand<'a> {
        RawOperand {
            t,
            transposed: false,
            batched,
        }
    }

    /// `t` read transposed (its last two axes swapped).
    fn transposed(t: &'a Tensor, batched: bool) -> RawOperand<'a> {
        RawOperand {
            t,
            transposed: true,
            batched,
        }
    }
}

impl Tensor {
    /// Raw product `op(a)·op(b)` of `batch` matrices with explicit transposes (see
    /// [`RawOperand`]), output `out_shape`.
    fn matmul_raw(
        a: RawOperand<'_>,
        b: RawOperand<'_>,
        batch: usize,
        out_shape: Vec<usize>,
    ) -> Result<Tensor> {
        let RawOperand {
            t: a,
            transposed: ta,
            batched: a_batched,
        } = a;
        let RawOperand {
            t: b,
            transposed: tb,
            batched: b_batched,
        } = b;
        let (ra, ca) = (a.shape()[a.rank() - 2], a.shape()[a.rank() - 1]);
        let (rb, cb) = (b.shape()[b.rank() - 2], b.shape()[b.rank() - 1]);
        let (m, k) = if ta { (ca, ra) } else { (ra, ca) };
        let n = if tb { rb } else { cb };
        let dims = MatmulDims { batch, m, k, n };
        let out = a.storage().matmul(
            layout(ra, ca, a_batched, ta),
            b.storage(),
            layout(rb, cb, b_batched, tb),
            dims,
        )?;
        Ok(Tensor::from_storage(out, out_shape))
    }

    /// Matrix product. 2-D × 2-D, or batched: both operands `[..., m, k]` and `[..., k, n]` with
    /// equal batch dimensions, or one of them 2-D (shared by every batch entry).
    ///
    /// # Example
    /// ```
    /// use moegrad::{Device, Tensor};
    /// let a = Tensor::from_f32(vec![1.0, 2.0, 3.0, 4.0], &[2, 2], Device::cpu()).unwrap();
    /// let i = Tensor::from_f32(vec![1.0, 0.0, 0.0, 1.0], &[2, 2], Device::cpu()).unwrap();
    /// assert_eq!(a.matmul(&i).unwrap().to_vec_f32().unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
    /// ```
    pub fn matmul(&self, other: &Tensor) -> Result<Tensor> {
        if let Some([a, b]) = crate::autocast::low_precision_operands([self, other])? {
            return a.matmul(&b);
        }
        let _profile = crate::profile::op("matmul");
        self.check_compatible(other, "matmul")?;
        self.check_float("matmul")?;
        let (a, b) = (self, other);
        if a.rank() < 2 || b.rank() < 2 {
            return Err(Error::Shape(format!(
                "matmul needs operands of rank >= 2, got {:?} and {:?}",
                a.shape(),
                b.shape()
            )));
        }
        let (m, k) = (a.shape()[a.rank() - 2], a.shape()[a.rank() - 1]);
        let (k2, n) = (b.shape()[b.rank() - 2], b.shape()[b.rank() - 1]);
        let (a_batch, b_batch) = (&a.shape()[..a.rank() - 2], &b.shape()[..b.rank() - 2]);
        let batch_dims = if a_batch == b_batch || b_batch.is_empty() {
            a_batch
        } else if a_batch.is_empty() {
            b_batch
        } else {
            &[usize::MAX][..]
        };
        if k != k2 || batch_dims == [usize::MAX] {
            return Err(Error::Shape(format!(
                "matmul: shapes {:?} and {:?} do not align (need [..., m, k]·[..., k, n] with equal batch dims or a 2-D operand)",
                a.shape(),
                b.shape()
            )));
        }
        let batch: usize = batch_dims.iter().product();
        let (a_b, b_b) = (!a_batch.is_empty(), !b_batch.is_empty());
        let mut out_shape = batch_dims.to_vec();
        out_shape.extend([m, n]);
        let y = Tensor::matmul_raw(
            RawOperand::plain(a, a_b),
            RawOperand::plain(b, b_b),
            batch,
            out_shape,
        )?;
        let (ad, bd) = (a.detach(), b.detach());
        let (need_a, need_b) = (a.requires_grad(), b.requires_grad());
        Ok(Tensor::record(y, "matmul", &[a, b], move |g| {
            // dA = g·Bᵀ, dB = Aᵀ·g; a shared (2-D) operand sums its gradient over the batch.
            // Only the gradients someone needs are computed.
            let ga = if !need_a {
                None
            } else if a_b || batch == 1 {
                let ga = Tensor::matmul_raw(
                    RawOperand::plain(g, true),
                    RawOperand::transposed(&bd, b_b),
                    batch,
                    ad.shape().to_vec(),
                )?;
                Some(ga.reshape(ad.shape())?)
            } else {
                let per = Tensor::matmul_raw(
                    RawOperand::plain(g, true),
                    RawOperand::transposed(&bd, b_b),
                    batch,
                    vec![batch, m, k],
                )?;
                Some(per.sum(&[0], false)?.reshape(ad.shape())?)
            };
            let gb = if !need_b {
                None
            } else if b_b || batch == 1 {
                let gb = Tensor::matmul_raw(
                    RawOperand::transposed(&ad, a_b),
                    RawOperand::plain(g, true),
                    batch,
                    bd.shape().to_vec(),
                )?;
                Some(gb.reshape(bd.shape())?)
            } else {
                // B shared and A batched: stack the batch into rows, one GEMM of k×(batch·m)·(batch·m)×n.
                let a2 = ad.reshape(&[batch * m, k])?;
                let g2 = g.reshape(&[batch * m, n])?;
                let gb = Tensor::matmul_raw(
                    RawOperand::transposed(&a2, false),
                    RawOperand::plain(&g2, false),
                    1,
                    vec![k, n],
                )?;
                Some(gb.reshape(bd.shape())?)
            };
            Ok(vec![ga, gb])
        }))
    }
}
