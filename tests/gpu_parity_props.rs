//! GPU parity as property tests over random shapes, for every kernel that is not a fused op
//! (elementwise, reductions, the softmax family, layout and indexing, matmul, sorting, casts, fill
//! and random numbers; the fused ops and optimizers have tests of their own).
//!
//! Two parts:
//!
//! - **Properties** (module `props`): proptest draws ranks 1–4, dims 1–70 with workgroup edges
//!   (1, 255, 256, 257; 63, 64, 65 for matmul tiles) and long axes where a launcher switches
//!   kernels (reductions past 128, scatters past 4096 source rows, sort rows past 1024), from a
//!   fixed seed and a fixed, small number of cases, so runs are reproducible and CI's time
//!   bounded. Each case runs [`parity::parity`]: the op on f64 CPU copies and on f32 device copies
//!   of the same inputs, forward and backward with one random upstream gradient. Every property
//!   also runs with the CPU's f32 backend in the GPU's place
//!   (`properties_hold_with_the_cpu_f32_backend`), so the cases run on machines without an adapter.
//! - **Folded grids** (the `folded_*` and `split_*` tests): every kernel whose launch can exceed
//!   65,535 workgroups in one dimension runs once on the smallest shape that does (see
//!   `common/fold.rs`; each case asserts that it crosses the limit, from the launcher's own
//!   formula), through the `Backend` trait, against the CPU backend in f32. Before each launch a
//!   buffer of the output's size is filled with NaN and returned to the pool, so an output element
//!   a folded workgroup failed to write reads as NaN instead of a lucky zero. Two fused kernels
//!   are here too, because their cheapest folding shape goes through the `Backend` trait: the
//!   grouped matmul and its weight gradient (past 65,535 column tiles) and `attention_delta`
//!   (through `attention_backward`, with random `o` and `lse` instead of a forward pass). Left
//!   out: matmul's z split (`gpu_matmul::matmul_grid_split`) and the grouped matmul's row split
//!   (4.2 million rows, minutes on lavapipe; it shares the base tile with the column split);
//!   `reduce_rows` and `cumsum_rows` cannot fold (their launcher takes them only for fewer than
//!   4096 lines).
//!
//! Without a GPU adapter the GPU tests print "skipping" and pass, unless `MOEGRAD_REQUIRE_GPU=1`.

mod common;
#[path = "common/fold.rs"]
mod fold;
#[path = "common/parity.rs"]
mod parity;
#[path = "common/property.rs"]
mod property;

use moegrad::backend::cpu::CpuBackend;
use moegrad::backend::gpu::{GpuBackend, GpuBuffer, MatmulKernel};
use moegrad::backend::{
    AttentionDims, AttentionGradOperands, AxisView, Backend, BinaryOp, BufferOps, ElementwiseOps,
    ExpertBankDims, GroupedMatmulDims, HostData, LayoutOps, MatLayout, MatmulDims, MatmulOps,
    NnOps, ReduceOp, ReduceOps, ScatterDims, Strided, UnaryOp,
};
use moegrad::{DType, Device, Result, Tensor};
use parity::{Gen, LOOSE, TIGHT, Tol, V, parity};
use property::check_property;
use proptest::prelude::*;
use std::sync::{Mutex, MutexGuard};

// ---- input strategies -------------------------------------------------------------------------

/// Elements a random shape may hold (lavapipe runs every case).
const CAP: usize = 12_000;

/// One dim: mostly 1–70, sometimes 1 or a workgroup edge (255, 256, 257).
fn dim() -> impl Strategy<Value = usize> {
    prop_oneof![
        6 => 1usize..=70,
        1 => Just(1usize),
        1 => prop::sample::select(vec![255usize, 256, 257]),
    ]
}

/// `s` with its largest dim halved until it holds at most `cap` elements.
fn fit(mut s: Vec<usize>, cap: usize) -> Vec<usize> {
    while s.iter().product::<usize>() > cap {
        let i = (0..s.len())
            .max_by_key(|&i| s[i])
            .expect("a non-empty shape");
        s[i] = (s[i] / 2).max(1);
    }
    s
}

/// A shape of rank 1–4 and at most [`CAP`] elements, and a seed for the values.
fn shape_and_seed() -> impl Strategy<Value = (Vec<usize>, u64)> {
    (
        prop::collection::vec(dim(), 1..=4).prop_map(|s| fit(s, CAP)),
        any::<u64>(),
    )
}

fn norm(axis: isize, rank: usize) -> usize {
    if axis < 0 {
        (axis + rank as isize) as usize
    } else {
        axis as usize
    }
}

/// `s` with axis `a` set to `len` and every other dim cut to at most `others`.
fn with_long_axis(s: &[usize], a: usize, len: usize, others: usize) -> Vec<usize> {
    (0..s.len())
        .map(|d| if d == a { len } else { s[d].min(others) })
        .collect()
}

/// Sums of up to `terms` values of size ~1: f32 rounding grows about linearly with the terms.
fn sum_tol(terms: usize) -> Tol {
    Tol {
        atol: LOOSE.atol + 1e-6 * terms as f64,
        rtol: LOOSE.rtol,
    }
}

/// Values from {−1, −0.5, 0, 0.5, 1}: ties for comparisons and for sort stability.
fn few_values(g: &mut Gen, s: &[usize]) -> Tensor {
    let n: usize = s.iter().product();
    let v: Vec<f64> = (0..n).map(|_| g.dim(0, 4) as f64 * 0.5 - 1.0).collect();
    common::f64t(&v, s)
}

/// A 0/1 mask of shape `s`.
fn mask(g: &mut Gen, s: &[usize]) -> Tensor {
    let n: usize = s.iter().product();
    let v: Vec<f64> = (0..n).map(|_| if g.flip() { 1.0 } else { 0.0 }).collect();
    common::f64t(&v, s)
}

// ---- the properties ---------------------------------------------------------------------------

mod props {
    use super::*;

    type Un = fn(&Tensor) -> Result<Tensor>;
    type Bin = fn(&Tensor, &Tensor) -> Result<Tensor>;

    /// Every unary op (forward: `unary`; backward: `binary` and the `Step`/`Sign` unary codes,
    /// GELU's through `GeluBackward`).
    pub fn unary_ops(dev: Device) {
        let ops: [(&str, V, Un); 20] = [
            ("neg", V::Smooth, Tensor::neg),
            ("exp", V::Smooth, Tensor::exp),
            ("log", V::Positive, Tensor::log),
            ("sqrt", V::Positive, Tensor::sqrt),
            ("abs", V::Distinct, Tensor::abs),
            ("recip", V::NonZero, Tensor::recip),
            ("relu", V::Distinct, Tensor::relu),
            ("gelu", V::Smooth, Tensor::gelu),
            ("silu", V::Smooth, Tensor::silu),
            ("tanh", V::Smooth, Tensor::tanh),
            ("sigmoid", V::Smooth, Tensor::sigmoid),
            ("softplus", V::Smooth, Tensor::softplus),
            ("softsign", V::Smooth, Tensor::softsign),
            ("powf(-1.5)", V::Positive, |x| x.powf(-1.5)),
            ("powf(0.5)", V::Positive, |x| x.powf(0.5)),
            ("powf(3)", V::Positive, |x| x.powf(3.0)),
            // Distinct values are multiples of 0.05 plus 0.025: these bounds never tie with them.
            ("clamp", V::Distinct, |x| x.clamp(-0.2, 0.35)),
            ("add_scalar", V::Smooth, |x| x.add_scalar(-1.25)),
            ("mul_scalar", V::Smooth, |x| x.mul_scalar(2.5)),
            ("to_dtype f32", V::Smooth, |x| {
                x.to_dtype(DType::F32)?.mul_scalar(1.5)
            }),
        ];
        check_property("unary_ops", 16, shape_and_seed(), |(s, seed)| {
            let mut g = Gen::from_seed(seed);
            for (name, kind, op) in ops {
                let x = g.tensor(&s, kind);
                parity(&format!("{name} {s:?}"), dev, TIGHT, |t| op(&t[0]), &[x]);
            }
        });
    }

    /// Arithmetic, extrema, comparisons, `where_cond` and `masked_fill` on operands that
    /// broadcast (dims of 1 on either side, leading dims missing on one side).
    pub fn binary_ops_broadcast(dev: Device) {
        check_property("binary_ops_broadcast", 16, shape_and_seed(), |(s, seed)| {
            let mut g = Gen::from_seed(seed);
            let (sa, sb) = g.broadcast_pair(&s);
            let what = format!("{sa:?} with {sb:?}");
            let arithmetic: [(&str, V, Bin); 4] = [
                ("add", V::Smooth, Tensor::add),
                ("sub", V::Smooth, Tensor::sub),
                ("mul", V::Smooth, Tensor::mul),
                ("div", V::NonZero, Tensor::div),
            ];
            for (name, kind_b, op) in arithmetic {
                let (a, b) = (g.tensor(&sa, V::Smooth), g.tensor(&sb, kind_b));
                let name = format!("{name} {what}");
                parity(&name, dev, TIGHT, |t| op(&t[0], &t[1]), &[a, b]);
            }
            // Extrema on one ladder split between the operands: no ties, one-sided gradients.
            let (na, nb): (usize, usize) = (sa.iter().product(), sb.iter().product());
            let ladder = g.vals(na + nb, V::Distinct);
            let a = common::f64t(&ladder[..na], &sa);
            let b = common::f64t(&ladder[na..], &sb);
            let extrema: [(&str, Bin); 2] =
                [("maximum", Tensor::maximum), ("minimum", Tensor::minimum)];
            for (name, op) in extrema {
                let inputs = [a.clone(), b.clone()];
                let name = format!("{name} {what}");
                parity(&name, dev, TIGHT, |t| op(&t[0], &t[1]), &inputs);
            }
            for (name, op) in parity::COMPARISONS {
                let (a, b) = (few_values(&mut g, &sa), few_values(&mut g, &sb));
                let name = format!("{name} {what}");
                parity(&name, dev, TIGHT, |t| op(&t[0], &t[1]), &[a, b]);
            }
            // where: the condition broadcasts too (a third shape from the same output shape).
            let (sc, _) = g.broadcast_pair(&s);
            let cond = mask(&mut g, &sc);
            let (a, b) = (g.tensor(&sa, V::Smooth), g.tensor(&sb, V::Smooth));
            parity(
                &format!("where_cond {sc:?}, {what}"),
                dev,
                TIGHT,
                |t| Tensor::where_cond(&t[0], &t[1], &t[2]),
                &[cond, a, b],
            );
            let (m, x) = (mask(&mut g, &sb), g.tensor(&s, V::Smooth));
            parity(
                &format!("masked_fill {sb:?} into {s:?}"),
                dev,
                TIGHT,
                |t| t[1].masked_fill(&t[0], -7.5),
                &[m, x],
            );
        });
    }

    /// Reductions (sum and mean over random axis sets, max, min, argmax, cumsum along one axis,
    /// sum_all, mean_all): once on the drawn shape (the serial kernels) and once with the axis
    /// 129–700 long and few lines (the workgroup-per-line kernels).
    pub fn reductions(dev: Device) {
        check_property("reductions", 16, shape_and_seed(), |(s, seed)| {
            let mut g = Gen::from_seed(seed);
            let a = g.axis(s.len());
            let long = with_long_axis(&s, norm(a, s.len()), g.dim(129, 700), 4);
            for s in [s.clone(), long] {
                let n: usize = s.iter().product();
                let tol = sum_tol(n);
                let mut axes: Vec<isize> = Vec::new();
                for d in 0..s.len() as isize {
                    if g.flip() {
                        axes.push(if g.flip() { d - s.len() as isize } else { d });
                    }
                }
                let keep = g.flip();
                let x = g.tensor(&s, V::Smooth);
                let what = format!("{s:?} axes {axes:?} keep {keep}");
                let inputs = std::slice::from_ref(&x);
                parity(
                    &format!("sum {what}"),
                    dev,
                    tol,
                    |t| t[0].sum(&axes, keep),
                    inputs,
                );
                parity(
                    &format!("mean {what}"),
                    dev,
                    tol,
                    |t| t[0].mean(&axes, keep),
                    inputs,
                );
                parity(
                    &format!("sum_all {s:?}"),
                    dev,
                    tol,
                    |t| t[0].sum_all(),
                    inputs,
                );
                parity(
                    &format!("mean_all {s:?}"),
                    dev,
                    tol,
                    |t| t[0].mean_all(),
                    inputs,
                );
                let what = format!("{s:?} axis {a} keep {keep}");
                parity(
                    &format!("cumsum {what}"),
                    dev,
                    tol,
                    |t| t[0].cumsum(a),
                    inputs,
                );
                let x = g.tensor(&s, V::Distinct);
                let inputs = std::slice::from_ref(&x);
                parity(
                    &format!("max {what}"),
                    dev,
                    LOOSE,
                    |t| t[0].max(a, keep),
                    inputs,
                );
                parity(
                    &format!("min {what}"),
                    dev,
                    LOOSE,
                    |t| t[0].min(a, keep),
                    inputs,
                );
                let argmax = |t: &[Tensor]| t[0].argmax(a, keep);
                parity(&format!("argmax {what}"), dev, TIGHT, argmax, inputs);
                // Ties: the first maximum wins on both devices.
                let ties = [few_values(&mut g, &s)];
                parity(&format!("argmax ties {what}"), dev, TIGHT, argmax, &ties);
            }
        });
    }

    /// softmax, log_softmax and logsumexp along a random axis, short and long (as above).
    pub fn softmax_family(dev: Device) {
        check_property("softmax_family", 16, shape_and_seed(), |(s, seed)| {
            let mut g = Gen::from_seed(seed);
            let a = g.axis(s.len());
            let long = with_long_axis(&s, norm(a, s.len()), g.dim(129, 700), 4);
            for s in [s.clone(), long] {
                let keep = g.flip();
                let x = g.tensor(&s, V::Smooth);
                let what = format!("{s:?} axis {a}");
                let inputs = std::slice::from_ref(&x);
                parity(
                    &format!("softmax {what}"),
                    dev,
                    LOOSE,
                    |t| t[0].softmax(a),
                    inputs,
                );
                let log_softmax = |t: &[Tensor]| t[0].log_softmax(a);
                parity(
                    &format!("log_softmax {what}"),
                    dev,
                    LOOSE,
                    log_softmax,
                    inputs,
                );
                let logsumexp = |t: &[Tensor]| t[0].logsumexp(a, keep);
                parity(&format!("logsumexp {what}"), dev, LOOSE, logsumexp, inputs);
            }
        });
    }

    /// Strided copies: transpose, permute, slice, expand, concat, reshape, and a chain of views
    /// read by an elementwise op.
    pub fn layout_ops(dev: Device) {
        check_property("layout_ops", 16, shape_and_seed(), |(s, seed)| {
            let mut g = Gen::from_seed(seed);
            let r = s.len();
            let (a, b) = (g.axis(r), g.axis(r));
            let x = g.tensor(&s, V::Smooth);
            let inputs = std::slice::from_ref(&x);
            let transpose = |t: &[Tensor]| t[0].transpose(a, b);
            parity(
                &format!("transpose {s:?} {a} {b}"),
                dev,
                TIGHT,
                transpose,
                inputs,
            );

            let mut dims: Vec<usize> = (0..r).collect();
            for i in (1..r).rev() {
                dims.swap(i, g.dim(0, i));
            }
            let permute = |t: &[Tensor]| t[0].permute(&dims);
            parity(
                &format!("permute {s:?} {dims:?}"),
                dev,
                TIGHT,
                permute,
                inputs,
            );

            let len = s[norm(a, r)];
            let start = g.dim(0, len - 1);
            let end = g.dim(start + 1, len);
            let slice = |t: &[Tensor]| t[0].slice(a, start, end);
            let what = format!("slice {s:?} axis {a} {start}..{end}");
            parity(&what, dev, TIGHT, slice, inputs);

            // A view of a view, copied by the op that reads it.
            let chain = |t: &[Tensor]| t[0].transpose(a, b)?.slice(b, 0, 1)?.mul_scalar(1.5);
            let what = format!("transpose+slice {s:?} {a} {b}");
            parity(&what, dev, TIGHT, chain, inputs);

            let mut rev = s.clone();
            rev.reverse();
            let w = g.tensor(&rev, V::Smooth);
            let n: usize = s.iter().product();
            let reshape = |t: &[Tensor]| t[0].reshape(&rev)?.mul(&t[1])?.reshape(&[n]);
            parity(
                &format!("reshape {s:?}"),
                dev,
                TIGHT,
                reshape,
                &[x.clone(), w],
            );

            // expand: some dims of 1 grown, and a new leading dim (a reduction of the gradient).
            let from: Vec<usize> = s.iter().map(|&d| if g.flip() { 1 } else { d }).collect();
            let lead = if n <= CAP / 3 { g.dim(1, 3) } else { 1 };
            let to: Vec<usize> = std::iter::once(lead).chain(s.iter().copied()).collect();
            let small = g.tensor(&from, V::Smooth);
            let expand = |t: &[Tensor]| t[0].expand(&to);
            parity(
                &format!("expand {from:?} to {to:?}"),
                dev,
                LOOSE,
                expand,
                &[small],
            );

            let parts: Vec<Tensor> = (0..g.dim(2, 3))
                .map(|_| {
                    let mut si = s.clone();
                    si[norm(a, r)] = g.dim(1, 8);
                    g.tensor(&si, V::Smooth)
                })
                .collect();
            let concat = |t: &[Tensor]| Tensor::concat(t, a);
            parity(
                &format!("concat {s:?} axis {a}"),
                dev,
                TIGHT,
                concat,
                &parts,
            );
        });
    }

    /// gather, index_select, scatter_add and index_scatter (the adjoint of index_select, the
    /// MoE combine), each once on the drawn shape (the loop kernel) and once with more than 4096
    /// source rows along the axis (the kernel that sorts the indices first).
    pub fn indexing(dev: Device) {
        check_property("indexing", 16, shape_and_seed(), |(s, seed)| {
            let mut g = Gen::from_seed(seed);
            let a = g.axis(s.len());
            let an = norm(a, s.len());
            let len = s[an];

            let mut is = s.clone();
            is[an] = g.dim(1, 8);
            let x = g.tensor(&s, V::Smooth);
            let idx = g.ints(&is, len);
            let gather = |t: &[Tensor]| t[0].gather(a, &t[1]);
            let what = format!("gather {s:?} axis {a} index {is:?}");
            parity(&what, dev, TIGHT, gather, &[x, idx]);

            // Short: up to 70 rows picked or scattered (fewer where the other axes are wide).
            // Long: more than 4096, with the other axes cut to at most 2.
            let others = s.iter().product::<usize>() / len;
            let short_m = g.dim(1, 70).min(CAP / others).max(1);
            let long = with_long_axis(&s, an, g.dim(4097, 5000), 2);
            for (m, rows) in [(short_m, &s), (long[an], &long)] {
                let mut src_shape = rows.to_vec();
                src_shape[an] = m;
                let out_len = g.dim(1, 70);
                let src = g.tensor(&src_shape, V::Smooth);
                let idx = g.ints(&[m], out_len);
                let scatter = |t: &[Tensor]| t[0].index_scatter(a, &t[1], out_len);
                let what = format!("index_scatter {src_shape:?} axis {a} onto {out_len}");
                parity(&what, dev, TIGHT, scatter, &[src, idx]);

                let x = g.tensor(rows, V::Smooth);
                let idx = g.ints(&[m], rows[an]);
                let select = |t: &[Tensor]| t[0].index_select(a, &t[1]);
                let what = format!("index_select {m} of {rows:?} axis {a}");
                parity(&what, dev, TIGHT, select, &[x, idx]);

                let x = g.tensor(rows, V::Smooth);
                let idx = g.ints(&src_shape, rows[an]); // repeats accumulate
                let src = g.tensor(&src_shape, V::Smooth);
                let scatter_add = |t: &[Tensor]| t[0].scatter_add(a, &t[1], &t[2]);
                let what = format!("scatter_add {src_shape:?} into {rows:?} axis {a}");
                parity(&what, dev, TIGHT, scatter_add, &[x, idx, src]);
            }
        });
    }

    /// Dense, batched, broadcast-batch and transposed-operand products, dims 1–70 with the
    /// 64-wide tile's edges, under every matmul kernel the adapter offers.
    pub fn matmul(dev: Device) {
        let side = || {
            prop_oneof![
                3 => 1usize..=70,
                1 => prop::sample::select(vec![63usize, 64, 65]),
            ]
        };
        let strategy = (side(), side(), side(), 1usize..=3, 0usize..7, any::<u64>());
        let _kernel_lock = lock(&MATMUL_KERNEL);
        let gpu = (dev == Device::Gpu).then(|| GpuBackend::get().expect("the GPU opened"));
        let before = gpu.as_ref().map(GpuBackend::matmul_kernel);
        for kernel in matmul_kernels(gpu.as_ref()) {
            if let Some(be) = &gpu {
                be.set_matmul_kernel(kernel).expect("an available kernel");
            }
            let name = format!("matmul ({kernel:?} kernel)");
            check_property(
                &name,
                16,
                strategy.clone(),
                |(m, k, n, b, variant, seed)| {
                    let mut g = Gen::from_seed(seed);
                    let (sa, sb): (Vec<usize>, Vec<usize>) = match variant {
                        0 => (vec![m, k], vec![k, n]),
                        1 => (vec![b, m, k], vec![b, k, n]),
                        2 => (vec![m, k], vec![b, k, n]),
                        3 => (vec![b, m, k], vec![k, n]),
                        4 => (vec![2, b, m, k], vec![2, b, k, n]),
                        // operands stored transposed: the kernel reads them through strides
                        5 => (vec![b, k, m], vec![k, n]),
                        _ => (vec![m, k], vec![b, n, k]),
                    };
                    let (x, y) = (g.tensor(&sa, V::Smooth), g.tensor(&sb, V::Smooth));
                    let what = format!("{name} {sa:?} x {sb:?} variant {variant}");
                    parity(
                        &what,
                        dev,
                        LOOSE,
                        |t| match variant {
                            5 => t[0].transpose(-1, -2)?.matmul(&t[1]),
                            6 => t[0].matmul(&t[1].transpose(-1, -2)?),
                            _ => t[0].matmul(&t[1]),
                        },
                        &[x, y],
                    );
                },
            );
        }
        if let (Some(be), Some(k)) = (&gpu, before) {
            be.set_matmul_kernel(k).expect("the kernel it ran before");
        }
    }

    /// argsort (both directions) and topk of the last dim, rows 1–70 long (one workgroup sorts
    /// a row) and 1025–2100 long (global merge steps), on distinct values and on ties (the
    /// lowest index first).
    pub fn sorting(dev: Device) {
        check_property("sorting", 16, shape_and_seed(), |(s, seed)| {
            let mut g = Gen::from_seed(seed);
            let r = s.len();
            let long = with_long_axis(&s, r - 1, g.dim(1025, 2100), 2);
            for s in [s.clone(), long] {
                let last = s[r - 1];
                let k = g.dim(1, last);
                for (values, x) in [
                    ("distinct", g.tensor(&s, V::Distinct)),
                    ("ties", few_values(&mut g, &s)),
                ] {
                    let inputs = std::slice::from_ref(&x);
                    for desc in [false, true] {
                        let what = format!("argsort {s:?} {values} descending {desc}");
                        parity(&what, dev, TIGHT, |t| t[0].argsort(desc), inputs);
                    }
                    let what = format!("topk {k} of {s:?} {values}");
                    let top_values = |t: &[Tensor]| Ok(t[0].topk(k)?.0);
                    parity(&format!("{what} values"), dev, TIGHT, top_values, inputs);
                    let top_indices = |t: &[Tensor]| Ok(t[0].topk(k)?.1);
                    parity(&format!("{what} indices"), dev, TIGHT, top_indices, inputs);
                }
            }
        });
    }

    /// dtype casts both ways and `fill` of both dtypes.
    pub fn casts_and_fill(dev: Device) {
        check_property("casts_and_fill", 16, shape_and_seed(), |(s, seed)| {
            let mut g = Gen::from_seed(seed);
            let n: usize = s.iter().product();
            // Away from integer boundaries: k ± 0.25 or k ± 0.75.
            let v: Vec<f64> = (0..n)
                .map(|_| g.dim(0, 100) as f64 - 50.0 + [0.25, 0.75, -0.25, -0.75][g.dim(0, 3)])
                .collect();
            let x = common::f64t(&v, &s);
            let to_i32 = |t: &[Tensor]| t[0].to_dtype(DType::I32);
            parity(&format!("to_dtype i32 {s:?}"), dev, TIGHT, to_i32, &[x]);
            let idx = g.ints(&s, 1000);
            let to_f32 = |t: &[Tensor]| t[0].to_dtype(DType::F32);
            parity(
                &format!("i32 to_dtype f32 {s:?}"),
                dev,
                TIGHT,
                to_f32,
                &[idx],
            );
            let value = g.vals(1, V::Smooth)[0] * 100.0;
            let any = [g.tensor(&[1], V::Smooth)];
            for dtype in [DType::F32, DType::I32] {
                // `full` on the input's device: f64 on the reference side, the device's f32 or i32.
                let full = |t: &[Tensor]| {
                    let d = if dtype == DType::I32 {
                        dtype
                    } else {
                        t[0].dtype()
                    };
                    Tensor::full(&s, value, d, t[0].device())
                };
                parity(
                    &format!("full {s:?} {value} {dtype}"),
                    dev,
                    TIGHT,
                    full,
                    &any,
                );
            }
        });
    }

    /// The backend codes no tensor op reaches on the GPU (`BinaryOp::Pow` with broadcasting,
    /// `UnaryOp::GeluGrad`), and `random_uniform`, against the CPU backend through the `Backend`
    /// trait: f64 for the functions, bit for bit in f32 for the random numbers.
    pub fn backend_only_codes(dev: Device) {
        check_property("backend_only_codes", 16, shape_and_seed(), |(s, seed)| {
            let mut g = Gen::from_seed(seed);
            let (sa, sb) = g.broadcast_pair(&s);
            let base = g.vals(sa.iter().product(), V::Positive);
            let exponent = g.vals(sb.iter().product(), V::Smooth);
            let x = g.vals(s.iter().product(), V::Smooth);
            let reference = codes(&CpuBackend, &s, (&sa, &base), (&sb, &exponent), &x, true);
            let got = match dev {
                Device::Cpu => codes(&CpuBackend, &s, (&sa, &base), (&sb, &exponent), &x, false),
                Device::Gpu => {
                    let be = GpuBackend::get().expect("the GPU opened");
                    codes(&be, &s, (&sa, &base), (&sb, &exponent), &x, false)
                }
            };
            let what = format!("{sa:?} pow {sb:?}");
            common::assert_close(&what, &got.0, &reference.0, 1e-4, 1e-3);
            common::assert_close(
                &format!("gelu_grad {s:?}"),
                &got.1,
                &reference.1,
                1e-4,
                1e-3,
            );
            let n = s.iter().product::<usize>();
            let random = match dev {
                Device::Cpu => {
                    CpuBackend.download(&CpuBackend.random_uniform(n, seed, DType::F32).unwrap())
                }
                Device::Gpu => {
                    let be = GpuBackend::get().expect("the GPU opened");
                    be.download(&be.random_uniform(n, seed, DType::F32).unwrap())
                }
            };
            let want =
                CpuBackend.download(&CpuBackend.random_uniform(n, seed, DType::F32).unwrap());
            assert_eq!(
                random.unwrap(),
                want.unwrap(),
                "random_uniform {n} seed {seed}"
            );
        });
    }

    /// `a^b` broadcast over `out` and `gelu'(x)` on backend `be`, in f64 or f32.
    fn codes<B: Backend>(
        be: &B,
        out: &[usize],
        (sa, a): (&[usize], &[f64]),
        (sb, b): (&[usize], &[f64]),
        x: &[f64],
        f64: bool,
    ) -> (Vec<f64>, Vec<f64>) {
        let up = |v: &[f64]| {
            let h = if f64 {
                HostData::F64(v.to_vec())
            } else {
                HostData::F32(v.iter().map(|&x| x as f32).collect())
            };
            be.upload(&h).unwrap()
        };
        let pow = be
            .binary(
                BinaryOp::Pow,
                &up(a),
                &broadcast_strides(sa, out),
                &up(b),
                &broadcast_strides(sb, out),
                out,
            )
            .unwrap();
        let gelu_grad = be.unary(UnaryOp::GeluGrad, &up(x)).unwrap();
        (
            host_f64(be.download(&pow).unwrap()),
            host_f64(be.download(&gelu_grad).unwrap()),
        )
    }
}

/// Strides reading a contiguous tensor of shape `s` as `out` (numpy broadcasting: `s` aligned to
/// the right, stride 0 on dims of size 1).
fn broadcast_strides(s: &[usize], out: &[usize]) -> Vec<usize> {
    let pad = out.len() - s.len();
    let mut strides = vec![0; out.len()];
    let mut step = 1;
    for d in (0..s.len()).rev() {
        strides[pad + d] = if s[d] == 1 { 0 } else { step };
        step *= s[d];
    }
    strides
}

fn host_f64(h: HostData) -> Vec<f64> {
    match h {
        HostData::F32(v) => v.into_iter().map(f64::from).collect(),
        HostData::F64(v) => v,
        HostData::I32(v) => v.into_iter().map(f64::from).collect(),
    }
}

/// Serialises the tests that switch the GPU's matmul kernel.
static MATMUL_KERNEL: Mutex<()> = Mutex::new(());

fn lock(m: &'static Mutex<()>) -> MutexGuard<'static, ()> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The matmul kernels `gpu` offers (the plain one alone stands for the CPU's).
fn matmul_kernels(gpu: Option<&GpuBackend>) -> Vec<MatmulKernel> {
    let mut kernels = vec![MatmulKernel::Plain];
    if gpu.is_some_and(GpuBackend::subgroup_matmul_available) {
        kernels.push(MatmulKernel::Subgroup);
    }
    kernels
}

parity::gpu_and_cpu_f32_tests!(
    props,
    "gpu_parity_props",
    /// Every property with the CPU's f32 backend standing in for the GPU: the cases and the
    /// harness run on machines without an adapter.
    fn properties_hold_with_the_cpu_f32_backend;
    unary_ops,
    binary_ops_broadcast,
    reductions,
    softmax_family,
    layout_ops,
    indexing,
    matmul,
    sorting,
    casts_and_fill,
    backend_only_codes,
);

// ---- folded grids -----------------------------------------------------------------------------

/// Invocations per workgroup of the 1-D kernels (elementwise, layout, reduce, sort, random).
const WG: usize = 256;

/// The GPU and the lock that runs the large fold cases one at a time (each holds a few hundred
/// MB), or `None` when skipping.
fn fold_gpu(test: &str) -> Option<(GpuBackend, MutexGuard<'static, ()>)> {
    static FOLD: Mutex<()> = Mutex::new(());
    common::gpu_or_skip(test)?;
    let guard = lock(&FOLD);
    let be = GpuBackend::get().expect("Device::gpu succeeded");
    be.synchronize().unwrap();
    be.trim_pool();
    Some((be, guard))
}

/// Leaves a NaN-filled buffer of `len` elements as the pool's only free one, so the next output
/// of that size starts as NaN wherever the kernel does not write (a fresh buffer reads as zeros).
/// Also bounds memory: the pool's other free buffers go back to the driver.
fn poison_pool(be: &GpuBackend, len: usize) {
    be.synchronize().unwrap();
    be.trim_pool();
    drop(be.full(len, f64::NAN, DType::F32).unwrap());
    be.flush().unwrap();
}

fn up_f32(be: &GpuBackend, v: &[f32]) -> GpuBuffer {
    be.upload(&HostData::F32(v.to_vec())).unwrap()
}
fn up_i32(be: &GpuBackend, v: &[i32]) -> GpuBuffer {
    be.upload(&HostData::I32(v.to_vec())).unwrap()
}
fn cpu_f32(v: &[f32]) -> moegrad::backend::cpu::CpuBuffer {
    CpuBackend.upload(&HostData::F32(v.to_vec())).unwrap()
}
fn cpu_i32(v: &[i32]) -> moegrad::backend::cpu::CpuBuffer {
    CpuBackend.upload(&HostData::I32(v.to_vec())).unwrap()
}

/// Asserts the GPU's output equals the CPU backend's, exactly for integers and within f32
/// rounding of transcendental functions for floats (NaN never matches a number).
fn assert_same(what: &str, gpu: HostData, cpu: HostData) {
    match (gpu, cpu) {
        (HostData::I32(g), HostData::I32(c)) => {
            assert_eq!(g.len(), c.len(), "{what}: lengths differ");
            if let Some(i) = (0..g.len()).find(|&i| g[i] != c[i]) {
                panic!(
                    "{what}: element {i} of {}: got {}, expected {}",
                    g.len(),
                    g[i],
                    c[i]
                );
            }
        }
        (g, c) => common::assert_close(what, &host_f64(g), &host_f64(c), 1e-6, 1e-5),
    }
}

/// `buf` read through `strides`.
fn strided<'a, B>(buf: &'a B, strides: &'a [usize]) -> Strided<'a, B> {
    Strided { buf, strides }
}

fn random_f32(seed: u64, n: usize) -> Vec<f32> {
    let mut g = Gen::from_seed(seed);
    g.vals(n, V::Smooth).into_iter().map(|v| v as f32).collect()
}

fn random_i32(seed: u64, n: usize, hi: usize) -> Vec<i32> {
    let mut g = Gen::from_seed(seed);
    (0..n).map(|_| g.dim(0, hi - 1) as i32).collect()
}

/// `fill`, `cast_dtype`, `unary`, `binary` (a broadcast operand) and `where_cond` (two broadcast
/// operands) on the smallest output that needs more than 65,535 workgroups of 256.
#[test]
fn folded_elementwise_kernels() {
    let Some((be, _lock)) = fold_gpu("folded_elementwise_kernels") else {
        return;
    };
    let n = fold::smallest_folding(WG);
    fold::assert_past_limit("elementwise", fold::groups(n, WG));
    let cpu = CpuBackend;

    poison_pool(&be, n);
    let filled = be.download(&be.full(n, -2.5, DType::F32).unwrap()).unwrap();
    assert_same(
        "fill",
        filled,
        cpu.download(&cpu.full(n, -2.5, DType::F32).unwrap())
            .unwrap(),
    );

    let x = random_f32(1, n);
    let (gx, cx) = (up_f32(&be, &x), cpu_f32(&x));
    poison_pool(&be, n);
    let cast = be.download(&be.cast(&gx, DType::I32).unwrap()).unwrap();
    assert_same(
        "cast_dtype",
        cast,
        cpu.download(&cpu.cast(&cx, DType::I32).unwrap()).unwrap(),
    );

    poison_pool(&be, n);
    let exp = be.download(&be.unary(UnaryOp::Exp, &gx).unwrap()).unwrap();
    assert_same(
        "unary exp",
        exp,
        cpu.download(&cpu.unary(UnaryOp::Exp, &cx).unwrap())
            .unwrap(),
    );

    // [rows, 3] op [3], and where([rows, 1], [rows, 3], [3]): rows·3 ≥ n.
    let rows = n.div_ceil(3);
    let shape = [rows, 3];
    fold::assert_past_limit("broadcast elementwise", fold::groups(rows * 3, WG));
    let a = random_f32(2, rows * 3);
    let b = random_f32(3, 3);
    let cond: Vec<f32> = random_i32(4, rows, 2)
        .into_iter()
        .map(|c| c as f32)
        .collect();
    let (ga, gb, gc) = (up_f32(&be, &a), up_f32(&be, &b), up_f32(&be, &cond));
    let (ca, cb, cc) = (cpu_f32(&a), cpu_f32(&b), cpu_f32(&cond));
    let (full, row, col) = ([3usize, 1], [0usize, 1], [1usize, 0]);
    poison_pool(&be, rows * 3);
    let sub = be
        .binary(BinaryOp::Sub, &ga, &full, &gb, &row, &shape)
        .unwrap();
    let want = cpu
        .binary(BinaryOp::Sub, &ca, &full, &cb, &row, &shape)
        .unwrap();
    assert_same(
        "binary sub, broadcast",
        be.download(&sub).unwrap(),
        cpu.download(&want).unwrap(),
    );
    poison_pool(&be, rows * 3);
    let got = be
        .where_cond(
            strided(&gc, &col),
            strided(&ga, &full),
            strided(&gb, &row),
            &shape,
        )
        .unwrap();
    let want = cpu
        .where_cond(
            strided(&cc, &col),
            strided(&ca, &full),
            strided(&cb, &row),
            &shape,
        )
        .unwrap();
    assert_same(
        "where_cond, broadcast",
        be.download(&got).unwrap(),
        cpu.download(&want).unwrap(),
    );
}

/// `copy_strided` (a transposed view), `concat_part`, `gather`, and both scatter kernels
/// (`scatter_add_loop` for few source rows, `scatter_add_sorted` for more than 32 with a large
/// output), each writing more than 65,535·256 elements.
#[test]
fn folded_layout_kernels() {
    let Some((be, _lock)) = fold_gpu("folded_layout_kernels") else {
        return;
    };
    let n = fold::smallest_folding(WG);
    let cpu = CpuBackend;

    // [rows, 2] read as its transpose [2, rows].
    let rows = n.div_ceil(2);
    fold::assert_past_limit("copy_strided", fold::groups(2 * rows, WG));
    let x = random_f32(5, 2 * rows);
    let (gx, cx) = (up_f32(&be, &x), cpu_f32(&x));
    let (shape, strides) = ([2, rows], [1, 2]);
    poison_pool(&be, 2 * rows);
    let got = be.copy_strided(&gx, &shape, &strides, 0).unwrap();
    let want = cpu.copy_strided(&cx, &shape, &strides, 0).unwrap();
    assert_same(
        "copy_strided",
        be.download(&got).unwrap(),
        cpu.download(&want).unwrap(),
    );

    // [2, rows, 1] ++ [2, 3, 1] along the middle axis: the first part's launch folds.
    let small = random_f32(6, 6);
    let (gs, cs) = (up_f32(&be, &small), cpu_f32(&small));
    poison_pool(&be, 2 * (rows + 3));
    let got = be.concat(&[&gx, &gs], &[rows, 3], 2, 1).unwrap();
    let want = cpu.concat(&[&cx, &cs], &[rows, 3], 2, 1).unwrap();
    assert_same(
        "concat_part",
        be.download(&got).unwrap(),
        cpu.download(&want).unwrap(),
    );

    // n picks from 10 values.
    fold::assert_past_limit("gather", fold::groups(n, WG));
    let table = random_f32(7, 10);
    let idx = random_i32(8, n, 10);
    let (gt, ct) = (up_f32(&be, &table), cpu_f32(&table));
    let (gi, ci) = (up_i32(&be, &idx), cpu_i32(&idx));
    let view = AxisView {
        outer: 1,
        len: 10,
        inner: 1,
    };
    poison_pool(&be, n);
    let got = be.gather(&gt, view, &gi, [0, 1, 0], n).unwrap();
    let want = cpu.gather(&ct, view, &ci, [0, 1, 0], n).unwrap();
    assert_same(
        "gather",
        be.download(&got).unwrap(),
        cpu.download(&want).unwrap(),
    );

    // m rows scattered into n (an index_scatter): one invocation per output element. With
    // m ≤ 32 the loop kernel runs; with m = 40 and m·n > 2^24 the sorted one. Targets spread
    // over the whole output (the last element included) and repeat.
    for (kernel, m) in [("scatter_add_loop", 2usize), ("scatter_add_sorted", 40)] {
        fold::assert_past_limit(kernel, fold::groups(n, WG));
        let src = random_f32(9, m);
        let mut idx = random_i32(10, m, n);
        idx[0] = (n - 1) as i32;
        idx[m - 1] = idx[0];
        let (gs, cs) = (up_f32(&be, &src), cpu_f32(&src));
        let (gi, ci) = (up_i32(&be, &idx), cpu_i32(&idx));
        let dims = ScatterDims {
            outer: 1,
            m,
            inner: 1,
            len: n,
        };
        poison_pool(&be, n);
        let got = be.scatter_add(&gs, &gi, [0, 1, 0], dims).unwrap();
        let want = cpu.scatter_add(&cs, &ci, [0, 1, 0], dims).unwrap();
        assert_same(
            kernel,
            be.download(&got).unwrap(),
            cpu.download(&want).unwrap(),
        );
    }
}

/// `reduce_serial` and `cumsum_serial` over more than 65,535·256 lines (one invocation a line).
/// Their workgroup-per-line siblings never fold: the launcher picks them only below 4096 lines.
#[test]
fn folded_reduce_kernels() {
    let Some((be, _lock)) = fold_gpu("folded_reduce_kernels") else {
        return;
    };
    let cpu = CpuBackend;
    let lines = fold::smallest_folding(WG);
    fold::assert_past_limit("reduce_serial", fold::groups(lines, WG));
    // lines of 2 along the middle axis, inner lines interleaved: [1, 2, lines]
    let view = AxisView {
        outer: 1,
        len: 2,
        inner: lines,
    };
    let x = random_f32(11, 2 * lines);
    let (gx, cx) = (up_f32(&be, &x), cpu_f32(&x));
    for op in [ReduceOp::Sum, ReduceOp::ArgMax] {
        poison_pool(&be, lines);
        let got = be.reduce(op, &gx, view).unwrap();
        let want = cpu.reduce(op, &cx, view).unwrap();
        let what = format!("reduce_serial {op:?}");
        assert_same(
            &what,
            be.download(&got).unwrap(),
            cpu.download(&want).unwrap(),
        );
    }
    poison_pool(&be, 2 * lines);
    let got = be.cumsum(&gx, view, false).unwrap();
    let want = cpu.cumsum(&cx, view, false).unwrap();
    assert_same(
        "cumsum_serial",
        be.download(&got).unwrap(),
        cpu.download(&want).unwrap(),
    );
}

/// The sort kernels past 65,535 workgroups: `sort_local` (one workgroup per row of 2, 65,536
/// rows) and `sort_init`/`sort_finish` (one invocation per element of 16,385 rows of 1024).
#[test]
fn folded_sort_kernels() {
    let Some((be, _lock)) = fold_gpu("folded_sort_kernels") else {
        return;
    };
    let cpu = CpuBackend;
    // Workgroups of the launch that folds, by the launcher's formulas: sort_local runs one
    // workgroup per block of min(p, 1024) of each row padded to p; init and finish one
    // invocation per (padded) element; sort_global_step (rows longer than 1024 only) one per
    // pair of padded elements, so rows of 1025 (padded to 2048) reach it with the fewest data.
    let local_rows = fold::MAX_GROUPS + 1;
    let local_groups = local_rows; // rows of 2: one block, so one workgroup, per row
    let flat_rows = fold::smallest_folding(WG).div_ceil(1024);
    let flat_groups = fold::groups(flat_rows * 1024, WG);
    let global_pairs = |rows: usize| rows * 2048 / 2;
    let global_rows = fold::smallest_past_limit("sort_global_step rows", |r| {
        fold::groups(global_pairs(r), WG)
    });
    let global_groups = fold::groups(global_pairs(global_rows), WG);
    // (the kernels that fold, rows, row length, their workgroups, descending)
    let cases = [
        ("sort_local", local_rows, 2, local_groups, true),
        (
            "sort_init and sort_finish",
            flat_rows,
            1024,
            flat_groups,
            false,
        ),
        ("sort_global_step", global_rows, 1025, global_groups, true),
    ];
    for (kernels, rows, len, workgroups, descending) in cases {
        fold::assert_past_limit(kernels, workgroups);
        let x = random_f32(12, rows * len);
        let (gx, cx) = (up_f32(&be, &x), cpu_f32(&x));
        poison_pool(&be, rows * len);
        let got = be.argsort(&gx, rows, len, descending).unwrap();
        let want = cpu.argsort(&cx, rows, len, descending).unwrap();
        let what = format!("{kernels}: argsort of {rows} rows of {len}, descending {descending}");
        assert_same(
            &what,
            be.download(&got).unwrap(),
            cpu.download(&want).unwrap(),
        );
    }
}

/// The grouped matmul (with its bias) and its weight gradient with more than 65,535 column
/// tiles of 64: both launchers split x (`tiles(m)`) into launches that each start at a tile
/// offset. The cheapest axis to split: two rows, one input, two experts, so each workgroup runs
/// one one-row expert run of one slab (the row split, 4.2 million rows, takes minutes).
#[test]
fn split_grouped_matmul_columns() {
    let Some((be, _lock)) = fold_gpu("split_grouped_matmul_columns") else {
        return;
    };
    let cpu = CpuBackend;
    let m = fold::smallest_folding(64);
    fold::assert_past_limit("grouped_matmul column tiles", fold::groups(m, 64));
    let (rows, k, experts) = (2, 1, 2);
    let x = random_f32(21, rows * k);
    let w = random_f32(22, experts * k * m);
    let bias = random_f32(23, experts * m);
    let row_expert = [0, 1];
    let dims = GroupedMatmulDims {
        rows,
        k,
        m,
        experts,
        transpose_w: false,
    };
    // uploaded before poisoning the pool: w and the bias have the output's size
    let (gx, gw, gbias, gexpert) = (
        up_f32(&be, &x),
        up_f32(&be, &w),
        up_f32(&be, &bias),
        up_i32(&be, &row_expert),
    );
    poison_pool(&be, rows * m);
    let got = be
        .grouped_matmul(&gx, &gw, Some(&gbias), &gexpert, dims)
        .unwrap();
    let want = cpu
        .grouped_matmul(
            &cpu_f32(&x),
            &cpu_f32(&w),
            Some(&cpu_f32(&bias)),
            &cpu_i32(&row_expert),
            dims,
        )
        .unwrap();
    assert_same(
        &format!("grouped_matmul [{rows}, {k}]·[{experts}, {k}, {m}] with bias"),
        be.download(&got).unwrap(),
        cpu.download(&want).unwrap(),
    );
    drop((got, want, gw, gbias));

    let dy = random_f32(24, rows * m);
    let offsets = [0, 1, 2];
    let bank = ExpertBankDims { k, m, experts };
    // dy has the output's size too
    let (gdy, goffsets) = (up_f32(&be, &dy), up_i32(&be, &offsets));
    poison_pool(&be, experts * k * m);
    let got = be
        .grouped_weight_grad(&gx, &gdy, &gexpert, &goffsets, bank)
        .unwrap();
    let want = cpu
        .grouped_weight_grad(
            &cpu_f32(&x),
            &cpu_f32(&dy),
            &cpu_i32(&row_expert),
            &cpu_i32(&offsets),
            bank,
        )
        .unwrap();
    assert_same(
        &format!("grouped_weight_grad of {rows} rows into [{experts}, {k}, {m}]"),
        be.download(&got).unwrap(),
        cpu.download(&want).unwrap(),
    );
}

/// The operands of `attention_backward` from `[q, k, v, o, lse, dO]`.
fn attention_grad_operands<B>(b: &[B; 6]) -> AttentionGradOperands<'_, B> {
    AttentionGradOperands {
        q: &b[0],
        k: &b[1],
        v: &b[2],
        o: &b[3],
        lse: &b[4],
        d_o: &b[5],
    }
}

/// `attention_delta` (`D = rowsum(dO ∘ O)`, one invocation per row of `heads·seq`) past
/// 65,535 workgroups of 256 rows, through `attention_backward`, whose tiled kernels read `D`:
/// a row the folded grid missed stays NaN (the poisoned pool hands its buffer to `D`, the first
/// allocation) and turns that row's dq and dk into NaN. At 64 rows a head (one tile each, the
/// fewest tiled workgroups for the rows) and head dimension 1. `o` and `lse` are random rather
/// than the forward's: the backward is a function of them either way.
#[test]
fn folded_attention_delta() {
    let Some((be, _lock)) = fold_gpu("folded_attention_delta") else {
        return;
    };
    let cpu = CpuBackend;
    let seq = 64;
    let heads = fold::smallest_past_limit("attention_delta rows", |h| fold::groups(h * seq, WG));
    let dims = AttentionDims {
        heads,
        seq,
        head_dim: 1,
    };
    let rows = heads * seq;
    let [q, k, v, o, d_o] = [31, 32, 33, 34, 35].map(|seed| random_f32(seed, rows));
    // a log-sum-exp at least the largest score, as the forward's is
    let lse: Vec<f32> = random_f32(36, rows).iter().map(|z| 2.0 + z.abs()).collect();
    let gpu_in = [&q, &k, &v, &o, &lse, &d_o].map(|a| up_f32(&be, a));
    let cpu_in = [&q, &k, &v, &o, &lse, &d_o].map(|a| cpu_f32(a));
    poison_pool(&be, rows);
    let got = be
        .attention_backward(attention_grad_operands(&gpu_in), dims)
        .unwrap();
    let want = cpu
        .attention_backward(attention_grad_operands(&cpu_in), dims)
        .unwrap();
    for (name, g, c) in [
        ("dq", &got.0, &want.0),
        ("dk", &got.1, &want.1),
        ("dv", &got.2, &want.2),
    ] {
        common::assert_close(
            &format!("attention_backward {name} of [{heads}, {seq}, 1]"),
            &host_f64(be.download(g).unwrap()),
            &host_f64(cpu.download(c).unwrap()),
            1e-5,
            1e-4,
        );
    }
}

/// `random_uniform` past 65,535 workgroups: bit for bit the CPU's stream.
#[test]
fn folded_random_uniform() {
    let Some((be, _lock)) = fold_gpu("folded_random_uniform") else {
        return;
    };
    let n = fold::smallest_folding(WG);
    fold::assert_past_limit("random_uniform", fold::groups(n, WG));
    poison_pool(&be, n);
    let got = be
        .download(&be.random_uniform(n, 77, DType::F32).unwrap())
        .unwrap();
    let want = CpuBackend
        .download(&CpuBackend.random_uniform(n, 77, DType::F32).unwrap())
        .unwrap();
    assert_eq!(got, want, "random_uniform of {n}");
}

/// matmul with more than 65,535 column tiles (x) or row tiles (y) of 64: the launcher splits the
/// grid into launches that each start at a tile offset. Both splits under the adapter's default
/// kernel, the x split under the other one where the adapter offers two.
/// (More than 65,535 batch entries, the z split, is `gpu_matmul::matmul_grid_split`.)
#[test]
fn split_matmul_grids() {
    let Some((be, _lock)) = fold_gpu("split_matmul_grids") else {
        return;
    };
    let _kernel_lock = lock(&MATMUL_KERNEL);
    let before = be.matmul_kernel();
    let cpu = CpuBackend;
    let long = fold::smallest_folding(64);
    fold::assert_past_limit("matmul tiles", fold::groups(long, 64));
    let k = 2;
    let row_major = |cols: usize| MatLayout {
        offset: 0,
        batch_stride: 0,
        row_stride: cols,
        col_stride: 1,
    };
    for kernel in matmul_kernels(Some(&be)) {
        be.set_matmul_kernel(kernel).unwrap();
        // [1, k]·[k, long] (x split), and under the adapter's default kernel also
        // [long, k]·[k, 1] (y split): each split costs seconds on a software rasterizer.
        let splits: &[(usize, usize)] = if kernel == before {
            &[(1, long), (long, 1)]
        } else {
            &[(1, long)]
        };
        for &(m, n) in splits {
            let a = random_f32(13, m * k);
            let b = random_f32(14, k * n);
            let dims = MatmulDims { batch: 1, m, k, n };
            poison_pool(&be, m * n);
            let got = be
                .matmul(
                    &up_f32(&be, &a),
                    row_major(k),
                    &up_f32(&be, &b),
                    row_major(n),
                    dims,
                )
                .unwrap();
            let want = cpu
                .matmul(&cpu_f32(&a), row_major(k), &cpu_f32(&b), row_major(n), dims)
                .unwrap();
            let what = format!("matmul ({kernel:?}) [{m}, {k}]·[{k}, {n}]");
            assert_same(
                &what,
                be.download(&got).unwrap(),
                cpu.download(&want).unwrap(),
            );
        }
    }
    be.set_matmul_kernel(before).unwrap();
}
