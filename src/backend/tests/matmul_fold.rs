//! The matmul with the gradient its output's tensor already has folded in
//! (`MatmulOps::matmul_plus`, reached through the matmul's folding rule on its left operand,
//! `Tensor::record_folding`): at the backend, `pending + A·B` to the bit of the product followed
//! by the separate add over fixed and random shapes, on the CPU (f32, f64) and the GPU (f32 under every tile kernel and under
//! `auto` with split-k, where the add runs after the slices' sum; f16 and the f32 → f16 build,
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

/// `matmul_plus` against `matmul` then the add kernel (`pending + C`) on backend `be`, the
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
            .matmul_plus((&a, la), (&b, lb), dims, out, &pending)
            .unwrap();
        let host = |x| be.download(&be.cast(x, host_dtype(out)).unwrap()).unwrap();
        let at = format!("{what}, [{batch}, {m}, {k}]·[{k}, {n}]");
        assert_eq!(host(&folded), host(&summed), "{at}: pending + A·B");
        let short = up(vec![0.0; len + 1], out);
        let err = be.matmul_plus((&a, la), (&b, lb), dims, out, &short);
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

/// Under `kernel`, on the GPU: the fold's bits, and which kernels ran: no add where the product
/// folds the pending gradient itself, the add after split-k's sum where it does not.
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
                dims,
                DType::F32,
                &p,
            )
            .unwrap();
        });
        let adds = ran
            .iter()
            .filter(|k| k.as_str() == "elementwise.binary")
            .count();
        let expected = usize::from(splits);
        assert_eq!(
            adds, expected,
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
