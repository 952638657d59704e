//! Causal multi-head self-attention as one differentiable op, forward and backward side by side:
//!
//! * forward  `O = softmax(Q·Kᵀ/√Dh + mask)·V` per (batch, head), the mask hiding every key after
//!   its query, computed block by block with an online softmax; the row log-sum-exp
//!   `lse = ln Σ_{j ≤ i} e^{q_i·k_j/√Dh}` is kept for backward;
//! * backward  with `P = e^{Q·Kᵀ/√Dh − lse}` recomputed block by block and `D = rowsum(dO ∘ O)`:
//!   `dV = Pᵀ·dO`, `dS = P ∘ (dO·Vᵀ − D)`, `dQ = dS·K/√Dh`, `dK = dSᵀ·Q/√Dh`.
//!
//! Neither pass stores a `[B, H, T, T]` tensor: activation memory is the output and `lse`, as in
//! FlashAttention-2. Both passes are backend primitives (`NnOps::attention_forward` /
//! `attention_backward`): `src/backend/cpu/attention.rs` on the CPU, `shaders/attention.wgsl`
//! (launched by `src/backend/gpu/attention.rs`) on the GPU.

use crate::backend::{AttentionDims, PackedAttentionDims};
use crate::{Error, Result, Tensor};

impl Tensor {
    /// Causal multi-head self-attention with `self` as the queries: `self`, `k` and `v` are
    /// `[B, H, T, Dh]` (batch, heads, sequence, head dimension) and the result, also
    /// `[B, H, T, Dh]`, is `softmax(Q·Kᵀ/√Dh + M)·V` for each (batch, head), where `M` is 0 for
    /// key ≤ query and −∞ after (position `t` attends to positions `0..=t`). The scale `1/√Dh`
    /// is fixed.
    ///
    /// Forward saves the output and the `[B, H, T]` row log-sum-exp; backward recomputes the
    /// scores from them block by block, so no `[B, H, T, T]` tensor is ever stored. The backward
    /// rule is one backend kernel, not tensor ops, so it is not itself differentiable: second
    /// derivatives through this op are not available.
    ///
    /// f32 or f64 on the CPU, f32 on the GPU (where `Dh` is at most 128, the GPU kernel's
    /// `ATTENTION_MAX_HEAD_DIM`; a larger one is an error naming it). A tensor with a zero-sized dimension
    /// gives an empty result of the same shape (no kernel runs).
    ///
    /// # Errors
    /// [`Error::Shape`] unless the three tensors have one rank-4 shape; [`Error::DType`] for
    /// non-float or mixed dtypes (or f64 on the GPU); [`Error::Device`] when they live on
    /// different devices; [`Error::Invalid`] for a head dimension the GPU kernel does not take.
    ///
    /// # Example
    /// ```
    /// use moegrad::{Device, Tensor};
    /// # fn main() -> moegrad::Result<()> {
    /// // one head, two positions, Dh = 1: the first position only sees itself
    /// let q = Tensor::from_f32(vec![1.0, 1.0], &[1, 1, 2, 1], Device::cpu())?;
    /// let v = Tensor::from_f32(vec![3.0, 5.0], &[1, 1, 2, 1], Device::cpu())?;
    /// let o = q.causal_attention(&q, &v)?.to_vec_f32()?;
    /// assert_eq!(o[0], 3.0);
    /// assert!((o[1] - 4.0).abs() < 1e-6); // equal scores: the mean of 3 and 5
    /// # Ok(()) }
    /// ```
    pub fn causal_attention(&self, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        if let Some([q, k, v]) = crate::autocast::low_precision_operands([self, k, v])? {
            return q.causal_attention(&k, &v);
        }
        let _profile = crate::profile::op("causal_attention");
        const WHAT: &str = "causal_attention";
        let q = self;
        q.check_compatible(k, WHAT)?;
        q.check_compatible(v, WHAT)?;
        q.check_float(WHAT)?;
        if q.rank() != 4 || k.shape() != q.shape() || v.shape() != q.shape() {
            return Err(Error::Shape(format!(
                "{WHAT}: q {:?}, k {:?} and v {:?} must share one shape [B, H, T, Dh]",
                q.shape(),
                k.shape(),
                v.shape()
            )));
        }
        let shape = q.shape().to_vec();
        let (b, h, t, dh) = (shape[0], shape[1], shape[2], shape[3]);
        if q.numel() == 0 {
            // Nothing to attend over: an empty result, and empty gradients.
            let out = Tensor::zeros(&shape, q.dtype(), q.device())?;
            let empty = out.clone();
            return Ok(Tensor::record(out, WHAT, &[q, k, v], move |_| {
                Ok(vec![Some(empty.clone()), Some(empty.clone()), Some(empty)])
            }));
        }
        let dims = AttentionDims {
            heads: b * h,
            seq: t,
            head_dim: dh,
        };
        let (o, lse) = q
            .storage()
            .attention_forward(k.storage(), v.storage(), dims)?;
        let out = Tensor::from_storage(o, shape);
        let (qd, kd, vd, saved_out) = (q.detach(), k.detach(), v.detach(), out.clone());
        let need = [q.requires_grad(), k.requires_grad(), v.requires_grad()];
        Ok(Tensor::record(out, WHAT, &[q, k, v], move |g| {
            let (dq, dk, dv) = qd.storage().attention_backward(
                (
                    kd.storage(),
                    vd.storage(),
                    saved_out.storage(),
                    &lse,
                    g.storage(),
                ),
                dims,
            )?;
            let grads = [dq, dk, dv]
                .into_iter()
                .zip(need)
                .map(|(d, needed)| needed.then(|| Tensor::from_storage(d, qd.shape().to_vec())))
                .collect();
            Ok(grads)
        }))
    }

    /// [`Tensor::causal_attention`] of queries, keys and values packed per position in one
    /// tensor `[B, T, 3, H, Dh]` (`self[.., .., 0]` the queries, `1` the keys, `2` the values):
    /// the output of a fused `d → 3d` projection reshaped, nothing permuted. Returns
    /// `[B, T, H, Dh]`, which reshapes to `[B·T, H·Dh]` for the output projection, again
    /// without a copy.
    ///
    /// The same kernels as the unpacked op, reading q, k and v where they lie in the packed
    /// tensor (`NnOps::attention_forward_packed`: on the GPU each row is found through strides,
    /// on the CPU the three parts are gathered first) and writing `dq`, `dk` and `dv` straight
    /// into a gradient packed the same way. Cutting the parts out with `permute` and `slice`
    /// would take a copy per part each way, and three tape nodes whose backward rules pad their
    /// gradients back to the full shape; here there is one node.
    ///
    /// # Errors
    /// [`Error::Shape`] unless `self` is `[B, T, 3, H, Dh]`; otherwise those of
    /// [`Tensor::causal_attention`].
    ///
    /// # Example
    /// ```
    /// use moegrad::{Device, Tensor};
    /// # fn main() -> moegrad::Result<()> {
    /// // one head, two positions, Dh = 1: (q, k, v) = (1, 1, 3) at t = 0 and (1, 1, 5) at t = 1
    /// let qkv = Tensor::from_f32(vec![1.0, 1.0, 3.0, 1.0, 1.0, 5.0], &[1, 2, 3, 1, 1], Device::cpu())?;
    /// let o = qkv.causal_attention_packed()?;
    /// assert_eq!(o.shape(), &[1, 2, 1, 1]);
    /// let o = o.to_vec_f32()?;
    /// assert_eq!(o[0], 3.0);
    /// assert!((o[1] - 4.0).abs() < 1e-6); // equal scores: the mean of 3 and 5
    /// # Ok(()) }
    /// ```
    pub fn causal_attention_packed(&self) -> Result<Tensor> {
        if let Some([qkv]) = crate::autocast::low_precision_operands([self])? {
            return qkv.causal_attention_packed();
        }
        let _profile = crate::profile::op("causal_attention");
        const WHAT: &str = "causal_attention_packed";
        if self.rank() != 5 || self.shape()[2] != 3 {
            return Err(Error::Shape(format!(
                "{WHAT}: expects q, k, v packed as [B, T, 3, H, Dh], got {:?}",
                self.shape()
            )));
        }
        self.check_float(WHAT)?;
        let &[batch, seq, _, heads, head_dim] = self.shape() else {
            unreachable!("rank 5 was checked")
        };
        let shape = vec![batch, seq, heads, head_dim];
        let packed_shape = self.shape().to_vec();
        if self.numel() == 0 {
            let out = Tensor::zeros(&shape, self.dtype(), self.device())?;
            let empty = Tensor::zeros(&packed_shape, self.dtype(), self.device())?;
            return Ok(Tensor::record(out, WHAT, &[self], move |_| {
                Ok(vec![Some(empty.clone())])
            }));
        }
        // q, k and v are read where they lie in the packed tensor, and the gradient comes back
        // packed the same way
        let packed = self.detach();
        let dims = PackedAttentionDims {
            batch,
            heads,
            seq,
            head_dim,
        };
        let (o, lse) = packed.storage().attention_forward_packed(dims)?;
        let out = Tensor::from_storage(o, shape);
        let saved_out = out.clone();
        Ok(Tensor::record(out, WHAT, &[self], move |g| {
            let d = packed
                .storage()
                .attention_backward_packed((saved_out.storage(), &lse, g.storage()), dims)?;
            Ok(vec![Some(Tensor::from_storage(d, packed_shape.clone()))])
        }))
    }
}
