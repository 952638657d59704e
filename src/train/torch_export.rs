//! `moegrad export --format torch`: an image-model checkpoint (`mlp`, `cnn`, `moe-mlp`,
//! `moe-cnn`, `mmoe-cnn`) written as a directory that PyTorch loads without moegrad:
//!
//! * `model.py`: one readable `nn.Module` per model, with the routers at inference
//!   (`torch_model.py` beside this file, written as it is);
//! * `config.json`: which model, its sizes, its router and the router's options resolved;
//! * `model.safetensors`: the weights under PyTorch's conventional names and `[out, in]`
//!   layouts, so `model.load_state_dict(safetensors.torch.load_file(...))` loads them strictly;
//! * with `test_data`: `test_data.safetensors` (the test split as the model sees it: `images`
//!   F32 `[N, 1, side, side]`, `labels` I64 `[N, tasks]`) and `moegrad_eval.json` (moegrad's
//!   test loss and accuracy on it, and the logits of its first 64 examples, computed here), which `scripts/check_torch_export.py`
//!   compares with PyTorch's.
//!
//! What maps to what:
//!
//! | moegrad | PyTorch | layout |
//! |---|---|---|
//! | `trunk.0`, `trunk.3` (cnn) | `conv1`, `conv2` | `[OC, C, 5, 5]`, as is |
//! | `trunk.7` (cnn) / `trunk.1`, `trunk.3` (mlp) | `fc` / `fc1`, `fc2` | `[in, out]` → `[out, in]` |
//! | `heads.t`, `towers.t.0` (moe-mlp, moe-cnn) | `heads.t` | transposed |
//! | `towers.t.0`, `towers.t.2` (mmoe-cnn) | `towers.t.0`, `towers.t.2` | transposed |
//! | `moe.router`, `moe.router1`, … | `routers.0`, `routers.1`, … | gate `weight [d, n]` → `gate.weight [n, d]` |
//! | `moe.experts.w1 [n, d, h]`, `b1` (MLP) | `moe.experts.e.fc1.weight [h, d]`, `.bias` | one module per expert |
//! | `moe.experts.conv1 [n, C·25, OC]` (CNN) | `moe.experts.e.conv1.weight [OC, C, 5, 5]` | transposed, reshaped |
//! | `moe.experts.dense1 [n, F, 50]`, `dense2` | `moe.experts.e.fc1`, `fc2` | transposed |
//!
//! Routers export when their inference rule is deterministic and written in `model.py`
//! ([`TORCH_ROUTERS`]); `hash` (a fixed random projection of the pixels), `expert-choice` (each
//! expert picks tokens of the batch, so a prediction depends on the batch), the SparseMixer
//! family (its mask and output scale) and `deepseek-v3` are refused naming the router, as is a
//! finite `--eval-capacity-factor` (drops that depend on the batch) and synthetic-b (its frozen
//! experts are not in the checkpoint). Language models export with `--format hf`.

use super::config::{DataKind, TrainConfig};
use super::{evaluate, load_data, models};
use crate::checkpoint::Checkpoint;
use crate::export_dir::{RawTensor, Values, raw_safetensors_bytes, safetensors_bytes, write_dir};
use crate::moe::routers::{DSelectKOptions, ThresholdOptions, UnusedCodes};
use crate::{Device, Error, Result, Tensor};
use serde::Serialize;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The routers `model.py` implements at inference (see the module docs for the others).
pub const TORCH_ROUTERS: &[&str] = &[
    "softmax",
    "topk",
    "topk-noisy",
    "topk-unnorm",
    "default-moe",
    "smoe",
    "vmoe",
    "switch",
    "st",
    "gumbel-st",
    "reinforce",
    "reinmax",
    "moesart",
    "threshold",
    "xmoe-cosine",
    "dselect-k",
    "dselect-k-static",
];

/// How many test examples' logits `moegrad_eval.json` holds.
const LOGITS_EXAMPLES: usize = 64;

/// The PyTorch modules, written into every export as `model.py`.
pub const TORCH_MODEL_PY: &str = include_str!("torch_model.py");

/// What a `--format torch` export wrote (`moegrad export --json` prints it).
#[derive(Clone, Debug, Serialize)]
pub struct TorchExportReport {
    /// the moegrad model (`cnn`, `mmoe-cnn`, …)
    pub model: String,
    /// the router of an MoE model
    pub router: Option<String>,
    /// tensors written to `model.safetensors`
    pub tensors: usize,
    /// test examples written to `test_data.safetensors` (with `test_data`)
    pub test_examples: Option<usize>,
    /// moegrad's accuracy per task on them (with `test_data`)
    pub test_accuracy: Option<Vec<f64>>,
    /// the directory written
    pub dir: PathBuf,
}

/// Exports the image-model checkpoint at `checkpoint` as a PyTorch directory `out` (see the
/// module docs); with `test_data`, also the test split and moegrad's accuracy on it (the data
/// the run was trained on must be where its settings say).
///
/// # Errors
/// A language model, synthetic-b, a router or evaluation capacity `model.py` cannot represent
/// (named); an unreadable checkpoint or data; an `out` that exists and is not an empty
/// directory; a failed write (nothing is left behind).
pub fn export_torch(checkpoint: &Path, out: &Path, test_data: bool) -> Result<TorchExportReport> {
    let meta = Checkpoint::read_metadata(checkpoint)?;
    let cfg: TrainConfig = meta
        .get("config")
        .ok_or_else(|| {
            Error::Io(format!(
                "{}: no config in the metadata: not a checkpoint of a moegrad run",
                checkpoint.display()
            ))
        })
        .and_then(|text| {
            serde_json::from_str(text).map_err(|e| {
                Error::Io(format!(
                    "{}: the run configuration in the metadata is malformed: {e}",
                    checkpoint.display()
                ))
            })
        })?;
    exportable(&cfg)?;
    let device = Device::cpu();
    let (side, tasks, data) = if test_data {
        let data = load_data(&cfg)?;
        (data.side, data.tasks, Some(data))
    } else {
        match cfg.data {
            DataKind::Multimnist => (crate::data::multimnist::CANVAS, 2, None),
            _ => (28, 1, None),
        }
    };
    let model = models::build(&cfg, side, tasks, device)?;
    let ck = Checkpoint::load(checkpoint, device)?;
    ck.load_into(model.as_ref(), checkpoint)?;
    let tensors = torch_tensors(&cfg, model.as_ref())?;

    let text = |v: &Value| serde_json::to_vec_pretty(v).map_err(|e| Error::Invalid(e.to_string()));
    let config = torch_config(&cfg, side, tasks, model.as_ref())?;
    let mut files: Vec<(&str, Vec<u8>)> = vec![
        ("model.py", TORCH_MODEL_PY.as_bytes().to_vec()),
        ("config.json", text(&config)?),
        ("model.safetensors", safetensors_bytes(&tensors)?),
    ];
    let mut evaluation = None;
    if let Some(data) = &data {
        let (loss, accuracy) = evaluate(model.as_ref(), &data.test, cfg.batch.max(256), device)?;
        let test = &data.test;
        let n = test.len();
        // the logits of the first examples, for a comparison finer than the accuracy
        let first: Vec<usize> = (0..n.min(LOGITS_EXAMPLES)).collect();
        let x = test.batch(&first, device)?.x;
        model.set_training(false); // (evaluate leaves the model training)
        let logits = crate::no_grad(|| model.forward(&x))?
            .logits
            .iter()
            .map(|l| l.to_vec_f32())
            .collect::<Result<Vec<_>>>()?;
        let labels: Vec<i64> = (0..n)
            .flat_map(|i| test.labels.iter().map(move |task| i64::from(task[i])))
            .collect();
        files.push((
            "test_data.safetensors",
            raw_safetensors_bytes(vec![
                RawTensor {
                    name: "images".into(),
                    dtype: safetensors::Dtype::F32,
                    shape: [vec![n], test.sample_shape.clone()].concat(),
                    bytes: test.features.iter().flat_map(|x| x.to_le_bytes()).collect(),
                },
                RawTensor {
                    name: "labels".into(),
                    dtype: safetensors::Dtype::I64,
                    shape: vec![n, tasks],
                    bytes: labels.iter().flat_map(|x| x.to_le_bytes()).collect(),
                },
            ])?,
        ));
        files.push((
            "moegrad_eval.json",
            text(&json!({
                "checkpoint": checkpoint.display().to_string(),
                "test_examples": n,
                "test_loss": loss,
                "test_accuracy": accuracy,
                "logits_examples": first.len(),
                "logits": logits,
            }))?,
        ));
        evaluation = Some((n, accuracy));
    }
    write_dir(out, &files)?;
    Ok(TorchExportReport {
        model: cfg.model.name().into(),
        router: cfg.model.is_moe().then(|| cfg.router.clone()),
        tensors: tensors.len(),
        test_examples: evaluation.as_ref().map(|e| e.0),
        test_accuracy: evaluation.map(|e| e.1),
        dir: out.to_path_buf(),
    })
}

/// Refuses what `model.py` cannot represent, naming the setting.
fn exportable(cfg: &TrainConfig) -> Result<()> {
    if cfg.model.is_lm() {
        return Err(Error::Invalid(format!(
            "--model {} is a language model: export it with --format hf (a transformers directory)",
            cfg.model.name()
        )));
    }
    if cfg.data == DataKind::SyntheticB {
        return Err(Error::Invalid(
            "--data synthetic-b: its frozen experts are generated from the seed, not saved in the checkpoint, so the model cannot be exported".into(),
        ));
    }
    if !cfg.model.is_moe() {
        return Ok(());
    }
    if !TORCH_ROUTERS.contains(&cfg.router.as_str()) {
        return Err(Error::Invalid(format!(
            "--router {} cannot be exported to PyTorch: model.py writes the inference rules of {} ({})",
            cfg.router,
            TORCH_ROUTERS.join(", "),
            match cfg.router.as_str() {
                "expert-choice" =>
                    "expert-choice lets each expert pick tokens of the batch, so a prediction depends on the batch",
                "hash" => "hash routes by a fixed random projection of the pixels, not a parameter",
                r if r.starts_with("sparsemixer") =>
                    "the SparseMixer family's mask and output scale are not written there",
                _ => "this router's rule is not written there",
            }
        )));
    }
    if cfg.eval_capacity_factor > 0.0 {
        return Err(Error::Invalid(format!(
            "--eval-capacity-factor {} drops tokens at evaluation depending on the batch; model.py computes every token (train with --eval-capacity-factor 0 to export)",
            cfg.eval_capacity_factor
        )));
    }
    if cfg.balancing.uses_selection_bias() {
        return Err(Error::Invalid(format!(
            "--balance {}: the run chooses its experts with a selection bias that model.py's routers do not add, so the exported model would choose other experts (export a run balanced with --balance aux or none)",
            cfg.balancing.method.name()
        )));
    }
    if cfg.null_experts > 0 {
        return Err(Error::Invalid(format!(
            "--null-experts {}: model.py's routers score only the real experts (export a run without null experts)",
            cfg.null_experts
        )));
    }
    Ok(())
}

/// `config.json`: the model, its sizes, and the router with its options resolved.
fn torch_config(
    cfg: &TrainConfig,
    side: usize,
    tasks: usize,
    model: &dyn super::TaskModel,
) -> Result<Value> {
    let mut j = json!({
        "format": "moegrad-torch-1",
        "model": cfg.model.name(),
        "data": cfg.data.name(),
        "side": side,
        "tasks": tasks,
    });
    if !cfg.model.is_moe() {
        return Ok(j);
    }
    let rc = crate::moe::RouterConfig {
        options: cfg.router_options.clone(),
        ..crate::moe::RouterConfig::new(side * side, cfg.experts, cfg.k)
    };
    let names: Vec<String> = model.named_params().into_iter().map(|(n, _)| n).collect();
    let has = |name: &str| names.iter().any(|n| n == name);
    let options = match cfg.router.as_str() {
        "threshold" => {
            let o = ThresholdOptions::from_config(&rc)?;
            json!({"eval_t": o.eval_t, "max_k": o.max_k})
        }
        "dselect-k" | "dselect-k-static" => {
            let o = DSelectKOptions::from_config(&cfg.router, &rc)?;
            json!({
                "gamma": o.gamma,
                "unused": match o.unused { UnusedCodes::Wrap => "wrap", UnusedCodes::Penalty => "penalty" },
                "alpha_bias": has("moe.router.alpha_bias"),
                "z_bias": has("moe.router.z_bias"),
            })
        }
        "xmoe-cosine" => json!({"proj_dim": (cfg.experts / 2).max(1)}),
        _ => json!({}),
    };
    j["d"] = json!(side * side);
    j["experts"] = json!(cfg.experts);
    j["k"] = json!(cfg.k);
    j["expert_hidden"] = json!(cfg.expert_hidden);
    j["router"] = json!(cfg.router);
    j["gate_bias"] = json!(has("moe.router.bias"));
    j["router_options"] = options;
    Ok(j)
}

/// A `[r, c]` matrix transposed to `[c, r]`.
fn transposed(shape: &[usize], v: &[f32]) -> Values {
    let (r, c) = (shape[0], shape[1]);
    (vec![c, r], crate::lm::transpose(v, r, c))
}

/// Expert `e`'s `[r, c]` slice of a stacked `[n, r, c]` bank, transposed to `[c, r]`.
fn expert_transposed(shape: &[usize], v: &[f32], e: usize) -> Values {
    let (r, c) = (shape[1], shape[2]);
    transposed(&[r, c], &v[e * r * c..(e + 1) * r * c])
}

/// The PyTorch tensors of `model` under `model.py`'s names (see the module docs' table).
fn torch_tensors(
    cfg: &TrainConfig,
    model: &dyn super::TaskModel,
) -> Result<BTreeMap<String, Values>> {
    let mut out = BTreeMap::new();
    let unknown = |name: &str| {
        Error::Invalid(format!(
            "--format torch: parameter {name} of --model {} has no PyTorch name (a bug: please report it)",
            cfg.model.name()
        ))
    };
    let trunk_names: &[(&str, &str)] = match cfg.model.name() {
        "cnn" => &[
            ("trunk.0", "conv1"),
            ("trunk.3", "conv2"),
            ("trunk.7", "fc"),
        ],
        "mlp" => &[("trunk.1", "fc1"), ("trunk.3", "fc2")],
        _ => &[],
    };
    let multi_gate = cfg.model.name() == "mmoe-cnn";
    for (name, p) in model.named_params() {
        let t: Tensor = p.get();
        let shape = t.shape().to_vec();
        let v = t.to_vec_f32()?;
        let matrix = |torch: String, out: &mut BTreeMap<String, Values>| {
            out.insert(torch, transposed(&shape, &v));
        };
        let as_is = |torch: String, out: &mut BTreeMap<String, Values>| {
            out.insert(torch, (shape.clone(), v.clone()));
        };
        let (scope, leaf) = name.rsplit_once('.').ok_or_else(|| unknown(&name))?;
        if let Some((_, torch)) = trunk_names.iter().find(|(m, _)| *m == scope) {
            let torch = format!("{torch}.{leaf}");
            match (leaf, shape.len()) {
                ("weight", 2) => matrix(torch, &mut out),
                _ => as_is(torch, &mut out),
            }
        } else if let Some(t) = scope.strip_prefix("heads.") {
            if leaf == "weight" {
                matrix(format!("heads.{t}.weight"), &mut out)
            } else {
                as_is(format!("heads.{t}.bias"), &mut out)
            }
        } else if let Some(rest) = scope.strip_prefix("towers.") {
            // towers.t.0 / towers.t.2: a head (single gate) or a tower (multi-gate)
            let (t, layer) = rest.split_once('.').ok_or_else(|| unknown(&name))?;
            let torch = if multi_gate {
                format!("towers.{t}.{layer}.{leaf}")
            } else {
                format!("heads.{t}.{leaf}")
            };
            if leaf == "weight" {
                matrix(torch, &mut out)
            } else {
                as_is(torch, &mut out)
            }
        } else if scope == "moe.experts" {
            expert_tensors(leaf, &shape, &v, &mut out).ok_or_else(|| unknown(&name))?;
        } else if let Some(router) = scope.strip_prefix("moe.router") {
            // `moe.router.weight` → router 0; `moe.router1.weight` → router 1 (multi-gate)
            let index: usize = if router.is_empty() {
                0
            } else {
                router.parse().map_err(|_| unknown(&name))?
            };
            let prefix = format!("routers.{index}");
            match leaf {
                "noise_weight" => {} // topk-noisy's noise scale: training only
                "weight" => matrix(format!("{prefix}.gate.weight"), &mut out),
                "bias" => as_is(format!("{prefix}.gate.bias"), &mut out),
                "proj" => matrix(format!("{prefix}.proj.weight"), &mut out),
                "experts" => matrix(format!("{prefix}.expert_embeddings"), &mut out),
                "log_temperature" => as_is(format!("{prefix}.log_temperature"), &mut out),
                "alpha_weight" => matrix(format!("{prefix}.alpha.weight"), &mut out),
                "alpha_bias" => as_is(format!("{prefix}.alpha.bias"), &mut out),
                "z_weight" => matrix(format!("{prefix}.z.weight"), &mut out),
                "z_bias" => as_is(format!("{prefix}.z.bias"), &mut out),
                "alpha" | "z" => as_is(format!("{prefix}.{leaf}"), &mut out),
                _ => return Err(unknown(&name)),
            }
        } else {
            return Err(unknown(&name));
        }
    }
    Ok(out)
}

/// Splits one stacked expert tensor (`moe.experts.<leaf>`) into the per-expert modules of
/// `model.py`; None for a leaf it does not know.
fn expert_tensors(
    leaf: &str,
    shape: &[usize],
    v: &[f32],
    out: &mut BTreeMap<String, Values>,
) -> Option<()> {
    let n = shape[0];
    let per = v.len() / n.max(1);
    for e in 0..n {
        let torch = |module: &str, what: &str| format!("moe.experts.{e}.{module}.{what}");
        let row = || (shape[1..].to_vec(), v[e * per..(e + 1) * per].to_vec());
        let (key, value) = match leaf {
            // MLP experts: w [n, in, out] → [out, in]
            "w1" => (torch("fc1", "weight"), expert_transposed(shape, v, e)),
            "w2" => (torch("fc2", "weight"), expert_transposed(shape, v, e)),
            "b1" => (torch("fc1", "bias"), row()),
            "b2" => (torch("fc2", "bias"), row()),
            // CNN experts: conv [n, C·25, OC] → [OC, C·25] → [OC, C, 5, 5]
            "conv1" | "conv2" => {
                let (_, values) = expert_transposed(shape, v, e);
                let oc = shape[2];
                let c = shape[1] / 25;
                (torch(leaf, "weight"), (vec![oc, c, 5, 5], values))
            }
            "conv1_bias" => (torch("conv1", "bias"), row()),
            "conv2_bias" => (torch("conv2", "bias"), row()),
            "dense1" => (torch("fc1", "weight"), expert_transposed(shape, v, e)),
            "dense2" => (torch("fc2", "weight"), expert_transposed(shape, v, e)),
            "dense1_bias" => (torch("fc1", "bias"), row()),
            "dense2_bias" => (torch("fc2", "bias"), row()),
            _ => return None,
        };
        out.insert(key, value);
    }
    Some(())
}
