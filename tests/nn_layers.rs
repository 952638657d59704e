//! The layers of `nn` and the ops behind them (conv2d, max/avg pooling, layer norm, embedding
//! lookup, dropout with a fixed mask): gradcheck in f64 on the CPU over random shapes, and GPU
//! parity (f32 on the GPU against f64 on the CPU) of forward values and input gradients.

mod common;

use moegrad::gradcheck::{GradcheckOptions, gradcheck};
use moegrad::nn::{Conv2d, Embedding, Init, LayerNorm, Linear, Module};
use moegrad::{DType, Device, Result, Tensor};
use proptest::prelude::*;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn random(shape: &[usize], seed: u64) -> Tensor {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let n = shape.iter().product();
    common::f64t(
        &(0..n)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect::<Vec<_>>(),
        shape,
    )
}

/// Distinct values (gaps ≥ 0.01) in random order, so max-pooling windows have no ties.
fn distinct(shape: &[usize], seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let mut v: Vec<f64> = (0..n).map(|i| i as f64 * 0.01 - n as f64 * 0.005).collect();
    use rand::seq::SliceRandom;
    v.shuffle(&mut ChaCha8Rng::seed_from_u64(seed));
    common::f64t(&v, shape)
}

fn check(f: impl Fn(&[Tensor]) -> Result<Tensor>, inputs: &[Tensor]) {
    if let Err(e) = gradcheck(f, inputs, &GradcheckOptions::default()) {
        panic!("{e}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    #[test]
    fn conv2d_gradcheck(b in 1usize..3, c in 1usize..3, oc in 1usize..3, h in 3usize..7, w in 3usize..7,
                        k in 1usize..4, stride in 1usize..3, pad in 0usize..2, seed in 0u64..1000) {
        prop_assume!(k <= h + 2 * pad && k <= w + 2 * pad);
        let x = random(&[b, c, h, w], seed);
        let wt = random(&[oc, c, k, k], seed + 1);
        let bias = random(&[oc], seed + 2);
        check(|t| t[0].conv2d(&t[1], Some(&t[2]), stride, pad), &[x, wt, bias]);
    }

    #[test]
    fn pools_gradcheck(b in 1usize..3, c in 1usize..3, h in 2usize..7, w in 2usize..7, k in 1usize..3, stride in 1usize..3, seed in 0u64..1000) {
        prop_assume!(k <= h && k <= w);
        let x = distinct(&[b, c, h, w], seed);
        check(|t| t[0].max_pool2d(k, stride), std::slice::from_ref(&x));
        check(|t| t[0].avg_pool2d(k, stride), &[x]);
    }

    #[test]
    fn layer_norm_gradcheck(rows in 1usize..4, dim in 2usize..6, seed in 0u64..1000) {
        let x = random(&[rows, dim], seed);
        let g = random(&[dim], seed + 1);
        let b = random(&[dim], seed + 2);
        check(|t| t[0].layer_norm(&t[1], &t[2], 1e-5), &[x, g, b]);
    }

    #[test]
    fn embedding_gradcheck(num in 1usize..6, dim in 1usize..4, len in 1usize..6, seed in 0u64..1000) {
        let table = random(&[num, dim], seed);
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let ids: Vec<i32> = (0..len).map(|_| rng.random_range(0..num as i32)).collect();
        let idx = Tensor::from_i32(ids, &[len], Device::cpu()).unwrap();
        check(|t| t[0].index_select(0, &idx), &[table]);
    }

    #[test]
    fn dropout_gradcheck_fixed_mask(n in 1usize..20, p in 0.0f64..0.9, seed in 0u64..1000) {
        let x = random(&[n], seed);
        check(|t| t[0].dropout(p, seed), &[x]);
    }
}

#[test]
fn dropout_mask_has_the_right_rate_and_scale() {
    let x = Tensor::ones(&[20000], DType::F32, Device::cpu()).unwrap();
    let y = x.dropout(0.25, 7).unwrap().to_vec_f64().unwrap();
    let kept = y.iter().filter(|&&v| v != 0.0).count() as f64 / y.len() as f64;
    // Binomial(20000, 0.75): standard error 0.0031; allow 5 of them.
    assert!((kept - 0.75).abs() < 0.016, "kept fraction {kept}");
    assert!(y.iter().all(|&v| v == 0.0 || (v - 1.0 / 0.75).abs() < 1e-6));
    // Same seed, same mask; another seed, another mask.
    assert_eq!(x.dropout(0.25, 7).unwrap().to_vec_f64().unwrap(), y);
    assert_ne!(x.dropout(0.25, 8).unwrap().to_vec_f64().unwrap(), y);
}

#[test]
fn conv2d_matches_a_direct_loop() {
    let (b, c, h, w, oc, k, stride, pad) = (2, 3, 7, 6, 4, 3, 2, 1);
    let x = random(&[b, c, h, w], 1);
    let wt = random(&[oc, c, k, k], 2);
    let bias = random(&[oc], 3);
    let y = x.conv2d(&wt, Some(&bias), stride, pad).unwrap();
    let (oh, ow) = (
        (h + 2 * pad - k) / stride + 1,
        (w + 2 * pad - k) / stride + 1,
    );
    assert_eq!(y.shape(), &[b, oc, oh, ow]);
    let (xv, wv, bv, yv) = (
        x.to_vec_f64().unwrap(),
        wt.to_vec_f64().unwrap(),
        bias.to_vec_f64().unwrap(),
        y.to_vec_f64().unwrap(),
    );
    for n in 0..b {
        for o in 0..oc {
            for i in 0..oh {
                for j in 0..ow {
                    let mut s = bv[o];
                    for ci in 0..c {
                        for ki in 0..k {
                            for kj in 0..k {
                                let r = (i * stride + ki) as isize - pad as isize;
                                let q = (j * stride + kj) as isize - pad as isize;
                                if r >= 0 && q >= 0 && (r as usize) < h && (q as usize) < w {
                                    s += xv[((n * c + ci) * h + r as usize) * w + q as usize]
                                        * wv[((o * c + ci) * k + ki) * k + kj];
                                }
                            }
                        }
                    }
                    let got = yv[((n * oc + o) * oh + i) * ow + j];
                    assert!((got - s).abs() < 1e-12, "({n},{o},{i},{j}): {got} vs {s}");
                }
            }
        }
    }
}

#[test]
fn layers_reject_bad_shapes() {
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let dev = Device::cpu();
    let lin = Linear::new(4, 3, Init::XavierUniform, &mut rng, dev).unwrap();
    let e = lin
        .forward(&Tensor::zeros(&[2, 5], DType::F32, dev).unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("[2, 5]"), "{e}");
    let conv = Conv2d::new(3, 2, 3, 1, 0, &mut rng, dev).unwrap();
    let e = conv
        .forward(&Tensor::zeros(&[1, 2, 5, 5], DType::F32, dev).unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("[1, 2, 5, 5]") && e.contains("[2, 3, 3, 3]"),
        "{e}"
    );
    let e = conv
        .forward(&Tensor::zeros(&[1, 3, 2, 2], DType::F32, dev).unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("2×2"), "{e}");
    assert!(Conv2d::new(1, 1, 3, 0, 0, &mut rng, dev).is_err());
    let ln = LayerNorm::new(4, dev).unwrap();
    assert!(
        ln.forward(&Tensor::zeros(&[2, 3], DType::F32, dev).unwrap())
            .is_err()
    );
    let emb = Embedding::new(5, 2, &mut rng, dev).unwrap();
    let bad = Tensor::from_i32(vec![0, 5], &[2], dev).unwrap();
    assert!(
        emb.forward(&bad)
            .unwrap_err()
            .to_string()
            .contains("out of range")
    );
    assert!(
        Tensor::zeros(&[3], DType::F32, dev)
            .unwrap()
            .dropout(1.0, 0)
            .is_err()
    );
}

#[test]
fn same_seed_same_model() {
    let build = |seed| {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let l = Linear::new(5, 4, Init::KaimingUniform, &mut rng, Device::cpu()).unwrap();
        l.weight.get().to_vec_f32().unwrap()
    };
    assert_eq!(build(3), build(3));
    assert_ne!(build(3), build(4));
    let w = build(3);
    let bound = (6.0f32 / 5.0).sqrt();
    assert!(w.iter().all(|v| v.abs() <= bound));
}

/// Forward values and input gradients on the GPU (f32) against the CPU (f64).
fn gpu_parity(name: &str, f: impl Fn(&[Tensor]) -> Result<Tensor>, inputs: &[Tensor]) {
    let Some(gpu) = common::gpu_or_skip(name) else {
        return;
    };
    let run = |dev: Device| -> (Vec<f64>, Vec<Vec<f64>>) {
        let xs: Vec<Tensor> = inputs
            .iter()
            .map(|t| {
                let moved = if dev == Device::Cpu {
                    t.detach()
                } else {
                    t.to_device(dev).unwrap()
                };
                moved.with_grad().unwrap()
            })
            .collect();
        let y = f(&xs).unwrap();
        let up = Tensor::from_f64(
            (0..y.numel())
                .map(|i| ((i * 7919) % 13) as f64 / 13.0 - 0.4)
                .collect(),
            y.shape(),
            Device::Cpu,
        )
        .unwrap();
        let up = if dev == Device::Cpu {
            up
        } else {
            up.to_device(dev).unwrap()
        };
        y.backward_with(&up).unwrap();
        (
            y.to_vec_f64().unwrap(),
            xs.iter()
                .map(|x| x.grad().unwrap().to_vec_f64().unwrap())
                .collect(),
        )
    };
    let (cy, cg) = run(Device::Cpu);
    let (gy, gg) = run(gpu);
    common::assert_close(&format!("{name} forward"), &gy, &cy, 1e-4, 1e-3);
    for (i, (g, c)) in gg.iter().zip(&cg).enumerate() {
        common::assert_close(&format!("{name} grad of input {i}"), g, c, 1e-4, 1e-3);
    }
}

#[test]
fn gpu_parity_layers() {
    gpu_parity(
        "conv2d",
        |t| t[0].conv2d(&t[1], Some(&t[2]), 1, 1),
        &[
            random(&[2, 3, 6, 5], 1),
            random(&[4, 3, 3, 3], 2),
            random(&[4], 3),
        ],
    );
    gpu_parity(
        "conv2d stride 2",
        |t| t[0].conv2d(&t[1], None, 2, 0),
        &[random(&[1, 2, 7, 7], 4), random(&[3, 2, 3, 3], 5)],
    );
    gpu_parity(
        "max_pool2d",
        |t| t[0].max_pool2d(2, 2),
        &[distinct(&[2, 3, 6, 6], 6)],
    );
    gpu_parity(
        "avg_pool2d",
        |t| t[0].avg_pool2d(3, 1),
        &[random(&[2, 2, 5, 5], 7)],
    );
    gpu_parity(
        "layer_norm",
        |t| t[0].layer_norm(&t[1], &t[2], 1e-5),
        &[random(&[5, 8], 8), random(&[8], 9), random(&[8], 10)],
    );
    let idx = |dev: Device| Tensor::from_i32(vec![3, 0, 3, 1, 2], &[5], dev).unwrap();
    gpu_parity(
        "embedding",
        |t| t[0].index_select(0, &idx(t[0].device())),
        &[random(&[4, 6], 11)],
    );
    gpu_parity("dropout", |t| t[0].dropout(0.3, 42), &[random(&[64], 12)]);
}
