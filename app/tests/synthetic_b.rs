//! DSelect-k's generator B (`--data synthetic-b`): the data is a deterministic function of the
//! seed, its labels come from the true experts hidden in the frozen bank, training leaves the
//! bank untouched, the command line reports which experts the gate selects, static DSelect-k
//! with γ = 10 recovers the true experts, and every router learns on it (and on MNIST and
//! MultiMNIST): its test loss falls below that of the model it starts from.

#[path = "../../tests/common/mod.rs"]
mod common;

use moegrad::data::SyntheticB;
use moegrad::moe::ROUTER_NAMES;
use moegrad::train::{DataKind, ModelKind, RunOptions, TrainConfig, run};
use std::path::{Path, PathBuf};
use std::process::Command;

fn outdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("moegrad-synth-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn generator_is_deterministic_and_its_labels_come_from_the_true_experts() {
    let a = SyntheticB::generate(7, 16, 2000, 1000).unwrap();
    let b = SyntheticB::generate(7, 16, 2000, 1000).unwrap();
    assert_eq!(a.train.features, b.train.features);
    assert_eq!(a.test.labels, b.test.labels);
    assert_eq!(a.expert_weights, b.expert_weights);
    assert_eq!(a.true_experts, b.true_experts);
    let c = SyntheticB::generate(8, 16, 2000, 1000).unwrap();
    assert_ne!(a.train.features, c.train.features);
    assert_eq!((a.train.len(), a.test.len()), (2000, 1000));
    assert_eq!(a.train.sample_shape, vec![10]);
    assert_eq!(a.expert_weights.len(), 16 * 10 * 4);
    assert_eq!(a.true_experts.len(), 4);
    assert!(a.true_experts.windows(2).all(|w| w[0] < w[1]) && a.true_experts[3] < 16);

    // balanced classes (the offset is the median)
    let ones: i32 = a.train.labels[0].iter().chain(&a.test.labels[0]).sum();
    assert!((ones - 1500).abs() <= 1, "{ones} positives of 3000");
    // the labels are the true model's, computed from the bank's copies of the true experts
    let mut wrong = 0;
    for (set, labels) in [(&a.train, &a.train.labels[0]), (&a.test, &a.test.labels[0])] {
        for (i, x) in set.features.chunks(10).enumerate() {
            let mut avg = [0.0f64; 4];
            for &e in &a.true_experts {
                let w = &a.expert_weights[e * 40..(e + 1) * 40];
                for (j, s) in avg.iter_mut().enumerate() {
                    let h: f64 = (0..10).map(|r| x[r] as f64 * w[r * 4 + j] as f64).sum();
                    *s += h.max(0.0) / 4.0;
                }
            }
            let logit: f64 = avg.iter().zip(&a.head).map(|(p, q)| p * q).sum::<f64>() + a.offset;
            wrong += usize::from(i32::from(logit > 0.0) != labels[i]);
        }
    }
    assert!(
        wrong <= 3,
        "{wrong} labels disagree with the true experts (f32 rounding only)"
    );
    assert!(
        SyntheticB::generate(0, 3, 10, 10)
            .unwrap_err()
            .to_string()
            .contains("--experts 3")
    );
}

#[test]
fn training_keeps_the_bank_frozen_and_reports_the_selected_experts() {
    let cfg = TrainConfig {
        data: DataKind::SyntheticB,
        model: ModelKind::MoeMlp,
        router: "topk".into(),
        experts: 16,
        k: 4,
        epochs: 3,
        batch: 128,
        lr: 0.01,
        balance_loss: 0.0,
        device: "cpu".into(),
        out: outdir("frozen"),
        ..TrainConfig::default()
    };
    let s = run(&cfg, RunOptions::default()).unwrap();
    assert!(
        s.test_accuracy.as_f64().unwrap() > 0.7,
        "a gate over the bank with the true experts in it must learn: {:?}",
        s.test_accuracy
    );
    let rate = s.expert_selection_rate.clone().unwrap();
    assert_eq!(rate.len(), 16);
    // top-4 selects exactly 4 experts per example
    assert!((rate.iter().sum::<f64>() - 4.0).abs() < 1e-9, "{rate:?}");
    let weight = s.expert_mean_weight.clone().unwrap();
    // Shazeer top-k weights sum to 1 per example
    assert!(
        (weight.iter().sum::<f64>() - 1.0).abs() < 1e-5,
        "{weight:?}"
    );
    let selected = s.selected_experts.clone().unwrap();
    assert!(
        selected.iter().all(|&e| weight[e] >= 0.125),
        "{selected:?} {weight:?}"
    );
    assert_eq!(s.true_experts.clone().unwrap().len(), 4);
    // only the gate (16·10 + 16) and the logistic unit (4·2 + 2) train; the bank is not saved
    assert_eq!(s.params, 16 * 10 + 16 + 4 * 2 + 2);
    let ck = moegrad::checkpoint::Checkpoint::load(
        &cfg.out.join("checkpoint.safetensors"),
        moegrad::Device::cpu(),
    )
    .unwrap();
    assert!(
        ck.tensors.keys().all(|k| !k.contains("experts")),
        "{:?}",
        ck.tensors.keys()
    );

    for (bad, what) in [
        (
            TrainConfig {
                model: ModelKind::Cnn,
                ..cfg.clone()
            },
            "--model moe-mlp",
        ),
        (
            TrainConfig {
                experts: 3,
                k: 2,
                ..cfg.clone()
            },
            "--experts",
        ),
    ] {
        let e = run(&bad, RunOptions::default()).unwrap_err().to_string();
        assert!(e.contains(what), "{e}");
    }
}

#[test]
fn command_line_reports_selected_and_true_experts() {
    let out = Command::new(env!("CARGO_BIN_EXE_moegrad"))
        .args([
            "train",
            "--data",
            "synthetic-b",
            "--router",
            "dselect-k",
            "--epochs",
            "1",
        ])
        .args(["--device", "cpu", "--batch", "256", "--json", "--out"])
        .arg(outdir("cli"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["selected_experts"].is_array(), "{v}");
    assert_eq!(v["true_experts"].as_array().unwrap().len(), 4);
    assert_eq!(v["expert_selection_rate"].as_array().unwrap().len(), 16);
    assert_eq!(v["expert_mean_weight"].as_array().unwrap().len(), 16);
    let out = Command::new(env!("CARGO_BIN_EXE_moegrad"))
        .args([
            "train",
            "--data",
            "synthetic-b",
            "--model",
            "cnn",
            "--device",
            "cpu",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("moe-mlp"));
}

/// One dataset of [`every_router_learns_on_mnist_multimnist_and_synthetic_b`]: the model, its
/// size, a short run, and what that run must reach.
struct LearningCase {
    data: DataKind,
    model: ModelKind,
    experts: usize,
    k: usize,
    train_limit: usize,
    test_limit: usize,
    lr: f64,
    /// the test loss after the run must be below this fraction of the loss before it
    max_loss_ratio: f64,
    /// each task's test accuracy must be above this (chance is 0.1 on the digits)
    min_accuracy: f64,
}

/// Every router, on each dataset, lowers the test loss of the model it starts from within a few
/// steps (8 on MNIST and synthetic-b, 4 of the costlier CNN on MultiMNIST), and on MNIST reaches
/// an accuracy well above chance. Measured ratios (seed 0): MNIST 0.57–0.81 with accuracy
/// 0.38–0.66, MultiMNIST 0.81–0.985, synthetic-b 0.33–0.93.
#[test]
fn every_router_learns_on_mnist_multimnist_and_synthetic_b() {
    let data_dir = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/..")).join("data");
    let cases = [
        LearningCase {
            data: DataKind::Mnist,
            model: ModelKind::MoeMlp,
            experts: 4,
            k: 2,
            train_limit: 256,
            test_limit: 200,
            lr: 3e-3,
            max_loss_ratio: 0.9,
            min_accuracy: 0.3,
        },
        LearningCase {
            data: DataKind::Multimnist,
            model: ModelKind::MmoeCnn,
            experts: 4,
            k: 2,
            train_limit: 128,
            test_limit: 64,
            lr: 3e-3,
            max_loss_ratio: 1.0,
            min_accuracy: 0.0,
        },
        LearningCase {
            data: DataKind::SyntheticB,
            model: ModelKind::MoeMlp,
            experts: 16,
            k: 4,
            train_limit: 256,
            test_limit: 200,
            lr: 3e-2,
            max_loss_ratio: 0.95,
            min_accuracy: 0.0,
        },
    ];
    for case in &cases {
        let base = TrainConfig {
            data: case.data,
            model: case.model,
            experts: case.experts,
            k: case.k,
            epochs: 1,
            batch: 32,
            lr: case.lr,
            train_limit: case.train_limit,
            test_limit: case.test_limit,
            device: "cpu".into(),
            data_dir: data_dir.clone(),
            ..TrainConfig::default()
        };
        let split = common::test_split(&base);
        for &router in ROUTER_NAMES {
            let what = format!("{router} on {:?}", case.data);
            // sparsemixer-v2 is top-1 or top-2 only (it says so in an error for k = 4)
            let k = if router == "sparsemixer-v2" {
                case.k.min(2)
            } else {
                case.k
            };
            let cfg = TrainConfig {
                router: router.into(),
                k,
                out: outdir(&format!("all-{router}-{:?}", case.data)),
                ..base.clone()
            };
            let (start, _) = common::initial_test_metrics(&cfg, &split);
            let s = run(&cfg, RunOptions::default()).unwrap_or_else(|e| panic!("{what}: {e}"));
            assert!(s.train_loss.is_finite(), "{what}");
            assert_eq!(s.expert_load.unwrap().len(), case.experts, "{what}");
            assert!(
                s.test_loss < case.max_loss_ratio * start,
                "{what}: test loss {} after training, {start} before (must fall below {} of it)",
                s.test_loss,
                case.max_loss_ratio
            );
            let accuracies: Vec<f64> = match &s.test_accuracy {
                serde_json::Value::Array(a) => a.iter().map(|v| v.as_f64().unwrap()).collect(),
                v => vec![v.as_f64().unwrap()],
            };
            assert!(
                accuracies.iter().all(|&a| a > case.min_accuracy),
                "{what}: test accuracy {accuracies:?}, must exceed {}",
                case.min_accuracy
            );
        }
    }
}

/// DSelect-k's synthetic claim, which moegrad reproduces (docs/benchmarks.md, 150 epochs): the
/// static gate with γ = 10 recovers the 4 true experts of generator B. The smallest setting
/// found to recover them on seeds 0–5 alike (each with ≥ 0.99 of the weight on the true experts
/// and each true expert ≥ 0.23) is 40 epochs at lr 0.02; seed 3 is the slowest (at 30 epochs it
/// has found only 3 of them), seed 0 is pinned. About 4 s on two cores.
#[test]
fn static_dselect_k_with_gamma_10_recovers_the_true_experts() {
    let cfg = TrainConfig {
        data: DataKind::SyntheticB,
        model: ModelKind::MoeMlp,
        router: "dselect-k-static".into(),
        router_options: [("gamma".to_string(), "10".to_string())].into(),
        experts: 16,
        k: 4,
        epochs: 40,
        batch: 128,
        lr: 0.02,
        balance_loss: 0.0,
        test_limit: 2000,
        seed: 0,
        device: "cpu".into(),
        out: outdir("dselect-recovery"),
        ..TrainConfig::default()
    };
    let s = run(&cfg, RunOptions::default()).unwrap();
    let truth = s.true_experts.clone().unwrap();
    let weight = s.expert_mean_weight.clone().unwrap();
    assert_eq!(
        s.selected_experts.clone().unwrap(),
        truth,
        "the gate must select exactly the true experts; mean weights {weight:?}"
    );
    let on_true: f64 = truth.iter().map(|&e| weight[e]).sum();
    assert!(
        on_true > 0.95,
        "weight on the true experts {on_true}: {weight:?}"
    );
    assert!(
        truth.iter().all(|&e| weight[e] > 0.2),
        "each true expert must hold about a quarter: {weight:?}"
    );
    let acc = s.test_accuracy.as_f64().unwrap();
    assert!(acc > 0.95, "test accuracy {acc}");
}
