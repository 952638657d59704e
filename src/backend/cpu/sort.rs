//! Sorting kernels: `argsort` and its top-k form `argsort_top`, on integer keys whose unsigned
//! order is the float order ([`sort_key`], [`sort_key_f32`], also used by the routing kernels).

use super::PAR_MIN;
use num_traits::Float;
use rayon::prelude::*;

/// A key whose unsigned order is the order of `x` as the sort sees it: NaN as −∞, −0 as +0
/// (each compares equal to its partner, so both must get one key), then the IEEE bits with the
/// sign flipped for positive values and all bits flipped for negative ones.
pub(super) fn sort_key(x: f64) -> u64 {
    let x = if x.is_nan() {
        f64::NEG_INFINITY
    } else if x == 0.0 {
        0.0
    } else {
        x
    };
    let bits = x.to_bits();
    if bits >> 63 == 1 {
        !bits
    } else {
        bits | (1 << 63)
    }
}

/// [`sort_key`] for an f32, in 32 bits.
pub(super) fn sort_key_f32(x: f32) -> u32 {
    let x = if x.is_nan() {
        f32::NEG_INFINITY
    } else if x == 0.0 {
        0.0
    } else {
        x
    };
    let bits = x.to_bits();
    if bits >> 31 == 1 {
        !bits
    } else {
        bits | (1 << 31)
    }
}

/// Stable argsort of each row, keeping the first `keep` columns (`keep = len` for a full
/// argsort). Each element becomes one integer, its key (from [`sort_key`], inverted for a
/// descending sort) above its index, so one unstable sort of plain integers gives the stable
/// order: equal keys fall back to the index. With `keep < len` the `keep` first keys are
/// selected (`select_nth_unstable`) and only they are sorted. f32 rows pack into u64, f64 rows
/// into u128. One scratch vector per rayon task, none per row.
pub(super) fn argsort_kernel<T: Float + Send + Sync>(
    x: &[T],
    rows: usize,
    len: usize,
    keep: usize,
    descending: bool,
) -> Vec<i32> {
    let keep = keep.min(len);
    let mut out = vec![0i32; rows * keep];
    let narrow = std::mem::size_of::<T>() == 4;
    let flip = |k: u64| if descending { !k } else { k };
    let sort_row = |(narrow_keys, wide_keys): &mut (Vec<u64>, Vec<u128>),
                    (r, row_out): (usize, &mut [i32])| {
        let row = &x[r * len..(r + 1) * len];
        if narrow {
            narrow_keys.clear();
            narrow_keys.extend(row.iter().enumerate().map(|(i, v)| {
                let k = sort_key_f32(v.to_f32().unwrap_or(f32::NAN)) as u64;
                (flip(k << 32) & !0xFFFF_FFFF) | i as u64
            }));
            sort_first(narrow_keys, keep);
            for (slot, &k) in row_out.iter_mut().zip(narrow_keys.iter()) {
                *slot = k as u32 as i32;
            }
        } else {
            wide_keys.clear();
            wide_keys.extend(row.iter().enumerate().map(|(i, v)| {
                let k = flip(sort_key(v.to_f64().unwrap_or(f64::NAN)));
                ((k as u128) << 64) | i as u128
            }));
            sort_first(wide_keys, keep);
            for (slot, &k) in row_out.iter_mut().zip(wide_keys.iter()) {
                *slot = k as u64 as i32;
            }
        }
    };
    let scratch = || (Vec::with_capacity(len), Vec::new());
    if keep > 0 {
        if rows * len >= PAR_MIN && rows > 1 {
            out.par_chunks_mut(keep)
                .enumerate()
                .for_each_init(scratch, sort_row);
        } else {
            let mut keys = scratch();
            out.chunks_mut(keep)
                .enumerate()
                .for_each(|row| sort_row(&mut keys, row));
        }
    }
    out
}

/// Sorts the `keep` smallest elements of `v` into its front (all of `v` when `keep ≥ len`).
pub(super) fn sort_first<K: Ord + Copy>(v: &mut [K], keep: usize) {
    if keep < v.len() {
        if keep == 0 {
            return;
        }
        if keep <= 8 {
            // a router's top-k: one pass that keeps the `keep` smallest keys sorted in front
            // (an insertion when a key beats the worst kept one), cheaper than a selection for
            // short lists; the keys are distinct, so the result is the selection's
            v[..keep].sort_unstable();
            for i in keep..v.len() {
                let key = v[i];
                if key < v[keep - 1] {
                    let mut j = keep - 1;
                    while j > 0 && v[j - 1] > key {
                        v[j] = v[j - 1];
                        j -= 1;
                    }
                    v[j] = key;
                }
            }
            return;
        }
        v.select_nth_unstable(keep - 1);
        v[..keep].sort_unstable();
    } else {
        v.sort_unstable();
    }
}
