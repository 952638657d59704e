//! The dedicated convolution and pooling kernels (`Tensor::conv2d`, `grouped_conv2d`,
//! `max_pool2d`, `avg_pool2d` and the `_padded` forms) against finite differences, against the
//! composed im2col path they replaced (`conv2d_unfolded`, `max_pool2d_unfolded`,
//! `avg_pool2d_unfolded`) and across devices:
//!
//! * f64 gradcheck on the CPU over stride 1 and 2, padding 0 and 1, odd sizes and batch 1;
//! * values and gradients equal to the composed path at fixed shapes and over random shapes
//!   (proptest);
//! * the grouped convolution equals one convolution per image with its bank's weight; an image
//!   without a bank gets zeros, and a bank without images exactly zero gradient;
//! * the CPU weight gradient gives identical bits on one thread and on eight;
//! * GPU (f32) against CPU (f64), forward and every gradient, skipped with a printed reason
//!   without an adapter unless `MOEGRAD_REQUIRE_GPU=1`;
//! * bad shapes give an `Error` naming the shapes; zero-sized batches an empty result.

mod common;

use moegrad::gradcheck::{GradcheckOptions, gradcheck};
use moegrad::{DType, Device, Error, Result, Tensor};
use proptest::prelude::*;
use rand::seq::SliceRandom;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// `n` values uniform in `[-1, 1)`, f32-representable, from a fixed seed.
fn values(n: usize, seed: u64) -> Vec<f64> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|_| rng.random_range(-1.0..1.0) as f32 as f64)
        .collect()
}

fn random(shape: &[usize], seed: u64) -> Tensor {
    common::f64t(&values(shape.iter().product(), seed), shape)
}

/// Distinct values (gaps of 1/64, exact in f32) in random order: max-pooling windows have no
/// ties, and a finite-difference step cannot change which element wins.
fn distinct(shape: &[usize], seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let mut v: Vec<f64> = (0..n).map(|i| (i as f64 - n as f64 / 2.0) / 64.0).collect();
    v.shuffle(&mut ChaCha8Rng::seed_from_u64(seed));
    common::f64t(&v, shape)
}

fn check(what: &str, f: impl Fn(&[Tensor]) -> Result<Tensor>, inputs: &[Tensor]) {
    if let Err(e) = gradcheck(f, inputs, &GradcheckOptions::default()) {
        panic!("{what}: {e}");
    }
}

/// Output values and the gradient of every input for the upstream gradient `up`, through `f`.
fn run(
    f: &dyn Fn(&[Tensor]) -> Result<Tensor>,
    inputs: &[Tensor],
    up_seed: u64,
) -> (Vec<f64>, Vec<Vec<f64>>) {
    let leaves: Vec<Tensor> = inputs
        .iter()
        .map(|t| t.detach().with_grad().expect("a float leaf"))
        .collect();
    let y = f(&leaves).expect("forward");
    let g = Tensor::from_f64(values(y.numel(), up_seed), y.shape(), Device::cpu())
        .and_then(|g| g.to_dtype(y.dtype()))
        .and_then(|g| g.to_device(y.device()))
        .expect("upstream gradient");
    y.backward_with(&g).expect("backward");
    let grads = leaves
        .iter()
        .map(|t| t.grad().expect("a gradient").to_vec_f64().unwrap())
        .collect();
    (y.to_vec_f64().unwrap(), grads)
}

/// Asserts `f` and `reference` agree on values and every gradient.
fn assert_same(
    what: &str,
    f: &dyn Fn(&[Tensor]) -> Result<Tensor>,
    reference: &dyn Fn(&[Tensor]) -> Result<Tensor>,
    inputs: &[Tensor],
    tol: f64,
) {
    let (y, grads) = run(f, inputs, 7);
    let (y_ref, grads_ref) = run(reference, inputs, 7);
    common::assert_close(&format!("{what}: output"), &y, &y_ref, tol, tol);
    for (i, (g, r)) in grads.iter().zip(&grads_ref).enumerate() {
        common::assert_close(&format!("{what}: gradient of input {i}"), g, r, tol, tol);
    }
}

/// `(B, C, H, W, OC, KH, KW, stride, padding)` of the fixed-shape tests.
const GEOMETRIES: [[usize; 9]; 6] = [
    [1, 1, 5, 5, 1, 3, 3, 1, 0], // batch 1, one channel
    [2, 3, 7, 6, 4, 3, 3, 2, 1], // stride 2, padding 1, odd and uneven sides
    [1, 2, 6, 5, 3, 2, 3, 1, 1], // a non-square kernel with padding
    [3, 2, 5, 7, 2, 3, 2, 2, 0], // stride 2 without padding, the last column unread
    [2, 1, 4, 4, 3, 1, 1, 1, 1], // a 1×1 kernel: the padding ring gives bias-only outputs
    [1, 2, 3, 3, 2, 5, 5, 1, 2], // a kernel larger than the image, reached through padding
];

// ---- gradcheck ----------------------------------------------------------------------------

#[test]
fn conv2d_gradcheck_over_strides_paddings_and_odd_sizes() {
    for (i, &[b, c, h, w, oc, kh, kw, s, p]) in GEOMETRIES.iter().enumerate() {
        let inputs = [
            random(&[b, c, h, w], 10 + i as u64),
            random(&[oc, c, kh, kw], 20 + i as u64),
            random(&[oc], 30 + i as u64),
        ];
        check(
            &format!("conv2d {:?}", GEOMETRIES[i]),
            |t| t[0].conv2d(&t[1], Some(&t[2]), s, p),
            &inputs,
        );
    }
}

#[test]
fn grouped_conv2d_gradcheck_with_idle_and_unbanked_images() {
    // 5 images over 3 banks: bank 1 idle, one image without a bank, banks not sorted
    let bank = Tensor::from_i32(vec![2, 0, -1, 2, 0], &[5], Device::cpu()).unwrap();
    for (s, p) in [(1, 0), (2, 1)] {
        let inputs = [random(&[5, 2, 5, 6], 40), random(&[3, 3, 2, 3, 2], 41)];
        check(
            &format!("grouped_conv2d stride {s} padding {p}"),
            |t| t[0].grouped_conv2d(&t[1], &bank, s, p),
            &inputs,
        );
    }
}

#[test]
fn pooling_gradcheck_over_strides_paddings_and_odd_sizes() {
    // (B, C, H, W, kernel, stride, padding)
    for (i, &[b, c, h, w, k, s, p]) in [
        [1, 1, 4, 4, 2, 2, 0],
        [2, 3, 5, 7, 2, 2, 0], // odd sides: the last row and column are dropped
        [1, 2, 5, 5, 3, 1, 1], // overlapping windows with padding
        [2, 1, 6, 5, 3, 2, 1],
        [1, 1, 3, 3, 2, 1, 1], // windows reaching the padding on both sides
    ]
    .iter()
    .enumerate()
    {
        let x = distinct(&[b, c, h, w], 50 + i as u64);
        let what = format!("[{b}, {c}, {h}, {w}] kernel {k} stride {s} padding {p}");
        check(
            &format!("max_pool2d {what}"),
            |t| t[0].max_pool2d_padded(k, s, p),
            std::slice::from_ref(&x),
        );
        check(
            &format!("avg_pool2d {what}"),
            |t| t[0].avg_pool2d_padded(k, s, p),
            &[x],
        );
    }
}

// ---- against the composed path ------------------------------------------------------------

#[test]
fn conv2d_matches_the_composed_path() {
    for (i, &[b, c, h, w, oc, kh, kw, s, p]) in GEOMETRIES.iter().enumerate() {
        let inputs = [
            random(&[b, c, h, w], 60 + i as u64),
            random(&[oc, c, kh, kw], 70 + i as u64),
            random(&[oc], 80 + i as u64),
        ];
        assert_same(
            &format!("conv2d {:?}", GEOMETRIES[i]),
            &|t| t[0].conv2d(&t[1], Some(&t[2]), s, p),
            &|t| t[0].conv2d_unfolded(&t[1], Some(&t[2]), s, p),
            &inputs,
            1e-12,
        );
    }
}

#[test]
fn avg_pooling_with_padding_divides_by_the_whole_window() {
    // one 2×2 plane, kernel 2, padding 1: the corner windows hold one pixel and three zeros
    let x = common::f64t(&[4.0, 8.0, 12.0, 16.0], &[1, 1, 2, 2]);
    let y = x.avg_pool2d_padded(2, 2, 1).unwrap().to_vec_f64().unwrap();
    assert_eq!(y, vec![1.0, 2.0, 3.0, 4.0]);
    let m = x.max_pool2d_padded(2, 1, 1).unwrap();
    assert_eq!(m.shape(), &[1, 1, 3, 3]);
    // padding never wins, even against negative pixels
    let neg = x.neg().unwrap().max_pool2d_padded(2, 2, 1).unwrap();
    assert_eq!(neg.to_vec_f64().unwrap(), vec![-4.0, -8.0, -12.0, -16.0]);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Random small geometries: the kernels' values and gradients equal the composed path's.
    #[test]
    fn random_convolutions_match_the_composed_path(
        b in 1usize..=3, c in 1usize..=3, oc in 1usize..=4, h in 1usize..=9, w in 1usize..=9,
        kh in 1usize..=4, kw in 1usize..=4, s in 1usize..=3, p in 0usize..=2, seed in 0u64..1000,
    ) {
        prop_assume!(kh <= h + 2 * p && kw <= w + 2 * p);
        let inputs = [
            random(&[b, c, h, w], seed),
            random(&[oc, c, kh, kw], seed + 1),
            random(&[oc], seed + 2),
        ];
        assert_same(
            &format!("conv2d [{b}, {c}, {h}, {w}] * [{oc}, {c}, {kh}, {kw}] stride {s} padding {p}"),
            &|t| t[0].conv2d(&t[1], Some(&t[2]), s, p),
            &|t| t[0].conv2d_unfolded(&t[1], Some(&t[2]), s, p),
            &inputs,
            1e-12,
        );
    }

    /// Random small geometries without padding (the composed path has none for pooling).
    #[test]
    fn random_poolings_match_the_composed_path(
        b in 1usize..=3, c in 1usize..=3, h in 1usize..=9, w in 1usize..=9,
        k in 1usize..=4, s in 1usize..=3, seed in 0u64..1000,
    ) {
        prop_assume!(k <= h && k <= w);
        let x = distinct(&[b, c, h, w], seed);
        let what = format!("[{b}, {c}, {h}, {w}] kernel {k} stride {s}");
        assert_same(
            &format!("max_pool2d {what}"),
            &|t| t[0].max_pool2d(k, s),
            &|t| t[0].max_pool2d_unfolded(k, s),
            std::slice::from_ref(&x),
            0.0,
        );
        assert_same(
            &format!("avg_pool2d {what}"),
            &|t| t[0].avg_pool2d(k, s),
            &|t| t[0].avg_pool2d_unfolded(k, s),
            &[x],
            1e-12,
        );
    }
}

// ---- the grouped convolution --------------------------------------------------------------

#[test]
fn grouped_conv2d_is_one_convolution_per_image_and_idle_banks_get_zero() {
    let (c, oc, k) = (2, 3, 3);
    let banks = [1, 1, 3, -1, 0, 3, 5];
    let x = random(&[banks.len(), c, 6, 5], 90);
    let w = random(&[4, oc, c, k, k], 91);
    let bank = Tensor::from_i32(banks.to_vec(), &[banks.len()], Device::cpu()).unwrap();
    let (xg, wg) = (
        x.detach().with_grad().unwrap(),
        w.detach().with_grad().unwrap(),
    );
    let y = xg.grouped_conv2d(&wg, &bank, 2, 1).unwrap();
    y.sum_all().unwrap().backward().unwrap();
    for (b, &g) in banks.iter().enumerate() {
        let image = x.slice(0, b, b + 1).unwrap();
        let got = y.slice(0, b, b + 1).unwrap().to_vec_f64().unwrap();
        if (0..4).contains(&g) {
            let g = g as usize;
            let own = w
                .slice(0, g, g + 1)
                .unwrap()
                .reshape(&[oc, c, k, k])
                .unwrap();
            let want = image
                .conv2d(&own, None, 2, 1)
                .unwrap()
                .to_vec_f64()
                .unwrap();
            common::assert_close(&format!("image {b} (bank {g})"), &got, &want, 1e-12, 1e-12);
        } else {
            assert!(
                got.iter().all(|&v| v == 0.0),
                "image {b} has no bank: {got:?}"
            );
        }
    }
    let (gx, gw) = (
        xg.grad().unwrap().to_vec_f64().unwrap(),
        wg.grad().unwrap().to_vec_f64().unwrap(),
    );
    let image = c * 6 * 5;
    assert!(
        gx[3 * image..4 * image].iter().all(|&v| v == 0.0),
        "the image without a bank must get zero gradient"
    );
    let bank_len = oc * c * k * k;
    assert!(
        gw[2 * bank_len..3 * bank_len].iter().all(|&v| v == 0.0),
        "idle bank 2 must get exactly zero gradient"
    );
    assert!(gw[bank_len..2 * bank_len].iter().any(|&v| v != 0.0));
}

#[test]
fn weight_gradient_bits_do_not_depend_on_the_thread_count() {
    // more images than one partial sum holds, in two banks
    // the CPU kernel's images per weight-gradient block (`WEIGHT_GRAD_IMAGES` in
    // backend/cpu/conv2d.rs, copied: src/backend/tests/constants.rs fails when it changes)
    let weight_grad_images = 8;
    let n = 3 * weight_grad_images + 5;
    let banks: Vec<i32> = (0..n).map(|b| (b * 2 / n) as i32).collect();
    let bank = Tensor::from_i32(banks, &[n], Device::cpu()).unwrap();
    let inputs = [random(&[n, 3, 9, 8], 100), random(&[2, 4, 3, 3, 3], 101)];
    let in_pool = |threads: usize| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("a thread pool")
            .install(|| run(&|t| t[0].grouped_conv2d(&t[1], &bank, 1, 1), &inputs, 102))
    };
    let (y1, g1) = in_pool(1);
    let (y8, g8) = in_pool(8);
    assert_eq!(y1, y8, "forward differs");
    assert_eq!(g1, g8, "gradients differ between 1 and 8 threads");
}

#[test]
fn f32_matches_f64() {
    let [b, c, h, w, oc, kh, kw, s, p] = GEOMETRIES[1];
    let inputs = [random(&[b, c, h, w], 110), random(&[oc, c, kh, kw], 111)];
    let single: Vec<Tensor> = inputs
        .iter()
        .map(|t| t.to_dtype(DType::F32).unwrap())
        .collect();
    let conv = |t: &[Tensor]| t[0].conv2d(&t[1], None, s, p);
    let (y, grads) = run(&conv, &single, 112);
    let (y_ref, grads_ref) = run(&conv, &inputs, 112);
    common::assert_close("f32 output", &y, &y_ref, 1e-5, 1e-5);
    for (g, r) in grads.iter().zip(&grads_ref) {
        common::assert_close("f32 gradient", g, r, 1e-5, 1e-5);
    }
}

// ---- GPU parity ---------------------------------------------------------------------------

/// `f` on the GPU in f32 against the CPU in f64: values and every gradient.
fn assert_gpu_matches(
    what: &str,
    gpu: Device,
    f: &dyn Fn(&[Tensor]) -> Result<Tensor>,
    inputs: &[Tensor],
) {
    let on_gpu: Vec<Tensor> = inputs
        .iter()
        .map(|t| t.to_dtype(DType::F32).unwrap().to_device(gpu).unwrap())
        .collect();
    let (y, grads) = run(f, &on_gpu, 120);
    let (y_ref, grads_ref) = run(f, inputs, 120);
    common::assert_close(&format!("{what}: GPU output"), &y, &y_ref, 1e-5, 1e-4);
    for (i, (g, r)) in grads.iter().zip(&grads_ref).enumerate() {
        common::assert_close(&format!("{what}: GPU gradient {i}"), g, r, 1e-4, 1e-4);
    }
}

#[test]
fn gpu_matches_cpu() {
    let Some(gpu) = common::gpu_or_skip("gpu_matches_cpu") else {
        return;
    };
    for (i, &[b, c, h, w, oc, kh, kw, s, p]) in GEOMETRIES.iter().enumerate() {
        let inputs = [
            random(&[b, c, h, w], 130 + i as u64),
            random(&[oc, c, kh, kw], 140 + i as u64),
            random(&[oc], 150 + i as u64),
        ];
        assert_gpu_matches(
            &format!("conv2d {:?}", GEOMETRIES[i]),
            gpu,
            &|t| t[0].conv2d(&t[1], Some(&t[2]), s, p),
            &inputs,
        );
    }
    // more than one workgroup tile along every axis: 70 positions (tiles of 64), 18 channels
    // (tiles of 16), a window of 5·5 = 25 (chunks of 16), 17 input channels of planes over 256
    let inputs = [random(&[2, 1, 16, 18], 160), random(&[18, 1, 5, 5], 161)];
    assert_gpu_matches(
        "conv2d over several tiles",
        gpu,
        &|t| t[0].conv2d(&t[1], None, 1, 0),
        &inputs,
    );
    let inputs = [random(&[1, 17, 17, 16], 162), random(&[2, 17, 3, 3], 163)];
    assert_gpu_matches(
        "conv2d with many input channels and large planes",
        gpu,
        &|t| t[0].conv2d(&t[1], None, 1, 1),
        &inputs,
    );
    let bank = Tensor::from_i32(vec![2, 0, -1, 2, 0], &[5], gpu).unwrap();
    let inputs = [random(&[5, 2, 7, 6], 170), random(&[3, 3, 2, 3, 3], 171)];
    assert_gpu_matches(
        "grouped_conv2d",
        gpu,
        &|t| {
            let bank = bank.to_device(t[0].device())?;
            t[0].grouped_conv2d(&t[1], &bank, 2, 1)
        },
        &inputs,
    );
    for (i, &[b, c, h, w, k, s, p]) in [
        [2, 3, 7, 6, 2, 2, 0],
        [1, 2, 9, 9, 3, 2, 1],
        [1, 1, 20, 20, 3, 1, 1],
    ]
    .iter()
    .enumerate()
    {
        let x = distinct(&[b, c, h, w], 180 + i as u64);
        let what = format!("[{b}, {c}, {h}, {w}] kernel {k} stride {s} padding {p}");
        assert_gpu_matches(
            &format!("max_pool2d {what}"),
            gpu,
            &|t| t[0].max_pool2d_padded(k, s, p),
            std::slice::from_ref(&x),
        );
        assert_gpu_matches(
            &format!("avg_pool2d {what}"),
            gpu,
            &|t| t[0].avg_pool2d_padded(k, s, p),
            &[x],
        );
    }
}

// ---- bad input ----------------------------------------------------------------------------

#[test]
fn bad_shapes_are_errors_naming_the_shapes() {
    let t = |shape: &[usize]| Tensor::zeros(shape, DType::F32, Device::cpu()).unwrap();
    let names_shapes = |r: Result<Tensor>, what: &str, shapes: &[&str]| match r {
        Err(Error::Shape(msg)) => {
            for s in shapes {
                assert!(msg.contains(s), "{what}: message does not name {s}: {msg}");
            }
        }
        other => panic!("{what}: expected Error::Shape, got {other:?}"),
    };
    let x = t(&[2, 3, 8, 8]);
    names_shapes(
        x.conv2d(&t(&[4, 2, 3, 3]), None, 1, 0),
        "channels differ",
        &["[2, 3, 8, 8]", "[4, 2, 3, 3]"],
    );
    names_shapes(
        t(&[3, 8, 8]).conv2d(&t(&[4, 3, 3, 3]), None, 1, 0),
        "rank-3 input",
        &["[3, 8, 8]"],
    );
    names_shapes(
        x.conv2d(&t(&[4, 3, 3, 3]), Some(&t(&[3])), 1, 0),
        "bias of the wrong length",
        &["[3]", "[4, 3, 3, 3]"],
    );
    names_shapes(
        x.conv2d(&t(&[4, 3, 11, 3]), None, 1, 1),
        "kernel larger than the padded image",
        &["[2, 3, 8, 8]", "11"],
    );
    names_shapes(
        x.conv2d(&t(&[4, 3, 3, 3]), None, 0, 0),
        "stride 0",
        &["stride 0"],
    );
    names_shapes(
        x.grouped_conv2d(
            &t(&[2, 4, 3, 3, 3]),
            &Tensor::from_i32(vec![0; 3], &[3], Device::cpu()).unwrap(),
            1,
            0,
        ),
        "one bank entry too many",
        &["[3]", "[2, 3, 8, 8]"],
    );
    names_shapes(
        x.grouped_conv2d(
            &t(&[4, 3, 3, 3]),
            &Tensor::from_i32(vec![0; 2], &[2], Device::cpu()).unwrap(),
            1,
            0,
        ),
        "a rank-4 weight for grouped_conv2d",
        &["[4, 3, 3, 3]"],
    );
    assert!(matches!(
        x.grouped_conv2d(&t(&[2, 4, 3, 3, 3]), &t(&[2]), 1, 0),
        Err(Error::DType(_))
    ));
    assert!(matches!(
        x.conv2d(&t(&[4, 3, 3, 3]).to_dtype(DType::F64).unwrap(), None, 1, 0),
        Err(Error::DType(_))
    ));
    for (what, r) in [
        ("pooling a rank-3 tensor", t(&[3, 8, 8]).max_pool2d(2, 2)),
        ("a window larger than the image", x.avg_pool2d(9, 1)),
        ("padding over half the kernel", x.max_pool2d_padded(2, 2, 2)),
        ("stride 0", x.max_pool2d(2, 0)),
    ] {
        names_shapes(r, what, &["8"]);
    }
}

#[test]
fn zero_sized_batches_give_empty_results_and_gradients() {
    let x = Tensor::zeros(&[0, 2, 5, 5], DType::F64, Device::cpu())
        .unwrap()
        .with_grad()
        .unwrap();
    let w = random(&[3, 2, 3, 3], 190).with_grad().unwrap();
    let y = x.conv2d(&w, None, 1, 0).unwrap();
    assert_eq!(y.shape(), &[0, 3, 3, 3]);
    let pooled = y.max_pool2d(2, 1).unwrap();
    assert_eq!(pooled.shape(), &[0, 3, 2, 2]);
    pooled.sum_all().unwrap().backward().unwrap();
    assert_eq!(x.grad().unwrap().shape(), &[0, 2, 5, 5]);
    assert!(
        w.grad()
            .unwrap()
            .to_vec_f64()
            .unwrap()
            .iter()
            .all(|&v| v == 0.0)
    );
}
