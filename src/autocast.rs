//! Mixed precision's casting rule, in one place: inside [`autocast_f16`] the ops that carry a
//! training step's bytes (matrix products, the expert bank's grouped products, convolutions,
//! attention, the elementwise arithmetic between activations and parameters, the norms,
//! scatter-add) run in f16 on the GPU, while what needs the range of f32 stays f32: the loss (cross-entropy reads
//! f16 logits but sums and returns in f32), the router's softmax and top-k, and everything
//! inside [`full_precision`]. Four ops of the f16 class cast only their activations: the
//! matrix product, whose f16-rows kernels read an f32 right operand (a weight) where it is and
//! give it its gradient in f32 (`reads_f32_weight`), the convolution, whose f16-rows kernels do
//! the same with its f32 weight bank, the expert bank's grouped product, whose
//! f16-rows kernel reads the f32 bank where it is, and layer norm and RMSNorm, whose f16-rows
//! kernels read f32 `gamma`/`beta` and write their gradients in f32. It is PyTorch's
//! `torch.autocast` with one
//! policy, and Switch Transformer's "selective precision" (Fedus et al. 2021, §2.4: the router
//! computes in f32 on f32 inputs while the rest of the layer runs in a 16-bit format).
//!
//! Inside [`full_precision`] one op reads f16 where it is: a matrix product of f16 tokens and
//! a 2-D f32 weight is an f32 product (`reads_f16_activation`), so a router computes in f32
//! from the f16 tokens without casting them up or its tokens' gradient back down.
//!
//! How an op applies it (the op calls `low_precision_operands`, `matched_operands` or
//! [`full_precision_operand`]):
//! - an op of the f16 class casts its f32 *GPU* operands to f16 (`Tensor::to_dtype`, which is
//!   differentiable: the gradient of an f32 parameter comes back to it in f32, so parameters,
//!   their gradients and the optimizer's state stay f32 — the "master weights");
//! - an op of the f32 class casts f16 operands up to f32;
//! - outside a scope, or on the CPU, nothing is cast and mixed dtypes stay an error.
//!
//! The scope is per thread and only matters while the forward pass is recorded: the backward
//! rules see the dtypes their forward saw, so they need no scope.

use crate::{DType, Result, Tensor};
use std::cell::Cell;

thread_local! {
    /// The compute dtype of the f16 class in the current scope: `Some(F16)` inside
    /// [`autocast_f16`], `None` outside it and inside [`full_precision`].
    static LOW_PRECISION: Cell<Option<DType>> = const { Cell::new(None) };
    /// Whether the innermost scope is a [`full_precision`] one (where a matrix product reads
    /// f16 activations into an f32 product, see `reads_f16_activation`).
    static FULL_PRECISION: Cell<bool> = const { Cell::new(false) };
}

/// Restores the previous scope when dropped (so a `?` inside the closure cannot leak a scope).
struct ScopeGuard(Option<DType>, bool);

impl Drop for ScopeGuard {
    fn drop(&mut self) {
        LOW_PRECISION.with(|c| c.set(self.0));
        FULL_PRECISION.with(|c| c.set(self.1));
    }
}

fn with_scope<R>(dtype: Option<DType>, f: impl FnOnce() -> R) -> R {
    let previous = LOW_PRECISION.with(|c| c.replace(dtype));
    let previous_full = FULL_PRECISION.with(|c| c.replace(dtype.is_none()));
    let _restore = ScopeGuard(previous, previous_full);
    f()
}

/// Runs `f` with mixed precision on: the GPU ops of the f16 class compute on f16 operands.
/// Parameters stay f32 (they are cast at each use, and their gradients cast back); pair it with
/// a loss scale (`optim::LossScale`) so that small gradients do not flush to zero in f16.
///
/// # Example
/// ```
/// use moegrad::{Device, Tensor, autocast_f16};
/// let a = Tensor::from_f32(vec![1.0, 2.0], &[1, 2], Device::cpu()).unwrap();
/// let b = Tensor::from_f32(vec![3.0, 4.0], &[2, 1], Device::cpu()).unwrap();
/// // On the CPU nothing is cast: f16 is a GPU storage format.
/// let c = autocast_f16(|| a.matmul(&b)).unwrap();
/// assert_eq!(c.to_vec_f32().unwrap(), vec![11.0]);
/// ```
pub fn autocast_f16<R>(f: impl FnOnce() -> R) -> R {
    with_scope(Some(DType::F16), f)
}

/// Runs `f` in f32 even inside [`autocast_f16`]: the router's scope (selective precision).
/// Its inputs are cast up by the f32-class ops it calls; cast an activation up front with
/// [`full_precision_operand`] when the first op would otherwise keep f16. One op reads f16
/// where it is instead: a matrix product of an f16 GPU activation and an f32 operand gives an
/// f32 product (the bits of casting the activation up first), and the activation an f16
/// gradient (the bits of the f32 gradient cast down), without the two casts or an f32 copy.
pub fn full_precision<R>(f: impl FnOnce() -> R) -> R {
    with_scope(None, f)
}

/// The dtype the f16 class computes in here: `Some(DType::F16)` inside [`autocast_f16`]
/// (and outside [`full_precision`]), else `None`.
pub fn low_precision() -> Option<DType> {
    LOW_PRECISION.with(|c| c.get())
}

/// True when `t` is one the f16 class casts down: an f32 tensor on the GPU.
fn casts_down(t: &Tensor) -> bool {
    t.dtype() == DType::F32 && t.device().is_gpu()
}

/// The operands of an op of the f16 class, when the scope changes any: inside a scope, each f32
/// GPU operand cast to f16 (the others as they are); `None` when nothing was cast (outside a
/// scope, on the CPU, or all already f16), so that an op can write
/// `if let Some([a, b]) = low_precision_operands([self, other])? { return a.op(&b); }`.
///
/// # Errors
/// The cast's own errors (an adapter without `SHADER_F16`).
pub(crate) fn low_precision_operands<const N: usize>(
    ts: [&Tensor; N],
) -> Result<Option<[Tensor; N]>> {
    let Some(dtype) = low_precision() else {
        return Ok(None);
    };
    if !ts.iter().any(|t| casts_down(t)) {
        return Ok(None);
    }
    let mut out: [Tensor; N] = ts.map(Tensor::clone);
    for t in out.iter_mut() {
        if casts_down(t) {
            *t = t.to_dtype(dtype)?;
        }
    }
    Ok(Some(out))
}

/// Whether a matrix product `a·b` (or a convolution of images `a` with weights `b`) reads an
/// f32 weight in f32 inside a scope: `a` already in the scope's f16 and `b` an f32 GPU tensor.
/// The GPU's f16-rows build of the product (or convolution) kernels reads `b` where it is and
/// writes an f16 product, and the backward pass gives `b` its gradient in
/// f32 from the f16-to-f32 build: no f16 copy of the weight forward, no cast of its gradient
/// back, and the gradient is rounded once (to f32), not first to f16.
pub(crate) fn reads_f32_weight(a: &Tensor, b: &Tensor) -> bool {
    low_precision().is_some_and(|dtype| a.dtype() == dtype) && casts_down(b)
}

/// Whether a matrix product `a·b` reads an f16 activation into an f32 product inside
/// [`full_precision`] (a router's logits from the f16 tokens of a mixed-precision model): `a`
/// an f16 GPU tensor and `b` an f32 one. The GPU's f16-elements build reads `a` where it is
/// and sums in f32, which is what the f32 kernel computes on `a` cast up (an f16 value is
/// exact in f32); the backward pass stores `a`'s gradient in f16 from the f32 product (the
/// f16-output build: one rounding, as a cast of the f32 gradient) and `b`'s in f32 from `a`
/// where it is.
pub(crate) fn reads_f16_activation(a: &Tensor, b: &Tensor) -> bool {
    FULL_PRECISION.with(|c| c.get())
        && a.dtype() == DType::F16
        && a.device().is_gpu()
        && b.dtype() == DType::F32
        && b.device() == a.device()
}

/// The operands of an elementwise op between two tensors, when the scope changes them: where
/// one is f16 and the other an f32 GPU tensor inside a scope, the f32 one cast to f16 (an
/// activation meeting a parameter); `None` otherwise (equal dtypes, and mismatches outside a
/// scope, go on to the op's own check).
pub(crate) fn matched_operands(a: &Tensor, b: &Tensor) -> Result<Option<(Tensor, Tensor)>> {
    if let Some(dtype) = low_precision() {
        if a.dtype() == dtype && casts_down(b) {
            return Ok(Some((a.clone(), b.to_dtype(dtype)?)));
        }
        if b.dtype() == dtype && casts_down(a) {
            return Ok(Some((a.to_dtype(dtype)?, b.clone())));
        }
    }
    Ok(None)
}

/// An activation that several ops of the f16 class will read, cast once: inside a scope an f32
/// GPU tensor cast to the scope's dtype, anything else as it is. Each op of the class casts its
/// own f32 operands, so a model calls this where one f32 activation feeds several of them: the
/// token embedding, read by the first block's norm and by its residual add. They then share
/// one cast forward and one cast of their summed gradient backward (instead of a cast each way
/// per reader and an f32 add of the gradients), and the residual can be added inside the
/// block's output projection, as in every later block.
///
/// # Errors
/// The cast's own errors (an adapter without `SHADER_F16`).
///
/// # Example
/// ```
/// use moegrad::{DType, Device, Tensor, autocast_f16, autocast::low_precision_activation};
/// let h = Tensor::from_f32(vec![1.0, 2.0], &[1, 2], Device::cpu()).unwrap();
/// // on the CPU (and outside a scope) nothing is cast
/// let x = autocast_f16(|| low_precision_activation(&h)).unwrap();
/// assert_eq!(x.dtype(), DType::F32);
/// ```
pub fn low_precision_activation(t: &Tensor) -> Result<Tensor> {
    match low_precision() {
        Some(dtype) if casts_down(t) => t.to_dtype(dtype),
        _ => Ok(t.clone()),
    }
}

/// The operand of an op of the f32 class (a loss, a softmax): an f16 tensor cast up to f32,
/// anything else as it is. Applies in and out of a scope: an f16 tensor only exists where
/// someone chose it, and these ops have no f16 kernel.
pub fn full_precision_operand(t: &Tensor) -> Result<Tensor> {
    if t.dtype() == DType::F16 {
        t.to_dtype(DType::F32)
    } else {
        Ok(t.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes_nest_and_restore() {
        assert_eq!(low_precision(), None);
        autocast_f16(|| {
            assert_eq!(low_precision(), Some(DType::F16));
            full_precision(|| assert_eq!(low_precision(), None));
            assert_eq!(low_precision(), Some(DType::F16));
        });
        assert_eq!(low_precision(), None);
    }

    #[test]
    fn only_a_full_precision_scope_reads_f16_activations() {
        let full = || FULL_PRECISION.with(|c| c.get());
        assert!(!full(), "no scope is not a full-precision one");
        full_precision(|| {
            assert!(full());
            autocast_f16(|| assert!(!full(), "autocast inside full precision"));
            assert!(full());
        });
        autocast_f16(|| full_precision(|| assert!(full())));
        assert!(!full());
    }

    #[test]
    fn a_panic_inside_a_scope_does_not_leak_it() {
        let r = std::panic::catch_unwind(|| autocast_f16(|| panic!("inside")));
        assert!(r.is_err());
        assert_eq!(low_precision(), None);
    }

    #[test]
    fn cpu_tensors_are_never_cast() {
        let a = Tensor::from_f32(vec![1.0], &[1], crate::Device::Cpu).unwrap();
        assert!(
            autocast_f16(|| low_precision_operands([&a]))
                .unwrap()
                .is_none()
        );
    }
}
