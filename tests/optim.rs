//! Optimizers against hand-computed references (Adam and AdamW to 1e-6 over several steps, SGD
//! with and without Nesterov momentum), gradient clipping on the device, the schedules, and
//! the same updates on the GPU (fused kernels) against the CPU.

mod common;

use moegrad::nn::Param;
use moegrad::optim::{Adam, Optimizer, Schedule, ScheduleKind, Sgd, clip_grad_norm};
use moegrad::{Device, Tensor};

/// A parameter with value `p0` whose loss is `Σ c_i·p_i + ½Σ p_i²` (gradient `c + p`).
fn grad_step(param: &Param, c: &[f64]) {
    let p = param.get();
    let dev = p.device();
    let ct = Tensor::from_f32(c.iter().map(|&x| x as f32).collect(), p.shape(), dev).unwrap();
    let loss = p
        .mul(&ct)
        .unwrap()
        .sum_all()
        .unwrap()
        .add(
            &p.mul(&p)
                .unwrap()
                .sum_all()
                .unwrap()
                .mul_scalar(0.5)
                .unwrap(),
        )
        .unwrap();
    loss.backward().unwrap();
}

fn adam_reference(
    p0: &[f64],
    c: &[f64],
    steps: usize,
    lr: f64,
    wd: f64,
    decoupled: bool,
) -> Vec<f64> {
    let (b1, b2, eps) = (0.9f64, 0.999f64, 1e-8);
    let mut p = p0.to_vec();
    let mut m = vec![0.0; p.len()];
    let mut v = vec![0.0; p.len()];
    for t in 1..=steps {
        for i in 0..p.len() {
            let mut g = c[i] + p[i];
            if !decoupled {
                g += wd * p[i];
            }
            m[i] = b1 * m[i] + (1.0 - b1) * g;
            v[i] = b2 * v[i] + (1.0 - b2) * g * g;
            let mh = m[i] / (1.0 - b1.powi(t as i32));
            let vh = v[i] / (1.0 - b2.powi(t as i32));
            let decay = if decoupled { lr * wd * p[i] } else { 0.0 };
            p[i] -= lr * mh / (vh.sqrt() + eps) + decay;
        }
    }
    p
}

fn run_opt(opt: &mut dyn Optimizer, p0: &[f64], c: &[f64], steps: usize, dev: Device) -> Vec<f64> {
    let param = Param::new(
        Tensor::from_f32(p0.iter().map(|&x| x as f32).collect(), &[p0.len()], dev).unwrap(),
    )
    .unwrap();
    let named = vec![("w".to_string(), param.clone())];
    for _ in 0..steps {
        grad_step(&param, c);
        opt.step(&named, None).unwrap();
    }
    param.get().to_vec_f64().unwrap()
}

const P0: [f64; 5] = [0.5, -1.5, 2.0, 0.0, 0.25];
const C: [f64; 5] = [0.1, -0.3, 0.7, 1.2, -2.0];

#[test]
fn adam_matches_hand_computed_reference() {
    for dev in common::devices("adam_matches_hand_computed_reference") {
        let got = run_opt(&mut Adam::new(0.01).unwrap(), &P0, &C, 7, dev);
        common::assert_close(
            &format!("adam on {dev}"),
            &got,
            &adam_reference(&P0, &C, 7, 0.01, 0.0, false),
            1e-6,
            0.0,
        );
        let mut adam_l2 = Adam::new(0.01).unwrap();
        adam_l2.weight_decay = 0.1;
        let got = run_opt(&mut adam_l2, &P0, &C, 7, dev);
        common::assert_close(
            &format!("adam+L2 on {dev}"),
            &got,
            &adam_reference(&P0, &C, 7, 0.01, 0.1, false),
            1e-6,
            0.0,
        );
        let got = run_opt(&mut Adam::adamw(0.01, 0.1).unwrap(), &P0, &C, 7, dev);
        common::assert_close(
            &format!("adamw on {dev}"),
            &got,
            &adam_reference(&P0, &C, 7, 0.01, 0.1, true),
            1e-6,
            0.0,
        );
    }
}

#[test]
fn sgd_matches_hand_computed_reference() {
    for dev in common::devices("sgd_matches_hand_computed_reference") {
        for nesterov in [false, true] {
            let (lr, mu, wd) = (0.05, 0.9, 0.01);
            let mut opt = Sgd::with_momentum(lr, mu).unwrap();
            opt.weight_decay = wd;
            opt.nesterov = nesterov;
            let got = run_opt(&mut opt, &P0, &C, 5, dev);
            let mut p = P0.to_vec();
            let mut b = [0.0; 5];
            for _ in 0..5 {
                for i in 0..5 {
                    let g = C[i] + p[i] + wd * p[i];
                    b[i] = mu * b[i] + g;
                    p[i] -= lr * if nesterov { g + mu * b[i] } else { b[i] };
                }
            }
            common::assert_close(
                &format!("sgd nesterov={nesterov} on {dev}"),
                &got,
                &p,
                1e-6,
                0.0,
            );
        }
    }
}

#[test]
fn clipping_scales_gradients_on_the_device() {
    for dev in common::devices("clipping_scales_gradients_on_the_device") {
        let param = Param::new(Tensor::from_f32(vec![0.0; 2], &[2], dev).unwrap()).unwrap();
        let named = vec![("w".to_string(), param.clone())];
        grad_step(&param, &[3.0, 4.0]); // gradient (3, 4), norm 5
        let (norm, scale) = clip_grad_norm(&named, 1.0).unwrap().unwrap();
        assert!((norm.item().unwrap() - 5.0).abs() < 1e-5);
        assert!((scale.item().unwrap() - 0.2).abs() < 1e-5);
        Sgd::new(1.0).unwrap().step(&named, Some(&scale)).unwrap();
        common::assert_close(
            "clipped step",
            &param.get().to_vec_f64().unwrap(),
            &[-0.6, -0.8],
            1e-5,
            0.0,
        );
        // A norm below the limit leaves the gradient alone.
        grad_step(&param, &[0.6, 0.8]);
        let (_, scale) = clip_grad_norm(&named, 10.0).unwrap().unwrap();
        assert!((scale.item().unwrap() - 1.0).abs() < 1e-6);
        assert!(clip_grad_norm(&named, f64::NAN).is_err());
    }
}

#[test]
fn schedules_warm_up_and_decay() {
    let s = Schedule::new(1.0, 4, 14, ScheduleKind::Cosine { min_lr: 0.0 }).unwrap();
    let lrs: Vec<f64> = (0..15).map(|t| s.lr(t)).collect();
    common::assert_close("warm-up", &lrs[..4], &[0.25, 0.5, 0.75, 1.0], 1e-12, 0.0);
    assert!((lrs[4] - 1.0).abs() < 1e-12);
    assert!(
        (lrs[9] - 0.5).abs() < 1e-12,
        "half-way through the decay: {}",
        lrs[9]
    );
    assert!(lrs[14].abs() < 1e-12);
    assert!(lrs.windows(2).skip(4).all(|w| w[1] <= w[0]));
    let c = Schedule::new(0.1, 0, 10, ScheduleKind::Constant).unwrap();
    assert!((0..10).all(|t| c.lr(t) == 0.1));
    assert!(Schedule::new(f64::INFINITY, 0, 10, ScheduleKind::Constant).is_err());
    assert!(Schedule::new(0.1, 0, 10, ScheduleKind::Cosine { min_lr: 0.5 }).is_err());
    assert!(Schedule::from_name("linear", 0.1, 0, 10).is_err());
    assert!(Adam::new(0.0).is_err() && Adam::new(f64::NAN).is_err() && Sgd::new(-1.0).is_err());
}

#[test]
fn parameters_without_gradient_are_left_alone() {
    let p = Param::new(Tensor::from_f32(vec![1.0, 2.0], &[2], Device::cpu()).unwrap()).unwrap();
    let mut opt = Adam::new(0.1).unwrap();
    opt.step(&[("w".into(), p.clone())], None).unwrap();
    assert_eq!(p.get().to_vec_f32().unwrap(), vec![1.0, 2.0]);
}
