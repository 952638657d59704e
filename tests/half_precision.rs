//! f16 tensors on the GPU (`DType::F16`): the casts to and from f32, the f16 build of the matmul
//! kernel (f16 operands and output, f32 sums) forward and backward, and the errors around them.
//!
//! * casts: every value lands on one of the two f16 values around it (the one IEEE's
//!   round-to-nearest-even picks, or its neighbour: WGSL does not fix the rounding direction),
//!   exactly on values f16 holds; ±inf past the largest f16, NaN kept; back to f32 exactly;
//!   lengths of 1, odd and even (f16 buffers end on half a word);
//! * matmul in f16 against the f64 product of the same f16-rounded operands over random shapes
//!   (batched, one row, one column, widths that are not multiples of the 64-wide tiles), within
//!   the f16 output's rounding plus the f32 sum's error; its backward (the transposed layouts)
//!   through `to_dtype` against the f32 gradients within f16's tolerance;
//! * the elementwise kernels in f16 (unary, binary with broadcasting, where) compute exactly what
//!   the f32 ones compute from the same operands and round it once: each element is a
//!   neighbouring f16 of the f32 kernel's result (±inf past the largest f16);
//! * the layout copies in f16 move exactly the values the f32 ones move; reductions (sum, max,
//!   over one axis or two, cumulative sums, argmax) sum in f32 and round once;
//! * causal attention in f16 (`[B, H, T, Dh]`) against the f32 kernel on the same f16-rounded
//!   queries, keys, values and upstream gradient over random shapes (one position, head
//!   dimensions 1, odd, 32 and 64, sequences inside, at the end of and across the 64-row tiles,
//!   several batches and heads), forward and backward through `to_dtype`: within the output's
//!   f16 rounding, plus for `dq` and `dk` the rounding of the saved output carried in by the
//!   backward's `D = rowsum(dO ∘ O)`;
//! * the packed form (`[B, T, 3, H, Dh]`, one gradient) in f16 against f32 the same way;
//! * scatter_add in f16 (`Tensor::scatter_add`, `index_scatter`) sums the f16 source in f32 and
//!   rounds once: each output a neighbouring f16 of the f32 kernel's, through both kernels (the
//!   per-output loop over few source rows, the sorted index over more than 4096), with repeated
//!   indices and outputs nothing hits;
//! * the backward of `index_select` (on both scatter kernels) and of `gather` in f16, a
//!   scatter_add of the gradient, through the casts: a neighbouring f16 of the f32 gradient;
//! * cross-entropy on f16 logits: the f32 kernel's loss exactly, the gradient rounded once;
//! * f16 rows against f32 expert weights and biases (mixed precision's expert bank) against the
//!   f32 kernel, forward and backward, the weight and bias gradients in f32 with the f32
//!   kernel's bits;
//! * errors, not panics or validation failures: an f16 tensor on the CPU, an op that has no f16
//!   kernel, a product of an f16 and an f32 operand.
//!
//! Skipped with a printed reason without an adapter unless `MOEGRAD_REQUIRE_GPU=1`; on an
//! adapter without `shader-f16` every f16 request must be an error naming it.

mod common;
#[path = "common/f16_checks.rs"]
mod f16_checks;

use f16_checks::{assert_rounded_once, f16_gpu, f16_values, kernels_run};
use half::f16;
use moegrad::{DType, Device, Error, Tensor};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

#[test]
fn casts_round_to_a_neighbouring_f16_and_return_exactly() {
    let Some(gpu) = f16_gpu("casts_round_to_a_neighbouring_f16_and_return_exactly") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let mut values: Vec<f32> = vec![
        0.0,
        -0.0,
        1.0,
        -2.5,
        65504.0,   // the largest f16
        65519.0,   // rounds down to it
        65520.0,   // rounds past it: inf
        -1.0e6,    // -inf
        6.0e-8,    // about the smallest subnormal
        1.0e-9,    // below half of it: 0
        3.0e-5,    // a subnormal
        1.0 / 3.0, // not representable
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
    ];
    // every binade f16 covers, and beyond
    values.extend((0..4000).map(|_| {
        let e = rng.random_range(-30.0f32..18.0);
        let s = if rng.random_bool(0.5) { -1.0 } else { 1.0 };
        s * rng.random_range(1.0f32..2.0) * e.exp2()
    }));
    for len in [1, 2, 7, values.len()] {
        let x = &values[..len];
        let t = Tensor::from_f32(x.to_vec(), &[len], gpu).unwrap();
        let h = t.to_dtype(DType::F16).unwrap();
        assert_eq!(h.dtype(), DType::F16);
        let read = h.to_vec_f32().unwrap();
        let back = h.to_dtype(DType::F32).unwrap().to_vec_f32().unwrap();
        for (i, (&got, &b)) in read.iter().zip(&back).enumerate() {
            assert!(
                got.to_bits() == b.to_bits() || (got.is_nan() && b.is_nan()),
                "element {i}: read back {got}, cast back {b}"
            );
        }
        assert_rounded_once(&format!("the cast of {len} values"), &read, x);
    }
}

#[test]
fn full_and_zeros_in_f16() {
    let Some(gpu) = f16_gpu("full_and_zeros_in_f16") else {
        return;
    };
    for len in [1usize, 2, 5, 1000] {
        let z = Tensor::zeros(&[len], DType::F16, gpu).unwrap();
        assert_eq!(z.to_vec_f32().unwrap(), vec![0.0; len]);
        let f = Tensor::full(&[len], -1.5, DType::F16, gpu).unwrap();
        assert_eq!(f.to_vec_f32().unwrap(), vec![-1.5; len]);
        let third = Tensor::full(&[len], 1.0 / 3.0, DType::F16, gpu).unwrap();
        let want = f16::from_f64(1.0 / 3.0).to_f32();
        assert_eq!(third.to_vec_f32().unwrap(), vec![want; len]);
    }
}

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
/// gradients of the f32 weight and bias back in f32 within one f16 rounding (the weight-gradient
/// kernel sums in f32 and stores f16, then the cast widens).
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

/// Layer norm and RMSNorm in f16: the forward output and the three gradients (`dx`, `dγ`, `dβ`)
/// of the f16 build are each a neighbouring f16 of the f32 kernel's result on the same
/// f16-valued operands (the same f32 arithmetic, rounded once), over rows and widths on both
/// sides of the kernels' 64-wide and 8-column blocks. With f16 rows and f32 parameters (the
/// f16-rows build, mixed precision's norms) `y` and `dx` are the same rounding of the f32
/// result, and `dγ`, `dβ` come back in f32 with the f32 kernel's bits.
#[test]
fn f16_layer_norm_and_rms_norm_round_the_f32_result_once() {
    let Some(gpu) = f16_gpu("f16_layer_norm_and_rms_norm_round_the_f32_result_once") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(37);
    for (rows, dim) in [(1, 1), (3, 7), (70, 65), (5, 200), (130, 9)] {
        let x = f16_values(rows * dim, &mut rng);
        let (gamma, beta) = (f16_values(dim, &mut rng), f16_values(dim, &mut rng));
        let up = f16_values(rows * dim, &mut rng);
        for centered in [true, false] {
            let run = |dtype: DType, param_dtype: DType| {
                let leaf = |v: &[f32], shape: &[usize], dtype: DType| {
                    Tensor::from_f32(v.to_vec(), shape, gpu)
                        .and_then(|t| t.to_dtype(dtype))
                        .unwrap()
                        .with_grad()
                        .unwrap()
                };
                let (xt, gt, bt) = (
                    leaf(&x, &[rows, dim], dtype),
                    leaf(&gamma, &[dim], param_dtype),
                    leaf(&beta, &[dim], param_dtype),
                );
                let y = if centered {
                    xt.layer_norm(&gt, &bt, 1e-5).unwrap()
                } else {
                    xt.rms_norm(&gt, 1e-5).unwrap()
                };
                assert_eq!(y.dtype(), dtype);
                let g = Tensor::from_f32(up.clone(), &[rows, dim], gpu)
                    .and_then(|t| t.to_dtype(dtype))
                    .unwrap();
                y.backward_with(&g).unwrap();
                let f32s = |t: &Tensor| t.to_vec_f32().unwrap();
                let dgamma = gt.grad().unwrap();
                assert_eq!(
                    dgamma.dtype(),
                    param_dtype,
                    "dgamma in the parameter's dtype"
                );
                let mut out = vec![f32s(&y), f32s(&xt.grad().unwrap()), f32s(&dgamma)];
                if centered {
                    out.push(f32s(&bt.grad().unwrap()));
                }
                out
            };
            let single = run(DType::F32, DType::F32);
            let half = run(DType::F16, DType::F16);
            let rows_only = run(DType::F16, DType::F32);
            let norm = if centered { "layer_norm" } else { "rms_norm" };
            for (i, name) in ["y", "dx", "dgamma", "dbeta"]
                .iter()
                .enumerate()
                .take(half.len())
            {
                let what = format!("{norm} [{rows}, {dim}] {name}");
                assert_rounded_once(&what, &half[i], &single[i]);
                if i < 2 {
                    assert_rounded_once(
                        &format!("{what}, f32 parameters"),
                        &rows_only[i],
                        &single[i],
                    );
                } else {
                    assert_eq!(rows_only[i], single[i], "{what}, f32 parameters");
                }
            }
        }
    }
}

/// The fused SwiGLU in f16: its output and input gradient are each a neighbouring f16 of the
/// f32 kernel's on the same f16-valued operands, over widths on both sides of a workgroup and
/// gate values large enough for σ to saturate.
#[test]
fn f16_swiglu_rounds_the_f32_result_once() {
    let Some(gpu) = f16_gpu("f16_swiglu_rounds_the_f32_result_once") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(41);
    for (rows, half) in [(1, 1), (3, 5), (9, 300)] {
        let mut x = f16_values(rows * 2 * half, &mut rng);
        x[0] = -30.0; // σ(−30) ≈ 1e-13: the gate's output underflows f16
        let up = f16_values(rows * half, &mut rng);
        let run = |dtype: DType| {
            let xt = Tensor::from_f32(x.clone(), &[rows, 2 * half], gpu)
                .and_then(|t| t.to_dtype(dtype))
                .unwrap()
                .with_grad()
                .unwrap();
            let y = xt.swiglu().unwrap();
            assert_eq!(y.dtype(), dtype);
            let g = Tensor::from_f32(up.clone(), &[rows, half], gpu)
                .and_then(|t| t.to_dtype(dtype))
                .unwrap();
            y.backward_with(&g).unwrap();
            [
                y.to_vec_f32().unwrap(),
                xt.grad().unwrap().to_vec_f32().unwrap(),
            ]
        };
        let ([y16, dx16], [y32, dx32]) = (run(DType::F16), run(DType::F32));
        assert_rounded_once(&format!("swiglu [{rows}, {half}] y"), &y16, &y32);
        assert_rounded_once(&format!("swiglu [{rows}, {half}] dx"), &dx16, &dx32);
    }
}

/// The rotary embedding in f16 (`nn::Rotary` casts its tables to the input's dtype): output and
/// input gradient against the f32 path, within the rounding of the tables and of the output
/// (the tables' cos and sin are rounded to f16 too, so this is not one rounding of the f32
/// result).
#[test]
fn f16_rotary_matches_f32_within_the_tables_rounding() {
    let Some(gpu) = f16_gpu("f16_rotary_matches_f32_within_the_tables_rounding") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(43);
    for (batch, seq, dh) in [(1, 1, 2), (2, 5, 8), (3, 64, 32)] {
        let rope = moegrad::nn::Rotary::new(dh, 64, 1e4, gpu).unwrap();
        let x = f16_values(batch * seq * dh, &mut rng);
        let up = f16_values(batch * seq * dh, &mut rng);
        let run = |dtype: DType| {
            let xt = Tensor::from_f32(x.clone(), &[batch, seq, dh], gpu)
                .and_then(|t| t.to_dtype(dtype))
                .unwrap()
                .with_grad()
                .unwrap();
            let y = rope.apply(&xt).unwrap();
            assert_eq!(y.dtype(), dtype);
            let g = Tensor::from_f32(up.clone(), &[batch, seq, dh], gpu)
                .and_then(|t| t.to_dtype(dtype))
                .unwrap();
            y.backward_with(&g).unwrap();
            [
                y.to_vec_f64().unwrap(),
                xt.grad().unwrap().to_vec_f64().unwrap(),
            ]
        };
        let ([y16, dx16], [y32, dx32]) = (run(DType::F16), run(DType::F32));
        // each output mixes two inputs (|v| ≤ 2) through cos and sin (each within 2⁻¹¹ relative
        // of their f32 values), then rounds once (2⁻¹¹ relative)
        for (name, got, want) in [("y", &y16, &y32), ("dx", &dx16, &dx32)] {
            for (i, (&g, &w)) in got.iter().zip(want.iter()).enumerate() {
                let tol = 2.0 * 2.0 * 2f64.powi(-11) + w.abs() * 2f64.powi(-11) + 1e-7;
                assert!(
                    (g - w).abs() <= tol,
                    "rotary [{batch}, {seq}, {dh}] {name}[{i}]: f16 {g}, f32 {w}"
                );
            }
        }
    }
}

/// Causal attention on queries, keys and values `[B, H, T, Dh]` given as one f32 buffer `qkv`
/// (`q`, then `k`, then `v`), as f32 leaves: the output and the gradients `dq`, `dk`, `dv` of
/// `Σ y ⊙ up`, twice: `[f16, f32]`. The f16 run casts the leaves to f16, attends there (checking
/// the output is f16) and casts the output back, so its gradients come back through the casts as
/// f32. `packed` attends with `causal_attention_packed` on one `[B, T, 3, H, Dh]` leaf instead
/// of three (its output and gradient read back in the separate op's order).
fn attention_f16_and_f32(
    gpu: Device,
    dims: [usize; 4],
    qkv: &[f32],
    up: &[f32],
    packed: bool,
) -> [[Vec<f64>; 4]; 2] {
    let n = dims.iter().product::<usize>();
    let run = |half: bool| {
        let leaf = |v: &[f32], shape: &[usize]| {
            Tensor::from_f32(v.to_vec(), shape, gpu)
                .unwrap()
                .with_grad()
                .unwrap()
        };
        let cast = |t: &Tensor| match half {
            true => t.to_dtype(DType::F16).unwrap(),
            false => t.clone(),
        };
        let (y, leaves) = if packed {
            // [3, B, H, T, Dh] → [B, T, 3, H, Dh], the layout the packed op takes
            let per_position = Tensor::from_f32(
                qkv.to_vec(),
                &[[3].as_slice(), &dims].concat(),
                Device::cpu(),
            )
            .and_then(|t| t.permute(&[1, 3, 0, 2, 4]))
            .and_then(|t| t.to_vec_f32())
            .unwrap();
            let [b, h, t, dh] = dims;
            let x = leaf(&per_position, &[b, t, 3, h, dh]);
            let y = cast(&x).causal_attention_packed().unwrap();
            // [B, T, H, Dh] → [B, H, T, Dh], the separate op's order
            (y.permute(&[0, 2, 1, 3]).unwrap(), vec![x])
        } else {
            let [q, k, v] = [0, 1, 2].map(|i| leaf(&qkv[i * n..(i + 1) * n], &dims));
            let y = cast(&q).causal_attention(&cast(&k), &cast(&v)).unwrap();
            (y, vec![q, k, v])
        };
        let want = if half { DType::F16 } else { DType::F32 };
        assert_eq!(y.dtype(), want, "the attention's dtype");
        let y = if half {
            y.to_dtype(DType::F32).unwrap()
        } else {
            y
        };
        y.backward_with(&Tensor::from_f32(up.to_vec(), &dims, gpu).unwrap())
            .unwrap();
        // dq, dk, dv one after the other, from three leaves or from the packed one
        let grads: Vec<f64> = leaves
            .iter()
            .flat_map(|l| {
                let g = l.grad().expect("a gradient");
                assert_eq!(g.dtype(), DType::F32, "the f32 leaf's gradient is f32");
                let g = if packed {
                    g.permute(&[2, 0, 3, 1, 4]).unwrap() // [3, B, H, T, Dh]
                } else {
                    g
                };
                g.to_vec_f64().unwrap()
            })
            .collect();
        let part = |i: usize| grads[i * n..(i + 1) * n].to_vec();
        [y.to_vec_f64().unwrap(), part(0), part(1), part(2)]
    };
    [run(true), run(false)]
}

/// `|got − want| ≤ 2⁻¹⁰·(|want| + extra) + extra + inner·4·2⁻²³ + 10⁻⁶` per element: the
/// rounding of the f16 output (as in [`assert_rounded_output`]) of a value that may differ from
/// the f32 kernel's by up to `extra` (an error the f16 run carries in from an earlier rounding).
fn assert_rounded_output_within(
    what: &str,
    got: &[f64],
    want: &[f64],
    inner: usize,
    extra: &[f64],
) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, ((&g, &w), &e)) in got.iter().zip(want).zip(extra).enumerate() {
        let tol = (w.abs() + e) * 2f64.powi(-10) + e + inner as f64 * 4.0 * 2f64.powi(-23) + 1e-6;
        assert!(
            (g - w).abs() <= tol,
            "{what}[{i}]: f16 {g}, f32 {w} (tolerance {tol:e}, of which {e:e} carried in)"
        );
    }
}

/// Checks causal attention in f16 against the f32 kernel on the same f16-valued `q`, `k`, `v`
/// and upstream gradient (both builds run the same f32 operations in the same order; the f16
/// build reads f16 and rounds each output once):
///
/// * `y` and `dv` differ only by that rounding: one f16 ulp, 2⁻¹⁰ relative (WGSL does not fix
///   the rounding direction, so either neighbour, not half an ulp), and near zero, where the
///   relative bound vanishes, f16's subnormal spacing 2⁻²⁴ and the f32 sums' rounding over the
///   `T` keys or queries (`T·4·2⁻²³ + 10⁻⁶`, as [`assert_rounded_output`] allows);
/// * `dq` and `dk` also carry the rounding of the saved output: the backward's
///   `D_i = Σ_c dO_ic·O_ic` reads the f16 `O`, so it is off by `Δ_i = Σ_c dO_ic·(O16 − O32)_ic`
///   (computed here from the two outputs, plus `2·Dh·2⁻²⁴·Σ_c |dO_ic·O_ic|` for the two f32
///   sums), and `dS_ij = P_ij·(dP_ij − D_i)` passes it on: `dq_i` is off by
///   `Δ_i·Σ_j P_ij·k_j/√Dh`, `dk_j` by `Σ_i P_ij·Δ_i·q_i/√Dh`, bounded with `|·|` and `P`
///   recomputed here in f64.
fn check_f16_attention(gpu: Device, dims: [usize; 4], packed: bool, rng: &mut ChaCha8Rng) {
    let [b, h, t, dh] = dims;
    let n = b * h * t * dh;
    let (qkv, up) = (f16_values(3 * n, rng), f16_values(n, rng));
    let [[y16, dq16, dk16, dv16], [y32, dq32, dk32, dv32]] =
        attention_f16_and_f32(gpu, dims, &qkv, &up, packed);
    let (q, k) = (&qkv[..n], &qkv[n..2 * n]);
    let scale = 1.0 / (dh as f64).sqrt();
    let (mut extra_q, mut extra_k) = (vec![0.0; n], vec![0.0; n]);
    for head in 0..b * h {
        let at = |row: usize, c: usize| (head * t + row) * dh + c;
        // the error of each row's D, then P row by row (softmax of the visible scores)
        let delta_err: Vec<f64> = (0..t)
            .map(|i| {
                let (mut d, mut mag) = (0.0, 0.0);
                for c in 0..dh {
                    d += up[at(i, c)] as f64 * (y16[at(i, c)] - y32[at(i, c)]);
                    mag += (up[at(i, c)] as f64 * y32[at(i, c)]).abs();
                }
                d.abs() + 2.0 * dh as f64 * 2f64.powi(-24) * mag
            })
            .collect();
        for i in 0..t {
            let scores: Vec<f64> = (0..=i)
                .map(|j| {
                    let dot = (0..dh).map(|c| q[at(i, c)] as f64 * k[at(j, c)] as f64);
                    dot.sum::<f64>() * scale
                })
                .collect();
            let top = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let total: f64 = scores.iter().map(|s| (s - top).exp()).sum();
            for (j, s) in scores.iter().enumerate() {
                let p = (s - top).exp() / total;
                for c in 0..dh {
                    extra_q[at(i, c)] += p * delta_err[i] * (k[at(j, c)] as f64).abs() * scale;
                    extra_k[at(j, c)] += p * delta_err[i] * (q[at(i, c)] as f64).abs() * scale;
                }
            }
        }
    }
    let what = format!("{}attention {dims:?}", if packed { "packed " } else { "" });
    let none = vec![0.0; n];
    for (name, got, want, extra) in [
        ("y", &y16, &y32, &none),
        ("dq", &dq16, &dq32, &extra_q),
        ("dk", &dk16, &dk32, &extra_k),
        ("dv", &dv16, &dv32, &none),
    ] {
        assert_rounded_output_within(&format!("{what} {name}"), got, want, t, extra);
    }
}

/// Causal attention in f16 (`[B, H, T, Dh]` queries, keys and values): output and gradients
/// against the f32 kernel on the same f16-valued operands (see [`check_f16_attention`] for the
/// tolerance), over one position, head dimensions 1, odd, 32 and 64, sequences that fill one
/// 64-row tile exactly, end inside one, and span three, several heads and batches, and random
/// shapes.
#[test]
fn f16_causal_attention_and_its_backward_match_f32() {
    let Some(gpu) = f16_gpu("f16_causal_attention_and_its_backward_match_f32") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(47);
    let mut shapes = vec![
        [1, 1, 1, 1],
        [1, 1, 1, 64],
        [2, 1, 5, 7],
        [1, 3, 70, 32],
        [1, 2, 64, 1],
        [2, 1, 130, 64],
    ];
    shapes.extend((0..4).map(|_| {
        [
            rng.random_range(1..=2),
            rng.random_range(1..=3),
            rng.random_range(1..=150),
            rng.random_range(1..=64),
        ]
    }));
    for dims in shapes {
        check_f16_attention(gpu, dims, false, &mut rng);
    }
}

/// The packed form (`[B, T, 3, H, Dh]`, one leaf whose gradient packs `dq`, `dk`, `dv`) in f16
/// against f32, as [`f16_causal_attention_and_its_backward_match_f32`].
#[test]
fn f16_packed_causal_attention_matches_f32() {
    let Some(gpu) = f16_gpu("f16_packed_causal_attention_matches_f32") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(53);
    for dims in [[1, 1, 1, 1], [2, 2, 67, 7], [1, 1, 129, 64]] {
        check_f16_attention(gpu, dims, true, &mut rng);
    }
}

#[test]
fn f16_requests_that_cannot_run_are_errors() {
    // the CPU has no f16 buffers
    let cpu = Tensor::from_f32(vec![1.0, 2.0], &[2], Device::cpu()).unwrap();
    match cpu.to_dtype(DType::F16) {
        Err(Error::DType(m)) => assert!(m.contains("f16 tensors live on the GPU"), "{m}"),
        other => panic!("f16 on the CPU gave {other:?}"),
    }
    assert!(matches!(
        Tensor::zeros(&[3], DType::F16, Device::cpu()),
        Err(Error::DType(_))
    ));
    let Some(gpu) = f16_gpu("f16_requests_that_cannot_run_are_errors") else {
        return;
    };
    let x = Tensor::from_f32(vec![1.0; 6], &[2, 3], gpu).unwrap();
    let h = x.to_dtype(DType::F16).unwrap();
    // an op without an f16 kernel names it and says what to do
    match h.argsort(false) {
        Err(Error::DType(m)) => {
            assert!(m.contains("no f16 kernel") && m.contains("to_dtype"), "{m}")
        }
        other => panic!("an f16 argsort gave {other:?}"),
    }
    // RMSNorm of f32 rows cannot take an f16 weight (f16 rows may take an f32 one)
    let weight = Tensor::from_f32(vec![1.0; 3], &[3], gpu)
        .and_then(|w| w.to_dtype(DType::F16))
        .unwrap();
    match x.rms_norm(&weight, 1e-6) {
        Err(Error::DType(m)) => assert!(m.contains("f16") && m.contains("f32"), "{m}"),
        other => panic!("an f32 RMSNorm with an f16 weight gave {other:?}"),
    }
    // f16 times f32
    let w = Tensor::from_f32(vec![1.0; 6], &[3, 2], gpu).unwrap();
    match h.matmul(&w) {
        Err(Error::DType(m)) => assert!(m.contains("f16") && m.contains("f32"), "{m}"),
        other => panic!("an f16·f32 product gave {other:?}"),
    }
    // the device still works afterwards
    assert_eq!(h.to_vec_f32().unwrap(), vec![1.0; 6]);
}

#[test]
fn f16_elementwise_rounds_the_f32_result_once() {
    let Some(gpu) = f16_gpu("f16_elementwise_rounds_the_f32_result_once") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(17);
    for _ in 0..6 {
        let (r, c) = (rng.random_range(1..=40), rng.random_range(1..=300));
        let a = f16_values(r * c, &mut rng);
        let b = f16_values(c, &mut rng);
        let mask: Vec<f32> = (0..r * c)
            .map(|_| f32::from(rng.random_bool(0.5)))
            .collect();
        let up = |v: &[f32], shape: &[usize]| Tensor::from_f32(v.to_vec(), shape, gpu).unwrap();
        let (a32, b32, m32) = (up(&a, &[r, c]), up(&b, &[c]), up(&mask, &[r, c]));
        let half = |t: &Tensor| t.to_dtype(DType::F16).unwrap();
        let (a16, b16, m16) = (half(&a32), half(&b32), half(&m32));
        type Op = fn(&Tensor, &Tensor, &Tensor) -> moegrad::Result<Tensor>;
        let ops: [(&str, Op); 10] = [
            ("exp", |a, _, _| a.exp()),
            ("neg", |a, _, _| a.neg()),
            ("gelu", |a, _, _| a.gelu()),
            ("relu", |a, _, _| a.relu()),
            ("mul_scalar 3e4 (overflows f16)", |a, _, _| {
                a.mul_scalar(3e4)
            }),
            ("a + b (b broadcast)", |a, b, _| a.add(b)),
            ("a · b", |a, b, _| a.mul(b)),
            ("a / b", |a, b, _| a.div(b)),
            ("a < b", |a, b, _| a.lt(b)),
            ("where(mask, a, b)", |a, b, m| Tensor::where_cond(m, a, b)),
        ];
        for (name, op) in ops {
            let y16 = op(&a16, &b16, &m16).unwrap();
            assert_eq!(y16.dtype(), DType::F16, "{name}");
            let y32 = op(&a32, &b32, &m32).unwrap();
            let what = format!("{name} on [{r}, {c}]");
            assert_rounded_once(
                &what,
                &y16.to_vec_f32().unwrap(),
                &y32.to_vec_f32().unwrap(),
            );
        }
    }
}

#[test]
fn f16_layout_ops_move_values_exactly() {
    let Some(gpu) = f16_gpu("f16_layout_ops_move_values_exactly") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(23);
    for (a, b, c) in [(1, 1, 1), (3, 5, 7), (4, 33, 9)] {
        let v = f16_values(a * b * c, &mut rng);
        let x32 = Tensor::from_f32(v.clone(), &[a, b, c], gpu).unwrap();
        let x16 = x32.to_dtype(DType::F16).unwrap();
        let idx: Vec<i32> = (0..2 * b).map(|_| rng.random_range(0..b as i32)).collect();
        let idx = Tensor::from_i32(idx, &[2 * b], gpu).unwrap();
        type Op = fn(&Tensor, &Tensor) -> moegrad::Result<Tensor>;
        let ops: [(&str, Op); 5] = [
            ("permute", |x, _| x.permute(&[2, 0, 1])),
            ("transpose", |x, _| x.transpose(0, 1)),
            ("slice", |x, _| x.slice(1, 1, x.shape()[1])),
            ("concat", |x, _| Tensor::concat(&[x.clone(), x.clone()], 1)),
            ("index_select", |x, i| x.index_select(1, i)),
        ];
        for (name, op) in ops {
            let y16 = op(&x16, &idx).unwrap();
            assert_eq!(y16.dtype(), DType::F16, "{name}");
            // the values are f16 values: moving them in f16 or in f32 gives the same numbers
            let y32 = op(&x32, &idx).unwrap();
            assert_eq!(
                y16.to_vec_f32().unwrap(),
                y32.to_vec_f32().unwrap(),
                "{name} of [{a}, {b}, {c}]"
            );
        }
    }
}

#[test]
fn f16_reductions_sum_in_f32_and_round_once() {
    let Some(gpu) = f16_gpu("f16_reductions_sum_in_f32_and_round_once") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(31);
    // rows short and long (the one-invocation and the one-workgroup-per-row kernels)
    for (r, c) in [(1, 1), (3, 7), (5, 300), (2, 2000)] {
        let v = f16_values(r * c, &mut rng);
        let x32 = Tensor::from_f32(v.clone(), &[r, c], gpu).unwrap();
        let x16 = x32.to_dtype(DType::F16).unwrap();
        type Op = fn(&Tensor) -> moegrad::Result<Tensor>;
        let ops: [(&str, Op); 5] = [
            ("sum(-1)", |x| x.sum(&[-1], false)),
            ("sum(0)", |x| x.sum(&[0], false)),
            ("max(-1)", |x| x.max(-1, false)),
            ("sum over both axes", |x| x.sum(&[0, 1], false)),
            ("cumsum(-1)", |x| x.cumsum(-1)),
        ];
        for (name, op) in ops {
            let y16 = op(&x16).unwrap();
            assert_eq!(y16.dtype(), DType::F16, "{name}");
            let y32 = op(&x32).unwrap();
            let what = format!("{name} of [{r}, {c}]");
            assert_rounded_once(
                &what,
                &y16.to_vec_f32().unwrap(),
                &y32.to_vec_f32().unwrap(),
            );
        }
        let am16 = x16.argmax(-1, false).unwrap();
        assert_eq!(am16.dtype(), DType::I32);
        assert_eq!(
            am16.to_vec_f64().unwrap(),
            x32.argmax(-1, false).unwrap().to_vec_f64().unwrap(),
            "argmax of [{r}, {c}]"
        );
    }
}

/// An I32 index of `shape` on the GPU, random in `0..hit` (with `hit` below the output length,
/// the last outputs get no source value).
fn random_index(shape: &[usize], hit: usize, gpu: Device, rng: &mut ChaCha8Rng) -> Tensor {
    let n = shape.iter().product();
    let v = (0..n).map(|_| rng.random_range(0..hit as i32)).collect();
    Tensor::from_i32(v, shape, gpu).unwrap()
}

/// scatter_add in f16 adds the f16 source in f32, in the f32 kernel's order, and rounds once:
/// every output is a neighbouring f16 of the f32 kernel's sum of the same f16-valued source.
/// The three kernels of the launcher (`layout::scatter_kernel`), with repeated indices and
/// outputs no index hits: `scatter_add_loop` (at most 32 source rows), `scatter_add_wide`
/// (small work, many hits per output, or an index that varies along the inner axis) and
/// `scatter_add_sorted` (one index per source row, outputs × rows past 2^24 and few hits per
/// output), through `Tensor::scatter_add` and `index_scatter`.
#[test]
fn f16_scatter_add_rounds_the_f32_sum_once() {
    let Some(gpu) = f16_gpu("f16_scatter_add_rounds_the_f32_sum_once") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(59);
    // the source in f16 and in f32
    let both = |v: &[f32], shape: &[usize]| {
        let t = Tensor::from_f32(v.to_vec(), shape, gpu).unwrap();
        [t.to_dtype(DType::F16).unwrap(), t]
    };
    // `Tensor::scatter_add` into zeros: (source and index shape, axis, output length on it);
    // the index has the source's shape, so its inner stride is 0 only when inner is 1
    for (shape, axis, len) in [
        (vec![20, 7], 0, 5), // loop: 20 rows (the index varies along the inner axis)
        (vec![3, 30], 1, 4), // loop: 30 rows each of 3 outer slices
        (vec![40, 7], 0, 5), // wide: the index varies along the inner axis
        (vec![5000], 0, 37), // wide: 5000 rows of one element, ~135 hits per output
    ] {
        let n: usize = shape.iter().product();
        let src = f16_values(n, &mut rng);
        let idx = random_index(&shape, len - 1, gpu, &mut rng);
        let mut out_shape = shape.clone();
        out_shape[axis] = len;
        let [y16, y32] = both(&src, &shape).map(|s| {
            Tensor::zeros(&out_shape, s.dtype(), gpu)
                .unwrap()
                .scatter_add(axis as isize, &idx, &s)
                .unwrap()
        });
        assert_eq!(y16.dtype(), DType::F16);
        assert_rounded_once(
            &format!("scatter_add of {shape:?} along {axis} into {len}"),
            &y16.to_vec_f32().unwrap(),
            &y32.to_vec_f32().unwrap(),
        );
    }
    // `index_scatter`: one index per source row (source shape, axis, output length on it)
    for (shape, axis, len) in [
        (vec![9, 3], 0, 4),          // loop: 9 rows
        (vec![4200, 3], 0, 50),      // wide: 4200 rows of 3
        (vec![5000, 4], 0, 1000),    // sorted: 5 hits per output of 4000
        (vec![2, 4100, 2], 1, 3000), // sorted: 2 outer slices sharing one sorted index
    ] {
        let n: usize = shape.iter().product();
        let src = f16_values(n, &mut rng);
        let idx = random_index(&[shape[axis]], len - 1, gpu, &mut rng);
        let [y16, y32] =
            both(&src, &shape).map(|s| s.index_scatter(axis as isize, &idx, len).unwrap());
        assert_eq!(y16.dtype(), DType::F16);
        assert_rounded_once(
            &format!("index_scatter of {shape:?} along {axis} into {len}"),
            &y16.to_vec_f32().unwrap(),
            &y32.to_vec_f32().unwrap(),
        );
    }
}

/// The backward of `index_select` (and of `gather`) in f16 is a scatter_add of the f16 upstream
/// gradient: through the casts, the gradient of the f32 leaf is a neighbouring f16 of the f32
/// run's, for a few picked rows (`scatter_add_loop`), for 4500 picks of 40 rows (many hits
/// each: `scatter_add_wide`, also the gather's, whose index varies along the inner axis) and
/// 5000 picks of 3000 rows (`scatter_add_sorted`), rows picked many times and rows never picked.
#[test]
fn f16_index_select_and_gather_backward_round_the_f32_gradient_once() {
    let Some(gpu) = f16_gpu("f16_index_select_and_gather_backward_round_the_f32_gradient_once")
    else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(61);
    // x [len, cols] picked along axis 0: (len, cols, picks)
    for (len, cols, picks) in [(6, 5, 20), (40, 3, 4500), (3000, 4, 5000)] {
        let x = f16_values(len * cols, &mut rng);
        let upstream = f16_values(picks * cols, &mut rng);
        let selected = random_index(&[picks], len - 1, gpu, &mut rng);
        // gather along axis 0 with an index of the output's shape (inner stride 1: the loop)
        let gathered = random_index(&[picks, cols], len - 1, gpu, &mut rng);
        type Op = fn(&Tensor, &Tensor) -> Tensor;
        let ops: [(&str, &Tensor, Op); 2] = [
            ("index_select", &selected, |x, i| {
                x.index_select(0, i).unwrap()
            }),
            ("gather", &gathered, |x, i| x.gather(0, i).unwrap()),
        ];
        for (name, idx, op) in ops {
            let grad = |half: bool| {
                let leaf = Tensor::from_f32(x.clone(), &[len, cols], gpu)
                    .unwrap()
                    .with_grad()
                    .unwrap();
                let y = if half {
                    let y16 = op(&leaf.to_dtype(DType::F16).unwrap(), idx);
                    assert_eq!(y16.dtype(), DType::F16, "{name}");
                    y16.to_dtype(DType::F32).unwrap()
                } else {
                    op(&leaf, idx)
                };
                let g = Tensor::from_f32(upstream.clone(), &[picks, cols], gpu).unwrap();
                y.backward_with(&g).unwrap();
                leaf.grad().expect("a gradient").to_vec_f32().unwrap()
            };
            assert_rounded_once(
                &format!("the gradient of {name} of {picks} rows of [{len}, {cols}]"),
                &grad(true),
                &grad(false),
            );
        }
    }
}

/// The softmax cross-entropy on f16 logits (mixed precision's, read without an f32 copy):
/// the per-row loss and log-sum-exp are f32 and the arithmetic is the f32 kernel's on the same
/// values, so the loss equals the f32 kernel's on the f16-valued logits exactly; the logits'
/// gradient is f16, each element a neighbouring f16 of the f32 kernel's. Rows of 1, 63, 64 and
/// 65 classes (the forward's 64-wide workgroup), a large vocabulary, and a target outside the
/// classes (loss 0, zero gradient, as in f32).
#[test]
fn f16_cross_entropy_matches_f32_on_the_same_logits() {
    let Some(gpu) = f16_gpu("f16_cross_entropy_matches_f32_on_the_same_logits") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(53);
    for (rows, classes) in [(1usize, 1usize), (3, 63), (5, 64), (4, 65), (7, 1000)] {
        let logits: Vec<f32> = f16_values(rows * classes, &mut rng)
            .into_iter()
            .map(|v| v * 4.0)
            .collect();
        let mut targets: Vec<i32> = (0..rows)
            .map(|_| rng.random_range(0..classes) as i32)
            .collect();
        if rows > 1 {
            targets[rows - 1] = classes as i32; // outside: contributes nothing
        }
        let t = Tensor::from_i32(targets, &[rows], gpu).unwrap();
        let up: Vec<f32> = (0..rows).map(|r| 0.5 + r as f32 * 0.25).collect();
        let run = |half: bool| {
            let x = Tensor::from_f32(logits.clone(), &[rows, classes], gpu).unwrap();
            let x = if half {
                x.to_dtype(DType::F16).unwrap()
            } else {
                x
            }
            .with_grad()
            .unwrap();
            let loss = x.cross_entropy_per_row(&t).unwrap();
            assert_eq!(loss.dtype(), DType::F32, "the loss is f32 either way");
            loss.backward_with(&Tensor::from_f32(up.clone(), &[rows], gpu).unwrap())
                .unwrap();
            let g = x.grad().expect("the logits' gradient");
            assert_eq!(g.dtype(), x.dtype(), "the gradient has the logits' dtype");
            (loss.to_vec_f32().unwrap(), g.to_vec_f32().unwrap())
        };
        let ((loss16, g16), (loss32, g32)) = (run(true), run(false));
        let what = format!("cross-entropy [{rows}, {classes}]");
        assert_eq!(loss16, loss32, "{what}: the loss");
        assert_rounded_once(&format!("{what} dlogits"), &g16, &g32);
    }
}
