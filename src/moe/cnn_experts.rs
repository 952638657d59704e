//! The CNN experts of the MOESART paper's MultiMNIST setup, `n` of them stored stacked and run
//! with the same grouped matmul as the MLP experts:
//!
//! ```text
//! image → conv 5×5×10, ReLU, max-pool 2 → conv 5×5×20, ReLU, max-pool 2 → dense 50, ReLU → dense 50, ReLU
//! ```
//!
//! Each convolution is one [`Tensor::grouped_conv2d`] over all routed rows (images) at once,
//! every image convolved with its own expert's filters (`plan.row_expert` picks the bank; a
//! dropped row gets zeros). The backend spreads the images over the threads whichever expert
//! they belong to, so no expert waits for another's tail, and computes each expert's weight
//! gradient from its own images only: an expert that received no rows gets exactly zero. The
//! dense layers are grouped matmuls, as for the MLP experts.
//!
//! The convolution weights are stored `[n, C·5·5, OC]` (the layout of a grouped matmul over
//! unfolded windows, which is how these experts were first computed; checkpoints keep it) and
//! transposed to the kernels' `[n, OC, C, 5, 5]` on use, a copy of a few thousand values.

use super::DispatchPlan;
use super::experts::ExpertNet;
use crate::nn::Parameters;
use crate::nn::{Module, Param, join, uniform};
use crate::{DType, Device, Error, Result, Tensor};
use rand_chacha::ChaCha8Rng;

/// `n` LeNet-style experts on `side × side` single-channel images, output width 50.
pub struct CnnExpertBank {
    /// `[n, 1·5·5, 10]`
    pub conv1: Param,
    /// `[n, 10]`
    pub conv1_bias: Param,
    /// `[n, 10·5·5, 20]`
    pub conv2: Param,
    /// `[n, 20]`
    pub conv2_bias: Param,
    /// `[n, 20·s·s, 50]`
    pub dense1: Param,
    /// `[n, 50]`
    pub dense1_bias: Param,
    /// `[n, 50, 50]`
    pub dense2: Param,
    /// `[n, 50]`
    pub dense2_bias: Param,
    side: usize,
}

/// Output width of a CNN expert.
pub const CNN_EXPERT_OUT: usize = 50;

impl CnnExpertBank {
    /// `experts` CNN experts for `side × side` images (side ≥ 16).
    pub fn new(
        experts: usize,
        side: usize,
        rng: &mut ChaCha8Rng,
        device: Device,
    ) -> Result<CnnExpertBank> {
        if side < 16 || experts == 0 {
            return Err(Error::Invalid(format!(
                "CNN experts need images of side ≥ 16 and n ≥ 1, got side {side}, n {experts}"
            )));
        }
        let after = ((side - 4) / 2 - 4) / 2;
        let w = |shape: &[usize], fan_in: usize, rng: &mut ChaCha8Rng| {
            Param::new(uniform(shape, (6.0 / fan_in as f64).sqrt(), rng, device)?)
        };
        let z = |shape: &[usize]| Param::new(Tensor::zeros(shape, DType::F32, device)?);
        Ok(CnnExpertBank {
            conv1: w(&[experts, 25, 10], 25, rng)?,
            conv1_bias: z(&[experts, 10])?,
            conv2: w(&[experts, 250, 20], 250, rng)?,
            conv2_bias: z(&[experts, 20])?,
            dense1: w(&[experts, 20 * after * after, 50], 20 * after * after, rng)?,
            dense1_bias: z(&[experts, 50])?,
            dense2: w(&[experts, 50, 50], 50, rng)?,
            dense2_bias: z(&[experts, 50])?,
            side,
        })
    }

    /// One grouped convolution (5×5, each image with its expert's filters `w` `[n, C·25, OC]`
    /// and bias `b` `[n, OC]`) + ReLU + 2×2 max-pool on `[A, C, H, W]` images.
    ///
    /// Computed as convolution → max-pool → bias → ReLU: a bias constant over each window and
    /// a monotone ReLU commute with the max, so the values are those of the order above, while
    /// the two elementwise passes (and their backward) run on a quarter of the elements.
    fn conv_block(x: &Tensor, w: &Tensor, b: &Tensor, plan: &DispatchPlan) -> Result<Tensor> {
        let (a, c) = (x.shape()[0], x.shape()[1]);
        let (n, oc) = (w.shape()[0], w.shape()[2]);
        let banks = w.transpose(1, 2)?.reshape(&[n, oc, c, 5, 5])?;
        let bias = b
            .index_select(0, &plan.row_expert_clamped)?
            .reshape(&[a, oc, 1, 1])?;
        x.grouped_conv2d(&banks, &plan.row_expert, 1, 0)?
            .max_pool2d(2, 2)?
            .add(&bias)?
            .relu()
    }
}

impl ExpertNet for CnnExpertBank {
    fn forward_rows(&self, rows: &Tensor, plan: &DispatchPlan) -> Result<Tensor> {
        let a = rows.shape()[0];
        let x = rows.reshape(&[a, 1, self.side, self.side])?;
        let (re, off) = (&plan.row_expert, &plan.offsets);
        let h = Self::conv_block(&x, &self.conv1.get(), &self.conv1_bias.get(), plan)?;
        let h = Self::conv_block(&h, &self.conv2.get(), &self.conv2_bias.get(), plan)?;
        let h = h.reshape(&[a, h.numel() / a.max(1)])?;
        // The dense layers add their expert's bias inside the grouped kernel; a dropped or
        // invalid row (expert −1) gets exact zeros from the second one, so no masking pass.
        let h = h
            .grouped_matmul_with_bias(&self.dense1.get(), Some(&self.dense1_bias.get()), re, off)?
            .relu()?;
        h.grouped_matmul_with_bias(&self.dense2.get(), Some(&self.dense2_bias.get()), re, off)?
            .relu()
    }
    fn experts(&self) -> usize {
        self.conv1.get().shape()[0]
    }
    fn d_out(&self) -> usize {
        CNN_EXPERT_OUT
    }
}

impl Module for CnnExpertBank {
    /// Every expert on every image (`[T, side²]` → `[n, T, 50]`): the dense reference for tests.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (t, n) = (x.shape()[0], self.experts());
        let mut outs = Vec::new();
        for e in 0..n {
            let row_expert = Tensor::full(&[t], e as f64, DType::I32, x.device())?;
            let mut offs = vec![0i32; n + 1];
            for (i, o) in offs.iter_mut().enumerate() {
                *o = if i <= e { 0 } else { t as i32 };
            }
            let plan = DispatchPlan::identity(
                &row_expert,
                Tensor::from_i32(offs, &[n + 1], x.device())?,
                x.dtype(),
            )?;
            outs.push(
                self.forward_rows(x, &plan)?
                    .reshape(&[1, t, CNN_EXPERT_OUT])?,
            );
        }
        Tensor::concat(&outs, 0)
    }
}

impl Parameters for CnnExpertBank {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(String, &Param)) {
        for (name, p) in [
            ("conv1", &self.conv1),
            ("conv1_bias", &self.conv1_bias),
            ("conv2", &self.conv2),
            ("conv2_bias", &self.conv2_bias),
            ("dense1", &self.dense1),
            ("dense1_bias", &self.dense1_bias),
            ("dense2", &self.dense2),
            ("dense2_bias", &self.dense2_bias),
        ] {
            f(join(prefix, name), p);
        }
    }
}
