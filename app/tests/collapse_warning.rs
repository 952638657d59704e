//! The collapse warning of `moegrad train` (`moe::CollapseAlarm`, thresholds `--collapse-dead`
//! and `--collapse-share`): it fires on a run that collapses (`switch` with `--balance none`,
//! whose routing ends on one of eight experts) and not on a balanced one (`topk` with the
//! default balance loss), and the flags silence it. The routing diagnostics land in
//! `metrics.jsonl` (`routing`) and the `--json` summary.

use std::path::PathBuf;
use std::process::{Command, Output};

fn train(name: &str, extra: &[&str]) -> (Output, PathBuf) {
    let out = std::env::temp_dir().join(format!("moegrad-collapse-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let mut args = vec![
        "train",
        "--data",
        "mnist",
        "--model",
        "moe-mlp",
        "--epochs",
        "2",
        "--train-limit",
        "3000",
        "--test-limit",
        "200",
        "--device",
        "cpu",
        "--json",
        "--out",
    ];
    let o = out.to_str().unwrap().to_string();
    args.push(&o);
    args.extend_from_slice(extra);
    let output = Command::new(env!("CARGO_BIN_EXE_moegrad"))
        .args(&args)
        .output()
        .expect("moegrad runs");
    assert!(
        output.status.success(),
        "{name}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    (output, out)
}

fn warned(o: &Output) -> bool {
    String::from_utf8_lossy(&o.stderr).contains("routing has collapsed")
}

#[test]
fn the_warning_fires_on_a_collapsing_run_only_and_the_flags_silence_it() {
    let (o, dir) = train("switch", &["--router", "switch", "--balance", "none"]);
    assert!(
        warned(&o),
        "switch with --balance none: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let summary: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&o.stdout).lines().last().unwrap()).unwrap();
    let layer = &summary["routing"]["layers"][0];
    assert!(layer["dead_experts"].as_u64().unwrap() >= 4, "{layer}");
    let metrics = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    let last: serde_json::Value = serde_json::from_str(metrics.lines().last().unwrap()).unwrap();
    assert_eq!(
        last["routing"], summary["routing"],
        "metrics.jsonl and --json agree"
    );

    let (o, _) = train(
        "silenced",
        &[
            "--router",
            "switch",
            "--balance",
            "none",
            "--collapse-dead",
            "2",
            "--collapse-share",
            "1",
        ],
    );
    assert!(
        !warned(&o),
        "silenced: {}",
        String::from_utf8_lossy(&o.stderr)
    );

    // the same switch run balanced by the quantile bias instead of a loss
    let (o, _) = train(
        "switch-quantile",
        &["--router", "switch", "--balance", "quantile"],
    );
    assert!(
        !warned(&o),
        "switch with --balance quantile: {}",
        String::from_utf8_lossy(&o.stderr)
    );

    let (o, _) = train("topk", &["--router", "topk"]);
    assert!(
        !warned(&o),
        "topk with a balance loss: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let summary: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&o.stdout).lines().last().unwrap()).unwrap();
    assert_eq!(summary["routing"]["layers"][0]["dead_experts"], 0);
}
