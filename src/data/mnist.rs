//! MNIST as tensors-to-be: reads the four IDX files from a directory (the bundled 10,000-digit
//! subset in `data/`, or the full MNIST files wherever a user has them) and checks they agree.

use super::idx::{read_images, read_labels};
use crate::{Error, Result};
use std::path::{Path, PathBuf};

/// One split of a labelled image dataset, pixels scaled to [0, 1].
#[derive(Clone, Debug)]
pub struct ImageSet {
    /// `count·rows·cols` values in [0, 1]
    pub images: Vec<f32>,
    /// one class per image
    pub labels: Vec<i32>,
    /// number of images
    pub count: usize,
    /// image height
    pub rows: usize,
    /// image width
    pub cols: usize,
}

impl ImageSet {
    /// Builds a set from raw bytes (checked: `labels.len() == count`).
    pub fn from_bytes(
        pixels: &[u8],
        labels: &[u8],
        count: usize,
        rows: usize,
        cols: usize,
    ) -> Result<ImageSet> {
        let need = count.checked_mul(rows).and_then(|n| n.checked_mul(cols));
        if labels.len() != count || need != Some(pixels.len()) {
            return Err(Error::Invalid(format!(
                "{count} images of {rows}×{cols} need {} pixels and {count} labels, got {} and {}",
                need.map_or("more than can be counted".into(), |n| n.to_string()),
                pixels.len(),
                labels.len()
            )));
        }
        Ok(ImageSet {
            images: pixels.iter().map(|&p| p as f32 / 255.0).collect(),
            labels: labels.iter().map(|&l| l as i32).collect(),
            count,
            rows,
            cols,
        })
    }
}

/// The train and test splits of MNIST.
#[derive(Clone, Debug)]
pub struct Mnist {
    /// training images
    pub train: ImageSet,
    /// test images
    pub test: ImageSet,
}

/// File names tried, in order, for each of the four files.
const NAMES: [[&str; 4]; 4] = [
    [
        "mnist10k-train-images-idx3-ubyte.gz",
        "train-images-idx3-ubyte.gz",
        "train-images-idx3-ubyte",
        "train-images.idx3-ubyte",
    ],
    [
        "mnist10k-train-labels-idx1-ubyte.gz",
        "train-labels-idx1-ubyte.gz",
        "train-labels-idx1-ubyte",
        "train-labels.idx1-ubyte",
    ],
    [
        "mnist10k-test-images-idx3-ubyte.gz",
        "t10k-images-idx3-ubyte.gz",
        "t10k-images-idx3-ubyte",
        "t10k-images.idx3-ubyte",
    ],
    [
        "mnist10k-test-labels-idx1-ubyte.gz",
        "t10k-labels-idx1-ubyte.gz",
        "t10k-labels-idx1-ubyte",
        "t10k-labels.idx1-ubyte",
    ],
];

fn find(dir: &Path, names: &[&str]) -> Result<PathBuf> {
    names
        .iter()
        .map(|n| dir.join(n))
        .find(|p| crate::data::bundled::is_file(p))
        .ok_or_else(|| {
            Error::Io(format!(
                "{}: none of {} found",
                dir.display(),
                names.join(", ")
            ))
        })
}

/// Reads one split; returns it with the path of its image file (for messages).
fn load_split(dir: &Path, images: &[&str], labels: &[&str]) -> Result<(ImageSet, PathBuf)> {
    let (ip, lp) = (find(dir, images)?, find(dir, labels)?);
    let im = read_images(&ip)?;
    let lab = read_labels(&lp, 9)?;
    if lab.len() != im.count {
        return Err(Error::Io(format!(
            "{} holds {} images but {} holds {} labels",
            ip.display(),
            im.count,
            lp.display(),
            lab.len()
        )));
    }
    Ok((
        ImageSet::from_bytes(&im.pixels, &lab, im.count, im.rows, im.cols)?,
        ip,
    ))
}

impl Mnist {
    /// Loads MNIST from `dir`: the bundled `mnist10k-*` files or the standard file names
    /// (`train-images-idx3-ubyte[.gz]`, `t10k-labels-idx1-ubyte[.gz]`, ...).
    ///
    /// # Errors
    /// A file is missing or malformed, labels and images disagree in number, or the training
    /// and test images differ in size (the error names both files and both sizes).
    pub fn load(dir: &Path) -> Result<Mnist> {
        let (train, train_path) = load_split(dir, &NAMES[0], &NAMES[1])?;
        let (test, test_path) = load_split(dir, &NAMES[2], &NAMES[3])?;
        if (train.rows, train.cols) != (test.rows, test.cols) {
            return Err(Error::Io(format!(
                "the training images in {} are {}×{} but the test images in {} are {}×{}; a model takes one size",
                train_path.display(),
                train.rows,
                train.cols,
                test_path.display(),
                test.rows,
                test.cols
            )));
        }
        Ok(Mnist { train, test })
    }
}
