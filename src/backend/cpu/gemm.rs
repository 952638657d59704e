//! The one door to the `gemm` crate: every CPU kernel that multiplies matrices (dense and
//! grouped matmul, the convolutions, the attention blocks) calls [`gemm()`] or [`gemm_uninit`]
//! here, with each matrix given as a strided view into a slice ([`Mat`], [`MatIn`]). The views
//! are checked against their slices before the one `unsafe` call into the crate, so a wrong
//! size in a caller panics here instead of reading or writing out of bounds.
//!
//! `gemm` takes arbitrary row and column strides, so transposed operands (`Mat::t`) and blocks
//! of larger matrices need no copy.
//!
//! [`gemm_uninit_threaded`] picks how one product uses the threads: the crate's own threading
//! for large products (it shares the packed operands between threads), and for the mid-sized
//! ones of small models (`[768, 128]·[128, 512]`, a weight gradient `[128, 768]·[768, 128]`) one
//! single-threaded call per thread on a strip of the output, which measured 10–80% faster on
//! those shapes than the crate's split of them (docs/benchmarks.md).

use crate::backend::MatLayout;
use num_traits::Float;
use std::mem::MaybeUninit;

/// A matrix inside a slice: element `(r, c)` at `offset + r·rs + c·cs`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Mat {
    /// element index of `(0, 0)`
    pub(super) offset: usize,
    /// distance between consecutive rows
    pub(super) rs: usize,
    /// distance between consecutive columns
    pub(super) cs: usize,
}

impl Mat {
    /// A row-major matrix with rows `width` apart, starting at `offset`.
    pub(super) fn rows(offset: usize, width: usize) -> Mat {
        Mat {
            offset,
            rs: width,
            cs: 1,
        }
    }
    /// One matrix of a batched operand (the batch stride is the caller's to apply).
    pub(super) fn from_layout(l: MatLayout) -> Mat {
        Mat {
            offset: l.offset,
            rs: l.row_stride,
            cs: l.col_stride,
        }
    }
    /// The same matrix read transposed.
    pub(super) fn t(self) -> Mat {
        Mat {
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }
    /// True when every element of a `rows × cols` matrix read through this view lies in `len`.
    pub(super) fn fits(&self, rows: usize, cols: usize, len: usize) -> bool {
        rows == 0 || cols == 0 || self.offset + (rows - 1) * self.rs + (cols - 1) * self.cs < len
    }
    /// The matrix this view picks out of `data` (an operand of [`gemm()`]).
    pub(super) fn over<T>(self, data: &[T]) -> MatIn<'_, T> {
        MatIn { data, view: self }
    }
}

/// A matrix read from a slice through a [`Mat`] view.
#[derive(Clone, Copy)]
pub(super) struct MatIn<'a, T> {
    pub(super) data: &'a [T],
    pub(super) view: Mat,
}

impl<'a, T> MatIn<'a, T> {
    /// Rows `first..` of a row-major matrix in `data` whose rows have `width` elements.
    pub(super) fn rows(data: &'a [T], first: usize, width: usize) -> MatIn<'a, T> {
        Mat::rows(first * width, width).over(data)
    }
    /// The same matrix read transposed.
    pub(super) fn t(self) -> MatIn<'a, T> {
        MatIn {
            view: self.view.t(),
            ..self
        }
    }
}

/// Panics unless every element an `[m, k]·[k, n]` product reads or writes through the views
/// lies inside its slice (the output given as its length and view).
fn assert_in_bounds<T>(
    (dst_len, dm): (usize, Mat),
    a: MatIn<'_, T>,
    b: MatIn<'_, T>,
    (m, k, n): (usize, usize, usize),
) {
    let (am, bm) = (a.view, b.view);
    assert!(
        dm.fits(m, n, dst_len) && am.fits(m, k, a.data.len()) && bm.fits(k, n, b.data.len()),
        "GEMM operand out of bounds: [{m}, {k}]·[{k}, {n}] with views {dm:?} (of {dst_len}), \
         {am:?} (of {}), {bm:?} (of {})",
        a.data.len(),
        b.data.len()
    );
}

/// `dst = beta·a·b` (or `dst += beta·a·b` with `accumulate`) for `a: m×k`, `b: k×n` and the
/// output `(dst, dm)`, an `m×n` matrix in `dst` at the view `dm`; `k = 0` gives zeros (or leaves
/// `dst` as it is).
///
/// # Panics
/// When a view reaches outside its slice (a bug in the caller: sizes come from dims the
/// backend checked against the buffers).
pub(super) fn gemm<T: Float + 'static>(
    (dst, dm): (&mut [T], Mat),
    a: MatIn<'_, T>,
    b: MatIn<'_, T>,
    dims: (usize, usize, usize),
    accumulate: bool,
    beta: T,
    par: ::gemm::Parallelism,
) {
    // SAFETY: `MaybeUninit<T>` has `T`'s layout, `dst` is initialised (so `accumulate` may read
    // it), and `gemm_uninit` stores only values of `T` into it.
    let dst = unsafe { &mut *(dst as *mut [T] as *mut [MaybeUninit<T>]) };
    unsafe { gemm_uninit((dst, dm), a, b, dims, accumulate, beta, par) }
}

/// [`gemm()`] into possibly uninitialised output: without `accumulate`, every element the view
/// `dm` covers is written (zeros when `k = 0`) and none is read, so a kernel that owns a fresh
/// buffer skips zeroing it first.
///
/// # Safety
/// With `accumulate`, every element of `dst` the view covers must be initialised.
///
/// # Panics
/// As [`gemm()`].
pub(super) unsafe fn gemm_uninit<T: Float + 'static>(
    (dst, dm): (&mut [MaybeUninit<T>], Mat),
    a: MatIn<'_, T>,
    b: MatIn<'_, T>,
    (m, k, n): (usize, usize, usize),
    accumulate: bool,
    beta: T,
    par: ::gemm::Parallelism,
) {
    assert_in_bounds((dst.len(), dm), a, b, (m, k, n));
    let (MatIn { data: a, view: am }, MatIn { data: b, view: bm }) = (a, b);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for r in 0..m {
                for c in 0..n {
                    dst[dm.offset + r * dm.rs + c * dm.cs] = MaybeUninit::new(T::zero());
                }
            }
        }
        return;
    }
    // SAFETY: the assertion above puts every element gemm reads or writes inside its slice.
    // With `read_dst = false` gemm stores `beta·a·b` into every element of the view without
    // loading it (its `alpha` is then unused), so uninitialised memory is never read; with
    // `accumulate` the caller promised the elements are initialised.
    unsafe {
        ::gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr().add(dm.offset).cast::<T>(),
            dm.cs as isize,
            dm.rs as isize,
            accumulate,
            a.as_ptr().add(am.offset),
            am.cs as isize,
            am.rs as isize,
            b.as_ptr().add(bm.offset),
            bm.cs as isize,
            bm.rs as isize,
            T::one(),
            beta,
            false,
            false,
            false,
            par,
        );
    }
}

/// Products of at least this many multiply-adds use the threads (smaller ones run on one).
const THREADED_MIN_MACS: usize = 64 * 64 * 64;

/// Products of at most this many multiply-adds are split into strips by
/// [`gemm_uninit_threaded`]; larger ones use the crate's threading.
const STRIPS_MAX_MACS: usize = 1 << 28;

/// A pointer moved into the strips' tasks (each writes its own elements through it).
#[derive(Clone, Copy)]
struct SendPtr<T>(*mut T);
// SAFETY: the strips write disjoint elements of one output and read shared inputs.
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}

impl<T> SendPtr<T> {
    /// The pointer (a method, so that a closure captures the whole `SendPtr`, not its field).
    fn get(self) -> *mut T {
        self.0
    }
}

/// [`gemm_uninit`] (no accumulation, `beta = 1`) on up to `threads` threads, used as suits the
/// size: one thread below [`THREADED_MIN_MACS`]; above it, the output cut into one strip per
/// thread (along its rows or columns, at least 32 each), each strip a single-threaded product, up
/// to [`STRIPS_MAX_MACS`]; the crate's own threading beyond. Every output element is computed by
/// the same sequence of operations whichever way it is cut.
///
/// # Safety
/// None beyond [`gemm_uninit`]'s: the output may be uninitialised (it is only written).
///
/// # Panics
/// As [`gemm()`].
pub(super) unsafe fn gemm_uninit_threaded<T: Float + Send + Sync + 'static>(
    (dst, dm): (&mut [MaybeUninit<T>], Mat),
    a: MatIn<'_, T>,
    b: MatIn<'_, T>,
    (m, k, n): (usize, usize, usize),
    threads: usize,
) {
    use ::gemm::Parallelism;
    use rayon::prelude::*;
    let macs = m.saturating_mul(k).saturating_mul(n);
    let whole = |dst: &mut [MaybeUninit<T>], par| {
        // SAFETY: as the caller's: no accumulation, the output is only written.
        unsafe { gemm_uninit((dst, dm), a, b, (m, k, n), false, T::one(), par) }
    };
    if macs < THREADED_MIN_MACS || threads < 2 {
        return whole(dst, Parallelism::None);
    }
    if macs > STRIPS_MAX_MACS {
        return whole(dst, Parallelism::Rayon(threads));
    }
    assert_in_bounds((dst.len(), dm), a, b, (m, k, n));
    let (MatIn { data: ad, view: am }, MatIn { data: bd, view: bm }) = (a, b);
    // cut the longer side of the output (rows of `a` and `dst`, or columns of `b` and `dst`),
    // or the rows whenever each thread gets at least 256 of them: measured on 2 cores, the
    // forward `[768, 128]·[128, 1024]` runs 5-8% faster cut by rows, while short wide products
    // with a long inner side (a weight gradient `[128, 768]·[768, 1024]`) prefer the columns
    let by_rows = m >= n || m >= 256 * threads;
    let side = if by_rows { m } else { n };
    let strips = threads.min(side.div_ceil(32));
    let width = side.div_ceil(strips).next_multiple_of(16);
    let out = SendPtr(dst.as_mut_ptr().cast::<T>());
    (0..strips).into_par_iter().for_each(|i| {
        let (first, end) = (i * width, ((i + 1) * width).min(side));
        if first >= end {
            return;
        }
        let (dst_at, a_at, b_at, rows, cols) = if by_rows {
            let shift = (first * dm.rs, first * am.rs, 0);
            (shift.0, shift.1, shift.2, end - first, n)
        } else {
            (first * dm.cs, 0, first * bm.cs, m, end - first)
        };
        // SAFETY: the assertion above put the whole product inside the slices, and each strip
        // is a block of it; the strips write disjoint elements of the output, which no
        // reference aliases while they run (the caller's `&mut` is only used through `out`).
        unsafe {
            ::gemm::gemm(
                rows,
                cols,
                k,
                out.get().add(dm.offset + dst_at),
                dm.cs as isize,
                dm.rs as isize,
                false,
                ad.as_ptr().add(am.offset + a_at),
                am.cs as isize,
                am.rs as isize,
                bd.as_ptr().add(bm.offset + b_at),
                bm.cs as isize,
                bm.rs as isize,
                T::one(),
                T::one(),
                false,
                false,
                false,
                Parallelism::None,
            );
        }
    });
}
