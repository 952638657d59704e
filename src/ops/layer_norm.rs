//! Layer normalisation of the last axis as one differentiable op (Ba, Kiros & Hinton, 2016,
//! "Layer Normalization"), forward and backward side by side. For each row `x` of `dim` values:
//!
//! * forward  `μ = Σ_j x_j / dim`, `σ² = Σ_j (x_j − μ)² / dim` (biased, as PyTorch's
//!   `nn.LayerNorm`), `r = 1/√(σ² + ε)`, `x̂ = (x − μ)·r`, `y = x̂·γ + β`; the per-row `μ` and `r`
//!   are kept for backward;
//! * backward  with `h = g·γ` (g the upstream gradient): `dx = r·(h − mean_j(h) − x̂·mean_j(h·x̂))`,
//!   `dγ = Σ_rows g·x̂`, `dβ = Σ_rows g`.
//!
//! Both passes are backend primitives (`NnOps::layer_norm_forward` / `_backward`):
//! `src/backend/cpu/layer_norm.rs` on the CPU, `shaders/layer_norm.wgsl` (launched by
//! `src/backend/gpu/layer_norm.rs`) on the GPU. Composed from elementwise ops the same function
//! took eight ops forward and about twenty backward (the composed form is kept as the reference
//! in `tests/layer_norm.rs`).

use crate::backend::LayerNormDims;
use crate::{Error, Result, Tensor};

impl Tensor {
    /// Layer normalisation of the last axis with scale `gamma` and shift `beta` (both `[dim]`):
    /// `(x − mean)/√(var + eps)·gamma + beta`, the mean and (biased) variance taken over each
    /// row's last axis.
    ///
    /// The backward rule is one backend kernel, not tensor ops, so it is not itself
    /// differentiable: second derivatives through this op are not available. A tensor with no
    /// rows (a zero-sized leading axis) gives an empty result.
    ///
    /// # Errors
    /// [`Error::Shape`] when the last axis is missing or empty or `gamma`/`beta` are not `[dim]`;
    /// [`Error::DType`] for non-float or mixed dtypes (or f64 on the GPU); [`Error::Device`] for
    /// operands on different devices; [`Error::Invalid`] for a negative or non-finite `eps`.
    ///
    /// # Example
    /// ```
    /// use moegrad::{Device, Tensor};
    /// # fn main() -> moegrad::Result<()> {
    /// let x = Tensor::from_f32(vec![1.0, 3.0], &[1, 2], Device::cpu())?;
    /// let (g, b) = (Tensor::ones(&[2], x.dtype(), x.device())?, Tensor::zeros(&[2], x.dtype(), x.device())?);
    /// let y = x.layer_norm(&g, &b, 0.0)?.to_vec_f32()?;
    /// assert_eq!(y, vec![-1.0, 1.0]); // mean 2, variance 1
    /// # Ok(()) }
    /// ```
    pub fn layer_norm(&self, gamma: &Tensor, beta: &Tensor, eps: f64) -> Result<Tensor> {
        let _profile = crate::profile::op("layer_norm");
        const WHAT: &str = "layer_norm";
        let dim = self.shape().last().copied().unwrap_or(0);
        if dim == 0 || gamma.shape() != [dim] || beta.shape() != [dim] {
            return Err(Error::Shape(format!(
                "{WHAT}: input {:?} needs gamma and beta of shape [{dim}] (a non-empty last axis), got {:?} and {:?}",
                self.shape(),
                gamma.shape(),
                beta.shape()
            )));
        }
        if !(eps >= 0.0 && eps.is_finite()) {
            return Err(Error::Invalid(format!(
                "{WHAT}: eps must be finite and at least 0, got {eps}"
            )));
        }
        self.check_float(WHAT)?;
        self.check_compatible(gamma, WHAT)?;
        self.check_compatible(beta, WHAT)?;
        let shape = self.shape().to_vec();
        let rows = self.numel() / dim;
        if rows == 0 {
            let out = Tensor::zeros(&shape, self.dtype(), self.device())?;
            let (gz, bz) = (gamma.zeros_like()?, beta.zeros_like()?);
            let empty = out.clone();
            return Ok(Tensor::record(out, WHAT, &[self, gamma, beta], move |_| {
                Ok(vec![Some(empty), Some(gz), Some(bz)])
            }));
        }
        let dims = LayerNormDims { rows, dim, eps };
        let (y, mean, rstd) =
            self.storage()
                .layer_norm_forward(gamma.storage(), beta.storage(), dims)?;
        let out = Tensor::from_storage(y, shape.clone());
        let (xd, gd) = (self.detach(), gamma.detach());
        let need = [
            self.requires_grad(),
            gamma.requires_grad(),
            beta.requires_grad(),
        ];
        Ok(Tensor::record(out, WHAT, &[self, gamma, beta], move |g| {
            let (dx, dgamma, dbeta) = g
                .storage()
                .layer_norm_backward((xd.storage(), gd.storage(), &mean, &rstd), dims)?;
            let shapes = [shape, vec![dim], vec![dim]];
            Ok([dx, dgamma, dbeta]
                .into_iter()
                .zip(shapes)
                .zip(need)
                .map(|((d, s), needed)| needed.then(|| Tensor::from_storage(d, s)))
                .collect())
        }))
    }
}
