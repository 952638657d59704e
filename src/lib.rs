//! moegrad (work in progress skeleton).
pub mod backend;
pub mod dtype;
pub mod error;
pub use dtype::DType;
pub use error::{Error, Result};
