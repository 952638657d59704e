//! The MoE combine as one op: `y[t] = Σ_{r : idx[r] = t} w[r]·rows[r]`, each expert output row
//! scaled by its routing weight and added into its token's row.
//!
//! It is `rows.mul(w)` followed by `index_scatter`, computed as one backend primitive
//! (`RoutingOps::weighted_scatter`): one pass does the forward without writing the scaled
//! `[A, d]` rows, and one does the backward, `d_rows[r] = w[r]·dy[idx[r]]` and
//! `d_w[r] = dy[idx[r]]·rows[r]`, without the gathered gradient and the products of the composed
//! rule (`cpu/moe_combine.rs`; on the GPU `gpu/moe_combine.rs`, one kernel each way after the
//! forward's index sort). Both round as the composition does.
//!
//! Told where each output's rows are (`weighted_index_scatter_by_slots`: a token-choice plan's
//! `position` lists each token's rows), the GPU forward needs no sort. The same slots serve the
//! layer's gather of the routed rows (`index_select_by_slots`), whose backward is this sum
//! unweighted: the two ends of the MoE layer's dispatch, in one file. With a residual
//! (`weighted_index_scatter_per_slot_add`), the combine is a transformer block's whole MoE
//! output, `h + Σ w·f(x)`, in one pass.

use crate::{DType, Error, Result, Tensor};

impl Tensor {
    /// `y [len, d]` with `y[t] = Σ_{r : idx[r] = t} weights[r]·self[r]` for `self: [A, d]`,
    /// `weights: [A]` (cast to `self`'s dtype) and `idx: [A]` I32 in `0..len`: an MoE layer's
    /// combine of its expert outputs into tokens. The same as
    /// `self.mul(&weights.reshape(&[A, 1])?)?.index_scatter(0, idx, len)`, differentiable in
    /// `self` and `weights`.
    ///
    /// f16 rows (on the GPU) with f32 weights, mixed precision's combine of expert outputs
    /// with the router's gate weights, read the weights as they are: each product `w·row` is
    /// taken in f32 and rounded to f16 once, and the weights' gradient comes back in f32,
    /// summed without rounding to f16 (no cast either way, where casting the weights first
    /// would cost a pass forward and one backward).
    ///
    /// ```
    /// # use moegrad::{Device, Tensor};
    /// let rows = Tensor::from_f32(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[3, 2], Device::cpu())?;
    /// let w = Tensor::from_f32(vec![0.5, 1.0, 2.0], &[3], Device::cpu())?;
    /// let idx = Tensor::from_i32(vec![1, 0, 1], &[3], Device::cpu())?;
    /// let y = rows.weighted_index_scatter(&w, &idx, 2)?;
    /// assert_eq!(y.to_vec_f64()?, vec![3.0, 4.0, 10.5, 13.0]);
    /// # Ok::<(), moegrad::Error>(())
    /// ```
    ///
    /// # Errors
    /// `self` not `[A, d]` float, `weights` not `[A]` float, `idx` not `[A]` I32, an index
    /// outside `0..len`, or operands on different devices.
    pub fn weighted_index_scatter(
        &self,
        weights: &Tensor,
        idx: &Tensor,
        len: usize,
    ) -> Result<Tensor> {
        self.weighted_scatter_with(weights, idx, len, None, None, None)
    }

    /// [`Tensor::weighted_index_scatter`] told where each output's rows are: `slots: [len·k]`
    /// I32 lists, for each output `t`, the `k` rows with `idx = t` (`slots[t·k..t·k+k]`, in any
    /// order; every row once). An MoE layer's dispatch plan has them for a token-choice
    /// routing: its `position`, each token's `k` assignments' rows. The result is the same,
    /// to the bit; the GPU reads each output's rows through `slots` instead of sorting `idx`
    /// (six dispatches at 8192 rows), and the CPU checks the promise.
    ///
    /// ```
    /// # use moegrad::{Device, Tensor};
    /// let rows = Tensor::from_f32(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[3, 2], Device::cpu())?;
    /// let w = Tensor::from_f32(vec![0.5, 1.0, 2.0], &[3], Device::cpu())?;
    /// let idx = Tensor::from_i32(vec![1, 0, 2], &[3], Device::cpu())?;
    /// // output 0's row is 1, output 1's row 0, output 2's row 2
    /// let slots = Tensor::from_i32(vec![1, 0, 2], &[3], Device::cpu())?;
    /// let y = rows.weighted_index_scatter_by_slots(&w, &idx, 3, &slots)?;
    /// assert_eq!(y.to_vec_f64()?, rows.weighted_index_scatter(&w, &idx, 3)?.to_vec_f64()?);
    /// # Ok::<(), moegrad::Error>(())
    /// ```
    ///
    /// # Errors
    /// Those of `weighted_index_scatter`; `slots` not I32, not on `self`'s device, or not
    /// `[len·k]` for `A = len·k` rows; on the CPU, slots that do not list each output's rows.
    pub fn weighted_index_scatter_by_slots(
        &self,
        weights: &Tensor,
        idx: &Tensor,
        len: usize,
        slots: &Tensor,
    ) -> Result<Tensor> {
        self.check_index_tensor(slots, "weighted_index_scatter slots")?;
        let k = match len {
            0 => 0,
            len => slots.numel() / len,
        };
        self.weighted_scatter_with(weights, idx, len, Some((slots, k)), None, None)
    }

    /// [`Tensor::weighted_index_scatter_by_slots`] with the weights given per slot instead of
    /// per row: `weights[s]` weighs row `slots[s]`, so `y[t] = Σ_j weights[t·k + j]·
    /// self[slots[t·k + j]]`; `order` (`[A]` I32) is the slots' inverse, each row's slot. An MoE
    /// layer's token-choice routing has its weights in slot order (token `t`'s `k` choices at
    /// `t·k..t·k+k`) and its plan both maps: `position` (the slots) and `order`. The result is
    /// the same, to the bit, as gathering the weights into row order
    /// (`weights.index_select(0, order)`) and calling `weighted_index_scatter_by_slots`, without
    /// that gather and its backward: the weights' gradient comes back per slot.
    ///
    /// ```
    /// # use moegrad::{Device, Tensor};
    /// let rows = Tensor::from_f32(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[3, 2], Device::cpu())?;
    /// let idx = Tensor::from_i32(vec![1, 0, 2], &[3], Device::cpu())?;
    /// // output 0's row is 1, output 1's row 0, output 2's row 2; the weights by output
    /// let slots = Tensor::from_i32(vec![1, 0, 2], &[3], Device::cpu())?;
    /// let order = Tensor::from_i32(vec![1, 0, 2], &[3], Device::cpu())?;
    /// let w = Tensor::from_f32(vec![1.0, 0.5, 2.0], &[3], Device::cpu())?;
    /// let y = rows.weighted_index_scatter_per_slot(&w, &idx, 3, &slots, &order)?;
    /// assert_eq!(y.to_vec_f64()?, vec![3.0, 4.0, 0.5, 1.0, 10.0, 12.0]);
    /// # Ok::<(), moegrad::Error>(())
    /// ```
    ///
    /// # Errors
    /// Those of `weighted_index_scatter_by_slots`; `order` not I32 `[A]` on `self`'s device; on
    /// the CPU, an order that is not the slots' inverse.
    pub fn weighted_index_scatter_per_slot(
        &self,
        weights: &Tensor,
        idx: &Tensor,
        len: usize,
        slots: &Tensor,
        order: &Tensor,
    ) -> Result<Tensor> {
        self.per_slot_with(weights, idx, len, (slots, order), None)
    }

    /// `addend + self.weighted_index_scatter_per_slot(weights, idx, len, slots, order)`, to the
    /// bit, in one op: an MoE block's residual added by the combine (`h + moe(norm(h))`). On
    /// the GPU the combine's kernel adds it to each output element after rounding the sum, so
    /// the block's output is one pass instead of two. An addend of another shape (one that
    /// broadcasts) or dtype is added by [`Tensor::add`] after the combine. The addend's
    /// gradient is the output's.
    ///
    /// ```
    /// # use moegrad::{Device, Tensor};
    /// let rows = Tensor::from_f32(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[3, 2], Device::cpu())?;
    /// let idx = Tensor::from_i32(vec![1, 0, 2], &[3], Device::cpu())?;
    /// let slots = Tensor::from_i32(vec![1, 0, 2], &[3], Device::cpu())?;
    /// let order = Tensor::from_i32(vec![1, 0, 2], &[3], Device::cpu())?;
    /// let w = Tensor::from_f32(vec![1.0, 0.5, 2.0], &[3], Device::cpu())?;
    /// let h = Tensor::from_f32(vec![10.0; 6], &[3, 2], Device::cpu())?;
    /// let y = rows.weighted_index_scatter_per_slot_add(&w, &idx, 3, &slots, &order, &h)?;
    /// assert_eq!(y.to_vec_f64()?, vec![13.0, 14.0, 10.5, 11.0, 20.0, 22.0]);
    /// # Ok::<(), moegrad::Error>(())
    /// ```
    ///
    /// # Errors
    /// Those of `weighted_index_scatter_per_slot`, and those of `add` for an addend that does
    /// not broadcast to `[len, d]`.
    pub fn weighted_index_scatter_per_slot_add(
        &self,
        weights: &Tensor,
        idx: &Tensor,
        len: usize,
        slots: &Tensor,
        order: &Tensor,
        addend: &Tensor,
    ) -> Result<Tensor> {
        let fits = self.rank() == 2
            && addend.shape() == [len, self.shape()[1]]
            && addend.dtype() == self.dtype()
            && addend.device() == self.device();
        if !fits {
            return addend
                .add(&self.weighted_index_scatter_per_slot(weights, idx, len, slots, order)?);
        }
        self.per_slot_with(weights, idx, len, (slots, order), Some(addend))
    }

    /// The combines with the weights per slot, `addend` (when given) added by the combine.
    fn per_slot_with(
        &self,
        weights: &Tensor,
        idx: &Tensor,
        len: usize,
        (slots, order): (&Tensor, &Tensor),
        addend: Option<&Tensor>,
    ) -> Result<Tensor> {
        self.check_index_tensor(slots, "weighted_index_scatter slots")?;
        self.check_index_tensor(order, "weighted_index_scatter slot order")?;
        let k = match len {
            0 => 0,
            len => slots.numel() / len,
        };
        self.weighted_scatter_with(weights, idx, len, Some((slots, k)), Some(order), addend)
    }

    /// [`Tensor::index_select`] along axis 0 whose backward is told where each source row's
    /// copies are: `slots: [len·k]` I32 lists, for each row `t` of `self` (`len` of them), the
    /// `k` positions of `idx` that select it (`slots[t·k..t·k+k]`, in any order; every position
    /// once). An MoE layer's dispatch plan has them for a token-choice routing: its `position`.
    /// The same values and gradient, to the bit; the gradient, a sum of each row's copies,
    /// reads them through `slots` on the GPU instead of sorting `idx`.
    ///
    /// ```
    /// # use moegrad::{Device, Tensor};
    /// let x = Tensor::from_f32(vec![1.0, 2.0, 3.0, 4.0], &[2, 2], Device::cpu())?.with_grad()?;
    /// // rows 0 and 1 selected twice each: row 0 at positions 1 and 2, row 1 at 0 and 3
    /// let idx = Tensor::from_i32(vec![1, 0, 0, 1], &[4], Device::cpu())?;
    /// let slots = Tensor::from_i32(vec![1, 2, 0, 3], &[4], Device::cpu())?;
    /// let y = x.index_select_by_slots(&idx, &slots)?;
    /// assert_eq!(y.to_vec_f64()?, vec![3.0, 4.0, 1.0, 2.0, 1.0, 2.0, 3.0, 4.0]);
    /// y.sum_all()?.backward()?;
    /// assert_eq!(x.grad().unwrap().to_vec_f64()?, vec![2.0; 4]);
    /// # Ok::<(), moegrad::Error>(())
    /// ```
    ///
    /// # Errors
    /// Those of `index_select`; `slots` not I32, not on `self`'s device, or not `[len·k]` for
    /// `idx`'s `len·k` positions (checked in the backward); on the CPU, slots that do not list
    /// each row's positions.
    pub fn index_select_by_slots(&self, idx: &Tensor, slots: &Tensor) -> Result<Tensor> {
        const WHAT: &str = "index_select_by_slots";
        self.check_index_tensor(slots, WHAT)?;
        if self.rank() == 0 || idx.rank() != 1 || slots.shape() != idx.shape() {
            return Err(Error::Shape(format!(
                "{WHAT}: a tensor of rank ≥ 1 ({:?}), a 1-D index ({:?}) and slots of the \
                 index's shape ({:?})",
                self.shape(),
                idx.shape(),
                slots.shape()
            )));
        }
        let y = crate::no_grad(|| self.index_select(0, idx))?;
        let len = self.shape()[0];
        let d = self.numel() / len.max(1);
        let k = idx.numel() / len.max(1);
        let (idx, slots, in_shape) = (idx.clone(), slots.clone(), self.shape().to_vec());
        Ok(Tensor::record(y, WHAT, &[self], move |g| {
            let dx = g.storage().weighted_scatter(
                None,
                None,
                idx.storage(),
                (d, len),
                Some((slots.storage(), k)),
                None,
            )?;
            Ok(vec![Some(Tensor::from_storage(dx, in_shape))])
        }))
    }

    /// The combines: `slots` is `(each output's rows, rows per output)` when known,
    /// `slot_order` each row's slot when the weights are per slot, and `addend` (`[len, d]` of
    /// `self`'s dtype and device, checked by the caller) added to the output.
    fn weighted_scatter_with(
        &self,
        weights: &Tensor,
        idx: &Tensor,
        len: usize,
        slots: Option<(&Tensor, usize)>,
        slot_order: Option<&Tensor>,
        addend: Option<&Tensor>,
    ) -> Result<Tensor> {
        const WHAT: &str = "weighted_index_scatter";
        let _profile = crate::profile::op(WHAT);
        self.check_float(WHAT)?;
        weights.check_float(WHAT)?;
        self.check_index_tensor(idx, WHAT)?;
        if self.rank() != 2
            || weights.shape() != [self.shape()[0]]
            || idx.shape() != weights.shape()
        {
            return Err(Error::Shape(format!(
                "{WHAT}: rows {:?} must be [A, d] with weights {:?} and indices {:?} both [A]",
                self.shape(),
                weights.shape(),
                idx.shape()
            )));
        }
        let (a, d) = (self.shape()[0], self.shape()[1]);
        // mixed precision: f16 rows take f32 weights as they are (the kernels read them)
        let w = match (self.dtype(), weights.dtype()) {
            (DType::F16, DType::F32) => weights.clone(),
            (dtype, _) => weights.to_dtype(dtype)?,
        };
        self.check_same_device(&w, WHAT)?;
        let y = self.storage().weighted_scatter(
            addend.map(|a| a.storage()),
            Some(w.storage()),
            idx.storage(),
            (d, len),
            slots.map(|(s, k)| (s.storage(), k)),
            slot_order.map(|o| o.storage()),
        )?;
        let y = Tensor::from_storage(y, vec![len, d]);
        let (rows, w_saved, idx) = (self.detach(), w.detach(), idx.clone());
        let has_addend = addend.is_some();
        let slot_order = slot_order.cloned();
        let mut inputs = vec![self, &w];
        inputs.extend(addend);
        Ok(Tensor::record(y, WHAT, &inputs, move |g| {
            let g = g.to_dtype(rows.dtype())?;
            let (d_rows, d_w) = rows.storage().weighted_scatter_backward(
                w_saved.storage(),
                idx.storage(),
                g.storage(),
                (d, len),
                slot_order.as_ref().map(|o| o.storage()),
            )?;
            let mut grads = vec![
                Some(Tensor::from_storage(d_rows, vec![a, d])),
                Some(Tensor::from_storage(d_w, vec![a])),
            ];
            if has_addend {
                // the addend's gradient is the output's
                grads.push(Some(g));
            }
            Ok(grads)
        }))
    }
}
