//! [`Rotary`]: rotary position embedding (RoPE; Su et al., 2021, "RoFormer: Enhanced Transformer
//! with Rotary Position Embedding"), in the half-split form transformers' Llama-style models use.
//!
//! For a head vector `x` of even width `Dh` at position `p`, with `h = Dh/2`,
//! `θ_i = theta^(−2i/Dh)` (`i < h`) and the angle of column `j` being `p·θ_(j mod h)`:
//!
//! ```text
//! rope(x)_j = x_j·cos(angle_j) + rotate_half(x)_j·sin(angle_j),   rotate_half(x) = [−x_(h..Dh) | x_(0..h)]
//! ```
//!
//! i.e. column `i` of the first half and column `i + h` of the second are rotated together by the
//! angle `p·θ_i`. The tables `cos` and `sin` `[block, Dh]` are computed once (`sin` carrying the
//! sign of `rotate_half`: −sin on the first half), and the rotation is one backend primitive
//! (`NnOps::rotary`: `src/backend/cpu/rotary.rs`, `shaders/rotary.wgsl`),
//! `y_j = x_j·cos_j + x_j'·sin_j` with `j'` the column paired with `j`. Its backward rule is the
//! transposed rotation (the rotation by the negated angle), `dx_j = g_j·cos_j + g_j'·sin_j'`: the
//! same primitive with `transpose` set. Composed from slices, a concatenation, products and a
//! sum, it took six passes each way; `tests/llama_blocks.rs` checks it against an f64 reference
//! written from the definition.
//!
//! The angles are computed as transformers does, in f32: `θ_i` rounded to f32, the product
//! `p·θ_i` in f32, its cosine and sine rounded to f32, so imported models see the same tables.
//! f16 heads (mixed precision) are rotated with these f32 tables, read where they are: the
//! tables are never rounded to f16, and the rotation costs no cast.

use crate::backend::RotaryDims;
use crate::{DType, Device, Error, Result, Tensor};

/// The rotary tables of one head width and context length.
pub struct Rotary {
    /// `cos(p·θ)` `[block, Dh]`
    cos: Tensor,
    /// `±sin(p·θ)` `[block, Dh]`, negative on the first half (the sign of `rotate_half`)
    sin_signed: Tensor,
    block: usize,
}

impl Rotary {
    /// Tables for heads of width `head_dim` (even) at positions `0..block`, base `theta`
    /// (transformers' `rope_theta`, 10 000 by default in Llama).
    ///
    /// # Errors
    /// [`Error::Invalid`] for an odd or zero `head_dim`, a zero `block`, or a `theta` that is not
    /// a finite number above 1.
    ///
    /// # Example
    /// ```
    /// use moegrad::nn::Rotary;
    /// use moegrad::{Device, Tensor};
    /// # fn main() -> moegrad::Result<()> {
    /// let rope = Rotary::new(2, 4, 10_000.0, Device::cpu())?;
    /// // one head of width 2 at positions 0 and 1: position 0 is unchanged, position 1 turns by 1 radian
    /// let x = Tensor::from_f32(vec![1.0, 0.0, 1.0, 0.0], &[1, 1, 2, 2], Device::cpu())?;
    /// let y = rope.apply(&x)?.to_vec_f32()?;
    /// assert_eq!(&y[..2], &[1.0, 0.0]);
    /// assert!((y[2] - 1f32.cos()).abs() < 1e-6 && (y[3] - 1f32.sin()).abs() < 1e-6);
    /// # Ok(()) }
    /// ```
    pub fn new(head_dim: usize, block: usize, theta: f64, device: Device) -> Result<Rotary> {
        if head_dim == 0 || !head_dim.is_multiple_of(2) || block == 0 {
            return Err(Error::Invalid(format!(
                "rotary embedding needs an even head width and a context of at least 1, got head \
                 width {head_dim} and context {block}"
            )));
        }
        if !(theta.is_finite() && theta > 1.0) {
            return Err(Error::Invalid(format!(
                "rope_theta must be a finite number above 1, got {theta}"
            )));
        }
        let half = head_dim / 2;
        // θ_i in f32, as transformers computes inv_freq
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| (1.0 / theta.powf(2.0 * i as f64 / head_dim as f64)) as f32)
            .collect();
        let mut cos = Vec::with_capacity(block * head_dim);
        let mut sin_signed = Vec::with_capacity(block * head_dim);
        for p in 0..block {
            for j in 0..head_dim {
                let angle = (p as f32 * inv_freq[j % half]) as f64;
                cos.push(angle.cos() as f32);
                let sin = angle.sin() as f32;
                sin_signed.push(if j < half { -sin } else { sin });
            }
        }
        Ok(Rotary {
            cos: Tensor::from_f32(cos, &[block, head_dim], device)?,
            sin_signed: Tensor::from_f32(sin_signed, &[block, head_dim], device)?,
            block,
        })
    }

    /// Rotates `x` `[.., T, Dh]` (positions `0..T` along the second-to-last axis, `T ≤ block`).
    ///
    /// # Errors
    /// [`Error::Shape`] for a rank below 2, another head width, or `T` beyond the tables;
    /// errors of the ops (device or dtype mismatch).
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        let dh = self.cos.shape()[1];
        let rank = x.rank();
        if rank < 2 || x.shape()[rank - 1] != dh || x.shape()[rank - 2] > self.block {
            return Err(Error::Shape(format!(
                "rotary embedding of head width {dh} over at most {} positions got {:?} \
                 (expects [.., T, {dh}])",
                self.block,
                x.shape()
            )));
        }
        let t = x.shape()[rank - 2];
        // f16 heads (mixed precision, on the GPU) read the f32 tables where they are
        let (cos, sin) = if matches!(x.dtype(), DType::F32 | DType::F16) {
            (self.cos.clone(), self.sin_signed.clone())
        } else {
            (
                self.cos.to_dtype(x.dtype())?,
                self.sin_signed.to_dtype(x.dtype())?,
            )
        };
        let dims = RotaryDims {
            batch: x.shape()[..rank - 2].iter().product(),
            seq: t,
            head_dim: dh,
            table_rows: self.block,
            transpose: false,
        };
        let _profile = crate::profile::op("rotary");
        rotate(x, cos, sin, dims)
    }
}

/// `x` rotated by the tables, recorded as one node whose backward is the transposed rotation.
fn rotate(x: &Tensor, cos: Tensor, sin: Tensor, dims: RotaryDims) -> Result<Tensor> {
    if x.numel() == 0 {
        return x.zeros_like();
    }
    let y = x.storage().rotary(cos.storage(), sin.storage(), dims)?;
    let y = Tensor::from_storage(y, x.shape().to_vec());
    Ok(Tensor::record(y, "rotary", &[x], move |g| {
        let back = RotaryDims {
            transpose: true,
            ..dims
        };
        let dx = g.storage().rotary(cos.storage(), sin.storage(), back)?;
        Ok(vec![Some(Tensor::from_storage(dx, g.shape().to_vec()))])
    }))
}
