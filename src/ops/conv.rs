//! 2-D convolution and pooling as differentiable ops, each forward beside its backward rule:
//!
//! * [`Tensor::conv2d`] and [`Tensor::grouped_conv2d`] (one weight bank per image, for the CNN
//!   experts of an MoE layer) call the backend's convolution primitives,
//!   `NnOps::conv2d_forward` and in backward `conv2d_input_grad` / `conv2d_weight_grad`
//!   (`src/backend/cpu/conv2d.rs`; `shaders/conv2d.wgsl`, launched by
//!   `src/backend/gpu/conv2d.rs`). The forward kernel adds a bias itself (the bits of a
//!   broadcast `add` after it, one pass fewer); its gradient is the upstream gradient summed
//!   over images and positions.
//! * [`Tensor::max_pool2d`] / [`Tensor::avg_pool2d`] (and their `_padded` forms) call
//!   `NnOps::pool2d_forward` / `pool2d_backward` (`src/backend/cpu/pool2d.rs`;
//!   `shaders/pool2d.wgsl`, launched by `src/backend/gpu/pool2d.rs`). Max pooling keeps the
//!   position of each maximum for backward.
//!
//! Inside [`crate::autocast_f16`] the convolutions are of the f16 class (f16 images, the f32
//! weight read where it is and its gradient written in f32, as `autocast.rs` says) and pooling
//! runs in its input's dtype, so a CNN's activations are f16 from its first convolution on.
//!
//! Only the gradients some input needs are computed (the first convolution of a network needs
//! no input gradient). The backward rules are backend kernels, not tensor ops, so these ops are
//! not twice differentiable. The same operations composed from general primitives
//! (`ops/conv_unfolded.rs`) stay as the reference the tests compare against.

use crate::backend::{Conv2dDims, Pool2dDims, PoolKind};
use crate::{DType, Error, Result, Tensor};

impl Tensor {
    /// 2-D convolution (cross-correlation, as in PyTorch) of `self` `[B, C, H, W]` with `weight`
    /// `[OC, C, KH, KW]` and an optional `bias` `[OC]`; output `[B, OC, OH, OW]` with
    /// `OH = (H + 2·padding − KH) / stride + 1` (the same for `OW`), padding adding zeros on
    /// every side.
    ///
    /// # Errors
    /// [`Error::Shape`] naming the shapes when they do not match or the kernel does not fit the
    /// padded image (or stride is 0); [`Error::DType`] / [`Error::Device`] for mixed dtypes or
    /// devices.
    ///
    /// # Example
    /// ```
    /// use moegrad::{Device, Tensor};
    /// # fn main() -> moegrad::Result<()> {
    /// let x = Tensor::from_f32((1..=9).map(|v| v as f32).collect(), &[1, 1, 3, 3], Device::cpu())?;
    /// let w = Tensor::ones(&[1, 1, 2, 2], moegrad::DType::F32, Device::cpu())?;
    /// let y = x.conv2d(&w, None, 1, 0)?; // sums of 2×2 windows
    /// assert_eq!(y.shape(), &[1, 1, 2, 2]);
    /// assert_eq!(y.to_vec_f32()?, vec![12.0, 16.0, 24.0, 28.0]);
    /// # Ok(()) }
    /// ```
    pub fn conv2d(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        stride: usize,
        padding: usize,
    ) -> Result<Tensor> {
        let _profile = crate::profile::op("conv2d");
        const WHAT: &str = "conv2d";
        if weight.rank() != 4 || self.rank() != 4 || weight.shape()[1] != self.shape()[1] {
            return Err(Error::Shape(format!(
                "{WHAT}: input [B, C, H, W] {:?} and weight [OC, C, KH, KW] {:?} do not match",
                self.shape(),
                weight.shape()
            )));
        }
        let oc = weight.shape()[0];
        if let Some(b) = bias {
            if b.shape() != [oc] {
                return Err(Error::Shape(format!(
                    "{WHAT}: bias {:?} should be [{oc}] for weight {:?}",
                    b.shape(),
                    weight.shape()
                )));
            }
            weight.check_same_device(b, WHAT)?;
            if b.dtype() != weight.dtype() {
                // the kernel reads the bias in the weight's dtype, as `matmul_bias` does
                return self.conv2d(weight, Some(&b.to_dtype(weight.dtype())?), stride, padding);
            }
        }
        let mut banked = weight.shape().to_vec();
        banked.insert(0, 1);
        let banked = weight.reshape(&banked)?;
        self.conv2d_banked((&banked, bias), None, stride, padding, WHAT)
    }

    /// A convolution with one weight bank per image: image `b` of `self` `[B, C, H, W]` is
    /// convolved with `weight[image_bank[b]]`, `weight` `[G, OC, C, KH, KW]`, `image_bank` I32
    /// `[B]`; output `[B, OC, OH, OW]` as in [`Tensor::conv2d`] (no bias). An image whose bank is
    /// outside `0..G` gets zeros and passes no gradient. Each bank's weights are read only for
    /// its own images, so a bank no image uses gets exactly zero gradient: this is the
    /// convolution of the CNN experts of an MoE layer (`moe/cnn_experts.rs`), where the banks
    /// are experts and the images their routed rows.
    ///
    /// # Errors
    /// [`Error::Shape`] naming the shapes when they do not match; [`Error::DType`] unless
    /// `image_bank` is I32 and the others one float dtype; [`Error::Device`] for mixed devices.
    ///
    /// # Example
    /// ```
    /// use moegrad::{DType, Device, Tensor};
    /// # fn main() -> moegrad::Result<()> {
    /// let dev = Device::cpu();
    /// let x = Tensor::ones(&[3, 1, 2, 2], DType::F32, dev)?;
    /// // bank 0 sums a window, bank 1 doubles the sum
    /// let w = Tensor::from_f32(vec![1.0; 4].into_iter().chain(vec![2.0; 4]).collect(), &[2, 1, 1, 2, 2], dev)?;
    /// let banks = Tensor::from_i32(vec![1, 0, -1], &[3], dev)?;
    /// let y = x.grouped_conv2d(&w, &banks, 1, 0)?;
    /// assert_eq!(y.to_vec_f32()?, vec![8.0, 4.0, 0.0]);
    /// # Ok(()) }
    /// ```
    pub fn grouped_conv2d(
        &self,
        weight: &Tensor,
        image_bank: &Tensor,
        stride: usize,
        padding: usize,
    ) -> Result<Tensor> {
        const WHAT: &str = "grouped_conv2d";
        let _profile = crate::profile::op(WHAT);
        if weight.rank() != 5 || self.rank() != 4 || weight.shape()[2] != self.shape()[1] {
            return Err(Error::Shape(format!(
                "{WHAT}: input [B, C, H, W] {:?} and weight [G, OC, C, KH, KW] {:?} do not match",
                self.shape(),
                weight.shape()
            )));
        }
        if image_bank.shape() != [self.shape()[0]] {
            return Err(Error::Shape(format!(
                "{WHAT}: image_bank {:?} should be [{}], one bank per image of {:?}",
                image_bank.shape(),
                self.shape()[0],
                self.shape()
            )));
        }
        if image_bank.dtype() != DType::I32 {
            return Err(Error::DType(format!(
                "{WHAT}: image_bank must be i32, got {}",
                image_bank.dtype()
            )));
        }
        if image_bank.device() != self.device() {
            return Err(Error::Device(format!(
                "{WHAT}: image_bank is on {}, the images on {}",
                image_bank.device(),
                self.device()
            )));
        }
        self.conv2d_banked((weight, None), Some(image_bank), stride, padding, WHAT)
    }

    /// The convolution of `self` `[B, C, H, W]` with a banked weight `[G, OC, C, KH, KW]`
    /// (shapes of rank 4 and 5, channels matching: checked by the callers). Inside
    /// [`crate::autocast_f16`] f32 GPU images are cast to f16 and an f32 weight is read in f32
    /// where it is (the f16-rows kernels: an f16 output, and the weight's gradient summed and
    /// written in f32), as the matrix product does. A `bias` `[OC]` (the weight's dtype and
    /// device, checked by the caller) is added by the convolution's own kernel; its gradient is
    /// the upstream gradient summed over images and positions, in the bias's dtype (from f16
    /// summed in f32, no cast).
    fn conv2d_banked(
        &self,
        (weight, bias): (&Tensor, Option<&Tensor>),
        image_bank: Option<&Tensor>,
        stride: usize,
        padding: usize,
        what: &'static str,
    ) -> Result<Tensor> {
        if let Some([x]) = crate::autocast::low_precision_operands([self])? {
            return x.conv2d_banked((weight, bias), image_bank, stride, padding, what);
        }
        if crate::autocast::reads_f32_weight(self, weight) {
            self.check_same_device(weight, what)?;
        } else {
            self.check_compatible(weight, what)?;
        }
        self.check_float(what)?;
        let (x, w) = (self.shape(), weight.shape());
        let dims = Conv2dDims {
            batch: x[0],
            in_channels: x[1],
            height: x[2],
            width: x[3],
            out_channels: w[1],
            kernel_h: w[3],
            kernel_w: w[4],
            stride,
            padding,
            banks: w[0],
        };
        dims.check(what)?;
        let out_shape = vec![dims.batch, dims.out_channels, dims.out_h(), dims.out_w()];
        if out_shape.contains(&0) || dims.window() == 0 {
            // Nothing to compute (no images, channels or positions): zeros, and zero gradients.
            let out = Tensor::zeros(&out_shape, self.dtype(), self.device())?;
            let (xz, wz) = (
                Tensor::zeros(x, self.dtype(), self.device())?,
                Tensor::zeros(w, weight.dtype(), self.device())?,
            );
            let y = Tensor::record(out, what, &[self, weight], move |_| {
                Ok(vec![Some(xz), Some(wz)])
            });
            return match bias {
                Some(b) => y.add(&b.reshape(&[dims.out_channels, 1, 1])?),
                None => Ok(y),
            };
        }
        let bank = image_bank.map(|b| b.storage().clone());
        let y = self.storage().conv2d_forward(
            weight.storage(),
            bias.map(Tensor::storage),
            bank.as_ref(),
            dims,
        )?;
        let out = Tensor::from_storage(y, out_shape);
        let (need_x, need_w) = (self.requires_grad(), weight.requires_grad());
        // Each gradient keeps only what it reads: dx the weight, dw the input.
        let saved_w = need_x.then(|| weight.detach());
        let saved_x = need_w.then(|| self.detach());
        let (x_shape, w_shape, w_dtype) = (x.to_vec(), w.to_vec(), weight.dtype());
        let bias_grad = bias.map(|b| (b.requires_grad(), b.dtype()));
        let inputs: Vec<&Tensor> = [Some(self), Some(weight), bias]
            .into_iter()
            .flatten()
            .collect();
        Ok(Tensor::record(out, what, &inputs, move |g| {
            let dx = match &saved_w {
                Some(w) => Some(Tensor::from_storage(
                    g.storage()
                        .conv2d_input_grad(w.storage(), bank.as_ref(), dims)?,
                    x_shape,
                )),
                None => None,
            };
            let dw = match &saved_x {
                Some(x) => Some(Tensor::from_storage(
                    x.storage()
                        .conv2d_weight_grad(g.storage(), bank.as_ref(), dims, w_dtype)?,
                    w_shape,
                )),
                None => None,
            };
            let mut grads = vec![dx, dw];
            if let Some((needed, dtype)) = bias_grad {
                // over images and positions, innermost first: the bits of the broadcast add's
                // gradient in f32
                grads.push(
                    needed
                        .then(|| g.sum_as(&[0, 2, 3], false, dtype))
                        .transpose()?,
                );
            }
            Ok(grads)
        }))
    }

    /// Max pooling over `kernel × kernel` windows moved by `stride`, no padding:
    /// `[B, C, H, W]` → `[B, C, OH, OW]`, `OH = (H − kernel) / stride + 1`. The gradient goes to
    /// the first maximum of each window (rows, then columns).
    ///
    /// # Errors
    /// [`Error::Shape`] naming the shape unless it is `[B, C, H, W]` with the window fitting
    /// (and kernel, stride ≥ 1); [`Error::DType`] for an integer tensor.
    pub fn max_pool2d(&self, kernel: usize, stride: usize) -> Result<Tensor> {
        self.pool2d(PoolKind::Max, kernel, stride, 0)
    }

    /// [`Tensor::max_pool2d`] with `padding` (at most `kernel / 2`) on every side, which never
    /// wins a window (it stands for −∞).
    pub fn max_pool2d_padded(
        &self,
        kernel: usize,
        stride: usize,
        padding: usize,
    ) -> Result<Tensor> {
        self.pool2d(PoolKind::Max, kernel, stride, padding)
    }

    /// Average pooling over `kernel × kernel` windows moved by `stride`, no padding (shapes and
    /// errors as [`Tensor::max_pool2d`]).
    pub fn avg_pool2d(&self, kernel: usize, stride: usize) -> Result<Tensor> {
        self.pool2d(PoolKind::Avg, kernel, stride, 0)
    }

    /// [`Tensor::avg_pool2d`] with `padding` (at most `kernel / 2`) zeros on every side, counted
    /// in every mean (each window divides by `kernel²`, as PyTorch's default `count_include_pad`).
    pub fn avg_pool2d_padded(
        &self,
        kernel: usize,
        stride: usize,
        padding: usize,
    ) -> Result<Tensor> {
        self.pool2d(PoolKind::Avg, kernel, stride, padding)
    }

    fn pool2d(
        &self,
        kind: PoolKind,
        kernel: usize,
        stride: usize,
        padding: usize,
    ) -> Result<Tensor> {
        let what = match kind {
            PoolKind::Max => "max_pool2d",
            PoolKind::Avg => "avg_pool2d",
        };
        let _profile = crate::profile::op(what);
        if self.rank() != 4 {
            return Err(Error::Shape(format!(
                "{what}: expected an image batch [B, C, H, W], got shape {:?}",
                self.shape()
            )));
        }
        self.check_float(what)?;
        let s = self.shape();
        let dims = Pool2dDims {
            planes: s[0] * s[1],
            height: s[2],
            width: s[3],
            kernel,
            stride,
            padding,
        };
        dims.check(what)
            .map_err(|e| Error::Shape(format!("{e} (input of shape {:?})", self.shape())))?;
        let out_shape = vec![s[0], s[1], dims.out_h(), dims.out_w()];
        if dims.planes == 0 {
            let out = Tensor::zeros(&out_shape, self.dtype(), self.device())?;
            let dx = Tensor::zeros(s, self.dtype(), self.device())?;
            return Ok(Tensor::record(out, what, &[self], move |_| {
                Ok(vec![Some(dx)])
            }));
        }
        let (y, argmax) = self.storage().pool2d_forward(kind, dims)?;
        let out = Tensor::from_storage(y, out_shape);
        let in_shape = s.to_vec();
        Ok(Tensor::record(out, what, &[self], move |g| {
            let dx = g.storage().pool2d_backward(kind, argmax.as_ref(), dims)?;
            Ok(vec![Some(Tensor::from_storage(dx, in_shape))])
        }))
    }
}
