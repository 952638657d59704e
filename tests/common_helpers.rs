//! The shared test helpers of `tests/common` checked on their own: `assert_close` fails on a NaN
//! on either side (NaN against NaN included, so two results broken the same way cannot pass), and
//! `assert_close_nan_aware` accepts NaN only where NaN is expected and still compares the rest.
//! A comparison helper that cannot fail would make every test built on it unable to fail.

mod common;

#[test]
fn assert_close_accepts_values_within_the_tolerance() {
    common::assert_close(
        "ok",
        &[1.0, -2.0, 0.0],
        &[1.0 + 1e-9, -2.0, 1e-10],
        1e-8,
        1e-8,
    );
}

#[test]
#[should_panic(expected = "element 1: got NaN, expected NaN")]
fn assert_close_fails_on_nan_against_nan() {
    common::assert_close("both NaN", &[1.0, f64::NAN], &[1.0, f64::NAN], 1e-6, 1e-6);
}

#[test]
#[should_panic(expected = "element 0: got NaN, expected 1")]
fn assert_close_fails_on_a_nan_result() {
    common::assert_close("NaN got", &[f64::NAN], &[1.0], 1e-6, 1e-6);
}

#[test]
#[should_panic(expected = "element 0: got 1, expected NaN")]
fn assert_close_fails_on_a_nan_expectation() {
    common::assert_close("NaN expected", &[1.0], &[f64::NAN], 1e-6, 1e-6);
}

#[test]
#[should_panic(expected = "element 2: got 3.1, expected 3")]
fn assert_close_fails_beyond_the_tolerance() {
    common::assert_close("far", &[1.0, 2.0, 3.1], &[1.0, 2.0, 3.0], 1e-3, 1e-3);
}

#[test]
fn assert_close_nan_aware_matches_nan_positions_and_compares_the_rest() {
    let nan = f64::NAN;
    common::assert_close_nan_aware("ok", &[nan, 2.0, nan], &[nan, 2.0 + 1e-12, nan], 1e-9, 0.0);
}

#[test]
#[should_panic(expected = "element 1: got 2.5, expected 2")]
fn assert_close_nan_aware_still_compares_the_values_that_are_not_nan() {
    let nan = f64::NAN;
    common::assert_close_nan_aware("value", &[nan, 2.5], &[nan, 2.0], 1e-9, 0.0);
}

#[test]
#[should_panic(expected = "element 0: got NaN, expected 1")]
fn assert_close_nan_aware_fails_on_an_unexpected_nan() {
    common::assert_close_nan_aware("extra NaN", &[f64::NAN, 2.0], &[1.0, 2.0], 1e-9, 0.0);
}

#[test]
#[should_panic(expected = "element 1: got 2, expected NaN")]
fn assert_close_nan_aware_fails_on_a_missing_nan() {
    common::assert_close_nan_aware("missing NaN", &[1.0, 2.0], &[1.0, f64::NAN], 1e-9, 0.0);
}

#[test]
#[should_panic(expected = "every expected element is NaN")]
fn assert_close_nan_aware_refuses_a_result_of_nan_only() {
    common::assert_close_nan_aware("all NaN", &[f64::NAN], &[f64::NAN], 1e-9, 0.0);
}
