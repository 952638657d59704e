//! GPU parity: for every op, forward and backward run on the CPU in f64 and on the GPU in f32
//! from identical inputs (f32-representable values) and one fixed random upstream gradient;
//! outputs and input gradients must agree (abs 1e-4 + rel 1e-3, looser for matmul and
//! reductions; integer outputs such as argmax, argsort and topk indices exactly). A few fixed-seed
//! random shapes per op, each dim ≤ 64, so a software Vulkan rasterizer gets through.
//!
//! Without a GPU adapter every GPU test prints "skipping" and returns. One more test,
//! `harness_self_check_cpu_f32`, runs all the same cases with the CPU's f32 backend in the GPU's
//! place, so the harness and the cases are exercised on every machine. The harness itself
//! (`parity`, the tolerances, the input generator) is `tests/common/parity.rs`, shared with the
//! property tests of `tests/gpu_parity_props.rs`.

mod common;
#[path = "common/parity.rs"]
mod parity;

use parity::{Gen, LOOSE, TIGHT, V, parity};

use moegrad::{DType, Device, Result, Tensor};

// ---- shapes of the fixed cases ----------------------------------------------------------------

impl Gen {
    /// Rank 1–3; case 0 keeps dims small, later cases go up to 17 (and one dim of 64 on case 2).
    fn shape(&mut self, case: u64) -> Vec<usize> {
        let r = self.dim(1, 3);
        let hi = if case == 0 { 4 } else { 17 };
        let mut s: Vec<usize> = (0..r).map(|_| self.dim(1, hi)).collect();
        if case == 2 {
            s[r - 1] = 64;
        }
        s
    }
    /// Two shapes that broadcast together, from a shape of this case.
    fn bcast(&mut self, case: u64) -> (Vec<usize>, Vec<usize>) {
        let s = self.shape(case);
        self.broadcast_pair(&s)
    }
}

const CASES: u64 = 3;

fn norm(axis: isize, rank: usize) -> usize {
    if axis < 0 {
        (axis + rank as isize) as usize
    } else {
        axis as usize
    }
}

// ---- the cases, one function per op ---------------------------------------------------------

mod cases {
    use super::*;

    type Un = fn(&Tensor) -> Result<Tensor>;

    fn unary(dev: Device, name: &str, kind: V, op: impl Fn(&Tensor) -> Result<Tensor>) {
        for case in 0..CASES {
            let mut g = Gen::new(name, case);
            let s = g.shape(case);
            let x = g.tensor(&s, kind);
            parity(name, dev, TIGHT, |t| op(&t[0]), &[x]);
        }
    }

    pub fn neg(dev: Device) {
        unary(dev, "neg", V::Smooth, Tensor::neg as Un);
    }
    pub fn exp(dev: Device) {
        unary(dev, "exp", V::Smooth, Tensor::exp as Un);
    }
    pub fn log(dev: Device) {
        unary(dev, "log", V::Positive, Tensor::log as Un);
    }
    pub fn sqrt(dev: Device) {
        unary(dev, "sqrt", V::Positive, Tensor::sqrt as Un);
    }
    pub fn powf(dev: Device) {
        for p in [-1.5, 0.5, 2.0, 3.0] {
            unary(dev, &format!("powf({p})"), V::Positive, |x| x.powf(p));
        }
    }
    pub fn abs(dev: Device) {
        unary(dev, "abs", V::Distinct, Tensor::abs as Un);
    }
    pub fn clamp(dev: Device) {
        // Distinct values are multiples of 0.05 plus 0.025: bounds on multiples of 0.05 avoid them.
        unary(dev, "clamp", V::Distinct, |x| x.clamp(-0.2, 0.35));
    }
    pub fn recip(dev: Device) {
        unary(dev, "recip", V::NonZero, Tensor::recip as Un);
    }
    pub fn add_scalar(dev: Device) {
        unary(dev, "add_scalar", V::Smooth, |x| x.add_scalar(-1.25));
    }
    pub fn mul_scalar(dev: Device) {
        unary(dev, "mul_scalar", V::Smooth, |x| x.mul_scalar(2.5));
    }
    pub fn relu(dev: Device) {
        unary(dev, "relu", V::Distinct, Tensor::relu as Un);
    }
    pub fn gelu(dev: Device) {
        unary(dev, "gelu", V::Smooth, Tensor::gelu as Un);
    }
    pub fn silu(dev: Device) {
        unary(dev, "silu", V::Smooth, Tensor::silu as Un);
    }
    pub fn tanh(dev: Device) {
        unary(dev, "tanh", V::Smooth, Tensor::tanh as Un);
    }
    pub fn sigmoid(dev: Device) {
        unary(dev, "sigmoid", V::Smooth, Tensor::sigmoid as Un);
    }
    pub fn softsign(dev: Device) {
        unary(dev, "softsign", V::Smooth, Tensor::softsign as Un);
        // The tails, where 1 + |x| dominates.
        let x = common::f64t(&[-4e4, -12.0, -0.5, 0.5, 12.0, 4e4], &[6]);
        parity("softsign (large)", dev, TIGHT, |t| t[0].softsign(), &[x]);
    }
    pub fn softplus(dev: Device) {
        unary(dev, "softplus", V::Smooth, Tensor::softplus as Un);
        // The stable branches at large |x|.
        let x = common::f64t(&[-40.0, -12.0, -0.5, 0.5, 12.0, 40.0], &[6]);
        parity("softplus (large)", dev, TIGHT, |t| t[0].softplus(), &[x]);
    }

    type Bin = fn(&Tensor, &Tensor) -> Result<Tensor>;

    fn binary(dev: Device, name: &str, ka: V, kb: V, op: Bin) {
        for case in 0..CASES {
            let mut g = Gen::new(name, case);
            let (sa, sb) = g.bcast(case);
            let (a, b) = (g.tensor(&sa, ka), g.tensor(&sb, kb));
            parity(name, dev, TIGHT, |t| op(&t[0], &t[1]), &[a, b]);
        }
        // The named patterns: [a,b] with [b], with [a,1], and [a,1] with [1,b].
        let mut g = Gen::new(name, 99);
        for (sa, sb) in [
            (vec![5, 7], vec![7]),
            (vec![5, 7], vec![5, 1]),
            (vec![5, 1], vec![1, 7]),
        ] {
            let (a, b) = (g.tensor(&sa, ka), g.tensor(&sb, kb));
            parity(name, dev, TIGHT, |t| op(&t[0], &t[1]), &[a, b]);
        }
    }

    pub fn add(dev: Device) {
        binary(dev, "add", V::Smooth, V::Smooth, Tensor::add);
    }
    pub fn sub(dev: Device) {
        binary(dev, "sub", V::Smooth, V::Smooth, Tensor::sub);
    }
    pub fn mul(dev: Device) {
        binary(dev, "mul", V::Smooth, V::Smooth, Tensor::mul);
    }
    pub fn div(dev: Device) {
        binary(dev, "div", V::Smooth, V::NonZero, Tensor::div);
    }

    /// maximum/minimum on operands whose values never tie (one ladder split between them).
    fn extremum_pair(dev: Device, name: &str, op: Bin) {
        for case in 0..CASES + 1 {
            let mut g = Gen::new(name, case);
            let (sa, sb) = g.bcast(case.min(2));
            let (na, nb): (usize, usize) = (sa.iter().product(), sb.iter().product());
            let v = g.vals(na + nb, V::Distinct);
            let a = common::f64t(&v[..na], &sa);
            let b = common::f64t(&v[na..], &sb);
            parity(name, dev, TIGHT, |t| op(&t[0], &t[1]), &[a, b]);
        }
    }
    pub fn maximum(dev: Device) {
        extremum_pair(dev, "maximum", Tensor::maximum);
    }
    pub fn minimum(dev: Device) {
        extremum_pair(dev, "minimum", Tensor::minimum);
    }

    pub fn comparisons(dev: Device) {
        for (name, op) in parity::COMPARISONS {
            for case in 0..CASES {
                let mut g = Gen::new(name, case);
                let s = g.shape(case);
                let n: usize = s.iter().product();
                let va = g.vals(n, V::Smooth);
                // b equals a in about a third of the places, so eq/ne/ge/le see ties.
                let vb: Vec<f64> = va
                    .iter()
                    .map(|&x| {
                        if g.dim(0, 2) == 0 {
                            x
                        } else {
                            g.vals(1, V::Smooth)[0]
                        }
                    })
                    .collect();
                let (a, b) = (common::f64t(&va, &s), common::f64t(&vb, &s));
                parity(name, dev, TIGHT, |t| op(&t[0], &t[1]), &[a, b]);
                // And with a broadcast scalar.
                let a = common::f64t(&va, &s);
                let c = common::f64t(&[va[0]], &[1]);
                parity(name, dev, TIGHT, |t| op(&t[0], &t[1]), &[a, c]);
            }
        }
    }

    pub fn matmul(dev: Device) {
        for case in 0..6u64 {
            let mut g = Gen::new("matmul", case);
            let hi = if case < 3 { 5 } else { 40 };
            let (m, k, n) = (g.dim(1, hi), g.dim(1, hi), g.dim(1, hi));
            let b = g.dim(1, 3);
            let (sa, sb) = match case {
                0 | 3 => (vec![m, k], vec![k, n]),
                1 | 4 => (vec![b, m, k], vec![b, k, n]),
                2 => (vec![m, k], vec![b, k, n]),
                _ => (vec![b, m, k], vec![k, n]),
            };
            let (x, y) = (g.tensor(&sa, V::Smooth), g.tensor(&sb, V::Smooth));
            parity("matmul", dev, LOOSE, |t| t[0].matmul(&t[1]), &[x, y]);
        }
        // Full 64-wide tiles plus ragged edges.
        let mut g = Gen::new("matmul", 100);
        let (x, y) = (
            g.tensor(&[2, 33, 64], V::Smooth),
            g.tensor(&[64, 17], V::Smooth),
        );
        parity("matmul (64)", dev, LOOSE, |t| t[0].matmul(&t[1]), &[x, y]);
        // Two batch dims.
        let (x, y) = (
            g.tensor(&[2, 3, 4, 5], V::Smooth),
            g.tensor(&[2, 3, 5, 6], V::Smooth),
        );
        parity(
            "matmul (2 batch dims)",
            dev,
            LOOSE,
            |t| t[0].matmul(&t[1]),
            &[x, y],
        );
    }

    pub fn transpose(dev: Device) {
        for case in 0..CASES {
            let mut g = Gen::new("transpose", case);
            let s = g.shape(case);
            let (a, b) = (g.axis(s.len()), g.axis(s.len()));
            let x = g.tensor(&s, V::Smooth);
            parity("transpose", dev, TIGHT, |t| t[0].transpose(a, b), &[x]);
        }
    }

    pub fn permute(dev: Device) {
        for (case, dims) in [vec![0usize], vec![1, 0], vec![2, 0, 1], vec![1, 2, 0]]
            .into_iter()
            .enumerate()
        {
            let mut g = Gen::new("permute", case as u64);
            let s: Vec<usize> = (0..dims.len()).map(|_| g.dim(1, 9)).collect();
            let x = g.tensor(&s, V::Smooth);
            parity("permute", dev, TIGHT, |t| t[0].permute(&dims), &[x]);
        }
    }

    pub fn reshape(dev: Device) {
        for case in 0..CASES {
            let mut g = Gen::new("reshape", case);
            let s = g.shape(case);
            let n: usize = s.iter().product();
            let mut rev = s.clone();
            rev.reverse();
            let x = g.tensor(&s, V::Smooth);
            let w = g.tensor(&rev, V::Smooth);
            // Reshape, then an elementwise op in the new shape, so the gradient is reshaped back.
            parity(
                "reshape",
                dev,
                TIGHT,
                |t| t[0].reshape(&rev)?.mul(&t[1])?.reshape(&[n]),
                &[x, w],
            );
        }
    }

    pub fn expand(dev: Device) {
        let shapes: [(&[usize], &[usize]); 4] = [
            (&[3], &[4, 3]),
            (&[4, 1], &[4, 5]),
            (&[1, 3, 1], &[2, 3, 6]),
            (&[1], &[2, 2, 64]),
        ];
        let mut g = Gen::new("expand", 0);
        for (from, to) in shapes {
            let x = g.tensor(from, V::Smooth);
            parity("expand", dev, LOOSE, |t| t[0].expand(to), &[x]);
        }
    }

    pub fn slice(dev: Device) {
        for case in 0..CASES {
            let mut g = Gen::new("slice", case);
            let s = g.shape(case);
            let a = g.axis(s.len());
            let len = s[norm(a, s.len())];
            let start = g.dim(0, len - 1);
            let end = g.dim(start + 1, len);
            let x = g.tensor(&s, V::Smooth);
            parity("slice", dev, TIGHT, |t| t[0].slice(a, start, end), &[x]);
        }
    }

    pub fn concat(dev: Device) {
        for case in 0..CASES {
            let mut g = Gen::new("concat", case);
            let s = g.shape(case);
            let a = g.axis(s.len());
            let parts = g.dim(2, 3);
            let inputs: Vec<Tensor> = (0..parts)
                .map(|_| {
                    let mut si = s.clone();
                    si[norm(a, s.len())] = g.dim(1, 5);
                    g.tensor(&si, V::Smooth)
                })
                .collect();
            parity("concat", dev, TIGHT, |t| Tensor::concat(t, a), &inputs);
        }
    }

    fn axes_of(g: &mut Gen, rank: usize) -> (Vec<isize>, bool) {
        let mut axes = Vec::new();
        for d in 0..rank {
            let (take, neg) = (g.flip(), g.flip());
            if take {
                axes.push(if neg {
                    d as isize - rank as isize
                } else {
                    d as isize
                });
            }
        }
        (axes, g.flip())
    }

    pub fn sum(dev: Device) {
        for case in 0..CASES {
            let mut g = Gen::new("sum", case);
            let s = g.shape(case);
            let (axes, keep) = axes_of(&mut g, s.len());
            let x = g.tensor(&s, V::Smooth);
            parity("sum", dev, LOOSE, |t| t[0].sum(&axes, keep), &[x]);
        }
    }
    pub fn sum_all(dev: Device) {
        unary_loose(dev, "sum_all", V::Smooth, |x| x.sum_all());
    }
    pub fn mean(dev: Device) {
        for case in 0..CASES {
            let mut g = Gen::new("mean", case);
            let s = g.shape(case);
            let (axes, keep) = axes_of(&mut g, s.len());
            let x = g.tensor(&s, V::Smooth);
            parity("mean", dev, LOOSE, |t| t[0].mean(&axes, keep), &[x]);
        }
    }
    pub fn mean_all(dev: Device) {
        unary_loose(dev, "mean_all", V::Smooth, |x| x.mean_all());
    }

    fn unary_loose(dev: Device, name: &str, kind: V, op: impl Fn(&Tensor) -> Result<Tensor>) {
        for case in 0..CASES {
            let mut g = Gen::new(name, case);
            let s = g.shape(case);
            let x = g.tensor(&s, kind);
            parity(name, dev, LOOSE, |t| op(&t[0]), &[x]);
        }
    }

    fn along_axis(
        dev: Device,
        name: &str,
        kind: V,
        op: impl Fn(&Tensor, isize, bool) -> Result<Tensor>,
    ) {
        for case in 0..CASES {
            let mut g = Gen::new(name, case);
            let s = g.shape(case);
            let a = g.axis(s.len());
            let keep = g.flip();
            let x = g.tensor(&s, kind);
            parity(name, dev, LOOSE, |t| op(&t[0], a, keep), &[x]);
        }
    }

    pub fn max(dev: Device) {
        along_axis(dev, "max", V::Distinct, |x, a, k| x.max(a, k));
    }
    pub fn min(dev: Device) {
        along_axis(dev, "min", V::Distinct, |x, a, k| x.min(a, k));
    }
    pub fn argmax(dev: Device) {
        along_axis(dev, "argmax", V::Distinct, |x, a, k| x.argmax(a, k));
        // Ties: the first maximum wins on both devices.
        let x = common::f64t(&[1.0, 3.0, 3.0, 0.0, 2.0, 2.0, 2.0, -1.0], &[2, 4]);
        parity(
            "argmax (ties)",
            dev,
            TIGHT,
            |t| t[0].argmax(-1, false),
            &[x],
        );
    }
    pub fn cumsum(dev: Device) {
        along_axis(dev, "cumsum", V::Smooth, |x, a, _| x.cumsum(a));
    }
    pub fn softmax(dev: Device) {
        along_axis(dev, "softmax", V::Smooth, |x, a, _| x.softmax(a));
    }
    pub fn log_softmax(dev: Device) {
        along_axis(dev, "log_softmax", V::Smooth, |x, a, _| x.log_softmax(a));
    }
    pub fn logsumexp(dev: Device) {
        along_axis(dev, "logsumexp", V::Smooth, |x, a, k| x.logsumexp(a, k));
        // Large logits: the max must be subtracted on the device too.
        let x = common::f64t(&[80.0, 81.5, 79.0, -90.0, -88.0, -93.0], &[2, 3]);
        parity(
            "logsumexp (large)",
            dev,
            LOOSE,
            |t| t[0].logsumexp(1, false),
            std::slice::from_ref(&x),
        );
        parity("softmax (large)", dev, LOOSE, |t| t[0].softmax(1), &[x]);
    }

    pub fn cross_entropy(dev: Device) {
        for case in 0..CASES {
            let mut g = Gen::new("cross_entropy", case);
            let (n, c) = (g.dim(1, 16), g.dim(1, 12));
            let x = g.tensor(&[n, c], V::Smooth);
            let tg = g.ints(&[n], c);
            parity(
                "cross_entropy",
                dev,
                LOOSE,
                |t| t[0].cross_entropy(&t[1]),
                &[x, tg],
            );
        }
    }
    pub fn mse(dev: Device) {
        for case in 0..CASES {
            let mut g = Gen::new("mse", case);
            let s = g.shape(case);
            let (p, y) = (g.tensor(&s, V::Smooth), g.tensor(&s, V::Smooth));
            parity("mse", dev, LOOSE, |t| t[0].mse(&t[1]), &[p, y]);
        }
    }
    pub fn bce_with_logits(dev: Device) {
        for case in 0..CASES {
            let mut g = Gen::new("bce_with_logits", case);
            let s = g.shape(case);
            let x = g.tensor(&s, V::Smooth);
            let n: usize = s.iter().product();
            let y: Vec<f64> = g
                .vals(n, V::Smooth)
                .iter()
                .map(|v| (v + 2.0) / 4.0)
                .collect();
            let y = common::f64t(&y, &s);
            parity(
                "bce_with_logits",
                dev,
                LOOSE,
                |t| t[0].bce_with_logits(&t[1]),
                &[x, y],
            );
        }
    }

    pub fn gather(dev: Device) {
        for case in 0..CASES {
            let mut g = Gen::new("gather", case);
            let s = g.shape(case);
            let a = g.axis(s.len());
            let an = norm(a, s.len());
            let mut is = s.clone();
            is[an] = g.dim(1, 6);
            let x = g.tensor(&s, V::Smooth);
            let idx = g.ints(&is, s[an]);
            parity("gather", dev, TIGHT, |t| t[0].gather(a, &t[1]), &[x, idx]);
        }
    }
    pub fn index_select(dev: Device) {
        for case in 0..CASES {
            let mut g = Gen::new("index_select", case);
            let s = g.shape(case);
            let a = g.axis(s.len());
            let m = g.dim(1, 8);
            let x = g.tensor(&s, V::Smooth);
            let idx = g.ints(&[m], s[norm(a, s.len())]);
            parity(
                "index_select",
                dev,
                TIGHT,
                |t| t[0].index_select(a, &t[1]),
                &[x, idx],
            );
        }
    }
    pub fn scatter_add(dev: Device) {
        for case in 0..CASES {
            let mut g = Gen::new("scatter_add", case);
            let s = g.shape(case);
            let a = g.axis(s.len());
            let an = norm(a, s.len());
            let mut is = s.clone();
            is[an] = g.dim(1, 6);
            let x = g.tensor(&s, V::Smooth);
            let idx = g.ints(&is, s[an]); // repeats accumulate
            let src = g.tensor(&is, V::Smooth);
            parity(
                "scatter_add",
                dev,
                TIGHT,
                |t| t[0].scatter_add(a, &t[1], &t[2]),
                &[x, idx, src],
            );
        }
    }

    fn mask(g: &mut Gen, s: &[usize]) -> Tensor {
        let n: usize = s.iter().product();
        let v: Vec<f64> = (0..n).map(|_| if g.flip() { 1.0 } else { 0.0 }).collect();
        common::f64t(&v, s)
    }

    pub fn where_cond(dev: Device) {
        for case in 0..CASES {
            let mut g = Gen::new("where_cond", case);
            let (sa, sb) = g.bcast(case);
            let cond = mask(&mut g, &sa);
            let (a, b) = (g.tensor(&sa, V::Smooth), g.tensor(&sb, V::Smooth));
            parity(
                "where_cond",
                dev,
                TIGHT,
                |t| Tensor::where_cond(&t[0], &t[1], &t[2]),
                &[cond, a, b],
            );
        }
    }
    pub fn masked_fill(dev: Device) {
        for case in 0..CASES {
            let mut g = Gen::new("masked_fill", case);
            let s = g.shape(case);
            let m = mask(&mut g, &s);
            let x = g.tensor(&s, V::Smooth);
            parity(
                "masked_fill",
                dev,
                TIGHT,
                |t| t[1].masked_fill(&t[0], -7.5),
                &[m, x],
            );
        }
    }

    pub fn topk(dev: Device) {
        for case in 0..CASES {
            let mut g = Gen::new("topk", case);
            let s = g.shape(case);
            let k = g.dim(1, s[s.len() - 1]);
            let x = g.tensor(&s, V::Distinct);
            parity(
                "topk values",
                dev,
                TIGHT,
                |t| Ok(t[0].topk(k)?.0),
                std::slice::from_ref(&x),
            );
            parity("topk indices", dev, TIGHT, |t| Ok(t[0].topk(k)?.1), &[x]);
        }
        // Ties: lowest index first on both devices.
        let x = common::f64t(&[0.5, 0.9, 0.5, 0.9, 0.1, 0.5], &[1, 6]);
        parity("topk (ties)", dev, TIGHT, |t| Ok(t[0].topk(4)?.1), &[x]);
    }
    pub fn argsort(dev: Device) {
        for case in 0..CASES {
            let mut g = Gen::new("argsort", case);
            let s = g.shape(case);
            let x = g.tensor(&s, V::Distinct);
            for desc in [false, true] {
                parity(
                    "argsort",
                    dev,
                    TIGHT,
                    |t| t[0].argsort(desc),
                    std::slice::from_ref(&x),
                );
            }
        }
        let x = common::f64t(&[2.0, 1.0, 2.0, 1.0, 3.0], &[5]);
        for desc in [false, true] {
            parity(
                "argsort (ties)",
                dev,
                TIGHT,
                |t| t[0].argsort(desc),
                std::slice::from_ref(&x),
            );
        }
    }

    pub fn to_dtype(dev: Device) {
        for case in 0..CASES {
            let mut g = Gen::new("to_dtype", case);
            let s = g.shape(case);
            let x = g.tensor(&s, V::Smooth);
            // Float → f32 (a cast on the reference, a no-op on the device), differentiable.
            parity(
                "to_dtype f32",
                dev,
                TIGHT,
                |t| t[0].to_dtype(DType::F32)?.mul_scalar(1.5),
                std::slice::from_ref(&x),
            );
            // Float → i32: values k + 0.25 scaled, away from integer boundaries.
            let n: usize = s.iter().product();
            let v: Vec<f64> = (0..n).map(|i| (i as f64 % 13.0) - 6.0 + 0.25).collect();
            let y = common::f64t(&v, &s);
            parity(
                "to_dtype i32",
                dev,
                TIGHT,
                |t| t[0].to_dtype(DType::I32),
                &[y],
            );
            // i32 → float.
            let idx = g.ints(&s, 50);
            parity(
                "i32 to_dtype f32",
                dev,
                TIGHT,
                |t| t[0].to_dtype(DType::F32),
                &[idx],
            );
        }
    }

    pub fn to_device(dev: Device) {
        for case in 0..CASES {
            let mut g = Gen::new("to_device", case);
            let s = g.shape(case);
            let x = g.tensor(&s, V::Smooth);
            // Down to the CPU and back: same values, a new leaf (no gradient crosses).
            parity(
                "to_device",
                dev,
                TIGHT,
                |t| {
                    let back = t[0].to_device(Device::cpu())?.to_device(t[0].device())?;
                    assert!(back.is_leaf() && !back.requires_grad());
                    Ok(back)
                },
                &[x],
            );
            let idx = g.ints(&s, 9);
            parity(
                "to_device i32",
                dev,
                TIGHT,
                |t| t[0].to_device(Device::cpu())?.to_device(t[0].device()),
                &[idx],
            );
        }
    }

    /// A small MLP-like composite, so ops chain on the device and gradients meet.
    pub fn composite(dev: Device) {
        let mut g = Gen::new("composite", 0);
        let x = g.tensor(&[8, 16], V::Smooth);
        let w1 = g.tensor(&[16, 32], V::Smooth);
        let w2 = g.tensor(&[32, 5], V::Smooth);
        let tg = g.ints(&[8], 5);
        parity(
            "composite",
            dev,
            LOOSE,
            |t| {
                let h = t[0].matmul(&t[1])?.mul_scalar(0.25)?.gelu()?;
                let h = h.add(&h.tanh()?)?; // h used twice
                h.matmul(&t[2])?.cross_entropy(&t[3])
            },
            &[x, w1, w2, tg],
        );
    }
}

// ---- the tests --------------------------------------------------------------------------------

parity::gpu_and_cpu_f32_tests!(
    cases,
    "gpu_parity",
    /// Every case with the CPU's f32 backend standing in for the GPU: proves the harness and
    /// the cases run (and catches f32-only CPU bugs) on machines without an adapter.
    fn harness_self_check_cpu_f32;
    neg,
    exp,
    log,
    sqrt,
    powf,
    abs,
    clamp,
    recip,
    add_scalar,
    mul_scalar,
    relu,
    gelu,
    silu,
    tanh,
    sigmoid,
    softplus,
    softsign,
    add,
    sub,
    mul,
    div,
    maximum,
    minimum,
    comparisons,
    matmul,
    transpose,
    permute,
    reshape,
    expand,
    slice,
    concat,
    sum,
    sum_all,
    mean,
    mean_all,
    max,
    min,
    argmax,
    cumsum,
    softmax,
    log_softmax,
    logsumexp,
    cross_entropy,
    mse,
    bce_with_logits,
    gather,
    index_select,
    scatter_add,
    where_cond,
    masked_fill,
    topk,
    argsort,
    to_dtype,
    to_device,
    composite,
);

/// The harness must notice a difference: a deliberately different function on the device side.
#[test]
fn harness_detects_a_mismatch() {
    let x = common::f64t(&[0.5, -1.0, 2.0], &[3]);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        parity(
            "mismatch",
            Device::cpu(),
            TIGHT,
            // f64 (reference) computes exp, f32 (device under test) computes exp + 1e-2.
            |t| {
                if t[0].dtype() == DType::F64 {
                    t[0].exp()
                } else {
                    t[0].exp()?.add_scalar(1e-2)
                }
            },
            std::slice::from_ref(&x),
        )
    }));
    assert!(r.is_err(), "parity accepted different outputs");
    // Same output, different gradient.
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        parity(
            "grad mismatch",
            Device::cpu(),
            TIGHT,
            |t| {
                if t[0].dtype() == DType::F64 {
                    t[0].mul(&t[0])
                } else {
                    t[0].mul(&t[0].detach())
                }
            },
            std::slice::from_ref(&x),
        )
    }));
    assert!(r.is_err(), "parity accepted different gradients");
}
