//! The sparse MoE layer, read in order: route → plan → gather rows → experts → combine.
//!
//! ```text
//! x [T, d] ──router──▶ Routing (token, expert, weight) ──DispatchPlan──▶ rows sorted by expert
//!   rows = x[row_token]                  (index_select; its backward scatter-adds into ∂x)
//!   out  = ExpertBank(rows)              (grouped matmuls; each expert only on its own rows)
//!   y[t] = Σ_{rows of t} weight · out    (weighted_index_scatter by token)
//! ```
//!
//! The sparse backward falls out of the pieces: `∂L/∂weight` of a row is `⟨∂L/∂y_t, out_row⟩`
//! for kept rows and 0 for dropped ones; expert parameters get gradient only from their rows;
//! experts that received no rows are never run and get exactly zero.
//!
//! A routing in which every token uses every expert (`Routing::every_expert`: the dense
//! `softmax` router, the straight-through estimators in training) may skip the plan, the gather
//! and the scatter: `all_experts.rs` runs it as two wide products instead.

use super::cnn_experts::CnnExpertBank;
use super::dispatch::{Capacity, DispatchPlan};
use super::experts::{ExpertBank, ExpertBankConfig, ExpertNet};
use super::score_function::ScoreTerm;
use super::shared_experts::SharedExperts;
use super::stats::{ExpertWeights, RoutingStats};
use super::{BalanceMethod, BalanceScope, Balancing};
use super::{ExpertKind, MoeConfig, Router, build_router};
use super::{Routing, aux_loss};
use crate::nn::{Param, Parameters, join};
use crate::{Device, Error, Result, Tensor};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

/// What a forward pass returns.
#[derive(Clone, Debug)]
pub struct MoeOutput {
    /// `[T, d_out]`
    pub y: Tensor,
    /// balance loss + z-loss (a scalar; zero when both are off)
    pub aux_loss: Tensor,
    /// routing statistics (device tensors)
    pub stats: RoutingStats,
    /// the score-function terms of routers that sample with REINFORCE, one per routing that has
    /// one: add [`ScoreTerm::surrogate`] of each to the objective (see `moe/score_function.rs`)
    pub score_terms: Vec<ScoreTerm>,
}

/// One MoE layer: a router over a bank of experts.
///
/// The router and the experts are read through [`MoeLayer::router`] and [`MoeLayer::experts`],
/// and the router is replaced only through [`MoeLayer::set_router`], which rebuilds the output
/// scale ω and the training mode to match it.
pub struct MoeLayer {
    /// the router (replaced only by `set_router`, which keeps ω and the mode in step with it)
    router: Box<dyn Router>,
    /// the experts (their number and widths are the router's and the config's)
    experts: Box<dyn ExpertNet>,
    /// the settings (read through [`MoeLayer::config`]; changed only through the setters of the
    /// settings that may change after construction)
    config: MoeConfig,
    /// the trainable per-channel output scale ω `[d_out]` of routers that ask for one
    /// ([`Router::output_scale`], SparseMixer), named `router.omega`; None for the others
    omega: Option<Param>,
    /// the experts every token uses besides its routed ones, when configured
    shared: Option<SharedExperts>,
    /// the `global` balance scope's window: assignments per expert over its batches so far and
    /// how many batches that is (None before the first training batch)
    window: Mutex<Option<(Tensor, usize)>>,
    training: AtomicBool,
    /// whether routings in which every token uses every expert run as two wide products
    /// (`all_experts.rs`): Some(choice) when set, None for the device's default
    all_experts_path: Option<bool>,
}

impl MoeLayer {
    /// Builds the router and the experts from the config.
    pub fn new(cfg: &MoeConfig, device: Device) -> Result<MoeLayer> {
        let router = build_router(&cfg.router, &cfg.router_config(cfg.seed), device)?;
        check_balancing(
            &cfg.balancing,
            router.as_ref(),
            cfg.k,
            cfg.experts + cfg.null_experts,
        )?;
        super::null_experts::check_null_experts(cfg, router.as_ref())?;
        let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed);
        let experts: Box<dyn ExpertNet> = match cfg.expert_kind {
            ExpertKind::Mlp => {
                let bank = ExpertBankConfig {
                    experts: cfg.experts,
                    d: cfg.d,
                    hidden: cfg.hidden,
                    d_out: cfg.d_out,
                    activation: cfg.activation,
                    bias: cfg.expert_bias,
                };
                Box::new(ExpertBank::new(bank, &mut rng, device)?)
            }
            ExpertKind::Cnn { side } => {
                if side * side != cfg.d {
                    return Err(Error::Invalid(format!(
                        "CNN experts on {side}×{side} images need d = {}, got {}",
                        side * side,
                        cfg.d
                    )));
                }
                Box::new(CnnExpertBank::new(cfg.experts, side, &mut rng, device)?)
            }
        };
        let omega = match router.output_scale() {
            Some(init) => Some(Param::new(Tensor::full(
                &[cfg.d_out],
                init,
                crate::DType::F32,
                device,
            )?)?),
            None => None,
        };
        let shared = if cfg.shared.count > 0 {
            Some(SharedExperts::new(
                cfg.shared,
                (cfg.d, cfg.d_out),
                cfg.activation,
                cfg.expert_bias,
                &mut rng,
                device,
            )?)
        } else {
            None
        };
        Ok(MoeLayer {
            router,
            experts,
            omega,
            shared,
            config: cfg.clone(),
            window: Mutex::new(None),
            training: AtomicBool::new(true),
            all_experts_path: None,
        })
    }

    /// The settings the layer was built from (the router, the experts' sizes, the capacity and
    /// the auxiliary-loss weights). Sizes and the router are fixed once built; the capacity and
    /// the loss weights may change with [`MoeLayer::set_capacity`] and
    /// [`MoeLayer::set_loss_weights`].
    pub fn config(&self) -> &MoeConfig {
        &self.config
    }

    /// The experts the router scores: the real ones plus the null experts
    /// ([`MoeConfig::null_experts`]). Balance counts, the selection bias and Default MoE's
    /// vectors have this size; the experts, the dispatch and the diagnostics have `n`.
    pub fn routed_experts(&self) -> usize {
        self.config.experts + self.config.null_experts
    }

    /// Sets the capacity in training (`capacity`) and in evaluation (`eval_capacity`): they
    /// take effect from the next [`MoeLayer::forward`].
    ///
    /// # Errors
    /// [`Error::Invalid`] for a capacity factor that is not a positive finite number.
    ///
    /// # Example
    /// ```
    /// use moegrad::moe::{Capacity, MoeConfig, MoeLayer};
    /// # fn main() -> moegrad::Result<()> {
    /// let mut layer = MoeLayer::new(&MoeConfig::new(8, 16, 4, 2), moegrad::Device::cpu())?;
    /// layer.set_capacity(Capacity::Factor { factor: 1.25, min_capacity: 4 }, Capacity::Dropless)?;
    /// assert_eq!(layer.config().eval_capacity, Capacity::Dropless);
    /// assert!(layer.set_capacity(Capacity::Factor { factor: 0.0, min_capacity: 0 }, Capacity::Dropless).is_err());
    /// # Ok(()) }
    /// ```
    pub fn set_capacity(&mut self, capacity: Capacity, eval_capacity: Capacity) -> Result<()> {
        for (name, c) in [("capacity", capacity), ("eval_capacity", eval_capacity)] {
            if let Capacity::Factor { factor, .. } = c
                && !(factor.is_finite() && factor > 0.0)
            {
                return Err(Error::Invalid(format!(
                    "MoE {name}: the capacity factor must be a positive number, got {factor}"
                )));
            }
        }
        self.config.capacity = capacity;
        self.config.eval_capacity = eval_capacity;
        Ok(())
    }

    /// Sets the weights of the auxiliary losses added to [`MoeOutput::aux_loss`]: the
    /// load-balancing loss (`balance_loss`) and the router z-loss (`z_loss`); 0 turns one off.
    ///
    /// # Errors
    /// [`Error::Invalid`] for a weight that is negative or not finite.
    pub fn set_loss_weights(&mut self, balance_loss: f64, z_loss: f64) -> Result<()> {
        for (name, w) in [("balance_loss", balance_loss), ("z_loss", z_loss)] {
            if !(w.is_finite() && w >= 0.0) {
                return Err(Error::Invalid(format!(
                    "MoE {name}: the weight must be a finite number of at least 0, got {w}"
                )));
            }
        }
        self.config.balance_loss = balance_loss;
        self.config.z_loss = z_loss;
        Ok(())
    }

    /// The router: call [`Router::route`] on it to see how tokens would be routed without
    /// running the experts. Replace it with [`MoeLayer::set_router`].
    ///
    /// # Example
    /// ```
    /// use moegrad::moe::{MoeConfig, MoeLayer};
    /// use moegrad::{Device, Tensor};
    /// # fn main() -> moegrad::Result<()> {
    /// let layer = MoeLayer::new(&MoeConfig::new(8, 16, 4, 2), Device::cpu())?;
    /// let x = Tensor::zeros(&[3, 8], moegrad::DType::F32, Device::cpu())?;
    /// let routing = layer.router().route(&x)?;
    /// assert_eq!(routing.tokens, 3);
    /// # Ok(()) }
    /// ```
    pub fn router(&self) -> &dyn Router {
        self.router.as_ref()
    }

    /// The bank of experts (all of them run densely with [`Module::forward`](crate::nn::Module::forward):
    /// `[T, d]` → `[n, T, d_out]`).
    pub fn experts(&self) -> &dyn ExpertNet {
        self.experts.as_ref()
    }

    /// Replaces the bank of experts, e.g. with one split from a trained dense FFN
    /// ([`decompose_ffn`](crate::moe::decompose_ffn), `examples/dense_to_sparse.rs`).
    ///
    /// # Errors
    /// [`Error::Invalid`] if the bank's number of experts or output width differs from the
    /// layer's (`config.experts`, `config.d_out`), which the router and the combine step rely on.
    pub fn set_experts(&mut self, experts: Box<dyn ExpertNet>) -> Result<()> {
        let (n, d_out) = (experts.experts(), experts.d_out());
        if n != self.config.experts || d_out != self.config.d_out {
            return Err(Error::Invalid(format!(
                "the MoE layer routes over {} experts of output width {}; the new bank has {n} of width {d_out}",
                self.config.experts, self.config.d_out
            )));
        }
        self.experts = experts;
        Ok(())
    }

    /// The trainable per-channel output scale ω `[d_out]` of routers that ask for one
    /// ([`Router::output_scale`], SparseMixer), the parameter `router.omega`; `None` for the
    /// others.
    pub fn omega(&self) -> Option<&Param> {
        self.omega.as_ref()
    }

    /// Replaces the router with one of your own (a type implementing [`Router`], written
    /// outside the crate: `examples/custom_router.rs`). The layer's output scale ω is rebuilt
    /// for the new router ([`Router::output_scale`]); the router should route over
    /// `config.experts` experts with tokens of width `config.d`, which [`MoeLayer::forward`]
    /// checks when it combines the routing.
    ///
    /// # Errors
    /// A router without a selection bias when the layer balances with one (`aux-free`,
    /// `quantile`); whatever making ω fails with.
    ///
    /// # Example
    /// ```
    /// use moegrad::moe::{MoeConfig, MoeLayer, RouterConfig, build_router};
    /// use moegrad::Device;
    /// # fn main() -> moegrad::Result<()> {
    /// let cfg = MoeConfig::new(8, 16, 4, 1);
    /// let mut layer = MoeLayer::new(&cfg, Device::cpu())?;
    /// let mine = build_router("switch", &RouterConfig::new(8, 4, 1), Device::cpu())?;
    /// layer.set_router(mine)?;
    /// assert_eq!(layer.router().name(), "switch");
    /// # Ok(()) }
    /// ```
    pub fn set_router(&mut self, router: Box<dyn Router>) -> Result<()> {
        check_balancing(
            &self.config.balancing,
            router.as_ref(),
            self.config.k,
            self.config.experts,
        )?;
        // the experts' device (the layer keeps no device of its own)
        let mut device = Device::Cpu;
        self.experts
            .visit_params("", &mut |_, p| device = p.get().device());
        self.omega = match router.output_scale() {
            Some(init) => Some(Param::new(Tensor::full(
                &[self.config.d_out],
                init,
                crate::DType::F32,
                device,
            )?)?),
            None => None,
        };
        router.set_training(self.training.load(Ordering::Relaxed));
        self.router = router;
        Ok(())
    }

    /// The `global` scope's counts: in training, this batch's added to the window's (a new
    /// window every `balancing.window` batches); in evaluation, this batch's alone.
    fn window_counts(&self, routed: &[Tensor], training: bool) -> Result<Tensor> {
        let batch = crate::no_grad(|| {
            routed
                .iter()
                .skip(1)
                .try_fold(routed[0].to_dtype(crate::DType::F32)?, |acc, c| {
                    acc.add(&c.to_dtype(crate::DType::F32)?)
                })
        })?;
        if !training {
            return Ok(batch);
        }
        let mut slot = self
            .window
            .lock()
            .map_err(|_| Error::Invalid("MoE balance window lock poisoned".into()))?;
        let next = match slot.take() {
            Some((sum, steps)) if steps < self.config.balancing.window => {
                (crate::no_grad(|| sum.add(&batch))?, steps + 1)
            }
            _ => (batch, 1),
        };
        let counts = next.0.clone();
        *slot = Some(next);
        Ok(counts)
    }

    fn capacity(&self) -> Capacity {
        if self.training.load(Ordering::Relaxed) {
            self.config.capacity
        } else {
            self.config.eval_capacity
        }
    }

    /// Whether a routing in which every token uses every expert (the dense `softmax` router,
    /// the straight-through estimators in training) runs as two wide products with no
    /// dispatch plan (`Some(true)`), through the plan like any other (`Some(false)`), or as the
    /// device prefers (`None`, the default: the wide products on the GPU, where they save the
    /// plan's kernels and the `T·n`-row gathers and scatters; the plan on the CPU, where the
    /// two measured within 10% of each other and the plan held less memory, docs/benchmarks.md).
    /// Both compute the same output and gradients.
    ///
    /// ```
    /// # use moegrad::{Device, Tensor};
    /// # use moegrad::moe::{MoeConfig, MoeLayer};
    /// # fn main() -> moegrad::Result<()> {
    /// let mut cfg = MoeConfig::new(8, 16, 4, 4);
    /// cfg.router = "softmax".into();
    /// let mut layer = MoeLayer::new(&cfg, Device::cpu())?;
    /// let x = Tensor::ones(&[3, 8], moegrad::DType::F32, Device::cpu())?;
    /// layer.set_all_experts_path(Some(true));
    /// let wide = layer.forward(&x)?.y.to_vec_f64()?;
    /// layer.set_all_experts_path(Some(false));
    /// let planned = layer.forward(&x)?.y.to_vec_f64()?;
    /// assert!(wide.iter().zip(&planned).all(|(a, b)| (a - b).abs() < 1e-5));
    /// # Ok(())
    /// # }
    /// ```
    pub fn set_all_experts_path(&mut self, choice: Option<bool>) {
        self.all_experts_path = choice;
    }

    /// The router's decision for `x`, in f32 even under mixed precision (Switch's selective
    /// precision, see `autocast.rs`): f16 tokens are cast up and the router's products,
    /// softmax, top-k and auxiliary losses run in f32.
    pub fn route(&self, x: &Tensor) -> Result<Routing> {
        super::router_trait::route_in_f32(self.router.as_ref(), x)
    }

    /// [`MoeLayer::route`] for tokens `x`, which must be `[T, d]`.
    fn route_tokens(&self, x: &Tensor) -> Result<Routing> {
        if x.rank() != 2 || x.shape()[1] != self.config.d {
            return Err(Error::Shape(format!(
                "MoE layer expects tokens [T, {}], got {:?}",
                self.config.d,
                x.shape()
            )));
        }
        self.route(x)
    }

    /// Routes `x: [T, d]` and runs the experts.
    pub fn forward(&self, x: &Tensor) -> Result<MoeOutput> {
        let routing = self.route_tokens(x)?;
        self.forward_routed(x, &[routing])
    }

    /// [`MoeLayer::forward`] for tokens that are `T / seq_len` sequences of `seq_len` each (a
    /// language model's `[B·L, d]`): the same output, with the balance loss of
    /// `--balance-scope sequence` taken per sequence.
    ///
    /// # Errors
    /// Those of `forward`; with the sequence scope, T not a multiple of `seq_len`.
    pub fn forward_sequences(&self, x: &Tensor, seq_len: usize) -> Result<MoeOutput> {
        let routing = self.route_tokens(x)?;
        self.forward_routed_in(x, &[routing], Some(seq_len), None)
    }

    /// [`MoeLayer::forward_sequences`] with `y = residual + moe(x)`, the bits of
    /// `residual.add(&out.y)` (a block's `h + moe(norm(h))`): added by the combine's kernel
    /// where the combine is the last op (no shared experts, ω or Default MoE terms) and a
    /// token-choice routing lists each token's rows, else by an add.
    ///
    /// # Errors
    /// Those of `forward_sequences`, and a residual that does not broadcast to `[T, d_out]`.
    pub fn forward_sequences_add(
        &self,
        x: &Tensor,
        seq_len: usize,
        residual: &Tensor,
    ) -> Result<MoeOutput> {
        let routing = self.route_tokens(x)?;
        self.forward_routed_in(x, &[routing], Some(seq_len), Some(residual))
    }

    /// Runs the experts for one or more routings of the same tokens (several routings: one
    /// per task of a multi-gate MoE, dispatched together so each expert runs once on all its
    /// rows). Output rows are `task·T + t`.
    pub fn forward_routed(&self, x: &Tensor, routings: &[Routing]) -> Result<MoeOutput> {
        self.forward_routed_in(x, routings, None, None)
    }

    /// `forward_routed` with the tokens' sequence length (None: one sequence) and a residual to
    /// add to the output (`forward_sequences_add`).
    fn forward_routed_in(
        &self,
        x: &Tensor,
        routings: &[Routing],
        seq_len: Option<usize>,
        residual: Option<&Tensor>,
    ) -> Result<MoeOutput> {
        let t = x.shape()[0];
        let n = self.config.experts;
        let nulls = self.config.null_experts;
        // the routers score n + N experts; only the n real ones are dispatched
        let routing = Routing::concat(routings)?;
        let routing = if nulls > 0 {
            routing.without_null_experts(n)?
        } else {
            routing
        };
        // Capacity counts slots, or tokens for routers whose experts per token vary (XMoE).
        let variable = self.router.variable_experts_per_token();
        let counted = if variable {
            routing.tokens
        } else {
            routing.len()
        };
        let source = if routings.len() == 1 {
            x.clone()
        } else {
            Tensor::concat(&vec![x.clone(); routings.len()], 0)?
        };
        let plain = routings.len() == 1 && nulls == 0 && !variable;
        // the residual is added by the combine where nothing follows it (no Default MoE terms,
        // ω or shared experts), else by an add at the end
        let training = self.training.load(Ordering::Relaxed);
        let combine_is_last = self.omega.is_none()
            && self.shared.is_none()
            && (!training || routings.iter().all(|r| r.defaults.is_none()));
        let mut residual_added = false;
        let dense =
            match super::all_experts::dense_weights(&routing, self.capacity(), counted, plain) {
                Some(w) if self.all_experts_path.unwrap_or(source.device().is_gpu()) => self
                    .experts
                    .forward_all_experts(&source, w)?
                    .map(|y| (y, w.clone())),
                _ => None,
            };
        let (mut y, combined) = match dense {
            Some((y, w)) => (y, Combined::AllExperts(w)),
            None => {
                let plan = DispatchPlan::build_sized(&routing, self.capacity(), counted)?;
                // token-choice: each token's rows are its assignments' `position`s, which
                // the gather's backward and the combine read instead of sorting by token
                let slots = routing
                    .slots_per_token
                    .filter(|&k| (t * routings.len()).checked_mul(k) == Some(routing.len()));
                let rows = match slots {
                    Some(_) => source.index_select_by_slots(&plan.row_token, &plan.position)?,
                    None => source.index_select(0, &plan.row_token)?,
                };
                let out = self.experts.forward_rows(&rows, &plan)?;
                // y[t] = Σ over t's rows of weight·output (one fused op; see
                // `weighted_index_scatter`), the weights read where the routing has them (per
                // slot) when each token's rows are known, else first put in row order (a
                // reordering whose backward gathers by the inverse: no scatter-add)
                let len = t * routings.len();
                let (mut y, w) = match slots {
                    Some(_) => (
                        match residual.filter(|_| combine_is_last) {
                            Some(h) => {
                                residual_added = true;
                                out.weighted_index_scatter_per_slot_add(
                                    &routing.weight,
                                    &plan.row_token,
                                    len,
                                    &plan.position,
                                    &plan.order,
                                    h,
                                )?
                            }
                            None => out.weighted_index_scatter_per_slot(
                                &routing.weight,
                                &plan.row_token,
                                len,
                                &plan.position,
                                &plan.order,
                            )?,
                        },
                        WeightOrder::PerSlot(routing.weight.clone()),
                    ),
                    _ => {
                        let w = routing.weight.permute_rows(&plan.order, &plan.position)?;
                        let y = out.weighted_index_scatter(&w, &plan.row_token, len)?;
                        (y, WeightOrder::PerRow(w))
                    }
                };
                if training {
                    y = super::default_outputs::add_default_terms(
                        y,
                        routings,
                        &out,
                        &plan,
                        (n, nulls),
                    )?;
                }
                (y, Combined::Plan(plan, w))
            }
        };
        if let Some(omega) = &self.omega {
            // y = ω ⊙ Σ w·f: the same as scaling every expert output by ω before the combine
            y = y.mul(&omega.get().to_dtype(y.dtype())?)?;
        }
        if let Some(shared) = &self.shared {
            // every token (of every task) also passes through the shared experts
            y = shared.forward_add(&source, &y)?;
        }

        let balancing = self.config.balancing;
        // valid assignments per expert of each routing, before capacity (no gradient)
        let routed: Vec<Tensor> = if let (Combined::Plan(plan, _), true) = (&combined, plain) {
            // one routing counting every slot: the plan has counted them
            vec![plan.routed_per_expert.clone()]
        } else {
            crate::no_grad(|| {
                routings
                    .iter()
                    .map(|r| count_per_expert(r, variable))
                    .collect::<Result<Vec<_>>>()
            })?
        };
        let alpha = self.config.balance_loss;
        let aux_on = balancing.method == BalanceMethod::Aux && alpha > 0.0;
        let window = if aux_on && balancing.scope == BalanceScope::Global {
            Some(self.window_counts(&routed, training)?)
        } else {
            None
        };
        // the auxiliary losses are of the f32 class (see `autocast.rs`): f32 under mixed precision
        let aux_dtype = match y.dtype() {
            crate::DType::F16 => crate::DType::F32,
            dtype => dtype,
        };
        // the terms in order, with no zero to start from (one add fewer)
        let mut aux: Option<Tensor> = None;
        let mut add_aux = |term: Tensor| -> Result<()> {
            let term = term.to_dtype(aux_dtype)?;
            aux = Some(match aux.take() {
                Some(sum) => sum.add(&term)?,
                None => term,
            });
            Ok(())
        };
        for (r, counts) in routings.iter().zip(&routed) {
            if aux_on {
                let loss = match (balancing.scope, seq_len, &window) {
                    (BalanceScope::Sequence, Some(l), _) => {
                        aux_loss::sequence_balance_loss(r, l, alpha, variable)?
                    }
                    (_, _, Some(w)) => aux_loss::balance_loss(r, w, alpha)?,
                    _ => aux_loss::balance_loss(r, counts, alpha)?,
                };
                add_aux(loss)?;
            }
            if training && balancing.uses_selection_bias() {
                let sel = r.selection.as_ref().ok_or_else(|| {
                    Error::Invalid(format!(
                        "--balance {} needs routers that keep a selection bias; a routing of this layer has none",
                        balancing.method.name()
                    ))
                })?;
                match balancing.method {
                    BalanceMethod::AuxFree => sel.bias.update_aux_free(counts, balancing.rate)?,
                    _ => sel
                        .bias
                        .update_quantile(&sel.scores, r.len() / r.tokens.max(1))?,
                }
            }
            if self.config.z_loss > 0.0 {
                add_aux(aux_loss::z_loss(r, self.config.z_loss)?)?;
            }
            if let Some(own) = &r.aux_loss {
                add_aux(own.clone())?;
            }
        }
        let aux = match aux {
            Some(aux) => aux,
            None => Tensor::zeros(&[], aux_dtype, y.device())?,
        };
        // the combine weight each expert received (summed only when asked for)
        let (kept_per_expert, expert_weights) = match &combined {
            Combined::Plan(plan, w) => (
                plan.kept_per_expert.clone(),
                ExpertWeights::PerRow {
                    weight: match w {
                        WeightOrder::PerRow(w) | WeightOrder::PerSlot(w) => w.detach(),
                    },
                    slot_of_row: match w {
                        WeightOrder::PerRow(_) => None,
                        WeightOrder::PerSlot(_) => Some(plan.order.clone()),
                    },
                    kept: plan.row_kept.clone(),
                    expert: plan.row_expert_clamped.clone(),
                    experts: self.config.experts,
                },
            ),
            // nothing is dropped on the all-experts path: kept = routed
            Combined::AllExperts(w) => (routed[0].clone(), ExpertWeights::PerToken(w.detach())),
        };
        let routed_per_expert = match &combined {
            Combined::Plan(plan, _) => plan.routed_per_expert.clone(),
            Combined::AllExperts(_) => routed[0].clone(),
        };
        let stats = RoutingStats {
            kept_per_expert,
            expert_weights,
            routed_per_expert,
            // the diagnostics describe the real experts (`without_null_experts`)
            probs: routing.probs.detach(),
            logits: routing.logits.detach(),
            tokens: t * routings.len(),
            metrics: routings.iter().flat_map(|r| r.metrics.clone()).collect(),
        };
        if let (Some(h), false) = (residual, residual_added) {
            y = h.add(&y)?;
        }
        Ok(MoeOutput {
            y,
            aux_loss: aux,
            stats,
            score_terms: routings.iter().filter_map(|r| r.score.clone()).collect(),
        })
    }
}

/// How a forward pass combined the experts' outputs: through a dispatch plan (with its
/// weights), or on the all-experts path (with the dense weights `[T, n]`).
enum Combined {
    Plan(DispatchPlan, WeightOrder),
    AllExperts(Tensor),
}

/// The combine weights of a plan, `[A]`: per row (the plan's order) or per slot (the routing's
/// own order, when each token's rows were read through the plan's `position`).
enum WeightOrder {
    PerRow(Tensor),
    PerSlot(Tensor),
}

/// Fails unless `router` can be balanced as `balancing` asks ([`Balancing::check`]).
pub(crate) fn check_balancing(
    balancing: &Balancing,
    router: &dyn Router,
    k: usize,
    n: usize,
) -> Result<()> {
    balancing.check(router.name(), router.selection_bias().is_some(), k, n)
}

/// Valid assignments per expert of one routing (`[n]`, float); with `first_only`, only the first
/// choices (rank 0) are counted (XMoE's balance loss on the top-1 assignment).
fn count_per_expert(r: &Routing, first_only: bool) -> Result<Tensor> {
    let valid = aux_loss::valid_assignments(r, first_only)?;
    valid.index_scatter(0, &r.expert, r.experts)
}

impl MoeLayer {
    /// The state name of the `global` balance window's counts (`[n]` F32).
    pub const WINDOW_COUNTS: &'static str = "balance.window_counts";
    /// The state name of the number of batches in the `global` balance window.
    pub const WINDOW_STEPS: &'static str = "balance.window_steps";

    /// Restores one of the two window entries (the other keeps its value until it arrives).
    fn load_window(&self, name: &str, value: &Tensor) -> Result<()> {
        let n = self.routed_experts();
        let mut device = Device::Cpu;
        self.experts
            .visit_params("", &mut |_, p| device = p.get().device());
        let mut slot = self
            .window
            .lock()
            .map_err(|_| Error::Invalid("MoE balance window lock poisoned".into()))?;
        let (mut counts, mut steps) = slot
            .take()
            .unwrap_or((Tensor::zeros(&[n], crate::DType::F32, device)?, 0));
        if name == Self::WINDOW_COUNTS {
            if value.shape() != [n] {
                return Err(Error::Shape(format!(
                    "MoE state {name}: expected [{n}], got {:?}",
                    value.shape()
                )));
            }
            counts = value.to_dtype(crate::DType::F32)?.to_device(device)?;
        } else {
            let v = value.to_vec_f64()?;
            match v.as_slice() {
                [x] if x.is_finite() && *x >= 0.0 && x.fract() == 0.0 => steps = *x as usize,
                _ => {
                    return Err(Error::Invalid(format!(
                        "MoE state {name}: expected one whole number, got {v:?}"
                    )));
                }
            }
        }
        *slot = Some((counts, steps));
        Ok(())
    }
}

impl Parameters for MoeLayer {
    /// Every parameter, named `router.*` (with SparseMixer's `router.omega`) and `experts.*`.
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(String, &Param)) {
        self.router.visit_params(&join(prefix, "router"), f);
        if let Some(omega) = &self.omega {
            f(join(&join(prefix, "router"), "omega"), omega);
        }
        self.experts.visit_params(&join(prefix, "experts"), f);
        if let Some(shared) = &self.shared {
            shared.visit_params(&join(prefix, "shared"), f);
        }
    }

    /// Switches router noise and capacity between training and evaluation.
    fn set_training(&self, on: bool) {
        self.training.store(on, Ordering::Relaxed);
        self.router.set_training(on);
    }

    /// The router's step-to-step state (see [`Router`]), named `router.<name>`.
    /// With the `global` balance scope, also `balance.window_counts` and `balance.window_steps`.
    fn state(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out: Vec<(String, Tensor)> = self
            .router
            .state()?
            .into_iter()
            .map(|(name, t)| (join("router", &name), t))
            .collect();
        let window = self
            .window
            .lock()
            .map_err(|_| Error::Invalid("MoE balance window lock poisoned".into()))?;
        let b = self.config.balancing;
        if b.method == BalanceMethod::Aux && b.scope == BalanceScope::Global {
            // present from the start (zero counts, no batches) so a checkpoint's names are fixed
            let (counts, steps) = match window.as_ref() {
                Some((c, s)) => (c.to_device(Device::Cpu)?, *s),
                None => (
                    Tensor::zeros(&[self.config.experts], crate::DType::F32, Device::Cpu)?,
                    0,
                ),
            };
            out.push((Self::WINDOW_COUNTS.into(), counts));
            out.push((
                Self::WINDOW_STEPS.into(),
                Tensor::scalar(steps as f64, crate::DType::F64, Device::Cpu)?,
            ));
        }
        Ok(out)
    }

    /// Restores one entry of [`Parameters::state`] (`router.<name>`); a name this layer does not
    /// hold is an error naming it.
    fn load_state(&self, name: &str, value: &Tensor) -> Result<()> {
        if name == Self::WINDOW_COUNTS || name == Self::WINDOW_STEPS {
            return self.load_window(name, value);
        }
        match crate::nn::within("router", name) {
            Some(rest) => self.router.load_state(rest, value),
            None => Err(Error::Invalid(format!(
                "the MoE layer has no state named {name:?}"
            ))),
        }
    }
}
