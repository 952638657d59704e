//! Counters of what the GPU backend asks of the driver: kernel dispatches, queue submissions,
//! host waits, buffers and bind groups created, bytes uploaded and downloaded.
//!
//! These are the costs that decide a step's speed on a real GPU beyond the kernels themselves,
//! and unlike timings they can be counted on any adapter, Mesa's lavapipe included. Each is one
//! relaxed atomic add at the place the work is asked for (`encoder.rs` counts dispatches,
//! submissions and parameter uploads, `buffer_pool.rs` buffer creations, `mod.rs` uploads, downloads
//! and waits), so counting costs nothing measurable. The counters are process-wide, like the GPU
//! context: [`GpuStats`] is a snapshot of them, read with `GpuBackend::stats` or
//! [`crate::Device::gpu_stats`] and restarted with `GpuBackend::reset_stats`.

use serde::Serialize;
use std::sync::atomic::{AtomicU64, Ordering};

/// A snapshot of the GPU backend's counters since the context opened or the last reset.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct GpuStats {
    /// compute dispatches recorded (one per kernel launch)
    pub dispatches: u64,
    /// command buffers submitted to the queue (a batch of dispatches, or a download's copy)
    pub submits: u64,
    /// times the host blocked until the device finished: one per download (`to_vec`, `item`)
    /// and one per `synchronize`
    pub host_waits: u64,
    /// device buffers created by the driver: pool misses (storage or download staging), plus
    /// the parameter arena when the context opens; zero when every buffer is reused
    pub buffers_created: u64,
    /// bind groups created (a dispatch's binding of its buffers; see `bind_group_cache.rs`):
    /// zero in a steady step, where every dispatch binds buffers an earlier step bound
    pub bind_groups_created: u64,
    /// bytes written from the host to the device: tensor uploads plus the kernels' parameter
    /// blocks
    pub uploaded_bytes: u64,
    /// of `uploaded_bytes`, the kernels' parameter blocks (shapes, strides, hyper-parameters)
    pub param_bytes: u64,
    /// bytes read back from the device to the host
    pub downloaded_bytes: u64,
    /// bytes of the storage buffers bound to the dispatches (every kernel's operands and
    /// outputs, each distinct buffer counted once per dispatch, even where it is bound at
    /// several slots): the memory traffic the kernels ask for, an upper bound on what they move
    /// (a kernel may read part of a buffer, or read it through a cache); halved where tensors
    /// are f16
    pub bound_bytes: u64,
}

/// The live counters (one per [`GpuStats`] field).
#[derive(Default)]
pub(crate) struct Counters {
    dispatches: AtomicU64,
    submits: AtomicU64,
    host_waits: AtomicU64,
    buffers_created: AtomicU64,
    bind_groups_created: AtomicU64,
    uploaded_bytes: AtomicU64,
    param_bytes: AtomicU64,
    downloaded_bytes: AtomicU64,
    bound_bytes: AtomicU64,
}

/// Adds `n` to `c`.
fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

impl Counters {
    /// One dispatch recorded, binding storage buffers of `bound` bytes in all.
    pub(super) fn dispatch(&self, bound: u64) {
        add(&self.dispatches, 1);
        add(&self.bound_bytes, bound);
    }
    /// One command buffer submitted.
    pub(super) fn submit(&self) {
        add(&self.submits, 1);
    }
    /// The host waited for the device once.
    pub(super) fn host_wait(&self) {
        add(&self.host_waits, 1);
    }
    /// The driver created one buffer.
    pub(super) fn buffer_created(&self) {
        add(&self.buffers_created, 1);
    }
    /// The driver created one bind group.
    pub(super) fn bind_group_created(&self) {
        add(&self.bind_groups_created, 1);
    }
    /// `bytes` of tensor data written to the device.
    pub(super) fn uploaded(&self, bytes: u64) {
        add(&self.uploaded_bytes, bytes);
    }
    /// `bytes` of kernel parameters written to the device (counted in the uploads too).
    pub(super) fn params_uploaded(&self, bytes: u64) {
        add(&self.uploaded_bytes, bytes);
        add(&self.param_bytes, bytes);
    }
    /// `bytes` read back to the host.
    pub(super) fn downloaded(&self, bytes: u64) {
        add(&self.downloaded_bytes, bytes);
    }

    /// The counts now.
    pub(super) fn snapshot(&self) -> GpuStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        GpuStats {
            dispatches: get(&self.dispatches),
            submits: get(&self.submits),
            host_waits: get(&self.host_waits),
            buffers_created: get(&self.buffers_created),
            bind_groups_created: get(&self.bind_groups_created),
            uploaded_bytes: get(&self.uploaded_bytes),
            param_bytes: get(&self.param_bytes),
            downloaded_bytes: get(&self.downloaded_bytes),
            bound_bytes: get(&self.bound_bytes),
        }
    }

    /// Sets every counter back to zero.
    pub(super) fn reset(&self) {
        for c in [
            &self.dispatches,
            &self.submits,
            &self.host_waits,
            &self.buffers_created,
            &self.bind_groups_created,
            &self.uploaded_bytes,
            &self.param_bytes,
            &self.downloaded_bytes,
            &self.bound_bytes,
        ] {
            c.store(0, Ordering::Relaxed);
        }
    }
}

impl GpuStats {
    /// The counts of `self` less those of an earlier snapshot `before` (what happened between).
    pub fn since(&self, before: &GpuStats) -> GpuStats {
        GpuStats {
            dispatches: self.dispatches.saturating_sub(before.dispatches),
            submits: self.submits.saturating_sub(before.submits),
            host_waits: self.host_waits.saturating_sub(before.host_waits),
            buffers_created: self.buffers_created.saturating_sub(before.buffers_created),
            bind_groups_created: self
                .bind_groups_created
                .saturating_sub(before.bind_groups_created),
            uploaded_bytes: self.uploaded_bytes.saturating_sub(before.uploaded_bytes),
            param_bytes: self.param_bytes.saturating_sub(before.param_bytes),
            downloaded_bytes: self
                .downloaded_bytes
                .saturating_sub(before.downloaded_bytes),
            bound_bytes: self.bound_bytes.saturating_sub(before.bound_bytes),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_add_snapshot_and_reset() {
        let c = Counters::default();
        c.dispatch(64);
        c.dispatch(16);
        c.submit();
        c.host_wait();
        c.buffer_created();
        c.bind_group_created();
        c.bind_group_created();
        c.uploaded(100);
        c.params_uploaded(32);
        c.downloaded(8);
        let s = c.snapshot();
        assert_eq!(
            s,
            GpuStats {
                dispatches: 2,
                submits: 1,
                host_waits: 1,
                buffers_created: 1,
                bind_groups_created: 2,
                uploaded_bytes: 132,
                param_bytes: 32,
                downloaded_bytes: 8,
                bound_bytes: 80,
            }
        );
        c.dispatch(4);
        assert_eq!(c.snapshot().since(&s).dispatches, 1);
        assert_eq!(c.snapshot().since(&s).uploaded_bytes, 0);
        c.reset();
        assert_eq!(c.snapshot(), GpuStats::default());
    }
}
