//! Tests of `gradcheck` itself: deliberately broken backward rules and degenerate checks must
//! fail it, never pass. Each broken function is built from public ops so that its value is right
//! but its gradient is not (a NaN or an infinity from `sqrt` at 0, a wrong sign from a
//! straight-through construct, a path cut by `detach`); beside each, the correct version passes,
//! so the failure comes from the defect and not from the setting. `gradcheck`'s reading of a
//! deferred gradient that cannot be computed is tested inside the crate (`src/gradcheck.rs`),
//! where such a gradient can be planted.

mod common;

use moegrad::gradcheck::{GradcheckOptions, gradcheck};
use moegrad::{Device, Error, Result, Tensor};

fn full() -> GradcheckOptions {
    GradcheckOptions::default()
}

fn fast() -> GradcheckOptions {
    GradcheckOptions {
        fast_mode: true,
        seed: 3,
        ..GradcheckOptions::default()
    }
}

/// `opts` with only the Jacobian (or projection) comparison: no reentrancy and no zero-upstream
/// pass, whose own checks would otherwise catch some defects first.
fn comparison_only(opts: GradcheckOptions) -> GradcheckOptions {
    GradcheckOptions {
        check_reentrant: false,
        check_zero_grad_output: false,
        ..opts
    }
}

/// Runs gradcheck and returns its `Error::Gradcheck` message, failing the test on anything else.
fn gradcheck_message(
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
    inputs: &[Tensor],
    opts: &GradcheckOptions,
) -> String {
    match gradcheck(f, inputs, opts) {
        Err(Error::Gradcheck(msg)) => msg,
        other => panic!("expected Err(Error::Gradcheck), got {other:?}"),
    }
}

fn assert_mentions(msg: &str, words: &[&str]) {
    for w in words {
        assert!(msg.contains(w), "message lacks {w:?}: {msg}");
    }
}

/// `x + √(0·x)`: the value is `x` and the derivative 1, but the backward of `√` at 0 is `+∞`
/// and `0·∞` gives NaN. Built as `x + √(s·x)` so that `s = 1` at positive `x` is the
/// correct twin.
fn plus_sqrt_of_scaled(t: &[Tensor], s: f64) -> Result<Tensor> {
    t[0].add(&t[0].mul_scalar(s)?.sqrt()?)
}

#[test]
fn a_nan_backward_fails_gradcheck() {
    let x = common::f64t(&[0.7, 1.3], &[2]);
    for opts in [full(), comparison_only(full())] {
        let msg = gradcheck_message(
            |t| plus_sqrt_of_scaled(t, 0.0),
            std::slice::from_ref(&x),
            &opts,
        );
        assert_mentions(&msg, &["input 0", "element [", "analytic gradient", "NaN"]);
    }
    // The same function away from the singular point passes.
    gradcheck(|t| plus_sqrt_of_scaled(t, 1.0), &[x], &full()).unwrap();
}

#[test]
fn a_nan_backward_fails_gradcheck_in_fast_mode() {
    let x = common::f64t(&[0.7, 1.3], &[2]);
    for opts in [fast(), comparison_only(fast())] {
        let msg = gradcheck_message(
            |t| plus_sqrt_of_scaled(t, 0.0),
            std::slice::from_ref(&x),
            &opts,
        );
        assert_mentions(&msg, &["input 0", "fast mode", "NaN"]);
    }
    gradcheck(|t| plus_sqrt_of_scaled(t, 1.0), &[x], &fast()).unwrap();
}

#[test]
fn an_infinite_gradient_fails_gradcheck() {
    // √(x − sg(x)) is 0 everywhere, but its backward is 1/(2·0) = +∞.
    let x = common::f64t(&[0.4], &[1]);
    let broken = |t: &[Tensor]| t[0].add(&t[0].sub(&t[0].detach())?.sqrt()?);
    let msg = gradcheck_message(broken, std::slice::from_ref(&x), &full());
    assert_mentions(&msg, &["input 0", "element [0]", "inf"]);
    let msg = gradcheck_message(broken, std::slice::from_ref(&x), &fast());
    assert_mentions(&msg, &["inf"]);
    gradcheck(|t| t[0].add(&t[0].sqrt()?), &[x], &full()).unwrap();
}

#[test]
fn a_wrong_sign_backward_fails_gradcheck() {
    // 2·sg(x) − x has the value x but the gradient −1.
    let x = common::f64t(&[0.5, -1.5, 2.0], &[3]);
    let broken = |t: &[Tensor]| t[0].detach().mul_scalar(2.0)?.sub(&t[0]);
    let msg = gradcheck_message(broken, std::slice::from_ref(&x), &full());
    assert_mentions(&msg, &["input 0", "analytic -1.0", "numeric 1.0"]);
    let msg = gradcheck_message(broken, std::slice::from_ref(&x), &fast());
    assert_mentions(&msg, &["input 0", "fast mode"]);
    gradcheck(|t| t[0].mul_scalar(1.0), &[x], &full()).unwrap();
}

#[test]
fn a_detached_output_fails_gradcheck() {
    let x = common::f64t(&[0.5, -1.5], &[2]);
    for opts in [full(), fast()] {
        let msg = gradcheck_message(|t| t[0].detach().exp(), std::slice::from_ref(&x), &opts);
        assert_mentions(&msg, &["does not depend on the inputs through the tape"]);
        // Even when the numeric Jacobian is zero too: an output off the tape has no gradient
        // to check, and gradcheck says so rather than passing.
        let msg = gradcheck_message(
            |t| t[0].detach().mul_scalar(0.0),
            std::slice::from_ref(&x),
            &opts,
        );
        assert_mentions(&msg, &["does not depend on the inputs through the tape"]);
    }
    gradcheck(|t| t[0].exp(), &[x], &full()).unwrap();
}

#[test]
fn a_detached_path_to_one_input_fails_gradcheck() {
    // The output is on the tape through x, but the path from y is cut: y's gradient is missing.
    let x = common::f64t(&[0.5, -1.5], &[2]);
    let y = common::f64t(&[1.25, 0.75], &[2]);
    let msg = gradcheck_message(
        |t| t[0].mul(&t[1].detach()),
        &[x.clone(), y.clone()],
        &full(),
    );
    assert_mentions(&msg, &["input 1", "analytic 0.0", "numeric"]);
    gradcheck(|t| t[0].mul(&t[1]), &[x, y], &full()).unwrap();
}

#[test]
fn a_non_finite_output_fails_gradcheck() {
    // At the given point.
    let zero = common::f64t(&[0.0, 1.0], &[2]);
    let msg = gradcheck_message(|t| t[0].log(), &[zero], &full());
    assert_mentions(&msg, &["output element [0]", "-inf", "at the given inputs"]);
    // Only one finite-difference step away (log of a negative number): the numeric derivative
    // is NaN while the analytic one, 1/x, is finite.
    let tiny = common::f64t(&[5e-7], &[1]);
    for opts in [comparison_only(full()), comparison_only(fast())] {
        let msg = gradcheck_message(|t| t[0].log(), std::slice::from_ref(&tiny), &opts);
        assert_mentions(&msg, &["NaN", "with input 0", "moved by"]);
    }
    let one = common::f64t(&[1.0], &[1]);
    gradcheck(|t| t[0].log(), &[one], &full()).unwrap();
}

#[test]
fn a_non_finite_input_fails_gradcheck() {
    let x = common::f64t(&[1.0, f64::NAN], &[2]);
    let msg = gradcheck_message(|t| t[0].mul_scalar(2.0), &[x], &full());
    assert_mentions(&msg, &["input 0", "element [1]", "NaN"]);
}

#[test]
fn comparing_nothing_fails_gradcheck() {
    let empty = Tensor::from_f64(vec![], &[0, 3], Device::cpu()).unwrap();
    for opts in [full(), fast()] {
        // An input with no elements.
        let msg = gradcheck_message(|t| t[0].mul(&t[0]), std::slice::from_ref(&empty), &opts);
        assert_mentions(&msg, &["nothing to compare", "[0, 3]"]);
        // No inputs at all.
        let msg = gradcheck_message(
            |_| Tensor::from_f64(vec![1.0], &[1], Device::cpu()),
            &[],
            &opts,
        );
        assert_mentions(&msg, &["nothing to compare", "0 input(s)"]);
        // An output with no elements.
        let x = common::f64t(&[1.0, 2.0], &[2]);
        let msg = gradcheck_message(|t| t[0].slice(0, 0, 0), &[x], &opts);
        assert_mentions(&msg, &["nothing to compare", "0 element(s)"]);
    }
}

#[test]
fn a_passing_check_reports_what_it_compared() {
    let x = common::f64t(&[0.3, -1.2, 2.0], &[3]);
    let report = gradcheck(
        |t| t[0].tanh()?.mul(&t[0]),
        std::slice::from_ref(&x),
        &full(),
    )
    .unwrap();
    assert_eq!(report.compared, 9, "3 inputs × 3 outputs");
    let report = gradcheck(|t| t[0].tanh()?.mul(&t[0]), &[x], &fast()).unwrap();
    assert_eq!(report.compared, 1, "one projection per input");
}
