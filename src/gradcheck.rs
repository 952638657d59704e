//! `gradcheck`: compares the gradients autograd computes with central finite differences, in
//! f64 on the CPU, the way PyTorch's `torch.autograd.gradcheck` does.
//!
//! For a function `f` of some f64 tensors, the full check builds the Jacobian both ways:
//! column by column from `(f(x + ε·e_i) − f(x − ε·e_i)) / 2ε`, and row by row from one backward
//! pass per output element. Every entry must satisfy `|analytic − numeric| ≤ atol + rtol·|numeric|`.
//! The fast mode checks one random projection `uᵀ J v` instead (one backward pass and two
//! forward passes per input). Two more checks come with it: backward run twice gives identical
//! gradients (reentrancy), and a zero upstream gradient gives zero input gradients. A NaN or an
//! infinity anywhere, an empty comparison, or an output off the tape is a failure, never a pass
//! (see [`gradcheck`]).
//!
//! # Example
//! ```
//! use moegrad::{Device, Tensor, gradcheck::{gradcheck, GradcheckOptions}};
//! let x = Tensor::from_f64(vec![0.3, -1.2, 2.0], &[3], Device::cpu()).unwrap();
//! gradcheck(|t| t[0].tanh()?.mul(&t[0]), &[x], &GradcheckOptions::default()).unwrap();
//! ```

use crate::{DType, Device, Error, Result, Tensor};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Settings of a gradient check (defaults as in PyTorch's gradcheck).
#[derive(Clone, Debug)]
pub struct GradcheckOptions {
    /// finite-difference step (default 1e-6)
    pub eps: f64,
    /// absolute tolerance (default 1e-5)
    pub atol: f64,
    /// relative tolerance (default 1e-3)
    pub rtol: f64,
    /// check one random projection `uᵀJv` instead of the whole Jacobian (default false)
    pub fast_mode: bool,
    /// check that a second backward pass gives the same gradients bit for bit (default true)
    pub check_reentrant: bool,
    /// check that a zero upstream gradient gives zero input gradients (default true)
    pub check_zero_grad_output: bool,
    /// seed of the random projections used by the fast mode (default 0)
    pub seed: u64,
}

impl Default for GradcheckOptions {
    fn default() -> Self {
        GradcheckOptions {
            eps: 1e-6,
            atol: 1e-5,
            rtol: 1e-3,
            fast_mode: false,
            check_reentrant: true,
            check_zero_grad_output: true,
            seed: 0,
        }
    }
}

/// What a passing check measured.
#[derive(Clone, Debug)]
pub struct GradcheckReport {
    /// number of Jacobian entries (or projections, in fast mode) compared
    pub compared: usize,
    /// largest `|analytic − numeric|` seen
    pub max_abs_error: f64,
}

fn leaf(values: Vec<f64>, shape: &[usize], grad: bool) -> Result<Tensor> {
    let t = Tensor::from_f64(values, shape, Device::Cpu)?;
    if grad {
        t.set_requires_grad(true)?;
    }
    Ok(t)
}

/// Evaluates `f` at the given input values and returns the flattened output, failing when an
/// output element is not finite. `at` says where `f` was evaluated, for the message.
fn eval(
    f: &impl Fn(&[Tensor]) -> Result<Tensor>,
    values: &[Vec<f64>],
    shapes: &[Vec<usize>],
    at: &dyn Fn() -> String,
) -> Result<Vec<f64>> {
    let inputs = values
        .iter()
        .zip(shapes)
        .map(|(v, s)| leaf(v.clone(), s, false))
        .collect::<Result<Vec<_>>>()?;
    let y = crate::no_grad(|| f(&inputs))?;
    let out = y.to_vec_f64()?;
    if let Some(o) = out.iter().position(|v| !v.is_finite()) {
        return Err(Error::Gradcheck(format!(
            "the function's output element {:?} is {} {}; gradcheck needs a finite output",
            multi_index(o, y.shape()),
            out[o],
            at()
        )));
    }
    Ok(out)
}

/// Runs `f` on fresh leaves and back-propagates `upstream`; returns each input's gradient (zeros
/// for an input no gradient reached). Fails when the output is not on the tape (see
/// [`gradcheck`]), when reading a gradient fails, or when a gradient element is not finite;
/// `pass` names the backward pass for the message.
fn analytic(
    f: &impl Fn(&[Tensor]) -> Result<Tensor>,
    values: &[Vec<f64>],
    shapes: &[Vec<usize>],
    upstream: impl Fn(&[usize]) -> Vec<f64>,
    pass: &dyn Fn() -> String,
) -> Result<Vec<Vec<f64>>> {
    let inputs = values
        .iter()
        .zip(shapes)
        .map(|(v, s)| leaf(v.clone(), s, true))
        .collect::<Result<Vec<_>>>()?;
    let y = f(&inputs)?;
    if y.dtype() != DType::F64 {
        return Err(Error::DType(format!(
            "gradcheck: the function must return f64, got {}",
            y.dtype()
        )));
    }
    if !y.requires_grad() {
        return Err(Error::Gradcheck(format!(
            "the output (shape {:?}) does not depend on the inputs through the tape (it was \
             computed without recording, or detached), so autograd gives it no gradient to check",
            y.shape()
        )));
    }
    let g = Tensor::from_f64(upstream(y.shape()), y.shape(), Device::Cpu)?;
    y.backward_with(&g)?;
    let mut grads = Vec::with_capacity(inputs.len());
    for (i, t) in inputs.iter().enumerate() {
        let grad = match t.try_grad()? {
            Some(g) => g.to_vec_f64()?,
            None => vec![0.0; t.numel()],
        };
        if let Some(j) = grad.iter().position(|v| !v.is_finite()) {
            return Err(Error::Gradcheck(format!(
                "input {i} (shape {:?}): the analytic gradient at element {:?} is {} ({})",
                shapes[i],
                multi_index(j, &shapes[i]),
                grad[j],
                pass()
            )));
        }
        grads.push(grad);
    }
    Ok(grads)
}

fn multi_index(mut flat: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for d in (0..shape.len()).rev() {
        idx[d] = flat % shape[d].max(1);
        flat /= shape[d].max(1);
    }
    idx
}

/// Checks the gradients of `f` at `inputs` (f64 CPU tensors; every one is treated as requiring
/// grad). Returns a report, or `Error::Gradcheck` naming the input, the worst element, the
/// analytic and numeric values and the tolerance.
///
/// The check cannot pass by accident. It fails (with `Error::Gradcheck`) when:
/// * an analytic or numeric derivative, or an output of `f`, is NaN or infinite (in either mode
///   and in the reentrancy and zero-upstream checks too); a comparison with a NaN is a failure,
///   never a pass;
/// * nothing was compared (no inputs, inputs or output with no elements);
/// * the output is not on the tape: no input reaches it through recorded ops (it was computed
///   under `no_grad` or detached). Such an output has no analytic gradient at all, and reading
///   that as zeros would pass any function that is locally constant, so it is an error even when
///   the numeric Jacobian happens to be zero too: there is nothing to check. An input the output
///   does not reach while others do gets zeros, compared as usual with the numeric derivative,
///   so a path cut off by mistake shows up as a mismatch.
///
/// An error while computing a gradient (for instance an expert bank's deferred gradient, see
/// [`Tensor::try_grad`]) is returned as it is.
pub fn gradcheck(
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
    inputs: &[Tensor],
    opts: &GradcheckOptions,
) -> Result<GradcheckReport> {
    for (i, t) in inputs.iter().enumerate() {
        if t.dtype() != DType::F64 || t.device() != Device::Cpu {
            return Err(Error::DType(format!(
                "gradcheck: input {i} is {} on {}; gradcheck needs f64 tensors on the CPU",
                t.dtype(),
                t.device()
            )));
        }
    }
    let shapes: Vec<Vec<usize>> = inputs.iter().map(|t| t.shape().to_vec()).collect();
    let values: Vec<Vec<f64>> = inputs
        .iter()
        .map(|t| t.to_vec_f64())
        .collect::<Result<_>>()?;
    if let Some((i, j)) = values
        .iter()
        .enumerate()
        .find_map(|(i, v)| v.iter().position(|x| !x.is_finite()).map(|j| (i, j)))
    {
        return Err(Error::Gradcheck(format!(
            "input {i} (shape {:?}) element {:?} is {}; gradcheck needs finite inputs",
            shapes[i],
            multi_index(j, &shapes[i]),
            values[i][j]
        )));
    }
    let y0 = eval(&f, &values, &shapes, &|| "at the given inputs".into())?;
    let nothing_compared = || {
        Error::Gradcheck(format!(
            "nothing to compare: {} input(s) with shapes {shapes:?} and an output of {} \
             element(s); gradcheck needs at least one input element and one output element",
            inputs.len(),
            y0.len()
        ))
    };
    if y0.is_empty() || values.iter().all(|v| v.is_empty()) {
        return Err(nothing_compared());
    }
    let mut report = GradcheckReport {
        compared: 0,
        max_abs_error: 0.0,
    };
    let tol = |n: f64| opts.atol + opts.rtol * n.abs();
    // NaN-safe: anything but a finite numeric derivative and an error within tolerance fails.
    let within = |err: f64, numeric: f64| numeric.is_finite() && err <= tol(numeric);

    if opts.fast_mode {
        let mut rng = ChaCha8Rng::seed_from_u64(opts.seed);
        let u: Vec<f64> = (0..y0.len()).map(|_| rng.random_range(-1.0..1.0)).collect();
        let grads = analytic(&f, &values, &shapes, |_| u.clone(), &|| {
            "fast mode, backward of a random projection of the output".into()
        })?;
        for (i, shape) in shapes.iter().enumerate() {
            let v: Vec<f64> = (0..values[i].len())
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            if v.is_empty() || y0.is_empty() {
                continue;
            }
            let shifted = |sign: f64| -> Result<Vec<f64>> {
                let mut vals = values.clone();
                for (x, d) in vals[i].iter_mut().zip(&v) {
                    *x += sign * opts.eps * d;
                }
                eval(&f, &vals, &shapes, &|| {
                    format!("with input {i} moved by {sign:+}·eps along a random direction")
                })
            };
            let (plus, minus) = (shifted(1.0)?, shifted(-1.0)?);
            let numeric: f64 = plus
                .iter()
                .zip(&minus)
                .zip(&u)
                .map(|((p, m), w)| w * (p - m) / (2.0 * opts.eps))
                .sum();
            let analytic_dot: f64 = grads[i].iter().zip(&v).map(|(g, d)| g * d).sum();
            let err = (analytic_dot - numeric).abs();
            report.compared += 1;
            report.max_abs_error = report.max_abs_error.max(err);
            if !within(err, numeric) {
                return Err(Error::Gradcheck(format!(
                    "input {i} (shape {shape:?}), fast mode: projection uᵀJv analytic {analytic_dot:.9e} vs numeric {numeric:.9e}, |diff| {err:.3e} > tolerance {:.3e}",
                    tol(numeric)
                )));
            }
        }
    } else {
        // Analytic Jacobian, one row per output element.
        let rows: Vec<Vec<Vec<f64>>> = (0..y0.len())
            .map(|o| {
                analytic(
                    &f,
                    &values,
                    &shapes,
                    |s| {
                        let mut e = vec![0.0; s.iter().product()];
                        e[o] = 1.0;
                        e
                    },
                    &|| format!("Jacobian row of output element {o}"),
                )
            })
            .collect::<Result<_>>()?;
        for (i, shape) in shapes.iter().enumerate() {
            let mut worst: Option<(f64, usize, usize, f64, f64)> = None;
            for j in 0..values[i].len() {
                let shifted = |sign: f64| -> Result<Vec<f64>> {
                    let mut vals = values.clone();
                    vals[i][j] += sign * opts.eps;
                    eval(&f, &vals, &shapes, &|| {
                        format!(
                            "with input {i} element {:?} moved by {sign:+}·eps",
                            multi_index(j, shape)
                        )
                    })
                };
                let (plus, minus) = (shifted(1.0)?, shifted(-1.0)?);
                for o in 0..y0.len() {
                    let numeric = (plus[o] - minus[o]) / (2.0 * opts.eps);
                    let ana = rows[o][i][j];
                    let err = (ana - numeric).abs();
                    report.compared += 1;
                    report.max_abs_error = report.max_abs_error.max(err);
                    if within(err, numeric) {
                        continue;
                    }
                    let excess = if numeric.is_finite() {
                        err - tol(numeric)
                    } else {
                        f64::INFINITY
                    };
                    if worst.is_none_or(|w| excess > w.0) {
                        worst = Some((excess, j, o, ana, numeric));
                    }
                }
            }
            if let Some((_, j, o, ana, numeric)) = worst {
                return Err(Error::Gradcheck(format!(
                    "input {i} (shape {shape:?}): worst element {:?} for output element {o}: analytic {ana:.9e} vs numeric {numeric:.9e}, |diff| {:.3e} > tolerance {:.3e} (atol {}, rtol {}, eps {})",
                    multi_index(j, shape),
                    (ana - numeric).abs(),
                    tol(numeric),
                    opts.atol,
                    opts.rtol,
                    opts.eps
                )));
            }
        }
    }
    if report.compared == 0 {
        return Err(nothing_compared());
    }

    if opts.check_reentrant {
        let mut rng = ChaCha8Rng::seed_from_u64(opts.seed ^ 0x5eed);
        let u: Vec<f64> = (0..y0.len()).map(|_| rng.random_range(-1.0..1.0)).collect();
        let first = analytic(&f, &values, &shapes, |_| u.clone(), &|| {
            "reentrancy check, first backward".into()
        })?;
        let second = analytic(&f, &values, &shapes, |_| u.clone(), &|| {
            "reentrancy check, second backward".into()
        })?;
        for (i, (a, b)) in first.iter().zip(&second).enumerate() {
            if let Some(j) = (0..a.len()).find(|&j| a[j].to_bits() != b[j].to_bits()) {
                return Err(Error::Gradcheck(format!(
                    "input {i}: backward is not reentrant: element {:?} gave {:.17e} then {:.17e}",
                    multi_index(j, &shapes[i]),
                    a[j],
                    b[j]
                )));
            }
        }
    }
    if opts.check_zero_grad_output {
        let grads = analytic(
            &f,
            &values,
            &shapes,
            |s| vec![0.0; s.iter().product()],
            &|| "backward of a zero upstream gradient".into(),
        )?;
        for (i, g) in grads.iter().enumerate() {
            if let Some(j) = g.iter().position(|&x| x != 0.0) {
                return Err(Error::Gradcheck(format!(
                    "input {i}: a zero upstream gradient gave a nonzero gradient {:.3e} at {:?}",
                    g[j],
                    multi_index(j, &shapes[i])
                )));
            }
        }
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    //! Reading a gradient can fail only for an expert bank's deferred gradient, whose recipe is
    //! crate-private; these tests plant a recipe that cannot be computed (operands of two
    //! dtypes) and check that the error reaches the caller instead of reading as zeros.
    use super::*;
    use crate::autograd::GroupedWeightGrad;

    #[test]
    fn an_error_while_reading_a_gradient_fails_gradcheck() {
        let x = Tensor::from_f64(vec![0.5, -0.25], &[2], Device::Cpu).unwrap();
        let bank = Tensor::from_f64(vec![0.0], &[1, 1, 1], Device::Cpu).unwrap();
        // The output depends on x only; the bank (not on the path, so backward leaves its
        // gradient alone) carries a deferred gradient that cannot be computed.
        let f = |t: &[Tensor]| {
            if t[1].requires_grad() {
                t[1].accumulate_deferred(GroupedWeightGrad::uncomputable())?;
            }
            t[0].mul(&t[0])
        };
        let err = gradcheck(f, &[x, bank], &GradcheckOptions::default()).unwrap_err();
        assert!(
            err.to_string().contains("grouped_weight_grad"),
            "expected the deferred gradient's error, got: {err}"
        );
    }
}
