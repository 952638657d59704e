//! Dense to sparse (XMoE §3.6, Eq. 4): split a trained dense FFN into `n` small experts that
//! reproduce it exactly, so that a threshold router can later run only some of them.
//!
//! A dense FFN `x → σ(x·W1 + b1)·W2 + b2` with `W1: [d, h]`, `W2: [h, d_out]` is a sum over its
//! hidden units, so cutting the hidden layer into `n` blocks of `h/n` units gives (Eq. 4)
//!
//! ```text
//! σ(x·W1 + b1)·W2 + b2  =  Σ_i [ σ(x·W1^i + b1^i)·W2^i + b2/n ]
//! ```
//!
//! with `W1^i` the i-th block of columns of `W1` (and of `b1`) and `W2^i` the i-th block of rows
//! of `W2`; `σ` acts element-wise, so the blocks never mix. That is [`SplitScale::Sum`].
//!
//! The MoE layer weighs the experts by the router: `y = Σ_i p_i E_i(x)`. A router that starts
//! uniform (`p_i = 1/n`, e.g. a zero-initialised `threshold` router) with `t = 1` and no drops
//! then gives `(1/n)·Σ_i E_i(x)`. [`SplitScale::UniformRouter`] multiplies every expert's output
//! by `n` — `W2^i ← n·W2^i`, and each expert keeps the whole `b2` — so that this layer reproduces
//! the dense FFN exactly at the start of fine-tuning. This is our choice (the paper does not say
//! how it scales): it keeps the output right without a separate scale parameter, and `n` is a
//! power of two in practice, so the scaling is exact in floating point too.
//!
//! After fine-tuning with `t = 1` (and capacity γ ≥ n, or dropless), lowering the threshold at
//! inference (`eval_t`) runs fewer experts per token.

use super::ExpertBank;
use crate::nn::{Activation, Param};
use crate::{Error, Result, Tensor};

/// How the split experts' outputs are scaled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SplitScale {
    /// `Σ_i E_i(x)` equals the dense FFN (XMoE Eq. 4 as written; `b2` split evenly)
    Sum,
    /// `(1/n)·Σ_i E_i(x)` equals the dense FFN: the layer's output under a uniform router with
    /// every expert kept (`W2^i` scaled by `n`, each expert keeps all of `b2`)
    UniformRouter,
}

/// A dense two-layer FFN `x → act(x·W1 + b1)·W2 + b2`, borrowed for splitting.
#[derive(Clone, Copy, Debug)]
pub struct DenseFfn<'a> {
    /// `[d, h]`
    pub w1: &'a Tensor,
    /// `[h]` (None: no hidden bias)
    pub b1: Option<&'a Tensor>,
    /// `[h, d_out]`
    pub w2: &'a Tensor,
    /// `[d_out]` (None: no output bias)
    pub b2: Option<&'a Tensor>,
    /// the element-wise activation
    pub activation: Activation,
}

/// Splits `ffn` into `experts` experts of hidden width `h / experts` (XMoE Eq. 4), scaled as
/// `scale` says. The bank's parameters are fresh leaves with the dtype and device of `ffn`.
///
/// # Errors
/// When `experts` is 0 or does not divide `h`, or when the shapes do not chain.
///
/// # Example
/// ```
/// use moegrad::moe::{DenseFfn, SplitScale, decompose_ffn};
/// use moegrad::nn::Activation;
/// use moegrad::{DType, Device, Tensor};
/// let dev = Device::cpu();
/// let w1 = Tensor::rand_uniform(&[3, 8], 1, DType::F64, dev).unwrap();
/// let w2 = Tensor::rand_uniform(&[8, 2], 2, DType::F64, dev).unwrap();
/// let ffn = DenseFfn { w1: &w1, b1: None, w2: &w2, b2: None, activation: Activation::Relu };
/// let bank = decompose_ffn(&ffn, 4, SplitScale::Sum).unwrap();
/// assert_eq!(bank.w1.get().shape(), &[4, 3, 2]);
/// ```
pub fn decompose_ffn(
    ffn: &DenseFfn,
    experts: usize,
    scale: SplitScale,
) -> Result<super::ExpertBank> {
    let (w1, w2) = (ffn.w1, ffn.w2);
    if w1.rank() != 2 || w2.rank() != 2 || w1.shape()[1] != w2.shape()[0] {
        return Err(Error::Shape(format!(
            "decompose_ffn: W1 [d, h] and W2 [h, d_out] must chain, got {:?} and {:?}",
            w1.shape(),
            w2.shape()
        )));
    }
    let (d, h, d_out) = (w1.shape()[0], w1.shape()[1], w2.shape()[1]);
    if experts == 0 || h % experts != 0 {
        return Err(Error::Invalid(format!(
            "decompose_ffn: {experts} experts must divide the hidden width {h}"
        )));
    }
    let check = |name: &str, b: Option<&Tensor>, len: usize| match b {
        Some(b) if b.shape() != [len] => Err(Error::Shape(format!(
            "decompose_ffn: {name} must be [{len}], got {:?}",
            b.shape()
        ))),
        _ => Ok(()),
    };
    check("b1", ffn.b1, h)?;
    check("b2", ffn.b2, d_out)?;
    let (n, hn) = (experts, h / experts);
    let out_scale = match scale {
        SplitScale::Sum => 1.0,
        SplitScale::UniformRouter => n as f64,
    };
    let _guard = crate::NoGradGuard::new();
    // Column block i of W1: [d, h] → [d, n, h/n] → [n, d, h/n].
    let w1s = w1.detach().reshape(&[d, n, hn])?.permute(&[1, 0, 2])?;
    // Row block i of W2: [h, d_out] → [n, h/n, d_out] (the blocks are already contiguous).
    let w2s = w2
        .detach()
        .reshape(&[n, hn, d_out])?
        .mul_scalar(out_scale)?;
    let b1s = ffn.b1.map(|b| b.detach().reshape(&[n, hn])).transpose()?;
    // Each expert's output bias is (out_scale/n)·b2: Σ_i p_i (out_scale/n) b2 = b2 under the
    // split's own weighting (all ones for Sum, 1/n for UniformRouter).
    let b2s = ffn
        .b2
        .map(|b| {
            b.detach()
                .reshape(&[1, d_out])?
                .expand(&[n, d_out])?
                .mul_scalar(out_scale / n as f64)
        })
        .transpose()?;
    Ok(ExpertBank {
        w1: Param::new(w1s)?,
        b1: b1s.map(Param::new).transpose()?,
        w2: Param::new(w2s)?,
        b2: b2s.map(Param::new).transpose()?,
        activation: ffn.activation,
    })
}
