//! The matmul launchers' grids past 65,535 workgroups in a dimension, run once on the smallest
//! shape that does (see `tests/common/fold.rs`), against the CPU backend in f32 into
//! NaN-poisoned outputs, like the 1-D kernels of `folded_grids.rs` whose helpers these use:
//! matmul's x and y splits under every kernel the adapter offers, and the grouped matmul's and
//! its weight gradient's column split. Left out: matmul's z split
//! (`gpu_matmul::matmul_grid_split`) and the grouped matmul's row split (4.2 million rows,
//! minutes on lavapipe; it shares the base tile with the column split).
//!
//! Without a GPU adapter the tests print "skipping" and pass, unless `MOEGRAD_REQUIRE_GPU=1`.

use super::folded_grids::{
    assert_same, cpu_f32, cpu_i32, fold_gpu, poison_pool, random_f32, up_f32, up_i32,
};
use crate::backend::cpu::CpuBackend;
use crate::backend::gpu::{GpuBackend, MatmulKernel};
use crate::backend::{
    BufferOps, ExpertBankDims, GroupedMatmulDims, MatLayout, MatmulDims, MatmulOps,
};
use crate::{DType, fold};

/// The matmul kernels `gpu` offers.
pub(super) fn matmul_kernels(gpu: &GpuBackend) -> Vec<MatmulKernel> {
    let mut kernels = vec![
        MatmulKernel::Plain,
        MatmulKernel::Wide,
        MatmulKernel::WideVec4,
    ];
    if gpu.subgroup_matmul_available() {
        kernels.push(MatmulKernel::Subgroup);
    }
    kernels
}

/// matmul with more than 65,535 column tiles (x) or row tiles (y): the launcher splits the grid
/// into launches that each start at a tile offset. The x split under every kernel the adapter
/// offers (tiles of 64, or 128 for the wide one), the y split under the plain kernel, each with
/// a bias (read per column, so each x launch must add its tile offset to find it), then with the
/// bias and a pending gradient (`matmul_plus`, read per element, each launch at its own tiles).
/// (More than 65,535 batch entries, the z split, is `gpu_matmul::matmul_grid_split`.)
#[test]
fn split_matmul_grids() {
    let Some((be, _lock)) = fold_gpu("split_matmul_grids") else {
        return;
    };
    let before = be.matmul_kernel();
    let cpu = CpuBackend;
    let row_major = |cols: usize| MatLayout {
        offset: 0,
        batch_stride: 0,
        row_stride: cols,
        col_stride: 1,
    };
    for kernel in matmul_kernels(&be) {
        be.set_matmul_kernel(kernel).unwrap();
        let tile = if matches!(kernel, MatmulKernel::Wide | MatmulKernel::WideVec4) {
            128
        } else {
            64
        };
        // k = 4 and n a multiple of 4 for the vec4 kernel (contiguous axes of whole vec4s)
        let vec4 = kernel == MatmulKernel::WideVec4;
        let k = if vec4 { 4 } else { 2 };
        let long = match vec4 {
            true => fold::smallest_folding(tile).next_multiple_of(4),
            false => fold::smallest_folding(tile),
        };
        fold::assert_past_limit("matmul tiles", fold::groups(long, tile));
        // [1, k]·[k, long] (x split), and under the plain kernel also [long, k]·[k, 1] (y
        // split): each split costs seconds on a software rasterizer.
        let splits: &[(usize, usize)] = if kernel == MatmulKernel::Plain {
            &[(1, long), (long, 1)]
        } else {
            &[(1, long)]
        };
        for &(m, n) in splits {
            let a = random_f32(13, m * k);
            let b = random_f32(14, k * n);
            // with a bias, which each launch must read at its own columns
            let bias = random_f32(15, n);
            let dims = MatmulDims { batch: 1, m, k, n };
            poison_pool(&be, m * n);
            let got = be
                .matmul(
                    (&up_f32(&be, &a), row_major(k)),
                    (&up_f32(&be, &b), row_major(n)),
                    Some(&up_f32(&be, &bias)),
                    dims,
                    DType::F32,
                )
                .unwrap();
            let want = cpu
                .matmul(
                    (&cpu_f32(&a), row_major(k)),
                    (&cpu_f32(&b), row_major(n)),
                    Some(&cpu_f32(&bias)),
                    dims,
                    DType::F32,
                )
                .unwrap();
            let what = format!("matmul ({kernel:?}) [{m}, {k}]·[{k}, {n}]");
            assert_same(
                &what,
                be.download(&got).unwrap(),
                cpu.download(&want).unwrap(),
            );
            // with a pending gradient (or a residual) too, which each launch must read at its
            // own tiles, and the bias at its own columns
            let pending = random_f32(16, m * n);
            poison_pool(&be, m * n);
            let got = be
                .matmul_plus(
                    (&up_f32(&be, &a), row_major(k)),
                    (&up_f32(&be, &b), row_major(n)),
                    Some(&up_f32(&be, &bias)),
                    dims,
                    DType::F32,
                    &up_f32(&be, &pending),
                )
                .unwrap();
            let want = cpu
                .matmul_plus(
                    (&cpu_f32(&a), row_major(k)),
                    (&cpu_f32(&b), row_major(n)),
                    Some(&cpu_f32(&bias)),
                    dims,
                    DType::F32,
                    &cpu_f32(&pending),
                )
                .unwrap();
            assert_same(
                &format!("{what} plus a bias and a pending gradient"),
                be.download(&got).unwrap(),
                cpu.download(&want).unwrap(),
            );
        }
    }
    be.set_matmul_kernel(before).unwrap();
}

/// The grouped matmul (with its bias) and its weight gradient with more than 65,535 column
/// tiles of 64 (the plain kernel, then 128 for the wide one): both launchers split x
/// (`tiles(m)`) into launches that each start at a tile offset. The cheapest axis to split: two
/// rows, one input, two experts, so each workgroup runs one one-row expert run of one slab (the
/// row split, 4.2 million rows, takes minutes).
#[test]
fn split_grouped_matmul_columns() {
    let Some((be, _lock)) = fold_gpu("split_grouped_matmul_columns") else {
        return;
    };
    let before = be.matmul_kernel();
    // the wide kernel's split first: its 8.4 million columns are the larger case
    be.set_matmul_kernel(MatmulKernel::Wide).unwrap();
    split_grouped_columns(&be, 128, false);
    be.set_matmul_kernel(MatmulKernel::Plain).unwrap();
    split_grouped_columns(&be, 64, true);
    be.set_matmul_kernel(before).unwrap();
}

/// [`split_grouped_matmul_columns`] for the kernel of `tile` columns a workgroup, and the weight
/// gradient too when `weight_grad`.
fn split_grouped_columns(be: &GpuBackend, tile: usize, weight_grad: bool) {
    let cpu = CpuBackend;
    let m = fold::smallest_folding(tile);
    fold::assert_past_limit("grouped_matmul column tiles", fold::groups(m, tile));
    let (rows, k, experts) = (2, 1, 2);
    let x = random_f32(21, rows * k);
    let w = random_f32(22, experts * k * m);
    let bias = random_f32(23, experts * m);
    let row_expert = [0, 1];
    let dims = GroupedMatmulDims {
        rows,
        k,
        m,
        experts,
        transpose_w: false,
    };
    // uploaded before poisoning the pool: w and the bias have the output's size
    let (gx, gw, gbias, gexpert) = (
        up_f32(be, &x),
        up_f32(be, &w),
        up_f32(be, &bias),
        up_i32(be, &row_expert),
    );
    poison_pool(be, rows * m);
    let got = be
        .grouped_matmul(&gx, &gw, Some(&gbias), &gexpert, dims)
        .unwrap();
    let want = cpu
        .grouped_matmul(
            &cpu_f32(&x),
            &cpu_f32(&w),
            Some(&cpu_f32(&bias)),
            &cpu_i32(&row_expert),
            dims,
        )
        .unwrap();
    assert_same(
        &format!("grouped_matmul [{rows}, {k}]·[{experts}, {k}, {m}] with bias"),
        be.download(&got).unwrap(),
        cpu.download(&want).unwrap(),
    );
    drop((got, want, gw, gbias));
    if !weight_grad {
        return;
    }

    let dy = random_f32(24, rows * m);
    let offsets = [0, 1, 2];
    let bank = ExpertBankDims { k, m, experts };
    // dy has the output's size too
    let (gdy, goffsets) = (up_f32(be, &dy), up_i32(be, &offsets));
    poison_pool(be, experts * k * m);
    let got = be
        .grouped_weight_grad(&gx, &gdy, &gexpert, &goffsets, bank, DType::F32)
        .unwrap();
    let want = cpu
        .grouped_weight_grad(
            &cpu_f32(&x),
            &cpu_f32(&dy),
            &cpu_i32(&row_expert),
            &cpu_i32(&offsets),
            bank,
            DType::F32,
        )
        .unwrap();
    assert_same(
        &format!("grouped_weight_grad of {rows} rows into [{experts}, {k}, {m}]"),
        be.download(&got).unwrap(),
        cpu.download(&want).unwrap(),
    );
}
