//! MultiMNIST: two digits overlaid on a 36×36 canvas, one shifted 4 pixels toward the top-left,
//! the other 4 pixels toward the bottom-right, combined by pixelwise maximum, with one label per
//! digit (two tasks). This is the construction of the MOESART and DSelect-k papers (which leave
//! the overlay operator open; we take the maximum so pixels stay in [0, 1]).
//!
//! Deterministic: the partner of each digit comes from a ChaCha permutation of the seed.

use super::mnist::ImageSet;
use crate::{Error, Result};
use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

/// Side of the MultiMNIST canvas.
pub const CANVAS: usize = 36;

/// A two-task image set: `images` are `count·36·36`, `labels[t][i]` the class of digit `t` of image `i`.
#[derive(Clone, Debug)]
pub struct MultiImageSet {
    /// pixels in [0, 1]
    pub images: Vec<f32>,
    /// one label vector per task (top-left digit, bottom-right digit)
    pub labels: [Vec<i32>; 2],
    /// number of images
    pub count: usize,
}

/// Composes one MultiMNIST image per digit of `src` (28×28), pairing digit `i` with a partner
/// drawn by a seeded permutation (never itself, when there are two or more digits).
pub fn compose(src: &ImageSet, seed: u64) -> Result<MultiImageSet> {
    if src.rows != 28 || src.cols != 28 {
        return Err(Error::Invalid(format!(
            "MultiMNIST needs 28×28 digits, got {}×{}",
            src.rows, src.cols
        )));
    }
    let n = src.count;
    let mut partner: Vec<usize> = (0..n).collect();
    partner.shuffle(&mut ChaCha8Rng::seed_from_u64(seed));
    let side = 28;
    let shift = (CANVAS - side) / 2 + 4; // offset of the bottom-right digit: centred, then 4 px further
    let mut images = vec![0.0f32; n * CANVAS * CANVAS];
    let mut top = Vec::with_capacity(n);
    let mut bottom = Vec::with_capacity(n);
    for i in 0..n {
        let mut j = partner[i];
        if j == i && n > 1 {
            j = (i + 1) % n;
        }
        let canvas = &mut images[i * CANVAS * CANVAS..(i + 1) * CANVAS * CANVAS];
        for (digit, off) in [(i, 0usize), (j, shift)] {
            let px = &src.images[digit * side * side..(digit + 1) * side * side];
            for r in 0..side {
                for c in 0..side {
                    let dst = &mut canvas[(r + off) * CANVAS + c + off];
                    *dst = dst.max(px[r * side + c]);
                }
            }
        }
        top.push(src.labels[i]);
        bottom.push(src.labels[j]);
    }
    Ok(MultiImageSet {
        images,
        labels: [top, bottom],
        count: n,
    })
}
