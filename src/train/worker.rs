//! Running a whole job on a CPU worker thread, as the trainers run their loops: each CPU
//! kernel's parallel part then starts on the calling thread instead of being handed to the pool
//! and waited for (two thread wake-ups per kernel, about 8% of a char-LM step on 2 cores).
//! [`super::run`] and [`crate::lm::run`] do it themselves; a loop of one's own (a benchmark, a
//! custom training loop) may do the same. The `moegrad` binary runs every command through it.

/// Runs `f` on a worker thread of a CPU thread pool of its own (at once when already on one)
/// and returns its result: the way to run a whole loop of CPU work, such as a training loop or
/// a benchmark, without a thread hand-over per kernel. It is only about speed: without it, the
/// CPU backend moves each large kernel onto its pool by itself, and the results are the same.
///
/// Thread-local state, such as the grad mode ([`crate::no_grad`]) and a profile
/// ([`crate::profile::enable`]), is the worker's: set it inside `f`.
///
/// # Example
/// ```
/// use moegrad::{DType, Device, Tensor};
/// let total = moegrad::train::on_worker_thread(|| -> moegrad::Result<f64> {
///     let x = Tensor::full(&[1 << 16], 0.5, DType::F32, Device::cpu())?;
///     let mut s = 0.0;
///     for _ in 0..4 {
///         s += x.mul(&x)?.sum_all()?.item()?; // every kernel starts on this worker
///     }
///     Ok(s)
/// });
/// assert_eq!(total.unwrap(), 4.0 * 16384.0);
/// ```
pub fn on_worker_thread<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    crate::backend::cpu::on_worker_thread(f)
}
