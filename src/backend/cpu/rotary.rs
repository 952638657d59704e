//! The CPU kernel of `nn::Rotary` (`NnOps::rotary`), generic over f32 and f64: each row of
//! `head_dim` values is rotated in one pass, its two halves together, with the tables' row of
//! its position. Groups of rows run in parallel.
//!
//! With `h = head_dim/2`, column `j < h` is paired with `j + h`: forward
//! `y_j = x_j·cos_j + x_(j+h)·sin_j` and `y_(j+h) = x_(j+h)·cos_(j+h) + x_j·sin_(j+h)` (the
//! `sin` table carries `rotate_half`'s sign); the transpose (the backward rule) reads the sine of
//! the paired column instead, `y_j = x_j·cos_j + x_(j+h)·sin_(j+h)`. Composed, the rotation
//! took two slices, a concatenation, two products and a sum each way.

use super::{MAP_CHUNK, write_chunks};
use crate::backend::RotaryDims;
use num_traits::Float;

/// `y` `[batch, seq, head_dim]`; see `NnOps::rotary`. Lengths were checked by the caller.
pub(crate) fn rotary<T: Float + Send + Sync>(
    x: &[T],
    cos: &[T],
    sin: &[T],
    d: RotaryDims,
) -> Vec<T> {
    let (dh, h) = (d.head_dim, d.head_dim / 2);
    let rows_per_task = (MAP_CHUNK / dh).max(1);
    let n = d.batch * d.seq * dh;
    // SAFETY: each chunk is `rows_per_task` whole rows, and both halves of each are written.
    unsafe {
        write_chunks(n, rows_per_task * dh, |task, y| {
            for (r, y) in y.chunks_mut(dh).enumerate() {
                let row = task * rows_per_task + r;
                let p = row % d.seq;
                let x = &x[row * dh..(row + 1) * dh];
                let (c, s) = (&cos[p * dh..(p + 1) * dh], &sin[p * dh..(p + 1) * dh]);
                let (x0, x1) = x.split_at(h);
                let (c0, c1) = c.split_at(h);
                // the sine each half multiplies its partner by
                let (s0, s1) = if d.transpose {
                    (&s[h..], &s[..h])
                } else {
                    s.split_at(h)
                };
                let (y0, y1) = y.split_at_mut(h);
                // one zipped pass per half (no indexing, so no bounds checks: it vectorises)
                for ((((y, &a), &b), &c), &s) in y0.iter_mut().zip(x0).zip(x1).zip(c0).zip(s0) {
                    y.write(a * c + b * s);
                }
                for ((((y, &b), &a), &c), &s) in y1.iter_mut().zip(x1).zip(x0).zip(c1).zip(s1) {
                    y.write(b * c + a * s);
                }
            }
        })
    }
}
