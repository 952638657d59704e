//! The public custom-op API: put an op of your own on the tape, with a backward rule you write.
//!
//! This is moegrad's counterpart of PyTorch's `autograd.Function` and candle's `CustomOp`. An op
//! is two closures: a **forward** that computes the output from the inputs (with tensor ops, or
//! with host code on the values, see below) and a **backward** that maps the gradient of the
//! output to one optional gradient per input. [`custom_op`] runs the forward with gradients off,
//! then records the output on the tape exactly as moegrad's built-in ops record theirs
//! (`Tensor::record`), so the op works on any device its forward and backward work on.
//!
//! The crate's own routers with hand-written gradient rules (the straight-through estimators of
//! `moe/routers/estimators.rs`, SparseMixer's scale in `moe/routers/sparsemixer.rs`) are built on
//! this function; `examples/custom_router.rs` and `examples/custom_op.rs` show it used from
//! outside the crate, and `docs/tutorial/02-new-op.md` explains it step by step.
//!
//! What is checked, each an [`Error`] rather than a panic:
//! * before the forward: at least one input, all inputs on one device;
//! * after the forward: the output is on the inputs' device;
//! * when the backward runs: it returned one entry per input, and every gradient it returned has
//!   its input's shape, dtype and device.
//!
//! A kernel of your own fits in the forward (or backward) closure: host code reads the values
//! with [`Tensor::to_vec_f64`] / [`Tensor::to_vec_f32`] and builds the result with
//! [`Tensor::from_f64`] / [`Tensor::from_f32`]; a WGSL compute shader runs on GPU tensors through
//! [`crate::wgsl::WgslKernel`].

use crate::{Device, Error, Result, Tensor, no_grad};

/// What a custom op's backward rule receives: the gradient of the output, and the op's inputs
/// and output (all untracked: ops on them inside the rule are not recorded).
pub struct CustomGrad<'a> {
    /// the op's name, as given to [`custom_op`]
    pub op: &'static str,
    /// `∂L/∂output`, the output's shape
    pub grad_output: &'a Tensor,
    /// the inputs, in the order given to [`custom_op`] (detached)
    pub inputs: &'a [Tensor],
    /// the value the forward computed
    pub output: &'a Tensor,
}

/// Runs `forward` on `inputs` and records its result as one op named `name` whose backward
/// rule is `backward`.
///
/// # Arguments
/// * `name`: the op's name, shown by [`Tensor::op_name`], in error messages and in the profile.
/// * `inputs`: the tensors the op reads; the gradients of those that require grad flow back
///   through `backward`. All must be on one device.
/// * `forward`: computes the output from the inputs (given detached, in the same order); it runs
///   under [`no_grad`], so whatever it computes is not recorded.
/// * `backward`: given the gradient of the output (and the inputs and output, see
///   [`CustomGrad`]), returns one entry per input: `Some(∂L/∂input)` of the input's shape, dtype
///   and device, or `None` for an input that gets no gradient. It runs once, during
///   [`Tensor::backward`], with gradients off.
///
/// # Returns
/// The output, tracked when gradients are enabled and some input requires grad (then
/// [`Tensor::op_name`] is `Some(name)`); otherwise the forward's value as it is.
///
/// # Errors
/// [`Error::Invalid`] for no inputs; [`Error::Device`] when the inputs, or the output and the
/// inputs, are on different devices; whatever `forward` returns. During `backward()`:
/// [`Error::Autograd`] naming the op when the rule returns the wrong number of gradients or a
/// gradient whose shape, dtype or device differs from its input's.
///
/// # Example
/// `y = x³` with its derivative `3x²` written by hand:
/// ```
/// use moegrad::autograd::custom_op;
/// use moegrad::{Device, Tensor};
/// # fn main() -> moegrad::Result<()> {
/// let x = Tensor::from_f64(vec![1.0, 2.0], &[2], Device::cpu())?.with_grad()?;
/// let y = custom_op(
///     "cube",
///     &[&x],
///     |inp| inp[0].mul(&inp[0])?.mul(&inp[0]),
///     |ctx| {
///         let x = &ctx.inputs[0];
///         Ok(vec![Some(x.mul(x)?.mul_scalar(3.0)?.mul(ctx.grad_output)?)])
///     },
/// )?;
/// assert_eq!(y.op_name(), Some("cube"));
/// y.sum_all()?.backward()?;
/// assert_eq!(x.grad().unwrap().to_vec_f64()?, vec![3.0, 12.0]);
/// # Ok(()) }
/// ```
pub fn custom_op<F, B>(
    name: &'static str,
    inputs: &[&Tensor],
    forward: F,
    backward: B,
) -> Result<Tensor>
where
    F: FnOnce(&[Tensor]) -> Result<Tensor>,
    B: FnOnce(&CustomGrad<'_>) -> Result<Vec<Option<Tensor>>> + Send + 'static,
{
    let device = one_device(name, inputs)?;
    let detached: Vec<Tensor> = inputs.iter().map(|t| t.detach()).collect();
    // detached: a forward that hands back a tracked tensor it captured is still one op
    let output = no_grad(|| forward(&detached))?.detach();
    if output.device() != device {
        return Err(Error::Device(format!(
            "custom op '{name}': the forward returned a tensor on {} for inputs on {device}",
            output.device()
        )));
    }
    let saved_output = output.clone();
    Ok(Tensor::record(output, name, inputs, move |grad_output| {
        let ctx = CustomGrad {
            op: name,
            grad_output,
            inputs: &detached,
            output: &saved_output,
        };
        let grads = backward(&ctx)?;
        check_grads(name, &detached, &grads)?;
        Ok(grads)
    }))
}

/// The one device all `inputs` are on.
fn one_device(name: &str, inputs: &[&Tensor]) -> Result<Device> {
    let Some(first) = inputs.first() else {
        return Err(Error::Invalid(format!(
            "custom op '{name}' needs at least one input"
        )));
    };
    let device = first.device();
    if let Some((i, t)) = inputs
        .iter()
        .enumerate()
        .find(|(_, t)| t.device() != device)
    {
        return Err(Error::Device(format!(
            "custom op '{name}': input 0 is on {device} but input {i} is on {}",
            t.device()
        )));
    }
    Ok(device)
}

/// One gradient per input, each with its input's shape, dtype and device.
fn check_grads(name: &str, inputs: &[Tensor], grads: &[Option<Tensor>]) -> Result<()> {
    if grads.len() != inputs.len() {
        return Err(Error::Autograd(format!(
            "backward of custom op '{name}' returned {} gradient(s) for {} input(s); \
             return one entry per input (None for an input without a gradient)",
            grads.len(),
            inputs.len()
        )));
    }
    for (i, (input, grad)) in inputs.iter().zip(grads).enumerate() {
        let Some(g) = grad else { continue };
        if g.shape() != input.shape() || g.dtype() != input.dtype() || g.device() != input.device()
        {
            return Err(Error::Autograd(format!(
                "backward of custom op '{name}': the gradient of input {i} is {:?} {} on {}, \
                 the input is {:?} {} on {}",
                g.shape(),
                g.dtype(),
                g.device(),
                input.shape(),
                input.dtype(),
                input.device()
            )));
        }
    }
    Ok(())
}
