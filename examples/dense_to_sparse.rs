//! Dense to sparse (XMoE §3.6): train a small dense FFN classifier on the bundled MNIST digits,
//! split its FFN into 8 small experts behind a `threshold` router, fine-tune briefly with t = 1
//! (every expert, no drops), then lower the threshold at inference and watch the accuracy and
//! the number of experts each digit uses.
//!
//! ```text
//! dense:  x ─▶ FFN 784 → 256 → 64 (GELU) ─▶ ReLU ─▶ Linear 64 → 10
//! sparse: x ─▶ MoE: threshold router over 8 experts 784 → 32 → 64 ─▶ ReLU ─▶ Linear 64 → 10
//! ```
//!
//! The split is exact (XMoE Eq. 4) and the router starts at zero, so before fine-tuning the
//! sparse model with t = 1 computes the same function as the dense one.
//!
//! Run with `cargo run --release --example dense_to_sparse` (seconds on two CPU cores).

use moegrad::data::Mnist;
use moegrad::moe::{Capacity, MoeConfig, MoeLayer};
use moegrad::moe::{DenseFfn, SplitScale, decompose_ffn};
use moegrad::nn::Parameters;
use moegrad::nn::{Activation, Init, Linear, Module, Param};
use moegrad::optim::{Adam, Optimizer};
use moegrad::{Device, Result, Tensor};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::path::Path;

const SIDE: usize = 28 * 28;
const HIDDEN: usize = 256;
const WIDTH: usize = 64;
const EXPERTS: usize = 8;
const BATCH: usize = 64;

/// A model: a batch of images → logits and an optional auxiliary loss.
type Model<'a> = dyn Fn(&Tensor) -> Result<(Tensor, Option<Tensor>)> + 'a;

/// Something that calls a visitor for every named parameter.
type Visit<'a> = &'a dyn Fn(&mut dyn FnMut(String, &Param));

/// A batch of images `[B, 784]` and labels `[B]` starting at example `start`.
fn batch(
    set: &moegrad::data::ImageSet,
    start: usize,
    len: usize,
    dev: Device,
) -> Result<(Tensor, Tensor)> {
    let x = set.images[start * SIDE..(start + len) * SIDE].to_vec();
    let y = set.labels[start..start + len].to_vec();
    Ok((
        Tensor::from_f32(x, &[len, SIDE], dev)?,
        Tensor::from_i32(y, &[len], dev)?,
    ))
}

/// Trains `params` for one pass over the training set, `logits` giving the model's output
/// and its auxiliary loss.
fn train_epoch(
    mnist: &Mnist,
    params: &[(String, Param)],
    opt: &mut Adam,
    logits: &Model,
    dev: Device,
) -> Result<f64> {
    let steps = mnist.train.count / BATCH;
    let mut last = 0.0;
    for s in 0..steps {
        let (x, y) = batch(&mnist.train, s * BATCH, BATCH, dev)?;
        let (z, aux) = logits(&x)?;
        let mut loss = z.cross_entropy(&y)?;
        if let Some(aux) = aux {
            loss = loss.add(&aux)?;
        }
        for (_, p) in params {
            p.zero_grad();
        }
        loss.backward()?;
        opt.step(params, None)?;
        if s + 1 == steps {
            last = loss.item()?;
        }
    }
    Ok(last)
}

/// Test accuracy of `logits`.
fn accuracy(mnist: &Mnist, logits: &dyn Fn(&Tensor) -> Result<Tensor>, dev: Device) -> Result<f64> {
    let mut right = 0usize;
    let chunk = 500;
    for start in (0..mnist.test.count).step_by(chunk) {
        let len = chunk.min(mnist.test.count - start);
        let (x, _) = batch(&mnist.test, start, len, dev)?;
        let pred = logits(&x)?.argmax(-1, false)?.to_vec_i32()?;
        right += pred
            .iter()
            .zip(&mnist.test.labels[start..start + len])
            .filter(|(p, l)| p == l)
            .count();
    }
    Ok(right as f64 / mnist.test.count as f64)
}

/// The threshold MoE layer of the sparse model; `eval_t` is the threshold at inference.
fn moe_layer(eval_t: f64, dev: Device) -> Result<MoeLayer> {
    let mut cfg = MoeConfig::new(SIDE, HIDDEN / EXPERTS, EXPERTS, 1);
    cfg.d_out = WIDTH;
    cfg.router = "threshold".into();
    cfg.activation = Activation::Gelu;
    cfg.capacity = Capacity::Dropless;
    cfg.eval_capacity = Capacity::Dropless;
    cfg.balance_loss = 0.0;
    cfg.router_options = [
        ("t".to_string(), "1".to_string()),
        ("eval_t".to_string(), eval_t.to_string()),
    ]
    .into_iter()
    .collect();
    MoeLayer::new(&cfg, dev)
}

fn named(visit: Visit) -> Vec<(String, Param)> {
    let mut v = Vec::new();
    visit(&mut |n, p| v.push((n, p.clone())));
    v
}

fn main() -> Result<()> {
    let dev = Device::best()?;
    let mnist = Mnist::load(Path::new("data"))?;
    let mut rng = ChaCha8Rng::seed_from_u64(0);

    // 1. The dense model.
    let fc1 = Linear::new(SIDE, HIDDEN, Init::KaimingUniform, &mut rng, dev)?;
    let fc2 = Linear::new(HIDDEN, WIDTH, Init::KaimingUniform, &mut rng, dev)?;
    let head = Linear::new(WIDTH, 10, Init::XavierUniform, &mut rng, dev)?;
    let dense = |x: &Tensor| -> Result<Tensor> {
        let h = Activation::Gelu.apply(&fc1.forward(x)?)?;
        head.forward(&fc2.forward(&h)?.relu()?)
    };
    let mut params = named(&|f| fc1.visit_params("fc1", f));
    params.extend(named(&|f| fc2.visit_params("fc2", f)));
    params.extend(named(&|f| head.visit_params("head", f)));
    let mut opt = Adam::new(1e-3)?;
    for epoch in 0..3 {
        let loss = train_epoch(&mnist, &params, &mut opt, &|x| Ok((dense(x)?, None)), dev)?;
        println!("dense   epoch {epoch}: loss {loss:.4}");
    }
    let dense_acc = accuracy(&mnist, &dense, dev)?;
    println!(
        "dense FFN ({SIDE} → {HIDDEN} → {WIDTH}): test accuracy {:.2}%",
        100.0 * dense_acc
    );

    // 2. Split its FFN into EXPERTS experts of hidden HIDDEN/EXPERTS; zero router, t = 1.
    let bias = |l: &Linear| {
        l.bias
            .as_ref()
            .map(|b| b.get())
            .ok_or_else(|| moegrad::Error::Invalid("the dense FFN's layers have biases".into()))
    };
    let (w1, b1, w2, b2) = (fc1.weight.get(), bias(&fc1)?, fc2.weight.get(), bias(&fc2)?);
    let ffn = DenseFfn {
        w1: &w1,
        b1: Some(&b1),
        w2: &w2,
        b2: Some(&b2),
        activation: Activation::Gelu,
    };
    let mut moe = moe_layer(1.0, dev)?;
    moe.set_experts(Box::new(decompose_ffn(
        &ffn,
        EXPERTS,
        SplitScale::UniformRouter,
    )?))?;
    for (_, p) in named(&|f| moe.router().visit_params("router", f)) {
        p.set(p.get().zeros_like()?)?;
    }
    let sparse = |layer: &MoeLayer, x: &Tensor| -> Result<(Tensor, Tensor, f64)> {
        let out = layer.forward(x)?;
        let z = head.forward(&out.y.relu()?)?;
        Ok((z, out.aux_loss, out.stats.read()?.experts_per_token))
    };
    moe.set_training(false);
    let acc0 = accuracy(&mnist, &|x| Ok(sparse(&moe, x)?.0), dev)?;
    println!(
        "split into {EXPERTS} experts of {} (zero router, t = 1): test accuracy {:.2}% (same function)",
        HIDDEN / EXPERTS,
        100.0 * acc0
    );

    // 3. Fine-tune with t = 1: every expert runs, the router learns which ones matter.
    moe.set_training(true);
    let mut params = named(&|f| moe.visit_params("moe", f));
    params.extend(named(&|f| head.visit_params("head", f)));
    let mut opt = Adam::new(5e-4)?;
    for epoch in 0..3 {
        let loss = train_epoch(
            &mnist,
            &params,
            &mut opt,
            &|x| {
                let (z, aux, _) = sparse(&moe, x)?;
                Ok((z, Some(aux)))
            },
            dev,
        )?;
        println!("sparse  epoch {epoch} (t = 1): loss {loss:.4}");
    }

    // 4. Lower the threshold at inference: fewer experts per digit.
    println!("\n  eval t   test accuracy   experts per token (of {EXPERTS})");
    let trained = named(&|f| moe.visit_params("moe", f));
    for eval_t in [1.0, 0.9, 0.7, 0.5, 0.0] {
        let mut layer = moe_layer(eval_t, dev)?;
        layer.set_experts(Box::new(decompose_ffn(
            &ffn,
            EXPERTS,
            SplitScale::UniformRouter,
        )?))?;
        for ((_, from), (_, to)) in trained.iter().zip(named(&|f| layer.visit_params("moe", f))) {
            to.set(from.get().detach())?;
        }
        layer.set_training(false);
        let per_token = std::cell::Cell::new(0.0);
        let batches = std::cell::Cell::new(0.0);
        let acc = accuracy(
            &mnist,
            &|x| {
                let (z, _, k) = sparse(&layer, x)?;
                per_token.set(per_token.get() + k);
                batches.set(batches.get() + 1.0);
                Ok(z)
            },
            dev,
        )?;
        println!(
            "  {eval_t:>6.1}   {:>12.2}%   {:>6.2}",
            100.0 * acc,
            per_token.get() / batches.get()
        );
    }
    Ok(())
}
