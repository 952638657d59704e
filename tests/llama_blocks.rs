//! The ops of Llama-style blocks composed from existing ones: `Tensor::swiglu`, the rotary
//! position embedding (`nn::Rotary`) and grouped-query attention (`nn::GroupedQueryAttention`),
//! each checked against finite differences in f64, against an f64 reference written from its
//! definition with plain loops, and on the GPU against the CPU over random shapes (skipped with a
//! printed reason without an adapter unless `MOEGRAD_REQUIRE_GPU=1`). Whole models are checked
//! against transformers' own logits in `tests/hf_parity.rs`.

mod common;

use moegrad::gradcheck::{GradcheckOptions, gradcheck};
use moegrad::nn::{GroupedQueryAttention, Linear, Rotary};
use moegrad::{DType, Device, Tensor};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn values(n: usize, seed: u64) -> Vec<f64> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|_| rng.random_range(-2.0..2.0f64) as f32 as f64)
        .collect()
}

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

#[test]
fn swiglu_gradcheck_and_definition() {
    for (i, shape) in [vec![1, 2], vec![3, 8], vec![2, 3, 10]].iter().enumerate() {
        let n: usize = shape.iter().product();
        let x = common::f64t(&values(n, i as u64), shape);
        gradcheck(
            |t| t[0].swiglu(),
            std::slice::from_ref(&x),
            &GradcheckOptions::default(),
        )
        .unwrap_or_else(|e| panic!("{shape:?}: {e}"));
        let h = shape[shape.len() - 1] / 2;
        let xv = x.to_vec_f64().unwrap();
        let want: Vec<f64> = xv
            .chunks(2 * h)
            .flat_map(|row| (0..h).map(move |j| silu(row[j]) * row[h + j]))
            .collect();
        let got = x.swiglu().unwrap().to_vec_f64().unwrap();
        common::assert_close(&format!("swiglu {shape:?}"), &got, &want, 1e-12, 1e-12);
    }
    let odd = Tensor::zeros(&[2, 3], DType::F32, Device::cpu()).unwrap();
    assert!(odd.swiglu().is_err(), "an odd last axis is an error");
}

/// `silu'(x)` from the definition `x·σ(x)`.
fn silu_slope(x: f64) -> f64 {
    let s = 1.0 / (1.0 + (-x).exp());
    s * (1.0 + x * (1.0 - s))
}

/// `f(x)` and the gradient of `sum(f(x))` with respect to `x`, both read back as f64.
fn value_and_gradient(
    data: Vec<f32>,
    shape: &[usize],
    dev: Device,
    f: impl Fn(&Tensor) -> Tensor,
) -> (Vec<f64>, Vec<f64>) {
    let x = Tensor::from_f32(data, shape, dev)
        .unwrap()
        .with_grad()
        .unwrap();
    let y = f(&x);
    y.sum_all().unwrap().backward().unwrap();
    (
        y.to_vec_f64().unwrap(),
        x.grad().unwrap().to_vec_f64().unwrap(),
    )
}

/// In f32 on the CPU, `silu` and `swiglu` keep the slope from the forward pass (one exponential
/// for value and slope, `fast_math`); their values and gradients against the f64 definition,
/// over ordinary values and the extremes where σ saturates (±30, ±100, ±1e30).
#[test]
fn f32_silu_and_swiglu_with_the_kept_slope_match_the_f64_definition() {
    let mut xs: Vec<f64> = values(2 * 1000, 7).iter().map(|v| v * 4.0).collect();
    xs.extend([
        -1e30, -100.0, -30.0, -1e-20, 0.0, 1e-20, 30.0, 100.0, 1e30, 3.5,
    ]);
    let n = xs.len();
    let up: Vec<f64> = values(n, 8);
    let dev = Device::cpu();
    // silu: y and dy/dx (the gradient of sum(y))
    let (got_y, got_g) =
        value_and_gradient(xs.iter().map(|&v| v as f32).collect(), &[n], dev, |x| {
            x.silu().unwrap()
        });
    for i in 0..n {
        let v = xs[i] as f32 as f64;
        let (wy, wg) = (silu(v), silu_slope(v));
        assert!(
            (got_y[i] - wy).abs() <= 1e-6 * (1.0 + wy.abs()),
            "silu({v}) = {} not {wy}",
            got_y[i]
        );
        assert!(
            (got_g[i] - wg).abs() <= 1e-6 * (1.0 + wg.abs()),
            "silu'({v}) = {} not {wg}",
            got_g[i]
        );
    }
    // swiglu on rows [a | b]: y = silu(a)·b, d/da = b·silu'(a), d/db = silu(a)
    let rows: Vec<f32> = xs
        .iter()
        .zip(&up)
        .flat_map(|(&a, &b)| [a as f32, b as f32])
        .collect();
    // [n, 2] with gate column 0 and up column 1
    let (got_y, got_g) = value_and_gradient(rows, &[n, 2], dev, |x| x.swiglu().unwrap());
    for i in 0..n {
        let (a, b) = (xs[i] as f32 as f64, up[i] as f32 as f64);
        let want = [silu(a) * b, b * silu_slope(a), silu(a)];
        let got = [got_y[i], got_g[2 * i], got_g[2 * i + 1]];
        for (what, (g, w)) in ["y", "d/da", "d/db"].iter().zip(got.iter().zip(want)) {
            assert!(
                (g - w).abs() <= 1e-6 * (1.0 + w.abs()),
                "swiglu {what} at a = {a}, b = {b}: {g} not {w}"
            );
        }
    }
}

/// RoPE from the definition: columns `i` and `i + h` of position `p` turned together by
/// `p·θ_i`, `θ_i = theta^(−2i/Dh)` (computed in f64 here; the tables are f32 as transformers').
fn rope_reference(x: &[f64], t: usize, dh: usize, theta: f64) -> Vec<f64> {
    let h = dh / 2;
    let mut out = x.to_vec();
    for (row, chunk) in x.chunks(dh).enumerate() {
        let p = (row % t) as f64;
        for i in 0..h {
            let a = p * theta.powf(-2.0 * i as f64 / dh as f64);
            let (c, s) = (a.cos(), a.sin());
            out[row * dh + i] = chunk[i] * c - chunk[i + h] * s;
            out[row * dh + i + h] = chunk[i + h] * c + chunk[i] * s;
        }
    }
    out
}

#[test]
fn rotary_gradcheck_and_definition() {
    let cpu = Device::cpu();
    for (i, &(b, heads, t, dh, theta)) in [
        (1, 1, 1, 2, 10_000.0),
        (2, 3, 5, 8, 10_000.0),
        (1, 2, 7, 6, 500.0),
    ]
    .iter()
    .enumerate()
    {
        let rope = Rotary::new(dh, 8, theta, cpu).unwrap();
        let shape = [b, heads, t, dh];
        let x = common::f64t(&values(b * heads * t * dh, 10 + i as u64), &shape);
        gradcheck(
            |v| rope.apply(&v[0]),
            std::slice::from_ref(&x),
            &GradcheckOptions::default(),
        )
        .unwrap_or_else(|e| panic!("{shape:?}: {e}"));
        let got = rope.apply(&x).unwrap().to_vec_f64().unwrap();
        let want = rope_reference(&x.to_vec_f64().unwrap(), t, dh, theta);
        // the tables are f32 (as transformers'): agreement to f32 rounding
        common::assert_close(&format!("rope {shape:?}"), &got, &want, 1e-5, 1e-5);
    }
    assert!(Rotary::new(3, 4, 1e4, cpu).is_err(), "odd head width");
    let rope = Rotary::new(4, 2, 1e4, cpu).unwrap();
    let long = Tensor::zeros(&[1, 1, 3, 4], DType::F32, cpu).unwrap();
    assert!(rope.apply(&long).is_err(), "more positions than the tables");
}

/// Causal attention from the definition, with query head `i` reading kv head `i / (H/G)`.
fn gqa_reference(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    (b, t, h, g, dh): (usize, usize, usize, usize, usize),
) -> Vec<f64> {
    // q [b, t, h, dh], k and v [b, t, g, dh] (the projections' layouts); out [b, t, h, dh]
    let mut out = vec![0.0; b * t * h * dh];
    for bi in 0..b {
        for hi in 0..h {
            let gi = hi / (h / g);
            for i in 0..t {
                let qi = &q[((bi * t + i) * h + hi) * dh..][..dh];
                let scores: Vec<f64> = (0..=i)
                    .map(|j| {
                        let kj = &k[((bi * t + j) * g + gi) * dh..][..dh];
                        qi.iter().zip(kj).map(|(a, c)| a * c).sum::<f64>() / (dh as f64).sqrt()
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = scores.iter().map(|s| (s - m).exp()).sum();
                for (j, s) in scores.iter().enumerate() {
                    let w = (s - m).exp() / z;
                    let vj = &v[((bi * t + j) * g + gi) * dh..][..dh];
                    for c in 0..dh {
                        out[((bi * t + i) * h + hi) * dh + c] += w * vj[c];
                    }
                }
            }
        }
    }
    out
}

fn identity_linear(width: usize, dtype: DType, device: Device) -> Linear {
    let mut eye = vec![0.0; width * width];
    for i in 0..width {
        eye[i * width + i] = 1.0;
    }
    Linear {
        weight: moegrad::nn::Param::new(common::tensor_on(eye, &[width, width], dtype, device))
            .unwrap(),
        bias: None,
    }
}

/// An attention whose q projection reads the first `h·dh` columns of its input, k the next
/// `g·dh` and v the last `g·dh` (selection matrices), with the identity as output projection,
/// so the reference can be fed the input's slices directly (rotating q and k itself).
fn selecting(
    (h, g, dh): (usize, usize, usize),
    dtype: DType,
    device: Device,
) -> GroupedQueryAttention {
    let width = (h + 2 * g) * dh;
    let select = |from: usize, n: usize| {
        let mut w = vec![0.0; width * n];
        for c in 0..n {
            w[(from + c) * n + c] = 1.0;
        }
        Linear {
            weight: moegrad::nn::Param::new(common::tensor_on(w, &[width, n], dtype, device))
                .unwrap(),
            bias: None,
        }
    };
    GroupedQueryAttention {
        q: select(0, h * dh),
        k: select(h * dh, g * dh),
        v: select((h + g) * dh, g * dh),
        o: identity_linear(h * dh, dtype, device),
        heads: h,
        kv_heads: g,
        q_norm: None,
        k_norm: None,
    }
}

#[test]
fn grouped_query_attention_matches_the_definition() {
    let cpu = Device::cpu();
    for (i, &(b, t, h, g, dh)) in [(1, 3, 2, 1, 2), (2, 5, 4, 2, 4), (1, 4, 3, 3, 2)]
        .iter()
        .enumerate()
    {
        let attn = selecting((h, g, dh), DType::F64, cpu);
        let rope = Rotary::new(dh, 8, 1e4, cpu).unwrap();
        let width = (h + 2 * g) * dh;
        let xv = values(b * t * width, 20 + i as u64);
        let x = common::f64t(&xv, &[b * t, width]);
        let got = attn.forward(&x, b, t, &rope).unwrap().to_vec_f64().unwrap();
        // the reference: slices of x as q, k, v, q and k rotated per head
        let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
        for row in xv.chunks(width) {
            q.extend_from_slice(&row[..h * dh]);
            k.extend_from_slice(&row[h * dh..(h + g) * dh]);
            v.extend_from_slice(&row[(h + g) * dh..]);
        }
        // rotate: rows of q are [b, t, h, dh]; rope_reference wants position = row % t over
        // [.., t, dh], so rotate head by head
        let rotate = |m: &[f64], heads: usize| -> Vec<f64> {
            let mut out = m.to_vec();
            for bi in 0..b {
                for hi in 0..heads {
                    let rows: Vec<f64> = (0..t)
                        .flat_map(|ti| m[((bi * t + ti) * heads + hi) * dh..][..dh].to_vec())
                        .collect();
                    let r = rope_reference(&rows, t, dh, 1e4);
                    for ti in 0..t {
                        out[((bi * t + ti) * heads + hi) * dh..][..dh]
                            .copy_from_slice(&r[ti * dh..(ti + 1) * dh]);
                    }
                }
            }
            out
        };
        let want = gqa_reference(&rotate(&q, h), &rotate(&k, g), &v, (b, t, h, g, dh));
        common::assert_close(&format!("gqa {i}"), &got, &want, 1e-5, 1e-5);
        // and the gradient of every projection against finite differences
        gradcheck(
            |v| attn.forward(&v[0], b, t, &rope),
            std::slice::from_ref(&x),
            &GradcheckOptions::default(),
        )
        .unwrap_or_else(|e| panic!("gqa {i}: {e}"));
    }
}

#[test]
fn gpu_matches_cpu() {
    let Some(gpu) = common::gpu_or_skip("llama blocks on the GPU") else {
        return;
    };
    let cpu = Device::cpu();
    for (i, &(b, t, h, g, dh)) in [(1, 3, 2, 1, 2), (2, 9, 4, 2, 8), (3, 16, 6, 3, 16)]
        .iter()
        .enumerate()
    {
        let width = (h + 2 * g) * dh;
        let xv = values(b * t * width, 40 + i as u64);
        let run = |device: Device| -> (Vec<f64>, Vec<f64>) {
            let attn = selecting((h, g, dh), DType::F32, device);
            let rope = Rotary::new(dh, 16, 1e4, device).unwrap();
            let x = common::tensor_on(xv.clone(), &[b * t, width], DType::F32, device)
                .with_grad()
                .unwrap();
            let y = attn.forward(&x, b, t, &rope).unwrap().swiglu().unwrap();
            y.sum_all().unwrap().backward().unwrap();
            (
                y.to_vec_f64().unwrap(),
                x.grad().unwrap().to_vec_f64().unwrap(),
            )
        };
        let (y_gpu, dx_gpu) = run(gpu);
        let (y_cpu, dx_cpu) = run(cpu);
        common::assert_close(&format!("case {i}: output"), &y_gpu, &y_cpu, 1e-5, 1e-4);
        common::assert_close(&format!("case {i}: dx"), &dx_gpu, &dx_cpu, 1e-4, 1e-3);
    }
}

/// The fused SwiGLU and rotary primitives on the GPU against the CPU over random shapes (odd
/// widths, a single row, sequences shorter than the tables), forward and backward with a random
/// upstream gradient. The folded grids are in the backend's own tests (`folded_llama_kernels`).
#[test]
fn swiglu_and_rotary_gpu_parity_over_random_shapes() {
    let Some(gpu) = common::gpu_or_skip("swiglu and rotary on the GPU") else {
        return;
    };
    let cpu = Device::cpu();
    let mut rng = ChaCha8Rng::seed_from_u64(29);
    // y = f(x), then (y ⊙ w).sum() backward: (y, dx) on one device
    let run = |f: &dyn Fn(&Tensor) -> Tensor, xv: &[f64], shape: &[usize], wv: &[f64], device| {
        let x = common::tensor_on(xv.to_vec(), shape, DType::F32, device)
            .with_grad()
            .unwrap();
        let y = f(&x);
        let w = common::tensor_on(wv.to_vec(), y.shape(), DType::F32, device);
        y.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
        (
            y.to_vec_f64().unwrap(),
            x.grad().unwrap().to_vec_f64().unwrap(),
        )
    };
    for case in 0..12u64 {
        let (rows, half) = (rng.random_range(1..40usize), rng.random_range(1..70usize));
        let xv = values(rows * 2 * half, 100 + case);
        let wv = values(rows * half, 200 + case);
        let swiglu = |x: &Tensor| x.swiglu().unwrap();
        let (y_gpu, dx_gpu) = run(&swiglu, &xv, &[rows, 2 * half], &wv, gpu);
        let (y_cpu, dx_cpu) = run(&swiglu, &xv, &[rows, 2 * half], &wv, cpu);
        let what = format!("swiglu [{rows}, 2·{half}]");
        common::assert_close(&format!("{what}: y"), &y_gpu, &y_cpu, 1e-5, 1e-5);
        common::assert_close(&format!("{what}: dx"), &dx_gpu, &dx_cpu, 1e-5, 1e-5);

        let (b, heads) = (rng.random_range(1..4usize), rng.random_range(1..4usize));
        let (t, dh) = (
            rng.random_range(1..20usize),
            2 * rng.random_range(1..20usize),
        );
        let block = t + rng.random_range(0..5usize);
        let shape = [b, heads, t, dh];
        let n = b * heads * t * dh;
        let (xv, wv) = (values(n, 300 + case), values(n, 400 + case));
        let rotate = |device| {
            let rope = Rotary::new(dh, block, 1e4, device).unwrap();
            move |x: &Tensor| rope.apply(x).unwrap()
        };
        let (y_gpu, dx_gpu) = run(&rotate(gpu), &xv, &shape, &wv, gpu);
        let (y_cpu, dx_cpu) = run(&rotate(cpu), &xv, &shape, &wv, cpu);
        let what = format!("rotary {shape:?} of {block} positions");
        common::assert_close(&format!("{what}: y"), &y_gpu, &y_cpu, 1e-5, 1e-5);
        common::assert_close(&format!("{what}: dx"), &dx_gpu, &dx_cpu, 1e-5, 1e-5);
    }
}
