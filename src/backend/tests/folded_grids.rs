//! Every kernel whose launch can exceed 65,535 workgroups in one dimension, run once on the
//! smallest shape that does (see `tests/common/fold.rs`; each case asserts that it crosses the
//! limit, from the launcher's own formula), through the backend's family traits, against the CPU
//! backend in f32. Before each launch a buffer of the output's size is filled with NaN and
//! returned to the pool, so an output element a folded workgroup failed to write reads as NaN
//! instead of a lucky zero. A fused kernel is here too, because its cheapest folding shape goes
//! through the backend: `attention_delta` (through `attention_backward`, with random `o` and
//! `lse` instead of a forward pass). The f16 builds of mixed precision's `scatter_add` and
//! cross-entropy backward fold too (against the CPU on the same f16 values). The scatter kernels
//! in f32 are `folded_scatter.rs`, the matmul
//! launchers' grids are `folded_matmul_grids.rs`; `reduce_rows` and `cumsum_rows` cannot fold (their launcher takes
//! them only for fewer than 4096 lines).
//!
//! Without a GPU adapter the tests print "skipping" and pass, unless `MOEGRAD_REQUIRE_GPU=1`.

use super::folded_scatter::{folded_scatter_cases, index_scatter_dims, scatter_on};
use crate::backend::cpu::{CpuBackend, CpuBuffer};
use crate::backend::gpu::{GpuBackend, GpuBuffer};
use crate::backend::{
    AttentionDims, AttentionGradOperands, AxisView, BinaryOp, BufferOps, ElementwiseOps, HostData,
    LayoutOps, NnOps, PackedAttentionDims, ReduceOp, ReduceOps, RotaryDims, Strided, SwiGluDims,
    UnaryOp,
};
use crate::parity::{Gen, V};
use crate::{DType, common, fold};
use std::sync::MutexGuard;

/// The values of host data as f64.
pub(super) fn host_f64(h: HostData) -> Vec<f64> {
    match h {
        HostData::F32(v) => v.into_iter().map(f64::from).collect(),
        HostData::F64(v) => v,
        HostData::I32(v) => v.into_iter().map(f64::from).collect(),
    }
}

/// Invocations per workgroup of the 1-D kernels (elementwise, layout, reduce, sort, random).
pub(super) const WG: usize = 256;

/// The GPU and the lock of the backend's GPU tests (the large fold cases each hold a few hundred
/// MB), or `None` when skipping.
pub(super) fn fold_gpu(test: &str) -> Option<(GpuBackend, MutexGuard<'static, ()>)> {
    common::gpu_or_skip(test)?;
    let guard = super::gpu_lock();
    let be = GpuBackend::get().expect("Device::gpu succeeded");
    be.synchronize().unwrap();
    be.trim_pool();
    Some((be, guard))
}

/// Leaves a NaN-filled buffer of `len` elements as the pool's only free one, so the next output
/// of that size starts as NaN wherever the kernel does not write (a fresh buffer reads as zeros).
/// Also bounds memory: the pool's other free buffers go back to the driver.
pub(super) fn poison_pool(be: &GpuBackend, len: usize) {
    be.synchronize().unwrap();
    be.trim_pool();
    drop(be.full(len, f64::NAN, DType::F32).unwrap());
    be.flush().unwrap();
}

pub(super) fn up_f32(be: &GpuBackend, v: &[f32]) -> GpuBuffer {
    be.upload(&HostData::F32(v.to_vec())).unwrap()
}
pub(super) fn up_i32(be: &GpuBackend, v: &[i32]) -> GpuBuffer {
    be.upload(&HostData::I32(v.to_vec())).unwrap()
}
pub(super) fn cpu_f32(v: &[f32]) -> CpuBuffer {
    CpuBackend.upload(&HostData::F32(v.to_vec())).unwrap()
}
pub(super) fn cpu_i32(v: &[i32]) -> CpuBuffer {
    CpuBackend.upload(&HostData::I32(v.to_vec())).unwrap()
}

/// Asserts the GPU's output equals the CPU backend's, exactly for integers and within f32
/// rounding of transcendental functions for floats (NaN never matches a number).
pub(super) fn assert_same(what: &str, gpu: HostData, cpu: HostData) {
    match (gpu, cpu) {
        (HostData::I32(g), HostData::I32(c)) => {
            assert_eq!(g.len(), c.len(), "{what}: lengths differ");
            if let Some(i) = (0..g.len()).find(|&i| g[i] != c[i]) {
                panic!(
                    "{what}: element {i} of {}: got {}, expected {}",
                    g.len(),
                    g[i],
                    c[i]
                );
            }
        }
        (g, c) => common::assert_close(what, &host_f64(g), &host_f64(c), 1e-6, 1e-5),
    }
}

/// `buf` read through `strides`.
fn strided<'a, B>(buf: &'a B, strides: &'a [usize]) -> Strided<'a, B> {
    Strided { buf, strides }
}

pub(super) fn random_f32(seed: u64, n: usize) -> Vec<f32> {
    let mut g = Gen::from_seed(seed);
    g.vals(n, V::Smooth).into_iter().map(|v| v as f32).collect()
}

pub(super) fn random_i32(seed: u64, n: usize, hi: usize) -> Vec<i32> {
    let mut g = Gen::from_seed(seed);
    (0..n).map(|_| g.dim(0, hi - 1) as i32).collect()
}

/// `fill`, `cast_dtype`, `unary`, `binary` (a broadcast operand) and `where_cond` (two broadcast
/// operands) on the smallest output that needs more than 65,535 workgroups of 256.
#[test]
fn folded_elementwise_kernels() {
    let Some((be, _lock)) = fold_gpu("folded_elementwise_kernels") else {
        return;
    };
    let n = fold::smallest_folding(WG);
    fold::assert_past_limit("elementwise", fold::groups(n, WG));
    let cpu = CpuBackend;

    poison_pool(&be, n);
    let filled = be.download(&be.full(n, -2.5, DType::F32).unwrap()).unwrap();
    assert_same(
        "fill",
        filled,
        cpu.download(&cpu.full(n, -2.5, DType::F32).unwrap())
            .unwrap(),
    );

    let x = random_f32(1, n);
    let (gx, cx) = (up_f32(&be, &x), cpu_f32(&x));
    poison_pool(&be, n);
    let cast = be.download(&be.cast(&gx, DType::I32).unwrap()).unwrap();
    assert_same(
        "cast_dtype",
        cast,
        cpu.download(&cpu.cast(&cx, DType::I32).unwrap()).unwrap(),
    );

    poison_pool(&be, n);
    let exp = be.download(&be.unary(UnaryOp::Exp, &gx).unwrap()).unwrap();
    assert_same(
        "unary exp",
        exp,
        cpu.download(&cpu.unary(UnaryOp::Exp, &cx).unwrap())
            .unwrap(),
    );

    // [rows, 3] op [3], and where([rows, 1], [rows, 3], [3]): rows·3 ≥ n.
    let rows = n.div_ceil(3);
    let shape = [rows, 3];
    fold::assert_past_limit("broadcast elementwise", fold::groups(rows * 3, WG));
    let a = random_f32(2, rows * 3);
    let b = random_f32(3, 3);
    let cond: Vec<f32> = random_i32(4, rows, 2)
        .into_iter()
        .map(|c| c as f32)
        .collect();
    let (ga, gb, gc) = (up_f32(&be, &a), up_f32(&be, &b), up_f32(&be, &cond));
    let (ca, cb, cc) = (cpu_f32(&a), cpu_f32(&b), cpu_f32(&cond));
    let (full, row, col) = ([3usize, 1], [0usize, 1], [1usize, 0]);
    poison_pool(&be, rows * 3);
    let sub = be
        .binary(BinaryOp::Sub, &ga, &full, &gb, &row, &shape)
        .unwrap();
    let want = cpu
        .binary(BinaryOp::Sub, &ca, &full, &cb, &row, &shape)
        .unwrap();
    assert_same(
        "binary sub, broadcast",
        be.download(&sub).unwrap(),
        cpu.download(&want).unwrap(),
    );
    poison_pool(&be, rows * 3);
    let got = be
        .where_cond(
            strided(&gc, &col),
            strided(&ga, &full),
            strided(&gb, &row),
            &shape,
        )
        .unwrap();
    let want = cpu
        .where_cond(
            strided(&cc, &col),
            strided(&ca, &full),
            strided(&cb, &row),
            &shape,
        )
        .unwrap();
    assert_same(
        "where_cond, broadcast",
        be.download(&got).unwrap(),
        cpu.download(&want).unwrap(),
    );
}

/// `swiglu_forward`, `swiglu_backward` (one invocation per `[rows, half]` element, the
/// backward writing both halves of `dx`) and `rotary` (forward and transposed, with tables
/// longer than the sequence) on the smallest shapes past 65,535 workgroups of 256.
#[test]
fn folded_llama_kernels() {
    let Some((be, _lock)) = fold_gpu("folded_llama_kernels") else {
        return;
    };
    let cpu = CpuBackend;
    // swiglu: rows·half = the smallest folding count, half = 5 (odd, so rows are not aligned)
    let half = 5;
    let rows = fold::smallest_folding(WG).div_ceil(half);
    fold::assert_past_limit("swiglu", fold::groups(rows * half, WG));
    let dims = SwiGluDims { rows, half };
    let x = random_f32(11, rows * 2 * half);
    let g = random_f32(12, rows * half);
    let (gx, cx, gg, cg) = (up_f32(&be, &x), cpu_f32(&x), up_f32(&be, &g), cpu_f32(&g));
    poison_pool(&be, rows * half);
    let y = be.download(&be.swiglu_forward(&gx, dims).unwrap()).unwrap();
    let want = cpu
        .download(&cpu.swiglu_forward(&cx, dims).unwrap())
        .unwrap();
    assert_same("swiglu_forward", y, want);
    poison_pool(&be, rows * 2 * half);
    let dx = be.swiglu_backward(&gx, &gg, dims).unwrap();
    let want = cpu.swiglu_backward(&cx, &cg, dims).unwrap();
    assert_same(
        "swiglu_backward",
        be.download(&dx).unwrap(),
        cpu.download(&want).unwrap(),
    );
    drop((gx, gg, dx));

    // rotary: batch·seq·head_dim past the limit, seq 7 of tables with 9 rows, head width 6
    let (seq, head_dim, table_rows) = (7, 6, 9);
    let batch = fold::smallest_folding(WG).div_ceil(seq * head_dim);
    let n = batch * seq * head_dim;
    fold::assert_past_limit("rotary", fold::groups(n, WG));
    let x = random_f32(13, n);
    let (c, s) = (
        random_f32(14, table_rows * head_dim),
        random_f32(15, table_rows * head_dim),
    );
    let (gx, cx) = (up_f32(&be, &x), cpu_f32(&x));
    let (gc, gs, cc, cs) = (up_f32(&be, &c), up_f32(&be, &s), cpu_f32(&c), cpu_f32(&s));
    for transpose in [false, true] {
        let dims = RotaryDims {
            batch,
            seq,
            head_dim,
            table_rows,
            transpose,
        };
        poison_pool(&be, n);
        let y = be
            .download(&be.rotary(&gx, &gc, &gs, dims).unwrap())
            .unwrap();
        let want = cpu
            .download(&cpu.rotary(&cx, &cc, &cs, dims).unwrap())
            .unwrap();
        assert_same(&format!("rotary (transpose {transpose})"), y, want);
    }
}

/// `copy_strided` (a transposed view), `concat_part` and `gather`, each writing more than
/// 65,535·256 elements (the scatter kernels: `folded_scatter.rs`).
#[test]
fn folded_layout_kernels() {
    let Some((be, _lock)) = fold_gpu("folded_layout_kernels") else {
        return;
    };
    let n = fold::smallest_folding(WG);
    let cpu = CpuBackend;

    // [rows, 2] read as its transpose [2, rows].
    let rows = n.div_ceil(2);
    fold::assert_past_limit("copy_strided", fold::groups(2 * rows, WG));
    let x = random_f32(5, 2 * rows);
    let (gx, cx) = (up_f32(&be, &x), cpu_f32(&x));
    let (shape, strides) = ([2, rows], [1, 2]);
    poison_pool(&be, 2 * rows);
    let got = be.copy_strided(&gx, &shape, &strides, 0).unwrap();
    let want = cpu.copy_strided(&cx, &shape, &strides, 0).unwrap();
    assert_same(
        "copy_strided",
        be.download(&got).unwrap(),
        cpu.download(&want).unwrap(),
    );

    // [2, rows, 1] ++ [2, 3, 1] along the middle axis: the first part's launch folds.
    let small = random_f32(6, 6);
    let (gs, cs) = (up_f32(&be, &small), cpu_f32(&small));
    poison_pool(&be, 2 * (rows + 3));
    let got = be.concat(&[&gx, &gs], &[rows, 3], 2, 1).unwrap();
    let want = cpu.concat(&[&cx, &cs], &[rows, 3], 2, 1).unwrap();
    assert_same(
        "concat_part",
        be.download(&got).unwrap(),
        cpu.download(&want).unwrap(),
    );

    // n picks from 10 values.
    fold::assert_past_limit("gather", fold::groups(n, WG));
    let table = random_f32(7, 10);
    let idx = random_i32(8, n, 10);
    let (gt, ct) = (up_f32(&be, &table), cpu_f32(&table));
    let (gi, ci) = (up_i32(&be, &idx), cpu_i32(&idx));
    let view = AxisView {
        outer: 1,
        len: 10,
        inner: 1,
    };
    poison_pool(&be, n);
    let got = be.gather(&gt, view, &gi, [0, 1, 0], n).unwrap();
    let want = cpu.gather(&ct, view, &ci, [0, 1, 0], n).unwrap();
    assert_same(
        "gather",
        be.download(&got).unwrap(),
        cpu.download(&want).unwrap(),
    );
}

/// `reduce_serial` and `cumsum_serial` over more than 65,535·256 lines (one invocation a line).
/// Their workgroup-per-line siblings never fold: the launcher picks them only below 4096 lines.
#[test]
fn folded_reduce_kernels() {
    let Some((be, _lock)) = fold_gpu("folded_reduce_kernels") else {
        return;
    };
    let cpu = CpuBackend;
    let lines = fold::smallest_folding(WG);
    fold::assert_past_limit("reduce_serial", fold::groups(lines, WG));
    // lines of 2 along the middle axis, inner lines interleaved: [1, 2, lines]
    let view = AxisView {
        outer: 1,
        len: 2,
        inner: lines,
    };
    let x = random_f32(11, 2 * lines);
    let (gx, cx) = (up_f32(&be, &x), cpu_f32(&x));
    for op in [ReduceOp::Sum, ReduceOp::ArgMax] {
        poison_pool(&be, lines);
        let got = be.reduce(op, &gx, view).unwrap();
        let want = cpu.reduce(op, &cx, view).unwrap();
        let what = format!("reduce_serial {op:?}");
        assert_same(
            &what,
            be.download(&got).unwrap(),
            cpu.download(&want).unwrap(),
        );
    }
    poison_pool(&be, 2 * lines);
    let got = be.cumsum(&gx, view, false).unwrap();
    let want = cpu.cumsum(&cx, view, false).unwrap();
    assert_same(
        "cumsum_serial",
        be.download(&got).unwrap(),
        cpu.download(&want).unwrap(),
    );
}

/// The sort kernels past 65,535 workgroups: `sort_local` (one workgroup per row of 2, 65,536
/// rows: the launch that reads the input and writes the output) and `sort_global_step` (one
/// invocation per pair, rows of 2049 padded to 4096).
#[test]
fn folded_sort_kernels() {
    let Some((be, _lock)) = fold_gpu("folded_sort_kernels") else {
        return;
    };
    let cpu = CpuBackend;
    // Workgroups of the launch that folds, by the launcher's formulas: sort_local runs one
    // workgroup per block of min(p, 2048) of each row padded to p; sort_global_step (rows
    // longer than 2048 only) one invocation per pair of padded elements, so rows of 2049
    // (padded to 4096) reach it with the fewest data.
    let local_rows = fold::MAX_GROUPS + 1;
    let local_groups = local_rows; // rows of 2: one block, so one workgroup, per row
    let global_pairs = |rows: usize| rows * 4096 / 2;
    let global_rows = fold::smallest_past_limit("sort_global_step rows", |r| {
        fold::groups(global_pairs(r), WG)
    });
    let global_groups = fold::groups(global_pairs(global_rows), WG);
    // (the kernels that fold, rows, row length, their workgroups, descending)
    let cases = [
        ("sort_local", local_rows, 2, local_groups, true),
        ("sort_global_step", global_rows, 2049, global_groups, true),
    ];
    for (kernels, rows, len, workgroups, descending) in cases {
        fold::assert_past_limit(kernels, workgroups);
        let x = random_f32(12, rows * len);
        let (gx, cx) = (up_f32(&be, &x), cpu_f32(&x));
        poison_pool(&be, rows * len);
        let got = be.argsort(&gx, rows, len, descending).unwrap();
        let want = cpu.argsort(&cx, rows, len, descending).unwrap();
        let what = format!("{kernels}: argsort of {rows} rows of {len}, descending {descending}");
        assert_same(
            &what,
            be.download(&got).unwrap(),
            cpu.download(&want).unwrap(),
        );
    }
}

/// The mean squared error past 65,535 workgroups: `mse_backward` (one invocation per element)
/// folds its grid, and `mse_partials` (512 workgroups at most) walks the input in 128 strides
/// per invocation; both against the CPU (the forward's sum in another order: within f32
/// rounding of a sum of 16.7 million terms).
#[test]
fn folded_mse() {
    let Some((be, _lock)) = fold_gpu("folded_mse") else {
        return;
    };
    let cpu = CpuBackend;
    let n = fold::smallest_folding(WG);
    fold::assert_past_limit("mse_backward", fold::groups(n, WG));
    let (x, t) = (random_f32(41, n), random_f32(42, n));
    let (gx, gt, cx, ct) = (up_f32(&be, &x), up_f32(&be, &t), cpu_f32(&x), cpu_f32(&t));
    let got = host_f64(be.download(&be.mse_forward(&gx, &gt).unwrap()).unwrap());
    let want = host_f64(cpu.download(&cpu.mse_forward(&cx, &ct).unwrap()).unwrap());
    common::assert_close("mse_forward", &got, &want, 0.0, 1e-5);
    let (gg, cg) = (up_f32(&be, &[0.75]), cpu_f32(&[0.75]));
    poison_pool(&be, n);
    let dx = be.mse_backward(&gg, &gx, &gt).unwrap();
    let want = cpu.mse_backward(&cg, &cx, &ct).unwrap();
    assert_same(
        "mse_backward",
        be.download(&dx).unwrap(),
        cpu.download(&want).unwrap(),
    );
}

/// The row softmax of `Tensor::softmax` past 65,535 workgroups: `softmax_rows` and
/// `softmax_backward` (one invocation per row, 64 a workgroup; without and with a pending
/// gradient) on rows of 3, each output starting NaN in the poisoned pool, against the CPU.
#[test]
fn folded_softmax_rows() {
    let Some((be, _lock)) = fold_gpu("folded_softmax_rows") else {
        return;
    };
    let cpu = CpuBackend;
    let (rows, n) = (fold::smallest_folding(64), 3);
    fold::assert_past_limit("softmax_rows", fold::groups(rows, 64));
    let (x, dy) = (random_f32(43, rows * n), random_f32(44, rows * n));
    let (gx, cx) = (up_f32(&be, &x), cpu_f32(&x));
    poison_pool(&be, rows * n);
    let y = be.softmax_forward(&gx, rows, n).unwrap();
    let want_y = cpu.softmax_forward(&cx, rows, n).unwrap();
    assert_same(
        "softmax_rows",
        be.download(&y).unwrap(),
        cpu.download(&want_y).unwrap(),
    );
    let (gdy, cdy) = (up_f32(&be, &dy), cpu_f32(&dy));
    poison_pool(&be, rows * n);
    let dx = be.softmax_backward((&y, &gdy), None, rows, n).unwrap();
    let want = cpu
        .softmax_backward((&want_y, &cdy), None, rows, n)
        .unwrap();
    assert_same(
        "softmax_backward",
        be.download(&dx).unwrap(),
        cpu.download(&want).unwrap(),
    );
    // with a pending gradient folded in: every row adds its own
    let pending = random_f32(45, rows * n);
    let (gp, cp) = (up_f32(&be, &pending), cpu_f32(&pending));
    poison_pool(&be, rows * n);
    let dx = be.softmax_backward((&y, &gdy), Some(&gp), rows, n).unwrap();
    let want = cpu
        .softmax_backward((&want_y, &cdy), Some(&cp), rows, n)
        .unwrap();
    assert_same(
        "softmax_backward with pending",
        be.download(&dx).unwrap(),
        cpu.download(&want).unwrap(),
    );
}

/// The packed attention (`attention_forward_packed`, `attention_backward_packed`) past 65,535
/// (batch entry, head) pairs, which the launcher splits into launches of at most 65,535
/// (`head_base`): every launch must add its first head, find its batch entry and head within
/// it (3 heads an entry, so a launch starts mid-entry), add the packed parts' offsets, and leave
/// no output or gradient element (each starting NaN in the poisoned pool) unwritten. Against
/// the CPU's packed path, at 3 positions, head dimension 2.
#[test]
fn packed_attention_past_the_heads_a_launch_takes() {
    let Some((be, _lock)) = fold_gpu("packed_attention_past_the_heads_a_launch_takes") else {
        return;
    };
    let cpu = CpuBackend;
    let dims = PackedAttentionDims {
        batch: fold::MAX_GROUPS / 3 + 1,
        heads: 3,
        seq: 3,
        head_dim: 2,
    };
    assert!(dims.batch * dims.heads > fold::MAX_GROUPS);
    let n = dims.batch * dims.heads * dims.seq * dims.head_dim;
    let (qkv, d_o) = (random_f32(51, 3 * n), random_f32(52, n));
    let (gqkv, cqkv) = (up_f32(&be, &qkv), cpu_f32(&qkv));
    poison_pool(&be, n);
    let (o, lse) = be.attention_forward_packed(&gqkv, dims).unwrap();
    let (want_o, want_lse) = cpu.attention_forward_packed(&cqkv, dims).unwrap();
    let download = |b: &GpuBuffer| host_f64(be.download(b).unwrap());
    let cpu_download = |b: &CpuBuffer| host_f64(cpu.download(b).unwrap());
    common::assert_close(
        "packed o",
        &download(&o),
        &cpu_download(&want_o),
        1e-5,
        1e-4,
    );
    common::assert_close(
        "packed lse",
        &download(&lse),
        &cpu_download(&want_lse),
        1e-5,
        1e-4,
    );
    let (gd_o, cd_o) = (up_f32(&be, &d_o), cpu_f32(&d_o));
    poison_pool(&be, 3 * n);
    let grad = be
        .attention_backward_packed(&gqkv, (&o, &lse, &gd_o), dims)
        .unwrap();
    let want = cpu
        .attention_backward_packed(&cqkv, (&want_o, &want_lse, &cd_o), dims)
        .unwrap();
    common::assert_close(
        "packed attention gradient",
        &download(&grad),
        &cpu_download(&want),
        1e-5,
        1e-4,
    );
}

/// The operands of `attention_backward` from `[q, k, v, o, lse, dO]`.
fn attention_grad_operands<B>(b: &[B; 6]) -> AttentionGradOperands<'_, B> {
    AttentionGradOperands {
        q: &b[0],
        k: &b[1],
        v: &b[2],
        o: &b[3],
        lse: &b[4],
        d_o: &b[5],
    }
}

/// `attention_delta` (`D = rowsum(dO ∘ O)`, one invocation per row of `heads·seq`) past
/// 65,535 workgroups of 256 rows, through `attention_backward`, whose tiled kernels read `D`:
/// a row the folded grid missed stays NaN (the poisoned pool hands its buffer to `D`, the first
/// allocation) and turns that row's dq and dk into NaN. At 64 rows a head (one tile each, the
/// fewest tiled workgroups for the rows) and head dimension 1. `o` and `lse` are random rather
/// than the forward's: the backward is a function of them either way.
#[test]
fn folded_attention_delta() {
    let Some((be, _lock)) = fold_gpu("folded_attention_delta") else {
        return;
    };
    let cpu = CpuBackend;
    let seq = 64;
    let heads = fold::smallest_past_limit("attention_delta rows", |h| fold::groups(h * seq, WG));
    let dims = AttentionDims {
        heads,
        seq,
        head_dim: 1,
    };
    let rows = heads * seq;
    let [q, k, v, o, d_o] = [31, 32, 33, 34, 35].map(|seed| random_f32(seed, rows));
    // a log-sum-exp at least the largest score, as the forward's is
    let lse: Vec<f32> = random_f32(36, rows).iter().map(|z| 2.0 + z.abs()).collect();
    let gpu_in = [&q, &k, &v, &o, &lse, &d_o].map(|a| up_f32(&be, a));
    let cpu_in = [&q, &k, &v, &o, &lse, &d_o].map(|a| cpu_f32(a));
    poison_pool(&be, rows);
    let got = be
        .attention_backward(attention_grad_operands(&gpu_in), dims)
        .unwrap();
    let want = cpu
        .attention_backward(attention_grad_operands(&cpu_in), dims)
        .unwrap();
    for (name, g, c) in [
        ("dq", &got.0, &want.0),
        ("dk", &got.1, &want.1),
        ("dv", &got.2, &want.2),
    ] {
        common::assert_close(
            &format!("attention_backward {name} of [{heads}, {seq}, 1]"),
            &host_f64(be.download(g).unwrap()),
            &host_f64(cpu.download(c).unwrap()),
            1e-5,
            1e-4,
        );
    }
}

/// `random_uniform` past 65,535 workgroups: bit for bit the CPU's stream.
#[test]
fn folded_random_uniform() {
    let Some((be, _lock)) = fold_gpu("folded_random_uniform") else {
        return;
    };
    let n = fold::smallest_folding(WG);
    fold::assert_past_limit("random_uniform", fold::groups(n, WG));
    poison_pool(&be, n);
    let got = be
        .download(&be.random_uniform(n, 77, DType::F32).unwrap())
        .unwrap();
    let want = CpuBackend
        .download(&CpuBackend.random_uniform(n, 77, DType::F32).unwrap())
        .unwrap();
    assert_eq!(got, want, "random_uniform of {n}");
}

/// The f32 → f16 → f32 casts (`half.wgsl`) on the smallest length past 65,535 workgroups of
/// 256 (plus 3, so the f16 buffer ends on half a word), each into a NaN-poisoned output; skipped
/// with a printed reason where the adapter has no `shader-f16`.
#[test]
fn folded_f16_casts() {
    let Some((be, _lock)) = fold_gpu("folded_f16_casts") else {
        return;
    };
    if !be.has_f16() {
        eprintln!("skipping folded_f16_casts: this adapter has no shader-f16");
        return;
    }
    let n = fold::smallest_folding(WG) + 3;
    fold::assert_past_limit("f16 casts", fold::groups(n, WG));
    let x = random_f32(21, n);
    let gx = up_f32(&be, &x);
    be.synchronize().unwrap();
    be.trim_pool();
    drop(be.full(n, f64::NAN, DType::F16).unwrap());
    be.flush().unwrap();
    let h = be.cast(&gx, DType::F16).unwrap();
    drop(gx);
    poison_pool(&be, n);
    let back = be.download(&be.cast(&h, DType::F32).unwrap()).unwrap();
    let got = host_f64(back);
    assert_eq!(got.len(), n);
    for (i, (&g, &v)) in got.iter().zip(&x).enumerate() {
        let tol = (v as f64).abs() * 2f64.powi(-11) + 2f64.powi(-25);
        assert!(
            (g - v as f64).abs() <= tol,
            "f16 casts: element {i} of {n}: {v} came back as {g}"
        );
    }
}

/// `values` rounded to f16 and back, on the CPU (the values an f16 buffer holds).
fn f16_rounded(values: &[f32]) -> Vec<f32> {
    values
        .iter()
        .map(|&v| half::f16::from_f32(v).to_f32())
        .collect()
}

/// The f16 builds of mixed precision's 1-D kernels past 65,535 workgroups: `scatter_add`
/// (loop and sorted entries, f16 source and output) and the cross-entropy's backward (f16
/// logits and gradient), against the CPU in f32 on the same f16 values, within the output's
/// f16 rounding. The f16 builds share the f32 builds' index arithmetic, but they are separate
/// pipelines, so their folding is run too.
#[test]
fn folded_f16_mixed_precision_kernels() {
    let Some((be, _lock)) = fold_gpu("folded_f16_mixed_precision_kernels") else {
        return;
    };
    if !be.has_f16() {
        eprintln!("skipping folded_f16_mixed_precision_kernels: this adapter has no shader-f16");
        return;
    }
    let cpu = CpuBackend;
    let to_f16 = |b: &GpuBuffer| be.cast(b, DType::F16).unwrap();
    let back = |b: &GpuBuffer| host_f64(be.download(&be.cast(b, DType::F32).unwrap()).unwrap());
    for (kernel, m, n) in folded_scatter_cases() {
        let src = f16_rounded(&random_f32(31, m));
        let mut idx = random_i32(32, m, n);
        idx[0] = (n - 1) as i32;
        idx[m - 1] = idx[0];
        let dims = index_scatter_dims(m, n);
        let gs = to_f16(&up_f32(&be, &src));
        let gi = up_i32(&be, &idx);
        poison_pool(&be, n);
        let got = scatter_on(&be, kernel, &gs, &gi, dims);
        assert_eq!(got.dtype(), DType::F16, "{kernel}: f16 in, f16 out");
        let want = cpu
            .scatter_add(&cpu_f32(&src), &cpu_i32(&idx), [0, 1, 0], dims)
            .unwrap();
        let want = host_f64(cpu.download(&want).unwrap());
        common::assert_close(kernel, &back(&got), &want, 1e-7, 2f64.powi(-10));
    }
    // one row of n classes: the backward's one invocation per logit folds
    let classes = fold::smallest_folding(256);
    fold::assert_past_limit("cross_entropy_backward", fold::groups(classes, 256));
    let logits = f16_rounded(&random_f32(33, classes));
    let (cl, ct, cg) = (cpu_f32(&logits), cpu_i32(&[7]), cpu_f32(&[0.75]));
    let (_, lse) = cpu.cross_entropy_forward(&cl, &ct, classes).unwrap();
    let want = cpu
        .cross_entropy_backward((&cg, 1.0), &cl, &ct, &lse)
        .unwrap();
    let lse_v: Vec<f32> = host_f64(cpu.download(&lse).unwrap())
        .iter()
        .map(|&v| v as f32)
        .collect();
    let gl = to_f16(&up_f32(&be, &logits));
    let (gt, gg, glse) = (up_i32(&be, &[7]), up_f32(&be, &[0.75]), up_f32(&be, &lse_v));
    poison_pool(&be, classes);
    let got = be
        .cross_entropy_backward((&gg, 1.0), &gl, &gt, &glse)
        .unwrap();
    assert_eq!(got.dtype(), DType::F16, "the f16 logits' gradient is f16");
    let want = host_f64(cpu.download(&want).unwrap());
    // each gradient is about 1/classes: the f16 rounding is relative, plus f16's subnormal step
    common::assert_close(
        "cross_entropy_backward (f16)",
        &back(&got),
        &want,
        2f64.powi(-24),
        2f64.powi(-10),
    );
}
