//! The character-level language models: the text corpus and its errors, the GPT (weight tying,
//! parameter count), training by iterations (learning happens, exact resume, every router on
//! `moe-gpt`, GPU = CPU), and `generate` (deterministic, refuses bad prompts).

#[path = "../../tests/common/mod.rs"]
mod common;

use moegrad::data::text::{CharCorpus, MAX_VOCAB};
use moegrad::lm::{Gpt, GptConfig, SampleOptions, generate};
use moegrad::lm::{gpt_config, load_model, run, run_observed};
use moegrad::nn::Parameters;
use moegrad::train::{DataKind, ModelKind, RunOptions, TrainConfig};
use moegrad::{DType, Device, Tensor};
use std::path::{Path, PathBuf};

fn tmp(name: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("moegrad-lm-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    p
}

/// A small language-model run on the bundled Shakespeare.
fn tiny(model: ModelKind, out: &Path) -> TrainConfig {
    TrainConfig {
        out: out.to_path_buf(),
        device: "cpu".into(),
        layers: 1,
        heads: 2,
        d_model: 32,
        block: 16,
        batch: 8,
        iters: 40,
        eval_every: 20,
        eval_windows: 32,
        warmup_steps: 5,
        experts: 4,
        k: 2,
        expert_hidden: 32,
        log_every: 5,
        ..TrainConfig::language_model(model)
    }
}

fn quiet() -> RunOptions {
    RunOptions::default()
}

#[test]
fn corpus_splits_encodes_and_batches() {
    let text = "abcabcabcabcabcabcabcabcabcabcabcabcabcabcabcabcabcabcabcabcabcabcabcabcabcabcabcabcabcab\
                cabcabcabcabcabcabca";
    let c = CharCorpus::from_text(text, 4, Path::new("t.txt")).unwrap();
    assert_eq!(c.vocab, vec!['a', 'b', 'c']);
    assert_eq!(c.train.len() + c.val.len(), text.chars().count());
    assert_eq!(c.train.len(), text.chars().count() * 9 / 10);
    assert_eq!(c.decode(&c.encode("cab").unwrap()), "cab");
    let (x, y) = c.train_batch(3, 4, 7, 11);
    assert_eq!((x.len(), y.len()), (12, 12));
    for r in 0..3 {
        // targets are the inputs shifted by one: in "abcabc…", each is the next letter
        for i in 0..4 {
            assert_eq!(y[r * 4 + i], (x[r * 4 + i] + 1) % 3);
        }
    }
    assert_eq!(
        c.train_batch(3, 4, 7, 11),
        (x, y),
        "a batch depends on (seed, step) only"
    );
    assert_ne!(c.train_batch(3, 4, 7, 12).0, c.train_batch(3, 4, 7, 11).0);
    assert_eq!(c.val_windows(5, 4, 3), c.val_windows(5, 4, 3));
    let err = c.encode("abd").unwrap_err().to_string();
    assert!(err.contains("'d'") && err.contains("position 2"), "{err}");
}

#[test]
fn bad_text_files_are_errors_naming_the_file() {
    let dir = tmp("bad-text");
    std::fs::create_dir_all(&dir).unwrap();
    let write = |name: &str, bytes: &[u8]| {
        let p = dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    };
    let cases: Vec<(PathBuf, &str)> = vec![
        (dir.join("missing.txt"), "missing.txt"),
        (write("empty.txt", b""), "empty"),
        (
            write("latin1.txt", b"caf\xe9 au lait, caf\xe9 au lait"),
            "not UTF-8",
        ),
        (write("short.txt", b"to be or not"), "--block"),
        (
            write(
                "wide.txt",
                (0..(MAX_VOCAB as u32 + 10))
                    .filter_map(|i| char::from_u32(0x4e00 + i))
                    .collect::<String>()
                    .repeat(2)
                    .as_bytes(),
            ),
            "distinct characters",
        ),
    ];
    for (path, word) in cases {
        let err = CharCorpus::load(&path, 8).unwrap_err().to_string();
        assert!(
            err.contains(path.file_name().unwrap().to_str().unwrap()) && err.contains(word),
            "{}: {err}",
            path.display()
        );
    }
    // a gzip text reads like the plain one
    let plain = "To be, or not to be, that is the question.\n".repeat(20);
    let gz = dir.join("q.txt.gz");
    {
        use std::io::Write;
        let mut e = flate2::write::GzEncoder::new(
            std::fs::File::create(&gz).unwrap(),
            flate2::Compression::default(),
        );
        e.write_all(plain.as_bytes()).unwrap();
        e.finish().unwrap();
    }
    let a = CharCorpus::load(&gz, 8).unwrap();
    let b = CharCorpus::load(&write("q.txt", plain.as_bytes()), 8).unwrap();
    assert_eq!((a.vocab, a.train, a.val), (b.vocab, b.train, b.val));
    // the bundled Shakespeare: 1,271,402 characters, 80 symbols
    let s = CharCorpus::load(
        &Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
            .join("data/shakespeare-10-plays.txt.gz"),
        64,
    )
    .unwrap();
    assert_eq!(s.train.len() + s.val.len(), 1_271_402);
    assert_eq!(s.vocab_size(), 80);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_tied_embedding_gets_both_gradients_and_the_parameter_count_is_known() {
    let mut cfg = GptConfig::baby(7);
    cfg.block = 5;
    cfg.layers = 1;
    cfg.d_model = 8;
    cfg.heads = 2;
    cfg.ffn = moegrad::lm::FeedForward::Dense { hidden: 16 };
    let model = Gpt::new(&cfg, Device::cpu()).unwrap();
    assert_eq!(cfg.parameter_count().unwrap() as usize, model.num_params());
    let names: Vec<String> = model.named_params().into_iter().map(|(n, _)| n).collect();
    assert!(
        !names
            .iter()
            .any(|n| n.contains("head") || n.contains("lm_")),
        "no separate output projection: {names:?}"
    );
    let emb = model
        .named_params()
        .into_iter()
        .find(|(n, _)| n == "tok_emb.weight")
        .unwrap()
        .1;
    let idx = Tensor::from_i32(vec![0, 3, 1, 2, 6, 2, 2, 5], &[2, 4], Device::cpu()).unwrap();
    let y = Tensor::from_i32(vec![3, 1, 2, 6, 2, 2, 5, 0], &[8], Device::cpu()).unwrap();
    let loss_at = |w: &Tensor| -> f64 {
        emb.set(w.clone()).unwrap();
        moegrad::no_grad(|| model.forward(&idx)?.logits.cross_entropy(&y))
            .unwrap()
            .item()
            .unwrap()
    };
    let w0 = emb.get().detach();
    emb.set(w0.clone()).unwrap();
    model
        .forward(&idx)
        .unwrap()
        .logits
        .cross_entropy(&y)
        .unwrap()
        .backward()
        .unwrap();
    let g = emb.get().grad().unwrap().to_vec_f64().unwrap();
    // row 4 is never an input: its gradient comes from the output projection alone, and a
    // row that is an input gets both parts; a central difference along a random direction
    // checks their sum
    assert!(
        g[4 * 8..5 * 8].iter().any(|v| *v != 0.0),
        "the output path reaches every row"
    );
    let dir: Vec<f64> = (0..56)
        .map(|i| ((i * 37 % 11) as f64 - 5.0) / 5.0)
        .collect();
    let w0v = w0.to_vec_f64().unwrap();
    let shifted = |s: f64| {
        let v: Vec<f32> = w0v
            .iter()
            .zip(&dir)
            .map(|(w, d)| (w + s * d) as f32)
            .collect();
        Tensor::from_f32(v, &[7, 8], Device::cpu()).unwrap()
    };
    // the loss is strongly curved at weights of 0.02: a small step, in f32
    let eps = 1e-3;
    let numeric = (loss_at(&shifted(eps)) - loss_at(&shifted(-eps))) / (2.0 * eps);
    let analytic: f64 = g.iter().zip(&dir).map(|(a, b)| a * b).sum();
    assert!(
        (numeric - analytic).abs() <= 1e-3 + 0.1 * numeric.abs(),
        "directional derivative: analytic {analytic} vs numeric {numeric}"
    );
    // and it is the sum of the two paths: the embedding path alone is not it
    emb.set(w0.clone()).unwrap();
    emb.get().zero_grad();
    let rows = emb
        .get()
        .index_select(0, &idx.reshape(&[8]).unwrap())
        .unwrap();
    rows.sum_all().unwrap().backward().unwrap();
    assert!(
        emb.get().grad().unwrap().to_vec_f64().unwrap()[4 * 8..5 * 8]
            .iter()
            .all(|v| *v == 0.0)
    );
}

#[test]
fn one_weight_used_as_embedding_and_output_projection_passes_gradcheck() {
    // the tying pattern in f64: logits = g(W[idx])·Wᵀ, both uses of W on the tape
    let w = common::f64t(
        &(0..20)
            .map(|i| ((i * 7 % 13) as f64 - 6.0) / 6.0)
            .collect::<Vec<_>>(),
        &[5, 4],
    );
    let idx = Tensor::from_i32(vec![0, 3, 3, 1], &[4], Device::cpu()).unwrap();
    let y = Tensor::from_i32(vec![3, 1, 4, 0], &[4], Device::cpu()).unwrap();
    let report = moegrad::gradcheck::gradcheck(
        |t| {
            let h = t[0].index_select(0, &idx)?.tanh()?;
            h.matmul(&t[0].transpose(0, 1)?)?.cross_entropy(&y)
        },
        &[w],
        &Default::default(),
    )
    .unwrap();
    assert!(report.compared > 0);
}

#[test]
fn a_few_hundred_steps_lower_the_validation_loss() {
    let out = tmp("learn");
    let mut cfg = tiny(ModelKind::Gpt, &out);
    cfg.iters = 300;
    cfg.eval_every = 150;
    let s = run_observed(
        &cfg,
        quiet(),
        &mut moegrad_cli::progress::CliObserver::new(),
    )
    .unwrap();
    let chance = (80f64).ln();
    assert!(
        s.val_loss < chance - 1.0,
        "val loss {} (uniform: {chance})",
        s.val_loss
    );
    let lines = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let vals: Vec<f64> = lines
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["val_loss"]
                .as_f64()
                .unwrap()
        })
        .collect();
    assert_eq!(vals.len(), 2);
    assert!(vals[1] < vals[0], "validation loss fell: {vals:?}");
    assert!(out.join("curves.svg").exists());
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn resumed_language_model_runs_continue_bit_for_bit() {
    for model in [ModelKind::Gpt, ModelKind::MoeGpt] {
        let (a, b) = (tmp("straight"), tmp("resumed"));
        let mut cfg = tiny(model, &a);
        if model == ModelKind::MoeGpt {
            cfg.router = "reinforce".into(); // noise counter and running baseline
        }
        let straight = run(&cfg, quiet()).unwrap();
        let mut first = cfg.clone();
        first.out = b.clone();
        first.iters = 20;
        first.schedule_epochs = 2;
        let mut second = first.clone();
        second.iters = 40;
        run(&first, quiet()).unwrap();
        let resumed = run(
            &second,
            RunOptions {
                resume: true,
                ..quiet()
            },
        )
        .unwrap();
        // the straight run's cosine spans its 2 intervals, as --schedule-epochs 2 fixes it
        let mut fixed = cfg.clone();
        fixed.out = tmp("fixed");
        fixed.schedule_epochs = 2;
        let fixed_run = run(&fixed, quiet()).unwrap();
        assert_eq!(fixed_run.val_loss, straight.val_loss);
        assert_eq!(
            (resumed.val_loss, resumed.train_loss, resumed.iters),
            (straight.val_loss, straight.train_loss, straight.iters),
            "{}",
            model.name()
        );
        for d in [a, b, fixed.out] {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

/// Trains `cfg` (40 iterations) straight, then the same run in `split` as 20 iterations and a
/// `--resume` to 40; asserts the validation loss fell between 20 and 40 iterations and that the
/// resumed run ends bit for bit where the straight one did. Returns the straight run's summary.
fn learns_and_resumes(cfg: &TrainConfig, split: &Path, what: &str) -> moegrad::lm::LmSummary {
    let mut cfg = cfg.clone();
    cfg.schedule_epochs = 2;
    let straight = run(&cfg, quiet()).unwrap();
    let mut first = cfg.clone();
    first.out = split.to_path_buf();
    first.iters = 20;
    let half = run(&first, quiet()).unwrap();
    assert!(
        straight.val_loss < half.val_loss,
        "{what}: the loss did not fall"
    );
    let resumed = run(
        &TrainConfig { iters: 40, ..first },
        RunOptions {
            resume: true,
            ..quiet()
        },
    )
    .unwrap();
    assert_eq!(
        (resumed.val_loss, resumed.train_loss),
        (straight.val_loss, straight.train_loss),
        "{what}"
    );
    straight
}

/// Each balancer on a language model: the sequence-wise loss, aux-free and quantile train
/// `moe-gpt` (the validation loss falls) and resume bit for bit; `mixtral` takes aux-free too.
#[test]
fn language_models_train_and_resume_with_every_balancer() {
    use moegrad::moe::{BalanceMethod, BalanceScope, Balancing};
    let cases = [
        (
            ModelKind::MoeGpt,
            BalanceMethod::Aux,
            BalanceScope::Sequence,
        ),
        (
            ModelKind::MoeGpt,
            BalanceMethod::AuxFree,
            BalanceScope::Batch,
        ),
        (
            ModelKind::MoeGpt,
            BalanceMethod::Quantile,
            BalanceScope::Batch,
        ),
        (
            ModelKind::Mixtral,
            BalanceMethod::AuxFree,
            BalanceScope::Batch,
        ),
    ];
    for (model, method, scope) in cases {
        let what = format!("{} {method:?} {scope:?}", model.name());
        let (a, b) = (tmp("bal-straight"), tmp("bal-resumed"));
        let mut cfg = tiny(model, &a);
        cfg.experts = 4;
        cfg.k = 2;
        cfg.balancing = Balancing {
            method,
            scope,
            rate: 0.01,
            ..Balancing::default()
        };
        let straight = learns_and_resumes(&cfg, &b, &what);
        assert!(straight.val_loss.is_finite(), "{what}");
        for d in [a, b] {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

/// `--null-experts`: `mixtral` and `moe-gpt` with two null experts train, resume bit for bit,
/// route fewer than k real experts per token (the diagnostics and the summary say how many), and
/// refuse to export to transformers, which has no null experts.
#[test]
fn null_experts_train_resume_and_are_counted() {
    for model in [ModelKind::Mixtral, ModelKind::MoeGpt] {
        let what = model.name();
        let (a, b) = (tmp("null-straight"), tmp("null-resumed"));
        let mut cfg = tiny(model, &a);
        cfg.null_experts = 2;
        let straight = learns_and_resumes(&cfg, &b, what);
        let routing = straight.routing.as_ref().expect("routing diagnostics");
        let per_token = routing.experts_per_token.median;
        assert!(
            per_token > 0.0 && per_token < 2.0,
            "{what}: {per_token} real experts per token with 2 null experts at k = 2"
        );
        assert_eq!(
            routing.layers[0].load.len(),
            4,
            "{what}: diagnostics over the real experts"
        );
        if model == ModelKind::Mixtral {
            let err = moegrad::lm::export_checkpoint(
                &a.join("checkpoint.safetensors"),
                &tmp("null-hf"),
                moegrad::lm::HfLayout::Legacy,
            )
            .unwrap_err()
            .to_string();
            assert!(err.contains("--null-experts"), "{err}");
        }
        for d in [a, b] {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

/// The routing diagnostics are read at `--log-every` with the loss: each step message of an MoE
/// run ends with their short form, a dense run's does not.
#[test]
fn step_messages_carry_the_routing_at_log_every() {
    struct Messages(Vec<String>);
    impl moegrad::train::TrainObserver for Messages {
        fn step(&mut self, loss: Option<&str>) {
            self.0.extend(loss.map(str::to_string));
        }
    }
    for (model, routed) in [(ModelKind::MoeGpt, true), (ModelKind::Gpt, false)] {
        let out = tmp(&format!("log-every-{}", model.name()));
        let mut cfg = tiny(model, &out);
        cfg.iters = 20;
        cfg.eval_every = 20;
        let mut seen = Messages(Vec::new());
        run_observed(&cfg, quiet(), &mut seen).unwrap();
        // one message every --log-every 5 steps
        assert_eq!(seen.0.len(), 4, "{:?}", seen.0);
        for m in &seen.0 {
            assert_eq!(
                m.contains("load/ideal") && m.contains("dead "),
                routed,
                "{m}"
            );
        }
        let _ = std::fs::remove_dir_all(&out);
    }
}

/// How far below `ln(vocab)` (the loss of a uniform guess, about the untrained model's: its first
/// interval's training loss is a little above it) every router's validation loss must be after
/// [`ROUTER_RUN_ITERS`] iterations. Measured with the seed of `tiny`: 0.17 nats (reinforce) to
/// 0.22 (sparsemixer-v2) below it, so 0.1 is well inside every router's margin.
const ROUTER_RUN_LOSS_DROP: f64 = 0.1;
/// Iterations of each router's run: two evaluation intervals of 6.
const ROUTER_RUN_ITERS: usize = 12;
/// How far (largest element) the router's parameters must move from their initial values.
/// Measured: 0.0054 (reinforce) to 0.0074 (threshold), about Adam's step summed over the
/// iterations, whatever the gradient's size; with the router's gradient cut they stay as they
/// were, and AdamW's decay alone would move them by at most a few 1e-4.
const ROUTER_RUN_MIN_MOVE: f64 = 1e-3;
/// How much the validation loss must fall from the first evaluation to the second (measured:
/// 0.10 nats for reinforce to 0.12 for topk-unnorm).
const ROUTER_RUN_INTERVAL_FALL: f64 = 0.05;

#[test]
fn every_token_choice_router_trains_moe_gpt_and_expert_choice_is_refused() {
    for name in moegrad::moe::ROUTER_NAMES {
        let out = tmp(&format!("router-{name}"));
        let mut cfg = tiny(ModelKind::MoeGpt, &out);
        cfg.router = name.to_string();
        cfg.iters = ROUTER_RUN_ITERS;
        cfg.eval_every = ROUTER_RUN_ITERS / 2;
        cfg.eval_windows = 8;
        if name.starts_with("dselect") {
            cfg.k = 2;
        }
        if *name == "deepseek-v3" {
            // group-limited routing: 4 experts in 2 groups, top-2 within the best group
            for (key, value) in [("n_group", "2"), ("topk_group", "1")] {
                cfg.router_options.insert(key.into(), value.into());
            }
        }
        let r = run(&cfg, quiet());
        if *name == "expert-choice" {
            let err = r.err().unwrap().to_string();
            assert!(
                err.contains("expert-choice") && err.contains("later positions"),
                "{err}"
            );
            continue;
        }
        let s = r.unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(s.val_loss.is_finite() && s.train_loss.is_finite(), "{name}");
        assert_eq!(s.expert_load.as_ref().map(|l| l.len()), Some(1), "{name}");
        // learning happened with this router: below a uniform guess by a margin, and falling
        let uniform = (s.vocab as f64).ln();
        assert!(
            s.val_loss < uniform - ROUTER_RUN_LOSS_DROP,
            "{name}: validation loss {} not {ROUTER_RUN_LOSS_DROP} below ln(vocab) = {uniform}",
            s.val_loss
        );
        let lines = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
        let vals: Vec<f64> = lines
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["val_loss"]
                    .as_f64()
                    .unwrap()
            })
            .collect();
        assert_eq!(vals.len(), 2, "{name}");
        assert!(
            vals[1] < vals[0] - ROUTER_RUN_INTERVAL_FALL,
            "{name}: validation loss did not fall by {ROUTER_RUN_INTERVAL_FALL}: {vals:?}"
        );
        // and the router itself learnt: its parameters moved from their initial values (a
        // router whose gradient never arrives would leave them as initialised); hash routing
        // has none (read from the checkpoint's tensors: `load_model` refuses xmoe-cosine's checkpoint,
        // whose router has fewer parameters than the linear gate `parameter_count` assumes)
        let checkpoint = moegrad::checkpoint::Checkpoint::load(
            &out.join("checkpoint.safetensors"),
            Device::cpu(),
        )
        .unwrap();
        let initial = Gpt::new(&gpt_config(&cfg, s.vocab), Device::cpu()).unwrap();
        let before: Vec<(String, Vec<f64>)> = initial
            .named_params()
            .into_iter()
            .filter(|(n, _)| n.contains(".router."))
            .map(|(n, p)| (n, p.get().to_vec_f64().unwrap()))
            .collect();
        let after: Vec<Vec<f64>> = before
            .iter()
            .map(|(n, _)| {
                let t = checkpoint.tensors.get(n);
                t.unwrap_or_else(|| panic!("{name}: {n} is not in the checkpoint"))
                    .to_vec_f64()
                    .unwrap()
            })
            .collect();
        if *name == "hash" {
            assert!(before.is_empty(), "{name}: {before:?}");
        } else {
            let moved = before
                .iter()
                .zip(&after)
                .map(|((_, b), a)| {
                    b.iter()
                        .zip(a)
                        .map(|(x, y)| (x - y).abs())
                        .fold(0.0, f64::max)
                })
                .fold(0.0, f64::max);
            assert!(
                moved > ROUTER_RUN_MIN_MOVE,
                "{name}: the router's parameters never moved: {:?}",
                before.iter().map(|(n, _)| n).collect::<Vec<_>>()
            );
        }
        let _ = std::fs::remove_dir_all(&out);
    }
}

#[test]
fn moe_gpt_counts_active_parameters_by_k() {
    let cfg = tiny(ModelKind::MoeGpt, &tmp("count"));
    let model = Gpt::new(&gpt_config(&cfg, 80), Device::cpu()).unwrap();
    let all = model.num_params();
    let experts: usize = model
        .named_params()
        .iter()
        .filter(|(n, _)| n.contains(".moe.experts."))
        .map(|(_, p)| p.get().numel())
        .sum();
    assert_eq!(
        model.active_params_per_token(),
        all - experts + experts * 2 / 4
    );
    // a measured count (threshold routing, drops) scales the experts' share: 1 of 4 here
    assert_eq!(model.active_params_at(1.0), all - experts + experts / 4);
    assert_eq!(model.active_params_at(0.0), all - experts);
}

#[test]
fn generate_is_deterministic_and_refuses_bad_prompts() {
    let out = tmp("generate");
    let mut cfg = tiny(ModelKind::Gpt, &out);
    cfg.iters = 20;
    run(&cfg, quiet()).unwrap();
    let (model, vocab) = load_model(&out.join("checkpoint.safetensors"), Device::cpu()).unwrap();
    assert_eq!(vocab.vocab_size(), 80);
    assert_eq!(vocab.char_vocab().map(<[char]>::len), Some(80));
    let opts = SampleOptions {
        tokens: 40,
        ..SampleOptions::default()
    };
    let mut streamed = String::new();
    let a = generate(&model, &vocab, "ROMEO:", &opts, Device::cpu(), |c| {
        streamed.push_str(c)
    })
    .unwrap();
    let b = generate(&model, &vocab, "ROMEO:", &opts, Device::cpu(), |_| {}).unwrap();
    assert_eq!(a, b, "same seed, same text");
    assert_eq!(a, streamed);
    assert_eq!(a.chars().count(), 40);
    let other = SampleOptions {
        seed: 2,
        ..opts.clone()
    };
    assert_ne!(
        a,
        generate(&model, &vocab, "ROMEO:", &other, Device::cpu(), |_| {}).unwrap()
    );
    let err = generate(&model, &vocab, "ROMEO€", &opts, Device::cpu(), |_| {})
        .unwrap_err()
        .to_string();
    assert!(err.contains('€') && err.contains("vocabulary"), "{err}");
    assert!(generate(&model, &vocab, "", &opts, Device::cpu(), |_| {}).is_err());
    let hot = SampleOptions {
        temperature: 0.0,
        ..opts
    };
    assert!(generate(&model, &vocab, "A", &hot, Device::cpu(), |_| {}).is_err());
    // the command line: same text twice, a bad prompt refused before anything is printed
    let cli = |prompt: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_moegrad"))
            .args(["generate", "--checkpoint"])
            .arg(out.join("checkpoint.safetensors"))
            .args(["--prompt", prompt, "--tokens", "30", "--device", "cpu"])
            .output()
            .unwrap()
    };
    let (x, y) = (cli("KING:"), cli("KING:"));
    assert!(x.status.success(), "{}", String::from_utf8_lossy(&x.stderr));
    assert_eq!(x.stdout, y.stdout);
    let bad = cli("KING€");
    assert_eq!(bad.status.code(), Some(1));
    assert!(bad.stdout.is_empty());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("vocabulary"));
    // a checkpoint of an image model is not a language model
    assert!(load_model(Path::new("Cargo.toml"), Device::cpu()).is_err());
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn bad_language_model_settings_are_errors() {
    let out = tmp("settings");
    let check = |f: &dyn Fn(&mut TrainConfig), word: &str| {
        let mut cfg = tiny(ModelKind::MoeGpt, &out);
        f(&mut cfg);
        let err = run(&cfg, quiet()).err().unwrap().to_string();
        assert!(err.contains(word), "{word}: {err}");
    };
    check(&|c| c.iters = 30, "--eval-every");
    check(&|c| c.heads = 3, "--heads");
    check(&|c| c.moe_every = 5, "--moe-every");
    check(&|c| c.data = DataKind::Mnist, "language model");
    check(&|c| c.data = DataKind::Text, "--data-file");
    check(&|c| c.block = 0, "--block");
    check(&|c| c.experts = 100_000_000, "--experts");
    check(
        &|c| c.optimizer = moegrad::train::OptimizerKind::Sgd,
        "adamw",
    );
    assert!(!out.exists(), "bad settings leave --out alone");
    // the image trainer refuses a language model, and the other way round
    let err = moegrad::train::run(&tiny(ModelKind::Gpt, &out), quiet())
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("lm::run"), "{err}");
}

#[test]
fn gpu_moe_gpt_matches_the_cpu() {
    let Some(_) = common::gpu_or_skip("gpu_moe_gpt_matches_the_cpu") else {
        return;
    };
    let mut results = Vec::new();
    for device in ["cpu", "gpu"] {
        let out = tmp(&format!("parity-{device}"));
        let mut cfg = tiny(ModelKind::MoeGpt, &out);
        cfg.device = device.into();
        cfg.iters = 20;
        cfg.eval_every = 10;
        results.push(run(&cfg, quiet()).unwrap());
        let _ = std::fs::remove_dir_all(&out);
    }
    let (c, g) = (&results[0], &results[1]);
    for (what, a, b) in [
        ("train loss", c.train_loss, g.train_loss),
        ("val loss", c.val_loss, g.val_loss),
    ] {
        assert!(
            (a - b).abs() <= 1e-3 * a.abs(),
            "{what}: cpu {a} vs gpu {b}"
        );
    }
    let _ = DType::F32;
}

#[test]
fn per_row_cross_entropy_is_checked_and_averages_to_the_mean_loss() {
    let logits = common::f64t(
        &(0..12)
            .map(|i| ((i * 5 % 7) as f64 - 3.0) / 2.0)
            .collect::<Vec<_>>(),
        &[4, 3],
    );
    let y = Tensor::from_i32(vec![2, 0, 1, 2], &[4], Device::cpu()).unwrap();
    moegrad::gradcheck::gradcheck(
        |t| t[0].cross_entropy_per_row(&y),
        std::slice::from_ref(&logits),
        &Default::default(),
    )
    .unwrap();
    let rows = logits
        .cross_entropy_per_row(&y)
        .unwrap()
        .to_vec_f64()
        .unwrap();
    let mean = logits.cross_entropy(&y).unwrap().item().unwrap();
    assert!((rows.iter().sum::<f64>() / 4.0 - mean).abs() < 1e-12);
    let bad = Tensor::from_i32(vec![0, 1], &[2], Device::cpu()).unwrap();
    assert!(logits.cross_entropy_per_row(&bad).is_err());
    if let Some(gpu) = common::gpu_or_skip("per_row_cross_entropy_gpu") {
        let g = logits
            .to_dtype(DType::F32)
            .unwrap()
            .to_device(gpu)
            .unwrap()
            .cross_entropy_per_row(&y.to_device(gpu).unwrap())
            .unwrap()
            .to_vec_f64()
            .unwrap();
        common::assert_close("gpu per-row cross-entropy", &g, &rows, 1e-5, 1e-5);
    }
}

/// A language model's periods are evaluation intervals: `--resume`'s refusals name them so
/// (and `--iters`), never epochs, which a language-model run does not have (but for the name of
/// the flag `--schedule-epochs`, which both kinds of run take).
#[test]
fn language_model_resume_messages_speak_of_intervals_not_epochs() {
    let out = tmp("resume-words");
    let mut cfg = tiny(ModelKind::Gpt, &out);
    cfg.iters = 20;
    cfg.eval_every = 10;
    run(&cfg, quiet()).unwrap();
    let resume = RunOptions {
        resume: true,
        ..quiet()
    };
    // nothing left to train
    let done = run(&cfg, resume.clone()).unwrap_err().to_string();
    assert!(
        done.contains("already trained 2 evaluation intervals (20 iterations)")
            && done.contains("--iters 20"),
        "{done}"
    );
    // a setting that belongs to the run changed
    let mut other = cfg.clone();
    other.iters = 30;
    other.batch = 4;
    let changed = run(&other, resume).unwrap_err().to_string();
    assert!(changed.contains("--batch"), "{changed}");
    for msg in [&done, &changed] {
        // (the one flag shared with the image runs keeps its name: --schedule-epochs)
        let words = msg.replace("--schedule-epochs", "");
        assert!(
            !words.to_lowercase().contains("epoch"),
            "a language model's resume message speaks of epochs: {msg}"
        );
    }
    let _ = std::fs::remove_dir_all(&out);
}
