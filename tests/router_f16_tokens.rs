//! A router under mixed precision reads the f16 tokens where they are (selective precision
//! without the casts, `src/backend/gpu/matmul_build.rs`): inside `full_precision` an f16
//! activation times a 2-D f32 weight is an f32 product (the f16-elements build of the product
//! kernels), the weight's gradient is f32 from the f16 tokens (the same build) and the tokens'
//! gradient is stored in f16 straight from the f32 product (the f16-output build).
//!
//! * the product: y, the weight's gradient and the tokens' gradient to the bit of casting the
//!   tokens up first and the f32 gradient down after, under the plain, wide and `auto` kernels
//!   (split-k for the weight's gradient), with and without a bias; and which kernels ran: the
//!   two new builds and no cast;
//! * every router whose `reads_tokens_only_through_products` is true: handed f16 tokens by
//!   `route_in_f32`, its routing (experts, weights, probabilities, logits) and every gradient
//!   (the tokens', the router's parameters') are the bits of routing the tokens cast to f32,
//!   with no cast in its forward; the others still route f16 tokens, cast up first;
//! * outside a scope an f16·f32 product is still an error.
//!
//! Skipped with a printed reason without an adapter unless `MOEGRAD_REQUIRE_GPU=1`.

mod common;
#[path = "common/f16_checks.rs"]
mod f16_checks;

use f16_checks::{f16_gpu, f16_values, kernels_run};
use moegrad::gpu::MatmulKernel;
use moegrad::moe::{ROUTER_NAMES, Router, RouterConfig, build_router, route_in_f32};
use moegrad::{DType, Device, Error, Tensor, autocast_f16, full_precision};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::Mutex;

/// The tests here choose the matmul kernel (a process-wide setting) and read profiles: one at
/// a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// `a` and `b` have the same bits, element by element.
fn assert_bits(what: &str, a: &Tensor, b: &Tensor) {
    assert_eq!(a.dtype(), b.dtype(), "{what}: dtypes");
    assert_eq!(a.shape(), b.shape(), "{what}: shapes");
    let (a, b) = (a.to_vec_f64().unwrap(), b.to_vec_f64().unwrap());
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(
            x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()),
            "{what}[{i}]: {x} vs {y}"
        );
    }
}

/// `[y, dx, dw, db]` of `x16·w (+ b)` inside `full_precision` for the upstream gradient `up`,
/// with the tokens read where they are (`direct`) or cast to f32 first.
fn product(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    up: &Tensor,
    direct: bool,
) -> [Option<Tensor>; 4] {
    let x16 = x.to_dtype(DType::F16).unwrap();
    let y = full_precision(|| {
        let xin = if direct {
            x16.clone()
        } else {
            x16.to_dtype(DType::F32).unwrap()
        };
        match b {
            Some(b) => xin.matmul_bias(w, b).unwrap(),
            None => xin.matmul(w).unwrap(),
        }
    });
    assert_eq!(y.dtype(), DType::F32, "a product in a full-precision scope");
    y.backward_with(up).unwrap();
    let grads = [x.grad(), w.grad(), b.and_then(Tensor::grad)];
    for t in [x, w].into_iter().chain(b) {
        t.zero_grad();
    }
    let [gx, gw, gb] = grads;
    [Some(y), gx, gw, gb]
}

#[test]
fn f16_tokens_times_f32_weights_are_the_f32_products_bits() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(gpu) = f16_gpu("f16_tokens_times_f32_weights_are_the_f32_products_bits") else {
        return;
    };
    let before = moegrad::gpu::matmul_kernel().unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(47);
    // one element; a router's shape (k = d, few experts); wide tiles; a long reduction for the
    // weight's gradient (600 rows: split-k under auto); random shapes
    let mut shapes = vec![(1, 1, 1), (96, 24, 8), (130, 20, 140), (600, 40, 30)];
    for _ in 0..3 {
        shapes.push((
            rng.random_range(1..=200),
            rng.random_range(1..=80),
            rng.random_range(1..=70),
        ));
    }
    let leaf = |v: Vec<f32>, shape: &[usize]| {
        Tensor::from_f32(v, shape, gpu)
            .unwrap()
            .with_grad()
            .unwrap()
    };
    for kernel in [MatmulKernel::Plain, MatmulKernel::Wide, MatmulKernel::Auto] {
        moegrad::gpu::set_matmul_kernel(kernel).unwrap();
        for &(t, d, n) in &shapes {
            for with_bias in [false, true] {
                let what = format!("[{t}, {d}]·[{d}, {n}] bias {with_bias} under {kernel:?}");
                let x = leaf(f16_values(t * d, &mut rng), &[t, d]);
                let w = leaf(
                    (0..d * n).map(|_| rng.random_range(-1.0f32..1.0)).collect(),
                    &[d, n],
                );
                let b = with_bias.then(|| {
                    leaf(
                        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect(),
                        &[n],
                    )
                });
                let up = Tensor::from_f32(
                    (0..t * n).map(|_| rng.random_range(-1.0f32..1.0)).collect(),
                    &[t, n],
                    gpu,
                )
                .unwrap();
                let mut ran = Vec::new();
                let direct = {
                    let got = kernels_run(|| ran.push(product(&x, &w, b.as_ref(), &up, true)));
                    (ran.pop().unwrap(), got)
                };
                let cast = product(&x, &w, b.as_ref(), &up, false);
                for (i, name) in ["y", "dx", "dw", "db"].iter().enumerate() {
                    match (&direct.0[i], &cast[i]) {
                        (Some(a), Some(c)) => assert_bits(&format!("{what}: {name}"), a, c),
                        (None, None) => {}
                        (a, c) => panic!("{what}: {name} is {a:?} one way and {c:?} the other"),
                    }
                }
                // the casts: x to f16 and its gradient back to the f32 leaf, and no other
                let casts: Vec<&String> =
                    direct.1.iter().filter(|k| k.starts_with("half.")).collect();
                assert_eq!(casts.len(), 2, "{what}: casts {:?}", direct.1);
                let prefix = if kernel == MatmulKernel::Wide {
                    "matmul_wide_f16_"
                } else {
                    "matmul_f16_"
                };
                for build in ["elements", "output"] {
                    assert!(
                        direct
                            .1
                            .iter()
                            .any(|k| k.starts_with(&format!("{prefix}{build}."))),
                        "{what}: the f16-{build} build did not run: {:?}",
                        direct.1
                    );
                }
            }
        }
    }
    moegrad::gpu::set_matmul_kernel(before).unwrap();
    // outside a scope, and with a batched weight, f16 times f32 stays an error
    let h = Tensor::from_f32(vec![1.0; 6], &[2, 3], gpu)
        .and_then(|x| x.to_dtype(DType::F16))
        .unwrap();
    let w = Tensor::from_f32(vec![1.0; 6], &[3, 2], gpu).unwrap();
    assert!(matches!(h.matmul(&w), Err(Error::DType(_))));
    let w3 = Tensor::from_f32(vec![1.0; 12], &[2, 3, 2], gpu).unwrap();
    let h3 = h.reshape(&[1, 2, 3]).unwrap().expand(&[2, 2, 3]).unwrap();
    assert!(matches!(
        full_precision(|| h3.matmul(&w3)),
        Err(Error::DType(_))
    ));
}

/// Two routers `name` built alike (the same seed, so the same weights and noise).
fn twin_routers(name: &str, cfg: &RouterConfig, gpu: Device) -> (Box<dyn Router>, Box<dyn Router>) {
    (
        build_router(name, cfg, gpu).unwrap(),
        build_router(name, cfg, gpu).unwrap(),
    )
}

/// The router's parameters' gradients, by name.
fn param_grads(r: &dyn Router) -> Vec<(String, Option<Tensor>)> {
    let mut out = Vec::new();
    r.visit_params("", &mut |name, p| out.push((name, p.grad())));
    out
}

/// Routes `x` (an f32 leaf of f16 values) in mixed precision through `route`, and backpropagates
/// a fixed mix of the weights, probabilities and logits; returns the routing's tensors, the
/// kernels its forward ran, and the tokens' gradient (none where the router passes none back).
fn route_and_backward(
    r: &dyn Router,
    x: &Tensor,
    via_route_in_f32: bool,
    seed: u64,
) -> (Vec<Tensor>, Vec<String>, Option<Tensor>) {
    let x16 = x.to_dtype(DType::F16).unwrap();
    let mut routing = None;
    let ran = kernels_run(|| {
        routing = Some(autocast_f16(|| {
            if via_route_in_f32 {
                route_in_f32(r, &x16).unwrap()
            } else {
                full_precision(|| r.route(&x16.to_dtype(DType::F32).unwrap()).unwrap())
            }
        }))
    });
    let routing = routing.unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut term = |t: &Tensor| {
        let t = t.to_dtype(DType::F32).unwrap();
        let c: Vec<f32> = (0..t.numel())
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let c = Tensor::from_f32(c, t.shape(), x.device()).unwrap();
        t.mul(&c).unwrap().sum_all().unwrap()
    };
    let mut loss = term(&routing.weight)
        .add(&term(&routing.probs))
        .unwrap()
        .add(&term(&routing.logits))
        .unwrap();
    if let Some(aux) = &routing.aux_loss {
        loss = loss.add(&aux.to_dtype(DType::F32).unwrap()).unwrap();
    }
    // (a router that reads no gradient from its tokens, such as hash routing, has none)
    if loss.requires_grad() {
        loss.backward().unwrap();
    }
    let gx = x.grad();
    x.zero_grad();
    let tensors = vec![
        routing.token.clone(),
        routing.expert.clone(),
        routing.weight.detach(),
        routing.valid.clone(),
        routing.probs.detach(),
        routing.logits.detach(),
    ];
    (tensors, ran, gx)
}

#[test]
fn routers_read_f16_tokens_to_the_bits_of_f32_tokens() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(gpu) = f16_gpu("routers_read_f16_tokens_to_the_bits_of_f32_tokens") else {
        return;
    };
    let (t, d) = (48, 24);
    let mut rng = ChaCha8Rng::seed_from_u64(53);
    let x = Tensor::from_f32(f16_values(t * d, &mut rng), &[t, d], gpu)
        .unwrap()
        .with_grad()
        .unwrap();
    let cfg = RouterConfig::new(d, 8, 2);
    let mut direct_routers = 0;
    for &name in ROUTER_NAMES {
        let (a, b) = twin_routers(name, &cfg, gpu);
        let (got, ran, gx) = route_and_backward(a.as_ref(), &x, true, 7);
        let (want, ran_cast, gx_cast) = route_and_backward(b.as_ref(), &x, false, 7);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_bits(&format!("{name}: routing tensor {i}"), g, w);
        }
        match (&gx, &gx_cast) {
            (Some(g), Some(w)) => assert_bits(&format!("{name}: the tokens' gradient"), g, w),
            (None, None) => assert!(!a.reads_tokens_only_through_products(), "{name}"),
            _ => panic!("{name}: the tokens have a gradient one way only"),
        }
        for ((pn, g), (_, w)) in param_grads(a.as_ref()).iter().zip(param_grads(b.as_ref())) {
            match (g, &w) {
                (Some(g), Some(w)) => assert_bits(&format!("{name}: {pn}'s gradient"), g, w),
                (None, None) => {}
                _ => panic!("{name}: {pn} has a gradient one way only"),
            }
        }
        let casts = |k: &[String]| k.iter().filter(|k| k.starts_with("half.")).count();
        assert!(
            casts(&ran_cast) >= 1,
            "{name}: the cast path ran no cast: {ran_cast:?}"
        );
        if a.reads_tokens_only_through_products() {
            direct_routers += 1;
            assert_eq!(casts(&ran), 0, "{name}: a cast in the forward: {ran:?}");
            assert!(
                ran.iter().any(|k| k.contains("f16_elements.")),
                "{name}: no product read the f16 tokens: {ran:?}"
            );
        } else {
            assert!(
                casts(&ran) >= 1,
                "{name}: the tokens were not cast up: {ran:?}"
            );
        }
    }
    assert!(
        direct_routers >= 10,
        "only {direct_routers} routers read f16 tokens directly"
    );
}
