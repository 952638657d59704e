//! The CPU backend's buffer pool: freed buffers are kept and handed out again, so that a training
//! step, which frees and allocates the same sizes every time, allocates nothing in steady state.
//!
//! Without it, every op's output is a fresh `Vec`: the C allocator returns large freed blocks to
//! the operating system and the next step faults the same pages back in, zeroed. On the char-LM
//! (a few thousand buffers of 0.1–2 MB a step) that was a sixth of the step's time in the kernel
//! (docs/benchmarks.md).
//!
//! How it works:
//! - A [`PooledVec`] is the `Vec` a [`super::CpuBuffer`] holds; when the last handle to it drops,
//!   its allocation goes back to the pool instead of to the allocator.
//! - [`take`] hands out an empty `Vec<T>` with room for `n` values: a pooled allocation of the
//!   same size class when there is one, else a fresh one. Sizes are rounded up to one of four
//!   classes per power of two (at most 19% more than asked), so buffers whose length varies a
//!   little from step to step (an expert's routed rows) still find one another.
//! - Allocations are pooled by byte size and alignment, not by type: an `f32` buffer's block can
//!   come back as an `i32` buffer (both 4-byte aligned; the `Vec` is rebuilt over the same
//!   layout it was allocated with, which is what `Vec::from_raw_parts` requires).
//! - Blocks under [`MIN_POOLED_BYTES`] are left to the allocator (it serves small sizes from its
//!   own free lists without the kernel). The pool holds at most [`MAX_POOLED_BYTES`]; a block
//!   freed beyond that is returned to the allocator. [`trim`] empties it.

use std::alloc::Layout;
use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Smaller blocks go straight back to the allocator.
pub(crate) const MIN_POOLED_BYTES: usize = 16 << 10;
/// The most the pool keeps (freed blocks beyond it are returned to the allocator).
pub(crate) const MAX_POOLED_BYTES: usize = 1 << 30;

/// One free allocation: its address and the layout it was allocated with.
struct Block {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: a block is an unowned-by-anyone allocation; whoever takes it out owns it.
unsafe impl Send for Block {}

impl Drop for Block {
    fn drop(&mut self) {
        // SAFETY: the block was allocated by the global allocator with exactly this layout (it
        // came from a `Vec` with this capacity and element layout) and nobody else owns it.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// Free blocks by (bytes, alignment), and how many bytes they hold in all.
struct Pool {
    free: HashMap<(usize, usize), Vec<Block>>,
    held: usize,
}

static POOL: Mutex<Option<Pool>> = Mutex::new(None);
static HITS: AtomicU64 = AtomicU64::new(0);
static MISSES: AtomicU64 = AtomicU64::new(0);
static HELD: AtomicUsize = AtomicUsize::new(0);

/// How the CPU buffer pool has served requests since the process started or the counters were
/// last reset (`moegrad::memory::buffer_pool_stats`). Hits and misses count requests of at least
/// 16 KiB (smaller buffers are left to the allocator).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// buffers handed out from the pool
    pub hits: u64,
    /// buffers of a pooled size that had to be allocated
    pub misses: u64,
    /// bytes the pool holds now
    pub held_bytes: usize,
}

/// The counters (hits and misses count only requests of at least [`MIN_POOLED_BYTES`]).
pub(crate) fn stats() -> PoolStats {
    PoolStats {
        hits: HITS.load(Ordering::Relaxed),
        misses: MISSES.load(Ordering::Relaxed),
        held_bytes: HELD.load(Ordering::Relaxed),
    }
}

/// Zeroes the hit and miss counters.
pub(crate) fn reset_stats() {
    HITS.store(0, Ordering::Relaxed);
    MISSES.store(0, Ordering::Relaxed);
}

/// Returns every pooled block to the allocator.
pub(crate) fn trim() {
    if let Ok(mut pool) = POOL.lock() {
        *pool = None;
    }
    HELD.store(0, Ordering::Relaxed);
}

/// `n` rounded up to its size class: the next multiple of a quarter of the largest power of two
/// not above `n`, so the classes run `4·2^e, 5·2^e, 6·2^e, 7·2^e, 8·2^e, …` (each at most 25%
/// above the one before).
fn size_class(n: usize) -> usize {
    if n <= 8 {
        return n;
    }
    let step = 1usize << (usize::BITS - 1 - n.leading_zeros() - 2); // a quarter of the top bit
    n.div_ceil(step).saturating_mul(step)
}

/// An empty vector with capacity for at least `n` values of `T`, from the pool when it holds a
/// block of the right size class, else freshly allocated (fallibly: a buffer larger than memory
/// is an error).
pub(crate) fn take<T: Copy>(n: usize) -> crate::Result<Vec<T>> {
    let elem = std::mem::size_of::<T>();
    if elem == 0 || n.saturating_mul(elem) < MIN_POOLED_BYTES {
        return crate::memory::try_vec(n);
    }
    let cap = size_class(n);
    let Ok(layout) = Layout::array::<T>(cap) else {
        return crate::memory::try_vec(n);
    };
    let block = POOL.lock().ok().and_then(|mut pool| {
        let pool = pool.as_mut()?;
        let block = pool.free.get_mut(&(layout.size(), layout.align()))?.pop()?;
        pool.held -= layout.size();
        HELD.store(pool.held, Ordering::Relaxed);
        Some(block)
    });
    match block {
        Some(block) => {
            HITS.fetch_add(1, Ordering::Relaxed);
            let ptr = block.ptr.as_ptr() as *mut T;
            std::mem::forget(block);
            // SAFETY: the block was allocated by the global allocator for `Layout::array::<U>(c)`
            // of some `U` with this `T`'s alignment and `size_of::<U>()·c` equal to
            // `size_of::<T>()·cap` (blocks are keyed by exactly that size and alignment), which is
            // the layout a `Vec<T>` of capacity `cap` deallocates with; length 0 reads nothing.
            Ok(unsafe { Vec::from_raw_parts(ptr, 0, cap) })
        }
        None => {
            MISSES.fetch_add(1, Ordering::Relaxed);
            crate::memory::try_vec(cap)
        }
    }
}

/// Gives a vector's allocation to the pool (or back to the allocator when it is small, or when
/// the pool is full).
pub(crate) fn give<T: Copy>(v: Vec<T>) {
    let elem = std::mem::size_of::<T>();
    let cap = v.capacity();
    if elem == 0 || cap.saturating_mul(elem) < MIN_POOLED_BYTES || cap != size_class(cap) {
        return; // not one of the pool's own sizes: an ordinary free
    }
    let Ok(layout) = Layout::array::<T>(cap) else {
        return;
    };
    let mut v = std::mem::ManuallyDrop::new(v);
    let Some(ptr) = NonNull::new(v.as_mut_ptr() as *mut u8) else {
        return;
    };
    // From here the block owns the allocation (and frees it if it is not kept).
    let block = Block { ptr, layout };
    let Ok(mut pool) = POOL.lock() else {
        return;
    };
    let pool = pool.get_or_insert_with(|| Pool {
        free: HashMap::new(),
        held: 0,
    });
    if pool.held + layout.size() > MAX_POOLED_BYTES {
        return;
    }
    pool.held += layout.size();
    HELD.store(pool.held, Ordering::Relaxed);
    pool.free
        .entry((layout.size(), layout.align()))
        .or_default()
        .push(block);
}

/// A `Vec` whose allocation returns to the pool when it is dropped; reads and writes as the
/// `Vec` it wraps.
#[derive(Debug, Default)]
pub(crate) struct PooledVec<T: Copy>(Vec<T>);

impl<T: Copy> From<Vec<T>> for PooledVec<T> {
    fn from(v: Vec<T>) -> Self {
        PooledVec(v)
    }
}

impl<T: Copy> Drop for PooledVec<T> {
    fn drop(&mut self) {
        give(std::mem::take(&mut self.0));
    }
}

impl<T: Copy> Clone for PooledVec<T> {
    /// A copy in a buffer from the pool.
    fn clone(&self) -> Self {
        let mut v = take(self.0.len()).unwrap_or_default();
        v.extend_from_slice(&self.0);
        PooledVec(v)
    }
}

impl<T: Copy> std::ops::Deref for PooledVec<T> {
    type Target = Vec<T>;
    fn deref(&self) -> &Vec<T> {
        &self.0
    }
}

impl<T: Copy> std::ops::DerefMut for PooledVec<T> {
    fn deref_mut(&mut self) -> &mut Vec<T> {
        &mut self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_classes_are_at_most_a_quarter_apart_and_idempotent() {
        for n in [9usize, 15, 16, 17, 100, 1000, 4097, 123_457, 1 << 20] {
            let c = size_class(n);
            assert!(c >= n && (c - n) * 4 <= n, "{n} -> {c}");
            assert_eq!(size_class(c), c, "{n} -> {c} is not a class");
        }
        assert_eq!(size_class(5), 5);
    }
}
