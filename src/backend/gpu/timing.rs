//! GPU time per kernel from timestamp queries: the GPU half of the step profile
//! (`crate::profile`), for the kernels launched by a thread while it records (inside the steps,
//! once steps are marked).
//!
//! On the GPU an op's wall time is only the time to encode its kernels, so the profile asks the
//! device itself. While profiling, and where the adapter has `Features::TIMESTAMP_QUERY`, the
//! batcher (`encoder.rs`) gives every dispatch a compute pass of its own whose beginning and end
//! write a timestamp into the batch's query set ([`Slot`]; one pair per dispatch, at most
//! `MAX_BATCH` per batch). When the batch is submitted the query set is resolved and copied into
//! a mappable buffer, which is mapped without waiting: finished read-backs are collected at later
//! submits, and the rest when the report is taken ([`report`], which waits for the device and
//! for the map callbacks of this thread's read-backs).
//! So profiling adds no host wait inside a step; it does split the batch's one compute pass into
//! one pass per dispatch, which may cost a little GPU time of its own.
//!
//! A kernel is named `shader.entry_point` (e.g. `matmul.matmul_tiled`); its time is the sum over
//! its dispatches of end minus beginning, converted with the queue's timestamp period. The times
//! are kept per launching thread, as the op times are, so profiles of different threads (tests
//! running in parallel) do not mix. Without timestamp queries the dispatches are only counted,
//! and the report says so.

use super::GpuBackend;
use super::context::Context;
use super::encoder::MAX_BATCH;
use crate::profile::{GpuProfile, KernelTime};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::ThreadId;

/// Bytes of one resolved timestamp.
const TIMESTAMP_BYTES: u64 = 8;

/// How long a report waits for a finished read-back's map callback (see
/// `Timer::wait_for_thread`).
const READBACK_PATIENCE: std::time::Duration = std::time::Duration::from_secs(10);

/// What the map callback of a read-back reports.
type MapStatus = Arc<Mutex<Option<std::result::Result<(), wgpu::BufferAsyncError>>>>;

/// The timestamp queries of one batch: two per dispatch, the buffers they are resolved and read
/// back through, and the kernel of each dispatch with the thread that launched it.
pub(crate) struct Slot {
    queries: wgpu::QuerySet,
    resolved: wgpu::Buffer,
    readback: wgpu::Buffer,
    kernels: Vec<(Arc<str>, ThreadId)>,
    mapped: MapStatus,
}

impl Slot {
    fn new(ctx: &Context) -> Slot {
        let bytes = 2 * MAX_BATCH as u64 * TIMESTAMP_BYTES;
        let buffer = |label, usage| {
            ctx.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: bytes,
                usage,
                mapped_at_creation: false,
            })
        };
        Slot {
            queries: ctx.device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("moegrad profile timestamps"),
                ty: wgpu::QueryType::Timestamp,
                count: 2 * MAX_BATCH as u32,
            }),
            resolved: buffer(
                "moegrad profile timestamps (resolved)",
                wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            ),
            readback: buffer(
                "moegrad profile timestamps (read back)",
                wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            ),
            kernels: Vec::with_capacity(MAX_BATCH),
            mapped: Arc::new(Mutex::new(None)),
        }
    }

    /// Whether another dispatch fits.
    pub(crate) fn is_full(&self) -> bool {
        self.kernels.len() >= MAX_BATCH
    }

    /// Reserves the timestamps of the next dispatch, of `kernel`; returns the pass's writes.
    pub(crate) fn next(&mut self, kernel: &Arc<str>) -> wgpu::ComputePassTimestampWrites<'_> {
        let i = self.kernels.len() as u32;
        self.kernels
            .push((kernel.clone(), std::thread::current().id()));
        wgpu::ComputePassTimestampWrites {
            query_set: &self.queries,
            beginning_of_pass_write_index: Some(2 * i),
            end_of_pass_write_index: Some(2 * i + 1),
        }
    }

    /// Appends to `encoder` the resolve of the written timestamps and their copy into the
    /// mappable buffer.
    pub(crate) fn resolve(&self, encoder: &mut wgpu::CommandEncoder) {
        let n = 2 * self.kernels.len() as u32;
        if n == 0 {
            return;
        }
        encoder.resolve_query_set(&self.queries, 0..n, &self.resolved, 0);
        encoder.copy_buffer_to_buffer(
            &self.resolved,
            0,
            &self.readback,
            0,
            n as u64 * TIMESTAMP_BYTES,
        );
    }
}

/// Calls and nanoseconds per kernel (of one launching thread).
#[derive(Clone, Default)]
struct Tables {
    /// timed dispatches: calls and summed GPU nanoseconds
    timed: HashMap<Arc<str>, (u64, f64)>,
    /// dispatches counted without timestamps (the adapter has none)
    counted: HashMap<Arc<str>, u64>,
}

struct State {
    free: Vec<Slot>,
    /// submitted, waiting for their read-back
    pending: Vec<Slot>,
    /// per launching thread
    tables: HashMap<ThreadId, Tables>,
}

/// The per-kernel timer of the batcher.
pub(crate) struct Timer {
    /// the device has `Features::TIMESTAMP_QUERY`
    supported: bool,
    /// nanoseconds per timestamp tick
    period_ns: f64,
    state: Mutex<State>,
}

impl Timer {
    /// A timer for the device of `ctx` (idle until a profile records).
    pub(crate) fn new(ctx: &Context) -> Timer {
        Timer {
            supported: ctx.features.contains(wgpu::Features::TIMESTAMP_QUERY),
            period_ns: ctx.queue.get_timestamp_period() as f64,
            state: Mutex::new(State {
                free: Vec::new(),
                pending: Vec::new(),
                tables: HashMap::new(),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether a dispatch launched now is to be profiled (the launching thread records a
    /// profile, inside a step once steps are marked).
    pub(crate) fn profiling(&self) -> bool {
        crate::profile::records_now()
    }

    /// Whether profiled dispatches get timestamps (else they are only counted).
    pub(crate) fn has_timestamps(&self) -> bool {
        self.supported
    }

    /// Counts a dispatch of `kernel`, launched by this thread, that gets no timestamps.
    pub(crate) fn count(&self, kernel: &Arc<str>) {
        let thread = std::thread::current().id();
        let mut state = self.lock();
        let tables = state.tables.entry(thread).or_default();
        *tables.counted.entry(kernel.clone()).or_default() += 1;
    }

    /// A slot for a batch's timestamps (a recycled one when available).
    pub(crate) fn slot(&self, ctx: &Context) -> Slot {
        self.lock().free.pop().unwrap_or_else(|| Slot::new(ctx))
    }

    /// After the submit that resolved `slot`: maps its read-back without waiting and collects
    /// the read-backs that have finished since.
    pub(crate) fn submitted(&self, ctx: &Context, slot: Slot) {
        if slot.kernels.is_empty() {
            self.lock().free.push(slot);
            return;
        }
        let status = slot.mapped.clone();
        let bytes = 2 * slot.kernels.len() as u64 * TIMESTAMP_BYTES;
        slot.readback
            .map_async(wgpu::MapMode::Read, 0..bytes, move |r| {
                *status.lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
            });
        let mut state = self.lock();
        state.pending.push(slot);
        // runs the callbacks of finished work without blocking
        let _ = ctx.device.poll(wgpu::PollType::Poll);
        self.collect(&mut state);
    }

    /// Adds every mapped read-back to the tables and recycles its slot.
    fn collect(&self, state: &mut State) {
        let mut still = Vec::new();
        for mut slot in std::mem::take(&mut state.pending) {
            let status = slot.mapped.lock().unwrap_or_else(|p| p.into_inner()).take();
            match status {
                None => still.push(slot),
                // a failed map loses that batch's times; the slot is dropped
                Some(Err(_)) => {}
                Some(Ok(())) => {
                    let bytes = 2 * slot.kernels.len() as u64 * TIMESTAMP_BYTES;
                    if let Ok(view) = slot.readback.get_mapped_range(0..bytes) {
                        let ticks: &[u64] = bytemuck::cast_slice(&view);
                        for ((kernel, thread), pair) in
                            slot.kernels.iter().zip(ticks.chunks_exact(2))
                        {
                            let ns = pair[1].saturating_sub(pair[0]) as f64 * self.period_ns;
                            let tables = state.tables.entry(*thread).or_default();
                            let t = tables.timed.entry(kernel.clone()).or_default();
                            t.0 += 1;
                            t.1 += ns;
                        }
                    }
                    slot.readback.unmap();
                    slot.kernels.clear();
                    state.free.push(slot);
                }
            }
        }
        state.pending = still;
    }

    /// Waits until every submitted read-back holding a dispatch of `thread` has been collected;
    /// returns the state locked.
    ///
    /// Waiting for the device is not enough: wgpu gathers the map callbacks of finished work
    /// under its lock and runs them after releasing it, so a poll or submit on another thread
    /// may hold this thread's callbacks while our own poll returns with nothing left to wait
    /// for. Those callbacks run moments later; without this wait the report would silently lose
    /// the last batches of the step (seen under parallel tests). A read-back still not mapped
    /// after [`READBACK_PATIENCE`] (a lost device) is left out of the report.
    fn wait_for_thread(&self, ctx: &Context, thread: ThreadId) -> MutexGuard<'_, State> {
        let started = std::time::Instant::now();
        loop {
            let _ = ctx.device.poll(wgpu::PollType::wait_indefinitely());
            let mut state = self.lock();
            self.collect(&mut state);
            let waiting = state
                .pending
                .iter()
                .any(|slot| slot.kernels.iter().any(|(_, t)| *t == thread));
            if !waiting || started.elapsed() > READBACK_PATIENCE {
                return state;
            }
            drop(state);
            std::thread::yield_now();
        }
    }

    /// Forgets the times of the kernels this thread launched.
    fn reset(&self) {
        self.lock().tables.remove(&std::thread::current().id());
    }
}

/// Clears this thread's kernel tables when its profile starts (only if the GPU is open: this
/// never opens it).
pub(crate) fn start() {
    if let Some(gpu) = GpuBackend::opened() {
        gpu.inner.batcher.timer.reset();
    }
}

/// The GPU time per kernel this thread launched since its profile started, after submitting the
/// pending batch and waiting for the device; `None` when the GPU was not opened or this thread
/// ran no kernel while profiling. With `clear`, this thread's tables are removed.
pub(crate) fn report(clear: bool) -> Option<GpuProfile> {
    let gpu = GpuBackend::opened()?;
    let inner = &gpu.inner;
    inner.batcher.flush(&inner.ctx);
    let timer = &inner.batcher.timer;
    let thread = std::thread::current().id();
    let mut state = timer.wait_for_thread(&inner.ctx, thread);
    let tables = if clear {
        state.tables.remove(&thread)
    } else {
        state.tables.get(&thread).cloned()
    };
    drop(state);
    let tables = tables.filter(|t| !t.timed.is_empty() || !t.counted.is_empty())?;
    let mut kernels: Vec<KernelTime> = tables
        .timed
        .iter()
        .map(|(k, &(calls, ns))| KernelTime {
            kernel: k.to_string(),
            calls,
            ms: Some(ns / 1e6),
        })
        .chain(tables.counted.iter().map(|(k, &calls)| KernelTime {
            kernel: k.to_string(),
            calls,
            ms: None,
        }))
        .collect();
    kernels.sort_by(|a, b| {
        b.ms.unwrap_or(0.0)
            .total_cmp(&a.ms.unwrap_or(0.0))
            .then(b.calls.cmp(&a.calls))
            .then_with(|| a.kernel.cmp(&b.kernel))
    });
    let info = &inner.ctx.adapter_info;
    let note = if timer.supported {
        "GPU time per kernel from timestamp queries (while profiling, each dispatch runs in a \
         compute pass of its own); the op times above are the host's time to encode the kernels"
            .to_string()
    } else {
        format!(
            "this adapter ({:?}) has no timestamp queries (wgpu Features::TIMESTAMP_QUERY): only \
             the dispatches per kernel are counted, and the op times above are the host's time \
             to encode the kernels, not GPU time",
            info.backend
        )
    };
    Some(GpuProfile {
        adapter: info.name.clone(),
        timestamps: timer.supported,
        note,
        kernels,
    })
}
