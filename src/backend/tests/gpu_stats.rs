//! The device's counters (`backend/gpu/stats.rs`) as the batcher fills them: what one dispatch
//! adds to `dispatches` and `bound_bytes`, a buffer bound at two slots of one dispatch counted
//! once.
//!
//! Without a GPU adapter each test prints "skipping ..." and passes; with `MOEGRAD_REQUIRE_GPU=1`
//! a missing adapter fails.

use super::gpu_primitives::*;
use crate::backend::gpu::{GpuBackend, GpuBuffer};
use crate::backend::{BinaryOp, ElementwiseOps};

/// The dispatches and bound bytes of `a + b` (`n` f32 each), the sum's buffer returned.
fn counted_add(g: &GpuBackend, a: &GpuBuffer, b: &GpuBuffer, n: usize) -> (u64, u64, GpuBuffer) {
    g.synchronize().unwrap();
    let before = g.stats();
    let sum = g.binary(BinaryOp::Add, a, &[1], b, &[1], &[n]).unwrap();
    g.synchronize().unwrap();
    let counts = g.stats().since(&before);
    (counts.dispatches, counts.bound_bytes, sum)
}

#[test]
fn a_buffer_bound_twice_in_a_dispatch_is_counted_once() {
    let Some((g, _l)) = gpu("a_buffer_bound_twice_in_a_dispatch_is_counted_once") else {
        return;
    };
    let n = 1024;
    let bytes = 4 * n as u64;
    let x = up(&g, &vec![1.5; n]);
    let y = up(&g, &vec![0.25; n]);
    // x, y and the sum: three buffers of n floats
    let (dispatches, two_inputs, sum) = counted_add(&g, &x, &y, n);
    assert_eq!(dispatches, 1);
    assert_eq!(
        two_inputs,
        3 * bytes,
        "x + y binds three buffers of {bytes} bytes"
    );
    assert_eq!(f32s(g_down(&g, &sum)), vec![1.75; n]);
    // x at both operand slots and the sum: two buffers
    let (dispatches, one_input, sum) = counted_add(&g, &x, &x, n);
    assert_eq!(dispatches, 1);
    assert_eq!(one_input, 2 * bytes, "x + x binds x twice: counted once");
    assert_eq!(f32s(g_down(&g, &sum)), vec![3.0; n]);
}
