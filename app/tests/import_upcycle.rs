//! Models that come from elsewhere: `moegrad import` (a transformers checkpoint written as a run,
//! `moegrad::lm::import_run`), `moegrad logits`, and `--init-from` (training on from a
//! checkpoint, and sparse upcycling a dense `llama` into `mixtral`/`qwen2-moe`).
//!
//! * every fixture of `tests/fixtures/hf` imported as a run gives the logits of the import
//!   itself bit for bit, and transformers' to 1e-4 through the `logits` command;
//! * a transformers config written from a model's settings reads back as the same model, for
//!   every family's preset and every fixture;
//! * at step 0 an upcycled `mixtral` (experts copies of the dense FFN, renormalised top-2)
//!   computes the dense `llama`'s logits, and a short run from there improves on it;
//! * an imported GPT-2 with its tokenizer trains on from the import, and bad imports and ids are
//!   refused with one line naming the cause, leaving no directory behind.

#[path = "../../tests/common/mod.rs"]
mod common;

use moegrad::lm::{
    Architecture, LanguageModel, architecture_from_hf, architecture_to_hf, import_hf, import_run,
    inherit_settings, load_checkpoint, load_model, run,
};
use moegrad::nn::Parameters;
use moegrad::train::{ModelKind, RunOptions, TrainConfig};
use moegrad::{Device, Tensor};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::{HF_FIXTURES as FIXTURES, hf_fixture as fixture};

fn tmp(name: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("moegrad-imp-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    p
}

fn moegrad() -> Command {
    Command::new(env!("CARGO_BIN_EXE_moegrad"))
}

/// The fixture's ids `[B][T]` and transformers' logits (flat, row-major `[B, T, V]`).
fn expected(name: &str) -> (Vec<Vec<i32>>, Vec<f64>) {
    let json: Value = serde_json::from_str(
        &std::fs::read_to_string(fixture(name).join("expected.json")).unwrap(),
    )
    .unwrap();
    (
        serde_json::from_value(json["ids"].clone()).unwrap(),
        serde_json::from_value(json["logits"].clone()).unwrap(),
    )
}

fn logits(model: &LanguageModel, ids: &[Vec<i32>]) -> Vec<f32> {
    let idx = Tensor::from_i32(ids.concat(), &[ids.len(), ids[0].len()], Device::cpu()).unwrap();
    model.set_training(false);
    moegrad::no_grad(|| model.forward(&idx))
        .unwrap()
        .logits
        .to_vec_f32()
        .unwrap()
}

#[test]
fn every_fixture_imported_as_a_run_gives_the_imports_logits_bit_for_bit() {
    for name in FIXTURES {
        let out = tmp(&format!("run-{name}"));
        let report = import_run(&fixture(name), &out, None, false, Device::cpu())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let direct = import_hf(&fixture(name), Device::cpu()).unwrap();
        let (from_run, tokenizer) = load_checkpoint(&report.checkpoint, Device::cpu())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(tokenizer.is_some(), name == "gpt2", "{name}: tokenizer");
        let (ids, _) = expected(name);
        let (a, b) = (logits(&from_run, &ids), logits(&direct.model, &ids));
        let worst = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        assert!(
            a == b,
            "{name}: the run's logits differ from the import's by up to {worst}"
        );
        assert_eq!(
            from_run.named_params().len(),
            direct.model.named_params().len()
        );
        let _ = std::fs::remove_dir_all(&out);
    }
}

#[test]
fn the_logits_command_on_an_imported_run_matches_transformers() {
    for name in ["gpt2", "deepseek_v3", "qwen2_moe"] {
        let out = tmp(&format!("cli-{name}"));
        let st = moegrad()
            .args(["import", "--hf"])
            .arg(fixture(name))
            .arg("--out")
            .arg(&out)
            .output()
            .unwrap();
        assert!(
            st.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&st.stderr)
        );
        let (ids, want) = expected(name);
        let ids_file = out.join("ids.json");
        std::fs::write(&ids_file, serde_json::to_string(&ids).unwrap()).unwrap();
        let o = moegrad()
            .args(["logits", "--json", "--checkpoint"])
            .arg(out.join("checkpoint.safetensors"))
            .arg("--ids")
            .arg(&ids_file)
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let json: Value = serde_json::from_slice(&o.stdout).unwrap();
        let got: Vec<f64> = json["logits"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|s| s.as_array().unwrap().iter())
            .flat_map(|r| r.as_array().unwrap().iter().map(|v| v.as_f64().unwrap()))
            .collect();
        assert_eq!(got.len(), want.len(), "{name}: logits count");
        let err = got
            .iter()
            .zip(&want)
            .map(|(g, w)| (g - w).abs())
            .fold(0.0, f64::max);
        println!("{name}: moegrad logits vs transformers: max error {err:.2e}");
        assert!(
            err < 1e-4,
            "{name}: logits differ from transformers' by {err}"
        );
        let _ = std::fs::remove_dir_all(&out);
    }
}

#[test]
fn a_config_written_from_a_model_reads_back_as_that_model() {
    let mut archs: Vec<(String, Architecture)> = moegrad::lm::Family::ALL
        .into_iter()
        .map(|f| {
            (
                f.name().to_string(),
                Architecture::Decoder(moegrad::lm::DecoderConfig::baby(f, 300)),
            )
        })
        .collect();
    archs.push((
        "gpt".into(),
        Architecture::Gpt(moegrad::lm::GptConfig::baby(65)),
    ));
    for name in FIXTURES {
        let json: Value = serde_json::from_str(
            &std::fs::read_to_string(fixture(name).join("config.json")).unwrap(),
        )
        .unwrap();
        archs.push((name.to_string(), architecture_from_hf(&json).unwrap()));
    }
    for (name, arch) in archs {
        let json = architecture_to_hf(&arch).unwrap_or_else(|e| panic!("{name}: {e}"));
        let back = architecture_from_hf(&json).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(back, arch, "{name}: {json}");
    }
    // what a family's config cannot say is refused, naming it
    let mut d = moegrad::lm::DecoderConfig::baby(moegrad::lm::Family::Mixtral, 300);
    d.qkv_bias = true;
    let e = architecture_to_hf(&Architecture::Decoder(d))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("MixtralForCausalLM") && e.contains("q/k/v biases"),
        "{e}"
    );
    let moe_gpt = moegrad::lm::gpt_config(&TrainConfig::language_model(ModelKind::MoeGpt), 65);
    let e = architecture_to_hf(&Architecture::Gpt(moe_gpt))
        .unwrap_err()
        .to_string();
    assert!(e.contains("moe-gpt has no transformers class"), "{e}");
}

/// A small dense llama run on the bundled Shakespeare.
fn dense_llama(out: &Path) -> TrainConfig {
    TrainConfig {
        out: out.to_path_buf(),
        device: "cpu".into(),
        layers: 2,
        heads: 2,
        kv_heads: 1,
        d_model: 32,
        block: 16,
        batch: 8,
        iters: 60,
        eval_every: 30,
        eval_windows: 16,
        warmup_steps: 5,
        log_every: 10,
        ..TrainConfig::language_model(ModelKind::Llama)
    }
}

/// The settings of a run upcycling the checkpoint in `from` into `model` with experts of
/// `expert_hidden` (the other flags inherited).
fn upcycle(
    from: &Path,
    model: ModelKind,
    expert_hidden: usize,
    shared_hidden: Option<usize>,
    out: &Path,
) -> TrainConfig {
    let mut cfg = TrainConfig {
        out: out.to_path_buf(),
        device: "cpu".into(),
        batch: 8,
        block: 16,
        iters: 60,
        eval_every: 30,
        eval_windows: 16,
        warmup_steps: 5,
        log_every: 10,
        init_from: Some(from.join("checkpoint.safetensors")),
        ..TrainConfig::language_model(model)
    };
    cfg.expert_hidden = expert_hidden;
    cfg.experts = 4;
    if let Some(h) = shared_hidden {
        cfg.shared_hidden = h;
    }
    inherit_settings(
        &mut cfg,
        &["--model", "--expert-hidden", "--experts", "--block"],
    )
    .unwrap();
    cfg
}

#[test]
fn an_upcycled_mixtral_computes_the_dense_logits_at_step_0_and_improves_on_them() {
    let dense_dir = tmp("dense");
    let dense_cfg = dense_llama(&dense_dir);
    let dense_run = run(&dense_cfg, RunOptions::default()).unwrap();
    let (dense, tokenizer) =
        load_model(&dense_dir.join("checkpoint.safetensors"), Device::cpu()).unwrap();
    let ids = vec![
        tokenizer.encode("ROMEO: What, ho").unwrap(),
        tokenizer.encode("JULIET: Romeo!!").unwrap(),
    ];
    let want = logits(&dense, &ids);

    // copies of the 128-wide dense FFN, renormalised top-2: the same function
    let up_dir = tmp("up");
    let cfg = upcycle(&dense_dir, ModelKind::Mixtral, 128, None, &up_dir);
    assert_eq!((cfg.layers, cfg.d_model, cfg.kv_heads), (2, 32, 1));
    let vocab = tokenizer.vocab_size();
    let up = LanguageModel::build_initialised(&cfg, vocab, Device::cpu()).unwrap();
    assert_eq!(up.moe_layers_named().len(), 2);
    let got = logits(&up, &ids);
    let err = got
        .iter()
        .zip(&want)
        .map(|(g, w)| (g - w).abs())
        .fold(0.0f32, f32::max);
    println!("upcycled mixtral vs dense llama at step 0: max |Δ logit| = {err:.2e}");
    assert!(
        err < 1e-5,
        "upcycled logits differ from the dense model's by {err}"
    );

    // the same on the GPU: the upcycled experts are built on the device of the checkpoint
    if let Some(gpu) = common::gpu_or_skip("upcycling on the GPU") {
        let up_gpu = LanguageModel::build_initialised(&cfg, vocab, gpu).unwrap();
        let idx = Tensor::from_i32(ids.concat(), &[ids.len(), ids[0].len()], gpu).unwrap();
        up_gpu.set_training(false);
        let on_gpu = moegrad::no_grad(|| up_gpu.forward(&idx))
            .unwrap()
            .logits
            .to_vec_f32()
            .unwrap();
        let err = on_gpu
            .iter()
            .zip(&want)
            .map(|(g, w)| (g - w).abs())
            .fold(0.0f32, f32::max);
        println!("upcycled mixtral on the GPU vs dense llama on the CPU: {err:.2e}");
        assert!(err < 1e-4, "GPU upcycled logits differ by {err}");
    }

    // slices (64 of the 128 columns each) are another function
    let sliced = upcycle(&dense_dir, ModelKind::Mixtral, 64, None, &tmp("sliced"));
    let sliced = LanguageModel::build_initialised(&sliced, vocab, Device::cpu()).unwrap();
    let diff = logits(&sliced, &ids)
        .iter()
        .zip(&want)
        .map(|(g, w)| (g - w).abs())
        .fold(0.0f32, f32::max);
    assert!(
        diff > 1e-3,
        "sliced experts cannot give the dense logits ({diff})"
    );

    // training from the upcycled start improves on the dense model
    let s = run(&cfg, RunOptions::default()).unwrap();
    println!(
        "dense llama val loss {:.4}; upcycled mixtral after 60 more iterations {:.4}",
        dense_run.val_loss, s.val_loss
    );
    assert!(
        s.val_loss < dense_run.val_loss,
        "the upcycled run ({}) did not improve on its dense start ({})",
        s.val_loss,
        dense_run.val_loss
    );
    // its checkpoint rebuilds the upcycled architecture alone (the dense rotary base kept)
    let (reloaded, _) = load_model(&up_dir.join("checkpoint.safetensors"), Device::cpu()).unwrap();
    let Architecture::Decoder(d) = reloaded.architecture() else {
        panic!("not a decoder")
    };
    assert_eq!(
        (d.rope_theta, d.moe.as_ref().unwrap().hidden),
        (10_000.0, 128)
    );

    // a qwen2-moe upcycles too (slices, the shared expert a copy); olmoe is refused
    let q = upcycle(&dense_dir, ModelKind::Qwen2Moe, 64, None, &tmp("qwen"));
    // (the preset's shared expert is 256 wide, twice this dense FFN: named in the refusal)
    let e = LanguageModel::build_initialised(&q, vocab, Device::cpu())
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(e.contains("--shared-hidden 128"), "{e}");
    let q = upcycle(&dense_dir, ModelKind::Qwen2Moe, 64, Some(128), &tmp("qwen"));
    let q = LanguageModel::build_initialised(&q, vocab, Device::cpu()).unwrap();
    assert_eq!(q.moe_layers_named().len(), 2);
    let mut o = TrainConfig {
        init_from: Some(dense_dir.join("checkpoint.safetensors")),
        ..TrainConfig::language_model(ModelKind::Olmoe)
    };
    let e = inherit_settings(&mut o, &["--model"])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("not --model olmoe") && e.contains("q/k norms"),
        "{e}"
    );
    // a shape flag that contradicts the checkpoint is refused
    let mut o = TrainConfig {
        init_from: Some(dense_dir.join("checkpoint.safetensors")),
        d_model: 64,
        ..TrainConfig::language_model(ModelKind::Llama)
    };
    let e = inherit_settings(&mut o, &["--d-model"])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("--d-model 64 differs") && e.contains("32"),
        "{e}"
    );
    for d in [dense_dir, up_dir] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn an_imported_gpt2_trains_on_from_the_import_with_its_own_tokenizer() {
    let imported = tmp("gpt2");
    import_run(&fixture("gpt2"), &imported, None, false, Device::cpu()).unwrap();
    let out = tmp("gpt2-tuned");
    let st = moegrad()
        .args(["train", "--data", "shakespeare", "--init-from"])
        .arg(imported.join("checkpoint.safetensors"))
        .args([
            "--iters",
            "8",
            "--eval-every",
            "4",
            "--eval-windows",
            "8",
            "--block",
            "16",
        ])
        .args(["--device", "cpu", "--json", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        st.status.success(),
        "{}",
        String::from_utf8_lossy(&st.stderr)
    );
    let s: Value = serde_json::from_slice(&st.stdout).unwrap();
    assert_eq!(s["vocab"], 262, "{s}");
    assert!(s["val_loss"].as_f64().unwrap().is_finite());
    // the fine-tuned run is a gpt of GPT-2's shape, and samples from its checkpoint
    let (model, tok) = load_model(&out.join("checkpoint.safetensors"), Device::cpu()).unwrap();
    assert!(
        matches!(model.architecture(), Architecture::Gpt(g) if g.d_model == 24 && g.vocab == 262)
    );
    assert_eq!(tok.vocab_size(), 262);
    let g = moegrad()
        .args([
            "generate",
            "--device",
            "cpu",
            "--tokens",
            "5",
            "--prompt",
            "To be",
            "--checkpoint",
        ])
        .arg(out.join("checkpoint.safetensors"))
        .output()
        .unwrap();
    assert!(g.status.success(), "{}", String::from_utf8_lossy(&g.stderr));
    // a tokenizer-less import cannot train on text, and says why
    let llama = tmp("llama");
    import_run(&fixture("llama"), &llama, None, false, Device::cpu()).unwrap();
    let mut cfg = TrainConfig {
        init_from: Some(llama.join("checkpoint.safetensors")),
        ..TrainConfig::language_model(ModelKind::Llama)
    };
    let e = inherit_settings(&mut cfg, &[]).unwrap_err().to_string();
    assert!(
        e.contains("no tokenizer") && e.contains("--tokenizer"),
        "{e}"
    );
    for d in [imported, out, llama] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// Runs the binary and returns (success, stderr).
fn fails(args: &[&str], paths: &[&Path]) -> String {
    let mut c = moegrad();
    c.args(args);
    for p in paths {
        c.arg(p);
    }
    let o = c.output().unwrap();
    assert!(!o.status.success(), "{args:?} succeeded");
    let err = String::from_utf8_lossy(&o.stderr).trim().to_string();
    assert_eq!(err.lines().count(), 1, "not one line: {err}");
    assert!(!err.contains("panicked"), "{err}");
    err
}

#[test]
fn bad_imports_and_ids_are_refused_naming_the_cause_and_leave_nothing_behind() {
    // an unknown model_type
    let src = tmp("bad-src");
    std::fs::create_dir_all(&src).unwrap();
    let mut cfg: Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("llama").join("config.json")).unwrap(),
    )
    .unwrap();
    cfg["model_type"] = "mamba".into();
    std::fs::write(src.join("config.json"), cfg.to_string()).unwrap();
    let out = tmp("bad-out");
    let e = fails(&["import", "--hf"], &[&src, Path::new("--out"), &out]);
    assert!(
        e.contains("\"mamba\"") && e.contains("llama, mixtral"),
        "{e}"
    );
    assert!(!out.exists(), "a failed import left {}", out.display());
    // an unsupported setting, named
    cfg["model_type"] = "llama".into();
    cfg["rope_scaling"] = serde_json::json!({"type": "linear", "factor": 2.0});
    std::fs::write(src.join("config.json"), cfg.to_string()).unwrap();
    let e = fails(&["import", "--hf"], &[&src, Path::new("--out"), &out]);
    assert!(e.contains("rope_scaling"), "{e}");
    // a missing tensor file
    cfg["rope_scaling"] = Value::Null;
    std::fs::write(src.join("config.json"), cfg.to_string()).unwrap();
    let e = fails(&["import", "--hf"], &[&src, Path::new("--out"), &out]);
    assert!(e.contains("model.safetensors"), "{e}");
    assert!(!out.exists());
    // an --out holding another run is refused without --overwrite
    let good = tmp("good");
    import_run(&fixture("mixtral"), &good, None, false, Device::cpu()).unwrap();
    let e = fails(
        &["import", "--hf"],
        &[&fixture("mixtral"), Path::new("--out"), &good],
    );
    assert!(e.contains("--overwrite"), "{e}");
    // ids outside the vocabulary, of unequal lengths, or longer than the context
    let ck = good.join("checkpoint.safetensors");
    for (ids, want) in [
        (
            "[1, 2, 53]",
            "token id 53 is outside the model's vocabulary 0..53",
        ),
        ("[[1, 2], [3]]", "same length"),
        ("[[]]", "same length"),
        ("\"hello\"", "expected a list of token ids"),
        (
            "[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17]",
            "longer than the model's context of 16",
        ),
    ] {
        let f = good.join("ids.json");
        std::fs::write(&f, ids).unwrap();
        let e = fails(&["logits", "--checkpoint"], &[&ck, Path::new("--ids"), &f]);
        assert!(e.contains(want), "{ids}: {e}");
    }
    for d in [src, good] {
        let _ = std::fs::remove_dir_all(d);
    }
}
