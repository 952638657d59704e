//! Tutorial chapter 3 (`docs/tutorial/03-moe-layer-by-hand.md`): a top-k Mixture-of-Experts layer
//! built by hand from tensor ops (routing, dispatch, experts, combine), checked against
//! `moegrad::moe::MoeLayer` with the same weights, and the reason unselected experts get exactly
//! zero gradient, shown by assertions.
//!
//! Run with `cargo run --release --example tutorial_03_moe_by_hand`.

use moegrad::prelude::*;
use std::collections::BTreeMap;

/// Sizes: T tokens of width D, N experts D → H → D, each token routed to K of them.
const T: usize = 16;
const D: usize = 4;
const H: usize = 8;
const N: usize = 4;
const K: usize = 2;
/// The expert no token will choose: its router bias is set very low.
const IDLE: usize = 3;

/// The layer's parameters by name (`router.weight`, `router.bias`, `experts.w1`, ...).
fn params(layer: &MoeLayer) -> BTreeMap<String, Param> {
    let mut map = BTreeMap::new();
    layer.visit_params("", &mut |name, p| {
        map.insert(name, p.clone());
    });
    map
}

fn param<'a>(map: &'a BTreeMap<String, Param>, name: &str) -> Result<&'a Param> {
    map.get(name).ok_or_else(|| {
        let names: Vec<&String> = map.keys().collect();
        Error::Invalid(format!(
            "the layer has no parameter {name:?}; it has {names:?}"
        ))
    })
}

/// Expert `e`'s slice of a stacked `[N, ...]` parameter, as a matrix or vector of its own.
fn expert_slice(stacked: &Tensor, e: usize) -> Result<Tensor> {
    let shape = stacked.shape()[1..].to_vec();
    stacked.slice(0, e, e + 1)?.reshape(&shape)
}

/// Expert `e` on some rows: `relu(rows·W1_e + b1_e)·W2_e + b2_e`.
fn expert(p: &BTreeMap<String, Param>, e: usize, rows: &Tensor) -> Result<Tensor> {
    let w1 = expert_slice(&param(p, "experts.w1")?.get(), e)?;
    let b1 = expert_slice(&param(p, "experts.b1")?.get(), e)?;
    let w2 = expert_slice(&param(p, "experts.w2")?.get(), e)?;
    let b2 = expert_slice(&param(p, "experts.b2")?.get(), e)?;
    rows.matmul(&w1)?.add(&b1)?.relu()?.matmul(&w2)?.add(&b2)
}

/// Routing: probabilities over the N experts, the top K of each token, renormalised.
/// Returns the gates `[T, K]` (on the tape) and the chosen experts `[T, K]` (host ids).
fn route(p: &BTreeMap<String, Param>, x: &Tensor) -> Result<(Tensor, Vec<i32>)> {
    let logits = x
        .matmul(&param(p, "router.weight")?.get())?
        .add(&param(p, "router.bias")?.get())?;
    let probs = logits.softmax(-1)?; // p = σ(o), [T, N]
    let (top_p, top_idx) = probs.topk(K)?; // [T, K] each; the gradient flows to top_p only
    let gates = top_p.div(&top_p.sum(&[-1], true)?)?; // g = p_T / Σ p_T
    Ok((gates, top_idx.to_vec_i32()?))
}

/// The sparse layer: each expert runs on the rows routed to it and nothing else.
fn sparse_moe(p: &BTreeMap<String, Param>, x: &Tensor) -> Result<Tensor> {
    let (gates, chosen) = route(p, x)?;
    let flat_gates = gates.reshape(&[T * K])?; // slot s = t·K + j
    let mut y = Tensor::zeros(&[T, D], x.dtype(), x.device())?;
    for e in 0..N {
        // Dispatch: the tokens (and their slots) that chose expert e.
        let slots: Vec<i32> = (0..T * K)
            .filter(|&s| chosen[s] == e as i32)
            .map(|s| s as i32)
            .collect();
        if slots.is_empty() {
            continue; // no token chose e: it does not run, so it is not on the tape at all
        }
        let tokens: Vec<i32> = slots.iter().map(|s| s / K as i32).collect();
        let m = slots.len();
        let tokens = Tensor::from_i32(tokens, &[m], x.device())?;
        let slots = Tensor::from_i32(slots, &[m], x.device())?;
        let rows = x.index_select(0, &tokens)?; // [m, D]
        let out = expert(p, e, &rows)?; // [m, D]
        let g = flat_gates.index_select(0, &slots)?.reshape(&[m, 1])?;
        // Combine: y[t] += g_{t,e} · f_e(x_t), scattered back to the token rows.
        y = y.add(&out.mul(&g)?.index_scatter(0, &tokens, T)?)?;
    }
    Ok(y)
}

/// The same layer computed densely: every expert on every token, weighted by a gate matrix
/// `G [T, N]` that is zero outside each token's top K. Slower, but it shows the math.
fn dense_masked_moe(p: &BTreeMap<String, Param>, x: &Tensor) -> Result<Tensor> {
    let (gates, chosen) = route(p, x)?;
    let idx = Tensor::from_i32(chosen, &[T, K], x.device())?;
    let g_full = Tensor::zeros(&[T, N], x.dtype(), x.device())?.scatter_add(1, &idx, &gates)?;
    let mut y = Tensor::zeros(&[T, D], x.dtype(), x.device())?;
    for e in 0..N {
        let g_e = g_full.slice(1, e, e + 1)?; // [T, 1], exactly 0 where e was not chosen
        y = y.add(&expert(p, e, x)?.mul(&g_e)?)?;
    }
    Ok(y)
}

/// Every parameter's gradient, flattened, then forgets them (for the next comparison).
fn take_grads(p: &BTreeMap<String, Param>) -> Result<BTreeMap<String, Vec<f64>>> {
    let mut out = BTreeMap::new();
    for (name, param) in p {
        let g = param
            .try_grad()?
            .ok_or_else(|| Error::Invalid(format!("{name} got no gradient at all")))?;
        out.insert(name.clone(), g.to_vec_f64()?);
        param.zero_grad();
    }
    Ok(out)
}

/// Expert `e`'s part of a stacked parameter's flat gradient.
fn expert_part(flat: &[f64], e: usize) -> &[f64] {
    let per = flat.len() / N;
    &flat[e * per..(e + 1) * per]
}

fn assert_close(what: &str, a: &[f64], b: &[f64], tol: f64) {
    assert_eq!(a.len(), b.len(), "{what}: lengths differ");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= tol * (1.0 + x.abs()),
            "{what}[{i}]: {x} vs {y}"
        );
    }
}

fn main() -> Result<()> {
    let cpu = Device::cpu();
    // A dropless top-2 layer of 4 ReLU MLP experts; we borrow its initialised weights.
    let layer = MoeLayer::new(&MoeConfig::new(D, H, N, K), cpu)?;
    let p = params(&layer);
    // Make expert IDLE unattractive: logit − 30 means p ≈ e⁻³⁰, never among the top 2 of 4.
    let mut bias = vec![0.0f32; N];
    bias[IDLE] = -30.0;
    param(&p, "router.bias")?.set(Tensor::from_f32(bias, &[N], cpu)?.with_grad()?)?;
    let x = Tensor::rand_uniform(&[T, D], 3, DType::F32, cpu)?.add_scalar(-0.5)?;

    // 1. The hand-built sparse layer, and its gradients.
    let y_sparse = sparse_moe(&p, &x)?;
    y_sparse.mul(&y_sparse)?.mean_all()?.backward()?;
    let g_sparse = take_grads(&p)?;
    println!(
        "hand-built sparse layer: y[0] = {:?}",
        &y_sparse.to_vec_f64()?[..D]
    );
    // What the router learns from the task loss: nonzero for K = 2; with K = 1 the renormalised
    // gate is identically 1 and the router gets nothing but rounding (the chapter's "Try it").
    let largest = |name: &str| g_sparse[name].iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let (router_w, router_b) = (largest("router.weight"), largest("router.bias"));
    println!("router gradient: max |∂L/∂W_r| = {router_w:.3e}, max |∂L/∂b_r| = {router_b:.3e}");
    assert!(
        if K == 1 {
            router_w < 1e-9 && router_b < 1e-9
        } else {
            router_w > 0.0 && router_b > 0.0
        },
        "router gradient with K = {K}: {router_w:e}, {router_b:e}"
    );

    // 2. The same layer, dense and masked: same output, same gradients, and expert IDLE's
    // gradient is exactly zero even though it ran on every token: ∂L/∂f_IDLE = g_IDLE·∂L/∂y and
    // g_IDLE = 0 exactly (not a small number: a zero that was never written).
    let y_dense = dense_masked_moe(&p, &x)?;
    y_dense.mul(&y_dense)?.mean_all()?.backward()?;
    let g_dense = take_grads(&p)?;
    assert_close(
        "y (sparse vs dense)",
        &y_sparse.to_vec_f64()?,
        &y_dense.to_vec_f64()?,
        1e-5,
    );
    for name in ["experts.w1", "experts.b1", "experts.w2", "experts.b2"] {
        assert_close(name, &g_sparse[name], &g_dense[name], 1e-5);
        for grads in [&g_sparse, &g_dense] {
            let idle = expert_part(&grads[name], IDLE);
            assert!(
                idle.iter().all(|&v| v == 0.0),
                "{name} of the idle expert: {idle:?}"
            );
        }
        for e in (0..N).filter(|&e| e != IDLE) {
            let part = expert_part(&g_sparse[name], e);
            assert!(
                part.iter().any(|&v| v != 0.0),
                "{name} of expert {e} is all zero"
            );
        }
    }
    println!("expert {IDLE} was chosen by no token: its gradient is exactly 0 (sparse and dense)");
    // The router's logit of the idle expert: with renormalised top-k, g does not depend on
    // o_IDLE at all, so ∂L/∂b_IDLE is 0 up to rounding (the softmax's terms cancel).
    let b_idle = g_sparse["router.bias"][IDLE];
    assert!(b_idle.abs() < 1e-9, "∂L/∂b_idle = {b_idle}");
    println!("∂L/∂b_{IDLE} = {b_idle:e} (0 up to rounding)");

    // 3. The library's layer with the same weights: the same output and gradients.
    layer.set_training(false);
    let out = layer.forward(&x)?;
    out.y.mul(&out.y)?.mean_all()?.backward()?;
    let g_layer = take_grads(&p)?;
    assert_close(
        "y (hand vs MoeLayer)",
        &y_sparse.to_vec_f64()?,
        &out.y.to_vec_f64()?,
        1e-5,
    );
    for (name, g) in &g_layer {
        assert_close(
            &format!("∂L/∂{name} (hand vs MoeLayer)"),
            &g_sparse[name],
            g,
            1e-4,
        );
    }
    let load = out.stats.read()?.expert_load;
    assert_eq!(
        load[IDLE], 0.0,
        "MoeLayer routed tokens to the idle expert: {load:?}"
    );
    println!("MoeLayer agrees with the hand-built layer; expert load {load:.3?}");

    println!("tutorial_03_moe_by_hand: all checks passed");
    Ok(())
}
