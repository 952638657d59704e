//! Expert capacity where `γ·A/n` is not an integer: `C = max(min_capacity, ⌈γ·A/n⌉)`
//! (`moe::Capacity`, docs/routers.md). The other capacity tests use sizes where `γ·A/n` is an
//! integer, which a floor (or a round) passes as well as the ceiling; here every case is
//! computed by hand and the dispatch plan keeps exactly `min(routed, C)` rows per expert.

mod common;

use moegrad::moe::{Capacity, DispatchPlan, Routing};
use moegrad::{DType, Device, Tensor};

fn factor(factor: f64, min_capacity: usize) -> Capacity {
    Capacity::Factor {
        factor,
        min_capacity,
    }
}

#[test]
fn capacity_is_the_ceiling_of_gamma_a_over_n_raised_to_the_minimum() {
    // (γ, A, n, min_capacity, C by hand); every γ exact in binary, so γ·A/n is computed exactly
    let cases = [
        (1.25, 10, 4, 0, 4), // 3.125 → 4
        (0.5, 9, 2, 0, 3),   // 2.25 → 3
        (1.0, 7, 3, 0, 3),   // 2.33… → 3
        (1.5, 5, 4, 0, 2),   // 1.875 → 2
        (0.25, 3, 4, 0, 1),  // 0.1875 → 1 (a floor would give 0: nothing could be kept)
        (0.75, 8, 4, 1, 2),  // 1.5 → 2, above the minimum
        (1.25, 10, 4, 2, 4), // the minimum below both ceiling and floor
        (1.25, 10, 4, 6, 6), // the minimum above the ceiling wins
        (0.25, 3, 4, 1, 1),  // 0.1875 → 1, equal to the minimum
        (2.0, 8, 4, 0, 4),   // integral: 4
        (1.0, 0, 4, 0, 0),   // no assignments
    ];
    for (gamma, a, n, min, want) in cases {
        assert_eq!(
            factor(gamma, min).slots(a, n),
            Some(want),
            "γ = {gamma}, A = {a}, n = {n}, min_capacity = {min}"
        );
    }
    assert_eq!(Capacity::Dropless.slots(10, 4), None);
}

/// Five tokens, top-2 over four experts: A = 10 assignments, expert 0 takes every token's
/// first choice (5 routed), experts 1, 2, 3 take 3, 1, 1.
fn five_tokens(dev: Device) -> Routing {
    let idx = vec![0, 1, 0, 2, 0, 1, 0, 3, 0, 1];
    let weights: Vec<f64> = (0..10).map(|i| 0.9 - 0.05 * i as f64).collect();
    let probs: Vec<f64> = (0..5).flat_map(|_| [0.4, 0.3, 0.2, 0.1]).collect();
    let dt = if dev.is_gpu() { DType::F32 } else { DType::F64 };
    let float = |v: Vec<f64>, shape: &[usize]| common::tensor_on(v, shape, dt, dev);
    Routing::token_choice(
        &Tensor::from_i32(idx, &[5, 2], dev).unwrap(),
        &float(weights, &[5, 2]),
        None,
        float(probs, &[5, 4]),
        float(vec![0.0; 20], &[5, 4]),
    )
    .unwrap()
}

#[test]
fn the_dispatch_plan_keeps_the_ceiling_at_a_non_integral_capacity() {
    for dev in common::devices("the_dispatch_plan_keeps_the_ceiling_at_a_non_integral_capacity") {
        let r = five_tokens(dev);
        // (γ, min_capacity, C, kept per expert) by hand; routed is [5, 3, 1, 1]
        let cases = [
            (1.25, 0, 4, [4.0, 3.0, 1.0, 1.0]),   // 10·1.25/4 = 3.125 → 4
            (0.5, 0, 2, [2.0, 2.0, 1.0, 1.0]),    // 1.25 → 2
            (0.3125, 0, 1, [1.0, 1.0, 1.0, 1.0]), // 0.78125 → 1
            (0.5, 3, 3, [3.0, 3.0, 1.0, 1.0]),    // 1.25 → 2, raised to 3
        ];
        for (gamma, min, c, kept) in cases {
            let plan = DispatchPlan::build(&r, factor(gamma, min)).unwrap();
            let what = format!("{dev}, γ = {gamma}, min_capacity = {min}");
            assert_eq!(plan.capacity, Some(c), "{what}: capacity");
            assert_eq!(
                plan.kept_per_expert.to_vec_f64().unwrap(),
                kept.to_vec(),
                "{what}: kept per expert"
            );
            assert_eq!(
                plan.routed_per_expert.to_vec_f64().unwrap(),
                vec![5.0, 3.0, 1.0, 1.0],
                "{what}: routed per expert"
            );
            let kept_rows: f64 = plan.row_kept.to_vec_f64().unwrap().iter().sum();
            assert_eq!(kept_rows, kept.iter().sum::<f64>(), "{what}: kept rows");
        }
    }
}
