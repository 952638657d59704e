//! Host memory for the CPU backend: a global allocator that wraps the system allocator, counts
//! live and peak bytes (for benchmarks), and keeps freed large blocks for reuse.
//!
//! The cache is the CPU side of "no allocation in a steady-state training step": a training step
//! frees and allocates the same large buffers (activations, gradients) every time, and without a
//! cache each of them is a fresh `mmap` whose pages the kernel faults in and zeroes one by one
//! (measured: about a third of a CPU MoE step went to page faults). Blocks of at least
//! [`CACHE_MIN_BYTES`] are kept, up to [`CACHE_MAX_BYTES`] in all, and handed back to a request
//! of exactly the same size and alignment.
//!
//! The `moegrad` binary installs it; a library user may too:
//!
//! ```ignore
//! #[global_allocator]
//! static ALLOC: moegrad::memory::CountingAllocator = moegrad::memory::CountingAllocator;
//! ```
//!
//! Without it installed the counters stay at zero and [`installed`] says so.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use std::sync::atomic::AtomicPtr;

/// Freed blocks of at least this many bytes are cached for reuse.
pub const CACHE_MIN_BYTES: usize = 1 << 20;
/// At most this many bytes are held in the cache; beyond it the oldest blocks go back to the system.
pub const CACHE_MAX_BYTES: usize = 1 << 30;
const SLOTS: usize = 64;

/// One cached block: its pointer (null when the slot is empty), size and alignment.
struct Slot {
    ptr: AtomicPtr<u8>,
    size: AtomicUsize,
    align: AtomicUsize,
    stamp: AtomicUsize,
}
#[allow(clippy::declare_interior_mutable_const)]
const EMPTY: Slot = Slot {
    ptr: AtomicPtr::new(std::ptr::null_mut()),
    size: AtomicUsize::new(0),
    align: AtomicUsize::new(0),
    stamp: AtomicUsize::new(0),
};
static CACHE: [Slot; SLOTS] = [EMPTY; SLOTS];
static CACHED: AtomicUsize = AtomicUsize::new(0);
static CLOCK: AtomicUsize = AtomicUsize::new(0);
/// A spin lock over `CACHE` (the allocator must not allocate, so no `Mutex` with a poisoning
/// payload; the critical sections are a scan of 64 slots).
static LOCK: AtomicBool = AtomicBool::new(false);

fn with_cache<R>(f: impl FnOnce() -> R) -> R {
    while LOCK
        .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
        .is_err()
    {
        std::hint::spin_loop();
    }
    let r = f();
    LOCK.store(false, Ordering::Release);
    r
}

/// A cached block of exactly `layout`, if there is one.
fn take_cached(layout: Layout) -> *mut u8 {
    with_cache(|| {
        for s in &CACHE {
            let p = s.ptr.load(Ordering::Relaxed);
            if !p.is_null()
                && s.size.load(Ordering::Relaxed) == layout.size()
                && s.align.load(Ordering::Relaxed) == layout.align()
            {
                s.ptr.store(std::ptr::null_mut(), Ordering::Relaxed);
                CACHED.fetch_sub(layout.size(), Ordering::Relaxed);
                return p;
            }
        }
        std::ptr::null_mut()
    })
}

/// Keeps a freed block; returns the blocks pushed out (oldest first) to make room, or the block
/// itself when it cannot be kept. Frees nothing itself (the caller does, outside the lock).
fn put_cached(ptr: *mut u8, layout: Layout) -> [(*mut u8, Layout); 4] {
    let mut evicted = [(std::ptr::null_mut(), layout); 4];
    if layout.size() > CACHE_MAX_BYTES {
        evicted[0] = (ptr, layout);
        return evicted;
    }
    with_cache(|| {
        let mut n = 0;
        loop {
            let free = CACHE
                .iter()
                .find(|s| s.ptr.load(Ordering::Relaxed).is_null());
            let fits = CACHED.load(Ordering::Relaxed) + layout.size() <= CACHE_MAX_BYTES;
            if let (Some(slot), true) = (free, fits) {
                slot.size.store(layout.size(), Ordering::Relaxed);
                slot.align.store(layout.align(), Ordering::Relaxed);
                slot.stamp
                    .store(CLOCK.fetch_add(1, Ordering::Relaxed), Ordering::Relaxed);
                slot.ptr.store(ptr, Ordering::Relaxed);
                CACHED.fetch_add(layout.size(), Ordering::Relaxed);
                return;
            }
            // evict the oldest block, at most three times; then give up on caching this one
            let oldest = CACHE
                .iter()
                .filter(|s| !s.ptr.load(Ordering::Relaxed).is_null())
                .min_by_key(|s| s.stamp.load(Ordering::Relaxed));
            match oldest {
                Some(s) if n < 3 => {
                    let size = s.size.load(Ordering::Relaxed);
                    let align = s.align.load(Ordering::Relaxed);
                    let p = s.ptr.swap(std::ptr::null_mut(), Ordering::Relaxed);
                    CACHED.fetch_sub(size, Ordering::Relaxed);
                    if let Ok(l) = Layout::from_size_align(size, align) {
                        evicted[n] = (p, l);
                    }
                    n += 1;
                }
                _ => {
                    evicted[n] = (ptr, layout);
                    return;
                }
            }
        }
    });
    evicted
}

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static ACTIVE: AtomicBool = AtomicBool::new(false);

/// The counting allocator (zero-sized; all state is in statics).
pub struct CountingAllocator;

fn count_alloc(size: usize) {
    let live = LIVE.fetch_add(size, Ordering::Relaxed) + size;
    PEAK.fetch_max(live, Ordering::Relaxed);
}

// SAFETY: blocks come from the system allocator, either directly or through the cache, which only
// hands a block back for exactly the size and alignment it was allocated with; every block is
// freed exactly once (to the cache or the system).
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ACTIVE.store(true, Ordering::Relaxed);
        let mut p = std::ptr::null_mut();
        if layout.size() >= CACHE_MIN_BYTES {
            p = take_cached(layout);
        }
        if p.is_null() {
            p = unsafe { System.alloc(layout) };
        }
        if !p.is_null() {
            count_alloc(layout.size());
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ACTIVE.store(true, Ordering::Relaxed);
        if layout.size() >= CACHE_MIN_BYTES {
            let p = take_cached(layout);
            if !p.is_null() {
                unsafe { std::ptr::write_bytes(p, 0, layout.size()) };
                count_alloc(layout.size());
                return p;
            }
        }
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            count_alloc(layout.size());
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        if layout.size() < CACHE_MIN_BYTES {
            unsafe { System.dealloc(ptr, layout) };
            return;
        }
        for (p, l) in put_cached(ptr, layout) {
            if !p.is_null() {
                unsafe { System.dealloc(p, l) };
            }
        }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if layout.size() >= CACHE_MIN_BYTES || new_size >= CACHE_MIN_BYTES {
            // through alloc/dealloc, so cached blocks keep their exact sizes
            let Ok(new_layout) = Layout::from_size_align(new_size, layout.align()) else {
                return std::ptr::null_mut();
            };
            let p = unsafe { self.alloc(new_layout) };
            if !p.is_null() {
                unsafe {
                    std::ptr::copy_nonoverlapping(ptr, p, layout.size().min(new_size));
                    self.dealloc(ptr, layout);
                }
            }
            return p;
        }
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            if new_size >= layout.size() {
                count_alloc(new_size - layout.size());
            } else {
                LIVE.fetch_sub(layout.size() - new_size, Ordering::Relaxed);
            }
        }
        p
    }
}

/// Bytes held in the cache of freed large blocks (not counted in [`live_bytes`]).
pub fn cached_bytes() -> usize {
    CACHED.load(Ordering::Relaxed)
}

/// Whether the counting allocator is the global allocator of this process.
pub fn installed() -> bool {
    ACTIVE.load(Ordering::Relaxed)
}

/// Bytes currently allocated on the heap.
pub fn live_bytes() -> usize {
    LIVE.load(Ordering::Relaxed)
}

/// The largest `live_bytes` seen since the last [`reset_peak`].
pub fn peak_bytes() -> usize {
    PEAK.load(Ordering::Relaxed)
}

/// Starts a new peak measurement from the current live bytes.
pub fn reset_peak() {
    PEAK.store(LIVE.load(Ordering::Relaxed), Ordering::Relaxed);
}
