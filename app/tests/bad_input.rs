//! Bad input gives a descriptive `Err`, never a panic: non-broadcastable or misaligned shapes for
//! every binary op (the message names both shapes), axes out of range (`Error::Axis`), wrong
//! sizes, out-of-range slices/indices/k, wrong dtypes (`Error::DType`), devices that differ,
//! misuse of autograd, empty reductions, inverted clamp bounds and gradcheck on f32 inputs.
//! Sizes beyond memory (tensors, models, benchmarks; in the library and on the command line)
//! are errors that name the setting, raised before anything is allocated; and settings that
//! would do nothing (MoE flags on a dense model, a tiny learning rate, an endless warm-up) are
//! warned about.

#[path = "../../tests/common/mod.rs"]
mod common;

use moegrad::gradcheck::{GradcheckOptions, gradcheck};
use moegrad::{DType, Device, Error, Result, Tensor};
use proptest::prelude::*;
use proptest::sample::Index;
use std::panic::{AssertUnwindSafe, catch_unwind};

/// Runs `f`, turning a panic into a test failure that names the call.
fn no_panic<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            panic!("{what} panicked instead of returning Err: {msg}")
        }
    }
}

/// A tensor of `shape` with distinct f32 values.
fn t32(shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    let v = (0..n).map(|i| i as f32 * 0.25 - 1.0).collect();
    Tensor::from_f32(v, shape, Device::cpu()).unwrap()
}

fn t64(shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f64> = (0..n).map(|i| i as f64 * 0.25 - 1.0).collect();
    common::f64t(&v, shape)
}

fn i32t(values: &[i32], shape: &[usize]) -> Tensor {
    Tensor::from_i32(values.to_vec(), shape, Device::cpu()).unwrap()
}

/// Asserts `r` is `Err(Error::Shape(msg))` with every shape's `{:?}` in `msg`.
fn assert_shape_err<T: std::fmt::Debug>(what: &str, r: Result<T>, shapes: &[&[usize]]) {
    match r {
        Err(Error::Shape(msg)) => {
            for s in shapes {
                let s = format!("{s:?}");
                assert!(msg.contains(&s), "{what}: message does not name {s}: {msg}");
            }
        }
        other => panic!("{what}: expected Err(Error::Shape), got {other:?}"),
    }
}

fn assert_axis_err<T: std::fmt::Debug>(what: &str, r: Result<T>) {
    assert!(
        matches!(r, Err(Error::Axis(_))),
        "{what}: expected Err(Error::Axis), got {r:?}"
    );
}

fn assert_dtype_err<T: std::fmt::Debug>(what: &str, r: Result<T>) {
    assert!(
        matches!(r, Err(Error::DType(_))),
        "{what}: expected Err(Error::DType), got {r:?}"
    );
}

/// Two shapes that cannot broadcast: at one aligned position both sizes are ≥ 2 and differ;
/// elsewhere the second matches or has a 1, and it may lose leading dims before the conflict.
fn non_broadcastable() -> impl Strategy<Value = (Vec<usize>, Vec<usize>)> {
    (
        prop::collection::vec(1usize..=4, 1..=3),
        any::<Index>(),
        2usize..=4,
        1usize..=2,
        prop::collection::vec(any::<bool>(), 3),
        0usize..=2,
        any::<bool>(),
    )
        .prop_map(|(mut a, ci, x, off, ones, drop, swap)| {
            let c = ci.index(a.len());
            a[c] = x;
            let y = 2 + (x - 2 + off) % 3; // in 2..=4, never x
            let mut b: Vec<usize> = a
                .iter()
                .zip(&ones)
                .map(|(&d, &o)| if o { 1 } else { d })
                .collect();
            b[c] = y;
            b.drain(..drop.min(c));
            if swap { (b, a) } else { (a, b) }
        })
}

type Bin = fn(&Tensor, &Tensor) -> Result<Tensor>;

const BINARY: [(&str, Bin); 12] = [
    ("add", Tensor::add),
    ("sub", Tensor::sub),
    ("mul", Tensor::mul),
    ("div", Tensor::div),
    ("maximum", Tensor::maximum),
    ("minimum", Tensor::minimum),
    ("gt", Tensor::gt),
    ("ge", Tensor::ge),
    ("lt", Tensor::lt),
    ("le", Tensor::le),
    ("eq", Tensor::eq),
    ("ne", Tensor::ne),
];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn binary_ops_name_both_shapes((sa, sb) in non_broadcastable()) {
        let (a, b) = (t32(&sa), t32(&sb));
        for (name, op) in BINARY {
            let r = no_panic(name, || op(&a, &b));
            assert_shape_err(name, r, &[&sa, &sb]);
        }
        // Also with gradients on (the recording path must not change the answer).
        let (ag, bg) = (t64(&sa).with_grad().unwrap(), t64(&sb).with_grad().unwrap());
        for (name, op) in BINARY {
            let r = no_panic(name, || op(&ag, &bg));
            assert_shape_err(name, r, &[&sa, &sb]);
        }
    }

    #[test]
    fn where_cond_names_the_shapes((sa, sb) in non_broadcastable()) {
        let (a, b) = (t32(&sa), t32(&sb));
        let cond = a.gt(&a.full_like(0.0).unwrap()).unwrap();
        let r = no_panic("where_cond", || Tensor::where_cond(&cond, &a, &b));
        assert_shape_err("where_cond (a vs b)", r, &[&sa, &sb]);
        // The condition itself not broadcasting with a, b.
        let cond_b = t32(&sb).gt(&t32(&sb)).unwrap();
        let r = no_panic("where_cond", || Tensor::where_cond(&cond_b, &a, &a));
        assert_shape_err("where_cond (cond vs a)", r, &[&sb, &sa]);
        // masked_fill with a mask that does not broadcast.
        let r = no_panic("masked_fill", || a.masked_fill(&cond_b, 1.0));
        assert_shape_err("masked_fill", r, &[&sb, &sa]);
    }

    #[test]
    fn mse_and_bce_need_equal_shapes((sa, sb) in non_broadcastable()) {
        let (a, b) = (t32(&sa), t32(&sb));
        assert_shape_err("mse", no_panic("mse", || a.mse(&b)), &[&sa, &sb]);
        assert_shape_err("bce_with_logits", no_panic("bce", || a.bce_with_logits(&b)), &[&sa, &sb]);
    }

    #[test]
    fn matmul_misaligned(
        (m, k, k2, n) in (1usize..=4, 1usize..=4, 1usize..=4, 1usize..=4)
            .prop_filter("k must differ", |(_, k, k2, _)| k != k2),
        batch in 0usize..=3,
        (b1, b2) in (1usize..=3, 1usize..=3).prop_filter("batches differ", |(x, y)| x != y)
    ) {
        let (sa, sb) = match batch {
            0 => (vec![m, k], vec![k2, n]),
            1 => (vec![b1, m, k], vec![b1, k2, n]),
            2 => (vec![b1, m, k], vec![k2, n]),
            _ => (vec![m, k], vec![b1, k2, n]),
        };
        let r = no_panic("matmul", || t32(&sa).matmul(&t32(&sb)));
        assert_shape_err("matmul (inner dims)", r, &[&sa, &sb]);
        // Aligned inner dims but different batch dims.
        let (sa, sb) = (vec![b1, m, k], vec![b2, k, n]);
        let r = no_panic("matmul", || t32(&sa).matmul(&t32(&sb)));
        assert_shape_err("matmul (batch dims)", r, &[&sa, &sb]);
        // Rank-1 operands.
        let r = no_panic("matmul", || t32(&[k]).matmul(&t32(&[k, n])));
        assert_shape_err("matmul (rank 1)", r, &[&[k], &[k, n]]);
    }

    #[test]
    fn concat_off_axis_mismatch((sa, axis_i, delta) in (
        prop::collection::vec(1usize..=4, 2..=3), any::<Index>(), 1usize..=3
    )) {
        let r = sa.len();
        let axis = axis_i.index(r);
        let off = (axis + 1) % r;
        let mut sb = sa.clone();
        sb[axis] += 1; // along the axis: allowed
        sb[off] += delta; // off the axis: not allowed
        let res = no_panic("concat", || Tensor::concat(&[t32(&sa), t32(&sb)], axis as isize));
        assert_shape_err("concat", res, &[&sa, &sb]);
        // A rank mismatch is a shape error too.
        let mut sc = sa.clone();
        sc.push(2);
        let res = no_panic("concat", || Tensor::concat(&[t32(&sa), t32(&sc)], 0));
        assert!(matches!(res, Err(Error::Shape(_))), "concat of ranks {r} and {}: {res:?}", r + 1);
    }

    /// Axes outside `-rank..rank` in every op that takes one.
    #[test]
    fn axis_out_of_range(shape in prop::collection::vec(1usize..=4, 1..=3), beyond in 0isize..3, neg in any::<bool>()) {
        let r = shape.len() as isize;
        let bad = if neg { -r - 1 - beyond } else { r + beyond };
        let x = t32(&shape);
        let idx_shape = shape.clone();
        let idx = i32t(&vec![0; idx_shape.iter().product()], &idx_shape);
        assert_axis_err("sum", no_panic("sum", || x.sum(&[bad], false)));
        assert_axis_err("sum (one good, one bad)", no_panic("sum", || x.sum(&[0, bad], true)));
        assert_axis_err("mean", no_panic("mean", || x.mean(&[bad], false)));
        assert_axis_err("max", no_panic("max", || x.max(bad, false)));
        assert_axis_err("min", no_panic("min", || x.min(bad, true)));
        assert_axis_err("argmax", no_panic("argmax", || x.argmax(bad, false)));
        assert_axis_err("softmax", no_panic("softmax", || x.softmax(bad)));
        assert_axis_err("log_softmax", no_panic("log_softmax", || x.log_softmax(bad)));
        assert_axis_err("logsumexp", no_panic("logsumexp", || x.logsumexp(bad, false)));
        assert_axis_err("cumsum", no_panic("cumsum", || x.cumsum(bad)));
        assert_axis_err("transpose", no_panic("transpose", || x.transpose(0, bad)));
        assert_axis_err("transpose", no_panic("transpose", || x.transpose(bad, 0)));
        assert_axis_err("slice", no_panic("slice", || x.slice(bad, 0, 1)));
        assert_axis_err("concat", no_panic("concat", || Tensor::concat(&[x.clone(), x.clone()], bad)));
        assert_axis_err("gather", no_panic("gather", || x.gather(bad, &idx)));
        assert_axis_err("index_select", no_panic("index_select", || x.index_select(bad, &i32t(&[0], &[1]))));
        assert_axis_err("scatter_add", no_panic("scatter_add", || x.scatter_add(bad, &idx, &x)));
        // permute with an axis that does not exist, a repeated axis, or the wrong count.
        let mut dims: Vec<usize> = (0..shape.len()).collect();
        dims[0] = shape.len() + beyond as usize;
        assert_axis_err("permute (bad axis)", no_panic("permute", || x.permute(&dims)));
        let mut dup: Vec<usize> = (0..shape.len()).collect();
        dup.push(0);
        assert_axis_err("permute (wrong count)", no_panic("permute", || x.permute(&dup)));
        if shape.len() >= 2 {
            let mut rep: Vec<usize> = (0..shape.len()).collect();
            rep[1] = 0;
            assert_axis_err("permute (repeat)", no_panic("permute", || x.permute(&rep)));
        }
    }

    #[test]
    fn reshape_to_wrong_size(shape in prop::collection::vec(1usize..=4, 1..=3), extra in 1usize..=3) {
        let x = t32(&shape);
        let n: usize = shape.iter().product();
        let target = vec![n + extra];
        assert_shape_err("reshape", no_panic("reshape", || x.reshape(&target)), &[&shape, &target]);
    }

    #[test]
    fn slice_out_of_range(shape in prop::collection::vec(1usize..=4, 1..=3), ai in any::<Index>(), over in 1usize..=3) {
        let x = t32(&shape);
        let a = ai.index(shape.len());
        let len = shape[a];
        let r = no_panic("slice", || x.slice(a as isize, 0, len + over));
        assert!(matches!(r, Err(Error::Shape(_))), "end past the axis: {r:?}");
        let r = no_panic("slice", || x.slice(a as isize, len + over, len + over));
        assert!(matches!(r, Err(Error::Shape(_))), "start past the axis: {r:?}");
        if len >= 1 {
            let r = no_panic("slice", || x.slice(a as isize, len, len - 1));
            assert!(matches!(r, Err(Error::Shape(_))), "start > end: {r:?}");
        }
    }

    #[test]
    fn topk_k_too_large(shape in prop::collection::vec(1usize..=4, 1..=3), over in 1usize..=3) {
        let x = t32(&shape);
        let k = shape[shape.len() - 1] + over;
        let r = no_panic("topk", || x.topk(k));
        assert!(matches!(r, Err(Error::Invalid(_))), "topk({k}) of {shape:?}: {r:?}");
    }

    #[test]
    fn expand_to_incompatible((sa, sb) in non_broadcastable()) {
        // Expanding to a shape that one of the sizes cannot broadcast to.
        let r = no_panic("expand", || t32(&sa).expand(&sb));
        assert_shape_err("expand", r, &[&sa, &sb]);
    }
}

#[test]
fn expand_to_lower_rank() {
    let r = no_panic("expand", || t32(&[2, 3]).expand(&[3]));
    assert_shape_err("expand", r, &[&[2, 3], &[3]]);
}

#[test]
fn cross_entropy_wrong_shapes_and_dtypes() {
    let logits = t32(&[3, 4]);
    let ok_targets = i32t(&[0, 3, 1], &[3]);
    logits.cross_entropy(&ok_targets).unwrap();

    let cases: [(&str, Tensor, Tensor); 4] = [
        ("targets too short", t32(&[3, 4]), i32t(&[0, 1], &[2])),
        ("targets 2-D", t32(&[3, 4]), i32t(&[0, 1, 2], &[3, 1])),
        ("logits 1-D", t32(&[4]), i32t(&[0, 1, 2, 3], &[4])),
        ("logits 3-D", t32(&[3, 4, 1]), i32t(&[0, 1, 2], &[3])),
    ];
    for (what, l, t) in cases {
        let r = no_panic(what, || l.cross_entropy(&t));
        assert_shape_err(what, r, &[l.shape(), t.shape()]);
    }
    // f32 targets (class indices must be i32).
    let f_targets = Tensor::from_f32(vec![0.0, 3.0, 1.0], &[3], Device::cpu()).unwrap();
    assert_dtype_err(
        "cross_entropy f32 targets",
        no_panic("cross_entropy", || logits.cross_entropy(&f_targets)),
    );
    // A class index outside 0..C (the CPU checks).
    for bad in [4, -1] {
        let t = i32t(&[0, bad, 1], &[3]);
        let r = no_panic("cross_entropy", || logits.cross_entropy(&t));
        assert!(r.is_err(), "target {bad} with 4 classes: {r:?}");
    }
}

#[test]
fn index_ops_need_i32_indices_in_range() {
    let x = t32(&[3, 4]);
    let f_idx = Tensor::from_f32(vec![0.0, 1.0, 2.0], &[3, 1], Device::cpu()).unwrap();
    assert_dtype_err("gather f32 idx", no_panic("gather", || x.gather(1, &f_idx)));
    let f_idx1 = Tensor::from_f32(vec![0.0, 1.0], &[2], Device::cpu()).unwrap();
    assert_dtype_err(
        "index_select f32 idx",
        no_panic("index_select", || x.index_select(0, &f_idx1)),
    );
    assert_dtype_err(
        "scatter_add f32 idx",
        no_panic("scatter_add", || x.scatter_add(1, &f_idx, &t32(&[3, 1]))),
    );
    // Out-of-range and negative indices.
    for bad in [4, -1, 100] {
        let idx = i32t(&[0, bad, 1], &[3, 1]);
        let r = no_panic("gather", || x.gather(1, &idx));
        assert!(r.is_err(), "gather index {bad}: {r:?}");
        let r = no_panic("scatter_add", || x.scatter_add(1, &idx, &t32(&[3, 1])));
        assert!(r.is_err(), "scatter_add index {bad}: {r:?}");
        let r = no_panic("index_select", || x.index_select(1, &i32t(&[bad], &[1])));
        assert!(r.is_err(), "index_select index {bad}: {r:?}");
    }
    // Index shapes that do not fit.
    let r = no_panic("gather", || x.gather(1, &i32t(&[0, 1], &[2, 1])));
    assert_shape_err("gather shape", r, &[&[2, 1], &[3, 4]]);
    let r = no_panic("index_select", || {
        x.index_select(0, &i32t(&[0, 1], &[1, 2]))
    });
    assert_shape_err("index_select 2-D index", r, &[&[1, 2]]);
    let r = no_panic("scatter_add", || {
        x.scatter_add(1, &i32t(&[0, 1, 2], &[3, 1]), &t32(&[3, 2]))
    });
    assert_shape_err("scatter_add src/idx", r, &[&[3, 1], &[3, 2]]);
}

#[test]
fn dtype_mismatch_is_a_dtype_error() {
    let a = t32(&[2, 3]);
    let b = t64(&[2, 3]);
    for (name, op) in BINARY {
        assert_dtype_err(name, no_panic(name, || op(&a, &b)));
    }
    assert_dtype_err("matmul", no_panic("matmul", || a.matmul(&t64(&[3, 2]))));
    assert_dtype_err(
        "concat",
        no_panic("concat", || Tensor::concat(&[a.clone(), b.clone()], 0)),
    );
    assert_dtype_err(
        "where_cond",
        no_panic("where", || Tensor::where_cond(&a, &a, &b)),
    );
    assert_dtype_err("mse", no_panic("mse", || a.mse(&b)));
    // Integer tensors where floats are needed.
    let i = i32t(&[1, 2, 3, 4, 5, 6], &[2, 3]);
    assert_dtype_err("add i32", no_panic("add", || i.add(&i)));
    assert_dtype_err("exp i32", no_panic("exp", || i.exp()));
    assert_dtype_err("sum i32", no_panic("sum", || i.sum(&[0], false)));
    assert_dtype_err("softmax i32", no_panic("softmax", || i.softmax(-1)));
    assert_dtype_err("topk i32", no_panic("topk", || i.topk(1)));
    assert_dtype_err(
        "matmul i32",
        no_panic("matmul", || i.matmul(&i32t(&[1; 6], &[3, 2]))),
    );
    assert_dtype_err("to_vec_i32 of f32", a.to_vec_i32());
}

#[test]
fn device_mismatch_is_a_device_error() {
    let Some(gpu) = common::gpu_or_skip("device_mismatch_is_a_device_error") else {
        return;
    };
    let a = t32(&[2, 3]);
    let b = a.to_device(gpu).unwrap();
    for (name, op) in BINARY {
        let r = no_panic(name, || op(&a, &b));
        assert!(matches!(r, Err(Error::Device(_))), "{name}: {r:?}");
    }
    let r = no_panic("matmul", || a.matmul(&t32(&[3, 2]).to_device(gpu).unwrap()));
    assert!(matches!(r, Err(Error::Device(_))), "matmul: {r:?}");
    let idx = i32t(&[0, 1], &[2, 1]).to_device(gpu).unwrap();
    let r = no_panic("gather", || a.gather(1, &idx));
    assert!(matches!(r, Err(Error::Device(_))), "gather: {r:?}");
    // f64 cannot live on the GPU.
    let r = Tensor::from_f64(vec![1.0], &[1], gpu);
    assert_dtype_err("f64 on the GPU", r);
}

#[test]
fn constructors_check_the_length() {
    let r = Tensor::from_f32(vec![1.0, 2.0, 3.0], &[2, 2], Device::cpu());
    assert_shape_err("from_f32", r, &[&[2, 2]]);
    let r = Tensor::from_f64(vec![1.0; 5], &[2, 3], Device::cpu());
    assert_shape_err("from_f64", r, &[&[2, 3]]);
    let r = Tensor::from_i32(vec![1; 7], &[2, 3], Device::cpu());
    assert_shape_err("from_i32", r, &[&[2, 3]]);
    let r = Tensor::from_f32(vec![1.0], &[], Device::cpu());
    assert!(r.is_ok(), "one value fills a 0-d tensor: {r:?}");
}

#[test]
fn item_needs_one_element() {
    let r = t32(&[2, 2]).item();
    assert_shape_err("item", r, &[&[2, 2]]);
    let r = t32(&[0]).item();
    assert!(
        matches!(r, Err(Error::Shape(_))),
        "item of an empty tensor: {r:?}"
    );
    assert_eq!(t32(&[1, 1]).item().unwrap(), -1.0);
}

#[test]
fn autograd_misuse() {
    // backward() on a non-scalar.
    let w = t64(&[2, 3]).with_grad().unwrap();
    let y = w.mul_scalar(2.0).unwrap();
    let r = y.backward();
    match r {
        Err(Error::Autograd(msg)) => assert!(msg.contains("[2, 3]"), "{msg}"),
        other => panic!("backward on non-scalar: {other:?}"),
    }
    // backward on a tensor that does not require grad.
    let c = t64(&[1]).exp().unwrap();
    let r = c.backward();
    assert!(matches!(r, Err(Error::Autograd(_))), "{r:?}");
    // backward_with a gradient of the wrong shape or dtype.
    let r = y.backward_with(&t64(&[3, 2]));
    assert!(matches!(r, Err(Error::Autograd(_))), "{r:?}");
    let r = y.backward_with(&t32(&[2, 3]));
    assert!(matches!(r, Err(Error::Autograd(_))), "{r:?}");
    // requires_grad on integer tensors and on op outputs.
    let i = i32t(&[1, 2], &[2]);
    let r = i.set_requires_grad(true).map(|_| ());
    assert!(matches!(r, Err(Error::Autograd(_))), "{r:?}");
    assert!(!i.requires_grad());
    let r = i.clone().with_grad();
    assert!(matches!(r, Err(Error::Autograd(_))), "{r:?}");
    let r = y.set_requires_grad(false).map(|_| ());
    assert!(matches!(r, Err(Error::Autograd(_))), "{r:?}");
    assert!(
        y.requires_grad(),
        "a failed set_requires_grad changed the flag"
    );
}

#[test]
fn empty_reductions_are_invalid() {
    let x = t32(&[2, 0, 3]);
    let r = no_panic("mean", || x.mean(&[1], false));
    assert!(
        matches!(r, Err(Error::Invalid(_))),
        "mean over empty axis: {r:?}"
    );
    let r = no_panic("mean_all", || t32(&[0]).mean_all());
    assert!(
        matches!(r, Err(Error::Invalid(_))),
        "mean_all of empty: {r:?}"
    );
    let r = no_panic("max", || x.max(1, false));
    assert!(
        matches!(r, Err(Error::Invalid(_))),
        "max over empty axis: {r:?}"
    );
    let r = no_panic("min", || x.min(1, false));
    assert!(
        matches!(r, Err(Error::Invalid(_))),
        "min over empty axis: {r:?}"
    );
    let r = no_panic("argmax", || x.argmax(1, false));
    assert!(
        matches!(r, Err(Error::Invalid(_))),
        "argmax over empty axis: {r:?}"
    );
    // The sum of nothing is 0, not an error.
    let s = x.sum(&[1], false).unwrap();
    assert_eq!(s.shape(), &[2, 3]);
    assert_eq!(s.to_vec_f32().unwrap(), vec![0.0; 6]);
    // Empty losses.
    let e = t32(&[0]);
    assert!(matches!(
        no_panic("mse", || e.mse(&e)),
        Err(Error::Invalid(_))
    ));
    assert!(matches!(
        no_panic("bce", || e.bce_with_logits(&e)),
        Err(Error::Invalid(_))
    ));
    let r = no_panic("cross_entropy", || {
        t32(&[0, 3]).cross_entropy(&i32t(&[], &[0]))
    });
    assert!(matches!(r, Err(Error::Invalid(_))), "{r:?}");
    assert!(matches!(
        no_panic("concat", || Tensor::concat(&[], 0)),
        Err(Error::Invalid(_))
    ));
}

#[test]
fn clamp_needs_lo_not_above_hi() {
    let x = t32(&[4]);
    let r = no_panic("clamp", || x.clamp(1.0, -1.0));
    assert!(matches!(r, Err(Error::Invalid(_))), "clamp(1, -1): {r:?}");
    let r = no_panic("clamp", || x.clamp(f64::NAN, 1.0));
    assert!(matches!(r, Err(Error::Invalid(_))), "clamp(NaN, 1): {r:?}");
    // lo == hi is allowed.
    let y = x.clamp(0.5, 0.5).unwrap();
    assert_eq!(y.to_vec_f32().unwrap(), vec![0.5; 4]);
}

#[test]
fn scalar_inputs_to_axis_ops() {
    let s = Tensor::scalar(2.0, DType::F32, Device::cpu()).unwrap();
    assert!(matches!(
        no_panic("topk", || s.topk(1)),
        Err(Error::Shape(_))
    ));
    assert!(matches!(
        no_panic("argsort", || s.argsort(false)),
        Err(Error::Shape(_))
    ));
    assert_axis_err("softmax of a scalar", no_panic("softmax", || s.softmax(0)));
    assert_axis_err("cumsum of a scalar", no_panic("cumsum", || s.cumsum(0)));
    assert_axis_err(
        "transpose of a scalar",
        no_panic("transpose", || s.transpose(0, 0)),
    );
}

#[test]
fn gradcheck_needs_f64_cpu_inputs() {
    let x = t32(&[3]);
    let r = gradcheck(|t| t[0].exp(), &[x], &GradcheckOptions::default());
    assert_dtype_err("gradcheck of f32", r);
    let i = i32t(&[1, 2], &[2]);
    let r = gradcheck(
        |t| t[0].to_dtype(DType::F64),
        &[i],
        &GradcheckOptions::default(),
    );
    assert_dtype_err("gradcheck of i32", r);
    // A function returning f32 from f64 inputs.
    let r = gradcheck(
        |t| t[0].to_dtype(DType::F32),
        &[t64(&[2])],
        &GradcheckOptions::default(),
    );
    assert_dtype_err("gradcheck of an f32 result", r);
}

#[test]
fn absurd_tensor_sizes_are_errors_not_aborts() {
    let cpu = Device::cpu();
    // an element count that overflows
    let r = no_panic("zeros [2^40, 2^40]", || {
        Tensor::zeros(&[1 << 40, 1 << 40], DType::F32, cpu)
    });
    assert!(
        matches!(&r, Err(Error::Invalid(m)) if m.contains("[1099511627776, 1099511627776]")),
        "{r:?}"
    );
    // one that wraps around to 0 must not pass for an empty tensor
    let r = no_panic("from_f32 [2^63, 2]", || {
        Tensor::from_f32(vec![], &[1 << 63, 2], cpu)
    });
    assert_shape_err("from_f32 [2^63, 2]", r, &[&[1 << 63, 2]]);
    // counts that fit but need petabytes: refused before the allocator is asked (which aborts)
    let r = no_panic("zeros [2^50]", || {
        Tensor::zeros(&[1 << 50], DType::F32, cpu)
    });
    assert!(
        matches!(&r, Err(Error::Invalid(m)) if m.contains("more than")),
        "{r:?}"
    );
    let r = no_panic("full f64 [2^40, 2^10]", || {
        Tensor::full(&[1 << 40, 1 << 10], 1.0, DType::F64, cpu)
    });
    assert!(matches!(&r, Err(Error::Invalid(_))), "{r:?}");
    let mut rng = <rand_chacha::ChaCha8Rng as rand::SeedableRng>::seed_from_u64(0);
    let r = no_panic("uniform [2^30, 2^20]", || {
        moegrad::nn::uniform(&[1 << 30, 1 << 20], 0.1, &mut rng, cpu)
    });
    assert!(matches!(&r, Err(Error::Invalid(_))), "{r:?}");
    // ordinary sizes are unaffected
    assert_eq!(
        Tensor::full(&[3, 2], 1.5, DType::F64, cpu)
            .unwrap()
            .to_vec_f64()
            .unwrap(),
        vec![1.5; 6]
    );
}

#[test]
fn the_memory_estimate_counts_the_parameters_the_models_allocate() {
    use moegrad::train::{
        DataKind, ModelKind, TrainConfig, build_model, build_synthetic_b, memory_estimate,
    };
    let cpu = Device::cpu();
    let cases = [
        (DataKind::Mnist, ModelKind::Mlp, 28, 1),
        (DataKind::Multimnist, ModelKind::Mlp, 36, 2),
        (DataKind::Mnist, ModelKind::Cnn, 28, 1),
        (DataKind::Multimnist, ModelKind::Cnn, 36, 2),
        (DataKind::Mnist, ModelKind::MoeMlp, 28, 1),
        (DataKind::Multimnist, ModelKind::MoeMlp, 36, 2),
        (DataKind::Mnist, ModelKind::MoeCnn, 28, 1),
        (DataKind::Multimnist, ModelKind::MmoeCnn, 36, 2),
    ];
    for (data, model, side, tasks) in cases {
        let cfg = TrainConfig {
            data,
            model,
            experts: 3,
            k: 2,
            expert_hidden: 5,
            ..TrainConfig::default()
        };
        let built = build_model(&cfg, side, tasks, cpu).unwrap();
        let counted: usize = built
            .named_params()
            .iter()
            .map(|(_, p)| p.get().numel())
            .sum();
        let e = memory_estimate(&cfg, side, tasks, 64).unwrap();
        assert_eq!(e.parameters, counted as u64, "{model:?} on {data:?}");
        assert_eq!(e.trainable, e.parameters, "{model:?} on {data:?}");
        // weights, gradients and two Adam moments, plus some activations
        assert!(e.activation_bytes > 0 && e.total_bytes > 16 * e.parameters);
    }
    // synthetic-b: the frozen bank is allocated but not trained
    let bank = moegrad::data::SyntheticB::generate(0, 16, 10, 10).unwrap();
    let cfg = TrainConfig {
        data: DataKind::SyntheticB,
        model: ModelKind::MoeMlp,
        experts: 16,
        k: 4,
        ..TrainConfig::default()
    };
    let built = build_synthetic_b(&cfg, &bank, cpu).unwrap();
    let counted: usize = built
        .named_params()
        .iter()
        .map(|(_, p)| p.get().numel())
        .sum();
    let e = memory_estimate(&cfg, 0, 1, 64).unwrap();
    assert_eq!(e.trainable, counted as u64);
    assert_eq!(e.parameters, counted as u64 + 16 * (10 * 4 + 4 * 4));
}

#[test]
fn models_too_large_for_memory_are_refused_before_allocating() {
    use moegrad::train::{
        DataKind, ModelKind, TrainConfig, build_model, check_memory, memory_estimate,
    };
    let cpu = Device::cpu();
    let moe = |experts: usize, expert_hidden: usize| TrainConfig {
        model: ModelKind::MoeMlp,
        experts,
        expert_hidden,
        ..TrainConfig::default()
    };
    // about 1.6 TiB: more than any machine this runs on
    let cfg = moe(1_000_000, 128);
    let e = check_memory(&cfg, 28, 1, 64).unwrap_err().to_string();
    assert!(
        e.contains("--experts 1000000") && e.contains("more than"),
        "{e}"
    );
    let r = no_panic("build --experts 1000000", || build_model(&cfg, 28, 1, cpu));
    assert!(r.is_err_and(|e| e.to_string().contains("--experts 1000000")));
    let e = check_memory(&moe(8, 4_000_000_000), 28, 1, 64)
        .unwrap_err()
        .to_string();
    assert!(e.contains("--expert-hidden 4000000000"), "{e}");
    // sizes whose products overflow 64 bits
    assert!(memory_estimate(&moe(usize::MAX, usize::MAX), 28, 1, 64).is_none());
    let e = check_memory(&moe(usize::MAX, 128), 28, 1, 64)
        .unwrap_err()
        .to_string();
    assert!(e.contains("64-bit"), "{e}");
    // synthetic-b's bank is counted before it is generated
    let r = no_panic("synthetic-b 10^14 experts", || {
        moegrad::data::SyntheticB::generate(0, 100_000_000_000_000, 10, 10)
    });
    assert!(r.is_err_and(|e| e.to_string().contains("--experts 100000000000000")));
    // images too small for the convolutions
    let cnn = TrainConfig {
        data: DataKind::Mnist,
        model: ModelKind::Cnn,
        ..TrainConfig::default()
    };
    let r = no_panic("cnn on 12×12", || build_model(&cnn, 12, 1, cpu));
    assert!(r.is_err_and(|e| e.to_string().contains("16×16")));
}

/// Runs the `moegrad` binary with a fixed memory limit of 16 GiB, so what is refused does not
/// depend on the machine.
fn moegrad_limited(args: &[&str]) -> (Option<i32>, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_moegrad"))
        .args(args)
        .env(moegrad::memory::LIMIT_ENV, "16G")
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn fresh_dir(name: &str) -> String {
    let d = std::env::temp_dir().join(format!("moegrad-bad-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d.to_string_lossy().into_owned()
}

#[test]
fn the_command_line_refuses_sizes_beyond_memory_naming_the_setting() {
    let out = fresh_dir("sizes");
    let train = |extra: &[&str]| {
        let mut a = vec!["train", "--device", "cpu", "--out", &out, "--epochs", "1"];
        a.extend_from_slice(extra);
        moegrad_limited(&a)
    };
    let cases = [
        (
            train(&["--model", "moe-mlp", "--experts", "100000"]),
            "--experts 100000",
        ),
        (
            train(&["--model", "moe-mlp", "--expert-hidden", "4000000000"]),
            "--expert-hidden 4000000000",
        ),
        (
            moegrad_limited(&["bench", "matmul", "--device", "cpu", "--sizes", "100000"]),
            "--sizes 100000",
        ),
        (
            moegrad_limited(&["bench", "moe", "--device", "cpu", "--tokens", "100000000"]),
            "--tokens 100000000",
        ),
    ];
    for ((code, stdout, stderr), setting) in cases {
        assert_eq!(code, Some(1), "{setting}: {stderr}");
        assert!(stdout.is_empty(), "{setting}: {stdout}");
        assert!(
            stderr.contains(setting) && stderr.contains("more than the 16.0 GiB"),
            "{setting}: {stderr}"
        );
    }
    assert!(
        !std::path::Path::new(&out).exists(),
        "the refused runs created {out}"
    );
}

#[test]
fn settings_that_would_do_nothing_are_warned_about() {
    use moegrad::train::{DataKind, ModelKind, TrainConfig};
    let cnn = TrainConfig {
        model: ModelKind::Cnn,
        ..TrainConfig::default()
    };
    let w = cnn.warnings(&["--router", "--seed", "--experts", "--router-opt"]);
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(
        w[0].contains("--router, --experts, --router-opt ignored") && w[0].contains("--model cnn"),
        "{w:?}"
    );
    assert!(cnn.warnings(&["--seed", "--lr"]).is_empty());
    let moe = |model| TrainConfig {
        model,
        ..TrainConfig::default()
    };
    assert!(
        moe(ModelKind::MoeMlp)
            .warnings(&["--router", "--expert-hidden"])
            .is_empty()
    );
    let w = moe(ModelKind::MoeCnn).warnings(&["--router", "--expert-hidden"]);
    assert!(
        w.len() == 1 && w[0].contains("--expert-hidden ignored"),
        "{w:?}"
    );
    let synthetic = TrainConfig {
        data: DataKind::SyntheticB,
        model: ModelKind::MoeMlp,
        ..TrainConfig::default()
    };
    assert_eq!(
        synthetic
            .warnings(&["--expert-hidden", "--data-dir", "--experts"])
            .len(),
        2
    );
    // the thresholds: lr below 1e-8, warm-up not shorter than the run
    let lr = |lr| TrainConfig {
        lr,
        ..TrainConfig::default()
    };
    let w = lr(1e-50).warnings(&[]);
    assert!(w.len() == 1 && w[0].contains("--lr 1e-50"), "{w:?}");
    assert!(lr(1e-8).warnings(&[]).is_empty());
    let warm = |warmup_steps| TrainConfig {
        warmup_steps,
        ..TrainConfig::default()
    };
    assert!(warm(100).warmup_warning(100).is_some());
    assert!(warm(99).warmup_warning(100).is_none());
    assert!(warm(0).warmup_warning(0).is_none());

    // the command line: flags given, not defaults, are what is warned about
    let run = |name: &str, extra: &[&str]| {
        let out = fresh_dir(name);
        let mut a = vec![
            "train",
            "--device",
            "cpu",
            "--out",
            &out,
            "--epochs",
            "1",
            "--train-limit",
            "64",
            "--test-limit",
            "64",
            "--model",
            "cnn",
        ];
        a.extend_from_slice(extra);
        let r = moegrad_limited(&a);
        let _ = std::fs::remove_dir_all(&out);
        r
    };
    let (code, _, stderr) = run(
        "warn",
        &["--router", "switch", "--lr", "1e-50", "--warmup-steps", "5"],
    );
    assert_eq!(code, Some(0), "{stderr}");
    for part in [
        "warning: --router ignored: --model cnn has no MoE layer",
        "warning: --lr 1e-50",
        "warning: --warmup-steps 5 is not shorter than the run's 1 steps",
    ] {
        assert!(stderr.contains(part), "{part} missing from: {stderr}");
    }
    let (code, _, stderr) = run("quiet", &[]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(!stderr.contains("warning"), "{stderr}");
}

#[test]
fn f16_mixed_on_the_cpu_is_refused_before_the_output_directory_is_touched() {
    let out = fresh_dir("f16-cpu");
    let (code, _, err) = moegrad_limited(&[
        "train",
        "--model",
        "mlp",
        "--device",
        "cpu",
        "--precision",
        "f16-mixed",
        "--epochs",
        "1",
        "--out",
        &out,
    ]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("--precision f16-mixed trains on the GPU") && err.contains("--device gpu"),
        "{err}"
    );
    assert!(!std::path::Path::new(&out).exists(), "--out was created");
    let (code, _, err) = moegrad_limited(&["train", "--precision", "bf16", "--out", &out]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("f16-mixed"), "{err}");
}
