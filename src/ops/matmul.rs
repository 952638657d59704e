//! Matrix products: 2-D `[m,k]·[k,n]` and batched `[..., m, k]·[..., k, n]` (a 2-D operand is
//! shared across the other's batch). The backward passes `dA = dC·Bᵀ` and `dB = Aᵀ·dC` reuse the
//! same kernel with swapped strides instead of copying a transpose, each gradient in its
//! operand's dtype (in mixed precision an f32 B's gradient comes from f16 A and dC, summed and
//! stored in f32).

use crate::backend::{MatLayout, MatmulDims};
use crate::{DType, Error, Result, Tensor};

/// Layout of a contiguous `[batch, rows, cols]` operand, optionally read transposed.
pub(crate) fn layout(rows: usize, cols: usize, batched: bool, transposed: bool) -> MatLayout {
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

/// A product [`Tensor::matmul_raw`] will compute: `op(a)·op(b)` over `batch` matrices, output
/// `out_shape` of dtype `out`, plus `pending` (of that shape and dtype) where given: the
/// gradient the product's tensor already has, added by the product's kernel.
struct RawProduct<'a> {
    a: RawOperand<'a>,
    b: RawOperand<'a>,
    batch: usize,
    out_shape: Vec<usize>,
    out: DType,
    pending: Option<&'a Tensor>,
}

impl RawProduct<'_> {
    /// The operands' layouts and the product's sizes.
    fn layouts(&self) -> (MatLayout, MatLayout, MatmulDims) {
        let (a, b) = (self.a, self.b);
        let (ra, ca) = (a.t.shape()[a.t.rank() - 2], a.t.shape()[a.t.rank() - 1]);
        let (rb, cb) = (b.t.shape()[b.t.rank() - 2], b.t.shape()[b.t.rank() - 1]);
        let (m, k) = if a.transposed { (ca, ra) } else { (ra, ca) };
        let n = if b.transposed { rb } else { cb };
        let dims = MatmulDims {
            batch: self.batch,
            m,
            k,
            n,
        };
        (
            layout(ra, ca, a.batched, a.transposed),
            layout(rb, cb, b.batched, b.transposed),
            dims,
        )
    }
}

impl Tensor {
    /// Raw product `op(a)·op(b)` of `batch` matrices with explicit transposes (see
    /// [`RawOperand`]), output `out_shape`.
    fn matmul_raw(p: RawProduct<'_>) -> Result<Tensor> {
        Tensor::matmul_raw_bias(p, None)
    }

    /// [`Tensor::matmul_raw`] with `bias` (`[n]`, of B's dtype) added to every output row by
    /// the product's own kernel, then its `pending` (where given) added to the rounded result.
    fn matmul_raw_bias(p: RawProduct<'_>, bias: Option<&Tensor>) -> Result<Tensor> {
        let (la, lb, dims) = p.layouts();
        let (a, b) = (p.a.t.storage(), p.b.t.storage());
        let bias = bias.map(|t| t.storage());
        let out = match p.pending {
            Some(pending) => a.matmul_plus(la, (b, lb), bias, dims, p.out, pending.storage())?,
            None => a.matmul(la, (b, lb), bias, dims, p.out)?,
        };
        Ok(Tensor::from_storage(out, p.out_shape))
    }

    /// Two independent raw products at once (see `MatmulOps::matmul_pair`: the CPU runs them
    /// side by side); only the first may have a pending gradient.
    fn matmul_raw_pair(p: RawProduct<'_>, q: RawProduct<'_>) -> Result<(Tensor, Tensor)> {
        if q.pending.is_some() {
            return Err(Error::Invalid(
                "matmul: only the first product of a pair takes a pending gradient".into(),
            ));
        }
        let ((la, lb, dp), (lc, ld, dq)) = (p.layouts(), q.layouts());
        let pending = p.pending.map(|t| t.storage());
        let (x, y) = p.a.t.storage().matmul_pair(
            (la, p.b.t.storage(), lb, dp, p.out, pending),
            (q.a.t.storage(), lc, q.b.t.storage(), ld, dq, q.out),
        )?;
        Ok((
            Tensor::from_storage(x, p.out_shape),
            Tensor::from_storage(y, q.out_shape),
        ))
    }

    /// The gradient products a backward rule asks for: both at once (side by side, see
    /// [`Tensor::matmul_raw_pair`]) when it needs both, else the one it needs.
    fn matmul_raw_grads(
        ga: Option<RawProduct<'_>>,
        gb: Option<RawProduct<'_>>,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        Ok(match (ga, gb) {
            (Some(p), Some(q)) => {
                let (x, y) = Tensor::matmul_raw_pair(p, q)?;
                (Some(x), Some(y))
            }
            (p, q) => (
                p.map(Tensor::matmul_raw).transpose()?,
                q.map(Tensor::matmul_raw).transpose()?,
            ),
        })
    }

    /// Matrix product. 2-D × 2-D, or batched: both operands `[..., m, k]` and `[..., k, n]` with
    /// equal batch dimensions, or one of them 2-D (shared by every batch entry). Inside
    /// [`crate::autocast_f16`] an f32 GPU `self` is cast to f16 and an f32 `other` (a weight) is
    /// read in f32 where it is, giving an f16 product and an f32 gradient for `other`. Inside
    /// [`crate::full_precision`] (a router's scope) an f16 GPU `self` times a 2-D f32 `other`
    /// is read where it is into an f32 product, with the bits of `self` cast to f32 first, and
    /// `self` gets an f16 gradient, the f32 one rounded once.
    ///
    /// # Example
    /// ```
    /// use moegrad::{Device, Tensor};
    /// let a = Tensor::from_f32(vec![1.0, 2.0, 3.0, 4.0], &[2, 2], Device::cpu()).unwrap();
    /// let i = Tensor::from_f32(vec![1.0, 0.0, 0.0, 1.0], &[2, 2], Device::cpu()).unwrap();
    /// assert_eq!(a.matmul(&i).unwrap().to_vec_f32().unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
    /// ```
    pub fn matmul(&self, other: &Tensor) -> Result<Tensor> {
        self.product(other, None, None)
    }

    /// `self·otherᵀ` for a 2-D `other` `[n, k]` and `self` `[..., m, k]`: `[..., m, n]`, with
    /// `other` read transposed where it lies (the kernels take strides), where
    /// `self.matmul(&other.transpose(0, 1)?)` would copy it first and copy its gradient back:
    /// a tied output head, `h·Eᵀ` with E the token embedding, needs no transpose either way.
    /// Inside [`crate::autocast_f16`] it behaves as [`Tensor::matmul`] (an f32 `other` is read in
    /// f32 and gets an f32 gradient).
    ///
    /// # Errors
    /// [`Error::Shape`] unless `other` is 2-D and `self` has rank ≥ 2 with the same last
    /// dimension; those of [`Tensor::matmul`] for dtypes and devices.
    ///
    /// # Example
    /// ```
    /// use moegrad::{Device, Tensor};
    /// # fn main() -> moegrad::Result<()> {
    /// let h = Tensor::from_f32(vec![1.0, 2.0], &[1, 2], Device::cpu())?;
    /// let e = Tensor::from_f32(vec![1.0, 0.0, 0.0, 1.0, 1.0, 1.0], &[3, 2], Device::cpu())?;
    /// assert_eq!(h.matmul_t(&e)?.to_vec_f32()?, vec![1.0, 2.0, 3.0]);
    /// # Ok(()) }
    /// ```
    pub fn matmul_t(&self, other: &Tensor) -> Result<Tensor> {
        if let Some([a]) = crate::autocast::low_precision_operands([self])? {
            return a.matmul_t(other);
        }
        let _profile = crate::profile::op("matmul");
        if !crate::autocast::reads_f32_weight(self, other) {
            self.check_compatible(other, "matmul_t")?;
        }
        self.check_float("matmul_t")?;
        let (a, b) = (self, other);
        if a.rank() < 2 || b.rank() != 2 || a.shape()[a.rank() - 1] != b.shape()[1] {
            return Err(Error::Shape(format!(
                "matmul_t: needs [..., m, k] and a 2-D [n, k], got {:?} and {:?}",
                a.shape(),
                b.shape()
            )));
        }
        let (m, k, n) = (a.shape()[a.rank() - 2], b.shape()[1], b.shape()[0]);
        let batch_dims = &a.shape()[..a.rank() - 2];
        let batch: usize = batch_dims.iter().product();
        let mut out_shape = batch_dims.to_vec();
        out_shape.extend([m, n]);
        let y = Tensor::matmul_raw(RawProduct {
            a: RawOperand::plain(a, !batch_dims.is_empty()),
            b: RawOperand::transposed(b, false),
            batch,
            out_shape,
            out: a.dtype(),
            pending: None,
        })?;
        let (ad, bd) = (a.detach(), b.detach());
        let (need_a, need_b) = (a.requires_grad(), b.requires_grad());
        Ok(Tensor::record(y, "matmul_t", &[a, b], move |g| {
            // dA = g·B ([.., m, n]·[n, k]); dB = gᵀ·A over every row of the batch ([n, k])
            let (a2, g2) = (ad.reshape(&[batch * m, k])?, g.reshape(&[batch * m, n])?);
            let ga = need_a.then(|| RawProduct {
                a: RawOperand::plain(&g2, false),
                b: RawOperand::plain(&bd, false),
                batch: 1,
                out_shape: ad.shape().to_vec(),
                out: ad.dtype(),
                pending: None,
            });
            let gb = need_b.then(|| RawProduct {
                a: RawOperand::transposed(&g2, false),
                b: RawOperand::plain(&a2, false),
                batch: 1,
                out_shape: vec![n, k],
                out: bd.dtype(),
                pending: None,
            });
            let (ga, gb) = Tensor::matmul_raw_grads(ga, gb)?;
            Ok(vec![ga, gb])
        }))
    }

    /// `self·w + bias`, the linear layer's forward, in one kernel: [`Tensor::matmul`] with
    /// `bias` (`[n]`, `n` the last dimension of `w`) added to every output row after the
    /// product's sum and before its rounding to the output dtype, without a second pass over
    /// the output (one dispatch fewer per layer on the GPU). On the CPU and in the GPU's
    /// unsplit kernels it gives the bits of `self.matmul(w)?.add(bias)` in f32 and f64; where
    /// the GPU splits a long reduction into partial sums (split-k), the bias joins the first
    /// of them, which can move the last bit; in f16 the sum is rounded once instead of twice.
    /// The backward rule is the matmul's for `self` and `w` and the sum of the upstream
    /// gradient over every row for `bias`.
    ///
    /// Inside [`crate::autocast_f16`] the bias stays in the weight's dtype (an f32 weight and
    /// bias are read in f32 where they are). A bias of another dtype than `w` is cast to it.
    ///
    /// # Errors
    /// Those of [`Tensor::matmul`], and [`Error::Shape`] unless `bias` is `[n]`.
    ///
    /// # Example
    /// ```
    /// use moegrad::{Device, Tensor};
    /// # fn main() -> moegrad::Result<()> {
    /// let x = Tensor::from_f32(vec![1.0, 2.0, 3.0, 4.0], &[2, 2], Device::cpu())?;
    /// let w = Tensor::from_f32(vec![1.0, 0.0, 0.0, 1.0], &[2, 2], Device::cpu())?;
    /// let b = Tensor::from_f32(vec![10.0, 20.0], &[2], Device::cpu())?;
    /// assert_eq!(x.matmul_bias(&w, &b)?.to_vec_f32()?, vec![11.0, 22.0, 13.0, 24.0]);
    /// # Ok(()) }
    /// ```
    pub fn matmul_bias(&self, w: &Tensor, bias: &Tensor) -> Result<Tensor> {
        let n = w.shape().last().copied().unwrap_or(0);
        if w.rank() < 2 || bias.shape() != [n] {
            return Err(Error::Shape(format!(
                "matmul_bias: the bias must be [n] for a weight [..., k, n], got bias {:?} and \
                 weight {:?}",
                bias.shape(),
                w.shape()
            )));
        }
        if bias.dtype() != w.dtype() {
            return self.matmul_bias(w, &bias.to_dtype(w.dtype())?);
        }
        self.product(w, Some(bias), None)
    }

    /// `addend + (self·w + bias)`, a transformer block's last projection added to its residual
    /// stream, with the bits of `addend.add(&self.matmul_bias(w, bias)?)` (or, without a bias,
    /// of `addend.add(&self.matmul(w)?)`) and the gradients of that composition (`addend`'s is
    /// the upstream gradient itself). Where `addend` has the product's shape and dtype, the
    /// product's own kernel adds it after rounding its output (on the GPU: no add launch and
    /// no second pass over the output; a product split along k adds it in the pass that sums
    /// the slices); otherwise, e.g. an `addend` that broadcasts, the add runs on its own.
    ///
    /// # Errors
    /// Those of [`Tensor::matmul_bias`] (or [`Tensor::matmul`]) and of [`Tensor::add`].
    ///
    /// # Example
    /// ```
    /// use moegrad::{Device, Tensor};
    /// # fn main() -> moegrad::Result<()> {
    /// let x = Tensor::from_f32(vec![1.0, 2.0, 3.0, 4.0], &[2, 2], Device::cpu())?;
    /// let w = Tensor::from_f32(vec![1.0, 0.0, 0.0, 1.0], &[2, 2], Device::cpu())?;
    /// let b = Tensor::from_f32(vec![10.0, 20.0], &[2], Device::cpu())?;
    /// let h = Tensor::from_f32(vec![0.5; 4], &[2, 2], Device::cpu())?;
    /// assert_eq!(x.matmul_add(&w, Some(&b), &h)?.to_vec_f32()?, vec![11.5, 22.5, 13.5, 24.5]);
    /// # Ok(()) }
    /// ```
    pub fn matmul_add(&self, w: &Tensor, bias: Option<&Tensor>, addend: &Tensor) -> Result<Tensor> {
        match bias {
            Some(bias) => {
                let n = w.shape().last().copied().unwrap_or(0);
                if w.rank() < 2 || bias.shape() != [n] {
                    // matmul_bias names the shapes
                    return addend.add(&self.matmul_bias(w, bias)?);
                }
                if bias.dtype() != w.dtype() {
                    return self.matmul_add(w, Some(&bias.to_dtype(w.dtype())?), addend);
                }
                self.product(w, Some(bias), Some(addend))
            }
            None => self.product(w, None, Some(addend)),
        }
    }

    /// [`Tensor::matmul`], [`Tensor::matmul_bias`] with `bias` (`[n]`, `other`'s dtype, checked
    /// by the caller) and [`Tensor::matmul_add`] with `addend`.
    fn product(
        &self,
        other: &Tensor,
        bias: Option<&Tensor>,
        addend: Option<&Tensor>,
    ) -> Result<Tensor> {
        // mixed precision: A (the activation) in f16; B as it is, f16 or an f32 weight
        if let Some([a]) = crate::autocast::low_precision_operands([self])? {
            return a.product(other, bias, addend);
        }
        let _profile = crate::profile::op("matmul");
        if let Some(bias) = bias {
            other.check_compatible(bias, "matmul_bias")?;
        }
        // in a router's f32 scope, f16 tokens times a 2-D f32 weight: an f32 product read
        // from the f16 tokens where they are (`autocast::reads_f16_activation`)
        let f16_into_f32 = other.rank() == 2 && crate::autocast::reads_f16_activation(self, other);
        if !f16_into_f32 && !crate::autocast::reads_f32_weight(self, other) {
            self.check_compatible(other, "matmul")?;
        }
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
        if let (Some(bias), 0) = (bias, k) {
            // no product to add the bias to in a kernel: the bias alone, broadcast
            let y = a.product(b, None, None)?.add(bias)?;
            return match addend {
                Some(r) => r.add(&y),
                None => Ok(y),
            };
        }
        let out = if f16_into_f32 { DType::F32 } else { a.dtype() };
        // the kernel adds an addend of the output's own shape, dtype and device; any other
        // goes through the add (which broadcasts, promotes or names the mismatch)
        let addend = match addend {
            Some(r) if r.shape() != out_shape || r.dtype() != out || r.device() != a.device() => {
                return r.add(&a.product(b, bias, None)?);
            }
            r => r,
        };
        let y = Tensor::matmul_raw_bias(
            RawProduct {
                a: RawOperand::plain(a, a_b),
                b: RawOperand::plain(b, b_b),
                batch,
                out_shape,
                out,
                pending: addend,
            },
            bias,
        )?;
        let (ad, bd) = (a.detach(), b.detach());
        let (need_a, need_b) = (a.requires_grad(), b.requires_grad());
        // the bias's gradient: the upstream gradient summed over every row, in the bias's dtype
        let bias_grad = bias.map(|t| (t.dtype(), t.requires_grad()));
        // the addend's gradient is the upstream gradient itself
        let addend_grad = addend.map(|t| t.requires_grad());
        let inputs: Vec<&Tensor> = [Some(a), Some(b), bias, addend]
            .into_iter()
            .flatten()
            .collect();
        // A's gradient from its other consumers (a router's tokens also feed the experts, a
        // norm's output several projections) is added by the product that gives dA, in its
        // own pass (a folding rule, see `MatmulOps::matmul_plus`); otherwise by an add
        Ok(Tensor::record_folding(
            y,
            "matmul",
            &inputs,
            0,
            move |g, pending| {
                // dA = g·Bᵀ, dB = Aᵀ·g; a shared (2-D) operand sums its gradient over the batch.
                // Only the gradients someone needs are computed; both at once when both are.
                // A shared B with A batched: A's batch stacked into rows, one GEMM of
                // k×(batch·m)·(batch·m)×n.
                let fold = pending.as_ref().filter(|p| {
                    (a_b || batch == 1)
                        && p.shape() == ad.shape()
                        && p.dtype() == ad.dtype()
                        && p.device() == ad.device()
                });
                let stacked = if need_b && !(b_b || batch == 1) {
                    Some((ad.reshape(&[batch * m, k])?, g.reshape(&[batch * m, n])?))
                } else {
                    None
                };
                let ga = need_a.then(|| RawProduct {
                    a: RawOperand::plain(g, true),
                    b: RawOperand::transposed(&bd, b_b),
                    batch,
                    out_shape: if a_b || batch == 1 {
                        ad.shape().to_vec()
                    } else {
                        vec![batch, m, k]
                    },
                    out: ad.dtype(),
                    pending: fold,
                });
                let gb = need_b.then(|| match &stacked {
                    Some((a2, g2)) => RawProduct {
                        a: RawOperand::transposed(a2, false),
                        b: RawOperand::plain(g2, false),
                        batch: 1,
                        out_shape: vec![k, n],
                        out: bd.dtype(),
                        pending: None,
                    },
                    None => RawProduct {
                        a: RawOperand::transposed(&ad, a_b),
                        b: RawOperand::plain(g, true),
                        batch,
                        out_shape: bd.shape().to_vec(),
                        out: bd.dtype(),
                        pending: None,
                    },
                });
                let (ga, gb) = Tensor::matmul_raw_grads(ga, gb)?;
                let ga = match ga {
                    Some(x) if !(a_b || batch == 1) => {
                        Some(x.sum(&[0], false)?.reshape(ad.shape())?)
                    }
                    x => x.map(|x| x.reshape(ad.shape())).transpose()?,
                };
                let ga = match (fold, &pending, ga) {
                    (None, Some(p), Some(x)) => Some(p.add(&x)?),
                    (_, _, x) => x,
                };
                let gb = gb.map(|x| x.reshape(bd.shape())).transpose()?;
                let mut grads = vec![ga, gb];
                if let Some((dtype, needed)) = bias_grad {
                    let db = needed
                        .then(|| {
                            let rows = g.numel() / n;
                            g.reshape(&[rows, n])?.sum_as(&[0], false, dtype)
                        })
                        .transpose()?;
                    grads.push(db);
                }
                if let Some(needed) = addend_grad {
                    grads.push(needed.then(|| g.clone()));
                }
                Ok(grads)
            },
        ))
    }
}
