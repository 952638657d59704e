//! Mixed precision's matrix products on the GPU (`src/backend/gpu/matmul_build.rs`): inside
//! `autocast_f16` an f16 activation times an f32 weight reads the weight in f32 where it is (the
//! f16-rows build of the product kernels), and the weight's gradient is summed and stored in f32
//! from the f16 activation and upstream gradient (the f16-to-f32 build): no f16 copy of the
//! weight forward, no cast of its gradient back, one rounding (to f32) instead of two. (The
//! expert bank's gradients from f16 rows, the same build's `grouped_weight_grad`, are checked in
//! `half_precision_matmul.rs`, `f16_rows_with_f32_expert_weights_match_f32`.)
//!
//! * forward and the activation's gradient, under the plain and the wide kernel: each element a
//!   neighbouring f16 of the f32 kernel's result on the same operands (the weights are not f16
//!   values, so a weight rounded to f16 on the way would change the f32 sums and miss);
//! * the weight's gradient: the f32 kernel's bits (the same FMA chain, stored in f32), under the
//!   plain and wide kernels and under `auto` with split-k (the same ranges, added in the same
//!   order), for a weight shared by a batched activation and for a transposed weight;
//! * which kernels ran: the two new builds, and no f16 build of the product;
//! * outside a scope an f16·f32 product is still an error;
//! * a bias's gradient from f16 (`Tensor::sum_as` to f32): the f32 sum of the f16 gradient to
//!   the bit, never rounded to f16, from one reduction and no cast.
//!
//! Skipped with a printed reason without an adapter unless `MOEGRAD_REQUIRE_GPU=1`.

mod common;
#[path = "common/f16_checks.rs"]
mod f16_checks;

use f16_checks::{assert_rounded_once, f16_gpu, f16_values, kernels_run};
use moegrad::gpu::MatmulKernel;
use moegrad::{DType, Device, Error, Tensor, autocast_f16};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::Mutex;

/// The tests here choose the matmul kernel (a process-wide setting) and read profiles: one at
/// a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// One product `x·w` (or `x·wᵀ` with `w` stored `[n, k]`), its gradients for `Σ (x·w) ⊙ up`.
struct Product {
    x_shape: Vec<usize>,
    w_shape: Vec<usize>,
    transposed: bool,
    x: Vec<f32>,
    w: Vec<f32>,
    up: Vec<f32>,
}

impl Product {
    /// `x: [.., m, k]` and `up` f16 values, `w` uniform in [-1, 1) (not f16 values).
    fn random(x_shape: &[usize], n: usize, transposed: bool, rng: &mut ChaCha8Rng) -> Product {
        let k = x_shape[x_shape.len() - 1];
        let rows: usize = x_shape[..x_shape.len() - 1].iter().product();
        Product {
            x_shape: x_shape.to_vec(),
            w_shape: if transposed { vec![n, k] } else { vec![k, n] },
            transposed,
            x: f16_values(rows * k, rng),
            w: (0..k * n).map(|_| rng.random_range(-1.0f32..1.0)).collect(),
            up: f16_values(rows * n, rng),
        }
    }

    /// `[y, dx, dw]` as f32, in f32 or inside `autocast_f16` (checking the dtypes there).
    fn run(&self, gpu: Device, mixed: bool) -> [Vec<f32>; 3] {
        let leaf = |v: &[f32], shape: &[usize]| {
            Tensor::from_f32(v.to_vec(), shape, gpu)
                .unwrap()
                .with_grad()
                .unwrap()
        };
        let (x, w) = (leaf(&self.x, &self.x_shape), leaf(&self.w, &self.w_shape));
        let forward = || {
            let w = if self.transposed {
                w.transpose(0, 1).unwrap()
            } else {
                w.clone()
            };
            x.matmul(&w).unwrap()
        };
        let y = if mixed {
            let y16 = autocast_f16(forward);
            assert_eq!(y16.dtype(), DType::F16, "f16 activation · f32 weight");
            y16.to_dtype(DType::F32).unwrap()
        } else {
            forward()
        };
        let mut up_shape = self.x_shape.clone();
        *up_shape.last_mut().unwrap() = y.shape()[y.rank() - 1];
        y.backward_with(&Tensor::from_f32(self.up.clone(), &up_shape, gpu).unwrap())
            .unwrap();
        let grad = |t: &Tensor| {
            let g = t.grad().expect("a gradient");
            assert_eq!(g.dtype(), DType::F32, "an f32 leaf's gradient is f32");
            g.to_vec_f32().unwrap()
        };
        [y.to_vec_f32().unwrap(), grad(&x), grad(&w)]
    }
}

/// Shapes: one element; odd sizes; a batched activation sharing a 2-D weight (its gradient
/// summed over the batch in one product); widths across the 64- and 128-wide tiles; a long
/// reduction for the weight's gradient (600 rows into one 64×64 tile: split-k under `auto`);
/// transposed weights (a tied output head's `h·Eᵀ`).
fn cases(rng: &mut ChaCha8Rng) -> Vec<Product> {
    let mut cases = vec![
        Product::random(&[1, 1], 1, false, rng),
        Product::random(&[5, 7], 3, false, rng),
        Product::random(&[2, 65, 17], 129, false, rng),
        Product::random(&[600, 40], 30, false, rng),
        Product::random(&[70, 33], 150, true, rng),
    ];
    for _ in 0..4 {
        let (m, k, n) = (
            rng.random_range(1..=200),
            rng.random_range(1..=140),
            rng.random_range(1..=200),
        );
        let transposed = rng.random_bool(0.5);
        cases.push(Product::random(&[m, k], n, transposed, rng));
    }
    cases
}

#[test]
fn f16_activations_read_f32_weights_and_give_them_f32_gradients() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(gpu) = f16_gpu("f16_activations_read_f32_weights_and_give_them_f32_gradients") else {
        return;
    };
    let before = moegrad::gpu::matmul_kernel().unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(41);
    let cases = cases(&mut rng);
    for kernel in [MatmulKernel::Plain, MatmulKernel::Wide, MatmulKernel::Auto] {
        moegrad::gpu::set_matmul_kernel(kernel).unwrap();
        for p in &cases {
            let what = format!(
                "{:?}·{:?}{} under {kernel:?}",
                p.x_shape,
                p.w_shape,
                if p.transposed { "ᵀ" } else { "" }
            );
            let [y16, dx16, dw16] = p.run(gpu, true);
            let [y32, dx32, dw32] = p.run(gpu, false);
            // split-k (auto, f32 outputs only) sums y and dx in another order in f32 than in f16
            if kernel != MatmulKernel::Auto {
                assert_rounded_once(&format!("{what}: y"), &y16, &y32);
                assert_rounded_once(&format!("{what}: dx"), &dx16, &dx32);
            }
            assert_eq!(dw16.len(), dw32.len(), "{what}: dw length");
            for (i, (a, b)) in dw16.iter().zip(&dw32).enumerate() {
                assert!(
                    a.to_bits() == b.to_bits(),
                    "{what}: dw[{i}] is {a} from f16 operands, {b} from the f32 kernel"
                );
            }
        }
    }
    moegrad::gpu::set_matmul_kernel(before).unwrap();
}

#[test]
fn mixed_products_run_the_f16_rows_and_f16_to_f32_builds_and_cast_no_weight() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(gpu) =
        f16_gpu("mixed_products_run_the_f16_rows_and_f16_to_f32_builds_and_cast_no_weight")
    else {
        return;
    };
    let before = moegrad::gpu::matmul_kernel().unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(43);
    // plain tiles, then wide ones; the weight's gradient walks 600 rows: split-k under auto
    for (kernel, p) in [
        (
            MatmulKernel::Auto,
            Product::random(&[600, 40], 30, false, &mut rng),
        ),
        (
            MatmulKernel::Wide,
            Product::random(&[130, 20], 70, false, &mut rng),
        ),
    ] {
        moegrad::gpu::set_matmul_kernel(kernel).unwrap();
        let ran = kernels_run(|| {
            p.run(gpu, true);
        });
        let (forward, gradient) = match kernel {
            MatmulKernel::Wide => (
                "matmul_wide_f16_rows.matmul_wide",
                "matmul_wide_f16_to_f32.matmul_wide",
            ),
            _ => ("matmul_f16_rows.matmul", "matmul_f16_to_f32.matmul"),
        };
        for kernel_name in [forward, gradient] {
            assert!(
                ran.iter().any(|k| k == kernel_name),
                "{kernel:?}: {kernel_name} did not run: {ran:?}"
            );
        }
        // the activation's casts (f32 leaf → f16, its f16 gradient → f32) and nothing else: no
        // f16 copy of the weight, no f16 product, no cast of the weight's gradient
        let f16_products: Vec<&String> = ran
            .iter()
            .filter(|k| k.starts_with("matmul_f16.") || k.starts_with("matmul_wide_f16."))
            .collect();
        assert!(f16_products.is_empty(), "{kernel:?}: ran {f16_products:?}");
        if kernel == MatmulKernel::Auto {
            assert!(
                ran.iter().any(|k| k.starts_with("reduce.")),
                "the weight's gradient was not split (no reduction ran): {ran:?}"
            );
        }
    }
    moegrad::gpu::set_matmul_kernel(before).unwrap();
    // outside a scope, f16 times f32 stays an error
    let h = Tensor::from_f32(vec![1.0; 6], &[2, 3], gpu)
        .and_then(|x| x.to_dtype(DType::F16))
        .unwrap();
    let w = Tensor::from_f32(vec![1.0; 6], &[3, 2], gpu).unwrap();
    assert!(matches!(h.matmul(&w), Err(Error::DType(_))));
}

/// `sum_as(.., F32)` of an f16 tensor, a bias's gradient in mixed precision: the f32 kernel's
/// sum of the same values to the bit and in f32, never rounded to f16 (it differs from `sum`
/// cast up where the sum needs more than f16's 11 bits), over short and long rows (both
/// reduction kernels) and two axes at once; its backward hands the upstream gradient back in
/// f16; a linear layer's bias under `autocast_f16` gets it as its gradient, from one reduction
/// and no cast; and in other dtypes it is `sum` then `to_dtype`.
#[test]
fn sum_as_f32_keeps_an_f16_tensors_f32_sum() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(gpu) = f16_gpu("sum_as_f32_keeps_an_f16_tensors_f32_sum") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(45);
    let mut differs = false;
    for (r, c, axes) in [
        (1usize, 1usize, &[0isize][..]),
        (300, 5, &[0]),
        (3, 2000, &[-1]),
        (40, 30, &[0, 1]),
    ] {
        let what = format!("sum_as over {axes:?} of [{r}, {c}]");
        let x32 = Tensor::from_f32(f16_values(r * c, &mut rng), &[r, c], gpu).unwrap();
        let x16 = x32.to_dtype(DType::F16).unwrap().with_grad().unwrap();
        let s = x16.sum_as(axes, false, DType::F32).unwrap();
        assert_eq!(s.dtype(), DType::F32, "{what}");
        let (got, want) = (
            s.to_vec_f32().unwrap(),
            x32.sum(axes, false).unwrap().to_vec_f32().unwrap(),
        );
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.to_bits(), w.to_bits(), "{what}[{i}]: {g} vs {w}");
        }
        let rounded = x16.sum(axes, false).unwrap().to_dtype(DType::F32).unwrap();
        differs |= rounded.to_vec_f32().unwrap() != got;
        // backward: the upstream gradient (f16 values) broadcast back, in f16
        let up = f16_values(got.len(), &mut rng);
        s.backward_with(&Tensor::from_f32(up.clone(), s.shape(), gpu).unwrap())
            .unwrap();
        let g = x16.grad().unwrap();
        assert_eq!(g.dtype(), DType::F16, "{what}: the gradient's dtype");
        let g = g.to_vec_f32().unwrap();
        for (i, v) in g.iter().enumerate() {
            let j = match axes {
                [0] => i % c,
                [-1] => i / c,
                _ => 0,
            };
            assert_eq!(*v, up[j], "{what}: gradient [{i}]");
        }
    }
    assert!(
        differs,
        "no case needed more than f16 for its sum: the test cannot fail"
    );

    // a linear layer's bias in mixed precision: one reduction of the f16 gradient, no cast
    let (x, w, b, up) = (
        f16_values(600 * 8, &mut rng),
        f16_values(8 * 20, &mut rng),
        f16_values(20, &mut rng),
        f16_values(600 * 20, &mut rng),
    );
    let leaf = |v: &[f32], shape: &[usize]| {
        Tensor::from_f32(v.to_vec(), shape, gpu)
            .unwrap()
            .with_grad()
            .unwrap()
    };
    let (x, w, b) = (leaf(&x, &[600, 8]), leaf(&w, &[8, 20]), leaf(&b, &[20]));
    let y = autocast_f16(|| x.matmul_bias(&w, &b).unwrap());
    assert_eq!(y.dtype(), DType::F16);
    let up16 = Tensor::from_f32(up, &[600, 20], gpu)
        .unwrap()
        .to_dtype(DType::F16)
        .unwrap();
    let ran = kernels_run(|| y.backward_with(&up16).unwrap());
    let db = b.grad().unwrap();
    assert_eq!(db.dtype(), DType::F32, "the bias's gradient");
    let want = up16.to_dtype(DType::F32).unwrap().sum(&[0], false).unwrap();
    assert_eq!(
        db.to_vec_f32().unwrap(),
        want.to_vec_f32().unwrap(),
        "the bias's gradient: the f32 sum of the f16 gradient"
    );
    let reductions = ran.iter().filter(|k| k.starts_with("reduce")).count();
    let casts: Vec<&String> = ran.iter().filter(|k| k.starts_with("half.")).collect();
    // x's gradient goes back to its f32 leaf through a cast; nothing else is cast
    assert_eq!(casts.len(), 1, "casts in the backward: {ran:?}");
    assert!(reductions >= 1, "the bias's reduction did not run: {ran:?}");

    // other dtypes: sum, then to_dtype
    let t = Tensor::from_f32(vec![0.1, 0.2, 0.3, 0.4], &[2, 2], Device::cpu()).unwrap();
    let s = t.sum_as(&[1], true, DType::F64).unwrap();
    let want = t.sum(&[1], true).unwrap().to_dtype(DType::F64).unwrap();
    assert_eq!((s.dtype(), s.shape()), (DType::F64, &[2usize, 1][..]));
    assert_eq!(s.to_vec_f64().unwrap(), want.to_vec_f64().unwrap());
}
