//! The checks of a run's MoE settings (router, experts and k, expert width, capacities, the
//! auxiliary-loss weights and the balancing), which [`TrainConfig::validate`] runs for the
//! models with an MoE layer. Each error names the flag at fault.

use super::TrainConfig;
use crate::{Error, Result};

/// Checks the MoE settings of `cfg` (a model with an MoE layer).
pub(super) fn validate(cfg: &TrainConfig) -> Result<()> {
    let bad = |m: String| Err(Error::Invalid(m));
    if !crate::moe::ROUTER_NAMES.contains(&cfg.router.as_str()) {
        return bad(format!(
            "--router {:?}: expected one of {}",
            cfg.router,
            crate::moe::ROUTER_NAMES.join(", ")
        ));
    }
    if cfg.experts == 0 || cfg.k == 0 || cfg.k > cfg.experts {
        return bad(format!(
            "--k {} must be between 1 and --experts {}",
            cfg.k, cfg.experts
        ));
    }
    if cfg.expert_hidden == 0 {
        return bad("--expert-hidden must be at least 1, got 0".into());
    }
    let router = cfg.router.as_str();
    let takes_bias = crate::moe::BIASABLE_ROUTERS.contains(&router);
    cfg.balancing
        .check(router, takes_bias, cfg.k, cfg.experts + cfg.null_experts)?;
    if cfg.null_experts > 0 && matches!(router, "expert-choice" | "hash" | "softmax") {
        return bad(format!(
            "--null-experts {} needs a router that picks experts per token by their scores; --router {router} does not (use topk, switch, deepseek-v3, ...)",
            cfg.null_experts
        ));
    }
    if cfg.balancing.scope == crate::moe::BalanceScope::Sequence && !cfg.model.is_lm() {
        return bad(format!(
            "--balance-scope sequence balances each sequence of a language model; --model {} sees one token per example (use batch or global)",
            cfg.model.name()
        ));
    }
    for (name, v) in [
        ("--capacity-factor", cfg.capacity_factor),
        ("--eval-capacity-factor", cfg.eval_capacity_factor),
        ("--balance-loss", cfg.balance_loss),
        ("--z-loss", cfg.z_loss),
    ] {
        if !(v.is_finite() && v >= 0.0) {
            return bad(format!("{name} must be finite and non-negative, got {v}"));
        }
    }
    Ok(())
}
