//! The gated linear unit of Llama-style feed-forward blocks, composed from existing ops:
//!
//! ```text
//! swiglu([a | b]) = silu(a) ⊙ b        a, b: the two halves of the last axis, [.., h] each
//! ```
//!
//! (Shazeer, 2020, "GLU Variants Improve Transformer"). A SwiGLU MLP `down(silu(gate·x) ⊙ up·x)`
//! computes `gate·x` and `up·x` with one matmul against the weights side by side (`[d, 2h]`,
//! gate first, as transformers v5 stores `gate_up_proj`) and then this op.
//!
//! The forward pass runs the ops untracked and keeps `b`, `silu(a)` and the slope `silu'(a)`;
//! the tape holds one node whose backward is the chain rule through them,
//!
//! ```text
//! d[a | b] = [g ⊙ b ⊙ silu'(a) | g ⊙ silu(a)]
//! ```
//!
//! one concatenation instead of the two zero-padded slice gradients, the product's two sides and
//! `silu`'s own backward (five nodes, each a pass over `[.., h]` or `[.., 2h]`).

use crate::{Error, Result, Tensor};

impl Tensor {
    /// `silu(a) ⊙ b` for the halves `a = self[.., :h]`, `b = self[.., h:]` of the last axis
    /// (`[.., 2h]` → `[.., h]`).
    ///
    /// # Errors
    /// [`Error::Shape`] when the last axis is missing or odd; errors of the ops.
    ///
    /// # Example
    /// ```
    /// use moegrad::{Device, Tensor};
    /// # fn main() -> moegrad::Result<()> {
    /// let x = Tensor::from_f32(vec![0.0, 3.0, 2.0, 5.0], &[1, 4], Device::cpu())?;
    /// let y = x.swiglu()?.to_vec_f32()?; // [silu(0)·2, silu(3)·5]
    /// assert_eq!(y[0], 0.0);
    /// assert!((y[1] - 5.0 * 3.0 / (1.0 + (-3.0f32).exp())).abs() < 1e-5);
    /// # Ok(()) }
    /// ```
    pub fn swiglu(&self) -> Result<Tensor> {
        let width = self.shape().last().copied().unwrap_or(0);
        if self.rank() == 0 || !width.is_multiple_of(2) {
            return Err(Error::Shape(format!(
                "swiglu: the last axis holds the gate and up halves side by side, so it must be \
                 even, got shape {:?}",
                self.shape()
            )));
        }
        let h = width / 2;
        let _profile = crate::profile::op("swiglu");
        let (silu_a, slope, up) = crate::no_grad(|| -> Result<_> {
            let gate = self.slice(-1, 0, h)?;
            let up = self.slice(-1, h, width)?;
            // silu(a) and silu'(a) = σ(a)·(1 + a·(1 − σ(a))), in one pass where the backend can
            let (silu_a, slope) = match gate.storage().value_and_slope(true) {
                Some((y, s)) => (
                    Tensor::from_storage(y, gate.shape().to_vec()),
                    Tensor::from_storage(s, gate.shape().to_vec()),
                ),
                None => {
                    let s = gate.sigmoid()?;
                    let slope = gate
                        .mul(&s.neg()?.add_scalar(1.0)?)?
                        .add_scalar(1.0)?
                        .mul(&s)?;
                    (gate.mul(&s)?, slope)
                }
            };
            Ok((silu_a, slope, up))
        })?;
        let y = crate::no_grad(|| silu_a.mul(&up))?;
        let last = self.rank() as isize - 1;
        Ok(Tensor::record(y, "swiglu", &[self], move |g| {
            let da = g.mul(&up)?.mul(&slope)?;
            let db = g.mul(&silu_a)?;
            Ok(vec![Some(Tensor::concat(&[da, db], last)?)])
        }))
    }
}
