//! Shared experts: an MLP every token passes through beside the experts its router picked
//! (DeepSeekMoE, Dai et al., 2024; Qwen2-MoE). The MoE layer's output becomes
//!
//! ```text
//! y = Σ_i w_i·E_i(x) + g(x)·S(x)      S(x) = down(act(up(x))),  g(x) = σ(x·w_g) or 1
//! ```
//!
//! where `S` is one MLP of width `count·hidden` (DeepSeek-V3 builds its `n_shared_experts`
//! shared experts as one MLP that wide; Qwen2-MoE has one of `shared_expert_intermediate_size`)
//! and `g` the optional sigmoid gate of Qwen2-MoE (`shared_expert_gate`, `Linear(d, 1)` without
//! a bias). The shared experts run on every token, so they add dense compute, never routing.

use crate::nn::{Activation, Linear, Mlp, Module, Param, Parameters, join};
use crate::{Device, Error, Result, Tensor};
use rand_chacha::ChaCha8Rng;

/// How many shared experts an MoE layer has, how wide, and whether they are gated.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SharedExpertsConfig {
    /// shared experts (0: none)
    pub count: usize,
    /// hidden width of each (the MLP is `count·hidden` wide)
    pub hidden: usize,
    /// scale their output by `σ(x·w_g)` (Qwen2-MoE's `shared_expert_gate`)
    pub gate: bool,
}

/// The shared experts of one MoE layer, as one MLP (see the module docs).
pub struct SharedExperts {
    /// `d → count·hidden → d_out`
    pub mlp: Mlp,
    /// `d → 1`, the sigmoid gate, when configured
    pub gate: Option<Linear>,
}

impl SharedExperts {
    /// Shared experts `d → d_out` of the layer's activation and bias setting, weights drawn
    /// N(0, 0.02²) (transformers' initialiser range).
    ///
    /// # Errors
    /// [`Error::Invalid`] when `cfg.count` is 0 or `cfg.hidden` is 0.
    pub fn new(
        cfg: SharedExpertsConfig,
        (d, d_out): (usize, usize),
        activation: Activation,
        bias: bool,
        rng: &mut ChaCha8Rng,
        device: Device,
    ) -> Result<SharedExperts> {
        let width = cfg.count * cfg.hidden;
        if width == 0 {
            return Err(Error::Invalid(format!(
                "shared experts need --shared-experts and --shared-hidden of at least 1, got {} and {}",
                cfg.count, cfg.hidden
            )));
        }
        let mut mlp = Mlp::normal_without_bias(d, width, d_out, activation, 0.02, rng, device)?;
        if bias {
            for l in [&mut mlp.up, &mut mlp.down] {
                let o = l.outputs();
                l.bias = Some(Param::new(Tensor::zeros(&[o], crate::DType::F32, device)?)?);
            }
        }
        Ok(SharedExperts {
            mlp,
            gate: if cfg.gate {
                Some(Linear::normal_without_bias(d, 1, 0.02, rng, device)?)
            } else {
                None
            },
        })
    }

    /// `g(x)·S(x)` for tokens `x` `[T, d]` → `[T, d_out]`.
    ///
    /// # Errors
    /// Errors of the ops (a mis-shaped `x`).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = self.mlp.forward(x)?;
        match &self.gate {
            Some(g) => y.mul(&g.forward(x)?.sigmoid()?),
            None => Ok(y),
        }
    }

    /// `addend + g(x)·S(x)`, the bits of `addend.add(&self.forward(x)?)`: without a gate the
    /// down projection's kernel adds `addend` to its product (one pass fewer, see
    /// [`Mlp::forward_add`]); with one, the gate's product and then the add.
    ///
    /// # Errors
    /// Errors of the ops (a mis-shaped `x`, an `addend` that does not broadcast to the output).
    pub fn forward_add(&self, x: &Tensor, addend: &Tensor) -> Result<Tensor> {
        match &self.gate {
            Some(_) => addend.add(&self.forward(x)?),
            None => self.mlp.forward_add(x, addend),
        }
    }
}

impl Parameters for SharedExperts {
    /// Names `<prefix>.up.*`, `<prefix>.down.*` and `<prefix>.gate.weight` when gated.
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(String, &Param)) {
        self.mlp.visit_params(prefix, f);
        if let Some(g) = &self.gate {
            g.visit_params(&join(prefix, "gate"), f);
        }
    }
}
