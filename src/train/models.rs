//! The models `moegrad train` builds, each with one 10-way output per task (one for MNIST, two
//! for MultiMNIST):
//!
//! * `mlp`, `cnn`: a shared trunk and a linear head per task. The CNN is the expert network of
//!   the MOESART MultiMNIST setup (conv 5×5×10, ReLU, pool; conv 5×5×20, ReLU, pool; dense 50).
//! * `moe-mlp`: one MoE layer of MLP experts (hidden `--expert-hidden`, default 128; output 64) on the flattened image,
//!   ReLU, a linear head per task.
//! * `moe-cnn`: one MoE layer of the MOESART CNN experts (output 50), a head per task.
//! * `mmoe-cnn`: multi-gate MoE (MOESART/DSelect-k multi-task setup): one router per task over
//!   the shared CNN experts, and a tower per task (dense 50 → 50, ReLU → 10).

use super::config::{DataKind, ModelKind, OptimizerKind, TrainConfig};
use crate::moe::{
    Capacity, ExpertKind, MoeConfig, MoeLayer, Router, RoutingStats, ScoreTerm, build_router,
};
use crate::nn::{
    Activation, Conv2d, Flatten, Init, Linear, MaxPool2d, Module, Param, Parameters, Sequential,
    join, within,
};
use crate::{Device, Result, Tensor};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// What a model returns for a batch.
pub struct ModelOutput {
    /// logits `[B, 10]` per task
    pub logits: Vec<Tensor>,
    /// auxiliary loss to add to the task loss (MoE balance/z-loss)
    pub aux_loss: Option<Tensor>,
    /// routing statistics of each MoE layer, in order (empty for a dense model)
    pub routing: Vec<RoutingStats>,
    /// the score-function terms of routers trained with REINFORCE (see
    /// `moe/score_function.rs`): the training loop adds each one's surrogate to the objective
    pub score_terms: Vec<ScoreTerm>,
}

/// A model trained by `moegrad train`: a forward pass over a batch, on top of the
/// [`Parameters`] protocol (its named parameters, training flag and step-to-step state, e.g.
/// `moe.router.noise_calls`, which checkpoints save under `state.<name>`).
pub trait TaskModel: Parameters {
    /// Runs a batch of images `[B, 1, side, side]`.
    fn forward(&self, x: &Tensor) -> Result<ModelOutput>;
}

/// Prefixes the names of `state` with `scope` and appends them to `out`.
fn push_scoped(out: &mut Vec<(String, Tensor)>, scope: &str, state: Vec<(String, Tensor)>) {
    out.extend(state.into_iter().map(|(n, t)| (join(scope, &n), t)));
}

/// The error for a state name no part of a model holds.
fn no_such_state(name: &str) -> crate::Error {
    crate::Error::Invalid(format!("the model has no state named {name:?}"))
}

/// A shared trunk and one classification head per task.
pub struct MultiHead {
    /// the shared layers
    pub trunk: Sequential,
    /// one head per task
    pub heads: Vec<Linear>,
}

impl TaskModel for MultiHead {
    fn forward(&self, x: &Tensor) -> Result<ModelOutput> {
        let h = self.trunk.forward(x)?;
        let logits = self
            .heads
            .iter()
            .map(|head| head.forward(&h))
            .collect::<Result<_>>()?;
        Ok(ModelOutput {
            logits,
            aux_loss: None,
            routing: Vec::new(),
            score_terms: Vec::new(),
        })
    }
}

impl Parameters for MultiHead {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(String, &Param)) {
        self.trunk.visit_params(&join(prefix, "trunk"), f);
        for (t, head) in self.heads.iter().enumerate() {
            head.visit_params(&join(prefix, &join("heads", &t.to_string())), f);
        }
    }
    fn set_training(&self, on: bool) {
        self.trunk.set_training(on);
    }
    fn state(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        push_scoped(&mut out, "trunk", self.trunk.state()?);
        for (t, head) in self.heads.iter().enumerate() {
            push_scoped(&mut out, &join("heads", &t.to_string()), head.state()?);
        }
        Ok(out)
    }
    fn load_state(&self, name: &str, value: &Tensor) -> Result<()> {
        if let Some(rest) = within("trunk", name) {
            return self.trunk.load_state(rest, value);
        }
        for (t, head) in self.heads.iter().enumerate() {
            if let Some(rest) = within(&join("heads", &t.to_string()), name) {
                return head.load_state(rest, value);
            }
        }
        Err(no_such_state(name))
    }
}

/// An MoE layer (with extra routers for a multi-gate MoE) and a tower per task.
pub struct MoeModel {
    /// the MoE layer (its router is task 0's)
    pub moe: MoeLayer,
    /// routers of tasks 1.. (multi-gate only)
    pub extra_gates: Vec<Box<dyn Router>>,
    /// one tower per task
    pub towers: Vec<Sequential>,
    /// ReLU after the MoE layer (MLP experts)
    pub activate: bool,
    /// the experts are fixed (synthetic-b): their parameters are not trained or saved
    pub frozen_experts: bool,
}

impl TaskModel for MoeModel {
    fn forward(&self, x: &Tensor) -> Result<ModelOutput> {
        let b = x.shape()[0];
        let flat = x.reshape(&[b, x.numel() / b.max(1)])?;
        let mut routings = vec![self.moe.route(&flat)?];
        for g in &self.extra_gates {
            routings.push(crate::moe::route_in_f32(g.as_ref(), &flat)?);
        }
        let out = self.moe.forward_routed(&flat, &routings)?;
        let mut h = out.y;
        if self.activate {
            h = h.relu()?;
        }
        let tasks = self.towers.len();
        let logits = (0..tasks)
            .map(|t| {
                // multi-gate: task t reads its own rows t·B..(t+1)·B; single gate: all tasks share them
                let rows = if routings.len() > 1 {
                    h.slice(0, t * b, (t + 1) * b)?
                } else {
                    h.clone()
                };
                self.towers[t].forward(&rows)
            })
            .collect::<Result<_>>()?;
        Ok(ModelOutput {
            logits,
            aux_loss: Some(out.aux_loss),
            routing: vec![out.stats],
            score_terms: out.score_terms,
        })
    }
}

impl Parameters for MoeModel {
    /// Every parameter but frozen experts' (synthetic-b: they are neither trained nor saved).
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(String, &Param)) {
        let frozen_scope = join(prefix, "moe.experts");
        let frozen = self.frozen_experts;
        self.moe.visit_params(&join(prefix, "moe"), &mut |n, p| {
            if !(frozen && n.starts_with(&frozen_scope)) {
                f(n, p)
            }
        });
        for (t, g) in self.extra_gates.iter().enumerate() {
            g.visit_params(&join(prefix, &extra_gate_scope(t)), f);
        }
        for (t, tower) in self.towers.iter().enumerate() {
            tower.visit_params(&join(prefix, &join("towers", &t.to_string())), f);
        }
    }
    fn set_training(&self, on: bool) {
        self.moe.set_training(on);
        for g in &self.extra_gates {
            g.set_training(on);
        }
        for t in &self.towers {
            t.set_training(on);
        }
    }
    fn state(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        push_scoped(&mut out, "moe", self.moe.state()?);
        for (t, g) in self.extra_gates.iter().enumerate() {
            push_scoped(&mut out, &extra_gate_scope(t), g.state()?);
        }
        for (t, tower) in self.towers.iter().enumerate() {
            push_scoped(&mut out, &join("towers", &t.to_string()), tower.state()?);
        }
        Ok(out)
    }
    fn load_state(&self, name: &str, value: &Tensor) -> Result<()> {
        for (t, g) in self.extra_gates.iter().enumerate() {
            if let Some(rest) = within(&extra_gate_scope(t), name) {
                return g.load_state(rest, value);
            }
        }
        // the layer's router and its balance window
        if let Some(rest) = within("moe", name) {
            return self.moe.load_state(rest, value);
        }
        for (t, tower) in self.towers.iter().enumerate() {
            if let Some(rest) = within(&join("towers", &t.to_string()), name) {
                return tower.load_state(rest, value);
            }
        }
        Err(no_such_state(name))
    }
}

/// The name scope of the router of task `t + 1` of a multi-gate MoE (`moe.router1`, ...).
fn extra_gate_scope(t: usize) -> String {
    join("moe", &format!("router{}", t + 1))
}

pub(crate) fn capacity(factor: f64) -> Capacity {
    if factor > 0.0 {
        Capacity::Factor {
            factor,
            min_capacity: 4,
        }
    } else {
        Capacity::Dropless
    }
}

/// The MoE layer settings of a run: `experts` experts `d → hidden → d` with the run's router,
/// k, capacities, auxiliary-loss coefficients, router options and seed.
fn moe_config(cfg: &TrainConfig, d: usize, hidden: usize, experts: usize) -> MoeConfig {
    let mut mc = MoeConfig::new(d, hidden, experts, cfg.k);
    mc.router = cfg.router.clone();
    mc.capacity = capacity(cfg.capacity_factor);
    mc.eval_capacity = capacity(cfg.eval_capacity_factor);
    mc.balance_loss = cfg.balance_loss;
    mc.balancing = cfg.balancing;
    mc.z_loss = cfg.z_loss;
    mc.null_experts = cfg.null_experts;
    mc.router_options = cfg.router_options.clone();
    mc.seed = cfg.seed;
    mc
}

/// What training a model costs, counted from the shapes [`build`] and [`build_synthetic_b`]
/// allocate (see [`memory_estimate`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryEstimate {
    /// parameters the model allocates, trained or frozen (the router counted as one linear map
    /// `d → n`; routers with more parameters, such as DSelect-k's selectors, are a little larger)
    pub parameters: u64,
    /// the trained ones (all but synthetic-b's frozen bank)
    pub trainable: u64,
    /// about the bytes of one batch's activations and their gradients
    pub activation_bytes: u64,
    /// about the bytes training holds: 4 per parameter, 4 more per trainable parameter for its
    /// gradient and 4 per optimizer slot (Adam 2, SGD 1), and the activations
    pub total_bytes: u64,
}

/// A checked sum of checked products: `Σ_terms Π factors`, `None` past 64 bits.
fn sum_of_products(terms: &[&[usize]]) -> Option<u64> {
    terms.iter().try_fold(0u64, |acc, factors| {
        let p = factors
            .iter()
            .try_fold(1u64, |p, &f| p.checked_mul(f as u64))?;
        acc.checked_add(p)
    })
}

/// Side of the feature map after the LeNet trunk (two 5×5 convolutions, each followed by a 2×2
/// pool) on `side × side` images; `None` below 16 pixels, where it vanishes.
fn lenet_after(side: usize) -> Option<usize> {
    Some(((side.checked_sub(4)? / 2).checked_sub(4)?) / 2).filter(|&a| a > 0)
}

/// Parameters and one batch's activations (in floats) of a LeNet trunk on `side × side`
/// images with a dense layer of 50: the two convolutions' unfolded windows, outputs and pooled
/// maps, each with its gradient.
fn lenet_sizes(side: usize) -> Option<(u64, u64)> {
    let after = lenet_after(side)?;
    let (c1, p1) = (side - 4, (side - 4) / 2);
    let c2 = p1 - 4;
    let params = sum_of_products(&[
        &[10, 25],
        &[10],
        &[20, 250],
        &[20],
        &[20 * after * after, 50],
        &[50],
        &[50, 50],
        &[50],
    ])?;
    let acts = sum_of_products(&[
        &[c1, c1, 25 + 10],
        &[p1, p1, 10],
        &[c2, c2, 250 + 20],
        &[after, after, 20],
        &[100],
    ])?;
    Some((params, acts.checked_mul(2)?))
}

/// Counts what training `cfg`'s model on `side × side` images (`tasks` heads) would hold, with
/// batches of `batch_rows` examples, before anything is allocated. Every product is checked,
/// so absurd sizes give `None` instead of wrapping around.
pub fn memory_estimate(
    cfg: &TrainConfig,
    side: usize,
    tasks: usize,
    batch_rows: usize,
) -> Option<MemoryEstimate> {
    let (n, k, h) = (cfg.experts, cfg.k, cfg.expert_hidden);
    let d = side.checked_mul(side)?;
    let linear = |i: usize, o: usize| sum_of_products(&[&[i, o], &[o]]);
    // (parameters, trainable, activation floats per example)
    let (params, trainable, acts): (u64, u64, u64) = match (cfg.data, cfg.model) {
        // the language models are sized by `GptConfig::check_memory` and
        // `DecoderConfig::check_memory`
        (
            _,
            ModelKind::Gpt
            | ModelKind::MoeGpt
            | ModelKind::Llama
            | ModelKind::Mixtral
            | ModelKind::Qwen2Moe
            | ModelKind::Olmoe
            | ModelKind::DeepseekMoe,
        ) => (0, 0, 0),
        (DataKind::SyntheticB, _) => {
            use crate::data::{SYNTHETIC_B_EXPERT_OUT as OUT, SYNTHETIC_B_INPUT as IN};
            let bank = sum_of_products(&[&[n, IN, OUT], &[n, OUT, OUT]])?;
            let trained = linear(IN, n)?.checked_add(linear(OUT, 2)?)?;
            let acts = sum_of_products(&[&[k, IN + 2 * OUT], &[n]])?;
            (bank.checked_add(trained)?, trained, acts)
        }
        (_, ModelKind::Mlp) => {
            let p = sum_of_products(&[&[d, 256], &[256], &[256, 128], &[128], &[tasks, 129, 10]])?;
            (p, p, d.checked_add(2 * (256 + 128))? as u64)
        }
        (_, ModelKind::Cnn) => {
            let (trunk, acts) = lenet_sizes(side)?;
            // the dense 50 → 50 of the expert version is not in the trunk
            let p = trunk - 2550 + sum_of_products(&[&[tasks, 51, 10]])?;
            (p, p, acts.checked_add(d as u64)?)
        }
        (_, ModelKind::MoeMlp | ModelKind::MoeCnn | ModelKind::MmoeCnn) => {
            let cnn = cfg.model != ModelKind::MoeMlp;
            let multi = cfg.model == ModelKind::MmoeCnn;
            let gates = if multi { tasks.max(1) } else { 1 };
            let (expert, expert_acts, d_out) = if cnn {
                let (p, a) = lenet_sizes(side)?;
                (p, a, crate::moe::CNN_EXPERT_OUT)
            } else {
                let p = sum_of_products(&[&[d, h], &[h], &[h, 64], &[64]])?;
                let a = sum_of_products(&[&[2, d], &[4, h], &[2, 64]])?;
                (p, a, 64)
            };
            let towers = if multi {
                sum_of_products(&[&[tasks, d_out + 1, 50], &[tasks, 51, 10]])?
            } else {
                sum_of_products(&[&[tasks, d_out + 1, 10]])?
            };
            let p = expert
                .checked_mul(n as u64)?
                .checked_add(linear(d, n)?.checked_mul(gates as u64)?)?
                .checked_add(towers)?;
            let acts = expert_acts
                .checked_mul(k as u64)?
                .checked_mul(gates as u64)?
                .checked_add(d as u64)?;
            (p, p, acts)
        }
    };
    let slots = match cfg.optimizer {
        OptimizerKind::Sgd => 1,
        OptimizerKind::Adam | OptimizerKind::Adamw => 2,
    };
    let activation_bytes = acts.checked_mul(batch_rows as u64)?.checked_mul(4)?;
    let total_bytes = params
        .checked_mul(4)?
        .checked_add(trainable.checked_mul(4 * (1 + slots))?)?
        .checked_add(activation_bytes)?;
    Some(MemoryEstimate {
        parameters: params,
        trainable,
        activation_bytes,
        total_bytes,
    })
}

/// Checks, before anything is allocated, that training `cfg`'s model fits in memory
/// ([`crate::memory::check_fits`]); the error names the settings that set its size. Also
/// refuses images too small for the convolutional models (they need a side of at least 16).
///
/// # Errors
/// The images are too small for a CNN, or the estimate exceeds the memory limit.
pub fn check_memory(cfg: &TrainConfig, side: usize, tasks: usize, batch_rows: usize) -> Result<()> {
    let cnn = matches!(
        cfg.model,
        ModelKind::Cnn | ModelKind::MoeCnn | ModelKind::MmoeCnn
    );
    if cnn && cfg.data != DataKind::SyntheticB && lenet_after(side).is_none() {
        return Err(crate::Error::Invalid(format!(
            "--model {}: the convolutions need images of at least 16×16 pixels, the data has {side}×{side}",
            cfg.model.name()
        )));
    }
    let moe = match cfg.model {
        ModelKind::MoeMlp if cfg.data != DataKind::SyntheticB => format!(
            ", --experts {} × --expert-hidden {}, --k {}",
            cfg.experts, cfg.expert_hidden, cfg.k
        ),
        m if m.is_moe() => format!(", --experts {}, --k {}", cfg.experts, cfg.k),
        _ => String::new(),
    };
    let data = if cfg.data == DataKind::SyntheticB {
        "synthetic-b".to_string()
    } else {
        format!("{side}×{side} images")
    };
    let estimate = memory_estimate(cfg, side, tasks, batch_rows);
    let params = match estimate {
        Some(e) => format!("{} parameters", e.parameters),
        None => "too many parameters to count".into(),
    };
    crate::memory::check_fits(
        &format!(
            "training --model {} on {data} ({params}{moe}, --batch {})",
            cfg.model.name(),
            cfg.batch
        ),
        estimate.map(|e| e.total_bytes),
    )
}

/// Builds the model for images of `side × side` pixels and `tasks` tasks.
///
/// # Errors
/// The model does not fit in memory (checked first, see [`check_memory`], for one example per
/// batch; `moegrad train` checks a whole batch before), or a layer refuses its sizes.
pub fn build(
    cfg: &TrainConfig,
    side: usize,
    tasks: usize,
    device: Device,
) -> Result<Box<dyn TaskModel>> {
    check_memory(cfg, side, tasks, 1)?;
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed);
    let heads = |width: usize, rng: &mut ChaCha8Rng| -> Result<Vec<Linear>> {
        (0..tasks)
            .map(|_| Linear::new(width, 10, Init::XavierUniform, rng, device))
            .collect()
    };
    Ok(match cfg.model {
        ModelKind::Gpt
        | ModelKind::MoeGpt
        | ModelKind::Llama
        | ModelKind::Mixtral
        | ModelKind::Qwen2Moe
        | ModelKind::Olmoe
        | ModelKind::DeepseekMoe => {
            return Err(crate::Error::Invalid(format!(
                "--model {} is a language model: lm::run builds it",
                cfg.model.name()
            )));
        }
        ModelKind::Mlp => {
            let trunk = Sequential::new()
                .push(Flatten)
                .push(Linear::new(
                    side * side,
                    256,
                    Init::KaimingUniform,
                    &mut rng,
                    device,
                )?)
                .push(Activation::Relu)
                .push(Linear::new(
                    256,
                    128,
                    Init::KaimingUniform,
                    &mut rng,
                    device,
                )?)
                .push(Activation::Relu);
            Box::new(MultiHead {
                trunk,
                heads: heads(128, &mut rng)?,
            })
        }
        ModelKind::Cnn => {
            let after = ((side - 4) / 2 - 4) / 2;
            let trunk = Sequential::new()
                // max-pool before ReLU: the same values and gradients as ReLU → max-pool (ReLU
                // is monotone, so it commutes with the max), with the ReLU on a quarter of the
                // elements; parameter names are unchanged (the convolutions keep slots 0 and 3)
                .push(Conv2d::new(1, 10, 5, 1, 0, &mut rng, device)?)
                .push(MaxPool2d {
                    kernel: 2,
                    stride: 2,
                })
                .push(Activation::Relu)
                .push(Conv2d::new(10, 20, 5, 1, 0, &mut rng, device)?)
                .push(MaxPool2d {
                    kernel: 2,
                    stride: 2,
                })
                .push(Activation::Relu)
                .push(Flatten)
                .push(Linear::new(
                    20 * after * after,
                    50,
                    Init::KaimingUniform,
                    &mut rng,
                    device,
                )?)
                .push(Activation::Relu);
            Box::new(MultiHead {
                trunk,
                heads: heads(50, &mut rng)?,
            })
        }
        ModelKind::MoeMlp | ModelKind::MoeCnn | ModelKind::MmoeCnn => {
            let cnn = cfg.model != ModelKind::MoeMlp;
            let mut mc = moe_config(cfg, side * side, cfg.expert_hidden, cfg.experts);
            if cnn {
                mc.expert_kind = ExpertKind::Cnn { side };
                mc.d_out = crate::moe::CNN_EXPERT_OUT;
            } else {
                mc.d_out = 64;
            }
            let moe = MoeLayer::new(&mc, device)?;
            let multi_gate = cfg.model == ModelKind::MmoeCnn;
            let extra_gates = if multi_gate {
                (1..tasks)
                    .map(|t| {
                        build_router(&cfg.router, &mc.router_config(cfg.seed + t as u64), device)
                    })
                    .collect::<Result<Vec<_>>>()?
            } else {
                Vec::new()
            };
            let towers = (0..tasks)
                .map(|_| -> Result<Sequential> {
                    Ok(if multi_gate {
                        Sequential::new()
                            .push(Linear::new(
                                mc.d_out,
                                50,
                                Init::KaimingUniform,
                                &mut rng,
                                device,
                            )?)
                            .push(Activation::Relu)
                            .push(Linear::new(50, 10, Init::XavierUniform, &mut rng, device)?)
                    } else {
                        Sequential::new().push(Linear::new(
                            mc.d_out,
                            10,
                            Init::XavierUniform,
                            &mut rng,
                            device,
                        )?)
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            Box::new(MoeModel {
                moe,
                extra_gates,
                towers,
                activate: !cnn,
                frozen_experts: false,
            })
        }
    })
}

/// The DSelect-k paper's synthetic model for generator B (see `data::SyntheticB`): the frozen
/// bank `f_e(x) = ReLU(x·W_e)` (an MLP expert `10 → 4 → 4` whose second layer is the identity
/// and which has no biases computes exactly that), the configured router choosing `--k` of
/// them, and a trainable logistic unit on the mixture. The logistic unit is written as a
/// 2-way linear softmax head (`p(1) = σ(l₁ − l₀)`, the same family as `σ(vᵀy + c)`), so the
/// classification loop and its accuracy apply unchanged.
pub fn build_synthetic_b(
    cfg: &TrainConfig,
    bank: &crate::data::SyntheticB,
    device: Device,
) -> Result<Box<dyn TaskModel>> {
    use crate::data::{SYNTHETIC_B_EXPERT_OUT as OUT, SYNTHETIC_B_INPUT as IN};
    let n = bank.experts;
    check_memory(cfg, 0, 1, 1)?;
    let mut mc = moe_config(cfg, IN, OUT, n);
    mc.d_out = OUT;
    mc.expert_bias = false;
    let moe = MoeLayer::new(&mc, device)?;
    let mut w1 = None;
    let mut w2 = None;
    moe.experts()
        .visit_params("", &mut |name, p| match name.as_str() {
            "w1" => w1 = Some(p.clone()),
            "w2" => w2 = Some(p.clone()),
            _ => {}
        });
    let (Some(w1), Some(w2)) = (w1, w2) else {
        return Err(crate::Error::Invalid(
            "synthetic-b: the expert bank has no w1/w2".into(),
        ));
    };
    w1.set(Tensor::from_f32(
        bank.expert_weights.clone(),
        &[n, IN, OUT],
        device,
    )?)?;
    let eye: Vec<f32> = (0..n * OUT * OUT)
        .map(|i| f32::from(i % (OUT * OUT) / OUT == i % OUT))
        .collect();
    w2.set(Tensor::from_f32(eye, &[n, OUT, OUT], device)?)?;
    w1.freeze()?;
    w2.freeze()?;
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed ^ 0x6865_6164);
    let head = Sequential::new().push(Linear::new(OUT, 2, Init::XavierUniform, &mut rng, device)?);
    Ok(Box::new(MoeModel {
        moe,
        extra_gates: Vec::new(),
        towers: vec![head],
        activate: false,
        frozen_experts: true,
    }))
}
