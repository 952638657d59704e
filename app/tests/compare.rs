//! `moegrad compare`: the acceptance command on tiny limits prints a table and a second
//! invocation reuses its cells; adding seeds runs only the new cells and an interrupted cell
//! runs again; a failing cell is reported while the others finish; bad grids fail before any
//! cell runs, naming the cell; the shipped grids check; and the numbers (mean, standard error,
//! steps to a target, the flattened metrics) on known values.

use moegrad_cli::compare::grid::{Grid, cell_dir_name, parse_train_words};
use moegrad_cli::compare::stats::{CurvePoint, Target, final_metrics, mean_curve, mean_se};
use moegrad_cli::compare::table::format_mean_se;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn outdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("moegrad-compare-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn data_dir() -> String {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .join("data")
        .display()
        .to_string()
}

/// `moegrad compare ARGS` with the bundled data and tiny MNIST limits (each cell well under a
/// second).
fn compare(out: &Path, args: &[&str]) -> Output {
    let data = data_dir();
    let mut all: Vec<&str> = vec![
        "compare",
        "--data",
        "mnist",
        "--model",
        "moe-mlp",
        "--epochs",
        "1",
        "--train-limit",
        "256",
        "--test-limit",
        "128",
        "--device",
        "cpu",
        "--data-dir",
        &data,
    ];
    all.extend(args);
    let out_s = out.display().to_string();
    all.extend(["--out", &out_s]);
    Command::new(env!("CARGO_BIN_EXE_moegrad"))
        .args(&all)
        .output()
        .expect("moegrad runs")
}

fn json_of(o: &Output) -> Value {
    assert!(
        o.status.success(),
        "compare failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).expect("compare --json prints one JSON object")
}

fn mtime(p: &Path) -> std::time::SystemTime {
    std::fs::metadata(p).unwrap().modified().unwrap()
}

#[test]
fn acceptance_command_prints_the_table_and_a_second_run_reuses_every_cell() {
    let out = outdir("accept");
    let first = compare(
        &out,
        &["--routers", "topk,softmax", "--seeds", "1,2", "--json"],
    );
    let j = json_of(&first);
    let groups = j["groups"].as_array().unwrap();
    assert_eq!(groups.len(), 2);
    assert_eq!(groups[0]["router"], "topk");
    assert_eq!(groups[1]["router"], "softmax");
    for g in groups {
        assert_eq!(g["seeds"], serde_json::json!(["1", "2"]));
        let loss = g["mean"]["test_loss"].as_f64().unwrap();
        assert!(loss.is_finite() && loss > 0.0);
        assert!(g["se"]["test_loss"].as_f64().unwrap() >= 0.0);
        assert!(g["mean"]["test_accuracy"].as_f64().unwrap() > 0.2);
        assert!(g["mean"]["experts_per_token"].is_number());
    }
    let cells = j["cells"].as_array().unwrap();
    assert_eq!(cells.len(), 4);
    assert_eq!(j["ran"], 4);
    assert!(
        cells
            .iter()
            .all(|c| c["status"] == "ok" && c["reused"] == false)
    );
    for f in [
        "table.md",
        "table.csv",
        "table.json",
        "curves_test_loss.svg",
        "final_test_loss.svg",
    ] {
        assert!(out.join(f).is_file(), "{f} written");
    }
    let record = out.join("router-topk_seed-1").join("cell.json");
    let before = mtime(&record);

    // the same command again: nothing runs, the same numbers come back, a table is printed
    let second = compare(&out, &["--routers", "topk,softmax", "--seeds", "1,2"]);
    assert!(second.status.success());
    let table = String::from_utf8_lossy(&second.stdout);
    assert!(
        table.starts_with("| router | seeds | test_loss |"),
        "{table}"
    );
    assert!(table.contains("| topk | 2 | "), "{table}");
    assert!(
        table.contains("4 cells: 0 run now, 4 reused, 0 failed"),
        "{table}"
    );
    assert_eq!(mtime(&record), before, "a finished cell is not run again");
    let again: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("table.json")).unwrap()).unwrap();
    assert_eq!(again["reused"], 4);
    assert_eq!(again["groups"][0]["mean"], j["groups"][0]["mean"]);

    // a third seed: only the two new cells run
    let third = json_of(&compare(
        &out,
        &["--routers", "topk,softmax", "--seeds", "1,2,3", "--json"],
    ));
    assert_eq!(third["ran"], 2);
    assert_eq!(third["reused"], 4);
    assert_eq!(third["groups"][0]["n"], 3);
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn an_interrupted_cell_runs_again_and_a_changed_grid_is_refused() {
    let out = outdir("resume");
    json_of(&compare(
        &out,
        &["--routers", "topk", "--seeds", "1,2", "--json"],
    ));
    // an interrupted cell: its files are there but it never wrote its record
    std::fs::remove_file(out.join("router-topk_seed-2").join("cell.json")).unwrap();
    let j = json_of(&compare(
        &out,
        &[
            "--routers",
            "topk",
            "--seeds",
            "1,2",
            "--json",
            "--target",
            "test_loss=100",
        ],
    ));
    assert_eq!(j["ran"], 1);
    assert_eq!(j["reused"], 1);
    assert_eq!(j["cells"][1]["reused"], false);
    assert_eq!(j["cells"][1]["status"], "ok");
    // every cell reaches a loss of 100 at its first evaluation
    let t = &j["groups"][0]["to_target"];
    assert_eq!(t["reached"], 2);
    assert_eq!(t["epochs"]["mean"], 1.0);
    assert!(t["steps"]["mean"].as_f64().unwrap() >= 1.0);

    // the same --out with other fixed settings: refused before anything runs, naming the cell
    let changed = compare(
        &out,
        &["--routers", "topk", "--seeds", "1,2", "--lr", "0.01"],
    );
    assert!(!changed.status.success());
    let err = String::from_utf8_lossy(&changed.stderr);
    assert!(
        err.contains("cell router=topk seed=1") && err.contains("--lr 0.01"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn a_failing_cell_is_reported_while_the_others_finish() {
    let out = outdir("fail");
    // lr 1e30 passes train's checks and diverges at once: the run stops on a NaN loss
    let o = compare(
        &out,
        &[
            "--routers",
            "topk",
            "--set",
            "lr=0.001,1e30",
            "--seeds",
            "1",
            "--jobs",
            "2",
        ],
    );
    // the table is printed, and the command fails because a cell did
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success(),
        "a failed cell must fail compare: {stderr}"
    );
    assert!(stderr.contains("1 of 2 cells failed"), "{stderr}");
    let table = String::from_utf8_lossy(&o.stdout);
    assert!(
        table.contains("| topk | 1e30 | 0 (1 failed) | failed"),
        "{table}"
    );
    assert!(
        table.contains("| router=topk lr=1e30 seed=1 | failed | ") && table.contains("NaN"),
        "{table}"
    );
    let j: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("table.json")).unwrap()).unwrap();
    assert_eq!(j["failed"], 1);
    assert_eq!(j["cells"][0]["status"], "ok");
    assert_eq!(j["groups"][0]["n"], 1);
    assert!(j["groups"][0]["mean"]["test_loss"].is_number());
    assert_eq!(j["groups"][1]["failed"], serde_json::json!(["1"]));
    // the failure is recorded: a second invocation reports it without running the cell (and
    // fails again, its JSON still printed)
    let again = compare(
        &out,
        &[
            "--routers",
            "topk",
            "--set",
            "lr=0.001,1e30",
            "--seeds",
            "1",
            "--json",
        ],
    );
    assert!(!again.status.success());
    let again: Value = serde_json::from_slice(&again.stdout).expect("the report as JSON");
    assert_eq!(again["ran"], 0);
    assert_eq!(again["failed"], 1);
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn bad_grids_fail_before_any_cell_runs_naming_the_cell() {
    let grid_file = outdir("badgrid-file").with_extension("toml");
    std::fs::write(&grid_file, "seeds = [1]\nrouterz = [\"topk\"]\n").unwrap();
    let grid_path = grid_file.display().to_string();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["--routers", "topk,bogus", "--seeds", "1"],
            "cell router=bogus seed=1: invalid value 'bogus' for '--router",
        ),
        (
            vec!["--routers", "topk", "--frobnicate", "3"],
            "cell router=topk: unexpected argument '--frobnicate'",
        ),
        (vec!["--routers", "topk", "--seeds", ""], "seed axis"),
        (vec!["--routers", "topk", "--set", "k="], "k axis"),
        (
            vec!["--routers", "topk", "--set", "k=2,9"],
            "cell router=topk k=9: --k 9 must be between 1 and --experts 8",
        ),
        (
            vec!["--routers", "moesart", "--set", "router-opt=tau=-1"],
            "cell router=moesart router-opt=tau=-1:",
        ),
        (
            vec!["--routers", "topk", "--set", "lr=0.01,-1"],
            "cell router=topk lr=-1: --lr must be a finite positive number",
        ),
        (
            vec!["--routers", "topk", "--seed", "3", "--seeds", "1"],
            "--seed is set both",
        ),
        (
            vec!["--routers", "topk", "--resume"],
            "--resume cannot be part of a grid",
        ),
        (
            vec!["--routers", "topk", "--target", "val_loss=2"],
            "cell router=topk: --target val_loss",
        ),
        (
            vec!["--routers", "topk", "--jobs", "0"],
            "--jobs must be at least 1",
        ),
        (vec!["--grid", &grid_path], "unknown key \"routerz\""),
    ];
    for (i, (args, expected)) in cases.iter().enumerate() {
        let out = outdir(&format!("bad{i}"));
        let o = compare(&out, args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{args:?} was accepted");
        assert_eq!(err.lines().count(), 1, "{args:?}: one line, got {err}");
        assert!(err.contains(expected), "{args:?}: {err}");
        assert!(!out.exists(), "{args:?}: nothing may run or be written");
    }
    let _ = std::fs::remove_file(&grid_file);
}

#[test]
fn every_shipped_grid_checks() {
    let dir = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/..")).join("experiments");
    let mut grids: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    grids.sort();
    assert!(grids.len() >= 4, "{grids:?}");
    for g in grids {
        let out = outdir("shipped");
        let o = Command::new(env!("CARGO_BIN_EXE_moegrad"))
            .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
            .args(["compare", "--dry-run", "--grid"])
            .arg(&g)
            .arg("--out")
            .arg(&out)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&o.stdout);
        assert!(
            o.status.success(),
            "{}: {}",
            g.display(),
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(text.contains(" cells checked, "), "{text}");
        assert!(!out.exists(), "--dry-run writes nothing");
        let comment = std::fs::read_to_string(&g).unwrap();
        assert!(
            comment.contains("Full size"),
            "{}: full-size setting",
            g.display()
        );
    }
}

#[test]
fn a_grid_file_with_variants_runs_and_command_line_flags_override_it() {
    let out = outdir("variants");
    let file = outdir("variants-grid").with_extension("json");
    std::fs::write(
        &file,
        r#"{"seeds": [1, 2, 3], "metric": "test_accuracy",
            "train": {"epochs": 5, "batch": 64},
            "variants": [{"name": "top-1 switch", "router": "switch", "k": 1},
                         {"router": "topk", "k": 2}]}"#,
    )
    .unwrap();
    let grid = file.display().to_string();
    // the command line's --epochs 1 and --seeds 1 replace the file's
    let j = json_of(&compare(&out, &["--grid", &grid, "--seeds", "1", "--json"]));
    let groups = j["groups"].as_array().unwrap();
    assert_eq!(groups.len(), 2);
    assert_eq!(groups[0]["variant"], "top-1 switch");
    assert_eq!(groups[1]["variant"], "router=topk k=2");
    assert_eq!(groups[0]["mean"]["experts_per_token"], 1.0);
    assert_eq!(groups[1]["mean"]["experts_per_token"], 2.0);
    assert_eq!(groups[0]["mean"]["epochs"], 1.0);
    assert_eq!(j["metric"], "test_accuracy");
    assert!(out.join("final_test_accuracy.svg").is_file());
    let argv = j["cells"][0]["argv"].as_array().unwrap();
    assert!(argv.contains(&serde_json::json!("switch")));
    let _ = std::fs::remove_dir_all(&out);
    let _ = std::fs::remove_file(&file);
}

#[test]
fn a_language_model_grid_reports_validation_loss_steps_and_experts_per_token() {
    let out = outdir("lm");
    let out_s = out.display().to_string();
    let data = data_dir();
    let o = Command::new(env!("CARGO_BIN_EXE_moegrad"))
        .args([
            "compare",
            "--data",
            "shakespeare",
            "--model",
            "moe-gpt",
            "--data-dir",
            &data,
            "--layers",
            "1",
            "--d-model",
            "16",
            "--heads",
            "2",
            "--block",
            "16",
            "--batch",
            "4",
            "--experts",
            "4",
            "--expert-hidden",
            "16",
            "--iters",
            "20",
            "--eval-every",
            "10",
            "--eval-windows",
            "4",
            "--warmup-steps",
            "2",
            "--device",
            "cpu",
            "--routers",
            "topk,switch",
            "--seeds",
            "1,2",
            "--target",
            "val_loss=100",
            "--json",
            "--out",
            &out_s,
        ])
        .output()
        .unwrap();
    let j = json_of(&o);
    assert_eq!(j["metric"], "val_loss");
    let groups = j["groups"].as_array().unwrap();
    // dropless: top-2 keeps 2 experts per token, Switch 1
    assert_eq!(groups[0]["mean"]["experts_per_token"], 2.0);
    assert_eq!(groups[1]["mean"]["experts_per_token"], 1.0);
    for g in groups {
        assert!(g["mean"]["val_loss"].as_f64().unwrap().is_finite());
        assert_eq!(g["mean"]["iters"], 20.0);
        // every run is below a loss of 100 at its first evaluation, iteration 10
        assert_eq!(g["to_target"]["steps"]["mean"], 10.0);
        assert_eq!(g["to_target"]["steps"]["se"], 0.0);
        assert_eq!(g["to_target"]["reached"], 2);
    }
    assert!(out.join("curves_val_loss.svg").is_file());
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn mean_and_standard_error_on_known_numbers() {
    // 2, 4, 4, 4, 5, 5, 7, 9: mean 5, sample variance 32/7, s.e. sqrt(32/7)/sqrt(8)
    let m = mean_se(&[2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]);
    assert_eq!(m.mean, 5.0);
    assert!(
        (m.se - (32.0f64 / 7.0 / 8.0).sqrt()).abs() < 1e-15,
        "{}",
        m.se
    );
    assert_eq!(m.n, 8);
    let two = mean_se(&[1.0, 3.0]);
    assert_eq!((two.mean, two.se), (2.0, 1.0));
    assert!(mean_se(&[3.0]).se.is_nan());
    assert!(mean_se(&[]).mean.is_nan());
    assert_eq!(format_mean_se(&two), "2.000 ± 1.000");
    assert_eq!(format_mean_se(&mean_se(&[0.25, 0.75])), "0.5000 ± 0.2500");
    assert_eq!(format_mean_se(&mean_se(&[0.5])), "0.5000 ± –");
}

#[test]
fn targets_curves_and_flattened_metrics() {
    let point = |step: f64, loss: f64| CurvePoint {
        step,
        epoch: step / 10.0,
        values: [("val_loss".to_string(), loss)].into_iter().collect(),
    };
    let a = vec![point(10.0, 3.0), point(20.0, 2.4), point(30.0, 2.0)];
    let b = vec![point(10.0, 2.8), point(20.0, 2.6)];
    let t = Target::parse("val_loss=2.5").unwrap();
    assert!(!t.higher_is_better);
    assert_eq!(t.first_reached(&a), Some((20.0, 2.0)));
    assert_eq!(t.first_reached(&b), None);
    let up = Target::parse("test_accuracy_1=0.9").unwrap();
    assert!(up.higher_is_better && up.reached_by(0.9) && !up.reached_by(0.89));
    for bad in ["val_loss", "=2", "val_loss=x", "val_loss=inf"] {
        assert!(Target::parse(bad).is_err(), "{bad}");
    }
    // the mean curve stops at the shorter one
    let m = mean_curve(&[&a, &b], "val_loss");
    assert_eq!(m.len(), 2);
    assert_eq!(m[0].0, 10.0);
    assert!((m[0].1.mean - 2.9).abs() < 1e-12 && (m[0].1.se - 0.1).abs() < 1e-12);

    let mm = final_metrics(&serde_json::json!({
        "test_loss": 1.5, "test_accuracy": [0.8, 0.7], "device": "cpu", "expert_load": [0.5, 0.5]
    }))
    .unwrap();
    assert_eq!(mm["test_accuracy_1"], 0.8);
    assert_eq!(mm["test_accuracy_2"], 0.7);
    assert!(!mm.contains_key("expert_load") && !mm.contains_key("device"));
    let sb = final_metrics(&serde_json::json!({
        "test_loss": 0.1, "true_experts": [2, 5, 7, 10], "selected_experts": [10, 7, 5, 2],
        "expert_mean_weight": [0.0, 0.0, 0.25, 0.0, 0.0, 0.25, 0.0, 0.2, 0.0, 0.0, 0.3],
        "expert_selection_rate": [1.0, 0.5, 0.5]
    }))
    .unwrap();
    assert_eq!(sb["true_experts_recovered"], 1.0);
    assert!((sb["true_expert_mass"] - 1.0).abs() < 1e-12);
    assert_eq!(sb["experts_run"], 2.0);
    let wrong = final_metrics(&serde_json::json!({
        "test_loss": 0.1, "true_experts": [2, 5], "selected_experts": [2, 6]
    }))
    .unwrap();
    assert_eq!(wrong["true_experts_recovered"], 0.0);
    // an MoE run's routing diagnostics, at the worst layer
    let moe = final_metrics(&serde_json::json!({
        "test_loss": 0.3,
        "routing": {
            "layers": [],
            "dead_experts": {"min": 0.0, "median": 1.0, "max": 3.0},
            "load_max_over_ideal": {"min": 1.1, "median": 1.5, "max": 2.5},
            "top_share": {"min": 0.2, "median": 0.3, "max": 0.6},
            "routing_entropy_ratio": {"min": 0.4, "median": 0.8, "max": 0.9},
            "drop_rate": {"min": 0.0, "median": 0.0, "max": 0.0},
            "logit_max": {"min": 1.0, "median": 2.0, "max": 7.0}
        }
    }))
    .unwrap();
    assert_eq!(
        (
            moe["dead_experts"],
            moe["load_max_over_ideal"],
            moe["top_share"]
        ),
        (3.0, 2.5, 0.6)
    );
    assert_eq!((moe["routing_entropy_ratio"], moe["logit_max"]), (0.4, 7.0));
    // a diverged run's loss comes back as null: not a result
    assert!(final_metrics(&serde_json::json!({"val_loss": null})).is_err());
}

#[test]
fn grids_cross_axes_in_order_with_stable_directory_names() {
    let words: Vec<String> = ["--model", "moe-mlp", "--epochs", "1"]
        .map(String::from)
        .into();
    let routers: Vec<String> = ["topk", "softmax"].map(String::from).into();
    let seeds: Vec<String> = ["1", "2"].map(String::from).into();
    let grid = Grid::from_flags(&words, Some(&routers), Some(&seeds), &["k=2,4".into()]).unwrap();
    let cells = grid.cells().unwrap();
    assert_eq!(cells.len(), 8);
    assert_eq!(cells[0].name, "router-topk_k-2_seed-1");
    assert_eq!(cells[1].name, "router-topk_k-2_seed-2");
    assert_eq!(cells[2].label(), "router=topk k=4 seed=1");
    assert_eq!(cells[7].name, "router-softmax_k-4_seed-2");
    // flags sorted, so the same cell has the same flags whatever order they were given in
    assert_eq!(
        cells[0].argv.join(" "),
        "--epochs 1 --k 2 --model moe-mlp --router topk --seed 1"
    );
    assert_eq!(cells[0].group(), cells[1].group());
    assert_ne!(cells[0].group(), cells[2].group());
    // labels that are not plain file names get a hash, so distinct labels never collide
    let a = cell_dir_name(&[("variant".into(), "a b".into())]);
    let b = cell_dir_name(&[("variant".into(), "a/b".into())]);
    assert_ne!(a, b);
    assert!(a.starts_with("variant-a-b-") && !a.contains(' '));
    assert_eq!(
        parse_train_words(&["--lr".into(), "-0.5".into()]).unwrap()[0].label(),
        "lr=-0.5"
    );
    assert!(parse_train_words(&["5".into()]).is_err());
}
