//! The fused optimizer steps: Adam / AdamW ([`CpuBackend::adam_step_mut`]), the expert bank's
//! Adam step that never stores its gradient ([`CpuBackend::grouped_weight_grad_adam_mut`]) and
//! SGD with momentum ([`CpuBackend::sgd_step_mut`]), all in place, chunked over threads, with
//! the Adam loop compiled once per vector width; and the gradients' sum of squares that
//! gradient clipping needs ([`CpuBackend::grad_sum_of_squares`]).

use super::grouped_matmul::{WeightGradProblem, expert_routing};
use super::{CpuBackend, CpuBuffer, PooledVec};
use crate::backend::OptimOps;
use crate::backend::checks::check_same_lengths;
use crate::backend::{AdamHyper, BankGradOperands, BufferOps, ExpertBankDims, SgdHyper};
use crate::{Error, Result};
use num_traits::Float;
use rayon::prelude::*;
use std::sync::Arc;

/// Elements per rayon task in the fused optimizer loops.
pub(super) const OPT_CHUNK: usize = 1 << 14;

/// Adam's per-step constants in the buffer's own precision (so the f32 loop runs in f32 lanes).
#[derive(Clone, Copy)]
pub(super) struct AdamConsts<T> {
    b1: T,
    b2: T,
    one_minus_b1: T,
    one_minus_b2: T,
    lr: T,
    wd: T,
    eps: T,
    scale: T,
    inv_bc1: T,
    inv_bc2: T,
}

impl<T: Float> AdamConsts<T> {
    fn new(h: AdamHyper, scale: f64) -> AdamConsts<T> {
        let c = |x: f64| T::from(x).unwrap_or_else(T::nan);
        let (b1, b2) = (c(h.beta1), c(h.beta2));
        AdamConsts {
            b1,
            b2,
            one_minus_b1: T::one() - b1,
            one_minus_b2: T::one() - b2,
            lr: c(h.lr),
            wd: c(h.weight_decay),
            eps: c(h.eps),
            scale: c(scale),
            inv_bc1: c(1.0 / h.bias_correction1),
            inv_bc2: c(1.0 / h.bias_correction2),
        }
    }
}

/// The widest vector instructions this processor offers beyond the baseline build's SSE2, for
/// the loops that are compiled once per width (see [`adam_chunk_wide`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Wide {
    /// only the baseline (SSE2 on x86-64, or another architecture)
    Baseline,
    /// AVX2: eight f32 lanes
    Avx2,
    /// AVX-512F: sixteen f32 lanes
    Avx512,
}

impl Wide {
    pub(super) fn detect() -> Wide {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return Wide::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                return Wide::Avx2;
            }
        }
        Wide::Baseline
    }
}

/// [`adam_chunk`] compiled for the widest vectors `wide` names. Adam is a streaming loop whose
/// `sqrt` and division keep SSE2's four lanes busy for about as long as memory takes to deliver
/// the four arrays; wider lanes leave it bound by memory alone. The results are identical (the
/// same IEEE operations, no fused multiply-adds).
pub(super) fn adam_chunk_wide<T: Float, const DECOUPLED: bool>(
    wide: Wide,
    p: &mut [T],
    g: &[T],
    m: &mut [T],
    v: &mut [T],
    c: AdamConsts<T>,
) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f")]
        fn avx512<T: Float, const D: bool>(
            p: &mut [T],
            g: &[T],
            m: &mut [T],
            v: &mut [T],
            c: AdamConsts<T>,
        ) {
            adam_chunk::<T, D>(p, g, m, v, c)
        }
        #[target_feature(enable = "avx2")]
        fn avx2<T: Float, const D: bool>(
            p: &mut [T],
            g: &[T],
            m: &mut [T],
            v: &mut [T],
            c: AdamConsts<T>,
        ) {
            adam_chunk::<T, D>(p, g, m, v, c)
        }
        match wide {
            // SAFETY: `Wide::detect` found the feature on this processor.
            Wide::Avx512 => return unsafe { avx512::<T, DECOUPLED>(p, g, m, v, c) },
            // SAFETY: as above.
            Wide::Avx2 => return unsafe { avx2::<T, DECOUPLED>(p, g, m, v, c) },
            Wide::Baseline => {}
        }
    }
    let _ = wide;
    adam_chunk::<T, DECOUPLED>(p, g, m, v, c)
}

/// One Adam (`DECOUPLED = false`, L2 decay folded into the gradient) or AdamW
/// (`DECOUPLED = true`) update over one chunk, in place. The constants arrive by value and the
/// slices are cut to one length, so the loop has no branch or reload and vectorises.
#[inline(always)]
pub(super) fn adam_chunk<T: Float, const DECOUPLED: bool>(
    p: &mut [T],
    g: &[T],
    m: &mut [T],
    v: &mut [T],
    c: AdamConsts<T>,
) {
    let n = p.len().min(g.len()).min(m.len()).min(v.len());
    let (p, g, m, v) = (&mut p[..n], &g[..n], &mut m[..n], &mut v[..n]);
    for i in 0..n {
        let pi = p[i];
        let mut gi = g[i] * c.scale;
        if !DECOUPLED {
            gi = gi + c.wd * pi;
        }
        let mi = c.b1 * m[i] + c.one_minus_b1 * gi;
        let vi = c.b2 * v[i] + c.one_minus_b2 * gi * gi;
        m[i] = mi;
        v[i] = vi;
        let update = (mi * c.inv_bc1) / ((vi * c.inv_bc2).sqrt() + c.eps);
        let decay = if DECOUPLED {
            c.lr * c.wd * pi
        } else {
            T::zero()
        };
        p[i] = pi - c.lr * update - decay;
    }
}

impl CpuBackend {
    /// [`OptimOps::adam_step`] in place: the parameter and moment buffers are updated where they
    /// are when nothing else shares them (copied first otherwise), so a steady-state optimizer
    /// step allocates nothing and touches each element once.
    pub(crate) fn adam_step_mut(
        &self,
        param: &mut CpuBuffer,
        grad: &CpuBuffer,
        grad_scale: Option<&CpuBuffer>,
        m: &mut CpuBuffer,
        v: &mut CpuBuffer,
        h: AdamHyper,
    ) -> Result<()> {
        let (scale, skipped) = scale_of(grad_scale)?;
        if scale < 0.0 {
            return Ok(()); // a skipped step (see `scale_of`)
        }
        let h = h.after_skipped_steps(skipped);
        check_same_lengths("adam_step", &[param, grad, m, v])?;
        fn run<T: Float + Send + Sync + Clone>(
            p: &mut Arc<PooledVec<T>>,
            g: &[T],
            m: &mut Arc<PooledVec<T>>,
            v: &mut Arc<PooledVec<T>>,
            scale: f64,
            h: AdamHyper,
        ) {
            let (p, m, v) = (Arc::make_mut(p), Arc::make_mut(m), Arc::make_mut(v));
            let c = AdamConsts::new(h, scale);
            let chunks = p
                .par_chunks_mut(OPT_CHUNK)
                .zip(g.par_chunks(OPT_CHUNK))
                .zip(m.par_chunks_mut(OPT_CHUNK))
                .zip(v.par_chunks_mut(OPT_CHUNK));
            // the Adam/AdamW choice is made once here, not per element, so the loop vectorises
            let wide = Wide::detect();
            if h.decoupled {
                chunks.for_each(|(((p, g), m), v)| adam_chunk_wide::<T, true>(wide, p, g, m, v, c));
            } else {
                chunks
                    .for_each(|(((p, g), m), v)| adam_chunk_wide::<T, false>(wide, p, g, m, v, c));
            }
        }
        match (param, grad, m, v) {
            (CpuBuffer::F32(p), CpuBuffer::F32(g), CpuBuffer::F32(m), CpuBuffer::F32(v)) => {
                run(p, g, m, v, scale, h)
            }
            (CpuBuffer::F64(p), CpuBuffer::F64(g), CpuBuffer::F64(m), CpuBuffer::F64(v)) => {
                run(p, g, m, v, scale, h)
            }
            _ => {
                return Err(Error::DType(
                    "adam_step: parameter, gradient and state must share one float dtype".into(),
                ));
            }
        }
        Ok(())
    }

    /// One Adam step on an expert bank `param` (`[experts, k, m]`, with moments `m_state`,
    /// `v_state`) whose gradient is the grouped weight gradient of `grad` (see
    /// [`MatmulOps::grouped_weight_grad`](crate::backend::MatmulOps::grouped_weight_grad)), in place and without storing that gradient: each
    /// expert's block is applied while still in cache. The result equals
    /// `grouped_weight_grad` followed by [`CpuBackend::adam_step_mut`], element for element.
    pub(crate) fn grouped_weight_grad_adam_mut(
        &self,
        grad: BankGradOperands<'_, CpuBuffer>,
        param: &mut CpuBuffer,
        grad_scale: Option<&CpuBuffer>,
        m_state: &mut CpuBuffer,
        v_state: &mut CpuBuffer,
        h: AdamHyper,
    ) -> Result<()> {
        let BankGradOperands {
            x,
            dy,
            row_expert,
            offsets,
            bank: ExpertBankDims { k, m, experts },
        } = grad;
        let what = "grouped_weight_grad_adam";
        let routing = expert_routing(row_expert, offsets, experts, what)?;
        let rows = routing.0.len();
        if x.len() < rows * k || dy.len() < rows * m {
            return Err(Error::Shape(format!(
                "{what}: {rows} rows need x of {rows}×{k} and dy of {rows}×{m} elements, got {} and {}",
                x.len(),
                dy.len()
            )));
        }
        if param.len() != experts * k * m {
            return Err(Error::Shape(format!(
                "{what}: a bank of {experts}×{k}×{m} has {} elements, the parameter has {}",
                experts * k * m,
                param.len()
            )));
        }
        check_same_lengths(what, &[param, m_state, v_state])?;
        let (scale, skipped) = scale_of(grad_scale)?;
        if scale < 0.0 {
            return Ok(()); // a skipped step (see `scale_of`)
        }
        let h = h.after_skipped_steps(skipped);
        fn run<T: Float + Send + Sync + Clone + 'static>(
            prob: WeightGradProblem<'_, T>,
            p: &mut Arc<PooledVec<T>>,
            mo: &mut Arc<PooledVec<T>>,
            ve: &mut Arc<PooledVec<T>>,
            scale: f64,
            h: AdamHyper,
        ) {
            let (p, mo, ve) = (Arc::make_mut(p), Arc::make_mut(mo), Arc::make_mut(ve));
            let c = AdamConsts::new(h, scale);
            if h.decoupled {
                prob.adam_step::<true>(p, mo, ve, c)
            } else {
                prob.adam_step::<false>(p, mo, ve, c)
            }
        }
        let dims = (k, m, experts);
        match (x, dy, param, m_state, v_state) {
            (
                CpuBuffer::F32(x),
                CpuBuffer::F32(dy),
                CpuBuffer::F32(p),
                CpuBuffer::F32(mo),
                CpuBuffer::F32(ve),
            ) => run(
                WeightGradProblem::new(x, dy, routing, dims),
                p,
                mo,
                ve,
                scale,
                h,
            ),
            (
                CpuBuffer::F64(x),
                CpuBuffer::F64(dy),
                CpuBuffer::F64(p),
                CpuBuffer::F64(mo),
                CpuBuffer::F64(ve),
            ) => run(
                WeightGradProblem::new(x, dy, routing, dims),
                p,
                mo,
                ve,
                scale,
                h,
            ),
            _ => {
                return Err(Error::DType(format!(
                    "{what}: rows, gradient, parameter and state must share one float dtype"
                )));
            }
        }
        Ok(())
    }

    /// [`OptimOps::sgd_step`] in place (see [`CpuBackend::adam_step_mut`]).
    pub(crate) fn sgd_step_mut(
        &self,
        param: &mut CpuBuffer,
        grad: &CpuBuffer,
        grad_scale: Option<&CpuBuffer>,
        buf: &mut CpuBuffer,
        h: SgdHyper,
    ) -> Result<()> {
        let (scale, _) = scale_of(grad_scale)?;
        if scale < 0.0 {
            return Ok(()); // a skipped step (see `scale_of`)
        }
        check_same_lengths("sgd_step", &[param, grad, buf])?;
        fn run<T: Float + Send + Sync + Clone>(
            p: &mut Arc<PooledVec<T>>,
            g: &[T],
            b: &mut Arc<PooledVec<T>>,
            scale: f64,
            h: SgdHyper,
        ) {
            let p = Arc::make_mut(p);
            if h.momentum == 0.0 {
                // plain SGD: the momentum buffer is neither read nor written
                p.par_chunks_mut(OPT_CHUNK)
                    .zip(g.par_chunks(OPT_CHUNK))
                    .for_each(|(p, g)| {
                        for (p, g) in p.iter_mut().zip(g) {
                            let pi = p.to_f64().unwrap_or(0.0);
                            let gi = g.to_f64().unwrap_or(0.0) * scale + h.weight_decay * pi;
                            *p = T::from(pi - h.lr * gi).unwrap_or(T::nan());
                        }
                    });
                return;
            }
            let b = Arc::make_mut(b);
            let f = |p: &mut [T], g: &[T], b: &mut [T]| {
                for i in 0..p.len() {
                    let pi = p[i].to_f64().unwrap_or(0.0);
                    let gi = g[i].to_f64().unwrap_or(0.0) * scale + h.weight_decay * pi;
                    let bi = h.momentum * b[i].to_f64().unwrap_or(0.0) + gi;
                    let step = if h.nesterov { gi + h.momentum * bi } else { bi };
                    p[i] = T::from(pi - h.lr * step).unwrap_or(T::nan());
                    b[i] = T::from(bi).unwrap_or(T::nan());
                }
            };
            p.par_chunks_mut(OPT_CHUNK)
                .zip(g.par_chunks(OPT_CHUNK))
                .zip(b.par_chunks_mut(OPT_CHUNK))
                .for_each(|((p, g), b)| f(p, g, b));
        }
        match (param, grad, buf) {
            (CpuBuffer::F32(p), CpuBuffer::F32(g), CpuBuffer::F32(b)) => run(p, g, b, scale, h),
            (CpuBuffer::F64(p), CpuBuffer::F64(g), CpuBuffer::F64(b)) => run(p, g, b, scale, h),
            _ => {
                return Err(Error::DType(
                    "sgd_step: parameter, gradient and state must share one float dtype".into(),
                ));
            }
        }
        Ok(())
    }
}

/// The gradient scale of an update and the steps a loss scale skipped: `(1, 0)` without one,
/// else its first value and its second (0 for a one-value scale). A negative scale means "skip
/// this step" (mixed precision's overflowed step, `optim::LossScale`): the updates return
/// without writing, as the GPU kernels do; Adam's bias corrections leave the skipped steps out
/// ([`AdamHyper::after_skipped_steps`]).
pub(super) fn scale_of(grad_scale: Option<&CpuBuffer>) -> Result<(f64, f64)> {
    match grad_scale {
        None => Ok((1.0, 0.0)),
        Some(s) if s.len() == 1 || s.len() == 2 => {
            let v = CpuBackend.download(s)?.to_f64();
            Ok((v[0], v.get(1).copied().unwrap_or(0.0)))
        }
        Some(s) => Err(crate::backend::checks::grad_scale_length_error(s.len())),
    }
}

impl CpuBackend {
    /// `Σ_i ‖g_i‖²` over float buffers of one dtype, accumulated in f64 (`None` when the buffers
    /// are not all f32 or all f64): one parallel pass over the values in chunks of
    /// `OPT_CHUNK`, each summed in eight running sums so that the loop vectorises and no
    /// addition waits for the one before it. The CPU end of `optim::clip_grad_norm`, as
    /// `GpuBackend::grad_norm_clip` is the GPU's.
    pub(crate) fn grad_sum_of_squares(&self, grads: &[&CpuBuffer]) -> Option<f64> {
        fn sum_sq<T: Copy + Into<f64> + Sync>(v: &[T]) -> f64 {
            let chunk_sum = |c: &[T]| {
                let mut lanes = [0.0f64; 8];
                let whole = c.chunks_exact(8);
                let tail: f64 = whole.remainder().iter().map(|&x| x.into() * x.into()).sum();
                for w in whole {
                    for (acc, &x) in lanes.iter_mut().zip(w) {
                        *acc += x.into() * x.into();
                    }
                }
                lanes.iter().sum::<f64>() + tail
            };
            v.par_chunks(OPT_CHUNK).map(chunk_sum).sum()
        }
        let dtype = grads.first()?.dtype();
        let mut total = 0.0;
        for g in grads {
            total += match (g, dtype) {
                (CpuBuffer::F32(v), crate::DType::F32) => sum_sq(v),
                (CpuBuffer::F64(v), crate::DType::F64) => sum_sq(v),
                _ => return None,
            };
        }
        Some(total)
    }
}

impl OptimOps for CpuBackend {
    fn adam_step(
        &self,
        param: &CpuBuffer,
        grad: &CpuBuffer,
        grad_scale: Option<&CpuBuffer>,
        m: &CpuBuffer,
        v: &CpuBuffer,
        h: AdamHyper,
    ) -> Result<(CpuBuffer, CpuBuffer, CpuBuffer)> {
        let (mut p, mut m, mut v) = (param.clone(), m.clone(), v.clone());
        self.adam_step_mut(&mut p, grad, grad_scale, &mut m, &mut v, h)?;
        Ok((p, m, v))
    }

    fn sgd_step(
        &self,
        param: &CpuBuffer,
        grad: &CpuBuffer,
        grad_scale: Option<&CpuBuffer>,
        buf: &CpuBuffer,
        h: SgdHyper,
    ) -> Result<(CpuBuffer, CpuBuffer)> {
        let (mut p, mut b) = (param.clone(), buf.clone());
        self.sgd_step_mut(&mut p, grad, grad_scale, &mut b, h)?;
        Ok((p, b))
    }
}
