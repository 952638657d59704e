//! DSelect-k (`dselect-k`, `dselect-k-static`) against the properties of the DSelect-k paper
//! and docs/routers.md (`dselect-k`): the smooth-step, the binary-encoding selector laws,
//! saturation, the initial
//! state, simplex and sparsity, sparse-evaluation invariance (only experts with nonzero gate
//! weight run), the closed-form backward of §3, gradcheck of the gate and of its regularisers,
//! non-power-of-two n, a property test over random shapes, GPU parity, and bad options.

mod common;

use moegrad::gradcheck::{GradcheckOptions, gradcheck};
use moegrad::moe::RouterConfig;
use moegrad::moe::routers::{
    DSelectKKind, DSelectKRouter, selector_bits, selector_probs, smooth_step,
};
use moegrad::moe::{MoeConfig, MoeLayer, Router, build_router};
use moegrad::nn::Param;
use moegrad::nn::Parameters;
use moegrad::{DType, Device, Result, Tensor};
use proptest::prelude::*;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn host_rand(len: usize, seed: u64, lo: f64, hi: f64) -> Vec<f64> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..len).map(|_| rng.random_range(lo..hi)).collect()
}

fn randt(shape: &[usize], seed: u64, lo: f64, hi: f64) -> Tensor {
    let n = shape.iter().product();
    common::f64t(&host_rand(n, seed, lo, hi), shape)
}

/// Values in (−0.45γ, 0.45γ) kept at least 0.02γ away from 0: generic points, away from the knots.
fn generic(shape: &[usize], seed: u64, gamma: f64) -> Tensor {
    let n = shape.iter().product();
    let v: Vec<f64> = host_rand(n, seed, 0.02, 0.45)
        .iter()
        .zip(host_rand(n, seed + 1, -1.0, 1.0))
        .map(|(a, s)| a * gamma * s.signum())
        .collect();
    common::f64t(&v, shape)
}

fn cfg(d: usize, n: usize, k: usize, opts: &[(&str, &str)]) -> RouterConfig {
    let mut c = RouterConfig::new(d, n, k);
    c.seed = 3;
    c.options = opts
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    c
}

fn params(r: &dyn Router) -> Vec<(String, Param)> {
    let mut v = Vec::new();
    r.visit_params("", &mut |n, p| v.push((n, p.clone())));
    v
}

fn set(r: &dyn Router, name: &str, value: Tensor) {
    let p = params(r)
        .into_iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| panic!("no parameter {name}"))
        .1;
    p.set(value).unwrap();
}

fn to_f64(r: &dyn Router) {
    for (_, p) in params(r) {
        p.set(p.get().to_dtype(DType::F64).unwrap().detach())
            .unwrap();
    }
}

/// The gate q `[T, n]` as a dense row-major table (from the routing's sparse slots).
fn dense_gate(r: &dyn Router, x: &Tensor, n: usize) -> Vec<f64> {
    let routing = r.route(x).unwrap();
    let t = routing.tokens;
    let tok = routing.token.to_vec_i32().unwrap();
    let ex = routing.expert.to_vec_i32().unwrap();
    let w = routing.weight.to_vec_f64().unwrap();
    let valid = routing.valid.to_vec_f64().unwrap();
    let mut q = vec![0.0; t * n];
    for a in 0..tok.len() {
        if valid[a] > 0.0 {
            q[tok[a] as usize * n + ex[a] as usize] += w[a];
        } else {
            assert_eq!(w[a], 0.0, "an invalid slot must carry weight 0");
        }
    }
    q
}

fn binary_entropy(p: f64) -> f64 {
    let term = |x: f64| if x > 0.0 { -x * x.ln() } else { 0.0 };
    term(p) + term(1.0 - p)
}

#[test]
fn p17_smooth_step_shape() {
    for gamma in [0.1, 1.0, 10.0] {
        let h = gamma / 2.0;
        let ts: Vec<f64> = (-60..=60).map(|i| i as f64 * gamma / 50.0).collect();
        let t = common::f64t(&ts, &[ts.len()]).with_grad().unwrap();
        let s = smooth_step(&t, gamma).unwrap();
        s.sum_all().unwrap().backward().unwrap();
        let sv = s.to_vec_f64().unwrap();
        let ds = t.grad().unwrap().to_vec_f64().unwrap();
        for (i, &x) in ts.iter().enumerate() {
            assert!(
                (0.0..=1.0).contains(&sv[i]),
                "S({x}) = {} outside [0, 1]",
                sv[i]
            );
            assert!(ds[i] >= 0.0, "S'({x}) = {} < 0", ds[i]);
            // symmetry S(−t) = 1 − S(t): ts is symmetric around its middle
            let j = ts.len() - 1 - i;
            assert!(
                (sv[i] + sv[j] - 1.0).abs() < 1e-12,
                "S(−t) ≠ 1 − S(t) at {x}"
            );
            if x >= h {
                assert_eq!(sv[i], 1.0, "S({x}) must be exactly 1 (γ = {gamma})");
                assert_eq!(ds[i], 0.0);
            }
            if x <= -h {
                assert_eq!(sv[i], 0.0, "S({x}) must be exactly 0 (γ = {gamma})");
                assert_eq!(ds[i], 0.0);
            }
            if x.abs() < h {
                let expected = 1.5 / gamma - 6.0 * x * x / gamma.powi(3);
                assert!((ds[i] - expected).abs() < 1e-9, "S'({x})");
            }
        }
        let mid = ts.len() / 2;
        assert_eq!(sv[mid], 0.5, "S(0) = ½");
        assert!((ds[mid] - 1.5 / gamma).abs() < 1e-12, "S'(0) = 3/(2γ)");
        // S' is continuous: it tends to 0 at the knots from inside
        let near = common::f64t(&[h - 1e-7 * gamma], &[1]).with_grad().unwrap();
        smooth_step(&near, gamma)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        assert!(near.grad().unwrap().to_vec_f64().unwrap()[0] < 1e-5 / gamma);
    }
    let s = smooth_step(&common::f64t(&[0.25], &[1]), 1.0).unwrap();
    assert!((s.to_vec_f64().unwrap()[0] - 0.84375).abs() < 1e-15);
}

#[test]
fn p18_p19_selector_laws() {
    for m in 1..=4usize {
        let codes = 1 << m;
        // binary S(z): one-hot at Σ_j 2^j S(z_j)
        for code in 0..codes {
            let z: Vec<f64> = (0..m)
                .map(|j| if (code >> j) & 1 == 1 { 0.7 } else { -0.9 })
                .collect();
            let r = selector_probs(&common::f64t(&z, &[m]), 1.0)
                .unwrap()
                .to_vec_f64()
                .unwrap();
            for (e, &v) in r.iter().enumerate() {
                assert_eq!(v, if e == code { 1.0 } else { 0.0 }, "m {m} code {code}");
            }
        }
        // generic z: simplex, marginals, entropy identity, and the sign-flip symmetry
        let z = generic(&[m], 40 + m as u64, 1.0);
        let zv = z.to_vec_f64().unwrap();
        let r = selector_probs(&z, 1.0).unwrap().to_vec_f64().unwrap();
        let u = smooth_step(&z, 1.0).unwrap().to_vec_f64().unwrap();
        assert!((r.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        for (j, uj) in u.iter().enumerate() {
            let marginal: f64 = (0..codes).filter(|e| (e >> j) & 1 == 1).map(|e| r[e]).sum();
            assert!((marginal - uj).abs() < 1e-12, "marginal of bit {j}");
        }
        let h: f64 = r
            .iter()
            .map(|&p| if p > 0.0 { -p * p.ln() } else { 0.0 })
            .sum();
        let hb: f64 = u.iter().map(|&p| binary_entropy(p)).sum();
        assert!((h - hb).abs() < 1e-12, "h(r) = Σ H_b(S(z_j))");
        for j in 0..m {
            let mut flipped = zv.clone();
            flipped[j] = -flipped[j];
            let rf = selector_probs(&common::f64t(&flipped, &[m]), 1.0)
                .unwrap()
                .to_vec_f64()
                .unwrap();
            for e in 0..codes {
                assert!((rf[e] - r[e ^ (1 << j)]).abs() < 1e-12, "flip bit {j}");
            }
        }
    }
    assert_eq!(
        (1..=9).map(selector_bits).collect::<Vec<_>>(),
        vec![1, 1, 2, 2, 3, 3, 3, 3, 4]
    );
}

#[test]
fn p20_saturated_logits_get_zero_gradient_and_no_nan() {
    // static gate, n = 8, k = 2; selector 0 fully saturated, selector 1 half saturated
    let r = DSelectKRouter::new(
        &cfg(3, 8, 2, &[("entropy", "0.5")]),
        DSelectKKind::Static,
        Device::cpu(),
    )
    .unwrap();
    to_f64(&r);
    let z = common::f64t(&[0.6, -2.0, 0.5, 0.2, -0.51, 0.1], &[2, 3]);
    set(&r, "z", z.clone());
    set(&r, "alpha", common::f64t(&[0.3, -0.2], &[2]));
    let x = randt(&[5, 3], 1, -1.0, 1.0);
    let routing = r.route(&x).unwrap();
    let up = randt(&[routing.len()], 2, 0.5, 1.5);
    routing
        .weight
        .mul(&up)
        .unwrap()
        .sum_all()
        .unwrap()
        .add(routing.aux_loss.as_ref().unwrap())
        .unwrap()
        .backward()
        .unwrap();
    let gz = params(&r)
        .into_iter()
        .find(|(n, _)| n == "z")
        .unwrap()
        .1
        .grad()
        .unwrap()
        .to_vec_f64()
        .unwrap();
    for (i, (&zi, &g)) in z.to_vec_f64().unwrap().iter().zip(&gz).enumerate() {
        assert!(g.is_finite(), "gradient {i} is not finite");
        if zi.abs() >= 0.5 {
            assert_eq!(g, 0.0, "saturated logit {i} = {zi} got gradient {g}");
        } else {
            assert!(g != 0.0, "unsaturated logit {i} got no gradient");
        }
    }
    let aux = routing.aux_loss.unwrap().item().unwrap();
    assert!(aux.is_finite() && aux > 0.0);
    // saturated metric: 4 of 6 logits have |z| ≥ γ/2
    let (name, sat) = &routing.metrics[0];
    assert_eq!(*name, "dselect_saturated");
    assert!((sat.item().unwrap() - 4.0 / 6.0).abs() < 1e-12);
}

#[test]
fn p20_entropy_regulariser_is_summed_and_matches_binary_entropies() {
    // per-example gate: the aux loss is λ Σ_t Σ_i h(r^(i)(x_t)), h with the +1e-6 of the code
    let (d, n, k, t) = (3, 4, 2, 6);
    let r = DSelectKRouter::new(
        &cfg(d, n, k, &[("entropy", "0.1")]),
        DSelectKKind::PerExample,
        Device::cpu(),
    )
    .unwrap();
    to_f64(&r);
    set(&r, "z_weight", randt(&[d, k * 2], 5, -0.3, 0.3));
    let x = randt(&[t, d], 6, -1.0, 1.0);
    let routing = r.route(&x).unwrap();
    let aux = routing.aux_loss.unwrap().item().unwrap();
    let (_, z) = r.gate_logits(&x).unwrap();
    let u = smooth_step(&z, 1.0).unwrap().to_vec_f64().unwrap();
    let exact: f64 = u.iter().map(|&p| binary_entropy(p)).sum::<f64>() * 0.1;
    assert!(
        (aux - exact).abs() < 1e-5 * (t * k) as f64,
        "{aux} vs {exact}"
    );
}

#[test]
fn p21_p22_initial_state_and_static_gate() {
    for n in [2, 4, 5, 8] {
        // Z = 0, α = 0: every code has mass 1/2^m; with 2^m = n the gate is uniform 1/n
        let s =
            DSelectKRouter::new(&cfg(3, n, 2, &[]), DSelectKKind::Static, Device::cpu()).unwrap();
        to_f64(&s);
        let m = selector_bits(n);
        set(&s, "z", common::f64t(&vec![0.0; 2 * m], &[2, m]));
        set(&s, "alpha", common::f64t(&[0.0, 0.0], &[2]));
        let q = dense_gate(&s, &randt(&[3, 3], 1, -1.0, 1.0), n);
        if n.is_power_of_two() {
            assert!(
                q.iter().all(|&v| (v - 1.0 / n as f64).abs() < 1e-12),
                "n {n}: {q:?}"
            );
        }
        assert!((q[..n].iter().sum::<f64>() - 1.0).abs() < 1e-12);
        // static: the same gate for every token, whatever x is
        let q2 = dense_gate(&s, &randt(&[3, 3], 99, -5.0, 5.0), n);
        assert_eq!(q, q2);
        for row in q.chunks(n) {
            assert_eq!(row, &q[..n]);
        }
        // per-example with zero weights and biases → uniform (power of two)
        let p = DSelectKRouter::new(&cfg(3, n, 2, &[]), DSelectKKind::PerExample, Device::cpu())
            .unwrap();
        to_f64(&p);
        for (_, param) in params(&p) {
            param.set(param.get().zeros_like().unwrap()).unwrap();
        }
        let q = dense_gate(&p, &randt(&[4, 3], 2, -1.0, 1.0), n);
        if n.is_power_of_two() {
            assert!(q.iter().all(|&v| (v - 1.0 / n as f64).abs() < 1e-12));
        }
    }
}

#[test]
fn p1_p2_simplex_and_sparsity_at_saturation() {
    for (n, k) in [(8, 2), (16, 4), (5, 2), (6, 3)] {
        let m = selector_bits(n);
        let r = DSelectKRouter::new(&cfg(4, n, k, &[]), DSelectKKind::PerExample, Device::cpu())
            .unwrap();
        to_f64(&r);
        set(&r, "z_weight", randt(&[4, k * m], 7, -0.4, 0.4));
        let x = randt(&[9, 4], 8, -1.0, 1.0);
        let q = dense_gate(&r, &x, n);
        for row in q.chunks(n) {
            assert!(
                (row.iter().sum::<f64>() - 1.0).abs() < 1e-12,
                "n {n}: {row:?}"
            );
            assert!(row.iter().all(|&v| v >= 0.0));
        }
        // saturated: huge z weights push every |z| ≥ γ/2 → at most k experts per token
        set(
            &r,
            "z_weight",
            randt(&[4, k * m], 9, -1.0, 1.0).mul_scalar(1e3).unwrap(),
        );
        let routing = r.route(&x).unwrap();
        let valid = routing.valid.to_vec_f64().unwrap();
        for tok in 0..9 {
            let used: f64 = valid[tok * n..(tok + 1) * n].iter().sum();
            assert!(
                used >= 1.0 && used <= k as f64,
                "token {tok}: {used} experts"
            );
        }
        let q = dense_gate(&r, &x, n);
        for row in q.chunks(n) {
            assert!((row.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        }
    }
}

#[test]
fn closed_form_backward_of_spec_section_3() {
    // Static gate, linear loss L = Σ_e a_e q_e: ∂L/∂α_i = σ_i (Σ_e a_e r^(i)_e − Σ_e a_e q_e),
    // ∂L/∂z^(i)_j = σ_i S'(z^(i)_j) Σ_e a_e ∂r^(i)_e/∂u_j.
    let (n, k, m, gamma) = (8, 3, 3, 1.0);
    let r = DSelectKRouter::new(&cfg(2, n, k, &[]), DSelectKKind::Static, Device::cpu()).unwrap();
    to_f64(&r);
    let z = generic(&[k, m], 11, gamma);
    let alpha = randt(&[k], 12, -1.0, 1.0);
    set(&r, "z", z.clone());
    set(&r, "alpha", alpha.clone());
    let a = host_rand(n, 13, -1.0, 1.0);
    let x = randt(&[1, 2], 14, -1.0, 1.0);
    let routing = r.route(&x).unwrap();
    let ex = routing.expert.to_vec_i32().unwrap();
    let coef: Vec<f64> = ex.iter().map(|&e| a[e as usize]).collect();
    routing
        .weight
        .mul(&common::f64t(&coef, &[coef.len()]))
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let grad_of = |name: &str| {
        params(&r)
            .into_iter()
            .find(|(n, _)| n == name)
            .unwrap()
            .1
            .grad()
            .unwrap()
            .to_vec_f64()
            .unwrap()
    };
    let (ga, gz) = (grad_of("alpha"), grad_of("z"));
    // host reference
    let zv = z.to_vec_f64().unwrap();
    let av = alpha.to_vec_f64().unwrap();
    let mx = av.iter().cloned().fold(f64::MIN, f64::max);
    let ex_sum: f64 = av.iter().map(|v| (v - mx).exp()).sum();
    let sigma: Vec<f64> = av.iter().map(|v| (v - mx).exp() / ex_sum).collect();
    let s = |t: f64| -> f64 {
        let c = t.clamp(-gamma / 2.0, gamma / 2.0);
        -2.0 / gamma.powi(3) * c.powi(3) + 1.5 / gamma * c + 0.5
    };
    let ds = |t: f64| -> f64 {
        if t.abs() >= gamma / 2.0 {
            0.0
        } else {
            1.5 / gamma - 6.0 * t * t / gamma.powi(3)
        }
    };
    let sel = |i: usize, e: usize, skip: Option<usize>| -> f64 {
        (0..m)
            .filter(|&j| Some(j) != skip)
            .map(|j| {
                let u = s(zv[i * m + j]);
                if (e >> j) & 1 == 1 { u } else { 1.0 - u }
            })
            .product()
    };
    let aq: f64 = (0..n)
        .map(|e| a[e] * (0..k).map(|i| sigma[i] * sel(i, e, None)).sum::<f64>())
        .sum();
    for i in 0..k {
        let ar: f64 = (0..n).map(|e| a[e] * sel(i, e, None)).sum();
        let want = sigma[i] * (ar - aq);
        assert!((ga[i] - want).abs() < 1e-12, "∂α_{i}: {} vs {want}", ga[i]);
        for j in 0..m {
            let dr: f64 = (0..n)
                .map(|e| a[e] * (2.0 * ((e >> j) & 1) as f64 - 1.0) * sel(i, e, Some(j)))
                .sum();
            let want = sigma[i] * ds(zv[i * m + j]) * dr;
            assert!((gz[i * m + j] - want).abs() < 1e-12, "∂z_{i}{j}");
        }
    }
}

/// The gate as a function of x and its parameters (α or G, z or W, and biases) → a scalar
/// loss of q plus the router's auxiliary loss.
fn gate_loss(
    kind: DSelectKKind,
    opts: &[(&str, &str)],
    n: usize,
    k: usize,
    t: &[Tensor],
) -> Result<Tensor> {
    let r = DSelectKRouter::new(&cfg(3, n, k, opts), kind, Device::cpu())?;
    for ((_, p), v) in params(&r).iter().zip(&t[1..]) {
        p.set(v.clone())?;
    }
    let routing = r.route(&t[0])?;
    // Σ_e q_e/(e + 1) + ½ Σ_e q_e²: the coefficient follows the expert, not the slot (slots
    // are sorted by weight), so this is a smooth function of the gate
    let ex = routing.expert.to_dtype(DType::F64)?;
    let w = &routing.weight;
    let mut l = w
        .mul(&ex.add_scalar(1.0)?.recip()?)?
        .sum_all()?
        .add(&w.mul(w)?.sum_all()?.mul_scalar(0.5)?)?;
    if let Some(a) = routing.aux_loss {
        l = l.add(&a)?;
    }
    Ok(l)
}

#[test]
fn p4_gradcheck_of_the_gate_and_its_regularisers() {
    let opts = GradcheckOptions::default();
    for (kind, n, k, extra) in [
        (DSelectKKind::Static, 8, 2, vec![("entropy", "0.3")]),
        (DSelectKKind::PerExample, 4, 2, vec![("entropy", "0.2")]),
        (DSelectKKind::PerExample, 5, 3, vec![]),
        (
            DSelectKKind::Static,
            6,
            2,
            vec![("unused", "penalty"), ("xi", "0.1")],
        ),
        (DSelectKKind::PerExample, 7, 2, vec![("unused", "penalty")]),
    ] {
        let proto = DSelectKRouter::new(&cfg(3, n, k, &extra), kind, Device::cpu()).unwrap();
        let mut inputs = vec![randt(&[4, 3], 1, -1.0, 1.0)];
        for (i, (name, p)) in params(&proto).into_iter().enumerate() {
            let shape = p.get().shape().to_vec();
            let v = match name.as_str() {
                "z" => generic(&shape, 20 + i as u64, 1.0),
                // small per-example weights keep every z inside (−γ/2, γ/2), away from the knots
                "z_weight" => generic(&shape, 20 + i as u64, 0.3).mul_scalar(0.5).unwrap(),
                "z_bias" => generic(&shape, 30 + i as u64, 0.2),
                _ => randt(&shape, 40 + i as u64, -1.0, 1.0),
            };
            inputs.push(v);
        }
        let f = |t: &[Tensor]| gate_loss(kind, &extra, n, k, t);
        if let Err(e) = gradcheck(f, &inputs, &opts) {
            panic!("{kind:?} n {n} k {k} {extra:?}: {e}");
        }
    }
}

#[test]
fn non_power_of_two_n_wrap_and_penalty() {
    let n = 5; // m = 3, codes 5, 6, 7 unused
    let wrap =
        DSelectKRouter::new(&cfg(3, n, 2, &[]), DSelectKKind::Static, Device::cpu()).unwrap();
    to_f64(&wrap);
    // selector 0 saturated on code 6 → expert 1; selector 1 on code 2
    set(
        &wrap,
        "z",
        common::f64t(&[-1.0, 1.0, 1.0, -1.0, 1.0, -1.0], &[2, 3]),
    );
    set(&wrap, "alpha", common::f64t(&[0.4, -0.4], &[2]));
    let x = randt(&[2, 3], 3, -1.0, 1.0);
    let q = dense_gate(&wrap, &x, n);
    let s0 = 0.4f64.exp() / (0.4f64.exp() + (-0.4f64).exp());
    assert!(
        (q[1] - s0).abs() < 1e-12 && (q[2] - (1.0 - s0)).abs() < 1e-12,
        "{q:?}"
    );
    assert!((q[..n].iter().sum::<f64>() - 1.0).abs() < 1e-12);
    assert!(wrap.route(&x).unwrap().aux_loss.is_none());

    let pen = DSelectKRouter::new(
        &cfg(3, n, 2, &[("unused", "penalty"), ("xi", "0.5")]),
        DSelectKKind::Static,
        Device::cpu(),
    )
    .unwrap();
    to_f64(&pen);
    set(
        &pen,
        "z",
        common::f64t(&[0.1, 0.2, 0.3, -0.1, 0.05, 0.2], &[2, 3]),
    );
    let routing = pen.route(&x).unwrap();
    let q = dense_gate(&pen, &x, n);
    let used = q[..n].iter().sum::<f64>();
    assert!(
        used < 1.0 && used > 0.0,
        "penalty mode keeps only the used mass: {used}"
    );
    // aux = ξ Σ_i 1/Σ_{e<n} r^(i)_e, counted once for the static gate
    let (_, z) = pen.gate_logits(&x).unwrap();
    let r = selector_probs(&z.slice(0, 0, 1).unwrap(), 1.0)
        .unwrap()
        .to_vec_f64()
        .unwrap();
    let want: f64 = r
        .chunks(8)
        .map(|c| 1.0 / c[..n].iter().sum::<f64>())
        .sum::<f64>()
        * 0.5;
    let aux = routing.aux_loss.unwrap().item().unwrap();
    assert!((aux - want).abs() < 1e-9, "{aux} vs {want}");
}

fn moe_layer(router: &str, n: usize, k: usize) -> MoeLayer {
    let mut c = MoeConfig::new(3, 4, n, k);
    c.router = router.into();
    c.seed = 5;
    MoeLayer::new(&c, Device::cpu()).unwrap()
}

fn layer_params(l: &MoeLayer) -> Vec<(String, Param)> {
    let mut v = Vec::new();
    l.visit_params("", &mut |n, p| v.push((n, p.clone())));
    v
}

#[test]
fn p3_only_experts_with_nonzero_weight_run_and_get_gradient() {
    let (n, k) = (8, 2);
    let l = moe_layer("dselect-k-static", n, k);
    for (_, p) in layer_params(&l) {
        p.set(p.get().to_dtype(DType::F64).unwrap().detach())
            .unwrap();
    }
    // selectors saturated on experts 3 and 6 (codes 011 and 110)
    set(
        l.router(),
        "z",
        common::f64t(&[1.0, 1.0, -1.0, -1.0, 1.0, 1.0], &[2, 3]),
    );
    let x = randt(&[7, 3], 1, -1.0, 1.0);
    let run = |poison: bool| {
        let l2 = moe_layer("dselect-k-static", n, k);
        for ((_, a), (name, b)) in layer_params(&l).iter().zip(layer_params(&l2)) {
            let mut v = a.get().detach();
            if poison && name.starts_with("experts") {
                // NaN in every expert but 3 and 6: must change nothing
                let shape = v.shape().to_vec();
                let per = v.numel() / n;
                let vals: Vec<f64> = v
                    .to_vec_f64()
                    .unwrap()
                    .iter()
                    .enumerate()
                    .map(|(i, &x)| {
                        if [3, 6].contains(&(i / per)) {
                            x
                        } else {
                            f64::NAN
                        }
                    })
                    .collect();
                v = common::f64t(&vals, &shape);
            }
            b.set(v).unwrap();
        }
        let out = l2.forward(&x).unwrap();
        out.y.sum_all().unwrap().backward().unwrap();
        let kept = out.stats.kept_per_expert.to_vec_f64().unwrap();
        let grads: Vec<(String, Vec<f64>)> = layer_params(&l2)
            .into_iter()
            .map(|(name, p)| {
                (
                    name,
                    p.grad()
                        .map(|g| g.to_vec_f64().unwrap())
                        .unwrap_or_default(),
                )
            })
            .collect();
        (out.y.to_vec_f64().unwrap(), kept, grads)
    };
    let (y, kept, grads) = run(false);
    assert_eq!(
        kept,
        vec![0.0, 0.0, 0.0, 7.0, 0.0, 0.0, 7.0, 0.0],
        "only experts 3 and 6 run"
    );
    for (name, g) in &grads {
        if name.starts_with("experts") && !g.is_empty() {
            let per = g.len() / n;
            for (i, v) in g.iter().enumerate() {
                if ![3, 6].contains(&(i / per)) {
                    assert_eq!(*v, 0.0, "{name}: idle expert {} got gradient", i / per);
                }
            }
        }
    }
    let (y2, _, grads2) = run(true);
    assert_eq!(y, y2, "garbage in unselected experts changed the output");
    for ((name, g1), (_, g2)) in grads.iter().zip(&grads2) {
        assert_eq!(
            g1, g2,
            "{name}: garbage in unselected experts changed a gradient"
        );
    }
}

#[test]
fn the_layer_gradcheck_in_the_dense_early_phase() {
    // whole MoE layer (experts and gate) at a generic point, both kinds
    for router in ["dselect-k", "dselect-k-static"] {
        let proto = moe_layer(router, 4, 2);
        let names: Vec<String> = layer_params(&proto).into_iter().map(|(n, _)| n).collect();
        let mut inputs = vec![randt(&[5, 3], 2, -1.0, 1.0)];
        for (i, (name, p)) in layer_params(&proto).into_iter().enumerate() {
            let shape = p.get().shape().to_vec();
            inputs.push(if name.contains("z") {
                generic(&shape, 50 + i as u64, 0.3)
            } else if name.ends_with("b1") || name.ends_with("b2") {
                randt(&shape, 60 + i as u64, -0.3, 0.3)
            } else {
                p.get().to_dtype(DType::F64).unwrap().detach()
            });
        }
        let f = |t: &[Tensor]| -> Result<Tensor> {
            let l = moe_layer(router, 4, 2);
            for ((_, p), v) in layer_params(&l).iter().zip(&t[1..]) {
                p.set(v.clone())?;
            }
            let y = l.forward(&t[0])?.y;
            y.mul(&y)?.sum_all()
        };
        if let Err(e) = gradcheck(f, &inputs, &GradcheckOptions::default()) {
            panic!("{router} ({names:?}): {e}");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    #[test]
    fn gate_is_on_the_simplex_for_random_shapes(
        t in 1usize..6, n in 2usize..12, kk in 1usize..4, gamma in 0.1f64..5.0, seed in 0u64..1000,
    ) {
        let k = kk.min(n);
        let r = DSelectKRouter::new(
            &cfg(3, n, k, &[("gamma", &gamma.to_string())]),
            DSelectKKind::PerExample,
            Device::cpu(),
        ).unwrap();
        to_f64(&r);
        let m = selector_bits(n);
        set(&r, "z_weight", randt(&[3, k * m], seed, -gamma, gamma));
        let x = randt(&[t, 3], seed + 1, -1.0, 1.0);
        let q = dense_gate(&r, &x, n);
        for row in q.chunks(n) {
            prop_assert!((row.iter().sum::<f64>() - 1.0).abs() < 1e-12);
            prop_assert!(row.iter().all(|&v| v >= 0.0));
        }
        // slots sorted by weight, descending
        let w = r.route(&x).unwrap().weight.to_vec_f64().unwrap();
        for row in w.chunks(n) {
            prop_assert!(row.windows(2).all(|p| p[0] >= p[1]));
        }
    }
}

#[test]
fn gpu_parity_of_the_gate_forward_and_backward() {
    let Some(gpu) = common::gpu_or_skip("gpu_parity_of_the_gate_forward_and_backward") else {
        return;
    };
    for (name, n, k, opts) in [
        ("dselect-k", 8, 2, vec![("entropy", "0.1")]),
        ("dselect-k-static", 8, 3, vec![]),
        ("dselect-k", 6, 2, vec![("unused", "penalty")]),
        ("dselect-k-static", 5, 2, vec![]),
    ] {
        let c = cfg(3, n, k, &opts);
        let cpu_r = build_router(name, &c, Device::cpu()).unwrap();
        let gpu_r = build_router(name, &c, gpu).unwrap();
        to_f64(cpu_r.as_ref());
        // move some logits past the knots so the saturated paths are compared too
        for (i, ((pn, cp), (_, gp))) in params(cpu_r.as_ref())
            .iter()
            .zip(params(gpu_r.as_ref()).iter())
            .enumerate()
        {
            let shape = cp.get().shape().to_vec();
            let v = if pn.contains('z') {
                randt(&shape, 70 + i as u64, -1.5, 1.5)
            } else {
                randt(&shape, 80 + i as u64, -0.5, 0.5)
            };
            cp.set(v.clone()).unwrap();
            gp.set(v.to_dtype(DType::F32).unwrap().to_device(gpu).unwrap())
                .unwrap();
        }
        let x = randt(&[6, 3], 90, -1.0, 1.0);
        let run = |r: &dyn Router, x: &Tensor| {
            let routing = r.route(x).unwrap();
            let coef = randt(&[routing.len()], 91, -1.0, 1.0)
                .to_dtype(routing.weight.dtype())
                .unwrap()
                .to_device(x.device())
                .unwrap();
            let mut l = routing.weight.mul(&coef).unwrap().sum_all().unwrap();
            if let Some(a) = &routing.aux_loss {
                l = l.add(&a.to_dtype(l.dtype()).unwrap()).unwrap();
            }
            l.backward().unwrap();
            let mut v = vec![
                routing.weight.to_vec_f64().unwrap(),
                routing.valid.to_vec_f64().unwrap(),
                routing
                    .expert
                    .to_vec_i32()
                    .unwrap()
                    .iter()
                    .map(|&e| e as f64)
                    .collect(),
                routing.probs.to_vec_f64().unwrap(),
            ];
            v.extend(
                params(r)
                    .iter()
                    .map(|(_, p)| p.grad().unwrap().to_vec_f64().unwrap()),
            );
            v
        };
        let a = run(cpu_r.as_ref(), &x);
        let b = run(
            gpu_r.as_ref(),
            &x.to_dtype(DType::F32).unwrap().to_device(gpu).unwrap(),
        );
        for (i, (g, c)) in b.iter().zip(&a).enumerate() {
            common::assert_close(&format!("{name} n {n}: tensor {i}"), g, c, 2e-4, 2e-3);
        }
    }
}

#[test]
fn bad_options_are_errors_naming_the_setting() {
    for (opts, key) in [
        (vec![("gamma", "0")], "gamma"),
        (vec![("gamma", "-1")], "gamma"),
        (vec![("entropy", "-0.1")], "entropy"),
        (vec![("entropy", "nan")], "entropy"),
        (vec![("unused", "drop")], "unused"),
        (vec![("xi", "-1")], "xi"),
        (vec![("tau", "1")], "tau"),
    ] {
        for name in ["dselect-k", "dselect-k-static"] {
            let e = build_router(name, &cfg(3, 8, 2, &opts), Device::cpu())
                .err()
                .unwrap_or_else(|| panic!("{name} {opts:?} must fail"))
                .to_string();
            assert!(e.contains(key), "{name} {opts:?}: {e}");
        }
    }
    let r = build_router("dselect-k", &cfg(3, 8, 2, &[]), Device::cpu()).unwrap();
    let e = r
        .route(&Tensor::zeros(&[2, 4], DType::F32, Device::cpu()).unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("[2, 4]"), "{e}");
}
