//! Robustness of training runs, checkpoints and `--resume`, each fed the bad input or the
//! interruption it guards against:
//!
//! * every router resumes bit for bit (its noise counter is in the checkpoint), and a cosine
//!   schedule trained in parts follows the one of an uninterrupted run (`--schedule-epochs`);
//! * no NaN or infinity is ever saved (loss, parameters and optimizer state are checked before
//!   writing) or resumed from, and the NaN message names the step range and a checkpoint of
//!   this run;
//! * a fresh run never deletes an earlier run's record without `--overwrite`, and `--out` is
//!   locked against a concurrent run;
//! * `--resume` refuses a changed configuration (listing each setting with its old and new
//!   value), malformed metadata, missing optimizer or router state, and a run already trained
//!   as far as `--epochs` asks;
//! * temporaries of killed runs are removed at the start of a run.
//!
//! Runs are tiny (48 training images, 3 steps per epoch) so the whole file takes seconds.

use moegrad::checkpoint::Checkpoint;
use moegrad::train::{DataKind, ModelKind, RunOptions, TrainConfig, run};
use moegrad::{Device, Tensor};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A fresh, empty output directory for test `name`.
fn outdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("moegrad-robust-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn data_dir() -> PathBuf {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/..")).join("data")
}

/// A tiny MoE run on the CPU: 48 training images in batches of 16 (3 steps per epoch).
fn tiny(router: &str, name: &str) -> TrainConfig {
    TrainConfig {
        data_dir: data_dir(),
        model: ModelKind::MoeMlp,
        router: router.into(),
        experts: 4,
        k: 2,
        expert_hidden: 8,
        epochs: 2,
        batch: 16,
        seed: 3,
        device: "cpu".into(),
        out: outdir(name),
        train_limit: 48,
        test_limit: 16,
        ..TrainConfig::default()
    }
}

fn resume() -> RunOptions {
    RunOptions {
        resume: true,
        ..RunOptions::default()
    }
}

/// Every tensor of a checkpoint as raw values (bit patterns, so NaN = NaN and -0 ≠ 0).
fn tensors_of(path: &Path) -> BTreeMap<String, Vec<u64>> {
    let ck = Checkpoint::load(path, Device::cpu()).unwrap();
    ck.tensors
        .iter()
        .map(|(k, t)| {
            let bits = match t.dtype() {
                moegrad::DType::I32 => t
                    .to_vec_i32()
                    .unwrap()
                    .into_iter()
                    .map(|v| v as u64)
                    .collect(),
                _ => t
                    .to_vec_f64()
                    .unwrap()
                    .into_iter()
                    .map(f64::to_bits)
                    .collect(),
            };
            (k.clone(), bits)
        })
        .collect()
}

/// Trains `straight` in one go and the same run as 1 epoch + `--resume`; returns a description
/// of every difference (empty when the runs agree bit for bit).
fn resume_differences(straight: &TrainConfig, split_name: &str) -> Vec<String> {
    let a = run(straight, RunOptions::default()).unwrap();
    let first = TrainConfig {
        epochs: 1,
        out: outdir(split_name),
        ..straight.clone()
    };
    run(&first, RunOptions::default()).unwrap();
    let rest = TrainConfig {
        epochs: straight.epochs,
        ..first.clone()
    };
    let b = run(&rest, resume()).unwrap();
    let mut diffs = Vec::new();
    if (a.train_loss.to_bits(), a.test_loss.to_bits(), a.steps)
        != (b.train_loss.to_bits(), b.test_loss.to_bits(), b.steps)
    {
        diffs.push(format!(
            "train/test loss, steps {} {} {} straight vs {} {} {} resumed",
            a.train_loss, a.test_loss, a.steps, b.train_loss, b.test_loss, b.steps
        ));
    }
    let ta = tensors_of(&straight.out.join("checkpoint.safetensors"));
    let tb = tensors_of(&rest.out.join("checkpoint.safetensors"));
    let differing: Vec<&String> = ta
        .keys()
        .chain(tb.keys())
        .filter(|k| ta.get(*k) != tb.get(*k))
        .collect();
    if let Some(first) = differing.first() {
        diffs.push(format!(
            "{} checkpoint tensors (first: {first})",
            differing.len()
        ));
    }
    diffs
}

/// The routers that draw noise in training: their checkpoints must carry the draw count.
const NOISY: &[&str] = &[
    "topk-noisy",
    "switch",
    "vmoe",
    "smoe",
    "sparsemixer",
    "sparsemixer-1st",
    "sparsemixer-2rd",
    "sparsemixer-v2",
    "st",
    "gumbel-st",
    "reinforce",
    "reinmax",
    "moesart",
];

#[test]
fn every_router_resumes_bit_for_bit() {
    let mut failures = Vec::new();
    for &router in moegrad::moe::ROUTER_NAMES {
        let straight = tiny(router, &format!("straight-{router}"));
        let diffs = resume_differences(&straight, &format!("split-{router}"));
        if !diffs.is_empty() {
            failures.push(format!("{router}: {}", diffs.join(", ")));
        }
        if NOISY.contains(&router) {
            // the counter must be there and count the 6 training steps' draws
            let ck = Checkpoint::load(&straight.out.join("checkpoint.safetensors"), Device::cpu())
                .unwrap();
            match ck.tensors.get("state.moe.router.noise_calls") {
                Some(t) if t.item().unwrap() == 6.0 => {}
                other => failures.push(format!(
                    "{router}: state.moe.router.noise_calls is {:?}, expected 6 draws",
                    other.map(|t| t.item().unwrap())
                )),
            }
        }
    }
    // a multi-gate MoE: the routers of tasks 1.. have counters of their own
    let mmoe = TrainConfig {
        data: DataKind::Multimnist,
        model: ModelKind::MmoeCnn,
        experts: 2,
        k: 1,
        train_limit: 32,
        ..tiny("switch", "straight-mmoe")
    };
    let diffs = resume_differences(&mmoe, "split-mmoe");
    if !diffs.is_empty() {
        failures.push(format!("mmoe-cnn switch: {}", diffs.join(", ")));
    }
    let ck = Checkpoint::load(&mmoe.out.join("checkpoint.safetensors"), Device::cpu()).unwrap();
    assert!(
        ck.tensors.contains_key("state.moe.router1.noise_calls"),
        "{:?}",
        ck.tensors.keys().collect::<Vec<_>>()
    );
    assert!(
        failures.is_empty(),
        "1 epoch + --resume differs from 2 epochs straight:\n{}",
        failures.join("\n")
    );
}

/// Every balancer resumes bit for bit: the aux-free and quantile biases (router state) and the
/// global scope's window (layer state) are in the checkpoint; the multi-gate MoE's second
/// router keeps a bias of its own.
#[test]
fn every_balancer_resumes_bit_for_bit() {
    use moegrad::moe::{BalanceMethod, BalanceScope, Balancing};
    let mut failures = Vec::new();
    let cases = [
        ("aux-free", BalanceMethod::AuxFree, BalanceScope::Batch),
        ("quantile", BalanceMethod::Quantile, BalanceScope::Batch),
        ("global", BalanceMethod::Aux, BalanceScope::Global),
    ];
    for (name, method, scope) in cases {
        let mut straight = tiny("topk", &format!("straight-{name}"));
        straight.balancing = Balancing {
            method,
            scope,
            window: 4,
            rate: 0.05,
        };
        let diffs = resume_differences(&straight, &format!("split-{name}"));
        if !diffs.is_empty() {
            failures.push(format!("{name}: {}", diffs.join(", ")));
        }
        let ck =
            Checkpoint::load(&straight.out.join("checkpoint.safetensors"), Device::cpu()).unwrap();
        let key = if scope == BalanceScope::Global {
            "state.moe.balance.window_counts"
        } else {
            "state.moe.router.selection_bias"
        };
        match ck.tensors.get(key) {
            Some(t) if t.to_vec_f64().unwrap().iter().any(|v| *v != 0.0) => {}
            other => failures.push(format!("{name}: {key} is {other:?}")),
        }
    }
    let mut mmoe = TrainConfig {
        data: DataKind::Multimnist,
        model: ModelKind::MmoeCnn,
        experts: 2,
        k: 1,
        train_limit: 32,
        ..tiny("switch", "straight-mmoe-free")
    };
    mmoe.balancing.method = BalanceMethod::AuxFree;
    let diffs = resume_differences(&mmoe, "split-mmoe-free");
    if !diffs.is_empty() {
        failures.push(format!("mmoe-cnn aux-free: {}", diffs.join(", ")));
    }
    let ck = Checkpoint::load(&mmoe.out.join("checkpoint.safetensors"), Device::cpu()).unwrap();
    for key in [
        "state.moe.router.selection_bias",
        "state.moe.router1.selection_bias",
    ] {
        if !ck.tensors.contains_key(key) {
            failures.push(format!("mmoe-cnn aux-free: no {key}"));
        }
    }
    assert!(
        failures.is_empty(),
        "1 epoch + --resume differs from 2 epochs straight:\n{}",
        failures.join("\n")
    );
}

/// `--null-experts` on an image model: trains and resumes bit for bit (the router scores the
/// null experts, the aux-free bias covers them), and the PyTorch export refuses it.
#[test]
fn null_experts_resume_bit_for_bit() {
    use moegrad::moe::BalanceMethod;
    for (name, method) in [
        ("null-aux", BalanceMethod::Aux),
        ("null-free", BalanceMethod::AuxFree),
    ] {
        let mut straight = tiny("topk", &format!("straight-{name}"));
        straight.null_experts = 2;
        straight.balancing.method = method;
        straight.balancing.rate = 0.05;
        let diffs = resume_differences(&straight, &format!("split-{name}"));
        assert!(diffs.is_empty(), "{name}: {}", diffs.join(", "));
        let err = moegrad::train::export_torch(
            &straight.out.join("checkpoint.safetensors"),
            &outdir(&format!("torch-{name}")),
            false,
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("--null-experts") || err.contains("--balance"),
            "{err}"
        );
    }
}

#[test]
fn a_cosine_trained_in_parts_follows_the_cosine_of_one_run() {
    let straight = TrainConfig {
        schedule: "cosine".into(),
        schedule_epochs: 2,
        ..tiny("switch", "cosine-straight")
    };
    let diffs = resume_differences(&straight, "cosine-split");
    assert!(diffs.is_empty(), "{diffs:?}");
    // and the learning rate of the last epoch is the cosine's, not the constant rate
    let line = std::fs::read_to_string(straight.out.join("metrics.jsonl")).unwrap();
    let lr = serde_json::from_str::<serde_json::Value>(line.lines().nth(1).unwrap()).unwrap()["lr"]
        .as_f64()
        .unwrap();
    assert!(lr < 0.5 * straight.lr, "lr of the last step: {lr}");
}

#[test]
fn a_cosine_that_follows_epochs_refuses_a_changed_epochs_on_resume() {
    let first = TrainConfig {
        schedule: "cosine".into(),
        epochs: 1,
        ..tiny("switch", "cosine-follow")
    };
    run(&first, RunOptions::default()).unwrap();
    let more = TrainConfig {
        epochs: 2,
        ..first.clone()
    };
    let e = run(&more, resume()).unwrap_err().to_string();
    assert!(
        e.contains("--epochs 1 → 2") && e.contains("--schedule-epochs"),
        "{e}"
    );
    // a deliberate change is possible
    let allowed = RunOptions {
        allow_config_change: vec!["epochs".into()],
        ..resume()
    };
    assert_eq!(run(&more, allowed).unwrap().steps, 6);
    // --schedule-epochs must cover --epochs and needs the cosine
    let short = TrainConfig {
        schedule_epochs: 1,
        ..more.clone()
    };
    let e = run(&short, RunOptions::default()).unwrap_err().to_string();
    assert!(e.contains("--schedule-epochs 1 is below --epochs 2"), "{e}");
    let constant = TrainConfig {
        schedule: "constant".into(),
        schedule_epochs: 2,
        ..more
    };
    let e = run(&constant, RunOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("--schedule-epochs 2 sets the length"), "{e}");
}

// ---- the command line ----

/// The default arguments of the command-line tests (a tiny MoE run), with `over` replacing or
/// adding flags (a value of "" adds a bare flag such as `--resume`).
fn args(out: &Path, over: &[(&str, &str)]) -> Vec<String> {
    let mut flags: Vec<(String, String)> = [
        ("--model", "moe-mlp"),
        ("--experts", "4"),
        ("--k", "2"),
        ("--expert-hidden", "8"),
        ("--train-limit", "48"),
        ("--test-limit", "16"),
        ("--batch", "16"),
        ("--epochs", "1"),
        ("--device", "cpu"),
        ("--json", ""),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    for (k, v) in over {
        match flags.iter_mut().find(|(f, _)| f == k) {
            Some(slot) => slot.1 = v.to_string(),
            None => flags.push((k.to_string(), v.to_string())),
        }
    }
    let mut out_args = vec![
        "train".to_string(),
        "--data-dir".into(),
        data_dir().display().to_string(),
        "--out".into(),
        out.display().to_string(),
    ];
    for (k, v) in flags {
        out_args.push(k);
        if !v.is_empty() {
            out_args.push(v);
        }
    }
    out_args
}

fn moegrad(args: &[String]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_moegrad"))
        .args(args)
        .output()
        .unwrap()
}

/// Runs the command line and returns its stderr after asserting it failed (with no panic).
fn fails(args: &[String]) -> String {
    let out = moegrad(args);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "{args:?} should fail; stderr {err}");
    assert!(!err.contains("panicked"), "{err}");
    err
}

/// Runs the command line and returns its stderr after asserting it succeeded.
fn succeeds(args: &[String]) -> String {
    let out = moegrad(args);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{args:?} failed: {err}");
    err
}

/// The PID of a process that has exited (so is not running).
fn dead_pid() -> u32 {
    let mut child = Command::new(env!("CARGO_BIN_EXE_moegrad"))
        .arg("--version")
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id();
    child.wait().unwrap();
    pid
}

#[test]
fn a_huge_balance_loss_writes_no_non_finite_checkpoint() {
    let out = outdir("balance");
    let err = fails(&args(
        &out,
        &[("--balance-loss", "1e30"), ("--epochs", "2")],
    ));
    assert!(
        err.contains("adam.v.") && err.contains("inf") && err.contains("without writing"),
        "{err}"
    );
    assert!(!out.join("checkpoint.safetensors").exists());
    assert!(!out.join("metrics.jsonl").exists());
}

#[test]
fn a_cnn_at_lr_1e6_writes_no_non_finite_checkpoint() {
    let out = outdir("cnn-lr");
    let err = fails(&args(
        &out,
        &[("--model", "cnn"), ("--lr", "1e6"), ("--epochs", "2")],
    ));
    assert!(
        err.contains("non-finite") && err.contains("no checkpoint has been written"),
        "{err}"
    );
    assert!(!out.join("checkpoint.safetensors").exists());
}

/// Trains 1 epoch into `out` and rewrites its checkpoint through `edit`.
fn tampered(out: &Path, edit: impl FnOnce(&mut Checkpoint)) {
    succeeds(&args(out, &[]));
    let path = out.join("checkpoint.safetensors");
    let mut ck = Checkpoint::load(&path, Device::cpu()).unwrap();
    edit(&mut ck);
    ck.save(&path).unwrap();
}

#[test]
fn a_checkpoint_with_nan_weights_is_not_resumed() {
    let out = outdir("nan-weights");
    tampered(&out, |ck| {
        let w = ck.tensors["moe.router.weight"].clone();
        let mut v = w.to_vec_f32().unwrap();
        v[3] = f32::NAN;
        ck.tensors.insert(
            "moe.router.weight".into(),
            Tensor::from_f32(v, w.shape(), Device::cpu()).unwrap(),
        );
    });
    let err = fails(&args(&out, &[("--resume", ""), ("--epochs", "2")]));
    assert!(
        err.contains("moe.router.weight holds NaN") && err.contains("cannot be resumed"),
        "{err}"
    );
}

#[test]
fn the_nan_message_names_the_step_and_the_checkpoint_of_this_run() {
    // read every step: the first bad step is known exactly
    let out = outdir("nan-step");
    let wild = [
        ("--optimizer", "sgd"),
        ("--lr", "1e30"),
        ("--log-every", "1"),
    ];
    let err = fails(&args(&out, &wild));
    let step: u64 = err
        .split("at step ")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no step in {err}"));
    assert!(
        err.contains(&format!("it first became non-finite at step {step}")),
        "{err}"
    );
    assert!(
        err.contains("no checkpoint has been written by this run yet"),
        "{err}"
    );
    // read every 3 steps, after a good first epoch: a range, and the resumed checkpoint
    let out = outdir("nan-range");
    succeeds(&args(&out, &[("--optimizer", "sgd")]));
    let err = fails(&args(
        &out,
        &[
            ("--optimizer", "sgd"),
            ("--lr", "1e30"),
            ("--log-every", "3"),
            ("--epochs", "2"),
            ("--resume", ""),
            ("--allow-config-change", "lr"),
        ],
    ));
    assert!(
        err.contains("loss is NaN at step 6") || err.contains("loss is inf at step 6"),
        "{err}"
    );
    assert!(
        err.contains("read every 3 steps")
            && err.contains("last read finite at step 3")
            && err.contains("one of steps 4..=6"),
        "{err}"
    );
    assert!(
        err.contains(&format!(
            "written after epoch 1, is kept at {}",
            out.join("checkpoint.safetensors").display()
        )),
        "{err}"
    );
}

#[test]
fn a_fresh_run_refuses_an_out_holding_an_earlier_run() {
    let out = outdir("fresh");
    succeeds(&args(&out, &[]));
    let metrics = std::fs::read(out.join("metrics.jsonl")).unwrap();
    let ckpt = std::fs::read(out.join("checkpoint.safetensors")).unwrap();
    let err = fails(&args(&out, &[("--lr", "0.002")]));
    assert!(
        err.contains("holds the record of an earlier run")
            && err.contains("--resume")
            && err.contains("--overwrite"),
        "{err}"
    );
    assert_eq!(std::fs::read(out.join("metrics.jsonl")).unwrap(), metrics);
    assert_eq!(
        std::fs::read(out.join("checkpoint.safetensors")).unwrap(),
        ckpt
    );
    assert!(!out.join(".moegrad.lock").exists(), "the lock is released");
}

#[test]
fn overwrite_deletes_the_earlier_run_only_once_the_new_one_is_set_up() {
    let out = outdir("overwrite");
    succeeds(&args(&out, &[]));
    std::fs::write(out.join("notes.txt"), "mine").unwrap();
    let metrics = std::fs::read(out.join("metrics.jsonl")).unwrap();
    // bad input with --overwrite: the earlier run's record is untouched
    let missing = std::env::temp_dir().join("moegrad-robust-no-such-data");
    let mut bad = args(&out, &[("--overwrite", "")]);
    bad[2] = missing.display().to_string();
    fails(&bad);
    assert_eq!(std::fs::read(out.join("metrics.jsonl")).unwrap(), metrics);
    // a good one replaces it and keeps the user's own files
    succeeds(&args(&out, &[("--overwrite", ""), ("--lr", "0.002")]));
    let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    assert_eq!(text.lines().count(), 1);
    assert!(text.contains("\"lr\":0.002"), "{text}");
    assert_eq!(std::fs::read(out.join("notes.txt")).unwrap(), b"mine");
    // --resume and --overwrite contradict each other
    let err = fails(&args(
        &out,
        &[("--overwrite", ""), ("--resume", ""), ("--epochs", "2")],
    ));
    assert!(err.contains("pass one of them"), "{err}");
}

#[test]
fn a_nan_after_overwrite_names_no_checkpoint_of_the_earlier_run() {
    let out = outdir("overwrite-nan");
    succeeds(&args(&out, &[("--optimizer", "sgd")]));
    let err = fails(&args(
        &out,
        &[
            ("--optimizer", "sgd"),
            ("--lr", "1e30"),
            ("--log-every", "1"),
            ("--overwrite", ""),
        ],
    ));
    assert!(
        err.contains("no checkpoint has been written by this run yet"),
        "{err}"
    );
    assert!(!err.contains("checkpoint.safetensors"), "{err}");
}

#[test]
fn an_out_locked_by_a_running_process_is_refused() {
    let out = outdir("lock-live");
    std::fs::create_dir_all(&out).unwrap();
    // this test's own process is running
    let me = std::process::id();
    std::fs::write(out.join(".moegrad.lock"), format!("{me}\n")).unwrap();
    let err = fails(&args(&out, &[]));
    assert!(
        err.contains(&format!("in use by another moegrad run (PID {me}")),
        "{err}"
    );
    assert_eq!(
        std::fs::read_to_string(out.join(".moegrad.lock")).unwrap(),
        format!("{me}\n"),
        "the live lock is left alone"
    );
    assert!(!out.join("metrics.jsonl").exists());
}

#[test]
fn a_stale_lock_is_taken_over_with_a_note() {
    let out = outdir("lock-stale");
    std::fs::create_dir_all(&out).unwrap();
    let dead = dead_pid();
    std::fs::write(out.join(".moegrad.lock"), format!("{dead}\n")).unwrap();
    let err = succeeds(&args(&out, &[]));
    assert!(
        err.contains("took over the lock") && err.contains(&dead.to_string()),
        "{err}"
    );
    assert!(out.join("checkpoint.safetensors").is_file());
    assert!(!out.join(".moegrad.lock").exists(), "the lock is released");
}

#[test]
fn resume_refuses_each_changed_setting_naming_old_and_new() {
    let out = outdir("changed");
    succeeds(&args(&out, &[]));
    let cases: &[(&str, &str, &str)] = &[
        ("--router", "switch", "--router \"topk\" → \"switch\""),
        ("--k", "1", "--k 2 → 1"),
        ("--optimizer", "sgd", "--optimizer \"adam\" → \"sgd\""),
        ("--lr", "0.01", "--lr 0.001 → 0.01"),
        ("--train-limit", "32", "--train-limit 48 → 32"),
        ("--seed", "7", "--seed 0 → 7"),
        ("--expert-hidden", "16", "--expert-hidden 8 → 16"),
    ];
    for (flag, value, shown) in cases {
        let err = fails(&args(
            &out,
            &[(flag, value), ("--resume", ""), ("--epochs", "2")],
        ));
        assert!(err.contains(shown), "{flag} {value}: {err}");
    }
    // several at once are listed together
    let err = fails(&args(
        &out,
        &[
            ("--lr", "0.01"),
            ("--k", "1"),
            ("--resume", ""),
            ("--epochs", "2"),
        ],
    ));
    assert!(
        err.contains("--k 2 → 1, --lr 0.001 → 0.01") && err.contains("--allow-config-change lr"),
        "{err}"
    );
    // the checkpoint is untouched by the refusals
    let lines = std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .count();
    assert_eq!(lines, 1);
}

#[test]
fn allow_config_change_accepts_only_meaningful_changes() {
    let out = outdir("allowed");
    succeeds(&args(&out, &[]));
    let err = fails(&args(
        &out,
        &[
            ("--router", "switch"),
            ("--resume", ""),
            ("--epochs", "2"),
            ("--allow-config-change", "router"),
        ],
    ));
    assert!(err.contains("--router defines the parameters"), "{err}");
    let err = fails(&args(
        &out,
        &[
            ("--resume", ""),
            ("--epochs", "2"),
            ("--allow-config-change", "colour"),
        ],
    ));
    assert!(err.contains("no such setting"), "{err}");
    let err = fails(&args(&out, &[("--allow-config-change", "lr")]));
    assert!(err.contains("applies to --resume only"), "{err}");
    succeeds(&args(
        &out,
        &[
            ("--lr", "0.01"),
            ("--train-limit", "32"),
            ("--resume", ""),
            ("--epochs", "2"),
            ("--allow-config-change", "lr,train-limit"),
        ],
    ));
    let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    assert!(
        text.lines().nth(1).unwrap().contains("\"lr\":0.01"),
        "{text}"
    );
}

#[test]
fn resume_says_when_the_run_is_already_trained() {
    let out = outdir("trained");
    succeeds(&args(&out, &[("--epochs", "2")]));
    for epochs in ["1", "2"] {
        let err = fails(&args(&out, &[("--resume", ""), ("--epochs", epochs)]));
        assert!(
            err.contains("has already trained 2 epochs")
                && err.contains(&format!("--epochs {epochs} leaves nothing")),
            "{err}"
        );
    }
}

#[test]
fn resume_refuses_malformed_metadata() {
    for (key, value) in [
        ("epoch", "two"),
        ("epoch", "0"),
        ("steps", "-3"),
        ("steps", "7"),
        ("format", "moegrad-checkpoint-1"),
        ("optimizer_state", "adam"),
        ("config", "{}"),
    ] {
        let out = outdir(&format!("meta-{key}-{value}"));
        tampered(&out, |ck| {
            ck.metadata.insert(key.into(), value.into());
        });
        let err = fails(&args(&out, &[("--resume", ""), ("--epochs", "2")]));
        assert!(
            err.contains(key) && err.contains("checkpoint.safetensors"),
            "{key} = {value}: {err}"
        );
    }
    let out = outdir("meta-missing");
    tampered(&out, |ck| {
        ck.metadata.remove("steps");
    });
    let err = fails(&args(&out, &[("--resume", ""), ("--epochs", "2")]));
    assert!(err.contains("no steps in its metadata"), "{err}");
}

#[test]
fn resume_refuses_missing_optimizer_or_router_state() {
    for missing in [
        "adam.m.moe.router.weight",
        "adam.v.towers.0.0.bias",
        "moe.experts.w1",
    ] {
        let out = outdir(&format!("missing-{missing}"));
        tampered(&out, |ck| {
            ck.tensors.remove(missing);
        });
        let err = fails(&args(&out, &[("--resume", ""), ("--epochs", "2")]));
        assert!(err.contains(&format!("{missing} is missing")), "{err}");
    }
    let out = outdir("missing-noise");
    let switch = [("--router", "switch"), ("--k", "1")];
    let mut resumed = switch.to_vec();
    resumed.extend([("--resume", ""), ("--epochs", "2")]);
    succeeds(&args(&out, &switch));
    let path = out.join("checkpoint.safetensors");
    let mut ck = Checkpoint::load(&path, Device::cpu()).unwrap();
    ck.tensors.remove("state.moe.router.noise_calls");
    ck.save(&path).unwrap();
    let err = fails(&args(&out, &resumed));
    assert!(
        err.contains("state.moe.router.noise_calls is missing"),
        "{err}"
    );
    // a tensor this model does not have
    ck.tensors.insert(
        "moe.router.extra".into(),
        Tensor::from_f32(vec![0.0], &[1], Device::cpu()).unwrap(),
    );
    ck.save(&path).unwrap();
    let err = fails(&args(&out, &resumed));
    assert!(
        err.contains("tensor moe.router.extra is no parameter"),
        "{err}"
    );
}

#[test]
fn temporaries_of_killed_runs_are_removed_at_the_start() {
    let out = outdir("temporaries");
    std::fs::create_dir_all(&out).unwrap();
    let dead = dead_pid();
    let stale = out.join(format!(".checkpoint.safetensors.tmp-{dead}"));
    let live = out.join(format!(
        ".checkpoint.safetensors.tmp-{}",
        std::process::id()
    ));
    let foreign = out.join(format!(".notes.txt.tmp-{dead}"));
    for f in [&stale, &live, &foreign] {
        std::fs::write(f, vec![0u8; 4096]).unwrap();
    }
    let err = succeeds(&args(&out, &[]));
    assert!(!stale.exists(), "the temporary of a dead process stays");
    assert!(live.exists(), "a running process's temporary was removed");
    assert!(
        foreign.exists(),
        "a file moegrad does not write was removed"
    );
    assert!(err.contains("removed 1 temporary file"), "{err}");
}

#[test]
fn a_dropout_layer_resumes_its_mask_sequence() {
    use moegrad::nn::{Dropout, Module, Parameters, Sequential};
    let build = || Sequential::new().push(Dropout::new(0.5, 11).unwrap());
    let x = Tensor::from_f32(vec![1.0; 64], &[8, 8], Device::cpu()).unwrap();
    let first = build();
    first.forward(&x).unwrap();
    let state = first.state().unwrap();
    assert_eq!(state.len(), 1);
    assert_eq!(state[0].0, "0.dropout_calls");
    let expected = first.forward(&x).unwrap().to_vec_f32().unwrap();
    // a fresh layer given the saved counter draws the mask the first one drew next
    let resumed = build();
    resumed.load_state(&state[0].0, &state[0].1).unwrap();
    assert_eq!(resumed.forward(&x).unwrap().to_vec_f32().unwrap(), expected);
    let e = resumed
        .load_state("1.dropout_calls", &state[0].1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("1.dropout_calls"), "{e}");
}
