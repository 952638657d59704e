//! Two rules of the source layout, checked as text. No file under `src/` is over 800 lines.
//! And the dependency between the `tensor` and `autograd` modules goes one way: autograd depends
//! on `tensor` (its nodes hold tensors, its rules compute with them), and `src/tensor.rs` names
//! nothing of autograd's (see `docs/architecture.md`, "The layers").
//!
//! Rust allows modules of one crate to import each other, so the compiler would not notice the
//! cycle coming back; this test reads the sources as text instead. It collects the names
//! autograd defines (its types, its free functions, the module path itself) and checks that
//! none of them occurs in the code of `src/tensor.rs` (comments, which may explain the
//! relation, are left out).

use std::collections::BTreeSet;
use std::path::Path;

/// `src/` of this crate.
fn src_dir() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/src"))
}

/// The source with `//` comments (line, doc and trailing comments) removed.
fn code_without_comments(source: &str) -> String {
    source
        .lines()
        .map(|line| line.find("//").map_or(line, |at| &line[..at]))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The identifiers of `code`, in order (words of letters, digits and `_`).
fn identifiers(code: &str) -> Vec<&str> {
    code.split(|c: char| !(c.is_alphanumeric() || c == '_'))
        .filter(|w| !w.is_empty())
        .collect()
}

/// The names the `autograd` module defines: its structs, enums, traits and type aliases
/// (at any depth), its free functions (those at the start of a line), and `autograd` itself.
fn autograd_names() -> BTreeSet<String> {
    let mut names = BTreeSet::from(["autograd".to_string()]);
    let dir = src_dir().join("autograd");
    let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    for entry in entries {
        let path = entry.expect("a directory entry").path();
        let source =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        for line in code_without_comments(&source).lines() {
            let words = identifiers(line);
            let at_column_0 = !line.starts_with(char::is_whitespace);
            for pair in words.windows(2) {
                let is_type = matches!(pair[0], "struct" | "enum" | "trait" | "type");
                if is_type || (at_column_0 && pair[0] == "fn") {
                    names.insert(pair[1].to_string());
                }
            }
        }
    }
    names
}

#[test]
fn tensor_rs_names_nothing_from_autograd() {
    let names = autograd_names();
    // the collection itself works: these are defined in src/autograd/
    for expected in [
        "Node",
        "LeafGrad",
        "GroupedWeightGrad",
        "backward",
        "no_grad",
    ] {
        assert!(
            names.contains(expected),
            "autograd_names() missed {expected}: {names:?}"
        );
    }
    let path = src_dir().join("tensor.rs");
    let source =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let code = code_without_comments(&source);
    let found: BTreeSet<&str> = identifiers(&code)
        .into_iter()
        .filter(|w| names.contains(*w))
        .collect();
    assert!(
        found.is_empty(),
        "src/tensor.rs uses {found:?} from src/autograd/; the dependency must go one way \
         (autograd -> tensor): move the code that needs them into autograd's own `impl Tensor` \
         (src/autograd/leaf.rs)"
    );
}

/// Every `.rs` file under `dir`, recursively.
fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("a readable source directory") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// No source file is longer than a reader takes in at once: 800 lines at most (split a file by
/// concept when it grows past that, as `backend/cpu/` and `app/src/bin/moegrad/` are), in the
/// library (`src/`) and in the command line (`app/src/`).
#[test]
fn no_source_file_is_over_800_lines() {
    let mut files = Vec::new();
    rust_files(src_dir(), &mut files);
    rust_files(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("app/src"),
        &mut files,
    );
    assert!(
        files.len() > 50,
        "found only {} files under src/",
        files.len()
    );
    let long: Vec<String> = files
        .iter()
        .filter_map(|f| {
            let lines = std::fs::read_to_string(f).ok()?.lines().count();
            (lines > 800).then(|| format!("{} ({lines} lines)", f.display()))
        })
        .collect();
    assert!(long.is_empty(), "files over 800 lines: {long:?}");
}

/// The library a user depends on carries no command-line crates: argument parsing, progress
/// bars, plots, TOML grids and Ctrl-C handling are the `moegrad-cli` crate's (`app/`).
#[test]
fn the_library_depends_on_no_command_line_crate() {
    let manifest =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml"))
            .expect("Cargo.toml");
    let deps = manifest
        .split("\n[dependencies]\n")
        .nth(1)
        .expect("a [dependencies] table")
        .split("\n[")
        .next()
        .unwrap_or_default();
    let names: Vec<&str> = deps
        .lines()
        .filter_map(|l| l.split('=').next())
        .map(str::trim)
        .filter(|n| !n.is_empty() && !n.starts_with('#'))
        .collect();
    assert!(names.contains(&"wgpu"), "read no dependencies: {names:?}");
    for cli in ["clap", "ctrlc", "indicatif", "plotters", "toml"] {
        assert!(
            !names.contains(&cli),
            "the moegrad library depends on {cli}, a command-line crate: it belongs to app/"
        );
    }
}
