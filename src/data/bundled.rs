//! The bundled datasets, built into the binary: the 10,000 MNIST digits and the ten Shakespeare
//! plays of `data/` (about 2 MB of gzip, see `data/README.md` for their origin and licences), so
//! that `moegrad train --data mnist` and `--data shakespeare` work from any directory and from a
//! binary installed with `cargo install` or copied anywhere.
//!
//! They are reached through a virtual directory, [`BUNDLED_DIR`] (`<bundled>`): it is the default
//! `--data-dir`, and the readers (`idx.rs`, [`crate::data::text`]) open
//! `<bundled>/NAME` from the embedded bytes instead of the file system. A real directory given
//! with `--data-dir` (the full MNIST files, say) is read from disk as before; error messages name
//! `<bundled>/NAME` so it is clear which copy was read.

use std::path::Path;

/// The virtual directory whose files are the ones built into the binary.
pub const BUNDLED_DIR: &str = "<bundled>";

/// The embedded files, by name (the names of the copies in `data/`).
const FILES: &[(&str, &[u8])] = &[
    (
        "mnist10k-train-images-idx3-ubyte.gz",
        include_bytes!("../../data/mnist10k-train-images-idx3-ubyte.gz"),
    ),
    (
        "mnist10k-train-labels-idx1-ubyte.gz",
        include_bytes!("../../data/mnist10k-train-labels-idx1-ubyte.gz"),
    ),
    (
        "mnist10k-test-images-idx3-ubyte.gz",
        include_bytes!("../../data/mnist10k-test-images-idx3-ubyte.gz"),
    ),
    (
        "mnist10k-test-labels-idx1-ubyte.gz",
        include_bytes!("../../data/mnist10k-test-labels-idx1-ubyte.gz"),
    ),
    (
        "shakespeare-10-plays.txt.gz",
        include_bytes!("../../data/shakespeare-10-plays.txt.gz"),
    ),
];

/// The bundled directory as a path (the default `--data-dir`).
pub fn dir() -> &'static Path {
    Path::new(BUNDLED_DIR)
}

/// Whether `dir` is the bundled directory.
pub(crate) fn is_bundled_dir(dir: &Path) -> bool {
    dir == Path::new(BUNDLED_DIR)
}

/// The embedded bytes of `path` when it names a file of the bundled directory
/// (`<bundled>/NAME` with NAME one of the bundled files), else `None`.
pub(crate) fn file(path: &Path) -> Option<&'static [u8]> {
    if !is_bundled_dir(path.parent()?) {
        return None;
    }
    let name = path.file_name()?.to_str()?;
    FILES.iter().find(|(n, _)| *n == name).map(|(_, b)| *b)
}

/// Whether `path` is a file: one of the bundled files, or a file on disk.
pub(crate) fn is_file(path: &Path) -> bool {
    file(path).is_some() || path.is_file()
}
