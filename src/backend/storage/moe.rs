//! [`Storage`]'s Mixture-of-Experts primitives, forwarded to the owning backend: the grouped
//! (per-expert) matmul and its weight gradient, the top-k gate and its backward, the softmax
//! backward and the dispatch plan.

use super::*;

impl Storage {
    /// See [`Backend::grouped_matmul`]; `self` is `x`.
    pub fn grouped_matmul(
        &self,
        w: &Storage,
        bias: Option<&Storage>,
        row_expert: &Storage,
        dims: GroupedMatmulDims,
    ) -> Result<Storage> {
        const WHAT: &str = "grouped_matmul";
        let (ow, oe) = (same_dev!(self, w, WHAT), same_dev!(self, row_expert, WHAT));
        let ob = bias.map(|b| Ok(same_dev!(self, b, WHAT))).transpose()?;
        match self {
            Storage::Cpu(x) => cpu::on_pool(self.len(), || {
                cpu::CpuBackend.grouped_matmul(
                    x,
                    ow.cpu(),
                    ob.as_ref().map(|b| b.cpu()),
                    oe.cpu(),
                    dims,
                )
            })
            .map(Storage::Cpu),
            Storage::Gpu(x) => gpu::GpuBackend::get()?
                .grouped_matmul(x, ow.gpu(), ob.as_ref().map(|b| b.gpu()), oe.gpu(), dims)
                .map(Storage::Gpu),
        }
    }
    /// See [`Backend::grouped_weight_grad`]; `self` is `x`.
    pub fn grouped_weight_grad(
        &self,
        dy: &Storage,
        row_expert: &Storage,
        offsets: &Storage,
        bank: ExpertBankDims,
    ) -> Result<Storage> {
        let (od, oe, oo) = (
            same_dev!(self, dy, "grouped_weight_grad"),
            same_dev!(self, row_expert, "grouped_weight_grad"),
            same_dev!(self, offsets, "grouped_weight_grad"),
        );
        match self {
            Storage::Cpu(x) => cpu::on_pool(self.len(), || {
                cpu::CpuBackend.grouped_weight_grad(x, od.cpu(), oe.cpu(), oo.cpu(), bank)
            })
            .map(Storage::Cpu),
            Storage::Gpu(x) => gpu::GpuBackend::get()?
                .grouped_weight_grad(x, od.gpu(), oe.gpu(), oo.gpu(), bank)
                .map(Storage::Gpu),
        }
    }

    /// See [`Backend::topk_gate`]; `self` is the logits `[rows, n]`. Returns `(probs, idx,
    /// weights)`.
    pub fn topk_gate(
        &self,
        scores: Option<&Storage>,
        (rows, n, k): (usize, usize, usize),
        renormalise: bool,
    ) -> Result<(Storage, Storage, Storage)> {
        const WHAT: &str = "topk_gate";
        let os = scores.map(|s| Ok(same_dev!(self, s, WHAT))).transpose()?;
        match self {
            Storage::Cpu(l) => {
                let (p, i, w) = cpu::on_pool(self.len(), || {
                    cpu::CpuBackend.topk_gate(
                        l,
                        os.as_ref().map(|o| o.cpu()),
                        rows,
                        n,
                        k,
                        renormalise,
                    )
                })?;
                Ok((Storage::Cpu(p), Storage::Cpu(i), Storage::Cpu(w)))
            }
            Storage::Gpu(l) => {
                let (p, i, w) = gpu::GpuBackend::get()?.topk_gate(
                    l,
                    os.as_ref().map(|o| o.gpu()),
                    rows,
                    n,
                    k,
                    renormalise,
                )?;
                Ok((Storage::Gpu(p), Storage::Gpu(i), Storage::Gpu(w)))
            }
        }
    }
    /// See [`Backend::topk_gate_backward`]; `self` is the gate's weights `[rows, k]`.
    pub fn topk_gate_backward(
        &self,
        idx: &Storage,
        d_weights: &Storage,
        probs: Option<&Storage>,
        (rows, n, k): (usize, usize, usize),
    ) -> Result<Storage> {
        const WHAT: &str = "topk_gate backward";
        let (oi, od) = (same_dev!(self, idx, WHAT), same_dev!(self, d_weights, WHAT));
        let op = probs.map(|p| Ok(same_dev!(self, p, WHAT))).transpose()?;
        match self {
            Storage::Cpu(w) => cpu::on_pool(self.len(), || {
                cpu::CpuBackend.topk_gate_backward(
                    w,
                    oi.cpu(),
                    od.cpu(),
                    op.as_ref().map(|o| o.cpu()),
                    (rows, n, k),
                )
            })
            .map(Storage::Cpu),
            Storage::Gpu(w) => gpu::GpuBackend::get()?
                .topk_gate_backward(
                    w,
                    oi.gpu(),
                    od.gpu(),
                    op.as_ref().map(|o| o.gpu()),
                    (rows, n, k),
                )
                .map(Storage::Gpu),
        }
    }
    /// See [`Backend::softmax_backward`]; `self` is the softmax output `y` `[rows, n]`.
    pub fn softmax_backward(&self, dy: &Storage, rows: usize, n: usize) -> Result<Storage> {
        let od = same_dev!(self, dy, "softmax backward");
        match self {
            Storage::Cpu(y) => cpu::on_pool(self.len(), || {
                cpu::CpuBackend.softmax_backward(y, od.cpu(), rows, n)
            })
            .map(Storage::Cpu),
            Storage::Gpu(y) => gpu::GpuBackend::get()?
                .softmax_backward(y, od.gpu(), rows, n)
                .map(Storage::Gpu),
        }
    }
    /// See [`Backend::dispatch_plan`]; `self` is the token of each assignment.
    pub fn dispatch_plan(
        &self,
        (expert, weight, rank, valid): (&Storage, &Storage, &Storage, &Storage),
        experts: usize,
        capacity: Option<usize>,
    ) -> Result<PlanBuffers<Storage>> {
        const WHAT: &str = "dispatch_plan";
        let (oe, ow, or, ov) = (
            same_dev!(self, expert, WHAT),
            same_dev!(self, weight, WHAT),
            same_dev!(self, rank, WHAT),
            same_dev!(self, valid, WHAT),
        );
        fn wrap<B>(p: PlanBuffers<B>, f: impl Fn(B) -> Storage) -> PlanBuffers<Storage> {
            PlanBuffers {
                order: f(p.order),
                row_token: f(p.row_token),
                row_expert: f(p.row_expert),
                row_expert_clamped: f(p.row_expert_clamped),
                row_kept: f(p.row_kept),
                offsets: f(p.offsets),
                kept_per_expert: f(p.kept_per_expert),
                routed_per_expert: f(p.routed_per_expert),
            }
        }
        match self {
            Storage::Cpu(t) => Ok(wrap(
                cpu::on_pool(self.len(), || {
                    cpu::CpuBackend.dispatch_plan(
                        t,
                        oe.cpu(),
                        (ow.cpu(), or.cpu(), ov.cpu()),
                        experts,
                        capacity,
                    )
                })?,
                Storage::Cpu,
            )),
            Storage::Gpu(t) => Ok(wrap(
                gpu::GpuBackend::get()?.dispatch_plan(
                    t,
                    oe.gpu(),
                    (ow.gpu(), or.gpu(), ov.gpu()),
                    experts,
                    capacity,
                )?,
                Storage::Gpu,
            )),
        }
    }
}
