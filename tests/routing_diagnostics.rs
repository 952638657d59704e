//! The routing diagnostics (`moe::RoutingWindow`, `moe::RoutingDiagnostics`) against values
//! worked out by hand from their definitions (docs: `src/moe/diagnostics.rs`), on two steps of
//! two MoE layers, one with a dead expert and a capacity drop, the other perfectly balanced; on
//! the CPU and on the GPU (skipped with a printed reason without an adapter unless
//! `MOEGRAD_REQUIRE_GPU=1`); and the collapse alarm's thresholds.

mod common;

use moegrad::moe::{CollapseAlarm, ExpertWeights, RoutingStats, RoutingWindow, Spread};
use moegrad::{DType, Device, Tensor};

fn t(v: &[f64], shape: &[usize], dev: Device) -> Tensor {
    Tensor::from_f32(v.iter().map(|&x| x as f32).collect(), shape, dev).unwrap()
}

/// One layer's statistics of one step: 2 tokens, 4 experts.
fn stats(probs: &[f64], logits: &[f64], routed: &[f64], kept: &[f64], dev: Device) -> RoutingStats {
    RoutingStats {
        kept_per_expert: t(kept, &[4], dev),
        expert_weights: ExpertWeights::Summed(Tensor::zeros(&[4], DType::F32, dev).unwrap()),
        routed_per_expert: t(routed, &[4], dev),
        probs: t(probs, &[2, 4], dev),
        logits: t(logits, &[2, 4], dev),
        tokens: 2,
        metrics: Vec::new(),
    }
}

fn entropy(p: &[f64]) -> f64 {
    -p.iter()
        .filter(|&&x| x > 0.0)
        .map(|x| x * x.ln())
        .sum::<f64>()
}

fn close(what: &str, got: f64, want: f64) {
    assert!(
        (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
        "{what}: {got} not {want}"
    );
}

#[test]
fn diagnostics_match_hand_computed_values_with_a_dead_expert_and_a_drop() {
    for dev in
        common::devices("diagnostics_match_hand_computed_values_with_a_dead_expert_and_a_drop")
    {
        let uniform = [0.25; 8];
        let balanced = |dev| stats(&uniform, &[0.0; 8], &[1.0; 4], &[1.0; 4], dev);
        // layer 0, step 1: 4 assignments routed (k = 2), one dropped by capacity, expert 3 unused
        let p1 = [0.7, 0.1, 0.1, 0.1, 0.25, 0.25, 0.25, 0.25];
        let l1 = [2.0, -1.0, 0.0, 0.5, 1.0, 1.0, 1.0, -3.0];
        // step 2: nothing dropped, expert 3 unused again
        let p2 = [0.1, 0.6, 0.2, 0.1, 0.4, 0.4, 0.1, 0.1];
        let l2 = [0.0, 3.0, 0.0, 0.0, -4.0, 0.0, 0.0, 0.0];
        let mut w = RoutingWindow::new();
        assert!(w.is_empty());
        w.add(&[
            stats(&p1, &l1, &[2.0, 1.0, 1.0, 0.0], &[1.0, 1.0, 1.0, 0.0], dev),
            balanced(dev),
        ])
        .unwrap();
        w.add(&[
            stats(&p2, &l2, &[1.0, 2.0, 1.0, 0.0], &[1.0, 2.0, 1.0, 0.0], dev),
            balanced(dev),
        ])
        .unwrap();
        let d = w.read().unwrap();
        let (a, b) = (&d.layers[0], &d.layers[1]);
        // kept [2, 3, 2, 0] of 7, routed [3, 3, 2, 0] of 8, over 4 tokens
        let want_load = [2.0 / 7.0, 3.0 / 7.0, 2.0 / 7.0, 0.0];
        let want_before = [3.0 / 8.0, 3.0 / 8.0, 2.0 / 8.0, 0.0];
        for e in 0..4 {
            close("load", a.load[e], want_load[e]);
            close(
                "load before capacity",
                a.load_before_capacity[e],
                want_before[e],
            );
        }
        close("load/ideal", a.load_max_over_ideal, 4.0 * 3.0 / 7.0);
        assert_eq!(a.dead_experts, 1, "{dev}");
        close("top share", a.top_share, 3.0 / 4.0);
        close("drop rate", a.drop_rate, 1.0 / 8.0);
        // 8 routed assignments over 4 tokens: k = 2 each
        close("experts per token", a.experts_per_token, 2.0);
        assert_eq!(
            (a.tokens, a.kept_assignments, a.routed_assignments),
            (4, 7.0, 8.0)
        );
        let rows: Vec<&[f64]> = p1.chunks(4).chain(p2.chunks(4)).collect();
        let mean: Vec<f64> = (0..4)
            .map(|e| rows.iter().map(|r| r[e]).sum::<f64>() / 4.0)
            .collect();
        close(
            "exp(H)/n",
            a.routing_entropy_ratio,
            entropy(&mean).exp() / 4.0,
        );
        let token_h = rows.iter().map(|r| entropy(r)).sum::<f64>() / 4.0;
        close("token entropy", a.token_entropy, token_h);
        let sq: f64 = l1.iter().chain(&l2).map(|x| x * x).sum();
        close("logit rms", a.logit_rms, (sq / 16.0).sqrt());
        close("logit max", a.logit_max, 4.0);
        // the balanced layer
        assert_eq!(b.dead_experts, 0);
        close("balanced load/ideal", b.load_max_over_ideal, 1.0);
        close("balanced exp(H)/n", b.routing_entropy_ratio, 1.0);
        close("balanced top share", b.top_share, 2.0 / 4.0);
        close("balanced logit rms", b.logit_rms, 0.0);
        // spreads across the two layers
        assert_eq!(
            d.dead_experts,
            Spread {
                min: 0.0,
                median: 0.5,
                max: 1.0
            }
        );
        close("spread max", d.load_max_over_ideal.max, 12.0 / 7.0);
        close(
            "spread median",
            d.load_max_over_ideal.median,
            (1.0 + 12.0 / 7.0) / 2.0,
        );
        assert!(d.short().contains("dead 1/4"), "{}", d.short());

        // the alarm: one dead expert of four is a quarter; the busiest serves 3/4 of the tokens
        let alarm = |dead_fraction, top_share| {
            CollapseAlarm {
                dead_fraction,
                top_share,
            }
            .check(&d)
        };
        let fired = alarm(0.25, 2.0).expect("a quarter dead at --collapse-dead 0.25");
        assert!(
            fired.contains("MoE layer 0: 1 of 4 experts dead") && !fired.contains("layer 1"),
            "{fired}"
        );
        assert!(
            alarm(0.5, 2.0).is_none(),
            "a quarter dead is below --collapse-dead 0.5"
        );
        assert!(
            alarm(2.0, 0.7).is_some(),
            "75% of the tokens is above --collapse-share 0.7"
        );
        assert!(
            alarm(2.0, 0.8).is_none(),
            "75% of the tokens is below --collapse-share 0.8"
        );
        // an expert on every token is no collapse when it takes no more than its share of the
        // assignments (every expert on every token: k = n, or remoe with its gates open)
        let mut even = d.clone();
        even.layers[0].top_share = 1.0;
        even.layers[0].load_max_over_ideal = 1.0;
        even.layers[0].dead_experts = 0;
        let even_alarm = CollapseAlarm {
            dead_fraction: 2.0,
            top_share: 0.7,
        };
        assert!(even_alarm.check(&even).is_none(), "an even dense layer");
        even.layers[0].load_max_over_ideal = 1.6;
        assert!(
            even_alarm.check(&even).is_some(),
            "1.6 times the fair share"
        );
    }
}

/// `RoutingStats::weight_per_expert` from each form a forward pass leaves: the plan's rows (a
/// dropped row's weight not counted), the all-experts path's `[T, n]` weights, and the totals.
#[test]
fn weight_per_expert_sums_kept_weights_by_expert() {
    let mut devices = vec![Device::cpu()];
    devices.extend(common::gpu_or_skip(
        "weight_per_expert_sums_kept_weights_by_expert",
    ));
    for dev in devices {
        let mut s = stats(&[0.25; 8], &[0.0; 8], &[1.0; 4], &[1.0; 4], dev);
        s.expert_weights = ExpertWeights::PerRow {
            weight: t(&[0.5, 0.25, 1.0, 2.0, 4.0], &[5], dev),
            kept: t(&[1.0, 0.0, 1.0, 1.0, 1.0], &[5], dev),
            expert: Tensor::from_i32(vec![1, 1, 0, 1, 3], &[5], dev).unwrap(),
            experts: 4,
            slot_of_row: None,
        };
        let got = s.weight_per_expert().unwrap().to_vec_f64().unwrap();
        assert_eq!(got, vec![1.0, 2.5, 0.0, 4.0], "per row on {dev}");
        // the same weights per slot: row r's weight at slot_of_row[r]
        s.expert_weights = ExpertWeights::PerRow {
            weight: t(&[2.0, 0.5, 4.0, 0.25, 1.0], &[5], dev),
            kept: t(&[1.0, 0.0, 1.0, 1.0, 1.0], &[5], dev),
            expert: Tensor::from_i32(vec![1, 1, 0, 1, 3], &[5], dev).unwrap(),
            experts: 4,
            slot_of_row: Some(Tensor::from_i32(vec![1, 3, 4, 0, 2], &[5], dev).unwrap()),
        };
        let got = s.weight_per_expert().unwrap().to_vec_f64().unwrap();
        assert_eq!(got, vec![1.0, 2.5, 0.0, 4.0], "per slot on {dev}");
        s.expert_weights = ExpertWeights::PerToken(t(
            &[0.125, 0.5, 0.0, 0.375, 0.25, 0.25, 0.5, 0.0],
            &[2, 4],
            dev,
        ));
        let got = s.weight_per_expert().unwrap().to_vec_f64().unwrap();
        assert_eq!(got, vec![0.375, 0.75, 0.5, 0.375], "per token on {dev}");
        s.expert_weights = ExpertWeights::Summed(t(&[1.0, 2.0, 3.0, 4.0], &[4], dev));
        let got = s.weight_per_expert().unwrap().to_vec_f64().unwrap();
        assert_eq!(got, vec![1.0, 2.0, 3.0, 4.0], "summed on {dev}");
    }
}
