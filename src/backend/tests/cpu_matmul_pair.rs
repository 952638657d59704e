//! The CPU's dense matmul run as a pair (`MatmulOps::matmul_pair`, a matmul's backward pass):
//! side by side, each product on part of the threads, it must give the bits each product gives
//! alone, on one thread or several, for the sizes that run on one thread, the sizes cut in
//! strips, batches sharing an operand and transposed operands; and both must match the
//! product's definition.

use super::cpu_kernels::{CPU, up};
use crate::DType;
use crate::backend::cpu::CpuBuffer;
use crate::backend::{BufferOps, HostData, MatLayout, MatmulDims, MatmulOps, MatmulProduct};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// `C[b] = A[b]·B[b]` from the layouts' definition, in f64.
fn reference_matmul(a: &[f32], la: MatLayout, b: &[f32], lb: MatLayout, d: MatmulDims) -> Vec<f64> {
    let at = |l: MatLayout, bi: usize, r: usize, c: usize| {
        l.offset + bi * l.batch_stride + r * l.row_stride + c * l.col_stride
    };
    let mut c = vec![0.0; d.batch * d.m * d.n];
    for bi in 0..d.batch {
        for i in 0..d.m {
            for j in 0..d.n {
                c[(bi * d.m + i) * d.n + j] = (0..d.k)
                    .map(|p| a[at(la, bi, i, p)] as f64 * b[at(lb, bi, p, j)] as f64)
                    .sum();
            }
        }
    }
    c
}

#[test]
fn a_pair_of_products_gives_the_bits_of_each_product_alone_on_any_number_of_threads() {
    let mut rng = ChaCha8Rng::seed_from_u64(31);
    let f32s = |rng: &mut ChaCha8Rng, n: usize| -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-1.0..1.0)).collect()
    };
    let down = |b: &CpuBuffer| CPU.download(b).unwrap().to_f64();
    // (batch, m, k, n, A transposed, B shared by the batch): one-threaded sizes, strips (over
    // 64³ multiply-adds) by rows and by columns, a batch sharing B, transposed operands, a
    // single row
    let shapes = [
        (1usize, 9usize, 7usize, 5usize, false, false),
        (1, 96, 80, 72, true, false),
        (3, 70, 64, 90, false, true),
        (1, 1, 200, 300, true, false),
        (2, 130, 66, 40, true, true),
        // wider than tall, but tall enough to be cut by rows on two threads (by columns on three)
        (1, 520, 16, 600, false, false),
    ];
    for threads in [1usize, 2, 3] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        for (i, &(batch, m, k, n, ta, shared)) in shapes.iter().enumerate() {
            let d = MatmulDims { batch, m, k, n };
            let la = MatLayout {
                offset: 0,
                batch_stride: m * k,
                row_stride: if ta { 1 } else { k },
                col_stride: if ta { m } else { 1 },
            };
            let lb = MatLayout {
                offset: 0,
                batch_stride: if shared { 0 } else { k * n },
                row_stride: n,
                col_stride: 1,
            };
            let (a, b) = (f32s(&mut rng, batch * m * k), f32s(&mut rng, batch * k * n));
            // the second product: the next shape's, so the two differ in size
            let (batch2, m2, k2, n2, _, _) = shapes[(i + 1) % shapes.len()];
            let d2 = MatmulDims {
                batch: batch2,
                m: m2,
                k: k2,
                n: n2,
            };
            let (l2a, l2b) = (
                MatLayout {
                    offset: 0,
                    batch_stride: m2 * k2,
                    row_stride: k2,
                    col_stride: 1,
                },
                MatLayout {
                    offset: 0,
                    batch_stride: k2 * n2,
                    row_stride: n2,
                    col_stride: 1,
                },
            );
            let (c, e) = (
                f32s(&mut rng, batch2 * m2 * k2),
                f32s(&mut rng, batch2 * k2 * n2),
            );
            let bufs = [&a, &b, &c, &e].map(|v| up(HostData::F32(v.clone())));
            let (x, y, alone_x, alone_y) = pool.install(|| {
                let first = MatmulProduct {
                    a: &bufs[0],
                    a_layout: la,
                    b: &bufs[1],
                    b_layout: lb,
                    dims: d,
                    out: DType::F32,
                    pending: None,
                };
                let second = MatmulProduct {
                    a: &bufs[2],
                    a_layout: l2a,
                    b: &bufs[3],
                    b_layout: l2b,
                    dims: d2,
                    out: DType::F32,
                    pending: None,
                };
                let (x, y) = CPU.matmul_pair(first, second).unwrap();
                let alone_x = CPU
                    .matmul((&bufs[0], la), (&bufs[1], lb), None, d, DType::F32)
                    .unwrap();
                let alone_y = CPU
                    .matmul((&bufs[2], l2a), (&bufs[3], l2b), None, d2, DType::F32)
                    .unwrap();
                (down(&x), down(&y), down(&alone_x), down(&alone_y))
            });
            let what = format!("{threads} threads, shape {i}: {d:?} with {d2:?}");
            assert_eq!(
                x, alone_x,
                "first product of the pair differs from it alone ({what})"
            );
            assert_eq!(
                y, alone_y,
                "second product of the pair differs from it alone ({what})"
            );
            for (got, want) in [
                (&x, reference_matmul(&a, la, &b, lb, d)),
                (&y, reference_matmul(&c, l2a, &e, l2b, d2)),
            ] {
                assert_eq!(got.len(), want.len(), "{what}");
                for (j, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g - w).abs() <= 1e-4 * (1.0 + w.abs()),
                        "{what}: element {j} is {g}, want {w}"
                    );
                }
            }
        }
    }
}
