//! `MatmulKernel::Tuned` on the GPU (`src/backend/gpu/matmul_tune.rs`): a large product is
//! timed once per size class over the candidates its operands and the adapter allow, the
//! kernel chosen gives `Auto`'s bits, a second product of the class is not timed again, and
//! products `Auto` would split are left to it.

use super::folded_grids::poison_pool;
use super::gpu_matmul::{contiguous, f32_data, gpu, values};
use crate::DType;
use crate::backend::gpu::{GpuBackend, GpuBuffer, MatmulKernel, TunedMatmul};
use crate::backend::{BufferOps, ElementwiseOps, HostData, MatLayout, MatmulDims, MatmulOps};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// The product `a·b` under `kernel`, as f32 values (f16 outputs widened), into a poisoned
/// buffer so that an element left unwritten shows.
fn product_under(
    be: &GpuBackend,
    kernel: MatmulKernel,
    (a, la): (&GpuBuffer, MatLayout),
    (b, lb): (&GpuBuffer, MatLayout),
    dims: MatmulDims,
    out: DType,
) -> Vec<f32> {
    be.set_matmul_kernel(kernel).unwrap();
    poison_pool(be, dims.batch * dims.m * dims.n);
    let c = be.matmul((a, la), (b, lb), None, dims, out).unwrap();
    let c = be.cast(&c, DType::F32).unwrap();
    match be.download(&c).unwrap() {
        HostData::F32(v) => v,
        other => panic!("matmul gave {other:?}"),
    }
}

/// The tuning record of exactly this product in these dtypes ("f32", "f16"), if it was the one
/// timed for its class.
fn record_of(be: &GpuBackend, product: [usize; 4], dtypes: &str) -> Option<TunedMatmul> {
    be.matmul_tuning()
        .records()
        .into_iter()
        .find(|t| t.product == product && t.dtypes == dtypes)
}

/// Tuned and Auto give the same bits for one product in `dtype`, and the tuning record of
/// the class afterwards (`None` when the product was not timed).
fn check_against_auto(
    be: &GpuBackend,
    rng: &mut ChaCha8Rng,
    [batch, m, k, n]: [usize; 4],
    (ta, tb): (bool, bool),
    dtype: DType,
) -> Option<TunedMatmul> {
    let (la, a_len) = contiguous(batch, m, k, ta, false);
    let (lb, b_len) = contiguous(batch, k, n, tb, false);
    let a = be.upload(&f32_data(&values(rng, a_len))).unwrap();
    let b = be.upload(&f32_data(&values(rng, b_len))).unwrap();
    let (a, b) = (be.cast(&a, dtype).unwrap(), be.cast(&b, dtype).unwrap());
    let dims = MatmulDims { batch, m, k, n };
    let tuned = product_under(be, MatmulKernel::Tuned, (&a, la), (&b, lb), dims, dtype);
    let auto = product_under(be, MatmulKernel::Auto, (&a, la), (&b, lb), dims, dtype);
    let differ = tuned
        .iter()
        .zip(&auto)
        .position(|(t, a)| t.to_bits() != a.to_bits());
    assert!(
        differ.is_none() && tuned.len() == auto.len(),
        "{dtype} matmul {dims:?} transposed ({ta}, {tb}): tuned and auto differ at element {differ:?}"
    );
    record_of(be, [batch, m, k, n], &dtype.to_string())
}

/// Checks a record: exactly `candidates` timed (each a finite, positive time) and one of them
/// chosen.
fn check_record(record: &TunedMatmul, candidates: &[MatmulKernel], dtypes: &str) {
    let timed: Vec<MatmulKernel> = record.ms.iter().map(|&(k, _)| k).collect();
    assert_eq!(timed, candidates, "{record:?}: candidates timed");
    assert!(
        record.ms.iter().all(|&(_, ms)| ms.is_finite() && ms > 0.0),
        "{record:?}: every time finite and positive"
    );
    assert!(
        candidates.contains(&record.kernel),
        "{record:?}: the kernel chosen is a candidate"
    );
    assert_eq!(record.dtypes, dtypes, "{record:?}: dtypes");
}

#[test]
fn tuned_products_are_timed_once_per_class_and_give_autos_bits() {
    let Some((be, _lock)) = gpu("tuned_products_are_timed_once_per_class_and_give_autos_bits")
    else {
        return;
    };
    let before = be.matmul_kernel();
    let mut rng = ChaCha8Rng::seed_from_u64(31);
    let subgroup = be.subgroup_matmul_available();
    let with_subgroup = |mut c: Vec<MatmulKernel>| {
        if subgroup {
            c.push(MatmulKernel::Subgroup);
        }
        c
    };
    use MatmulKernel::{Plain, Wide, WideVec4};

    // 64 output tiles of 128×128, the smallest product Auto runs wide: timed, vec4 allowed
    let first = [1, 1024, 8, 1024];
    let record = check_against_auto(&be, &mut rng, first, (false, false), DType::F32)
        .expect("a product with 64 wide tiles is tuned");
    check_record(&record, &with_subgroup(vec![Wide, Plain, WideVec4]), "f32");

    // the same class (sizes round up to the same powers of two): not timed again
    let again = [1, 1000, 8, 1000];
    assert_eq!(
        check_against_auto(&be, &mut rng, again, (false, false), DType::F32),
        None,
        "a second product of a tuned class is timed again"
    );
    assert_eq!(
        record_of(&be, first, "f32"),
        Some(record),
        "the class's record changed"
    );

    // n not a multiple of 4 and B stored transposed: another class, without the vec4 kernel
    let odd = [1, 1024, 8, 1030];
    let record = check_against_auto(&be, &mut rng, odd, (false, true), DType::F32)
        .expect("a new class is tuned");
    check_record(&record, &with_subgroup(vec![Wide, Plain]), "f32");

    // a batch of products with a tail: its own class
    let batched = [3, 650, 12, 390];
    let record = check_against_auto(&be, &mut rng, batched, (true, false), DType::F32)
        .expect("a batched product with enough wide tiles is tuned");
    check_record(&record, &with_subgroup(vec![Wide, Plain]), "f32");

    // fewer than 64 wide tiles: Auto's plain kernel and split-k, no timing
    for small in [[1, 200, 300, 200], [2, 64, 1000, 96]] {
        assert_eq!(
            check_against_auto(&be, &mut rng, small, (false, false), DType::F32),
            None,
            "a product with few tiles is left to Auto"
        );
    }

    // f16: only the kernels with f16 builds are candidates
    if be.has_f16() {
        let record = check_against_auto(&be, &mut rng, first, (false, false), DType::F16)
            .expect("a large f16 product is tuned");
        check_record(&record, &[Wide, Plain], "f16");
    }
    be.set_matmul_kernel(before).unwrap();
}

/// The expert bank's weight gradient splits each expert's rows under `Tuned` as under `Auto`
/// (the same bits): few experts with long segments are few workgroups otherwise. `Plain` runs
/// it unsplit, whose bits differ here (a different summation order), so the case does split.
#[test]
fn tuned_splits_the_grouped_weight_gradient_as_auto_does() {
    use crate::backend::ExpertBankDims;
    let Some((be, _lock)) = gpu("tuned_splits_the_grouped_weight_gradient_as_auto_does") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(31);
    // 2 experts of 2048 rows, k = 64, m = 128: 2·1·2 = 4 tiles of 64×64, far below 128
    let (rows, k, m, experts) = (4096, 64, 128, 2);
    let x = be.upload(&f32_data(&values(&mut rng, rows * k))).unwrap();
    let dy = be.upload(&f32_data(&values(&mut rng, rows * m))).unwrap();
    let row_expert: Vec<i32> = (0..rows).map(|r| (r * experts / rows) as i32).collect();
    let row_expert = be.upload(&HostData::I32(row_expert)).unwrap();
    let offsets = be.upload(&HostData::I32(vec![0, 2048, 4096])).unwrap();
    let dims = ExpertBankDims { k, m, experts };
    let grad_under = |kernel: MatmulKernel| {
        be.set_matmul_kernel(kernel).unwrap();
        let dw = be
            .grouped_weight_grad(&x, &dy, &row_expert, &offsets, dims, DType::F32)
            .unwrap();
        match be.download(&dw).unwrap() {
            HostData::F32(v) => v.iter().map(|v| v.to_bits()).collect::<Vec<u32>>(),
            other => panic!("grouped_weight_grad gave {other:?}"),
        }
    };
    let (tuned, auto, plain) = (
        grad_under(MatmulKernel::Tuned),
        grad_under(MatmulKernel::Auto),
        grad_under(MatmulKernel::Plain),
    );
    be.set_matmul_kernel(MatmulKernel::Auto).unwrap();
    assert_ne!(
        auto, plain,
        "the case splits under auto (else it tests nothing)"
    );
    assert_eq!(tuned, auto, "tuned splits the rows as auto does");
}
