//! The GPU matmul's kernel choices (`MatmulKernel`): the plain, wide, wide-vec4 and subgroup
//! kernels agree to the bit (shapes the vec4 kernel takes, with padded strides and offsets, and
//! shapes it leaves to the wide one), and the default choice's split-k (products with few tiles and a long reduction,
//! summed in a second pass) matches the CPU and is deterministic, as do the expert bank's weight
//! gradients whose segments it cuts into row ranges. The kernels' layouts, grid splits and bad
//! inputs are `gpu_matmul.rs`, whose helpers these tests use.

use super::folded_grids::poison_pool;
use super::folded_matmul_grids::matmul_kernels;
use super::gpu_matmul::{
    check_contiguous, check_weight_grad, contiguous, f32_data, gpu, offsets_of, sorted_experts,
    values,
};
use super::kernels_of;
use crate::DType;
use crate::Error;
use crate::backend::cpu::CpuBackend;
use crate::backend::gpu::MatmulKernel;
use crate::backend::{
    BufferOps, ElementwiseOps, ExpertBankDims, HostData, MatLayout, MatmulDims, MatmulOps,
};
use rand::{RngExt, SeedableRng};
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
    let kernels = matmul_kernels(&be);
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    for ([batch, m, k, n], (ta, tb)) in [
        ([1, 300, 257, 129], (false, false)),
        ([2, 129, 15, 260], (true, false)),
        ([1, 131, 70, 200], (false, true)),
        ([3, 64, 9, 127], (true, true)),
        // vec4 layouts (n and every contiguous axis a multiple of 4), tails past 128 included
        ([1, 300, 256, 132], (false, false)),
        ([2, 260, 20, 264], (true, false)),
        ([1, 131, 68, 200], (false, true)),
        ([3, 64, 12, 128], (true, true)),
        ([1, 1, 8, 4], (false, false)),
    ] {
        let (la, a_len) = contiguous(batch, m, k, ta, false);
        let (lb, b_len) = contiguous(batch, k, n, tb, false);
        let a = be.upload(&f32_data(&values(&mut rng, a_len))).unwrap();
        let b = be.upload(&f32_data(&values(&mut rng, b_len))).unwrap();
        let dims = MatmulDims { batch, m, k, n };
        let mut results = Vec::new();
        for &kernel in &kernels {
            be.set_matmul_kernel(kernel).unwrap();
            // NaN in the buffer the output will get, so that an element left unwritten shows
            poison_pool(&be, batch * m * n);
            let c = be
                .matmul((&a, la), (&b, lb), None, dims, DType::F32)
                .unwrap();
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

/// The vec4 kernel on padded storage: offsets, row strides and batch strides that are multiples
/// of 4 (it runs) and ones that are not (it leaves the product to the wide kernel), against the
/// wide kernel's bits; and which layouts it accepts.
#[test]
fn matmul_wide_vec4_with_offsets_and_strides() {
    let Some((be, _lock)) = gpu("matmul_wide_vec4_with_offsets_and_strides") else {
        return;
    };
    let before = be.matmul_kernel();
    let mut rng = ChaCha8Rng::seed_from_u64(14);
    let (batch, m, k, n) = (2, 133, 40, 136);
    for pad in [4, 3] {
        // A: offset pad, rows padded to k + pad, batches padded by pad; B: stored [k, batch, n]
        let la = MatLayout {
            offset: pad,
            batch_stride: m * (k + pad) + pad,
            row_stride: k + pad,
            col_stride: 1,
        };
        let a_len = (pad + batch * (m * (k + pad) + pad)).next_multiple_of(4);
        let lb = MatLayout {
            offset: 2 * pad,
            batch_stride: n,
            row_stride: batch * n,
            col_stride: 1,
        };
        let b_len = (2 * pad + k * batch * n).next_multiple_of(4);
        let a = be.upload(&f32_data(&values(&mut rng, a_len))).unwrap();
        let b = be.upload(&f32_data(&values(&mut rng, b_len))).unwrap();
        let dims = MatmulDims { batch, m, k, n };
        let mut results = Vec::new();
        for kernel in [MatmulKernel::Wide, MatmulKernel::WideVec4] {
            be.set_matmul_kernel(kernel).unwrap();
            poison_pool(&be, batch * m * n);
            let c = be
                .matmul((&a, la), (&b, lb), None, dims, DType::F32)
                .unwrap();
            match be.download(&c).unwrap() {
                HostData::F32(v) => results.push(v),
                other => panic!("matmul gave {other:?}"),
            }
        }
        let same = results[0]
            .iter()
            .zip(&results[1])
            .all(|(w, v)| w.to_bits() == v.to_bits());
        assert!(same, "padding {pad}: wide-vec4 and wide differ");
    }
    be.set_matmul_kernel(before).unwrap();
    // which layouts it takes
    let row_major = |rows: usize, cols: usize| contiguous(1, rows, cols, false, false);
    let takes = |(la, a_len): (MatLayout, usize), (lb, b_len): (MatLayout, usize), dims| {
        let a = be.upload(&f32_data(&vec![0.0; a_len])).unwrap();
        let b = be.upload(&f32_data(&vec![0.0; b_len])).unwrap();
        crate::backend::gpu::matmul::takes_vec4(&a, la, &b, lb, dims)
    };
    let dims = |m, k, n| MatmulDims { batch: 1, m, k, n };
    assert!(takes(row_major(5, 8), row_major(8, 12), dims(5, 8, 12)));
    assert!(
        !takes(row_major(5, 8), row_major(8, 10), dims(5, 8, 10)),
        "n = 10"
    );
    assert!(
        !takes(row_major(5, 6), row_major(6, 12), dims(5, 6, 12)),
        "k = 6, A row-major"
    );
    let shifted = MatLayout {
        offset: 2,
        ..row_major(5, 8).0
    };
    assert!(
        !takes((shifted, 48), row_major(8, 12), dims(5, 8, 12)),
        "offset 2"
    );
    // A transposed (m contiguous) needs m a multiple of 4
    assert!(takes(
        contiguous(1, 8, 6, true, false),
        row_major(6, 4),
        dims(8, 6, 4)
    ));
    assert!(!takes(
        contiguous(1, 6, 6, true, false),
        row_major(6, 4),
        dims(6, 6, 4)
    ));
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
        .download(
            &be.matmul((&a, la), (&b, lb), None, dims, DType::F32)
                .unwrap(),
        )
        .unwrap();
    let twice = be
        .download(
            &be.matmul((&a, la), (&b, lb), None, dims, DType::F32)
                .unwrap(),
        )
        .unwrap();
    assert_eq!(once, twice, "split-k matmul: two runs differ");
    be.set_matmul_kernel(before).unwrap();
}

/// The expert bank's weight gradient with few experts and long segments (a small-n MoE layer:
/// few tiles, each summing thousands of rows), which the default kernel choice cuts into row
/// ranges and sums in a second pass: against the CPU in f64 with uneven, short, empty and stray
/// rows; the split runs (a reduction follows it) and writes every slice (NaN-poisoned output
/// buffers); the same bits when run twice; and no split under `MatmulKernel::Plain`.
#[test]
fn grouped_weight_grad_row_splits() {
    let Some((be, _lock)) = gpu("grouped_weight_grad_row_splits") else {
        return;
    };
    let before = be.matmul_kernel();
    be.set_matmul_kernel(MatmulKernel::Auto).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(14);
    // (counts per expert, [k, m], splits the launcher picks: split_k(tiles, mean segment))
    for (counts, [k, m], splits) in [
        (vec![600, 420], [64, 96], 3),
        // one long segment, a short one (its second range empty) and an empty one
        (vec![1000, 3, 0], [45, 70], 2),
        (vec![2100], [1, 1], 15),
        (vec![300, 277, 290, 301], [130, 65], 2),
    ] {
        let name = format!("row-split weight gradient {counts:?} k {k} m {m}");
        let (mut re, off) = (sorted_experts(&counts), offsets_of(&counts));
        if re.len() > 700 {
            // stray rows inside a segment contribute nothing, split or not
            re[5] = -1;
            re[650] = counts.len() as i32 - 1;
        }
        poison_pool(&be, splits * counts.len() * k * m);
        let kernels = kernels_of(|| check_weight_grad(&be, &mut rng, &name, &re, &off, [k, m]));
        assert!(
            kernels.iter().any(|k| k.starts_with("reduce.")),
            "{name}: no reduction after the split: {kernels:?}"
        );
    }
    let (counts, [k, m]) = ([700, 500], [64, 64]);
    let rows = 1200;
    let upload_f32 =
        |n: usize, rng: &mut ChaCha8Rng| be.upload(&f32_data(&values(rng, n))).unwrap();
    let (x, dy) = (
        upload_f32(rows * k, &mut rng),
        upload_f32(rows * m, &mut rng),
    );
    let re = be.upload(&HostData::I32(sorted_experts(&counts))).unwrap();
    let off = be.upload(&HostData::I32(offsets_of(&counts))).unwrap();
    let bank = ExpertBankDims { k, m, experts: 2 };
    let run = || {
        let dw = be.grouped_weight_grad(&x, &dy, &re, &off, bank, DType::F32);
        be.download(&dw.unwrap()).unwrap()
    };
    let once = run();
    assert_eq!(once, run(), "row-split weight gradient: two runs differ");
    be.set_matmul_kernel(MatmulKernel::Plain).unwrap();
    let kernels = kernels_of(|| drop(run()));
    assert_eq!(
        kernels,
        ["matmul.grouped_weight_grad"],
        "unsplit under Plain"
    );
    be.set_matmul_kernel(before).unwrap();
}

/// The expert bank's bias gradient (`grouped_bias_grad`, the weight-gradient kernel reading a
/// column of ones it is not given): the bits of `grouped_weight_grad` with that column, on the
/// GPU (under `Auto`, whose row splits cut the long segments, and `Plain`; f32, and f16 rows
/// into f32) and on the CPU (f64); against `Σ dy` over each expert's rows in f64 with empty
/// experts, stray rows and odd offsets; every output written (NaN-poisoned pool); and no
/// buffer of ones filled.
#[test]
fn grouped_bias_grad_is_the_weight_grad_of_a_column_of_ones() {
    let Some((be, _lock)) = gpu("grouped_bias_grad_is_the_weight_grad_of_a_column_of_ones") else {
        return;
    };
    let before = be.matmul_kernel();
    let mut rng = ChaCha8Rng::seed_from_u64(15);
    let cpu = CpuBackend;
    let mut cases: Vec<(Vec<i32>, Vec<i32>, usize)> = vec![
        (
            sorted_experts(&[70, 0, 1, 64, 130, 0]),
            offsets_of(&[70, 0, 1, 64, 130, 0]),
            70,
        ),
        (sorted_experts(&[1500, 900]), offsets_of(&[1500, 900]), 200),
        (sorted_experts(&[2100]), offsets_of(&[2100]), 1),
    ];
    let mut stray = sorted_experts(&[40, 25, 0, 70]);
    for r in [0, 5, 39, 41, 64, 100, 134] {
        stray[r] = if r % 2 == 0 { -1 } else { 2 };
    }
    cases.push((stray, offsets_of(&[40, 25, 0, 70]), 33));
    let odd: Vec<i32> = (0..90).map(|_| rng.random_range(-1..4)).collect();
    cases.push((odd, vec![-5, 3, 2, 140], 17));
    for kernel in [MatmulKernel::Auto, MatmulKernel::Plain] {
        be.set_matmul_kernel(kernel).unwrap();
        for (re, off, m) in &cases {
            let (rows, experts) = (re.len(), off.len() - 1);
            let name =
                format!("bias gradient of {rows} rows, {experts} experts, m {m}, {kernel:?}");
            let dy_values = values(&mut rng, rows * m);
            // the definition: each expert's rows inside its (clamped) segment, in f64
            let mut want = vec![0.0f64; experts * m];
            for e in 0..experts {
                let lo = (off[e].max(0) as usize).min(rows);
                let hi = (off[e + 1].max(0) as usize).min(rows).max(lo);
                for r in (lo..hi).filter(|&r| re[r] == e as i32) {
                    for c in 0..*m {
                        want[e * m + c] += dy_values[r * m + c] as f64;
                    }
                }
            }
            let (re_h, off_h) = (HostData::I32(re.clone()), HostData::I32(off.clone()));
            let bank = ExpertBankDims {
                k: 1,
                m: *m,
                experts,
            };
            // the GPU, f32 (and f16 rows into f32): the bias kernel against the product of ones
            let mut dtypes = vec![DType::F32];
            if be.has_f16() {
                dtypes.push(DType::F16);
            }
            for dtype in dtypes {
                let dy = be
                    .cast(&be.upload(&f32_data(&dy_values)).unwrap(), dtype)
                    .unwrap();
                let (re_g, off_g) = (be.upload(&re_h).unwrap(), be.upload(&off_h).unwrap());
                let ones = be.full(rows, 1.0, dtype).unwrap();
                let product = be
                    .grouped_weight_grad(&ones, &dy, &re_g, &off_g, bank, DType::F32)
                    .unwrap();
                let product = be.download(&product).unwrap().to_f64();
                poison_pool(&be, experts * m * 16);
                let mut got = None;
                let kernels = kernels_of(|| {
                    let db = be
                        .grouped_bias_grad(&dy, (&re_g, &off_g), (*m, experts), DType::F32)
                        .unwrap();
                    assert_eq!(db.dtype(), DType::F32, "{name}");
                    got = Some(be.download(&db).unwrap().to_f64());
                });
                let got = got.unwrap();
                let differ = got
                    .iter()
                    .zip(&product)
                    .position(|(a, b)| a.to_bits() != b.to_bits());
                assert!(
                    differ.is_none(),
                    "{name} {dtype}: differs from ones·dy at {differ:?}"
                );
                assert!(
                    !kernels.iter().any(|k| k.contains("fill")),
                    "{name}: {kernels:?}"
                );
                if dtype == DType::F32 {
                    let atol = 1e-5 * (rows as f64).sqrt();
                    crate::common::assert_close(&name, &got, &want, atol, 1e-5);
                }
            }
            // the CPU, f64: the same bits as its product with a column of ones
            let dy = cpu
                .upload(&HostData::F64(
                    dy_values.iter().map(|&v| v as f64).collect(),
                ))
                .unwrap();
            let (re_c, off_c) = (cpu.upload(&re_h).unwrap(), cpu.upload(&off_h).unwrap());
            let ones = cpu.full(rows, 1.0, DType::F64).unwrap();
            let product = cpu
                .grouped_weight_grad(&ones, &dy, &re_c, &off_c, bank, DType::F64)
                .unwrap();
            let db = cpu
                .grouped_bias_grad(&dy, (&re_c, &off_c), (*m, experts), DType::F64)
                .unwrap();
            assert_eq!(
                cpu.download(&db).unwrap(),
                cpu.download(&product).unwrap(),
                "{name} on the CPU"
            );
        }
    }
    be.set_matmul_kernel(before).unwrap();
}

/// A product's output dtype: the GPU computes f32·f32 → f32 or f16, f16·f16 → f16 or f32 and
/// f16·f32 → f16 or f32 (mixed precision's builds, `gpu/matmul_build.rs`; the f16 ones only
/// with `shader-f16`) and refuses the others with an error naming the three dtypes; the CPU
/// computes in its operands' dtype.
#[test]
fn matmul_output_dtypes_are_the_builds_or_an_error() {
    let Some((be, _lock)) = gpu("matmul_output_dtypes_are_the_builds_or_an_error") else {
        return;
    };
    let a = be.upload(&HostData::F32(vec![1.0; 12])).unwrap();
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
    // outputs other than the operands' dtype: the f16 ones need shader-f16, and no f64
    if !be.has_f16() {
        assert!(matches!(
            be.matmul((&a, l(4)), (&a, l(3)), None, dims, DType::F16),
            Err(Error::DType(_))
        ));
    }
    assert!(matches!(
        be.matmul((&a, l(4)), (&a, l(3)), None, dims, DType::F64),
        Err(Error::DType(_))
    ));
    let cpu = CpuBackend;
    let a_cpu = cpu.upload(&HostData::F32(vec![1.0; 12])).unwrap();
    match cpu.matmul((&a_cpu, l(4)), (&a_cpu, l(3)), None, dims, DType::F64) {
        Err(Error::DType(m)) => assert!(m.contains("f32") && m.contains("f64"), "{m}"),
        other => panic!("a CPU f32 product into f64 gave {other:?}"),
    }
    if be.has_f16() {
        let h = be.cast(&a, DType::F16).unwrap();
        for (x, y, out) in [(&a, &h, DType::F16), (&a, &h, DType::F32)] {
            match be.matmul((x, l(4)), (y, l(3)), None, dims, out) {
                Err(Error::DType(m)) => assert!(m.contains("A is") && m.contains("output"), "{m}"),
                other => panic!("{} · {} → {out} gave {other:?}", x.dtype(), y.dtype()),
            }
        }
        // the five that run with f16: f16·f16 → f16 or f32, f16·f32 → f16 or f32, f32·f32 →
        // f16, each 4 (= k ones summed)
        for (x, y, out) in [
            (&h, &h, DType::F16),
            (&h, &h, DType::F32),
            (&h, &a, DType::F16),
            (&h, &a, DType::F32),
            (&a, &a, DType::F16),
        ] {
            let c = be.matmul((x, l(4)), (y, l(3)), None, dims, out).unwrap();
            assert_eq!(c.dtype(), out);
            let c = be.cast(&c, DType::F32).unwrap();
            assert_eq!(be.download(&c).unwrap(), HostData::F32(vec![4.0; 9]));
        }
    }
}
