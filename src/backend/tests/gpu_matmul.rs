//! GPU parity of the matrix-product kernels (`shaders/matmul.wgsl`): `matmul`, `grouped_matmul`
//! and `grouped_weight_grad` on the GPU in f32 against the CPU backend in f64, from identical
//! f32-representable inputs, through the backend's `MatmulOps` directly (so layouts, offsets and
//! unsorted or out-of-range experts can be chosen freely).
//!
//! The tolerance is `atol = 1e-5·(terms summed) + 1e-6`, `rtol = 1e-4`: inputs lie in [-1, 1), so
//! f32 rounding stays far below it while any indexing mistake is off by O(1). Rows and experts
//! that must come out as zeros are checked to be exactly 0. (`tests/gpu_matmul.rs` checks the same
//! kernels through the tensor API.)
//!
//! Without a GPU adapter every test prints "skipping" and returns (a failure under
//! `MOEGRAD_REQUIRE_GPU=1`). Sizes are modest: CI runs these on a software Vulkan driver.

use crate::DType;
use crate::Error;
use crate::backend::cpu::CpuBackend;
use crate::backend::gpu::GpuBackend;
use crate::backend::{
    BufferOps, ExpertBankDims, GroupedMatmulDims, HostData, MatLayout, MatmulDims, MatmulOps,
};
use crate::common;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::MutexGuard;

/// An expert bank's sizes `[experts, k, m]`.
fn bank_dims(k: usize, m: usize, experts: usize) -> ExpertBankDims {
    ExpertBankDims { k, m, experts }
}

/// The sizes of a grouped matmul.
fn grouped_dims(
    rows: usize,
    k: usize,
    m: usize,
    experts: usize,
    transpose_w: bool,
) -> GroupedMatmulDims {
    GroupedMatmulDims {
        rows,
        k,
        m,
        experts,
        transpose_w,
    }
}

/// The GPU backend and the lock of the backend's GPU tests, or `None` after printing why the
/// test is skipped.
pub(super) fn gpu(test: &str) -> Option<(GpuBackend, MutexGuard<'static, ()>)> {
    common::gpu_or_skip(test)?;
    let guard = super::gpu_lock();
    let be = GpuBackend::get().expect("Device::gpu() succeeded, so GpuBackend::get() must");
    Some((be, guard))
}

/// `n` values uniform in [-1, 1), exactly representable in f32.
pub(super) fn values(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

pub(super) fn f32_data(v: &[f32]) -> HostData {
    HostData::F32(v.to_vec())
}

fn f64_data(v: &[f32]) -> HostData {
    HostData::F64(v.iter().map(|&x| x as f64).collect())
}

fn tol(terms: usize) -> (f64, f64) {
    (1e-5 * terms as f64 + 1e-6, 1e-4)
}

// ---- matmul -----------------------------------------------------------------------------------

/// A contiguous `[batch, rows, cols]` operand (`[batch, cols, rows]` in memory when `transposed`;
/// one matrix shared by every batch entry when `shared`): its layout and buffer length.
pub(super) fn contiguous(
    batch: usize,
    rows: usize,
    cols: usize,
    transposed: bool,
    shared: bool,
) -> (MatLayout, usize) {
    let (row_stride, col_stride) = if transposed { (1, rows) } else { (cols, 1) };
    let stored = if shared { 1 } else { batch };
    let layout = MatLayout {
        offset: 0,
        batch_stride: if shared { 0 } else { rows * cols },
        row_stride,
        col_stride,
    };
    (layout, stored * rows * cols)
}

/// Runs one matmul on both backends from random buffers of the given lengths and compares.
#[allow(clippy::too_many_arguments)]
fn check_matmul(
    be: &GpuBackend,
    rng: &mut ChaCha8Rng,
    name: &str,
    la: MatLayout,
    a_len: usize,
    lb: MatLayout,
    b_len: usize,
    dims: MatmulDims,
) {
    let (a, b) = (values(rng, a_len), values(rng, b_len));
    let cpu = CpuBackend;
    let expected = cpu
        .matmul(
            (&cpu.upload(&f64_data(&a)).unwrap(), la),
            (&cpu.upload(&f64_data(&b)).unwrap(), lb),
            None,
            dims,
            DType::F64,
        )
        .unwrap();
    let expected = cpu.download(&expected).unwrap().to_f64();
    let got = be
        .matmul(
            (&be.upload(&f32_data(&a)).unwrap(), la),
            (&be.upload(&f32_data(&b)).unwrap(), lb),
            None,
            dims,
            DType::F32,
        )
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let got = be.download(&got).unwrap().to_f64();
    assert_eq!(
        got.len(),
        dims.batch * dims.m * dims.n,
        "{name}: output length"
    );
    let (atol, rtol) = tol(dims.k);
    common::assert_close(name, &got, &expected, atol, rtol);
}

/// Contiguous operands, optionally transposed or shared across the batch.
pub(super) fn check_contiguous(
    be: &GpuBackend,
    rng: &mut ChaCha8Rng,
    [batch, m, k, n]: [usize; 4],
    (ta, tb): (bool, bool),
    (a_shared, b_shared): (bool, bool),
) {
    let (la, a_len) = contiguous(batch, m, k, ta, a_shared);
    let (lb, b_len) = contiguous(batch, k, n, tb, b_shared);
    let name = format!(
        "matmul [{batch}, {m}, {k}]·[{batch}, {k}, {n}] transposed ({ta}, {tb}) shared ({a_shared}, {b_shared})"
    );
    let dims = MatmulDims { batch, m, k, n };
    check_matmul(be, rng, &name, la, a_len, lb, b_len, dims);
}

#[test]
fn matmul_shapes() {
    let Some((be, _lock)) = gpu("matmul_shapes") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let shapes = [
        [1, 1, 1, 1],
        [1, 1, 7, 1],
        [1, 5, 1, 3],
        [1, 1, 33, 70],
        [1, 65, 17, 1],
        [2, 63, 65, 66],
        [3, 64, 64, 64],
        [1, 16, 16, 16],
        [2, 129, 15, 130],
        [1, 300, 257, 129],
    ];
    for s in shapes {
        check_contiguous(&be, &mut rng, s, (false, false), (false, false));
    }
}

#[test]
fn matmul_transposed_operands() {
    let Some((be, _lock)) = gpu("matmul_transposed_operands") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    for s in [
        [2, 37, 50, 29],
        [1, 70, 1, 65],
        [1, 1, 40, 3],
        [1, 3, 40, 1],
    ] {
        for t in [(false, true), (true, false), (true, true)] {
            check_contiguous(&be, &mut rng, s, t, (false, false));
        }
    }
}

#[test]
fn matmul_broadcast_batch() {
    let Some((be, _lock)) = gpu("matmul_broadcast_batch") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    for shared in [(true, false), (false, true), (true, true)] {
        check_contiguous(&be, &mut rng, [3, 33, 20, 70], (false, false), shared);
        check_contiguous(&be, &mut rng, [4, 9, 31, 5], (true, true), shared);
    }
}

/// Offsets, padded rows and interleaved batches (a permuted `[k, batch, n]` operand).
#[test]
fn matmul_offsets_and_strides() {
    let Some((be, _lock)) = gpu("matmul_offsets_and_strides") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let (batch, m, k, n) = (3, 45, 38, 67);
    // A: offset 5, rows padded to k + 3, batches padded by 7 elements
    let la = MatLayout {
        offset: 5,
        batch_stride: m * (k + 3) + 7,
        row_stride: k + 3,
        col_stride: 1,
    };
    let a_len = 5 + batch * (m * (k + 3) + 7);
    // B: stored [k, batch, n] after an offset of 11
    let lb = MatLayout {
        offset: 11,
        batch_stride: n,
        row_stride: batch * n,
        col_stride: 1,
    };
    let b_len = 11 + k * batch * n;
    let dims = MatmulDims { batch, m, k, n };
    check_matmul(
        &be,
        &mut rng,
        "matmul offsets and strides",
        la,
        a_len,
        lb,
        b_len,
        dims,
    );
    // both read transposed out of padded storage, with a trailing tail in the buffer
    let la = MatLayout {
        offset: 2,
        batch_stride: 0,
        row_stride: 1,
        col_stride: m + 1,
    };
    let lb = MatLayout {
        offset: 3,
        batch_stride: (k + 2) * n,
        row_stride: 1,
        col_stride: k + 2,
    };
    check_matmul(
        &be,
        &mut rng,
        "matmul transposed padded",
        la,
        2 + k * (m + 1) + 9,
        lb,
        3 + batch * (k + 2) * n,
        dims,
    );
}

/// More batch entries than one dispatch dimension allows (65535): the grid is split.
#[test]
fn matmul_grid_split() {
    let Some((be, _lock)) = gpu("matmul_grid_split") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    check_contiguous(
        &be,
        &mut rng,
        [65_537, 1, 2, 1],
        (false, false),
        (false, false),
    );
}

#[test]
fn matmul_empty_sizes() {
    let Some((be, _lock)) = gpu("matmul_empty_sizes") else {
        return;
    };
    let a = be.upload(&HostData::F32(vec![1.0; 12])).unwrap();
    let l = |cols: usize| MatLayout {
        offset: 0,
        batch_stride: 0,
        row_stride: cols,
        col_stride: 1,
    };
    // k = 0: zeros
    let dims = MatmulDims {
        batch: 2,
        m: 3,
        k: 0,
        n: 4,
    };
    let c = be
        .matmul((&a, l(0)), (&a, l(4)), None, dims, DType::F32)
        .unwrap();
    assert_eq!(be.download(&c).unwrap(), HostData::F32(vec![0.0; 24]));
    // m = 0, n = 0, batch = 0: empty
    for (batch, m, n) in [(1, 0, 4), (1, 3, 0), (0, 3, 4)] {
        let dims = MatmulDims { batch, m, k: 2, n };
        let c = be
            .matmul((&a, l(2)), (&a, l(n)), None, dims, DType::F32)
            .unwrap();
        assert_eq!(be.download(&c).unwrap(), HostData::F32(vec![]));
    }
}

#[test]
fn matmul_bad_input_is_an_error() {
    let Some((be, _lock)) = gpu("matmul_bad_input_is_an_error") else {
        return;
    };
    let a = be.upload(&HostData::F32(vec![1.0; 12])).unwrap();
    let idx = be.upload(&HostData::I32(vec![1; 12])).unwrap();
    let l = |cols: usize| MatLayout {
        offset: 0,
        batch_stride: 0,
        row_stride: cols,
        col_stride: 1,
    };
    let dims = MatmulDims {
        batch: 1,
        m: 3,
        k: 4,
        n: 3,
    };
    // 4×3 of B reads up to element 11 of 12: fine; one more row or an offset is not
    assert!(
        be.matmul((&a, l(4)), (&a, l(3)), None, dims, DType::F32)
            .is_ok()
    );
    let too_big = MatmulDims { m: 4, ..dims };
    assert!(matches!(
        be.matmul((&a, l(4)), (&a, l(3)), None, too_big, DType::F32),
        Err(Error::Shape(_))
    ));
    let shifted = MatLayout { offset: 1, ..l(3) };
    assert!(matches!(
        be.matmul((&a, l(4)), (&a, shifted), None, dims, DType::F32),
        Err(Error::Shape(_))
    ));
    let batched = MatmulDims { batch: 2, ..dims };
    let strided = MatLayout {
        batch_stride: usize::MAX / 2,
        ..l(4)
    };
    assert!(matches!(
        be.matmul((&a, strided), (&a, l(3)), None, batched, DType::F32),
        Err(Error::Shape(_))
    ));
    assert!(matches!(
        be.matmul((&idx, l(4)), (&a, l(3)), None, dims, DType::F32),
        Err(Error::DType(_))
    ));
}

// ---- grouped_matmul ---------------------------------------------------------------------------

/// `row_expert` for sorted rows with the given count per expert.
pub(super) fn sorted_experts(counts: &[usize]) -> Vec<i32> {
    counts
        .iter()
        .enumerate()
        .flat_map(|(e, &c)| std::iter::repeat_n(e as i32, c))
        .collect()
}

/// Runs one grouped matmul on both backends and compares; rows whose expert is out of range must
/// be exactly 0 on the GPU.
fn check_grouped(
    be: &GpuBackend,
    rng: &mut ChaCha8Rng,
    name: &str,
    row_expert: &[i32],
    [k, m, experts]: [usize; 3],
    transpose_w: bool,
) {
    let rows = row_expert.len();
    let (x, w) = (values(rng, rows * k), values(rng, experts * k * m));
    // the forward product also runs with the experts' biases
    let bias = (!transpose_w).then(|| values(rng, experts * m));
    let re = HostData::I32(row_expert.to_vec());
    let cpu = CpuBackend;
    let cpu_bias = bias.as_ref().map(|b| cpu.upload(&f64_data(b)).unwrap());
    let expected = cpu
        .grouped_matmul(
            &cpu.upload(&f64_data(&x)).unwrap(),
            &cpu.upload(&f64_data(&w)).unwrap(),
            cpu_bias.as_ref(),
            &cpu.upload(&re).unwrap(),
            GroupedMatmulDims {
                rows,
                k,
                m,
                experts,
                transpose_w,
            },
        )
        .unwrap();
    let expected = cpu.download(&expected).unwrap().to_f64();
    let gpu_bias = bias.as_ref().map(|b| be.upload(&f32_data(b)).unwrap());
    let got = be
        .grouped_matmul(
            &be.upload(&f32_data(&x)).unwrap(),
            &be.upload(&f32_data(&w)).unwrap(),
            gpu_bias.as_ref(),
            &be.upload(&re).unwrap(),
            GroupedMatmulDims {
                rows,
                k,
                m,
                experts,
                transpose_w,
            },
        )
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let got = be.download(&got).unwrap().to_f64();
    assert_eq!(got.len(), rows * m, "{name}: output length");
    let (atol, rtol) = tol(k);
    common::assert_close(name, &got, &expected, atol, rtol);
    for (r, &e) in row_expert.iter().enumerate() {
        if e < 0 || e as usize >= experts {
            assert!(
                got[r * m..(r + 1) * m].iter().all(|&v| v == 0.0),
                "{name}: row {r} (expert {e}, out of range) is not exactly zero"
            );
        }
    }
}

#[test]
fn grouped_matmul_sorted_rows() {
    let Some((be, _lock)) = gpu("grouped_matmul_sorted_rows") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(10);
    // runs of 70, none (expert 1 has no rows), 1, 64 and 130 rows: tiles straddle boundaries
    let re = sorted_experts(&[70, 0, 1, 64, 130]);
    for transpose_w in [false, true] {
        let name = format!("grouped_matmul sorted, transpose_w {transpose_w}");
        check_grouped(&be, &mut rng, &name, &re, [45, 70, 5], transpose_w);
    }
    let re = sorted_experts(&[37, 41, 29, 50, 0, 63, 45, 35]);
    check_grouped(
        &be,
        &mut rng,
        "grouped_matmul moe-like",
        &re,
        [64, 96, 8],
        false,
    );
    check_grouped(
        &be,
        &mut rng,
        "grouped_matmul 1×1×1",
        &[0],
        [1, 1, 1],
        false,
    );
    check_grouped(&be, &mut rng, "grouped_matmul k 1", &re, [1, 3, 8], true);
}

#[test]
fn grouped_matmul_unsorted_and_out_of_range_rows() {
    let Some((be, _lock)) = gpu("grouped_matmul_unsorted_and_out_of_range_rows") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let experts = 5;
    let re: Vec<i32> = (0..150)
        .map(|_| match rng.random_range(0..10) {
            0 => -1,
            1 => experts as i32,
            2 => 100,
            _ => rng.random_range(0..experts as i32),
        })
        .collect();
    for transpose_w in [false, true] {
        let name = format!("grouped_matmul unsorted, transpose_w {transpose_w}");
        check_grouped(&be, &mut rng, &name, &re, [20, 33, experts], transpose_w);
    }
    // sorted with dropped rows (-1) first and trailing out-of-range rows
    let mut re = vec![-1; 10];
    re.extend(sorted_experts(&[20, 0, 60]));
    re.extend([3, 3, 7, i32::MAX, i32::MIN]);
    check_grouped(
        &be,
        &mut rng,
        "grouped_matmul dropped rows",
        &re,
        [17, 65, 3],
        false,
    );
    let all_out = vec![-1, 9, -1, 4];
    check_grouped(
        &be,
        &mut rng,
        "grouped_matmul all rows out of range",
        &all_out,
        [8, 8, 3],
        true,
    );
}

#[test]
fn grouped_matmul_empty_sizes_and_bad_input() {
    let Some((be, _lock)) = gpu("grouped_matmul_empty_sizes_and_bad_input") else {
        return;
    };
    let x = be.upload(&HostData::F32(vec![1.0; 6])).unwrap();
    let w = be.upload(&HostData::F32(vec![1.0; 6])).unwrap();
    let re = be.upload(&HostData::I32(vec![0, 0, 0])).unwrap();
    let none = be.upload(&HostData::I32(vec![])).unwrap();
    let empty = be.upload(&HostData::F32(vec![])).unwrap();
    // x [3, 2], w [1, 2, 3]: fine
    let y = be
        .grouped_matmul(&x, &w, None, &re, grouped_dims(3, 2, 3, 1, false))
        .unwrap();
    assert_eq!(be.download(&y).unwrap(), HostData::F32(vec![2.0; 9]));
    // no rows: empty
    let y = be
        .grouped_matmul(&empty, &w, None, &none, grouped_dims(0, 2, 3, 1, false))
        .unwrap();
    assert_eq!(be.download(&y).unwrap(), HostData::F32(vec![]));
    // no experts: every row out of range, zeros
    let y = be
        .grouped_matmul(&x, &empty, None, &re, grouped_dims(3, 2, 3, 0, false))
        .unwrap();
    assert_eq!(be.download(&y).unwrap(), HostData::F32(vec![0.0; 9]));
    // k = 0: zeros
    let y = be
        .grouped_matmul(&empty, &empty, None, &re, grouped_dims(3, 0, 3, 1, false))
        .unwrap();
    assert_eq!(be.download(&y).unwrap(), HostData::F32(vec![0.0; 9]));
    // lengths that do not match the sizes, wrong dtypes
    assert!(matches!(
        be.grouped_matmul(&x, &w, None, &re, grouped_dims(3, 2, 3, 2, false)),
        Err(Error::Shape(_))
    ));
    assert!(matches!(
        be.grouped_matmul(&x, &w, None, &re, grouped_dims(2, 3, 3, 1, false)),
        Err(Error::Shape(_))
    ));
    assert!(matches!(
        be.grouped_matmul(&x, &w, None, &x, grouped_dims(3, 2, 3, 1, false)),
        Err(Error::DType(_))
    ));
    // a bias: [experts, m] only, f32 only, never with transpose_w; k = 0 gives the bias alone
    let b = be.upload(&HostData::F32(vec![0.5, 1.5, 2.5])).unwrap();
    let short = be.upload(&HostData::F32(vec![0.5, 1.5])).unwrap();
    let y = be
        .grouped_matmul(
            &empty,
            &empty,
            Some(&b),
            &re,
            grouped_dims(3, 0, 3, 1, false),
        )
        .unwrap();
    assert_eq!(
        be.download(&y).unwrap(),
        HostData::F32([0.5, 1.5, 2.5].repeat(3))
    );
    assert!(matches!(
        be.grouped_matmul(&x, &w, Some(&short), &re, grouped_dims(3, 2, 3, 1, false)),
        Err(Error::Shape(_))
    ));
    assert!(matches!(
        be.grouped_matmul(&x, &w, Some(&re), &re, grouped_dims(3, 2, 3, 1, false)),
        Err(Error::DType(_))
    ));
    assert!(matches!(
        be.grouped_matmul(&x, &w, Some(&b), &re, grouped_dims(3, 2, 3, 1, true)),
        Err(Error::Invalid(_))
    ));
}

// ---- grouped_weight_grad ----------------------------------------------------------------------

/// Expert offsets (`n + 1` entries) of sorted rows with the given counts.
pub(super) fn offsets_of(counts: &[usize]) -> Vec<i32> {
    let mut off = vec![0];
    for &c in counts {
        off.push(off.last().unwrap() + c as i32);
    }
    off
}

/// Runs one weight gradient on both backends and compares; experts the CPU gives no
/// contribution must be exactly 0 on the GPU.
pub(super) fn check_weight_grad(
    be: &GpuBackend,
    rng: &mut ChaCha8Rng,
    name: &str,
    row_expert: &[i32],
    offsets: &[i32],
    [k, m]: [usize; 2],
) {
    let (rows, experts) = (row_expert.len(), offsets.len() - 1);
    let (x, dy) = (values(rng, rows * k), values(rng, rows * m));
    let (re, off) = (
        HostData::I32(row_expert.to_vec()),
        HostData::I32(offsets.to_vec()),
    );
    let cpu = CpuBackend;
    let expected = cpu
        .grouped_weight_grad(
            &cpu.upload(&f64_data(&x)).unwrap(),
            &cpu.upload(&f64_data(&dy)).unwrap(),
            &cpu.upload(&re).unwrap(),
            &cpu.upload(&off).unwrap(),
            ExpertBankDims { k, m, experts },
            DType::F64,
        )
        .unwrap();
    let expected = cpu.download(&expected).unwrap().to_f64();
    let got = be
        .grouped_weight_grad(
            &be.upload(&f32_data(&x)).unwrap(),
            &be.upload(&f32_data(&dy)).unwrap(),
            &be.upload(&re).unwrap(),
            &be.upload(&off).unwrap(),
            ExpertBankDims { k, m, experts },
            DType::F32,
        )
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let got = be.download(&got).unwrap().to_f64();
    assert_eq!(got.len(), experts * k * m, "{name}: output length");
    let (atol, rtol) = tol(rows);
    common::assert_close(name, &got, &expected, atol, rtol);
    for e in 0..experts {
        let (lo, hi) = (
            (offsets[e].max(0) as usize).min(rows),
            (offsets[e + 1].max(0) as usize).min(rows),
        );
        if !(lo..hi).any(|r| row_expert[r] == e as i32) {
            assert!(
                got[e * k * m..(e + 1) * k * m].iter().all(|&v| v == 0.0),
                "{name}: expert {e} has no rows but a non-zero gradient"
            );
        }
    }
}

#[test]
fn grouped_weight_grad_sorted_segments() {
    let Some((be, _lock)) = gpu("grouped_weight_grad_sorted_segments") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(20);
    let counts = [70, 0, 1, 64, 130, 0];
    let (re, off) = (sorted_experts(&counts), offsets_of(&counts));
    check_weight_grad(
        &be,
        &mut rng,
        "grouped_weight_grad sorted",
        &re,
        &off,
        [45, 70],
    );
    let counts = [37, 41, 29, 50, 0, 63, 45, 35];
    let (re, off) = (sorted_experts(&counts), offsets_of(&counts));
    check_weight_grad(
        &be,
        &mut rng,
        "grouped_weight_grad moe-like",
        &re,
        &off,
        [64, 96],
    );
    check_weight_grad(
        &be,
        &mut rng,
        "grouped_weight_grad 1×1×1",
        &[0],
        &[0, 1],
        [1, 1],
    );
    check_weight_grad(
        &be,
        &mut rng,
        "grouped_weight_grad 65×1",
        &re,
        &off,
        [65, 1],
    );
}

/// Rows inside a segment whose expert differs (dropped rows, stray rows) contribute nothing;
/// offsets outside `0..R`, decreasing or all empty are clamped like the CPU's.
#[test]
fn grouped_weight_grad_stray_rows_and_odd_offsets() {
    let Some((be, _lock)) = gpu("grouped_weight_grad_stray_rows_and_odd_offsets") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(21);
    let counts = [40, 25, 0, 70];
    let (mut re, off) = (sorted_experts(&counts), offsets_of(&counts));
    for r in [0, 5, 39, 41, 64, 100, 134] {
        re[r] = if r % 2 == 0 { -1 } else { 2 };
    }
    check_weight_grad(
        &be,
        &mut rng,
        "grouped_weight_grad stray rows",
        &re,
        &off,
        [30, 20],
    );
    let re: Vec<i32> = (0..90).map(|_| rng.random_range(-1..4)).collect();
    let off = [-5, 3, 2, 140];
    check_weight_grad(
        &be,
        &mut rng,
        "grouped_weight_grad odd offsets",
        &re,
        &off,
        [20, 17],
    );
    let off = [0, 0, 0, 0];
    check_weight_grad(
        &be,
        &mut rng,
        "grouped_weight_grad no segments",
        &re,
        &off,
        [9, 66],
    );
}

#[test]
fn grouped_weight_grad_empty_sizes_and_bad_input() {
    let Some((be, _lock)) = gpu("grouped_weight_grad_empty_sizes_and_bad_input") else {
        return;
    };
    let x = be.upload(&HostData::F32(vec![1.0; 6])).unwrap();
    let dy = be.upload(&HostData::F32(vec![1.0; 9])).unwrap();
    let re = be.upload(&HostData::I32(vec![0, 0, 1])).unwrap();
    let off = be.upload(&HostData::I32(vec![0, 2, 3])).unwrap();
    let none = be.upload(&HostData::I32(vec![])).unwrap();
    let empty = be.upload(&HostData::F32(vec![])).unwrap();
    // x [3, 2], dy [3, 3], two experts
    let dw = be
        .grouped_weight_grad(&x, &dy, &re, &off, bank_dims(2, 3, 2), DType::F32)
        .unwrap();
    let mut expected = vec![2.0; 6];
    expected.extend([1.0; 6]);
    assert_eq!(be.download(&dw).unwrap(), HostData::F32(expected));
    // no rows: zeros
    let zero_off = be.upload(&HostData::I32(vec![0, 0, 0])).unwrap();
    let dw = be
        .grouped_weight_grad(
            &empty,
            &empty,
            &none,
            &zero_off,
            bank_dims(2, 3, 2),
            DType::F32,
        )
        .unwrap();
    assert_eq!(be.download(&dw).unwrap(), HostData::F32(vec![0.0; 12]));
    // k = 0: empty
    let dw = be
        .grouped_weight_grad(&empty, &dy, &re, &off, bank_dims(0, 3, 2), DType::F32)
        .unwrap();
    assert_eq!(be.download(&dw).unwrap(), HostData::F32(vec![]));
    // lengths that do not match, wrong dtypes
    assert!(matches!(
        be.grouped_weight_grad(&x, &dy, &re, &off, bank_dims(2, 3, 3), DType::F32),
        Err(Error::Shape(_))
    ));
    assert!(matches!(
        be.grouped_weight_grad(&x, &dy, &re, &off, bank_dims(3, 3, 2), DType::F32),
        Err(Error::Shape(_))
    ));
    assert!(matches!(
        be.grouped_weight_grad(&x, &dy, &re, &x, bank_dims(2, 3, 2), DType::F32),
        Err(Error::DType(_))
    ));
}
