//! The optimizers' side of lazy gradients ([`LazyGrad`], see `autograd/deferred.rs`): autograd
//! keeps some gradients as the recipe that computes them, and an optimizer either fuses a
//! recipe it knows into its own update or asks for the gradient. Today Adam fuses one recipe,
//! an expert bank's weight gradient ([`GroupedWeightGrad`]): it is computed expert by expert
//! inside the update and applied while still in cache, never stored (on the CPU; elsewhere
//! [`Storage::grouped_weight_grad_adam_mut`] runs the two kernels one after the other).

use crate::Result;
use crate::autograd::{GroupedWeightGrad, LazyGrad};
use crate::backend::{AdamHyper, BankGradOperands, Storage};

/// One Adam step on `param` (moments `m`, `v`) whose gradient is the lazy `grad` times
/// `scale`: fused into the update when `grad` is an expert bank's weight gradient, otherwise
/// computed first and applied as a dense gradient.
pub(super) fn adam_step_mut(
    grad: &dyn LazyGrad,
    param: &mut Storage,
    scale: Option<&Storage>,
    m: &mut Storage,
    v: &mut Storage,
    h: AdamHyper,
) -> Result<()> {
    match grad.as_any().downcast_ref::<GroupedWeightGrad>() {
        Some(bank) => {
            let operands = BankGradOperands {
                x: bank.x.storage(),
                dy: bank.dy.storage(),
                row_expert: bank.row_expert.storage(),
                offsets: bank.offsets.storage(),
                bank: bank.bank(),
            };
            Storage::grouped_weight_grad_adam_mut(operands, param, scale, m, v, h)
        }
        None => param.adam_step_mut(grad.materialize()?.storage(), scale, m, v, h),
    }
}
