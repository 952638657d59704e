//! Data: the MNIST IDX reader, the MultiMNIST composer, the synthetic generators with a known
//! mixture of experts, and batching.

pub mod idx;
pub mod loader;
pub mod mnist;
pub mod multimnist;
pub mod synthetic;

pub use loader::{Batch, Dataset};
pub use mnist::{ImageSet, Mnist};
pub use multimnist::MultiImageSet;
pub use synthetic::SyntheticB;
