//! The CPU backend's vectorised math against the scalar definitions: Adam compiled for wide
//! vectors and fused with an expert bank's weight gradient (bit for bit against the separate
//! steps), and the f32 GELU and its derivative (against the tanh form in f64, and the slope kept
//! for backward). Uses the helpers of `cpu_kernels.rs`; the `exp` and `ln` loops are checked
//! through the tensor API in `tests/cpu_kernels.rs`.

use super::cpu_kernels::{CPU, bank_dims, down_f64, routed_rows, up};
use crate::backend::cpu::{CpuBackend, CpuBuffer};
use crate::backend::{BankGradOperands, BufferOps, ElementwiseOps, HostData, MatmulOps};
use crate::{Device, Tensor};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The f32 Adam/AdamW loop, compiled for the widest vectors the processor has, gives bit for bit
/// what the same operations give one element at a time (over several chunks and a ragged tail,
/// with a gradient scale, tiny and huge values included).
#[test]
fn wide_adam_matches_the_scalar_update_bit_for_bit() {
    use crate::backend::AdamHyper;
    let mut r = ChaCha8Rng::seed_from_u64(41);
    let n = 3 * (1 << 14) + 77;
    let mut draw = |lo: f32, hi: f32| -> Vec<f32> {
        (0..n)
            .map(|i| match i % 97 {
                0 => 0.0,
                1 => 1e-30,
                2 => 3e30,
                _ => r.random_range(lo..hi),
            })
            .collect()
    };
    let (p, g, m, v) = (
        draw(-2.0, 2.0),
        draw(-1.0, 1.0),
        draw(-0.1, 0.1),
        draw(0.0, 0.01),
    );
    let v: Vec<f32> = v.iter().map(|x| x.abs()).collect();
    for decoupled in [false, true] {
        let h = AdamHyper {
            lr: 3e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            decoupled,
            step: 4,
            bias_correction1: 1.0 - 0.9f64.powi(4),
            bias_correction2: 1.0 - 0.999f64.powi(4),
        };
        let scale = 0.75f32;
        let (mut pb, gb, mut mb, mut vb) = (
            up(HostData::F32(p.clone())),
            up(HostData::F32(g.clone())),
            up(HostData::F32(m.clone())),
            up(HostData::F32(v.clone())),
        );
        let sb = up(HostData::F32(vec![scale]));
        CpuBackend
            .adam_step_mut(&mut pb, &gb, Some(&sb), &mut mb, &mut vb, h)
            .unwrap();
        let f = |x: f64| x as f32;
        let (b1, b2) = (f(h.beta1), f(h.beta2));
        let (inv_bc1, inv_bc2) = (f(1.0 / h.bias_correction1), f(1.0 / h.bias_correction2));
        let (lr, wd, eps) = (f(h.lr), f(h.weight_decay), f(h.eps));
        let down = |b: &CpuBuffer| match CpuBackend.download(b).unwrap() {
            HostData::F32(x) => x,
            other => panic!("expected f32, got {:?}", other.dtype()),
        };
        let (gp, gm, gv) = (down(&pb), down(&mb), down(&vb));
        for i in 0..n {
            let mut gi = g[i] * scale;
            if !decoupled {
                gi += wd * p[i];
            }
            let mi = b1 * m[i] + (1.0 - b1) * gi;
            let vi = b2 * v[i] + (1.0 - b2) * gi * gi;
            let update = (mi * inv_bc1) / ((vi * inv_bc2).sqrt() + eps);
            let decay = if decoupled { lr * wd * p[i] } else { 0.0 };
            let pi = p[i] - lr * update - decay;
            assert_eq!(
                (gp[i].to_bits(), gm[i].to_bits(), gv[i].to_bits()),
                (pi.to_bits(), mi.to_bits(), vi.to_bits()),
                "decoupled={decoupled} element {i}: p {} vs {pi}, m {} vs {mi}, v {} vs {vi}",
                gp[i],
                gm[i],
                gv[i]
            );
        }
    }
}

/// The fused expert-bank step (weight gradient computed expert by expert inside Adam) against
/// the two kernels it replaces, bit for bit: many experts (one thread per expert) and few
/// (threads inside each product), with dropped rows, an expert with no rows, a gradient scale,
/// Adam and AdamW, f32 and f64.
#[test]
fn fused_bank_adam_equals_weight_grad_then_adam_bit_for_bit() {
    use crate::backend::AdamHyper;
    let mut rng = ChaCha8Rng::seed_from_u64(43);
    for (rows, k, m, n) in [(900usize, 8usize, 12usize, 40usize), (2000, 24, 20, 2)] {
        let (re, offsets) = routed_rows(&mut rng, rows, n, 1);
        let mut draw = |len: usize, lo: f64, hi: f64| -> Vec<f64> {
            (0..len).map(|_| rng.random_range(lo..hi)).collect()
        };
        let (x, dy) = (draw(rows * k, -1.0, 1.0), draw(rows * m, -1.0, 1.0));
        let (p, mo, ve) = (
            draw(n * k * m, -1.0, 1.0),
            draw(n * k * m, -0.1, 0.1),
            draw(n * k * m, 0.0, 0.01),
        );
        for (decoupled, f64_data) in [(false, false), (true, false), (false, true)] {
            let h = AdamHyper {
                lr: 1e-2,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.05,
                decoupled,
                step: 3,
                bias_correction1: 1.0 - 0.9f64.powi(3),
                bias_correction2: 1.0 - 0.999f64.powi(3),
            };
            let buf = |v: &[f64]| {
                if f64_data {
                    up(HostData::F64(v.to_vec()))
                } else {
                    up(HostData::F32(v.iter().map(|&a| a as f32).collect()))
                }
            };
            let (xb, dyb) = (buf(&x), buf(&dy));
            let (reb, offb) = (
                up(HostData::I32(re.clone())),
                up(HostData::I32(offsets.clone())),
            );
            let scale = buf(&[0.5]);
            // the two kernels
            let g = CPU
                .grouped_weight_grad(&xb, &dyb, &reb, &offb, bank_dims(k, m, n), xb.dtype())
                .unwrap();
            let (mut p1, mut m1, mut v1) = (buf(&p), buf(&mo), buf(&ve));
            CpuBackend
                .adam_step_mut(&mut p1, &g, Some(&scale), &mut m1, &mut v1, h)
                .unwrap();
            // fused
            let (mut p2, mut m2, mut v2) = (buf(&p), buf(&mo), buf(&ve));
            CpuBackend
                .grouped_weight_grad_adam_mut(
                    BankGradOperands {
                        x: &xb,
                        dy: &dyb,
                        row_expert: &reb,
                        offsets: &offb,
                        bank: bank_dims(k, m, n),
                    },
                    &mut p2,
                    Some(&scale),
                    &mut m2,
                    &mut v2,
                    h,
                )
                .unwrap();
            for (what, a, b) in [("param", &p1, &p2), ("m", &m1, &m2), ("v", &v1, &v2)] {
                let (a, b) = (down_f64(a), down_f64(b));
                assert_eq!(a.len(), n * k * m);
                for (i, (x, y)) in a.iter().zip(&b).enumerate() {
                    assert_eq!(
                        x.to_bits(),
                        y.to_bits(),
                        "{what}[{i}] of {n} experts of {k}×{m} (decoupled {decoupled}, f64 \
                         {f64_data}): two kernels give {x}, fused gives {y}"
                    );
                }
            }
            // the update did happen: the parameter moved
            assert!(
                down_f64(&p2)
                    .iter()
                    .zip(&p)
                    .any(|(a, b)| (a - b).abs() > 1e-6)
            );
        }
    }
}

#[test]
fn fused_bank_adam_names_the_mismatched_sizes() {
    use crate::backend::AdamHyper;
    let h = AdamHyper {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
        decoupled: false,
        step: 1,
        bias_correction1: 0.1,
        bias_correction2: 0.001,
    };
    let f = |n: usize| up(HostData::F32(vec![0.5; n]));
    let (x, dy) = (f(4 * 3), f(4 * 5));
    let re = up(HostData::I32(vec![0, 0, 1, 1]));
    let off = up(HostData::I32(vec![0, 2, 4]));
    let fused = |x: &CpuBuffer, experts: usize, bank: usize| {
        let (mut p, mut m, mut v) = (f(bank), f(bank), f(bank));
        CpuBackend
            .grouped_weight_grad_adam_mut(
                BankGradOperands {
                    x,
                    dy: &dy,
                    row_expert: &re,
                    offsets: &off,
                    bank: bank_dims(3, 5, experts),
                },
                &mut p,
                None,
                &mut m,
                &mut v,
                h,
            )
            .unwrap_err()
            .to_string()
    };
    // a bank of the wrong size
    let err = fused(&x, 2, 2 * 3 * 5 - 1);
    assert!(err.contains("2×3×5") && err.contains("29"), "{err}");
    // rows shorter than the routing says
    let err = fused(&f(5), 2, 30);
    assert!(err.contains("4 rows"), "{err}");
    // offsets for another number of experts
    let err = fused(&x, 3, 45);
    assert!(err.contains("3 offsets for 3 experts"), "{err}");
}

/// GELU (tanh form) and its derivative in f64, written as the docs state them.
fn gelu_reference(x: f64) -> (f64, f64) {
    let k = (2.0 / std::f64::consts::PI).sqrt();
    let u = k * (x + 0.044715 * x * x * x);
    let t = u.tanh();
    let du = k * (1.0 + 3.0 * 0.044715 * x * x);
    (
        0.5 * x * (1.0 + t),
        0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du,
    )
}

#[test]
fn vectorised_f32_gelu_and_its_derivative_match_the_tanh_form_in_f64() {
    use crate::backend::UnaryOp;
    // a dense sweep over where GELU bends, sparse tails out to where it saturates, and specials
    let mut xs: Vec<f32> = (0..80_000).map(|i| (i as f32 - 40_000.0) * 2e-4).collect();
    xs.extend((0..2_000).map(|i| (i as f32 - 1_000.0) * 0.1));
    xs.extend([0.0, -0.0, 1e-30, -1e-30, 1e30, -1e30, f32::MAX, f32::MIN]);
    let run = |op| down_f64(&CPU.unary(op, &up(HostData::F32(xs.clone()))).unwrap());
    let (y, dy) = (run(UnaryOp::Gelu), run(UnaryOp::GeluGrad));
    for ((&x, &y), &dy) in xs.iter().zip(&y).zip(&dy) {
        let (want, dwant) = gelu_reference(x as f64);
        // relative to the value's size, with an absolute floor for the near-zero outputs of
        // very negative x (both are ~1e-7 of the input's scale)
        let tol = |w: f64| 2e-6 * w.abs().max(1e-6 * (x as f64).abs().min(1.0)) + 1e-7;
        if x.abs() < 1e20 {
            assert!(
                (y - want).abs() <= tol(want),
                "gelu({x}) = {y}, want {want}"
            );
            assert!(
                (dy - dwant).abs() <= tol(dwant) + 2e-6,
                "gelu'({x}) = {dy}, want {dwant}"
            );
        } else {
            // the limits: x for large x, 0 for very negative x; slope 1 and 0
            let (lim, dlim) = if x > 0.0 { (x as f64, 1.0) } else { (0.0, 0.0) };
            assert!(
                y == lim || (y - lim).abs() <= 1e-6 * lim.abs(),
                "gelu({x}) = {y}"
            );
            assert!(
                dy.is_finite() && (dy - dlim).abs() < 1e-6,
                "gelu'({x}) = {dy}"
            );
        }
    }
    let nan = run_one(UnaryOp::Gelu, f32::NAN);
    assert!(nan.is_nan(), "gelu(NaN) = {nan}");
}

/// `BinaryOp::GeluBackward` (GELU's backward in one pass) gives, bit for bit, the gradient times
/// the separately computed slope, over several parallel chunks; a broadcast operand takes the
/// general path and agrees with the tanh form in f64.
#[test]
fn fused_gelu_backward_is_the_gradient_times_the_slope() {
    use crate::backend::{BinaryOp, UnaryOp};
    let n = 70_001;
    let xs: Vec<f32> = (0..n).map(|i| (i as f32 - 35_000.0) * 3e-4).collect();
    let gs: Vec<f32> = (0..n).map(|i| ((i % 17) as f32 - 8.0) * 0.25).collect();
    let (x, g) = (up(HostData::F32(xs.clone())), up(HostData::F32(gs.clone())));
    let fused = down_f64(
        &CPU.binary(BinaryOp::GeluBackward, &g, &[1], &x, &[1], &[n])
            .unwrap(),
    );
    let slope = CPU.unary(UnaryOp::GeluGrad, &x).unwrap();
    let composed = down_f64(
        &CPU.binary(BinaryOp::Mul, &g, &[1], &slope, &[1], &[n])
            .unwrap(),
    );
    for i in 0..n {
        assert_eq!(
            fused[i].to_bits(),
            composed[i].to_bits(),
            "x {} g {}: fused {} composed {}",
            xs[i],
            gs[i],
            fused[i],
            composed[i]
        );
    }
    // one gradient value broadcast over every x: the general (strided) path
    let one = up(HostData::F32(vec![1.5]));
    let broadcast = down_f64(
        &CPU.binary(BinaryOp::GeluBackward, &one, &[0], &x, &[1], &[n])
            .unwrap(),
    );
    for (&x, &got) in xs.iter().zip(&broadcast) {
        let want = 1.5 * gelu_reference(x as f64).1;
        assert!(
            (got - want).abs() <= 1e-5,
            "1.5·gelu'({x}) = {got}, want {want}"
        );
    }
}

fn run_one(op: crate::backend::UnaryOp, x: f32) -> f64 {
    down_f64(&CPU.unary(op, &up(HostData::F32(vec![x]))).unwrap())[0]
}

/// `Tensor::gelu` on the CPU in f32 keeps the slope from its forward pass: its value and the
/// gradient it passes back are, bit for bit, the separately computed GELU and the gradient
/// times the separately computed slope (with and without a gradient being recorded).
#[test]
fn gelu_keeps_its_slope_for_backward_on_the_cpu() {
    use crate::backend::UnaryOp;

    let n = 40_003;
    let xs: Vec<f32> = (0..n).map(|i| (i as f32 - 20_000.0) * 4e-4).collect();
    let gs: Vec<f32> = (0..n).map(|i| ((i % 11) as f32 - 5.0) * 0.5).collect();
    let x = Tensor::from_f32(xs.clone(), &[n], Device::Cpu)
        .unwrap()
        .with_grad()
        .unwrap();
    let y = x.gelu().unwrap();
    let g = Tensor::from_f32(gs.clone(), &[n], Device::Cpu).unwrap();
    y.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
    let xb = up(HostData::F32(xs.clone()));
    let want_y = down_f64(&CPU.unary(UnaryOp::Gelu, &xb).unwrap());
    let slope = down_f64(&CPU.unary(UnaryOp::GeluGrad, &xb).unwrap());
    let got_y = y.to_vec_f64().unwrap();
    let got_dx = x.grad().unwrap().to_vec_f64().unwrap();
    let untracked = Tensor::from_f32(xs, &[n], Device::Cpu)
        .unwrap()
        .gelu()
        .unwrap();
    assert_eq!(got_y, want_y, "the value with the slope kept");
    assert_eq!(untracked.to_vec_f64().unwrap(), want_y, "the value without");
    for i in 0..n {
        let want = (gs[i] * slope[i] as f32) as f64;
        assert_eq!(
            got_dx[i].to_bits(),
            want.to_bits(),
            "dx[{i}]: {} vs {want}",
            got_dx[i]
        );
    }
}
