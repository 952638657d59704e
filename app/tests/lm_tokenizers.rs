//! Language models on other tokens than characters (`--tokenizer`): a byte-level BPE run whose
//! checkpoint alone is enough to sample from (library and command line), a resumed BPE run
//! continuing bit for bit, `--resume` refusing another tokenizer, bits per character equal to
//! the loss / ln 2 for a character model (and below it per token for BPE), and bad
//! `--tokenizer` values refused with the value or file named.

use moegrad::lm::{SampleOptions, generate, load_model, run};
use moegrad::train::{ModelKind, RunOptions, TrainConfig};
use moegrad::{Device, Result};
use std::path::{Path, PathBuf};

fn tmp(name: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("moegrad-lmtok-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    p
}

/// A small language-model run on the bundled Shakespeare with `tokenizer`.
fn tiny(out: &Path, tokenizer: &str) -> TrainConfig {
    TrainConfig {
        out: out.to_path_buf(),
        device: "cpu".into(),
        layers: 1,
        heads: 2,
        d_model: 32,
        block: 16,
        batch: 8,
        iters: 20,
        eval_every: 10,
        eval_windows: 32,
        warmup_steps: 5,
        log_every: 5,
        tokenizer: tokenizer.into(),
        ..TrainConfig::language_model(ModelKind::Gpt)
    }
}

fn metrics(out: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn resume() -> RunOptions {
    RunOptions {
        resume: true,
        ..RunOptions::default()
    }
}

#[test]
fn a_character_model_s_bits_per_character_are_its_loss_over_ln_2() {
    let out = tmp("char-bpc");
    let s = run(&tiny(&out, "char"), RunOptions::default()).unwrap();
    assert_eq!(s.val_bpc, s.val_loss / std::f64::consts::LN_2);
    for m in metrics(&out) {
        let (loss, bpc) = (
            m["val_loss"].as_f64().unwrap(),
            m["val_bpc"].as_f64().unwrap(),
        );
        assert_eq!(bpc, loss / std::f64::consts::LN_2, "{m}");
    }
    // a char checkpoint holds its vocabulary as before, and no tokenizer JSON
    let meta = moegrad::checkpoint::Checkpoint::read_metadata(&out.join("checkpoint.safetensors"))
        .unwrap();
    assert_eq!(meta.get("vocab").map(|v| v.chars().count()), Some(80));
    assert!(!meta.contains_key("tokenizer"));
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn a_bpe_run_samples_from_its_checkpoint_alone_and_resumes_exactly() -> Result<()> {
    let out = tmp("bpe");
    let cfg = tiny(&out, "bpe:300");
    let s = run(&cfg, RunOptions::default())?;
    assert!(s.vocab <= 300 && s.vocab > 256, "vocabulary {}", s.vocab);
    // about 1.6 characters per token: bits per character well below the loss per token / ln 2
    let per_token_bits = s.val_loss / std::f64::consts::LN_2;
    assert!(
        s.val_bpc < 0.8 * per_token_bits && s.val_bpc > 0.4 * per_token_bits,
        "bpc {} vs {per_token_bits} bits per token",
        s.val_bpc
    );
    let m = metrics(&out);
    assert_eq!(m.last().unwrap()["val_bpc"].as_f64(), Some(s.val_bpc));
    // the checkpoint holds the tokenizer's JSON: sampling needs nothing else
    let ckpt = out.join("checkpoint.safetensors");
    let (model, tokenizer) = load_model(&ckpt, Device::cpu())?;
    assert_eq!(tokenizer.vocab_size(), s.vocab);
    assert!(tokenizer.char_vocab().is_none());
    let opts = SampleOptions {
        tokens: 30,
        ..SampleOptions::default()
    };
    let mut streamed = String::new();
    // a prompt with characters the text never has: bytes, so still encodable
    let text = generate(
        &model,
        &tokenizer,
        "ROMEO: ★é",
        &opts,
        Device::cpu(),
        |t| streamed.push_str(t),
    )?;
    assert_eq!(text, streamed);
    assert!(!text.is_empty());
    assert_eq!(
        tokenizer.decode(&tokenizer.encode(&text)?)?,
        text,
        "sampled text re-encodes and decodes to itself"
    );
    // the command line decodes with it too, the same text twice
    let cli = || {
        std::process::Command::new(env!("CARGO_BIN_EXE_moegrad"))
            .args(["generate", "--checkpoint"])
            .arg(&ckpt)
            .args(["--prompt", "KING:", "--tokens", "25", "--device", "cpu"])
            .output()
            .unwrap()
    };
    let (a, b) = (cli(), cli());
    assert!(a.status.success(), "{}", String::from_utf8_lossy(&a.stderr));
    assert_eq!(a.stdout, b.stdout);
    let printed = String::from_utf8(a.stdout).unwrap();
    assert!(
        printed.starts_with("KING:") && printed.len() > 20,
        "{printed:?}"
    );

    // trained in two parts, the run ends where the straight one did
    let parts = tmp("bpe-parts");
    let mut first = cfg.clone();
    first.out = parts.clone();
    first.iters = 10;
    first.schedule_epochs = 2;
    run(&first, RunOptions::default())?;
    let mut second = first.clone();
    second.iters = 20;
    let resumed = run(&second, resume())?;
    let mut straight = cfg.clone();
    straight.out = tmp("bpe-straight");
    straight.schedule_epochs = 2;
    let straight_run = run(&straight, RunOptions::default())?;
    assert_eq!(
        (resumed.val_loss, resumed.val_bpc, resumed.train_loss),
        (
            straight_run.val_loss,
            straight_run.val_bpc,
            straight_run.train_loss
        )
    );
    for d in [out, parts, straight.out] {
        let _ = std::fs::remove_dir_all(d);
    }
    Ok(())
}

#[test]
fn resume_refuses_another_tokenizer() {
    let out = tmp("resume-other");
    let mut cfg = tiny(&out, "char");
    cfg.iters = 10;
    cfg.schedule_epochs = 2;
    run(&cfg, RunOptions::default()).unwrap();
    let mut other = cfg.clone();
    other.iters = 20;
    other.tokenizer = "bpe:300".into();
    let err = run(&other, resume()).unwrap_err().to_string();
    assert!(err.contains("--tokenizer \"char\" → \"bpe:300\""), "{err}");
    // and the other way round, from a BPE run
    let bpe = tmp("resume-bpe");
    let mut cfg = tiny(&bpe, "bpe:300");
    cfg.iters = 10;
    cfg.schedule_epochs = 2;
    run(&cfg, RunOptions::default()).unwrap();
    let mut other = cfg.clone();
    other.iters = 20;
    other.tokenizer = "bpe:400".into();
    let err = run(&other, resume()).unwrap_err().to_string();
    assert!(
        err.contains("--tokenizer \"bpe:300\" → \"bpe:400\""),
        "{err}"
    );
    // the same setting on a changed text trains another BPE: refused by the tokenizer check
    let text = tmp("text.txt");
    std::fs::write(&text, "a few words of text, said twice.\n".repeat(300)).unwrap();
    let textrun = tmp("resume-text");
    let mut cfg = tiny(&textrun, "bpe:280");
    cfg.data = moegrad::train::DataKind::Text;
    cfg.data_file = Some(text.clone());
    cfg.iters = 10;
    cfg.schedule_epochs = 2; // training on to 20 iterations is then a plain resume
    run(&cfg, RunOptions::default()).unwrap();
    std::fs::write(&text, "quite other words, written thrice.\n".repeat(300)).unwrap();
    let mut again = cfg.clone();
    again.iters = 20;
    let err = run(&again, resume()).unwrap_err().to_string();
    assert!(
        err.contains("another tokenizer") && err.contains("--tokenizer bpe:280"),
        "{err}"
    );
    // while the unchanged text resumes
    std::fs::write(&text, "a few words of text, said twice.\n".repeat(300)).unwrap();
    assert_eq!(run(&again, resume()).unwrap().iters, 20);
    for d in [out, bpe, textrun, text] {
        let _ = std::fs::remove_dir_all(&d);
        let _ = std::fs::remove_file(&d);
    }
}

#[test]
fn bad_tokenizer_values_are_refused_on_the_command_line() {
    let dir = tmp("bad-values");
    std::fs::create_dir_all(&dir).unwrap();
    let garbage = dir.join("garbage.json");
    std::fs::write(&garbage, "not json at all").unwrap();
    let missing = dir.join("missing.json");
    let train = |extra: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_moegrad"))
            .args([
                "train",
                "--device",
                "cpu",
                "--iters",
                "10",
                "--eval-every",
                "10",
            ])
            .args(["--out"])
            .arg(dir.join("out"))
            .args(extra)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{extra:?}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let lm = ["--data", "shakespeare", "--model", "gpt", "--tokenizer"];
    for (value, words) in [
        ("bpe:100", vec!["bpe:100", "between 257"]),
        ("bpe:99999999", vec!["bpe:99999999", "65536"]),
        ("bpe:many", vec!["bpe:many", "whole number"]),
        (
            "sentencepiece",
            vec!["sentencepiece", "expected char, bpe:N"],
        ),
    ] {
        let err = train(&[&lm[..], &[value]].concat());
        for w in words {
            assert!(err.contains(w), "{value}: {err}");
        }
    }
    let err = train(&[&lm[..], &[missing.to_str().unwrap()]].concat());
    assert!(
        err.contains(missing.to_str().unwrap()) && err.contains("cannot read"),
        "{err}"
    );
    let err = train(&[&lm[..], &[garbage.to_str().unwrap()]].concat());
    assert!(
        err.contains(garbage.to_str().unwrap()) && err.contains("not a Hugging Face"),
        "{err}"
    );
    let err = train(&[
        "--data",
        "mnist",
        "--model",
        "cnn",
        "--tokenizer",
        "bpe:512",
    ]);
    assert!(
        err.contains("--tokenizer bpe:512") && err.contains("--model cnn reads images"),
        "{err}"
    );
    assert!(!dir.join("out").exists(), "bad settings leave --out alone");
    // --help names the setting
    let help = std::process::Command::new(env!("CARGO_BIN_EXE_moegrad"))
        .args(["train", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(
        help.contains("--tokenizer") && help.contains("bpe:N"),
        "{help}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn checkpoints_written_before_tokenizers_load_and_resume() {
    let out = tmp("old");
    let mut cfg = tiny(&out, "char");
    cfg.iters = 10;
    cfg.schedule_epochs = 2;
    run(&cfg, RunOptions::default()).unwrap();
    // rewrite the checkpoint as an older moegrad wrote it: no `tokenizer` in its settings
    let path = out.join("checkpoint.safetensors");
    let mut ck = moegrad::checkpoint::Checkpoint::load(&path, Device::cpu()).unwrap();
    let mut config: serde_json::Value = serde_json::from_str(&ck.metadata["config"]).unwrap();
    assert_eq!(config["tokenizer"], "char");
    config.as_object_mut().unwrap().remove("tokenizer");
    ck.metadata.insert("config".into(), config.to_string());
    ck.save(&path).unwrap();
    let (_, tokenizer) = load_model(&path, Device::cpu()).unwrap();
    assert_eq!(tokenizer.vocab_size(), 80);
    let mut more = cfg.clone();
    more.iters = 20;
    assert_eq!(run(&more, resume()).unwrap().iters, 20);
    let _ = std::fs::remove_dir_all(&out);
}
