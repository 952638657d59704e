//! The f16 matrix products on the GPU: the f16 build of the matmul kernel (f16 operands and
//! output, f32 sums) forward and backward, on the plain and the wide kernel, and the expert bank
//! (`grouped_matmul`, `grouped_weight_grad`) in f16 and with f16 rows against f32 expert weights.
//! One of the f16 test files: the casts and the element-level kernels are checked in
//! `half_precision.rs`, the norms, SwiGLU, rotary and attention in `half_precision_nn.rs`, mixed
//! precision's f16·f32 dense products in `half_precision_products.rs`.
//!
//! * matmul in f16 against the f64 product of the same f16-rounded operands over random shapes
//!   (batched, one row, one column, widths that are not multiples of the 64-wide tiles), within
//!   the f16 output's rounding plus the f32 sum's error; its backward (the transposed layouts)
//!   through `to_dtype` against the f32 gradients within f16's tolerance;
//! * large f16 products run the wide kernel's f16 build (under `auto`, and small ones under
//!   `wide`) with the plain f16 kernel's bits;
//! * the expert bank in f16: `grouped_matmul`'s output against the f64 products of its f16
//!   operands, its backward through the casts against f32, with experts of no rows, one row and
//!   runs across the 64-row tiles;
//! * f16 rows against f32 expert weights and biases (mixed precision's expert bank) against the
//!   f32 kernel, forward and backward, the weight and bias gradients in f32 with the f32
//!   kernel's bits; mismatched devices and dtypes are errors.
//!
//! Skipped with a printed reason without an adapter unless `MOEGRAD_REQUIRE_GPU=1`; on an
//! adapter without `shader-f16` every f16 request must be an error naming it.

mod common;
#[path = "common/f16_checks.rs"]
mod f16_checks;

use f16_checks::{f16_gpu, f16_values, kernels_run};
use moegrad::{DType, Device, Error, Tensor};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// `|got − want| ≤` the f16 output's rounding (half an f16 ulp, relative 2⁻¹¹, or half the
/// smallest subnormal) plus the f32 sum's error (`k·2⁻²³·Σ|a·b|`, generous), per element.
fn assert_f16_product(what: &str, got: &[f32], want: &[f64], abs_sums: &[f64], k: usize) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, ((&g, &w), &s)) in got.iter().zip(want).zip(abs_sums).enumerate() {
        let tol = w.abs() * 2f64.powi(-11) + 2f64.powi(-25) + k as f64 * 2f64.powi(-23) * s;
        assert!(
            (g as f64 - w).abs() <= tol,
            "{what}: element {i} is {g}, the f16-rounded operands' product {w} (tolerance {tol:e})"
        );
    }
}

#[test]
fn f16_matmul_matches_the_f64_product_of_its_operands() {
    let Some(gpu) = f16_gpu("f16_matmul_matches_the_f64_product_of_its_operands") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(29);
    let mut shapes: Vec<(usize, usize, usize, usize)> = vec![
        (1, 1, 1, 1),
        (1, 1, 7, 1),
        (1, 5, 1, 3),
        (2, 65, 17, 129),
        (1, 64, 64, 64),
    ];
    shapes.extend((0..10).map(|_| {
        (
            rng.random_range(1..=3),
            rng.random_range(1..=150),
            rng.random_range(1..=90),
            rng.random_range(1..=150),
        )
    }));
    for (batch, m, k, n) in shapes {
        let a = f16_values(batch * m * k, &mut rng);
        let b = f16_values(batch * k * n, &mut rng);
        let to16 = |v: &[f32], shape: &[usize]| {
            Tensor::from_f32(v.to_vec(), shape, gpu)
                .and_then(|t| t.to_dtype(DType::F16))
                .unwrap()
        };
        let c = to16(&a, &[batch, m, k])
            .matmul(&to16(&b, &[batch, k, n]))
            .unwrap();
        assert_eq!((c.dtype(), c.shape()), (DType::F16, &[batch, m, n][..]));
        let (mut want, mut sums) = (Vec::new(), Vec::new());
        for bi in 0..batch {
            for i in 0..m {
                for j in 0..n {
                    let terms = (0..k)
                        .map(|l| a[(bi * m + i) * k + l] as f64 * b[(bi * k + l) * n + j] as f64);
                    want.push(terms.clone().sum::<f64>());
                    sums.push(terms.map(f64::abs).sum::<f64>());
                }
            }
        }
        let what = format!("[{batch}, {m}, {k}]·[{batch}, {k}, {n}]");
        assert_f16_product(&what, &c.to_vec_f32().unwrap(), &want, &sums, k);
    }
}

/// Large f16 products run the wide 128×128-tile kernel (its f16 build) under `auto`, and small
/// ones under `wide`, with the bits of the plain f16 kernel: the same f32 FMA chain, rounded
/// once to f16.
#[test]
fn large_f16_products_run_the_wide_kernel_with_the_plain_kernels_bits() {
    use moegrad::gpu::MatmulKernel;
    let Some(gpu) = f16_gpu("large_f16_products_run_the_wide_kernel_with_the_plain_kernels_bits")
    else {
        return;
    };
    let before = moegrad::gpu::matmul_kernel().unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(31);
    // 9 × 9 = 81 wide tiles: auto's choice is the wide kernel; 3 × 3 × 2: only when asked
    for ((batch, m, k, n), wide) in [
        ((1, 1030, 9, 1030), MatmulKernel::Auto),
        ((2, 300, 70, 260), MatmulKernel::Wide),
    ] {
        let to16 = |v: Vec<f32>, shape: &[usize]| {
            Tensor::from_f32(v, shape, gpu)
                .and_then(|t| t.to_dtype(DType::F16))
                .unwrap()
        };
        let a = to16(f16_values(batch * m * k, &mut rng), &[batch, m, k]);
        let b = to16(f16_values(batch * k * n, &mut rng), &[batch, k, n]);
        let run = |kernel: MatmulKernel| {
            moegrad::gpu::set_matmul_kernel(kernel).unwrap();
            let mut c = None;
            let ran = kernels_run(|| c = Some(a.matmul(&b).unwrap().to_vec_f32().unwrap()));
            (c.unwrap(), ran)
        };
        let (plain, plain_ran) = run(MatmulKernel::Plain);
        let (wide_out, wide_ran) = run(wide);
        let what = format!("[{batch}, {m}, {k}]·[{batch}, {k}, {n}] under {wide:?}");
        assert!(
            plain_ran.iter().any(|k| k == "matmul_f16.matmul"),
            "{what}: the plain run ran {plain_ran:?}"
        );
        assert!(
            wide_ran.iter().any(|k| k == "matmul_wide_f16.matmul_wide"),
            "{what}: the wide kernel did not run: {wide_ran:?}"
        );
        assert_eq!(plain.len(), wide_out.len());
        for (i, (p, w)) in plain.iter().zip(&wide_out).enumerate() {
            assert!(
                p.to_bits() == w.to_bits(),
                "{what}: element {i}: wide {w}, plain {p}"
            );
        }
    }
    moegrad::gpu::set_matmul_kernel(before).unwrap();
}

/// `op(x, w)` and the gradients for `x` and `w` of `Σ op(x, w) ⊙ up`, twice: `[f16, f32]`. The
/// f16 run casts the f32 leaves to f16, applies `op` there (checking that it gives f16) and casts
/// the result back, so its gradients come back through the casts as f32.
fn through_f16_and_f32(
    gpu: Device,
    (x, x_shape): (&[f32], &[usize]),
    (w, w_shape): (&[f32], &[usize]),
    (up, up_shape): (&[f32], &[usize]),
    op: impl Fn(&Tensor, &Tensor) -> Tensor,
) -> [[Vec<f64>; 3]; 2] {
    let run = |half: bool| {
        let leaf = |v: &[f32], shape: &[usize]| {
            Tensor::from_f32(v.to_vec(), shape, gpu)
                .unwrap()
                .with_grad()
                .unwrap()
        };
        let (x, w) = (leaf(x, x_shape), leaf(w, w_shape));
        let y = if half {
            let y16 = op(
                &x.to_dtype(DType::F16).unwrap(),
                &w.to_dtype(DType::F16).unwrap(),
            );
            assert_eq!(y16.dtype(), DType::F16, "the f16 operation's dtype");
            y16.to_dtype(DType::F32).unwrap()
        } else {
            op(&x, &w)
        };
        y.backward_with(&Tensor::from_f32(up.to_vec(), up_shape, gpu).unwrap())
            .unwrap();
        let grad = |t: &Tensor| {
            let g = t.grad().expect("a gradient");
            assert_eq!(g.dtype(), DType::F32, "the f32 leaf's gradient is f32");
            g.to_vec_f64().unwrap()
        };
        [y.to_vec_f64().unwrap(), grad(&x), grad(&w)]
    };
    [run(true), run(false)]
}

/// Every operand and upstream value being an f16 value, an f16 step differs from the f32 one only
/// by rounding its output to f16 (and the order of its f32 sums of `inner` terms).
fn assert_rounded_output(what: &str, got: &[f64], want: &[f64], inner: usize) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let tol = w.abs() * 2f64.powi(-10) + inner as f64 * 4.0 * 2f64.powi(-23) + 1e-6;
        assert!((g - w).abs() <= tol, "{what}[{i}]: f16 {g}, f32 {w}");
    }
}

#[test]
fn f16_matmul_backward_through_the_casts_matches_f32() {
    let Some(gpu) = f16_gpu("f16_matmul_backward_through_the_casts_matches_f32") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    for (m, k, n) in [(1, 1, 1), (33, 70, 5), (130, 64, 97)] {
        let (a, b) = (f16_values(m * k, &mut rng), f16_values(k * n, &mut rng));
        let up = f16_values(m * n, &mut rng);
        let [[y16, dx16, dw16], [y32, dx32, dw32]] =
            through_f16_and_f32(gpu, (&a, &[m, k]), (&b, &[k, n]), (&up, &[m, n]), |x, w| {
                x.matmul(w).unwrap()
            });
        let what = format!("[{m}, {k}]·[{k}, {n}]");
        assert_rounded_output(&format!("{what} y"), &y16, &y32, k);
        assert_rounded_output(&format!("{what} dx"), &dx16, &dx32, n);
        assert_rounded_output(&format!("{what} dw"), &dw16, &dw32, m);
    }
}

/// The rows of experts holding `counts[e]` rows each, sorted by expert: each row's expert and
/// where each expert's rows start (`n + 1` offsets), as `grouped_matmul` takes them.
fn expert_rows(counts: &[usize]) -> (Vec<i32>, Vec<i32>) {
    let experts = (0..counts.len())
        .flat_map(|e| std::iter::repeat_n(e as i32, counts[e]))
        .collect();
    let offsets = std::iter::once(0)
        .chain(counts.iter().scan(0, |acc, &c| {
            *acc += c as i32;
            Some(*acc)
        }))
        .collect();
    (experts, offsets)
}

/// [`expert_rows`] on `device`: each row's expert (also returned on the host) and the experts'
/// offsets, as the grouped ops take them.
fn expert_routing(counts: &[usize], device: Device) -> (Vec<i32>, Tensor, Tensor) {
    let (experts, offsets) = expert_rows(counts);
    let rows = experts.len();
    let row_expert = Tensor::from_i32(experts.clone(), &[rows], device).unwrap();
    let offsets = Tensor::from_i32(offsets, &[counts.len() + 1], device).unwrap();
    (experts, row_expert, offsets)
}

/// The expert banks the grouped tests run, `(rows per expert, k, m)`: one row, experts with
/// no rows, one row and 70 (a run across the 64-row tiles), and two runs past one tile.
fn bank_cases() -> [(Vec<usize>, usize, usize); 3] {
    [
        (vec![1], 1, 1),
        (vec![3, 0, 70, 1], 17, 33),
        (vec![64, 65], 64, 130),
    ]
}

/// The expert bank in f16: `grouped_matmul`'s output against the f64 products of its f16
/// operands (each row by its own expert's weights), and its backward (`grouped_matmul` with the
/// weights transposed for `dx`, `grouped_weight_grad` for `dW`) through the casts against the
/// same steps in f32: experts with no rows, one row, and runs across the 64-row tiles.
#[test]
fn f16_grouped_matmul_and_its_backward_match_f32() {
    let Some(gpu) = f16_gpu("f16_grouped_matmul_and_its_backward_match_f32") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(31);
    for (counts, k, m) in bank_cases() {
        let (n, rows) = (counts.len(), counts.iter().sum::<usize>());
        let (experts, row_expert, offsets) = expert_routing(&counts, gpu);
        let (xv, wv) = (
            f16_values(rows * k, &mut rng),
            f16_values(n * k * m, &mut rng),
        );
        let up = f16_values(rows * m, &mut rng);
        let what = format!("experts {counts:?}, k {k}, m {m}");
        let [[y16, dx16, dw16], [y32, dx32, dw32]] = through_f16_and_f32(
            gpu,
            (&xv, &[rows, k]),
            (&wv, &[n, k, m]),
            (&up, &[rows, m]),
            |x, w| x.grouped_matmul(w, &row_expert, &offsets).unwrap(),
        );
        // the forward against the exact products of the f16 operands
        let (mut want, mut sums) = (Vec::new(), Vec::new());
        for (r, &e) in experts.iter().enumerate() {
            for c in 0..m {
                let terms =
                    (0..k).map(|l| xv[r * k + l] as f64 * wv[(e as usize * k + l) * m + c] as f64);
                want.push(terms.clone().sum::<f64>());
                sums.push(terms.map(f64::abs).sum::<f64>());
            }
        }
        let y16_f32: Vec<f32> = y16.iter().map(|&v| v as f32).collect();
        assert_f16_product(&what, &y16_f32, &want, &sums, k);
        // the backward: each f16 step rounds its output once, the sums stay f32
        assert_rounded_output(&format!("{what} y"), &y16, &y32, k);
        assert_rounded_output(&format!("{what} dx"), &dx16, &dx32, m);
        assert_rounded_output(&format!("{what} dw"), &dw16, &dw32, rows);
    }
}

/// Mixed precision's expert bank: f16 rows against f32 weights and biases read where they are
/// (`grouped_matmul`'s f16-rows build, no f16 copy of the bank). The weights are arbitrary f32
/// values (not f16 ones), so this is exactly the f32 kernel's arithmetic on the same values with
/// the output rounded once: `y` and `dx` (f16) within their rounding of the f32 results, and the
/// gradients of the f32 weight and bias in f32 with the f32 kernel's bits (the weight-gradient
/// kernel's f16-to-f32 build sums in f32 and stores f32).
#[test]
fn f16_rows_with_f32_expert_weights_match_f32() {
    let Some(gpu) = f16_gpu("f16_rows_with_f32_expert_weights_match_f32") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(37);
    for (counts, k, m) in bank_cases() {
        let (n, rows) = (counts.len(), counts.iter().sum::<usize>());
        let (_, row_expert, offsets) = expert_routing(&counts, gpu);
        let xv = f16_values(rows * k, &mut rng);
        let wv: Vec<f32> = (0..n * k * m)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let bv: Vec<f32> = (0..n * m).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        let up = f16_values(rows * m, &mut rng);
        let run = |half: bool| {
            let leaf = |v: &[f32], shape: &[usize]| {
                Tensor::from_f32(v.to_vec(), shape, gpu)
                    .unwrap()
                    .with_grad()
                    .unwrap()
            };
            let (x, w, b) = (
                leaf(&xv, &[rows, k]),
                leaf(&wv, &[n, k, m]),
                leaf(&bv, &[n, m]),
            );
            let y = if half {
                let y16 = x
                    .to_dtype(DType::F16)
                    .unwrap()
                    .grouped_matmul_with_bias(&w, Some(&b), &row_expert, &offsets)
                    .unwrap();
                assert_eq!(y16.dtype(), DType::F16, "f16 rows give f16 outputs");
                y16.to_dtype(DType::F32).unwrap()
            } else {
                x.grouped_matmul_with_bias(&w, Some(&b), &row_expert, &offsets)
                    .unwrap()
            };
            y.backward_with(&Tensor::from_f32(up.clone(), &[rows, m], gpu).unwrap())
                .unwrap();
            let grad = |t: &Tensor| {
                let g = t.grad().expect("a gradient");
                assert_eq!(g.dtype(), DType::F32, "an f32 leaf's gradient is f32");
                g.to_vec_f64().unwrap()
            };
            [y.to_vec_f64().unwrap(), grad(&x), grad(&w), grad(&b)]
        };
        let ([y16, dx16, dw16, db16], [y32, dx32, dw32, db32]) = (run(true), run(false));
        let what = format!("f16 rows, f32 weights: experts {counts:?}, k {k}, m {m}");
        assert_rounded_output(&format!("{what} y"), &y16, &y32, k + 1);
        assert_rounded_output(&format!("{what} dx"), &dx16, &dx32, m);
        // the bank's and the bias's gradients are summed in f32 and stored in f32 (the
        // f16-to-f32 build): the f32 kernel's bits on the same f16-valued rows and gradient
        for (name, got, want) in [("dw", &dw16, &dw32), ("db", &db16, &db32)] {
            assert_eq!(got.len(), want.len(), "{what} {name}: length");
            for (i, (g, w)) in got.iter().zip(want).enumerate() {
                assert!(
                    g.to_bits() == w.to_bits(),
                    "{what} {name}[{i}]: {g} from f16 rows, {w} from the f32 kernel"
                );
            }
        }
    }
    // mismatched devices and dtypes are errors, not panics
    let x16 = Tensor::from_f32(vec![1.0; 2], &[1, 2], gpu)
        .unwrap()
        .to_dtype(DType::F16)
        .unwrap();
    let re = Tensor::from_i32(vec![0], &[1], gpu).unwrap();
    let off = Tensor::from_i32(vec![0, 1], &[2], gpu).unwrap();
    let w_cpu = Tensor::from_f32(vec![1.0; 2], &[1, 2, 1], Device::Cpu).unwrap();
    assert!(matches!(
        x16.grouped_matmul(&w_cpu, &re, &off),
        Err(Error::Device(_))
    ));
    let w = Tensor::from_f32(vec![1.0; 2], &[1, 2, 1], gpu).unwrap();
    let b16 = Tensor::from_f32(vec![1.0], &[1, 1], gpu)
        .unwrap()
        .to_dtype(DType::F16)
        .unwrap();
    assert!(matches!(
        x16.grouped_matmul_with_bias(&w, Some(&b16), &re, &off),
        Err(Error::DType(_))
    ));
}
