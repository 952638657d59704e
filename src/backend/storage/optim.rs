//! [`Storage`]'s optimizer steps: the fused Adam and SGD updates, as fresh buffers
//! ([`Storage::adam_step`], [`Storage::sgd_step`]) or in place (the `_mut` forms, and the expert
//! bank's Adam step that never stores its gradient), each forwarded to the owning backend.

use super::*;

impl Storage {
    /// See [`OptimOps::adam_step`]; `self` is the parameter.
    pub(crate) fn adam_step(
        &self,
        grad: &Storage,
        scale: Option<&Storage>,
        m: &Storage,
        v: &Storage,
        h: AdamHyper,
    ) -> Result<(Storage, Storage, Storage)> {
        const WHAT: &str = "adam_step";
        on_device!(self, |be| be.adam_step(
            be.buf(self, WHAT)?,
            be.buf(grad, WHAT)?,
            be.opt(scale, WHAT)?,
            be.buf(m, WHAT)?,
            be.buf(v, WHAT)?,
            h
        ))
    }
    /// See [`OptimOps::sgd_step`]; `self` is the parameter.
    pub(crate) fn sgd_step(
        &self,
        grad: &Storage,
        scale: Option<&Storage>,
        buf: &Storage,
        h: SgdHyper,
    ) -> Result<(Storage, Storage)> {
        const WHAT: &str = "sgd_step";
        on_device!(self, |be| be.sgd_step(
            be.buf(self, WHAT)?,
            be.buf(grad, WHAT)?,
            be.opt(scale, WHAT)?,
            be.buf(buf, WHAT)?,
            h
        ))
    }
    /// [`Storage::adam_step`] updating `self` (the parameter), `m` and `v` where they are: in
    /// place, on either device, when nothing else shares the buffers; otherwise fresh buffers
    /// replace them (the shared ones keep their old values).
    pub(crate) fn adam_step_mut(
        &mut self,
        grad: &Storage,
        scale: Option<&Storage>,
        m: &mut Storage,
        v: &mut Storage,
        h: AdamHyper,
    ) -> Result<()> {
        if let (Storage::Cpu(p), Storage::Cpu(g), Storage::Cpu(mm), Storage::Cpu(vv)) =
            (&mut *self, grad, &mut *m, &mut *v)
        {
            let sc = scale.map(|s| as_cpu(s, "adam_step")).transpose()?;
            return cpu::on_pool(g.len(), || {
                cpu::CpuBackend.adam_step_mut(p, g, sc, mm, vv, h)
            });
        }
        if let (Storage::Gpu(p), Storage::Gpu(g), Storage::Gpu(mm), Storage::Gpu(vv)) =
            (&mut *self, grad, &mut *m, &mut *v)
        {
            let sc = scale.map(|s| as_gpu(s, "adam_step")).transpose()?;
            return gpu::GpuBackend::get()?.adam_step_mut(p, g, sc, mm, vv, h);
        }
        let (np, nm, nv) = self.adam_step(grad, scale, m, v, h)?;
        (*self, *m, *v) = (np, nm, nv);
        Ok(())
    }
    /// One Adam step on the expert bank `param` whose gradient is the grouped weight gradient
    /// of `grad` (see [`Storage::grouped_weight_grad`]), updating `param`, `m` and `v` as
    /// [`Storage::adam_step_mut`] does. On the CPU the gradient is never stored: each expert's
    /// block is applied while still in cache. On the GPU it is the two kernels one after the
    /// other.
    pub(crate) fn grouped_weight_grad_adam_mut(
        grad: BankGradOperands<'_, Storage>,
        param: &mut Storage,
        scale: Option<&Storage>,
        m: &mut Storage,
        v: &mut Storage,
        h: AdamHyper,
    ) -> Result<()> {
        let BankGradOperands {
            x,
            dy,
            row_expert,
            offsets,
            bank,
        } = grad;
        if let (
            Storage::Cpu(x),
            Storage::Cpu(d),
            Storage::Cpu(re),
            Storage::Cpu(off),
            Storage::Cpu(p),
            Storage::Cpu(mm),
            Storage::Cpu(vv),
        ) = (x, dy, row_expert, offsets, &mut *param, &mut *m, &mut *v)
        {
            let sc = scale
                .map(|s| as_cpu(s, "grouped_weight_grad_adam"))
                .transpose()?;
            let grad = BankGradOperands {
                x,
                dy: d,
                row_expert: re,
                offsets: off,
                bank,
            };
            return cpu::on_pool(p.len(), || {
                cpu::CpuBackend.grouped_weight_grad_adam_mut(grad, p, sc, mm, vv, h)
            });
        }
        let g = x.grouped_weight_grad(dy, row_expert, offsets, bank, param.dtype())?;
        param.adam_step_mut(&g, scale, m, v, h)
    }
    /// [`Storage::sgd_step`] updating `self` and `buf` where they are (see
    /// [`Storage::adam_step_mut`]).
    pub(crate) fn sgd_step_mut(
        &mut self,
        grad: &Storage,
        scale: Option<&Storage>,
        buf: &mut Storage,
        h: SgdHyper,
    ) -> Result<()> {
        if let (Storage::Cpu(p), Storage::Cpu(g), Storage::Cpu(b)) = (&mut *self, grad, &mut *buf) {
            let sc = scale.map(|s| as_cpu(s, "sgd_step")).transpose()?;
            return cpu::on_pool(g.len(), || cpu::CpuBackend.sgd_step_mut(p, g, sc, b, h));
        }
        if let (Storage::Gpu(p), Storage::Gpu(g), Storage::Gpu(b)) = (&mut *self, grad, &mut *buf) {
            let sc = scale.map(|s| as_gpu(s, "sgd_step")).transpose()?;
            return gpu::GpuBackend::get()?.sgd_step_mut(p, g, sc, b, h);
        }
        let (np, nb) = self.sgd_step(grad, scale, buf, h)?;
        (*self, *buf) = (np, nb);
        Ok(())
    }
}
