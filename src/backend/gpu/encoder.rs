//! Batched submission: every kernel launch is recorded into one pending command encoder, and the
//! batch goes to the queue in one `submit` when it holds [`MAX_BATCH`] dispatches (or its
//! parameter arena is full), on `flush`/`synchronize`, on `download` (which appends its copy to
//! the batch first), and when the pool would create a buffer that submitting returns (see
//! `GpuBackend::alloc`).
//!
//! * **Parameters.** Each dispatch's small parameter block (`params: &[u32]`, zero-padded to the
//!   size of the kernel's uniform struct) is copied into the next slot of a host-side arena, each
//!   slot as long as its block rounded up to the device's uniform offset alignment (32 bytes on
//!   lavapipe, up to 256 elsewhere); the used part of the arena is written into one uniform
//!   buffer with `queue.write_buffer` just before the batch is submitted, and each dispatch binds
//!   its slot with a dynamic offset. The arena holds [`MAX_BATCH`] slots of the largest size
//!   (256 bytes); the batch is submitted when either runs out. Reusing the one uniform buffer
//!   across batches is safe: a `write_buffer` takes effect at the next submit, after the
//!   previous batch.
//! * **Lifetimes.** The batch holds an `Arc` of every pooled buffer it references until it has
//!   been submitted, so the pool cannot hand such a buffer out again while queued work still
//!   reads or writes it. After submission wgpu orders later work after earlier work.
//! * **Uploads.** `upload`, and `full` for a constant of at most 1 KiB (a zero scalar, the
//!   backward's seed: no dispatch), write into a freshly taken buffer with `queue.write_buffer`
//!   (`GpuBackend::write_fresh`). Such a buffer is not referenced by the pending batch (the
//!   batch would hold it, so it could not have been free), so applying the write before the
//!   whole pending batch at submit is correct.
//! * **Order.** Launches run in the order they were recorded (one compute pass per batch; wgpu puts
//!   the needed barriers between dependent dispatches).
//! * **Bind groups.** Each dispatch binds its parameter slot and storage buffers through a bind
//!   group from the [`BindGroupCache`], which reuses the group of an earlier dispatch that bound
//!   the same buffers (`bind_group_cache.rs`).
//! * **Profiling.** While a profile records, each dispatch gets a compute pass of its own with
//!   timestamp writes where the adapter has them (see `timing.rs`).

use super::bind_group_cache::BindGroupCache;
use super::buffer_pool::PooledBuffer;
use super::context::Context;
use super::stats::Counters;
use super::timing::{Slot, Timer};
use crate::{Error, Result};
use std::sync::{Arc, Mutex, MutexGuard};

/// Dispatches per batch. A larger batch means fewer submissions, but a buffer freed while the
/// pending batch still references it returns to the pool only when the batch is submitted, so
/// it can also hold more memory; `GpuBackend::alloc` therefore submits early when the pool
/// would otherwise grow while the batch holds 32 MiB of such buffers. Measured on lavapipe
/// (docs/benchmarks.md): gpt's step takes 5 submissions and a 156 MB pool peak, against 9 and
/// 152 MB with batches of 64 and 3 and 259 MB with 256 and no early submission.
pub(crate) const MAX_BATCH: usize = 256;

/// The largest parameter block a kernel may take, in bytes.
pub(crate) const MAX_PARAMS: u64 = 256;

/// One kernel dispatch, as [`Batcher::record`] takes it: the compiled kernel, what is bound to
/// it and the grid.
pub(crate) struct Dispatch<'a> {
    /// the kernel's name (`shader.entry`), for the profile
    pub name: &'a Arc<str>,
    /// the compiled kernel
    pub pipeline: &'a wgpu::ComputePipeline,
    /// its bind group layout
    pub layout: &'a wgpu::BindGroupLayout,
    /// the storage buffers, bindings 1..
    pub storage: &'a [StorageBinding<'a>],
    /// the parameter words (binding 0)
    pub params: &'a [u32],
    /// the size in bytes of the kernel's parameter block (`params` is zero-padded to it)
    pub params_block: u64,
    /// the number of workgroups along x, y, z
    pub groups: [u32; 3],
}

/// One storage binding of a dispatch: binding number, buffer, bytes bound.
pub(crate) struct StorageBinding<'a> {
    /// `@binding(n)` in the shader (1..)
    pub binding: u32,
    /// the pooled buffer (held by the batch until submitted)
    pub buffer: &'a Arc<PooledBuffer>,
    /// bytes bound from offset 0 (a multiple of 4, at least 4)
    pub size: u64,
}

/// The bytes `storage[i]` adds to a dispatch's bound bytes: its buffer's largest range among the
/// dispatch's bindings where `i` is that buffer's first binding, else 0. A buffer bound at
/// several slots (q, k and v packed in one, an operand standing in for an input a kernel does
/// not read, such as the matmul's pending gradient when there is none) is counted once.
fn distinct_bytes(storage: &[StorageBinding], i: usize) -> u64 {
    let same = |t: &&StorageBinding| Arc::ptr_eq(t.buffer, storage[i].buffer);
    if storage[..i].iter().any(|t| same(&t)) {
        return 0;
    }
    storage[i..]
        .iter()
        .filter(same)
        .map(|t| t.size)
        .max()
        .unwrap_or(0)
}

/// The work recorded since the last submit.
#[derive(Default)]
struct Batch {
    encoder: Option<wgpu::CommandEncoder>,
    pass: Option<wgpu::ComputePass<'static>>,
    dispatches: usize,
    params: Vec<u8>,
    hold: Vec<Arc<PooledBuffer>>,
    /// the timestamps of this batch's dispatches, while profiling
    timed: Option<Slot>,
}

/// The pending batch, the uniform arena it binds, and the submission logic.
pub(crate) struct Batcher {
    batch: Mutex<Batch>,
    arena: wgpu::Buffer,
    /// bytes of the arena
    arena_size: u64,
    /// the device's uniform buffer offset alignment (every slot starts at a multiple)
    align: u64,
    /// the backend's counters (dispatches, submissions, parameter bytes, bind groups)
    counters: Arc<Counters>,
    /// bind groups by the buffers they bind, reused across dispatches and steps
    pub(super) bind_groups: Mutex<BindGroupCache>,
    /// GPU time per kernel while a profile records
    pub(crate) timer: Timer,
}

impl Batcher {
    /// A batcher with an empty batch and a uniform arena of [`MAX_BATCH`] slots, reusing bind
    /// groups or not (see `bind_group_cache.rs`).
    pub(super) fn new(ctx: &Context, counters: Arc<Counters>, reuse_bind_groups: bool) -> Batcher {
        let align = (ctx.limits.min_uniform_buffer_offset_alignment as u64).max(16);
        let arena_size = MAX_PARAMS.next_multiple_of(align) * MAX_BATCH as u64;
        let arena = ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("moegrad params arena"),
            size: arena_size,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        counters.buffer_created();
        Batcher {
            batch: Mutex::new(Batch::default()),
            arena,
            arena_size,
            align,
            counters,
            bind_groups: Mutex::new(BindGroupCache::new(reuse_bind_groups)),
            timer: Timer::new(ctx),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Batch> {
        self.batch.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records one [`Dispatch`] with bind group 0 = params slot (binding 0, dynamic offset) plus
    /// its storage bindings, submitting first if the batch is full.
    pub(super) fn record(&self, ctx: &Context, dispatch: Dispatch<'_>) -> Result<()> {
        let Dispatch {
            name,
            pipeline,
            layout,
            storage,
            params,
            params_block: block,
            groups,
        } = dispatch;
        let param_bytes: &[u8] = bytemuck::cast_slice(params);
        // the bound range: the block, at least 16 bytes, a multiple of 16
        let bound = block
            .max(param_bytes.len() as u64)
            .max(16)
            .next_multiple_of(16);
        if bound > MAX_PARAMS {
            return Err(Error::Invalid(format!(
                "kernel parameters of {bound} bytes exceed the {MAX_PARAMS}-byte limit"
            )));
        }
        let slot = bound.next_multiple_of(self.align);
        let mut b = self.lock();
        if b.dispatches >= MAX_BATCH || b.params.len() as u64 + slot > self.arena_size {
            self.submit_locked(ctx, &mut b);
        }
        let offset = b.params.len() as u64;
        b.params.extend_from_slice(param_bytes);
        b.params.resize((offset + slot) as usize, 0);

        let bind_group = self
            .bind_groups
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&ctx.device, layout, &self.arena, bound, storage, || {
                self.counters.bind_group_created()
            });
        if b.encoder.is_none() {
            b.encoder = Some(
                ctx.device
                    .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None }),
            );
        }
        let profiling = self.timer.profiling();
        if profiling && self.timer.has_timestamps() {
            // a pass of its own, timestamped at its beginning and end
            b.pass = None;
            if b.timed.as_ref().is_none_or(Slot::is_full) {
                b.timed = Some(self.timer.slot(ctx));
            }
            let batch = &mut *b;
            let (enc, slot) = (batch.encoder.as_mut(), batch.timed.as_mut());
            let (enc, slot) = (enc.expect("created above"), slot.expect("taken above"));
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: None,
                timestamp_writes: Some(slot.next(name)),
            });
            pass.set_pipeline(pipeline);
            pass.set_bind_group(0, &bind_group, &[offset as u32]);
            pass.dispatch_workgroups(groups[0], groups[1], groups[2]);
        } else {
            if profiling {
                self.timer.count(name);
            }
            if b.pass.is_none() {
                let enc = b.encoder.as_mut().expect("encoder created above");
                let pass = enc
                    .begin_compute_pass(&wgpu::ComputePassDescriptor {
                        label: None,
                        timestamp_writes: None,
                    })
                    .forget_lifetime();
                b.pass = Some(pass);
            }
            let pass = b.pass.as_mut().expect("pass begun above");
            pass.set_pipeline(pipeline);
            pass.set_bind_group(0, &bind_group, &[offset as u32]);
            pass.dispatch_workgroups(groups[0], groups[1], groups[2]);
        }
        let mut bound = 0;
        for (i, s) in storage.iter().enumerate() {
            b.hold.push(s.buffer.clone());
            bound += distinct_bytes(storage, i);
        }
        b.dispatches += 1;
        self.counters.dispatch(bound);
        if b.dispatches >= MAX_BATCH {
            self.submit_locked(ctx, &mut b);
        }
        Ok(())
    }

    /// Ends the pass, writes the parameter arena and submits the batch (if there is one).
    fn submit_locked(&self, ctx: &Context, b: &mut Batch) -> Option<wgpu::SubmissionIndex> {
        b.pass = None;
        let mut enc = b.encoder.take()?;
        let timed = b.timed.take();
        if let Some(slot) = &timed {
            slot.resolve(&mut enc);
        }
        if !b.params.is_empty() {
            ctx.queue.write_buffer(&self.arena, 0, &b.params);
            self.counters.params_uploaded(b.params.len() as u64);
        }
        let index = ctx.queue.submit([enc.finish()]);
        self.counters.submit();
        if let Some(slot) = timed {
            self.timer.submitted(ctx, slot);
        }
        b.params.clear();
        b.dispatches = 0;
        b.hold.clear();
        Some(index)
    }

    /// Whether `buf` is referenced only by the caller's handle and by the pending batch (whose
    /// kernels were recorded earlier and so run before anything recorded next): a kernel may
    /// then overwrite it in place. Counted under the batch's lock, so no hold is added meanwhile.
    pub(super) fn only_held_by_batch(&self, buf: &Arc<PooledBuffer>) -> bool {
        let b = self.lock();
        let held = b.hold.iter().filter(|h| Arc::ptr_eq(h, buf)).count();
        Arc::strong_count(buf) == held + 1
    }

    /// `(bytes, of_slot)`: the bytes of the buffers that only the pending batch still
    /// references (submitting it returns them to the pool), and whether one of them is of the
    /// pool's free list `slot`.
    pub(super) fn freeable(&self, slot: (super::buffer_pool::Kind, u64)) -> (u64, bool) {
        let b = self.lock();
        let mut held: std::collections::HashMap<*const PooledBuffer, (usize, &Arc<PooledBuffer>)> =
            std::collections::HashMap::with_capacity(b.hold.len());
        for h in &b.hold {
            held.entry(Arc::as_ptr(h)).or_insert((0, h)).0 += 1;
        }
        let (mut bytes, mut of_slot) = (0, false);
        for (count, h) in held.values() {
            if Arc::strong_count(h) == *count {
                bytes += h.slot().1;
                of_slot |= h.slot() == slot;
            }
        }
        (bytes, of_slot)
    }

    /// Submits whatever is pending.
    pub(super) fn flush(&self, ctx: &Context) {
        let mut b = self.lock();
        self.submit_locked(ctx, &mut b);
    }

    /// Appends a copy of the first `bytes` bytes of `src` into `dst` to the batch and submits
    /// it; returns the submission to wait for.
    pub(super) fn copy_and_submit(
        &self,
        ctx: &Context,
        src: &Arc<PooledBuffer>,
        dst: &Arc<PooledBuffer>,
        bytes: u64,
    ) -> wgpu::SubmissionIndex {
        let mut b = self.lock();
        b.pass = None;
        let mut enc = b.encoder.take().unwrap_or_else(|| {
            ctx.device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None })
        });
        enc.copy_buffer_to_buffer(src.raw(), 0, dst.raw(), 0, bytes);
        b.encoder = Some(enc);
        b.hold.push(src.clone());
        b.hold.push(dst.clone());
        self.submit_locked(ctx, &mut b)
            .expect("the batch holds the copy just recorded")
    }
}
