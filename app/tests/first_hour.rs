//! A new user's first hour on the command line, each case fed the input that once went wrong:
//!
//! * sizes are capped before anything is allocated (`generate --tokens`, `--eval-windows`, a
//!   checkpoint's metadata describing a huge model, a checkpoint that is a device, a compare
//!   grid of a million cells), and logits that overflow are an error, not `PPPP…`;
//! * `compare` fails when a cell failed and refuses the same value written two ways;
//! * flags that a model does not read are warned about, and `--min-lr` reaches the image models;
//! * nothing of an earlier run is lost: `--overwrite` sets it aside until the new run's first
//!   checkpoint and puts it back when the new run ends (or was killed) before that, per-layer
//!   plots count as run files, plots are written atomically;
//! * messages say what is wrong: missing required arguments, negative counts, `-inf`, an
//!   `--out` that is a file, a run that wrote no checkpoint, a lock that may be stale;
//! * without `--out` each run gets its own directory and `runs/latest` follows it; the bundled
//!   data is built in, so any working directory works; the Wayland line of Mesa's probe is quiet.
//!
//! Runs are tiny (a few hundred images or a one-layer character model) so the file takes seconds.

use moegrad::checkpoint::Checkpoint;
use moegrad::train::out_dir::{OutDir, REPLACED_DIR};
use moegrad::{Device, Tensor};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A fresh, empty directory for test `name`.
fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("moegrad-first-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `moegrad ARGS` run in `dir`.
fn moegrad(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_moegrad"))
        .args(args)
        .current_dir(dir)
        .output()
        .expect("moegrad runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Asserts `o` failed with exit status 1 (an error) or 2 (a usage error), not a panic's 101
/// or an abort, and with one stderr line containing every one of `parts`.
fn fails_with(what: &str, o: &Output, parts: &[&str]) {
    let e = stderr(o);
    assert!(
        matches!(o.status.code(), Some(1 | 2)),
        "{what}: exit status {:?}, stderr {e}",
        o.status.code()
    );
    let lines: Vec<&str> = e
        .lines()
        .filter(|l| !l.contains("using CPU") && !l.starts_with("moegrad: warning:"))
        .collect();
    assert_eq!(lines.len(), 1, "{what}: expected one line, got {e}");
    for p in parts {
        assert!(lines[0].contains(p), "{what}: {p:?} not in {e}");
    }
}

/// A tiny image run's flags (500 training images, one epoch).
const TINY_MLP: &[&str] = &[
    "train",
    "--model",
    "mlp",
    "--epochs",
    "1",
    "--train-limit",
    "500",
    "--test-limit",
    "100",
    "--device",
    "cpu",
];

/// The flags of a one-layer character model run on the CPU: `train`, then `data` (e.g.
/// `["--data", "shakespeare"]`), `iters` iterations evaluated every 2 on 2 windows, then `extra`.
fn tiny_lm_args<'a>(data: &[&'a str], iters: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec!["train"];
    a.extend(data);
    a.extend([
        "--model",
        "gpt",
        "--layers",
        "1",
        "--d-model",
        "16",
        "--heads",
        "2",
        "--block",
        "8",
        "--batch",
        "2",
        "--iters",
        iters,
        "--eval-every",
        "2",
        "--eval-windows",
        "2",
        "--device",
        "cpu",
    ]);
    a.extend(extra);
    a
}

/// Trains a one-layer character model in `dir/lm` and returns its checkpoint.
fn tiny_lm(dir: &Path) -> PathBuf {
    let o = moegrad(
        dir,
        &tiny_lm_args(&["--data", "shakespeare"], "2", &["--out", "lm"]),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    dir.join("lm/checkpoint.safetensors")
}

#[test]
fn sizes_are_capped_before_anything_is_allocated() {
    let dir = scratch("caps");
    let ck = tiny_lm(&dir);
    let ck_s = ck.display().to_string();
    for tokens in ["18446744073709551615", "100000000000"] {
        let o = moegrad(
            &dir,
            &["generate", "--checkpoint", &ck_s, "--tokens", tokens],
        );
        fails_with("--tokens", &o, &["--tokens", "1000000"]);
    }
    let o = moegrad(
        &dir,
        &[
            "train",
            "--data",
            "shakespeare",
            "--eval-windows",
            "10000000000",
        ],
    );
    fails_with("--eval-windows", &o, &["--eval-windows", "100000"]);
    let o = moegrad(&dir, &["generate", "--checkpoint", "/dev/zero"]);
    fails_with(
        "a device as checkpoint",
        &o,
        &["/dev/zero", "not a regular file"],
    );

    // metadata that describes a much larger model than the tensors: refused before building it
    let mut c = Checkpoint::load(&ck, Device::cpu()).unwrap();
    let mut cfg: serde_json::Value = serde_json::from_str(&c.metadata["config"]).unwrap();
    cfg["layers"] = serde_json::json!(1_000_000);
    c.metadata.insert("config".into(), cfg.to_string());
    let big = dir.join("big.safetensors");
    c.save(&big).unwrap();
    let o = moegrad(
        &dir,
        &["generate", "--checkpoint", &big.display().to_string()],
    );
    fails_with("layers 1000000", &o, &["big.safetensors", "metadata"]);

    // settings in the metadata that no run could have: the checkpoint is named, not a flag
    let mut c = Checkpoint::load(&ck, Device::cpu()).unwrap();
    let mut cfg: serde_json::Value = serde_json::from_str(&c.metadata["config"]).unwrap();
    cfg["block"] = serde_json::json!(0);
    c.metadata.insert("config".into(), cfg.to_string());
    let bad = dir.join("bad.safetensors");
    c.save(&bad).unwrap();
    let o = moegrad(
        &dir,
        &["generate", "--checkpoint", &bad.display().to_string()],
    );
    fails_with(
        "block 0",
        &o,
        &["bad.safetensors", "metadata are not valid"],
    );

    // a grid of a million cells is refused at once, naming the cap
    let seeds: Vec<String> = (0..1000).map(|s| s.to_string()).collect();
    let seeds = seeds.join(",");
    let start = std::time::Instant::now();
    let o = moegrad(
        &dir,
        &[
            "compare",
            "--seeds",
            &seeds,
            "--set",
            &format!("batch={seeds}"),
            "--dry-run",
        ],
    );
    fails_with("a huge grid", &o, &["4096"]);
    assert!(
        start.elapsed().as_secs() < 20,
        "the grid was not refused at once"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_text_file_is_refused_early_when_it_is_not_text_or_too_large() {
    let dir = scratch("text");
    let train = |file: &str, limit: Option<&str>| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_moegrad"));
        c.args([
            "train",
            "--data",
            "text",
            "--data-file",
            file,
            "--device",
            "cpu",
        ])
        .current_dir(&dir);
        if let Some(l) = limit {
            c.env("MOEGRAD_MEMORY_LIMIT", l);
        }
        c.output().unwrap()
    };
    let start = std::time::Instant::now();
    fails_with(
        "/dev/zero",
        &train("/dev/zero", None),
        &["NUL byte at offset 0"],
    );
    // (its first bad byte may be an invalid one or a NUL)
    let o = train("/dev/urandom", None);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("not UTF-8") || stderr(&o).contains("NUL byte"),
        "{}",
        stderr(&o)
    );
    assert!(
        start.elapsed().as_secs() < 10,
        "a device was read far past its first bad byte"
    );
    // 3 MB of text under a 4 MB memory limit: refused while reading, naming the limit
    std::fs::write(dir.join("big.txt"), "to be or not to be\n".repeat(150_000)).unwrap();
    fails_with(
        "a text over the memory limit",
        &train("big.txt", Some("4M")),
        &["big.txt", "memory limit"],
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn huge_weights_are_an_error_not_garbage_text() {
    let dir = scratch("huge");
    let ck = tiny_lm(&dir);
    let mut c = Checkpoint::load(&ck, Device::cpu()).unwrap();
    for t in c.tensors.values_mut() {
        let n = t.numel();
        *t = Tensor::from_f32(vec![3e38; n], t.shape(), Device::cpu()).unwrap();
    }
    let huge = dir.join("huge.safetensors");
    c.save(&huge).unwrap();
    let o = moegrad(
        &dir,
        &["generate", "--checkpoint", &huge.display().to_string()],
    );
    fails_with("weights of 3e38", &o, &["logits", "not finite"]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn compare_refuses_the_same_value_written_twice() {
    let dir = scratch("dup");
    for axis in [["--seeds", "1,01"], ["--set", "k=2,02"]] {
        let o = moegrad(
            &dir,
            &[
                "compare",
                "--model",
                "moe-mlp",
                axis[0],
                axis[1],
                "--dry-run",
            ],
        );
        fails_with(axis[1], &o, &["same settings"]);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn flags_a_model_does_not_read_are_warned_about_and_min_lr_is_read() {
    let dir = scratch("flags");
    let mut args = TINY_MLP.to_vec();
    args.extend([
        "--iters",
        "7",
        "--layers",
        "100",
        "--block",
        "0",
        "--data-file",
        "x.txt",
        "--out",
        "a",
    ]);
    let o = moegrad(&dir, &args);
    let e = stderr(&o);
    assert!(o.status.success(), "{e}");
    assert!(e.contains("--iters, --layers, --block ignored"), "{e}");
    assert!(e.contains("--data-file ignored"), "{e}");
    let lm = moegrad(
        &dir,
        &tiny_lm_args(
            &["--data", "shakespeare"],
            "2",
            &["--epochs", "3", "--out", "lm"],
        ),
    );
    assert!(stderr(&lm).contains("--epochs ignored"), "{}", stderr(&lm));
    fails_with(
        "--min-lr -1",
        &moegrad(&dir, &["train", "--schedule", "cosine", "--min-lr", "-1"]),
        &["--min-lr -1"],
    );
    // the image models' cosine ends at --min-lr: the final loss differs with it
    let run = |min_lr: &str, out: &str| {
        let mut a = TINY_MLP.to_vec();
        a[4] = "2";
        a.extend([
            "--schedule",
            "cosine",
            "--lr",
            "0.01",
            "--min-lr",
            min_lr,
            "--out",
            out,
            "--json",
        ]);
        let o = moegrad(&dir, &a);
        assert!(o.status.success(), "{}", stderr(&o));
        let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        j["test_loss"].as_f64().unwrap()
    };
    assert_ne!(
        run("0", "c0"),
        run("0.01", "c1"),
        "--min-lr changed nothing"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn overwrite_keeps_the_earlier_run_until_the_new_one_checkpoints() {
    let dir = scratch("overwrite");
    let mut first = TINY_MLP.to_vec();
    first.extend(["--out", "r"]);
    assert!(moegrad(&dir, &first).status.success());
    let r = dir.join("r");
    let before = std::fs::read(r.join("checkpoint.safetensors")).unwrap();
    // an earlier run's per-layer plot is part of its record
    std::fs::write(r.join("expert_load_1.svg"), "<svg/>").unwrap();

    // a new run that fails before its first checkpoint (it diverges at once): nothing lost
    let mut failing = first.clone();
    failing.extend(["--overwrite", "--lr", "1e30"]);
    let o = moegrad(&dir, &failing);
    assert!(!o.status.success());
    assert_eq!(
        std::fs::read(r.join("checkpoint.safetensors")).unwrap(),
        before,
        "the earlier checkpoint was lost"
    );
    assert!(r.join("expert_load_1.svg").exists() && !r.join(REPLACED_DIR).exists());

    // a run killed between the two (simulated: the files set aside, no new checkpoint): the
    // next claim puts the earlier run back
    std::fs::create_dir_all(r.join(REPLACED_DIR)).unwrap();
    for f in ["checkpoint.safetensors", "metrics.jsonl"] {
        std::fs::rename(r.join(f), r.join(REPLACED_DIR).join(f)).unwrap();
    }
    std::fs::write(r.join("metrics.jsonl"), "{\"partial\": true}\n").unwrap();
    let claimed = OutDir::claim(&r, true, false).unwrap();
    assert!(claimed.notes.iter().any(|n| n.contains("put back")));
    drop(claimed);
    assert_eq!(
        std::fs::read(r.join("checkpoint.safetensors")).unwrap(),
        before
    );
    assert!(
        !std::fs::read_to_string(r.join("metrics.jsonl"))
            .unwrap()
            .contains("partial")
    );

    // a new run that checkpoints replaces everything, the old per-layer plot included
    let mut ok = first.clone();
    ok.extend(["--overwrite", "--seed", "5"]);
    let o = moegrad(&dir, &ok);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_ne!(
        std::fs::read(r.join("checkpoint.safetensors")).unwrap(),
        before
    );
    assert!(!r.join("expert_load_1.svg").exists() && !r.join(REPLACED_DIR).exists());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_plot_that_cannot_be_written_leaves_the_old_one_whole() {
    let dir = scratch("plot");
    let path = dir.join("curves.svg");
    let point = |epoch| moegrad_cli::plot::train::EpochPoint {
        epoch,
        train_loss: 1.0,
        test_loss: 1.1,
        test_accuracy: vec![0.5],
    };
    moegrad_cli::plot::train::draw_curves(&path, &[point(1), point(2)], "t").unwrap();
    let old = std::fs::read(&path).unwrap();
    // the temporary's name is taken by a directory: the write fails before the rename
    let tmp = dir.join(format!(".curves.svg.tmp-{}", std::process::id()));
    std::fs::create_dir_all(tmp.join("blocker")).unwrap();
    let r = moegrad_cli::plot::train::draw_curves(&path, &[point(1), point(2), point(3)], "t");
    assert!(r.is_err(), "the blocked write succeeded");
    assert_eq!(
        std::fs::read(&path).unwrap(),
        old,
        "the old plot was damaged"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn messages_say_what_is_wrong() {
    let dir = scratch("messages");
    fails_with(
        "generate without --checkpoint",
        &moegrad(&dir, &["generate"]),
        &["--checkpoint"],
    );
    fails_with(
        "bench without a workload",
        &moegrad(&dir, &["bench"]),
        &["WORKLOAD"],
    );
    for (flag, value, says) in [
        ("--epochs", "-1", "whole number"),
        ("--seed", "-1", "whole number"),
        ("--lr", "-inf", "finite positive"),
    ] {
        let o = moegrad(&dir, &["train", flag, value]);
        let e = stderr(&o);
        assert!(!o.status.success());
        assert!(e.contains(flag) && e.contains(says), "{flag} {value}: {e}");
    }
    // balancing settings that cannot work are refused before training, naming the flag
    for (extra, says) in [
        (
            &["--router", "sparsemixer", "--balance", "aux-free"][..],
            &["--balance aux-free", "sparsemixer", "topk"][..],
        ),
        (
            &["--balance", "quantile", "--experts", "2", "--k", "2"],
            &["--balance quantile", "--k"],
        ),
        (
            &["--balance-scope", "sequence"],
            &["--balance-scope sequence", "language model"],
        ),
        (
            &["--balance", "aux-free", "--balance-scope", "global"],
            &["--balance-scope global", "aux-free"],
        ),
        (&["--balance-rate", "0"], &["--balance-rate"]),
        (&["--balance", "sinkhorn"], &["--balance", "aux-free"]),
        (
            &["--router", "expert-choice", "--null-experts", "2"],
            &["--null-experts 2", "expert-choice"],
        ),
    ] {
        let mut a = vec!["train", "--model", "moe-mlp", "--epochs", "1", "--out"];
        a.push("balance-refused");
        a.extend_from_slice(extra);
        fails_with(&extra.join(" "), &moegrad(&dir, &a), says);
    }
    assert!(!dir.join("balance-refused").exists());
    std::fs::write(dir.join("afile"), "x").unwrap();
    for out in ["afile", "/dev/null"] {
        let mut a = TINY_MLP.to_vec();
        a.extend(["--out", out]);
        fails_with(out, &moegrad(&dir, &a), &["not a directory"]);
    }
    // a run whose first checkpoint was never written: the rerun is told to --overwrite
    std::fs::create_dir_all(dir.join("nockpt")).unwrap();
    std::fs::write(dir.join("nockpt/metrics.jsonl"), "").unwrap();
    let mut a = TINY_MLP.to_vec();
    a.extend(["--out", "nockpt"]);
    fails_with(
        "no checkpoint",
        &moegrad(&dir, &a),
        &["wrote no checkpoint", "--overwrite"],
    );
    // a run file that is a link to a device is neither read nor appended to
    let mut a = TINY_MLP.to_vec();
    a.extend(["--out", "linked"]);
    assert!(moegrad(&dir, &a).status.success());
    std::fs::remove_file(dir.join("linked/metrics.jsonl")).unwrap();
    std::os::unix::fs::symlink("/dev/zero", dir.join("linked/metrics.jsonl")).unwrap();
    a[4] = "2";
    a.push("--resume");
    fails_with(
        "metrics.jsonl -> /dev/zero",
        &moegrad(&dir, &a),
        &["metrics.jsonl", "not a regular file"],
    );
    // a lock whose PID is alive but may not be a moegrad run: say how to clear it
    std::fs::create_dir_all(dir.join("locked")).unwrap();
    std::fs::write(dir.join("locked/.moegrad.lock"), "1\n").unwrap();
    let mut a = TINY_MLP.to_vec();
    a.extend(["--out", "locked"]);
    fails_with("a live lock", &moegrad(&dir, &a), &["stale", "delete"]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn runs_without_out_get_their_own_directory_from_any_working_directory() {
    // a directory with no data/ in it: the bundled data is built in
    let dir = scratch("default-out");
    let mut dirs = Vec::new();
    for _ in 0..2 {
        let o = moegrad(&dir, TINY_MLP);
        let e = stderr(&o);
        assert!(o.status.success(), "{e}");
        let line = e
            .lines()
            .find(|l| l.contains("writing"))
            .expect("announced");
        let name = line.split_whitespace().nth(2).unwrap().to_string();
        assert!(
            dir.join(&name).join("checkpoint.safetensors").exists(),
            "{e}"
        );
        let latest = std::fs::read_link(dir.join("runs/latest")).unwrap();
        assert_eq!(dir.join("runs").join(latest), dir.join(&name));
        dirs.push(name);
    }
    assert_ne!(
        dirs[0], dirs[1],
        "the second run reused the first one's directory"
    );
    // --resume without --out continues runs/latest
    let mut a = TINY_MLP.to_vec();
    a[4] = "2";
    a.push("--resume");
    let o = moegrad(&dir, &a);
    assert!(o.status.success(), "{}", stderr(&o));
    let metrics = std::fs::read_to_string(dir.join(&dirs[1]).join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 2, "{metrics}");
    // the bundled text too
    let o = moegrad(&dir, &tiny_lm_args(&["--data", "shakespeare"], "2", &[]));
    assert!(o.status.success(), "{}", stderr(&o));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_gpu_probe_prints_no_wayland_error() {
    let dir = scratch("xdg");
    let o = Command::new(env!("CARGO_BIN_EXE_moegrad"))
        .arg("info")
        .current_dir(&dir)
        .env_remove("XDG_RUNTIME_DIR")
        .output()
        .unwrap();
    assert!(o.status.success());
    assert!(!stderr(&o).contains("XDG_RUNTIME_DIR"), "{}", stderr(&o));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_estimator_lab_keeps_its_figure_out_of_the_working_directory() {
    let dir = scratch("lab");
    let o = moegrad(&dir, &["estimators", "--samples", "50"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(dir.join("runs/estimators.svg").is_file());
    assert!(!dir.join("estimators.svg").exists());
    fails_with(
        "--plot x.png",
        &moegrad(&dir, &["estimators", "--plot", "x.png"]),
        &["x.png", ".svg"],
    );
    assert!(!dir.join("x.png").exists());
    // an offset so large that f64 logits lose their spread changes π: refused
    fails_with(
        "--logit-offset 1e17",
        &moegrad(&dir, &["estimators", "--logit-offset", "1e17", "--no-plot"]),
        &["--logit-offset", "spread"],
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_language_model_resumes_to_more_iterations_in_its_own_words() {
    let dir = scratch("lm-resume");
    tiny_lm(&dir);
    let more = |extra: &[&str]| {
        let mut a = tiny_lm_args(
            &["--data", "shakespeare"],
            "4",
            &["--out", "lm", "--resume"],
        );
        a.extend(extra);
        moegrad(&dir, &a)
    };
    let o = more(&[]);
    let e = stderr(&o);
    assert!(!o.status.success());
    assert!(
        e.contains("--iters 2 → 4") && e.contains("--allow-config-change iters"),
        "{e}"
    );
    assert!(!e.contains("--epochs"), "{e}");
    let o = more(&["--allow-config-change", "iters"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Starts a long tiny run in `dir/out`, waits for its first epoch's line in metrics.jsonl,
/// sends it `signals` SIGINTs (Ctrl-C) and returns how it ended.
fn interrupted_run(dir: &Path, signals: usize) -> Output {
    let mut a = TINY_MLP.to_vec();
    a[4] = "200";
    a[6] = "2000";
    if signals > 1 {
        // epochs of about half a second, so that both signals land inside the second one
        a[2] = "cnn";
        a[6] = "4000";
    }
    a.extend(["--out", "out"]);
    let child = Command::new(env!("CARGO_BIN_EXE_moegrad"))
        .args(&a)
        .current_dir(dir)
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let metrics = dir.join("out/metrics.jsonl");
    let start = std::time::Instant::now();
    while std::fs::read_to_string(&metrics).map_or(true, |t| t.lines().count() < 1) {
        assert!(
            start.elapsed().as_secs() < 60,
            "the run never finished an epoch"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // into the next epoch (its first line is written before its checkpoint)
    std::thread::sleep(std::time::Duration::from_millis(100));
    for _ in 0..signals {
        let kill = Command::new("kill")
            .args(["-INT", &child.id().to_string()])
            .status()
            .unwrap();
        assert!(kill.success());
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    child.wait_with_output().unwrap()
}

#[test]
fn ctrl_c_finishes_the_epoch_checkpoints_and_says_how_to_resume() {
    let dir = scratch("ctrl-c");
    let o = interrupted_run(&dir, 1);
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(130), "{e}");
    assert!(
        e.contains("stopped after epoch") && e.contains("--resume"),
        "{e}"
    );
    let epochs = std::fs::read_to_string(dir.join("out/metrics.jsonl"))
        .unwrap()
        .lines()
        .count();
    assert!(epochs < 200, "the run was not stopped");
    assert!(!dir.join("out/.moegrad.lock").exists(), "the lock was left");
    let ck = Checkpoint::load(&dir.join("out/checkpoint.safetensors"), Device::cpu()).unwrap();
    assert_eq!(
        ck.metadata["epoch"],
        epochs.to_string(),
        "checkpoint of the last epoch"
    );
    // the second Ctrl-C stops at the next step, keeping the last checkpoint
    let dir2 = scratch("ctrl-c-twice");
    let o = interrupted_run(&dir2, 2);
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(130), "{e}");
    assert!(
        e.contains("second request") && e.contains("--resume"),
        "{e}"
    );
    assert!(
        !dir2.join("out/.moegrad.lock").exists(),
        "the lock was left"
    );
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&dir2);
}

#[test]
fn grid_files_and_a_changed_text_get_messages_that_say_what_is_wrong() {
    let dir = scratch("grid-text");
    std::fs::write(dir.join("open.toml"), "routers = [\"topk\", \"softmax\"").unwrap();
    fails_with(
        "an unclosed TOML list",
        &moegrad(&dir, &["compare", "--grid", "open.toml", "--dry-run"]),
        &["line 1, column 29", "unclosed array"],
    );
    std::fs::write(dir.join("list.toml"), "[train]\nexperts = [1, 2]\n").unwrap();
    fails_with(
        "a list in [train]",
        &moegrad(&dir, &["compare", "--grid", "list.toml", "--dry-run"]),
        &["--experts", "[set]"],
    );
    // a text that gained characters since its checkpoint: the vocabulary, not a tensor shape
    std::fs::write(dir.join("t.txt"), "abcabcabc ".repeat(100)).unwrap();
    let run = |iters: &str, extra: &[&str]| {
        let mut a = tiny_lm_args(
            &["--data", "text", "--data-file", "t.txt"],
            iters,
            &["--out", "txt"],
        );
        a.extend(extra);
        moegrad(&dir, &a)
    };
    assert!(run("2", &[]).status.success());
    std::fs::write(dir.join("t.txt"), "abcxyzabc ".repeat(100)).unwrap();
    fails_with(
        "a changed vocabulary",
        &run("4", &["--resume"]),
        &["vocabulary changed", "4 → 7 symbols"],
    );
    let _ = std::fs::remove_dir_all(&dir);
}
