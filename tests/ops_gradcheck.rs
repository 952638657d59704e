//! Finite-difference gradient checks (`moegrad::gradcheck`, f64 on the CPU) of every
//! differentiable op, over random shapes and values drawn by proptest: elementwise and
//! broadcasting binary ops, matmul (2-D and batched), layout ops, reductions, softmax family,
//! losses, indexing (including `index_scatter`, the MoE combine), im2col windows
//! (`unfold_windows`), `where`/`masked_fill`, `topk` and dtype casts. Inputs stay away from kinks
//! (distinct values with gaps, positive arguments for log/sqrt/powf, denominators away from 0).
//! Also checks gradient accumulation through reused tensors, the fast (projection) mode, and
//! that gradcheck itself reports a wrong gradient.

mod common;

use moegrad::gradcheck::{GradcheckOptions, gradcheck};
use moegrad::{DType, Device, Error, Result, Tensor};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::Index;

// ---- inputs -------------------------------------------------------------------------------

/// One input tensor as plain data (so proptest can print and shrink it).
#[derive(Clone, Debug)]
struct In {
    shape: Vec<usize>,
    vals: Vec<f64>,
}

impl In {
    fn t(&self) -> Tensor {
        common::f64t(&self.vals, &self.shape)
    }
    fn rank(&self) -> usize {
        self.shape.len()
    }
}

/// Kinds of values, chosen to keep every op away from its kinks and singularities.
#[derive(Clone, Copy, Debug, PartialEq)]
enum V {
    /// uniform in [-2, 2)
    Smooth,
    /// pairwise distinct (gaps > 0.25), none within 0.08 of 0, none within 0.08 of a multiple of 0.37
    Distinct,
    /// in [0.2, 3)
    Positive,
    /// |x| in [0.5, 2), either sign
    NonZero,
}

/// `n` pairwise distinct values `(p − ⌊n/2⌋ + ½)·0.37 + jitter`, `p` a random permutation of
/// `0..n`, jitter in [0, 0.1): gaps of at least 0.27, at least 0.085 away from 0 and from every
/// multiple of 0.37 (where the clamp tests put their bounds).
fn distinct(n: usize) -> BoxedStrategy<Vec<f64>> {
    (
        Just((0..n).collect::<Vec<usize>>()).prop_shuffle(),
        vec(0.0f64..0.1, n),
    )
        .prop_map(move |(perm, jitter)| {
            perm.iter()
                .zip(jitter)
                .map(|(&p, j)| (p as f64 - (n / 2) as f64 + 0.5) * 0.37 + j)
                .collect()
        })
        .boxed()
}

fn vals(kind: V, n: usize) -> BoxedStrategy<Vec<f64>> {
    match kind {
        V::Smooth => vec(-2.0f64..2.0, n).boxed(),
        V::Positive => vec(0.2f64..3.0, n).boxed(),
        V::NonZero => vec(
            (0.5f64..2.0, any::<bool>()).prop_map(|(m, s)| if s { m } else { -m }),
            n,
        )
        .boxed(),
        V::Distinct => distinct(n),
    }
}

/// Rank 1–3, dims 1–4.
fn shape() -> impl Strategy<Value = Vec<usize>> {
    vec(1usize..=4, 1..=3)
}

fn input_of(shape: Vec<usize>, kind: V) -> BoxedStrategy<In> {
    let n = shape.iter().product();
    (Just(shape), vals(kind, n))
        .prop_map(|(shape, vals)| In { shape, vals })
        .boxed()
}

fn input(kind: V) -> impl Strategy<Value = In> {
    shape().prop_flat_map(move |s| input_of(s, kind))
}

/// Two shapes that broadcast together: a base shape, each side with some dims set to 1, the
/// second with up to two leading dims dropped, optionally swapped.
fn bcast_shapes() -> impl Strategy<Value = (Vec<usize>, Vec<usize>)> {
    (
        shape(),
        vec(any::<bool>(), 3),
        vec(any::<bool>(), 3),
        0usize..=2,
        any::<bool>(),
    )
        .prop_map(|(s, ones_a, ones_b, drop, swap)| {
            // A dim of one side becomes 1 only where the other keeps it (so neither collapses
            // everything when both masks agree, and both sides still broadcast).
            let a: Vec<usize> = s
                .iter()
                .zip(&ones_a)
                .map(|(&d, &o)| if o { 1 } else { d })
                .collect();
            let mut b: Vec<usize> = s
                .iter()
                .zip(ones_a.iter().zip(&ones_b))
                .map(|(&d, (&oa, &ob))| if ob && !oa { 1 } else { d })
                .collect();
            let drop = drop.min(b.len() - 1);
            b.drain(..drop);
            if swap { (b, a) } else { (a, b) }
        })
}

/// Two broadcast-compatible inputs; with both kinds `Distinct`, all values of both are distinct.
fn pair(ka: V, kb: V) -> impl Strategy<Value = (In, In)> {
    bcast_shapes().prop_flat_map(move |(sa, sb)| {
        let (na, nb): (usize, usize) = (sa.iter().product(), sb.iter().product());
        let both = if ka == V::Distinct && kb == V::Distinct {
            distinct(na + nb)
                .prop_map(move |v| (v[..na].to_vec(), v[na..].to_vec()))
                .boxed()
        } else {
            (vals(ka, na), vals(kb, nb)).boxed()
        };
        (Just(sa), Just(sb), both).prop_map(|(sa, sb, (va, vb))| {
            (
                In {
                    shape: sa,
                    vals: va,
                },
                In {
                    shape: sb,
                    vals: vb,
                },
            )
        })
    })
}

/// Two inputs of one shape.
fn same_shape_pair(ka: V, kb: V) -> impl Strategy<Value = (In, In)> {
    shape().prop_flat_map(move |s| (input_of(s.clone(), ka), input_of(s, kb)))
}

/// An input and an axis of it, as a possibly negative `isize` (both spellings are exercised).
fn with_axis(kind: V) -> impl Strategy<Value = (In, isize)> {
    (input(kind), any::<Index>(), any::<bool>()).prop_map(|(x, i, neg)| {
        let r = x.rank();
        let a = i.index(r) as isize;
        (x, if neg { a - r as isize } else { a })
    })
}

fn norm_axis(a: isize, rank: usize) -> usize {
    if a < 0 {
        (a + rank as isize) as usize
    } else {
        a as usize
    }
}

// ---- checking -----------------------------------------------------------------------------

fn opts() -> GradcheckOptions {
    GradcheckOptions::default()
}

fn fast(seed: u64) -> GradcheckOptions {
    GradcheckOptions {
        fast_mode: true,
        seed,
        ..GradcheckOptions::default()
    }
}

/// Runs gradcheck and turns its error into a proptest failure (so the case is shrunk).
fn gc_with(
    what: &str,
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
    inputs: &[Tensor],
    o: &GradcheckOptions,
) -> std::result::Result<(), TestCaseError> {
    match gradcheck(f, inputs, o) {
        Ok(report) => {
            // A check that compared nothing proves nothing (unless the op has no elements).
            let any_elems = inputs.iter().any(|t| t.numel() > 0);
            prop_assert!(
                report.compared > 0 || !any_elems,
                "{what}: gradcheck compared nothing"
            );
            Ok(())
        }
        Err(e) => Err(TestCaseError::fail(format!("{what}: {e}"))),
    }
}

fn gc(
    what: &str,
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
    inputs: &[Tensor],
) -> std::result::Result<(), TestCaseError> {
    gc_with(what, f, inputs, &opts())
}

fn i32t(values: &[i32], shape: &[usize]) -> Tensor {
    Tensor::from_i32(values.to_vec(), shape, Device::cpu()).expect("valid index tensor")
}

// ---- elementwise unary ops ----------------------------------------------------------------

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn neg(x in input(V::Smooth)) {
        gc("neg", |t| t[0].neg(), &[x.t()])?;
    }

    #[test]
    fn exp(x in input(V::Smooth)) {
        gc("exp", |t| t[0].exp(), &[x.t()])?;
    }

    #[test]
    fn log(x in input(V::Positive)) {
        gc("log", |t| t[0].log(), &[x.t()])?;
    }

    #[test]
    fn sqrt(x in input(V::Positive)) {
        gc("sqrt", |t| t[0].sqrt(), &[x.t()])?;
    }

    #[test]
    fn powf(x in input(V::Positive), p in prop::sample::select(vec![-1.5, -1.0, 0.5, 2.0, 3.0, 2.7])) {
        gc("powf", |t| t[0].powf(p), &[x.t()])?;
    }

    #[test]
    fn abs(x in input(V::Distinct)) {
        gc("abs", |t| t[0].abs(), &[x.t()])?;
    }

    #[test]
    fn clamp(x in input(V::Distinct), lo_k in -3i32..=0, width in 1i32..=4) {
        // Bounds on multiples of 0.37, which Distinct values avoid by > 0.08.
        let (lo, hi) = (lo_k as f64 * 0.37, (lo_k + width) as f64 * 0.37);
        gc("clamp", |t| t[0].clamp(lo, hi), &[x.t()])?;
    }

    #[test]
    fn recip(x in input(V::NonZero)) {
        gc("recip", |t| t[0].recip(), &[x.t()])?;
    }

    #[test]
    fn add_scalar(x in input(V::Smooth), c in -3.0f64..3.0) {
        gc("add_scalar", |t| t[0].add_scalar(c), &[x.t()])?;
    }

    #[test]
    fn mul_scalar(x in input(V::Smooth), c in -3.0f64..3.0) {
        gc("mul_scalar", |t| t[0].mul_scalar(c), &[x.t()])?;
    }

    #[test]
    fn relu(x in input(V::Distinct)) {
        gc("relu", |t| t[0].relu(), &[x.t()])?;
    }

    #[test]
    fn gelu(x in input(V::Smooth)) {
        gc("gelu", |t| t[0].gelu(), &[x.t()])?;
    }

    #[test]
    fn silu(x in input(V::Smooth)) {
        gc("silu", |t| t[0].silu(), &[x.t()])?;
    }

    #[test]
    fn tanh(x in input(V::Smooth)) {
        gc("tanh", |t| t[0].tanh(), &[x.t()])?;
    }

    #[test]
    fn sigmoid(x in input(V::Smooth)) {
        gc("sigmoid", |t| t[0].sigmoid(), &[x.t()])?;
    }

    #[test]
    fn softplus(x in input(V::Smooth)) {
        gc("softplus", |t| t[0].softplus(), &[x.t()])?;
    }

    #[test]
    fn softsign(x in input(V::Smooth)) {
        gc("softsign", |t| t[0].softsign(), &[x.t()])?;
    }
}

/// Wide-range inputs for the stable formulas (softplus, sigmoid, silu, tanh, gelu, softsign) at
/// large |x|.
#[test]
fn smooth_unaries_at_large_magnitudes() {
    let x = common::f64t(&[-30.0, -8.5, -3.1, 2.9, 7.7, 25.0], &[2, 3]);
    type Un = fn(&Tensor) -> Result<Tensor>;
    let ops: [(&str, Un); 6] = [
        ("softplus", Tensor::softplus),
        ("sigmoid", Tensor::sigmoid),
        ("silu", Tensor::silu),
        ("tanh", Tensor::tanh),
        ("gelu", Tensor::gelu),
        ("softsign", Tensor::softsign),
    ];
    for (name, op) in ops {
        gradcheck(|t| op(&t[0]), std::slice::from_ref(&x), &opts())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

// ---- binary ops with broadcasting ---------------------------------------------------------

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn add((a, b) in pair(V::Smooth, V::Smooth)) {
        gc("add", |t| t[0].add(&t[1]), &[a.t(), b.t()])?;
    }

    #[test]
    fn sub((a, b) in pair(V::Smooth, V::Smooth)) {
        gc("sub", |t| t[0].sub(&t[1]), &[a.t(), b.t()])?;
    }

    #[test]
    fn mul((a, b) in pair(V::Smooth, V::Smooth)) {
        gc("mul", |t| t[0].mul(&t[1]), &[a.t(), b.t()])?;
    }

    #[test]
    fn div((a, b) in pair(V::Smooth, V::NonZero)) {
        gc("div", |t| t[0].div(&t[1]), &[a.t(), b.t()])?;
    }

    #[test]
    fn maximum((a, b) in pair(V::Distinct, V::Distinct)) {
        gc("maximum", |t| t[0].maximum(&t[1]), &[a.t(), b.t()])?;
    }

    #[test]
    fn minimum((a, b) in pair(V::Distinct, V::Distinct)) {
        gc("minimum", |t| t[0].minimum(&t[1]), &[a.t(), b.t()])?;
    }
}

/// The named broadcasting patterns, for every binary op: `[a,b]` with `[b]`, with `[a,1]`, the
/// two-sided `[a,1]` with `[1,b]`, a scalar, and each the other way round.
#[test]
fn binary_ops_fixed_broadcast_patterns() {
    type Bin = fn(&Tensor, &Tensor) -> Result<Tensor>;
    let ops: [(&str, Bin); 6] = [
        ("add", Tensor::add),
        ("sub", Tensor::sub),
        ("mul", Tensor::mul),
        ("div", Tensor::div),
        ("maximum", Tensor::maximum),
        ("minimum", Tensor::minimum),
    ];
    let patterns: [(&[usize], &[usize]); 5] = [
        (&[3, 4], &[4]),
        (&[3, 4], &[3, 1]),
        (&[3, 1], &[1, 4]),
        (&[2, 3, 4], &[]),
        (&[2, 1, 4], &[3, 1]),
    ];
    for (name, op) in ops {
        for (sa, sb) in patterns {
            for (sa, sb) in [(sa, sb), (sb, sa)] {
                let (na, nb): (usize, usize) = (sa.iter().product(), sb.iter().product());
                // Distinct, nonzero values, interleaved between the two operands.
                let v = |i: usize| (i as f64 - 9.5) * 0.3 + 0.05;
                let va: Vec<f64> = (0..na).map(|i| v(2 * i)).collect();
                let vb: Vec<f64> = (0..nb).map(|i| v(2 * i + 1)).collect();
                let (a, b) = (common::f64t(&va, sa), common::f64t(&vb, sb));
                gradcheck(|t| op(&t[0], &t[1]), &[a, b], &opts())
                    .unwrap_or_else(|e| panic!("{name} {sa:?} with {sb:?}: {e}"));
            }
        }
    }
}

// ---- matmul -------------------------------------------------------------------------------

/// Operand shapes for every matmul form: 2-D, equal batch dims (one or two of them), and a
/// 2-D operand shared across the other's batch, on either side.
fn matmul_shapes() -> impl Strategy<Value = (Vec<usize>, Vec<usize>)> {
    (
        1usize..=4,
        1usize..=4,
        1usize..=4,
        1usize..=3,
        1usize..=3,
        0u8..6,
    )
        .prop_map(|(m, k, n, b1, b2, form)| match form {
            0 => (vec![m, k], vec![k, n]),
            1 => (vec![b1, m, k], vec![b1, k, n]),
            2 => (vec![b1, m, k], vec![k, n]),
            3 => (vec![m, k], vec![b1, k, n]),
            4 => (vec![b1, b2, m, k], vec![b1, b2, k, n]),
            _ => (vec![b1, b2, m, k], vec![k, n]),
        })
}

fn matmul_inputs() -> impl Strategy<Value = (In, In)> {
    matmul_shapes().prop_flat_map(|(sa, sb)| (input_of(sa, V::Smooth), input_of(sb, V::Smooth)))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    #[test]
    fn matmul((a, b) in matmul_inputs()) {
        gc("matmul", |t| t[0].matmul(&t[1]), &[a.t(), b.t()])?;
    }

    #[test]
    fn matmul_fast_mode((a, b) in matmul_inputs(), seed in 0u64..1000) {
        gc_with("matmul (fast)", |t| t[0].matmul(&t[1]), &[a.t(), b.t()], &fast(seed))?;
    }

    /// `x·Eᵀ` with x 2-D or batched and E 2-D `[n, k]`, read transposed in place: the
    /// gradients of x and E.
    #[test]
    fn matmul_t(
        (x, e) in (1usize..=4, 1usize..=4, 1usize..=4, 1usize..=3, 0u8..3)
            .prop_flat_map(|(m, k, n, b, form)| {
                let sx = match form {
                    0 => vec![m, k],
                    1 => vec![b, m, k],
                    _ => vec![b, 2, m, k],
                };
                (input_of(sx, V::Smooth), input_of(vec![n, k], V::Smooth))
            })
    ) {
        gc("matmul_t", |t| t[0].matmul_t(&t[1]), &[x.t(), e.t()])?;
    }

    /// `x·W + b` with x 2-D or batched (one or two batch dims) and W 2-D: the gradients of x,
    /// W and the bias.
    #[test]
    fn matmul_bias(
        (x, w, bias) in (1usize..=4, 1usize..=4, 1usize..=4, 1usize..=3, 0u8..3)
            .prop_flat_map(|(m, k, n, b, form)| {
                let sx = match form {
                    0 => vec![m, k],
                    1 => vec![b, m, k],
                    _ => vec![b, 2, m, k],
                };
                (
                    input_of(sx, V::Smooth),
                    input_of(vec![k, n], V::Smooth),
                    input_of(vec![n], V::Smooth),
                )
            })
    ) {
        gc("matmul_bias", |t| t[0].matmul_bias(&t[1], &t[2]), &[x.t(), w.t(), bias.t()])?;
    }

    /// `addend + x·W (+ b)` (a block's last projection added to its residual stream) with x
    /// 2-D or batched and W 2-D, with and without a bias, and an addend of the output's shape
    /// (the product's kernel adds it) or one that broadcasts (the add runs on its own): the
    /// gradients of x, W, the bias and the addend.
    #[test]
    fn matmul_add(
        (x, w, bias, addend, with_bias) in (1usize..=4, 1usize..=4, 1usize..=4, 1usize..=3, 0u8..3, any::<bool>(), any::<bool>())
            .prop_flat_map(|(m, k, n, b, form, broadcast, with_bias)| {
                let lead = match form {
                    0 => vec![m],
                    1 => vec![b, m],
                    _ => vec![b, 2, m],
                };
                let mut sx = lead.clone();
                sx.push(k);
                let mut sy = if broadcast { vec![1] } else { lead };
                sy.push(n);
                (
                    input_of(sx, V::Smooth),
                    input_of(vec![k, n], V::Smooth),
                    input_of(vec![n], V::Smooth),
                    input_of(sy, V::Smooth),
                    Just(with_bias),
                )
            })
    ) {
        if with_bias {
            let f = |t: &[Tensor]| t[0].matmul_add(&t[1], Some(&t[2]), &t[3]);
            gc("matmul_add", f, &[x.t(), w.t(), bias.t(), addend.t()])?;
        } else {
            gc("matmul_add", |t| t[0].matmul_add(&t[1], None, &t[2]), &[x.t(), w.t(), addend.t()])?;
        }
    }
}

// ---- layout ops ---------------------------------------------------------------------------

/// Candidate target shapes for a reshape of `s` (all with the same element count).
fn reshape_targets(s: &[usize]) -> Vec<Vec<usize>> {
    let n: usize = s.iter().product();
    let mut rev = s.to_vec();
    rev.reverse();
    let mut lead1 = vec![1];
    lead1.extend_from_slice(s);
    vec![vec![n], vec![n, 1], rev, lead1, vec![1, n, 1]]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn transpose(x in input(V::Smooth), i in any::<Index>(), j in any::<Index>(), neg in any::<bool>()) {
        let r = x.rank() as isize;
        let (a, b) = (i.index(x.rank()) as isize, j.index(x.rank()) as isize);
        let a = if neg { a - r } else { a };
        gc("transpose", |t| t[0].transpose(a, b), &[x.t()])?;
    }

    #[test]
    fn permute(
        (x, dims) in input(V::Smooth).prop_flat_map(|x| {
            let r = x.rank();
            (Just(x), Just((0..r).collect::<Vec<usize>>()).prop_shuffle())
        })
    ) {
        gc("permute", |t| t[0].permute(&dims), &[x.t()])?;
    }

    #[test]
    fn reshape(x in input(V::Smooth), pick in any::<Index>()) {
        let targets = reshape_targets(&x.shape);
        let target = pick.get(&targets).clone();
        // A reshape followed by an elementwise op, so the gradient has to be reshaped back.
        let w: Vec<f64> = (0..x.vals.len()).map(|i| 0.5 + i as f64 * 0.1).collect();
        let w = common::f64t(&w, &target);
        gc("reshape", |t| t[0].reshape(&target)?.mul(&w), &[x.t()])?;
    }

    #[test]
    fn expand((src, target) in bcast_shapes().prop_map(|(a, b)| {
        // The shape both broadcast to, and whichever side is smaller as the source.
        let r = a.len().max(b.len());
        let pad = |s: &Vec<usize>| {
            let mut p = vec![1; r - s.len()];
            p.extend(s);
            p
        };
        let (pa, pb) = (pad(&a), pad(&b));
        let out: Vec<usize> = pa.iter().zip(&pb).map(|(&x, &y)| x.max(y)).collect();
        (a, out)
    }).prop_flat_map(|(s, out)| (input_of(s, V::Smooth), Just(out)))) {
        gc("expand", |t| t[0].expand(&target), &[src.t()])?;
    }

    #[test]
    fn slice((x, axis) in with_axis(V::Smooth), i in any::<Index>(), j in any::<Index>()) {
        let len = x.shape[norm_axis(axis, x.rank())];
        let (p, q) = (i.index(len), j.index(len));
        let (start, end) = (p.min(q), p.max(q) + 1);
        gc("slice", |t| t[0].slice(axis, start, end), &[x.t()])?;
    }

    #[test]
    fn concat(
        (base, axis, lens) in (shape(), any::<Index>(), vec(1usize..=3, 2..=3))
    ) {
        let a = axis.index(base.len());
        let shapes: Vec<Vec<usize>> = lens
            .iter()
            .map(|&l| {
                let mut s = base.clone();
                s[a] = l;
                s
            })
            .collect();
        let inputs: Vec<Tensor> = shapes
            .iter()
            .enumerate()
            .map(|(k, s)| {
                let n: usize = s.iter().product();
                let v: Vec<f64> = (0..n).map(|i| ((i * 7 + k * 3) % 11) as f64 * 0.3 - 1.4).collect();
                common::f64t(&v, s)
            })
            .collect();
        // Weight the output so each piece's gradient differs from a plain copy of ones.
        gc("concat", |t| Tensor::concat(t, a as isize)?.tanh(), &inputs)?;
    }
}

// ---- reductions ---------------------------------------------------------------------------

/// An input, a subset of its axes (possibly empty; some spelled negatively), and keepdim.
fn with_axes() -> impl Strategy<Value = (In, Vec<isize>, bool)> {
    (
        input(V::Smooth),
        vec(any::<bool>(), 3),
        vec(any::<bool>(), 3),
        any::<bool>(),
    )
        .prop_map(|(x, pick, neg, keep)| {
            let r = x.rank() as isize;
            let axes = (0..x.rank())
                .filter(|&d| pick[d])
                .map(|d| if neg[d] { d as isize - r } else { d as isize })
                .collect();
            (x, axes, keep)
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn sum((x, axes, keep) in with_axes()) {
        gc("sum", |t| t[0].sum(&axes, keep), &[x.t()])?;
    }

    // `sum_as` into the tensor's own dtype (its f16 → f32 path exists only on the GPU, checked
    // bit for bit in half_precision_products.rs)
    #[test]
    fn sum_as((x, axes, keep) in with_axes()) {
        gc("sum_as", |t| t[0].sum_as(&axes, keep, moegrad::DType::F64), &[x.t()])?;
    }

    #[test]
    fn sum_all(x in input(V::Smooth)) {
        gc("sum_all", |t| t[0].sum_all(), &[x.t()])?;
    }

    #[test]
    fn mean((x, axes, keep) in with_axes()) {
        gc("mean", |t| t[0].mean(&axes, keep), &[x.t()])?;
    }

    #[test]
    fn mean_all(x in input(V::Smooth)) {
        gc("mean_all", |t| t[0].mean_all(), &[x.t()])?;
    }

    #[test]
    fn max((x, axis) in with_axis(V::Distinct), keep in any::<bool>()) {
        gc("max", |t| t[0].max(axis, keep), &[x.t()])?;
    }

    #[test]
    fn min((x, axis) in with_axis(V::Distinct), keep in any::<bool>()) {
        gc("min", |t| t[0].min(axis, keep), &[x.t()])?;
    }

    #[test]
    fn cumsum((x, axis) in with_axis(V::Smooth)) {
        gc("cumsum", |t| t[0].cumsum(axis), &[x.t()])?;
    }

    #[test]
    fn softmax((x, axis) in with_axis(V::Smooth)) {
        gc("softmax", |t| t[0].softmax(axis), &[x.t()])?;
    }

    #[test]
    fn log_softmax((x, axis) in with_axis(V::Smooth)) {
        gc("log_softmax", |t| t[0].log_softmax(axis), &[x.t()])?;
    }

    #[test]
    fn logsumexp((x, axis) in with_axis(V::Smooth), keep in any::<bool>()) {
        gc("logsumexp", |t| t[0].logsumexp(axis, keep), &[x.t()])?;
    }

    #[test]
    fn softmax_fast_mode((x, axis) in with_axis(V::Smooth), seed in 0u64..1000) {
        gc_with("softmax (fast)", |t| t[0].softmax(axis), &[x.t()], &fast(seed))?;
    }
}

/// Softmax-family ops must stay correct with large logits (the max is subtracted first).
#[test]
fn softmax_family_with_large_logits() {
    let x = common::f64t(&[500.0, 501.5, 499.0, -700.0, -698.0, -703.0], &[2, 3]);
    gradcheck(|t| t[0].softmax(-1), std::slice::from_ref(&x), &opts()).unwrap();
    gradcheck(|t| t[0].log_softmax(1), std::slice::from_ref(&x), &opts()).unwrap();
    gradcheck(|t| t[0].logsumexp(1, false), &[x], &opts()).unwrap();
}

// ---- losses -------------------------------------------------------------------------------

fn ce_inputs() -> impl Strategy<Value = (In, Vec<i32>)> {
    (1usize..=4, 1usize..=5)
        .prop_flat_map(|(n, c)| (input_of(vec![n, c], V::Smooth), vec(0..c as i32, n)))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn cross_entropy((x, targets) in ce_inputs()) {
        let tg = i32t(&targets, &[targets.len()]);
        gc("cross_entropy", |t| t[0].cross_entropy(&tg), &[x.t()])?;
    }

    #[test]
    fn cross_entropy_fast_mode((x, targets) in ce_inputs(), seed in 0u64..1000) {
        let tg = i32t(&targets, &[targets.len()]);
        gc_with("cross_entropy (fast)", |t| t[0].cross_entropy(&tg), &[x.t()], &fast(seed))?;
    }

    #[test]
    fn mse((p, y) in same_shape_pair(V::Smooth, V::Smooth)) {
        gc("mse", |t| t[0].mse(&t[1]), &[p.t(), y.t()])?;
    }

    #[test]
    fn bce_with_logits((x, y) in shape().prop_flat_map(|s| {
        let n: usize = s.iter().product();
        (input_of(s.clone(), V::Smooth), Just(s), vec(0.0f64..=1.0, n))
    }).prop_map(|(x, s, v)| (x, In { shape: s, vals: v }))) {
        // Differentiable in both the logits and the target probabilities.
        gc("bce_with_logits", |t| t[0].bce_with_logits(&t[1]), &[x.t(), y.t()])?;
    }
}

// ---- indexing -----------------------------------------------------------------------------

/// A tensor, an axis, and an index tensor of the tensor's shape with `m` entries on that axis
/// (values in range, repeats allowed).
fn gather_inputs() -> impl Strategy<Value = (In, usize, Vec<usize>, Vec<i32>)> {
    (input(V::Smooth), any::<Index>(), 1usize..=4).prop_flat_map(|(x, ai, m)| {
        let a = ai.index(x.rank());
        let len = x.shape[a] as i32;
        let mut ishape = x.shape.clone();
        ishape[a] = m;
        let n: usize = ishape.iter().product();
        (Just(x), Just(a), Just(ishape), vec(0..len, n))
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn gather((x, a, ishape, idx) in gather_inputs()) {
        let it = i32t(&idx, &ishape);
        gc("gather", |t| t[0].gather(a as isize, &it), &[x.t()])?;
    }

    #[test]
    fn gather_fast_mode((x, a, ishape, idx) in gather_inputs(), seed in 0u64..1000) {
        let it = i32t(&idx, &ishape);
        gc_with("gather (fast)", |t| t[0].gather(a as isize, &it), &[x.t()], &fast(seed))?;
    }

    #[test]
    fn index_select(
        (x, a, idx) in (input(V::Smooth), any::<Index>()).prop_flat_map(|(x, ai)| {
            let a = ai.index(x.rank());
            let len = x.shape[a] as i32;
            (Just(x), Just(a), vec(0..len, 1..=5))
        }),
        neg in any::<bool>()
    ) {
        let it = i32t(&idx, &[idx.len()]);
        let axis = if neg { a as isize - x.rank() as isize } else { a as isize };
        gc("index_select", |t| t[0].index_select(axis, &it), &[x.t()])?;
    }

    #[test]
    fn scatter_add(
        (x, a, ishape, idx) in gather_inputs(),
        seed in 0u64..1000
    ) {
        let it = i32t(&idx, &ishape);
        let n: usize = ishape.iter().product();
        let src: Vec<f64> = (0..n).map(|i| ((i as u64 * 31 + seed) % 17) as f64 * 0.2 - 1.6).collect();
        let src = common::f64t(&src, &ishape);
        // Differentiable in both the destination and the source.
        gc("scatter_add", |t| t[0].scatter_add(a as isize, &it, &t[1]), &[x.t(), src])?;
    }
}

/// A tensor, an axis, a destination length on that axis (the tensor's extent plus up to 3, so
/// some destination rows may get nothing) and one destination index per entry along the axis
/// (repeats allowed).
fn index_scatter_inputs() -> impl Strategy<Value = (In, usize, usize, Vec<i32>)> {
    (input(V::Smooth), any::<Index>(), 0usize..=3).prop_flat_map(|(x, ai, extra)| {
        let a = ai.index(x.rank());
        let len = x.shape[a] + extra;
        let m = x.shape[a];
        (Just(x), Just(a), Just(len), vec(0..len as i32, m))
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// The MoE combine: squared, so each destination's gradient is twice its accumulated sum
    /// and a wrong accumulation of repeated indices shows.
    #[test]
    fn index_scatter((x, a, len, idx) in index_scatter_inputs()) {
        let it = i32t(&idx, &[idx.len()]);
        gc(
            "index_scatter",
            |t| {
                let y = t[0].index_scatter(a as isize, &it, len)?;
                y.mul(&y)
            },
            &[x.t()],
        )?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// The weighted MoE combine `y[t] = Σ_{r : idx[r] = t} w[r]·rows[r]`, in the rows and the
    /// weights, squared so that repeated destinations' sums matter; rows wider and narrower
    /// than the vector lanes.
    #[test]
    fn weighted_index_scatter(
        (a, d, len) in (1usize..=9, 1usize..=20, 1usize..=6),
        seed in 0u64..1000
    ) {
        let val = |i: usize, salt: u64| ((i as u64 * 37 + seed * 11 + salt) % 23) as f64 * 0.1 - 1.1;
        let rows = common::f64t(&(0..a * d).map(|i| val(i, 1)).collect::<Vec<_>>(), &[a, d]);
        let w = common::f64t(&(0..a).map(|i| val(i, 5)).collect::<Vec<_>>(), &[a]);
        let idx: Vec<i32> = (0..a).map(|i| ((i as u64 * 7 + seed) % len as u64) as i32).collect();
        let it = i32t(&idx, &[a]);
        gc(
            "weighted_index_scatter",
            |t| {
                let y = t[0].weighted_index_scatter(&t[1], &it, len)?;
                y.mul(&y)
            },
            &[rows, w],
        )?;
    }

    /// The combine told each output's rows (weights per row, and per slot), and the gather whose
    /// backward sums each row's copies through the same slots (`k` rows per output in a
    /// shuffled order), in f64.
    #[test]
    fn combine_and_gather_by_slots(
        (len, k, d) in (1usize..=6, 1usize..=4, 1usize..=7),
        seed in 0u64..1000
    ) {
        let a = len * k;
        let val = |i: usize, salt: u64| ((i as u64 * 37 + seed * 11 + salt) % 23) as f64 * 0.1 - 1.1;
        // slots: a rotation of 0..a by the seed; idx[slots[t·k + j]] = t
        let slots: Vec<i32> = (0..a).map(|i| ((i as u64 + seed) % a as u64) as i32).collect();
        let mut idx = vec![0i32; a];
        for (i, &r) in slots.iter().enumerate() {
            idx[r as usize] = (i / k) as i32;
        }
        let (it, st) = (i32t(&idx, &[a]), i32t(&slots, &[a]));
        let rows = common::f64t(&(0..a * d).map(|i| val(i, 1)).collect::<Vec<_>>(), &[a, d]);
        let w = common::f64t(&(0..a).map(|i| val(i, 5)).collect::<Vec<_>>(), &[a]);
        gc(
            "weighted_index_scatter_by_slots",
            |t| {
                let y = t[0].weighted_index_scatter_by_slots(&t[1], &it, len, &st)?;
                y.mul(&y)
            },
            &[rows, w],
        )?;
        // the same combine with the weights per slot, through the slots' inverse
        let mut order = vec![0i32; a];
        for (i, &r) in slots.iter().enumerate() {
            order[r as usize] = i as i32;
        }
        let ot = i32t(&order, &[a]);
        let w_slots = common::f64t(&(0..a).map(|i| val(i, 7)).collect::<Vec<_>>(), &[a]);
        let rows2 = common::f64t(&(0..a * d).map(|i| val(i, 9)).collect::<Vec<_>>(), &[a, d]);
        gc(
            "weighted_index_scatter_per_slot",
            |t| {
                let y = t[0].weighted_index_scatter_per_slot(&t[1], &it, len, &st, &ot)?;
                y.mul(&y)
            },
            &[rows2.clone(), w_slots.clone()],
        )?;
        // with a residual added by the combine (an MoE block's output)
        let h = common::f64t(&(0..len * d).map(|i| val(i, 11)).collect::<Vec<_>>(), &[len, d]);
        gc(
            "weighted_index_scatter_per_slot_add",
            |t| {
                let y = t[0].weighted_index_scatter_per_slot_add(&t[1], &it, len, &st, &ot, &t[2])?;
                y.mul(&y)
            },
            &[rows2, w_slots, h],
        )?;
        let x = common::f64t(&(0..len * d).map(|i| val(i, 3)).collect::<Vec<_>>(), &[len, d]);
        gc(
            "index_select_by_slots",
            |t| {
                let y = t[0].index_select_by_slots(&it, &st)?;
                y.mul(&y)
            },
            &[x],
        )?;
    }
}

/// The MoE combine with repeated destinations (row 2 gets three rows) and destinations nobody
/// writes (rows 1, 3 and 5): those stay exactly zero, and the gradient is checked through a
/// square so that the sums matter.
#[test]
fn index_scatter_with_repeated_and_unwritten_destinations() {
    let rows = common::f64t(
        &[
            0.3, -1.1, 0.7, 1.9, -0.4, 0.2, 0.8, 0.5, -1.6, 1.2, 0.9, -0.7, -0.2, 1.4, 0.6,
        ],
        &[5, 3],
    );
    let idx = i32t(&[2, 0, 2, 2, 4], &[5]);
    let y = rows
        .index_scatter(0, &idx, 6)
        .unwrap()
        .to_vec_f64()
        .unwrap();
    for unwritten in [1, 3, 5] {
        assert_eq!(
            &y[unwritten * 3..unwritten * 3 + 3],
            &[0.0; 3],
            "row {unwritten}"
        );
    }
    let r = rows.to_vec_f64().unwrap();
    for j in 0..3 {
        let sum = r[j] + r[6 + j] + r[9 + j];
        assert!((y[6 + j] - sum).abs() < 1e-15, "row 2, column {j}");
    }
    let f = |t: &[Tensor]| {
        let y = t[0].index_scatter(0, &idx, 6)?;
        y.mul(&y)?.mul(&common::f64t(&[1.5; 18], &[6, 3]))
    };
    gradcheck(f, std::slice::from_ref(&rows), &opts()).unwrap();
    gradcheck(f, &[rows], &fast(5)).unwrap();
}

/// im2col over several window geometries (kernel, stride, padding, including windows that
/// hang over the padding and strides that skip pixels). Checked two ways: gradcheck through a
/// square (so overlapping windows must accumulate), and the gradient of the plain sum, which
/// must count for each pixel the windows that cover it.
#[test]
fn unfold_windows_over_several_geometries() {
    let (b, c, h, w) = (2, 2, 5, 4);
    let vals: Vec<f64> = (0..b * c * h * w)
        .map(|i| ((i * 37 % 23) as f64 - 11.0) * 0.13)
        .collect();
    let x = common::f64t(&vals, &[b, c, h, w]);
    for (kh, kw, stride, pad) in [
        (1, 1, 1, 0),
        (2, 2, 2, 0),
        (3, 3, 1, 1),
        (3, 2, 2, 1),
        (2, 3, 1, 2),
        (4, 4, 3, 0),
        (5, 4, 1, 0),
    ] {
        let what = format!("unfold_windows kernel {kh}×{kw} stride {stride} padding {pad}");
        let f = |t: &[Tensor]| {
            let u = t[0].unfold_windows(kh, kw, stride, pad)?;
            u.mul(&u)
        };
        gradcheck(f, std::slice::from_ref(&x), &opts()).unwrap_or_else(|e| panic!("{what}: {e}"));
        // The gradient of Σ unfold(x) counts the windows covering each pixel.
        let xg = x.detach().with_grad().unwrap();
        xg.unfold_windows(kh, kw, stride, pad)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let got = xg.grad().unwrap().to_vec_f64().unwrap();
        let (oh, ow) = (
            (h + 2 * pad - kh) / stride + 1,
            (w + 2 * pad - kw) / stride + 1,
        );
        let covering = |r: usize, s: usize| {
            let mut n = 0.0;
            for y in 0..oh {
                for z in 0..ow {
                    let (r0, s0) = (y * stride, z * stride); // window corner, padded coordinates
                    let (rp, sp) = (r + pad, s + pad);
                    if (r0..r0 + kh).contains(&rp) && (s0..s0 + kw).contains(&sp) {
                        n += 1.0;
                    }
                }
            }
            n
        };
        for (i, g) in got.iter().enumerate() {
            let (r, s) = ((i / w) % h, i % w);
            assert_eq!(
                *g,
                covering(r, s),
                "{what}: pixel ({r}, {s}) of image-channel {}",
                i / (h * w)
            );
        }
    }
}

// ---- where / masked_fill / topk / casts ---------------------------------------------------

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn where_cond(
        ((a, b), bits) in pair(V::Smooth, V::Smooth).prop_flat_map(|(a, b)| {
            let n = a.vals.len();
            (Just((a, b)), vec(any::<bool>(), n))
        })
    ) {
        // The condition has `a`'s shape; all three broadcast together.
        let cv: Vec<f64> = bits.iter().map(|&c| if c { 1.0 } else { 0.0 }).collect();
        let cond = common::f64t(&cv, &a.shape);
        gc("where_cond", |t| Tensor::where_cond(&cond, &t[0], &t[1]), &[a.t(), b.t()])?;
    }

    #[test]
    fn masked_fill(
        (x, bits) in input(V::Smooth).prop_flat_map(|x| {
            let n = x.vals.len();
            (Just(x), vec(any::<bool>(), n))
        }),
        value in -3.0f64..3.0
    ) {
        let mv: Vec<f64> = bits.iter().map(|&c| if c { 1.0 } else { 0.0 }).collect();
        let mask = common::f64t(&mv, &x.shape);
        gc("masked_fill", |t| t[0].masked_fill(&mask, value), &[x.t()])?;
    }

    #[test]
    fn topk_values(x in input(V::Distinct), ki in any::<Index>()) {
        let len = *x.shape.last().unwrap();
        let k = ki.index(len) + 1;
        gc("topk", |t| Ok(t[0].topk(k)?.0), &[x.t()])?;
    }

    /// f64 → f32 → f64: the gradient is cast back on the way down. The f32 rounding makes the
    /// default step of 1e-6 meaningless, so this one uses a step of 1e-3 and looser tolerances.
    #[test]
    fn to_dtype_round_trip(x in input(V::Smooth)) {
        let o = GradcheckOptions { eps: 1e-3, atol: 1e-3, rtol: 1e-3, ..GradcheckOptions::default() };
        gc_with(
            "to_dtype",
            |t| {
                let y = t[0].to_dtype(DType::F32)?;
                y.mul(&y)?.to_dtype(DType::F64)
            },
            &[x.t()],
            &o,
        )?;
    }
}

/// A comparison mask multiplying the input: no gradient through the mask, `mask·g` to `x`.
#[test]
fn comparison_masks_carry_no_gradient_but_gate_it() {
    let x = common::f64t(&[-1.3, 0.4, 2.2, -0.6, 1.1, 0.9], &[2, 3]);
    let c = common::f64t(&[0.5], &[1]);
    type Cmp = fn(&Tensor, &Tensor) -> Result<Tensor>;
    let cmps: [(&str, Cmp); 6] = [
        ("gt", Tensor::gt),
        ("ge", Tensor::ge),
        ("lt", Tensor::lt),
        ("le", Tensor::le),
        ("eq", Tensor::eq),
        ("ne", Tensor::ne),
    ];
    for (name, cmp) in cmps {
        gradcheck(
            |t| t[0].mul(&cmp(&t[0], &c)?),
            std::slice::from_ref(&x),
            &opts(),
        )
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

// ---- accumulation through reused tensors ------------------------------------------------

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn reused_tensor_x_times_x_plus_x(x in input(V::Smooth)) {
        gc("x*x + x", |t| t[0].mul(&t[0])?.add(&t[0]), &[x.t()])?;
    }

    #[test]
    fn reused_tensor_many_paths(x in input(V::Smooth)) {
        // x reaches the output through five paths, one of them broadcast and one reduced.
        gc(
            "many paths",
            |t| {
                let x = &t[0];
                let s = x.sum_all()?;
                let e = x.exp()?.mul(x)?;
                e.add(&s)?.sub(&x.tanh()?)?.mul(&x.sigmoid()?)
            },
            &[x.t()],
        )?;
    }

    #[test]
    fn reused_intermediate_diamond((a, b) in pair(V::Smooth, V::Smooth)) {
        // h is used twice downstream; both operands feed h.
        gc(
            "diamond",
            |t| {
                let h = t[0].mul(&t[1])?.tanh()?;
                h.mul(&h)?.add(&h.exp()?)
            },
            &[a.t(), b.t()],
        )?;
    }

    #[test]
    fn div_fast_mode((a, b) in pair(V::Smooth, V::NonZero), seed in 0u64..1000) {
        gc_with("div (fast)", |t| t[0].div(&t[1]), &[a.t(), b.t()], &fast(seed))?;
    }
}

/// One input used twice in a single op, and as two operands of a concat.
#[test]
fn same_tensor_twice_in_one_op() {
    let x = common::f64t(&[0.3, -1.1, 0.7, 1.9], &[2, 2]);
    gradcheck(|t| t[0].matmul(&t[0]), std::slice::from_ref(&x), &opts()).unwrap();
    gradcheck(
        |t| {
            let c = Tensor::concat(&[t[0].clone(), t[0].exp()?], 0)?;
            c.mul(&c)?.sum(&[0], false)
        },
        std::slice::from_ref(&x),
        &opts(),
    )
    .unwrap();
    gradcheck(
        |t| t[0].div(&t[0].add_scalar(3.0)?),
        std::slice::from_ref(&x),
        &opts(),
    )
    .unwrap();
}

// ---- gradcheck itself can fail -------------------------------------------------------------

/// `x · detach(x)` has derivative `2x`, but autograd only sees the first factor and gives `x`:
/// gradcheck must report the mismatch, naming both values.
#[test]
fn gradcheck_rejects_a_wrong_gradient() {
    let x = common::f64t(&[0.8, -1.5, 2.0], &[3]);
    let wrong = |t: &[Tensor]| t[0].mul(&t[0].detach());
    match gradcheck(wrong, std::slice::from_ref(&x), &opts()) {
        Err(Error::Gradcheck(msg)) => {
            assert!(msg.contains("analytic"), "message lacks 'analytic': {msg}");
            assert!(msg.contains("numeric"), "message lacks 'numeric': {msg}");
        }
        other => panic!("expected Err(Error::Gradcheck), got {other:?}"),
    }
    // The fast mode catches it too.
    match gradcheck(wrong, std::slice::from_ref(&x), &fast(7)) {
        Err(Error::Gradcheck(msg)) => {
            assert!(msg.contains("analytic") && msg.contains("numeric"), "{msg}");
        }
        other => panic!("fast mode: expected Err(Error::Gradcheck), got {other:?}"),
    }
    // And the correct version of the same function passes (so the failure above is real).
    gradcheck(|t| t[0].mul(&t[0]), &[x], &opts()).unwrap();
}

/// A function whose output does not depend on the input through the graph at all.
#[test]
fn gradcheck_rejects_a_missing_gradient() {
    let x = common::f64t(&[0.5, 1.5], &[2]);
    let r = gradcheck(|t| t[0].detach().exp(), &[x], &opts());
    assert!(
        matches!(r, Err(Error::Gradcheck(_))),
        "expected Err(Error::Gradcheck), got {r:?}"
    );
}

// ---- documented conventions at the kinks (where finite differences cannot decide) -----------

fn grad_after(x: &Tensor, f: impl Fn(&Tensor) -> Result<Tensor>) -> Vec<f64> {
    let x = x.detach().with_grad().unwrap();
    f(&x).unwrap().sum_all().unwrap().backward().unwrap();
    x.grad().unwrap().to_vec_f64().unwrap()
}

#[test]
fn kink_conventions() {
    // max/min share the gradient equally among tied extrema.
    let x = common::f64t(&[1.0, 3.0, 3.0, -2.0, -2.0, 0.0], &[2, 3]);
    assert_eq!(
        grad_after(&x, |t| t.max(1, false)),
        vec![0.0, 0.5, 0.5, 0.0, 0.0, 1.0]
    );
    assert_eq!(
        grad_after(&x, |t| t.min(1, false)),
        vec![1.0, 0.0, 0.0, 0.5, 0.5, 0.0]
    );
    // relu and abs pass nothing at exactly 0; clamp passes nothing at its bounds.
    let z = common::f64t(&[-1.0, 0.0, 2.0], &[3]);
    assert_eq!(grad_after(&z, |t| t.relu()), vec![0.0, 0.0, 1.0]);
    assert_eq!(grad_after(&z, |t| t.abs()), vec![-1.0, 0.0, 1.0]);
    assert_eq!(grad_after(&z, |t| t.clamp(0.0, 2.0)), vec![0.0, 0.0, 0.0]);
    // maximum/minimum send a tie's gradient to the first operand.
    let a = common::f64t(&[1.0, 2.0], &[2]).with_grad().unwrap();
    let b = common::f64t(&[1.0, 3.0], &[2]).with_grad().unwrap();
    a.maximum(&b)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(a.grad().unwrap().to_vec_f64().unwrap(), vec![1.0, 0.0]);
    assert_eq!(b.grad().unwrap().to_vec_f64().unwrap(), vec![0.0, 1.0]);
    // topk: ties keep index order, and only the chosen entries get gradient.
    let t = common::f64t(&[0.5, 0.9, 0.5, 0.1], &[1, 4]);
    let (_, idx) = t.topk(2).unwrap();
    assert_eq!(idx.to_vec_i32().unwrap(), vec![1, 0]);
    assert_eq!(
        grad_after(&t, |t| Ok(t.topk(2)?.0)),
        vec![1.0, 1.0, 0.0, 0.0]
    );
}
