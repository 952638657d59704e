//! Forward references: every fused or kernel-backed op, and every router whose forward is its own
//! code, against a naive reference written here from the op's definition.
//!
//! A gradcheck proves that an op's backward matches its forward; it cannot see a wrong forward
//! (the attention gradchecks passed with a causal mask that leaked one future key). These tests
//! prove the forward matches the math. Each `*_reference` function below is plain nested loops
//! over `f64` slices, with the definition it implements in its doc comment; none calls a moegrad
//! op, so a reference shares no code with the kernel it checks. Each test compares the op in f64
//! on the CPU (f32 where the op only exists in f32: GELU's fused slope) over shapes drawn from a
//! fixed seed, with values drawn away from kinks (no ties in a top-k, no point on a threshold).
//!
//! Ops covered: causal attention (separate and packed), layer norm, cross-entropy, conv2d and
//! grouped conv2d, max and average pooling (padded or not), `topk_gate` (both gates), the grouped
//! matmul with bias, GELU and its fused slope, softsign and its slope, `index_scatter`; and the routers' forwards:
//! MOESART's draw, combine weights and trimmed lasso, DSelect-k's smooth-step, selectors, gate,
//! entropy and unused-code penalty, SparseMixer's mask, masked softmax and weights (v1 variants
//! and v2 top-1/top-2), the estimator baselines' weights (st, gumbel-st, reinmax, reinforce) and
//! the threshold router's kept prefix.

mod common;

use common::assert_close;
use moegrad::moe::routers::{
    DSelectKKind, DSelectKRouter, EstimatorRouter, MaskRule, MoesartDraw, MoesartRouter,
    MoesartStrategy, SparseMixerRouter, SparseMixerVariant, ThresholdRouter, masked_softmax,
    scale_through, selector_probs, smooth_step, sparsemixer_mask,
};
use moegrad::moe::{Router, RouterConfig, Routing};
use moegrad::nn::Parameters;
use moegrad::{DType, Device, Tensor};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

// The CPU attention kernel's block size, copied (the backend is private;
// src/backend/tests/constants.rs fails when it changes).
const ATTENTION_BLOCK: usize = 32;

/// Random shapes drawn per op.
const CASES: u64 = 12;
/// Agreement asked of an f64 op with its f64 reference (absolute and relative).
const TOL: f64 = 1e-11;

// ---- helpers -------------------------------------------------------------------------------

/// The generator of case `case` of test `test` (one fixed stream per case).
fn rng_for(test: u64, case: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(test * 1000 + case)
}

/// `n` values uniform in `[lo, hi)`.
fn uniform(rng: &mut ChaCha8Rng, n: usize, lo: f64, hi: f64) -> Vec<f64> {
    (0..n).map(|_| rng.random_range(lo..hi)).collect()
}

/// An f64 CPU tensor.
fn tensor(values: &[f64], shape: &[usize]) -> Tensor {
    common::f64t(values, shape)
}

/// An I32 CPU tensor.
fn indices(values: &[i32], shape: &[usize]) -> Tensor {
    Tensor::from_i32(values.to_vec(), shape, Device::cpu()).expect("valid index tensor")
}

fn f64s(t: &Tensor) -> Vec<f64> {
    t.to_vec_f64().expect("float values")
}

fn i32s(t: &Tensor) -> Vec<i32> {
    t.to_vec_i32().expect("i32 values")
}

/// The softmax of one row, `e^{x_j − max} / Σ_l e^{x_l − max}` (a helper of the references).
fn softmax_row(x: &[f64]) -> Vec<f64> {
    let m = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = x.iter().map(|v| (v - m).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|v| v / s).collect()
}

/// The positions of a row from the largest value down, ties to the lowest index.
fn descending_order(x: &[f64]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..x.len()).collect();
    order.sort_by(|&a, &b| x[b].total_cmp(&x[a]).then(a.cmp(&b)));
    order
}

/// `n` distinct values with gaps of at least `gap`, shuffled, shifted into `[lo, ...)`: rows
/// with no near-ties for the top-k tests.
fn spread_row(rng: &mut ChaCha8Rng, n: usize, lo: f64, gap: f64) -> Vec<f64> {
    let mut v: Vec<f64> = (0..n)
        .map(|i| lo + gap * i as f64 + rng.random_range(0.0..gap * 0.5))
        .collect();
    for i in (1..n).rev() {
        let j = rng.random_range(0..=i);
        v.swap(i, j);
    }
    v
}

// ---- attention -----------------------------------------------------------------------------

/// Causal self-attention from its definition, per head `h` (of `heads` = B·H) and query `i`:
/// `s_j = Σ_d q[i,d]·k[j,d] / √Dh` for keys `j ≤ i` only, `p_j = e^{s_j} / Σ_{l ≤ i} e^{s_l}`
/// (formed with the maximum subtracted), `o[i,d] = Σ_{j ≤ i} p_j·v[j,d]`. Layout `[heads, T, Dh]`.
fn attention_reference(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    heads: usize,
    t: usize,
    dh: usize,
) -> Vec<f64> {
    let mut o = vec![0.0; heads * t * dh];
    let scale = 1.0 / (dh as f64).sqrt();
    for h in 0..heads {
        let at = |x: &[f64], pos: usize, d: usize| x[(h * t + pos) * dh + d];
        for i in 0..t {
            let mut s = vec![0.0; i + 1];
            for (j, sj) in s.iter_mut().enumerate() {
                for d in 0..dh {
                    *sj += at(q, i, d) * at(k, j, d);
                }
                *sj *= scale;
            }
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for d in 0..dh {
                let mut acc = 0.0;
                for (j, ej) in e.iter().enumerate() {
                    acc += ej / z * at(v, j, d);
                }
                o[(h * t + i) * dh + d] = acc;
            }
        }
    }
    o
}

#[test]
fn attention_matches_its_definition() {
    for case in 0..CASES {
        let mut rng = rng_for(1, case);
        let (b, h) = (rng.random_range(1..=2), rng.random_range(1..=3));
        let (t, dh) = (
            rng.random_range(1..=2 * ATTENTION_BLOCK + 8),
            rng.random_range(1..=9),
        );
        let shape = [b, h, t, dh];
        let n = b * h * t * dh;
        let [q, k, v] = [0, 1, 2].map(|_| uniform(&mut rng, n, -2.0, 2.0));
        let want = attention_reference(&q, &k, &v, b * h, t, dh);
        let got = tensor(&q, &shape)
            .causal_attention(&tensor(&k, &shape), &tensor(&v, &shape))
            .expect("attention");
        assert_close(
            &format!("attention {shape:?}"),
            &f64s(&got),
            &want,
            TOL,
            TOL,
        );

        // packed per position: element (b, t, part, h, c), output (b, t, h, c)
        let at = |b_: usize, h_: usize, t_: usize, c: usize| ((b_ * h + h_) * t + t_) * dh + c;
        let mut packed = vec![0.0; 3 * n];
        let mut want_packed = vec![0.0; n];
        for b_ in 0..b {
            for t_ in 0..t {
                for h_ in 0..h {
                    for c in 0..dh {
                        let row = ((b_ * t + t_) * 3 * h + h_) * dh + c;
                        packed[row] = q[at(b_, h_, t_, c)];
                        packed[row + h * dh] = k[at(b_, h_, t_, c)];
                        packed[row + 2 * h * dh] = v[at(b_, h_, t_, c)];
                        want_packed[((b_ * t + t_) * h + h_) * dh + c] = want[at(b_, h_, t_, c)];
                    }
                }
            }
        }
        let got = tensor(&packed, &[b, t, 3, h, dh])
            .causal_attention_packed()
            .expect("packed attention");
        assert_close(
            &format!("packed attention {shape:?}"),
            &f64s(&got),
            &want_packed,
            TOL,
            TOL,
        );
    }
}

// ---- the product with a bias ------------------------------------------------------------------

/// `matmul_bias` against `y[b][i][j] = Σ_c x[b][i][c]·w[c][j] + bias[j]`, summed term by term in
/// f64, for 2-D and batched x (and k = 0, where y is the bias alone).
#[test]
fn matmul_bias_matches_its_definition() {
    for case in 0..6u64 {
        let mut rng = rng_for(17, case);
        let (batch, m, k, n) = (
            1 + case as usize % 3,
            1 + (case as usize * 5) % 7,
            (case as usize * 3) % 6,
            1 + (case as usize * 7) % 5,
        );
        let (x, w, bias) = (
            uniform(&mut rng, batch * m * k, -2.0, 2.0),
            uniform(&mut rng, k * n, -2.0, 2.0),
            uniform(&mut rng, n, -2.0, 2.0),
        );
        let mut want = vec![0.0; batch * m * n];
        for b in 0..batch {
            for i in 0..m {
                for j in 0..n {
                    let mut s = 0.0;
                    for c in 0..k {
                        s += x[(b * m + i) * k + c] * w[c * n + j];
                    }
                    want[(b * m + i) * n + j] = s + bias[j];
                }
            }
        }
        let got = tensor(&x, &[batch, m, k])
            .matmul_bias(&tensor(&w, &[k, n]), &tensor(&bias, &[n]))
            .expect("matmul_bias");
        assert_eq!(got.shape(), &[batch, m, n]);
        assert_close(
            &format!("matmul_bias [{batch}, {m}, {k}]·[{k}, {n}]"),
            &f64s(&got),
            &want,
            TOL,
            TOL,
        );
    }
}

/// `matmul_add` against `y[b][i][j] = r[b][i][j] + (Σ_c x[b][i][c]·w[c][j] + bias[j])`, summed
/// term by term in f64, with and without the bias, for 2-D and batched x (and k = 0).
#[test]
fn matmul_add_matches_its_definition() {
    for case in 0..8u64 {
        let mut rng = rng_for(19, case);
        let c = case as usize;
        let (batch, m, k, n) = (1 + c % 3, 1 + (c * 5) % 7, (c * 3) % 6, 1 + (c * 7) % 5);
        let with_bias = case % 2 == 0;
        let (x, w, bias, r) = (
            uniform(&mut rng, batch * m * k, -2.0, 2.0),
            uniform(&mut rng, k * n, -2.0, 2.0),
            uniform(&mut rng, n, -2.0, 2.0),
            uniform(&mut rng, batch * m * n, -2.0, 2.0),
        );
        let mut want = vec![0.0; batch * m * n];
        for b in 0..batch {
            for i in 0..m {
                for j in 0..n {
                    let mut s = 0.0;
                    for c in 0..k {
                        s += x[(b * m + i) * k + c] * w[c * n + j];
                    }
                    let at = (b * m + i) * n + j;
                    want[at] = r[at] + (s + if with_bias { bias[j] } else { 0.0 });
                }
            }
        }
        let bias = tensor(&bias, &[n]);
        let got = tensor(&x, &[batch, m, k])
            .matmul_add(
                &tensor(&w, &[k, n]),
                with_bias.then_some(&bias),
                &tensor(&r, &[batch, m, n]),
            )
            .expect("matmul_add");
        assert_eq!(got.shape(), &[batch, m, n]);
        assert_close(
            &format!("matmul_add [{batch}, {m}, {k}]·[{k}, {n}], bias {with_bias}"),
            &f64s(&got),
            &want,
            TOL,
            TOL,
        );
    }
}

/// `matmul_t` against `y[b][i][j] = Σ_c x[b][i][c]·e[j][c]`, summed term by term in f64.
#[test]
fn matmul_t_matches_its_definition() {
    for case in 0..5u64 {
        let mut rng = rng_for(18, case);
        let c = case as usize;
        let (batch, m, k, n) = (1 + c % 2, 1 + (c * 5) % 7, 1 + (c * 3) % 6, 1 + (c * 7) % 5);
        let (x, e) = (
            uniform(&mut rng, batch * m * k, -2.0, 2.0),
            uniform(&mut rng, n * k, -2.0, 2.0),
        );
        let mut want = vec![0.0; batch * m * n];
        for b in 0..batch {
            for i in 0..m {
                for j in 0..n {
                    want[(b * m + i) * n + j] =
                        (0..k).map(|c| x[(b * m + i) * k + c] * e[j * k + c]).sum();
                }
            }
        }
        let got = tensor(&x, &[batch, m, k])
            .matmul_t(&tensor(&e, &[n, k]))
            .expect("matmul_t");
        assert_eq!(got.shape(), &[batch, m, n]);
        assert_close(
            &format!("matmul_t [{batch}, {m}, {k}]·[{n}, {k}]ᵀ"),
            &f64s(&got),
            &want,
            TOL,
            TOL,
        );
    }
}

// ---- layer norm ----------------------------------------------------------------------------

/// Layer norm of each row of `dim` values: `μ = Σ x_j / dim`, `σ² = Σ (x_j − μ)² / dim`,
/// `y_j = (x_j − μ) / √(σ² + ε) · γ_j + β_j`.
fn layer_norm_reference(x: &[f64], gamma: &[f64], beta: &[f64], dim: usize, eps: f64) -> Vec<f64> {
    let mut y = vec![0.0; x.len()];
    for (row, out) in x.chunks(dim).zip(y.chunks_mut(dim)) {
        let mean = row.iter().sum::<f64>() / dim as f64;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / dim as f64;
        let denom = (var + eps).sqrt();
        for j in 0..dim {
            out[j] = (row[j] - mean) / denom * gamma[j] + beta[j];
        }
    }
    y
}

#[test]
fn layer_norm_matches_its_definition() {
    for case in 0..CASES {
        let mut rng = rng_for(2, case);
        let rows = rng.random_range(1..=40);
        let dim = rng.random_range(1..=70);
        // ε comparable to the variance sometimes, so where it enters matters
        let eps = [1e-5, 0.1, 1.0][case as usize % 3];
        let offset = rng.random_range(-5.0..5.0);
        let x = uniform(&mut rng, rows * dim, offset - 1.0, offset + 1.0);
        let gamma = uniform(&mut rng, dim, 0.5, 1.5);
        let beta = uniform(&mut rng, dim, -0.5, 0.5);
        let got = tensor(&x, &[rows, dim])
            .layer_norm(&tensor(&gamma, &[dim]), &tensor(&beta, &[dim]), eps)
            .expect("layer norm");
        let want = layer_norm_reference(&x, &gamma, &beta, dim, eps);
        assert_close(
            &format!("layer norm [{rows}, {dim}] eps {eps}"),
            &f64s(&got),
            &want,
            TOL,
            TOL,
        );
    }
}

// ---- cross-entropy -------------------------------------------------------------------------

/// Cross-entropy of each row: `ℓ_n = ln Σ_c e^{x_nc} − x_{n,t_n}` (the log-sum-exp formed with
/// the row maximum subtracted).
fn cross_entropy_reference(x: &[f64], targets: &[i32], classes: usize) -> Vec<f64> {
    x.chunks(classes)
        .zip(targets)
        .map(|(row, &t)| {
            let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + row.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
            lse - row[t as usize]
        })
        .collect()
}

#[test]
fn cross_entropy_matches_its_definition() {
    for case in 0..CASES {
        let mut rng = rng_for(3, case);
        let (rows, classes) = (rng.random_range(1..=50), rng.random_range(1..=120));
        let offset = rng.random_range(-30.0..30.0);
        let x = uniform(&mut rng, rows * classes, offset - 4.0, offset + 4.0);
        let t: Vec<i32> = (0..rows)
            .map(|_| rng.random_range(0..classes as i32))
            .collect();
        let want = cross_entropy_reference(&x, &t, classes);
        let logits = tensor(&x, &[rows, classes]);
        let targets = indices(&t, &[rows]);
        let per_row = logits.cross_entropy_per_row(&targets).expect("per row");
        let what = format!("cross-entropy [{rows}, {classes}]");
        assert_close(&what, &f64s(&per_row), &want, TOL, TOL);
        let mean = want.iter().sum::<f64>() / rows as f64;
        let got = logits.cross_entropy(&targets).expect("mean");
        assert_close(&what, &f64s(&got), &[mean], TOL, TOL);
    }
}

// ---- mean squared error ----------------------------------------------------------------------

/// `mean_i (x_i − t_i)²` and its gradient with respect to `x`, `(2/N)(x_i − t_i)`, term by term.
fn mse_reference(x: &[f64], t: &[f64]) -> (f64, Vec<f64>) {
    let n = x.len() as f64;
    let loss = x.iter().zip(t).map(|(a, b)| (a - b) * (a - b)).sum::<f64>() / n;
    (
        loss,
        x.iter().zip(t).map(|(a, b)| 2.0 * (a - b) / n).collect(),
    )
}

/// The fused `Tensor::mse` (one CPU pass each way, blocks of 65,536 summed in parallel) against
/// its definition, over sizes up to three blocks, with the gradient of both operands.
#[test]
fn mse_matches_its_definition() {
    for case in 0..CASES {
        let mut rng = rng_for(17, case);
        let n = match case % 3 {
            0 => rng.random_range(1..=40),
            1 => rng.random_range(1000..=5000),
            _ => rng.random_range(65_536..=200_000),
        };
        let shape = if n % 2 == 0 { vec![2, n / 2] } else { vec![n] };
        let (x, t) = (
            uniform(&mut rng, n, -3.0, 3.0),
            uniform(&mut rng, n, -3.0, 3.0),
        );
        let (loss, dx) = mse_reference(&x, &t);
        let (xt, tt) = (
            tensor(&x, &shape).with_grad().unwrap(),
            tensor(&t, &shape).with_grad().unwrap(),
        );
        let got = xt.mse(&tt).expect("mse");
        let what = format!("mse of {n}");
        assert_eq!(got.shape(), &[] as &[usize], "{what}: a 0-d loss");
        assert_close(&what, &f64s(&got), &[loss], TOL, TOL);
        got.backward().expect("backward");
        let dt: Vec<f64> = dx.iter().map(|v| -v).collect();
        assert_close(
            &format!("{what}: dx"),
            &f64s(&xt.grad().unwrap()),
            &dx,
            TOL,
            TOL,
        );
        assert_close(
            &format!("{what}: dt"),
            &f64s(&tt.grad().unwrap()),
            &dt,
            TOL,
            TOL,
        );
    }
}

/// The fused `Tensor::softmax` (one kernel each way over rows of the last axis; another axis
/// is moved last and back) against its definition: each line along the axis is
/// `e^{x_j} / Σ_l e^{x_l}` (in the stable form of [`softmax_row`]), and the gradient for an
/// upstream `g` is the vector-Jacobian product with `∂y_i/∂x_j = y_i (δ_ij − y_j)`, summed
/// term by term. Shapes of rank 1–3 with lines up to 300 long, rows past the CPU's 64-row tasks,
/// logits up to ±1000 in some cases (past f64's e^709: the maximum must be subtracted).
#[test]
fn softmax_matches_its_definition() {
    for case in 0..CASES {
        let mut rng = rng_for(18, case);
        let rank = rng.random_range(1..=3);
        let mut shape: Vec<usize> = (0..rank).map(|_| rng.random_range(1..=9)).collect();
        let axis = rng.random_range(0..rank);
        match case % 3 {
            1 => shape[axis] = rng.random_range(100..=300),
            2 => shape[0] = rng.random_range(130..=200),
            _ => {}
        }
        let numel: usize = shape.iter().product();
        let scale = if case % 4 == 3 { 1000.0 } else { 4.0 };
        let x = uniform(&mut rng, numel, -scale, scale);
        let g = uniform(&mut rng, numel, -1.0, 1.0);
        let (len, inner) = (shape[axis], shape[axis + 1..].iter().product::<usize>());
        let outer = numel / (len * inner);
        let (mut y, mut dx) = (vec![0.0; numel], vec![0.0; numel]);
        for o in 0..outer {
            for i in 0..inner {
                let at = |j: usize| o * len * inner + j * inner + i;
                let line: Vec<f64> = (0..len).map(|j| x[at(j)]).collect();
                let p = softmax_row(&line);
                for j in 0..len {
                    y[at(j)] = p[j];
                    let jacobian = |i: usize| p[i] * (f64::from(i == j) - p[j]);
                    dx[at(j)] = (0..len).map(|i| g[at(i)] * jacobian(i)).sum();
                }
            }
        }
        let xt = tensor(&x, &shape).with_grad().unwrap();
        let got = xt.softmax(axis as isize).expect("softmax");
        let what = format!("softmax of {shape:?} along {axis}");
        assert_eq!(got.shape(), shape.as_slice(), "{what}");
        assert_close(&what, &f64s(&got), &y, TOL, TOL);
        got.mul(&tensor(&g, &shape))
            .and_then(|t| t.sum_all())
            .and_then(|l| l.backward())
            .expect("backward");
        let what = format!("{what}: dx");
        assert_close(&what, &f64s(&xt.grad().unwrap()), &dx, TOL, TOL);
    }
}

// ---- convolution and pooling ---------------------------------------------------------------

/// The sizes of a convolution or pooling case.
#[derive(Clone, Copy, Debug)]
struct Window {
    batch: usize,
    channels: usize,
    height: usize,
    width: usize,
    kh: usize,
    kw: usize,
    stride: usize,
    padding: usize,
}

impl Window {
    fn out_h(&self) -> usize {
        (self.height + 2 * self.padding - self.kh) / self.stride + 1
    }
    fn out_w(&self) -> usize {
        (self.width + 2 * self.padding - self.kw) / self.stride + 1
    }
    /// Input pixel `(c, y, x)` of image `b` at window offset `(ky, kx)` of output `(oy, ox)`,
    /// or None where the window lies on the padding.
    fn input_at(&self, oy: usize, ox: usize, ky: usize, kx: usize) -> Option<(usize, usize)> {
        let y = (oy * self.stride + ky).checked_sub(self.padding)?;
        let x = (ox * self.stride + kx).checked_sub(self.padding)?;
        (y < self.height && x < self.width).then_some((y, x))
    }
}

/// Cross-correlation of one image `x` `[C, H, W]` with weights `w` `[OC, C, KH, KW]`:
/// `y[o, oy, ox] = Σ_{c, ky, kx} x[c, oy·s + ky − p, ox·s + kx − p] · w[o, c, ky, kx]`, the
/// pixels outside the image (the padding) counting as 0.
fn conv_image_reference(x: &[f64], w: &[f64], oc: usize, g: &Window) -> Vec<f64> {
    let (c, h, wd) = (g.channels, g.height, g.width);
    let (oh, ow) = (g.out_h(), g.out_w());
    let mut y = vec![0.0; oc * oh * ow];
    for o in 0..oc {
        for oy in 0..oh {
            for ox in 0..ow {
                let mut acc = 0.0;
                for ci in 0..c {
                    for ky in 0..g.kh {
                        for kx in 0..g.kw {
                            if let Some((iy, ix)) = g.input_at(oy, ox, ky, kx) {
                                acc += x[(ci * h + iy) * wd + ix]
                                    * w[((o * c + ci) * g.kh + ky) * g.kw + kx];
                            }
                        }
                    }
                }
                y[(o * oh + oy) * ow + ox] = acc;
            }
        }
    }
    y
}

/// A random convolution case whose kernel fits the padded image.
fn random_window(rng: &mut ChaCha8Rng) -> Window {
    let (kh, kw): (usize, usize) = (rng.random_range(1..=3), rng.random_range(1..=3));
    let padding: usize = rng.random_range(0..=2);
    let min_h = kh.saturating_sub(2 * padding).max(1);
    let min_w = kw.saturating_sub(2 * padding).max(1);
    Window {
        batch: rng.random_range(1..=3),
        channels: rng.random_range(1..=3),
        height: rng.random_range(min_h..=min_h + 7),
        width: rng.random_range(min_w..=min_w + 7),
        kh,
        kw,
        stride: rng.random_range(1..=3),
        padding,
    }
}

#[test]
fn conv2d_matches_its_definition() {
    for case in 0..CASES {
        let mut rng = rng_for(4, case);
        let g = random_window(&mut rng);
        let oc = rng.random_range(1..=4);
        let image = g.channels * g.height * g.width;
        let x = uniform(&mut rng, g.batch * image, -1.0, 1.0);
        let w = uniform(&mut rng, oc * g.channels * g.kh * g.kw, -1.0, 1.0);
        let bias = uniform(&mut rng, oc, -1.0, 1.0);
        let mut want = Vec::new();
        for b in 0..g.batch {
            let y = conv_image_reference(&x[b * image..(b + 1) * image], &w, oc, &g);
            let plane = g.out_h() * g.out_w();
            want.extend(y.iter().enumerate().map(|(i, v)| v + bias[i / plane]));
        }
        let got = tensor(&x, &[g.batch, g.channels, g.height, g.width])
            .conv2d(
                &tensor(&w, &[oc, g.channels, g.kh, g.kw]),
                Some(&tensor(&bias, &[oc])),
                g.stride,
                g.padding,
            )
            .expect("conv2d");
        assert_eq!(got.shape(), &[g.batch, oc, g.out_h(), g.out_w()], "{g:?}");
        assert_close(&format!("conv2d {g:?}"), &f64s(&got), &want, TOL, TOL);
    }
}

#[test]
fn grouped_conv2d_matches_its_definition() {
    for case in 0..CASES {
        let mut rng = rng_for(5, case);
        let g = random_window(&mut rng);
        let (banks, oc) = (rng.random_range(1..=3), rng.random_range(1..=3));
        let image = g.channels * g.height * g.width;
        let bank_len = oc * g.channels * g.kh * g.kw;
        let x = uniform(&mut rng, g.batch * image, -1.0, 1.0);
        let w = uniform(&mut rng, banks * bank_len, -1.0, 1.0);
        // some images get a bank outside 0..G: their output is zeros
        let bank: Vec<i32> = (0..g.batch)
            .map(|_| rng.random_range(-1..=banks as i32))
            .collect();
        let plane = oc * g.out_h() * g.out_w();
        let mut want = Vec::new();
        for (b, &e) in bank.iter().enumerate() {
            if e < 0 || e as usize >= banks {
                want.extend(vec![0.0; plane]);
            } else {
                let wb = &w[e as usize * bank_len..(e as usize + 1) * bank_len];
                want.extend(conv_image_reference(
                    &x[b * image..(b + 1) * image],
                    wb,
                    oc,
                    &g,
                ));
            }
        }
        let got = tensor(&x, &[g.batch, g.channels, g.height, g.width])
            .grouped_conv2d(
                &tensor(&w, &[banks, oc, g.channels, g.kh, g.kw]),
                &indices(&bank, &[g.batch]),
                g.stride,
                g.padding,
            )
            .expect("grouped conv2d");
        let what = format!("grouped conv2d {g:?} banks {bank:?}");
        assert_close(&what, &f64s(&got), &want, TOL, TOL);
    }
}

/// Max or average pooling of each `[H, W]` plane over `kernel × kernel` windows moved by
/// `stride` on the image padded by `padding` on every side: the maximum of the window's pixels
/// inside the image (the padding never wins), or their sum divided by `kernel²` (the padding
/// counts as zeros in the mean).
fn pool_reference(x: &[f64], planes: usize, g: &Window, max: bool) -> Vec<f64> {
    let (h, w) = (g.height, g.width);
    let (oh, ow) = (g.out_h(), g.out_w());
    let mut y = Vec::with_capacity(planes * oh * ow);
    for p in 0..planes {
        for oy in 0..oh {
            for ox in 0..ow {
                let (mut best, mut sum) = (f64::NEG_INFINITY, 0.0);
                for ky in 0..g.kh {
                    for kx in 0..g.kw {
                        if let Some((iy, ix)) = g.input_at(oy, ox, ky, kx) {
                            let v = x[(p * h + iy) * w + ix];
                            best = best.max(v);
                            sum += v;
                        }
                    }
                }
                y.push(if max {
                    best
                } else {
                    sum / (g.kh * g.kw) as f64
                });
            }
        }
    }
    y
}

#[test]
fn pooling_matches_its_definition() {
    for case in 0..2 * CASES {
        let mut rng = rng_for(6, case);
        let kernel: usize = rng.random_range(1..=4);
        let padding = rng.random_range(0..=kernel / 2);
        let min = kernel.saturating_sub(2 * padding).max(1);
        let g = Window {
            batch: rng.random_range(1..=2),
            channels: rng.random_range(1..=3),
            height: rng.random_range(min..=min + 8),
            width: rng.random_range(min..=min + 8),
            kh: kernel,
            kw: kernel,
            stride: rng.random_range(1..=3),
            padding,
        };
        let planes = g.batch * g.channels;
        // all values negative: a padding counted as a 0 in the maximum would win
        let x = uniform(&mut rng, planes * g.height * g.width, -2.0, -0.1);
        let input = tensor(&x, &[g.batch, g.channels, g.height, g.width]);
        for max in [true, false] {
            let got = match (max, padding) {
                (true, 0) if case % 2 == 0 => input.max_pool2d(kernel, g.stride),
                (false, 0) if case % 2 == 0 => input.avg_pool2d(kernel, g.stride),
                (true, _) => input.max_pool2d_padded(kernel, g.stride, padding),
                (false, _) => input.avg_pool2d_padded(kernel, g.stride, padding),
            }
            .expect("pooling");
            let want = pool_reference(&x, planes, &g, max);
            let what = format!("{} pool {g:?}", if max { "max" } else { "avg" });
            assert_close(&what, &f64s(&got), &want, TOL, TOL);
        }
    }
}

// ---- topk_gate -----------------------------------------------------------------------------

/// A top-k gate on one row of logits `o` with selection scores `h`: `probs = softmax(o)`;
/// `idx` = the `k` largest `h`, descending (ties to the lowest index); weights
/// `softmax(h[idx])` over the selected (renormalised) or `probs[idx]` (not).
fn topk_gate_reference(
    o: &[f64],
    h: &[f64],
    k: usize,
    renormalise: bool,
) -> (Vec<f64>, Vec<i32>, Vec<f64>) {
    let probs = softmax_row(o);
    let idx: Vec<usize> = descending_order(h)[..k].to_vec();
    let weights = if renormalise {
        softmax_row(&idx.iter().map(|&i| h[i]).collect::<Vec<_>>())
    } else {
        idx.iter().map(|&i| probs[i]).collect()
    };
    (probs, idx.iter().map(|&i| i as i32).collect(), weights)
}

#[test]
fn topk_gate_matches_its_definition() {
    for case in 0..CASES {
        let mut rng = rng_for(7, case);
        let (t, n) = (rng.random_range(1..=30), rng.random_range(1..=40));
        let k = rng.random_range(1..=n);
        let rows: Vec<Vec<f64>> = (0..t).map(|_| spread_row(&mut rng, n, -3.0, 0.1)).collect();
        let noisy: Vec<Vec<f64>> = (0..t).map(|_| spread_row(&mut rng, n, -3.0, 0.1)).collect();
        let o = tensor(&rows.concat(), &[t, n]);
        let h = tensor(&noisy.concat(), &[t, n]);
        for (renormalise, scores) in [(true, None), (true, Some(&h)), (false, None)] {
            let gate = o.topk_gate(scores, k, renormalise).expect("topk_gate");
            let (mut probs, mut idx, mut weights) = (vec![], vec![], vec![]);
            for (row, noisy_row) in rows.iter().zip(&noisy) {
                let sel = if scores.is_some() { noisy_row } else { row };
                let (p, i, w) = topk_gate_reference(row, sel, k, renormalise);
                probs.extend(p);
                idx.extend(i);
                weights.extend(w);
            }
            let what = format!("topk_gate [{t}, {n}] k {k} renormalise {renormalise}");
            assert_close(&what, &f64s(&gate.probs), &probs, TOL, TOL);
            assert_eq!(i32s(&gate.idx), idx, "{what}: selected experts");
            assert_close(&what, &f64s(&gate.weights), &weights, TOL, TOL);
        }
    }
}

// ---- grouped matmul ------------------------------------------------------------------------

/// The grouped matmul with bias: `y[r, j] = Σ_i x[r, i]·W[e_r, i, j] + b[e_r, j]`, zeros for a
/// row whose expert `e_r` is outside `0..n`. `x` `[R, k]`, `W` `[n, k, m]`, `b` `[n, m]`.
fn grouped_matmul_reference(
    x: &[f64],
    w: &[f64],
    bias: Option<&[f64]>,
    row_expert: &[i32],
    (k, m, n): (usize, usize, usize),
) -> Vec<f64> {
    let mut y = vec![0.0; row_expert.len() * m];
    for (r, &e) in row_expert.iter().enumerate() {
        if e < 0 || e as usize >= n {
            continue;
        }
        let e = e as usize;
        for j in 0..m {
            let mut acc = bias.map_or(0.0, |b| b[e * m + j]);
            for i in 0..k {
                acc += x[r * k + i] * w[(e * k + i) * m + j];
            }
            y[r * m + j] = acc;
        }
    }
    y
}

#[test]
fn grouped_matmul_with_bias_matches_its_definition() {
    for case in 0..CASES {
        let mut rng = rng_for(8, case);
        let (n, k, m) = (
            rng.random_range(1..=6),
            rng.random_range(1..=40),
            rng.random_range(1..=40),
        );
        // rows sorted by expert (some experts get none), then a few rows for no expert (n)
        let mut row_expert: Vec<i32> = Vec::new();
        let mut offsets = vec![0i32];
        for e in 0..n {
            let count = if rng.random_bool(0.3) {
                0
            } else {
                rng.random_range(1..=20)
            };
            row_expert.extend(vec![e as i32; count]);
            offsets.push(row_expert.len() as i32);
        }
        row_expert.extend(vec![n as i32; rng.random_range(0..=3)]);
        let rows = row_expert.len();
        let x = uniform(&mut rng, rows * k, -1.0, 1.0);
        let w = uniform(&mut rng, n * k * m, -1.0, 1.0);
        let b = uniform(&mut rng, n * m, -1.0, 1.0);
        let (xt, wt, bt) = (
            tensor(&x, &[rows, k]),
            tensor(&w, &[n, k, m]),
            tensor(&b, &[n, m]),
        );
        let (re, off) = (indices(&row_expert, &[rows]), indices(&offsets, &[n + 1]));
        let what = format!("grouped matmul R {rows} k {k} m {m} n {n}");
        let got = xt
            .grouped_matmul_with_bias(&wt, Some(&bt), &re, &off)
            .expect("grouped matmul with bias");
        let want = grouped_matmul_reference(&x, &w, Some(&b), &row_expert, (k, m, n));
        assert_close(&what, &f64s(&got), &want, TOL, TOL);
        let got = xt.grouped_matmul(&wt, &re, &off).expect("grouped matmul");
        let want = grouped_matmul_reference(&x, &w, None, &row_expert, (k, m, n));
        assert_close(&what, &f64s(&got), &want, TOL, TOL);
    }
}

// ---- GELU ----------------------------------------------------------------------------------

/// GELU's tanh form and its derivative: with `u = √(2/π)(x + 0.044715x³)`,
/// `gelu(x) = ½x(1 + tanh u)` and
/// `gelu'(x) = ½(1 + tanh u) + ½x(1 − tanh² u)·√(2/π)(1 + 3·0.044715x²)`.
fn gelu_reference(x: f64) -> (f64, f64) {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    let u = c * (x + 0.044715 * x * x * x);
    let th = u.tanh();
    let value = 0.5 * x * (1.0 + th);
    let slope = 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * c * (1.0 + 3.0 * 0.044715 * x * x);
    (value, slope)
}

#[test]
fn gelu_and_its_fused_slope_match_the_definition() {
    for case in 0..CASES {
        let mut rng = rng_for(9, case);
        let len = rng.random_range(1..=3000);
        let x = uniform(&mut rng, len, -6.0, 6.0);
        let value: Vec<f64> = x.iter().map(|&v| gelu_reference(v).0).collect();
        // f64: the plain elementwise kernel
        let got = tensor(&x, &[len]).gelu().expect("gelu");
        assert_close(&format!("gelu f64 [{len}]"), &f64s(&got), &value, TOL, TOL);
        // f32 with a gradient wanted: the CPU keeps the slope its forward pass computes
        let x32 = tensor(&x, &[len])
            .to_dtype(DType::F32)
            .expect("f32")
            .with_grad()
            .expect("a leaf");
        let y = x32.gelu().expect("gelu f32");
        y.sum_all().expect("sum").backward().expect("backward");
        let x_rounded = f64s(&x32);
        let (value32, slope32): (Vec<f64>, Vec<f64>) =
            x_rounded.iter().map(|&v| gelu_reference(v)).unzip();
        let what = format!("gelu f32 [{len}]");
        assert_close(&format!("{what} value"), &f64s(&y), &value32, 2e-6, 2e-6);
        let grad = x32.grad().expect("gradient");
        assert_close(&format!("{what} slope"), &f64s(&grad), &slope32, 2e-6, 2e-6);
    }
}

// ---- softsign ------------------------------------------------------------------------------

/// Softsign and its derivative: `softsign(x) = x / (1 + |x|)`, `softsign'(x) = 1 / (1 + |x|)²`.
fn softsign_reference(x: f64) -> (f64, f64) {
    let d = 1.0 + x.abs();
    (x / d, 1.0 / (d * d))
}

#[test]
fn softsign_matches_its_definition() {
    for case in 0..CASES {
        let mut rng = rng_for(16, case);
        let len = rng.random_range(1..=3000);
        let scale = [1.0, 10.0, 1e4][case as usize % 3];
        let x = uniform(&mut rng, len, -scale, scale);
        let (value, slope): (Vec<f64>, Vec<f64>) = x.iter().map(|&v| softsign_reference(v)).unzip();
        let leaf = tensor(&x, &[len]).with_grad().expect("a leaf");
        let y = leaf.softsign().expect("softsign");
        assert_close(&format!("softsign [{len}]"), &f64s(&y), &value, TOL, TOL);
        y.sum_all().expect("sum").backward().expect("backward");
        let grad = leaf.grad().expect("gradient");
        assert_close(
            &format!("softsign' [{len}]"),
            &f64s(&grad),
            &slope,
            TOL,
            TOL,
        );
    }
}

// ---- index_scatter -------------------------------------------------------------------------

/// `index_scatter` along `axis` of a tensor viewed as `[outer, m, inner]`: output
/// `[outer, len, inner]` with `out[o, r, i] = Σ_{j : idx[j] = r} x[o, j, i]` (0 where no `j`
/// points at `r`).
fn index_scatter_reference(
    x: &[f64],
    idx: &[i32],
    (outer, m, inner): (usize, usize, usize),
    len: usize,
) -> Vec<f64> {
    let mut y = vec![0.0; outer * len * inner];
    for o in 0..outer {
        for (j, &r) in idx.iter().enumerate().take(m) {
            for i in 0..inner {
                y[(o * len + r as usize) * inner + i] += x[(o * m + j) * inner + i];
            }
        }
    }
    y
}

#[test]
fn index_scatter_matches_its_definition() {
    for case in 0..2 * CASES {
        let mut rng = rng_for(10, case);
        let rank = rng.random_range(1..=3);
        let shape: Vec<usize> = (0..rank).map(|_| rng.random_range(1..=7)).collect();
        let axis = rng.random_range(0..rank);
        let m = shape[axis];
        let outer: usize = shape[..axis].iter().product();
        let inner: usize = shape[axis + 1..].iter().product();
        // some targets hit twice, some never
        let len = rng.random_range(1..=m + 2);
        let idx: Vec<i32> = (0..m).map(|_| rng.random_range(0..len as i32)).collect();
        let x = uniform(&mut rng, outer * m * inner, -1.0, 1.0);
        let got = tensor(&x, &shape)
            .index_scatter(axis as isize, &indices(&idx, &[m]), len)
            .expect("index_scatter");
        let want = index_scatter_reference(&x, &idx, (outer, m, inner), len);
        let what = format!("index_scatter {shape:?} axis {axis} idx {idx:?} len {len}");
        assert_close(&what, &f64s(&got), &want, TOL, TOL);
    }
}

// ---- weighted_index_scatter ----------------------------------------------------------------

/// The weighted MoE combine from its definition: `y[t] = Σ_{r : idx[r] = t} w[r]·rows[r]`.
fn weighted_index_scatter_reference(
    rows: &[f64],
    w: &[f64],
    idx: &[i32],
    d: usize,
    len: usize,
) -> Vec<f64> {
    let mut y = vec![0.0; len * d];
    for (r, &t) in idx.iter().enumerate() {
        for i in 0..d {
            y[t as usize * d + i] += w[r] * rows[r * d + i];
        }
    }
    y
}

/// Random `(rows [a, d], w [a], idx [a] into len)` for case `case` of test `test`.
fn weighted_combine_case(test: u64, case: u64) -> (Vec<f64>, Vec<f64>, Vec<i32>, [usize; 3]) {
    let mut rng = rng_for(test, case);
    let (a, d) = (rng.random_range(1..=300), rng.random_range(1..=40));
    // some tokens get several rows, some none
    let len = rng.random_range(1..=a + 2);
    let idx: Vec<i32> = (0..a).map(|_| rng.random_range(0..len as i32)).collect();
    let rows = uniform(&mut rng, a * d, -1.0, 1.0);
    let w = uniform(&mut rng, a, 0.0, 1.0);
    (rows, w, idx, [a, d, len])
}

#[test]
fn weighted_index_scatter_matches_its_definition() {
    for case in 0..2 * CASES {
        let (rows, w, idx, [a, d, len]) = weighted_combine_case(11, case);
        let got = tensor(&rows, &[a, d])
            .weighted_index_scatter(&tensor(&w, &[a]), &indices(&idx, &[a]), len)
            .expect("weighted_index_scatter");
        let want = weighted_index_scatter_reference(&rows, &w, &idx, d, len);
        let what = format!("weighted_index_scatter [{a}, {d}] onto {len}");
        assert_close(&what, &f64s(&got), &want, TOL, TOL);
    }
}

/// The MoE block's output from its definition, `y[t] = h[t] + Σ_j w[t·k + j]·rows[slots[t·k +
/// j]]` (token t's k rows, the weights per slot), against `weighted_index_scatter_per_slot_add`.
#[test]
fn weighted_index_scatter_per_slot_add_matches_its_definition() {
    for case in 0..CASES {
        let mut rng = rng_for(12, case);
        let (len, k, d) = (
            rng.random_range(1..=60),
            rng.random_range(1..=4),
            rng.random_range(1..=40),
        );
        let a = len * k;
        // each output's k rows: a shuffle of 0..a, k to an output
        let mut slots: Vec<i32> = (0..a as i32).collect();
        for i in (1..a).rev() {
            slots.swap(i, rng.random_range(0..=i));
        }
        let (mut idx, mut order) = (vec![0i32; a], vec![0i32; a]);
        for (s, &r) in slots.iter().enumerate() {
            idx[r as usize] = (s / k) as i32;
            order[r as usize] = s as i32;
        }
        let rows = uniform(&mut rng, a * d, -1.0, 1.0);
        let w = uniform(&mut rng, a, 0.0, 1.0);
        let h = uniform(&mut rng, len * d, -1.0, 1.0);
        let got = tensor(&rows, &[a, d])
            .weighted_index_scatter_per_slot_add(
                &tensor(&w, &[a]),
                &indices(&idx, &[a]),
                len,
                &indices(&slots, &[a]),
                &indices(&order, &[a]),
                &tensor(&h, &[len, d]),
            )
            .expect("weighted_index_scatter_per_slot_add");
        let mut want = h.clone();
        for t in 0..len {
            for j in 0..k {
                let (s, r) = (t * k + j, slots[t * k + j] as usize);
                for i in 0..d {
                    want[t * d + i] += w[s] * rows[r * d + i];
                }
            }
        }
        let what = format!("weighted_index_scatter_per_slot_add {len} × {k} rows of {d}");
        assert_close(&what, &f64s(&got), &want, TOL, TOL);
    }
}

/// The fused CPU kernels round as the composition they replace (`rows.mul(w)` then
/// `index_scatter`, and its backward rules), so a model trains to the same bits with either:
/// output and both gradients equal in f32, bit for bit.
#[test]
fn weighted_index_scatter_rounds_as_its_composition() {
    let f32t = |v: &[f64], shape: &[usize]| {
        Tensor::from_f32(v.iter().map(|&x| x as f32).collect(), shape, Device::cpu())
            .unwrap()
            .with_grad()
            .unwrap()
    };
    for case in 0..CASES {
        let (rows, w, idx, [a, d, len]) = weighted_combine_case(12, case);
        let up = uniform(&mut rng_for(13, case), len * d, -1.0, 1.0);
        let up = Tensor::from_f32(
            up.iter().map(|&x| x as f32).collect(),
            &[len, d],
            Device::cpu(),
        )
        .unwrap();
        let it = indices(&idx, &[a]);
        let run = |fused: bool| {
            let (x, wt) = (f32t(&rows, &[a, d]), f32t(&w, &[a]));
            let y = if fused {
                x.weighted_index_scatter(&wt, &it, len)
            } else {
                x.mul(&wt.reshape(&[a, 1]).unwrap())
                    .unwrap()
                    .index_scatter(0, &it, len)
            }
            .unwrap();
            y.mul(&up).unwrap().sum_all().unwrap().backward().unwrap();
            let grad = |t: &Tensor| t.grad().unwrap().to_vec_f32().unwrap();
            (y.to_vec_f32().unwrap(), grad(&x), grad(&wt))
        };
        assert_eq!(run(true), run(false), "[{a}, {d}] onto {len}");
    }
}

#[test]
fn weighted_index_scatter_names_what_is_wrong() {
    let rows = tensor(&[1.0; 6], &[3, 2]);
    let w = tensor(&[1.0; 3], &[3]);
    let err = |r: moegrad::Result<Tensor>| r.expect_err("must fail").to_string();
    let e = err(rows.weighted_index_scatter(&w, &indices(&[0, 1, 5], &[3]), 2));
    assert!(e.contains("index 5") && e.contains("size 2"), "{e}");
    let e =
        err(rows.weighted_index_scatter(&tensor(&[1.0; 2], &[2]), &indices(&[0, 1, 1], &[3]), 2));
    assert!(e.contains("[3, 2]") && e.contains("[2]"), "{e}");
    let e = err(rows.weighted_index_scatter(&w, &tensor(&[0.0; 3], &[3]), 2));
    assert!(e.contains("i32"), "{e}");
}

// ---- routers: shared pieces ----------------------------------------------------------------

/// A router configuration for `d`-wide tokens, `n` experts, `k`, with the options given.
fn router_config(d: usize, n: usize, k: usize, options: &[(&str, &str)]) -> RouterConfig {
    let mut cfg = RouterConfig::new(d, n, k);
    cfg.seed = 7;
    for (key, value) in options {
        cfg.options.insert(key.to_string(), value.to_string());
    }
    cfg
}

/// Replaces every parameter of `router` with spread-out f64 values, so tokens get distinct,
/// far-from-uniform logits.
fn spread_params(router: &dyn Router, rng: &mut ChaCha8Rng, spread: f64) {
    router.visit_params("", &mut |_, p| {
        let shape = p.get().shape().to_vec();
        let n = shape.iter().product();
        p.set(tensor(&uniform(rng, n, -spread, spread), &shape))
            .expect("same shape");
    });
}

/// A routing read back: per assignment its token, expert, weight and validity.
struct Assignments {
    token: Vec<i32>,
    expert: Vec<i32>,
    weight: Vec<f64>,
    valid: Vec<f64>,
}

fn assignments(r: &Routing) -> Assignments {
    Assignments {
        token: i32s(&r.token),
        expert: i32s(&r.expert),
        weight: f64s(&r.weight),
        valid: f64s(&r.valid),
    }
}

/// Rows of a `[T, n]` host matrix.
fn rows_of(values: &[f64], n: usize) -> Vec<Vec<f64>> {
    values.chunks(n).map(|r| r.to_vec()).collect()
}

// ---- MOESART -------------------------------------------------------------------------------

/// MOESART's trimmed-lasso penalty without λ: the mean over tokens of the mass of the `n − k`
/// smallest entries of each token's gate `g_t` (`1 − top-k mass`).
fn trimmed_lasso_reference(g: &[Vec<f64>], k: usize) -> f64 {
    let mut total = 0.0;
    for row in g {
        let order = descending_order(row);
        total += order[k..].iter().map(|&i| row[i]).sum::<f64>();
    }
    total / g.len() as f64
}

/// MOESART's combine weights of one token from the dense gate `g = softmax(o)`, the k drawn
/// experts, their counts `r`, validity (first occurrence) and the anchor slot `z`:
/// `i`: `g_i / Σ_{j∈s} g_j`; `ii`: `r_i g_i / Σ_{j∈s} r_j g_j`; `iii`: `r_i / k`; `eq3`: with
/// `D = r_z g_z + (k − r_z)/(k − 1)`, `r_z g_z / D` at the anchor and `r_i / ((k − 1) D)`
/// elsewhere (docs/routers.md, MOESART). Invalid (repeat) slots weigh 0.
fn moesart_weights_reference(
    strategy: MoesartStrategy,
    g: &[f64],
    experts: &[i32],
    counts: &[f64],
    valid: &[f64],
    anchor: usize,
) -> Vec<f64> {
    let k = experts.len();
    let gi = |slot: usize| g[experts[slot] as usize];
    let slots = || (0..k).filter(|&s| valid[s] > 0.5);
    let mut w = vec![0.0; k];
    match strategy {
        MoesartStrategy::I | MoesartStrategy::II => {
            let r = |s: usize| {
                if strategy == MoesartStrategy::II {
                    counts[s]
                } else {
                    1.0
                }
            };
            let z: f64 = slots().map(|s| r(s) * gi(s)).sum();
            for s in slots() {
                w[s] = r(s) * gi(s) / z;
            }
        }
        MoesartStrategy::III => {
            for s in slots() {
                w[s] = counts[s] / k as f64;
            }
        }
        MoesartStrategy::Eq3 => {
            let rz = counts[anchor];
            let d = rz * gi(anchor) + (k as f64 - rz) / (k as f64 - 1.0);
            for s in slots() {
                w[s] = if s == anchor {
                    rz * gi(anchor) / d
                } else {
                    counts[s] / ((k as f64 - 1.0) * d)
                };
            }
        }
    }
    w
}

#[test]
fn moesart_draws_weights_and_trimmed_lasso_match_their_definitions() {
    let strategies = [
        MoesartStrategy::I,
        MoesartStrategy::II,
        MoesartStrategy::III,
        MoesartStrategy::Eq3,
    ];
    for case in 0..CASES {
        let mut rng = rng_for(11, case);
        let (t, n) = (rng.random_range(1..=24), rng.random_range(2..=9));
        let k = rng.random_range(2..=n);
        let o: Vec<Vec<f64>> = (0..t).map(|_| spread_row(&mut rng, n, -2.0, 0.3)).collect();
        let g: Vec<Vec<f64>> = o.iter().map(|r| softmax_row(r)).collect();
        let logits = tensor(&o.concat(), &[t, n]);
        let what = format!("moesart T {t} n {n} k {k}");

        let got = MoesartRouter::trimmed_lasso(&tensor(&g.concat(), &[t, n]), k).expect("lasso");
        let want = trimmed_lasso_reference(&g, k);
        assert_close(
            &format!("{what}: trimmed lasso"),
            &f64s(&got),
            &[want],
            TOL,
            TOL,
        );

        let draws = [
            MoesartDraw::sample(&logits, k, false, 100 + case).expect("draw"),
            MoesartDraw::sample(&logits, k, true, 200 + case).expect("draw"),
            MoesartDraw::top_k(&logits, k).expect("top k"),
        ];
        for (which, draw) in ["without replacement", "with replacement", "top-k"]
            .iter()
            .zip(&draws)
        {
            let experts = i32s(&draw.experts);
            let (counts, valid, anchor) =
                (f64s(&draw.counts), f64s(&draw.valid), f64s(&draw.anchor));
            for s in strategies {
                let got = f64s(&s.weights(&logits, draw).expect("weights"));
                for tok in 0..t {
                    let slot = |v: &[f64]| v[tok * k..(tok + 1) * k].to_vec();
                    let ex = &experts[tok * k..(tok + 1) * k];
                    let (c, val, anc) = (slot(&counts), slot(&valid), slot(&anchor));
                    // the draw itself: r = how many slots chose the expert, valid = first
                    // occurrence, the anchor one valid slot
                    for j in 0..k {
                        let same = ex.iter().filter(|&&e| e == ex[j]).count() as f64;
                        let first = !ex[..j].contains(&ex[j]);
                        assert_eq!(c[j], same, "{what} {which}: count of slot {j}");
                        assert_eq!(val[j], f64::from(first), "{what} {which}: valid {j}");
                    }
                    let z: Vec<usize> = (0..k).filter(|&j| anc[j] == 1.0).collect();
                    assert_eq!(z.len(), 1, "{what} {which}: one anchor in {anc:?}");
                    assert_eq!(val[z[0]], 1.0, "{what} {which}: the anchor is valid");
                    if *which == "top-k" {
                        let top = &descending_order(&o[tok])[..k];
                        let top: Vec<i32> = top.iter().map(|&i| i as i32).collect();
                        assert_eq!(ex, &top[..], "{what}: top-k draw");
                    }
                    let want = moesart_weights_reference(s, &g[tok], ex, &c, &val, z[0]);
                    let w = &got[tok * k..(tok + 1) * k];
                    let label = format!("{what} {which} strategy {}: token {tok}", s.name());
                    assert_close(&label, w, &want, TOL, TOL);
                }
            }
        }

        // the router's auxiliary loss: λ · trimmed lasso of softmax(o), o = (x·A + b)/τ
        let lambda = 0.3;
        let cfg = router_config(5, n, k, &[("trimmed_lasso", "0.3"), ("tau", "0.7")]);
        let router = MoesartRouter::new(&cfg, Device::cpu()).expect("router");
        spread_params(&router, &mut rng, 2.0);
        let x = tensor(&uniform(&mut rng, t * 5, -1.0, 1.0), &[t, 5]);
        let o = rows_of(&f64s(&router.logits(&x).expect("logits")), n);
        let g: Vec<Vec<f64>> = o.iter().map(|r| softmax_row(r)).collect();
        let routing = router.route(&x).expect("route");
        let aux = routing.aux_loss.expect("a trimmed-lasso term");
        let want = lambda * trimmed_lasso_reference(&g, k);
        assert_close(&format!("{what}: aux loss"), &f64s(&aux), &[want], TOL, TOL);
    }
}

// ---- DSelect-k -----------------------------------------------------------------------------

/// DSelect-k's smooth-step of width γ: 0 for `t ≤ −γ/2`, 1 for `t ≥ γ/2`, and
/// `−(2/γ³)t³ + (3/(2γ))t + ½` between.
fn smooth_step_reference(t: f64, gamma: f64) -> f64 {
    if t <= -gamma / 2.0 {
        0.0
    } else if t >= gamma / 2.0 {
        1.0
    } else {
        -2.0 / gamma.powi(3) * t.powi(3) + 1.5 / gamma * t + 0.5
    }
}

/// One selector's distribution over the `2^m` codes: `r_e = Π_j (S(z_j) if bit j of e is set,
/// else 1 − S(z_j))`.
fn selector_reference(z: &[f64], gamma: f64) -> Vec<f64> {
    let m = z.len();
    (0..1usize << m)
        .map(|e| {
            (0..m)
                .map(|j| {
                    let s = smooth_step_reference(z[j], gamma);
                    if (e >> j) & 1 == 1 { s } else { 1.0 - s }
                })
                .product()
        })
        .collect()
}

/// The DSelect-k gate of one token from mixing logits `α` `[k]` and selector logits `z`
/// `[k, m]`: `q_code = Σ_i softmax(α)_i r^(i)_code`; with `n < 2^m`, `wrap` folds code `e ≥ n`
/// onto expert `e − n`, `penalty` drops them and adds `Σ_i 1 / (Σ_{e<n} r^(i)_e + 10⁻¹²)`.
/// Also the token's entropy term `Σ_i −Σ_e r^(i)_e ln(r^(i)_e + 10⁻⁶)`.
fn dselect_gate_reference(
    alpha: &[f64],
    z: &[f64],
    n: usize,
    gamma: f64,
    wrap: bool,
) -> (Vec<f64>, f64, f64) {
    let k = alpha.len();
    let m = z.len() / k;
    let codes = 1usize << m;
    let mix = softmax_row(alpha);
    let mut q_codes = vec![0.0; codes];
    let (mut penalty, mut entropy) = (0.0, 0.0);
    for i in 0..k {
        let r = selector_reference(&z[i * m..(i + 1) * m], gamma);
        for e in 0..codes {
            q_codes[e] += mix[i] * r[e];
            entropy -= r[e] * (r[e] + 1e-6).ln();
        }
        penalty += 1.0 / (r[..n].iter().sum::<f64>() + 1e-12);
    }
    let mut q = q_codes[..n].to_vec();
    if wrap {
        for e in n..codes {
            q[e - n] += q_codes[e];
        }
    }
    (q, penalty, entropy)
}

#[test]
fn dselect_k_gate_matches_its_definition() {
    for case in 0..CASES {
        let mut rng = rng_for(12, case);
        let (t, n) = (rng.random_range(1..=16), rng.random_range(2..=11));
        let k = rng.random_range(1..=n.min(4));
        let gamma = [1.0, 0.3, 4.0][case as usize % 3];
        let m = moegrad::moe::routers::selector_bits(n);
        let what = format!("dselect-k T {t} n {n} k {k} gamma {gamma}");

        // the smooth-step and the selectors, on logits both inside and outside (−γ/2, γ/2)
        let z = uniform(&mut rng, t * k * m, -gamma, gamma);
        let s = smooth_step(&tensor(&z, &[t, k, m]), gamma).expect("smooth step");
        let want: Vec<f64> = z.iter().map(|&v| smooth_step_reference(v, gamma)).collect();
        assert_close(&format!("{what}: smooth step"), &f64s(&s), &want, TOL, TOL);
        let r = selector_probs(&tensor(&z, &[t, k, m]), gamma).expect("selectors");
        let want: Vec<f64> = z
            .chunks(m)
            .flat_map(|zi| selector_reference(zi, gamma))
            .collect();
        assert_close(&format!("{what}: selectors"), &f64s(&r), &want, TOL, TOL);

        // the gate, and the route's weights and auxiliary loss, in both unused-code modes
        for unused in ["wrap", "penalty"] {
            let (entropy_w, xi) = (0.05, 0.01);
            let cfg = router_config(
                4,
                n,
                k,
                &[
                    ("gamma", &gamma.to_string()),
                    ("unused", unused),
                    ("entropy", "0.05"),
                    ("xi", "0.01"),
                ],
            );
            let router =
                DSelectKRouter::new(&cfg, DSelectKKind::PerExample, Device::cpu()).expect("router");
            spread_params(&router, &mut rng, gamma);
            let x = tensor(&uniform(&mut rng, t * 4, -1.0, 1.0), &[t, 4]);
            let (alpha, zt) = router.gate_logits(&x).expect("gate logits");
            let (alpha_h, z_h) = (f64s(&alpha), f64s(&zt));
            let (q, _, _) = router.gate(&alpha, &zt).expect("gate");
            let mut want_q = Vec::new();
            let (mut penalty, mut entropy) = (0.0, 0.0);
            for tok in 0..t {
                let (qt, p, h) = dselect_gate_reference(
                    &alpha_h[tok * k..(tok + 1) * k],
                    &z_h[tok * k * m..(tok + 1) * k * m],
                    n,
                    gamma,
                    unused == "wrap",
                );
                want_q.extend(qt);
                penalty += p;
                entropy += h;
            }
            let what = format!("{what} unused={unused}");
            assert_close(&format!("{what}: gate"), &f64s(&q), &want_q, TOL, TOL);

            let routing = router.route(&x).expect("route");
            let a = assignments(&routing);
            for tok in 0..t {
                let qt = &want_q[tok * n..(tok + 1) * n];
                let order = descending_order(qt);
                for (slot, &e) in order.iter().enumerate() {
                    let at = tok * n + slot;
                    let label = format!("{what}: token {tok} slot {slot}");
                    assert_eq!(a.token[at], tok as i32, "{label}: token");
                    assert_close(&label, &[a.weight[at]], &[qt[e]], TOL, TOL);
                    assert_eq!(a.valid[at], f64::from(qt[e] > 0.0), "{label}: valid");
                    if qt[e] > 0.0 {
                        assert_eq!(a.expert[at], e as i32, "{label}: expert");
                    }
                }
            }
            let mut want_aux = entropy_w * entropy;
            if unused == "penalty" && n < 1 << m {
                want_aux += xi * penalty;
            }
            let aux = f64s(&routing.aux_loss.expect("an entropy term"));
            assert_close(&format!("{what}: aux loss"), &aux, &[want_aux], TOL, TOL);
        }
    }
}

// ---- SparseMixer ---------------------------------------------------------------------------

/// SparseMixer's mask of one row: expert j may be sampled iff `θ* − θ_j ≤ r(|θ*| + |θ_j|)`
/// (the paper's Eq. 9) or `θ* − θ_j ≤ 2r·max(|θ_j|, θ*)` (the released code), `θ* = max θ`.
fn sparsemixer_mask_reference(theta: &[f64], r: f64, rule: MaskRule) -> Vec<bool> {
    let top = theta.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    theta
        .iter()
        .map(|&v| match rule {
            MaskRule::Paper => top - v <= r * (top.abs() + v.abs()),
            MaskRule::Code => top - v <= 2.0 * r * v.abs().max(top),
        })
        .collect()
}

/// The softmax of one row over the kept experts only, exactly 0 elsewhere.
fn masked_softmax_reference(theta: &[f64], keep: &[bool]) -> Vec<f64> {
    let m = theta
        .iter()
        .zip(keep)
        .filter(|(_, k)| **k)
        .map(|(v, _)| *v)
        .fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = theta
        .iter()
        .zip(keep)
        .map(|(v, &k)| if k { (v - m).exp() } else { 0.0 })
        .collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|v| v / s).collect()
}

fn argmax(x: &[f64]) -> usize {
    descending_order(x)[0]
}

/// The forward scales a SparseMixer variant may give a sample that is (`at_argmax`) or is not
/// the row's argmax: `1st` c = 1; `2rd` c = ½; the hybrid (mid-point probability 1) 1 at the
/// argmax, else ½; v2 1 at the argmax, else ⅓ (probability ¾) or 1.
fn allowed_scales(variant: SparseMixerVariant, at_argmax: bool) -> Vec<f64> {
    match variant {
        SparseMixerVariant::FirstOrder => vec![1.0],
        SparseMixerVariant::SecondOrder => vec![0.5],
        SparseMixerVariant::Hybrid if at_argmax => vec![1.0],
        SparseMixerVariant::Hybrid => vec![0.5],
        SparseMixerVariant::V2 if at_argmax => vec![1.0],
        SparseMixerVariant::V2 => vec![1.0 / 3.0, 1.0],
    }
}

/// Asserts that weight `w` of sampled expert `d` is `c·π_d` for one of the allowed `c`.
fn assert_scaled(what: &str, w: f64, pi_d: f64, allowed: &[f64]) {
    assert!(
        allowed
            .iter()
            .any(|c| (w - c * pi_d).abs() <= TOL * (1.0 + pi_d)),
        "{what}: weight {w} is not c·π_D for π_D = {pi_d} and c in {allowed:?}"
    );
}

#[test]
fn sparsemixer_mask_softmax_and_weights_match_their_definitions() {
    let variants = [
        (SparseMixerVariant::Hybrid, 1),
        (SparseMixerVariant::FirstOrder, 1),
        (SparseMixerVariant::SecondOrder, 1),
        (SparseMixerVariant::V2, 1),
        (SparseMixerVariant::V2, 2),
    ];
    for case in 0..CASES {
        let mut rng = rng_for(13, case);
        let (t, n) = (rng.random_range(2..=24), rng.random_range(3..=9));
        // logits of one sign or both, close enough that several experts pass the mask
        let offset = [1.5, 0.0, -1.5][case as usize % 3];
        let theta: Vec<Vec<f64>> = (0..t)
            .map(|_| spread_row(&mut rng, n, offset - 0.6, 0.15))
            .collect();
        let logits = tensor(&theta.concat(), &[t, n]);
        let jitter = 0.3;
        let rule = [MaskRule::Paper, MaskRule::Code][case as usize % 2];
        let rule_name = if rule == MaskRule::Paper {
            "paper"
        } else {
            "code"
        };
        let what = format!("sparsemixer T {t} n {n} mask {rule_name}");

        let keep: Vec<Vec<bool>> = theta
            .iter()
            .map(|row| sparsemixer_mask_reference(row, jitter, rule))
            .collect();
        let got = f64s(&sparsemixer_mask(&logits, jitter, rule).expect("mask"));
        let want: Vec<f64> = keep.concat().iter().map(|&b| f64::from(b)).collect();
        assert_eq!(got, want, "{what}: mask");
        let pi: Vec<Vec<f64>> = theta
            .iter()
            .zip(&keep)
            .map(|(row, k)| masked_softmax_reference(row, k))
            .collect();
        let got = masked_softmax(&logits, &tensor(&want, &[t, n])).expect("masked softmax");
        assert_close(&format!("{what}: π"), &f64s(&got), &pi.concat(), TOL, TOL);
        // the custom op's value is c ⊙ p
        let p = uniform(&mut rng, t, 0.1, 1.0);
        let c = uniform(&mut rng, t, 0.1, 1.0);
        let scaled = scale_through(&tensor(&p, &[t, 1]), &tensor(&c, &[t, 1]), 2.0).expect("op");
        let want: Vec<f64> = p.iter().zip(&c).map(|(a, b)| a * b).collect();
        assert_close(
            &format!("{what}: scale_through"),
            &f64s(&scaled),
            &want,
            TOL,
            TOL,
        );

        for (variant, top) in variants {
            let top_opt = top.to_string();
            let mut options = vec![("jitter", "0.3"), ("mask_rule", rule_name)];
            if variant == SparseMixerVariant::V2 {
                options.push(("top", top_opt.as_str()));
            }
            let cfg = router_config(4, n, 1, &options);
            let router = SparseMixerRouter::new(&cfg, variant, Device::cpu()).expect("router");
            let label = format!("{what} {} top {top}", variant.name());
            for training in [true, false] {
                router.set_training(training);
                let routing = router
                    .route_logits_seeded(&logits, 300 + case)
                    .expect("route");
                let a = assignments(&routing);
                let slots = if training { top } else { 1 };
                assert_eq!(a.expert.len(), t * slots, "{label}: assignments");
                for tok in 0..t {
                    let at = tok * slots;
                    let d = a.expert[at] as usize;
                    let best = argmax(&theta[tok]);
                    let label = format!("{label} training {training}: token {tok}");
                    assert_eq!(a.token[at], tok as i32, "{label}");
                    if !training {
                        assert_eq!(d, best, "{label}: evaluation takes the argmax");
                        assert_close(&label, &[a.weight[at]], &[pi[tok][d]], TOL, TOL);
                        continue;
                    }
                    assert!(keep[tok][d], "{label}: sampled expert {d} is masked");
                    let allowed = allowed_scales(variant, d == best);
                    assert_scaled(&label, a.weight[at], pi[tok][d], &allowed);
                    if top == 2 {
                        // second choice: the first masked out, the mask taken again relative
                        // to the largest remaining logit, the softmax over what is left
                        let rest: Vec<f64> = (0..n)
                            .map(|j| {
                                if j == d {
                                    f64::NEG_INFINITY
                                } else {
                                    theta[tok][j]
                                }
                            })
                            .collect();
                        let mut keep2 = sparsemixer_mask_reference(&rest, jitter, rule);
                        keep2[d] = false;
                        let pi2 = masked_softmax_reference(&theta[tok], &keep2);
                        let d2 = a.expert[at + 1] as usize;
                        assert!(keep2[d2], "{label}: second choice {d2} is masked");
                        let allowed = allowed_scales(variant, d2 == argmax(&rest));
                        assert_scaled(
                            &format!("{label} (second)"),
                            a.weight[at + 1],
                            pi2[d2],
                            &allowed,
                        );
                    }
                }
            }
        }
    }
}

// ---- the estimator baselines ---------------------------------------------------------------

#[test]
fn estimator_weights_match_their_definitions() {
    // `st`, `gumbel-st`, `reinmax`: every expert a slot, weight π_D = softmax(θ)_D on the
    // sampled D and 0 elsewhere; `reinforce`: one slot, D with weight π_D and the score term
    // ln π_D. Evaluation: the argmax a with weight π_a.
    for case in 0..CASES {
        let mut rng = rng_for(14, case);
        let (t, n) = (rng.random_range(2..=24), rng.random_range(2..=9));
        let theta: Vec<Vec<f64>> = (0..t).map(|_| spread_row(&mut rng, n, -1.0, 0.3)).collect();
        let pi: Vec<Vec<f64>> = theta.iter().map(|r| softmax_row(r)).collect();
        let logits = tensor(&theta.concat(), &[t, n]);
        for name in ["st", "gumbel-st", "reinmax", "reinforce"] {
            let router = EstimatorRouter::new(name, &router_config(4, n, 1, &[]), Device::cpu())
                .expect("router");
            for training in [true, false] {
                router.set_training(training);
                let routing = router
                    .route_logits_seeded(&logits, 400 + case)
                    .expect("route");
                let a = assignments(&routing);
                let what = format!("{name} T {t} n {n} training {training}");
                let dense = training && name != "reinforce";
                let slots = if dense { n } else { 1 };
                assert_eq!(a.expert.len(), t * slots, "{what}: assignments");
                let log_prob = routing.score.as_ref().map(|s| f64s(&s.log_prob));
                for tok in 0..t {
                    let row = &a.weight[tok * slots..(tok + 1) * slots];
                    let experts = &a.expert[tok * slots..(tok + 1) * slots];
                    let d = if dense {
                        let nonzero: Vec<usize> = (0..n).filter(|&j| row[j] != 0.0).collect();
                        assert_eq!(nonzero.len(), 1, "{what}: token {tok} weights {row:?}");
                        assert_eq!(experts, &(0..n as i32).collect::<Vec<_>>()[..], "{what}");
                        nonzero[0]
                    } else {
                        experts[0] as usize
                    };
                    if !training {
                        assert_eq!(d, argmax(&theta[tok]), "{what}: token {tok} argmax");
                    }
                    let label = format!("{what}: token {tok} expert {d}");
                    let weight = if dense { row[d] } else { row[0] };
                    assert_close(&label, &[weight], &[pi[tok][d]], TOL, TOL);
                    if let (Some(lp), true) = (&log_prob, training) {
                        assert_close(&label, &[lp[tok]], &[pi[tok][d].ln()], TOL, TOL);
                    }
                }
            }
        }
    }
}

// ---- the threshold router ------------------------------------------------------------------

/// XMoE's threshold routing of one token with probabilities `p = softmax(x·W)`: the experts by
/// `p` descending (ties to the lowest index), cut at `K` slots; rank j kept iff its exclusive
/// prefix sum `s_j = Σ_{l<j} p_{i_l}` is below `max(t, 1/(2n))` (all kept when `t ≥ 1`); weight
/// `p_{i_j}` when kept, 0 otherwise. Returns (expert, weight, kept) per slot.
fn threshold_reference(p: &[f64], t: f64, slots: usize) -> Vec<(usize, f64, bool)> {
    let order = descending_order(p);
    let bound = t.max(0.5 / p.len() as f64);
    let mut before = 0.0;
    order[..slots]
        .iter()
        .map(|&e| {
            let kept = t >= 1.0 || before < bound;
            before += p[e];
            (e, if kept { p[e] } else { 0.0 }, kept)
        })
        .collect()
}

#[test]
fn threshold_routing_matches_its_definition() {
    for case in 0..CASES {
        let mut rng = rng_for(15, case);
        let (t, n, d) = (
            rng.random_range(2..=24),
            rng.random_range(2..=10),
            rng.random_range(1..=6),
        );
        let max_k = rng.random_range(1..=n);
        let threshold = [0.0, 0.5, 0.9, 1.0][case as usize % 4];
        let cfg = router_config(
            d,
            n,
            1,
            &[("t", &threshold.to_string()), ("max_k", &max_k.to_string())],
        );
        let router = ThresholdRouter::new(&cfg, Device::cpu()).expect("router");
        spread_params(&router, &mut rng, 2.0);
        let x = uniform(&mut rng, t * d, -1.0, 1.0);
        let mut w = Vec::new();
        router.visit_params("", &mut |_, p| w = f64s(&p.get()));
        let routing = router.route(&tensor(&x, &[t, d])).expect("route");
        let a = assignments(&routing);
        let what = format!("threshold T {t} n {n} t {threshold} max_k {max_k}");
        for tok in 0..t {
            let logits: Vec<f64> = (0..n)
                .map(|e| (0..d).map(|i| x[tok * d + i] * w[i * n + e]).sum())
                .collect();
            let p = softmax_row(&logits);
            for (slot, (e, weight, kept)) in threshold_reference(&p, threshold, max_k)
                .into_iter()
                .enumerate()
            {
                let at = tok * max_k + slot;
                let label = format!("{what}: token {tok} slot {slot}");
                assert_eq!(a.token[at], tok as i32, "{label}: token");
                assert_eq!(a.expert[at], e as i32, "{label}: expert");
                assert_eq!(a.valid[at], f64::from(kept), "{label}: kept");
                assert_close(&label, &[a.weight[at]], &[weight], TOL, TOL);
            }
        }
    }
}
