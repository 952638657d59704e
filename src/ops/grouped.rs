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
        let _profile = crate::profile::op("grouped_matmul");
        self.check_compatible(w, "grouped_matmul")?;
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
        let out = self.storage().grouped_matmul(
            w.storage(),
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
        Ok(Tensor::record(y, "grouped_matmul", &[self, w], move |g| {
            let dx = if need_x {
                let dx = g.storage().grouped_matmul(
                    wd.storage(),
                    re.storage(),
                    GroupedMatmulDims {
                        rows,
                        k: m,
                        m: k,
                        experts: n,
                        transpose_w: true,
                    },
                )?;
                Some(Tensor::from_storage(dx, vec![rows, k]))
            } else {
                None
            };
            let dw = if need_w {
                let recipe = GroupedWeightGrad {
                    x,
                    dy: g.clone(),
                    row_expert: re,
                    offsets: off,
                    experts: n,
                    k,
                    m,
                };
                match &leaf {
                    Some(leaf) => {
                        leaf.accumulate_deferred(recipe)?;
                        None
                    }
                    None => Some(recipe.materialize()?),
                }
            } else {
                None
            };
            Ok(vec![dx, dw])
        }))
    }
}
