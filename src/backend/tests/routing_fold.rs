//! The router's backward kernels with the gradient the logits already have folded in
//! (`RoutingOps::topk_gate_backward` and `NnOps::softmax_backward` with `pending`, reached
//! through the tape's folding rules of `Tensor::topk_gate` and `Tensor::softmax`): an MoE
//! router's logits get one gradient through the probabilities (the balance loss) and one through
//! the gate's weights, and the second rule to run adds the first's in its kernel.
//!
//! At the backend, `pending + ∂` to the bit of the separate add on the CPU (f32, f64) and the
//! GPU (f32), for the renormalised and the unnormalised gate and the softmax; a pending
//! gradient of the wrong length is an error. Through the tape, a loss of both outputs gives the
//! logits the bits of the two paths' gradients added, and on the GPU the backward launches the
//! two kernels and no add.

use super::gpu_matmul::gpu;
use super::layer_norm_fold::{fold_devices, placed, values};
use crate::DType;
use crate::backend::cpu::CpuBackend;
use crate::backend::{BinaryOp, ElementwiseOps, HostData, NnOps, RoutingOps};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// Each backward kernel with `pending` against the same without it followed by the add
/// (`pending + ∂`), on backend `be` in `dtype`, to the bit.
fn folds_match_the_sum<B: NnOps + RoutingOps + ElementwiseOps>(be: &B, dtype: DType, what: &str) {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    for (rows, n, k) in [(1, 1, 1), (5, 8, 2), (70, 13, 4)] {
        let up = |v: Vec<f64>| {
            let data = match dtype {
                DType::F64 => HostData::F64(v),
                _ => HostData::F32(v.iter().map(|&x| x as f32).collect()),
            };
            be.upload(&data).unwrap()
        };
        let logits = up(values(&mut rng, rows * n));
        let (probs, idx, weights) = be.topk_gate(&logits, None, rows, n, k, true).unwrap();
        let (dw, dp, pending) = (
            up(values(&mut rng, rows * k)),
            up(values(&mut rng, rows * n)),
            up(values(&mut rng, rows * n)),
        );
        let add = |d: &B::Buffer| {
            let len = rows * n;
            be.binary(BinaryOp::Add, &pending, &[1], d, &[1], &[len])
                .unwrap()
        };
        let host = |b: &B::Buffer| be.download(b).unwrap();
        let at = format!("{what}, {rows}×{n}, k {k}");
        for probs in [None, Some(&probs)] {
            let sizes = (rows, n, k);
            let plain = be
                .topk_gate_backward(&weights, &idx, &dw, (probs, None), sizes)
                .unwrap();
            let folded = be
                .topk_gate_backward(&weights, &idx, &dw, (probs, Some(&pending)), sizes)
                .unwrap();
            let gate = if probs.is_some() {
                "unnormalised"
            } else {
                "renormalised"
            };
            assert_eq!(host(&folded), host(&add(&plain)), "{at}: {gate} gate");
        }
        let plain = be.softmax_backward((&probs, &dp), None, rows, n).unwrap();
        let folded = be
            .softmax_backward((&probs, &dp), Some(&pending), rows, n)
            .unwrap();
        assert_eq!(host(&folded), host(&add(&plain)), "{at}: softmax");
        // a pending gradient of the wrong length is an error, not a launch
        let short = up(vec![0.0; rows * n + 1]);
        let errors = [
            be.topk_gate_backward(&weights, &idx, &dw, (None, Some(&short)), (rows, n, k))
                .err(),
            be.softmax_backward((&probs, &dp), Some(&short), rows, n)
                .err(),
        ];
        for err in errors {
            assert!(
                matches!(err, Some(crate::Error::Shape(ref m)) if m.contains("pending gradient")),
                "{at}: {err:?}"
            );
        }
    }
}

#[test]
fn the_folded_gate_gradients_are_the_sums_to_the_bit_on_each_device() {
    let gpu = gpu("the_folded_gate_gradients_are_the_sums_to_the_bit_on_each_device");
    folds_match_the_sum(&CpuBackend, DType::F32, "CPU f32");
    folds_match_the_sum(&CpuBackend, DType::F64, "CPU f64");
    if let Some((be, _lock)) = &gpu {
        folds_match_the_sum(be, DType::F32, "GPU f32");
    }
}

/// A router's logits with a loss on both the gate's weights and the probabilities
/// (`Σ weights ⊙ a + Σ probs ⊙ b`, the combine and the balance loss): their gradient is the
/// two paths' gradients added, to the bit, for the renormalised gate
/// and the unnormalised one, and for `Tensor::softmax` fed twice; on the GPU the backward runs
/// as many launches as the two paths' backward passes apart: no add.
#[test]
fn the_logits_gradients_from_both_outputs_fold_into_one_launch() {
    let gpu = gpu("the_logits_gradients_from_both_outputs_fold_into_one_launch");
    let mut rng = ChaCha8Rng::seed_from_u64(8);
    let (rows, n, k) = (9, 6, 2);
    let host = [
        values(&mut rng, rows * n),
        values(&mut rng, rows * k),
        values(&mut rng, rows * n),
    ];
    for (dev, dtype) in fold_devices(&gpu) {
        let t = |v: &[f64], shape: &[usize]| placed(v, shape, dtype, dev);
        let (a, b) = (t(&host[1], &[rows, k]), t(&host[2], &[rows, n]));
        let loss_of = |gate: &crate::ops::TopkGate, weights: bool, probs: bool| {
            let mut terms = Vec::new();
            if weights {
                terms.push(gate.weights.mul(&a).unwrap().sum_all().unwrap());
            }
            if probs {
                terms.push(gate.probs.mul(&b).unwrap().sum_all().unwrap());
            }
            terms
        };
        for renormalise in [true, false] {
            // x's gradient, and the dispatches of the backward on the GPU
            let grad_of = |weights: bool, probs: bool| {
                let x = t(&host[0], &[rows, n]).with_grad().unwrap();
                let gate = x.topk_gate(None, k, renormalise).unwrap();
                let terms = loss_of(&gate, weights, probs);
                // backward from both terms at once: one walk, both rules
                let loss = terms
                    .iter()
                    .skip(1)
                    .fold(terms[0].clone(), |s, t| s.add(t).unwrap());
                let before = dev.gpu_stats();
                loss.backward().unwrap();
                let ran = match (before, dev.gpu_stats()) {
                    (Some(b), Some(a)) => a.since(&b).dispatches,
                    _ => 0,
                };
                (x.grad().unwrap(), ran)
            };
            let (both, ran_both) = grad_of(true, true);
            let ((w, ran_w), (p, ran_p)) = (grad_of(true, false), grad_of(false, true));
            let want = w.add(&p).unwrap();
            let (got, want) = (both.to_vec_f64().unwrap(), want.to_vec_f64().unwrap());
            let same = got
                .iter()
                .zip(&want)
                .all(|(g, w)| g.to_bits() == w.to_bits());
            let at = format!("{dev} {dtype}, renormalise {renormalise}");
            assert!(same, "{at}: {got:?} vs {want:?}");
            // each path's own launches, and no add where they meet
            assert_eq!(ran_both, ran_w + ran_p, "{at}: dispatches");
        }
        // the softmax fed twice: its input's two gradients
        let x = t(&host[0], &[rows, n]).with_grad().unwrap();
        let s1 = x.softmax(-1).unwrap().mul(&b).unwrap().sum_all().unwrap();
        let s2 = x.softmax(-1).unwrap().sum_all().unwrap();
        s1.add(&s2).unwrap().backward().unwrap();
        let x1 = t(&host[0], &[rows, n]).with_grad().unwrap();
        x1.softmax(-1)
            .unwrap()
            .mul(&b)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let x2 = t(&host[0], &[rows, n]).with_grad().unwrap();
        x2.softmax(-1)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let want = x1.grad().unwrap().add(&x2.grad().unwrap()).unwrap();
        let (got, want) = (
            x.grad().unwrap().to_vec_f64().unwrap(),
            want.to_vec_f64().unwrap(),
        );
        let same = got
            .iter()
            .zip(&want)
            .all(|(g, w)| g.to_bits() == w.to_bits());
        assert!(
            same,
            "{dev} {dtype}: softmax fed twice: {got:?} vs {want:?}"
        );
    }
}
