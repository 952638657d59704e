//! The matmul with the gradient its output's tensor already has folded in
//! (`MatmulOps::matmul_plus`, reached through the matmul's folding rule on its left operand,
//! `Tensor::record_folding`): at the backend, `pending + A·B` to the bit of the product followed
//! by the separate add over fixed and random shapes, on the CPU (f32, f64) and the GPU (f32 under every tile kernel and under
//! `auto` with split-k, where the pass that sums the slices adds it; f16 and the f32 → f16 build,
//! where the product is rounded before the add as the add kernel would see it), with no add
//! launched where the kernel folds it; through the tape, a tensor feeding two products (a
//! router's tokens, a norm's output read by several projections) gets the bits of the two
//! gradients added, with one launch fewer on the GPU, batched too, and an f64 gradcheck of it.
//! (Past 65,535 tiles: `folded_matmul_grids::split_matmul_grids`.)

use super::gpu_matmul::gpu;
use super::kernels_of;
use super::layer_norm_fold::{fold_devices, placed, values};
use crate::backend::cpu::CpuBackend;
use crate::backend::gpu::{GpuBackend, MatmulKernel};
use crate::backend::{BinaryOp, BufferOps, ElementwiseOps, HostData, MatmulDims, MatmulOps};
use crate::ops::matmul::layout;
use crate::{DType, Device, Tensor};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The products the fold is checked on: `(batch, m, k, n, a transposed)`: one element, odd
/// sizes, a batch, wide tiles, a long reduction into one tile (split-k under `auto`), and
/// three random shapes (fixed seed).
fn shapes(rng: &mut ChaCha8Rng) -> Vec<(usize, usize, usize, usize, bool)> {
    let mut shapes = vec![
        (1, 1, 1, 1, false),
        (1, 5, 7, 3, true),
        (3, 17, 9, 21, false),
        (1, 130, 20, 140, false),
        (1, 40, 600, 36, true),
    ];
    for _ in 0..3 {
        shapes.push((
            rng.random_range(1..=3),
            rng.random_range(1..=150),
            rng.random_range(1..=90),
            rng.random_range(1..=150),
            rng.random_bool(0.5),
        ));
    }
    shapes
}

/// `matmul_plus` against `matmul` then the add kernel (`pending + C`) on backend `be`, without
/// and with a bias, the
/// operands uploaded as `dtype` (A's and B's, then the output's): the same bits, and a pending
/// gradient of the wrong length is an error.
fn fold_matches_the_sum<B: MatmulOps + ElementwiseOps>(
    be: &B,
    (operands, out): (DType, DType),
    what: &str,
) {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    for (batch, m, k, n, transposed) in shapes(&mut rng) {
        let up = |v: Vec<f64>, dtype: DType| {
            let data = match dtype {
                DType::F64 => HostData::F64(v),
                _ => HostData::F32(v.iter().map(|&x| x as f32).collect()),
            };
            let b = be.upload(&data).unwrap();
            match dtype {
                DType::F16 => be.cast(&b, DType::F16).unwrap(),
                _ => b,
            }
        };
        let a = up(values(&mut rng, batch * m * k), operands);
        let b = up(values(&mut rng, batch * k * n), operands);
        let pending = up(values(&mut rng, batch * m * n), out);
        let (la, lb) = (
            if transposed {
                layout(k, m, true, true)
            } else {
                layout(m, k, true, false)
            },
            layout(k, n, true, false),
        );
        let dims = MatmulDims { batch, m, k, n };
        let c = be.matmul((&a, la), (&b, lb), None, dims, out).unwrap();
        let len = batch * m * n;
        let summed = be
            .binary(BinaryOp::Add, &pending, &[1], &c, &[1], &[len])
            .unwrap();
        let folded = be
            .matmul_plus((&a, la), (&b, lb), None, dims, out, &pending)
            .unwrap();
        let host = |x| be.download(&be.cast(x, host_dtype(out)).unwrap()).unwrap();
        let at = format!("{what}, [{batch}, {m}, {k}]·[{k}, {n}]");
        assert_eq!(host(&folded), host(&summed), "{at}: pending + A·B");
        // with a bias too (a block's last projection added to the residual stream)
        let bias = up(values(&mut rng, n), operands);
        let c = be
            .matmul((&a, la), (&b, lb), Some(&bias), dims, out)
            .unwrap();
        let summed = be
            .binary(BinaryOp::Add, &pending, &[1], &c, &[1], &[len])
            .unwrap();
        let folded = be
            .matmul_plus((&a, la), (&b, lb), Some(&bias), dims, out, &pending)
            .unwrap();
        assert_eq!(host(&folded), host(&summed), "{at}: pending + (A·B + bias)");
        let short = up(vec![0.0; len + 1], out);
        let err = be.matmul_plus((&a, la), (&b, lb), None, dims, out, &short);
        assert!(
            matches!(err, Err(crate::Error::Shape(ref m)) if m.contains("pending gradient")),
            "{at}: {:?}",
            err.err()
        );
    }
}

/// The dtype results are compared in: f16 ones as f32 (what `download` of a cast gives), f32
/// and f64 as they are.
fn host_dtype(d: DType) -> DType {
    match d {
        DType::F16 => DType::F32,
        d => d,
    }
}

/// Under `kernel`, on the GPU: the fold's bits, and which kernels ran: no add, the product
/// folds the pending gradient itself, or split along k, the pass that sums its slices does
/// (`sum_slices_plus`).
fn gpu_fold(be: &GpuBackend, kernel: MatmulKernel) {
    be.set_matmul_kernel(kernel).unwrap();
    fold_matches_the_sum(be, (DType::F32, DType::F32), &format!("GPU f32 {kernel:?}"));
    let mut rng = ChaCha8Rng::seed_from_u64(8);
    for (m, k, n, splits) in [
        (70, 20, 90, false),
        (40, 600, 36, kernel == MatmulKernel::Auto),
    ] {
        let mut up = |len| {
            let v: Vec<f32> = values(&mut rng, len).iter().map(|&x| x as f32).collect();
            be.upload(&HostData::F32(v)).unwrap()
        };
        let (a, b, p) = (up(m * k), up(k * n), up(m * n));
        let dims = MatmulDims { batch: 1, m, k, n };
        let ran = kernels_of(|| {
            be.matmul_plus(
                (&a, layout(m, k, false, false)),
                (&b, layout(k, n, false, false)),
                None,
                dims,
                DType::F32,
                &p,
            )
            .unwrap();
        });
        let count = |name: &str| ran.iter().filter(|k| k.as_str() == name).count();
        assert_eq!(
            (count("elementwise.binary"), count("reduce.sum_slices_plus")),
            (0, usize::from(splits)),
            "{kernel:?} [{m}, {k}]·[{k}, {n}]: ran {ran:?}"
        );
    }
}

#[test]
fn the_folded_product_is_the_sum_to_the_bit_on_each_device() {
    let gpu = gpu("the_folded_product_is_the_sum_to_the_bit_on_each_device");
    fold_matches_the_sum(&CpuBackend, (DType::F32, DType::F32), "CPU f32");
    fold_matches_the_sum(&CpuBackend, (DType::F64, DType::F64), "CPU f64");
    let Some((be, _lock)) = &gpu else {
        return;
    };
    let before = be.matmul_kernel();
    for kernel in super::folded_matmul_grids::matmul_kernels(be) {
        gpu_fold(be, kernel);
    }
    gpu_fold(be, MatmulKernel::Auto);
    if be.has_f16() {
        for kernel in [MatmulKernel::Plain, MatmulKernel::Wide] {
            be.set_matmul_kernel(kernel).unwrap();
            let f16s = (DType::F16, DType::F16);
            fold_matches_the_sum(be, f16s, &format!("GPU f16 {kernel:?}"));
            let f32_to_f16 = (DType::F32, DType::F16);
            fold_matches_the_sum(be, f32_to_f16, &format!("GPU f32 → f16 {kernel:?}"));
        }
    }
    be.set_matmul_kernel(before).unwrap();
}

/// `x·W1 + x·W2` backward from an upstream `w` (x batched `[2, rows, d]` or 2-D): x's gradient
/// is the two products' gradients added, to the bit of computing them apart and adding them,
/// and on the GPU the walk runs the four gradient products and no add.
#[test]
fn a_tensor_feeding_two_products_folds_its_second_gradient() {
    let gpu = gpu("a_tensor_feeding_two_products_folds_its_second_gradient");
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let (rows, d, n) = (6, 13, 10);
    let host = [
        values(&mut rng, 2 * rows * d),
        values(&mut rng, d * n),
        values(&mut rng, d * n),
        values(&mut rng, 2 * rows * n),
    ];
    for x_shape in [vec![2, rows, d], vec![2 * rows, d]] {
        let mut y_shape = x_shape.clone();
        *y_shape.last_mut().unwrap() = n;
        for (dev, dtype) in fold_devices(&gpu) {
            let t = |v: &[f64], shape: &[usize]| placed(v, shape, dtype, dev);
            let x = t(&host[0], &x_shape).with_grad().unwrap();
            let (w1, w2) = (
                t(&host[1], &[d, n]).with_grad().unwrap(),
                t(&host[2], &[d, n]).with_grad().unwrap(),
            );
            let up = t(&host[3], &y_shape);
            let y = x.matmul(&w1).unwrap().add(&x.matmul(&w2).unwrap()).unwrap();
            let ran = kernels_of(|| y.backward_with(&up).unwrap());
            if dev.is_gpu() {
                let adds = ran.iter().filter(|k| k.as_str() == "elementwise.binary");
                assert_eq!(adds.count(), 0, "{x_shape:?} on the GPU: {ran:?}");
            }
            // each product's gradient alone, then the add
            let apart = |w: &Tensor| {
                let x2 = t(&host[0], &x_shape).with_grad().unwrap();
                x2.matmul(&w.detach()).unwrap().backward_with(&up).unwrap();
                x2.grad().unwrap()
            };
            let (g1, g2) = (apart(&w1), apart(&w2));
            let want = [g1.add(&g2).unwrap(), g2.add(&g1).unwrap()];
            let got = x.grad().unwrap().to_vec_f64().unwrap();
            assert!(
                want.iter().any(|w| w.to_vec_f64().unwrap() == got),
                "{x_shape:?} {dev} {dtype}: x's gradient"
            );
        }
    }
}

/// The folded gradient of a tensor read by two products, gradchecked in f64 on the CPU: the
/// fold changes no value, so the rule still matches the forward's finite differences.
#[test]
fn a_folded_product_gradient_passes_gradcheck() {
    let mut rng = ChaCha8Rng::seed_from_u64(10);
    let (rows, d, n) = (4, 5, 3);
    let w1 = placed(&values(&mut rng, d * n), &[d, n], DType::F64, Device::Cpu);
    let w2 = placed(&values(&mut rng, d * n), &[d, n], DType::F64, Device::Cpu);
    let x = placed(
        &values(&mut rng, rows * d),
        &[rows, d],
        DType::F64,
        Device::Cpu,
    );
    let report = crate::gradcheck::gradcheck(
        |inputs: &[Tensor]| {
            let x = &inputs[0];
            let y = x.matmul(&inputs[1])?.tanh()?;
            y.add(&x.matmul(&inputs[2])?)?.sum_all()
        },
        &[x, w1, w2],
        &crate::gradcheck::GradcheckOptions::default(),
    )
    .unwrap();
    assert!(report.compared > 0, "{report:?}");
}

/// `x.matmul_add(w, bias, r)` (a block's last projection added to its residual stream) against
/// `r.add(&x.matmul_bias(w, bias)?)`: the same bits forward and the same gradients of x, w, the
/// bias and r, with and without a bias, short and split-k long reductions, on each device and
/// dtype; on the GPU the forward launches no add.
#[test]
fn a_product_added_to_its_residual_has_the_bits_of_the_add() {
    let gpu = gpu("a_product_added_to_its_residual_has_the_bits_of_the_add");
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for (rows, d, n) in [(6, 13, 10), (40, 600, 36)] {
        let host = [
            values(&mut rng, rows * d),
            values(&mut rng, d * n),
            values(&mut rng, n),
            values(&mut rng, rows * n),
            values(&mut rng, rows * n),
        ];
        for with_bias in [true, false] {
            for (dev, dtype) in fold_devices(&gpu) {
                let t =
                    |v: &[f64], shape: &[usize]| placed(v, shape, dtype, dev).with_grad().unwrap();
                let run = |fused: bool| {
                    let (x, w, b, r) = (
                        t(&host[0], &[rows, d]),
                        t(&host[1], &[d, n]),
                        t(&host[2], &[n]),
                        t(&host[3], &[rows, n]),
                    );
                    let bias = with_bias.then_some(&b);
                    let mut y = None;
                    let ran = kernels_of(|| {
                        y = Some(match (fused, bias) {
                            (true, bias) => x.matmul_add(&w, bias, &r).unwrap(),
                            (false, Some(b)) => r.add(&x.matmul_bias(&w, b).unwrap()).unwrap(),
                            (false, None) => r.add(&x.matmul(&w).unwrap()).unwrap(),
                        });
                    });
                    let y = y.unwrap();
                    y.backward_with(&placed(&host[4], &[rows, n], dtype, dev))
                        .unwrap();
                    let mut bits = vec![y.to_vec_f64().unwrap()];
                    let grads = [Some(&x), Some(&w), bias, Some(&r)];
                    for g in grads.into_iter().flatten() {
                        bits.push(g.grad().unwrap().to_vec_f64().unwrap());
                    }
                    (bits, ran)
                };
                let ((fused, ran), (composed, _)) = (run(true), run(false));
                let at = format!("[{rows}, {d}]·[{d}, {n}], bias {with_bias}, {dev} {dtype}");
                assert_eq!(fused, composed, "{at}: output, then each gradient");
                if dev.is_gpu() {
                    let adds = ran.iter().filter(|k| k.as_str() == "elementwise.binary");
                    assert_eq!(adds.count(), 0, "{at}: ran {ran:?}");
                }
            }
        }
    }
}

/// Mixed precision's residual: f16 rows times an f32 weight and bias (the f16-rows build)
/// added to an f16 residual (the kernel adds it) or an f32 one (the add does), inside
/// `autocast_f16`, against the product then the add: the same bits forward and the same
/// gradients.
#[test]
fn a_mixed_precision_product_added_to_its_residual_has_the_bits_of_the_add() {
    let Some((be, _lock)) = gpu("a_mixed_precision_product_added_to_its_residual") else {
        return;
    };
    if !be.has_f16() {
        return;
    }
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    let cases = [(24, 64, 64), (768, 128, 128), (768, 512, 128)];
    for ((rows, d, n), residual) in cases
        .into_iter()
        .flat_map(|c| [(c, DType::F16), (c, DType::F32)])
    {
        let host = [
            values(&mut rng, rows * d),
            values(&mut rng, d * n),
            values(&mut rng, n),
            values(&mut rng, rows * n),
            values(&mut rng, rows * n),
        ];
        let run = |fused: bool| {
            let on_gpu = |v: &[f64], shape: &[usize], dtype| {
                let t = placed(v, shape, DType::F32, Device::Gpu);
                t.to_dtype(dtype).unwrap()
            };
            let t =
                |v: &[f64], shape: &[usize], dtype| on_gpu(v, shape, dtype).with_grad().unwrap();
            let (x, w, b, r) = (
                t(&host[0], &[rows, d], DType::F16),
                t(&host[1], &[d, n], DType::F32),
                t(&host[2], &[n], DType::F32),
                t(&host[3], &[rows, n], residual),
            );
            let y = crate::autocast_f16(|| match fused {
                true => x.matmul_add(&w, Some(&b), &r),
                false => x.matmul_bias(&w, &b).and_then(|y| r.add(&y)),
            })
            .unwrap();
            y.backward_with(&on_gpu(&host[4], &[rows, n], y.dtype()))
                .unwrap();
            let mut bits = vec![y.to_vec_f64().unwrap()];
            for g in [&x, &w, &b, &r] {
                bits.push(g.grad().unwrap().to_vec_f64().unwrap());
            }
            bits
        };
        let (fused, composed) = (run(true), run(false));
        for (i, what) in ["output", "dx", "dw", "dbias", "dresidual"]
            .iter()
            .enumerate()
        {
            assert_eq!(
                fused[i], composed[i],
                "[{rows}, {d}]·[{d}, {n}], {residual} residual: {what}"
            );
        }
    }
}
