//! The GPU matmul's kernel choices (`MatmulKernel`): the plain, wide and subgroup kernels agree
//! to the bit, and the default choice's split-k (products with few tiles and a long reduction,
//! summed in a second pass) matches the CPU and is deterministic. The kernels' layouts, grid
//! splits and bad inputs are `gpu_matmul.rs`, whose helpers these tests use.

use super::gpu_matmul::{check_contiguous, contiguous, f32_data, gpu, values};
use crate::backend::gpu::MatmulKernel;
use crate::backend::{BufferOps, HostData, MatmulDims, MatmulOps};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// Every matmul kernel the adapter offers computes each element as the same chain of FMAs over
/// k, so all agree to the bit (the kernel choice changes speed, never results): shapes that
/// span several tiles of 64 and of 128, with tails, transposed operands and a batch.
#[test]
fn matmul_kernels_agree_to_the_bit() {
    let Some((be, _lock)) = gpu("matmul_kernels_agree_to_the_bit") else {
        return;
    };
    let before = be.matmul_kernel();
    let mut kernels = vec![MatmulKernel::Plain, MatmulKernel::Wide];
    if be.subgroup_matmul_available() {
        kernels.push(MatmulKernel::Subgroup);
    }
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    for ([batch, m, k, n], (ta, tb)) in [
        ([1, 300, 257, 129], (false, false)),
        ([2, 129, 15, 260], (true, false)),
        ([1, 131, 70, 200], (false, true)),
        ([3, 64, 9, 127], (true, true)),
    ] {
        let (la, a_len) = contiguous(batch, m, k, ta, false);
        let (lb, b_len) = contiguous(batch, k, n, tb, false);
        let a = be.upload(&f32_data(&values(&mut rng, a_len))).unwrap();
        let b = be.upload(&f32_data(&values(&mut rng, b_len))).unwrap();
        let dims = MatmulDims { batch, m, k, n };
        let mut results = Vec::new();
        for &kernel in &kernels {
            be.set_matmul_kernel(kernel).unwrap();
            let c = be.matmul(&a, la, &b, lb, dims).unwrap();
            match be.download(&c).unwrap() {
                HostData::F32(v) => results.push((kernel, v)),
                other => panic!("matmul gave {other:?}"),
            }
        }
        let (first, want) = &results[0];
        for (kernel, got) in &results[1..] {
            let differ = got
                .iter()
                .zip(want)
                .position(|(g, w)| g.to_bits() != w.to_bits());
            assert!(
                differ.is_none() && got.len() == want.len(),
                "matmul {dims:?} transposed ({ta}, {tb}): {kernel:?} and {first:?} differ at \
                 element {differ:?}"
            );
        }
    }
    be.set_matmul_kernel(before).unwrap();
}

/// Products with few output tiles and a long reduction (the weight gradients of a small model),
/// which the default kernel choice splits along k and sums in a second pass: against the CPU in
/// f64, transposed operands and a batch included, and the same bits when run twice.
#[test]
fn matmul_split_k() {
    let Some((be, _lock)) = gpu("matmul_split_k") else {
        return;
    };
    let before = be.matmul_kernel();
    be.set_matmul_kernel(MatmulKernel::Auto).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(13);
    for ([batch, m, k, n], t) in [
        ([1, 128, 768, 512], (true, false)),
        ([1, 70, 1000, 33], (false, false)),
        ([3, 64, 300, 64], (false, true)),
        ([1, 1, 4100, 1], (true, true)),
        ([2, 65, 257, 130], (false, false)),
    ] {
        check_contiguous(&be, &mut rng, [batch, m, k, n], t, (false, false));
    }
    let (la, a_len) = contiguous(1, 96, 700, false, false);
    let (lb, b_len) = contiguous(1, 700, 80, false, false);
    let a = be.upload(&f32_data(&values(&mut rng, a_len))).unwrap();
    let b = be.upload(&f32_data(&values(&mut rng, b_len))).unwrap();
    let dims = MatmulDims {
        batch: 1,
        m: 96,
        k: 700,
        n: 80,
    };
    let once = be
        .download(&be.matmul(&a, la, &b, lb, dims).unwrap())
        .unwrap();
    let twice = be
        .download(&be.matmul(&a, la, &b, lb, dims).unwrap())
        .unwrap();
    assert_eq!(once, twice, "split-k matmul: two runs differ");
    be.set_matmul_kernel(before).unwrap();
}
