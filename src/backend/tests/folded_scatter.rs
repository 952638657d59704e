//! The scatter kernels (`shaders/layout.wgsl`: `scatter_add_loop`, `_sorted`, `_columns` and
//! `_wide`) past 65,535 workgroups, against the CPU backend in f32, as `folded_grids.rs` runs the
//! other kernels (NaN-filled outputs, each case asserting it crosses the limit), and the cases
//! and helpers its f16 fold test shares.
//!
//! Without a GPU adapter the tests print "skipping" and pass, unless `MOEGRAD_REQUIRE_GPU=1`.

use super::folded_grids::{
    WG, assert_same, cpu_f32, cpu_i32, fold_gpu, poison_pool, random_f32, random_i32, up_f32,
    up_i32,
};
use crate::backend::cpu::CpuBackend;
use crate::backend::gpu::{GpuBackend, GpuBuffer};
use crate::backend::{BufferOps, LayoutOps, ScatterDims};
use crate::fold;

/// Each scatter kernel with one index per source row past 65,535 workgroups
/// ([`folded_scatter_cases`]).
#[test]
fn folded_scatter_kernels() {
    let Some((be, _lock)) = fold_gpu("folded_scatter_kernels") else {
        return;
    };
    let cpu = CpuBackend;
    // m rows scattered into n (an index_scatter): one invocation per output element (the column
    // kernel: a workgroup per output row). With m ≤ 32 the loop kernel runs; with m = 40 and m·n > 2^24 the
    // sorted one; with m = 33 into 65,536 the column one. Targets spread over the whole output
    // (the last element included) and repeat.
    for (kernel, m, n) in folded_scatter_cases() {
        let src = random_f32(9, m);
        let mut idx = random_i32(10, m, n);
        idx[0] = (n - 1) as i32;
        idx[m - 1] = idx[0];
        let (gs, cs) = (up_f32(&be, &src), cpu_f32(&src));
        let (gi, ci) = (up_i32(&be, &idx), cpu_i32(&idx));
        let dims = index_scatter_dims(m, n);
        poison_pool(&be, n);
        let got = scatter_on(&be, kernel, &gs, &gi, dims);
        let want = cpu.scatter_add(&cs, &ci, [0, 1, 0], dims).unwrap();
        assert_same(
            kernel,
            be.download(&got).unwrap(),
            cpu.download(&want).unwrap(),
        );
    }
}

/// `scatter_add_wide` (a workgroup per output element, for an index that varies along the inner
/// axis) past 65,535 workgroups: 33 rows of 2 columns, each element with its own index, into
/// 32,768 rows of 2 (65,536 outputs), the last output hit twice.
#[test]
fn folded_wide_scatter() {
    let Some((be, _lock)) = fold_gpu("folded_wide_scatter") else {
        return;
    };
    let cpu = CpuBackend;
    let (m, inner) = (33, 2);
    let len = fold::smallest_folding(1).div_ceil(inner);
    fold::assert_past_limit("scatter_add_wide", fold::groups(len * inner, 1));
    let src = random_f32(33, m * inner);
    let mut idx = random_i32(34, m * inner, len);
    // element (j, 1) of rows 0 and m − 1 into the last output row
    idx[1] = (len - 1) as i32;
    idx[(m - 1) * inner + 1] = idx[1];
    let (gs, cs) = (up_f32(&be, &src), cpu_f32(&src));
    let (gi, ci) = (up_i32(&be, &idx), cpu_i32(&idx));
    let dims = ScatterDims {
        outer: 1,
        m,
        inner,
        len,
    };
    let strides = [m * inner, inner, 1];
    poison_pool(&be, len * inner);
    let mut got = None;
    let ran = super::kernels_of(|| got = Some(be.scatter_add(&gs, &gi, strides, dims).unwrap()));
    assert!(
        ran.iter().any(|k| k.ends_with("scatter_add_wide")),
        "scatter_add_wide did not run: {ran:?}"
    );
    let want = cpu.scatter_add(&cs, &ci, strides, dims).unwrap();
    assert_same(
        "scatter_add_wide",
        be.download(&got.expect("ran")).unwrap(),
        cpu.download(&want).unwrap(),
    );
}

/// `(kernel, m, n)`: `m` rows scattered into `n` so that each scatter kernel with one index per
/// row runs past 65,535 workgroups (asserted here): the loop kernel with m ≤ 32, the sorted one
/// with m = 40 and m·n > 2^24, the column one (a workgroup per output row of one column) with
/// m = 33 into 65,536. (The wide kernel, for an index that varies along the inner axis, is
/// `folded_wide_scatter`'s.)
pub(super) fn folded_scatter_cases() -> [(&'static str, usize, usize); 3] {
    let (n, wide_n) = (fold::smallest_folding(WG), fold::smallest_folding(1));
    let cases = [
        ("scatter_add_loop", 2, n, WG),
        ("scatter_add_sorted", 40, n, WG),
        ("scatter_add_columns", 33, wide_n, 1),
    ];
    cases.map(|(kernel, m, n, per_group)| {
        fold::assert_past_limit(kernel, fold::groups(n, per_group));
        (kernel, m, n)
    })
}

/// The sizes of `m` rows scattered into `n` (an index_scatter).
pub(super) fn index_scatter_dims(m: usize, n: usize) -> ScatterDims {
    let (outer, inner, len) = (1, 1, n);
    ScatterDims {
        outer,
        m,
        inner,
        len,
    }
}

/// `be.scatter_add` of an index_scatter, asserting that the entry `kernel` ran.
pub(super) fn scatter_on(
    be: &GpuBackend,
    kernel: &str,
    src: &GpuBuffer,
    idx: &GpuBuffer,
    dims: ScatterDims,
) -> GpuBuffer {
    let mut got = None;
    let ran = super::kernels_of(|| got = Some(be.scatter_add(src, idx, [0, 1, 0], dims).unwrap()));
    assert!(
        ran.iter().any(|k| k.ends_with(kernel)),
        "{kernel} did not run: {ran:?}"
    );
    got.expect("ran")
}
