//! The `deepseek-v3` router (src/moe/routers/deepseek_v3.rs): DeepSeek-V3's sigmoid scores, a
//! selection-only correction bias and group-limited top-k.
//!
//! Numbered properties, each a test:
//! * (P1) selection uses the biased scores, the weights the unbiased ones;
//! * (P2) every chosen expert lies in one of the `topk_group` best groups;
//! * (P3) with one group, zero bias and `norm_topk_prob`, it is sigmoid → top-k → renormalise;
//! * (P4) with `norm_topk_prob` the weights of a token sum to `routed_scaling_factor`;
//! * (P5) an f64 gradcheck of an MoE layer using it, w.r.t. the input and every parameter;
//! * (P6) the bias survives a `state()`/`load_state()` round trip and is not a parameter.
//!
//! Then an f64 reference written from the definition with plain loops over random shapes
//! (proptest), parity with transformers' `DeepseekV3TopkRouter` on a fixture it wrote
//! (scripts/make_deepseek_router_fixture.py), GPU against CPU (skipped with a printed reason
//! without an adapter), and option errors.

mod common;

use moegrad::gradcheck::{GradcheckOptions, gradcheck};
use moegrad::moe::routers::DeepSeekV3Router;
use moegrad::moe::{MoeConfig, MoeLayer, Router, RouterConfig, Routing, build_router};
use moegrad::nn::Parameters;
use moegrad::{DType, Device, Result, Tensor};
use proptest::prelude::*;

const BIAS: &str = DeepSeekV3Router::CORRECTION_BIAS;

use common::uniform_vec;

fn options(opts: &[(&str, &str)]) -> std::collections::BTreeMap<String, String> {
    opts.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// A `deepseek-v3` router `d → n`, top-k, gate without bias, with weight `w` (`[d, n]`) and
/// correction bias `b`, in `dtype`.
fn router(
    d: usize,
    n: usize,
    k: usize,
    opts: &[(&str, &str)],
    w: &[f64],
    b: &[f64],
    dtype: DType,
) -> DeepSeekV3Router {
    let mut cfg = RouterConfig::new(d, n, k);
    cfg.gate_bias = false;
    cfg.options = options(opts);
    let r = DeepSeekV3Router::new(&cfg, Device::cpu()).unwrap();
    let wt = common::tensor_on(w.to_vec(), &[d, n], dtype, Device::cpu());
    r.gate().weight.set(wt).unwrap();
    r.set_correction_bias(&common::f64t(b, &[n])).unwrap();
    r
}

/// Each token's `(expert, weight)` pairs, sorted by expert.
fn chosen(r: &Routing) -> Vec<Vec<(usize, f64)>> {
    let e = r.expert.to_vec_i32().unwrap();
    let w = r.weight.to_vec_f64().unwrap();
    let k = e.len() / r.tokens;
    (0..r.tokens)
        .map(|t| {
            let mut v: Vec<(usize, f64)> = (0..k)
                .map(|j| (e[t * k + j] as usize, w[t * k + j]))
                .collect();
            v.sort_by_key(|p| p.0);
            v
        })
        .collect()
}

fn sigmoid(z: f64) -> f64 {
    1.0 / (1.0 + (-z).exp())
}

/// The settings of a reference computation.
#[derive(Clone, Copy, Debug)]
struct Opts {
    k: usize,
    n_group: usize,
    topk_group: usize,
    norm: bool,
    rsf: f64,
}

/// The groups a token keeps (sorted), from its biased scores `c`, by plain loops.
fn best_groups(c: &[f64], o: Opts) -> Vec<usize> {
    let per = c.len() / o.n_group;
    let mut scores: Vec<(usize, f64)> = (0..o.n_group)
        .map(|g| {
            let mut m = c[g * per..(g + 1) * per].to_vec();
            m.sort_by(|a, b| b.partial_cmp(a).unwrap());
            (g, m[0] + m[1])
        })
        .collect();
    scores.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap().then(a.0.cmp(&b.0)));
    let mut keep: Vec<usize> = scores[..o.topk_group].iter().map(|p| p.0).collect();
    keep.sort();
    keep
}

/// The definition, per token, by plain loops: `(expert, weight)` sorted by expert.
fn reference(logits: &[f64], bias: &[f64], o: Opts) -> Vec<(usize, f64)> {
    let n = logits.len();
    let per = n / o.n_group;
    let s: Vec<f64> = logits.iter().map(|&z| sigmoid(z)).collect();
    let c: Vec<f64> = s.iter().zip(bias).map(|(a, b)| a + b).collect();
    let keep = if o.n_group > 1 {
        best_groups(&c, o)
    } else {
        vec![0]
    };
    let mut cand: Vec<usize> = (0..n).filter(|i| keep.contains(&(i / per))).collect();
    cand.sort_by(|&a, &b| c[b].partial_cmp(&c[a]).unwrap().then(a.cmp(&b)));
    let mut sel: Vec<usize> = cand[..o.k].to_vec();
    sel.sort();
    let total: f64 = sel.iter().map(|&i| s[i]).sum();
    sel.iter()
        .map(|&i| {
            let w = if o.norm { s[i] / (total + 1e-20) } else { s[i] };
            (i, w * o.rsf)
        })
        .collect()
}

/// `x·W` on the host, `[T, n]` rows.
fn host_logits(x: &[f64], w: &[f64], d: usize, n: usize) -> Vec<Vec<f64>> {
    x.chunks(d)
        .map(|row| {
            (0..n)
                .map(|j| (0..d).map(|i| row[i] * w[i * n + j]).sum())
                .collect()
        })
        .collect()
}

fn opt_list(o: Opts) -> Vec<(&'static str, String)> {
    vec![
        ("n_group", o.n_group.to_string()),
        ("topk_group", o.topk_group.to_string()),
        ("norm_topk_prob", o.norm.to_string()),
        ("routed_scaling_factor", o.rsf.to_string()),
    ]
}

fn borrowed<'a>(v: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    v.iter().map(|(k, s)| (*k, s.as_str())).collect()
}

// ---- (P1)–(P4) ----

/// (P1) A bias that flips the choice changes the selection, but the chosen weight is still the
/// unbiased `sigmoid(logit)`.
#[test]
fn p1_selection_uses_biased_scores_and_weights_the_unbiased_ones() {
    let eye: Vec<f64> = (0..16)
        .map(|i| if i % 5 == 0 { 1.0 } else { 0.0 })
        .collect();
    let opts = [("norm_topk_prob", "false")];
    let x = common::f64t(&[2.0, 1.0, 0.0, 0.0], &[1, 4]);
    let plain = router(4, 4, 1, &opts, &eye, &[0.0; 4], DType::F64);
    let biased = router(4, 4, 1, &opts, &eye, &[0.0, 0.5, 0.0, 0.0], DType::F64);
    let a = chosen(&plain.route(&x).unwrap());
    let b = chosen(&biased.route(&x).unwrap());
    assert_eq!(a[0][0].0, 0, "without bias the largest logit wins");
    assert!((a[0][0].1 - sigmoid(2.0)).abs() < 1e-12);
    // sigmoid(1) + 0.5 = 1.23 > sigmoid(2) = 0.88: the bias flips the choice ...
    assert_eq!(b[0][0].0, 1, "the bias must change the selection");
    // ... and the weight is the unbiased score of the chosen expert
    assert!(
        (b[0][0].1 - sigmoid(1.0)).abs() < 1e-12,
        "weight {} must be sigmoid(1) = {}",
        b[0][0].1,
        sigmoid(1.0)
    );
}

/// (P2) Every chosen expert lies in one of the `topk_group` best groups (group score: the sum
/// of its top-2 biased scores), on random tokens, weights and biases.
#[test]
fn p2_every_chosen_expert_is_in_a_kept_group() {
    let (d, n) = (6, 16);
    let o = Opts {
        k: 4,
        n_group: 4,
        topk_group: 2,
        norm: true,
        rsf: 1.0,
    };
    for seed in 0..8u64 {
        let w = uniform_vec(d * n, -1.5, 1.5, seed);
        let b = uniform_vec(n, -0.3, 0.3, seed + 100);
        let xs = uniform_vec(20 * d, -1.0, 1.0, seed + 200);
        let ol = opt_list(o);
        let r = router(d, n, o.k, &borrowed(&ol), &w, &b, DType::F64);
        let got = chosen(&r.route(&common::f64t(&xs, &[20, d])).unwrap());
        for (t, row) in host_logits(&xs, &w, d, n).iter().enumerate() {
            let c: Vec<f64> = row.iter().zip(&b).map(|(z, bi)| sigmoid(*z) + bi).collect();
            let keep = best_groups(&c, o);
            for &(e, _) in &got[t] {
                assert!(
                    keep.contains(&(e / 4)),
                    "seed {seed}, token {t}: expert {e} of group {} is outside the kept groups {keep:?}",
                    e / 4
                );
            }
        }
    }
}

/// (P3) With one group, zero bias and `norm_topk_prob`, the router is sigmoid → top-k →
/// renormalise, computed here by hand.
#[test]
fn p3_one_group_zero_bias_is_sigmoid_topk_renormalised() {
    let (d, n, k, t) = (5, 7, 3, 9);
    let w = uniform_vec(d * n, -1.0, 1.0, 3);
    let xs = uniform_vec(t * d, -2.0, 2.0, 4);
    let r = router(d, n, k, &[], &w, &[0.0; 7], DType::F64);
    let got = chosen(&r.route(&common::f64t(&xs, &[t, d])).unwrap());
    for (ti, row) in host_logits(&xs, &w, d, n).iter().enumerate() {
        let s: Vec<f64> = row.iter().map(|&z| sigmoid(z)).collect();
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&a, &b| s[b].partial_cmp(&s[a]).unwrap());
        let mut top: Vec<usize> = order[..k].to_vec();
        top.sort();
        let total: f64 = top.iter().map(|&i| s[i]).sum();
        let want: Vec<(usize, f64)> = top.iter().map(|&i| (i, s[i] / total)).collect();
        assert_eq!(got[ti].len(), k);
        for ((ge, gw), (we, ww)) in got[ti].iter().zip(&want) {
            assert_eq!(ge, we, "token {ti}");
            assert!((gw - ww).abs() < 1e-12, "token {ti}: {gw} vs {ww}");
        }
    }
}

/// (P4) With `norm_topk_prob` each token's weights sum to `routed_scaling_factor`; without,
/// they are `routed_scaling_factor` times raw sigmoids.
#[test]
fn p4_normalised_weights_sum_to_the_scaling_factor() {
    let (d, n, t) = (4, 8, 11);
    let w = uniform_vec(d * n, -1.0, 1.0, 5);
    let b = uniform_vec(n, -0.2, 0.2, 6);
    let xs = uniform_vec(t * d, -1.0, 1.0, 7);
    let opts = [
        ("n_group", "2"),
        ("topk_group", "1"),
        ("routed_scaling_factor", "2.5"),
    ];
    let r = router(d, n, 3, &opts, &w, &b, DType::F64);
    for (ti, row) in chosen(&r.route(&common::f64t(&xs, &[t, d])).unwrap())
        .iter()
        .enumerate()
    {
        let sum: f64 = row.iter().map(|p| p.1).sum();
        assert!(
            (sum - 2.5).abs() < 1e-12,
            "token {ti}: weights sum to {sum}"
        );
    }
}

// ---- (P5) the whole layer in f64 ----

fn layer_config(opts: &[(&str, &str)]) -> MoeConfig {
    let mut cfg = MoeConfig::new(5, 4, 8, 2);
    cfg.d_out = 3;
    cfg.router = "deepseek-v3".into();
    cfg.router_options = options(opts);
    cfg.gate_bias = false;
    cfg.seed = 41;
    cfg
}

const LAYER_OPTS: [(&str, &str); 4] = [
    ("n_group", "4"),
    ("topk_group", "2"),
    ("routed_scaling_factor", "1.7"),
    ("norm_topk_prob", "true"),
];

/// (P5) f64 gradcheck of an MoE layer routed by `deepseek-v3` (nonzero bias, groups), w.r.t.
/// the input and every parameter (the gate included), both with and without normalisation.
#[test]
fn p5_layer_gradcheck_in_f64() {
    for norm in ["true", "false"] {
        let mut opts = LAYER_OPTS.to_vec();
        opts[3].1 = norm;
        let cfg = layer_config(&opts);
        let bias = common::f64t(&uniform_vec(8, -0.2, 0.2, 43), &[8]);
        let make = || {
            let l = MoeLayer::new(&cfg, Device::cpu()).unwrap();
            l.load_state(&format!("router.{BIAS}"), &bias).unwrap();
            l
        };
        let proto = make();
        let mut inputs = vec![common::f64t(&uniform_vec(7 * 5, -1.0, 1.0, 47), &[7, 5])];
        for (i, (name, p)) in proto.named_params().into_iter().enumerate() {
            // nonzero biases so no hidden unit sits at the ReLU kink
            let value = match name.ends_with("b1") || name.ends_with("b2") {
                true => Tensor::from_f64(
                    uniform_vec(p.get().numel(), -0.3, 0.3, 60 + i as u64),
                    p.get().shape(),
                    Device::cpu(),
                )
                .unwrap(),
                false => p.get().to_dtype(DType::F64).unwrap(),
            };
            inputs.push(value);
        }
        assert!(
            proto
                .named_params()
                .iter()
                .any(|(n, _)| n.contains("router")),
            "the gate must be among the checked inputs"
        );
        let f = |v: &[Tensor]| -> Result<Tensor> {
            let l = make();
            for ((_, p), value) in l.named_params().iter().zip(&v[1..]) {
                p.set(value.clone())?;
            }
            common::test_loss(&l.forward(&v[0])?.y)
        };
        if let Err(e) = gradcheck(f, &inputs, &GradcheckOptions::default()) {
            panic!("norm_topk_prob = {norm}: {e}");
        }
    }
}

// ---- (P6) state ----

/// (P6) The correction bias is state, not a parameter: zeros at initialisation, restored by
/// `load_state` from `state()` (also through an MoE layer) so routing is identical.
#[test]
fn p6_bias_round_trips_through_state_and_is_not_a_parameter() {
    let cfg = layer_config(&LAYER_OPTS);
    let a = MoeLayer::new(&cfg, Device::cpu()).unwrap();
    let key = format!("router.{BIAS}");
    let find = |l: &MoeLayer| -> Vec<f64> {
        let st = l.state().unwrap();
        let (_, t) = st.iter().find(|(n, _)| *n == key).expect("bias in state");
        t.to_vec_f64().unwrap()
    };
    assert_eq!(find(&a), vec![0.0; 8], "zeros at initialisation");
    let bias = uniform_vec(8, -0.5, 0.5, 9);
    a.load_state(&key, &common::f64t(&bias, &[8])).unwrap();
    let saved = find(&a);
    for (s, b) in saved.iter().zip(&bias) {
        assert!((s - b).abs() < 1e-7, "stored as f32: {s} vs {b}");
    }
    assert!(
        a.named_params().iter().all(|(n, _)| !n.contains(BIAS)),
        "the correction bias must not be a parameter"
    );
    let b = MoeLayer::new(&cfg, Device::cpu()).unwrap();
    for (name, t) in a.state().unwrap() {
        b.load_state(&name, &t).unwrap();
    }
    assert_eq!(find(&b), saved);
    let x = common::f64t(&uniform_vec(20 * 5, -1.0, 1.0, 11), &[20, 5])
        .to_dtype(DType::F32)
        .unwrap();
    let (ra, rb) = (a.router().route(&x).unwrap(), b.router().route(&x).unwrap());
    assert_eq!(chosen(&ra), chosen(&rb));
    let fresh = MoeLayer::new(&cfg, Device::cpu()).unwrap();
    assert_ne!(
        chosen(&fresh.router().route(&x).unwrap()),
        chosen(&ra),
        "the bias of this test must change some selection"
    );
    assert!(a.load_state(&key, &common::f64t(&[0.0; 3], &[3])).is_err());
}

// ---- the definition over random shapes ----

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// f64 routing equals the plain-loop reference of the definition, indices and weights.
    #[test]
    fn routing_matches_the_definition(
        t in 1usize..9, d in 1usize..6, n_group in 1usize..5, per in 2usize..5,
        tg_frac in 0.0f64..1.0, k_frac in 0.0f64..1.0, norm in any::<bool>(),
        rsf in 0.5f64..3.0, seed in 0u64..1000,
    ) {
        let n = n_group * per;
        let topk_group = 1 + ((n_group as f64 - 1.0) * tg_frac).round() as usize;
        let k = 1 + (((topk_group * per - 1) as f64) * k_frac).round() as usize;
        let o = Opts { k, n_group, topk_group, norm, rsf };
        let w = uniform_vec(d * n, -2.0, 2.0, seed);
        let b = uniform_vec(n, -0.3, 0.3, seed + 1);
        let xs = uniform_vec(t * d, -1.0, 1.0, seed + 2);
        let ol = opt_list(o);
        let r = router(d, n, k, &borrowed(&ol), &w, &b, DType::F64);
        let routing = r.route(&common::f64t(&xs, &[t, d])).unwrap();
        let got = chosen(&routing);
        let b32: Vec<f64> = b.iter().map(|&v| v as f32 as f64).collect(); // the bias is stored as f32
        for (ti, row) in host_logits(&xs, &w, d, n).iter().enumerate() {
            let want = reference(row, &b32, o);
            let ge: Vec<usize> = got[ti].iter().map(|p| p.0).collect();
            let we: Vec<usize> = want.iter().map(|p| p.0).collect();
            prop_assert_eq!(&ge, &we, "token {} of {:?}", ti, o);
            for (g, w) in got[ti].iter().zip(&want) {
                prop_assert!((g.1 - w.1).abs() < 1e-12, "token {}: {} vs {}", ti, g.1, w.1);
            }
            // probs: the sigmoid scores normalised per token
            let s: Vec<f64> = row.iter().map(|&z| sigmoid(z)).collect();
            let total: f64 = s.iter().sum();
            let p = routing.probs.slice(0, ti, ti + 1).unwrap().to_vec_f64().unwrap();
            for (pi, si) in p.iter().zip(&s) {
                prop_assert!((pi - si / total).abs() < 1e-12);
            }
        }
    }
}

// ---- transformers ----

/// Matches transformers' `DeepseekV3TopkRouter` (n = 16 in 4 groups, keep 2, k = 3, scaling
/// 2.5, nonzero correction bias, `norm_topk_prob` both ways): indices exactly, weights to 1e-6.
#[test]
fn matches_transformers_deepseek_v3_topk_router() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/deepseek_router/router.json"
    ))
    .expect("fixture written by scripts/make_deepseek_router_fixture.py");
    let j: serde_json::Value = serde_json::from_str(&text).unwrap();
    let num = |k: &str| j[k].as_f64().unwrap();
    let list = |v: &serde_json::Value| -> Vec<f64> {
        v.as_array()
            .unwrap()
            .iter()
            .flat_map(|e| match e.as_array() {
                Some(row) => row.iter().map(|x| x.as_f64().unwrap()).collect(),
                None => vec![e.as_f64().unwrap()],
            })
            .collect()
    };
    let (t, d, n, k) = (num("tokens"), num("d"), num("experts"), num("k"));
    let (t, d, n, k) = (t as usize, d as usize, n as usize, k as usize);
    let w_torch = list(&j["weight"]); // [n, d]
    let w: Vec<f64> = (0..d * n).map(|i| w_torch[(i % n) * d + i / n]).collect(); // [d, n]
    let (x, b) = (list(&j["x"]), list(&j["bias"]));
    for case in j["cases"].as_array().unwrap() {
        let norm = case["norm_topk_prob"].as_bool().unwrap();
        let ol = vec![
            ("n_group", num("n_group").to_string()),
            ("topk_group", num("topk_group").to_string()),
            ("norm_topk_prob", norm.to_string()),
            (
                "routed_scaling_factor",
                num("routed_scaling_factor").to_string(),
            ),
        ];
        let r = router(d, n, k, &borrowed(&ol), &w, &b, DType::F32);
        let xt = common::tensor_on(x.clone(), &[t, d], DType::F32, Device::cpu());
        let got = chosen(&r.route(&xt).unwrap());
        let (want_i, want_w) = (list(&case["indices"]), list(&case["weights"]));
        for ti in 0..t {
            let gi: Vec<f64> = got[ti].iter().map(|p| p.0 as f64).collect();
            assert_eq!(gi, want_i[ti * k..(ti + 1) * k], "norm {norm}, token {ti}");
            let gw: Vec<f64> = got[ti].iter().map(|p| p.1).collect();
            common::assert_close(
                &format!("norm {norm}, token {ti}"),
                &gw,
                &want_w[ti * k..(ti + 1) * k],
                1e-6,
                0.0,
            );
        }
    }
}

// ---- GPU ----

/// The GPU (f32) routes and back-propagates an MoE layer as the CPU (f64) does.
#[test]
fn gpu_matches_cpu() {
    let Some(gpu) = common::gpu_or_skip("gpu_matches_cpu") else {
        return;
    };
    let cfg = layer_config(&LAYER_OPTS);
    let bias = common::f64t(&uniform_vec(8, -0.2, 0.2, 13), &[8]);
    let x = uniform_vec(33 * 5, -1.0, 1.0, 17);
    let run = |dev: Device, dtype: DType| -> Vec<Vec<f64>> {
        let l = MoeLayer::new(&cfg, dev).unwrap();
        l.load_state(&format!("router.{BIAS}"), &bias).unwrap();
        for (_, p) in l.named_params() {
            p.set(p.get().to_dtype(dtype).unwrap()).unwrap();
        }
        let xd = common::tensor_on(x.clone(), &[33, 5], dtype, dev)
            .with_grad()
            .unwrap();
        let r = l.router().route(&xd).unwrap();
        let out = l.forward_routed(&xd, std::slice::from_ref(&r)).unwrap();
        common::test_loss(&out.y).unwrap().backward().unwrap();
        let mut v = vec![
            r.expert.to_dtype(DType::F32).unwrap().to_vec_f64().unwrap(),
            r.weight.to_vec_f64().unwrap(),
            r.probs.to_vec_f64().unwrap(),
            out.y.to_vec_f64().unwrap(),
            xd.grad().unwrap().to_vec_f64().unwrap(),
        ];
        v.extend(
            l.named_params()
                .iter()
                .map(|(_, p)| p.grad().unwrap().to_vec_f64().unwrap()),
        );
        v
    };
    let want = run(Device::cpu(), DType::F64);
    let got = run(gpu, DType::F32);
    assert_eq!(got[0], want[0], "the same experts must be chosen");
    for (i, (a, b)) in got.iter().zip(&want).enumerate().skip(1) {
        common::assert_close(&format!("{gpu:?}, tensor {i}"), a, b, 2e-4, 2e-3);
    }
}

// ---- bad options ----

#[test]
fn bad_options_are_errors_naming_the_option() {
    for (n, k, opts, names) in [
        (8, 2, vec![("n_group", "3")], "n_group"),
        (8, 2, vec![("n_group", "0")], "n_group"),
        (
            8,
            2,
            vec![("n_group", "2"), ("topk_group", "3")],
            "topk_group",
        ),
        (
            8,
            2,
            vec![("n_group", "2"), ("topk_group", "0")],
            "topk_group",
        ),
        (8, 2, vec![("n_group", "8"), ("topk_group", "2")], "n_group"),
        (8, 5, vec![("n_group", "2"), ("topk_group", "1")], "k = 5"),
        (8, 2, vec![("norm_topk_prob", "maybe")], "norm_topk_prob"),
        (
            8,
            2,
            vec![("routed_scaling_factor", "x")],
            "routed_scaling_factor",
        ),
        (8, 2, vec![("groups", "2")], "groups"),
    ] {
        let mut cfg = RouterConfig::new(4, n, k);
        cfg.options = options(&opts);
        let err = match build_router("deepseek-v3", &cfg, Device::cpu()) {
            Ok(_) => panic!("{opts:?} (n = {n}, k = {k}) must be refused"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains(names), "{opts:?}: {err:?} must name {names}");
    }
    let r = router(4, 4, 1, &[], &[0.0; 16], &[0.0; 4], DType::F32);
    assert!(
        r.set_correction_bias(&common::f64t(&[0.0; 5], &[5]))
            .is_err()
    );
    let nan = common::f64t(&[0.0, f64::NAN, 0.0, 0.0], &[4]);
    assert!(r.set_correction_bias(&nan).is_err());
}
