//! Layer normalisation and RMSNorm of the last axis, each one differentiable op (Ba, Kiros &
//! Hinton, 2016, "Layer Normalization"; Zhang & Sennrich, 2019, "Root Mean Square Layer
//! Normalization"), forward and backward side by side. For each row `x` of `dim` values:
//!
//! * forward  `μ = Σ_j x_j / dim`, `σ² = Σ_j (x_j − μ)² / dim` (biased, as PyTorch's
//!   `nn.LayerNorm`), `r = 1/√(σ² + ε)`, `x̂ = (x − μ)·r`, `y = x̂·γ + β`; the per-row `μ` and `r`
//!   are kept for backward;
//! * backward  with `h = g·γ` (g the upstream gradient): `dx = r·(h − mean_j(h) − x̂·mean_j(h·x̂))`,
//!   `dγ = Σ_rows g·x̂`, `dβ = Σ_rows g`.
//!
//! RMSNorm is the same with `μ = 0` and no `β`: `r = 1/√(mean_j(x_j²) + ε)`, `y = x·r·γ`, and
//! backward drops the `mean_j(h)` term: `dx = r·(h − x̂·mean_j(h·x̂))`, `dγ = Σ_rows g·x̂`.
//!
//! Both passes are backend primitives (`NnOps::layer_norm_forward` / `_backward`):
//! `src/backend/cpu/layer_norm.rs` on the CPU, `shaders/layer_norm.wgsl` (launched by
//! `src/backend/gpu/layer_norm.rs`) on the GPU. Composed from elementwise ops the same function
//! took eight ops forward and about twenty backward (the composed form is kept as the reference
//! in `tests/layer_norm.rs`).

use crate::backend::LayerNormDims;
use crate::{DType, Error, Result, Tensor};

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
    /// [`Error::DType`] for non-float or mixed dtypes (or f64 on the GPU), but for f16 rows with
    /// f32 parameters on the GPU (mixed precision's norms, whose parameter gradients come back
    /// in f32); [`Error::Device`] for
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
        self.normalize_last_axis("layer_norm", gamma, Some(beta), eps)
    }

    /// RMSNorm of the last axis with scale `weight` (`[dim]`): `x/√(mean(x²) + eps)·weight`,
    /// the mean of the squares taken over each row's last axis (Zhang & Sennrich, 2019, "Root
    /// Mean Square Layer Normalization"; the norm of Llama, Mixtral, Qwen and DeepSeek, as
    /// transformers' `LlamaRMSNorm`, computed in the tensor's dtype).
    ///
    /// The same backend kernels as [`Tensor::layer_norm`], told not to centre: no mean is
    /// subtracted and there is no shift. Its backward rule is not itself differentiable.
    ///
    /// # Errors
    /// As [`Tensor::layer_norm`], for `weight` in place of `gamma`.
    ///
    /// # Example
    /// ```
    /// use moegrad::{Device, Tensor};
    /// # fn main() -> moegrad::Result<()> {
    /// let x = Tensor::from_f32(vec![3.0, 4.0], &[1, 2], Device::cpu())?;
    /// let w = Tensor::from_f32(vec![1.0, 2.0], &[2], Device::cpu())?;
    /// let y = x.rms_norm(&w, 0.0)?.to_vec_f32()?;
    /// // mean square (9 + 16)/2 = 12.5, so x/√12.5 · w
    /// assert!((y[0] - 3.0 / 12.5f32.sqrt()).abs() < 1e-6 && (y[1] - 8.0 / 12.5f32.sqrt()).abs() < 1e-6);
    /// # Ok(()) }
    /// ```
    pub fn rms_norm(&self, weight: &Tensor, eps: f64) -> Result<Tensor> {
        let _profile = crate::profile::op("rms_norm");
        self.normalize_last_axis("rms_norm", weight, None, eps)
    }

    /// The body of [`Tensor::layer_norm`] (`beta` given: centred, shifted) and
    /// [`Tensor::rms_norm`] (`beta` None): checks, the forward kernel, the backward rule.
    fn normalize_last_axis(
        &self,
        what: &'static str,
        gamma: &Tensor,
        beta: Option<&Tensor>,
        eps: f64,
    ) -> Result<Tensor> {
        let dim = self.shape().last().copied().unwrap_or(0);
        let (scale_name, shape_ok) = match beta {
            Some(beta) => (
                "gamma and beta",
                gamma.shape() == [dim] && beta.shape() == [dim],
            ),
            None => ("weight", gamma.shape() == [dim]),
        };
        if dim == 0 || !shape_ok {
            return Err(Error::Shape(format!(
                "{what}: input {:?} needs {scale_name} of shape [{dim}] (a non-empty last axis), got {:?}{}",
                self.shape(),
                gamma.shape(),
                beta.map(|b| format!(" and {:?}", b.shape()))
                    .unwrap_or_default()
            )));
        }
        if !(eps >= 0.0 && eps.is_finite()) {
            return Err(Error::Invalid(format!(
                "{what}: eps must be finite and at least 0, got {eps}"
            )));
        }
        // mixed precision casts the rows only: the f16 kernels read f32 parameters where they
        // are and write their gradients in f32
        if let Some([x]) = crate::autocast::low_precision_operands([self])? {
            return x.normalize_last_axis(what, gamma, beta, eps);
        }
        self.check_float(what)?;
        for p in [Some(gamma), beta].into_iter().flatten() {
            // f16 rows with f32 parameters, both on the GPU, is one of the kernels' builds
            let mixed = self.dtype() == DType::F16
                && p.dtype() == DType::F32
                && self.device().is_gpu()
                && p.device().is_gpu();
            if !mixed {
                self.check_compatible(p, what)?;
            }
        }
        // the tape's inputs: x, gamma and (layer norm) beta
        let inputs: Vec<&Tensor> = [Some(self), Some(gamma), beta]
            .into_iter()
            .flatten()
            .collect();
        let shape = self.shape().to_vec();
        let rows = self.numel() / dim;
        if rows == 0 {
            let out = Tensor::zeros(&shape, self.dtype(), self.device())?;
            let mut grads = vec![Some(out.clone()), Some(gamma.zeros_like()?)];
            if let Some(beta) = beta {
                grads.push(Some(beta.zeros_like()?));
            }
            return Ok(Tensor::record(out, what, &inputs, move |_| {
                Ok(grads.clone())
            }));
        }
        let dims = LayerNormDims {
            rows,
            dim,
            eps,
            centered: beta.is_some(),
        };
        // RMSNorm's beta is never read: gamma stands in for it
        let beta_storage = beta.unwrap_or(gamma).storage();
        let (y, mean, rstd) =
            self.storage()
                .layer_norm_forward(gamma.storage(), beta_storage, dims)?;
        let out = Tensor::from_storage(y, shape.clone());
        let (xd, gd) = (self.detach(), gamma.detach());
        let need: Vec<bool> = inputs.iter().map(|t| t.requires_grad()).collect();
        // x's gradient from its other consumers (a residual connection, usually) is added by the
        // kernel as it writes dx, where it has dx's dtype and device; otherwise by an add
        Ok(Tensor::record_folding(
            out,
            what,
            &inputs,
            0,
            move |g, pending| {
                let foldable = pending.as_ref().filter(|p| {
                    p.shape() == shape.as_slice()
                        && p.dtype() == xd.dtype()
                        && p.device() == xd.device()
                });
                let (dx, dgamma, dbeta) = g.storage().layer_norm_backward(
                    (xd.storage(), gd.storage(), &mean, &rstd),
                    foldable.map(|p| p.storage()),
                    dims,
                )?;
                let shapes = [shape, vec![dim], vec![dim]];
                let mut grads: Vec<Option<Tensor>> = [dx, dgamma, dbeta]
                    .into_iter()
                    .zip(shapes)
                    .zip(need)
                    .map(|((d, s), needed)| needed.then(|| Tensor::from_storage(d, s)))
                    .collect();
                if let (None, Some(p), Some(dx)) = (foldable, &pending, &mut grads[0]) {
                    *dx = p.add(dx)?;
                }
                Ok(grads)
            },
        ))
    }
}
