//! End to end: checkpoints round-trip through safetensors and are written atomically; a resumed
//! run ends exactly where an uninterrupted one ends; short runs on the bundled digits (MNIST and
//! both MultiMNIST tasks) learn; a NaN stops the run and keeps the last good checkpoint; the
//! command line turns bad input into a one-line error and a non-zero exit.

#[path = "../../tests/common/mod.rs"]
mod common;

use moegrad::checkpoint::Checkpoint;
use moegrad::train::{
    DataKind, ModelKind, OptimizerKind, RunOptions, TrainConfig, run, run_observed,
};
use moegrad::{Device, Tensor};
use moegrad_cli::progress::CliObserver;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

fn outdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("moegrad-e2e-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn small(name: &str) -> TrainConfig {
    TrainConfig {
        data_dir: Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/..")).join("data"),
        model: ModelKind::Mlp,
        epochs: 2,
        batch: 32,
        lr: 2e-3,
        device: "cpu".into(),
        out: outdir(name),
        train_limit: 320,
        test_limit: 200,
        ..TrainConfig::default()
    }
}

fn params_of(path: &Path) -> BTreeMap<String, Vec<f32>> {
    let ck = Checkpoint::load(path, Device::cpu()).unwrap();
    ck.tensors
        .iter()
        .map(|(k, t)| (k.clone(), t.to_vec_f32().unwrap()))
        .collect()
}

#[test]
fn checkpoint_round_trip_and_atomic_write() {
    let dir = outdir("ckpt");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("c.safetensors");
    let mut ck = Checkpoint::default();
    ck.tensors.insert(
        "layer.weight".into(),
        Tensor::from_f32(vec![1.5, -2.0, 3.25, 0.0], &[2, 2], Device::cpu()).unwrap(),
    );
    ck.tensors.insert(
        "ids".into(),
        Tensor::from_i32(vec![3, -1], &[2], Device::cpu()).unwrap(),
    );
    ck.tensors.insert(
        "exact".into(),
        Tensor::from_f64(vec![0.1, 1e-300], &[2], Device::cpu()).unwrap(),
    );
    ck.metadata.insert("epoch".into(), "3".into());
    ck.save(&path).unwrap();
    let back = Checkpoint::load(&path, Device::cpu()).unwrap();
    assert_eq!(back.metadata["epoch"], "3");
    assert_eq!(back.tensors["layer.weight"].shape(), &[2, 2]);
    assert_eq!(
        back.tensors["layer.weight"].to_vec_f32().unwrap(),
        vec![1.5, -2.0, 3.25, 0.0]
    );
    assert_eq!(back.tensors["ids"].to_vec_i32().unwrap(), vec![3, -1]);
    assert_eq!(
        back.tensors["exact"].to_vec_f64().unwrap(),
        vec![0.1, 1e-300]
    );
    // Overwriting replaces the file and leaves no temporary behind.
    ck.metadata.insert("epoch".into(), "4".into());
    ck.save(&path).unwrap();
    assert_eq!(
        Checkpoint::load(&path, Device::cpu()).unwrap().metadata["epoch"],
        "4"
    );
    let names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 1, "{names:?}");
    // A corrupt file is an error naming it.
    std::fs::write(dir.join("bad.safetensors"), b"not a checkpoint").unwrap();
    let e = Checkpoint::load(&dir.join("bad.safetensors"), Device::cpu())
        .unwrap_err()
        .to_string();
    assert!(e.contains("bad.safetensors"), "{e}");
}

#[test]
fn resume_ends_exactly_where_an_uninterrupted_run_ends() {
    for opt in [OptimizerKind::Adam, OptimizerKind::Sgd] {
        let straight = TrainConfig {
            optimizer: opt,
            ..small("straight")
        };
        let a = run(&straight, RunOptions::default()).unwrap();
        let split = TrainConfig {
            optimizer: opt,
            epochs: 1,
            ..small("split")
        };
        run(&split, RunOptions::default()).unwrap();
        let resumed = TrainConfig {
            epochs: 2,
            ..split.clone()
        };
        let b = run(
            &resumed,
            RunOptions {
                resume: true,
                ..RunOptions::default()
            },
        )
        .unwrap();
        assert_eq!(a.steps, b.steps);
        assert_eq!(a.train_loss, b.train_loss, "{opt:?}");
        assert_eq!(a.test_loss, b.test_loss);
        let pa = params_of(&straight.out.join("checkpoint.safetensors"));
        let pb = params_of(&resumed.out.join("checkpoint.safetensors"));
        assert_eq!(
            pa, pb,
            "{opt:?}: parameters and optimizer state must match bit for bit"
        );
        let lines = |c: &TrainConfig| {
            std::fs::read_to_string(c.out.join("metrics.jsonl"))
                .unwrap()
                .lines()
                .count()
        };
        assert_eq!(lines(&straight), 2);
        assert_eq!(lines(&resumed), 2);
    }
}

#[test]
fn a_short_cnn_run_learns_and_writes_its_outputs() {
    let cfg = TrainConfig {
        model: ModelKind::Cnn,
        epochs: 2,
        train_limit: 1500,
        test_limit: 500,
        ..small("learns")
    };
    let s = run_observed(&cfg, RunOptions::default(), &mut CliObserver::new()).unwrap();
    let acc = s.test_accuracy.as_f64().unwrap();
    assert!(acc > 0.7, "test accuracy after 2 short epochs: {acc}");
    for f in ["metrics.jsonl", "checkpoint.safetensors", "curves.svg"] {
        assert!(cfg.out.join(f).is_file(), "{f} missing");
    }
    let svg = std::fs::read_to_string(cfg.out.join("curves.svg")).unwrap();
    assert!(svg.contains("<svg") && svg.contains("polyline"));
}

/// Both MultiMNIST tasks are reported, and both are learned: one short epoch (32 steps of the
/// MLP, measured accuracies 0.74 and 0.61) takes each task well above chance (0.1) and the test
/// loss far below that of the model it starts from (2.0 against about 4.7).
#[test]
fn multimnist_reports_and_learns_both_tasks() {
    let cfg = TrainConfig {
        data: DataKind::Multimnist,
        epochs: 1,
        train_limit: 1024,
        test_limit: 128,
        ..small("multi")
    };
    let (start, start_acc) = common::initial_test_metrics(&cfg, &common::test_split(&cfg));
    let s = run(&cfg, RunOptions::default()).unwrap();
    let acc: Vec<f64> = s
        .test_accuracy
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_f64().unwrap())
        .collect();
    assert_eq!(acc.len(), 2);
    assert!(
        acc.iter().all(|&a| a > 0.4),
        "test accuracies {acc:?} (before training {start_acc:?}): both tasks must be learned"
    );
    assert!(
        s.test_loss < 0.7 * start,
        "test loss {} after training, {start} before",
        s.test_loss
    );
}

#[test]
fn nan_stops_the_run_and_keeps_the_last_good_checkpoint() {
    let cfg = TrainConfig {
        epochs: 1,
        optimizer: OptimizerKind::Sgd,
        ..small("nan")
    };
    run(&cfg, RunOptions::default()).unwrap();
    let path = cfg.out.join("checkpoint.safetensors");
    let before = std::fs::read(&path).unwrap();
    let wild = TrainConfig {
        epochs: 3,
        lr: 1e30,
        log_every: 1,
        ..cfg.clone()
    };
    let e = run(
        &wild,
        RunOptions {
            resume: true,
            allow_config_change: vec!["lr".into()],
            ..RunOptions::default()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("at step") && e.contains("checkpoint"), "{e}");
    assert_eq!(
        std::fs::read(&path).unwrap(),
        before,
        "the good checkpoint must survive"
    );
}

#[test]
fn command_line_bad_input_is_one_line_and_nonzero() {
    let bin = env!("CARGO_BIN_EXE_moegrad");
    let cases: &[&[&str]] = &[
        &["train", "--batch", "0"],
        &["train", "--lr", "nan"],
        &["train", "--lr", "-1"],
        &["train", "--data", "fashion"],
        &["train", "--optimizer", "lion"],
        &["train", "--device", "tpu"],
        &[
            "train",
            "--data-dir",
            "/definitely/not/here",
            "--device",
            "cpu",
        ],
        &[
            "train",
            "--resume",
            "--device",
            "cpu",
            "--out",
            "/definitely/not/here",
        ],
    ];
    for args in cases {
        let out = Command::new(bin).args(*args).output().unwrap();
        assert!(!out.status.success(), "{args:?} should fail");
        let err = String::from_utf8_lossy(&out.stderr);
        let lines: Vec<&str> = err
            .lines()
            .filter(|l| !l.starts_with("moegrad: using"))
            .collect();
        assert_eq!(lines.len(), 1, "{args:?}: expected one line, got {err:?}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

#[test]
fn moe_runs_report_expert_load_and_drop_rate() {
    for (model, data) in [
        (ModelKind::MoeMlp, DataKind::Mnist),
        (ModelKind::MmoeCnn, DataKind::Multimnist),
    ] {
        let cfg = TrainConfig {
            model,
            data,
            router: "topk".into(),
            experts: 4,
            k: 2,
            capacity_factor: 1.0,
            epochs: 1,
            train_limit: 128,
            test_limit: 64,
            ..small("moe")
        };
        let s = run_observed(&cfg, RunOptions::default(), &mut CliObserver::new()).unwrap();
        let load = s.expert_load.clone().unwrap();
        assert_eq!(load.len(), 4);
        assert!((load.iter().sum::<f64>() - 1.0).abs() < 1e-9);
        let drop = s.drop_rate.unwrap();
        assert!((0.0..1.0).contains(&drop));
        let json = serde_json::to_value(&s).unwrap();
        assert!(json["expert_load"].is_array() && json["drop_rate"].is_number());
        assert!(cfg.out.join("expert_load.svg").is_file());
    }
    let bad = TrainConfig {
        model: ModelKind::MoeMlp,
        router: "nope".into(),
        ..small("moe-bad")
    };
    assert!(
        run(&bad, RunOptions::default())
            .unwrap_err()
            .to_string()
            .contains("--router")
    );
    let bad = TrainConfig {
        model: ModelKind::MoeMlp,
        k: 9,
        experts: 4,
        ..small("moe-bad2")
    };
    assert!(
        run(&bad, RunOptions::default())
            .unwrap_err()
            .to_string()
            .contains("--k 9")
    );
}
