//! `no_grad`: a per-thread switch that stops ops from recording the graph (evaluation, optimizer
//! updates, and the backward rules themselves run under it).

use std::cell::Cell;

thread_local! {
    static GRAD_ENABLED: Cell<bool> = const { Cell::new(true) };
}

/// Whether ops on this thread record the graph.
pub fn is_grad_enabled() -> bool {
    GRAD_ENABLED.with(|g| g.get())
}

/// Turns recording off until dropped, then restores the previous state.
pub struct NoGradGuard {
    previous: bool,
}

impl NoGradGuard {
    /// Disables recording on this thread.
    pub fn new() -> NoGradGuard {
        let previous = GRAD_ENABLED.with(|g| g.replace(false));
        NoGradGuard { previous }
    }
}

impl Default for NoGradGuard {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for NoGradGuard {
    fn drop(&mut self) {
        GRAD_ENABLED.with(|g| g.set(self.previous));
    }
}

/// Runs `f` with recording off.
///
/// # Example
/// ```
/// use moegrad::{Device, Tensor, no_grad};
/// let w = Tensor::from_f32(vec![1.0], &[1], Device::cpu()).unwrap().with_grad().unwrap();
/// let y = no_grad(|| w.mul(&w)).unwrap();
/// assert!(!y.requires_grad());
/// ```
pub fn no_grad<T>(f: impl FnOnce() -> T) -> T {
    let _guard = NoGradGuard::new();
    f()
}
