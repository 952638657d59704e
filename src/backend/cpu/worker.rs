//! How CPU kernels reach rayon's worker threads.
//!
//! A parallel loop started from a thread outside rayon's pools hands its work to a pool and
//! sleeps until a worker has done it: two thread wake-ups, tens of microseconds. The `Storage`
//! layer therefore calls every CPU kernel through [`on_pool`], which moves a large kernel onto
//! a worker of the backend's own pool once (rather than once per parallel loop inside it), and
//! leaves small kernels, which run serially, on the caller's thread. A user never enters a pool
//! by hand. The trainers go one step further with [`on_worker_thread`]: their whole loop runs
//! on a worker, so not even the per-kernel hand-over is paid.

use super::PAR_MIN;
use std::sync::LazyLock;

/// Runs `f` on a rayon worker thread and returns its result (inline when the caller is a
/// worker already). Not an API: the CPU backend enters its pool by itself ([`on_pool`]); the
/// trainers still run their whole loop through this, which saves the hop per kernel (and the
/// `moegrad` binary every command, through `train::on_worker_thread`).
///
/// A parallel kernel called from a thread outside rayon's pool hands its work to the pool and
/// sleeps until a worker has finished it: two thread wake-ups per kernel, tens of microseconds
/// each. Called from a worker, the same kernel runs its first part on that thread while the
/// other workers steal the rest.
///
/// `f` gets a pool of its own, with as many threads as the global one. A worker that waits for
/// a kernel's parallel part takes other jobs of its pool meanwhile; in the shared global pool
/// that could be another thread's whole loop, which would then run nested inside `f`'s wait,
/// under `f`'s thread-local state (the grad mode, a profile). In its own pool it only ever
/// finds `f`'s own kernels. (Building the pool costs a few thread starts, once per call.)
pub(crate) fn on_worker_thread<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() {
        return f();
    }
    match rayon::ThreadPoolBuilder::new()
        .num_threads(rayon::current_num_threads())
        .thread_name(|i| format!("moegrad-cpu-{i}"))
        .build()
    {
        Ok(pool) => pool.install(f),
        // no threads to be had: the caller's own thread, as without this helper
        Err(_) => f(),
    }
}

/// The pool the CPU backend runs its kernels in when they are called from a thread outside
/// rayon's pools (built on first use, as many threads as the global pool; `None` when no
/// thread can be started).
static KERNEL_POOL: LazyLock<Option<rayon::ThreadPool>> = LazyLock::new(|| {
    rayon::ThreadPoolBuilder::new()
        .num_threads(rayon::current_num_threads())
        .thread_name(|i| format!("moegrad-kernel-{i}"))
        .build()
        .ok()
});

/// Runs one CPU kernel `f`, whose operand holds `work` elements, on a rayon worker: the
/// `Storage` layer calls every CPU kernel through this, so a user never has to enter a pool.
///
/// - On a worker already (the trainers' loops, a kernel inside a kernel): inline.
/// - A small kernel (`work < PAR_MIN`): inline, since it runs serially and a hop would only
///   add two thread wake-ups.
/// - Otherwise through `install` on [`KERNEL_POOL`]: one hand-over for the whole kernel, where
///   each of its parallel loops would otherwise be handed to the global pool separately.
///
/// A worker of that pool waiting inside one kernel may run another thread's kernel meanwhile
/// (kernels read no autograd state), never another thread's training loop.
pub(crate) fn on_pool<R: Send>(work: usize, f: impl FnOnce() -> R + Send) -> R {
    if work < PAR_MIN || rayon::current_thread_index().is_some() {
        return f();
    }
    match &*KERNEL_POOL {
        Some(pool) => pool.install(f),
        None => f(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;
    use std::cell::Cell;

    /// A large kernel called from a thread outside rayon runs on a worker; a small one, or one
    /// called from a worker, stays on its caller's thread.
    #[test]
    fn large_kernels_hop_onto_a_worker_and_small_ones_do_not() {
        std::thread::spawn(|| {
            assert!(rayon::current_thread_index().is_none());
            let caller = std::thread::current().id();
            let large = on_pool(PAR_MIN, || std::thread::current().id());
            assert_ne!(large, caller, "a large kernel ran on the calling thread");
            assert!(on_pool(PAR_MIN, || rayon::current_thread_index().is_some()));
            let small = on_pool(PAR_MIN - 1, || std::thread::current().id());
            assert_eq!(small, caller, "a small kernel hopped threads");
            on_worker_thread(|| {
                let here = std::thread::current().id();
                assert_eq!(on_pool(PAR_MIN * 4, || std::thread::current().id()), here);
            });
        })
        .join()
        .expect("the checks passed");
    }

    /// Loops run through `on_worker_thread` from several threads at once never run inside one
    /// another: while one loop waits for a kernel's parallel part, its thread must not pick up
    /// another thread's whole loop (which would then run under the first loop's thread-local
    /// state: the grad mode, the profile). Each loop marks its thread busy, runs parallel work
    /// it has to wait for, and checks that it found the thread free.
    #[test]
    fn concurrent_worker_loops_do_not_nest() {
        thread_local! {
            static BUSY: Cell<bool> = const { Cell::new(false) };
        }
        let threads: Vec<_> = (0..4)
            .map(|_| {
                std::thread::spawn(|| {
                    for _ in 0..25 {
                        on_worker_thread(|| {
                            assert!(!BUSY.get(), "a loop started inside another loop's wait");
                            BUSY.set(true);
                            (0..32).into_par_iter().for_each(|_| {
                                std::thread::sleep(std::time::Duration::from_micros(200))
                            });
                            BUSY.set(false);
                        });
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("a worker loop panicked");
        }
    }
}
