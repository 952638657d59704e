//! The expert bank: `n` two-layer MLP experts stored stacked (`W1: [n, d, h]`, `b1: [n, h]`,
//! `W2: [n, h, d_out]`, `b2: [n, d_out]`) and run with the grouped matmul, each expert only on
//! the rows the dispatch plan gave it. SwiGLU experts (Mixtral, Qwen-MoE, OLMoE, DeepSeek) hold
//! their gate and up projections side by side in `W1: [n, d, 2h]` (gate first, transformers
//! v5's `gate_up_proj` transposed) and compute `silu(x·W_gate) ⊙ (x·W_up)` between the products.
//!
//! Rows that were dropped or invalid are replaced by exact zeros with `where` (never multiplied
//! by a zero weight), so whatever an unselected expert's parameters hold — even NaN — cannot
//! reach the output or any gradient.

use super::DispatchPlan;
use crate::nn::Parameters;
use crate::nn::{Activation, Module, Param, join, uniform};
use crate::{DType, Device, Error, Result, Tensor};
use rand_chacha::ChaCha8Rng;

/// A bank of experts the MoE layer can dispatch to: runs each kept row through its expert.
pub trait ExpertNet: Module {
    /// `rows: [A, d]` in the plan's sorted order → `[A, d_out]`, exact zeros on dropped rows.
    fn forward_rows(&self, rows: &Tensor, plan: &DispatchPlan) -> Result<Tensor>;
    /// Number of experts.
    fn experts(&self) -> usize;
    /// Output width.
    fn d_out(&self) -> usize;
    /// `y[t] = Σ_e weights[t, e] · expert_e(x[t])` with every expert run on every token
    /// (`x: [T, d]`, `weights: [T, n]` → `[T, d_out]`), for routings in which every token uses
    /// every expert (see `all_experts.rs`). `None` (the default) when the bank has no such
    /// path; the layer then dispatches through the plan.
    fn forward_all_experts(&self, x: &Tensor, weights: &Tensor) -> Result<Option<Tensor>> {
        let _ = (x, weights);
        Ok(None)
    }
}

/// `n` MLP experts `x → act(x·W1 + b1)·W2 + b2`.
pub struct ExpertBank {
    /// `[n, d, h]`
    pub w1: Param,
    /// `[n, h]` (None: no hidden bias)
    pub b1: Option<Param>,
    /// `[n, h, d_out]`
    pub w2: Param,
    /// `[n, d_out]` (None: no output bias)
    pub b2: Option<Param>,
    /// ReLU, GELU or SwiGLU (gated: `w1` is `[n, d, 2h]`)
    pub activation: Activation,
}

/// The sizes and form of an [`ExpertBank`]: `experts` MLPs `d → hidden → d_out`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ExpertBankConfig {
    /// the number of experts `n`
    pub experts: usize,
    /// the input width `d`
    pub d: usize,
    /// the hidden width of each expert's MLP
    pub hidden: usize,
    /// the output width
    pub d_out: usize,
    /// the activation between the two layers (ReLU, GELU, or the gated SwiGLU)
    pub activation: Activation,
    /// whether each layer has a bias (without: `x → act(x·W1)·W2`, as in Mixtral-style experts)
    pub bias: bool,
}

impl ExpertBank {
    /// `cfg.experts` MLPs `d → hidden → d_out` with Kaiming-uniform weights and, with
    /// `cfg.bias`, zero biases.
    ///
    /// # Errors
    /// [`Error::Invalid`] when a size is zero.
    ///
    /// # Example
    /// ```
    /// use moegrad::Device;
    /// use moegrad::moe::{ExpertBank, ExpertBankConfig};
    /// use moegrad::nn::Activation;
    /// use rand::SeedableRng;
    /// let cfg = ExpertBankConfig {
    ///     experts: 4, d: 8, hidden: 16, d_out: 8, activation: Activation::Relu, bias: true,
    /// };
    /// let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
    /// let bank = ExpertBank::new(cfg, &mut rng, Device::cpu()).unwrap();
    /// assert_eq!(bank.w1.get().shape(), &[4, 8, 16]);
    /// ```
    pub fn new(cfg: ExpertBankConfig, rng: &mut ChaCha8Rng, device: Device) -> Result<ExpertBank> {
        let ExpertBankConfig {
            experts,
            d,
            hidden,
            d_out,
            activation,
            bias,
        } = cfg;
        if experts == 0 || d == 0 || hidden == 0 || d_out == 0 {
            return Err(Error::Invalid(format!(
                "expert bank needs positive sizes, got {experts} experts of {d} → {hidden} → {d_out}"
            )));
        }
        // a gated activation (SwiGLU) reads gate and up halves side by side: W1 is twice as wide
        let wide = activation.input_width(hidden);
        Ok(ExpertBank {
            w1: Param::new(uniform(
                &[experts, d, wide],
                (6.0 / d as f64).sqrt(),
                rng,
                device,
            )?)?,
            b1: bias
                .then(|| Param::new(Tensor::zeros(&[experts, wide], DType::F32, device)?))
                .transpose()?,
            w2: Param::new(uniform(
                &[experts, hidden, d_out],
                (6.0 / hidden as f64).sqrt(),
                rng,
                device,
            )?)?,
            b2: bias
                .then(|| Param::new(Tensor::zeros(&[experts, d_out], DType::F32, device)?))
                .transpose()?,
            activation,
        })
    }
}

impl ExpertNet for ExpertBank {
    fn experts(&self) -> usize {
        self.w1.get().shape()[0]
    }

    fn d_out(&self) -> usize {
        self.w2.get().shape()[2]
    }

    fn forward_rows(&self, rows: &Tensor, plan: &DispatchPlan) -> Result<Tensor> {
        // Each product adds its expert's bias inside the grouped kernel. A dropped or invalid
        // row has expert −1, for which the second product gives exact zeros (and no bias)
        // whatever the activation made of the first: its output is 0 with no masking pass.
        let (b1, b2) = (
            self.b1.as_ref().map(Param::get),
            self.b2.as_ref().map(Param::get),
        );
        let (re, off) = (&plan.row_expert, &plan.offsets);
        let h = rows.grouped_matmul_with_bias(&self.w1.get(), b1.as_ref(), re, off)?;
        let h = self.activation.apply(&h)?;
        h.grouped_matmul_with_bias(&self.w2.get(), b2.as_ref(), re, off)
    }

    /// Two wide products instead of `n` per-expert ones: the experts' first layers side by
    /// side, `[W1_0 | … | W1_{n−1}]: [d, n·w]`, and their second layers stacked,
    /// `[W2_0; …; W2_{n−1}]: [n·h, d_out]`. Scaling expert e's hidden columns by `weights[:, e]`
    /// before the second product makes that product's sum over `n·h` the weighted sum over
    /// experts: `y_t = Σ_e W_te·(act_te·W2_e) + Σ_e W_te·b2_e`.
    fn forward_all_experts(&self, x: &Tensor, weights: &Tensor) -> Result<Option<Tensor>> {
        let w1 = self.w1.get();
        let (n, d, wide) = (w1.shape()[0], w1.shape()[1], w1.shape()[2]);
        let t = x.shape()[0];
        if weights.shape() != [t, n] || x.shape()[1] != d {
            return Err(Error::Shape(format!(
                "expert bank of {n} experts on [T, {d}] tokens: got tokens {:?} and weights {:?} \
                 (want [T, {n}])",
                x.shape(),
                weights.shape()
            )));
        }
        let side_by_side = w1.permute(&[1, 0, 2])?.reshape(&[d, n * wide])?;
        let mut h = x.matmul(&side_by_side)?;
        if let Some(b1) = &self.b1 {
            h = h.add(&b1.get().reshape(&[n * wide])?)?;
        }
        // the activation per expert (SwiGLU pairs each expert's own gate and up halves)
        let h = self.activation.apply(&h.reshape(&[t, n, wide])?)?;
        let hidden = h.shape()[2];
        let h = h.mul(&weights.reshape(&[t, n, 1])?.to_dtype(h.dtype())?)?;
        let w2 = self.w2.get();
        let d_out = w2.shape()[2];
        let stacked = w2.reshape(&[n * hidden, d_out])?;
        let y = h.reshape(&[t, n * hidden])?.matmul(&stacked)?;
        Ok(Some(match &self.b2 {
            Some(b2) => y.add(&weights.to_dtype(y.dtype())?.matmul(&b2.get())?)?,
            None => y,
        }))
    }
}

impl Module for ExpertBank {
    /// Runs every expert on every row of `x` (`[T, d]` → `[n, T, d_out]`): the dense reference
    /// used by tests.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let n = self.experts();
        let add_bias = |y: Tensor, b: &Option<Param>| match b {
            Some(b) => {
                let b = b.get();
                let width = b.shape()[1];
                y.add(&b.reshape(&[n, 1, width])?)
            }
            None => Ok(y),
        };
        let h = add_bias(x.matmul(&self.w1.get())?, &self.b1)?;
        let h = self.activation.apply(&h)?;
        add_bias(h.matmul(&self.w2.get())?, &self.b2)
    }
}

impl Parameters for ExpertBank {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(String, &Param)) {
        f(join(prefix, "w1"), &self.w1);
        if let Some(b1) = &self.b1 {
            f(join(prefix, "b1"), b1);
        }
        f(join(prefix, "w2"), &self.w2);
        if let Some(b2) = &self.b2 {
            f(join(prefix, "b2"), b2);
        }
    }
}
