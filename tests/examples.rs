//! Runs the tutorial's examples (`docs/tutorial/`), so that every chapter's code is checked by
//! `cargo test --release`, the command CI runs.
//!
//! `cargo test` builds every example under `examples/` before it runs the tests, into
//! `target/<profile>/examples/`; this test finds that folder from its own path
//! (`target/<profile>/deps/examples-<hash>`), runs each example of [`TUTORIAL_EXAMPLES`] and
//! asserts that it exits 0 and prints its success line. The examples are themselves checks: each
//! asserts what its chapter claims and fails (non-zero exit) when that does not hold. A second
//! test reads each chapter and checks that it names its example's run command and quotes the
//! success line the example prints, so a chapter cannot promise a line that never comes.

use std::path::PathBuf;
use std::process::Command;

/// Every tutorial chapter's example, in chapter order: the example's name (its file under
/// `examples/`), its chapter (under `docs/tutorial/`) and the line it prints on stdout once all
/// its checks have passed. To add a chapter, add its example here.
const TUTORIAL_EXAMPLES: &[(&str, &str, &str)] = &[
    (
        "tutorial_00_scalar_tape",
        "00-autodiff-in-100-lines.md",
        "tutorial_00_scalar_tape: all checks passed",
    ),
    (
        "tutorial_01_tape",
        "01-tensors-and-the-tape.md",
        "tutorial_01_tape: all checks passed",
    ),
    (
        "custom_op",
        "02-new-op.md",
        "custom_op example: all checks passed",
    ),
    (
        "tutorial_03_moe_by_hand",
        "03-moe-layer-by-hand.md",
        "tutorial_03_moe_by_hand: all checks passed",
    ),
    (
        "custom_router",
        "04-custom-router.md",
        "custom_router example: all checks passed",
    ),
    (
        "tutorial_05_estimators",
        "05-estimator-lab.md",
        "tutorial_05_estimators: all checks passed",
    ),
    (
        "tutorial_06_lm",
        "06-language-model.md",
        "tutorial_06_lm: all checks passed",
    ),
];

/// `target/<profile>/examples/`, found from this test binary's path.
fn examples_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's own path");
    let profile_dir = exe
        .parent() // deps/
        .and_then(|deps| deps.parent()) // target/<profile>/
        .expect("the test binary lies in target/<profile>/deps/");
    profile_dir.join("examples")
}

#[test]
fn every_tutorial_example_runs_and_passes_its_checks() {
    let dir = examples_dir();
    let mut failures = Vec::new();
    for (name, _, success_line) in TUTORIAL_EXAMPLES {
        let path = dir.join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
        if !path.is_file() {
            failures.push(format!(
                "{name}: no binary at {} (cargo test builds the examples; was it run with \
                 --test examples only? run `cargo build --release --examples` first)",
                path.display()
            ));
            continue;
        }
        let out = match Command::new(&path).output() {
            Ok(out) => out,
            Err(e) => {
                failures.push(format!("{name}: could not start {}: {e}", path.display()));
                continue;
            }
        };
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        if !out.status.success() {
            failures.push(format!(
                "{name}: exited with {}\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}",
                out.status
            ));
        } else if !stdout.lines().any(|l| l.trim() == *success_line) {
            failures.push(format!(
                "{name}: exited 0 but did not print {success_line:?}\n--- stdout ---\n{stdout}"
            ));
        } else {
            println!("{name}: ok");
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// Each chapter shows the command that runs its example and quotes, in backticks, the success
/// line the example prints (line breaks in the Markdown source count as spaces).
#[test]
fn every_chapter_names_its_example_and_quotes_its_success_line() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("docs/tutorial");
    let mut failures = Vec::new();
    for (name, chapter, success_line) in TUTORIAL_EXAMPLES {
        let path = dir.join(chapter);
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text.split_whitespace().collect::<Vec<_>>().join(" "),
            Err(e) => {
                failures.push(format!("{chapter}: cannot read {}: {e}", path.display()));
                continue;
            }
        };
        let command = format!("cargo run --release --example {name}");
        if !text.contains(&command) {
            failures.push(format!("{chapter}: does not show `{command}`"));
        }
        let quoted = format!("`{success_line}`");
        if !text.contains(&quoted) {
            failures.push(format!(
                "{chapter}: does not quote the line its example prints, {quoted}"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
