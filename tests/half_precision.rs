//! f16 tensors on the GPU (`DType::F16`), the element-level kernels: the casts to and from f32,
//! `zeros` and `full` in f16, the f16 builds of the elementwise, layout, reduction, scatter and
//! cross-entropy kernels, and the errors around them. The f16 matrix products and the expert bank
//! are checked in `half_precision_matmul.rs`; layer norm, RMSNorm, SwiGLU, rotary and attention
//! in `half_precision_nn.rs`; mixed precision's f16·f32 products in `half_precision_products.rs`.
//!
//! * casts: every value lands on one of the two f16 values around it (the one IEEE's
//!   round-to-nearest-even picks, or its neighbour: WGSL does not fix the rounding direction),
//!   exactly on values f16 holds; ±inf past the largest f16, NaN kept; back to f32 exactly;
//!   lengths of 1, odd and even (f16 buffers end on half a word);
//! * the elementwise kernels in f16 (unary, binary with broadcasting, where) compute exactly what
//!   the f32 ones compute from the same operands and round it once: each element is a
//!   neighbouring f16 of the f32 kernel's result (±inf past the largest f16);
//! * the layout copies in f16 move exactly the values the f32 ones move; reductions (sum, max,
//!   over one axis or two, cumulative sums, argmax) sum in f32 and round once;
//! * scatter_add in f16 (`Tensor::scatter_add`, `index_scatter`) sums the f16 source in f32 and
//!   rounds once: each output a neighbouring f16 of the f32 kernel's, through both kernels (the
//!   per-output loop over few source rows, the sorted index over more than 4096), with repeated
//!   indices and outputs nothing hits;
//! * the backward of `index_select` (on both scatter kernels) and of `gather` in f16, a
//!   scatter_add of the gradient, through the casts: a neighbouring f16 of the f32 gradient;
//! * cross-entropy on f16 logits: the f32 kernel's loss exactly, the gradient rounded once;
//! * errors, not panics or validation failures: an f16 tensor on the CPU, an op that has no f16
//!   kernel, a product of an f16 and an f32 operand.
//!
//! Skipped with a printed reason without an adapter unless `MOEGRAD_REQUIRE_GPU=1`; on an
//! adapter without `shader-f16` every f16 request must be an error naming it.

mod common;
#[path = "common/f16_checks.rs"]
mod f16_checks;

use f16_checks::{assert_rounded_once, f16_gpu, f16_values};
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

/// An f16 tensor's sums, maxima and minima are taken in f32 and rounded to f16 once, by the
/// reduction kernel itself (no cast after it, the cast's bits); argmax gives f32's indices.
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
        let ops: [(&str, Op); 6] = [
            ("sum(-1)", |x| x.sum(&[-1], false)),
            ("sum(0)", |x| x.sum(&[0], false)),
            ("max(-1)", |x| x.max(-1, false)),
            ("min(0)", |x| x.min(0, false)),
            ("sum over both axes", |x| x.sum(&[0, 1], false)),
            ("cumsum(-1)", |x| x.cumsum(-1)),
        ];
        for (name, op) in ops {
            let mut y16 = None;
            let kernels = f16_checks::kernels_run(|| y16 = Some(op(&x16).unwrap()));
            let y16 = y16.unwrap();
            assert_eq!(y16.dtype(), DType::F16, "{name}");
            // over one axis the f16 kernel alone; over two the f16 kernel's f32 partial sums,
            // the f32 kernel's total and its one rounding
            let f16_kernels_alone = kernels.iter().all(|k| k.starts_with("reduce_f16."));
            let two_axes_rounded_once = ["reduce_serial", "reduce_rows"].iter().any(|first| {
                let mut want = vec![
                    format!("reduce_f16.{first}"),
                    "reduce.reduce_serial_values".to_string(),
                    "half.f32_to_f16".to_string(),
                ];
                let mut got = kernels.clone();
                want.sort();
                got.sort();
                got == want
            });
            assert!(
                if name == "sum over both axes" {
                    two_axes_rounded_once
                } else {
                    f16_kernels_alone
                },
                "{name} of [{r}, {c}] runs {kernels:?}"
            );
            let y32 = op(&x32).unwrap();
            let what = format!("{name} of [{r}, {c}]");
            assert_rounded_once(
                &what,
                &y16.to_vec_f32().unwrap(),
                &y32.to_vec_f32().unwrap(),
            );
            // the same f32 sums (the same values in the same order) rounded once, as a cast
            // rounds them: over two axes too (the partial sums stay f32)
            assert_eq!(
                y16.to_vec_f32().unwrap(),
                y32.to_dtype(DType::F16).unwrap().to_vec_f32().unwrap(),
                "{what}: the bits of the f32 kernel's result cast to f16"
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
    // rounding per axis would lose the total: the rows sum to 1 + 2⁻¹¹ (a tie, rounded to 1)
    // and 2⁻¹¹; the whole sum, 1 + 2⁻¹⁰, is an f16
    let tie = 2f32.powi(-11);
    let x = Tensor::from_f32(vec![1.0, tie, 0.0, tie], &[2, 2], gpu)
        .and_then(|t| t.to_dtype(DType::F16))
        .unwrap();
    assert_eq!(
        x.sum(&[0, 1], false).unwrap().to_vec_f32().unwrap(),
        [1.0 + 2.0 * tie],
        "the sum over both axes is rounded once"
    );
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
/// The four kernels of the launcher (`layout::scatter_kernel`), with repeated indices and
/// outputs no index hits: `scatter_add_loop` (at most 32 source rows), `scatter_add_wide` (an
/// index that varies along the inner axis), `scatter_add_columns` (one index per source row,
/// small work or many hits per output) and `scatter_add_sorted` (one index per source row,
/// outputs × rows past 2^24 and few hits per output), through `Tensor::scatter_add` and
/// `index_scatter`.
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
        (vec![5000], 0, 37), // columns: 5000 rows of one element, ~135 hits per output
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
        (vec![4200, 3], 0, 50),      // columns: 4200 rows of 3
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
/// each: `scatter_add_columns`; the gather's `scatter_add_wide`, its index varying along the
/// inner axis) and
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
