//! The grouped (per-expert) matmul at the heart of an MoE layer: rows of `x` sorted by expert,
//! each multiplied by its own expert's weight. Forward and both backward products read each
//! expert's weights only for that expert's rows, so an expert that received no tokens costs
//! nothing and gets exactly zero gradient.
//!
//! * forward   `y[r] = x[r] · W[e_r]`
//! * backward  `∂x[r] = ∂y[r] · W[e_r]ᵀ`  (the same kernel with the weight transposed)
//! * backward  `∂W[e] = Σ_{r: e_r = e} x[r]ᵀ · ∂y[r]`  (one segment of rows per expert)

use crate::autograd::GroupedWeightGrad;
use crate::backend::GroupedMatmulDims;
use crate::{DType, Error, Result, Tensor};

impl Tensor {
    /// `y[r] = self[r] · w[row_expert[r]]` with `self: [R, k]`, `w: [n, k, m]`, `row_expert: [R]`
    /// (I32, rows sorted by expert; a row whose expert is outside `0..n` gives zeros) and
    /// `offsets: [n + 1]` (I32, where each expert's rows start; used by the weight gradient).
    pub fn grouped_matmul(
        &self,
        w: &Tensor,
        row_expert: &Tensor,
        offsets: &Tensor,
    ) -> Result<Tensor> {
        self.grouped_matmul_with_bias(w, None, row_expert, offsets)
    }

    /// [`Tensor::grouped_matmul`] plus each row's expert bias, in one kernel:
    /// `y[r] = self[r] · w[e_r] + bias[e_r]` with `bias: [n, m]`; a row whose expert is outside
    /// `0..n` still gives zeros (no bias). The same as adding `bias.index_select(0, experts)`
    /// to the product, without the `[R, m]` gathered bias, its add, and their backward passes.
    /// The bias gradient is `∂b[e] = Σ_{r: e_r = e} ∂y[r]`, the weight-gradient kernel with a
    /// column of ones for `x`.
    ///
    /// # Errors
    /// Those of [`Tensor::grouped_matmul`], and [`Error::Shape`] when `bias` is not `[n, m]`.
    pub fn grouped_matmul_with_bias(
        &self,
        w: &Tensor,
        bias: Option<&Tensor>,
        row_expert: &Tensor,
        offsets: &Tensor,
    ) -> Result<Tensor> {
        // Under mixed precision only the rows are cast: the kernel reads f32 expert weights
        // where they are (the f16-rows build), so no f16 copy of the whole bank is made and
        // the step's bytes grow with the experts used, not the experts owned.
        if let Some([x]) = crate::autocast::low_precision_operands([self])? {
            return x.grouped_matmul_with_bias(w, bias, row_expert, offsets);
        }
        let _profile = crate::profile::op("grouped_matmul");
        // f16 rows may meet f32 weights (mixed precision); otherwise the dtypes must agree
        let f16_rows = self.dtype() == DType::F16 && w.dtype() == DType::F32;
        if !f16_rows {
            self.check_compatible(w, "grouped_matmul")?;
        } else if self.device() != w.device() {
            return Err(Error::Device(format!(
                "grouped_matmul: rows on {} and expert weights on {}",
                self.device(),
                w.device()
            )));
        }
        self.check_float("grouped_matmul")?;
        if self.rank() != 2 || w.rank() != 3 || self.shape()[1] != w.shape()[1] {
            return Err(Error::Shape(format!(
                "grouped_matmul: rows [R, k] {:?} and expert weights [n, k, m] {:?} do not align",
                self.shape(),
                w.shape()
            )));
        }
        let (rows, k) = (self.shape()[0], self.shape()[1]);
        let (n, m) = (w.shape()[0], w.shape()[2]);
        if row_expert.shape() != [rows] || offsets.shape() != [n + 1] {
            return Err(Error::Shape(format!(
                "grouped_matmul: row_expert {:?} must be [{rows}] and offsets {:?} must be [{}]",
                row_expert.shape(),
                offsets.shape(),
                n + 1
            )));
        }
        if row_expert.dtype() != DType::I32 || offsets.dtype() != DType::I32 {
            return Err(Error::DType(
                "grouped_matmul: row_expert and offsets must be i32".into(),
            ));
        }
        if let Some(b) = bias {
            w.check_compatible(b, "grouped_matmul")?;
            if b.shape() != [n, m] {
                return Err(Error::Shape(format!(
                    "grouped_matmul: bias {:?} must be [{n}, {m}], one row per expert of w {:?}",
                    b.shape(),
                    w.shape()
                )));
            }
        }
        let out = self.storage().grouped_matmul(
            w.storage(),
            bias.map(|b| b.storage()),
            row_expert.storage(),
            GroupedMatmulDims {
                rows,
                k,
                m,
                experts: n,
                transpose_w: false,
            },
        )?;
        let y = Tensor::from_storage(out, vec![rows, m]);
        let (x, wd, re, off) = (
            self.detach(),
            w.detach(),
            row_expert.clone(),
            offsets.clone(),
        );
        // Only the gradients someone needs are computed: the rows are often a gather of the
        // layer's input, which needs no gradient when the MoE layer is the first layer.
        let (need_x, need_w) = (self.requires_grad(), w.requires_grad());
        // A CPU bank of many experts whose gradient is larger than the rows it comes from gets
        // it deferred (autograd/deferred.rs): the leaf keeps x and dy, and Adam computes dW
        // expert by expert inside its update. Only a leaf can: a computed weight must pass its
        // gradient on now.
        let defer = need_w
            && w.is_leaf()
            && GroupedWeightGrad::worth_deferring(w.device(), rows, (k, m, n));
        let leaf = if defer { Some(w.clone()) } else { None };
        let (bias_given, need_b) = (bias.is_some(), bias.is_some_and(|b| b.requires_grad()));
        let (w_dtype, bias_dtype) = (w.dtype(), bias.map_or(w.dtype(), |b| b.dtype()));
        let mut inputs = vec![self, w];
        inputs.extend(bias);
        Ok(Tensor::record(y, "grouped_matmul", &inputs, move |g| {
            // ∂b[e] = Σ_{rows r of e} ∂y[r]: the weight-gradient kernel with x a column of ones,
            // written in the bias's dtype (an f32 bias of f16 rows: summed and stored in f32)
            let db = if need_b {
                let db = g.storage().grouped_bias_grad(
                    (re.storage(), off.storage()),
                    (m, n),
                    bias_dtype,
                )?;
                Some(Tensor::from_storage(db, vec![n, m]))
            } else {
                None
            };
            let dx_of = || -> Result<Tensor> {
                let dx = g.storage().grouped_matmul(
                    wd.storage(),
                    None,
                    re.storage(),
                    GroupedMatmulDims {
                        rows,
                        k: m,
                        m: k,
                        experts: n,
                        transpose_w: true,
                    },
                )?;
                Ok(Tensor::from_storage(dx, vec![rows, k]))
            };
            let recipe = || GroupedWeightGrad {
                x: x.clone(),
                dy: g.clone(),
                row_expert: re.clone(),
                offsets: off.clone(),
                experts: n,
                k,
                m,
                // the bank's dtype: an f32 bank of f16 rows gets its gradient summed and
                // stored in f32
                out: w_dtype,
            };
            let dw_of = || recipe().materialize();
            let (dx, dw) = match (need_x, need_w, &leaf) {
                // both computed now: side by side on the CPU's threads (independent products:
                // only storage work crosses threads)
                (true, true, None) => {
                    let (dx, dw) = crate::backend::side_by_side(g.device(), dx_of, dw_of);
                    (Some(dx?), Some(dw?))
                }
                _ => {
                    let dx = need_x.then(dx_of).transpose()?;
                    let dw = match &leaf {
                        Some(leaf) if need_w => {
                            leaf.accumulate_deferred(recipe())?;
                            None
                        }
                        _ => need_w.then(dw_of).transpose()?,
                    };
                    (dx, dw)
                }
            };
            let mut grads = vec![dx, dw];
            if bias_given {
                grads.push(db);
            }
            Ok(grads)
        }))
    }
}
