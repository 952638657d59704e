//! The one door to the `gemm` crate: every CPU kernel that multiplies matrices (dense and
//! grouped matmul, the convolutions, the attention blocks) calls [`gemm`] or [`gemm_uninit`]
//! here, with each matrix given as a strided view into a slice ([`Mat`], [`MatIn`]). The views
//! are checked against their slices before the one `unsafe` call into the crate, so a wrong
//! size in a caller panics here instead of reading or writing out of bounds.
//!
//! `gemm` takes arbitrary row and column strides, so transposed operands (`Mat::t`) and blocks
//! of larger matrices need no copy.

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
    /// The matrix this view picks out of `data` (an operand of [`gemm`]).
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

/// [`gemm`] into possibly uninitialised output: without `accumulate`, every element the view
/// `dm` covers is written (zeros when `k = 0`) and none is read, so a kernel that owns a fresh
/// buffer skips zeroing it first.
///
/// # Safety
/// With `accumulate`, every element of `dst` the view covers must be initialised.
///
/// # Panics
/// As [`gemm`].
pub(super) unsafe fn gemm_uninit<T: Float + 'static>(
    (dst, dm): (&mut [MaybeUninit<T>], Mat),
    a: MatIn<'_, T>,
    b: MatIn<'_, T>,
    (m, k, n): (usize, usize, usize),
    accumulate: bool,
    beta: T,
    par: ::gemm::Parallelism,
) {
    let (MatIn { data: a, view: am }, MatIn { data: b, view: bm }) = (a, b);
    assert!(
        dm.fits(m, n, dst.len()) && am.fits(m, k, a.len()) && bm.fits(k, n, b.len()),
        "GEMM operand out of bounds: [{m}, {k}]·[{k}, {n}] with views {dm:?} (of {}), {am:?} \
         (of {}), {bm:?} (of {})",
        dst.len(),
        a.len(),
        b.len()
    );
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
