//! Elementwise functions of one tensor: each forward is one backend `unary` kernel, each backward
//! a line of tensor algebra (d/dx of the function times the upstream gradient).

use crate::backend::{BinaryOp, UnaryOp};
use crate::{Result, Tensor};

impl Tensor {
    /// Applies `op` and records `rule(grad_out, x, y) -> grad_x`.
    fn unary_with_rule(
        &self,
        op: UnaryOp,
        name: &'static str,
        rule: impl FnOnce(&Tensor, &Tensor, &Tensor) -> Result<Tensor> + Send + 'static,
    ) -> Result<Tensor> {
        let _profile = crate::profile::op(name);
        let y = self.map_unary(op)?;
        let (x, y_saved) = (self.detach(), y.clone());
        Ok(Tensor::record(y, name, &[self], move |g| {
            Ok(vec![Some(rule(g, &x, &y_saved)?)])
        }))
    }

    /// `-x`
    pub fn neg(&self) -> Result<Tensor> {
        self.unary_with_rule(UnaryOp::Neg, "neg", |g, _, _| g.map_unary(UnaryOp::Neg))
    }
    /// `e^x`; d/dx = e^x
    pub fn exp(&self) -> Result<Tensor> {
        self.unary_with_rule(UnaryOp::Exp, "exp", |g, _, y| g.mul(y))
    }
    /// natural log; d/dx = 1/x
    pub fn log(&self) -> Result<Tensor> {
        self.unary_with_rule(UnaryOp::Log, "log", |g, x, _| g.div(x))
    }
    /// `√x`; d/dx = 1/(2√x)
    pub fn sqrt(&self) -> Result<Tensor> {
        self.unary_with_rule(UnaryOp::Sqrt, "sqrt", |g, _, y| g.div(y)?.mul_scalar(0.5))
    }
    /// `|x|`; d/dx = sign(x)
    pub fn abs(&self) -> Result<Tensor> {
        self.unary_with_rule(UnaryOp::Abs, "abs", |g, x, _| {
            g.mul(&x.map_unary(UnaryOp::Sign)?)
        })
    }
    /// `x^p` for a constant `p`; d/dx = p·x^(p−1)
    pub fn powf(&self, p: f64) -> Result<Tensor> {
        self.unary_with_rule(UnaryOp::Powf(p), "powf", move |g, x, _| {
            g.mul(&x.map_unary(UnaryOp::Powf(p - 1.0))?.mul_scalar(p)?)
        })
    }
    /// `1/x`; d/dx = −1/x²
    pub fn recip(&self) -> Result<Tensor> {
        self.unary_with_rule(UnaryOp::Recip, "recip", |g, _, y| {
            g.mul(&y.mul(y)?)?.map_unary(UnaryOp::Neg)
        })
    }
    /// `min(max(x, lo), hi)`; the gradient passes where `lo < x < hi`.
    pub fn clamp(&self, lo: f64, hi: f64) -> Result<Tensor> {
        if lo.is_nan() || hi.is_nan() || lo > hi {
            return Err(crate::Error::Invalid(format!(
                "clamp: need lo <= hi, got lo={lo} hi={hi}"
            )));
        }
        self.unary_with_rule(UnaryOp::Clamp(lo, hi), "clamp", move |g, x, _| {
            let above = x
                .map_unary(UnaryOp::AddScalar(-lo))?
                .map_unary(UnaryOp::Step)?;
            let below = x
                .map_unary(UnaryOp::Neg)?
                .map_unary(UnaryOp::AddScalar(hi))?
                .map_unary(UnaryOp::Step)?;
            g.mul(&above.mul(&below)?)
        })
    }
    /// `x + c`
    pub fn add_scalar(&self, c: f64) -> Result<Tensor> {
        self.unary_with_rule(UnaryOp::AddScalar(c), "add_scalar", |g, _, _| Ok(g.clone()))
    }
    /// `x · c`
    pub fn mul_scalar(&self, c: f64) -> Result<Tensor> {
        self.unary_with_rule(UnaryOp::MulScalar(c), "mul_scalar", move |g, _, _| {
            g.map_unary(UnaryOp::MulScalar(c))
        })
    }
    /// `max(x, 0)`; d/dx = 1 where x > 0
    pub fn relu(&self) -> Result<Tensor> {
        // The gradient passes where the output is nonzero (x > 0) and is exactly 0 elsewhere:
        // one `where` pass over the saved output, with no step mask built first.
        self.unary_with_rule(UnaryOp::Relu, "relu", |g, _, y| {
            Tensor::where_cond(y, g, &Tensor::scalar(0.0, g.dtype(), g.device())?)
        })
    }
    /// GELU, tanh approximation `0.5·x·(1 + tanh(√(2/π)(x + 0.044715x³)))` (as in GPT-2/BERT code).
    ///
    /// Backward is `g·gelu'(x)`. When the gradient will be needed and the backend computes the
    /// slope alongside the value (the CPU in f32: one exponential for both), the forward pass
    /// keeps the slope and backward is one product; otherwise backward forms `g·gelu'(x)` in one
    /// fused pass (`BinaryOp::GeluBackward`).
    pub fn gelu(&self) -> Result<Tensor> {
        let _profile = crate::profile::op("gelu");
        if crate::is_grad_enabled()
            && self.requires_grad()
            && let Some((y, slope)) = self.storage().value_and_slope(false)
        {
            let y = Tensor::from_storage(y, self.shape().to_vec());
            let slope = Tensor::from_storage(slope, self.shape().to_vec());
            return Ok(Tensor::record(y, "gelu", &[self], move |g| {
                Ok(vec![Some(g.mul(&slope)?)])
            }));
        }
        self.unary_with_rule(UnaryOp::Gelu, "gelu", |g, x, _| {
            g.map_binary(x, BinaryOp::GeluBackward)
        })
    }
    /// `x·σ(x)`; d/dx = σ(x)·(1 + x·(1 − σ(x))).
    ///
    /// As [`Tensor::gelu`]: where the backend computes the slope with the value (the CPU in
    /// f32), the forward pass keeps it and backward is one product.
    pub fn silu(&self) -> Result<Tensor> {
        if crate::is_grad_enabled()
            && self.requires_grad()
            && let Some((y, slope)) = self.storage().value_and_slope(true)
        {
            let _profile = crate::profile::op("silu");
            let y = Tensor::from_storage(y, self.shape().to_vec());
            let slope = Tensor::from_storage(slope, self.shape().to_vec());
            return Ok(Tensor::record(y, "silu", &[self], move |g| {
                Ok(vec![Some(g.mul(&slope)?)])
            }));
        }
        self.unary_with_rule(UnaryOp::Silu, "silu", |g, x, _| {
            let s = x.map_unary(UnaryOp::Sigmoid)?;
            let one_minus_s = s
                .map_unary(UnaryOp::Neg)?
                .map_unary(UnaryOp::AddScalar(1.0))?;
            let d = x
                .mul(&one_minus_s)?
                .map_unary(UnaryOp::AddScalar(1.0))?
                .mul(&s)?;
            g.mul(&d)
        })
    }
    /// `tanh(x)`; d/dx = 1 − tanh²
    pub fn tanh(&self) -> Result<Tensor> {
        self.unary_with_rule(UnaryOp::Tanh, "tanh", |g, _, y| {
            g.mul(
                &y.mul(y)?
                    .map_unary(UnaryOp::Neg)?
                    .map_unary(UnaryOp::AddScalar(1.0))?,
            )
        })
    }
    /// `σ(x) = 1/(1 + e^−x)`; d/dx = σ(1 − σ)
    pub fn sigmoid(&self) -> Result<Tensor> {
        self.unary_with_rule(UnaryOp::Sigmoid, "sigmoid", |g, _, y| {
            g.mul(
                &y.mul(
                    &y.map_unary(UnaryOp::Neg)?
                        .map_unary(UnaryOp::AddScalar(1.0))?,
                )?,
            )
        })
    }
    /// `ln(1 + e^x)` (stable); d/dx = σ(x)
    pub fn softplus(&self) -> Result<Tensor> {
        self.unary_with_rule(UnaryOp::Softplus, "softplus", |g, x, _| {
            g.mul(&x.map_unary(UnaryOp::Sigmoid)?)
        })
    }
    /// Softsign, `x / (1 + |x|)`: squashes into (−1, 1) like tanh, with tails that approach ±1
    /// polynomially (as `1/|x|`) instead of exponentially, so the gradient stays alive longer;
    /// d/dx = 1 / (1 + |x|)².
    pub fn softsign(&self) -> Result<Tensor> {
        self.unary_with_rule(UnaryOp::Softsign, "softsign", |g, x, _| {
            let d = x
                .map_unary(UnaryOp::Abs)?
                .map_unary(UnaryOp::AddScalar(1.0))?;
            g.div(&d.mul(&d)?)
        })
    }
    /// Converts to another dtype. Between floats the gradient is cast back; to I32 nothing flows.
    pub fn to_dtype(&self, dtype: crate::DType) -> Result<Tensor> {
        let _profile = crate::profile::op("to_dtype");
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        if self.device().is_gpu() && dtype == crate::DType::F64 {
            return Err(crate::Error::DType(
                "the GPU computes in f32 (and stores f16); f64 tensors live on the CPU".into(),
            ));
        }
        let y = Tensor::from_storage(self.storage().cast(dtype)?, self.shape().to_vec());
        if !dtype.is_float() {
            return Ok(y);
        }
        let from = self.dtype();
        Ok(Tensor::record(y, "to_dtype", &[self], move |g| {
            Ok(vec![Some(g.to_dtype(from)?)])
        }))
    }
}
