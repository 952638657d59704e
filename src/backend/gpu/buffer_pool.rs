//! The buffer pool: wgpu buffers recycled by size class, so a steady-state training step
//! allocates nothing on the device.
//!
//! A request for `n` bytes is served from the class `max(256, n.next_power_of_two())` (capped at
//! the device's `max_buffer_size`). Buffers are handed out wrapped in a [`PooledBuffer`]; when the
//! last `Arc` of it drops (the last `GpuBuffer` clone, and the pending batch that referenced it,
//! see `encoder.rs`) the wgpu buffer goes back on its class's free list, never to the driver.
//! Two kinds are pooled separately: storage buffers (what kernels read and write) and staging
//! buffers (mappable, used by `download`). [`Pool::stats`] counts storage bytes checked out now
//! and the peak since [`Pool::reset_peak`]; `Pool::trim` releases the free lists
//! (`moegrad::gpu::release_free_memory`).
//!
//! **Which free buffer.** A request takes the free buffer of its class that the pool created
//! first (the lowest serial number), not the one freed last. The choice never changes how many
//! buffers a step needs, but it makes the step's buffers the same ones every step: the free
//! lists at the start of a step then hold the same buffers as at the start of the one before,
//! and the same requests in the same order get the same answers. A last-in-first-out list would
//! hand them out in an order that keeps shifting from step to step, and every dispatch would
//! bind a new combination of buffers: with the same buffers each step, every dispatch finds
//! its bind group in the cache (`bind_group_cache.rs`; measured in docs/benchmarks.md).

use super::stats::Counters as GpuCounters;
use crate::{Error, Result};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// The smallest size class, in bytes.
pub(crate) const MIN_CLASS: u64 = 256;

/// What a pooled buffer is for (each kind has its own free lists and usage flags).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Kind {
    /// read/written by kernels, copied to and from
    Storage,
    /// mapped for reading by `download`
    Staging,
}

impl Kind {
    fn usage(self) -> wgpu::BufferUsages {
        match self {
            Kind::Storage => {
                wgpu::BufferUsages::STORAGE
                    | wgpu::BufferUsages::COPY_SRC
                    | wgpu::BufferUsages::COPY_DST
            }
            Kind::Staging => wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        }
    }
}

/// Byte counters of the storage pool.
#[derive(Default)]
struct Counters {
    in_use: u64,
    peak: u64,
}

/// Free buffers by (kind, size class), each list by the serial number its buffer was created
/// with (see [`Pool::take`]).
type FreeLists = HashMap<(Kind, u64), BTreeMap<u64, wgpu::Buffer>>;

/// Free lists by (kind, size class) and the counters.
pub(crate) struct Pool {
    device: wgpu::Device,
    max_buffer_size: u64,
    /// the backend's counters (a creation is a pool miss)
    counters: Arc<GpuCounters>,
    free: Mutex<(FreeLists, Counters)>,
    /// the serial number of the next buffer created
    next_serial: AtomicU64,
}

/// A buffer checked out of the pool; it returns itself to its free list on drop.
pub(crate) struct PooledBuffer {
    buffer: Option<wgpu::Buffer>,
    /// the buffer's serial number, in the order the pool created its buffers
    serial: u64,
    kind: Kind,
    class: u64,
    pool: Arc<Pool>,
}

impl PooledBuffer {
    /// What it is for and its size class: the free list it returns to.
    pub(super) fn slot(&self) -> (Kind, u64) {
        (self.kind, self.class)
    }

    /// The wgpu buffer (its size is the class size, at least the bytes asked for).
    pub(crate) fn raw(&self) -> &wgpu::Buffer {
        self.buffer
            .as_ref()
            .expect("a pooled buffer holds its wgpu buffer until dropped")
    }
}

impl Drop for PooledBuffer {
    fn drop(&mut self) {
        if let Some(b) = self.buffer.take() {
            self.pool.give_back(self.kind, self.class, self.serial, b);
        }
    }
}

impl Pool {
    /// An empty pool for `device`, counting the buffers it creates in `counters`.
    pub(super) fn new(
        device: wgpu::Device,
        max_buffer_size: u64,
        counters: Arc<GpuCounters>,
    ) -> Arc<Pool> {
        Arc::new(Pool {
            device,
            max_buffer_size,
            counters,
            free: Mutex::new((HashMap::new(), Counters::default())),
            next_serial: AtomicU64::new(0),
        })
    }

    /// The size class serving a request of `bytes`.
    pub(super) fn class_of(&self, bytes: u64) -> u64 {
        let c = bytes
            .max(MIN_CLASS)
            .checked_next_power_of_two()
            .unwrap_or(u64::MAX);
        c.min(self.max_buffer_size.max(bytes))
    }

    /// A buffer of at least `bytes` bytes: the free buffer of its class created first, or a new
    /// one. Its contents are whatever the last user left (uninitialised).
    pub(crate) fn take(self: &Arc<Pool>, kind: Kind, bytes: u64) -> Result<Arc<PooledBuffer>> {
        if bytes > self.max_buffer_size {
            return Err(Error::Invalid(format!(
                "a GPU buffer of {bytes} bytes exceeds the device's max_buffer_size ({})",
                self.max_buffer_size
            )));
        }
        let class = self.class_of(bytes);
        let reused = {
            let mut g = self.free.lock().unwrap_or_else(|p| p.into_inner());
            let b = g.0.get_mut(&(kind, class)).and_then(|v| v.pop_first());
            if kind == Kind::Storage {
                g.1.in_use += class;
                g.1.peak = g.1.peak.max(g.1.in_use);
            }
            b
        };
        let (serial, buffer) = match reused {
            Some(b) => b,
            None => match self.create(kind, class) {
                Ok(b) => (self.next_serial.fetch_add(1, Ordering::Relaxed), b),
                Err(e) => {
                    if kind == Kind::Storage {
                        let mut g = self.free.lock().unwrap_or_else(|p| p.into_inner());
                        g.1.in_use -= class;
                    }
                    return Err(e);
                }
            },
        };
        Ok(Arc::new(PooledBuffer {
            buffer: Some(buffer),
            serial,
            kind,
            class,
            pool: self.clone(),
        }))
    }

    /// Whether a request of `bytes` would be served from a free list (not created).
    pub(super) fn has_free(&self, kind: Kind, bytes: u64) -> bool {
        let class = self.class_of(bytes);
        let g = self.free.lock().unwrap_or_else(|p| p.into_inner());
        g.0.get(&(kind, class)).is_some_and(|v| !v.is_empty())
    }

    /// Creates a new wgpu buffer, catching out-of-memory and validation errors in a scope.
    fn create(&self, kind: Kind, class: u64) -> Result<wgpu::Buffer> {
        self.counters.buffer_created();
        let oom = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let val = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let buffer = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("moegrad pool"),
            size: class,
            usage: kind.usage(),
            mapped_at_creation: false,
        });
        let v = pollster::block_on(val.pop());
        let o = pollster::block_on(oom.pop());
        match v.or(o) {
            Some(e) => Err(Error::Gpu(format!(
                "creating a {class}-byte GPU buffer failed: {e}"
            ))),
            None => Ok(buffer),
        }
    }

    fn give_back(&self, kind: Kind, class: u64, serial: u64, buffer: wgpu::Buffer) {
        let mut g = self.free.lock().unwrap_or_else(|p| p.into_inner());
        if kind == Kind::Storage {
            g.1.in_use = g.1.in_use.saturating_sub(class);
        }
        g.0.entry((kind, class)).or_default().insert(serial, buffer);
    }

    /// `(in_use_bytes, peak_bytes)` of the storage pool.
    pub(super) fn stats(&self) -> (u64, u64) {
        let g = self.free.lock().unwrap_or_else(|p| p.into_inner());
        (g.1.in_use, g.1.peak)
    }

    /// Restarts the peak counter at the bytes in use now.
    pub(super) fn reset_peak(&self) {
        let mut g = self.free.lock().unwrap_or_else(|p| p.into_inner());
        g.1.peak = g.1.in_use;
    }

    /// Bytes sitting on the free lists (storage and staging).
    #[cfg(test)]
    pub fn free_bytes(&self) -> u64 {
        let g = self.free.lock().unwrap_or_else(|p| p.into_inner());
        g.0.iter().map(|(&(_, c), v)| c * v.len() as u64).sum()
    }

    /// Releases every free buffer to the driver (buffers in use are untouched).
    pub fn trim(&self) {
        let mut g = self.free.lock().unwrap_or_else(|p| p.into_inner());
        g.0.clear();
    }
}
