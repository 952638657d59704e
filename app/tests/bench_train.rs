//! `moegrad bench train --json`: the record layout issue 14 asks for
//! (`{"train": [{"device", "model", "batch", "examples", "seconds"}]}`) for the three workloads of
//! the PyTorch peer, on a few examples (`--examples`), that the timed region holds exactly the
//! epoch's steps, and that bad settings are refused in one line. Nothing is timed against a
//! bound: the figures live in docs/benchmarks.md.

use std::process::Command;

fn bench_train(args: &[&str], profile: bool) -> std::process::Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_moegrad"));
    c.args(["bench", "train", "--device", "cpu"]).args(args);
    if profile {
        c.env("MOEGRAD_PROFILE", "1");
    } else {
        c.env_remove("MOEGRAD_PROFILE");
    }
    c.output().unwrap()
}

#[test]
fn bench_train_json_has_one_record_per_model_with_the_epoch_time() {
    // 40 examples in batches of 32: two steps per model, the second one of 8 examples
    let out = bench_train(&["--json", "--examples", "40", "--batch", "32"], true);
    assert!(
        out.status.success(),
        "bench train failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    let rows = v["train"].as_array().expect("a \"train\" array");
    let models: Vec<&str> = rows.iter().map(|r| r["model"].as_str().unwrap()).collect();
    assert_eq!(models, ["cnn", "moe-mlp", "mmoe-cnn"]);
    let mut total = 0.0;
    for r in rows {
        let mut keys: Vec<&str> = r.as_object().unwrap().keys().map(String::as_str).collect();
        keys.sort();
        assert_eq!(
            keys,
            ["batch", "device", "examples", "model", "seconds"],
            "{r}"
        );
        assert_eq!(r["device"], "cpu");
        assert_eq!(r["batch"], 32);
        assert_eq!(r["examples"], 40);
        let s = r["seconds"].as_f64().unwrap_or(f64::NAN);
        assert!(s.is_finite() && s > 0.0, "seconds = {s} in {r}");
        total += s;
    }
    // MOEGRAD_PROFILE=1 (on stderr): the timed region is the epoch's 3 × 2 steps, and they take
    // no longer than the seconds reported
    let err = String::from_utf8_lossy(&out.stderr);
    let line = err
        .lines()
        .find(|l| l.starts_with("profile:"))
        .unwrap_or_else(|| panic!("no profile on stderr: {err}"));
    assert!(line.starts_with("profile: 6 steps, "), "{line}");
    let step_ms: f64 = line["profile: 6 steps, ".len()..]
        .split(' ')
        .next()
        .and_then(|x| x.parse().ok())
        .unwrap_or_else(|| panic!("{line}"));
    // (the profile prints milliseconds to one decimal: allow its rounding)
    assert!(
        step_ms <= total * 1e3 + 0.05,
        "{step_ms} ms of steps in {total} s"
    );
    assert!(err.contains("adam step"), "{err}");
}

#[test]
fn bench_train_refuses_bad_settings_in_one_line() {
    for (args, needle) in [
        (&["--batch", "0"][..], "--batch"),
        (
            &["--data-dir", "/definitely/not/here"][..],
            "/definitely/not/here",
        ),
    ] {
        let out = bench_train(args, false);
        assert!(!out.status.success(), "{args:?} was accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}
