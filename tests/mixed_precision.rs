//! `--precision f16-mixed` (see `src/autocast.rs` and `src/optim/loss_scale.rs`): training with
//! f16 activations and f32 master weights on the GPU against the same training in f32.
//!
//! * a 50-step `moe-gpt` run (smaller than the baby size, so lavapipe runs it in seconds) in
//!   f16-mixed follows f32's losses within 1e-2 relative at every step, with no step skipped;
//! * the activations really are f16 (a block's products take f16 activations and read the f32
//!   weights where they are, the weights' gradients written in f32) while the router's logits
//!   (read from the f16 tokens into f32) and the loss stay f32; every language model casts only
//!   its embedding, once each way;
//! * the loss scale: a gradient that overflows skips the step on the device (parameters and
//!   moments unchanged, the scale halved, the skip counted, and Adam's next step the first
//!   step's update: its bias corrections leave the skipped step out), and good steps grow
//!   the scale; the backward starts from the scale itself (no product `loss · s`), and a
//!   parameter whose gradient is that seed keeps a copy of its own when the scale is rewritten.
//!
//! Skipped with a printed reason without an adapter (unless `MOEGRAD_REQUIRE_GPU=1`) or
//! without `shader-f16`, where f16-mixed must be refused with an error saying so.

mod common;

use moegrad::data::text::CharCorpus;
use moegrad::nn::Parameters;
use moegrad::train::{ModelKind, TrainConfig};
use moegrad::{Device, Tensor};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The GPU when it has `shader-f16`, else `None` (skipped with a printed reason).
fn f16_gpu(test: &str) -> Option<Device> {
    let dev = common::gpu_or_skip(test)?;
    let features = moegrad::gpu::info().expect("adapter info").features;
    if features.iter().any(|f| f == "shader-f16") {
        return Some(dev);
    }
    eprintln!("skipping {test}: this adapter has no shader-f16");
    None
}

/// A small `moe-gpt`: 2 layers, d = 64, 4 experts of width 128, top-2, context 32, batch 8.
fn small_moe_gpt() -> TrainConfig {
    TrainConfig {
        layers: 2,
        heads: 4,
        d_model: 64,
        block: 32,
        batch: 8,
        experts: 4,
        k: 2,
        expert_hidden: 128,
        warmup_steps: 5,
        iters: 50,
        device: "gpu".into(),
        ..TrainConfig::language_model(ModelKind::MoeGpt)
    }
}

fn corpus(cfg: &TrainConfig) -> CharCorpus {
    let path = moegrad::data::bundled::dir().join("shakespeare-10-plays.txt.gz");
    CharCorpus::load(&path, cfg.block).expect("the bundled Shakespeare text")
}

/// The training losses of `steps` steps of `cfg` on the GPU, in f32 or in f16-mixed; with the
/// loss scale's skipped steps.
fn losses(cfg: &TrainConfig, mixed: bool, steps: u64) -> (Vec<f32>, u64) {
    let corpus = corpus(cfg);
    let model = moegrad::lm::LanguageModel::build(cfg, corpus.vocab_size(), Device::Gpu).unwrap();
    let params = model.named_params();
    let mut opt = moegrad::lm::make_optimizer(cfg, &model).unwrap();
    let scale = mixed.then(|| moegrad::optim::LossScale::new(Device::Gpu).unwrap());
    let mut out = Vec::new();
    for step in 0..steps {
        let (b, t) = (cfg.batch, cfg.block);
        let (x, y) = corpus.train_batch(b, t, cfg.seed, step);
        let x = Tensor::from_i32(x, &[b, t], Device::Gpu).unwrap();
        let y = Tensor::from_i32(y, &[b * t], Device::Gpu).unwrap();
        let o = match &scale {
            Some(s) => moegrad::train::train_step_mixed(
                &model,
                &params,
                &mut opt,
                &x,
                &[y],
                cfg.clip_grad_norm,
                s,
            ),
            None => {
                moegrad::train::train_step(&model, &params, &mut opt, &x, &[y], cfg.clip_grad_norm)
            }
        }
        .unwrap();
        out.push(o.task_loss.item().unwrap() as f32);
    }
    let skipped = scale.map(|s| s.skipped_steps().unwrap()).unwrap_or(0);
    (out, skipped)
}

#[test]
fn fifty_moe_gpt_steps_in_f16_mixed_follow_f32() {
    let Some(_) = f16_gpu("fifty_moe_gpt_steps_in_f16_mixed_follow_f32") else {
        return;
    };
    let cfg = small_moe_gpt();
    let (f32_losses, _) = losses(&cfg, false, 50);
    let (mixed, skipped) = losses(&cfg, true, 50);
    eprintln!("f32   {f32_losses:?}\nmixed {mixed:?}");
    assert_eq!(skipped, 0, "no step should overflow at this size");
    for (i, (a, b)) in f32_losses.iter().zip(&mixed).enumerate() {
        let rel = (a - b).abs() / a.abs();
        assert!(
            rel <= 1e-2,
            "step {i}: f32 loss {a}, f16-mixed {b} (relative {rel})"
        );
    }
    assert!(
        mixed[49] < mixed[0] - 0.5,
        "the mixed run learned: {mixed:?}"
    );
}

/// The kernels one training step of `cfg` runs (`shader.entry` names, from the profile).
fn step_kernels(cfg: &TrainConfig, mixed: bool) -> Vec<String> {
    step_kernel_calls(cfg, mixed)
        .into_iter()
        .map(|(k, _)| k)
        .collect()
}

/// The kernels one training step of `cfg` runs, each with its number of calls.
fn step_kernel_calls(cfg: &TrainConfig, mixed: bool) -> Vec<(String, u64)> {
    let corpus = corpus(cfg);
    let model = moegrad::lm::LanguageModel::build(cfg, corpus.vocab_size(), Device::Gpu).unwrap();
    let params = model.named_params();
    let mut opt = moegrad::lm::make_optimizer(cfg, &model).unwrap();
    let scale = moegrad::optim::LossScale::new(Device::Gpu).unwrap();
    let (b, t) = (cfg.batch, cfg.block);
    let (x, y) = corpus.train_batch(b, t, cfg.seed, 0);
    let x = Tensor::from_i32(x, &[b, t], Device::Gpu).unwrap();
    let y = Tensor::from_i32(y, &[b * t], Device::Gpu).unwrap();
    let recording = moegrad::profile::start();
    {
        let _step = moegrad::profile::step();
        let clip = cfg.clip_grad_norm;
        if mixed {
            moegrad::train::train_step_mixed(&model, &params, &mut opt, &x, &[y], clip, &scale)
        } else {
            moegrad::train::train_step(&model, &params, &mut opt, &x, &[y], clip)
        }
        .unwrap();
    }
    let report = recording.finish().expect("a profile");
    report
        .gpu
        .expect("the GPU's kernels")
        .kernels
        .into_iter()
        .map(|k| (k.kernel, k.calls))
        .collect()
}

/// The seven language models at a size lavapipe steps quickly (2 layers of width 64, windows
/// of 16, batches of 2), each with its config.
fn small_language_models() -> impl Iterator<Item = (ModelKind, TrainConfig)> {
    [
        ModelKind::Gpt,
        ModelKind::MoeGpt,
        ModelKind::Llama,
        ModelKind::Mixtral,
        ModelKind::Qwen2Moe,
        ModelKind::Olmoe,
        ModelKind::DeepseekMoe,
    ]
    .into_iter()
    .map(|kind| {
        let cfg = TrainConfig {
            layers: 2,
            d_model: 64,
            block: 16,
            batch: 2,
            device: "gpu".into(),
            ..TrainConfig::language_model(kind)
        };
        (kind, cfg)
    })
}

/// In every language model's f16-mixed step the casts are the embedding's, once each way:
/// its f32 output cast to f16 once for the first block's norm and residual add, and their
/// summed gradient cast back once. The products read f32 weights where they are, the norms f32
/// gains, the rotary embedding its f32 tables and the router the f16 tokens, and an f16
/// gradient summed over a broadcast axis (Qwen2-MoE's shared-expert gate, DeepSeek's rotary key
/// shared by the heads) is rounded to f16 by the reduction kernel itself, so nothing else is
/// cast: not the rotary tables (cos and sin for the queries and the keys, four casts per
/// attention layer, until they were read in f32), not the embedding a second time for the
/// first residual add, not those sums (one cast per layer until the kernel stored f16).
#[test]
fn every_language_model_casts_its_embedding_once_in_f16_mixed() {
    let Some(_) = f16_gpu("every_language_model_casts_its_embedding_once_in_f16_mixed") else {
        return;
    };
    for (kind, cfg) in small_language_models() {
        let kernels = step_kernel_calls(&cfg, true);
        let calls = |name: &str| {
            kernels
                .iter()
                .filter(|(k, _)| k == name)
                .map(|&(_, n)| n)
                .sum::<u64>()
        };
        assert_eq!(
            (calls("half.f32_to_f16"), calls("half.f16_to_f32")),
            (1, 1),
            "{}: the casts of an f16-mixed step: {kernels:?}",
            kind.name()
        );
    }
}

#[test]
fn f16_mixed_runs_the_block_in_f16_and_the_router_and_loss_in_f32() {
    let Some(_) = f16_gpu("f16_mixed_runs_the_block_in_f16_and_the_router_and_loss_in_f32") else {
        return;
    };
    let cfg = small_moe_gpt();
    let mixed = step_kernels(&cfg, true);
    let has = |name: &str| mixed.iter().any(|k| k.starts_with(name));
    // the products read their f32 weights where they are and write the weights' gradients in
    // f32 (the f16-rows and f16-to-f32 builds): no f16 copy of a weight, no cast of a gradient
    for f16_kernel in [
        "matmul_f16_rows.matmul",
        "matmul_f16_to_f32.matmul",
        "matmul_f16_rows.grouped_matmul",
        "matmul_f16_to_f32.grouped_weight_grad",
        "attention_f16.attention_forward",
        "attention_f16.attention_backward_q",
        "layer_norm_f16",
        "elementwise_f16",
        // the routed rows' gather's backward, and the combine, summed per token in f16
        "layout_f16.weighted_gather_slots",
        "cross_entropy_f16.cross_entropy_forward",
        "cross_entropy_f16.cross_entropy_backward",
    ] {
        assert!(
            has(f16_kernel),
            "no {f16_kernel} in the mixed step: {mixed:?}"
        );
    }
    // the router (its product, softmax and top-k) and the optimizer in f32 (the loss reads f16
    // logits, and computes and returns it in f32); the router's product reads the f16 tokens
    // into f32 logits, and stores the tokens' gradient in f16 (no cast either way)
    for f32_kernel in [
        "matmul_f16_elements.matmul",
        "matmul_f16_output.matmul",
        "routing.topk_gate",
        "optim.adam_multi",
        "optim.loss_scale_factor",
    ] {
        assert!(
            has(f32_kernel),
            "no {f32_kernel} in the mixed step: {mixed:?}"
        );
    }
    let plain = step_kernels(&cfg, false);
    assert!(
        !plain
            .iter()
            .any(|k| k.contains("_f16") || k.starts_with("half.")),
        "an f16 kernel in the f32 step: {plain:?}"
    );
}

/// `params` as named parameters (the optimizer's and the loss scale's input).
fn named(params: &[&moegrad::nn::Param]) -> Vec<(String, moegrad::nn::Param)> {
    params
        .iter()
        .enumerate()
        .map(|(i, p)| (format!("p{i}"), (*p).clone()))
        .collect()
}

/// One step of `opt` on `loss(p)` through the loss scale (scale the loss, backward, unscale,
/// update with the factor); returns the factor.
fn scaled_step(
    scale: &moegrad::optim::LossScale,
    params: &[(String, moegrad::nn::Param)],
    opt: &mut dyn moegrad::optim::Optimizer,
    loss: &Tensor,
) -> f32 {
    scale.backward(loss).unwrap();
    let (_, factor) = scale.unscale(params, 0.0).unwrap().expect("gradients");
    opt.step(params, Some(&factor)).unwrap();
    factor.to_vec_f32().unwrap()[0]
}

#[test]
fn an_overflowing_gradient_skips_the_step_on_the_device() {
    use moegrad::optim::{Adam, LossScale, Optimizer, Sgd};
    let Some(gpu) = common::gpu_or_skip("an_overflowing_gradient_skips_the_step_on_the_device")
    else {
        return;
    };
    let start = vec![1.0f32, -2.0, 0.5];
    for momentum in [false, true] {
        // Adam, and SGD with and without momentum: every update kernel honours the skip
        let p =
            moegrad::nn::Param::new(Tensor::from_f32(start.clone(), &[3], gpu).unwrap()).unwrap();
        let q =
            moegrad::nn::Param::new(Tensor::from_f32(start.clone(), &[3], gpu).unwrap()).unwrap();
        let params = named(&[&p, &q]);
        let mut adam = Adam::new(0.1).unwrap();
        let mut sgd = if momentum {
            Sgd::with_momentum(0.1, 0.9).unwrap()
        } else {
            Sgd::new(0.1).unwrap()
        };
        let scale = LossScale::new(gpu).unwrap();
        // scaled gradients of 1e30·2¹⁶ are finite f32, their squares are not: an overflow
        let huge = |t: &Tensor| t.mul_scalar(1e30).unwrap().sum_all().unwrap();
        let loss = huge(&p.get()).add(&huge(&q.get())).unwrap();
        scale.backward(&loss).unwrap();
        let (norm, factor) = scale.unscale(&params, 1.0).unwrap().expect("gradients");
        assert_eq!(
            factor.to_vec_f32().unwrap(),
            vec![-1.0, 1.0],
            "the skip factor, and one step skipped so far"
        );
        assert!(norm.to_vec_f32().unwrap()[0].is_infinite());
        adam.step(&params[..1], Some(&factor)).unwrap();
        sgd.step(&params[1..], Some(&factor)).unwrap();
        assert_eq!(
            p.get().to_vec_f32().unwrap(),
            start,
            "Adam skipped the step"
        );
        assert_eq!(q.get().to_vec_f32().unwrap(), start, "SGD skipped the step");
        for (name, m) in adam.state().into_iter().chain(sgd.state()) {
            let m = m.to_vec_f32().unwrap();
            assert!(
                m.iter().all(|&v| v == 0.0),
                "{name} moved on a skipped step: {m:?}"
            );
        }
        assert_eq!(scale.scale().unwrap(), LossScale::INITIAL / 2.0, "halved");
        assert_eq!(scale.skipped_steps().unwrap(), 1);

        // a good step after it: Adam's first step without scaling. The host counted two
        // steps, but the factor says one was skipped, so the bias corrections are step 1's
        // (as PyTorch's GradScaler, which skips optimizer.step()); with step 2's they would
        // be 0.19 and 0.002, an update 0.74 times as long.
        let plain =
            moegrad::nn::Param::new(Tensor::from_f32(start.clone(), &[3], gpu).unwrap()).unwrap();
        let plain_params = named(&[&plain]);
        let mut plain_adam = Adam::new(0.1).unwrap();
        let quadratic = |t: &Tensor| t.mul(t).unwrap().sum_all().unwrap();
        quadratic(&plain.get()).backward().unwrap();
        plain_adam.step(&plain_params, None).unwrap();
        let factor = scaled_step(&scale, &params[..1], &mut adam, &quadratic(&p.get()));
        assert_eq!(factor as f64, 1.0 / scale.scale().unwrap());
        let (a, b) = (
            p.get().to_vec_f32().unwrap(),
            plain.get().to_vec_f32().unwrap(),
        );
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() <= 1e-6, "scaled Adam {a:?}, plain Adam {b:?}");
        }
        assert_eq!(scale.skipped_steps().unwrap(), 1);
    }
}

#[test]
fn good_steps_grow_the_scale_and_an_overflow_restarts_the_count() {
    use moegrad::optim::{LossScale, Sgd};
    let Some(gpu) =
        common::gpu_or_skip("good_steps_grow_the_scale_and_an_overflow_restarts_the_count")
    else {
        return;
    };
    let p = moegrad::nn::Param::new(Tensor::from_f32(vec![1.0, 2.0], &[2], gpu).unwrap()).unwrap();
    let params = named(&[&p]);
    let mut sgd = Sgd::new(1e-3).unwrap();
    let scale = LossScale::with(4.0, 3, gpu).unwrap();
    let good = || p.get().sum_all().unwrap();
    let bad = || p.get().mul_scalar(1e38).unwrap().sum_all().unwrap();
    let mut seen = Vec::new();
    for overflow in [false, false, false, false, true, false, false, false] {
        let loss = if overflow { bad() } else { good() };
        let factor = scaled_step(&scale, &params, &mut sgd, &loss);
        seen.push((scale.scale().unwrap(), factor < 0.0));
    }
    // three good steps double 4 → 8; one more good; the overflow halves 8 → 4 and restarts
    // the count, so three more good steps are needed before 8 again
    let want = [
        (4.0, false),
        (4.0, false),
        (8.0, false),
        (8.0, false),
        (4.0, true),
        (4.0, false),
        (4.0, false),
        (8.0, false),
    ];
    assert_eq!(seen, want);
    assert_eq!(scale.skipped_steps().unwrap(), 1);
    assert!(
        LossScale::new(Device::Cpu).is_err(),
        "the CPU has no f16-mixed"
    );
    assert!(LossScale::with(f64::NAN, 3, gpu).is_err());
}

/// The kernels `f` runs on the GPU, each with its number of calls, by name.
fn kernels_of(f: impl FnOnce()) -> Vec<(String, u64)> {
    let recording = moegrad::profile::start();
    f();
    let report = recording.finish().expect("a profile");
    let gpu = report.gpu.expect("the GPU's kernels");
    let mut kernels: Vec<_> = gpu
        .kernels
        .into_iter()
        .map(|k| (k.kernel, k.calls))
        .collect();
    kernels.sort();
    kernels
}

/// `LossScale::backward` seeds the walk with the scale: every gradient has the bits of
/// `(loss · s).backward()`, and it runs the kernels of a backward from a given seed and no
/// more (no product `loss · s` forward, none in its backward).
#[test]
fn the_loss_scale_seeds_the_backward_without_a_product() {
    use moegrad::optim::LossScale;
    let Some(gpu) = common::gpu_or_skip("the_loss_scale_seeds_the_backward_without_a_product")
    else {
        return;
    };
    let p = moegrad::nn::Param::new(
        Tensor::from_f32(vec![0.5, -1.5, 2.0, 0.25], &[2, 2], gpu).unwrap(),
    )
    .unwrap();
    let loss = || {
        p.get()
            .mul_scalar(3.0)
            .unwrap()
            .exp()
            .unwrap()
            .sum_all()
            .unwrap()
    };
    let s = 65536.0f32;
    let scale = LossScale::with(s as f64, 2000, gpu).unwrap();
    let s_tensor = Tensor::from_f32(vec![s], &[], gpu).unwrap();
    // the composition: the product, and backward from 1
    loss().mul(&s_tensor).unwrap().backward().unwrap();
    let composed = p.grad().unwrap().to_vec_f32().unwrap();
    p.zero_grad();
    // once before counting (constants made on first use), then counted against a backward
    // from the same seed handed over as it is
    scale.backward(&loss()).unwrap();
    p.zero_grad();
    let seeded = kernels_of(|| scale.backward(&loss()).unwrap());
    assert_eq!(p.grad().unwrap().to_vec_f32().unwrap(), composed);
    p.zero_grad();
    let plain = kernels_of(|| loss().backward_with(&s_tensor).unwrap());
    assert_eq!(seeded, plain, "kernels of the scaled backward");
    assert!(
        scale
            .backward(&Tensor::from_f32(vec![1.0, 2.0], &[2], gpu).unwrap())
            .is_err(),
        "a loss of two values"
    );
}

/// A parameter the loss adds as it is gets the backward's seed, the scale, as its gradient.
/// The unscale kernel rewrites the scale in place, so the parameter must keep a gradient of
/// its own: with the scale doubling after every good step, the update is still the unscaled
/// gradient (1 here), not the new scale over the old (2), and the kernel does not bind one
/// buffer twice.
#[test]
fn a_parameter_the_loss_adds_as_it_is_keeps_its_gradient_when_the_scale_grows() {
    use moegrad::optim::{LossScale, Optimizer, Sgd};
    let Some(gpu) = common::gpu_or_skip(
        "a_parameter_the_loss_adds_as_it_is_keeps_its_gradient_when_the_scale_grows",
    ) else {
        return;
    };
    let p = moegrad::nn::Param::new(Tensor::from_f32(vec![0.0], &[], gpu).unwrap()).unwrap();
    let q = moegrad::nn::Param::new(Tensor::from_f32(vec![1.0, 2.0], &[2], gpu).unwrap()).unwrap();
    let params = named(&[&p, &q]);
    let mut sgd = Sgd::new(1.0).unwrap();
    let scale = LossScale::with(4.0, 1, gpu).unwrap();
    for step in 1..=2 {
        let loss = p
            .get()
            .add(&q.get().mul_scalar(2.0).unwrap().sum_all().unwrap())
            .unwrap();
        scale.backward(&loss).unwrap();
        let (_, factor) = scale.unscale(&params, 0.0).unwrap().expect("gradients");
        sgd.step(&params, Some(&factor)).unwrap();
        let s = step as f32;
        assert_eq!(
            p.get().to_vec_f32().unwrap(),
            vec![-s],
            "p after step {step}"
        );
        assert_eq!(
            q.get().to_vec_f32().unwrap(),
            vec![1.0 - 2.0 * s, 2.0 - 2.0 * s],
            "q after step {step}"
        );
    }
    assert_eq!(
        scale.scale().unwrap(),
        16.0,
        "two good steps double 4 twice"
    );
}

/// Two f16-mixed training steps of the image model `cfg` (images `side`² with `tasks` tasks) on
/// `x`, `y`, each with a finite loss; `what` names the case in a failure.
fn two_mixed_steps(
    cfg: &TrainConfig,
    (side, tasks): (usize, usize),
    x: &Tensor,
    y: &[Tensor],
    what: &str,
) {
    let gpu = Device::Gpu;
    let model = moegrad::train::build_model(cfg, side, tasks, gpu).unwrap();
    let params = model.named_params();
    let mut opt = moegrad::train::make_optimizer(cfg).unwrap();
    let scale = moegrad::optim::LossScale::new(gpu).unwrap();
    for _ in 0..2 {
        let out = moegrad::train::train_step_mixed(
            model.as_ref(),
            &params,
            opt.as_mut(),
            x,
            y,
            1.0,
            &scale,
        )
        .unwrap_or_else(|e| panic!("{what} in f16-mixed: {e}"));
        let l = out.loss.item().unwrap();
        assert!(l.is_finite(), "{what}: loss {l}");
    }
}

#[test]
fn every_model_and_every_router_trains_in_f16_mixed() {
    let Some(gpu) = f16_gpu("every_model_and_every_router_trains_in_f16_mixed") else {
        return;
    };
    for (kind, cfg) in small_language_models() {
        let (l, skipped) = losses(&cfg, true, 3);
        assert!(
            l.iter().all(|v| v.is_finite()) && skipped == 0,
            "{}: losses {l:?}, {skipped} skipped",
            kind.name()
        );
    }
    // the image models (convolutions, pooling, the dense layers and experts run in f16)
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    for (kind, side, tasks) in [
        (ModelKind::Mlp, 28, 1),
        (ModelKind::Cnn, 28, 1),
        (ModelKind::MoeCnn, 28, 1),
        (ModelKind::MmoeCnn, 36, 2),
    ] {
        let cfg = TrainConfig {
            model: kind,
            batch: 4,
            device: "gpu".into(),
            ..TrainConfig::default()
        };
        let pixels: Vec<f32> = (0..4 * side * side)
            .map(|_| rng.random_range(0.0..1.0))
            .collect();
        let x = Tensor::from_f32(pixels, &[4, 1, side, side], gpu).unwrap();
        let y: Vec<Tensor> = (0..tasks)
            .map(|_| Tensor::from_i32(vec![1, 7, 3, 0], &[4], gpu).unwrap())
            .collect();
        two_mixed_steps(&cfg, (side, tasks), &x, &y, kind.name());
    }
    // every router, in the image MoE (its gate in f32, the experts in f16)
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let pixels: Vec<f32> = (0..4 * 28 * 28)
        .map(|_| rng.random_range(0.0..1.0))
        .collect();
    let x = Tensor::from_f32(pixels, &[4, 1, 28, 28], gpu).unwrap();
    let y = Tensor::from_i32(vec![1, 7, 3, 0], &[4], gpu).unwrap();
    for router in moegrad::moe::ROUTER_NAMES {
        let cfg = TrainConfig {
            model: ModelKind::MoeMlp,
            router: router.to_string(),
            experts: 4,
            k: 2,
            expert_hidden: 32,
            batch: 4,
            device: "gpu".into(),
            ..TrainConfig::default()
        };
        two_mixed_steps(&cfg, (28, 1), &x, std::slice::from_ref(&y), router);
    }
}

#[test]
fn the_loss_scale_state_round_trips_for_checkpoints() {
    use moegrad::optim::{LossScale, Sgd};
    let Some(gpu) = common::gpu_or_skip("the_loss_scale_state_round_trips_for_checkpoints") else {
        return;
    };
    let p = moegrad::nn::Param::new(Tensor::from_f32(vec![1.0], &[1], gpu).unwrap()).unwrap();
    let params = named(&[&p]);
    let mut sgd = Sgd::new(1e-3).unwrap();
    let grown = LossScale::with(4.0, 2, gpu).unwrap();
    for _ in 0..3 {
        scaled_step(&grown, &params, &mut sgd, &p.get().sum_all().unwrap());
    }
    assert_eq!(grown.scale().unwrap(), 8.0);
    // a checkpoint's tensors (read back, as a file would hold them) into a fresh scale
    let mut resumed = LossScale::new(gpu).unwrap();
    for (name, t) in grown.state() {
        let copy = Tensor::from_f32(t.to_vec_f32().unwrap(), t.shape(), gpu).unwrap();
        resumed.load_state(&name, &copy).unwrap();
    }
    assert_eq!(resumed.scale().unwrap(), 8.0);
    assert_eq!(resumed.skipped_steps().unwrap(), 0);
    // it goes on from there: the restored count (one good step since the last growth) plus one
    // more completes the interval of 2 and doubles the scale
    assert_eq!(grown.state()[1].1.to_vec_f32().unwrap(), vec![1.0, 0.0]);
    let mut scale = LossScale::with(1.0, 2, gpu).unwrap();
    for (name, t) in grown.state() {
        scale.load_state(&name, &t).unwrap();
    }
    scaled_step(&scale, &params, &mut sgd, &p.get().sum_all().unwrap());
    assert_eq!(scale.scale().unwrap(), 16.0);
    // bad state is refused
    let mut bad = |name: &str, t: Tensor| resumed.load_state(name, &t).is_err();
    assert!(bad(
        "scale",
        Tensor::from_f32(vec![f32::NAN], &[], gpu).unwrap()
    ));
    assert!(bad("scale", Tensor::from_f32(vec![0.5], &[], gpu).unwrap()));
    assert!(bad(
        "scale",
        Tensor::from_f32(vec![2.0], &[1], gpu).unwrap()
    ));
    assert!(bad(
        "counts",
        Tensor::from_f32(vec![0.0; 3], &[3], gpu).unwrap()
    ));
    assert!(bad(
        "growth",
        Tensor::from_f32(vec![0.0], &[], gpu).unwrap()
    ));
}

/// An f16 prediction's mean squared error is computed in f32 (a 0-d f32 loss, from the f16
/// values widened exactly), and its gradient comes back in f16, equal to the f32 gradient
/// rounded to f16.
#[test]
fn mse_of_an_f16_prediction_is_computed_in_f32() {
    let Some(dev) = f16_gpu("mse_of_an_f16_prediction_is_computed_in_f32") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let values = |rng: &mut ChaCha8Rng| -> Vec<f32> {
        (0..3000).map(|_| rng.random_range(-2.0f32..2.0)).collect()
    };
    let (x, t) = (values(&mut rng), values(&mut rng));
    let on = |v: &[f32], dtype| {
        Tensor::from_f32(v.to_vec(), &[30, 100], dev)
            .and_then(|t| t.to_dtype(dtype))
            .unwrap()
    };
    let (x16, t16) = (
        on(&x, moegrad::DType::F16).with_grad().unwrap(),
        on(&t, moegrad::DType::F16),
    );
    // the same f16 values, widened to f32
    let (x32, t32) = (
        x16.detach()
            .to_dtype(moegrad::DType::F32)
            .unwrap()
            .with_grad()
            .unwrap(),
        t16.to_dtype(moegrad::DType::F32).unwrap(),
    );
    let (l16, l32) = (x16.mse(&t16).unwrap(), x32.mse(&t32).unwrap());
    assert_eq!(l16.dtype(), moegrad::DType::F32, "the loss is f32");
    assert_eq!(
        l16.item().unwrap(),
        l32.item().unwrap(),
        "the same f32 loss"
    );
    l16.backward().unwrap();
    l32.backward().unwrap();
    let g16 = x16.grad().unwrap();
    assert_eq!(g16.dtype(), moegrad::DType::F16, "the gradient is f16");
    let want = x32
        .grad()
        .unwrap()
        .to_dtype(moegrad::DType::F16)
        .unwrap()
        .to_vec_f64()
        .unwrap();
    assert_eq!(
        g16.to_vec_f64().unwrap(),
        want,
        "f32's gradient rounded to f16"
    );
}

/// The softmax of f16 values is computed in f32 and rounded back: an f16 output equal to the
/// f32 softmax of the same (widened) values rounded to f16, along the last axis and another,
/// and an f16 gradient equal to the f32 one rounded to f16.
#[test]
fn softmax_of_f16_values_is_computed_in_f32() {
    let Some(dev) = f16_gpu("softmax_of_f16_values_is_computed_in_f32") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(6);
    let x: Vec<f32> = (0..600).map(|_| rng.random_range(-4.0f32..4.0)).collect();
    let g: Vec<f32> = (0..600).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let f16 = moegrad::DType::F16;
    // an upstream gradient of f16 values, so that the f16 output's gradient is not rounded
    let upstream = Tensor::from_f32(g, &[20, 30], dev)
        .and_then(|t| t.to_dtype(f16))
        .and_then(|t| t.to_dtype(moegrad::DType::F32))
        .unwrap();
    for axis in [-1, 0] {
        let x16 = Tensor::from_f32(x.clone(), &[20, 30], dev)
            .and_then(|t| t.to_dtype(f16))
            .and_then(|t| t.with_grad())
            .unwrap();
        let x32 = x16
            .detach()
            .to_dtype(moegrad::DType::F32)
            .and_then(|t| t.with_grad())
            .unwrap();
        let (y16, y32) = (x16.softmax(axis).unwrap(), x32.softmax(axis).unwrap());
        assert_eq!(
            y16.dtype(),
            f16,
            "axis {axis}: the softmax of f16 values is f16"
        );
        let rounded = |t: &Tensor| t.to_dtype(f16).unwrap().to_vec_f64().unwrap();
        assert_eq!(
            y16.to_vec_f64().unwrap(),
            rounded(&y32),
            "axis {axis}: the f32 softmax rounded to f16"
        );
        let loss = |y: &Tensor| {
            y.to_dtype(moegrad::DType::F32)
                .and_then(|y| y.mul(&upstream))
                .and_then(|t| t.sum_all())
                .unwrap()
        };
        loss(&y16).backward().unwrap();
        loss(&y32).backward().unwrap();
        let g16 = x16.grad().unwrap();
        assert_eq!(g16.dtype(), f16, "axis {axis}: the gradient is f16");
        assert_eq!(
            g16.to_vec_f64().unwrap(),
            rounded(&x32.grad().unwrap()),
            "axis {axis}: the f32 gradient rounded to f16"
        );
    }
}
