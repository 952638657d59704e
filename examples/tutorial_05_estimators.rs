//! Tutorial chapter 5 (`docs/tutorial/05-estimator-lab.md`): measuring router-gradient
//! estimators against the exact gradient with the estimator lab (`moegrad::estimator_lab`, the
//! library side of `moegrad estimators`). The example checks the exact gradient against finite
//! differences, then asserts what the chapter reads off the table: REINFORCE is unbiased for
//! ∇₀, Switch for ∇₁, SparseMixer follows the whole gradient, and what each costs.
//!
//! Run with `cargo run --release --example tutorial_05_estimators`.

use moegrad::estimator_lab::{
    EstimatorStats, LabConfig, LabReport, Problem, ProblemConfig, exact_gradient, expected_loss,
    run_lab,
};

/// Prints one lab run as a table, one row per estimator.
fn print_table(offset: f64, report: &LabReport) {
    println!(
        "\nlogit offset {offset}: ‖∇‖ = {:.4}, ‖∇₀‖ = {:.4}, ‖∇₁‖ = {:.4}, mask keeps {:.2} experts",
        report.exact_norm, report.nabla0_norm, report.nabla1_norm, report.mask_kept_per_token
    );
    println!(
        "{:<12} {:>7} {:>7} {:>9} {:>7} {:>8} {:>8} {:>8}",
        "estimator", "bias", "±s.e.", "variance", "cosine", "vs ∇₀", "vs ∇₁", "experts"
    );
    for s in &report.estimators {
        println!(
            "{:<12} {:>7.3} {:>7.3} {:>9.3} {:>7.3} {:>8.3} {:>8.3} {:>8.1}",
            s.name,
            s.bias,
            s.bias_se,
            s.variance,
            s.cosine,
            s.bias_nabla0,
            s.bias_nabla1,
            s.experts_per_token
        );
    }
}

/// The row of `name` in a report.
fn stat<'a>(report: &'a LabReport, name: &str) -> &'a EstimatorStats {
    report
        .estimators
        .iter()
        .find(|s| s.name == name)
        .unwrap_or_else(|| panic!("the lab did not report {name}"))
}

fn main() -> moegrad::Result<()> {
    // A small problem: 8 tokens, 4 experts, outputs of width 4, the default logistic loss.
    let problem_cfg = ProblemConfig {
        tokens: 8,
        experts: 4,
        ..ProblemConfig::default()
    };

    // 1. The exact gradient, by enumerating every expert choice, against central differences
    // of the enumerated expected loss L(θ) = Σ_t Σ_i π_{t,i} g(π_{t,i} f_{t,i}).
    let problem = Problem::new(&problem_cfg);
    let exact = exact_gradient(&problem);
    let h = 1e-6;
    for (j, &analytic) in exact.total.iter().enumerate() {
        let mut plus = problem.logits.clone();
        let mut minus = problem.logits.clone();
        plus[j] += h;
        minus[j] -= h;
        let numeric =
            (expected_loss(&problem, &plus) - expected_loss(&problem, &minus)) / (2.0 * h);
        assert!(
            (analytic - numeric).abs() <= 1e-6 * (1.0 + numeric.abs()),
            "∂L/∂θ[{j}]: enumerated {analytic} vs finite difference {numeric}"
        );
        let parts = exact.nabla0[j] + exact.nabla1[j];
        assert!(
            (parts - analytic).abs() <= 1e-12 * (1.0 + analytic.abs()),
            "∇₀ + ∇₁ ≠ ∇ at {j}"
        );
    }
    println!(
        "exact gradient (T·n = {}) matches finite differences; L = {:.6}",
        exact.total.len(),
        exact.loss
    );

    // 2. The lab: M draws per estimator, reduced to bias, variance and cosine relative to ‖∇‖.
    // Run twice: on the problem as drawn, where SparseMixer's mask keeps about one expert per
    // token, and with every logit shifted by 50, which leaves π, L and ∇ unchanged but makes the
    // mask keep every expert.
    let lab = |offset: f64| -> moegrad::Result<LabReport> {
        let cfg = LabConfig {
            problem: ProblemConfig {
                offset,
                ..problem_cfg.clone()
            },
            samples: 2000,
            estimators: ["sparsemixer", "st", "reinforce", "switch"]
                .iter()
                .map(|s| s.to_string())
                .collect(),
            ..LabConfig::default()
        };
        let report = run_lab(&cfg)?;
        print_table(offset, &report);
        Ok(report)
    };
    let tight = lab(0.0)?;
    let loose = lab(50.0)?;
    assert!(
        (tight.exact_norm - loose.exact_norm).abs() < 1e-9 * tight.exact_norm,
        "the shift must not change ∇"
    );

    // 3. What the tables say, as checks. An unbiased estimator's measured distance to its
    // target is about one standard error (not 0): allow four.
    let reinforce = stat(&tight, "reinforce");
    assert!(
        reinforce.bias_nabla0 <= 4.0 * reinforce.bias_se,
        "REINFORCE should be unbiased for ∇₀: {} vs s.e. {}",
        reinforce.bias_nabla0,
        reinforce.bias_se
    );
    let switch = stat(&tight, "switch");
    assert!(
        switch.bias_nabla1 <= 4.0 * switch.bias_se,
        "Switch should be unbiased for ∇₁: {} vs s.e. {}",
        switch.bias_nabla1,
        switch.bias_se
    );
    // Switch misses ∇₀ entirely, so against the whole gradient it is biased by about ‖∇₀‖/‖∇‖.
    assert!(
        switch.bias > 4.0 * switch.bias_se,
        "Switch should be biased for ∇"
    );
    // With a tight mask SparseMixer estimates the gradient of another objective: bias near 1.
    let masked = stat(&tight, "sparsemixer");
    assert!(
        masked.bias > 0.9,
        "a tight mask should cost SparseMixer most of ∇"
    );
    // With the mask off it approximates ∇₀ + ∇₁ with one expert per token, far closer than Switch.
    let sparsemixer = stat(&loose, "sparsemixer");
    assert!(
        loose.mask_kept_per_token == problem_cfg.experts as f64,
        "offset 50 should switch the mask off"
    );
    assert!(
        sparsemixer.bias < 0.5 * switch.bias && sparsemixer.cosine > 0.95,
        "SparseMixer without its mask should follow ∇ much better than Switch"
    );
    // The cost: sparse estimators run one expert per token, straight-through runs all n.
    for s in [reinforce, switch, sparsemixer] {
        assert_eq!(s.experts_per_token, 1.0, "{} should run one expert", s.name);
    }
    assert_eq!(
        stat(&tight, "st").experts_per_token,
        problem_cfg.experts as f64
    );

    println!("tutorial_05_estimators: all checks passed");
    Ok(())
}
