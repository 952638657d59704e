//! The f16 builds of the network kernels on the GPU: layer norm and RMSNorm, the fused SwiGLU,
//! the rotary embedding and causal attention (three tensors or packed), forward and backward,
//! each against the f32 kernel on the same f16-valued operands. One of the f16 test files: the
//! casts and the element-level kernels are checked in `half_precision.rs`, the matrix products
//! and the expert bank in `half_precision_matmul.rs`.
//!
//! * layer norm and RMSNorm in f16: the output and `dx`, `dγ`, `dβ` a neighbouring f16 of the f32
//!   kernel's result; with f16 rows and f32 parameters (mixed precision's norms) `dγ`, `dβ` in
//!   f32 with the f32 kernel's bits;
//! * the fused SwiGLU in f16: output and input gradient a neighbouring f16 of the f32 kernel's;
//! * the rotary embedding in f16 (f16 heads, f32 tables): output and input gradient a
//!   neighbouring f16 of the f32 kernel's;
//! * causal attention in f16 (`[B, H, T, Dh]`) against the f32 kernel on the same f16-rounded
//!   queries, keys, values and upstream gradient over random shapes (one position, head
//!   dimensions 1, odd, 32 and 64, sequences inside, at the end of and across the 64-row tiles,
//!   several batches and heads), forward and backward through `to_dtype`: within the output's
//!   f16 rounding, plus for `dq` and `dk` the rounding of the saved output carried in by the
//!   backward's `D = rowsum(dO ∘ O)`;
//! * the packed form (`[B, T, 3, H, Dh]`, one gradient) in f16 against f32 the same way.
//!
//! Skipped with a printed reason without an adapter unless `MOEGRAD_REQUIRE_GPU=1`; on an
//! adapter without `shader-f16` every f16 request must be an error naming it.

mod common;
#[path = "common/f16_checks.rs"]
mod f16_checks;

use f16_checks::{assert_rounded_once, f16_gpu, f16_values, kernels_run};
use moegrad::{DType, Device, Tensor};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

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

/// The rotary embedding in f16 (mixed precision's: f16 heads, and `nn::Rotary`'s f32 tables
/// read where they are): the output and the input gradient of the f16 build are each a
/// neighbouring f16 of the f32 kernel's result on the same f16-valued heads and gradient (the
/// same f32 arithmetic with the same f32 tables, rounded once), over head widths 2 to 64,
/// positions inside and at the tables' end, and several batches; the f32 tables are never cast
/// (the forward and backward run the rotation and nothing else).
#[test]
fn f16_rotary_rounds_the_f32_result_once() {
    let Some(gpu) = f16_gpu("f16_rotary_rounds_the_f32_result_once") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(43);
    for (batch, seq, dh) in [(1, 1, 2), (2, 5, 8), (3, 64, 32), (2, 17, 64)] {
        let rope = moegrad::nn::Rotary::new(dh, 64, 1e4, gpu).unwrap();
        let x = f16_values(batch * seq * dh, &mut rng);
        let up = f16_values(batch * seq * dh, &mut rng);
        let leaf = |dtype: DType| {
            Tensor::from_f32(x.clone(), &[batch, seq, dh], gpu)
                .and_then(|t| t.to_dtype(dtype))
                .unwrap()
                .with_grad()
                .unwrap()
        };
        let run = |dtype: DType| {
            let xt = leaf(dtype);
            let g = Tensor::from_f32(up.clone(), &[batch, seq, dh], gpu)
                .and_then(|t| t.to_dtype(dtype))
                .unwrap();
            let mut y = None;
            let kernels = kernels_run(|| {
                let out = rope.apply(&xt).unwrap();
                out.backward_with(&g).unwrap();
                y = Some(out);
            });
            let y = y.unwrap();
            assert_eq!(y.dtype(), dtype);
            let values = [
                y.to_vec_f32().unwrap(),
                xt.grad().unwrap().to_vec_f32().unwrap(),
            ];
            (values, kernels)
        };
        let (([y16, dx16], k16), ([y32, dx32], _)) = (run(DType::F16), run(DType::F32));
        assert_rounded_once(&format!("rotary [{batch}, {seq}, {dh}] y"), &y16, &y32);
        assert_rounded_once(&format!("rotary [{batch}, {seq}, {dh}] dx"), &dx16, &dx32);
        assert!(
            k16.iter().all(|k| k == "rotary_f16.rotary"),
            "f16 heads run the f16 rotation on the f32 tables and nothing else: {k16:?}"
        );
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
/// rounding of the f16 output (as in `half_precision_matmul.rs`'s `assert_rounded_output`) of
/// a value that may differ from the f32 kernel's by up to `extra` (an error the f16 run carries
/// in from an earlier rounding).
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
///   `T` keys or queries (`T·4·2⁻²³ + 10⁻⁶`, as `assert_rounded_output` in
///   `half_precision_matmul.rs` allows);
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
