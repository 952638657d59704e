//! The autograd machinery: gradients summed over every use of a tensor, accumulation across
//! backward calls until `zero_grad`, `no_grad` and `NoGradGuard` (per thread, restored on exit and
//! on panic), `detach`, `backward_with`, release of the graph after backward, `requires_grad`
//! propagation, leaves vs op outputs, deep graphs, and a 200-step training loop whose loss
//! trajectory matches closed-form gradient descent (gradients survive dropping the loss).

mod common;

use common::{assert_close, f64t};
use moegrad::{DType, Device, Error, NoGradGuard, Tensor, is_grad_enabled, no_grad};
use std::process::Command;

fn grad_of(t: &Tensor) -> Vec<f64> {
    t.grad()
        .expect("a gradient was accumulated")
        .to_vec_f64()
        .unwrap()
}

fn leaf(values: &[f64], shape: &[usize]) -> Tensor {
    f64t(values, shape).with_grad().unwrap()
}

#[test]
fn tensor_used_more_than_once_sums_its_gradients() {
    // y = Σ (x·x + x + 3x) → dy/dx = 2x + 4
    let x = leaf(&[1.0, -2.0, 0.5], &[3]);
    let y = x
        .mul(&x)
        .unwrap()
        .add(&x)
        .unwrap()
        .add(&x.mul_scalar(3.0).unwrap())
        .unwrap()
        .sum_all()
        .unwrap();
    y.backward().unwrap();
    assert_close("d/dx", &grad_of(&x), &[6.0, 0.0, 5.0], 1e-12, 0.0);
}

#[test]
fn shared_intermediate_diamond() {
    // h = 2x; y = Σ h·h + h → dy/dx = 2·(2h + 1) = 8x + 2
    let x = leaf(&[0.5, -1.0], &[2]);
    let h = x.mul_scalar(2.0).unwrap();
    let y = h.mul(&h).unwrap().add(&h).unwrap().sum_all().unwrap();
    y.backward().unwrap();
    assert_close("d/dx", &grad_of(&x), &[6.0, -6.0], 1e-12, 0.0);
}

#[test]
fn broadcast_operand_gets_summed_gradient() {
    // b [3] is broadcast over 2 rows: d/db Σ (a·b) = Σ_rows a
    let a = leaf(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]);
    let b = leaf(&[10.0, 20.0, 30.0], &[3]);
    a.mul(&b).unwrap().sum_all().unwrap().backward().unwrap();
    assert_close("d/db", &grad_of(&b), &[5.0, 7.0, 9.0], 1e-12, 0.0);
    assert_close(
        "d/da",
        &grad_of(&a),
        &[10.0, 20.0, 30.0, 10.0, 20.0, 30.0],
        1e-12,
        0.0,
    );
}

#[test]
fn grads_accumulate_across_backward_calls_until_zero_grad() {
    let x = leaf(&[1.0, 2.0], &[2]);
    let loss = || x.mul(&x).unwrap().sum_all().unwrap(); // d/dx = 2x
    loss().backward().unwrap();
    assert_close("after 1", &grad_of(&x), &[2.0, 4.0], 1e-12, 0.0);
    loss().backward().unwrap();
    assert_close("after 2", &grad_of(&x), &[4.0, 8.0], 1e-12, 0.0);
    x.zero_grad();
    assert!(x.grad().is_none(), "zero_grad left a gradient");
    loss().backward().unwrap();
    assert_close("after zero_grad", &grad_of(&x), &[2.0, 4.0], 1e-12, 0.0);
}

#[test]
fn no_grad_closure_stops_recording_and_restores() {
    let x = leaf(&[1.0, 2.0], &[2]);
    assert!(is_grad_enabled());
    let (y, inside) = no_grad(|| (x.mul(&x).unwrap(), is_grad_enabled()));
    assert!(!inside, "recording still on inside no_grad");
    assert!(is_grad_enabled(), "no_grad did not restore recording");
    assert!(!y.requires_grad());
    assert!(y.is_leaf());
    assert_eq!(y.op_name(), None);
    assert!(matches!(
        y.sum_all().unwrap().backward(),
        Err(Error::Autograd(_))
    ));
    // Outside, the same op records again.
    let z = x.mul(&x).unwrap();
    assert!(z.requires_grad());
    assert_eq!(z.op_name(), Some("mul"));
}

#[test]
fn no_grad_guard_nests_and_restores() {
    let x = leaf(&[3.0], &[1]);
    {
        let _outer = NoGradGuard::new();
        assert!(!is_grad_enabled());
        {
            let _inner = NoGradGuard::new();
            assert!(!is_grad_enabled());
        }
        assert!(!is_grad_enabled(), "inner guard re-enabled recording early");
        assert!(!x.exp().unwrap().requires_grad());
        // no_grad inside a guard leaves it off afterwards.
        no_grad(|| ());
        assert!(!is_grad_enabled());
    }
    assert!(is_grad_enabled());
    assert!(x.exp().unwrap().requires_grad());
}

#[test]
fn no_grad_is_restored_after_a_panic() {
    let r = std::panic::catch_unwind(|| no_grad(|| panic!("inside no_grad")));
    assert!(r.is_err());
    assert!(
        is_grad_enabled(),
        "a panic inside no_grad left recording off"
    );
}

#[test]
fn no_grad_is_per_thread() {
    let _g = NoGradGuard::new();
    assert!(!is_grad_enabled());
    let other = std::thread::spawn(is_grad_enabled).join().unwrap();
    assert!(
        other,
        "no_grad on one thread switched recording off on another"
    );
}

#[test]
fn detach_cuts_the_graph() {
    // y = x · detach(x) + x → autograd sees d/dx = detach(x) + 1 (not 2x + 1)
    let x = leaf(&[2.0, -3.0], &[2]);
    let d = x.detach();
    assert!(d.is_leaf() && !d.requires_grad());
    assert_eq!(d.to_vec_f64().unwrap(), x.to_vec_f64().unwrap());
    let y = x.mul(&d).unwrap().add(&x).unwrap().sum_all().unwrap();
    y.backward().unwrap();
    assert_close("d/dx", &grad_of(&x), &[3.0, -2.0], 1e-12, 0.0);
    assert!(d.grad().is_none());
    // Detaching an op output gives an untracked leaf.
    let h = x.exp().unwrap().detach();
    assert!(h.is_leaf() && !h.requires_grad());
    assert!(matches!(
        h.sum_all().unwrap().backward(),
        Err(Error::Autograd(_))
    ));
}

#[test]
fn backward_with_an_explicit_upstream_gradient() {
    // y = 3x², g given → dx = 6x·g
    let x = leaf(&[1.0, 2.0, -1.0, 0.5], &[2, 2]);
    let y = x.mul(&x).unwrap().mul_scalar(3.0).unwrap();
    let g = f64t(&[1.0, -1.0, 0.5, 2.0], &[2, 2]);
    y.backward_with(&g).unwrap();
    assert_close("dx", &grad_of(&x), &[6.0, -12.0, -3.0, 6.0], 1e-12, 0.0);
    // backward() on a one-element tensor equals backward_with(1).
    let a = leaf(&[1.5], &[1, 1]);
    let b = leaf(&[1.5], &[1, 1]);
    a.exp().unwrap().backward().unwrap();
    b.exp()
        .unwrap()
        .backward_with(&f64t(&[1.0], &[1, 1]))
        .unwrap();
    assert_eq!(grad_of(&a), grad_of(&b));
    assert_close("d exp", &grad_of(&a), &[1.5f64.exp()], 1e-12, 0.0);
}

#[test]
fn backward_on_a_leaf_itself() {
    let x = leaf(&[4.0], &[]);
    x.backward().unwrap();
    assert_eq!(grad_of(&x), vec![1.0]);
}

#[test]
fn graph_is_released_after_backward() {
    let x = leaf(&[1.0, 2.0], &[2]);
    let loss = x.exp().unwrap().sum_all().unwrap();
    loss.backward().unwrap();
    let first = grad_of(&x);
    match loss.backward() {
        Err(Error::Autograd(msg)) => assert!(msg.contains("released"), "{msg}"),
        other => panic!("second backward: expected Err mentioning 'released', got {other:?}"),
    }
    // The failed second call did not change the gradient.
    assert_eq!(grad_of(&x), first);
    // A fresh forward pass works again.
    x.zero_grad();
    x.exp().unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(grad_of(&x), first);
}

#[test]
fn requires_grad_propagation() {
    let p = leaf(&[1.0, 2.0], &[2]);
    let c = f64t(&[3.0, 4.0], &[2]);
    assert!(p.requires_grad() && !c.requires_grad());
    assert!(
        !c.add(&c).unwrap().requires_grad(),
        "constants made a tracked result"
    );
    assert!(c.add(&p).unwrap().requires_grad());
    assert!(p.add(&c).unwrap().requires_grad());
    assert!(p.exp().unwrap().sum_all().unwrap().requires_grad());
    // Index and comparison outputs carry no gradient.
    assert!(!p.gt(&c).unwrap().requires_grad());
    assert!(!p.argmax(0, false).unwrap().requires_grad());
    assert!(!p.argsort(true).unwrap().requires_grad());
    let (v, i) = p.reshape(&[1, 2]).unwrap().topk(1).unwrap();
    assert!(v.requires_grad() && !i.requires_grad());
    assert_eq!(i.dtype(), DType::I32);
    assert!(!p.to_dtype(DType::I32).unwrap().requires_grad());
    assert!(p.to_dtype(DType::F32).unwrap().requires_grad());
    // to_device makes a new leaf (no gradient crosses devices).
    let moved = p.to_device(Device::cpu()).unwrap();
    assert!(moved.is_leaf() && !moved.requires_grad());
    // Switching a leaf off stops tracking.
    let q = leaf(&[1.0], &[1]);
    q.set_requires_grad(false).unwrap();
    assert!(!q.exp().unwrap().requires_grad());
}

#[test]
fn leaves_and_op_outputs() {
    let x = leaf(&[1.0, 2.0, 3.0, 4.0], &[2, 2]);
    let c = f64t(&[1.0], &[1]);
    assert!(x.is_leaf() && c.is_leaf());
    assert_eq!(x.op_name(), None);
    let cases: Vec<(Tensor, &str)> = vec![
        (x.add(&c).unwrap(), "add"),
        (x.mul(&x).unwrap(), "mul"),
        (x.matmul(&x).unwrap(), "matmul"),
        (x.exp().unwrap(), "exp"),
        (x.reshape(&[4]).unwrap(), "reshape"),
        (x.sum(&[0], false).unwrap(), "sum"),
        (x.softmax(-1).unwrap(), "softmax"),
    ];
    for (t, name) in cases {
        assert!(!t.is_leaf(), "{name} output is a leaf");
        assert_eq!(t.op_name(), Some(name));
        assert!(t.grad().is_none());
        assert!(
            format!("{t:?}").contains(name),
            "Debug does not name the op: {t:?}"
        );
    }
    // Untracked op outputs are leaves.
    let u = c.exp().unwrap();
    assert!(u.is_leaf() && u.op_name().is_none());
    // Gradients land on leaves only.
    let h = x.exp().unwrap();
    h.sum_all().unwrap().backward().unwrap();
    assert!(h.grad().is_none(), "an op output kept a gradient");
    assert!(x.grad().is_some());
}

#[test]
fn gradients_keep_the_leaf_dtype() {
    let x = Tensor::from_f32(vec![1.0, 2.0], &[2], Device::cpu())
        .unwrap()
        .with_grad()
        .unwrap();
    x.to_dtype(DType::F64)
        .unwrap()
        .mul_scalar(2.0)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let g = x.grad().unwrap();
    assert_eq!(g.dtype(), DType::F32);
    assert_eq!(g.to_vec_f32().unwrap(), vec![2.0, 2.0]);
}

#[test]
fn deep_chain_backward_does_not_overflow() {
    // 100 000 ops in a line: the backward walk must not recurse per node.
    let depth = 100_000;
    let x = leaf(&[0.5], &[1]);
    let mut y = x.clone();
    for _ in 0..depth {
        y = y.add_scalar(1e-4).unwrap();
    }
    y.sum_all().unwrap().backward().unwrap();
    assert_eq!(grad_of(&x), vec![1.0]);
}

/// Linear regression on fixed data: 200 steps of forward, backward, SGD update under no_grad and
/// zero_grad. The loss at every step must equal closed-form gradient descent computed in plain
/// f64, the parameter's gradient must survive dropping the loss (and the whole graph), and the
/// parameters converge to the generating weights.
#[test]
fn training_loop_matches_closed_form_gradient_descent() {
    let (n, d) = (16usize, 3usize);
    let true_w = [0.7, -1.3, 2.0];
    let true_b = 0.25;
    // Deterministic inputs (no RNG needed): a smooth pseudo-random pattern.
    let xs: Vec<f64> = (0..n * d)
        .map(|i| ((i * 37 % 23) as f64 / 11.0) - 1.0)
        .collect();
    let ys: Vec<f64> = (0..n)
        .map(|r| (0..d).map(|c| xs[r * d + c] * true_w[c]).sum::<f64>() + true_b)
        .collect();
    let x = f64t(&xs, &[n, d]);
    let y = f64t(&ys, &[n, 1]);
    let mut w = leaf(&[0.0; 3], &[d, 1]);
    let mut b = leaf(&[0.0], &[1]);
    let lr = 0.1;

    // Reference: the same descent by hand.
    let (mut rw, mut rb) = (vec![0.0f64; d], 0.0f64);
    let mut losses = Vec::new();
    for step in 0..200 {
        let pred = x.matmul(&w).unwrap().add(&b).unwrap();
        let loss = pred.mse(&y).unwrap();
        let loss_value = loss.item().unwrap();
        loss.backward().unwrap();
        drop(loss);
        drop(pred);

        let resid: Vec<f64> = (0..n)
            .map(|r| (0..d).map(|c| xs[r * d + c] * rw[c]).sum::<f64>() + rb - ys[r])
            .collect();
        let ref_loss = resid.iter().map(|e| e * e).sum::<f64>() / n as f64;
        let gw: Vec<f64> = (0..d)
            .map(|c| 2.0 / n as f64 * (0..n).map(|r| resid[r] * xs[r * d + c]).sum::<f64>())
            .collect();
        let gb = 2.0 / n as f64 * resid.iter().sum::<f64>();
        assert!(
            (loss_value - ref_loss).abs() <= 1e-10 * (1.0 + ref_loss),
            "step {step}: loss {loss_value} vs reference {ref_loss}"
        );
        // The gradients are intact after the loss and prediction were dropped.
        assert_close(&format!("step {step} dw"), &grad_of(&w), &gw, 1e-10, 1e-9);
        assert_close(&format!("step {step} db"), &grad_of(&b), &[gb], 1e-10, 1e-9);

        // SGD update in place of the leaves' values: new leaves built under no_grad.
        let (nw, nb) = no_grad(|| {
            let nw = w.sub(&w.grad().unwrap().mul_scalar(lr).unwrap()).unwrap();
            let nb = b.sub(&b.grad().unwrap().mul_scalar(lr).unwrap()).unwrap();
            (nw, nb)
        });
        assert!(!nw.requires_grad() && nw.is_leaf(), "update was recorded");
        w.zero_grad();
        b.zero_grad();
        let w_vals = nw.to_vec_f64().unwrap();
        let b_vals = nb.to_vec_f64().unwrap();
        for (c, v) in rw.iter_mut().enumerate() {
            *v -= lr * gw[c];
        }
        rb -= lr * gb;
        assert_close("w after step", &w_vals, &rw, 1e-10, 1e-9);
        losses.push(loss_value);
        // The next step's parameters: fresh leaves holding the updated values.
        w = leaf(&w_vals, &[d, 1]);
        b = leaf(&b_vals, &[1]);
    }
    assert!(
        losses[199] < 1e-6 * losses[0],
        "did not converge: {:?}",
        &losses[190..]
    );
    assert!(
        losses.windows(2).all(|p| p[1] <= p[0] + 1e-15),
        "loss increased"
    );
}

/// Set by `dropping_a_deep_unreleased_graph_does_not_overflow` for the copy of this binary it starts.
const DEEP_DROP_CHILD: &str = "MOEGRAD_TEST_DEEP_DROP_CHILD";

/// The child half of `dropping_a_deep_unreleased_graph_does_not_overflow`. A stack overflow
/// aborts the whole process (it is not a panic), so the deep drop runs in a separate process;
/// run directly, without the variable, this does nothing.
#[test]
fn deep_drop_child() {
    if std::env::var(DEEP_DROP_CHILD).is_err() {
        return;
    }
    std::thread::Builder::new()
        .stack_size(2 << 20)
        .spawn(|| {
            let x = leaf(&[0.5], &[1]);
            let mut y = x.clone();
            for _ in 0..200_000 {
                y = y.add_scalar(1e-4).unwrap();
            }
            // Never back-propagated (e.g. a loss computed for logging): the whole recorded
            // chain is freed here.
            drop(y);
        })
        .unwrap()
        .join()
        .unwrap();
}

/// A long recorded graph that is dropped without backward (so it was never released) must be
/// freed without recursing once per node.
#[test]
fn dropping_a_deep_unreleased_graph_does_not_overflow() {
    let exe = std::env::current_exe().unwrap();
    let out = Command::new(exe)
        .args(["deep_drop_child", "--exact", "--test-threads=1"])
        .env(DEEP_DROP_CHILD, "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("test deep_drop_child"),
        "the child process did not run deep_drop_child: {stdout} {stderr}"
    );
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "dropping a 200 000-node unreleased graph crashed the process ({}): {stderr}",
        out.status
    );
}

#[test]
fn gradients_are_summed_last_made_consumer_first_however_the_ops_list_their_inputs() {
    // x has three consumers, made in the order 3·x, −1e8·x, 1e8·x. The walk sums its gradient
    // with the last-made consumer's first: (1e8 + −1e8) + 3 = 3 in f32, where any other order
    // loses the 3 ((3 + −1e8) + 1e8 = 0: 3 − 1e8 rounds to −1e8). The loss combines the three
    // in different orders, and so puts them in different input slots of its adds; the bits of
    // x's gradient do not change (the walk's order is the order the tensors were made).
    type Combine = fn(&[Tensor; 3]) -> moegrad::Result<Tensor>;
    let combinations: [Combine; 4] = [
        |[a, b, c]| a.add(b)?.add(c),
        |[a, b, c]| c.add(&b.add(a)?),
        |[a, b, c]| b.add(c)?.add(a),
        |[a, b, c]| a.add(&c.add(b)?),
    ];
    for (i, combine) in combinations.iter().enumerate() {
        let x = Tensor::from_f32(vec![2.0], &[1], Device::cpu())
            .unwrap()
            .with_grad()
            .unwrap();
        let uses = [3.0, -1e8, 1e8].map(|s| x.mul_scalar(s).unwrap());
        combine(&uses)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        assert_eq!(
            x.grad().unwrap().to_vec_f32().unwrap(),
            vec![3.0],
            "combination {i}: x's gradients summed in another order"
        );
    }
}
