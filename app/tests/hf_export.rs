//! `moegrad export --format hf` (`moegrad::lm::export_hf`), checked without Python:
//!
//! * `import(export(model))` gives the model back bit for bit (every parameter, the routers'
//!   state, the logits) for every family, in both expert layouts;
//! * `export(import(fixture))` gives the fixture transformers wrote bit for bit (names, shapes,
//!   dtypes, bytes; the stacked fixture for the stacked layout) and a config describing the
//!   same model;
//! * a character tokenizer exported as `tokenizer.json` gives moegrad's ids;
//! * what transformers cannot represent is refused in one line naming the setting, and a
//!   failed export leaves no directory.
//!
//! `scripts/check_hf_export.py` checks the same exports with transformers itself
//! (docs/interop.md).

#[path = "../../tests/common/mod.rs"]
mod common;

use moegrad::lm::{
    Decoder, DecoderConfig, Family, HfLayout, LanguageModel, architecture_from_hf, export_hf,
    import_hf,
};
use moegrad::nn::Parameters;
use moegrad::{Device, Tensor};
use safetensors::SafeTensors;
use serde_json::Value;
use std::path::{Path, PathBuf};

use common::{HF_FIXTURES as FIXTURES, hf_fixture as fixture};

fn tmp(name: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("moegrad-exp-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    p
}

fn logits(model: &LanguageModel, ids: &[i32]) -> Vec<f32> {
    let idx = Tensor::from_i32(ids.to_vec(), &[1, ids.len()], Device::cpu()).unwrap();
    model.set_training(false);
    moegrad::no_grad(|| model.forward(&idx))
        .unwrap()
        .logits
        .to_vec_f32()
        .unwrap()
}

/// Every parameter and state tensor of a model, by name, as f32 values.
fn contents(model: &LanguageModel) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut out: Vec<_> = model
        .named_params()
        .into_iter()
        .map(|(n, p)| (n, p.get().shape().to_vec(), p.get().to_vec_f32().unwrap()))
        .collect();
    for (n, t) in model.state().unwrap() {
        out.push((n, t.shape().to_vec(), t.to_vec_f32().unwrap()));
    }
    out
}

/// A small decoder of each family with awkward sizes (grouped-query attention, a shared expert
/// where the family has one, DeepSeek's dense first layer and low-rank queries), its weights
/// drawn by moegrad and its correction bias made nonzero.
fn small(family: Family) -> LanguageModel {
    let mut d = DecoderConfig::baby(family, 41);
    (
        d.layers, d.d_model, d.heads, d.kv_heads, d.head_dim, d.block,
    ) = (3, 24, 4, 2, 6, 12);
    d.ffn_hidden = 20;
    d.seed = 7;
    if let Some(m) = d.moe.as_mut() {
        (m.experts, m.k, m.hidden) = (4, 2, 10);
        if m.shared.count > 0 {
            m.shared.hidden = 10;
        }
        if family == Family::DeepseekMoe {
            m.router_options.insert("n_group".into(), "2".into());
            m.router_options.insert("topk_group".into(), "1".into());
        }
    }
    if let Some(l) = d.latent.as_mut() {
        (l.q_rank, l.kv_rank, l.nope_dim, l.rope_dim, l.v_dim) = (Some(8), 6, 4, 2, 8);
    }
    let model = LanguageModel::Decoder(Box::new(Decoder::new(&d, Device::cpu()).unwrap()));
    for (name, t) in model.state().unwrap() {
        if name.ends_with("e_score_correction_bias") {
            let n = t.numel();
            let bias: Vec<f32> = (0..n).map(|i| 0.05 * (i as f32 - 1.5)).collect();
            model
                .load_state(&name, &Tensor::from_f32(bias, &[n], Device::cpu()).unwrap())
                .unwrap();
        }
    }
    model
}

#[test]
fn import_of_export_gives_every_family_back_bit_for_bit_in_both_layouts() {
    let mut models: Vec<(String, LanguageModel)> = Family::ALL
        .into_iter()
        .map(|f| (f.name().to_string(), small(f)))
        .collect();
    let gpt = moegrad::lm::GptConfig {
        layers: 2,
        d_model: 24,
        heads: 3,
        block: 12,
        ..moegrad::lm::GptConfig::baby(41)
    };
    models.push((
        "gpt".into(),
        LanguageModel::Gpt(moegrad::lm::Gpt::new(&gpt, Device::cpu()).unwrap()),
    ));
    let ids = [1, 5, 40, 7, 7, 0, 22, 3, 9];
    for (name, model) in &models {
        for layout in [HfLayout::Legacy, HfLayout::Stacked] {
            let dir = tmp(&format!("rt-{name}-{layout:?}"));
            export_hf(model, None, None, layout, &dir).unwrap_or_else(|e| panic!("{name}: {e}"));
            let back = import_hf(&dir, Device::cpu()).unwrap_or_else(|e| panic!("{name}: {e}"));
            // what transformers reads that moegrad's import does not: DeepSeek-V3 sizes its
            // rotary tables by head_dim (found by scripts/check_hf_export.py)
            let config: Value =
                serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
                    .unwrap();
            if config["model_type"] == "deepseek_v3" {
                assert_eq!(config["head_dim"], config["qk_rope_head_dim"], "{config}");
            }
            assert!(
                contents(&back.model) == contents(model),
                "{name} ({layout:?}): parameters or state differ after the round trip"
            );
            assert!(
                logits(&back.model, &ids) == logits(model, &ids),
                "{name} ({layout:?}): logits differ after the round trip"
            );
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}

/// Every tensor of a safetensors file: name → (dtype, shape, bytes).
fn tensors(path: &Path) -> Vec<(String, String, Vec<usize>, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<_> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| {
            (
                n,
                format!("{:?}", v.dtype()),
                v.shape().to_vec(),
                v.data().to_vec(),
            )
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

#[test]
fn export_of_import_gives_the_transformers_fixtures_bit_for_bit() {
    for name in FIXTURES {
        let src = fixture(name);
        let config: Value =
            serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap())
                .unwrap();
        let imported = import_hf(&src, Device::cpu()).unwrap();
        for (layout, file) in [
            (HfLayout::Legacy, src.join("model.safetensors")),
            (HfLayout::Stacked, src.join("stacked/model.safetensors")),
        ] {
            if !file.is_file() {
                continue;
            }
            let dir = tmp(&format!("fx-{name}-{layout:?}"));
            export_hf(&imported.model, Some(&config), None, layout, &dir)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            let (want, got) = (tensors(&file), tensors(&dir.join("model.safetensors")));
            let names = |t: &[(String, String, Vec<usize>, Vec<u8>)]| {
                t.iter().map(|x| x.0.clone()).collect::<Vec<_>>()
            };
            assert_eq!(
                names(&got),
                names(&want),
                "{name} ({layout:?}): tensor names"
            );
            for (g, w) in got.iter().zip(&want) {
                assert_eq!(
                    (&g.1, &g.2),
                    (&w.1, &w.2),
                    "{name}: {} dtype and shape",
                    g.0
                );
                assert!(g.3 == w.3, "{name} ({layout:?}): {} differs", g.0);
            }
            let written: Value =
                serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
                    .unwrap();
            assert_eq!(
                architecture_from_hf(&written).unwrap(),
                architecture_from_hf(&config).unwrap(),
                "{name}: the exported config describes another model"
            );
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}

#[test]
fn a_character_tokenizer_exports_as_a_tokenizer_json_with_moegrads_ids() {
    let texts = ["ROMEO:\nA rose, by any", "  tis   \n\n?!"];
    let mut chars: Vec<char> = texts.concat().chars().collect();
    chars.sort_unstable();
    chars.dedup();
    let tok = moegrad::data::Tokenizer::chars(chars);
    let json = moegrad::lm::tokenizer_json(&tok).unwrap();
    let back = moegrad::data::Tokenizer::from_json(&json, "the exported tokenizer").unwrap();
    for text in texts {
        let ids = tok.encode(text).unwrap();
        assert_eq!(back.encode(text).unwrap(), ids, "{text:?}");
        assert_eq!(back.decode(&ids).unwrap(), text);
    }
    assert_eq!(back.vocab_size(), tok.vocab_size());
}

/// Runs the binary, which must fail with one line containing every `want`.
fn refused(args: &[&str], want: &[&str]) {
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_moegrad"))
        .args(args)
        .output()
        .unwrap();
    assert!(!o.status.success(), "{args:?} succeeded");
    let err = String::from_utf8_lossy(&o.stderr).trim().to_string();
    assert_eq!(err.lines().count(), 1, "not one line: {err}");
    for w in want {
        assert!(err.contains(w), "{args:?}: {err:?} lacks {w:?}");
    }
}

#[test]
fn what_transformers_cannot_represent_is_refused_and_leaves_nothing() {
    // a router transformers does not implement, in a family that has a rule of its own
    let mut d = DecoderConfig::baby(Family::Mixtral, 41);
    (d.layers, d.d_model, d.head_dim, d.block) = (1, 16, 4, 8);
    for (router, ok) in [("moesart", false), ("switch", false), ("topk-noisy", true)] {
        let mut d = d.clone();
        d.moe.as_mut().unwrap().router = router.into();
        let model = LanguageModel::Decoder(Box::new(Decoder::new(&d, Device::cpu()).unwrap()));
        let dir = tmp(&format!("bad-{router}"));
        let r = export_hf(&model, None, None, HfLayout::Legacy, &dir);
        assert_eq!(r.is_ok(), ok, "{router}: {r:?}");
        if let Err(e) = r {
            let e = e.to_string();
            assert!(
                e.contains(&format!("--router {router}")) && e.contains("mixtral"),
                "{e}"
            );
            assert!(
                !dir.exists(),
                "{router}: a refused export left {}",
                dir.display()
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
    // a selection bias (aux-free, quantile) has no place in transformers' Mixtral gate; in
    // DeepSeek-V3's it is the e_score_correction_bias
    for (family, ok) in [(Family::Mixtral, false), (Family::DeepseekMoe, true)] {
        let mut d = DecoderConfig::baby(family, 41);
        (d.layers, d.d_model, d.head_dim, d.block) = (2, 32, 8, 8);
        d.moe.as_mut().unwrap().balancing.method = moegrad::moe::BalanceMethod::AuxFree;
        let model = LanguageModel::Decoder(Box::new(Decoder::new(&d, Device::cpu()).unwrap()));
        let dir = tmp(&format!("biased-{}", family.name()));
        let r = export_hf(&model, None, None, HfLayout::Legacy, &dir);
        assert_eq!(r.is_ok(), ok, "{}: {r:?}", family.name());
        if let Err(e) = r {
            let e = e.to_string();
            assert!(
                e.contains("--balance aux-free") && e.contains("selection bias"),
                "{e}"
            );
            assert!(!dir.exists());
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
    // an MoE GPT has no transformers class
    let mut cfg = moegrad::train::TrainConfig::language_model(moegrad::train::ModelKind::MoeGpt);
    (cfg.layers, cfg.d_model, cfg.block) = (1, 16, 8);
    let model = LanguageModel::build(&cfg, 30, Device::cpu()).unwrap();
    let e = export_hf(&model, None, None, HfLayout::Legacy, &tmp("moegpt"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("moe-gpt has no transformers class") && e.contains("--init-from"),
        "{e}"
    );
    // through the command line: a non-empty --out, an unknown format, a missing checkpoint
    let run = tmp("cli-run");
    moegrad::lm::import_run(&fixture("olmoe"), &run, None, false, Device::cpu()).unwrap();
    let ck = run.join("checkpoint.safetensors");
    let ck = ck.to_str().unwrap();
    let full = tmp("cli-full");
    std::fs::create_dir_all(&full).unwrap();
    std::fs::write(full.join("notes.txt"), "mine").unwrap();
    let full_s = full.to_str().unwrap();
    refused(
        &[
            "export",
            "--checkpoint",
            ck,
            "--format",
            "hf",
            "--out",
            full_s,
        ],
        &["not an empty directory"],
    );
    assert_eq!(
        std::fs::read_to_string(full.join("notes.txt")).unwrap(),
        "mine"
    );
    refused(
        &[
            "export",
            "--checkpoint",
            ck,
            "--format",
            "onnx",
            "--out",
            "x",
        ],
        &["onnx", "hf"],
    );
    refused(
        &[
            "export",
            "--checkpoint",
            "/nonexistent/c.safetensors",
            "--format",
            "hf",
            "--out",
            "x",
        ],
        &["/nonexistent/c.safetensors"],
    );
    refused(
        &[
            "export",
            "--checkpoint",
            ck,
            "--format",
            "hf",
            "--out",
            "/nonexistent/dir/out",
        ],
        &["/nonexistent/dir", "does not exist"],
    );
    for d in [run, full] {
        let _ = std::fs::remove_dir_all(d);
    }
}
