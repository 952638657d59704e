//! The dense matmul's bias (`MatmulOps::matmul` with `Some(bias)`, what `Tensor::matmul_bias`
//! and so every `Linear` layer runs): each kernel adds `bias[col]` to its column after the
//! product's sum, so an unsplit product gives the bits of the product followed by an add; a
//! split-k product adds it once, in its first slice; a wrong bias is an error, not a launch.

use super::folded_grids::poison_pool;
use super::folded_matmul_grids::matmul_kernels;
use super::gpu_matmul::{contiguous, f32_data, gpu, values};
use crate::DType;
use crate::Error;
use crate::backend::cpu::CpuBackend;
use crate::backend::gpu::MatmulKernel;
use crate::backend::{BufferOps, HostData, MatmulDims, MatmulOps};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// f32 values of a downloaded buffer.
fn host(d: HostData) -> Vec<f32> {
    match d {
        HostData::F32(v) => v,
        other => panic!("expected f32, got {other:?}"),
    }
}

/// Under every kernel the adapter offers (forced, so none splits k), the biased product is the
/// unbiased one with `bias[col]` added in f32, to the bit: shapes with tails past tiles of 64
/// and 128, a batch, transposed operands, and vec4 shapes for `wide-vec4`.
#[test]
fn each_kernel_adds_the_bias_to_its_columns() {
    let Some((be, _lock)) = gpu("each_kernel_adds_the_bias_to_its_columns") else {
        return;
    };
    let before = be.matmul_kernel();
    let kernels = matmul_kernels(&be);
    let mut rng = ChaCha8Rng::seed_from_u64(31);
    for ([batch, m, k, n], (ta, tb)) in [
        ([1, 300, 37, 129], (false, false)),
        ([2, 129, 15, 260], (true, false)),
        ([3, 64, 9, 127], (true, true)),
        ([1, 300, 36, 132], (false, false)),
        ([2, 131, 20, 264], (false, true)),
        ([1, 1, 8, 4], (false, false)),
    ] {
        let (la, a_len) = contiguous(batch, m, k, ta, false);
        let (lb, b_len) = contiguous(batch, k, n, tb, false);
        let a = be.upload(&f32_data(&values(&mut rng, a_len))).unwrap();
        let b = be.upload(&f32_data(&values(&mut rng, b_len))).unwrap();
        let bias_values = values(&mut rng, n);
        let bias = be.upload(&f32_data(&bias_values)).unwrap();
        let dims = MatmulDims { batch, m, k, n };
        for &kernel in &kernels {
            be.set_matmul_kernel(kernel).unwrap();
            let plain = be
                .matmul((&a, la), (&b, lb), None, dims, DType::F32)
                .unwrap();
            let plain = host(be.download(&plain).unwrap());
            // NaN in the buffer the output will get, so that an element left unwritten shows
            poison_pool(&be, batch * m * n);
            let biased = be
                .matmul((&a, la), (&b, lb), Some(&bias), dims, DType::F32)
                .unwrap();
            let got = host(be.download(&biased).unwrap());
            let want: Vec<f32> = plain
                .iter()
                .enumerate()
                .map(|(i, &v)| v + bias_values[i % n])
                .collect();
            let differ = got
                .iter()
                .zip(&want)
                .position(|(g, w)| g.to_bits() != w.to_bits());
            assert!(
                differ.is_none() && got.len() == want.len(),
                "{kernel:?} {dims:?} transposed ({ta}, {tb}): the biased product differs from \
                 the product plus the bias at element {differ:?}"
            );
        }
    }
    be.set_matmul_kernel(before).unwrap();
}

/// The default kernel choice splits a product with few tiles and a long reduction (`split_k`):
/// the bias goes into the first slice only, so the sum of the slices has it once. Against the
/// CPU's f64 product plus bias, on router-like shapes (2 and 8 columns, k up to 2048).
#[test]
fn a_split_product_adds_the_bias_once() {
    let Some((be, _lock)) = gpu("a_split_product_adds_the_bias_once") else {
        return;
    };
    let before = be.matmul_kernel();
    be.set_matmul_kernel(MatmulKernel::Auto).unwrap();
    let cpu = CpuBackend;
    let mut rng = ChaCha8Rng::seed_from_u64(32);
    for [m, k, n] in [[64, 2048, 2], [200, 512, 8], [4096, 256, 2]] {
        let (a, b, bias) = (
            values(&mut rng, m * k),
            values(&mut rng, k * n),
            values(&mut rng, n),
        );
        let (la, _) = contiguous(1, m, k, false, false);
        let (lb, _) = contiguous(1, k, n, false, false);
        let dims = MatmulDims { batch: 1, m, k, n };
        poison_pool(&be, m * n);
        let up = |v: &[f32]| be.upload(&f32_data(v)).unwrap();
        let got = be
            .matmul(
                (&up(&a), la),
                (&up(&b), lb),
                Some(&up(&bias)),
                dims,
                DType::F32,
            )
            .unwrap();
        let got = host(be.download(&got).unwrap());
        let f64s = |v: &[f32]| HostData::F64(v.iter().map(|&x| x as f64).collect());
        let want = cpu
            .matmul(
                (&cpu.upload(&f64s(&a)).unwrap(), la),
                (&cpu.upload(&f64s(&b)).unwrap(), lb),
                Some(&cpu.upload(&f64s(&bias)).unwrap()),
                dims,
                DType::F64,
            )
            .unwrap();
        let want = cpu.download(&want).unwrap().to_f64();
        let got: Vec<f64> = got.iter().map(|&v| v as f64).collect();
        crate::common::assert_close(
            &format!("[{m}, {k}]·[{k}, {n}] + bias, split along k"),
            &got,
            &want,
            1e-5 * k as f64,
            1e-4,
        );
    }
    be.set_matmul_kernel(before).unwrap();
}

/// A bias of the wrong length or dtype is an error naming it, on both backends, before any
/// kernel runs.
#[test]
fn a_wrong_bias_is_an_error() {
    let cpu = CpuBackend;
    let dims = MatmulDims {
        batch: 1,
        m: 2,
        k: 3,
        n: 4,
    };
    let (la, _) = contiguous(1, 2, 3, false, false);
    let (lb, _) = contiguous(1, 3, 4, false, false);
    let a = cpu.upload(&f32_data(&[0.5; 6])).unwrap();
    let b = cpu.upload(&f32_data(&[0.5; 12])).unwrap();
    let short = cpu.upload(&f32_data(&[1.0; 3])).unwrap();
    let f64_bias = cpu.upload(&HostData::F64(vec![1.0; 4])).unwrap();
    match cpu.matmul((&a, la), (&b, lb), Some(&short), dims, DType::F32) {
        Err(Error::Shape(msg)) => assert!(msg.contains("expected [4]"), "{msg}"),
        other => panic!("a short bias gave {other:?}"),
    }
    match cpu.matmul((&a, la), (&b, lb), Some(&f64_bias), dims, DType::F32) {
        Err(Error::DType(msg)) => assert!(msg.contains("bias"), "{msg}"),
        other => panic!("an f64 bias gave {other:?}"),
    }
    let Some((be, _lock)) = gpu("a_wrong_bias_is_an_error") else {
        return;
    };
    let a = be.upload(&f32_data(&[0.5; 6])).unwrap();
    let b = be.upload(&f32_data(&[0.5; 12])).unwrap();
    let short = be.upload(&f32_data(&[1.0; 3])).unwrap();
    match be.matmul((&a, la), (&b, lb), Some(&short), dims, DType::F32) {
        Err(Error::Shape(msg)) => assert!(msg.contains("expected [4]"), "{msg}"),
        other => panic!("a short bias on the GPU gave {other:?}"),
    }
}
