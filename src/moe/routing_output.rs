//! [`Routing`]: what a router hands to the MoE layer — a flat list of (token, expert, weight)
//! assignments plus what the auxiliary losses and metrics need.
//!
//! Token-choice routers produce `K` slots per token, flattened so that assignment `a` belongs to
//! token `a / K` and slot `a % K`; Expert Choice produces `k'` tokens per expert. Either way the
//! dispatch plan sees the same list. Only `weight` carries gradient (through the router's own
//! backward rule); indices never do. [`Routing::concat`] joins the routings of a multi-gate
//! layer's tasks into one dispatch.

use super::default_outputs::DefaultOutputs;
use super::score_function::ScoreTerm;
use super::selection_bias::SelectionBias;
use crate::{DType, Device, Error, Result, Tensor};
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

/// The routing decision for one batch of `tokens` tokens over `experts` experts.
#[derive(Clone, Debug)]
pub struct Routing {
    /// `[A]` I32: the token of each assignment
    pub token: Tensor,
    /// `[A]` I32: the expert of each assignment
    pub expert: Tensor,
    /// `[A]` float, tracked: the combine weight (its backward is the router's rule)
    pub weight: Tensor,
    /// `[A]` float 0/1: whether the assignment exists (threshold routing leaves slots empty)
    pub valid: Tensor,
    /// `[A]` float: the slot (choice rank) of the assignment: 0 for first choices, 1 for second...
    pub rank: Tensor,
    /// `[T, n]` the router's probabilities over all experts (balance loss `P_i`, entropy)
    pub probs: Tensor,
    /// `[T, n]` the router's logits (z-loss)
    pub logits: Tensor,
    /// `Some(k)` when assignment `a` is token `a / k`'s (a token-choice routing: each token's
    /// `k` slots, valid or not, one after another; `token` is then `[0, …, 0, 1, …]`), which
    /// lets the layer's combine find each token's rows without sorting them by token
    /// ([`Tensor::weighted_index_scatter_by_slots`]); `None` when assignments come in any other
    /// order (expert choice)
    pub slots_per_token: Option<usize>,
    /// number of tokens
    pub tokens: usize,
    /// number of experts
    pub experts: usize,
    /// the router's own regulariser, a tracked scalar added to the layer's auxiliary loss
    /// (MOESART's trimmed lasso, DSelect-k's entropy term); None for most routers
    pub aux_loss: Option<Tensor>,
    /// router-specific scalar metrics, `(name, scalar tensor)`, read back once per epoch (e.g.
    /// DSelect-k's fraction of saturated selectors); reported beside the layer's statistics
    pub metrics: Vec<(&'static str, Tensor)>,
    /// for routers whose gradient is the score function (`reinforce`): the log-probability of
    /// each token's sampled expert, which the loss turns into the REINFORCE estimate
    /// ([`ScoreTerm::surrogate`]); None for the others
    pub score: Option<ScoreTerm>,
    /// for routers that keep a selection-only bias: the biased scores the experts were chosen
    /// by and the bias itself, which aux-free and quantile balancing update
    /// ([`Routing::with_selection`]); None for the others
    pub selection: Option<Selection>,
    /// for routings in which every token uses every expert, in expert order
    /// ([`Routing::every_expert`]): the combine weights as a matrix `[T, n]`, tracked (`weight`
    /// is this, flattened), which the layer's all-experts path reads instead of building a
    /// dispatch plan; None for the others
    pub dense: Option<Tensor>,
    /// for `default-moe`, in training: the probabilities of the experts each token did not use
    /// and the default outputs that answer for them, which the layer turns into the dense
    /// router gradient ([`DefaultTerm`]); None for the others
    pub defaults: Option<DefaultTerm>,
}

/// What Default MoE's layer step needs from its router (`default_outputs.rs`).
#[derive(Clone, Debug)]
pub struct DefaultTerm {
    /// `[T, n]` tracked: `π` with each token's chosen experts zeroed
    pub unselected: Tensor,
    /// the router's default outputs (a shared handle: updating it updates the router)
    pub outputs: DefaultOutputs,
}

/// How a router with a selection-only bias chose its experts.
#[derive(Clone, Debug)]
pub struct Selection {
    /// `[T, n]` detached: the scores plus the bias, as the router ranked them
    pub scores: Tensor,
    /// the router's bias (a shared handle: updating it updates the router)
    pub bias: SelectionBias,
}

impl Routing {
    /// Number of assignments `A`.
    pub fn len(&self) -> usize {
        self.token.numel()
    }
    /// True when there are no assignments.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Builds the routing of a token-choice router from `[T, K]` expert indices and weights
    /// (all slots valid unless `valid` is given).
    pub fn token_choice(
        idx: &Tensor,
        weights: &Tensor,
        valid: Option<&Tensor>,
        probs: Tensor,
        logits: Tensor,
    ) -> Result<Routing> {
        let (t, k) = (idx.shape()[0], idx.shape()[1]);
        let dev = idx.device();
        let (token, _) = slot_tables(t, k, dev)?;
        let (ones, rank) = slot_tables_float(t, k, weights.dtype(), dev)?;
        let a = t * k;
        let valid = match valid {
            Some(v) => v.reshape(&[a])?,
            None => ones,
        };
        Ok(Routing {
            token,
            expert: idx.reshape(&[a])?,
            weight: weights.reshape(&[a])?,
            valid,
            rank,
            experts: probs.shape()[1],
            probs,
            logits,
            slots_per_token: Some(k),
            tokens: t,
            aux_loss: None,
            metrics: Vec::new(),
            score: None,
            selection: None,
            defaults: None,
            dense: None,
        })
    }

    /// The routing of a router that sends every token to every expert (the dense `softmax`
    /// router, the straight-through estimators in training): `weights: [T, n]` (tracked) become
    /// `A = T·n` assignments, token `a / n` to expert `a % n`, and are kept as
    /// [`Routing::dense`] for the layer's all-experts path.
    ///
    /// # Errors
    /// [`Error::Shape`] when `weights` is not `[T, n]` with `probs` and `logits` of its shape.
    ///
    /// ```
    /// # use moegrad::{DType, Device, Tensor};
    /// # use moegrad::moe::Routing;
    /// let w = Tensor::from_f32(vec![0.25, 0.75, 0.5, 0.5], &[2, 2], Device::cpu())?;
    /// let r = Routing::every_expert(&w, w.clone(), w.clone())?;
    /// assert_eq!(r.expert.to_vec_f64()?, vec![0.0, 1.0, 0.0, 1.0]);
    /// assert_eq!(r.token.to_vec_f64()?, vec![0.0, 0.0, 1.0, 1.0]);
    /// assert!(r.dense.is_some());
    /// # Ok::<(), moegrad::Error>(())
    /// ```
    pub fn every_expert(weights: &Tensor, probs: Tensor, logits: Tensor) -> Result<Routing> {
        if weights.rank() != 2
            || probs.shape() != weights.shape()
            || logits.shape() != weights.shape()
        {
            return Err(Error::Shape(format!(
                "every_expert: weights {:?}, probs {:?} and logits {:?} must all be [T, n]",
                weights.shape(),
                probs.shape(),
                logits.shape()
            )));
        }
        // a token-choice routing whose K = n slots name the experts in order: slot s is expert s
        let (t, n) = (weights.shape()[0], weights.shape()[1]);
        let (_, slot) = slot_tables(t, n, weights.device())?;
        let mut routing =
            Routing::token_choice(&slot.reshape(&[t, n])?, weights, None, probs, logits)?;
        routing.dense = Some(weights.clone());
        Ok(routing)
    }

    /// The same routing, marked as chosen by the biased scores `chosen` (`[T, n]`) of `bias`.
    pub fn with_selection(mut self, bias: &SelectionBias, chosen: &Tensor) -> Routing {
        self.selection = Some(Selection {
            scores: chosen.detach(),
            bias: bias.clone(),
        });
        self
    }
}

type SlotCache = Mutex<HashMap<(usize, usize, Device), (Tensor, Tensor)>>;

/// `(token, slot)` of every assignment for `T` tokens with `K` slots, I32, made once per shape
/// and device (no upload inside a steady-state step).
pub(crate) fn slot_tables(t: usize, k: usize, device: Device) -> Result<(Tensor, Tensor)> {
    static CACHE: OnceLock<SlotCache> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    if let Some(hit) = cache
        .lock()
        .ok()
        .and_then(|c| c.get(&(t, k, device)).cloned())
    {
        return Ok(hit);
    }
    let a = t * k;
    let token = Tensor::from_i32(
        (0..a).map(|i| (i / k.max(1)) as i32).collect(),
        &[a],
        device,
    )?;
    let slot = Tensor::from_i32(
        (0..a).map(|i| (i % k.max(1)) as i32).collect(),
        &[a],
        device,
    )?;
    if let Ok(mut c) = cache.lock() {
        c.insert((t, k, device), (token.clone(), slot.clone()));
    }
    Ok((token, slot))
}

type FloatSlotCache = Mutex<HashMap<(usize, usize, DType, Device), (Tensor, Tensor)>>;

/// `(ones, slot)` of every assignment for `T` tokens with `K` slots in the float `dtype`: the
/// `valid` and `rank` of a routing whose slots are all filled, made once per shape, dtype and
/// device (so a steady-state step neither uploads nor fills them).
pub(crate) fn slot_tables_float(
    t: usize,
    k: usize,
    dtype: DType,
    device: Device,
) -> Result<(Tensor, Tensor)> {
    static CACHE: OnceLock<FloatSlotCache> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    let key = (t, k, dtype, device);
    if let Some(hit) = cache.lock().ok().and_then(|c| c.get(&key).cloned()) {
        return Ok(hit);
    }
    let (_, slot) = slot_tables(t, k, device)?;
    let tables = (
        Tensor::ones(&[t * k], dtype, device)?,
        slot.to_dtype(dtype)?,
    );
    if let Ok(mut c) = cache.lock() {
        c.insert(key, tables.clone());
    }
    Ok(tables)
}

/// `0, 1, ..., n−1` as a float tensor, computed on the device (a prefix sum of ones).
pub(crate) fn arange_f(n: usize, dtype: DType, device: Device) -> Result<Tensor> {
    Tensor::ones(&[n], dtype, device)?
        .cumsum(0)?
        .add_scalar(-1.0)
}

impl Routing {
    /// Joins routings of the same `T` tokens (one per task): task `i`'s tokens become `i·T + t`.
    pub fn concat(parts: &[Routing]) -> Result<Routing> {
        let first = parts
            .first()
            .ok_or_else(|| Error::Invalid("no routing to dispatch".into()))?;
        if parts.len() == 1 {
            return Ok(first.clone());
        }
        let t = first.tokens;
        let cat = |f: &dyn Fn(&Routing) -> Tensor| {
            Tensor::concat(&parts.iter().map(f).collect::<Vec<_>>(), 0)
        };
        let shifted: Vec<Tensor> = parts
            .iter()
            .enumerate()
            .map(|(i, r)| {
                r.token
                    .to_dtype(crate::DType::F32)?
                    .add_scalar((i * t) as f64)?
                    .to_dtype(crate::DType::I32)
            })
            .collect::<Result<_>>()?;
        Ok(Routing {
            token: Tensor::concat(&shifted, 0)?,
            expert: cat(&|r| r.expert.clone())?,
            weight: cat(&|r| r.weight.clone())?,
            valid: cat(&|r| r.valid.clone())?,
            rank: cat(&|r| r.rank.clone())?,
            probs: cat(&|r| r.probs.clone())?,
            logits: cat(&|r| r.logits.clone())?,
            // task i's assignments follow task i − 1's, and its tokens are i·T + t: still
            // token-major when every part is, with one k
            slots_per_token: first
                .slots_per_token
                .filter(|&k| parts.iter().all(|r| r.slots_per_token == Some(k))),
            tokens: t * parts.len(),
            experts: first.experts,
            aux_loss: parts.iter().filter_map(|r| r.aux_loss.clone()).try_fold(
                None::<Tensor>,
                |acc, a| match acc {
                    None => Ok::<_, Error>(Some(a)),
                    Some(s) => Ok(Some(s.add(&a)?)),
                },
            )?,
            metrics: parts.iter().flat_map(|r| r.metrics.clone()).collect(),
            // each task's router has its own score term and baseline: the layer reads them from
            // the parts (`MoeOutput::score_terms`), not from the joined routing
            score: None,
            selection: None,
            // the layer reads each part's defaults itself (`add_default_terms`)
            defaults: None,
            // several routings take the sparse path
            dense: None,
        })
    }
}
