//! `moegrad routers [--json]`: every router of the registry (`moegrad::moe::ROUTERS`)
//! with its one-line summary and its `--router-opt` options (key, type, default, help).

use moegrad::Result;
use moegrad::moe::{ROUTERS, RouterSpec};

/// One router as `moegrad routers --json` prints it.
#[derive(serde::Serialize)]
struct RouterEntry {
    name: &'static str,
    summary: &'static str,
    options: Vec<OptionEntry>,
    /// whether `--balance aux-free` and `quantile` work with it (`moe::BIASABLE_ROUTERS`)
    selection_bias: bool,
}

/// One `--router-opt` option as `moegrad routers --json` prints it.
#[derive(serde::Serialize)]
struct OptionEntry {
    key: &'static str,
    #[serde(rename = "type")]
    kind: String,
    default: &'static str,
    help: &'static str,
}

impl RouterEntry {
    fn from_spec(spec: &RouterSpec) -> RouterEntry {
        RouterEntry {
            name: spec.name,
            summary: spec.summary,
            options: spec
                .options
                .iter()
                .map(|o| OptionEntry {
                    key: o.key,
                    kind: o.kind.describe(),
                    default: o.default,
                    help: o.help,
                })
                .collect(),
            selection_bias: moegrad::moe::BIASABLE_ROUTERS.contains(&spec.name),
        }
    }
}

/// Prints the routers: a list (name, summary, then one indented line per option), or with
/// `json` one object `{"routers": [{"name", "summary", "options": [{"key", "type", "default",
/// "help"}], "selection_bias"}]}`.
pub(super) fn run_routers(json: bool) -> Result<()> {
    let entries: Vec<RouterEntry> = ROUTERS.iter().map(RouterEntry::from_spec).collect();
    if json {
        #[derive(serde::Serialize)]
        struct Report {
            routers: Vec<RouterEntry>,
        }
        return super::print_json(&Report { routers: entries });
    }
    let width = entries.iter().map(|e| e.name.len()).max().unwrap_or(0);
    for e in &entries {
        println!("{:<width$}  {}", e.name, e.summary);
        for o in &e.options {
            println!(
                "{:<width$}    --router-opt {}=<{}> (default {}): {}",
                "", o.key, o.kind, o.default, o.help
            );
        }
    }
    println!("options go after `moegrad train --router NAME` as `--router-opt key=value`");
    let biased: Vec<&str> = entries
        .iter()
        .filter(|e| e.selection_bias)
        .map(|e| e.name)
        .collect();
    println!(
        "--balance aux-free and quantile work with: {}",
        biased.join(", ")
    );
    Ok(())
}
