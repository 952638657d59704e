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

/// The global norm over several gradients of different sizes (one spanning several of the CPU
/// sum's parallel chunks), in f32 and in f64, against the host's sum of squares.
#[test]
fn the_global_norm_sums_every_gradient() {
    for dev in common::devices("the_global_norm_sums_every_gradient") {
        for f64_params in [false, true] {
            let mut named = Vec::new();
            let mut expected = 0.0f64;
            for (i, len) in [3usize, 40_000, 17].into_iter().enumerate() {
                let c: Vec<f64> = (0..len)
                    .map(|j| ((j * 7 + i) % 13) as f64 * 0.1 - 0.6)
                    .collect();
                let zeros = vec![0.0; len];
                let value = if f64_params && dev == Device::Cpu {
                    Tensor::from_f64(zeros, &[len], dev)
                } else {
                    Tensor::from_f32(zeros.iter().map(|&v| v as f32).collect(), &[len], dev)
                };
                let param = Param::new(value.unwrap()).unwrap();
                // the gradient at p = 0 is c (rounded to the parameter's dtype)
                let loss = param
                    .get()
                    .mul(&if f64_params && dev == Device::Cpu {
                        Tensor::from_f64(c, &[len], dev).unwrap()
                    } else {
                        Tensor::from_f32(c.iter().map(|&v| v as f32).collect(), &[len], dev)
                            .unwrap()
                    })
                    .unwrap()
                    .sum_all()
                    .unwrap();
                loss.backward().unwrap();
                expected += param
                    .get()
                    .grad()
                    .unwrap()
                    .to_vec_f64()
                    .unwrap()
                    .iter()
                    .map(|g| g * g)
                    .sum::<f64>();
                named.push((format!("p{i}"), param));
            }
            let (norm, scale) = clip_grad_norm(&named, 1.0).unwrap().unwrap();
            let norm = norm.item().unwrap();
            assert!(
                (norm - expected.sqrt()).abs() <= 1e-5 * expected.sqrt(),
                "{dev:?} f64 {f64_params}: norm {norm}, expected {}",
                expected.sqrt()
            );
            assert!((scale.item().unwrap() - 1.0 / (norm + 1e-6)).abs() < 1e-6);
        }
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
    assert!(Schedule::from_name("linear", 0.1, 0.0, 0, 10).is_err());
    assert!(Adam::new(0.0).is_err() && Adam::new(f64::NAN).is_err() && Sgd::new(-1.0).is_err());
}

#[test]
fn parameters_without_gradient_are_left_alone() {
    let p = Param::new(Tensor::from_f32(vec![1.0, 2.0], &[2], Device::cpu()).unwrap()).unwrap();
    let mut opt = Adam::new(0.1).unwrap();
    opt.step(&[("w".into(), p.clone())], None).unwrap();
    assert_eq!(p.get().to_vec_f32().unwrap(), vec![1.0, 2.0]);
}

// ---- an expert bank's deferred gradient ------------------------------------------------------

/// Rows routed to a bank of 16 experts of 5×7 (12 rows, so the bank's gradient, 560 values, is
/// larger than the rows and upstream gradient it comes from, 144: backward defers it). Experts
/// 2, 4, 6, 7, 9–11, 13 and 14 get no rows and row 4 is dropped (expert −1).
struct Bank {
    x: Tensor,
    row_expert: Tensor,
    offsets: Tensor,
    /// the loss is Σ c ⊙ (x · W[e])
    c: Tensor,
    xs: Vec<f64>,
    cs: Vec<f64>,
    re: Vec<i32>,
}

const BANK: (usize, usize, usize, usize) = (12, 5, 7, 16); // rows, k, m, experts

fn bank(dev: Device) -> Bank {
    let (rows, k, m, n) = BANK;
    let re = vec![0, 0, 1, 3, -1, 3, 5, 8, 8, 12, 15, 15];
    let mut offsets = vec![0i32; n + 1];
    let sorted = [0, 0, 1, 3, 3, 3, 5, 8, 8, 12, 15, 15];
    for e in 0..n {
        offsets[e + 1] = offsets[e] + sorted.iter().filter(|&&x| x == e as i32).count() as i32;
    }
    let wave = |i: usize, a: f64| ((i as f64 * a).sin() * 0.8) as f32 as f64;
    let xs: Vec<f64> = (0..rows * k).map(|i| wave(i, 0.7)).collect();
    let cs: Vec<f64> = (0..rows * m).map(|i| wave(i, 1.3)).collect();
    let t = |v: &[f64], shape: &[usize]| {
        Tensor::from_f32(v.iter().map(|&a| a as f32).collect(), shape, dev).unwrap()
    };
    Bank {
        x: t(&xs, &[rows, k]),
        row_expert: Tensor::from_i32(re.clone(), &[rows], dev).unwrap(),
        offsets: Tensor::from_i32(offsets, &[n + 1], dev).unwrap(),
        c: t(&cs, &[rows, m]),
        xs,
        cs,
        re,
    }
}

impl Bank {
    fn backward(&self, w: &Tensor) {
        self.x
            .grouped_matmul(w, &self.row_expert, &self.offsets)
            .unwrap()
            .mul(&self.c)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
    }
    /// `dW[e] = Σ_{rows r of e} x[r]ᵀ·c[r]`, in f64.
    fn exact_grad(&self) -> Vec<f64> {
        let (rows, k, m, n) = BANK;
        let mut g = vec![0.0; n * k * m];
        for r in 0..rows {
            let Ok(e) = usize::try_from(self.re[r]) else {
                continue;
            };
            for i in 0..k {
                for j in 0..m {
                    g[(e * k + i) * m + j] += self.xs[r * k + i] * self.cs[r * m + j];
                }
            }
        }
        g
    }
}

fn bank_param(dev: Device) -> Param {
    let (_, k, m, n) = BANK;
    let w: Vec<f32> = (0..n * k * m).map(|i| ((i as f32) * 0.37).cos()).collect();
    Param::new(Tensor::from_f32(w, &[n, k, m], dev).unwrap()).unwrap()
}

#[test]
fn an_expert_bank_gradient_is_deferred_and_reads_as_the_exact_gradient() {
    for dev in
        common::devices("an_expert_bank_gradient_is_deferred_and_reads_as_the_exact_gradient")
    {
        let b = bank(dev);
        let w = bank_param(dev);
        b.backward(&w.get());
        // deferred where the fused kernel is (the CPU); computed in backward on the GPU
        assert_eq!(
            w.get().grad_is_deferred(),
            !dev.is_gpu(),
            "{dev}: deferred or not"
        );
        let g = w.grad().expect("a gradient").to_vec_f64().unwrap();
        common::assert_close(
            &format!("deferred gradient on {dev}"),
            &g,
            &b.exact_grad(),
            1e-5,
            1e-5,
        );
        assert!(
            !w.get().grad_is_deferred(),
            "{dev}: reading did not keep the computed gradient"
        );
        // Two backward passes before a step add up, deferred or not.
        w.zero_grad();
        b.backward(&w.get());
        b.backward(&w.get());
        let twice: Vec<f64> = b.exact_grad().iter().map(|g| 2.0 * g).collect();
        common::assert_close(
            &format!("accumulated on {dev}"),
            &w.grad().unwrap().to_vec_f64().unwrap(),
            &twice,
            1e-5,
            1e-5,
        );
        // A computed weight passes its gradient on at once; the leaf behind it gets a tensor.
        w.zero_grad();
        b.backward(&w.get().mul_scalar(1.0).unwrap());
        assert!(
            !w.get().grad_is_deferred(),
            "{dev}: a computed weight's gradient was deferred"
        );
        common::assert_close(
            &format!("through a computed weight on {dev}"),
            &w.grad().unwrap().to_vec_f64().unwrap(),
            &b.exact_grad(),
            1e-5,
            1e-5,
        );
        // Gradient clipping reads a deferred gradient like any other.
        w.zero_grad();
        b.backward(&w.get());
        let named = vec![("bank".to_string(), w.clone())];
        let (norm, _) = clip_grad_norm(&named, 1e-3).unwrap().unwrap();
        let exact: f64 = b.exact_grad().iter().map(|g| g * g).sum::<f64>().sqrt();
        assert!(
            (norm.item().unwrap() - exact).abs() < 1e-4 * exact,
            "{dev}: norm"
        );
    }
}

#[test]
fn a_small_bank_gradient_is_computed_in_backward() {
    let dev = Device::cpu();
    let b = bank(dev);
    // one expert of 5×7 (35 values) is smaller than the 12 rows' 144: nothing to save
    let w = Param::new(Tensor::from_f32(vec![0.5; 35], &[1, 5, 7], dev).unwrap()).unwrap();
    let one = Tensor::from_i32(vec![0, 12], &[2], dev).unwrap();
    let re = Tensor::from_i32(vec![0; 12], &[12], dev).unwrap();
    b.x.grouped_matmul(&w.get(), &re, &one)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert!(!w.get().grad_is_deferred());
    assert!(w.grad().is_some());
}

/// Adam and AdamW on a bank whose gradient stays deferred (computed inside the update, on the
/// CPU) give exactly what they give when the gradient is read first (computed, stored, then
/// applied); and the GPU, which computes it in backward, agrees.
#[test]
fn adam_on_a_deferred_bank_gradient_matches_adam_on_the_read_gradient() {
    let mut finals: Vec<Vec<Vec<f64>>> = Vec::new();
    for dev in common::devices("adam_on_a_deferred_bank_gradient_matches_adam_on_the_read_gradient")
    {
        let b = bank(dev);
        let mut per_opt = Vec::new();
        for kind in ["adam", "adam+l2", "adamw"] {
            let make = || match kind {
                "adam" => Adam::new(0.05).unwrap(),
                "adam+l2" => {
                    let mut a = Adam::new(0.05).unwrap();
                    a.weight_decay = 0.1;
                    a
                }
                _ => Adam::adamw(0.05, 0.1).unwrap(),
            };
            let (mut fused_opt, mut read_opt) = (make(), make());
            let (fused, read) = (bank_param(dev), bank_param(dev));
            let start = fused.get().to_vec_f64().unwrap();
            for step in 0..3 {
                b.backward(&fused.get());
                b.backward(&read.get());
                assert_eq!(fused.get().grad_is_deferred(), !dev.is_gpu());
                let _ = read.grad(); // computed and stored: the ordinary path
                assert!(!read.get().grad_is_deferred());
                fused_opt
                    .step(&[("bank".into(), fused.clone())], None)
                    .unwrap();
                read_opt
                    .step(&[("bank".into(), read.clone())], None)
                    .unwrap();
                assert!(
                    fused.grad().is_none(),
                    "the step did not consume the gradient"
                );
                let (f, r) = (
                    fused.get().to_vec_f64().unwrap(),
                    read.get().to_vec_f64().unwrap(),
                );
                for (i, (x, y)) in f.iter().zip(&r).enumerate() {
                    assert_eq!(
                        x.to_bits(),
                        y.to_bits(),
                        "{kind} on {dev}, step {step}: element {i} is {x} fused, {y} read first"
                    );
                }
                for ((name, s1), (_, s2)) in fused_opt.state().iter().zip(read_opt.state().iter()) {
                    assert_eq!(
                        s1.to_vec_f64().unwrap(),
                        s2.to_vec_f64().unwrap(),
                        "{kind} on {dev}: state {name}"
                    );
                }
            }
            let end = fused.get().to_vec_f64().unwrap();
            // the experts with rows moved; with plain Adam, those without stayed put
            let (_, k, m, _) = BANK;
            let moved = |e: usize| (0..k * m).any(|i| start[e * k * m + i] != end[e * k * m + i]);
            assert!(
                moved(0) && moved(15),
                "{kind} on {dev}: used experts did not move"
            );
            if kind == "adam" {
                assert!(!moved(2), "{kind} on {dev}: an expert without rows moved");
            }
            per_opt.push(end);
        }
        finals.push(per_opt);
    }
    if let [cpu, gpu] = &finals[..] {
        for (c, g) in cpu.iter().zip(gpu) {
            common::assert_close("GPU against CPU", g, c, 1e-5, 1e-5);
        }
    }
}

/// A negative gradient scale (mixed precision's overflowed step, `optim::LossScale`) skips the
/// update on every device: Adam, AdamW, and SGD with and without momentum leave the parameter
/// and their state as they were (on the GPU the loss-scale tests cover it end to end; here the
/// CPU's updates, and the GPU's with a hand-made factor).
#[test]
fn a_negative_gradient_scale_skips_the_update() {
    for dev in common::devices("a_negative_gradient_scale_skips_the_update") {
        let skip = Tensor::from_f32(vec![-1.0], &[1], dev).unwrap();
        let mut optimizers: Vec<(&str, Box<dyn Optimizer>)> = vec![
            ("adam", Box::new(Adam::new(0.1).unwrap())),
            ("adamw", Box::new(Adam::adamw(0.1, 0.1).unwrap())),
            ("sgd", Box::new(Sgd::new(0.1).unwrap())),
            (
                "sgd momentum",
                Box::new(Sgd::with_momentum(0.1, 0.9).unwrap()),
            ),
        ];
        for (name, opt) in optimizers.iter_mut() {
            let param = Param::new(Tensor::from_f32(vec![0.5, -1.0], &[2], dev).unwrap()).unwrap();
            let named = vec![("w".to_string(), param.clone())];
            // one real step first, so the state is not zero
            grad_step(&param, &[1.0, 2.0]);
            opt.step(&named, None).unwrap();
            let before = param.get().to_vec_f64().unwrap();
            let state: Vec<Vec<f64>> = opt
                .state()
                .iter()
                .map(|(_, t)| t.to_vec_f64().unwrap())
                .collect();
            grad_step(&param, &[3.0, -4.0]);
            opt.step(&named, Some(&skip)).unwrap();
            assert_eq!(
                param.get().to_vec_f64().unwrap(),
                before,
                "{name} on {dev}: parameter"
            );
            let after: Vec<Vec<f64>> = opt
                .state()
                .iter()
                .map(|(_, t)| t.to_vec_f64().unwrap())
                .collect();
            assert_eq!(after, state, "{name} on {dev}: optimizer state");
        }
    }
}
