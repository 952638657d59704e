//! Data: the MNIST IDX reader, the MultiMNIST composer, and batching.

pub mod idx;
pub mod loader;
pub mod mnist;
pub mod multimnist;

pub use loader::{Batch, Dataset};
pub use mnist::{ImageSet, Mnist};
pub use multimnist::MultiImageSet;
