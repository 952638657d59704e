//! The numbers of `moegrad compare`: each cell's final metrics (flattened from the train run's
//! `--json` object, with a few derived ones), its learning curve (from `metrics.jsonl`), the step
//! at which it first reached a target, and the mean and standard error over seeds.
//!
//! The standard error of a mean over n seeds is the sample standard deviation (denominator
//! n − 1) divided by √n; it is undefined (NaN, shown as `–`) for one seed.

use moegrad::train::{DataKind, TrainConfig};
use moegrad::{Error, Result};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::Path;

/// A mean with its standard error over `n` values.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct MeanSe {
    /// the arithmetic mean (NaN for no values)
    pub mean: f64,
    /// sample standard deviation (n − 1 denominator) / √n; NaN for fewer than two values
    pub se: f64,
    /// how many values
    pub n: usize,
}

/// The mean and standard error of `values`.
///
/// # Example
/// ```
/// use moegrad_cli::compare::stats::mean_se;
/// let m = mean_se(&[1.0, 2.0, 3.0, 4.0]);
/// assert_eq!(m.mean, 2.5);
/// // sample variance 5/3, s.e. = sqrt(5/3) / 2
/// assert!((m.se - (5.0f64 / 3.0).sqrt() / 2.0).abs() < 1e-15);
/// assert!(mean_se(&[7.0]).se.is_nan());
/// ```
pub fn mean_se(values: &[f64]) -> MeanSe {
    let n = values.len();
    if n == 0 {
        return MeanSe {
            mean: f64::NAN,
            se: f64::NAN,
            n,
        };
    }
    let mean = values.iter().sum::<f64>() / n as f64;
    let se = if n < 2 {
        f64::NAN
    } else {
        let ss: f64 = values.iter().map(|v| (v - mean) * (v - mean)).sum();
        (ss / (n - 1) as f64).sqrt() / (n as f64).sqrt()
    };
    MeanSe { mean, se, n }
}

/// The final metrics a train run's `--json` object yields, by name: every number in it,
/// `test_accuracy_1`, `test_accuracy_2` for the tasks of MultiMNIST, and for synthetic-b
/// `true_experts_recovered` (1 when the selected experts are exactly the true ones, else 0),
/// `true_expert_mass` (the mean gate weight on the true experts) and `experts_run` (experts
/// with nonzero weight per example). Lists such as the per-expert load are left out.
///
/// # Errors
/// A loss that is missing or not a finite number (a run that diverged writes NaN as `null`).
pub fn final_metrics(summary: &serde_json::Value) -> Result<BTreeMap<String, f64>> {
    let obj = summary
        .as_object()
        .ok_or_else(|| Error::Invalid("the run's final JSON is not an object".into()))?;
    let mut out = BTreeMap::new();
    for (key, v) in obj {
        match v {
            serde_json::Value::Number(n) => {
                if let Some(x) = n.as_f64() {
                    out.insert(key.clone(), x);
                }
            }
            serde_json::Value::Array(a) if key == "test_accuracy" => {
                for (i, x) in a.iter().enumerate() {
                    if let Some(x) = x.as_f64() {
                        out.insert(format!("test_accuracy_{}", i + 1), x);
                    }
                }
            }
            _ => {}
        }
    }
    // the routing diagnostics of an MoE run, at its worst layer (`moe::RoutingDiagnostics`)
    if let Some(routing) = obj.get("routing") {
        for (metric, side) in ROUTING_METRICS {
            if let Some(x) = routing[*metric][*side].as_f64() {
                out.insert((*metric).to_string(), x);
            }
        }
    }
    for loss in ["test_loss", "val_loss"] {
        if obj.contains_key(loss) && !out.get(loss).is_some_and(|x| x.is_finite()) {
            return Err(Error::Invalid(format!(
                "the final {loss} is not a finite number ({})",
                obj[loss]
            )));
        }
    }
    let ids = |key: &str| -> Option<Vec<u64>> {
        let mut v: Vec<u64> = obj
            .get(key)?
            .as_array()?
            .iter()
            .filter_map(|x| x.as_u64())
            .collect();
        v.sort_unstable();
        Some(v)
    };
    let floats = |key: &str| -> Option<Vec<f64>> {
        Some(
            obj.get(key)?
                .as_array()?
                .iter()
                .filter_map(|x| x.as_f64())
                .collect(),
        )
    };
    if let Some(truth) = ids("true_experts") {
        if let Some(selected) = ids("selected_experts") {
            out.insert(
                "true_experts_recovered".into(),
                if selected == truth { 1.0 } else { 0.0 },
            );
        }
        if let Some(w) = floats("expert_mean_weight") {
            let mass = truth.iter().filter_map(|&e| w.get(e as usize)).sum::<f64>();
            out.insert("true_expert_mass".into(), mass);
        }
    }
    if let Some(rate) = floats("expert_selection_rate") {
        out.insert("experts_run".into(), rate.iter().sum());
    }
    Ok(out)
}

/// One line of a run's `metrics.jsonl`: where it was taken and the curve metrics in it.
#[derive(Clone, Debug, PartialEq)]
pub struct CurvePoint {
    /// optimizer steps so far (`step` of an image run, `iter` of a language model)
    pub step: f64,
    /// epochs so far (a language model: evaluations so far)
    pub epoch: f64,
    /// `train_loss`, `test_loss`, `test_accuracy` (`_1`, `_2` per task), `val_loss`, `val_ppl`,
    /// `val_bpc`
    pub values: BTreeMap<String, f64>,
}

/// The curve metrics a run of `cfg` writes to each line of `metrics.jsonl`.
pub fn curve_metrics(cfg: &TrainConfig) -> Vec<String> {
    let names: &[&str] = if cfg.model.is_lm() {
        &["train_loss", "val_loss", "val_ppl", "val_bpc"]
    } else if cfg.data == DataKind::Multimnist {
        &[
            "train_loss",
            "test_loss",
            "test_accuracy_1",
            "test_accuracy_2",
        ]
    } else {
        &["train_loss", "test_loss", "test_accuracy"]
    };
    names.iter().map(|s| s.to_string()).collect()
}

/// The default metric of the figures: the validation loss of a language model, else the test
/// loss.
pub fn default_metric(cfg: &TrainConfig) -> &'static str {
    if cfg.model.is_lm() {
        "val_loss"
    } else {
        "test_loss"
    }
}

/// The final metrics [`final_metrics`] can give besides the curve metrics (for checking a
/// `--metric` before anything runs).
pub const SUMMARY_METRICS: &[&str] = &[
    "seconds",
    "train_loss",
    "drop_rate",
    "experts_per_token",
    "steps",
    "params",
    "epochs",
    "iters",
    "ms_per_iter",
    "tokens_per_s",
    "active_params_per_token",
    "true_experts_recovered",
    "true_expert_mass",
    "experts_run",
    "dead_experts",
    "load_max_over_ideal",
    "top_share",
    "routing_entropy_ratio",
    "logit_max",
    "experts_per_token",
];

/// The routing diagnostics [`final_metrics`] takes from an MoE run's summary, each at the worst
/// layer: the most dead experts, the largest load/ideal, busiest share and logit, the lowest
/// exp(H)/n; and the median layer's real experts per token.
const ROUTING_METRICS: &[(&str, &str)] = &[
    ("dead_experts", "max"),
    ("load_max_over_ideal", "max"),
    ("top_share", "max"),
    ("routing_entropy_ratio", "min"),
    ("logit_max", "max"),
    ("experts_per_token", "median"),
];

/// Reads a run's `metrics.jsonl` (lines that do not parse are skipped: a run killed mid-line).
///
/// # Errors
/// A file that exists but cannot be read.
pub fn read_curve(path: &Path) -> Result<Vec<CurvePoint>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::Io(format!("{}: {e}", path.display()))),
    };
    Ok(text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .enumerate()
        .map(|(i, v)| {
            let mut values = BTreeMap::new();
            for key in ["train_loss", "test_loss", "val_loss", "val_ppl", "val_bpc"] {
                if let Some(x) = v[key].as_f64() {
                    values.insert(key.to_string(), x);
                }
            }
            match &v["test_accuracy"] {
                serde_json::Value::Array(a) => {
                    for (t, x) in a.iter().enumerate() {
                        if let Some(x) = x.as_f64() {
                            values.insert(format!("test_accuracy_{}", t + 1), x);
                        }
                    }
                }
                x => {
                    if let Some(x) = x.as_f64() {
                        values.insert("test_accuracy".into(), x);
                    }
                }
            }
            CurvePoint {
                step: v["step"]
                    .as_f64()
                    .or_else(|| v["iter"].as_f64())
                    .unwrap_or(f64::NAN),
                epoch: v["epoch"].as_f64().unwrap_or((i + 1) as f64),
                values,
            }
        })
        .collect())
}

/// `--target METRIC=VALUE`: reach `value` in `metric`, from below for accuracies and recovery,
/// from above for everything else (losses, perplexity).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Target {
    /// a curve metric (`val_loss`, `test_accuracy_1`, ...)
    pub metric: String,
    /// the value to reach
    pub value: f64,
    /// true: reached when `metric ≥ value`; false: when `metric ≤ value`
    pub higher_is_better: bool,
}

impl Target {
    /// Parses `METRIC=VALUE`.
    ///
    /// # Errors
    /// No `=`, an empty metric, or a value that is not a finite number.
    ///
    /// # Example
    /// ```
    /// use moegrad_cli::compare::stats::Target;
    /// let t = Target::parse("val_loss=2.1").unwrap();
    /// assert!(!t.higher_is_better && t.value == 2.1);
    /// assert!(Target::parse("test_accuracy=0.9").unwrap().higher_is_better);
    /// assert!(Target::parse("val_loss").is_err());
    /// ```
    pub fn parse(spec: &str) -> Result<Target> {
        let bad = |why: &str| {
            Err(Error::Invalid(format!(
                "--target {spec:?}: {why} (expected METRIC=VALUE, e.g. val_loss=2.0)"
            )))
        };
        let Some((metric, value)) = spec.split_once('=') else {
            return bad("no '='");
        };
        let metric = metric.trim();
        if metric.is_empty() {
            return bad("no metric");
        }
        let Ok(value) = value.trim().parse::<f64>() else {
            return bad("the value is not a number");
        };
        if !value.is_finite() {
            return bad("the value is not finite");
        }
        Ok(Target {
            metric: metric.to_string(),
            value,
            higher_is_better: metric.contains("accuracy"),
        })
    }

    /// Whether `x` has reached the target.
    pub fn reached_by(&self, x: f64) -> bool {
        if self.higher_is_better {
            x >= self.value
        } else {
            x <= self.value
        }
    }

    /// `val_loss ≤ 2` / `test_accuracy ≥ 0.9`.
    pub fn describe(&self) -> String {
        format!(
            "{} {} {}",
            self.metric,
            if self.higher_is_better { "≥" } else { "≤" },
            self.value
        )
    }

    /// The first point of `curve` at which the target is reached: `(step, epoch)`. Curves are
    /// evaluated once per epoch (per `--eval-every` for a language model), so this is the first
    /// evaluation at or past the target, not the exact step.
    pub fn first_reached(&self, curve: &[CurvePoint]) -> Option<(f64, f64)> {
        curve
            .iter()
            .find(|p| {
                p.values
                    .get(&self.metric)
                    .is_some_and(|&x| self.reached_by(x))
            })
            .map(|p| (p.step, p.epoch))
    }
}

/// Per position of the curves (evaluation 1, 2, ...): the mean step and the mean ± s.e. of
/// `metric` over the curves, up to the shortest curve that has the metric.
pub fn mean_curve(curves: &[&[CurvePoint]], metric: &str) -> Vec<(f64, MeanSe)> {
    let len = curves.iter().map(|c| c.len()).min().unwrap_or(0);
    (0..len)
        .filter_map(|i| {
            let values: Option<Vec<f64>> = curves
                .iter()
                .map(|c| c[i].values.get(metric).copied())
                .collect();
            let values = values?;
            let step = curves.iter().map(|c| c[i].step).sum::<f64>() / curves.len() as f64;
            Some((step, mean_se(&values)))
        })
        .collect()
}
