//! Every optimizer implementation against one independent reference written here in f64 from
//! the textbook definitions, over several steps, never against another implementation (two
//! implementations that read the same wrong hyper-parameter agree with each other).
//!
//! The reference ([`reference`]): Adam as Kingma & Ba (2015, Algorithm 1) with L2 decay folded
//! into the gradient; AdamW as Loshchilov & Hutter (2019), the decay `lr·λ·p` taken from the
//! parameter before the step (PyTorch's convention, which `src/optim/adam.rs` documents); SGD
//! with momentum and Nesterov momentum as PyTorch defines it (`src/optim/sgd.rs`). The gradient
//! of every step is a given constant (`loss = Σ p ⊙ c_t`), multiplied by a gradient scale as
//! clipping would, and the learning rate follows a warm-up + cosine schedule, so β₁ ≠ β₂
//! (0.8, 0.95), ε large enough to matter, weight decay, the scale and a changing rate all enter.
//!
//! The implementations, and how each test knows it ran the one it names:
//! * the fused CPU loops (`CpuBackend::adam_step_mut`, `sgd_step_mut`) in f32 and f64, on a
//!   parameter of more than one `OPT_CHUNK` (16384) so the chunked parallel loop runs several
//!   chunks and a tail: the only CPU path for a dense gradient;
//! * the expert bank's fused step on a deferred gradient (`grouped_weight_grad_adam_mut`; SGD
//!   materialises it): the test asserts the gradient is still deferred before each step;
//! * the GPU multi-tensor kernel (`adam_multi`): thirteen f32 GPU parameters, two dispatches of
//!   twelve slots at most; the test asserts the device supports it and counts two dispatches
//!   per step;
//! * the GPU per-parameter kernels (`adam_in_place`, `sgd_*_in_place`): the same parameters with
//!   one more parameter on the CPU, which sends `Adam::step` down the per-parameter path; one
//!   dispatch per GPU parameter is counted;
//! * the GPU functional kernels (`adam_step`, `sgd_plain`, `sgd_momentum`, fresh buffers): as
//!   above while the test holds the optimizer's state tensors, which must keep their old values.
//!
//! The GPU bank gradient is computed in backward (it is never deferred on the GPU), so on the
//! GPU the bank goes through the multi-tensor kernel like any parameter.

mod common;

use moegrad::nn::Param;
use moegrad::optim::{Adam, Optimizer, Schedule, ScheduleKind, Sgd};
use moegrad::{DType, Device, Tensor};
use std::sync::Mutex;

/// Held by every GPU part of this file, so the dispatch counters count only one test's kernels.
static GPU_COUNTERS: Mutex<()> = Mutex::new(());

const STEPS: u64 = 6;
const BETA1: f64 = 0.8;
const BETA2: f64 = 0.95;
const EPS: f64 = 1e-2;
/// the gradient scale (a clip factor)
const SCALE: f64 = 0.75;
/// a parameter exempt from weight decay (Adam's `no_decay`)
const NO_DECAY: &str = "p03";

/// The rate of each step: two steps of warm-up, then a cosine decay to 0.005.
fn schedule() -> Schedule {
    Schedule::new(0.05, 2, STEPS, ScheduleKind::Cosine { min_lr: 0.005 }).unwrap()
}

/// One update rule with its hyper-parameters.
#[derive(Clone, Copy, Debug)]
enum Rule {
    Adam {
        weight_decay: f64,
        decoupled: bool,
    },
    Sgd {
        momentum: f64,
        weight_decay: f64,
        nesterov: bool,
    },
}

impl Rule {
    fn all() -> [Rule; 5] {
        [
            Rule::Adam {
                weight_decay: 0.1,
                decoupled: false,
            },
            Rule::Adam {
                weight_decay: 0.2,
                decoupled: true,
            },
            Rule::Sgd {
                momentum: 0.0,
                weight_decay: 0.05,
                nesterov: false,
            },
            Rule::Sgd {
                momentum: 0.7,
                weight_decay: 0.05,
                nesterov: false,
            },
            Rule::Sgd {
                momentum: 0.7,
                weight_decay: 0.05,
                nesterov: true,
            },
        ]
    }

    fn optimizer(self) -> Box<dyn Optimizer> {
        let lr = schedule().lr(0);
        match self {
            Rule::Adam {
                weight_decay,
                decoupled,
            } => {
                let mut a = Adam::new(lr).unwrap();
                (a.beta1, a.beta2, a.eps) = (BETA1, BETA2, EPS);
                a.weight_decay = weight_decay;
                a.decoupled = decoupled;
                a.no_decay.insert(NO_DECAY.to_string());
                Box::new(a)
            }
            Rule::Sgd {
                momentum,
                weight_decay,
                nesterov,
            } => {
                let mut s = Sgd::with_momentum(lr, momentum).unwrap();
                s.weight_decay = weight_decay;
                s.nesterov = nesterov;
                Box::new(s)
            }
        }
    }

    /// Whether parameter `name` takes weight decay under this rule (SGD has no exemptions).
    fn decays(self, name: &str) -> bool {
        !matches!(self, Rule::Adam { .. }) || name != NO_DECAY
    }
}

/// The reference: `p0` after `grads.len()` steps of `rule` with gradients `scale · grads[t]`
/// and rates `lrs[t]`, in f64, written from the definitions (see the module docs).
fn reference(rule: Rule, decay: bool, p0: &[f64], grads: &[Vec<f64>], scale: f64) -> Vec<f64> {
    let s = schedule();
    let mut p = p0.to_vec();
    let mut m = vec![0.0; p.len()];
    let mut v = vec![0.0; p.len()];
    for (step, grad) in grads.iter().enumerate() {
        let lr = s.lr(step as u64);
        let t = step as i32 + 1;
        for i in 0..p.len() {
            let raw = scale * grad[i];
            match rule {
                Rule::Adam {
                    weight_decay,
                    decoupled,
                } => {
                    let wd = if decay { weight_decay } else { 0.0 };
                    let g = if decoupled { raw } else { raw + wd * p[i] };
                    m[i] = BETA1 * m[i] + (1.0 - BETA1) * g;
                    v[i] = BETA2 * v[i] + (1.0 - BETA2) * g * g;
                    let m_hat = m[i] / (1.0 - BETA1.powi(t));
                    let v_hat = v[i] / (1.0 - BETA2.powi(t));
                    let decoupled_decay = if decoupled { lr * wd * p[i] } else { 0.0 };
                    p[i] = p[i] - lr * m_hat / (v_hat.sqrt() + EPS) - decoupled_decay;
                }
                Rule::Sgd {
                    momentum,
                    weight_decay,
                    nesterov,
                } => {
                    let g = raw + weight_decay * p[i];
                    // PyTorch: the buffer starts as the first gradient (= μ·0 + g)
                    m[i] = momentum * m[i] + g;
                    let direction = if nesterov { g + momentum * m[i] } else { m[i] };
                    p[i] -= lr * direction;
                }
            }
        }
    }
    p
}

/// A multiple of 1/64 in about [−1.5, 1.5], exact in f32, from integers (no zero: Adam's ratio
/// m̂/√v̂ is ill-conditioned at a zero gradient).
fn value(a: usize, b: usize) -> f64 {
    let mag = 16 + (a * 37 + b * 11) % 80; // 16..96, over 64
    let sign = if (a * 7 + b * 3).is_multiple_of(3) {
        -1.0
    } else {
        1.0
    };
    sign * mag as f64 / 64.0
}

/// Thirteen parameters (more than the multi-tensor kernel's twelve slots): one of more than one
/// CPU chunk (16384 elements) plus a tail, one over a GPU workgroup, a one-element one, and small
/// ones. Returns `(name, p0, gradient of each step)`.
fn dense_problem() -> Vec<(String, Vec<f64>, Vec<Vec<f64>>)> {
    let sizes = [16_384 + 37, 15, 300, 1, 7, 2, 3, 4, 5, 6, 8, 9, 10];
    sizes
        .iter()
        .enumerate()
        .map(|(k, &n)| {
            let p0 = (0..n).map(|i| value(i, k)).collect();
            let grads = (0..STEPS as usize)
                .map(|t| (0..n).map(|i| value(i + 3, 5 * k + 2 * t + 1)).collect())
                .collect();
            (format!("p{k:02}"), p0, grads)
        })
        .collect()
}

fn tensor(values: &[f64], shape: &[usize], dtype: DType, dev: Device) -> Tensor {
    Tensor::from_f64(values.to_vec(), shape, Device::cpu())
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
        .to_device(dev)
        .unwrap()
}

/// How a run is set up.
#[derive(Clone, Copy)]
struct Run {
    dtype: DType,
    /// each parameter's device
    place: fn(usize) -> Device,
    /// pass the gradient scale (a one-element tensor on the parameters' device)
    scaled: bool,
    /// hold the optimizer's state across each step (forces fresh buffers on the GPU)
    hold_state: bool,
}

/// Runs `rule` on the dense problem as `run` says; returns each parameter's final values and the
/// GPU dispatches of each step after the first (the first also builds state).
fn run_dense(rule: Rule, run: Run) -> (Vec<Vec<f64>>, Vec<u64>) {
    let problem = dense_problem();
    let params: Vec<(String, Param)> = problem
        .iter()
        .enumerate()
        .map(|(k, (name, p0, _))| {
            let t = tensor(p0, &[p0.len()], run.dtype, (run.place)(k));
            (name.clone(), Param::new(t).unwrap())
        })
        .collect();
    let mut opt = rule.optimizer();
    let sched = schedule();
    let mut dispatches = Vec::new();
    for step in 0..STEPS as usize {
        for (k, (_, p)) in params.iter().enumerate() {
            let c = tensor(
                &problem[k].2[step],
                &[problem[k].1.len()],
                run.dtype,
                (run.place)(k),
            );
            p.get()
                .mul(&c)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
        }
        opt.set_lr(sched.lr(step as u64));
        let scale_dev = (run.place)(0);
        let scale = run
            .scaled
            .then(|| Tensor::scalar(SCALE, run.dtype, scale_dev).unwrap());
        let held: Vec<(String, Tensor, Vec<f64>)> = if run.hold_state {
            let state = opt.state();
            state
                .into_iter()
                .map(|(n, t)| {
                    let v = t.to_vec_f64().unwrap();
                    (n, t, v)
                })
                .collect()
        } else {
            Vec::new()
        };
        let before = scale_dev.gpu_stats();
        opt.step(&params, scale.as_ref()).unwrap();
        if let (Some(b), Some(a), true) = (before, scale_dev.gpu_stats(), step > 0) {
            dispatches.push(a.dispatches - b.dispatches);
        }
        for (name, t, v) in &held {
            assert_eq!(
                &t.to_vec_f64().unwrap(),
                v,
                "{rule:?}: the held state {name} changed: the step wrote a shared buffer"
            );
        }
        let stateful = !matches!(rule, Rule::Sgd { momentum: 0.0, .. });
        if run.hold_state && stateful && step > 0 {
            assert!(!held.is_empty(), "{rule:?}: no state was held");
        }
    }
    let finals = params
        .iter()
        .map(|(_, p)| p.get().to_vec_f64().unwrap())
        .collect();
    (finals, dispatches)
}

/// Compares a dense run's parameters with the reference.
fn check_dense(what: &str, rule: Rule, got: &[Vec<f64>], scale: f64, atol: f64) {
    for ((name, p0, grads), got) in dense_problem().iter().zip(got) {
        let want = reference(rule, rule.decays(name), p0, grads, scale);
        common::assert_close(&format!("{what}, {rule:?}, {name}"), got, &want, atol, 0.0);
    }
}

/// Tolerances: f64 agrees to rounding; f32 to a few units in the last place of values about 1
/// over six steps.
fn atol(dtype: DType) -> f64 {
    if dtype == DType::F64 { 1e-12 } else { 5e-6 }
}

#[test]
fn fused_cpu_steps_match_the_f64_reference() {
    for dtype in [DType::F64, DType::F32] {
        for rule in Rule::all() {
            let run = Run {
                dtype,
                place: |_| Device::cpu(),
                scaled: true,
                hold_state: false,
            };
            let (got, _) = run_dense(rule, run);
            check_dense(&format!("CPU {dtype}"), rule, &got, SCALE, atol(dtype));
        }
    }
}

#[test]
fn gpu_multi_tensor_and_per_parameter_steps_match_the_f64_reference() {
    let Some(_gpu) = common::gpu_or_skip("gpu_multi_tensor_and_per_parameter_steps") else {
        return;
    };
    let _counting = GPU_COUNTERS.lock().unwrap_or_else(|p| p.into_inner());
    let multi = moegrad::gpu::adam_multi_supported().unwrap();
    let n = dense_problem().len();
    // parameters per multi-tensor dispatch (`ADAM_MULTI_SLOTS` in backend/gpu/optim.rs, copied:
    // src/backend/tests/constants.rs fails when it changes)
    let slots = 12;
    assert!(
        n > slots,
        "the problem must fill more than one multi-tensor dispatch"
    );
    for rule in Rule::all() {
        let is_adam = matches!(rule, Rule::Adam { .. });
        // every parameter on the GPU: Adam's multi-tensor kernel, SGD's per-parameter kernels
        let all_gpu = Run {
            dtype: DType::F32,
            place: |_| Device::Gpu,
            scaled: true,
            hold_state: false,
        };
        let (got, dispatches) = run_dense(rule, all_gpu);
        check_dense("GPU", rule, &got, SCALE, 5e-6);
        let want = if is_adam && multi {
            n.div_ceil(slots)
        } else {
            n
        } as u64;
        assert!(
            dispatches.iter().all(|&d| d == want),
            "{rule:?}: dispatches per step {dispatches:?}, expected {want} (multi-tensor: {multi})"
        );
        // one parameter on the CPU: the per-parameter path for every GPU parameter, in place
        // and then with the state held (fresh buffers)
        for hold_state in [false, true] {
            let mixed = Run {
                dtype: DType::F32,
                place: |k| if k == 1 { Device::cpu() } else { Device::Gpu },
                scaled: false,
                hold_state,
            };
            let (got, dispatches) = run_dense(rule, mixed);
            check_dense(
                &format!("GPU per parameter, held {hold_state}"),
                rule,
                &got,
                1.0,
                5e-6,
            );
            assert!(
                dispatches.iter().all(|&d| d == (n - 1) as u64),
                "{rule:?}: per-parameter dispatches {dispatches:?}, expected {}",
                n - 1
            );
        }
    }
    if !multi {
        eprintln!("this GPU cannot bind the multi-tensor Adam kernel: its path was not run");
    }
}

// ---- the expert bank ---------------------------------------------------------------------------

/// rows, k, m, experts: `experts·k·m = 560 ≥ rows·(k + m) = 144`, so the CPU defers the gradient
const BANK: (usize, usize, usize, usize) = (12, 5, 7, 16);
/// each row's expert, −1 for a row dropped from expert 3's slice (see [`SLICE_OF_ROW`])
const ROW_EXPERT: [i32; 12] = [0, 0, 1, 3, -1, 3, 5, 8, 8, 12, 15, 15];
/// the expert whose slice (`offsets`) each row lies in; rows are sorted by it
const SLICE_OF_ROW: [i32; 12] = [0, 0, 1, 3, 3, 3, 5, 8, 8, 12, 15, 15];

/// `(x, c_t per step, W₀)` of the bank problem `loss_t = Σ c_t ⊙ (x · W[e])`, values exact in f32.
fn bank_problem() -> (Vec<f64>, Vec<Vec<f64>>, Vec<f64>) {
    let (rows, k, m, n) = BANK;
    let x = (0..rows * k).map(|i| value(i, 40)).collect();
    let cs = (0..STEPS as usize)
        .map(|t| (0..rows * m).map(|i| value(i, 50 + t)).collect())
        .collect();
    let w0 = (0..n * k * m).map(|i| value(i, 60)).collect();
    (x, cs, w0)
}

/// `dW[e] = Σ_{rows r of e} x[r]ᵀ·c[r]` in f64.
fn bank_grad(x: &[f64], c: &[f64]) -> Vec<f64> {
    let (rows, k, m, n) = BANK;
    let mut g = vec![0.0; n * k * m];
    for r in 0..rows {
        let Ok(e) = usize::try_from(ROW_EXPERT[r]) else {
            continue;
        };
        for i in 0..k {
            for j in 0..m {
                g[(e * k + i) * m + j] += x[r * k + i] * c[r * m + j];
            }
        }
    }
    g
}

/// Runs `rule` on the bank on `dev` in `dtype`; returns the final bank.
fn run_bank(rule: Rule, dtype: DType, dev: Device) -> Vec<f64> {
    let (rows, k, m, n) = BANK;
    let (x, cs, w0) = bank_problem();
    let mut offsets = vec![0i32; n + 1];
    for e in 0..n {
        offsets[e + 1] =
            offsets[e] + SLICE_OF_ROW.iter().filter(|&&r| r == e as i32).count() as i32;
    }
    let row_expert = Tensor::from_i32(ROW_EXPERT.to_vec(), &[rows], dev).unwrap();
    let offsets = Tensor::from_i32(offsets, &[n + 1], dev).unwrap();
    let xt = tensor(&x, &[rows, k], dtype, dev);
    let w = Param::new(tensor(&w0, &[n, k, m], dtype, dev)).unwrap();
    let named = vec![("bank".to_string(), w.clone())];
    let mut opt = rule.optimizer();
    let sched = schedule();
    for (step, c) in cs.iter().enumerate() {
        xt.grouped_matmul(&w.get(), &row_expert, &offsets)
            .unwrap()
            .mul(&tensor(c, &[rows, m], dtype, dev))
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        assert_eq!(
            w.get().grad_is_deferred(),
            !dev.is_gpu(),
            "{rule:?} on {dev}: the bank gradient is deferred exactly on the CPU"
        );
        opt.set_lr(sched.lr(step as u64));
        let scale = Tensor::scalar(SCALE, dtype, dev).unwrap();
        opt.step(&named, Some(&scale)).unwrap();
    }
    w.get().to_vec_f64().unwrap()
}

#[test]
fn expert_bank_steps_on_a_deferred_gradient_match_the_f64_reference() {
    let (x, cs, w0) = bank_problem();
    let grads: Vec<Vec<f64>> = cs.iter().map(|c| bank_grad(&x, c)).collect();
    for dev in common::devices("expert_bank_steps_on_a_deferred_gradient_match_the_f64_reference") {
        let _counting = dev
            .is_gpu()
            .then(|| GPU_COUNTERS.lock().unwrap_or_else(|p| p.into_inner()));
        let dtypes: &[DType] = if dev.is_gpu() {
            &[DType::F32]
        } else {
            &[DType::F64, DType::F32]
        };
        for &dtype in dtypes {
            for rule in Rule::all() {
                let got = run_bank(rule, dtype, dev);
                let want = reference(rule, true, &w0, &grads, SCALE);
                let what = format!("bank on {dev} in {dtype}, {rule:?}");
                common::assert_close(&what, &got, &want, atol(dtype), 0.0);
            }
        }
    }
}
