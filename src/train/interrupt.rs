//! Stopping a training run from outside, gracefully: what Ctrl-C does on the command line.
//!
//! A process-wide count of stop requests ([`request_stop`], called by the command line's
//! Ctrl-C handler) that the training loops read between steps:
//!
//! * **one request**: the run finishes the epoch (an image model) or evaluation interval (a
//!   language model) it is in, writes that checkpoint as usual, and stops with
//!   [`crate::Error::Interrupted`], whose message says where the checkpoint is and that
//!   `--resume` continues the run exactly;
//! * **two requests**: the run stops at the next step boundary without a new checkpoint (the
//!   last one written stays), for when the end of the interval is too far.
//!
//! Either way the run returns normally, so its output directory's lock is released.

use std::sync::atomic::{AtomicUsize, Ordering};

/// Stop requests since the process started (or since [`clear`]).
static REQUESTS: AtomicUsize = AtomicUsize::new(0);

/// Asks every running training loop of this process to stop (see the module docs); returns how
/// many requests have been made, this one included. Safe to call from a signal handler's thread.
pub fn request_stop() -> usize {
    REQUESTS.fetch_add(1, Ordering::SeqCst) + 1
}

/// The number of stop requests made so far.
pub fn requests() -> usize {
    REQUESTS.load(Ordering::SeqCst)
}

/// Forgets earlier requests (for a process that runs several trainings, e.g. a test).
pub fn clear() {
    REQUESTS.store(0, Ordering::SeqCst);
}

/// Whether the loop must stop before its next step (two requests or more).
pub(crate) fn stop_now() -> bool {
    requests() >= 2
}

/// Whether the loop must stop after the checkpoint it has just written (any request).
pub(crate) fn stop_after_checkpoint() -> bool {
    requests() >= 1
}
