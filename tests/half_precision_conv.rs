//! The f16 builds of the image kernels on the GPU: the convolutions (forward, input gradient,
//! weight gradient; one weight bank or several) and max and average pooling (forward and
//! backward), each against the f32 kernel on the same f16-valued operands. One of the f16 test
//! files: the casts and the element-level kernels are checked in `half_precision.rs`, the
//! matrix products in `half_precision_matmul.rs`, the norms and attention in
//! `half_precision_nn.rs`.
//!
//! * the convolutions in f16 (images, weights and gradients f16): `y`, `dx` and `dw` each a
//!   neighbouring f16 of the f32 kernel's result; with f16 images and an f32 weight (the
//!   f16-rows build that `autocast_f16` runs) `y` and `dx` the same, and `dw` f32 with the f32
//!   kernel's bits (the same sums, stored in f32), over strides, paddings, windows and channel
//!   counts on both sides of the kernels' 16- and 64-wide tiles, and banks with an image whose
//!   bank is out of range;
//! * pooling in f16: the maximum and its argmax exactly the f32 kernel's (NaN and ties
//!   included), the mean and both gradients a neighbouring f16 of the f32 kernel's;
//! * under `autocast_f16` a convolution runs the f16-rows kernels (no f16 copy of the weight,
//!   no cast of its gradient), and pooling runs in its input's f16.
//!
//! Skipped with a printed reason without an adapter unless `MOEGRAD_REQUIRE_GPU=1`; on an
//! adapter without `shader-f16` every f16 request must be an error naming it.

mod common;
#[path = "common/f16_checks.rs"]
mod f16_checks;

use f16_checks::{assert_rounded_once, f16_gpu, f16_values};
use moegrad::{DType, Device, Error, Tensor, autocast_f16};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// One convolution's geometry: images `[batch, channels, side, side]`, weights
/// `[banks, out_channels, channels, kernel, kernel]`.
#[derive(Clone, Copy, Debug)]
struct ConvCase {
    batch: usize,
    channels: usize,
    side: usize,
    out_channels: usize,
    kernel: usize,
    stride: usize,
    padding: usize,
    banks: usize,
}

/// A GPU tensor of `v` in `dtype` that records its gradient.
fn leaf(v: &[f32], shape: &[usize], dtype: DType, gpu: Device) -> Tensor {
    Tensor::from_f32(v.to_vec(), shape, gpu)
        .and_then(|t| t.to_dtype(dtype))
        .unwrap()
        .with_grad()
        .unwrap()
}

/// `y`, `dx` and `dw` (as f32) of the banked convolution of `c` with images of `image` dtype and
/// weights of `weight` dtype, on the same f16-valued `x`, `w` and upstream gradient `up`; the
/// mixed case (f16 images, f32 weights) inside `autocast_f16`, where it is allowed.
fn convolve(
    gpu: Device,
    c: ConvCase,
    [x, w, up]: [&[f32]; 3],
    (image, weight): (DType, DType),
) -> [Vec<f32>; 3] {
    let side_out = (c.side + 2 * c.padding - c.kernel) / c.stride + 1;
    let xt = leaf(x, &[c.batch, c.channels, c.side, c.side], image, gpu);
    let wt = leaf(
        w,
        &[c.banks, c.out_channels, c.channels, c.kernel, c.kernel],
        weight,
        gpu,
    );
    // image b uses bank b % (banks + 1) − 1 when there are several: one image of every
    // banks + 1 is out of range (zeros, no gradient)
    let banks: Vec<i32> = (0..c.batch)
        .map(|b| {
            if c.banks == 1 {
                0
            } else {
                (b % (c.banks + 1)) as i32 - 1
            }
        })
        .collect();
    let bank = Tensor::from_i32(banks, &[c.batch], gpu).unwrap();
    let forward = || xt.grouped_conv2d(&wt, &bank, c.stride, c.padding);
    let y = if image != weight {
        autocast_f16(forward)
    } else {
        forward()
    }
    .unwrap();
    assert_eq!(y.dtype(), image, "{c:?}: the output has the images' dtype");
    assert_eq!(
        y.shape(),
        &[c.batch, c.out_channels, side_out, side_out],
        "{c:?}"
    );
    let g = Tensor::from_f32(up.to_vec(), y.shape(), gpu)
        .and_then(|t| t.to_dtype(image))
        .unwrap();
    y.backward_with(&g).unwrap();
    let (dx, dw) = (xt.grad().unwrap(), wt.grad().unwrap());
    assert_eq!(dx.dtype(), image, "{c:?}: dx in the images' dtype");
    assert_eq!(dw.dtype(), weight, "{c:?}: dw in the weight's dtype");
    [&y, &dx, &dw].map(|t| t.to_vec_f32().unwrap())
}

/// The three builds of the convolutions on the same f16-valued operands: the f16 build's `y`,
/// `dx` and `dw` and the f16-rows build's `y` and `dx` are each a neighbouring f16 of the f32
/// kernel's result, and the f16-rows build's `dw` (f32, from f16 images and gradients) has the
/// f32 kernel's bits. The cases cross the forward's 64-position and 16-channel tiles, the
/// window's chunks of 16 (`C·k²` of 1, 25, 27 and 45), the input gradient's 256-pixel
/// workgroups, strides and padding, and banks with out-of-range images.
#[test]
fn f16_convolutions_round_the_f32_result_once() {
    let Some(gpu) = f16_gpu("f16_convolutions_round_the_f32_result_once") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(53);
    let case = |batch, channels, side, out_channels, kernel, stride, padding, banks| ConvCase {
        batch,
        channels,
        side,
        out_channels,
        kernel,
        stride,
        padding,
        banks,
    };
    for c in [
        case(1, 1, 1, 1, 1, 1, 0, 1),
        case(2, 1, 12, 10, 5, 1, 0, 1),
        case(3, 3, 17, 17, 3, 2, 1, 1),
        case(7, 5, 9, 20, 3, 1, 2, 3),
        case(4, 2, 20, 3, 2, 2, 0, 2),
    ] {
        let side_out = (c.side + 2 * c.padding - c.kernel) / c.stride + 1;
        let x = f16_values(c.batch * c.channels * c.side * c.side, &mut rng);
        let w = f16_values(
            c.banks * c.out_channels * c.channels * c.kernel * c.kernel,
            &mut rng,
        );
        let up = f16_values(c.batch * c.out_channels * side_out * side_out, &mut rng);
        let operands = [&x[..], &w[..], &up[..]];
        let single = convolve(gpu, c, operands, (DType::F32, DType::F32));
        let half = convolve(gpu, c, operands, (DType::F16, DType::F16));
        let rows = convolve(gpu, c, operands, (DType::F16, DType::F32));
        for (i, name) in ["y", "dx", "dw"].iter().enumerate() {
            let what = format!("{c:?} {name}");
            assert_rounded_once(&what, &half[i], &single[i]);
            if i < 2 {
                assert_rounded_once(&format!("{what}, f32 weight"), &rows[i], &single[i]);
            } else {
                assert_eq!(
                    rows[i], single[i],
                    "{what}, f32 weight: the f32 kernel's bits"
                );
            }
        }
    }
}

/// `y` and `dx` (as f32) of max (`max = true`) or average pooling of `x` in `dtype`, with the
/// upstream gradient `up`.
fn pool(
    gpu: Device,
    (x, shape, up): (&[f32], [usize; 4], &[f32]),
    (kernel, stride, padding): (usize, usize, usize),
    max: bool,
    dtype: DType,
) -> [Vec<f32>; 2] {
    let xt = leaf(x, &shape, dtype, gpu);
    let y = if max {
        xt.max_pool2d_padded(kernel, stride, padding)
    } else {
        xt.avg_pool2d_padded(kernel, stride, padding)
    }
    .unwrap();
    assert_eq!(y.dtype(), dtype, "pooling keeps its input's dtype");
    let g = Tensor::from_f32(up.to_vec(), y.shape(), gpu)
        .and_then(|t| t.to_dtype(dtype))
        .unwrap();
    y.backward_with(&g).unwrap();
    let dx = xt.grad().unwrap();
    assert_eq!(dx.dtype(), dtype);
    [y.to_vec_f32().unwrap(), dx.to_vec_f32().unwrap()]
}

/// Max and average pooling in f16 against f32 on the same f16-valued images: the maximum is
/// the f32 kernel's exactly (a NaN in a window wins it, ties go to the first), so its
/// gradient, routed by the same argmax, is the f32 sum rounded once; the mean and its gradient
/// are a neighbouring f16 of the f32 kernel's. Windows overlap (stride < kernel) so that a pixel
/// gathers from several outputs, and hang over padded edges.
#[test]
fn f16_pooling_rounds_the_f32_result_once() {
    let Some(gpu) = f16_gpu("f16_pooling_rounds_the_f32_result_once") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(59);
    for (shape, window) in [
        ([1, 1, 1, 1], (1, 1, 0)),
        ([2, 3, 8, 8], (2, 2, 0)),
        ([3, 2, 11, 7], (3, 2, 1)),
        ([1, 4, 30, 30], (3, 1, 1)),
    ] {
        let (b, c, h, w) = (shape[0], shape[1], shape[2], shape[3]);
        let (k, s, p) = window;
        let (oh, ow) = ((h + 2 * p - k) / s + 1, (w + 2 * p - k) / s + 1);
        let mut x = f16_values(b * c * h * w, &mut rng);
        // ties (equal values side by side) and a NaN in the largest case
        if x.len() > 4 {
            x[1] = x[0];
        }
        if x.len() > 100 {
            x[77] = f32::NAN;
        }
        let up = f16_values(b * c * oh * ow, &mut rng);
        for max in [true, false] {
            let single = pool(gpu, (&x, shape, &up), window, max, DType::F32);
            let half = pool(gpu, (&x, shape, &up), window, max, DType::F16);
            let what = format!(
                "{} pool {shape:?} {window:?}",
                if max { "max" } else { "avg" }
            );
            if max {
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&half[0]), bits(&single[0]), "{what} y: exactly f32's");
            } else {
                assert_rounded_once(&format!("{what} y"), &half[0], &single[0]);
            }
            assert_rounded_once(&format!("{what} dx"), &half[1], &single[1]);
        }
    }
}

/// Inside `autocast_f16` a convolution of f32 images with an f32 weight and bias runs the
/// f16-rows kernels: the images are cast to f16 (one cast), the weight and the bias are read
/// where they are (no f16 copy; the kernel adds the bias), the weight's gradient comes from
/// `conv2d_f16_rows.conv2d_weight_grad` in f32 and the bias's is summed from f16 into f32, with
/// no cast back, and max pooling after it runs in f16. Outside a scope, f32 images with an f16
/// weight stay an error naming both dtypes.
#[test]
fn mixed_precision_convolutions_read_the_f32_weight_where_it_is() {
    let Some(gpu) = f16_gpu("mixed_precision_convolutions_read_the_f32_weight_where_it_is") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(61);
    let x = Tensor::from_f32(f16_values(2 * 3 * 10 * 10, &mut rng), &[2, 3, 10, 10], gpu).unwrap();
    let w = Tensor::from_f32(f16_values(4 * 3 * 3 * 3, &mut rng), &[4, 3, 3, 3], gpu)
        .unwrap()
        .with_grad()
        .unwrap();
    let bias = Tensor::from_f32(f16_values(4, &mut rng), &[4], gpu)
        .unwrap()
        .with_grad()
        .unwrap();
    // warm-up: the pipelines and pooled buffers, so the profile below sees only the step
    let step = || {
        let y = autocast_f16(|| {
            x.conv2d(&w, Some(&bias), 1, 1)
                .and_then(|y| y.relu())
                .and_then(|y| y.max_pool2d(2, 2))
        })
        .unwrap();
        assert_eq!(
            y.dtype(),
            DType::F16,
            "the mixed convolution's output is f16"
        );
        y.to_dtype(DType::F32)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
    };
    step();
    let recording = moegrad::profile::start();
    step();
    let report = recording.finish().expect("a profile");
    let calls: Vec<(String, u64)> = report
        .gpu
        .expect("a GPU profile")
        .kernels
        .into_iter()
        .map(|k| (k.kernel, k.calls))
        .collect();
    let kernels: Vec<&String> = calls.iter().map(|(k, _)| k).collect();
    let count = |k: &str| calls.iter().find(|(n, _)| n == k).map_or(0, |&(_, c)| c);
    for k in [
        "conv2d_f16_rows.conv2d_forward",
        "conv2d_f16_rows.conv2d_weight_grad",
        "pool2d_f16.max_pool2d_forward",
        "pool2d_f16.max_pool2d_backward",
    ] {
        assert!(count(k) >= 1, "{k} did not run: {kernels:?}");
    }
    let f32_image_kernels: Vec<_> = kernels
        .iter()
        .filter(|k| k.starts_with("conv2d.") || k.starts_with("pool2d."))
        .collect();
    assert!(
        f32_image_kernels.is_empty(),
        "f32 image kernels ran under autocast: {f32_image_kernels:?}"
    );
    // the images are cast down, and the loss's f32 gradient back to the f16 output; nothing
    // casts the weight, the bias or their gradients (the bias's is summed from f16 into f32)
    assert_eq!(count("half.f32_to_f16"), 2, "{kernels:?}");
    assert_eq!(
        count("half.f16_to_f32"),
        1,
        "the loss's input only: {kernels:?}"
    );
    assert_eq!(
        count("elementwise_f16.binary"),
        0,
        "the bias is added by the kernel: {kernels:?}"
    );
    assert_eq!(w.grad().unwrap().dtype(), DType::F32);
    assert_eq!(bias.grad().unwrap().dtype(), DType::F32);

    let w16 = w.detach().to_dtype(DType::F16).unwrap();
    match x.conv2d(&w16, None, 1, 0) {
        Err(Error::DType(m)) => assert!(m.contains("f32") && m.contains("f16"), "{m}"),
        other => panic!("f32 images with an f16 weight outside a scope gave {other:?}"),
    }
}
