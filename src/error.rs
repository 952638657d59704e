//! One error type for the whole crate.
//!
//! Every fallible public call returns [`Result<T>`]; nothing public panics on bad input. Each variant
//! carries a message that names what was at fault (the shapes, the axis, the file, the setting), so
//! that the one line a user sees is enough to fix the call.

/// Everything that can go wrong in moegrad.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Two shapes that had to agree (or broadcast) did not; the message names both.
    #[error("shape error: {0}")]
    Shape(String),
    /// An operation got a dtype it does not support, or two dtypes that differ.
    #[error("dtype error: {0}")]
    DType(String),
    /// Tensors on different devices were combined, or a device could not be opened.
    #[error("device error: {0}")]
    Device(String),
    /// An axis outside `-rank..rank`.
    #[error("axis error: {0}")]
    Axis(String),
    /// An argument outside its domain (k larger than the axis, an empty tensor where one is not allowed, ...).
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// The autograd graph was misused (backward on a non-scalar without a gradient, twice on a released graph, ...).
    #[error("autograd error: {0}")]
    Autograd(String),
    /// A gradient check found analytic and numeric gradients that disagree; the message names the
    /// input, the worst element, both values and the tolerance.
    #[error("gradcheck failed: {0}")]
    Gradcheck(String),
    /// A GPU call failed (adapter request, buffer mapping, shader compilation, validation).
    #[error("gpu error: {0}")]
    Gpu(String),
    /// Reading or writing a file failed; the message names the file.
    #[error("io error: {0}")]
    Io(String),
    /// A training run was stopped on request (Ctrl-C, [`crate::train::interrupt`]); the message
    /// says what it left and how to continue it.
    #[error("interrupted: {0}")]
    Interrupted(String),
}

/// `Result` with moegrad's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

/// Builds an `Err(Error::Shape(..))` from a format string.
#[macro_export]
macro_rules! shape_err {
    ($($arg:tt)*) => { Err($crate::Error::Shape(format!($($arg)*))) };
}
