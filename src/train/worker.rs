//! Running a whole job on a CPU worker thread: each CPU kernel's parallel part then starts on
//! the calling thread instead of being handed to the pool and waited for (two thread wake-ups
//! per kernel, about 8% of a char-LM step on 2 cores). [`super::run`] and
//! [`crate::lm::run`] do it themselves. A library user never needs it: the CPU backend
//! moves each large kernel onto its pool by itself. The `moegrad` binary runs every command
//! through it (hidden from the docs: it is the application's, not an API).

/// Runs `f` on a worker thread of a CPU thread pool of its own (at once when already on one)
/// and returns its result. Thread-local state, such as the grad mode and a profile, is the
/// worker's: enable a profile inside `f`.
#[doc(hidden)]
pub fn on_worker_thread<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    crate::backend::cpu::on_worker_thread(f)
}
