//! GPU primitives against the CPU backend, one primitive at a time, through the `Backend` trait.
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

mod common;

use moegrad::backend::cpu::CpuBackend;
use moegrad::backend::gpu::{GpuBackend, GpuBuffer};
use moegrad::backend::{
    AdamHyper, AxisView, BinaryOp, BufferOps, ElementwiseOps, HostData, LayoutOps, OptimOps,
    ReduceOp, ReduceOps, ScatterDims, SgdHyper, Strided, UnaryOp,
};
use moegrad::{DType, Error};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::{Mutex, MutexGuard};

static GPU_LOCK: Mutex<()> = Mutex::new(());

/// The GPU backend and the lock that serialises GPU tests, or `None` when skipping.
/// A buffer read through `strides` (an operand of `where_cond`).
fn strided<'a, B>(buf: &'a B, strides: &'a [usize]) -> Strided<'a, B> {
    Strided { buf, strides }
}

fn gpu(test: &str) -> Option<(GpuBackend, MutexGuard<'static, ()>)> {
    common::gpu_or_skip(test)?;
    let guard = GPU_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    Some((GpuBackend::get().expect("Device::gpu succeeded"), guard))
}

const CPU: CpuBackend = CpuBackend;

fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

fn rand_vec(r: &mut ChaCha8Rng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| r.random_range(lo..hi)).collect()
}

fn up(g: &GpuBackend, v: &[f32]) -> GpuBuffer {
    g.upload(&HostData::F32(v.to_vec())).unwrap()
}
fn up_i(g: &GpuBackend, v: &[i32]) -> GpuBuffer {
    g.upload(&HostData::I32(v.to_vec())).unwrap()
}
fn cpu(v: &[f32]) -> moegrad::backend::cpu::CpuBuffer {
    CPU.upload(&HostData::F32(v.to_vec())).unwrap()
}
fn cpu_i(v: &[i32]) -> moegrad::backend::cpu::CpuBuffer {
    CPU.upload(&HostData::I32(v.to_vec())).unwrap()
}
fn g_down(g: &GpuBackend, b: &GpuBuffer) -> HostData {
    g.download(b).unwrap()
}
fn c_down(b: &moegrad::backend::cpu::CpuBuffer) -> HostData {
    CPU.download(b).unwrap()
}
fn f32s(h: HostData) -> Vec<f32> {
    match h {
        HostData::F32(v) => v,
        other => panic!("expected f32 data, got {:?}", other.dtype()),
    }
}

/// Asserts `|got − want| ≤ atol + rtol·|want|` elementwise (NaN matches NaN, ±inf must match).
fn assert_close(what: &str, got: &[f32], want: &[f32], atol: f32, rtol: f32) {
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
fn assert_bits(what: &str, got: &[f32], want: &[f32]) {
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
fn contiguous(shape: &[usize]) -> Vec<usize> {
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
    // (outer, m, inner, len, index strides kind): 0 shared per row, 1 per (o, j), 2 full
    let cases = [
        (1usize, 5usize, 3usize, 4usize, 0u8),
        (3, 20, 7, 5, 1),
        (2, 9, 4, 3, 2),
        (1, 1000, 16, 37, 0), // loop path: outputs × rows is small
        (4, 300, 5, 11, 1),   // loop path, an index row per o
        (1, 5000, 2, 37, 0),  // sorted path (more than 4096 rows), one shared key row
        (3, 4500, 1, 7, 1),   // sorted path, a key row per o
        (2, 200, 3, 6, 2),    // loop path with the index varying along i
        (1, 77, 1, 1, 0),     // everything into one element
        (2, 0, 3, 4, 0),
    ];
    for (outer, m, inner, len, kind) in cases {
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
        let got = g
            .scatter_add(&up(&g, &src), &up_i(&g, &idx), s, dims)
            .unwrap();
        let want = CPU.scatter_add(&cpu(&src), &cpu_i(&idx), s, dims).unwrap();
        assert_bits(
            &format!("scatter_add outer {outer} m {m} inner {inner} len {len} kind {kind}"),
            &f32s(g_down(&g, &got)),
            &f32s(c_down(&want)),
        );
    }
}

// ---- sorting ----------------------------------------------------------------------------------

#[test]
fn argsort_is_stable_and_matches_cpu() {
    let Some((g, _l)) = gpu("argsort_is_stable_and_matches_cpu") else {
        return;
    };
    let mut r = rng(10);
    for (rows, len) in [
        (1usize, 1usize),
        (3, 5),
        (2, 0),
        (0, 4),
        (7, 64),
        (300, 6),
        (5, 1000),
        (2, 1024),
        (3, 1500),
        (1, 5000),
    ] {
        // few distinct values: many ties, which must keep index order
        let mut x: Vec<f32> = (0..rows * len)
            .map(|_| r.random_range(0..8) as f32 * 0.5 - 2.0)
            .collect();
        for (k, v) in x.iter_mut().enumerate() {
            match k % 97 {
                3 => *v = f32::NAN,
                5 => *v = -0.0,
                6 => *v = f32::NEG_INFINITY,
                7 => *v = f32::INFINITY,
                _ => {}
            }
        }
        for descending in [false, true] {
            let got = g.argsort(&up(&g, &x), rows, len, descending).unwrap();
            let want = CPU.argsort(&cpu(&x), rows, len, descending).unwrap();
            assert_eq!(
                g_down(&g, &got),
                c_down(&want),
                "argsort [{rows}, {len}] descending {descending}"
            );
        }
    }
    assert!(matches!(
        g.argsort(&up_i(&g, &[3, 1]), 1, 2, false),
        Err(Error::DType(_))
    ));
    assert!(matches!(
        g.argsort(&up(&g, &[3.0, 1.0]), 2, 2, false),
        Err(Error::Shape(_))
    ));
}

// ---- random -----------------------------------------------------------------------------------

#[test]
fn random_uniform_is_bit_identical_to_cpu() {
    let Some((g, _l)) = gpu("random_uniform_is_bit_identical_to_cpu") else {
        return;
    };
    for (len, seed) in [(0usize, 1u64), (1, 0), (1000, 42), (4099, u64::MAX - 5)] {
        let got = f32s(g_down(
            &g,
            &g.random_uniform(len, seed, DType::F32).unwrap(),
        ));
        let want = f32s(c_down(&CPU.random_uniform(len, seed, DType::F32).unwrap()));
        assert_bits(&format!("random_uniform {len} {seed}"), &got, &want);
        assert!(got.iter().all(|&u| (0.0..1.0).contains(&u)));
    }
    let got = g_down(&g, &g.random_uniform(10, 3, DType::I32).unwrap());
    assert_eq!(got, c_down(&CPU.random_uniform(10, 3, DType::I32).unwrap()));
}

/// More than 65535 workgroups of 256: the grid folds into x and y.
#[test]
fn one_dimensional_launch_beyond_65535_workgroups() {
    let Some((g, _l)) = gpu("one_dimensional_launch_beyond_65535_workgroups") else {
        return;
    };
    let len = 65_535 * 256 + 1_001;
    let seed = 0x1234_5678_9abc_def0;
    let got = f32s(g_down(
        &g,
        &g.random_uniform(len, seed, DType::F32).unwrap(),
    ));
    let want = f32s(c_down(&CPU.random_uniform(len, seed, DType::F32).unwrap()));
    assert_bits("random_uniform beyond 65535 workgroups", &got, &want);
    drop((got, want));
    let x = g.full(len, 1.5, DType::F32).unwrap();
    let y = f32s(g_down(&g, &g.unary(UnaryOp::MulScalar(2.0), &x).unwrap()));
    assert_eq!(y.len(), len);
    assert!(y.iter().all(|&v| v == 3.0), "every folded workgroup ran");
    drop(y);
    // the newest op of the table (softsign) on the folded grid, against the CPU, over values of
    // both signs
    let gx = g
        .unary(
            UnaryOp::AddScalar(-0.5),
            &g.random_uniform(len, seed, DType::F32).unwrap(),
        )
        .unwrap();
    let cx = CPU
        .unary(
            UnaryOp::AddScalar(-0.5),
            &CPU.random_uniform(len, seed, DType::F32).unwrap(),
        )
        .unwrap();
    let got = f32s(g_down(&g, &g.unary(UnaryOp::Softsign, &gx).unwrap()));
    let want = f32s(c_down(&CPU.unary(UnaryOp::Softsign, &cx).unwrap()));
    assert_eq!(got.len(), len);
    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
        assert!(
            (a - b).abs() <= 1e-6,
            "softsign beyond 65535 workgroups: element {i}: got {a}, expected {b}"
        );
    }
}

// ---- optimizers -------------------------------------------------------------------------------

#[test]
fn adam_and_sgd_steps_match_cpu() {
    let Some((g, _l)) = gpu("adam_and_sgd_steps_match_cpu") else {
        return;
    };
    let mut r = rng(11);
    for n in [0usize, 1, 1000] {
        let p = rand_vec(&mut r, n, -1.0, 1.0);
        let grad = rand_vec(&mut r, n, -1.0, 1.0);
        let m = rand_vec(&mut r, n, -0.1, 0.1);
        let v = rand_vec(&mut r, n, 0.0, 0.01);
        let scale = [0.37f32];
        for (decoupled, with_scale) in [(false, false), (true, true), (false, true)] {
            let h = AdamHyper {
                lr: 1e-3,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.01,
                decoupled,
                bias_correction1: 1.0 - 0.9f64.powi(3),
                bias_correction2: 1.0 - 0.999f64.powi(3),
            };
            let gs = with_scale.then(|| up(&g, &scale));
            let cs = with_scale.then(|| cpu(&scale));
            let (gp, gm, gv) = g
                .adam_step(
                    &up(&g, &p),
                    &up(&g, &grad),
                    gs.as_ref(),
                    &up(&g, &m),
                    &up(&g, &v),
                    h,
                )
                .unwrap();
            let (cp, cm, cv) = CPU
                .adam_step(&cpu(&p), &cpu(&grad), cs.as_ref(), &cpu(&m), &cpu(&v), h)
                .unwrap();
            let what = format!("adam n={n} decoupled={decoupled} scale={with_scale}");
            assert_close(&what, &f32s(g_down(&g, &gp)), &f32s(c_down(&cp)), 1e-6, 0.0);
            assert_close(&what, &f32s(g_down(&g, &gm)), &f32s(c_down(&cm)), 1e-6, 0.0);
            assert_close(&what, &f32s(g_down(&g, &gv)), &f32s(c_down(&cv)), 1e-6, 0.0);
        }
        for (momentum, nesterov, with_scale) in
            [(0.0, false, false), (0.9, false, true), (0.9, true, false)]
        {
            let h = SgdHyper {
                lr: 0.05,
                momentum,
                weight_decay: 1e-3,
                nesterov,
            };
            let gs = with_scale.then(|| up(&g, &scale));
            let cs = with_scale.then(|| cpu(&scale));
            let (gp, gb) = g
                .sgd_step(&up(&g, &p), &up(&g, &grad), gs.as_ref(), &up(&g, &m), h)
                .unwrap();
            let (cp, cb) = CPU
                .sgd_step(&cpu(&p), &cpu(&grad), cs.as_ref(), &cpu(&m), h)
                .unwrap();
            let what = format!("sgd n={n} momentum={momentum} nesterov={nesterov}");
            assert_close(&what, &f32s(g_down(&g, &gp)), &f32s(c_down(&cp)), 1e-6, 0.0);
            assert_close(&what, &f32s(g_down(&g, &gb)), &f32s(c_down(&cb)), 1e-6, 0.0);
        }
    }
    let (a, b) = (up(&g, &[1.0, 2.0]), up(&g, &[1.0]));
    let h = SgdHyper {
        lr: 0.1,
        momentum: 0.0,
        weight_decay: 0.0,
        nesterov: false,
    };
    assert!(matches!(
        g.sgd_step(&a, &b, None, &a, h),
        Err(Error::Shape(_))
    ));
    assert!(matches!(
        g.sgd_step(&a, &a, Some(&a), &a, h),
        Err(Error::Shape(_))
    ));
}

/// The optimizers' `_mut` updates write the parameter and its state where they are when nothing
/// else shares them: the values match the CPU, a kernel queued earlier that reads the parameter
/// still sees the old values, no buffer is taken from the pool, and a tensor kept from before
/// the step (sharing the buffer) keeps its old values while the parameter moves on.
#[test]
fn optimizer_steps_update_in_place_unless_shared() {
    let Some((g, _l)) = gpu("optimizer_steps_update_in_place_unless_shared") else {
        return;
    };
    let mut r = rng(12);
    let n = 1 << 16;
    let (p, grad) = (
        rand_vec(&mut r, n, -1.0, 1.0),
        rand_vec(&mut r, n, -1.0, 1.0),
    );
    let (m, v) = (
        rand_vec(&mut r, n, -0.1, 0.1),
        rand_vec(&mut r, n, 0.0, 0.01),
    );
    let h = AdamHyper {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
        decoupled: true,
        bias_correction1: 1.0 - 0.9f64.powi(2),
        bias_correction2: 1.0 - 0.999f64.powi(2),
    };
    let (cp, cm, cv) = CPU
        .adam_step(&cpu(&p), &cpu(&grad), None, &cpu(&m), &cpu(&v), h)
        .unwrap();
    let (cp, cm, cv) = (f32s(c_down(&cp)), f32s(c_down(&cm)), f32s(c_down(&cv)));
    let tanh_p: Vec<f32> = p.iter().map(|x| x.tanh()).collect();
    for shared in [false, true] {
        let (mut gp, gg, mut gm, mut gv) = (up(&g, &p), up(&g, &grad), up(&g, &m), up(&g, &v));
        let kept = shared.then(|| gp.clone());
        // queued before the update and not yet submitted: must read the old parameter
        let read_before = g.unary(UnaryOp::Tanh, &gp).unwrap();
        let before = g.pool_stats().in_use_bytes;
        g.reset_peak();
        g.adam_step_mut(&mut gp, &gg, None, &mut gm, &mut gv, h)
            .unwrap();
        g.synchronize().unwrap();
        let grew = g.pool_stats().peak_bytes - before;
        let what = format!("adam_step_mut shared={shared}");
        assert_close(&what, &f32s(g_down(&g, &gp)), &cp, 1e-6, 0.0);
        assert_close(&what, &f32s(g_down(&g, &gm)), &cm, 1e-6, 0.0);
        assert_close(&what, &f32s(g_down(&g, &gv)), &cv, 1e-6, 0.0);
        assert_close(&what, &f32s(g_down(&g, &read_before)), &tanh_p, 1e-6, 1e-6);
        let bytes = (n * 4) as u64;
        if let Some(kept) = kept {
            assert_eq!(
                f32s(g_down(&g, &kept)),
                p,
                "{what}: the kept tensor changed"
            );
            assert!(
                grew >= 3 * bytes,
                "{what}: fresh buffers expected, grew {grew}"
            );
        } else {
            assert!(
                grew < bytes,
                "{what}: updated in place, yet {grew} more bytes in use"
            );
        }
    }
    for (momentum, nesterov) in [(0.0, false), (0.9, true)] {
        let h = SgdHyper {
            lr: 0.05,
            momentum,
            weight_decay: 1e-3,
            nesterov,
        };
        let (cp, cb) = CPU
            .sgd_step(&cpu(&p), &cpu(&grad), None, &cpu(&m), h)
            .unwrap();
        for shared in [false, true] {
            let (mut gp, gg, mut gb) = (up(&g, &p), up(&g, &grad), up(&g, &m));
            let kept = shared.then(|| (gp.clone(), gb.clone()));
            g.synchronize().unwrap();
            let before = g.pool_stats().in_use_bytes;
            g.reset_peak();
            g.sgd_step_mut(&mut gp, &gg, None, &mut gb, h).unwrap();
            g.synchronize().unwrap();
            let grew = g.pool_stats().peak_bytes - before;
            let what = format!("sgd_step_mut momentum={momentum} shared={shared}");
            assert_close(&what, &f32s(g_down(&g, &gp)), &f32s(c_down(&cp)), 1e-6, 0.0);
            assert_close(&what, &f32s(g_down(&g, &gb)), &f32s(c_down(&cb)), 1e-6, 0.0);
            if let Some((kp, kb)) = kept {
                assert_eq!(
                    f32s(g_down(&g, &kp)),
                    p,
                    "{what}: the kept parameter changed"
                );
                assert_eq!(f32s(g_down(&g, &kb)), m, "{what}: the kept buffer changed");
            } else {
                assert!(grew < (n * 4) as u64, "{what}: {grew} more bytes in use");
            }
        }
    }
}

// ---- batching, ordering and the pool ----------------------------------------------------------

/// A long dependent chain (many batches of 64 dispatches) with uploads, downloads and dropped
/// buffers interleaved: every value must come out as if each op ran at once.
#[test]
fn long_chains_with_interleaved_uploads_keep_order() {
    let Some((g, _l)) = gpu("long_chains_with_interleaved_uploads_keep_order") else {
        return;
    };
    let n = 1000;
    let mut x = g.full(n, 0.0, DType::F32).unwrap();
    let mut expect = 0.0f32;
    for step in 0..300 {
        // a fresh upload each step, added in, then dropped: its pooled buffer is reused at once
        let inc = up(&g, &vec![step as f32; n]);
        x = g.binary(BinaryOp::Add, &x, &[1], &inc, &[1], &[n]).unwrap();
        expect += step as f32;
        drop(inc);
        if step % 97 == 0 {
            let seen = f32s(g_down(&g, &x));
            assert!(seen.iter().all(|&v| v == expect), "step {step}");
        }
    }
    let seen = f32s(g_down(&g, &x));
    assert!(seen.iter().all(|&v| v == expect));
    g.synchronize().unwrap();
}

/// After a warm-up, repeating the same step takes every buffer from the pool: the bytes in use
/// return to where they were and no buffer is created. (Buffers the user drops stay held by the
/// pending batch until it is submitted, so the warm-up must span a few batches of 64 dispatches.)
#[test]
fn steady_state_steps_reuse_pooled_buffers() {
    let Some((g, _l)) = gpu("steady_state_steps_reuse_pooled_buffers") else {
        return;
    };
    let n = 4096;
    let p0 = up(&g, &vec![0.5; n]);
    let step = |p: &GpuBuffer| -> GpuBuffer {
        let y = g.unary(UnaryOp::Tanh, p).unwrap();
        let grad = g.binary(BinaryOp::Mul, &y, &[1], p, &[1], &[n]).unwrap();
        let h = SgdHyper {
            lr: 0.01,
            momentum: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        };
        g.sgd_step(p, &grad, None, &grad, h).unwrap().0
    };
    let mut p = step(&p0);
    for _ in 0..70 {
        p = step(&p);
    }
    g.synchronize().unwrap();
    let before = g.pool_stats().in_use_bytes;
    g.reset_peak();
    let free_before = g.pool_free_bytes();
    for _ in 0..70 {
        p = step(&p);
    }
    g.synchronize().unwrap();
    let after = g.pool_stats();
    assert_eq!(
        after.in_use_bytes, before,
        "bytes in use return to the baseline"
    );
    assert!(
        g.pool_free_bytes() <= free_before,
        "no new buffers were created in the steady state"
    );
    assert!(after.peak_bytes >= before, "peak {after:?}");
    drop(p);
}
