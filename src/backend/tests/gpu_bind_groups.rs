//! Bind-group reuse (`backend/gpu/bind_group_cache.rs`) and the pool's choice of free buffer
//! (`buffer_pool.rs`): repeated steps bind the same buffers and find their bind groups in the
//! cache, create none once warm, and compute exactly what they compute with a bind group created
//! per dispatch.
//!
//! Without a GPU adapter each test prints "skipping ..." and passes; with `MOEGRAD_REQUIRE_GPU=1`
//! a missing adapter fails.

use super::gpu_primitives::*;
use crate::backend::gpu::buffer_pool::Kind;
use crate::backend::gpu::{GpuBackend, GpuBuffer};
use crate::backend::{
    AxisView, BinaryOp, ElementwiseOps, OptimOps, ReduceOp, ReduceOps, SgdHyper, UnaryOp,
};

/// One "training step" of a parameter `p` of `n` values: a forward op, a gradient, a row sum
/// (another kernel, other bindings) and an SGD update, as a model's step records them.
fn step(g: &GpuBackend, p: &GpuBuffer, n: usize) -> (GpuBuffer, GpuBuffer) {
    let y = g.unary(UnaryOp::Tanh, p).unwrap();
    let grad = g.binary(BinaryOp::Mul, &y, &[1], p, &[1], &[n]).unwrap();
    let rows = AxisView {
        outer: 4,
        len: n / 4,
        inner: 1,
    };
    let total = g.reduce(ReduceOp::Sum, &grad, rows).unwrap();
    let h = SgdHyper {
        lr: 0.05,
        momentum: 0.0,
        weight_decay: 0.0,
        nesterov: false,
    };
    (g.sgd_step(p, &grad, None, &grad, h).unwrap().0, total)
}

/// `steps` steps from the same start, with reuse on or off, adding each step's row sums into a
/// running total on the device (as the training loop sums its losses): the total and the final
/// parameter, and the bind groups created over the last `counted` steps with the dispatches
/// they recorded.
fn run(g: &GpuBackend, reuse: bool, steps: usize, counted: usize) -> (Vec<f32>, u64, u64) {
    let n = 1024;
    g.bind_groups().set_reuse(reuse);
    let start: Vec<f32> = (0..n).map(|i| ((i % 37) as f32 - 18.0) / 9.0).collect();
    let mut p = up(g, &start);
    let mut sums = up(g, &[0.0; 4]);
    let mut before = g.stats();
    for s in 0..steps {
        if s == steps - counted {
            g.synchronize().unwrap();
            before = g.stats();
        }
        let (next, total) = step(g, &p, n);
        p = next;
        sums = g
            .binary(BinaryOp::Add, &sums, &[1], &total, &[1], &[4])
            .unwrap();
        // the step's end, as the training loop ends it: its last batch goes to the queue and
        // the buffers the batch held return to the pool
        g.flush().unwrap();
    }
    g.synchronize().unwrap();
    let counts = g.stats().since(&before);
    let mut values = f32s(g_down(g, &sums));
    values.extend(f32s(g_down(g, &p)));
    g.bind_groups().set_reuse(true);
    (values, counts.bind_groups_created, counts.dispatches)
}

#[test]
fn warm_steps_reuse_every_bind_group_and_compute_the_same_bits() {
    let Some((g, _l)) = gpu("warm_steps_reuse_every_bind_group") else {
        return;
    };
    let (created_values, created, dispatches) = run(&g, false, 12, 4);
    assert!(dispatches >= 20, "{dispatches} dispatches in 4 steps");
    assert_eq!(
        created, dispatches,
        "without reuse every dispatch creates its bind group"
    );
    let (reused_values, created, dispatches) = run(&g, true, 12, 4);
    assert!(dispatches >= 20, "{dispatches} dispatches in 4 steps");
    assert_eq!(
        created, 0,
        "warm steps bind the buffers earlier steps bound: {created} of {dispatches} dispatches created a bind group"
    );
    assert_eq!(
        created_values.len(),
        4 + 1024,
        "the summed row sums and the parameter"
    );
    let differ = created_values
        .iter()
        .zip(&reused_values)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    assert_eq!(
        differ,
        0,
        "reused bind groups changed {differ} of {} values",
        created_values.len()
    );
}

#[test]
fn turning_reuse_off_empties_the_cache_and_trimming_the_pool_does_too() {
    let Some((g, _l)) = gpu("turning_reuse_off_empties_the_cache") else {
        return;
    };
    run(&g, true, 3, 1);
    assert!(g.bind_groups().len() > 0, "the steps filled the cache");
    g.bind_groups().set_reuse(false);
    assert_eq!(g.bind_groups().len(), 0);
    assert_eq!(crate::gpu::info().unwrap().bind_groups, "create");
    g.bind_groups().set_reuse(true);
    assert_eq!(crate::gpu::info().unwrap().bind_groups, "reuse");
    run(&g, true, 3, 1);
    g.trim_pool();
    assert_eq!(
        g.bind_groups().len(),
        0,
        "a trimmed pool must not stay alive through cached bind groups"
    );
}

/// The pool hands out the free buffer it created first, whatever the order buffers came back
/// in: a last-in-first-out list would give `b` here, and the next step's buffers would differ.
#[test]
fn the_pool_hands_out_the_free_buffer_it_created_first() {
    let Some((g, _l)) = gpu("the_pool_hands_out_the_free_buffer_it_created_first") else {
        return;
    };
    let pool = g.private_pool();
    let take = || pool.take(Kind::Storage, 1000).unwrap();
    let (a, b, c) = (take(), take(), take());
    let (a_raw, b_raw, c_raw) = (a.raw().clone(), b.raw().clone(), c.raw().clone());
    drop(c);
    drop(a);
    drop(b);
    let first = take();
    assert!(
        first.raw() == &a_raw,
        "the first-created free buffer comes first"
    );
    let second = take();
    assert!(second.raw() == &b_raw, "then the second");
    drop(first);
    let third = take();
    assert!(third.raw() == &a_raw, "a returned buffer is first again");
    assert!(take().raw() == &c_raw, "and the last-created comes last");
}

#[test]
fn the_setting_reads_reuse_or_create_and_names_anything_else() {
    use crate::backend::gpu::bind_group_cache::reuse_from_setting;
    assert!(reuse_from_setting(None).unwrap());
    assert!(reuse_from_setting(Some("reuse")).unwrap());
    assert!(!reuse_from_setting(Some(" create")).unwrap());
    let err = reuse_from_setting(Some("never")).unwrap_err().to_string();
    assert!(err.contains("MOEGRAD_BIND_GROUPS=\"never\""), "{err}");
}
