//! GPU primitives against the CPU backend, one primitive at a time, through the family traits:
//! buffers, casts, elementwise ops, reductions and scans, layout (sorting, random numbers, the
//! optimizer steps and the batching and pool are in `gpu_sort_optim.rs`, with these helpers).
//!
//! Every test feeds identical f32 (or i32) inputs to `CpuBackend` and `GpuBackend` and compares:
//! exactly for data movement, integer results, sorting, scatter_add (same order of additions),
//! serial reductions and random numbers; within a small tolerance for transcendental functions
//! and tree reductions. Sizes include 0, 1, non-multiples of the 256-invocation workgroup, and
//! one launch of more than 65535·256 elements (the grid folds into two dimensions).
//!
//! Without a GPU adapter each test prints "skipping ..." and passes; with `MOEGRAD_REQUIRE_GPU=1`
//! a missing adapter fails. GPU tests take a lock so that they run one at a time (the software
//! rasterizer used in CI is multi-threaded itself, and the pool-reuse test counts buffers).

use super::kernels_of;
use crate::backend::cpu::{CpuBackend, CpuBuffer};
use crate::backend::gpu::{GpuBackend, GpuBuffer};
use crate::backend::{
    AxisView, BinaryOp, BufferOps, ElementwiseOps, HostData, LayoutOps, ReduceOp, ReduceOps,
    ScatterDims, Strided, UnaryOp,
};
use crate::common;
use crate::{DType, Error};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::MutexGuard;

/// A buffer read through `strides` (an operand of `where_cond`).
pub(super) fn strided<'a, B>(buf: &'a B, strides: &'a [usize]) -> Strided<'a, B> {
    Strided { buf, strides }
}

/// The GPU backend and the lock that serialises GPU tests, or `None` when skipping.
pub(super) fn gpu(test: &str) -> Option<(GpuBackend, MutexGuard<'static, ()>)> {
    common::gpu_or_skip(test)?;
    let guard = super::gpu_lock();
    Some((GpuBackend::get().expect("Device::gpu succeeded"), guard))
}

pub(super) const CPU: CpuBackend = CpuBackend;

pub(super) fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

pub(super) fn rand_vec(r: &mut ChaCha8Rng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| r.random_range(lo..hi)).collect()
}

pub(super) fn up(g: &GpuBackend, v: &[f32]) -> GpuBuffer {
    g.upload(&HostData::F32(v.to_vec())).unwrap()
}
pub(super) fn up_i(g: &GpuBackend, v: &[i32]) -> GpuBuffer {
    g.upload(&HostData::I32(v.to_vec())).unwrap()
}
pub(super) fn cpu(v: &[f32]) -> CpuBuffer {
    CPU.upload(&HostData::F32(v.to_vec())).unwrap()
}
pub(super) fn cpu_i(v: &[i32]) -> CpuBuffer {
    CPU.upload(&HostData::I32(v.to_vec())).unwrap()
}
pub(super) fn g_down(g: &GpuBackend, b: &GpuBuffer) -> HostData {
    g.download(b).unwrap()
}
pub(super) fn c_down(b: &CpuBuffer) -> HostData {
    CPU.download(b).unwrap()
}
pub(super) fn f32s(h: HostData) -> Vec<f32> {
    match h {
        HostData::F32(v) => v,
        other => panic!("expected f32 data, got {:?}", other.dtype()),
    }
}

/// Asserts `|got − want| ≤ atol + rtol·|want|` elementwise (NaN matches NaN, ±inf must match).
pub(super) fn assert_close(what: &str, got: &[f32], want: &[f32], atol: f32, rtol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = if w.is_nan() {
            g.is_nan()
        } else if w.is_infinite() {
            g == w
        } else {
            (g - w).abs() <= atol + rtol * w.abs()
        };
        assert!(ok, "{what}: element {i}: gpu {g}, cpu {w}");
    }
}

/// Asserts bit equality of f32 data (with NaN payloads ignored).
pub(super) fn assert_bits(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
            "{what}: element {i}: gpu {g} ({:#x}), cpu {w} ({:#x})",
            g.to_bits(),
            w.to_bits()
        );
    }
}

/// Contiguous strides of a shape.
pub(super) fn contiguous(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * shape[d + 1];
    }
    s
}

// ---- buffers, fill, cast ----------------------------------------------------------------------

#[test]
fn upload_download_full_roundtrip() {
    let Some((g, _l)) = gpu("upload_download_full_roundtrip") else {
        return;
    };
    for n in [0usize, 1, 255, 256, 257, 1000, 70_000] {
        let v: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 - 3.0).collect();
        assert_eq!(g_down(&g, &up(&g, &v)), HostData::F32(v));
        let iv: Vec<i32> = (0..n as i32).map(|i| i * 7 - 100).collect();
        assert_eq!(g_down(&g, &up_i(&g, &iv)), HostData::I32(iv));
        for (value, dtype) in [(2.5, DType::F32), (-7.9, DType::I32), (0.0, DType::F32)] {
            let got = g_down(&g, &g.full(n, value, dtype).unwrap());
            assert_eq!(got, c_down(&CPU.full(n, value, dtype).unwrap()), "full {n}");
        }
    }
}

#[test]
fn f64_is_a_dtype_error_on_the_gpu() {
    let Some((g, _l)) = gpu("f64_is_a_dtype_error_on_the_gpu") else {
        return;
    };
    assert!(matches!(
        g.upload(&HostData::F64(vec![1.0])),
        Err(Error::DType(_))
    ));
    assert!(matches!(g.full(3, 1.0, DType::F64), Err(Error::DType(_))));
    let x = up(&g, &[1.0, 2.0]);
    assert!(matches!(g.cast(&x, DType::F64), Err(Error::DType(_))));
    assert!(matches!(
        g.random_uniform(4, 1, DType::F64),
        Err(Error::DType(_))
    ));
}

#[test]
fn cast_matches_cpu() {
    let Some((g, _l)) = gpu("cast_matches_cpu") else {
        return;
    };
    let mut r = rng(1);
    let mut v = rand_vec(&mut r, 1000, -1e4, 1e4);
    v.extend([
        0.0,
        -0.0,
        0.99,
        -0.99,
        2.5,
        -2.5,
        3e9,
        -3e9,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        2147483520.0,
        -2147483648.0,
    ]);
    let to_i = g.cast(&up(&g, &v), DType::I32).unwrap();
    assert_eq!(to_i.dtype(), DType::I32);
    let want = c_down(&CPU.cast(&cpu(&v), DType::I32).unwrap());
    assert_eq!(g_down(&g, &to_i), want);
    let iv: Vec<i32> = (0..999).map(|i| (i - 500) * 12345).collect();
    let to_f = g.cast(&up_i(&g, &iv), DType::F32).unwrap();
    assert_eq!(
        g_down(&g, &to_f),
        c_down(&CPU.cast(&cpu_i(&iv), DType::F32).unwrap())
    );
    let same = g.cast(&up(&g, &v[..5]), DType::F32).unwrap();
    assert_bits("same dtype", &f32s(g_down(&g, &same)), &v[..5]);
    let empty = g.cast(&up(&g, &[]), DType::I32).unwrap();
    assert_eq!(g_down(&g, &empty), HostData::I32(vec![]));
}

// ---- elementwise ------------------------------------------------------------------------------

#[test]
fn unary_ops_match_cpu() {
    let Some((g, _l)) = gpu("unary_ops_match_cpu") else {
        return;
    };
    let mut r = rng(2);
    let ops = [
        UnaryOp::Neg,
        UnaryOp::Exp,
        UnaryOp::Log,
        UnaryOp::Sqrt,
        UnaryOp::Abs,
        UnaryOp::Relu,
        UnaryOp::Gelu,
        UnaryOp::GeluGrad,
        UnaryOp::Silu,
        UnaryOp::Tanh,
        UnaryOp::Sigmoid,
        UnaryOp::Softplus,
        UnaryOp::Softsign,
        UnaryOp::Recip,
        UnaryOp::Step,
        UnaryOp::Sign,
        UnaryOp::Powf(2.0),
        UnaryOp::Powf(3.0),
        UnaryOp::Powf(0.5),
        UnaryOp::Powf(-1.5),
        UnaryOp::Clamp(-0.5, 0.25),
        UnaryOp::AddScalar(0.1),
        UnaryOp::MulScalar(-3.0),
    ];
    for n in [0usize, 1, 300, 1031] {
        let signed = rand_vec(&mut r, n, -6.0, 6.0);
        let positive = rand_vec(&mut r, n, 0.05, 8.0);
        for op in ops {
            let domain_positive = matches!(
                op,
                UnaryOp::Log | UnaryOp::Sqrt | UnaryOp::Powf(0.5) | UnaryOp::Powf(-1.5)
            );
            let x = if domain_positive { &positive } else { &signed };
            let got = f32s(g_down(&g, &g.unary(op, &up(&g, x)).unwrap()));
            let want = f32s(c_down(&CPU.unary(op, &cpu(x)).unwrap()));
            assert_close(&format!("{op:?} n={n}"), &got, &want, 1e-5, 1e-5);
        }
    }
    // special values: saturating tanh/gelu, signed zeros, NaN through relu/clamp (Rust's max
    // ignores NaN), negative bases of integer powers, logs of 0 and negatives
    let special = [
        0.0f32,
        -0.0,
        100.0,
        -100.0,
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        -2.0,
        1e-30,
    ];
    for op in [
        UnaryOp::Tanh,
        UnaryOp::Gelu,
        UnaryOp::Relu,
        UnaryOp::Clamp(-1.0, 1.0),
        UnaryOp::Powf(3.0),
        UnaryOp::Powf(2.0),
        UnaryOp::Powf(0.0),
        UnaryOp::Log,
        UnaryOp::Sqrt,
        UnaryOp::Sigmoid,
        UnaryOp::Softplus,
        UnaryOp::Sign,
        UnaryOp::Step,
    ] {
        let got = f32s(g_down(&g, &g.unary(op, &up(&g, &special)).unwrap()));
        let want = f32s(c_down(&CPU.unary(op, &cpu(&special)).unwrap()));
        assert_close(&format!("{op:?} special"), &got, &want, 1e-6, 1e-5);
    }
    let i = up_i(&g, &[1, 2]);
    assert!(matches!(g.unary(UnaryOp::Exp, &i), Err(Error::DType(_))));
}

/// Runs one binary op on both backends and compares.
#[allow(clippy::too_many_arguments)]
fn check_binary(
    g: &GpuBackend,
    op: BinaryOp,
    a: &[f32],
    sa: &[usize],
    b: &[f32],
    sb: &[usize],
    shape: &[usize],
) {
    let got = f32s(g_down(
        g,
        &g.binary(op, &up(g, a), sa, &up(g, b), sb, shape).unwrap(),
    ));
    let want = f32s(c_down(
        &CPU.binary(op, &cpu(a), sa, &cpu(b), sb, shape).unwrap(),
    ));
    assert_close(
        &format!("{op:?} {shape:?} {sa:?} {sb:?}"),
        &got,
        &want,
        1e-6,
        2e-6,
    );
}

#[test]
fn binary_ops_broadcast_like_cpu() {
    let Some((g, _l)) = gpu("binary_ops_broadcast_like_cpu") else {
        return;
    };
    let mut r = rng(3);
    let ops = [
        BinaryOp::Add,
        BinaryOp::Sub,
        BinaryOp::Mul,
        BinaryOp::Div,
        BinaryOp::Max,
        BinaryOp::Min,
        BinaryOp::Pow,
        BinaryOp::Gt,
        BinaryOp::Ge,
        BinaryOp::Lt,
        BinaryOp::Le,
        BinaryOp::Eq,
        BinaryOp::Ne,
    ];
    // (shape, a strides, a len, b strides, b len)
    type Case = (Vec<usize>, Vec<usize>, usize, Vec<usize>, usize);
    let cases: Vec<Case> = vec![
        (vec![0], vec![1], 0, vec![1], 0),
        (vec![1], vec![1], 1, vec![1], 1),
        (vec![777], vec![1], 777, vec![1], 777),
        (vec![37, 29], vec![29, 1], 37 * 29, vec![0, 1], 29),
        (vec![37, 29], vec![29, 1], 37 * 29, vec![1, 0], 37),
        (vec![37, 29], vec![1, 37], 37 * 29, vec![0, 0], 1),
        (
            vec![3, 1, 5, 7],
            vec![35, 35, 7, 1],
            105,
            vec![0, 0, 1, 5],
            35,
        ),
        (
            vec![2, 2, 2, 2, 2, 2, 2, 3, 2],
            contiguous(&[2, 2, 2, 2, 2, 2, 2, 3, 2]),
            768,
            vec![0, 0, 0, 0, 0, 0, 0, 2, 1],
            6,
        ),
    ];
    for (shape, sa, na, sb, nb) in &cases {
        let mut a = rand_vec(&mut r, *na, -3.0, 3.0);
        let mut b = rand_vec(&mut r, *nb, -3.0, 3.0);
        // some exact ties for the comparisons
        for (x, y) in a.iter_mut().zip(b.iter_mut()).step_by(3) {
            *x = y.round();
            *y = y.round();
        }
        for op in ops {
            if op == BinaryOp::Pow {
                let pa: Vec<f32> = a.iter().map(|x| x.abs() + 0.1).collect();
                check_binary(&g, op, &pa, sa, &b, sb, shape);
            } else {
                check_binary(&g, op, &a, sa, &b, sb, shape);
            }
        }
    }
    // NaN in comparisons and max/min
    let a = [f32::NAN, 1.0, f32::NAN, 2.0];
    let b = [1.0, f32::NAN, f32::NAN, 2.0];
    for op in ops {
        check_binary(&g, op, &a, &[1], &b, &[1], &[4]);
    }
    // errors: dtype mismatch, strides that leave the buffer
    let (x, i) = (up(&g, &[1.0, 2.0]), up_i(&g, &[1, 2]));
    assert!(matches!(
        g.binary(BinaryOp::Add, &x, &[1], &i, &[1], &[2]),
        Err(Error::DType(_))
    ));
    assert!(g.binary(BinaryOp::Add, &x, &[1], &x, &[2], &[2]).is_err());
}

#[test]
fn where_cond_matches_cpu() {
    let Some((g, _l)) = gpu("where_cond_matches_cpu") else {
        return;
    };
    let mut r = rng(4);
    let shape = [13usize, 21];
    let cond: Vec<f32> = (0..13 * 21).map(|i| [0.0, 1.0, -0.0, 2.0][i % 4]).collect();
    let a = rand_vec(&mut r, 21, -1.0, 1.0);
    let b = rand_vec(&mut r, 13, -1.0, 1.0);
    let (sc, sa, sb) = ([21usize, 1], [0usize, 1], [1usize, 0]);
    let (gc, ga, gb) = (up(&g, &cond), up(&g, &a), up(&g, &b));
    let got = g
        .where_cond(
            strided(&gc, &sc),
            strided(&ga, &sa),
            strided(&gb, &sb),
            &shape,
        )
        .unwrap();
    let (cc, ca, cb) = (cpu(&cond), cpu(&a), cpu(&b));
    let want = CPU
        .where_cond(
            strided(&cc, &sc),
            strided(&ca, &sa),
            strided(&cb, &sb),
            &shape,
        )
        .unwrap();
    assert_bits("where", &f32s(g_down(&g, &got)), &f32s(c_down(&want)));
    let none = up(&g, &[]);
    let empty = g
        .where_cond(
            strided(&none, &[1]),
            strided(&none, &[1]),
            strided(&none, &[1]),
            &[0],
        )
        .unwrap();
    assert!(empty.is_empty());
}

// ---- reductions and scans ---------------------------------------------------------------------

#[test]
fn reductions_match_cpu() {
    let Some((g, _l)) = gpu("reductions_match_cpu") else {
        return;
    };
    let mut r = rng(5);
    let views = [
        AxisView {
            outer: 1,
            len: 1,
            inner: 1,
        },
        AxisView {
            outer: 3,
            len: 0,
            inner: 2,
        },
        AxisView {
            outer: 7,
            len: 13,
            inner: 5,
        },
        AxisView {
            outer: 1,
            len: 5000,
            inner: 1,
        }, // one long line: workgroup kernel
        AxisView {
            outer: 3,
            len: 700,
            inner: 2,
        }, // workgroup kernel, strided lines
        AxisView {
            outer: 300,
            len: 9,
            inner: 1,
        },
    ];
    for v in views {
        let n = v.outer * v.len * v.inner;
        let mut x = rand_vec(&mut r, n, -5.0, 5.0);
        // ties for argmax: repeat the running maximum
        for k in (7..n).step_by(11) {
            x[k] = x[k - 7];
        }
        for op in [
            ReduceOp::Sum,
            ReduceOp::Max,
            ReduceOp::Min,
            ReduceOp::ArgMax,
        ] {
            let got = g_down(&g, &g.reduce(op, &up(&g, &x), v).unwrap());
            let want = c_down(&CPU.reduce(op, &cpu(&x), v).unwrap());
            let what = format!("{op:?} {v:?}");
            match op {
                ReduceOp::ArgMax => assert_eq!(got, want, "{what}"),
                ReduceOp::Sum => assert_close(&what, &f32s(got), &f32s(want), 1e-4, 1e-5),
                _ => assert_bits(&what, &f32s(got), &f32s(want)),
            }
        }
    }
    // NaN: ignored by max/min, never the argmax unless everything is NaN
    let x = [
        f32::NAN,
        1.0,
        3.0,
        f32::NAN,
        3.0,
        f32::NAN,
        f32::NAN,
        f32::NAN,
    ];
    let v = AxisView {
        outer: 2,
        len: 4,
        inner: 1,
    };
    for op in [ReduceOp::Max, ReduceOp::Min, ReduceOp::ArgMax] {
        let got = g_down(&g, &g.reduce(op, &up(&g, &x), v).unwrap());
        let want = c_down(&CPU.reduce(op, &cpu(&x), v).unwrap());
        assert_eq!(format!("{got:?}"), format!("{want:?}"), "{op:?} with NaN");
    }
    let i = up_i(&g, &[1, 2]);
    let v = AxisView {
        outer: 1,
        len: 2,
        inner: 1,
    };
    assert!(matches!(
        g.reduce(ReduceOp::Sum, &i, v),
        Err(Error::DType(_))
    ));
}

#[test]
fn cumsum_matches_cpu() {
    let Some((g, _l)) = gpu("cumsum_matches_cpu") else {
        return;
    };
    let mut r = rng(6);
    for v in [
        AxisView {
            outer: 1,
            len: 1,
            inner: 1,
        },
        AxisView {
            outer: 4,
            len: 0,
            inner: 3,
        },
        AxisView {
            outer: 5,
            len: 17,
            inner: 3,
        },
        AxisView {
            outer: 1,
            len: 3001,
            inner: 1,
        },
        AxisView {
            outer: 2,
            len: 600,
            inner: 3,
        },
    ] {
        let x = rand_vec(&mut r, v.outer * v.len * v.inner, -1.0, 1.0);
        for reverse in [false, true] {
            let got = f32s(g_down(&g, &g.cumsum(&up(&g, &x), v, reverse).unwrap()));
            let want = f32s(c_down(&CPU.cumsum(&cpu(&x), v, reverse).unwrap()));
            assert_close(&format!("cumsum {v:?} {reverse}"), &got, &want, 1e-4, 1e-5);
        }
    }
}

// ---- layout -----------------------------------------------------------------------------------

#[test]
fn copy_strided_matches_cpu() {
    let Some((g, _l)) = gpu("copy_strided_matches_cpu") else {
        return;
    };
    let mut r = rng(7);
    let x = rand_vec(&mut r, 6 * 5 * 4, -1.0, 1.0);
    let xi: Vec<i32> = (0..120).collect();
    // (shape, strides, offset): transpose, permute, slice with offset, expand, scalar, empty
    let cases: Vec<(Vec<usize>, Vec<usize>, usize)> = vec![
        (vec![5, 6], vec![1, 5], 0),
        (vec![4, 6, 5], vec![1, 20, 4], 0),
        (vec![3, 2, 2], vec![20, 4, 1], 25),
        (vec![7, 3], vec![0, 1], 10),
        (vec![], vec![], 17),
        (vec![3, 0], vec![1, 1], 0),
        (vec![120], vec![1], 0),
    ];
    for (shape, strides, off) in &cases {
        let got = g.copy_strided(&up(&g, &x), shape, strides, *off).unwrap();
        let want = CPU.copy_strided(&cpu(&x), shape, strides, *off).unwrap();
        assert_eq!(g_down(&g, &got), c_down(&want), "{shape:?} {strides:?}");
        let got = g
            .copy_strided(&up_i(&g, &xi), shape, strides, *off)
            .unwrap();
        let want = CPU.copy_strided(&cpu_i(&xi), shape, strides, *off).unwrap();
        assert_eq!(g_down(&g, &got), c_down(&want), "i32 {shape:?}");
    }
    assert!(g.copy_strided(&up(&g, &x), &[2, 2], &[200, 1], 0).is_err());
}

#[test]
fn concat_matches_cpu() {
    let Some((g, _l)) = gpu("concat_matches_cpu") else {
        return;
    };
    let (outer, inner) = (3usize, 5usize);
    let lens = [2usize, 0, 7, 1];
    let parts: Vec<Vec<f32>> = lens
        .iter()
        .enumerate()
        .map(|(p, &l)| {
            (0..outer * l * inner)
                .map(|i| (p * 1000 + i) as f32)
                .collect()
        })
        .collect();
    let gp: Vec<GpuBuffer> = parts.iter().map(|p| up(&g, p)).collect();
    let cp: Vec<_> = parts.iter().map(|p| cpu(p)).collect();
    let got = g
        .concat(&gp.iter().collect::<Vec<_>>(), &lens, outer, inner)
        .unwrap();
    let want = CPU
        .concat(&cp.iter().collect::<Vec<_>>(), &lens, outer, inner)
        .unwrap();
    assert_eq!(g_down(&g, &got), c_down(&want));
    let a = up_i(&g, &[1, 2, 3, 4]);
    let b = up_i(&g, &[5, 6]);
    let got = g.concat(&[&a, &b], &[2, 1], 2, 1).unwrap();
    assert_eq!(g_down(&g, &got), HostData::I32(vec![1, 2, 5, 3, 4, 6]));
    let f = up(&g, &[1.0]);
    assert!(matches!(
        g.concat(&[&a, &f], &[2, 1], 1, 1),
        Err(Error::DType(_))
    ));
}

#[test]
fn gather_matches_cpu() {
    let Some((g, _l)) = gpu("gather_matches_cpu") else {
        return;
    };
    let mut r = rng(8);
    let v = AxisView {
        outer: 4,
        len: 9,
        inner: 6,
    };
    let x = rand_vec(&mut r, 4 * 9 * 6, -1.0, 1.0);
    // index_select: one index per row, shared by all o
    let m = 13;
    let rows: Vec<i32> = (0..m).map(|_| r.random_range(0..9)).collect();
    let got = g
        .gather(&up(&g, &x), v, &up_i(&g, &rows), [0, 1, 0], m)
        .unwrap();
    let want = CPU
        .gather(&cpu(&x), v, &cpu_i(&rows), [0, 1, 0], m)
        .unwrap();
    assert_eq!(g_down(&g, &got), c_down(&want));
    // full gather (take_along_axis): an index for every output element
    let full: Vec<i32> = (0..4 * m * 6).map(|_| r.random_range(0..9)).collect();
    let s = [m * 6, 6, 1];
    let got = g.gather(&up(&g, &x), v, &up_i(&g, &full), s, m).unwrap();
    let want = CPU.gather(&cpu(&x), v, &cpu_i(&full), s, m).unwrap();
    assert_eq!(g_down(&g, &got), c_down(&want));
    // i32 source (gathering labels)
    let xi: Vec<i32> = (0..4 * 9 * 6).collect();
    let got = g
        .gather(&up_i(&g, &xi), v, &up_i(&g, &rows), [0, 1, 0], m)
        .unwrap();
    let want = CPU
        .gather(&cpu_i(&xi), v, &cpu_i(&rows), [0, 1, 0], m)
        .unwrap();
    assert_eq!(g_down(&g, &got), c_down(&want));
    assert!(matches!(
        g.gather(&up(&g, &x), v, &up(&g, &[0.0]), [0, 0, 0], 1),
        Err(Error::DType(_))
    ));
}

#[test]
fn scatter_add_with_repeated_indices_matches_cpu_exactly() {
    let Some((g, _l)) = gpu("scatter_add_with_repeated_indices_matches_cpu_exactly") else {
        return;
    };
    let mut r = rng(9);
    // (outer, m, inner, len, index strides kind, kernel): kind 0 shared per row, 1 per (o, j),
    // 2 full; the kernel `layout::scatter_kernel` picks
    let (lp, wide, sorted) = ("scatter_add_loop", "scatter_add_wide", "scatter_add_sorted");
    let cols = "scatter_add_columns";
    let cases = [
        (1usize, 5usize, 3usize, 4usize, 0u8, lp),
        (3, 20, 7, 5, 1, lp),
        (2, 9, 4, 3, 2, lp),
        (1, 1000, 16, 37, 0, cols),    // outputs × rows is small
        (4, 300, 5, 11, 1, cols),      // an index row per o
        (1, 5000, 2, 37, 0, cols),     // small work, past the 256 rows of a round (a tail)
        (3, 4500, 1, 7, 1, cols),      // many hits per output (~640), a key row per o
        (1, 9000, 1000, 2, 0, cols),   // large work, but 4500 hits per output: per-expert sums
        (1, 768, 128, 65, 0, cols),    // the baby GPT's embedding gradient (12 × 64 rows, d 128)
        (2, 300, 600, 5, 1, cols),     // three column blocks, the last partial, a key row per o
        (2, 200, 3, 6, 2, wide),       // the index varying along i
        (2, 700, 2, 40, 2, wide),      // the same past the 256 rows of a round
        (1, 77, 1, 1, 0, cols),        // everything into one element
        (1, 5000, 4, 1000, 0, sorted), // large work, 5 hits per output, one shared key row
        (2, 4500, 1, 2000, 1, sorted), // a key row per o
        (2, 0, 3, 4, 0, lp),
    ];
    for (outer, m, inner, len, kind, kernel) in cases {
        let src = rand_vec(&mut r, outer * m * inner, -1.0, 1.0);
        let (s, idx_len) = match kind {
            0 => ([0, 1, 0], m),
            1 => ([m, 1, 0], outer * m),
            _ => ([m * inner, inner, 1], outer * m * inner),
        };
        // few distinct targets, so many sources hit the same one
        let idx: Vec<i32> = (0..idx_len)
            .map(|_| r.random_range(0..len as i32))
            .collect();
        let dims = ScatterDims {
            outer,
            m,
            inner,
            len,
        };
        let (gsrc, gidx) = (up(&g, &src), up_i(&g, &idx));
        let mut got = None;
        let ran = kernels_of(|| got = Some(g.scatter_add(&gsrc, &gidx, s, dims).unwrap()));
        let got = got.expect("ran");
        let what = format!("scatter_add outer {outer} m {m} inner {inner} len {len} kind {kind}");
        if m > 0 {
            let entry = format!("layout.{kernel}");
            assert!(ran.contains(&entry), "{what}: {entry} did not run: {ran:?}");
        }
        let want = CPU.scatter_add(&cpu(&src), &cpu_i(&idx), s, dims).unwrap();
        assert_bits(&what, &f32s(g_down(&g, &got)), &f32s(c_down(&want)));
    }
}
