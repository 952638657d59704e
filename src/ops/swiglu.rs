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
//! Both passes are backend primitives (`NnOps::swiglu_forward` / `_backward`):
//! `src/backend/cpu/swiglu.rs` on the CPU, `shaders/swiglu.wgsl` on the GPU. The tape holds one
//! node that keeps only its input; the backward recomputes `σ(a)` and writes
//!
//! ```text
//! d[a | b] = [g ⊙ b ⊙ silu'(a) | g ⊙ silu(a)],    silu'(a) = σ(a)·(1 + a·(1 − σ(a)))
//! ```
//!
//! in one pass. Composed from elementwise ops (two slices, `silu`, a product; backward two
//! products and a concatenation) it took a pass and a buffer per op: on the CPU about a seventh
//! of a `llama` training step (docs/benchmarks.md). `tests/llama_blocks.rs` checks it against an
//! f64 reference written from the definition.

use crate::backend::SwiGluDims;
use crate::{Error, Result, Tensor};

impl Tensor {
    /// `silu(a) ⊙ b` for the halves `a = self[.., :h]`, `b = self[.., h:]` of the last axis
    /// (`[.., 2h]` → `[.., h]`).
    ///
    /// The backward rule is one backend kernel, not tensor ops, so it is not itself
    /// differentiable (as `Tensor::layer_norm`).
    ///
    /// # Errors
    /// [`Error::Shape`] when the last axis is missing or odd; [`Error::DType`] for a non-float
    /// tensor (or f64 on the GPU).
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
        self.check_float("swiglu")?;
        let dims = SwiGluDims {
            rows: self.numel() / width.max(1),
            half: width / 2,
        };
        let mut out_shape = self.shape().to_vec();
        *out_shape.last_mut().expect("rank checked above") = dims.half;
        if dims.rows == 0 || dims.half == 0 {
            return Tensor::zeros(&out_shape, self.dtype(), self.device());
        }
        let _profile = crate::profile::op("swiglu");
        let y = Tensor::from_storage(self.storage().swiglu_forward(dims)?, out_shape);
        let x = self.detach();
        Ok(Tensor::record(y, "swiglu", &[self], move |g| {
            let dx = x.storage().swiglu_backward(g.storage(), dims)?;
            Ok(vec![Some(Tensor::from_storage(dx, x.shape().to_vec()))])
        }))
    }
}
