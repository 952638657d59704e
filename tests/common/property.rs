//! The fixed-seed property runner of the GPU parity property tests (`tests/gpu_parity_props.rs`,
//! `tests/gpu_parity_fused.rs`): proptest with a seed fixed by the property's name, a small case
//! count and no regression files, so every run draws the same cases and CI's time is bounded.
//! Included with `#[path = "common/property.rs"] mod property;` next to
//! `#[path = "common/parity.rs"] mod parity;` (it seeds from `parity::seed_of`).
#![allow(dead_code)]

use proptest::strategy::Strategy;
use proptest::test_runner::{Config, RngAlgorithm, RngSeed, TestRunner};
use std::fmt::Debug;

/// Runs `check` on `cases` inputs drawn from `strategy`, from a seed fixed by `name` (the same
/// inputs on every run, nothing written to disk); a failure panics with the smallest failing
/// input proptest finds in a bounded number of shrink steps.
pub fn check_property<S: Strategy>(name: &str, cases: u32, strategy: S, check: impl Fn(S::Value))
where
    S::Value: Debug,
{
    let config = Config {
        cases,
        failure_persistence: None,
        rng_algorithm: RngAlgorithm::ChaCha,
        rng_seed: RngSeed::Fixed(crate::parity::seed_of(name)),
        max_shrink_iters: 64,
        ..Config::default()
    };
    let mut runner = TestRunner::new(config);
    if let Err(e) = runner.run(&strategy, |v| {
        check(v);
        Ok(())
    }) {
        panic!("{name}: {e}");
    }
}
