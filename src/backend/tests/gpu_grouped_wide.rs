//! The expert bank's wide grouped matmul (`grouped_matmul_wide` in `shaders/matmul_wide.wgsl`:
//! 128×128 tiles, 8×8 per invocation) against the 64×64 `grouped_matmul`, to the bit: rows and
//! outputs that are not multiples of a tile, reductions that are not multiples of a slab (and an
//! empty one with a bias), expert runs that cross tiles, rows of no expert (−1 or ≥ n) among
//! them, unsorted rows, transposed weights, biases, and the f16 builds (f16 rows with f16 or f32
//! weights). Also which kernel each `MatmulKernel` choice runs. Skipped with a printed reason
//! without an adapter unless `MOEGRAD_REQUIRE_GPU=1`.

use super::folded_grids::poison_pool;
use super::gpu_matmul::{gpu, values};
use crate::DType;
use crate::backend::gpu::{GpuBackend, GpuBuffer, MatmulKernel};
use crate::backend::{BufferOps, ElementwiseOps, GroupedMatmulDims, HostData, MatmulOps};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The output of one grouped matmul under `kernel`, as bits (f16 outputs widened to f32), into
/// a poisoned buffer so that an element left unwritten shows.
fn grouped_under(
    be: &GpuBackend,
    kernel: MatmulKernel,
    (x, w, bias, re): (&GpuBuffer, &GpuBuffer, Option<&GpuBuffer>, &GpuBuffer),
    dims: GroupedMatmulDims,
) -> Vec<u32> {
    be.set_matmul_kernel(kernel).unwrap();
    poison_pool(be, dims.rows * dims.m);
    let out = be.grouped_matmul(x, w, bias, re, dims).unwrap();
    let out = be.cast(&out, DType::F32).unwrap();
    match be.download(&out).unwrap() {
        HostData::F32(v) => v.iter().map(|v| v.to_bits()).collect(),
        other => panic!("grouped_matmul gave {other:?}"),
    }
}

/// One case: `rows` rows of the experts `row_expert` (any order, −1 or ≥ n for none) through
/// `[experts, k, m]` weights (`[experts, m, k]` transposed), with a bias when asked.
struct Case {
    name: &'static str,
    row_expert: Vec<i32>,
    k: usize,
    m: usize,
    experts: usize,
    transpose_w: bool,
    bias: bool,
}

fn cases(rng: &mut ChaCha8Rng) -> Vec<Case> {
    // sorted runs of 100, 0, 157 and 43 rows, with no-expert rows at a tile edge and inside
    let mut sorted: Vec<i32> = [(0, 100), (2, 157), (3, 43)]
        .iter()
        .flat_map(|&(e, n)| std::iter::repeat_n(e, n))
        .collect();
    sorted[127] = -1;
    sorted[128] = 4;
    sorted[200] = -1;
    let unsorted: Vec<i32> = (0..333).map(|_| rng.random_range(-1..4)).collect();
    vec![
        Case {
            name: "sorted runs across tiles, bias",
            row_expert: sorted.clone(),
            k: 37,
            m: 200,
            experts: 4,
            transpose_w: false,
            bias: true,
        },
        Case {
            name: "transposed weights",
            row_expert: sorted,
            k: 130,
            m: 67,
            experts: 4,
            transpose_w: true,
            bias: false,
        },
        Case {
            name: "unsorted rows, bias",
            row_expert: unsorted,
            k: 9,
            m: 129,
            experts: 4,
            transpose_w: false,
            bias: true,
        },
        Case {
            name: "an empty reduction with a bias",
            row_expert: vec![1, 1, 0, -1, 1],
            k: 0,
            m: 131,
            experts: 2,
            transpose_w: false,
            bias: true,
        },
    ]
}

#[test]
fn grouped_wide_gives_the_plain_kernels_bits() {
    let Some((be, _lock)) = gpu("grouped_wide_gives_the_plain_kernels_bits") else {
        return;
    };
    let before = be.matmul_kernel();
    let mut rng = ChaCha8Rng::seed_from_u64(41);
    let mut builds = vec![(DType::F32, DType::F32)];
    if be.has_f16() {
        // f16 rows with f16 weights, and with f32 weights (mixed precision's bank)
        builds.extend([(DType::F16, DType::F16), (DType::F16, DType::F32)]);
    }
    for case in cases(&mut rng) {
        let rows = case.row_expert.len();
        let (k, m, n) = (case.k, case.m, case.experts);
        let up = |v: Vec<f32>, dtype| {
            let b = be.upload(&HostData::F32(v)).unwrap();
            be.cast(&b, dtype).unwrap()
        };
        for &(x_dtype, w_dtype) in &builds {
            let x = up(values(&mut rng, rows * k), x_dtype);
            let w = up(values(&mut rng, n * k * m), w_dtype);
            let bias = case.bias.then(|| up(values(&mut rng, n * m), w_dtype));
            let re = be.upload(&HostData::I32(case.row_expert.clone())).unwrap();
            let dims = GroupedMatmulDims {
                rows,
                k,
                m,
                experts: n,
                transpose_w: case.transpose_w,
            };
            let operands = (&x, &w, bias.as_ref(), &re);
            let wide = grouped_under(&be, MatmulKernel::Wide, operands, dims);
            let plain = grouped_under(&be, MatmulKernel::Plain, operands, dims);
            let differ = wide.iter().zip(&plain).position(|(a, b)| a != b);
            assert!(
                differ.is_none() && wide.len() == plain.len(),
                "{} ({x_dtype} rows, {w_dtype} weights): wide and plain differ at {differ:?}",
                case.name
            );
        }
    }
    be.set_matmul_kernel(before).unwrap();
}
