//! One sparse MoE layer: route a batch of tokens with a router chosen by name, run only the experts
//! each token uses, back-propagate, and print how the tokens spread over the experts.
//!
//! Run with `cargo run --release --example moe_layer -- topk` (any name from
//! `moegrad::moe::ROUTER_NAMES`; the default is `topk`).

use moegrad::moe::{MoeConfig, MoeLayer, ROUTER_NAMES};
use moegrad::{DType, Device, Tensor};

fn main() -> moegrad::Result<()> {
    let router = std::env::args().nth(1).unwrap_or_else(|| "topk".into());
    if !ROUTER_NAMES.contains(&router.as_str()) {
        eprintln!(
            "unknown router {router:?}; try one of {}",
            ROUTER_NAMES.join(", ")
        );
        std::process::exit(2);
    }
    let dev = Device::best()?;
    // 256 tokens of width 32, 8 experts 32 → 64 → 32, 2 experts per token.
    let mut cfg = MoeConfig::new(32, 64, 8, 2);
    cfg.router = router.clone();
    let layer = MoeLayer::new(&cfg, dev)?;
    let x = Tensor::rand_uniform(&[256, 32], 7, DType::F32, dev)?.add_scalar(-0.5)?;
    let out = layer.forward(&x)?;
    let loss = out.y.mul(&out.y)?.mean_all()?.add(&out.aux_loss)?;
    loss.backward()?;
    let stats = out.stats.read()?;
    println!("router {router}: loss {:.5}", loss.item()?);
    println!("expert load (fraction of assignments per expert):");
    for (e, load) in stats.expert_load.iter().enumerate() {
        println!(
            "  expert {e}: {:5.1}% {}",
            100.0 * load,
            "#".repeat((load * 100.0) as usize)
        );
    }
    println!(
        "experts per token {:.2}, router entropy {:.3} nats, drop rate {:.1}%",
        stats.experts_per_token,
        stats.entropy,
        100.0 * stats.drop_rate
    );
    Ok(())
}
