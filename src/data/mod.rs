//! Data: the MNIST IDX reader, the MultiMNIST composer, the synthetic generators with a known
//! mixture of experts, batching, and character-level text for the language models; the bundled
//! datasets are built into the binary ([`bundled`]).

pub mod bundled;
pub mod idx;
pub mod loader;
pub mod mnist;
pub mod multimnist;
pub mod synthetic;
pub mod text;

pub use loader::{Batch, Dataset};
pub use mnist::{ImageSet, Mnist};
pub use multimnist::MultiImageSet;
pub use synthetic::SyntheticB;
