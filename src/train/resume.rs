//! What a training checkpoint holds, and the checks that let `--resume` continue a run exactly
//! or refuse with a message naming what is wrong.
//!
//! [`snapshot`] writes, after each epoch: the parameters under their names; the optimizer's
//! state (`adam.m.<param>`, ...) with the list of its names in the metadata (so a tensor
//! missing from the file is noticed, not replaced by zeros); the model's step-to-step state
//! (router noise counters, dropout counters) under `state.<name>`; and the metadata `format`,
//! `epoch`, `steps` and `config` (the run's [`TrainConfig`] as JSON).
//!
//! [`restore`] reads it back and refuses, with an error naming the item, a checkpoint of
//! another format, malformed or inconsistent metadata, a configuration that differs from this
//! run's (listing every differing setting with its old and new value; settings where a change
//! is meaningful can be allowed with `--allow-config-change`), a run already trained as far as
//! `--epochs` asks, non-finite values, and missing, extra or misshapen tensors.

use super::config::{OptimizerKind, TrainConfig};
use super::models::TaskModel;
use crate::checkpoint::Checkpoint;
use crate::nn::Param;
use crate::optim::{LossScale, Optimizer};
use crate::{Device, Error, Result, Tensor};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The `format` metadata of the checkpoints this version writes and resumes.
pub const FORMAT: &str = "moegrad-checkpoint-2";

/// The prefix of the model's step-to-step state in a checkpoint (`state.moe.router.noise_calls`).
pub const STATE_PREFIX: &str = "state.";

/// The prefix of the loss scale's state (`--precision f16-mixed`: `loss_scale.scale`,
/// `loss_scale.counts`).
pub const LOSS_SCALE_PREFIX: &str = "loss_scale.";

/// Settings that say where things are or how often the loss is read, not what is computed, and
/// the precision (the master weights and the optimizer's state are f32 either way): a resumed
/// run may change them freely.
const FREE_SETTINGS: &[&str] = &["out", "device", "data_dir", "log_every", "precision"];

/// Settings a resumed run may change when they are named in `--allow-config-change`: learning
/// rate and schedule, regularisation, and how much is trained and evaluated. (`epochs` itself
/// changes freely unless the run's cosine schedule follows it; see [`check_config`].) The
/// others (data, model, optimizer, seed, router, experts, router options) define the
/// parameters and state being resumed.
pub const CHANGEABLE_SETTINGS: &[&str] = &[
    "epochs",
    "lr",
    "weight_decay",
    "schedule",
    "schedule_epochs",
    "warmup_steps",
    "clip_grad_norm",
    "batch",
    "train_limit",
    "test_limit",
    "balance_loss",
    "z_loss",
    "capacity_factor",
    "eval_capacity_factor",
    "collapse_dead",
    "collapse_share",
];

/// The command-line flag of a [`TrainConfig`] field (`train_limit` → `--train-limit`).
fn flag(field: &str) -> String {
    match field {
        "router_options" => "--router-opt".into(),
        "balancing" => "--balance (with --balance-scope, --balance-window, --balance-rate)".into(),
        other => format!("--{}", other.replace('_', "-")),
    }
}

/// Reads the names given to `--allow-config-change` (`lr`, `--train-limit`, `train_limit`)
/// as [`TrainConfig`] field names.
///
/// # Errors
/// A name that is no setting, or a setting that cannot change in a resumed run.
pub fn parse_allowed_changes(names: &[String]) -> Result<Vec<String>> {
    let choices = || {
        CHANGEABLE_SETTINGS
            .iter()
            .map(|f| f.replace('_', "-"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let known =
        serde_json::to_value(TrainConfig::default()).map_err(|e| Error::Invalid(e.to_string()))?;
    let mut out = Vec::new();
    for raw in names {
        let name = raw.trim();
        if name.is_empty() {
            continue;
        }
        let field = name.trim_start_matches("--").replace('-', "_");
        // a language model's length is --iters, which sets its `epochs` (evaluation intervals)
        let field = match field.as_str() {
            "router_opt" => "router_options".to_string(),
            "iters" => "epochs".to_string(),
            _ => field,
        };
        if !CHANGEABLE_SETTINGS.contains(&field.as_str()) {
            let why = if known.get(&field).is_some() {
                format!(
                    "{} defines the parameters and state being resumed and cannot change (start a new run instead)",
                    flag(&field)
                )
            } else {
                "there is no such setting".to_string()
            };
            return Err(Error::Invalid(format!(
                "--allow-config-change {name}: {why}; settings that may change: {}",
                choices()
            )));
        }
        out.push(field);
    }
    Ok(out)
}

/// Whether `epochs` is part of a run's identity: under a cosine schedule whose length follows
/// `--epochs` (no `--schedule-epochs`), changing it changes the rates of the steps already
/// taken.
fn schedule_follows_epochs(cfg: &TrainConfig) -> bool {
    cfg.schedule == "cosine" && cfg.schedule_epochs == 0
}

/// Compares the configuration a checkpoint was written with (`saved`) with this run's (`now`).
///
/// # Errors
/// Lists every setting that differs and is not allowed (free settings aside), each with its
/// old and new value, and says how a deliberate change can be made.
pub fn check_config(
    path: &Path,
    saved: &TrainConfig,
    now: &TrainConfig,
    allowed: &[String],
) -> Result<()> {
    let as_map = |c: &TrainConfig| -> Result<serde_json::Map<String, serde_json::Value>> {
        match serde_json::to_value(c).map_err(|e| Error::Invalid(e.to_string()))? {
            serde_json::Value::Object(m) => Ok(m),
            _ => Err(Error::Invalid(
                "a run configuration is not an object".into(),
            )),
        }
    };
    let (old, new) = (as_map(saved)?, as_map(now)?);
    let keys: BTreeSet<&String> = old.keys().chain(new.keys()).collect();
    let mut refused = Vec::new();
    for key in keys {
        let (a, b) = (old.get(key.as_str()), new.get(key.as_str()));
        if a == b || FREE_SETTINGS.contains(&key.as_str()) {
            continue;
        }
        // a language model's `iters` sets its `epochs` (evaluation intervals), which carries
        // the check; its evaluation windows only change what is measured
        if key == "epochs" && !schedule_follows_epochs(saved)
            || key == "iters"
            || key == "eval_windows"
        {
            continue;
        }
        if allowed.iter().any(|f| f == key) {
            continue;
        }
        let show = |v: Option<&serde_json::Value>| v.map_or("(none)".into(), |v| v.to_string());
        refused.push((key.clone(), show(a), show(b)));
    }
    if refused.is_empty() {
        return Ok(());
    }
    // a language model counts --iters; its `epochs` are evaluation intervals
    let lm = saved.model.is_lm();
    let listed: Vec<String> = refused
        .iter()
        .map(|(k, a, b)| {
            if lm && k == "epochs" {
                format!(
                    "--iters {} → {} ({a} → {b} evaluation intervals of --eval-every {})",
                    saved.iters, now.iters, saved.eval_every
                )
            } else {
                format!("{} {a} → {b}", flag(k))
            }
        })
        .collect();
    let mut msg = format!(
        "--resume: {} was written by a run with other settings: {}. Resume with the checkpoint's settings, or start a new run (another --out, or --overwrite)",
        path.display(),
        listed.join(", ")
    );
    let changeable: Vec<&str> = refused
        .iter()
        .map(|(k, _, _)| k.as_str())
        .filter(|k| CHANGEABLE_SETTINGS.contains(k))
        .collect();
    if !changeable.is_empty() {
        msg.push_str(&format!(
            "; to change {} deliberately, pass --allow-config-change {}",
            changeable
                .iter()
                .map(|k| if lm && *k == "epochs" {
                    "--iters".into()
                } else {
                    flag(k)
                })
                .collect::<Vec<_>>()
                .join(", "),
            changeable
                .iter()
                .map(|k| if lm && *k == "epochs" {
                    "iters".into()
                } else {
                    k.replace('_', "-")
                })
                .collect::<Vec<_>>()
                .join(",")
        ));
    }
    if lm && refused.iter().any(|(k, _, _)| k == "epochs") {
        msg.push_str(&format!(
            ". The run's cosine schedule spans --iters ({}), so training further changes the learning rate of every step: with --allow-config-change iters the cosine is stretched over the new length from here on; to train in parts along one cosine, start the run with --schedule-epochs N, its full length in evaluation intervals (--iters / --eval-every)",
            saved.iters
        ));
    } else if refused.iter().any(|(k, _, _)| k == "epochs") {
        msg.push_str(&format!(
            ". The run's cosine schedule spans --epochs ({}), so training further changes the learning rate of every step: with --allow-config-change epochs the cosine is stretched over the new length from here on; to train in parts along one cosine, start the run with --schedule-epochs N (its full length)",
            saved.epochs
        ));
    }
    Err(Error::Invalid(msg))
}

/// The prefixes of the optimizer state of each parameter (`adam.m.<param>`, ...).
fn optimizer_prefixes(kind: OptimizerKind) -> &'static [&'static str] {
    match kind {
        OptimizerKind::Sgd => &["sgd.momentum."],
        OptimizerKind::Adam | OptimizerKind::Adamw => &["adam.m.", "adam.v."],
    }
}

/// The checkpoint of a run after `epoch` epochs: parameters, optimizer state (with the list of
/// its names), the model's step-to-step state and the metadata (see the module docs).
pub fn snapshot(
    epoch: usize,
    params: &[(String, Param)],
    opt: &dyn Optimizer,
    model: &dyn TaskModel,
    config_json: &str,
) -> Result<Checkpoint> {
    let mut ck = Checkpoint::default();
    for (name, p) in params {
        ck.tensors.insert(name.clone(), p.get());
    }
    let opt_state = opt.state();
    let opt_names: Vec<&String> = opt_state.iter().map(|(n, _)| n).collect();
    let opt_list = serde_json::to_string(&opt_names).map_err(|e| Error::Invalid(e.to_string()))?;
    for (name, t) in model.state()? {
        ck.tensors.insert(format!("{STATE_PREFIX}{name}"), t);
    }
    ck.tensors.extend(opt_state);
    ck.metadata = BTreeMap::from([
        ("format".into(), FORMAT.into()),
        ("epoch".into(), epoch.to_string()),
        ("steps".into(), opt.steps().to_string()),
        ("config".into(), config_json.to_string()),
        ("optimizer_state".into(), opt_list),
    ]);
    Ok(ck)
}

/// Where the model, the settings and the data split stand for [`restore`].
pub struct ResumeTarget<'a> {
    /// this run's settings
    pub cfg: &'a TrainConfig,
    /// settings the user allows to differ from the checkpoint's (field names)
    pub allowed: &'a [String],
    /// the device the tensors go to
    pub device: Device,
    /// the model (its step-to-step state is restored)
    pub model: &'a dyn TaskModel,
    /// its trainable parameters by name
    pub params: &'a [(String, Param)],
    /// what the run's periods are: epochs (image models) or evaluation intervals (language
    /// models); the messages name them
    pub period: super::Period,
    /// optimizer steps per period of this run
    pub steps_per_period: u64,
}

/// Loads the checkpoint at `path` into the model and the optimizer after checking it belongs
/// to this run (see the module docs); returns the number of periods (epochs or evaluation
/// intervals) it has trained.
///
/// # Errors
/// Each refusal names the file and the item at fault (see the module docs).
pub fn restore(
    path: &Path,
    target: &ResumeTarget,
    opt: &mut dyn Optimizer,
    loss_scale: Option<&mut LossScale>,
) -> Result<usize> {
    let cfg = target.cfg;
    if !path.is_file() {
        return Err(Error::Io(format!(
            "--resume: {} does not exist: there is no run to continue in --out {} (start one without --resume)",
            path.display(),
            cfg.out.display()
        )));
    }
    let ck = Checkpoint::load(path, target.device)?;
    let meta = |key: &str| -> Result<&str> {
        ck.metadata.get(key).map(String::as_str).ok_or_else(|| {
            Error::Io(format!(
                "{}: the checkpoint has no {key} in its metadata",
                path.display()
            ))
        })
    };
    let format = meta("format")?;
    if format != FORMAT {
        return Err(Error::Io(format!(
            "{}: checkpoint format {format:?}, but this moegrad resumes {FORMAT:?} (checkpoints that also hold the router state and the optimizer-state list); start a new run",
            path.display()
        )));
    }
    let saved: TrainConfig = serde_json::from_str(meta("config")?).map_err(|e| {
        Error::Io(format!(
            "{}: the run configuration in the metadata is malformed: {e}",
            path.display()
        ))
    })?;
    check_config(path, &saved, cfg, target.allowed)?;

    let period = target.period;
    // (the metadata key is `epoch` for both kinds of period)
    let epoch_text = meta("epoch")?;
    let epoch = match epoch_text.trim().parse::<usize>() {
        Ok(e) if e >= 1 => e,
        _ => {
            return Err(Error::Io(format!(
                "{}: metadata epoch = {epoch_text:?} is not a number of {}s trained (a whole number ≥ 1)",
                path.display(),
                period.name()
            )));
        }
    };
    let steps_text = meta("steps")?;
    let steps = steps_text.trim().parse::<u64>().map_err(|_| {
        Error::Io(format!(
            "{}: metadata steps = {steps_text:?} is not a number of optimizer steps",
            path.display()
        ))
    })?;
    let same_split = saved.batch == cfg.batch && saved.train_limit == cfg.train_limit;
    if same_split && steps != epoch as u64 * target.steps_per_period {
        return Err(Error::Io(format!(
            "{}: metadata steps = {steps} disagrees with {} at {} steps per {}",
            path.display(),
            period.count(epoch),
            target.steps_per_period,
            period.name()
        )));
    }
    if cfg.epochs <= epoch {
        return Err(Error::Invalid(match period {
            super::Period::Epoch => format!(
                "--resume: {} has already trained {}, so --epochs {} leaves nothing to train; pass a larger --epochs to train further",
                path.display(),
                period.count(epoch),
                cfg.epochs
            ),
            super::Period::Interval => format!(
                "--resume: {} has already trained {} ({} iterations), so --iters {} leaves nothing to train; pass a larger --iters to train further",
                path.display(),
                period.count(epoch),
                epoch as u64 * target.steps_per_period,
                cfg.iters
            ),
        }));
    }
    if let Some(bad) = ck.first_non_finite()? {
        return Err(Error::Io(format!(
            "{}: {bad}; a checkpoint with non-finite values cannot be resumed (its run had diverged): start a new run",
            path.display()
        )));
    }

    // every tensor must be a parameter, listed optimizer state or model state of this model
    let param_shapes: BTreeMap<&str, &Param> =
        target.params.iter().map(|(n, p)| (n.as_str(), p)).collect();
    let opt_names: Vec<String> = serde_json::from_str(meta("optimizer_state")?).map_err(|e| {
        Error::Io(format!(
            "{}: metadata optimizer_state is not a list of tensor names: {e}",
            path.display()
        ))
    })?;
    let model_state = target.model.state()?;
    let state_names: BTreeSet<String> = model_state
        .iter()
        .map(|(n, _)| format!("{STATE_PREFIX}{n}"))
        .collect();
    for name in ck.tensors.keys() {
        // the loss scale of an f16-mixed run (used when this run is one, else ignored)
        let known = param_shapes.contains_key(name.as_str())
            || opt_names.contains(name)
            || state_names.contains(name)
            || name.starts_with(LOSS_SCALE_PREFIX);
        if !known {
            return Err(Error::Io(format!(
                "{}: tensor {name} is no parameter, optimizer state or model state of this {:?} model",
                path.display(),
                cfg.model
            )));
        }
    }
    let take = |name: &str, what: &str| -> Result<&Tensor> {
        ck.tensors
            .get(name)
            .ok_or_else(|| Error::Io(format!("{}: {what} {name} is missing", path.display())))
    };
    let fits = |name: &str, t: &Tensor, like: &Tensor| -> Result<()> {
        if t.shape() != like.shape() || t.dtype() != like.dtype() {
            return Err(Error::Io(format!(
                "{}: {name} is {:?} {:?}, but this model's parameter is {:?} {:?}",
                path.display(),
                t.dtype(),
                t.shape(),
                like.dtype(),
                like.shape()
            )));
        }
        Ok(())
    };

    for (name, p) in target.params {
        let t = take(name, "parameter")?;
        fits(name, t, &p.get())?;
        p.set(t.clone())?;
    }

    let prefixes = optimizer_prefixes(cfg.optimizer);
    let mut opt_tensors = BTreeMap::new();
    for name in &opt_names {
        let t = take(name, "optimizer state")?;
        let param = prefixes
            .iter()
            .find_map(|pre| name.strip_prefix(pre))
            .and_then(|p| param_shapes.get(p));
        let Some(param) = param else {
            return Err(Error::Io(format!(
                "{}: optimizer state {name} belongs to no parameter of this model under {:?}",
                path.display(),
                cfg.optimizer
            )));
        };
        fits(name, t, &param.get())?;
        opt_tensors.insert(name.clone(), t.clone());
    }
    opt.load_state(&opt_tensors, steps)?;

    for (name, _) in &model_state {
        let key = format!("{STATE_PREFIX}{name}");
        let t = take(&key, "model state (a router's noise counter or similar)")?;
        target
            .model
            .load_state(name, t)
            .map_err(|e| Error::Io(format!("{}: {key}: {e}", path.display())))?;
    }
    // an f16-mixed run goes on with the scale it had reached (from an f32 checkpoint, or one
    // written before this was saved, it starts afresh)
    if let Some(scale) = loss_scale {
        for (name, t) in &ck.tensors {
            if let Some(rest) = name.strip_prefix(LOSS_SCALE_PREFIX) {
                scale
                    .load_state(rest, t)
                    .map_err(|e| Error::Io(format!("{}: {name}: {e}", path.display())))?;
            }
        }
    }
    Ok(epoch)
}
