//! `Tensor::causal_attention`: the fused attention op against finite differences and against the
//! same attention composed from existing ops (`matmul`, `masked_fill`, `softmax`, `matmul`).
//!
//! * f64 gradcheck on the CPU for shapes with T = 1, T inside one CPU block, T not a multiple of
//!   the CPU block and T over several blocks (gradcheck also runs backward twice for
//!   reentrancy and checks a zero upstream gradient);
//! * values and all three gradients equal to the composed path, at fixed shapes and over random
//!   small shapes (proptest), with large scores too (the online softmax must stay stable);
//! * the f32 forward with scores of 10³–10⁴ on the CPU and the GPU against the f64 definition
//!   (written here as loops), within a bound derived from f32 rounding of the scores;
//! * the CPU's two backward schedules (one task per head, or per block when heads are few) give
//!   identical bits;
//! * GPU (f32) against CPU (f64), forward and the three gradients, for T = 1, T not a multiple of
//!   the GPU tile, several tiles, and the largest head dimension the GPU kernel takes; skipped
//!   with a printed reason without an adapter unless `MOEGRAD_REQUIRE_GPU=1`;
//! * bad shapes, dtypes and devices give an `Error`; zero-sized dimensions give an empty result.

mod common;

use moegrad::gradcheck::{GradcheckOptions, gradcheck};
use moegrad::{DType, Device, Error, Result, Tensor};
use proptest::prelude::*;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

// The kernels' block sizes, copied (the backend is private; src/backend/tests/constants.rs
// fails when they change): the CPU kernel's query and key blocks, the GPU kernel's tile, and the
// largest head dimension the GPU kernel takes.
const ATTENTION_BLOCK: usize = 32;
const ATTENTION_TILE: usize = 64;
const ATTENTION_MAX_HEAD_DIM: usize = 128;

/// `n` values uniform in `[-spread, spread)`, f32-representable, from a fixed seed.
fn values(n: usize, spread: f64, seed: u64) -> Vec<f64> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|_| rng.random_range(-spread..spread) as f32 as f64)
        .collect()
}

/// q, k, v as f64 CPU tensors of `shape`, each from its own seed.
fn qkv(shape: &[usize], spread: f64, seed: u64) -> [Tensor; 3] {
    let n: usize = shape.iter().product();
    [0, 1, 2].map(|i| common::f64t(&values(n, spread, seed * 3 + i), shape))
}

/// The same attention from existing ops: `softmax(q·kᵀ/√Dh, keys after the query masked)·v`.
fn composed(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    let (t, dh) = (q.shape()[2], q.shape()[3]);
    let scores = q
        .matmul(&k.transpose(-1, -2)?)?
        .mul_scalar(1.0 / (dh as f64).sqrt())?;
    let future: Vec<f64> = (0..t * t)
        .map(|ij| if ij % t > ij / t { 1.0 } else { 0.0 })
        .collect();
    let mask = Tensor::from_f64(future, &[t, t], Device::cpu())?
        .to_dtype(q.dtype())?
        .to_device(q.device())?;
    scores
        .masked_fill(&mask, f64::NEG_INFINITY)?
        .softmax(-1)?
        .matmul(v)
}

/// Asserts the fused op and the composed path agree on values and gradients.
fn assert_matches_composed(what: &str, inputs: &[Tensor; 3], tol: f64) {
    let up = values(inputs[0].numel(), 1.0, 99);
    let (y, grads) = common::run3(|q, k, v| q.causal_attention(k, v), inputs, &up);
    let (y_ref, grads_ref) = common::run3(composed, inputs, &up);
    common::assert_close(&format!("{what}: output"), &y, &y_ref, tol, tol);
    for (name, (g, r)) in ["dq", "dk", "dv"].iter().zip(grads.iter().zip(&grads_ref)) {
        common::assert_close(&format!("{what}: {name}"), g, r, tol, tol);
    }
}

fn attention(t: &[Tensor]) -> Result<Tensor> {
    t[0].causal_attention(&t[1], &t[2])
}

// ---- gradcheck ----------------------------------------------------------------------------

#[test]
fn gradcheck_small_shapes() {
    // T = 1 (a row that sees only itself), Dh = 1, several heads and batches, T inside one block
    for (i, shape) in [[1, 1, 1, 1], [2, 1, 1, 3], [1, 1, 4, 1], [2, 3, 5, 2]]
        .iter()
        .enumerate()
    {
        let inputs = qkv(shape, 1.0, i as u64);
        gradcheck(attention, &inputs, &GradcheckOptions::default())
            .unwrap_or_else(|e| panic!("{shape:?}: {e}"));
    }
}

#[test]
fn gradcheck_across_cpu_blocks() {
    // T not a multiple of the CPU block, over one and over two block boundaries; heads = 1 and
    // 2 run the per-block backward schedule on a machine with more threads, the per-head one
    // otherwise (the schedule test below covers both everywhere).
    for (i, shape) in [
        [1, 1, ATTENTION_BLOCK + 5, 2],
        [1, 2, 2 * ATTENTION_BLOCK + 3, 1],
    ]
    .iter()
    .enumerate()
    {
        let inputs = qkv(shape, 1.5, 10 + i as u64);
        gradcheck(attention, &inputs, &GradcheckOptions::default())
            .unwrap_or_else(|e| panic!("{shape:?}: {e}"));
    }
}

// ---- against the composed path ------------------------------------------------------------

#[test]
fn matches_the_composed_path() {
    for (i, shape) in [
        [1, 1, 1, 1],
        [2, 2, 7, 3],
        [1, 3, ATTENTION_BLOCK, 8],
        [2, 1, 2 * ATTENTION_BLOCK + 7, 16],
        [1, 2, 3 * ATTENTION_BLOCK + 1, 5],
    ]
    .iter()
    .enumerate()
    {
        assert_matches_composed(
            &format!("{shape:?}"),
            &qkv(shape, 1.0, 20 + i as u64),
            1e-10,
        );
    }
}

#[test]
fn large_scores_match_the_composed_path() {
    // scores up to ±(8·8·16)/4 = ±256: e^256 overflows f32 and the row maximum changes from
    // block to block, so the online softmax's rescaling is exercised
    let shape = [1, 2, 2 * ATTENTION_BLOCK + 9, 16];
    let inputs = qkv(&shape, 8.0, 30);
    assert_matches_composed("large scores", &inputs, 1e-9);
}

/// Causal attention from its definition in f64, layout `[heads, T, Dh]`: for query `i`,
/// `s_j = q_i·k_j/√Dh` over keys `j ≤ i`, `o_i = Σ_{j ≤ i} e^{s_j − max s} v_j / Σ_{j ≤ i} e^{s_j − max s}`.
fn attention_definition(q: &[f64], k: &[f64], v: &[f64], t: usize, dh: usize) -> Vec<f64> {
    let mut o = vec![0.0; q.len()];
    for (h, out) in o.chunks_mut(t * dh).enumerate() {
        let row = |m: &[f64], pos: usize| m[(h * t + pos) * dh..(h * t + pos + 1) * dh].to_vec();
        for i in 0..t {
            let qi = row(q, i);
            let s: Vec<f64> = (0..=i)
                .map(|j| {
                    let kj = row(k, j);
                    qi.iter().zip(&kj).map(|(a, b)| a * b).sum::<f64>() / (dh as f64).sqrt()
                })
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for (j, ej) in e.iter().enumerate() {
                let vj = row(v, j);
                for d in 0..dh {
                    out[i * dh + d] += ej / z * vj[d];
                }
            }
        }
    }
    o
}

/// The f32 forward with scores of 10³ to 10⁴ (far past where e^s overflows f32, so only the
/// running maximum keeps it finite), on the CPU and on the GPU, against the f64 definition on
/// the same (f32-representable) inputs. The bound is the f32 rounding of the scores carried
/// through the softmax: with `δ_i = Dh·ε·max_j Σ_d |q_id k_jd| / √Dh` the largest error of a
/// score of query `i`, the weights move by a factor within `e^{±2δ_i}`, so the output moves by
/// at most about `2δ_i·max|v|`, plus the rounding of the final sum.
#[test]
fn f32_large_scores_match_the_f64_definition() {
    let (b, h, t, dh) = (1, 2, 2 * ATTENTION_BLOCK + 9, 16);
    let shape = [b, h, t, dh];
    let inputs = qkv(&shape, 40.0, 31);
    let [q, k, v] = inputs.clone().map(|x| x.to_vec_f64().unwrap());
    let want = attention_definition(&q, &k, &v, t, dh);
    let eps = f32::EPSILON as f64;
    let max_v = v.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    let mut largest_score = 0.0f64;
    let tolerance: Vec<f64> = (0..b * h * t)
        .flat_map(|row| {
            let (head, i) = (row / t, row % t);
            let at = |x: &[f64], pos: usize, d: usize| x[(head * t + pos) * dh + d];
            let magnitude = (0..=i)
                .map(|j| {
                    (0..dh)
                        .map(|d| (at(&q, i, d) * at(&k, j, d)).abs())
                        .sum::<f64>()
                })
                .fold(0.0f64, f64::max)
                / (dh as f64).sqrt();
            largest_score = largest_score.max(magnitude);
            let delta = dh as f64 * eps * magnitude;
            vec![max_v * (2.0 * delta + (t + dh) as f64 * eps); dh]
        })
        .collect();
    assert!(
        largest_score > 1e3,
        "the scores reach only {largest_score}: not the large-score case"
    );
    for device in common::devices("f32_large_scores_match_the_f64_definition") {
        let [q32, k32, v32] = inputs
            .clone()
            .map(|x| x.to_dtype(DType::F32).unwrap().to_device(device).unwrap());
        let got = q32
            .causal_attention(&k32, &v32)
            .unwrap()
            .to_vec_f64()
            .unwrap();
        for (i, ((g, w), tol)) in got.iter().zip(&want).zip(&tolerance).enumerate() {
            assert!(
                (g - w).abs() <= *tol,
                "{device}: element {i} (query {}): f32 {g}, f64 definition {w}, bound {tol}",
                (i / dh) % t
            );
        }
    }
}

#[test]
fn f32_matches_f64() {
    let shape = [2, 2, ATTENTION_BLOCK + 11, 8];
    let inputs = qkv(&shape, 1.0, 40);
    let up = values(inputs[0].numel(), 1.0, 41);
    let single = inputs.clone().map(|t| t.to_dtype(DType::F32).unwrap());
    let (y, grads) = common::run3(|q, k, v| q.causal_attention(k, v), &single, &up);
    let (y_ref, grads_ref) = common::run3(|q, k, v| q.causal_attention(k, v), &inputs, &up);
    common::assert_close("f32 output", &y, &y_ref, 1e-5, 1e-4);
    for (g, r) in grads.iter().zip(&grads_ref) {
        common::assert_close("f32 gradient", g, r, 1e-5, 1e-4);
    }
}

#[test]
fn backward_schedules_give_identical_bits() {
    // one thread: every head count takes the per-head (fused) schedule; eight threads and two
    // heads: the per-block (split) schedule
    let shape = [1, 2, 2 * ATTENTION_BLOCK + 5, 4];
    let inputs = qkv(&shape, 1.0, 50);
    let up = values(inputs[0].numel(), 1.0, 51);
    let in_pool = |threads: usize| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("a thread pool")
            .install(|| common::run3(|q, k, v| q.causal_attention(k, v), &inputs, &up))
    };
    let (y1, g1) = in_pool(1);
    let (y8, g8) = in_pool(8);
    assert_eq!(y1, y8, "forward differs between schedules");
    for (name, (a, b)) in ["dq", "dk", "dv"].iter().zip(g1.iter().zip(&g8)) {
        assert_eq!(
            a, b,
            "{name} differs between the fused and the split schedule"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// Random small shapes (T up to past two CPU blocks): values and gradients as composed.
    #[test]
    fn random_shapes_match_the_composed_path(
        b in 1usize..=2,
        h in 1usize..=3,
        t in 1usize..=(2 * ATTENTION_BLOCK + 8),
        dh in 1usize..=9,
        seed in 0u64..1000,
    ) {
        let inputs = qkv(&[b, h, t, dh], 1.5, 1000 + seed);
        assert_matches_composed(&format!("[{b}, {h}, {t}, {dh}]"), &inputs, 1e-10);
    }
}

// ---- GPU parity ---------------------------------------------------------------------------

#[test]
fn gpu_matches_cpu() {
    let Some(gpu) = common::gpu_or_skip("gpu_matches_cpu") else {
        return;
    };
    let tile = ATTENTION_TILE;
    for (i, (shape, spread)) in [
        ([2, 2, 1, 4], 1.0),                             // T = 1
        ([1, 2, 40, 32], 1.0),                           // one tile, two key stages of 32
        ([1, 3, tile + 3, 8], 1.0),                      // T not a multiple of the tile
        ([2, 1, 2 * tile, 32], 1.0),                     // two whole tiles, Dh of the baby GPT
        ([1, 2, tile + 5, 5], 1.0),                      // small odd Dh
        ([1, 1, 50, 100], 1.0),                          // stages of 19 rows (1984 / 100)
        ([1, 1, tile + 1, ATTENTION_MAX_HEAD_DIM], 1.0), // the largest Dh the kernel takes
        ([1, 2, 2 * tile + 9, 16], 4.0), // scores up to ±64: the running max moves a lot
    ]
    .iter()
    .enumerate()
    {
        let what = format!("{shape:?}");
        let inputs = qkv(shape, *spread, 60 + i as u64);
        let up = values(inputs[0].numel(), 1.0, 61);
        let on_gpu = inputs
            .clone()
            .map(|t| t.to_dtype(DType::F32).unwrap().to_device(gpu).unwrap());
        let (y, grads) = common::run3(|q, k, v| q.causal_attention(k, v), &on_gpu, &up);
        let (y_ref, grads_ref) = common::run3(|q, k, v| q.causal_attention(k, v), &inputs, &up);
        common::assert_close(&format!("{what}: GPU output"), &y, &y_ref, 1e-5, 1e-4);
        for (name, (g, r)) in ["dq", "dk", "dv"].iter().zip(grads.iter().zip(&grads_ref)) {
            common::assert_close(&format!("{what}: GPU {name}"), g, r, 2e-5, 1e-3);
        }
    }
}

#[test]
fn gpu_refuses_what_it_cannot_run() {
    let Some(gpu) = common::gpu_or_skip("gpu_refuses_what_it_cannot_run") else {
        return;
    };
    let shape = [1, 1, 3, ATTENTION_MAX_HEAD_DIM + 1];
    let x = Tensor::zeros(&shape, DType::F32, gpu).unwrap();
    match x.causal_attention(&x, &x) {
        Err(Error::Invalid(msg)) => assert!(msg.contains("head dimension"), "{msg}"),
        other => panic!("head dimension over the limit: expected Error::Invalid, got {other:?}"),
    }
    let cpu = Tensor::zeros(&[1, 1, 3, 4], DType::F32, Device::cpu()).unwrap();
    let x = cpu.to_device(gpu).unwrap();
    assert!(matches!(
        x.causal_attention(&cpu, &x),
        Err(Error::Device(_))
    ));
}

// ---- bad input ----------------------------------------------------------------------------

#[test]
fn bad_inputs_are_errors() {
    let t = |shape: &[usize]| Tensor::zeros(shape, DType::F32, Device::cpu()).unwrap();
    let shape_err = |r: Result<Tensor>, what: &str| match r {
        Err(Error::Shape(msg)) => {
            assert!(msg.contains('['), "{what}: message names no shape: {msg}")
        }
        other => panic!("{what}: expected Error::Shape, got {other:?}"),
    };
    let x = t(&[1, 2, 3, 4]);
    shape_err(
        t(&[2, 3, 4]).causal_attention(&t(&[2, 3, 4]), &t(&[2, 3, 4])),
        "rank 3",
    );
    shape_err(x.causal_attention(&t(&[1, 2, 3, 5]), &x), "k of another Dh");
    shape_err(x.causal_attention(&x, &t(&[1, 2, 4, 4])), "v of another T");
    // as many elements as q, in another shape: only the op's own check can catch these
    shape_err(
        x.causal_attention(&t(&[1, 2, 4, 3]), &x),
        "k [T, Dh] swapped",
    );
    shape_err(
        x.causal_attention(&x, &t(&[2, 1, 3, 4])),
        "v [B, H] swapped",
    );
    shape_err(
        t(&[1, 1, 2, 3, 4]).causal_attention(&t(&[1, 1, 2, 3, 4]), &t(&[1, 1, 2, 3, 4])),
        "rank 5",
    );
    let ints = Tensor::from_i32(vec![0; 24], &[1, 2, 3, 4], Device::cpu()).unwrap();
    assert!(matches!(
        ints.causal_attention(&ints, &ints),
        Err(Error::DType(_))
    ));
    let doubles = x.to_dtype(DType::F64).unwrap();
    assert!(matches!(
        x.causal_attention(&doubles, &x),
        Err(Error::DType(_))
    ));
}

#[test]
fn zero_sized_dimensions_give_an_empty_result() {
    for shape in [[0, 2, 3, 4], [1, 0, 3, 4], [1, 2, 0, 4], [1, 2, 3, 0]] {
        let x = Tensor::zeros(&shape, DType::F64, Device::cpu())
            .unwrap()
            .with_grad()
            .unwrap();
        let y = x.causal_attention(&x, &x).unwrap();
        assert_eq!(y.shape(), &shape);
        y.sum_all().unwrap().backward().unwrap();
        assert_eq!(x.grad().expect("a gradient").shape(), &shape);
    }
}

// ---- the packed form ----------------------------------------------------------------------

/// q, k, v (each `[B, H, T, Dh]`) packed per position into one `[B, T, 3, H, Dh]` tensor, as a
/// fused projection lays them out.
fn packed(inputs: &[Tensor; 3]) -> Tensor {
    let &[b, h, t, dh] = inputs[0].shape() else {
        panic!("rank 4")
    };
    let parts: Vec<Tensor> = inputs
        .iter()
        .map(|x| {
            x.permute(&[0, 2, 1, 3])
                .and_then(|x| x.reshape(&[b, t, 1, h, dh]))
                .unwrap()
        })
        .collect();
    Tensor::concat(&parts, 2).unwrap()
}

/// The packed op's output `[B, T, H, Dh]` read in the separate op's order `[B, H, T, Dh]`.
fn output_as_bhtd(y: &Tensor) -> Vec<f64> {
    y.permute(&[0, 2, 1, 3]).unwrap().to_vec_f64().unwrap()
}

/// A packed gradient `[B, T, 3, H, Dh]` read as dq, dk and dv one after another, each in the
/// separate op's order `[B, H, T, Dh]`.
fn grad_as_parts(g: &Tensor) -> Vec<f64> {
    g.permute(&[2, 0, 3, 1, 4]).unwrap().to_vec_f64().unwrap()
}

/// An upstream gradient given in the separate op's order `[B, H, T, Dh]` (`up`), as the packed
/// op's output `y` `[B, T, H, Dh]` takes it: on y's device, in y's dtype.
fn upstream_for_packed(up: &[f64], y: &Tensor) -> Tensor {
    let &[b, t, h, dh] = y.shape() else {
        panic!("rank 4")
    };
    let g = Tensor::from_f64(up.to_vec(), &[b, h, t, dh], Device::cpu())
        .and_then(|g| g.permute(&[0, 2, 1, 3]))
        .expect("upstream gradient");
    if y.dtype() == DType::F64 {
        return g;
    }
    g.to_dtype(DType::F32)
        .and_then(|g| g.to_device(y.device()))
        .and_then(|g| g.to_dtype(y.dtype()))
        .expect("upstream gradient")
}

/// The packed op's output and the packed input's gradient for the upstream gradient `up`, both
/// in the separate op's order (output `[B, H, T, Dh]`, then dq, dk, dv).
fn run_packed(x: &Tensor, up: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let leaf = x.detach().with_grad().expect("a float leaf");
    let y = leaf.causal_attention_packed().expect("forward");
    let g = upstream_for_packed(up, &y);
    y.backward_with(&g).expect("backward");
    let grad = grad_as_parts(&leaf.grad().expect("a gradient"));
    (output_as_bhtd(&y), grad)
}

#[test]
fn packed_matches_the_separate_op_bit_for_bit() {
    for (i, shape) in [[1, 1, 1, 1], [2, 3, 5, 2], [1, 2, ATTENTION_BLOCK + 3, 8]]
        .iter()
        .enumerate()
    {
        let inputs = qkv(shape, 1.0, 80 + i as u64);
        let up = values(inputs[0].numel(), 1.0, 81);
        let (y, grads) = common::run3(|q, k, v| q.causal_attention(k, v), &inputs, &up);
        let (y_packed, grad_packed) = run_packed(&packed(&inputs), &up);
        assert_eq!(y_packed, y, "{shape:?}: output");
        let n = inputs[0].numel();
        for (j, name) in ["dq", "dk", "dv"].iter().enumerate() {
            assert_eq!(
                grad_packed[j * n..(j + 1) * n],
                grads[j][..],
                "{shape:?}: {name}, the packed gradient's part {j}"
            );
        }
    }
}

#[test]
fn packed_passes_gradcheck() {
    for (i, shape) in [[1, 1, 3, 2], [2, 2, 4, 3]].iter().enumerate() {
        let x = packed(&qkv(shape, 1.0, 90 + i as u64));
        gradcheck(
            |t| t[0].causal_attention_packed(),
            &[x],
            &GradcheckOptions::default(),
        )
        .unwrap_or_else(|e| panic!("{shape:?}: {e}"));
    }
}

#[test]
fn packed_on_the_gpu_matches_the_cpu() {
    let Some(gpu) = common::gpu_or_skip("packed_on_the_gpu_matches_the_cpu") else {
        return;
    };
    let inputs = qkv(&[2, 2, ATTENTION_TILE + 3, 8], 1.0, 95);
    let up = values(inputs[0].numel(), 1.0, 96);
    let x = packed(&inputs);
    let on_gpu = x.to_dtype(DType::F32).unwrap().to_device(gpu).unwrap();
    let (y, grad) = run_packed(&on_gpu, &up);
    let (y_ref, grad_ref) = run_packed(&x, &up);
    common::assert_close("packed: GPU output", &y, &y_ref, 1e-5, 1e-4);
    common::assert_close("packed: GPU gradient", &grad, &grad_ref, 2e-5, 1e-3);
}

/// On the GPU the packed op reads q, k and v in place and writes the three gradients into one
/// buffer (the kernels' `part`), where the separate op has three buffers each way: the same
/// arithmetic, so the same bits, in f32 and (where the adapter has shader-f16) in f16, over
/// shapes with several query tiles, odd head dimensions up to the kernel's 128 and many heads.
#[test]
fn packed_on_the_gpu_matches_the_separate_op_bit_for_bit() {
    let Some(gpu) = common::gpu_or_skip("packed_on_the_gpu_matches_the_separate_op_bit_for_bit")
    else {
        return;
    };
    let f16 = moegrad::gpu::info()
        .expect("adapter info")
        .features
        .iter()
        .any(|f| f == "shader-f16");
    let shapes = [
        [1, 1, 1, 1],
        [2, 3, ATTENTION_TILE + 5, 7],
        [1, 2, 2 * ATTENTION_TILE + 1, 33],
        [3, 5, 9, 128],
    ];
    for (i, shape) in shapes.iter().enumerate() {
        let inputs = qkv(shape, 1.0, 200 + i as u64);
        let up = values(inputs[0].numel(), 1.0, 300 + i as u64);
        let dtypes: &[DType] = if f16 {
            &[DType::F32, DType::F16]
        } else {
            &[DType::F32]
        };
        for &dtype in dtypes {
            let on_gpu = |t: &Tensor| {
                t.to_dtype(DType::F32)
                    .and_then(|t| t.to_device(gpu))
                    .and_then(|t| t.to_dtype(dtype))
                    .and_then(|t| t.with_grad())
                    .unwrap()
            };
            // the separate op's output and gradients for the upstream `up`
            let [q, k, v] = inputs.clone().map(|t| on_gpu(&t));
            let y = q.causal_attention(&k, &v).unwrap();
            let g = Tensor::from_f64(up.clone(), y.shape(), Device::cpu())
                .and_then(|g| g.to_dtype(DType::F32))
                .and_then(|g| g.to_device(gpu))
                .and_then(|g| g.to_dtype(dtype))
                .unwrap();
            y.backward_with(&g).expect("backward");
            let grads: Vec<Vec<f64>> = [q, k, v]
                .iter()
                .map(|t| t.grad().unwrap().to_vec_f64().unwrap())
                .collect();
            let y = y.to_vec_f64().unwrap();
            let (y_packed, grad_packed) = run_packed(&on_gpu(&packed(&inputs)), &up);
            let what = format!("{shape:?} {dtype}");
            assert_eq!(y_packed, y, "{what}: output");
            let n = inputs[0].numel();
            for (j, name) in ["dq", "dk", "dv"].iter().enumerate() {
                assert_eq!(
                    grad_packed[j * n..(j + 1) * n],
                    grads[j][..],
                    "{what}: {name}, the packed gradient's part {j}"
                );
            }
        }
    }
}

#[test]
fn packed_refuses_other_shapes() {
    for shape in [
        vec![3, 2, 4, 2],
        vec![3, 1, 1, 4, 2],
        vec![1, 4, 2, 1, 3],
        vec![1, 1, 3, 4, 2, 1],
    ] {
        let n: usize = shape.iter().product();
        let x = common::f64t(&values(n, 1.0, 7), &shape);
        match x.causal_attention_packed() {
            Err(Error::Shape(msg)) => assert!(msg.contains("[B, T, 3, H, Dh]"), "{msg}"),
            other => panic!("{shape:?}: expected a shape error, got {other:?}"),
        }
    }
    let empty = common::f64t(&[], &[1, 0, 3, 2, 4]);
    assert_eq!(
        empty.causal_attention_packed().unwrap().shape(),
        &[1, 0, 2, 4]
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(16))]

    /// The packed op over random shapes gives the separate op's output and gradients bit for bit.
    #[test]
    fn packed_matches_the_separate_op_over_random_shapes(
        b in 1usize..=2,
        h in 1usize..=3,
        t in 1usize..=40,
        dh in 1usize..=6,
        seed in 0u64..1000,
    ) {
        let inputs = qkv(&[b, h, t, dh], 1.0, seed);
        let up = values(inputs[0].numel(), 1.0, seed + 1);
        let (y, grads) = common::run3(|q, k, v| q.causal_attention(k, v), &inputs, &up);
        let (y_packed, grad_packed) = run_packed(&packed(&inputs), &up);
        prop_assert_eq!(y_packed, y);
        prop_assert_eq!(grad_packed, grads.concat());
    }
}
