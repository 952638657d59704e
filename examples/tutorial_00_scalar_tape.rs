//! Tutorial chapter 0 (`docs/tutorial/00-autodiff-in-100-lines.md`): reverse-mode autodiff in
//! about a hundred lines, on scalars, then the same computation with `moegrad::Tensor`; the
//! example asserts that both give the same value and the same gradients.
//!
//! Run with `cargo run --release --example tutorial_00_scalar_tape`.

// ---- a scalar tape -------------------------------------------------------------------------

/// One recorded operation: the ids of its inputs and, for each, the local derivative
/// ∂output/∂input, computed during the forward pass (the chain rule needs nothing else).
struct Node {
    inputs: Vec<(usize, f64)>,
}

/// The tape: every value ever computed, in the order it was computed, with the node that made it.
/// That order is already a topological order (an op's inputs exist before the op runs), so the
/// backward pass only has to walk it backwards.
#[derive(Default)]
struct Tape {
    values: Vec<f64>,
    nodes: Vec<Node>,
}

/// A handle to one value on the tape.
#[derive(Clone, Copy)]
struct Var(usize);

impl Tape {
    /// Records a value made from `inputs` (each with its local derivative).
    fn push(&mut self, value: f64, inputs: Vec<(usize, f64)>) -> Var {
        self.values.push(value);
        self.nodes.push(Node { inputs });
        Var(self.values.len() - 1)
    }
    /// A leaf: an input of the computation, made by no op.
    fn leaf(&mut self, value: f64) -> Var {
        self.push(value, vec![])
    }
    fn value(&self, v: Var) -> f64 {
        self.values[v.0]
    }
    fn add(&mut self, a: Var, b: Var) -> Var {
        self.push(self.value(a) + self.value(b), vec![(a.0, 1.0), (b.0, 1.0)])
    }
    fn mul(&mut self, a: Var, b: Var) -> Var {
        let (x, y) = (self.value(a), self.value(b));
        self.push(x * y, vec![(a.0, y), (b.0, x)])
    }
    /// `a / b`: ∂/∂a = 1/b, ∂/∂b = −a/b²
    fn div(&mut self, a: Var, b: Var) -> Var {
        let (x, y) = (self.value(a), self.value(b));
        self.push(x / y, vec![(a.0, 1.0 / y), (b.0, -x / (y * y))])
    }
    /// `tanh a`: ∂/∂a = 1 − tanh² a
    fn tanh(&mut self, a: Var) -> Var {
        let t = self.value(a).tanh();
        self.push(t, vec![(a.0, 1.0 - t * t)])
    }
    /// `e^a`: ∂/∂a = e^a
    fn exp(&mut self, a: Var) -> Var {
        let e = self.value(a).exp();
        self.push(e, vec![(a.0, e)])
    }
    /// `ln a`: ∂/∂a = 1/a
    fn log(&mut self, a: Var) -> Var {
        let x = self.value(a);
        self.push(x.ln(), vec![(a.0, 1.0 / x)])
    }
    /// The gradient of `root` with respect to every value on the tape: seed ∂root/∂root = 1,
    /// then, from the last node to the first, pass each node's gradient to its inputs, times
    /// the local derivative, summing where a value is used more than once.
    fn backward(&self, root: Var) -> Vec<f64> {
        let mut grad = vec![0.0; self.values.len()];
        grad[root.0] = 1.0;
        for id in (0..=root.0).rev() {
            for &(input, local) in &self.nodes[id].inputs {
                grad[input] += grad[id] * local;
            }
        }
        grad
    }
}

// ---- the same function, twice -----------------------------------------------------------------

/// `L(a, b, c) = tanh(a·b + c)·e^a + ln(b·b) / c` on the scalar tape: the value and
/// (∂L/∂a, ∂L/∂b, ∂L/∂c).
fn with_scalar_tape(a: f64, b: f64, c: f64) -> (f64, [f64; 3]) {
    let mut tape = Tape::default();
    let (a, b, c) = (tape.leaf(a), tape.leaf(b), tape.leaf(c));
    let ab = tape.mul(a, b);
    let ab_c = tape.add(ab, c);
    let y = tape.tanh(ab_c);
    let ea = tape.exp(a);
    let first = tape.mul(y, ea);
    let bb = tape.mul(b, b);
    let log_bb = tape.log(bb);
    let second = tape.div(log_bb, c);
    let loss = tape.add(first, second);
    let grad = tape.backward(loss);
    (tape.value(loss), [grad[a.0], grad[b.0], grad[c.0]])
}

/// The same `L` with moegrad: one-element f64 tensors on the CPU, `backward` on the result.
fn with_moegrad(a: f64, b: f64, c: f64) -> moegrad::Result<(f64, [f64; 3])> {
    use moegrad::{Device, Tensor};
    let leaf = |v: f64| Tensor::from_f64(vec![v], &[1], Device::cpu())?.with_grad();
    let (a, b, c) = (leaf(a)?, leaf(b)?, leaf(c)?);
    let y = a.mul(&b)?.add(&c)?.tanh()?;
    let loss = y.mul(&a.exp()?)?.add(&b.mul(&b)?.log()?.div(&c)?)?;
    loss.backward()?;
    let g = |t: &Tensor| -> moegrad::Result<f64> {
        let grad = t
            .grad()
            .ok_or_else(|| moegrad::Error::Invalid("a leaf of the loss got no gradient".into()))?;
        Ok(grad.to_vec_f64()?[0])
    };
    Ok((loss.item()?, [g(&a)?, g(&b)?, g(&c)?]))
}

fn main() -> moegrad::Result<()> {
    for (a, b, c) in [(0.5, -1.5, 2.0), (-0.3, 0.7, 1.1), (1.2, 2.0, -0.8)] {
        let (l_tape, g_tape) = with_scalar_tape(a, b, c);
        let (l_moe, g_moe) = with_moegrad(a, b, c)?;
        println!("a = {a}, b = {b}, c = {c}");
        println!("  scalar tape: L = {l_tape:.12}, ∇L = {g_tape:.12?}");
        println!("  moegrad:     L = {l_moe:.12}, ∇L = {g_moe:.12?}");
        // Both evaluate the same formulas in f64, possibly in another order: they agree to a
        // few units in the last place.
        let close = |x: f64, y: f64| (x - y).abs() <= 1e-12 * (1.0 + x.abs().max(y.abs()));
        assert!(close(l_tape, l_moe), "values differ: {l_tape} vs {l_moe}");
        for (name, (gt, gm)) in ["a", "b", "c"].iter().zip(g_tape.iter().zip(&g_moe)) {
            assert!(close(*gt, *gm), "∂L/∂{name} differs: {gt} vs {gm}");
        }
    }
    println!("tutorial_00_scalar_tape: all checks passed");
    Ok(())
}
