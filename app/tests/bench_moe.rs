//! `moegrad bench moe --json`: the record layout issue 4 asks for (`{"moe": [{"device",
//! "router", "n", "k", "step_ms", "peak_bytes", ...}]}`), on a workload small enough for a test
//! (`--tokens 32`). Nothing here is timed against a bound: the figures live in
//! docs/benchmarks.md; this only checks that every row is there and holds sane values.

use std::process::Command;

#[test]
fn bench_moe_json_has_every_router_and_n_with_step_phase_and_memory_figures() {
    let out = Command::new(env!("CARGO_BIN_EXE_moegrad"))
        .args([
            "bench", "moe", "--json", "--device", "cpu", "--tokens", "32",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "bench moe failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows = v["moe"].as_array().expect("a \"moe\" array");
    let key = |r: &serde_json::Value| {
        (
            r["router"].as_str().unwrap().to_string(),
            r["path"].as_str().unwrap().to_string(),
            r["n"].as_u64().unwrap(),
        )
    };
    let got: Vec<(String, String, u64)> = rows.iter().map(key).collect();
    let mut want: Vec<(String, String, u64)> = [2, 4, 8, 16, 32, 64]
        .iter()
        .map(|&n| ("topk".to_string(), "plan".to_string(), n))
        .collect();
    // the dense router both ways: on the all-experts path, then through the plan
    for n in [2, 8, 64] {
        for path in ["all-experts", "plan"] {
            want.push(("softmax".to_string(), path.to_string(), n));
        }
    }
    assert_eq!(got, want);
    for r in rows {
        assert_eq!(r["device"], "cpu");
        let n = r["n"].as_u64().unwrap();
        let k = r["k"].as_u64().unwrap();
        // top-2, or every expert for the dense router
        assert_eq!(k, if r["router"] == "softmax" { n } else { 2 });
        for field in [
            "step_ms",
            "forward_ms",
            "backward_ms",
            "optimizer_ms",
            "tokens_per_s",
        ] {
            let x = r[field].as_f64().unwrap_or(f64::NAN);
            assert!(x.is_finite() && x > 0.0, "{field} = {x} in {r}");
        }
        // The stored gradients are the router's and, unless deferred, the experts' (n experts
        // of 2·256·512 weights). At 32 tokens every bank is larger than its 64 rows, so on the
        // plan its gradient is deferred into Adam and not stored; the all-experts path's wide
        // products store the bank's gradient like any other.
        let peak = r["peak_bytes"].as_u64().unwrap();
        let grads = r["gradient_bytes"].as_u64().unwrap();
        let router = 256 * n * 4;
        let bank = match r["path"].as_str().unwrap() {
            "all-experts" => n * 2 * 256 * 512 * 4,
            _ => 0,
        };
        assert!(
            (router + bank..router + bank + n * 4 + 1).contains(&grads),
            "gradient_bytes {grads} in {r}: the router's and {bank} bytes of the bank's expected"
        );
        // dispatches are counted on the GPU only
        assert!(r["dispatches"].is_null(), "dispatches on the CPU in {r}");
        // the peak counts heap bytes beyond those held before the step, and the CPU's buffer
        // pool keeps the previous step's buffers: it can be below the gradients stored
        assert!(peak > 0, "peak_bytes {peak} in {r}");
        assert_eq!(
            r["activation_bytes"].as_u64().unwrap(),
            peak.saturating_sub(grads)
        );
    }
}

/// `--experts` and `--dense-experts` choose the cells (the latter alone: no dense cell), and
/// the CPU skips none.
#[test]
fn bench_moe_measures_the_experts_asked_for() {
    let run = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_moegrad"))
            .args([
                "bench", "moe", "--json", "--device", "cpu", "--tokens", "16",
            ])
            .args(extra)
            .output()
            .unwrap()
    };
    let cells = |extra: &[&str]| {
        let out = run(extra);
        assert!(
            out.status.success(),
            "{extra:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["skipped"], serde_json::json!([]), "{extra:?}");
        v["moe"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| format!("{} {} {}", r["router"], r["path"], r["n"]))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        cells(&["--experts", "3", "--dense-experts"]),
        ["\"topk\" \"plan\" 3"]
    );
    assert_eq!(
        cells(&["--experts", "--dense-experts", "2"]),
        ["\"softmax\" \"all-experts\" 2", "\"softmax\" \"plan\" 2"]
    );
    for (extra, want) in [
        (&["--experts", "0"][..], "--experts [0]"),
        (&["--experts", "--dense-experts"][..], "nothing to measure"),
    ] {
        let out = run(extra);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(want),
            "{extra:?}: {err}"
        );
    }
}

#[test]
fn bench_moe_rejects_zero_tokens() {
    let out = Command::new(env!("CARGO_BIN_EXE_moegrad"))
        .args(["bench", "moe", "--device", "cpu", "--tokens", "0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--tokens"));
}

/// `--sizes` takes the form its help shows (`256 512 1024`) as well as commas.
#[test]
fn bench_matmul_takes_sizes_separated_by_spaces_or_commas() {
    for args in [&["16", "32"][..], &["16,32"][..]] {
        let out = Command::new(env!("CARGO_BIN_EXE_moegrad"))
            .args(["bench", "matmul", "--json", "--device", "cpu", "--sizes"])
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "--sizes {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let sizes: Vec<u64> = v["matmul"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["size"].as_u64().unwrap())
            .collect();
        assert_eq!(sizes, [16, 32], "--sizes {args:?}");
    }
}
