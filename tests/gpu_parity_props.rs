//! GPU parity as property tests over random shapes, for every kernel that is not a fused op
//! (elementwise, reductions, the softmax family, layout and indexing, matmul, sorting, casts, fill
//! and random numbers; the fused ops and optimizers have tests of their own), through the tensor
//! API.
//!
//! Proptest draws ranks 1–4, dims 1–70 with workgroup edges (1, 255, 256, 257; 63, 64, 65 for
//! matmul tiles) and long axes where a launcher switches kernels (reductions past 128, scatters
//! past 4096 source rows, sort rows past 1024), from a fixed seed and a fixed, small number of
//! cases, so runs are reproducible and CI's time bounded. Each case runs [`parity::parity`]: the
//! op on f64 CPU copies and on f32 device copies of the same inputs, forward and backward with
//! one random upstream gradient. Every property also runs with the CPU's f32 backend in the
//! GPU's place (`properties_hold_with_the_cpu_f32_backend`), so the cases run on machines
//! without an adapter.
//!
//! What needs the backend itself is tested inside the crate (`src/backend/tests/`): the codes no
//! tensor op reaches (`backend_codes.rs`) and every launch past 65,535 workgroups
//! (`folded_grids.rs`).
//!
//! Without a GPU adapter the GPU tests print "skipping" and pass, unless `MOEGRAD_REQUIRE_GPU=1`.

mod common;
#[path = "common/parity.rs"]
mod parity;
#[path = "common/property.rs"]
mod property;

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
    /// source rows along the axis (the kernel that sorts the indices first); and the weighted
    /// combine `weighted_index_scatter` (one fused primitive on each device) at both sizes.
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

            // the weighted MoE combine, rows [m, d] with one weight each, short and long
            let d = g.dim(1, 40);
            for m in [g.dim(1, 70), g.dim(4097, 5000)] {
                let out_len = g.dim(1, 70);
                let rows = g.tensor(&[m, d], V::Smooth);
                let w = g.tensor(&[m], V::Smooth);
                let idx = g.ints(&[m], out_len);
                let combine = |t: &[Tensor]| t[0].weighted_index_scatter(&t[1], &t[2], out_len);
                let what = format!("weighted_index_scatter [{m}, {d}] onto {out_len}");
                parity(&what, dev, sum_tol(m + d), combine, &[rows, w, idx]);
            }

            // the MoE block's output: its residual plus the combine with the weights per slot
            // (k rows per output, the slots a rotation of the rows), the GPU's kernel adding
            // the residual; the output's grid past one workgroup where out_len·d is
            let (out_len, k) = (g.dim(1, 70), g.dim(1, 4));
            let m = out_len * k;
            let shift = g.dim(0, m - 1);
            let slots: Vec<i32> = (0..m).map(|s| ((s + shift) % m) as i32).collect();
            let (mut idx, mut order) = (vec![0i32; m], vec![0i32; m]);
            for (s, &r) in slots.iter().enumerate() {
                idx[r as usize] = (s / k) as i32;
                order[r as usize] = s as i32;
            }
            let int = |v: Vec<i32>| Tensor::from_i32(v, &[m], Device::cpu()).unwrap();
            let (idx, slots, order) = (int(idx), int(slots), int(order));
            let rows = g.tensor(&[m, d], V::Smooth);
            let w = g.tensor(&[m], V::Smooth);
            let h = g.tensor(&[out_len, d], V::Smooth);
            let block = |t: &[Tensor]| {
                t[0].weighted_index_scatter_per_slot_add(&t[1], &t[2], out_len, &t[3], &t[4], &t[5])
            };
            let what = format!("weighted_index_scatter_per_slot_add {out_len} × {k} rows of {d}");
            parity(
                &what,
                dev,
                sum_tol(k + d),
                block,
                &[rows, w, idx, slots, order, h],
            );
        });
    }

    /// Dense, batched, broadcast-batch and transposed-operand products, products with a bias
    /// (`matmul_bias`, 2-D and batched inputs), `matmul_t` and products added to an addend
    /// (`matmul_add`, batched with a bias, 2-D without), dims 1–70 with the edges of the
    /// 64-wide and 128-wide tiles, under every matmul kernel the adapter offers.
    pub fn matmul(dev: Device) {
        let side = || {
            prop_oneof![
                3 => 1usize..=70,
                1 => prop::sample::select(vec![63usize, 64, 65, 127, 128, 129]),
            ]
        };
        let strategy = (side(), side(), side(), 1usize..=3, 0usize..12, any::<u64>());
        let _kernel_lock = lock(&MATMUL_KERNEL);
        let on_gpu = dev == Device::Gpu;
        let before = on_gpu.then(|| moegrad::gpu::matmul_kernel().expect("the GPU opened"));
        for kernel in matmul_kernels(on_gpu) {
            if on_gpu {
                moegrad::gpu::set_matmul_kernel(kernel).expect("an available kernel");
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
                        6 => (vec![m, k], vec![b, n, k]),
                        // with a bias [n]
                        7 => (vec![m, k], vec![k, n]),
                        8 => (vec![b, m, k], vec![k, n]),
                        // matmul_t: the second operand [n, k], read transposed in place
                        9 => (vec![b, m, k], vec![n, k]),
                        // matmul_add: with a bias [n] and an addend [b, m, n]; without, [m, n]
                        10 => (vec![b, m, k], vec![k, n]),
                        _ => (vec![m, k], vec![k, n]),
                    };
                    let (x, y) = (g.tensor(&sa, V::Smooth), g.tensor(&sb, V::Smooth));
                    let mut inputs = vec![x, y];
                    if matches!(variant, 7 | 8 | 10) {
                        inputs.push(g.tensor(&[n], V::Smooth));
                    }
                    match variant {
                        10 => inputs.push(g.tensor(&[b, m, n], V::Smooth)),
                        11 => inputs.push(g.tensor(&[m, n], V::Smooth)),
                        _ => {}
                    }
                    let what = format!("{name} {sa:?} x {sb:?} variant {variant}");
                    parity(
                        &what,
                        dev,
                        LOOSE,
                        |t| match variant {
                            5 => t[0].transpose(-1, -2)?.matmul(&t[1]),
                            6 => t[0].matmul(&t[1].transpose(-1, -2)?),
                            7 | 8 => t[0].matmul_bias(&t[1], &t[2]),
                            9 => t[0].matmul_t(&t[1]),
                            10 => t[0].matmul_add(&t[1], Some(&t[2]), &t[3]),
                            11 => t[0].matmul_add(&t[1], None, &t[2]),
                            _ => t[0].matmul(&t[1]),
                        },
                        &inputs,
                    );
                },
            );
        }
        if let Some(k) = before {
            moegrad::gpu::set_matmul_kernel(k).expect("the kernel it ran before");
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
}

/// Serialises the tests that switch the GPU's matmul kernel.
static MATMUL_KERNEL: Mutex<()> = Mutex::new(());

fn lock(m: &'static Mutex<()>) -> MutexGuard<'static, ()> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The matmul kernels of the GPU when `gpu` (the plain one alone stands for the CPU's).
fn matmul_kernels(gpu: bool) -> Vec<moegrad::gpu::MatmulKernel> {
    let mut kernels = vec![moegrad::gpu::MatmulKernel::Plain];
    if gpu {
        kernels.push(moegrad::gpu::MatmulKernel::Wide);
        kernels.push(moegrad::gpu::MatmulKernel::WideVec4);
    }
    if gpu && moegrad::gpu::subgroup_matmul_available().expect("the GPU opened") {
        kernels.push(moegrad::gpu::MatmulKernel::Subgroup);
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
);
