//! [`OptimOps`]: the fused optimiser steps, one kernel per parameter buffer (Adam/AdamW and
//! SGD with momentum).

use crate::Result;
use crate::backend::{AdamHyper, BufferOps, SgdHyper};

/// Fused optimiser steps: one Adam/AdamW or SGD update per call.
pub(crate) trait OptimOps: BufferOps {
    /// One fused Adam/AdamW step over a parameter buffer. `grad_scale`, when given, multiplies
    /// the gradient first (gradient clipping without a read-back): one value, or two, the
    /// factor and the steps a loss scale skipped so far (`optim::LossScale`), whose bias
    /// corrections are then for `h.step` minus those ([`AdamHyper::after_skipped_steps`]). A
    /// negative factor skips the step: nothing changes. Returns the new `(param, m, v)`.
    fn adam_step(
        &self,
        param: &Self::Buffer,
        grad: &Self::Buffer,
        grad_scale: Option<&Self::Buffer>,
        m: &Self::Buffer,
        v: &Self::Buffer,
        h: AdamHyper,
    ) -> Result<(Self::Buffer, Self::Buffer, Self::Buffer)>;
    /// One fused SGD step (momentum buffer `buf`, ignored when momentum is 0). Returns the new
    /// `(param, buf)`.
    fn sgd_step(
        &self,
        param: &Self::Buffer,
        grad: &Self::Buffer,
        grad_scale: Option<&Self::Buffer>,
        buf: &Self::Buffer,
        h: SgdHyper,
    ) -> Result<(Self::Buffer, Self::Buffer)>;
}
