//! The Llama-style families as `moegrad train` runs them (`--model llama|mixtral|qwen2-moe|olmoe|
//! deepseek-moe`): each trains, learns, writes a checkpoint that `load_model` and `generate` read
//! back; every router of the crate trains in every MoE family (expert-choice refused for these
//! causal models, with its reason); the GPU's losses equal the CPU's to 1e-3 relative. Their
//! logits against transformers' are `tests/hf_parity.rs`.

#[path = "../../tests/common/mod.rs"]
mod common;

use moegrad::lm::{SampleOptions, generate, load_model, run};
use moegrad::train::{ModelKind, RunOptions, TrainConfig};
use moegrad::{Device, lm::Family};
use std::path::{Path, PathBuf};

const FAMILIES: [ModelKind; 5] = [
    ModelKind::Llama,
    ModelKind::Mixtral,
    ModelKind::Qwen2Moe,
    ModelKind::Olmoe,
    ModelKind::DeepseekMoe,
];

fn tmp(name: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("moegrad-fam-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    p
}

/// A small run of a family: 2 layers (DeepSeek's first dense), grouped-query attention (2 query
/// heads, 1 key/value head), 4 experts of 16, top-2, a shared expert where the family has one.
fn tiny(model: ModelKind, out: &Path) -> TrainConfig {
    let mut cfg = TrainConfig {
        out: out.to_path_buf(),
        device: "cpu".into(),
        layers: 2,
        heads: 2,
        kv_heads: 1,
        d_model: 32,
        block: 16,
        batch: 8,
        iters: 40,
        eval_every: 20,
        eval_windows: 16,
        warmup_steps: 5,
        log_every: 5,
        ..TrainConfig::language_model(model)
    };
    cfg.experts = 4;
    cfg.k = 2;
    cfg.expert_hidden = 16;
    if cfg.shared_experts > 0 {
        cfg.shared_hidden = 16;
    }
    if model == ModelKind::DeepseekMoe {
        // 4 experts in 2 groups, the best group's top-2
        cfg.router_options.insert("n_group".into(), "2".into());
        cfg.router_options.insert("topk_group".into(), "1".into());
    }
    cfg
}

#[test]
fn every_family_learns_and_samples_from_its_checkpoint() {
    for model in FAMILIES {
        let out = tmp(model.name());
        let cfg = tiny(model, &out);
        let s =
            run(&cfg, RunOptions::default()).unwrap_or_else(|e| panic!("{}: {e}", model.name()));
        let uniform = (s.vocab as f64).ln();
        assert!(
            s.val_loss < uniform - 0.3,
            "{}: validation loss {} not below ln(vocab) {uniform} − 0.3",
            model.name(),
            s.val_loss
        );
        let moe_layers = s.expert_load.as_ref().map_or(0, |l| l.len());
        let family = Family::from_name(model.name()).unwrap();
        let want = match family {
            Family::Llama => 0,
            Family::DeepseekMoe => 1, // its first layer stays dense
            _ => 2,
        };
        assert_eq!(moe_layers, want, "{}: MoE layers", model.name());
        let (lm, tokenizer) = load_model(&out.join("checkpoint.safetensors"), Device::cpu())
            .unwrap_or_else(|e| panic!("{}: {e}", model.name()));
        let opts = SampleOptions {
            tokens: 12,
            ..SampleOptions::default()
        };
        let text = generate(&lm, &tokenizer, "ROMEO:", &opts, Device::cpu(), |_| {}).unwrap();
        assert_eq!(text.chars().count(), 12, "{}: {text:?}", model.name());
        let _ = std::fs::remove_dir_all(&out);
    }
}

#[test]
fn every_router_trains_in_every_moe_family() {
    for model in FAMILIES.into_iter().filter(|m| m.is_moe()) {
        for name in moegrad::moe::ROUTER_NAMES {
            let out = tmp(&format!("{}-{name}", model.name()));
            let mut cfg = tiny(model, &out);
            cfg.router = name.to_string();
            cfg.router_options.clear();
            if *name == "deepseek-v3" {
                cfg.router_options.insert("n_group".into(), "2".into());
                cfg.router_options.insert("topk_group".into(), "1".into());
            }
            (cfg.iters, cfg.eval_every, cfg.eval_windows) = (4, 2, 4);
            let r = run(&cfg, RunOptions::default());
            let what = format!("{} with {name}", model.name());
            if *name == "expert-choice" {
                let err = r.err().map(|e| e.to_string()).unwrap_or_default();
                assert!(err.contains("later positions"), "{what}: {err}");
                continue;
            }
            let s = r.unwrap_or_else(|e| panic!("{what}: {e}"));
            assert!(s.val_loss.is_finite() && s.train_loss.is_finite(), "{what}");
            let _ = std::fs::remove_dir_all(&out);
        }
    }
}

#[test]
fn every_family_trains_on_the_gpu_as_on_the_cpu() {
    let Some(_) = common::gpu_or_skip("every_family_trains_on_the_gpu_as_on_the_cpu") else {
        return;
    };
    for model in FAMILIES {
        let mut results = Vec::new();
        for device in ["cpu", "gpu"] {
            let out = tmp(&format!("{}-{device}", model.name()));
            let mut cfg = tiny(model, &out);
            cfg.device = device.into();
            (cfg.iters, cfg.eval_every) = (20, 10);
            results.push(run(&cfg, RunOptions::default()).unwrap());
            let _ = std::fs::remove_dir_all(&out);
        }
        let (c, g) = (&results[0], &results[1]);
        for (what, a, b) in [
            ("train loss", c.train_loss, g.train_loss),
            ("val loss", c.val_loss, g.val_loss),
        ] {
            assert!(
                (a - b).abs() <= 1e-3 * a.abs(),
                "{}: {what}: cpu {a} vs gpu {b}",
                model.name()
            );
        }
    }
}

#[test]
fn shared_experts_work_in_moe_gpt_and_are_counted() {
    let out = tmp("moe-gpt-shared");
    let mut cfg = TrainConfig {
        out: out.clone(),
        device: "cpu".into(),
        layers: 1,
        heads: 2,
        d_model: 32,
        block: 16,
        batch: 8,
        iters: 4,
        eval_every: 2,
        eval_windows: 4,
        experts: 4,
        k: 2,
        expert_hidden: 16,
        ..TrainConfig::language_model(ModelKind::MoeGpt)
    };
    (cfg.shared_experts, cfg.shared_hidden, cfg.shared_gate) = (2, 8, true);
    let vocab = 65;
    let model = moegrad::lm::LanguageModel::build(&cfg, vocab, Device::cpu()).unwrap();
    use moegrad::nn::Parameters;
    let names: Vec<String> = model.named_params().into_iter().map(|(n, _)| n).collect();
    for part in [
        "moe.shared.up.weight",
        "moe.shared.down.weight",
        "moe.shared.gate.weight",
    ] {
        assert!(
            names.iter().any(|n| n.ends_with(part)),
            "{part} in {names:?}"
        );
    }
    assert_eq!(
        moegrad::lm::LanguageModel::parameter_count(&cfg, vocab),
        Some(model.num_params() as u64)
    );
    let s = run(&cfg, RunOptions::default()).unwrap();
    assert!(s.val_loss.is_finite());
    let _ = std::fs::remove_dir_all(&out);
}
