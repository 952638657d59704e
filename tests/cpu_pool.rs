//! The CPU buffer pool (`backend/cpu/buffer_pool.rs`, its counters read through
//! `moegrad::memory::buffer_pool_stats`): a steady training step allocates no buffer.
//!
//! One test in its own binary, because the pool and its counters are process-wide: other tests
//! running beside it in the same process would allocate too.

use moegrad::lm::{Gpt, GptConfig};
use moegrad::nn::Parameters;
use moegrad::optim::{Adam, Optimizer, clip_grad_norm};
use moegrad::{Device, Tensor};

#[test]
fn a_steady_gpt_training_step_takes_every_buffer_from_the_pool() {
    let mut cfg = GptConfig::baby(11);
    cfg.block = 16;
    cfg.layers = 2;
    cfg.d_model = 32;
    cfg.heads = 2;
    cfg.ffn = moegrad::lm::FeedForward::Dense { hidden: 128 };
    let model = Gpt::new(&cfg, Device::cpu()).unwrap();
    let params = model.named_params();
    let mut opt = Adam::adamw(1e-3, 0.1).unwrap();
    let (b, t) = (8, 16);
    let idx: Vec<i32> = (0..b * t).map(|i| (i * 7 % 11) as i32).collect();
    let tgt: Vec<i32> = (0..b * t).map(|i| (i * 5 % 11) as i32).collect();
    let step = |opt: &mut Adam| {
        let x = Tensor::from_i32(idx.clone(), &[b, t], Device::cpu()).unwrap();
        let y = Tensor::from_i32(tgt.clone(), &[b * t], Device::cpu()).unwrap();
        let loss = model.forward(&x).unwrap().logits.cross_entropy(&y).unwrap();
        loss.backward().unwrap();
        let scale = clip_grad_norm(&params, 1.0).unwrap();
        opt.step(&params, scale.as_ref().map(|(_, s)| s)).unwrap();
    };
    for _ in 0..3 {
        step(&mut opt);
    }
    moegrad::memory::reset_buffer_pool_stats();
    step(&mut opt);
    step(&mut opt);
    let s = moegrad::memory::buffer_pool_stats();
    assert!(
        s.hits > 50,
        "the step's big buffers come from the pool: {s:?}"
    );
    assert_eq!(s.misses, 0, "a steady step allocated buffers: {s:?}");
    moegrad::memory::trim_buffer_pool();
    assert_eq!(moegrad::memory::buffer_pool_stats().held_bytes, 0);
    moegrad::memory::reset_buffer_pool_stats();
    step(&mut opt);
    assert!(
        moegrad::memory::buffer_pool_stats().misses > 0,
        "after trim the pool is empty and the step allocates"
    );
}
