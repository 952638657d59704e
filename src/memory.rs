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
//!
//! # The memory limit
//! A setting that asks for more memory than the machine has (`--experts 100000`, `bench matmul
//! --sizes 100000`) must end in an error that names it, not in the allocator's abort. The checks
//! behind that compare what a job needs against [`memory_limit`]: the `MOEGRAD_MEMORY_LIMIT`
//! environment variable when set (bytes, or a number with a K/M/G/T suffix in powers of 1024),
//! else the smaller of the machine's total memory (`MemTotal` in `/proc/meminfo`) and the
//! cgroup's limit (a container's), else [`FALLBACK_LIMIT_BYTES`]. [`check_fits`] is the up-front
//! check a model or benchmark makes before it allocates; [`try_vec`] is the fallible allocation
//! the CPU backend's constructors use, so a single buffer too large for the machine is an error too.

use crate::{Error, Result};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::OnceLock;
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

/// The CPU backend's buffer pool: a tensor's freed buffer is kept and handed out again to the
/// next tensor of its size class, so a steady training step allocates no buffer (unlike the
/// cache above, it works without the counting allocator). The counters of
/// [`buffer_pool_stats`], set back by [`reset_buffer_pool_stats`], are process-wide.
pub use crate::backend::cpu::buffer_pool::PoolStats as BufferPoolStats;

/// The CPU buffer pool's counters: buffers served from the pool (hits), buffers it had to
/// allocate (misses), and the bytes it holds now.
///
/// # Example
/// ```
/// use moegrad::{DType, Device, Tensor};
/// let x = Tensor::full(&[1 << 16], 1.0, DType::F32, Device::cpu()).unwrap();
/// drop(x.add(&x).unwrap()); // its buffer goes back to the pool
/// moegrad::memory::reset_buffer_pool_stats();
/// let _y = x.add(&x).unwrap(); // the same size again: served from the pool
/// assert!(moegrad::memory::buffer_pool_stats().hits >= 1);
/// ```
pub fn buffer_pool_stats() -> BufferPoolStats {
    crate::backend::cpu::buffer_pool::stats()
}

/// Sets the hit and miss counters of [`buffer_pool_stats`] back to zero.
pub fn reset_buffer_pool_stats() {
    crate::backend::cpu::buffer_pool::reset_stats();
}

/// Gives every buffer the CPU pool holds back to the allocator (after training, say); the
/// next tensors allocate afresh.
pub fn trim_buffer_pool() {
    crate::backend::cpu::buffer_pool::trim();
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

/// The environment variable that sets the memory limit (bytes, or with a K/M/G/T suffix).
pub const LIMIT_ENV: &str = "MOEGRAD_MEMORY_LIMIT";

/// The limit when neither the environment nor the operating system gives one: 64 GiB.
pub const FALLBACK_LIMIT_BYTES: u64 = 64 << 30;

/// The most host memory one job may ask for, and where that figure came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryLimit {
    /// bytes
    pub bytes: u64,
    /// where the figure came from, e.g. "MemTotal in /proc/meminfo"
    pub source: String,
}

impl std::fmt::Display for MemoryLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", format_bytes(self.bytes), self.source)
    }
}

/// The memory limit of this process (read once; see the module docs for its sources).
///
/// # Errors
/// `MOEGRAD_MEMORY_LIMIT` is set but is not a size.
pub fn memory_limit() -> Result<&'static MemoryLimit> {
    static LIMIT: OnceLock<std::result::Result<MemoryLimit, String>> = OnceLock::new();
    LIMIT
        .get_or_init(read_limit)
        .as_ref()
        .map_err(|e| Error::Invalid(e.clone()))
}

fn read_limit() -> std::result::Result<MemoryLimit, String> {
    if let Ok(text) = std::env::var(LIMIT_ENV) {
        return match parse_size(&text) {
            Some(bytes) if bytes > 0 => Ok(MemoryLimit {
                bytes,
                source: format!("{LIMIT_ENV}={text}"),
            }),
            _ => Err(format!(
                "{LIMIT_ENV}={text:?}: expected a positive size in bytes, e.g. 8589934592 or 8G"
            )),
        };
    }
    let total = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| meminfo_total(&t));
    let cgroup = [
        "/sys/fs/cgroup/memory.max",
        "/sys/fs/cgroup/memory/memory.limit_in_bytes",
    ]
    .iter()
    .find_map(|p| std::fs::read_to_string(p).ok().and_then(|t| parse_size(&t)));
    Ok(match (total, cgroup) {
        (_, Some(c)) if total.is_none_or(|t| c < t) => MemoryLimit {
            bytes: c,
            source: "the cgroup's memory limit".into(),
        },
        (Some(t), _) => MemoryLimit {
            bytes: t,
            source: "MemTotal in /proc/meminfo".into(),
        },
        _ => MemoryLimit {
            bytes: FALLBACK_LIMIT_BYTES,
            source: "moegrad's default limit; set MOEGRAD_MEMORY_LIMIT to change it".into(),
        },
    })
}

/// `MemTotal` of a `/proc/meminfo` text, in bytes.
fn meminfo_total(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Parses a size: a whole number of bytes, optionally followed by K, M, G or T (with or without
/// `iB`/`B`; powers of 1024). `None` for anything else, including cgroup's `max`.
///
/// # Example
/// ```
/// use moegrad::memory::parse_size;
/// assert_eq!(parse_size("8G"), Some(8 << 30));
/// assert_eq!(parse_size("512 MiB"), Some(512 << 20));
/// assert_eq!(parse_size("1000"), Some(1000));
/// assert_eq!(parse_size("max"), None);
/// ```
pub fn parse_size(text: &str) -> Option<u64> {
    let text = text.trim();
    let digits = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let number: u64 = text[..digits].parse().ok()?;
    let unit = text[digits..].trim().to_ascii_uppercase();
    let unit = unit
        .strip_suffix("IB")
        .or_else(|| unit.strip_suffix('B'))
        .unwrap_or(&unit);
    let shift = match unit {
        "" => 0,
        "K" => 10,
        "M" => 20,
        "G" => 30,
        "T" => 40,
        _ => return None,
    };
    number.checked_mul(1u64 << shift)
}

/// A byte count for people: `"1.5 GiB"`, `"40.0 TiB"`, `"512 bytes"`.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if bytes < 1024 {
        return format!("{bytes} bytes");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// Checks, before allocating, that a job needing `bytes` fits in [`memory_limit`]; `None`
/// stands for a size too large to count in 64 bits.
///
/// The error reads `"{what} needs {size}, more than the {limit} this process may use"`, so
/// `what` should name the settings at fault (e.g. `"--experts 100000 (model moe-mlp)"`).
///
/// # Example
/// ```
/// use moegrad::memory::check_fits;
/// assert!(check_fits("a small job", Some(1 << 20)).is_ok());
/// let e = check_fits("--sizes 1000000000", None).unwrap_err().to_string();
/// assert!(e.contains("--sizes 1000000000"));
/// ```
pub fn check_fits(what: &str, bytes: Option<u64>) -> Result<()> {
    let limit = memory_limit()?;
    match bytes {
        Some(b) if b <= limit.bytes => Ok(()),
        Some(b) => Err(Error::Invalid(format!(
            "{what} needs about {}, more than the {limit} this process may use",
            format_bytes(b)
        ))),
        None => Err(Error::Invalid(format!(
            "{what} needs more bytes than a 64-bit count can hold, far more than the {limit} this process may use"
        ))),
    }
}

/// An empty vector with room for `len` values, or an error (not an abort) when that memory is
/// more than [`memory_limit`] or the allocator refuses it. The CPU backend's constructors
/// allocate through it, so one absurd tensor is an `Err`.
pub fn try_vec<T>(len: usize) -> Result<Vec<T>> {
    let bytes = (len as u64).checked_mul(std::mem::size_of::<T>() as u64);
    check_fits(&format!("a buffer of {len} values"), bytes)?;
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|e| {
        Error::Invalid(format!(
            "a buffer of {len} values ({}) could not be allocated: {e}",
            format_bytes(bytes.unwrap_or(u64::MAX))
        ))
    })?;
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_meminfo_and_sizes() {
        let text = "MemTotal:       24684096 kB\nMemFree:        20759696 kB\n";
        assert_eq!(meminfo_total(text), Some(24684096 * 1024));
        assert_eq!(meminfo_total("MemFree: 1 kB"), None);
        assert_eq!(parse_size("9223372036854775807\n"), Some(i64::MAX as u64));
        assert_eq!(parse_size("16GiB"), Some(16 << 30));
        assert_eq!(parse_size("3 kb"), Some(3 << 10));
        assert_eq!(parse_size("99999999999T"), None);
        assert_eq!(parse_size("-1"), None);
        assert_eq!(parse_size("1.5G"), None);
        assert_eq!(format_bytes(1536 << 20), "1.5 GiB");
        assert_eq!(format_bytes(100), "100 bytes");
    }

    #[test]
    fn the_limit_is_positive_and_try_vec_refuses_more() {
        let limit = memory_limit().unwrap();
        assert!(limit.bytes > 0, "{limit}");
        assert!(try_vec::<f32>(1000).unwrap().capacity() >= 1000);
        // more than the limit: refused before the allocator is asked
        let too_many = (limit.bytes / 4 + 1) as usize;
        let e = try_vec::<f32>(too_many).unwrap_err().to_string();
        assert!(
            e.contains(&too_many.to_string()) && e.contains("more than"),
            "{e}"
        );
        let e = try_vec::<f64>(usize::MAX).unwrap_err().to_string();
        assert!(e.contains("64-bit"), "{e}");
    }
}
