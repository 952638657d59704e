//! [`Storage`]: the buffer a tensor holds, on whichever device, and the dispatch of each
//! primitive to the backend that owns it. Mixing devices in one call is an error, not a copy.

use super::*;
use crate::Result;

/// A buffer on some device: what a tensor holds. Cloning is cheap (shared).
#[derive(Clone, Debug)]
pub enum Storage {
    /// on the CPU
    Cpu(cpu::CpuBuffer),
    /// on the GPU
    Gpu(gpu::GpuBuffer),
}

/// Dispatches one primitive to the backend that owns the storages; mixing devices is an error.
macro_rules! dispatch {
    ($self:expr, $b:ident, $x:ident => $body:expr) => {
        match $self {
            Storage::Cpu($x) => {
                let $b = cpu::CpuBackend;
                $body.map(Storage::Cpu)
            }
            Storage::Gpu($x) => {
                let $b = gpu::GpuBackend::get()?;
                $body.map(Storage::Gpu)
            }
        }
    };
}

fn as_cpu<'a>(s: &'a Storage, what: &str) -> Result<&'a cpu::CpuBuffer> {
    match s {
        Storage::Cpu(b) => Ok(b),
        Storage::Gpu(_) => Err(crate::Error::Device(format!(
            "{what}: operand is on the GPU, expected CPU"
        ))),
    }
}
fn as_gpu<'a>(s: &'a Storage, what: &str) -> Result<&'a gpu::GpuBuffer> {
    match s {
        Storage::Gpu(b) => Ok(b),
        Storage::Cpu(_) => Err(crate::Error::Device(format!(
            "{what}: operand is on the CPU, expected GPU"
        ))),
    }
}

/// Picks the partner storage of the same device as `$self`.
macro_rules! same_dev {
    ($self:expr, $other:expr, $what:expr) => {
        match $self {
            Storage::Cpu(_) => OtherRef::Cpu(as_cpu($other, $what)?),
            Storage::Gpu(_) => OtherRef::Gpu(as_gpu($other, $what)?),
        }
    };
}

enum OtherRef<'a> {
    Cpu(&'a cpu::CpuBuffer),
    Gpu(&'a gpu::GpuBuffer),
}
impl<'a> OtherRef<'a> {
    fn cpu(&self) -> &'a cpu::CpuBuffer {
        match self {
            OtherRef::Cpu(b) => b,
            OtherRef::Gpu(_) => unreachable!("same_dev checked the device"),
        }
    }
    fn gpu(&self) -> &'a gpu::GpuBuffer {
        match self {
            OtherRef::Gpu(b) => b,
            OtherRef::Cpu(_) => unreachable!("same_dev checked the device"),
        }
    }
}

impl Storage {
    /// The storage's device kind.
    pub fn is_gpu(&self) -> bool {
        matches!(self, Storage::Gpu(_))
    }
    /// The dtype of the elements.
    pub fn dtype(&self) -> DType {
        match self {
            Storage::Cpu(b) => b.dtype(),
            Storage::Gpu(b) => b.dtype(),
        }
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Storage::Cpu(b) => b.len(),
            Storage::Gpu(b) => b.len(),
        }
    }
    /// True when the storage holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Uploads host data to the CPU or GPU.
    pub fn upload(data: &HostData, gpu: bool) -> Result<Storage> {
        if gpu {
            Ok(Storage::Gpu(gpu::GpuBackend::get()?.upload(data)?))
        } else {
            Ok(Storage::Cpu(cpu::CpuBackend.upload(data)?))
        }
    }
    /// Takes host data to the CPU (keeping its vector, no copy) or uploads it to the GPU.
    pub fn from_host(data: HostData, gpu: bool) -> Result<Storage> {
        if gpu {
            return Storage::upload(&data, true);
        }
        Ok(Storage::Cpu(match data {
            HostData::F32(v) => cpu::CpuBuffer::F32(std::sync::Arc::new(v.into())),
            HostData::F64(v) => cpu::CpuBuffer::F64(std::sync::Arc::new(v.into())),
            HostData::I32(v) => cpu::CpuBuffer::I32(std::sync::Arc::new(v.into())),
        }))
    }
    /// A filled buffer on the CPU or GPU.
    pub fn full(len: usize, value: f64, dtype: DType, gpu: bool) -> Result<Storage> {
        if gpu {
            Ok(Storage::Gpu(
                gpu::GpuBackend::get()?.full(len, value, dtype)?,
            ))
        } else {
            Ok(Storage::Cpu(cpu::CpuBackend.full(len, value, dtype)?))
        }
    }
    /// Reads the values back to the host.
    pub fn download(&self) -> Result<HostData> {
        match self {
            Storage::Cpu(b) => cpu::CpuBackend.download(b),
            Storage::Gpu(b) => gpu::GpuBackend::get()?.download(b),
        }
    }
    /// See [`Backend::cast`].
    pub fn cast(&self, dtype: DType) -> Result<Storage> {
        dispatch!(self, be, x => be.cast(x, dtype))
    }
    /// See [`Backend::unary`].
    pub fn unary(&self, op: UnaryOp) -> Result<Storage> {
        dispatch!(self, be, x => be.unary(op, x))
    }
    /// See [`Backend::binary`].
    pub fn binary(
        &self,
        op: BinaryOp,
        a_strides: &[usize],
        b: &Storage,
        b_strides: &[usize],
        out_shape: &[usize],
    ) -> Result<Storage> {
        let o = same_dev!(self, b, "binary op");
        match self {
            Storage::Cpu(a) => cpu::CpuBackend
                .binary(op, a, a_strides, o.cpu(), b_strides, out_shape)
                .map(Storage::Cpu),
            Storage::Gpu(a) => gpu::GpuBackend::get()?
                .binary(op, a, a_strides, o.gpu(), b_strides, out_shape)
                .map(Storage::Gpu),
        }
    }
    /// See [`Backend::where_cond`]; `self` is the condition.
    #[allow(clippy::too_many_arguments)]
    pub fn where_cond(
        &self,
        c_strides: &[usize],
        a: &Storage,
        a_strides: &[usize],
        b: &Storage,
        b_strides: &[usize],
        out_shape: &[usize],
    ) -> Result<Storage> {
        let oa = same_dev!(self, a, "where");
        let ob = same_dev!(self, b, "where");
        match self {
            Storage::Cpu(c) => cpu::CpuBackend
                .where_cond(
                    c,
                    c_strides,
                    oa.cpu(),
                    a_strides,
                    ob.cpu(),
                    b_strides,
                    out_shape,
                )
                .map(Storage::Cpu),
            Storage::Gpu(c) => gpu::GpuBackend::get()?
                .where_cond(
                    c,
                    c_strides,
                    oa.gpu(),
                    a_strides,
                    ob.gpu(),
                    b_strides,
                    out_shape,
                )
                .map(Storage::Gpu),
        }
    }
    /// See [`Backend::reduce`].
    pub fn reduce(&self, op: ReduceOp, view: AxisView) -> Result<Storage> {
        dispatch!(self, be, x => be.reduce(op, x, view))
    }
    /// See [`Backend::matmul`].
    pub fn matmul(
        &self,
        a_layout: MatLayout,
        b: &Storage,
        b_layout: MatLayout,
        dims: MatmulDims,
    ) -> Result<Storage> {
        let o = same_dev!(self, b, "matmul");
        match self {
            Storage::Cpu(a) => cpu::CpuBackend
                .matmul(a, a_layout, o.cpu(), b_layout, dims)
                .map(Storage::Cpu),
            Storage::Gpu(a) => gpu::GpuBackend::get()?
                .matmul(a, a_layout, o.gpu(), b_layout, dims)
                .map(Storage::Gpu),
        }
    }
    /// See [`Backend::copy_strided`].
    pub fn copy_strided(
        &self,
        shape: &[usize],
        strides: &[usize],
        offset: usize,
    ) -> Result<Storage> {
        dispatch!(self, be, x => be.copy_strided(x, shape, strides, offset))
    }
    /// See [`Backend::concat`].
    pub fn concat(
        parts: &[&Storage],
        lens: &[usize],
        outer: usize,
        inner: usize,
    ) -> Result<Storage> {
        let first = parts
            .first()
            .ok_or_else(|| crate::Error::Invalid("concat of no tensors".into()))?;
        match first {
            Storage::Cpu(_) => {
                let v = parts
                    .iter()
                    .map(|p| as_cpu(p, "concat"))
                    .collect::<Result<Vec<_>>>()?;
                cpu::CpuBackend
                    .concat(&v, lens, outer, inner)
                    .map(Storage::Cpu)
            }
            Storage::Gpu(_) => {
                let v = parts
                    .iter()
                    .map(|p| as_gpu(p, "concat"))
                    .collect::<Result<Vec<_>>>()?;
                gpu::GpuBackend::get()?
                    .concat(&v, lens, outer, inner)
                    .map(Storage::Gpu)
            }
        }
    }
    /// See [`Backend::gather`].
    pub fn gather(
        &self,
        view: AxisView,
        idx: &Storage,
        idx_strides: [usize; 3],
        m: usize,
    ) -> Result<Storage> {
        let o = same_dev!(self, idx, "gather");
        match self {
            Storage::Cpu(x) => cpu::CpuBackend
                .gather(x, view, o.cpu(), idx_strides, m)
                .map(Storage::Cpu),
            Storage::Gpu(x) => gpu::GpuBackend::get()?
                .gather(x, view, o.gpu(), idx_strides, m)
                .map(Storage::Gpu),
        }
    }
    /// See [`Backend::scatter_add`]; `self` is the source.
    #[allow(clippy::too_many_arguments)]
    pub fn scatter_add(
        &self,
        idx: &Storage,
        idx_strides: [usize; 3],
        outer: usize,
        m: usize,
        inner: usize,
        len: usize,
    ) -> Result<Storage> {
        let o = same_dev!(self, idx, "scatter_add");
        match self {
            Storage::Cpu(s) => cpu::CpuBackend
                .scatter_add(s, o.cpu(), idx_strides, outer, m, inner, len)
                .map(Storage::Cpu),
            Storage::Gpu(s) => gpu::GpuBackend::get()?
                .scatter_add(s, o.gpu(), idx_strides, outer, m, inner, len)
                .map(Storage::Gpu),
        }
    }
    /// See [`Backend::cumsum`].
    pub fn cumsum(&self, view: AxisView, reverse: bool) -> Result<Storage> {
        dispatch!(self, be, x => be.cumsum(x, view, reverse))
    }
    /// See [`Backend::argsort`].
    pub fn argsort(&self, rows: usize, len: usize, descending: bool) -> Result<Storage> {
        dispatch!(self, be, x => be.argsort(x, rows, len, descending))
    }
    /// See [`Backend::argsort_top`].
    pub fn argsort_top(
        &self,
        rows: usize,
        len: usize,
        k: usize,
        descending: bool,
    ) -> Result<Storage> {
        dispatch!(self, be, x => be.argsort_top(x, rows, len, k, descending))
    }
    /// See [`Backend::random_uniform`].
    pub fn random_uniform(len: usize, seed: u64, dtype: DType, gpu: bool) -> Result<Storage> {
        if gpu {
            Ok(Storage::Gpu(
                gpu::GpuBackend::get()?.random_uniform(len, seed, dtype)?,
            ))
        } else {
            Ok(Storage::Cpu(
                cpu::CpuBackend.random_uniform(len, seed, dtype)?,
            ))
        }
    }
    /// See [`Backend::adam_step`]; `self` is the parameter.
    pub fn adam_step(
        &self,
        grad: &Storage,
        scale: Option<&Storage>,
        m: &Storage,
        v: &Storage,
        h: AdamHyper,
    ) -> Result<(Storage, Storage, Storage)> {
        let (g, mm, vv) = (
            same_dev!(self, grad, "adam_step"),
            same_dev!(self, m, "adam_step"),
            same_dev!(self, v, "adam_step"),
        );
        let sc = match scale {
            Some(s) => Some(same_dev!(self, s, "adam_step")),
            None => None,
        };
        match self {
            Storage::Cpu(p) => {
                let (a, b, c) = cpu::CpuBackend.adam_step(
                    p,
                    g.cpu(),
                    sc.as_ref().map(|s| s.cpu()),
                    mm.cpu(),
                    vv.cpu(),
                    h,
                )?;
                Ok((Storage::Cpu(a), Storage::Cpu(b), Storage::Cpu(c)))
            }
            Storage::Gpu(p) => {
                let (a, b, c) = gpu::GpuBackend::get()?.adam_step(
                    p,
                    g.gpu(),
                    sc.as_ref().map(|s| s.gpu()),
                    mm.gpu(),
                    vv.gpu(),
                    h,
                )?;
                Ok((Storage::Gpu(a), Storage::Gpu(b), Storage::Gpu(c)))
            }
        }
    }
    /// See [`Backend::sgd_step`]; `self` is the parameter.
    pub fn sgd_step(
        &self,
        grad: &Storage,
        scale: Option<&Storage>,
        buf: &Storage,
        h: SgdHyper,
    ) -> Result<(Storage, Storage)> {
        let (g, b) = (
            same_dev!(self, grad, "sgd_step"),
            same_dev!(self, buf, "sgd_step"),
        );
        let sc = match scale {
            Some(s) => Some(same_dev!(self, s, "sgd_step")),
            None => None,
        };
        match self {
            Storage::Cpu(p) => {
                let (a, c) = cpu::CpuBackend.sgd_step(
                    p,
                    g.cpu(),
                    sc.as_ref().map(|s| s.cpu()),
                    b.cpu(),
                    h,
                )?;
                Ok((Storage::Cpu(a), Storage::Cpu(c)))
            }
            Storage::Gpu(p) => {
                let (a, c) = gpu::GpuBackend::get()?.sgd_step(
                    p,
                    g.gpu(),
                    sc.as_ref().map(|s| s.gpu()),
                    b.gpu(),
                    h,
                )?;
                Ok((Storage::Gpu(a), Storage::Gpu(c)))
            }
        }
    }
    /// [`Storage::adam_step`] updating `self` (the parameter), `m` and `v` where they are: in
    /// place, on either device, when nothing else shares the buffers; otherwise fresh buffers
    /// replace them (the shared ones keep their old values).
    pub fn adam_step_mut(
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
            return cpu::CpuBackend.adam_step_mut(p, g, sc, mm, vv, h);
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
    /// of `self` (the rows `x`) and `dy` (see [`Storage::grouped_weight_grad`]), updating
    /// `param`, `m` and `v` as [`Storage::adam_step_mut`] does. On the CPU the gradient is
    /// never stored: each expert's block is applied while still in cache. On the GPU it is
    /// the two kernels one after the other.
    #[allow(clippy::too_many_arguments)]
    pub fn grouped_weight_grad_adam_mut(
        &self,
        dy: &Storage,
        row_expert: &Storage,
        offsets: &Storage,
        (k, m_cols, experts): (usize, usize, usize),
        param: &mut Storage,
        scale: Option<&Storage>,
        m: &mut Storage,
        v: &mut Storage,
        h: AdamHyper,
    ) -> Result<()> {
        if let (
            Storage::Cpu(x),
            Storage::Cpu(d),
            Storage::Cpu(re),
            Storage::Cpu(off),
            Storage::Cpu(p),
            Storage::Cpu(mm),
            Storage::Cpu(vv),
        ) = (self, dy, row_expert, offsets, &mut *param, &mut *m, &mut *v)
        {
            let sc = scale
                .map(|s| as_cpu(s, "grouped_weight_grad_adam"))
                .transpose()?;
            return cpu::CpuBackend.grouped_weight_grad_adam_mut(
                x,
                d,
                re,
                off,
                (k, m_cols, experts),
                p,
                sc,
                mm,
                vv,
                h,
            );
        }
        let g = self.grouped_weight_grad(dy, row_expert, offsets, k, m_cols, experts)?;
        param.adam_step_mut(&g, scale, m, v, h)
    }
    /// [`Storage::sgd_step`] updating `self` and `buf` where they are (see
    /// [`Storage::adam_step_mut`]).
    pub fn sgd_step_mut(
        &mut self,
        grad: &Storage,
        scale: Option<&Storage>,
        buf: &mut Storage,
        h: SgdHyper,
    ) -> Result<()> {
        if let (Storage::Cpu(p), Storage::Cpu(g), Storage::Cpu(b)) = (&mut *self, grad, &mut *buf) {
            let sc = scale.map(|s| as_cpu(s, "sgd_step")).transpose()?;
            return cpu::CpuBackend.sgd_step_mut(p, g, sc, b, h);
        }
        if let (Storage::Gpu(p), Storage::Gpu(g), Storage::Gpu(b)) = (&mut *self, grad, &mut *buf) {
            let sc = scale.map(|s| as_gpu(s, "sgd_step")).transpose()?;
            return gpu::GpuBackend::get()?.sgd_step_mut(p, g, sc, b, h);
        }
        let (np, nb) = self.sgd_step(grad, scale, buf, h)?;
        (*self, *buf) = (np, nb);
        Ok(())
    }
    /// See [`Backend::grouped_matmul`]; `self` is `x`.
    #[allow(clippy::too_many_arguments)]
    pub fn grouped_matmul(
        &self,
        w: &Storage,
        row_expert: &Storage,
        rows: usize,
        k: usize,
        m: usize,
        experts: usize,
        transpose_w: bool,
    ) -> Result<Storage> {
        let (ow, oe) = (
            same_dev!(self, w, "grouped_matmul"),
            same_dev!(self, row_expert, "grouped_matmul"),
        );
        match self {
            Storage::Cpu(x) => cpu::CpuBackend
                .grouped_matmul(x, ow.cpu(), oe.cpu(), rows, k, m, experts, transpose_w)
                .map(Storage::Cpu),
            Storage::Gpu(x) => gpu::GpuBackend::get()?
                .grouped_matmul(x, ow.gpu(), oe.gpu(), rows, k, m, experts, transpose_w)
                .map(Storage::Gpu),
        }
    }
    /// See [`Backend::grouped_weight_grad`]; `self` is `x`.
    #[allow(clippy::too_many_arguments)]
    pub fn grouped_weight_grad(
        &self,
        dy: &Storage,
        row_expert: &Storage,
        offsets: &Storage,
        k: usize,
        m: usize,
        experts: usize,
    ) -> Result<Storage> {
        let (od, oe, oo) = (
            same_dev!(self, dy, "grouped_weight_grad"),
            same_dev!(self, row_expert, "grouped_weight_grad"),
            same_dev!(self, offsets, "grouped_weight_grad"),
        );
        match self {
            Storage::Cpu(x) => cpu::CpuBackend
                .grouped_weight_grad(x, od.cpu(), oe.cpu(), oo.cpu(), k, m, experts)
                .map(Storage::Cpu),
            Storage::Gpu(x) => gpu::GpuBackend::get()?
                .grouped_weight_grad(x, od.gpu(), oe.gpu(), oo.gpu(), k, m, experts)
                .map(Storage::Gpu),
        }
    }
    /// See [`Backend::attention_forward`]; `self` is `q`. Returns `(o, lse)`.
    pub fn attention_forward(
        &self,
        k: &Storage,
        v: &Storage,
        dims: AttentionDims,
    ) -> Result<(Storage, Storage)> {
        let (ok, ov) = (
            same_dev!(self, k, "causal_attention"),
            same_dev!(self, v, "causal_attention"),
        );
        match self {
            Storage::Cpu(q) => {
                let (o, lse) = cpu::CpuBackend.attention_forward(q, ok.cpu(), ov.cpu(), dims)?;
                Ok((Storage::Cpu(o), Storage::Cpu(lse)))
            }
            Storage::Gpu(q) => {
                let (o, lse) =
                    gpu::GpuBackend::get()?.attention_forward(q, ok.gpu(), ov.gpu(), dims)?;
                Ok((Storage::Gpu(o), Storage::Gpu(lse)))
            }
        }
    }
    /// See [`Backend::attention_backward`]; `self` is `q`. Returns `(dq, dk, dv)`.
    pub fn attention_backward(
        &self,
        (k, v, o, lse, d_o): (&Storage, &Storage, &Storage, &Storage, &Storage),
        dims: AttentionDims,
    ) -> Result<(Storage, Storage, Storage)> {
        const WHAT: &str = "causal_attention backward";
        let (ok, ov, oo, ol, og) = (
            same_dev!(self, k, WHAT),
            same_dev!(self, v, WHAT),
            same_dev!(self, o, WHAT),
            same_dev!(self, lse, WHAT),
            same_dev!(self, d_o, WHAT),
        );
        match self {
            Storage::Cpu(q) => {
                let (dq, dk, dv) = cpu::CpuBackend.attention_backward(
                    q,
                    ok.cpu(),
                    ov.cpu(),
                    oo.cpu(),
                    ol.cpu(),
                    og.cpu(),
                    dims,
                )?;
                Ok((Storage::Cpu(dq), Storage::Cpu(dk), Storage::Cpu(dv)))
            }
            Storage::Gpu(q) => {
                let (dq, dk, dv) = gpu::GpuBackend::get()?.attention_backward(
                    q,
                    ok.gpu(),
                    ov.gpu(),
                    oo.gpu(),
                    ol.gpu(),
                    og.gpu(),
                    dims,
                )?;
                Ok((Storage::Gpu(dq), Storage::Gpu(dk), Storage::Gpu(dv)))
            }
        }
    }
    /// See [`Backend::layer_norm_forward`]; `self` is `x`. Returns `(y, mean, rstd)`.
    pub fn layer_norm_forward(
        &self,
        gamma: &Storage,
        beta: &Storage,
        dims: LayerNormDims,
    ) -> Result<(Storage, Storage, Storage)> {
        let (og, ob) = (
            same_dev!(self, gamma, "layer_norm"),
            same_dev!(self, beta, "layer_norm"),
        );
        match self {
            Storage::Cpu(x) => {
                let (y, m, r) = cpu::CpuBackend.layer_norm_forward(x, og.cpu(), ob.cpu(), dims)?;
                Ok((Storage::Cpu(y), Storage::Cpu(m), Storage::Cpu(r)))
            }
            Storage::Gpu(x) => {
                let (y, m, r) =
                    gpu::GpuBackend::get()?.layer_norm_forward(x, og.gpu(), ob.gpu(), dims)?;
                Ok((Storage::Gpu(y), Storage::Gpu(m), Storage::Gpu(r)))
            }
        }
    }
    /// See [`Backend::layer_norm_backward`]; `self` is the upstream gradient. Returns
    /// `(dx, dgamma, dbeta)`.
    pub fn layer_norm_backward(
        &self,
        (x, gamma, mean, rstd): (&Storage, &Storage, &Storage, &Storage),
        dims: LayerNormDims,
    ) -> Result<(Storage, Storage, Storage)> {
        const WHAT: &str = "layer_norm backward";
        let (ox, og, om, or) = (
            same_dev!(self, x, WHAT),
            same_dev!(self, gamma, WHAT),
            same_dev!(self, mean, WHAT),
            same_dev!(self, rstd, WHAT),
        );
        match self {
            Storage::Cpu(g) => {
                let (dx, dg, db) = cpu::CpuBackend.layer_norm_backward(
                    g,
                    ox.cpu(),
                    og.cpu(),
                    (om.cpu(), or.cpu()),
                    dims,
                )?;
                Ok((Storage::Cpu(dx), Storage::Cpu(dg), Storage::Cpu(db)))
            }
            Storage::Gpu(g) => {
                let (dx, dg, db) = gpu::GpuBackend::get()?.layer_norm_backward(
                    g,
                    ox.gpu(),
                    og.gpu(),
                    (om.gpu(), or.gpu()),
                    dims,
                )?;
                Ok((Storage::Gpu(dx), Storage::Gpu(dg), Storage::Gpu(db)))
            }
        }
    }
    /// See [`Backend::cross_entropy_forward`]; `self` is the logits. Returns `(loss, lse)`.
    pub fn cross_entropy_forward(
        &self,
        targets: &Storage,
        classes: usize,
    ) -> Result<(Storage, Storage)> {
        let ot = same_dev!(self, targets, "cross_entropy");
        match self {
            Storage::Cpu(x) => {
                let (l, s) = cpu::CpuBackend.cross_entropy_forward(x, ot.cpu(), classes)?;
                Ok((Storage::Cpu(l), Storage::Cpu(s)))
            }
            Storage::Gpu(x) => {
                let (l, s) = gpu::GpuBackend::get()?.cross_entropy_forward(x, ot.gpu(), classes)?;
                Ok((Storage::Gpu(l), Storage::Gpu(s)))
            }
        }
    }
    /// See [`Backend::cross_entropy_backward`]; `self` is the upstream gradient `[rows]`.
    pub fn cross_entropy_backward(
        &self,
        logits: &Storage,
        targets: &Storage,
        lse: &Storage,
    ) -> Result<Storage> {
        const WHAT: &str = "cross_entropy backward";
        let (ox, ot, ol) = (
            same_dev!(self, logits, WHAT),
            same_dev!(self, targets, WHAT),
            same_dev!(self, lse, WHAT),
        );
        match self {
            Storage::Cpu(g) => cpu::CpuBackend
                .cross_entropy_backward(g, ox.cpu(), ot.cpu(), ol.cpu())
                .map(Storage::Cpu),
            Storage::Gpu(g) => gpu::GpuBackend::get()?
                .cross_entropy_backward(g, ox.gpu(), ot.gpu(), ol.gpu())
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
                let (p, i, w) = cpu::CpuBackend.topk_gate(
                    l,
                    os.as_ref().map(|o| o.cpu()),
                    rows,
                    n,
                    k,
                    renormalise,
                )?;
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
            Storage::Cpu(w) => cpu::CpuBackend
                .topk_gate_backward(
                    w,
                    oi.cpu(),
                    od.cpu(),
                    op.as_ref().map(|o| o.cpu()),
                    rows,
                    n,
                    k,
                )
                .map(Storage::Cpu),
            Storage::Gpu(w) => gpu::GpuBackend::get()?
                .topk_gate_backward(
                    w,
                    oi.gpu(),
                    od.gpu(),
                    op.as_ref().map(|o| o.gpu()),
                    rows,
                    n,
                    k,
                )
                .map(Storage::Gpu),
        }
    }
    /// See [`Backend::softmax_backward`]; `self` is the softmax output `y` `[rows, n]`.
    pub fn softmax_backward(&self, dy: &Storage, rows: usize, n: usize) -> Result<Storage> {
        let od = same_dev!(self, dy, "softmax backward");
        match self {
            Storage::Cpu(y) => cpu::CpuBackend
                .softmax_backward(y, od.cpu(), rows, n)
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
                cpu::CpuBackend.dispatch_plan(
                    t,
                    oe.cpu(),
                    ow.cpu(),
                    or.cpu(),
                    ov.cpu(),
                    experts,
                    capacity,
                )?,
                Storage::Cpu,
            )),
            Storage::Gpu(t) => Ok(wrap(
                gpu::GpuBackend::get()?.dispatch_plan(
                    t,
                    oe.gpu(),
                    ow.gpu(),
                    or.gpu(),
                    ov.gpu(),
                    experts,
                    capacity,
                )?,
                Storage::Gpu,
            )),
        }
    }

    /// See [`Backend::conv2d_forward`]; `self` is the input `x`.
    pub fn conv2d_forward(
        &self,
        w: &Storage,
        image_bank: Option<&Storage>,
        dims: Conv2dDims,
    ) -> Result<Storage> {
        const WHAT: &str = "conv2d";
        match self {
            Storage::Cpu(x) => {
                let bank = image_bank.map(|b| as_cpu(b, WHAT)).transpose()?;
                cpu::CpuBackend
                    .conv2d_forward(x, as_cpu(w, WHAT)?, bank, dims)
                    .map(Storage::Cpu)
            }
            Storage::Gpu(x) => {
                let bank = image_bank.map(|b| as_gpu(b, WHAT)).transpose()?;
                gpu::GpuBackend::get()?
                    .conv2d_forward(x, as_gpu(w, WHAT)?, bank, dims)
                    .map(Storage::Gpu)
            }
        }
    }
    /// See [`Backend::conv2d_input_grad`]; `self` is the output gradient `dy`.
    pub fn conv2d_input_grad(
        &self,
        w: &Storage,
        image_bank: Option<&Storage>,
        dims: Conv2dDims,
    ) -> Result<Storage> {
        const WHAT: &str = "conv2d backward";
        match self {
            Storage::Cpu(dy) => {
                let bank = image_bank.map(|b| as_cpu(b, WHAT)).transpose()?;
                cpu::CpuBackend
                    .conv2d_input_grad(dy, as_cpu(w, WHAT)?, bank, dims)
                    .map(Storage::Cpu)
            }
            Storage::Gpu(dy) => {
                let bank = image_bank.map(|b| as_gpu(b, WHAT)).transpose()?;
                gpu::GpuBackend::get()?
                    .conv2d_input_grad(dy, as_gpu(w, WHAT)?, bank, dims)
                    .map(Storage::Gpu)
            }
        }
    }
    /// See [`Backend::conv2d_weight_grad`]; `self` is the input `x`.
    pub fn conv2d_weight_grad(
        &self,
        dy: &Storage,
        image_bank: Option<&Storage>,
        dims: Conv2dDims,
    ) -> Result<Storage> {
        const WHAT: &str = "conv2d backward";
        match self {
            Storage::Cpu(x) => {
                let bank = image_bank.map(|b| as_cpu(b, WHAT)).transpose()?;
                cpu::CpuBackend
                    .conv2d_weight_grad(x, as_cpu(dy, WHAT)?, bank, dims)
                    .map(Storage::Cpu)
            }
            Storage::Gpu(x) => {
                let bank = image_bank.map(|b| as_gpu(b, WHAT)).transpose()?;
                gpu::GpuBackend::get()?
                    .conv2d_weight_grad(x, as_gpu(dy, WHAT)?, bank, dims)
                    .map(Storage::Gpu)
            }
        }
    }
    /// See [`Backend::pool2d_forward`]; returns `(y, argmax)` (argmax for max pooling only).
    pub fn pool2d_forward(
        &self,
        kind: PoolKind,
        dims: Pool2dDims,
    ) -> Result<(Storage, Option<Storage>)> {
        match self {
            Storage::Cpu(x) => {
                let (y, a) = cpu::CpuBackend.pool2d_forward(kind, x, dims)?;
                Ok((Storage::Cpu(y), a.map(Storage::Cpu)))
            }
            Storage::Gpu(x) => {
                let (y, a) = gpu::GpuBackend::get()?.pool2d_forward(kind, x, dims)?;
                Ok((Storage::Gpu(y), a.map(Storage::Gpu)))
            }
        }
    }
    /// See [`Backend::pool2d_backward`]; `self` is the output gradient `dy`.
    pub fn pool2d_backward(
        &self,
        kind: PoolKind,
        argmax: Option<&Storage>,
        dims: Pool2dDims,
    ) -> Result<Storage> {
        const WHAT: &str = "pool2d backward";
        match self {
            Storage::Cpu(dy) => {
                let arg = argmax.map(|a| as_cpu(a, WHAT)).transpose()?;
                cpu::CpuBackend
                    .pool2d_backward(kind, dy, arg, dims)
                    .map(Storage::Cpu)
            }
            Storage::Gpu(dy) => {
                let arg = argmax.map(|a| as_gpu(a, WHAT)).transpose()?;
                gpu::GpuBackend::get()?
                    .pool2d_backward(kind, dy, arg, dims)
                    .map(Storage::Gpu)
            }
        }
    }
}
