//! The composed reference for 2-D convolution and pooling, written from general differentiable
//! primitives (no kernels of its own), kept so that the dedicated kernels of `ops/conv.rs` can be
//! tested against it:
//!
//! 1. *unfold* (im2col): each image's `[C, H·W]` pixels, plus one appended zero that padding
//!    positions point at, are gathered with `index_select` into `[C, OH·OW·KH·KW]` windows; the
//!    window index is computed once per geometry and cached on the device.
//! 2. convolution is then one matmul of the windows `[B·OH·OW, C·KH·KW]` with the weight
//!    `[C·KH·KW, OC]`; pooling is a max or mean over each window.
//!
//! Gradients come from the pieces: `index_select`'s backward is the scatter-add (col2im). This
//! was moegrad's convolution until the dedicated kernels replaced it: clear, but the general
//! gathers and scatters over every window dominated a CNN's training step.

use crate::{Device, Error, Result, Tensor};
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

/// Geometry of a sliding window over an `h × w` image.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Window {
    h: usize,
    w: usize,
    kh: usize,
    kw: usize,
    stride: usize,
    pad: usize,
}

impl Window {
    fn out(&self) -> Result<(usize, usize)> {
        let (hp, wp) = (self.h + 2 * self.pad, self.w + 2 * self.pad);
        if self.stride == 0 || self.kh == 0 || self.kw == 0 || self.kh > hp || self.kw > wp {
            return Err(Error::Shape(format!(
                "window {}×{} with stride {} and padding {} does not fit an image of {}×{}",
                self.kh, self.kw, self.stride, self.pad, self.h, self.w
            )));
        }
        Ok((
            (hp - self.kh) / self.stride + 1,
            (wp - self.kw) / self.stride + 1,
        ))
    }

    /// For every output position and kernel offset, the flat pixel index (or `h·w`, the appended
    /// zero, where the window hangs over the padding). Order: `(oh, ow, kh, kw)`.
    fn indices(&self) -> Result<Vec<i32>> {
        let (oh, ow) = self.out()?;
        let mut idx = Vec::with_capacity(oh * ow * self.kh * self.kw);
        for y in 0..oh {
            for x in 0..ow {
                for i in 0..self.kh {
                    for j in 0..self.kw {
                        let r = (y * self.stride + i) as isize - self.pad as isize;
                        let c = (x * self.stride + j) as isize - self.pad as isize;
                        let inside =
                            r >= 0 && c >= 0 && (r as usize) < self.h && (c as usize) < self.w;
                        idx.push(if inside {
                            (r as usize * self.w + c as usize) as i32
                        } else {
                            (self.h * self.w) as i32
                        });
                    }
                }
            }
        }
        Ok(idx)
    }
}

type WindowCache = Mutex<HashMap<(Window, Device), Tensor>>;

/// The window index tensor for a geometry, built once per device and reused every step.
fn window_index(win: Window, device: Device) -> Result<Tensor> {
    static CACHE: OnceLock<WindowCache> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    if let Some(t) = cache
        .lock()
        .ok()
        .and_then(|c| c.get(&(win, device)).cloned())
    {
        return Ok(t);
    }
    let idx = win.indices()?;
    let n = idx.len();
    let t = Tensor::from_i32(idx, &[n], device)?;
    if let Ok(mut c) = cache.lock() {
        c.insert((win, device), t.clone());
    }
    Ok(t)
}

impl Tensor {
    /// Windows of a `[B, C, H, W]` tensor (im2col): `[B, C, OH·OW, KH·KW]`, window order
    /// `(oh, ow)`, offsets `(kh, kw)`, zeros where a window hangs over the padding.
    pub fn unfold_windows(
        &self,
        kh: usize,
        kw: usize,
        stride: usize,
        pad: usize,
    ) -> Result<Tensor> {
        Ok(self.unfold(kh, kw, stride, pad)?.0)
    }

    /// [`Tensor::unfold_windows`] plus `(OH, OW)`.
    fn unfold(
        &self,
        kh: usize,
        kw: usize,
        stride: usize,
        pad: usize,
    ) -> Result<(Tensor, usize, usize)> {
        if self.rank() != 4 {
            return Err(Error::Shape(format!(
                "expected an image batch [B, C, H, W], got shape {:?}",
                self.shape()
            )));
        }
        let (b, c, h, w) = (
            self.shape()[0],
            self.shape()[1],
            self.shape()[2],
            self.shape()[3],
        );
        let win = Window {
            h,
            w,
            kh,
            kw,
            stride,
            pad,
        };
        let (oh, ow) = win.out()?;
        let idx = window_index(win, self.device())?;
        let flat = self.reshape(&[b, c, h * w])?;
        let with_zero = Tensor::concat(
            &[
                flat,
                Tensor::zeros(&[b, c, 1], self.dtype(), self.device())?,
            ],
            2,
        )?;
        let cols = with_zero
            .index_select(2, &idx)?
            .reshape(&[b, c, oh * ow, kh * kw])?;
        Ok((cols, oh, ow))
    }

    /// [`Tensor::conv2d`] composed from [`Tensor::unfold_windows`] and one matmul: the reference
    /// the dedicated kernels are tested against.
    pub fn conv2d_unfolded(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        stride: usize,
        padding: usize,
    ) -> Result<Tensor> {
        if weight.rank() != 4 || self.rank() != 4 || weight.shape()[1] != self.shape()[1] {
            return Err(Error::Shape(format!(
                "conv2d: input [B, C, H, W] {:?} and weight [OC, C, KH, KW] {:?} do not match",
                self.shape(),
                weight.shape()
            )));
        }
        let (oc, c, kh, kw) = (
            weight.shape()[0],
            weight.shape()[1],
            weight.shape()[2],
            weight.shape()[3],
        );
        if let Some(b) = bias
            && b.shape() != [oc]
        {
            return Err(Error::Shape(format!(
                "conv2d: bias {:?} should be [{oc}]",
                b.shape()
            )));
        }
        let batch = self.shape()[0];
        let (cols, oh, ow) = self.unfold(kh, kw, stride, padding)?;
        let l = oh * ow;
        let rows = cols
            .permute(&[0, 2, 1, 3])?
            .reshape(&[batch * l, c * kh * kw])?;
        let wmat = weight.reshape(&[oc, c * kh * kw])?.transpose(0, 1)?;
        let mut out = rows.matmul(&wmat)?;
        if let Some(b) = bias {
            out = out.add(b)?;
        }
        out.reshape(&[batch, oh, ow, oc])?.permute(&[0, 3, 1, 2])
    }

    fn pool2d_unfolded(&self, kernel: usize, stride: usize, max: bool) -> Result<Tensor> {
        let (cols, oh, ow) = self.unfold(kernel, kernel, stride, 0)?;
        let pooled = if max {
            cols.max(-1, false)?
        } else {
            cols.mean(&[-1], false)?
        };
        pooled.reshape(&[self.shape()[0], self.shape()[1], oh, ow])
    }

    /// [`Tensor::max_pool2d`] composed from [`Tensor::unfold_windows`] and a max over each
    /// window: the reference for tests.
    pub fn max_pool2d_unfolded(&self, kernel: usize, stride: usize) -> Result<Tensor> {
        self.pool2d_unfolded(kernel, stride, true)
    }

    /// [`Tensor::avg_pool2d`] composed from [`Tensor::unfold_windows`] and a mean over each
    /// window: the reference for tests.
    pub fn avg_pool2d_unfolded(&self, kernel: usize, stride: usize) -> Result<Tensor> {
        self.pool2d_unfolded(kernel, stride, false)
    }
}
