//! `routing_heatmap.svg` (`plot::routing`): the load of each expert of each MoE layer over the
//! run, as colours of load/ideal. Drawn from a hand-written `metrics.jsonl` (a balanced layer and
//! one that collapses onto one expert), every cell has the colour of its ratio: white for a
//! balanced expert, the darkest blue for a dead one, the darkest red for the expert that takes
//! every token; and a real MoE run writes the figure beside its other plots.

use moegrad_cli::plot::routing::{HOT, colour, draw_heatmap, read};
use std::path::PathBuf;

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("moegrad-heatmap-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn hex(c: plotters::style::RGBColor) -> String {
    format!("fill=\"#{:02X}{:02X}{:02X}\"", c.0, c.1, c.2)
}

#[test]
fn colours_by_load_over_ideal() {
    assert_eq!(hex(colour(1.0)), "fill=\"#FFFFFF\"");
    assert_eq!(hex(colour(0.0)), "fill=\"#2166AC\"");
    assert_eq!(hex(colour(HOT)), "fill=\"#B2182B\"");
    assert_eq!(colour(HOT), colour(10.0 * HOT), "saturates above HOT");
    assert_eq!(colour(f64::NAN), colour(0.0));
    // monotone: further from 1 is further from white
    let whiteness = |r: f64| {
        let c = colour(r);
        c.0 as u32 + c.1 as u32 + c.2 as u32
    };
    assert!(whiteness(0.2) < whiteness(0.6) && whiteness(0.6) < whiteness(0.95));
    assert!(whiteness(3.0) < whiteness(2.0) && whiteness(2.0) < whiteness(1.1));
}

#[test]
fn every_cell_has_the_colour_of_its_load() {
    let d = dir("cells");
    let metrics = d.join("metrics.jsonl");
    // 3 evaluations of 2 layers over 4 experts: layer 0 balanced throughout, layer 1 collapsing
    // onto expert 2 (a line without routing, as a dense run writes, is skipped)
    let lines = [
        r#"{"iter":10,"routing":{"layers":[{"load":[0.25,0.25,0.25,0.25]},{"load":[0.25,0.25,0.25,0.25]}]}}"#,
        r#"{"iter":20,"train_loss":2.0}"#,
        r#"{"iter":30,"routing":{"layers":[{"load":[0.25,0.25,0.25,0.25]},{"load":[0.0,0.25,0.75,0.0]}]}}"#,
        r#"{"iter":40,"routing":{"layers":[{"load":[0.25,0.25,0.25,0.25]},{"load":[0.0,0.0,1.0,0.0]}]}}"#,
    ];
    std::fs::write(&metrics, lines.join("\n")).unwrap();
    let points = read(&metrics);
    assert_eq!(points.len(), 3);
    assert_eq!(points[2].step, 40.0);
    assert_eq!(points[2].layers[1], vec![0.0, 0.0, 1.0, 0.0]);
    let svg = d.join("routing_heatmap.svg");
    draw_heatmap(&svg, &points, "test", "iteration").unwrap();
    let text = std::fs::read_to_string(&svg).unwrap();
    let count = |ratio: f64| text.matches(&hex(colour(ratio))).count();
    // white: 12 balanced cells of layer 0, 4 of layer 1's first point, 1 of its second (0.25),
    // plus the white background
    assert_eq!(count(1.0), 12 + 4 + 1 + 1, "white cells");
    assert_eq!(count(0.0), 2 + 3, "dead cells");
    assert_eq!(count(3.0), 1, "the 0.75 cell");
    assert_eq!(count(4.0), 1, "the collapsed cell");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn an_moe_run_writes_the_heat_map() {
    let d = dir("run");
    let out = d.join("run");
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_moegrad"))
        .args([
            "train",
            "--model",
            "moe-mlp",
            "--epochs",
            "2",
            "--train-limit",
            "256",
            "--test-limit",
            "64",
            "--device",
            "cpu",
            "--data-dir",
            concat!(env!("CARGO_MANIFEST_DIR"), "/../data"),
            "--out",
        ])
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
    let text = std::fs::read_to_string(out.join("routing_heatmap.svg")).unwrap();
    // 2 epochs × 8 experts of cells, all coloured by their load
    assert!(text.matches("<rect").count() >= 16, "{}", text.len());
    let _ = std::fs::remove_dir_all(&d);
}
