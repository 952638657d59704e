//! The CPU kernels of 2-D convolution, the end of `Tensor::conv2d` / `Tensor::grouped_conv2d`
//! and of their backward rule on the CPU (`CpuBackend::conv2d_forward`, `conv2d_input_grad`,
//! `conv2d_weight_grad`).
//!
//! Every image is unfolded (im2col) into a per-thread scratch `cols: [C·KH·KW, OH·OW]`, row
//! `(c, i, j)` holding pixel `(c, s·oy + i − p, s·ox + j − p)` of every output position (zero in
//! the padding), and the convolution becomes one GEMM per image through the `gemm` crate:
//!
//! * **forward** `y_b [OC, OH·OW] = W_g [OC, C·KH·KW] · cols_b`, written straight into the
//!   image's slice of the `[B, OC, OH, OW]` output;
//! * **input gradient** `dcols = W_gᵀ · dy_b`, folded back onto the image (col2im: each window
//!   element adds into the pixel it was read from);
//! * **weight gradient** `dW_g += dy_b · cols_bᵀ`, summed over a block of
//!   [`WEIGHT_GRAD_IMAGES`] images of one bank into a partial per block; the partials are then
//!   added per bank in block order, so the result does not depend on the number of threads.
//!
//! `g = image_bank[b]` picks each image's weight bank (the CNN experts of an MoE layer keep one
//! per expert); an image whose bank is out of range gets a zero output and contributes nothing.
//! Work is spread over the threads by blocks of images (rayon), each GEMM single-threaded: a
//! batch of images never waits for one image's tail. With fewer images than threads the GEMMs
//! use `gemm`'s own threads instead.
//!
//! Why im2col + GEMM rather than direct loops: measured on the 2-core development machine with
//! `examples/conv_bench.rs`, see docs/benchmarks.md.

use super::gemm::{Mat, gemm};
use super::{CpuBuffer, f32b, f64b};
use crate::backend::Conv2dDims;
use crate::{Error, Result};
use num_traits::Float;
use rayon::prelude::*;
use std::cell::RefCell;
use std::thread::LocalKey;

/// Images per partial sum of the weight gradient: fixed, so the partials (and the order they are
/// added in) do not depend on the thread count.
pub(crate) const WEIGHT_GRAD_IMAGES: usize = 8;

/// One image's geometry as the kernels use it.
#[derive(Clone, Copy, Debug)]
struct Geometry {
    c: usize,
    h: usize,
    w: usize,
    kh: usize,
    kw: usize,
    stride: usize,
    pad: usize,
    oh: usize,
    ow: usize,
    oc: usize,
}

impl Geometry {
    fn of(d: &Conv2dDims) -> Geometry {
        Geometry {
            c: d.in_channels,
            h: d.height,
            w: d.width,
            kh: d.kernel_h,
            kw: d.kernel_w,
            stride: d.stride,
            pad: d.padding,
            oh: d.out_h(),
            ow: d.out_w(),
            oc: d.out_channels,
        }
    }
    /// Pixels of one image, `C·H·W`.
    fn image(&self) -> usize {
        self.c * self.h * self.w
    }
    /// Output positions of one image, `OH·OW`.
    fn positions(&self) -> usize {
        self.oh * self.ow
    }
    /// Rows of `cols`, `C·KH·KW`.
    fn window(&self) -> usize {
        self.c * self.kh * self.kw
    }
    /// The input row that kernel row `i` reads at output row `oy`, `None` in the padding.
    fn source_row(&self, oy: usize, i: usize) -> Option<usize> {
        let r = oy * self.stride + i;
        (r >= self.pad && r < self.h + self.pad).then(|| r - self.pad)
    }
    /// The output columns `lo..hi` at which kernel column `j` reads a real pixel (the others
    /// read padding); the pixel of column `ox` is `ox·stride + j − pad`.
    fn valid_cols(&self, j: usize) -> (usize, usize) {
        let s = self.stride;
        let hi = if self.w + self.pad > j {
            (self.w + self.pad - j).div_ceil(s).min(self.ow)
        } else {
            0
        };
        let lo = if j >= self.pad {
            0
        } else {
            (self.pad - j).div_ceil(s)
        };
        (lo.min(hi), hi)
    }
}

/// Copies `src` into `dst` (of the same length) as fixed-size chunks of 8 and then element by
/// element: im2col's rows are often a dozen values long, where a call to `memcpy` per row cost
/// more than the copy.
#[inline]
fn copy_row<T: Copy>(dst: &mut [T], src: &[T]) {
    let (d8, d_rest) = dst.as_chunks_mut::<8>();
    let (s8, s_rest) = src.as_chunks::<8>();
    for (a, b) in d8.iter_mut().zip(s8) {
        *a = *b;
    }
    for (a, &b) in d_rest.iter_mut().zip(s_rest) {
        *a = b;
    }
}

/// The float types the kernels run in, each with its per-thread stack of spare buffers.
pub(super) trait ConvFloat: Float + Send + Sync + 'static {
    /// This thread's spare buffers of this type.
    fn spare() -> &'static LocalKey<RefCell<Vec<Vec<Self>>>>;
}

thread_local! {
    static SPARE_F32: RefCell<Vec<Vec<f32>>> = const { RefCell::new(Vec::new()) };
    static SPARE_F64: RefCell<Vec<Vec<f64>>> = const { RefCell::new(Vec::new()) };
}

impl ConvFloat for f32 {
    fn spare() -> &'static LocalKey<RefCell<Vec<Vec<f32>>>> {
        &SPARE_F32
    }
}

impl ConvFloat for f64 {
    fn spare() -> &'static LocalKey<RefCell<Vec<Vec<f64>>>> {
        &SPARE_F64
    }
}

/// How many spare buffers a thread keeps, and the longest it keeps (elements).
const SPARE_BUFFERS: usize = 4;
const SPARE_MAX_LEN: usize = 1 << 22;

/// Runs `f` on a scratch buffer of `len` elements (contents unspecified) taken from this
/// thread's spares and given back afterwards: the im2col buffers are allocated once per thread,
/// not once per call.
fn with_scratch<T: ConvFloat, R>(len: usize, f: impl FnOnce(&mut [T]) -> R) -> R {
    let mut buf = T::spare()
        .with(|s| s.borrow_mut().pop())
        .unwrap_or_default();
    if buf.len() < len {
        buf.resize(len, T::zero());
    }
    let out = f(&mut buf[..len]);
    if buf.len() <= SPARE_MAX_LEN {
        T::spare().with(|s| {
            let mut s = s.borrow_mut();
            if s.len() < SPARE_BUFFERS {
                s.push(buf);
            }
        });
    }
    out
}

/// Unfolds one `[C, H, W]` image into `cols: [C·KH·KW, OH·OW]` (every element written).
fn im2col<T: Float>(img: &[T], g: &Geometry, cols: &mut [T]) {
    let p = g.positions();
    let mut rows = cols.chunks_exact_mut(p);
    for plane in img.chunks_exact(g.h * g.w).take(g.c) {
        for i in 0..g.kh {
            for j in 0..g.kw {
                let Some(row) = rows.next() else { return };
                let (lo, hi) = g.valid_cols(j);
                for (oy, out) in row.chunks_exact_mut(g.ow).enumerate() {
                    let Some(iy) = g.source_row(oy, i) else {
                        out.fill(T::zero());
                        continue;
                    };
                    let src = &plane[iy * g.w..(iy + 1) * g.w];
                    out[..lo].fill(T::zero());
                    out[hi..].fill(T::zero());
                    if lo == hi {
                        continue;
                    }
                    let first = lo * g.stride + j - g.pad;
                    if g.stride == 1 {
                        copy_row(&mut out[lo..hi], &src[first..first + hi - lo]);
                    } else {
                        for (o, &v) in out[lo..hi]
                            .iter_mut()
                            .zip(src[first..].iter().step_by(g.stride))
                        {
                            *o = v;
                        }
                    }
                }
            }
        }
    }
}

/// The adjoint of [`im2col`]: adds every element of `cols: [C·KH·KW, OH·OW]` into the pixel of
/// `img: [C, H, W]` it was read from (padding elements are dropped).
fn col2im<T: Float>(cols: &[T], g: &Geometry, img: &mut [T]) {
    let p = g.positions();
    let mut rows = cols.chunks_exact(p);
    for plane in img.chunks_exact_mut(g.h * g.w).take(g.c) {
        for i in 0..g.kh {
            for j in 0..g.kw {
                let Some(row) = rows.next() else { return };
                let (lo, hi) = g.valid_cols(j);
                for (oy, src) in row.chunks_exact(g.ow).enumerate() {
                    let Some(iy) = g.source_row(oy, i) else {
                        continue;
                    };
                    if lo == hi {
                        continue;
                    }
                    let dst = &mut plane[iy * g.w..(iy + 1) * g.w];
                    let first = lo * g.stride + j - g.pad;
                    if g.stride == 1 {
                        // unit stride: a plain slice walk, which the compiler vectorises
                        for (d, &v) in dst[first..first + hi - lo].iter_mut().zip(&src[lo..hi]) {
                            *d = *d + v;
                        }
                    } else {
                        for (d, &v) in dst[first..].iter_mut().step_by(g.stride).zip(&src[lo..hi]) {
                            *d = *d + v;
                        }
                    }
                }
            }
        }
    }
}

/// Images per task of the forward and input-gradient kernels: about four tasks per thread.
fn images_per_task(batch: usize) -> usize {
    batch
        .div_ceil(4 * rayon::current_num_threads().max(1))
        .max(1)
}

/// `gemm`'s own threads only when there are fewer tasks than threads.
fn inner_parallelism(tasks: usize) -> ::gemm::Parallelism {
    if tasks < rayon::current_num_threads() {
        ::gemm::Parallelism::Rayon(0)
    } else {
        ::gemm::Parallelism::None
    }
}

/// The bank of image `b`, `None` when it is out of range (the image is skipped).
fn bank_of(banks: Option<&[i32]>, b: usize, count: usize) -> Option<usize> {
    match banks {
        None => Some(0),
        Some(v) => {
            let g = *v.get(b)?;
            (g >= 0 && (g as usize) < count).then_some(g as usize)
        }
    }
}

/// `y: [B, OC, OH, OW]`.
fn forward_kernel<T: ConvFloat>(
    (x, w, bias): (&[T], &[T], Option<&[T]>),
    banks: Option<&[i32]>,
    d: &Conv2dDims,
) -> Vec<T> {
    let g = Geometry::of(d);
    let (img, p, k, oc) = (g.image(), g.positions(), g.window(), g.oc);
    let mut y = super::zeroed(d.batch * oc * p);
    if y.is_empty() {
        return y;
    }
    let block = images_per_task(d.batch);
    let par = inner_parallelism(d.batch.div_ceil(block));
    let image = |b: usize, y_b: &mut [T], cols: &mut [T]| {
        let Some(bank) = bank_of(banks, b, d.banks) else {
            return; // stays zero
        };
        im2col(&x[b * img..(b + 1) * img], &g, cols);
        // y_b [OC, P] = W_g [OC, K] · cols [K, P]
        gemm(
            (y_b, Mat::rows(0, p)),
            Mat::rows(bank * oc * k, k).over(w),
            Mat::rows(0, p).over(cols),
            (oc, k, p),
            false,
            T::one(),
            par,
        );
        // the bias after the product: the bits of adding it in a second pass
        if let Some(bias) = bias {
            for (row, &b) in y_b.chunks_exact_mut(p).zip(bias) {
                row.iter_mut().for_each(|v| *v = *v + b);
            }
        }
    };
    y.par_chunks_mut(block * oc * p)
        .enumerate()
        .for_each(|(t, ys)| {
            with_scratch(k * p, |cols: &mut [T]| {
                for (i, y_b) in ys.chunks_exact_mut(oc * p).enumerate() {
                    image(t * block + i, y_b, cols);
                }
            })
        });
    y
}

/// `dx: [B, C, H, W]`.
fn input_grad_kernel<T: ConvFloat>(
    dy: &[T],
    w: &[T],
    banks: Option<&[i32]>,
    d: &Conv2dDims,
) -> Vec<T> {
    let g = Geometry::of(d);
    let (img, p, k, oc) = (g.image(), g.positions(), g.window(), g.oc);
    let mut dx = super::zeroed(d.batch * img);
    if dx.is_empty() || p == 0 {
        return dx;
    }
    let block = images_per_task(d.batch);
    let par = inner_parallelism(d.batch.div_ceil(block));
    let image = |b: usize, dx_b: &mut [T], dcols: &mut [T]| {
        let Some(bank) = bank_of(banks, b, d.banks) else {
            return; // stays zero
        };
        // dcols [K, P] = W_gᵀ [K, OC] · dy_b [OC, P]
        gemm(
            (dcols, Mat::rows(0, p)),
            Mat::rows(bank * oc * k, k).t().over(w),
            Mat::rows(b * oc * p, p).over(dy),
            (k, oc, p),
            false,
            T::one(),
            par,
        );
        col2im(dcols, &g, dx_b);
    };
    dx.par_chunks_mut(block * img)
        .enumerate()
        .for_each(|(t, dxs)| {
            with_scratch(k * p, |dcols: &mut [T]| {
                for (i, dx_b) in dxs.chunks_exact_mut(img).enumerate() {
                    image(t * block + i, dx_b, dcols);
                }
            })
        });
    dx
}

/// Consecutive images of one bank, at most [`WEIGHT_GRAD_IMAGES`] of them: `(bank, b0, b1)`.
fn weight_blocks(banks: Option<&[i32]>, batch: usize, count: usize) -> Vec<(usize, usize, usize)> {
    let mut blocks = Vec::new();
    let mut b = 0;
    while b < batch {
        let Some(bank) = bank_of(banks, b, count) else {
            b += 1;
            continue;
        };
        let mut end = b + 1;
        while end < batch
            && end - b < WEIGHT_GRAD_IMAGES
            && bank_of(banks, end, count) == Some(bank)
        {
            end += 1;
        }
        blocks.push((bank, b, end));
        b = end;
    }
    blocks
}

/// `dw: [banks, OC, C, KH, KW]`.
fn weight_grad_kernel<T: ConvFloat>(
    x: &[T],
    dy: &[T],
    banks: Option<&[i32]>,
    d: &Conv2dDims,
) -> Vec<T> {
    let g = Geometry::of(d);
    let (img, p, k, oc) = (g.image(), g.positions(), g.window(), g.oc);
    let bank_len = oc * k;
    let mut dw = super::zeroed(d.banks * bank_len);
    if dw.is_empty() || p == 0 {
        return dw;
    }
    let blocks = weight_blocks(banks, d.batch, d.banks);
    let par = inner_parallelism(blocks.len());
    let partials: Vec<Vec<T>> = blocks
        .par_iter()
        .map(|&(_, b0, b1)| {
            let mut part = super::zeroed(bank_len);
            with_scratch(k * p, |cols: &mut [T]| {
                for b in b0..b1 {
                    im2col(&x[b * img..(b + 1) * img], &g, cols);
                    // part [OC, K] += dy_b [OC, P] · cols_bᵀ [P, K]
                    gemm(
                        (&mut part, Mat::rows(0, k)),
                        Mat::rows(b * oc * p, p).over(dy),
                        Mat::rows(0, p).t().over(cols),
                        (oc, p, k),
                        b > b0,
                        T::one(),
                        par,
                    );
                }
            });
            part
        })
        .collect();
    dw.par_chunks_mut(bank_len)
        .enumerate()
        .for_each(|(bank, out)| {
            for (_, part) in blocks
                .iter()
                .zip(&partials)
                .filter(|((g, _, _), _)| *g == bank)
            {
                out.iter_mut().zip(part).for_each(|(o, &v)| *o = *o + v);
            }
        });
    dw
}

/// Checks the geometry, each buffer's length and the bank buffer; returns the banks as a slice.
fn check<'a>(
    what: &str,
    operands: &[(&str, &CpuBuffer, usize)],
    image_bank: Option<&'a CpuBuffer>,
    d: &Conv2dDims,
) -> Result<Option<&'a [i32]>> {
    crate::backend::checks::check_lengths(what, operands, d)?;
    crate::backend::checks::check_image_bank(what, image_bank, d)?;
    match image_bank {
        None => Ok(None),
        Some(buf) => Ok(Some(buf.indices(what)?)),
    }
}

/// Runs `$kernel(a, b, banks, &d)` on two float buffers of one dtype.
macro_rules! float_pair {
    ($what:expr, $a:expr, $b:expr, $kernel:ident, $banks:expr, $d:expr) => {
        match ($a, $b) {
            (CpuBuffer::F32(a), CpuBuffer::F32(b)) => Ok(f32b($kernel(a, b, $banks, $d))),
            (CpuBuffer::F64(a), CpuBuffer::F64(b)) => Ok(f64b($kernel(a, b, $banks, $d))),
            (a, b) => Err(Error::DType(format!(
                "{} needs two float buffers of one dtype, got {} and {}",
                $what,
                a.dtype(),
                b.dtype()
            ))),
        }
    };
}

/// `NnOps::conv2d_forward` on the CPU.
pub(super) fn forward(
    x: &CpuBuffer,
    w: &CpuBuffer,
    bias: Option<&CpuBuffer>,
    image_bank: Option<&CpuBuffer>,
    d: Conv2dDims,
) -> Result<CpuBuffer> {
    const WHAT: &str = "conv2d_forward";
    let (xl, wl, _) = d.check(WHAT)?;
    let banks = check(WHAT, &[("x", x, xl), ("w", w, wl)], image_bank, &d)?;
    if let Some(b) = bias {
        crate::backend::checks::check_lengths(WHAT, &[("bias", b, d.out_channels)], &d)?;
    }
    match (x, w, bias) {
        (CpuBuffer::F32(a), CpuBuffer::F32(b), None) => {
            Ok(f32b(forward_kernel((a, b, None), banks, &d)))
        }
        (CpuBuffer::F32(a), CpuBuffer::F32(b), Some(CpuBuffer::F32(c))) => {
            Ok(f32b(forward_kernel((a, b, Some(c)), banks, &d)))
        }
        (CpuBuffer::F64(a), CpuBuffer::F64(b), None) => {
            Ok(f64b(forward_kernel((a, b, None), banks, &d)))
        }
        (CpuBuffer::F64(a), CpuBuffer::F64(b), Some(CpuBuffer::F64(c))) => {
            Ok(f64b(forward_kernel((a, b, Some(c)), banks, &d)))
        }
        (a, b, c) => Err(Error::DType(format!(
            "{WHAT} needs float buffers of one dtype, got x {}, w {}{}",
            a.dtype(),
            b.dtype(),
            c.map_or(String::new(), |c| format!(", bias {}", c.dtype()))
        ))),
    }
}

/// `NnOps::conv2d_input_grad` on the CPU.
pub(super) fn input_grad(
    dy: &CpuBuffer,
    w: &CpuBuffer,
    image_bank: Option<&CpuBuffer>,
    d: Conv2dDims,
) -> Result<CpuBuffer> {
    const WHAT: &str = "conv2d_input_grad";
    let (_, wl, yl) = d.check(WHAT)?;
    let banks = check(WHAT, &[("dy", dy, yl), ("w", w, wl)], image_bank, &d)?;
    float_pair!(WHAT, dy, w, input_grad_kernel, banks, &d)
}

/// `NnOps::conv2d_weight_grad` on the CPU.
pub(super) fn weight_grad(
    x: &CpuBuffer,
    dy: &CpuBuffer,
    image_bank: Option<&CpuBuffer>,
    d: Conv2dDims,
    out: crate::DType,
) -> Result<CpuBuffer> {
    const WHAT: &str = "conv2d_weight_grad";
    if out != x.dtype() {
        return Err(Error::DType(format!(
            "{WHAT}: {} operands give a {} weight gradient on the CPU, not {out} (f16 is a GPU \
             format)",
            x.dtype(),
            x.dtype()
        )));
    }
    let (xl, _, yl) = d.check(WHAT)?;
    let banks = check(WHAT, &[("x", x, xl), ("dy", dy, yl)], image_bank, &d)?;
    float_pair!(WHAT, x, dy, weight_grad_kernel, banks, &d)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// im2col and col2im against a direct reading of the definition, with stride and padding
    /// that leave windows hanging over every edge.
    #[test]
    fn im2col_and_col2im_follow_the_definition() {
        // the last: kernel column 2 reads only padding (w + pad ≤ j)
        for (h, w, kh, kw, stride, pad) in [
            (5, 4, 3, 2, 2, 1),
            (3, 3, 3, 3, 1, 2),
            (4, 6, 1, 3, 3, 0),
            (2, 1, 1, 3, 1, 1),
        ] {
            let d = Conv2dDims {
                batch: 1,
                in_channels: 2,
                height: h,
                width: w,
                out_channels: 1,
                kernel_h: kh,
                kernel_w: kw,
                stride,
                padding: pad,
                banks: 1,
            };
            let g = Geometry::of(&d);
            let img: Vec<f64> = (0..g.image()).map(|v| v as f64 + 1.0).collect();
            let mut cols = vec![-1.0; g.window() * g.positions()];
            im2col(&img, &g, &mut cols);
            let mut folded = vec![0.0; g.image()];
            col2im(&cols, &g, &mut folded);
            let mut expect_folded = vec![0.0; g.image()];
            for c in 0..g.c {
                for i in 0..kh {
                    for j in 0..kw {
                        for oy in 0..g.oh {
                            for ox in 0..g.ow {
                                let row = (c * kh + i) * kw + j;
                                let got = cols[row * g.positions() + oy * g.ow + ox];
                                let (r, q) = (
                                    (oy * stride + i) as isize - pad as isize,
                                    (ox * stride + j) as isize - pad as isize,
                                );
                                let inside =
                                    r >= 0 && q >= 0 && (r as usize) < h && (q as usize) < w;
                                let at = c * h * w + r.max(0) as usize * w + q.max(0) as usize;
                                let want = if inside { img[at] } else { 0.0 };
                                assert_eq!(got, want, "{d:?} at ({c},{i},{j},{oy},{ox})");
                                if inside {
                                    expect_folded[at] += got;
                                }
                            }
                        }
                    }
                }
            }
            assert_eq!(folded, expect_folded, "{d:?}");
        }
    }

    /// Blocks of the weight gradient stay within one bank, hold at most WEIGHT_GRAD_IMAGES
    /// images and skip images without a bank.
    #[test]
    fn weight_blocks_split_runs_and_skip_unbanked_images() {
        let banks = [0, 0, -1, 1, 1, 1, 0, 3];
        let mut long = vec![2; WEIGHT_GRAD_IMAGES + 3];
        long.insert(0, 0);
        assert_eq!(
            weight_blocks(Some(&banks), banks.len(), 3),
            vec![(0, 0, 2), (1, 3, 6), (0, 6, 7)]
        );
        assert_eq!(
            weight_blocks(Some(&long), long.len(), 3),
            vec![
                (0, 0, 1),
                (2, 1, 1 + WEIGHT_GRAD_IMAGES),
                (2, 1 + WEIGHT_GRAD_IMAGES, long.len())
            ]
        );
    }
}
