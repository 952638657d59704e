//! The CPU backend's fast kernels against plain reference loops, through the family traits
//! (moved here from the integration tests when the backend became private).
//!
//! The CPU kernels are the reference the GPU is checked against (`gpu_primitives.rs`,
//! `gpu_matmul.rs` beside this file), so their own fast paths — the integer-key argsort and its
//! top-k selection, the grouped matmul cut into row blocks, the weight gradient written without
//! a zeroing pass, the sum, max and min along rows in lanes and blocks, the flat `where`, the
//! scatter of whole rows by destination — are checked here against the obvious loops: exactly
//! for sorting, selection, max, min and the row scatter, to rounding for products and sums.
//! Sizes cover the serial and the parallel paths, ties, NaN, ±0 and ±∞, rows dropped from every
//! expert, and experts that receive no rows. The vectorised math (`exp`, `ln`, GELU) and Adam
//! are in `cpu_math.rs`, which shares this file's helpers.

use crate::DType;
use crate::backend::cpu::{CpuBackend, CpuBuffer};
use crate::backend::{
    BufferOps, ElementwiseOps, ExpertBankDims, GroupedMatmulDims, HostData, LayoutOps, MatmulOps,
    ReduceOps, ScatterDims, Strided,
};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// An expert bank's sizes `[experts, k, m]`.
pub(super) fn bank_dims(k: usize, m: usize, experts: usize) -> ExpertBankDims {
    ExpertBankDims { k, m, experts }
}

pub(super) const CPU: CpuBackend = CpuBackend;

pub(super) fn up(h: HostData) -> CpuBuffer {
    CPU.upload(&h).unwrap()
}

pub(super) fn down_i32(b: &CpuBuffer) -> Vec<i32> {
    match CPU.download(b).unwrap() {
        HostData::I32(v) => v,
        other => panic!("expected i32 data, got {:?}", other.dtype()),
    }
}

pub(super) fn down_f64(b: &CpuBuffer) -> Vec<f64> {
    CPU.download(b).unwrap().to_f64()
}

/// The documented argsort: a stable sort of each row, NaN as the smallest value.
fn reference_argsort(x: &[f64], rows: usize, len: usize, descending: bool) -> Vec<i32> {
    let mut out = Vec::with_capacity(rows * len);
    for r in 0..rows {
        let row = &x[r * len..(r + 1) * len];
        let key = |i: usize| {
            if row[i].is_nan() {
                f64::NEG_INFINITY
            } else {
                row[i]
            }
        };
        let mut ids: Vec<usize> = (0..len).collect();
        ids.sort_by(|&i, &j| {
            let o = key(i).partial_cmp(&key(j)).unwrap();
            if descending { o.reverse() } else { o }
        });
        out.extend(ids.into_iter().map(|i| i as i32));
    }
    out
}

#[test]
fn argsort_top_rejects_k_beyond_the_row() {
    let x = up(HostData::F32(vec![1.0, 2.0, 3.0]));
    assert!(matches!(
        CPU.argsort_top(&x, 1, 3, 4, true),
        Err(crate::Error::Shape(_))
    ));
}

#[test]
fn argsort_is_the_stable_sort_with_nan_lowest_in_f32_and_f64() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for (rows, len) in [
        (0usize, 4usize),
        (3, 0),
        (1, 1),
        (3, 5),
        (4096, 64),
        (300, 7),
        (1, 5000),
        (2, 1025),
    ] {
        // few distinct values (many ties, which must keep index order), and the special values
        let mut x: Vec<f64> = (0..rows * len)
            .map(|_| rng.random_range(0..8) as f64 * 0.5 - 2.0)
            .collect();
        for (i, v) in x.iter_mut().enumerate() {
            match i % 13 {
                1 => *v = f64::NAN,
                4 => *v = -0.0,
                5 => *v = 0.0,
                7 => *v = f64::NEG_INFINITY,
                9 => *v = f64::INFINITY,
                11 => *v = rng.random_range(-1e-30..1e-30),
                _ => {}
            }
        }
        let x32: Vec<f32> = x.iter().map(|&v| v as f32).collect();
        let x32_back: Vec<f64> = x32.iter().map(|&v| v as f64).collect();
        for descending in [false, true] {
            let got = CPU
                .argsort(&up(HostData::F64(x.clone())), rows, len, descending)
                .unwrap();
            assert_eq!(
                down_i32(&got),
                reference_argsort(&x, rows, len, descending),
                "f64 argsort [{rows}, {len}] descending {descending}"
            );
            let want32 = reference_argsort(&x32_back, rows, len, descending);
            let got = CPU
                .argsort(&up(HostData::F32(x32.clone())), rows, len, descending)
                .unwrap();
            assert_eq!(
                down_i32(&got),
                want32,
                "f32 argsort [{rows}, {len}] descending {descending}"
            );
            // argsort_top (top-k routing): the first k columns, selected rather than sorted
            let want64 = reference_argsort(&x, rows, len, descending);
            for k in [0, 1, 2, 3, 8, 9, len / 2, len.saturating_sub(1), len] {
                if k > len {
                    continue;
                }
                let first = |all: &[i32]| -> Vec<i32> {
                    all.chunks(len.max(1))
                        .flat_map(|row| row[..k.min(row.len())].to_vec())
                        .collect()
                };
                let got = CPU
                    .argsort_top(&up(HostData::F32(x32.clone())), rows, len, k, descending)
                    .unwrap();
                assert_eq!(
                    down_i32(&got),
                    first(&want32),
                    "f32 argsort_top [{rows}, {len}] k {k} descending {descending}"
                );
                let got = CPU
                    .argsort_top(&up(HostData::F64(x.clone())), rows, len, k, descending)
                    .unwrap();
                assert_eq!(
                    down_i32(&got),
                    first(&want64),
                    "f64 argsort_top [{rows}, {len}] k {k} descending {descending}"
                );
            }
        }
    }
}

/// `out[r] = x[r] · W[e_r]` (or `W[e_r]ᵀ`) with zeros for rows whose expert is out of range.
#[allow(clippy::too_many_arguments)]
fn reference_grouped(
    x: &[f64],
    w: &[f64],
    re: &[i32],
    rows: usize,
    k: usize,
    m: usize,
    n: usize,
    transpose_w: bool,
) -> Vec<f64> {
    let mut out = vec![0.0; rows * m];
    for r in 0..rows {
        let e = re[r];
        if e < 0 || e as usize >= n {
            continue;
        }
        let e = e as usize;
        for j in 0..m {
            let mut s = 0.0;
            for i in 0..k {
                let wij = if transpose_w {
                    w[e * k * m + j * k + i]
                } else {
                    w[e * k * m + i * m + j]
                };
                s += x[r * k + i] * wij;
            }
            out[r * m + j] = s;
        }
    }
    out
}

/// Expert of each row, sorted by expert, with some rows dropped (−1) and expert `empty`
/// receiving none; `offsets[e]` is where expert e's rows start.
pub(super) fn routed_rows(
    rng: &mut ChaCha8Rng,
    rows: usize,
    n: usize,
    empty: usize,
) -> (Vec<i32>, Vec<i32>) {
    let mut re: Vec<i32> = (0..rows)
        .map(|_| {
            loop {
                let e = rng.random_range(0..n);
                if e != empty {
                    break e as i32;
                }
            }
        })
        .collect();
    re.sort();
    let mut offsets = vec![0i32; n + 1];
    for e in 0..n {
        offsets[e + 1] = offsets[e] + re.iter().filter(|&&x| x == e as i32).count() as i32;
    }
    // drop every 17th row (as a capacity limit would): expert −1 in place
    for (i, v) in re.iter_mut().enumerate() {
        if i % 17 == 3 {
            *v = -1;
        }
    }
    (re, offsets)
}

#[test]
fn grouped_matmul_matches_the_loop_in_row_blocks_and_small_runs() {
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    // (rows, k, m, experts): long runs cut into several blocks, many short runs, tiny, empty
    for (rows, k, m, n) in [
        (3000usize, 24usize, 40usize, 2usize),
        (700, 16, 33, 24),
        (5, 3, 4, 3),
        (0, 8, 8, 2),
    ] {
        let (re, _) = routed_rows(&mut rng, rows, n, 1);
        let x: Vec<f64> = (0..rows * k).map(|_| rng.random_range(-1.0..1.0)).collect();
        let w: Vec<f64> = (0..n * k * m)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let bias: Vec<f64> = (0..n * m).map(|_| rng.random_range(-1.0..1.0)).collect();
        // (transpose_w, with the expert bias): the bias only goes with the forward product
        for (transpose_w, with_bias) in [(false, false), (true, false), (false, true)] {
            let mut want = reference_grouped(&x, &w, &re, rows, k, m, n, transpose_w);
            if with_bias {
                for (r, &e) in re.iter().enumerate() {
                    if e >= 0 {
                        let b = &bias[e as usize * m..][..m];
                        want[r * m..][..m]
                            .iter_mut()
                            .zip(b)
                            .for_each(|(o, b)| *o += b);
                    }
                }
            }
            let bias_buf = with_bias.then(|| up(HostData::F64(bias.clone())));
            let got = CPU
                .grouped_matmul(
                    &up(HostData::F64(x.clone())),
                    &up(HostData::F64(w.clone())),
                    bias_buf.as_ref(),
                    &up(HostData::I32(re.clone())),
                    GroupedMatmulDims {
                        rows,
                        k,
                        m,
                        experts: n,
                        transpose_w,
                    },
                )
                .unwrap();
            let got = down_f64(&got);
            assert_eq!(got.len(), want.len());
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (g - w).abs() <= 1e-12 * (1.0 + w.abs()),
                    "grouped_matmul [{rows}, {k}]·[{n}, {k}, {m}] transpose {transpose_w}, \
                     bias {with_bias}: element {i} is {g}, want {w}"
                );
                if re[i / m] < 0 {
                    assert_eq!(
                        g.to_bits(),
                        0.0f64.to_bits(),
                        "dropped row {} not zero",
                        i / m
                    );
                }
            }
        }
    }
}

#[test]
fn grouped_weight_grad_matches_the_loop_and_is_exactly_zero_for_unused_experts() {
    let mut rng = ChaCha8Rng::seed_from_u64(13);
    for (rows, k, m, n) in [
        (3000usize, 12usize, 20usize, 3usize),
        (600, 8, 9, 40),
        (0, 4, 4, 2),
    ] {
        let empty = 1;
        let (re, offsets) = routed_rows(&mut rng, rows, n, empty);
        let x: Vec<f64> = (0..rows * k).map(|_| rng.random_range(-1.0..1.0)).collect();
        let dy: Vec<f64> = (0..rows * m).map(|_| rng.random_range(-1.0..1.0)).collect();
        let mut want = vec![0.0; n * k * m];
        for r in 0..rows {
            if re[r] < 0 {
                continue;
            }
            let e = re[r] as usize;
            for i in 0..k {
                for j in 0..m {
                    want[e * k * m + i * m + j] += x[r * k + i] * dy[r * m + j];
                }
            }
        }
        // free a NaN block of the output's size first, which the allocator may hand back
        drop(up(HostData::F64(vec![f64::NAN; n * k * m])));
        let got = CPU
            .grouped_weight_grad(
                &up(HostData::F64(x)),
                &up(HostData::F64(dy)),
                &up(HostData::I32(re.clone())),
                &up(HostData::I32(offsets)),
                ExpertBankDims { k, m, experts: n },
                DType::F64,
            )
            .unwrap();
        let got = down_f64(&got);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-12 * (1.0 + w.abs()),
                "grouped_weight_grad [{rows}, {k}]ᵀ·[{rows}, {m}] over {n} experts: element {i} \
                 is {g}, want {w}"
            );
        }
        let e = empty.min(n - 1);
        let used = re.contains(&(e as i32));
        if !used {
            assert!(
                got[e * k * m..(e + 1) * k * m]
                    .iter()
                    .all(|v| v.to_bits() == 0),
                "expert {e} received no rows but its gradient is not exactly zero"
            );
        }
    }
}

#[test]
fn sums_along_contiguous_rows_match_the_loop_in_blocks_and_lanes() {
    use crate::backend::{AxisView, ReduceOp};
    let mut rng = ChaCha8Rng::seed_from_u64(14);
    // one long row (summed in blocks), many rows (in parallel), short rows, empty shapes
    for (outer, len) in [
        (1usize, 200_003usize),
        (3, 70_000),
        (3000, 257),
        (5, 9),
        (0, 5),
        (4, 0),
    ] {
        let x: Vec<f64> = (0..outer * len)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let view = AxisView {
            outer,
            len,
            inner: 1,
        };
        let want: Vec<f64> = (0..outer)
            .map(|o| x[o * len..(o + 1) * len].iter().sum())
            .collect();
        let got = down_f64(
            &CPU.reduce(ReduceOp::Sum, &up(HostData::F64(x.clone())), view)
                .unwrap(),
        );
        let got32 = down_f64(
            &CPU.reduce(
                ReduceOp::Sum,
                &up(HostData::F32(x.iter().map(|&v| v as f32).collect())),
                view,
            )
            .unwrap(),
        );
        assert_eq!(got.len(), outer);
        for o in 0..outer {
            let scale = (len as f64).sqrt().max(1.0);
            assert!(
                (got[o] - want[o]).abs() <= 1e-12 * scale,
                "f64 sum of row {o} of [{outer}, {len}]: {} vs {}",
                got[o],
                want[o]
            );
            assert!(
                (got32[o] - want[o]).abs() <= 1e-5 * scale,
                "f32 sum of row {o} of [{outer}, {len}]: {} vs {}",
                got32[o],
                want[o]
            );
        }
    }
}

#[test]
fn where_matches_the_loop_for_contiguous_scalar_and_broadcast_operands() {
    let mut rng = ChaCha8Rng::seed_from_u64(15);
    let (rows, cols) = (300usize, 257usize);
    let n = rows * cols;
    let shape = [rows, cols];
    let full = [cols, 1];
    let cond: Vec<f64> = (0..n)
        .map(|i| match i % 5 {
            0 => 0.0,
            1 => -0.0,
            2 => f64::NAN,
            _ => rng.random_range(-1.0..1.0),
        })
        .collect();
    let a: Vec<f64> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
    let b: Vec<f64> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
    let row_b: Vec<f64> = (0..rows).map(|_| rng.random_range(-1.0..1.0)).collect();
    // (b, its strides, b expanded to every element): contiguous, one value, one value per row
    let cases = [
        (b.clone(), full, b.clone()),
        (vec![7.5], [0, 0], vec![7.5; n]),
        (
            row_b.clone(),
            [1, 0],
            (0..n).map(|i| row_b[i / cols]).collect::<Vec<f64>>(),
        ),
    ];
    for (bv, sb, b_full) in cases {
        let (cond_buf, a_buf, b_buf) = (
            up(HostData::F64(cond.clone())),
            up(HostData::F64(a.clone())),
            up(HostData::F64(bv)),
        );
        let operand = |buf, strides| Strided { buf, strides };
        let got = down_f64(
            &CPU.where_cond(
                operand(&cond_buf, &full[..]),
                operand(&a_buf, &full[..]),
                operand(&b_buf, &sb[..]),
                &shape,
            )
            .unwrap(),
        );
        for i in 0..n {
            let want = if cond[i] != 0.0 { a[i] } else { b_full[i] };
            assert_eq!(
                got[i].to_bits(),
                want.to_bits(),
                "where, b strides {sb:?}, element {i}"
            );
        }
    }
}

#[test]
fn max_and_min_along_contiguous_rows_match_the_serial_fold_including_nan_and_infinities() {
    use crate::backend::{AxisView, ReduceOp};
    let mut rng = ChaCha8Rng::seed_from_u64(15);
    for (outer, len) in [
        (4096usize, 64usize),
        (3, 70_000),
        (7, 13),
        (5, 3),
        (0, 5),
        (2, 1),
    ] {
        let mut x: Vec<f64> = (0..outer * len)
            .map(|_| rng.random_range(-100.0..100.0))
            .collect();
        for (i, v) in x.iter_mut().enumerate() {
            match i % 17 {
                3 => *v = f64::NAN,
                8 if i % 3 == 0 => *v = f64::INFINITY,
                12 if i % 5 == 0 => *v = f64::NEG_INFINITY,
                _ => {}
            }
        }
        if outer * len > 0 {
            // one row of NaN only: the fold's identity (−∞ for max, +∞ for min)
            x[..len].fill(f64::NAN);
        }
        let view = AxisView {
            outer,
            len,
            inner: 1,
        };
        for op in [ReduceOp::Max, ReduceOp::Min] {
            let want: Vec<f64> = (0..outer)
                .map(|o| {
                    let row = &x[o * len..(o + 1) * len];
                    match op {
                        ReduceOp::Max => row.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b)),
                        _ => row.iter().fold(f64::INFINITY, |a, &b| a.min(b)),
                    }
                })
                .collect();
            let got = down_f64(&CPU.reduce(op, &up(HostData::F64(x.clone())), view).unwrap());
            assert_eq!(got, want, "{op:?} of [{outer}, {len}] in f64");
            let x32: Vec<f32> = x.iter().map(|&v| v as f32).collect();
            let got32 = down_f64(&CPU.reduce(op, &up(HostData::F32(x32)), view).unwrap());
            let want32: Vec<f64> = want.iter().map(|&v| v as f32 as f64).collect();
            assert_eq!(got32, want32, "{op:?} of [{outer}, {len}] in f32");
        }
    }
}

#[test]
fn scatter_of_whole_rows_is_the_in_order_sum_of_each_rows_sources() {
    let mut rng = ChaCha8Rng::seed_from_u64(16);
    // (outer, source rows, row width, destination rows): the MoE combine (two sources per token,
    // in a shuffled order), destinations that receive nothing, many sources per destination
    for (outer, m, inner, len) in [
        (1usize, 8192usize, 256usize, 4096usize),
        (1, 50, 3, 400),
        (3, 40, 5, 4),
        (3, 40, 20, 4),
        (2, 0, 4, 3),
        (1, 7, 1, 7),
    ] {
        let src: Vec<f64> = (0..outer * m * inner)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let idx: Vec<i32> = (0..outer * m)
            .map(|_| rng.random_range(0..len as i32))
            .collect();
        let mut want = vec![0.0f64; outer * len * inner];
        for o in 0..outer {
            for j in 0..m {
                let k = idx[o * m + j] as usize;
                for i in 0..inner {
                    want[(o * len + k) * inner + i] += src[(o * m + j) * inner + i];
                }
            }
        }
        let s = [m, 1, 0];
        let dims = ScatterDims {
            outer,
            m,
            inner,
            len,
        };
        let got = CPU
            .scatter_add(
                &up(HostData::F64(src.clone())),
                &up(HostData::I32(idx.clone())),
                s,
                dims,
            )
            .unwrap();
        assert_eq!(
            down_f64(&got),
            want,
            "rows scatter [{outer}, {m}, {inner}] → {len}"
        );
        let src32: Vec<f32> = src.iter().map(|&v| v as f32).collect();
        let got = CPU
            .scatter_add(&up(HostData::F32(src32)), &up(HostData::I32(idx)), s, dims)
            .unwrap();
        for (g, w) in down_f64(&got).iter().zip(&want) {
            assert!((g - w).abs() <= 1e-5, "f32 rows scatter: {g} vs {w}");
        }
    }
    // an index out of range is an error, not a panic
    let bad = CPU.scatter_add(
        &up(HostData::F32(vec![1.0; 4])),
        &up(HostData::I32(vec![0, 5])),
        [2, 1, 0],
        ScatterDims {
            outer: 1,
            m: 2,
            inner: 2,
            len: 3,
        },
    );
    assert!(bad.is_err());
}

#[test]
fn reductions_across_rows_match_the_column_loop_bit_for_bit() {
    use crate::backend::{AxisView, ReduceOp};
    let mut rng = ChaCha8Rng::seed_from_u64(17);
    // a bias gradient ([rows, n] over rows), a middle axis, big enough for threads, empty shapes
    for (outer, len, inner) in [
        (1usize, 768usize, 512usize),
        (3, 7, 5),
        (40, 33, 1100),
        (2, 0, 4),
        (0, 3, 4),
        (5, 1, 2),
    ] {
        let mut x: Vec<f64> = (0..outer * len * inner)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        for (i, v) in x.iter_mut().enumerate() {
            match i % 23 {
                4 => *v = f64::NAN,
                9 if i % 3 == 0 => *v = f64::INFINITY,
                _ => {}
            }
        }
        let view = AxisView { outer, len, inner };
        for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
            // each output folds its column in order j = 0, 1, …
            let column = |x: &[f64], o: usize, i: usize, f: &dyn Fn(f64, f64) -> f64, id: f64| {
                (0..len).fold(id, |a, j| f(a, x[(o * len + j) * inner + i]))
            };
            let want: Vec<f64> = (0..outer * inner)
                .map(|oi| {
                    let (o, i) = (oi / inner, oi % inner);
                    match op {
                        ReduceOp::Sum => column(&x, o, i, &|a, b| a + b, 0.0),
                        ReduceOp::Max => column(&x, o, i, &|a, b| a.max(b), f64::NEG_INFINITY),
                        _ => column(&x, o, i, &|a, b| a.min(b), f64::INFINITY),
                    }
                })
                .collect();
            let got = down_f64(&CPU.reduce(op, &up(HostData::F64(x.clone())), view).unwrap());
            assert_eq!(got.len(), want.len());
            for (k, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                    "{op:?} of [{outer}, {len}, {inner}] at {k}: {g} vs {w}"
                );
            }
            // f32: the same fold in f32
            let x32: Vec<f32> = x.iter().map(|&v| v as f32).collect();
            let got32 = down_f64(
                &CPU.reduce(op, &up(HostData::F32(x32.clone())), view)
                    .unwrap(),
            );
            for (k, g) in got32.iter().enumerate() {
                let (o, i) = (k / inner, k % inner);
                let w = (0..len).fold(
                    match op {
                        ReduceOp::Sum => 0.0f32,
                        ReduceOp::Max => f32::NEG_INFINITY,
                        _ => f32::INFINITY,
                    },
                    |a, j| {
                        let b = x32[(o * len + j) * inner + i];
                        match op {
                            ReduceOp::Sum => a + b,
                            ReduceOp::Max => a.max(b),
                            _ => a.min(b),
                        }
                    },
                );
                assert!(
                    (*g as f32).to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                    "f32 {op:?} of [{outer}, {len}, {inner}] at {k}: {g} vs {w}"
                );
            }
        }
    }
}

/// `copy_strided` (the kernel of permute, transpose, slice and expand) against the definition,
/// `out[i] = x[offset + Σ_d index_d(i)·strides_d]`, over random shapes of rank 0 to 5, random
/// axis orders, offsets, broadcast (zero) strides and last-axis strides other than 1, with
/// outputs large enough that several tasks each start mid-way through the leading axes.
#[test]
fn strided_copy_matches_the_definition() {
    let mut rng = ChaCha8Rng::seed_from_u64(17);
    for case in 0..200 {
        let rank = rng.random_range(0..6usize);
        let big = case % 4 == 0;
        let shape: Vec<usize> = (0..rank)
            .map(|_| rng.random_range(1..if big { 24 } else { 6 }))
            .collect();
        // a contiguous source of a permuted shape, read through its permuted strides
        let mut order: Vec<usize> = (0..rank).collect();
        for i in (1..rank).rev() {
            order.swap(i, rng.random_range(0..=i));
        }
        let mut strides = vec![0usize; rank];
        let mut step = 1;
        for &d in order.iter().rev() {
            strides[d] = step;
            step *= shape[d];
        }
        if rank > 0 && rng.random_range(0..4) == 0 {
            strides[rng.random_range(0..rank)] = 0; // expand
        }
        let offset = rng.random_range(0..3);
        let len = offset + step;
        let x: Vec<f64> = (0..len).map(|i| i as f64).collect();
        let got = down_f64(
            &CPU.copy_strided(&up(HostData::F64(x.clone())), &shape, &strides, offset)
                .unwrap(),
        );
        let n: usize = shape.iter().product();
        let want: Vec<f64> = (0..n)
            .map(|i| {
                let (mut rest, mut at) = (i, offset);
                for d in (0..rank).rev() {
                    at += (rest % shape[d]) * strides[d];
                    rest /= shape[d];
                }
                x[at]
            })
            .collect();
        assert_eq!(
            got, want,
            "shape {shape:?} strides {strides:?} offset {offset}"
        );
    }
}

#[test]
fn zeroed_buffers_are_all_zero_even_when_recycled_from_dirty_ones() {
    // sizes on both sides of the parallel threshold; each first fills a buffer of the same size
    // with ones and drops it, so the pool is likely to hand that block back to `zeroed`
    for len in [1000usize, 40_000, 100_003, 1 << 20] {
        for _ in 0..3 {
            drop(up(HostData::F32(vec![1.0; len])));
            let z: Vec<f32> = crate::backend::cpu::zeroed(len);
            assert_eq!(z.len(), len);
            if let Some(i) = z.iter().position(|&v| v.to_bits() != 0) {
                panic!("zeroed({len}): element {i} is {}", z[i]);
            }
        }
    }
}
