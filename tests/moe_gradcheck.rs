//! Direct f64 checks of two pieces of the MoE layer that tests/moe.rs reaches only through the
//! whole layer: the grouped matmul of the expert bank over random shapes (proptest over the
//! number of experts, the rows each receives, zero included, dropped rows, and the widths k and
//! m; both sides of the deferred-bank-gradient rule `n·k·m ≥ R·(k + m)` come up), and the router
//! z-loss of ST-MoE, `β · mean_x (logsumexp θ(x))²`, against its formula, value and gradient,
//! alone and as the aux loss of a layer with `z_loss > 0`.

mod common;

use moegrad::gradcheck::{GradcheckOptions, gradcheck};
use moegrad::moe::{MoeConfig, MoeLayer, z_loss};
use moegrad::nn::Param;
use moegrad::nn::Parameters;
use moegrad::{DType, Device, Error, Result, Tensor};
use proptest::collection::vec;
use proptest::prelude::*;

// ---- grouped matmul -----------------------------------------------------------------------

/// A grouped matmul problem: expert `e` receives `rows[e]` consecutive rows (possibly none),
/// then `dropped` rows routed nowhere (expert −1) follow; `x` is `[R, k]`, the bank `[n, k, m]`.
#[derive(Clone, Debug)]
struct Grouped {
    rows: Vec<usize>,
    dropped: usize,
    k: usize,
    m: usize,
    x: Vec<f64>,
    w: Vec<f64>,
}

impl Grouped {
    fn experts(&self) -> usize {
        self.rows.len()
    }
    fn total_rows(&self) -> usize {
        self.rows.iter().sum::<usize>() + self.dropped
    }
    /// Each row's expert (−1 for a dropped row) and where each expert's rows start (`[n + 1]`).
    fn routing(&self) -> (Tensor, Tensor) {
        let mut row_expert: Vec<i32> = Vec::new();
        let mut offsets = vec![0i32];
        for (e, &r) in self.rows.iter().enumerate() {
            row_expert.extend(std::iter::repeat_n(e as i32, r));
            offsets.push(row_expert.len() as i32);
        }
        row_expert.extend(std::iter::repeat_n(-1, self.dropped));
        let n = row_expert.len();
        (
            Tensor::from_i32(row_expert, &[n], Device::cpu()).unwrap(),
            Tensor::from_i32(offsets, &[self.experts() + 1], Device::cpu()).unwrap(),
        )
    }
    /// The product on the host: row r of expert e is `x[r] · W[e]`; a dropped row is zero.
    fn reference(&self) -> Vec<f64> {
        let (k, m) = (self.k, self.m);
        let mut y = vec![0.0; self.total_rows() * m];
        let mut r = 0;
        for (e, &count) in self.rows.iter().enumerate() {
            for _ in 0..count {
                for j in 0..m {
                    y[r * m + j] = (0..k)
                        .map(|i| self.x[r * k + i] * self.w[(e * k + i) * m + j])
                        .sum();
                }
                r += 1;
            }
        }
        y
    }
}

/// 1–4 experts with 0–3 rows each (at least one routed row in all), 0–2 dropped rows,
/// k and m in 1..=3, values in [−1.5, 1.5).
fn grouped_problem() -> impl Strategy<Value = Grouped> {
    (vec(0usize..=3, 1..=4), 0usize..=2, 1usize..=3, 1usize..=3)
        .prop_filter("at least one routed row", |(rows, _, _, _)| {
            rows.iter().sum::<usize>() > 0
        })
        .prop_flat_map(|(rows, dropped, k, m)| {
            let total = rows.iter().sum::<usize>() + dropped;
            let n = rows.len();
            (
                Just((rows, dropped, k, m)),
                vec(-1.5f64..1.5, total * k),
                vec(-1.5f64..1.5, n * k * m),
            )
        })
        .prop_map(|((rows, dropped, k, m), x, w)| Grouped {
            rows,
            dropped,
            k,
            m,
            x,
            w,
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// Forward against the host product, and gradcheck in both operands; experts that receive
    /// no rows get exactly zero gradient.
    #[test]
    fn grouped_matmul_over_random_shapes(p in grouped_problem()) {
        let (row_expert, offsets) = p.routing();
        let (n, k, m, total) = (p.experts(), p.k, p.m, p.total_rows());
        let x = common::f64t(&p.x, &[total, k]);
        let w = common::f64t(&p.w, &[n, k, m]);
        let y = x.grouped_matmul(&w, &row_expert, &offsets).unwrap().to_vec_f64().unwrap();
        let want = p.reference();
        for (i, (a, b)) in y.iter().zip(&want).enumerate() {
            prop_assert!((a - b).abs() < 1e-12, "{p:?}: output {i}: {a} vs {b}");
        }
        let f = |t: &[Tensor]| t[0].grouped_matmul(&t[1], &row_expert, &offsets);
        let report = gradcheck(f, &[x.clone(), w.clone()], &GradcheckOptions::default());
        prop_assert!(report.is_ok(), "{p:?}: {report:?}");
        let wg = w.with_grad().unwrap();
        x.grouped_matmul(&wg, &row_expert, &offsets)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let gw = wg.grad().unwrap().to_vec_f64().unwrap();
        for (e, &r) in p.rows.iter().enumerate() {
            if r == 0 {
                let block = &gw[e * k * m..(e + 1) * k * m];
                prop_assert!(block.iter().all(|&v| v == 0.0), "{p:?}: idle expert {e}: {block:?}");
            }
        }
    }
}

// ---- router z-loss ------------------------------------------------------------------------

fn params(l: &MoeLayer) -> Vec<(String, Param)> {
    let mut v = Vec::new();
    l.visit_params("", &mut |n, p| v.push((n, p.clone())));
    v
}

/// A top-2 layer over 4 experts on 5-wide tokens, in f64, with the z-loss β and no balance loss.
fn z_layer(beta: f64) -> MoeLayer {
    let mut cfg = MoeConfig::new(5, 3, 4, 2);
    cfg.z_loss = beta;
    cfg.balance_loss = 0.0;
    cfg.seed = 3;
    let l = MoeLayer::new(&cfg, Device::cpu()).unwrap();
    for (_, p) in params(&l) {
        p.set(p.get().to_dtype(DType::F64).unwrap().detach())
            .unwrap();
    }
    l
}

/// Tokens `[6, 5]`, gate weight `[5, 4]` and bias `[4]`, with logits of a few units (so that
/// logsumexp is far from 0 and from linear).
fn z_inputs() -> (Tensor, Tensor, Tensor) {
    let v = |n: usize, s: usize, scale: f64| -> Vec<f64> {
        (0..n)
            .map(|i| (((i * 29 + s * 11) % 19) as f64 - 9.0) / 9.0 * scale)
            .collect()
    };
    (
        common::f64t(&v(30, 1, 1.0), &[6, 5]),
        common::f64t(&v(20, 2, 0.8), &[5, 4]),
        common::f64t(&[0.5, -1.0, 1.5, 0.25], &[4]),
    )
}

/// The z-loss and its gradient in the logits on the host, from the definition:
/// `z = β/T Σ_t l_t²` with `l_t = log Σ_j e^{θ_tj}`, so `∂z/∂θ_tj = (2β/T)·l_t·softmax(θ_t)_j`.
fn z_reference(theta: &[f64], experts: usize, beta: f64) -> (f64, Vec<f64>) {
    let t = theta.len() / experts;
    let mut value = 0.0;
    let mut grad = vec![0.0; theta.len()];
    for (row, g) in theta.chunks(experts).zip(grad.chunks_mut(experts)) {
        let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = row.iter().map(|v| (v - max).exp()).sum();
        let lse = max + sum.ln();
        value += lse * lse;
        for (gj, v) in g.iter_mut().zip(row) {
            *gj = 2.0 * beta / t as f64 * lse * (v - lse).exp();
        }
    }
    (beta * value / t as f64, grad)
}

/// Logits `x·W + b` on the host.
fn host_logits(x: &[f64], w: &[f64], b: &[f64], d: usize, n: usize) -> Vec<f64> {
    let t = x.len() / d;
    let mut out = vec![0.0; t * n];
    for r in 0..t {
        for j in 0..n {
            out[r * n + j] = b[j] + (0..d).map(|i| x[r * d + i] * w[i * n + j]).sum::<f64>();
        }
    }
    out
}

/// Sets the layer's gate to `w`, `b` (the other parameters keep their f64 initial values).
fn set_gate(l: &MoeLayer, w: &Tensor, b: &Tensor) -> Result<()> {
    for (name, p) in params(l) {
        if name == "router.weight" {
            p.set(w.clone())?;
        } else if name == "router.bias" {
            p.set(b.clone())?;
        }
    }
    Ok(())
}

#[test]
fn z_loss_matches_its_formula_in_value_and_gradient() {
    let beta = 0.3;
    let (x, w, b) = z_inputs();
    let (xv, wv, bv) = (
        x.to_vec_f64().unwrap(),
        w.to_vec_f64().unwrap(),
        b.to_vec_f64().unwrap(),
    );
    let theta = host_logits(&xv, &wv, &bv, 5, 4);
    let (want, want_dtheta) = z_reference(&theta, 4, beta);
    assert!(want > 0.5, "logits too small to test anything: z = {want}");

    // The function alone, on the routing of the layer's router.
    let l = z_layer(beta);
    let (wg, bg) = (
        w.detach().with_grad().unwrap(),
        b.detach().with_grad().unwrap(),
    );
    set_gate(&l, &wg, &bg).unwrap();
    let routing = l.router().route(&x).unwrap();
    common::assert_close(
        "router logits",
        &routing.logits.to_vec_f64().unwrap(),
        &theta,
        1e-12,
        1e-12,
    );
    let z = z_loss(&routing, beta).unwrap();
    common::assert_close("z-loss", &[z.item().unwrap()], &[want], 1e-12, 1e-12);
    // Its gradient in the bias is Σ_t ∂z/∂θ_t, in the gate weight xᵀ·∂z/∂θ.
    z.backward().unwrap();
    let want_db: Vec<f64> = (0..4)
        .map(|j| want_dtheta.iter().skip(j).step_by(4).sum())
        .collect();
    let want_dw: Vec<f64> = (0..20)
        .map(|ij| {
            let (i, j) = (ij / 4, ij % 4);
            (0..6).map(|r| xv[r * 5 + i] * want_dtheta[r * 4 + j]).sum()
        })
        .collect();
    common::assert_close(
        "∂z/∂b",
        &bg.grad().unwrap().to_vec_f64().unwrap(),
        &want_db,
        1e-12,
        1e-9,
    );
    common::assert_close(
        "∂z/∂W",
        &wg.grad().unwrap().to_vec_f64().unwrap(),
        &want_dw,
        1e-12,
        1e-9,
    );

    // And by finite differences, in the tokens and the gate.
    let f = |t: &[Tensor]| -> Result<Tensor> {
        let l = z_layer(beta);
        set_gate(&l, &t[1], &t[2])?;
        z_loss(&l.router().route(&t[0])?, beta)
    };
    gradcheck(f, &[x, w, b], &GradcheckOptions::default()).unwrap();
}

/// With `z_loss = β > 0` and no balance loss, a layer's aux loss is exactly the z-loss of its
/// router's logits; the expert parameters get no gradient from it, and it passes gradcheck.
#[test]
fn a_layer_with_z_loss_reports_it_as_its_aux_loss() {
    let beta = 0.05;
    let (x, w, b) = z_inputs();
    let theta = host_logits(
        &x.to_vec_f64().unwrap(),
        &w.to_vec_f64().unwrap(),
        &b.to_vec_f64().unwrap(),
        5,
        4,
    );
    let (want, _) = z_reference(&theta, 4, beta);
    let l = z_layer(beta);
    set_gate(&l, &w, &b).unwrap();
    let out = l.forward(&x).unwrap();
    common::assert_close(
        "aux loss",
        &[out.aux_loss.item().unwrap()],
        &[want],
        1e-12,
        1e-12,
    );
    // No z-loss configured: no aux loss.
    let plain = z_layer(0.0);
    set_gate(&plain, &w, &b).unwrap();
    assert_eq!(plain.forward(&x).unwrap().aux_loss.item().unwrap(), 0.0);

    out.aux_loss.backward().unwrap();
    for (name, p) in params(&l) {
        if name.starts_with("experts.") {
            let g = p
                .grad()
                .map(|g| g.to_vec_f64().unwrap())
                .unwrap_or_default();
            assert!(
                g.iter().all(|&v| v == 0.0),
                "{name} got gradient {g:?} from the z-loss"
            );
        }
    }
    let f = |t: &[Tensor]| -> Result<Tensor> {
        let l = z_layer(beta);
        set_gate(&l, &t[1], &t[2])?;
        Ok(l.forward(&t[0])?.aux_loss)
    };
    gradcheck(f, &[x, w, b], &GradcheckOptions::default()).unwrap();
}

// ---- grouped matmul with the experts' biases -----------------------------------------------

/// `x [R, k]`, `w [n, k, m]`, `b [n, m]` with sorted experts, one expert idle and two rows
/// dropped (expert −1), as f64 CPU tensors, plus `(row_expert, offsets)`.
fn biased_problem(seed: u64) -> ([Tensor; 3], Tensor, Tensor) {
    let (k, m, n) = (3, 4, 3);
    // experts 0 (3 rows), 1 (none), 2 (2 rows), then two dropped rows
    let re = vec![0, 0, 0, 2, 2, -1, -1];
    let rows = re.len();
    let v = |len: usize, s: u64| -> Vec<f64> {
        (0..len)
            .map(|i| ((i as f64 + 1.0) * 0.37 + s as f64).sin())
            .collect()
    };
    let t = |vals: Vec<f64>, shape: &[usize]| Tensor::from_f64(vals, shape, Device::cpu()).unwrap();
    (
        [
            t(v(rows * k, seed), &[rows, k]),
            t(v(n * k * m, seed + 1), &[n, k, m]),
            t(v(n * m, seed + 2), &[n, m]),
        ],
        Tensor::from_i32(re, &[rows], Device::cpu()).unwrap(),
        Tensor::from_i32(vec![0, 3, 3, 5], &[n + 1], Device::cpu()).unwrap(),
    )
}

#[test]
fn grouped_matmul_with_bias_passes_gradcheck_and_matches_the_gathered_bias() {
    let (inputs, re, off) = biased_problem(1);
    let f = |t: &[Tensor]| t[0].grouped_matmul_with_bias(&t[1], Some(&t[2]), &re, &off);
    gradcheck(f, &inputs, &GradcheckOptions::default()).unwrap();

    // against the composed form: product + the gathered bias, masked where the row is dropped
    let leaves = inputs.clone().map(|t| t.with_grad().unwrap());
    let y = f(&leaves).unwrap();
    let kept = Tensor::from_f64(vec![1., 1., 1., 1., 1., 0., 0.], &[7, 1], Device::cpu()).unwrap();
    let clamped = Tensor::from_i32(vec![0, 0, 0, 2, 2, 0, 0], &[7], Device::cpu()).unwrap();
    let refs = inputs.clone().map(|t| t.with_grad().unwrap());
    let y_ref = refs[0]
        .grouped_matmul(&refs[1], &re, &off)
        .unwrap()
        .add(&refs[2].index_select(0, &clamped).unwrap())
        .unwrap()
        .mul(&kept)
        .unwrap();
    let (a, b) = (y.to_vec_f64().unwrap(), y_ref.to_vec_f64().unwrap());
    for (i, (p, q)) in a.iter().zip(&b).enumerate() {
        assert!((p - q).abs() <= 1e-12, "element {i}: {p} vs {q}");
    }
    assert!(
        a[5 * 4..].iter().all(|&v| v == 0.0),
        "dropped rows are exact zeros"
    );
    let up = Tensor::from_f64(
        (0..28).map(|i| i as f64 * 0.1 - 1.0).collect(),
        &[7, 4],
        Device::cpu(),
    )
    .unwrap();
    y.backward_with(&up).unwrap();
    y_ref.backward_with(&up).unwrap();
    for (name, (l, r)) in ["dx", "dw", "db"].iter().zip(leaves.iter().zip(&refs)) {
        let (g, h) = (
            l.grad().unwrap().to_vec_f64().unwrap(),
            r.grad().unwrap().to_vec_f64().unwrap(),
        );
        for (i, (p, q)) in g.iter().zip(&h).enumerate() {
            assert!((p - q).abs() <= 1e-12, "{name} element {i}: {p} vs {q}");
        }
    }
    // the idle expert 1 gets exactly zero bias and weight gradient
    let db = leaves[2].grad().unwrap().to_vec_f64().unwrap();
    assert!(
        db[4..8].iter().all(|&v| v.to_bits() == 0.0f64.to_bits()),
        "idle expert's db: {db:?}"
    );

    // a bias of the wrong shape is an error naming it
    let bad = Tensor::from_f64(vec![0.0; 5], &[5], Device::cpu()).unwrap();
    match inputs[0].grouped_matmul_with_bias(&inputs[1], Some(&bad), &re, &off) {
        Err(Error::Shape(msg)) => assert!(msg.contains("bias"), "{msg}"),
        other => panic!("expected a shape error, got {other:?}"),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// The fused expert bias over random shapes: values equal the host product plus each routed
    /// row's expert bias (dropped rows stay exactly zero), and the three gradients pass
    /// gradcheck in f64.
    #[test]
    fn grouped_matmul_with_bias_over_random_shapes(
        p in grouped_problem(),
        seed in 0u64..1000,
    ) {
        let (row_expert, offsets) = p.routing();
        let (n, k, m, total) = (p.experts(), p.k, p.m, p.total_rows());
        let b: Vec<f64> = (0..n * m)
            .map(|i| ((i as f64 + 1.0) * 0.61 + seed as f64).sin())
            .collect();
        let inputs = [
            common::f64t(&p.x, &[total, k]),
            common::f64t(&p.w, &[n, k, m]),
            common::f64t(&b, &[n, m]),
        ];
        let y = inputs[0]
            .grouped_matmul_with_bias(&inputs[1], Some(&inputs[2]), &row_expert, &offsets)
            .unwrap()
            .to_vec_f64()
            .unwrap();
        let mut want = p.reference();
        let mut r = 0;
        for (e, &count) in p.rows.iter().enumerate() {
            for _ in 0..count {
                for j in 0..m {
                    want[r * m + j] += b[e * m + j];
                }
                r += 1;
            }
        }
        for (i, (a, w)) in y.iter().zip(&want).enumerate() {
            prop_assert!((a - w).abs() <= 1e-12, "element {}: {} vs {}", i, a, w);
        }
        prop_assert!(y[(total - p.dropped) * m..].iter().all(|&v| v == 0.0));
        let f = |t: &[Tensor]| t[0].grouped_matmul_with_bias(&t[1], Some(&t[2]), &row_expert, &offsets);
        prop_assert!(gradcheck(f, &inputs, &GradcheckOptions::default()).is_ok());
    }
}
