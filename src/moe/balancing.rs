//! How an MoE layer balances its experts' load, a setting separate from the router
//! (`--balance`, `--balance-scope`, `--balance-window`, `--balance-rate`): the Switch auxiliary
//! loss at a chosen scope (`aux_loss.rs`), a selection-only bias moved by the sign of each
//! expert's load error or solved from a quantile (`selection_bias.rs`), or nothing. The formulas,
//! their scales and how they relate to other codebases' forms are in docs/routers.md,
//! "Balancing".

use crate::{Error, Result};
use serde::{Deserialize, Serialize};

/// The balancing method.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum BalanceMethod {
    /// the Switch auxiliary loss `α·n·Σ f_i P_i` (α: `--balance-loss`) at the chosen scope
    #[default]
    Aux,
    /// DeepSeek-V3's auxiliary-loss-free bias, `b_i += u·sign(c̄ − c_i)` after each batch
    AuxFree,
    /// Quantile Balancing: the bias solved from each batch's scores
    Quantile,
    /// no balancing at all
    None,
}

/// Over which tokens the auxiliary loss counts `f_i` and averages `P_i`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum BalanceScope {
    /// the whole batch (Switch, Mixtral, transformers)
    #[default]
    Batch,
    /// each sequence on its own, the losses averaged (DeepSeek-V3's sequence-wise loss;
    /// language models only)
    Sequence,
    /// `f_i` from the counts of the last `window` training batches (Megatron's and Qwen's
    /// global-batch loss accumulate over the micro-batches of a step; moegrad, with no gradient
    /// accumulation, over a window of steps)
    Global,
}

/// The balancing of an MoE layer.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Balancing {
    /// which method
    pub method: BalanceMethod,
    /// the auxiliary loss's scope (`aux` only)
    pub scope: BalanceScope,
    /// training batches per window of the `global` scope (≥ 1)
    pub window: usize,
    /// the aux-free update rate u (DeepSeek-V3's γ = 0.001)
    pub rate: f64,
}

impl Default for Balancing {
    fn default() -> Self {
        Balancing {
            method: BalanceMethod::Aux,
            scope: BalanceScope::Batch,
            window: 8,
            rate: 1e-3,
        }
    }
}

impl BalanceMethod {
    /// Every method's command-line name.
    pub const NAMES: [&'static str; 4] = ["aux", "aux-free", "quantile", "none"];

    /// Parses a command-line name.
    pub fn parse(s: &str) -> Result<BalanceMethod> {
        Ok(match s {
            "aux" => BalanceMethod::Aux,
            "aux-free" => BalanceMethod::AuxFree,
            "quantile" => BalanceMethod::Quantile,
            "none" => BalanceMethod::None,
            other => {
                return Err(Error::Invalid(format!(
                    "--balance {other:?} is not one of {}",
                    Self::NAMES.join(", ")
                )));
            }
        })
    }

    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            BalanceMethod::Aux => "aux",
            BalanceMethod::AuxFree => "aux-free",
            BalanceMethod::Quantile => "quantile",
            BalanceMethod::None => "none",
        }
    }
}

impl BalanceScope {
    /// Parses a command-line name.
    pub fn parse(s: &str) -> Result<BalanceScope> {
        Ok(match s {
            "batch" => BalanceScope::Batch,
            "sequence" => BalanceScope::Sequence,
            "global" => BalanceScope::Global,
            other => {
                return Err(Error::Invalid(format!(
                    "--balance-scope {other:?} is not one of batch, sequence, global"
                )));
            }
        })
    }

    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            BalanceScope::Batch => "batch",
            BalanceScope::Sequence => "sequence",
            BalanceScope::Global => "global",
        }
    }
}

impl Balancing {
    /// Whether the method moves a selection-only bias (the router must take one).
    pub fn uses_selection_bias(&self) -> bool {
        matches!(
            self.method,
            BalanceMethod::AuxFree | BalanceMethod::Quantile
        )
    }

    /// Checks the settings for a layer of `n` experts, `k` per token, routed by `router`, which
    /// takes a selection bias or not (`takes_bias`): [`Balancing::validate`], a bias-moving
    /// method needs a router that takes one, and `quantile` needs `k < n`. Each error names the
    /// flag and the router.
    pub fn check(&self, router: &str, takes_bias: bool, k: usize, n: usize) -> Result<()> {
        self.validate()?;
        if self.uses_selection_bias() && !takes_bias {
            return Err(Error::Invalid(format!(
                "--balance {} moves a selection-only bias, which router {router} does not take (it does not choose its experts as the top k of a score); use a top-k router ({}) or --balance aux",
                self.method.name(),
                crate::moe::BIASABLE_ROUTERS.join(", ")
            )));
        }
        if self.method == BalanceMethod::Quantile && k >= n {
            return Err(Error::Invalid(format!(
                "--balance quantile needs k < n (a token's cutoff is its (k+1)-th score); got --k {k} of {n} experts"
            )));
        }
        Ok(())
    }

    /// Checks the settings (each error names the flag at fault).
    pub fn validate(&self) -> Result<()> {
        if self.window == 0 {
            return Err(Error::Invalid(
                "--balance-window must be at least 1 training batch".into(),
            ));
        }
        if !(self.rate.is_finite() && self.rate > 0.0) {
            return Err(Error::Invalid(format!(
                "--balance-rate must be a positive number, got {}",
                self.rate
            )));
        }
        if self.scope != BalanceScope::Batch && self.method != BalanceMethod::Aux {
            return Err(Error::Invalid(format!(
                "--balance-scope {} applies to the auxiliary loss (--balance aux), not to --balance {}",
                self.scope.name(),
                self.method.name()
            )));
        }
        Ok(())
    }
}
