//! The estimator lab (`moegrad estimators`, `moegrad::estimator_lab`): its exact gradient is the
//! gradient of the enumerated loss (finite differences, and a property test over random small
//! problems); its host and tensor losses agree (and on the GPU); known facts about the
//! estimators come out of it with fixed seeds and bounds of several standard errors
//! (docs/estimators.md,
//! SparseMixer §2–3); the command line prints parseable JSON and turns bad input into a
//! one-line error, refuses a figure path it cannot write before the work starts, still prints
//! its results when the figure fails after it, and its progress bar counts every draw.

#[path = "../../tests/common/mod.rs"]
mod common;

use moegrad::estimator_lab::{
    ESTIMATOR_NAMES, EstimatorStats, LabConfig, LabReport, LossKind, Problem, ProblemConfig,
    exact_gradient, expected_loss, run_lab,
};
use moegrad::{Device, Tensor};
use proptest::prelude::*;
use std::process::Command;

fn problem(loss: LossKind, tokens: usize, experts: usize, dim: usize, seed: u64) -> Problem {
    Problem::new(&ProblemConfig {
        tokens,
        experts,
        dim,
        loss,
        seed,
        ..ProblemConfig::default()
    })
}

/// Central differences of the enumerated loss at the problem's logits.
fn finite_differences(p: &Problem) -> Vec<f64> {
    let h = 1e-6;
    (0..p.logits.len())
        .map(|j| {
            let (mut up, mut down) = (p.logits.clone(), p.logits.clone());
            up[j] += h;
            down[j] -= h;
            (expected_loss(p, &up) - expected_loss(p, &down)) / (2.0 * h)
        })
        .collect()
}

#[test]
fn exact_gradient_is_the_gradient_of_the_enumerated_loss() {
    for loss in [LossKind::Linear, LossKind::Quadratic, LossKind::Logistic] {
        let p = problem(loss, 3, 5, 3, 11);
        let ex = exact_gradient(&p);
        common::assert_close(
            &format!("{loss}: ∇₀ + ∇₁ against finite differences"),
            &ex.total,
            &finite_differences(&p),
            1e-7,
            1e-6,
        );
        assert!((ex.loss - expected_loss(&p, &p.logits)).abs() < 1e-12);
        let sum: Vec<f64> = ex
            .nabla0
            .iter()
            .zip(&ex.nabla1)
            .map(|(a, b)| a + b)
            .collect();
        common::assert_close("total = ∇₀ + ∇₁", &ex.total, &sum, 0.0, 1e-15);
        // each token's gradient sums to 0 over the experts (softmax shift invariance)
        for t in 0..3 {
            let s: f64 = ex.nabla0[t * 5..(t + 1) * 5].iter().sum();
            assert!(s.abs() < 1e-12, "∇₀ row sum {s}");
        }
    }
    // with a linear loss g(π_i f_i) − g(0) = π_i⟨b, f_i⟩ = π_i⟨∇g, f_i⟩: ∇₀ = ∇₁
    let ex = exact_gradient(&problem(LossKind::Linear, 3, 5, 3, 11));
    common::assert_close("linear: ∇₀ = ∇₁", &ex.nabla0, &ex.nabla1, 1e-14, 1e-12);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    #[test]
    fn exact_gradient_matches_finite_differences_on_random_problems(
        tokens in 1usize..4,
        experts in 2usize..7,
        dim in 1usize..4,
        loss in prop_oneof![
            Just(LossKind::Linear),
            Just(LossKind::Quadratic),
            Just(LossKind::Logistic)
        ],
        scale in 0.1f64..3.0,
        seed in 0u64..1000,
    ) {
        let p = Problem::new(&ProblemConfig {
            tokens, experts, dim, loss, scale, seed, ..ProblemConfig::default()
        });
        let ex = exact_gradient(&p);
        let fd = finite_differences(&p);
        for (a, b) in ex.total.iter().zip(&fd) {
            prop_assert!((a - b).abs() <= 1e-6 + 1e-5 * b.abs(), "exact {a} vs fd {b}");
        }
    }
}

/// The host loss and its gradient agree with the tensor loss and its autograd, on every device.
#[test]
fn host_and_tensor_losses_agree() {
    for dev in common::devices("host_and_tensor_losses_agree") {
        for loss in [LossKind::Linear, LossKind::Quadratic, LossKind::Logistic] {
            let p = problem(loss, 1, 2, 3, 4);
            let ys: Vec<f64> = vec![0.3, -0.7, 1.1, -0.2, 0.5, 0.9];
            let y = Tensor::from_f64(ys.clone(), &[2, 3], Device::cpu())
                .unwrap()
                .to_dtype(if dev == Device::cpu() {
                    moegrad::DType::F64
                } else {
                    moegrad::DType::F32
                })
                .unwrap()
                .to_device(dev)
                .unwrap()
                .with_grad()
                .unwrap();
            let l = p.loss.tensor(&y).unwrap();
            l.backward().unwrap();
            let want = p.loss.value(&ys[..3]) + p.loss.value(&ys[3..]);
            let mut want_grad = p.loss.gradient(&ys[..3]);
            want_grad.extend(p.loss.gradient(&ys[3..]));
            let tol = if dev == Device::cpu() { 1e-12 } else { 1e-5 };
            common::assert_close(
                &format!("{loss} on {dev:?}: value"),
                &[l.item().unwrap()],
                &[want],
                tol,
                tol,
            );
            common::assert_close(
                &format!("{loss} on {dev:?}: gradient"),
                &y.grad().unwrap().to_vec_f64().unwrap(),
                &want_grad,
                tol,
                tol,
            );
        }
    }
}

fn lab(
    loss: LossKind,
    estimators: &[&str],
    samples: usize,
    tune: impl Fn(&mut LabConfig),
) -> LabReport {
    let mut cfg = LabConfig {
        problem: ProblemConfig {
            tokens: 4,
            experts: 5,
            dim: 3,
            loss,
            seed: 7,
            ..ProblemConfig::default()
        },
        samples,
        estimators: estimators.iter().map(|s| s.to_string()).collect(),
        ..LabConfig::default()
    };
    tune(&mut cfg);
    run_lab(&cfg).unwrap()
}

fn stats<'a>(r: &'a LabReport, name: &str) -> &'a EstimatorStats {
    r.estimators.iter().find(|e| e.name == name).unwrap()
}

fn rel_dist(a: &[f64], b: &[f64], norm: f64) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).powi(2))
        .sum::<f64>()
        .sqrt()
        / norm
}

#[test]
fn reinforce_is_unbiased_for_nabla0_not_for_the_full_gradient() {
    for loss in [LossKind::Quadratic, LossKind::Logistic] {
        // the router's own estimator: each token's loss g(y_t) is its reward, less the running
        // baseline, so several tokens do not add each other's noise
        let r = lab(loss, &["reinforce"], 40_000, |c| c.problem.tokens = 4);
        let e = stats(&r, "reinforce");
        assert!(
            e.bias_nabla0 < 4.0 * e.bias_se,
            "{loss}: |mean − ∇₀|/|∇| = {} beyond 4 s.e. ({})",
            e.bias_nabla0,
            e.bias_se
        );
        // the test can tell ∇₀ from ∇: they differ by many standard errors
        let gap = rel_dist(&r.exact.nabla0, &r.exact.total, r.exact_norm);
        assert!(
            gap > 8.0 * e.bias_se,
            "{loss}: |∇₁|/|∇| = {gap}, s.e. {}",
            e.bias_se
        );
        assert!(e.bias > 4.0 * e.bias_se, "{loss}: reinforce should miss ∇₁");
        assert_eq!(e.experts_per_token, 1.0);
    }
}

#[test]
fn straight_through_is_exact_for_nabla0_with_a_linear_loss() {
    let r = lab(LossKind::Linear, &["st"], 50, |_| {});
    let e = stats(&r, "st");
    assert!(e.bias_nabla0 < 1e-12, "every draw is ∇₀: {}", e.bias_nabla0);
    assert!(e.variance < 1e-24, "no spread: {}", e.variance);
    // ∇₀ = ∇₁ = ∇/2 for a linear loss
    assert!((e.bias - 0.5).abs() < 1e-12, "{}", e.bias);
    // with a generic loss it is only a first-order estimate of ∇₀: its expectation, enumerated,
    // is off ∇₀ by an exact amount, which the draws must reproduce within Monte Carlo noise
    let r = lab(LossKind::Logistic, &["st"], ST_DRAWS, |_| {});
    let e = stats(&r, "st");
    let expectation = straight_through_expectation(&Problem::new(&r.config.problem));
    let exact_bias = rel_dist(&expectation, &r.exact.nabla0, r.exact_norm);
    // The bound: ‖ḡ − E[ĝ]‖/‖∇‖ has root-mean-square bias_se (the trace of the mean's covariance
    // is the trace of one draw's over M), so 5 s.e. leaves a wide margin at this fixed seed, and
    // by the triangle inequality the measured ‖ḡ − ∇₀‖/‖∇‖ is within the same distance of the
    // exact bias.
    let off_expectation = rel_dist(&e.mean, &expectation, r.exact_norm);
    assert!(
        off_expectation <= 5.0 * e.bias_se,
        "‖mean − E[ST]‖/‖∇‖ = {off_expectation} beyond 5 s.e. ({})",
        e.bias_se
    );
    assert!(
        (e.bias_nabla0 - exact_bias).abs() <= 5.0 * e.bias_se,
        "measured bias against ∇₀ {} vs exact {exact_bias}: beyond 5 s.e. ({})",
        e.bias_nabla0,
        e.bias_se
    );
    // and the bias is real: many standard errors, so an estimator unbiased for ∇₀ would fail above
    assert!(
        exact_bias > 10.0 * e.bias_se,
        "exact bias {exact_bias}, s.e. {}",
        e.bias_se
    );
}

/// Draws of `st` in the logistic case: enough that the exact bias against ∇₀ is many standard
/// errors, few enough to take well under a second.
const ST_DRAWS: usize = 10_000;

/// The exact expectation of the `st` estimator (`[T·n]`), by enumerating each token's choice
/// D ∼ π_t, from its definition (docs/estimators.md; `moe/routers/estimators.rs`): given D, the
/// layer output is `y_t = π_D f_D`, the combine hands expert i's weight `a_i = ⟨∇g(y_t), f_i⟩`,
/// and the estimate is the softmax's backward applied to `u = π ⊙ a`,
/// `∂θ_k = π_k(u_k − Σ_j π_j u_j)`.
fn straight_through_expectation(p: &Problem) -> Vec<f64> {
    let (tokens, n) = (p.config.tokens, p.config.experts);
    let mut expectation = vec![0.0; tokens * n];
    for t in 0..tokens {
        let pi = p.probs(&p.logits, t);
        for chosen in 0..n {
            let y: Vec<f64> = p.output(t, chosen).iter().map(|v| v * pi[chosen]).collect();
            let grad_y = p.loss.gradient(&y);
            let u: Vec<f64> = (0..n)
                .map(|i| pi[i] * dot(&grad_y, p.output(t, i)))
                .collect();
            let pi_u: f64 = pi.iter().zip(&u).map(|(a, b)| a * b).sum();
            for k in 0..n {
                expectation[t * n + k] += pi[chosen] * pi[k] * (u[k] - pi_u);
            }
        }
    }
    expectation
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// The enumeration above is ∇₀ exactly when the loss is linear (∇g constant: ST is exact), and
/// not with the logistic loss.
#[test]
fn the_enumerated_straight_through_expectation_is_nabla0_for_a_linear_loss_only() {
    let linear = problem(LossKind::Linear, 4, 5, 3, 7);
    common::assert_close(
        "linear: E[ST] = ∇₀",
        &straight_through_expectation(&linear),
        &exact_gradient(&linear).nabla0,
        1e-15,
        1e-12,
    );
    let logistic = problem(LossKind::Logistic, 4, 5, 3, 7);
    let ex = exact_gradient(&logistic);
    let gap = rel_dist(
        &straight_through_expectation(&logistic),
        &ex.nabla0,
        ex.total.iter().map(|v| v * v).sum::<f64>().sqrt(),
    );
    assert!(gap > 1e-3, "logistic: ‖E[ST] − ∇₀‖/‖∇‖ = {gap}");
}

#[test]
fn switch_mean_is_nabla1() {
    for loss in [LossKind::Quadratic, LossKind::Logistic] {
        let r = lab(loss, &["switch"], 20_000, |_| {});
        let e = stats(&r, "switch");
        assert!(
            e.bias_nabla1 < 4.0 * e.bias_se,
            "{loss}: |mean − ∇₁|/|∇| = {} beyond 4 s.e. ({})",
            e.bias_nabla1,
            e.bias_se
        );
        assert!(e.bias > 8.0 * e.bias_se, "{loss}: switch should miss ∇₀");
        assert_eq!(e.experts_per_token, 1.0);
    }
}

#[test]
fn reinmax_is_unbiased_with_a_linear_loss() {
    let r = lab(LossKind::Linear, &["reinmax"], 20_000, |_| {});
    let e = stats(&r, "reinmax");
    assert!(e.bias < 4.0 * e.bias_se, "{} vs s.e. {}", e.bias, e.bias_se);
    assert!(e.cosine > 0.99, "{}", e.cosine);
}

#[test]
fn sparsemixer_mask_biases_it_and_an_offset_removes_the_mask() {
    // At r = 0.1 with zero-centred logits the paper's mask keeps few experts: SparseMixer
    // estimates the gradient of a different (masked) objective and is far off.
    let tight = lab(LossKind::Linear, &["sparsemixer-1st"], 4000, |_| {});
    let e = stats(&tight, "sparsemixer-1st");
    assert!(
        tight.mask_kept_per_token < 2.5,
        "{}",
        tight.mask_kept_per_token
    );
    assert!(
        e.bias > 0.3 && e.bias > 10.0 * e.bias_se,
        "{} (s.e. {})",
        e.bias,
        e.bias_se
    );
    // Shifting every logit leaves π and ∇ unchanged but keeps every expert; with a linear loss
    // the tape's 2∇̂ is then unbiased for ∇ (E∇̂ = ∇₀ = ∇₁), for c ≡ 1, c ≡ ½ and the hybrid.
    let names = ["sparsemixer", "sparsemixer-1st", "sparsemixer-2rd"];
    let loose = lab(LossKind::Linear, &names, 20_000, |c| {
        c.problem.offset = 50.0
    });
    assert_eq!(loose.mask_kept_per_token, 5.0);
    common::assert_close(
        "offset leaves ∇",
        &loose.exact.total,
        &tight.exact.total,
        1e-12,
        1e-9,
    );
    for n in names {
        let e = stats(&loose, n);
        assert!(
            e.bias < 4.0 * e.bias_se,
            "{n}: {} vs s.e. {}",
            e.bias,
            e.bias_se
        );
    }
    // A larger jitter loosens the mask too.
    let wide = lab(LossKind::Linear, &["sparsemixer-1st"], 10, |c| {
        c.jitter = 0.9
    });
    assert!(wide.mask_kept_per_token > tight.mask_kept_per_token);
}

#[test]
fn sparsemixer_v2_follows_nabla0_once_the_mask_is_off() {
    let r = lab(LossKind::Linear, &["sparsemixer-v2"], 20_000, |c| {
        c.problem.offset = 50.0
    });
    let e = stats(&r, "sparsemixer-v2");
    // linear g: the third-order rule is exact, E = ∇₀
    assert!(
        e.bias_nabla0 < 4.0 * e.bias_se,
        "{} vs s.e. {}",
        e.bias_nabla0,
        e.bias_se
    );
}

#[test]
fn experts_per_token_is_one_for_sparse_and_n_for_dense_estimators() {
    let mut names = ESTIMATOR_NAMES.to_vec();
    names.push("switch-jitter");
    let r = lab(LossKind::Logistic, &names, 20, |_| {});
    assert_eq!(r.estimators.len(), names.len());
    for e in &r.estimators {
        let want = if ["st", "gumbel-st", "reinmax"].contains(&e.name.as_str()) {
            5.0
        } else {
            1.0
        };
        assert_eq!(e.experts_per_token, want, "{}", e.name);
        assert!(e.bias.is_finite() && e.variance.is_finite() && e.cosine.is_finite());
    }
}

#[test]
fn the_lab_is_reproducible_and_rejects_bad_settings() {
    let a = lab(
        LossKind::Logistic,
        &["sparsemixer", "gumbel-st"],
        30,
        |_| {},
    );
    let b = lab(
        LossKind::Logistic,
        &["sparsemixer", "gumbel-st"],
        30,
        |_| {},
    );
    for (x, y) in a.estimators.iter().zip(&b.estimators) {
        assert_eq!(x.mean, y.mean, "{}", x.name);
    }
    let bad = |tune: &dyn Fn(&mut LabConfig), needle: &str| {
        let mut cfg = LabConfig::default();
        tune(&mut cfg);
        let e = run_lab(&cfg).unwrap_err().to_string();
        assert!(e.contains(needle), "expected {needle:?} in {e:?}");
    };
    bad(&|c| c.problem.experts = 1, "--experts");
    bad(&|c| c.samples = 0, "--samples");
    bad(&|c| c.problem.tokens = 0, "--tokens");
    bad(&|c| c.problem.dim = 0, "--dim");
    bad(&|c| c.jitter = 1.0, "--jitter");
    bad(&|c| c.problem.eps = 0.0, "--eps");
    bad(&|c| c.estimators = vec!["nope".into()], "nope");
    assert!(
        "cubic"
            .parse::<LossKind>()
            .unwrap_err()
            .to_string()
            .contains("--loss")
    );
}

fn moegrad(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_moegrad"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn the_command_prints_json_with_the_fields_and_draws_the_figure() {
    let dir = std::env::temp_dir().join(format!("moegrad-lab-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let svg = dir.join("lab.svg");
    let out = moegrad(&[
        "estimators",
        "--json",
        "--samples",
        "200",
        "--loss",
        "quadratic",
        "--plot",
        svg.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["exact_norm"].as_f64().unwrap() > 0.0);
    let ests = v["estimators"].as_array().unwrap();
    let names: Vec<&str> = ests.iter().map(|e| e["name"].as_str().unwrap()).collect();
    assert_eq!(names, ESTIMATOR_NAMES);
    for e in ests {
        for field in ["bias", "variance", "cosine", "experts_per_token", "bias_se"] {
            assert!(
                e[field].as_f64().is_some(),
                "{} lacks {field}: {e}",
                e["name"]
            );
        }
    }
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.starts_with("<svg") && text.contains("sparsemixer"));
    // the table, with a subset of estimators
    let out = moegrad(&[
        "estimators",
        "--samples",
        "20",
        "--estimators",
        "st,switch",
        "--no-plot",
    ]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("switch") && !text.contains("reinmax"),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_input_is_a_one_line_error() {
    for (args, needle) in [
        (&["estimators", "--experts", "1"][..], "--experts"),
        (&["estimators", "--samples", "0"][..], "--samples"),
        (&["estimators", "--estimators", "st,bogus"][..], "bogus"),
        (&["estimators", "--loss", "cubic"][..], "--loss"),
        (&["estimators", "--jitter", "1.5"][..], "--jitter"),
    ] {
        let mut a = args.to_vec();
        a.push("--no-plot");
        let out = moegrad(&a);
        assert!(!out.status.success(), "{args:?} should fail");
        let err = String::from_utf8_lossy(&out.stderr);
        let lines: Vec<&str> = err.lines().collect();
        assert_eq!(lines.len(), 1, "{args:?}: expected one line, got {err:?}");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

#[test]
fn a_figure_path_that_cannot_be_written_is_refused_before_any_draw() {
    let missing = "/nonexistent-moegrad-dir/lab.svg";
    let out = moegrad(&["estimators", "--samples", "200", "--plot", missing]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        out.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(
        stderr.contains(missing) && stderr.contains("cannot be written there"),
        "{stderr}"
    );
    let dir = std::env::temp_dir();
    let out = moegrad(&[
        "estimators",
        "--samples",
        "200",
        "--plot",
        dir.to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("it is a directory"),
        "{stderr}"
    );
}

#[test]
fn the_results_are_printed_when_the_figure_fails_after_the_run() {
    // a figure path that is a symbolic link to /dev/full opens for writing, so the check
    // before the run passes; drawing after it fails, since a figure is written by replacing a
    // regular file and /dev/full is none
    if !std::path::Path::new("/dev/full").exists() {
        eprintln!("skipped: no /dev/full on this system");
        return;
    }
    let link = std::env::temp_dir().join(format!("moegrad-full-{}.svg", std::process::id()));
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink("/dev/full", &link).unwrap();
    let link_s = link.to_str().unwrap();
    for json in [false, true] {
        let mut args = vec!["estimators", "--samples", "50", "--plot", link_s];
        if json {
            args.push("--json");
        }
        let out = moegrad(&args);
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(
            stderr.contains("/dev/full") && stderr.contains("not a regular file"),
            "{stderr}"
        );
        if json {
            let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
            assert_eq!(
                v["estimators"].as_array().unwrap().len(),
                ESTIMATOR_NAMES.len()
            );
        } else {
            assert!(stdout.starts_with("estimator lab:"), "{stdout}");
            for name in ESTIMATOR_NAMES {
                assert!(stdout.contains(name), "{name} missing from: {stdout}");
            }
            assert!(!stdout.contains("figure:"), "{stdout}");
        }
    }
    assert!(
        std::fs::metadata("/dev/full").is_ok_and(|m| !m.is_file()),
        "/dev/full was replaced by a file"
    );
    let _ = std::fs::remove_file(&link);
}

#[test]
fn the_progress_bar_counts_every_draw_of_every_estimator() {
    let cfg = LabConfig {
        samples: 7,
        estimators: ESTIMATOR_NAMES[..2].iter().map(|s| s.to_string()).collect(),
        ..LabConfig::default()
    };
    let mut bar = moegrad_cli::progress::LabBar::new(true);
    moegrad::estimator_lab::run_lab_with_progress(&cfg, &mut bar).unwrap();
    assert_eq!((bar.0.position(), bar.0.length()), (14, Some(14)));
}

/// The dense problem (`--problem dense`): its reference gradients are the gradients of their
/// losses (finite differences of `Σ_t g(Σ_i w_i f_i)` with w = π, and w = ReLU(θ) for remoe).
#[test]
fn dense_and_relu_gradients_are_the_gradients_of_their_losses() {
    use moegrad::estimator_lab::{dense_gradient, relu_gradient};
    for loss in [LossKind::Linear, LossKind::Quadratic, LossKind::Logistic] {
        let p = problem(loss, 3, 5, 3, 13);
        let mixture = |logits: &[f64], relu: bool| -> f64 {
            let (n, d) = (5, 3);
            (0..3)
                .map(|t| {
                    let w: Vec<f64> = if relu {
                        logits[t * n..(t + 1) * n]
                            .iter()
                            .map(|v| v.max(0.0))
                            .collect()
                    } else {
                        p.probs(logits, t)
                    };
                    let y: Vec<f64> = (0..d)
                        .map(|j| (0..n).map(|i| w[i] * p.output(t, i)[j]).sum())
                        .collect();
                    p.loss.value(&y)
                })
                .sum()
        };
        for (relu, exact) in [(false, dense_gradient(&p)), (true, relu_gradient(&p))] {
            let h = 1e-6;
            let fd: Vec<f64> = (0..p.logits.len())
                .map(|j| {
                    let (mut up, mut down) = (p.logits.clone(), p.logits.clone());
                    up[j] += h;
                    down[j] -= h;
                    (mixture(&up, relu) - mixture(&down, relu)) / (2.0 * h)
                })
                .collect();
            common::assert_close(
                &format!("{loss}, relu = {relu}"),
                &exact.total,
                &fd,
                1e-7,
                1e-6,
            );
            assert!((exact.loss - mixture(&p.logits, relu)).abs() < 1e-12);
        }
    }
}

/// On the dense problem: `softmax` is the reference itself, `remoe` the exact gradient of its
/// own loss, `topk-unnorm` at k = n the dense MoE; `default-moe` is exact when every token's
/// output of an expert is the same (its running mean is then the output it stands in for) and
/// the loss is linear, while `topk-unnorm` is not; sparsemixer-v2 runs top-2.
#[test]
fn dense_problem_facts() {
    let dense = |estimators: &[&str], k: usize, tune: &dyn Fn(&mut ProblemConfig)| {
        let mut problem = ProblemConfig {
            tokens: 48,
            experts: 5,
            dim: 3,
            loss: LossKind::Logistic,
            scale: 2.0,
            seed: 21,
            ..ProblemConfig::default()
        };
        tune(&mut problem);
        run_lab(&LabConfig {
            problem,
            samples: 200,
            estimators: estimators.iter().map(|s| s.to_string()).collect(),
            objective: moegrad::estimator_lab::Objective::Dense,
            k,
            ..LabConfig::default()
        })
        .unwrap()
    };
    let r = dense(&["softmax", "remoe", "topk-unnorm"], 5, &|_| {});
    for name in ["softmax", "remoe", "topk-unnorm"] {
        assert!(
            stats(&r, name).bias < 1e-12,
            "{name}: {}",
            stats(&r, name).bias
        );
    }
    assert!(stats(&r, "remoe").experts_per_token < 5.0);
    // outputs shared by every token (ε tiny): Default MoE's defaults are the outputs themselves,
    // and with a linear loss (∇g the same at the sparse and the dense output) its gradient is
    // the dense one
    let r = dense(&["default-moe", "topk-unnorm", "sparsemixer-v2"], 2, &|p| {
        p.shared = 1.0;
        p.eps = 1e-9;
        p.loss = LossKind::Linear;
    });
    let (dm, tk) = (stats(&r, "default-moe"), stats(&r, "topk-unnorm"));
    assert!(dm.bias < 1e-6, "default-moe: {}", dm.bias);
    assert!(tk.bias > 0.1, "topk-unnorm: {}", tk.bias);
    assert!((dm.experts_per_token - 2.0).abs() < 1e-12);
    let v2 = stats(&r, "sparsemixer-v2");
    assert!(
        v2.experts_per_token > 1.0 && v2.experts_per_token <= 2.0,
        "{}",
        v2.experts_per_token
    );
    assert!(v2.bias_nabla0.is_nan(), "no ∇₀ on the dense problem");
    // refusals name the setting
    for (estimators, k, says) in [
        (vec!["st"], 2, "--problem dense"),
        (vec!["topk"], 9, "--k 9"),
    ] {
        let err = run_lab(&LabConfig {
            estimators: estimators.iter().map(|s| s.to_string()).collect(),
            objective: moegrad::estimator_lab::Objective::Dense,
            k,
            ..LabConfig::default()
        })
        .err()
        .unwrap()
        .to_string();
        assert!(err.contains(says), "{err}");
    }
}

/// The top-2 sampled problem (`--problem top2`): with two experts the second draw is the other
/// one (π' = 1), so `L = p(g(p f₀ + f₁)) + (1 − p)(g((1 − p) f₁ + f₀))`, p = π₀, and for a
/// linear g its gradient is written out by hand; `sparsemixer-v2` at top 2, mask off, runs two
/// experts and points along its objective's gradient.
#[test]
fn top2_problem_matches_the_hand_computed_case_and_v2_follows_it() {
    use moegrad::estimator_lab::{Objective, top2_expected_loss, top2_gradient};
    let p = problem(LossKind::Linear, 3, 2, 3, 17);
    let g = |y: &[f64]| p.loss.value(y);
    let zero = g(&[0.0; 3]);
    let mut want_loss = 0.0;
    let mut want_grad = Vec::new();
    for t in 0..3 {
        let pi = p.probs(&p.logits, t);
        let (f0, f1) = (p.output(t, 0), p.output(t, 1));
        let mix = |a: f64, fa: &[f64], fb: &[f64]| -> Vec<f64> {
            fa.iter().zip(fb).map(|(x, y)| a * x + y).collect()
        };
        let q = pi[0];
        want_loss += q * g(&mix(q, f0, f1)) + (1.0 - q) * g(&mix(1.0 - q, f1, f0));
        // linear g: g(y) = ⟨b, y⟩ + c, B_i = ⟨b, f_i⟩ = g(f_i) − g(0)
        let (b0, b1) = (g(f0) - zero, g(f1) - zero);
        let dl_dq = 2.0 * q * b0 + b1 - 2.0 * (1.0 - q) * b1 - b0;
        let s = q * (1.0 - q);
        want_grad.extend([dl_dq * s, -dl_dq * s]);
    }
    assert!((top2_expected_loss(&p, &p.logits) - want_loss).abs() < 1e-12);
    let ex = top2_gradient(&p);
    common::assert_close("top-2 gradient", &ex.total, &want_grad, 1e-8, 1e-7);
    let r = run_lab(&LabConfig {
        problem: ProblemConfig {
            tokens: 8,
            experts: 5,
            dim: 3,
            offset: 50.0,
            seed: 5,
            ..ProblemConfig::default()
        },
        samples: 2000,
        estimators: vec!["sparsemixer-v2".into()],
        objective: Objective::Top2,
        ..LabConfig::default()
    })
    .unwrap();
    let v2 = stats(&r, "sparsemixer-v2");
    assert_eq!(v2.experts_per_token, 2.0);
    assert!(v2.cosine > 0.95, "cosine {}", v2.cosine);
}
