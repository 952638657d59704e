//! The backend's own tests: they call the CPU and GPU backends through the family traits, with
//! buffers, layouts and operands a tensor op would never pass (unsorted experts, odd strides and
//! offsets, launches past 65,535 workgroups, codes no op uses), so they live inside the crate,
//! where the backend is visible. What goes through the public tensor API is tested in `tests/`.
//! They share the integration tests' helpers (`tests/common/`, included at the crate root for
//! tests), among them the GPU rule: without an adapter a GPU test prints "skipping ..." and
//! passes, unless `MOEGRAD_REQUIRE_GPU=1`, which turns a missing adapter into a failure.
//!
//! - `cpu_kernels.rs`, `cpu_math.rs`: the CPU's fast kernels against plain loops;
//!   `cpu_matmul_pair.rs`: a matmul's two backward products run side by side.
//! - `gpu_primitives.rs`, `gpu_sort_optim.rs`: each GPU primitive against the CPU backend.
//! - `gpu_bind_groups.rs`: bind groups reused across steps, with the same bits.
//! - `gpu_matmul.rs`: the matrix-product kernels' layouts, grid splits and bad inputs;
//!   `gpu_matmul_kernels.rs`: the kernel choices agree, split-k; `gpu_matmul_tuning.rs`: the
//!   `tuned` choice times each size class once and gives `auto`'s bits.
//! - `folded_grids.rs`: every launch past 65,535 workgroups in one dimension.
//! - `layer_norm_fold.rs`: the norm's backward with its input's pending gradient folded in.
//! - `router_sums.rs`: a step's routing statistics against their definitions, per device.
//! - `backend_codes.rs`: the codes no tensor op reaches, as a property.
//! - `shader_backends.rs`: every built-in WGSL kernel translated for Metal, DX12 and Vulkan.
//! - `invocation_order.rs`: training with every workgroup's invocations permuted, bit for bit.
//! - `barrier_uniformity.rs`: every kernel's barriers in uniform control flow (naga's IR).
//! - `constants.rs`: the block sizes and limits the integration tests pick sizes around.

use std::sync::{Mutex, MutexGuard};

mod backend_codes;
mod barrier_uniformity;
mod constants;
mod cpu_kernels;
mod cpu_math;
mod cpu_matmul_pair;
mod folded_grids;
mod folded_matmul_grids;
mod folded_scatter;
mod gpu_bind_groups;
mod gpu_grouped_wide;
mod gpu_matmul;
mod gpu_matmul_bias;
mod gpu_matmul_kernels;
mod gpu_matmul_tuning;
mod gpu_primitives;
mod gpu_shader_checks;
mod gpu_sort_optim;
mod gpu_stats;
mod invocation_order;
mod layer_norm_fold;
mod matmul_fold;
mod router_sums;
mod routing_fold;
mod shader_backends;

/// Held by every GPU test of these modules, so they run one at a time in the test process: the
/// GPU's counters and buffer pool are process-wide (the pool-reuse and dispatch-count tests read
/// them), and the folding cases each hold a few hundred MB.
pub(super) fn gpu_lock() -> MutexGuard<'static, ()> {
    static GPU: Mutex<()> = Mutex::new(());
    GPU.lock().unwrap_or_else(|p| p.into_inner())
}

/// The GPU kernels (`shader.entry`) this thread dispatches in `f`, from a profile of it: which
/// of a launcher's kernels ran.
pub(super) fn kernels_of(f: impl FnOnce()) -> Vec<String> {
    crate::profile::enable();
    f();
    let report = crate::profile::disable().expect("this thread recorded");
    report.gpu.map_or_else(Vec::new, |g| {
        g.kernels.into_iter().map(|k| k.kernel).collect()
    })
}
