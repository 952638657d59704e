//! An MoE layer's router and ReLU MLP experts evaluated in f64 on the host, from the definition,
//! with the layer's own parameters: the reference the router tests build their expected outputs
//! and gradients from (`tests/routers_default_moe.rs`, `tests/null_experts.rs`).
#![allow(dead_code)]

use moegrad::nn::Parameters;

/// A layer `d → hidden → d_out` with a linear gate over `routed` experts, read once.
pub struct MoeF64 {
    d: usize,
    hidden: usize,
    d_out: usize,
    routed: usize,
    w: Vec<f64>,
    b: Vec<f64>,
    w1: Vec<f64>,
    b1: Vec<f64>,
    w2: Vec<f64>,
    b2: Vec<f64>,
}

fn values(l: &dyn Parameters, name: &str) -> Vec<f64> {
    l.named_params()
        .into_iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| panic!("no parameter {name}"))
        .1
        .get()
        .to_vec_f64()
        .unwrap()
}

impl MoeF64 {
    /// Reads `router.weight [d, routed]`, `router.bias`, `experts.w1 [n, d, hidden]`,
    /// `experts.b1`, `experts.w2 [n, hidden, d_out]` and `experts.b2` of `layer`.
    pub fn of(
        layer: &dyn Parameters,
        (d, hidden, d_out): (usize, usize, usize),
        routed: usize,
    ) -> MoeF64 {
        MoeF64 {
            d,
            hidden,
            d_out,
            routed,
            w: values(layer, "router.weight"),
            b: values(layer, "router.bias"),
            w1: values(layer, "experts.w1"),
            b1: values(layer, "experts.b1"),
            w2: values(layer, "experts.w2"),
            b2: values(layer, "experts.b2"),
        }
    }

    /// The gate's logits `x·W + b` for one token `x` `[d]`.
    pub fn logits(&self, x: &[f64]) -> Vec<f64> {
        let r = self.routed;
        (0..r)
            .map(|i| self.b[i] + (0..self.d).map(|j| x[j] * self.w[j * r + i]).sum::<f64>())
            .collect()
    }

    /// Expert `i`'s output `ReLU(x·W1_i + b1_i)·W2_i + b2_i` for one token `x` `[d]`.
    pub fn expert(&self, i: usize, x: &[f64]) -> Vec<f64> {
        let (d, h, m) = (self.d, self.hidden, self.d_out);
        let hid: Vec<f64> = (0..h)
            .map(|k| {
                (self.b1[i * h + k]
                    + (0..d)
                        .map(|j| x[j] * self.w1[(i * d + j) * h + k])
                        .sum::<f64>())
                .max(0.0)
            })
            .collect();
        (0..m)
            .map(|c| {
                self.b2[i * m + c]
                    + (0..h)
                        .map(|k| hid[k] * self.w2[(i * h + k) * m + c])
                        .sum::<f64>()
            })
            .collect()
    }
}

/// `softmax(o)`.
pub fn softmax(o: &[f64]) -> Vec<f64> {
    let m = o.iter().cloned().fold(f64::MIN, f64::max);
    let z: f64 = o.iter().map(|v| (v - m).exp()).sum();
    o.iter().map(|v| (v - m).exp() / z).collect()
}
