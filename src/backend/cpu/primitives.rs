//! The [`Backend`] implementation of [`CpuBackend`]: each primitive checks its operands, matches
//! on the buffer's dtype and calls the kernel of its family file (`elementwise.rs`,
//! `reduce.rs`, `matmul.rs`, `layout.rs`, `sort.rs`, `grouped_matmul.rs`, `optim.rs` and the
//! fused kernels `attention.rs`, `layer_norm.rs`, `cross_entropy.rs`, `routing.rs`,
//! `conv2d.rs`, `pool2d.rs`).

use super::elementwise::{binary_kernel, is_contiguous, strided_copy, unary_kernel, where_kernel};
use super::fast_math::{WideF32, gelu_backward_f32, map1_f32_wide};
use super::grouped_matmul::{WeightGradProblem, expert_routing, grouped_matmul_kernel};
use super::layout::{concat_kernel, gather_kernel, scatter_add_kernel};
use super::matmul::matmul_kernel;
use super::reduce::{argmax_kernel, cumsum_kernel, reduce_kernel};
use super::sort::argsort_kernel;
use super::{
    CpuBackend, CpuBuffer, attention, conv2d, copied, cross_entropy, f32b, f64b, filled, i32b,
    layer_norm, pool2d, routing, tabulate,
};
use crate::backend::AttentionGradOperands;
use crate::backend::checks::{
    binary_dtype_error, check_attention_lengths, check_cross_entropy, check_dispatch_sizes,
    check_grouped_bias, check_layer_norm_lengths, where_dtype_error,
};
use crate::backend::{
    AdamHyper, AttentionDims, AxisView, Backend, BinaryOp, Conv2dDims, ExpertBankDims,
    GroupedMatmulDims, HostData, LayerNormDims, MatLayout, MatmulDims, PlanBuffers, Pool2dDims,
    PoolKind, ReduceOp, ScatterDims, SgdHyper, Strided, UnaryOp, check_gate_backward_lengths,
    check_gate_sizes, check_lengths, uniform_hash,
};
use crate::{DType, Error, Result};

impl Backend for CpuBackend {
    type Buffer = CpuBuffer;

    fn upload(&self, data: &HostData) -> Result<CpuBuffer> {
        Ok(match data {
            HostData::F32(v) => f32b(copied(v)?),
            HostData::F64(v) => f64b(copied(v)?),
            HostData::I32(v) => i32b(copied(v)?),
        })
    }

    fn download(&self, x: &CpuBuffer) -> Result<HostData> {
        Ok(match x {
            CpuBuffer::F32(v) => HostData::F32(v.to_vec()),
            CpuBuffer::F64(v) => HostData::F64(v.to_vec()),
            CpuBuffer::I32(v) => HostData::I32(v.to_vec()),
        })
    }

    fn full(&self, len: usize, value: f64, dtype: DType) -> Result<CpuBuffer> {
        Ok(match dtype {
            DType::F32 => f32b(filled(len, value as f32)?),
            DType::F64 => f64b(filled(len, value)?),
            DType::I32 => i32b(filled(len, value as i32)?),
        })
    }

    fn cast(&self, x: &CpuBuffer, dtype: DType) -> Result<CpuBuffer> {
        let v = self.download(x)?.to_f64();
        Ok(match dtype {
            DType::F32 => f32b(v.iter().map(|&e| e as f32).collect()),
            DType::F64 => f64b(v),
            DType::I32 => i32b(v.iter().map(|&e| e as i32).collect()),
        })
    }

    fn unary(&self, op: UnaryOp, x: &CpuBuffer) -> Result<CpuBuffer> {
        match (op, x) {
            (UnaryOp::Exp, CpuBuffer::F32(v)) => return Ok(f32b(map1_f32_wide(v, WideF32::Exp))),
            (UnaryOp::Log, CpuBuffer::F32(v)) => return Ok(f32b(map1_f32_wide(v, WideF32::Ln))),
            (UnaryOp::Gelu, CpuBuffer::F32(v)) => return Ok(f32b(map1_f32_wide(v, WideF32::Gelu))),
            (UnaryOp::GeluGrad, CpuBuffer::F32(v)) => {
                return Ok(f32b(map1_f32_wide(v, WideF32::GeluGrad)));
            }
            _ => {}
        }
        float_map!(x, format!("{op:?}"), v => unary_kernel(op, v))
    }

    fn binary(
        &self,
        op: BinaryOp,
        a: &CpuBuffer,
        sa: &[usize],
        b: &CpuBuffer,
        sb: &[usize],
        shape: &[usize],
    ) -> Result<CpuBuffer> {
        let n: usize = shape.iter().product();
        let contiguous = |s: &[usize], len: usize| len == n && is_contiguous(shape, s);
        match (a, b) {
            (CpuBuffer::F32(a), CpuBuffer::F32(b))
                if op == BinaryOp::GeluBackward
                    && contiguous(sa, a.len())
                    && contiguous(sb, b.len()) =>
            {
                Ok(f32b(gelu_backward_f32(a, b)))
            }
            (CpuBuffer::F32(a), CpuBuffer::F32(b)) => {
                Ok(f32b(binary_kernel(op, a, sa, b, sb, shape)))
            }
            (CpuBuffer::F64(a), CpuBuffer::F64(b)) => {
                Ok(f64b(binary_kernel(op, a, sa, b, sb, shape)))
            }
            _ => Err(binary_dtype_error(&format!("{op:?}"), a.dtype(), b.dtype())),
        }
    }

    fn where_cond(
        &self,
        cond: Strided<'_, CpuBuffer>,
        a: Strided<'_, CpuBuffer>,
        b: Strided<'_, CpuBuffer>,
        shape: &[usize],
    ) -> Result<CpuBuffer> {
        let (sc, sa, sb) = (cond.strides, a.strides, b.strides);
        match (cond.buf, a.buf, b.buf) {
            (CpuBuffer::F32(c), CpuBuffer::F32(a), CpuBuffer::F32(b)) => {
                Ok(f32b(where_kernel(c, sc, a, sa, b, sb, shape)))
            }
            (CpuBuffer::F64(c), CpuBuffer::F64(a), CpuBuffer::F64(b)) => {
                Ok(f64b(where_kernel(c, sc, a, sa, b, sb, shape)))
            }
            _ => Err(where_dtype_error(
                cond.buf.dtype(),
                a.buf.dtype(),
                b.buf.dtype(),
            )),
        }
    }

    fn reduce(&self, op: ReduceOp, x: &CpuBuffer, view: AxisView) -> Result<CpuBuffer> {
        if op == ReduceOp::ArgMax {
            return match x {
                CpuBuffer::F32(v) => Ok(i32b(argmax_kernel(v, view))),
                CpuBuffer::F64(v) => Ok(i32b(argmax_kernel(v, view))),
                CpuBuffer::I32(_) => {
                    Err(Error::DType("argmax needs a float tensor, got i32".into()))
                }
            };
        }
        float_map!(x, format!("{op:?}"), v => reduce_kernel(op, v, view))
    }

    fn matmul(
        &self,
        a: &CpuBuffer,
        la: MatLayout,
        b: &CpuBuffer,
        lb: MatLayout,
        d: MatmulDims,
    ) -> Result<CpuBuffer> {
        match (a, b) {
            (CpuBuffer::F32(a), CpuBuffer::F32(b)) => Ok(f32b(matmul_kernel(a, la, b, lb, d))),
            (CpuBuffer::F64(a), CpuBuffer::F64(b)) => Ok(f64b(matmul_kernel(a, la, b, lb, d))),
            _ => Err(binary_dtype_error("matmul", a.dtype(), b.dtype())),
        }
    }

    fn copy_strided(
        &self,
        x: &CpuBuffer,
        shape: &[usize],
        strides: &[usize],
        offset: usize,
    ) -> Result<CpuBuffer> {
        if shape.iter().product::<usize>() == 0 {
            return Ok(any_map!(x, _v => Vec::new()));
        }
        Ok(any_map!(x, v => strided_copy(&v[offset.min(v.len())..], shape, strides)))
    }

    fn concat(
        &self,
        parts: &[&CpuBuffer],
        lens: &[usize],
        outer: usize,
        inner: usize,
    ) -> Result<CpuBuffer> {
        let dtype = crate::backend::checks::check_concat_dtypes(parts)?;
        macro_rules! join {
            ($variant:ident, $wrap:ident) => {{
                let slices: Vec<&[_]> = parts
                    .iter()
                    .map(|p| match p {
                        CpuBuffer::$variant(v) => v.as_slice(),
                        _ => unreachable!("dtype checked above"),
                    })
                    .collect();
                $wrap(concat_kernel(&slices, lens, outer, inner))
            }};
        }
        Ok(match dtype {
            DType::F32 => join!(F32, f32b),
            DType::F64 => join!(F64, f64b),
            DType::I32 => join!(I32, i32b),
        })
    }

    fn gather(
        &self,
        x: &CpuBuffer,
        view: AxisView,
        idx: &CpuBuffer,
        s: [usize; 3],
        m: usize,
    ) -> Result<CpuBuffer> {
        let idx = idx.indices("gather")?;
        Ok(match x {
            CpuBuffer::F32(v) => f32b(gather_kernel(v, view, idx, s, m)?),
            CpuBuffer::F64(v) => f64b(gather_kernel(v, view, idx, s, m)?),
            CpuBuffer::I32(v) => i32b(gather_kernel(v, view, idx, s, m)?),
        })
    }

    fn scatter_add(
        &self,
        src: &CpuBuffer,
        idx: &CpuBuffer,
        s: [usize; 3],
        dims: ScatterDims,
    ) -> Result<CpuBuffer> {
        let ScatterDims {
            outer,
            m,
            inner,
            len,
        } = dims;
        let idx = idx.indices("scatter_add")?;
        match src {
            CpuBuffer::F32(v) => Ok(f32b(scatter_add_kernel(v, idx, s, outer, m, inner, len)?)),
            CpuBuffer::F64(v) => Ok(f64b(scatter_add_kernel(v, idx, s, outer, m, inner, len)?)),
            CpuBuffer::I32(_) => Err(Error::DType(
                "scatter_add needs a float source, got i32".into(),
            )),
        }
    }

    fn cumsum(&self, x: &CpuBuffer, view: AxisView, reverse: bool) -> Result<CpuBuffer> {
        float_map!(x, "cumsum", v => cumsum_kernel(v, view, reverse))
    }

    fn argsort(
        &self,
        x: &CpuBuffer,
        rows: usize,
        len: usize,
        descending: bool,
    ) -> Result<CpuBuffer> {
        match x {
            CpuBuffer::F32(v) => Ok(i32b(argsort_kernel(v, rows, len, len, descending))),
            CpuBuffer::F64(v) => Ok(i32b(argsort_kernel(v, rows, len, len, descending))),
            CpuBuffer::I32(_) => Err(Error::DType("argsort needs a float tensor, got i32".into())),
        }
    }

    fn argsort_top(
        &self,
        x: &CpuBuffer,
        rows: usize,
        len: usize,
        k: usize,
        descending: bool,
    ) -> Result<CpuBuffer> {
        if k > len {
            return Err(Error::Shape(format!(
                "argsort_top: k = {k} exceeds the row length {len}"
            )));
        }
        match x {
            CpuBuffer::F32(v) => Ok(i32b(argsort_kernel(v, rows, len, k, descending))),
            CpuBuffer::F64(v) => Ok(i32b(argsort_kernel(v, rows, len, k, descending))),
            CpuBuffer::I32(_) => Err(Error::DType("argsort needs a float tensor, got i32".into())),
        }
    }

    fn grouped_matmul(
        &self,
        x: &CpuBuffer,
        w: &CpuBuffer,
        bias: Option<&CpuBuffer>,
        row_expert: &CpuBuffer,
        dims: GroupedMatmulDims,
    ) -> Result<CpuBuffer> {
        const WHAT: &str = "grouped_matmul";
        let re = row_expert.indices(WHAT)?;
        check_grouped_bias(WHAT, bias, dims)?;
        match (x, w, bias) {
            (CpuBuffer::F32(x), CpuBuffer::F32(w), None) => {
                Ok(f32b(grouped_matmul_kernel(x, w, None, re, dims)))
            }
            (CpuBuffer::F32(x), CpuBuffer::F32(w), Some(CpuBuffer::F32(b))) => {
                Ok(f32b(grouped_matmul_kernel(x, w, Some(b), re, dims)))
            }
            (CpuBuffer::F64(x), CpuBuffer::F64(w), None) => {
                Ok(f64b(grouped_matmul_kernel(x, w, None, re, dims)))
            }
            (CpuBuffer::F64(x), CpuBuffer::F64(w), Some(CpuBuffer::F64(b))) => {
                Ok(f64b(grouped_matmul_kernel(x, w, Some(b), re, dims)))
            }
            _ => Err(Error::DType(format!(
                "{WHAT} needs float buffers of one dtype, got x {}, w {}{}",
                x.dtype(),
                w.dtype(),
                bias.map(|b| format!(", bias {}", b.dtype()))
                    .unwrap_or_default()
            ))),
        }
    }

    fn grouped_weight_grad(
        &self,
        x: &CpuBuffer,
        dy: &CpuBuffer,
        row_expert: &CpuBuffer,
        offsets: &CpuBuffer,
        bank: ExpertBankDims,
    ) -> Result<CpuBuffer> {
        let ExpertBankDims { k, m, experts } = bank;
        let routing = expert_routing(row_expert, offsets, experts, "grouped_weight_grad")?;
        match (x, dy) {
            (CpuBuffer::F32(x), CpuBuffer::F32(dy)) => Ok(f32b(
                WeightGradProblem::new(x, dy, routing, (k, m, experts)).all(),
            )),
            (CpuBuffer::F64(x), CpuBuffer::F64(dy)) => Ok(f64b(
                WeightGradProblem::new(x, dy, routing, (k, m, experts)).all(),
            )),
            _ => Err(Error::DType(
                "grouped_weight_grad needs two float buffers of one dtype".into(),
            )),
        }
    }

    fn random_uniform(&self, len: usize, seed: u64, dtype: DType) -> Result<CpuBuffer> {
        let v: Vec<f32> = tabulate(len, |i| uniform_hash(seed, i as u32));
        self.cast(&f32b(v), dtype)
    }

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

    fn attention_forward(
        &self,
        q: &CpuBuffer,
        k: &CpuBuffer,
        v: &CpuBuffer,
        dims: AttentionDims,
    ) -> Result<(CpuBuffer, CpuBuffer)> {
        check_attention_lengths("attention_forward", &[("q", q), ("k", k), ("v", v)], dims)?;
        match (q, k, v) {
            (CpuBuffer::F32(q), CpuBuffer::F32(k), CpuBuffer::F32(v)) => {
                let (o, lse) = attention::forward(q, k, v, dims);
                Ok((f32b(o), f32b(lse)))
            }
            (CpuBuffer::F64(q), CpuBuffer::F64(k), CpuBuffer::F64(v)) => {
                let (o, lse) = attention::forward(q, k, v, dims);
                Ok((f64b(o), f64b(lse)))
            }
            _ => Err(Error::DType(format!(
                "attention_forward needs q, k, v float buffers of one dtype, got {}, {}, {}",
                q.dtype(),
                k.dtype(),
                v.dtype()
            ))),
        }
    }

    fn attention_backward(
        &self,
        operands: AttentionGradOperands<'_, CpuBuffer>,
        dims: AttentionDims,
    ) -> Result<(CpuBuffer, CpuBuffer, CpuBuffer)> {
        attention::backward_buffers(operands, dims)
    }

    fn layer_norm_forward(
        &self,
        x: &CpuBuffer,
        gamma: &CpuBuffer,
        beta: &CpuBuffer,
        dims: LayerNormDims,
    ) -> Result<(CpuBuffer, CpuBuffer, CpuBuffer)> {
        const WHAT: &str = "layer_norm_forward";
        check_layer_norm_lengths(
            WHAT,
            &[("x", x)],
            &[("gamma", gamma), ("beta", beta)],
            &[],
            dims,
        )?;
        match (x, gamma, beta) {
            (CpuBuffer::F32(x), CpuBuffer::F32(g), CpuBuffer::F32(b)) => {
                let (y, m, r) = layer_norm::forward(x, g, b, dims);
                Ok((f32b(y), f32b(m), f32b(r)))
            }
            (CpuBuffer::F64(x), CpuBuffer::F64(g), CpuBuffer::F64(b)) => {
                let (y, m, r) = layer_norm::forward(x, g, b, dims);
                Ok((f64b(y), f64b(m), f64b(r)))
            }
            _ => Err(Error::DType(format!(
                "{WHAT} needs float buffers of one dtype, got x {}, gamma {}, beta {}",
                x.dtype(),
                gamma.dtype(),
                beta.dtype()
            ))),
        }
    }

    fn layer_norm_backward(
        &self,
        g: &CpuBuffer,
        x: &CpuBuffer,
        gamma: &CpuBuffer,
        (mean, rstd): (&CpuBuffer, &CpuBuffer),
        dims: LayerNormDims,
    ) -> Result<(CpuBuffer, CpuBuffer, CpuBuffer)> {
        const WHAT: &str = "layer_norm_backward";
        check_layer_norm_lengths(
            WHAT,
            &[("g", g), ("x", x)],
            &[("gamma", gamma)],
            &[("mean", mean), ("rstd", rstd)],
            dims,
        )?;
        match (g, x, gamma, mean, rstd) {
            (
                CpuBuffer::F32(g),
                CpuBuffer::F32(x),
                CpuBuffer::F32(w),
                CpuBuffer::F32(m),
                CpuBuffer::F32(r),
            ) => {
                let (dx, dg, db) = layer_norm::backward(g, x, w, (m, r), dims);
                Ok((f32b(dx), f32b(dg), f32b(db)))
            }
            (
                CpuBuffer::F64(g),
                CpuBuffer::F64(x),
                CpuBuffer::F64(w),
                CpuBuffer::F64(m),
                CpuBuffer::F64(r),
            ) => {
                let (dx, dg, db) = layer_norm::backward(g, x, w, (m, r), dims);
                Ok((f64b(dx), f64b(dg), f64b(db)))
            }
            _ => Err(Error::DType(format!(
                "{WHAT} needs float buffers of one dtype, got g {}, x {}, gamma {}, mean {}, rstd {}",
                g.dtype(),
                x.dtype(),
                gamma.dtype(),
                mean.dtype(),
                rstd.dtype()
            ))),
        }
    }

    fn cross_entropy_forward(
        &self,
        logits: &CpuBuffer,
        targets: &CpuBuffer,
        classes: usize,
    ) -> Result<(CpuBuffer, CpuBuffer)> {
        const WHAT: &str = "cross_entropy";
        let t = check_cross_entropy(WHAT, logits, targets, classes)?;
        match logits {
            CpuBuffer::F32(x) => {
                let (l, s) = cross_entropy::forward(x, t, t.len(), classes);
                Ok((f32b(l), f32b(s)))
            }
            CpuBuffer::F64(x) => {
                let (l, s) = cross_entropy::forward(x, t, t.len(), classes);
                Ok((f64b(l), f64b(s)))
            }
            CpuBuffer::I32(_) => Err(Error::DType(format!(
                "{WHAT}: logits must be float, got i32"
            ))),
        }
    }

    fn cross_entropy_backward(
        &self,
        g: &CpuBuffer,
        logits: &CpuBuffer,
        targets: &CpuBuffer,
        lse: &CpuBuffer,
    ) -> Result<CpuBuffer> {
        const WHAT: &str = "cross_entropy backward";
        let classes = if targets.is_empty() {
            0
        } else {
            logits.len() / targets.len()
        };
        let t = check_cross_entropy(WHAT, logits, targets, classes)?;
        if g.len() != t.len() || lse.len() != t.len() {
            return Err(Error::Shape(format!(
                "{WHAT}: g and lse hold {} and {} values, expected one per row ({})",
                g.len(),
                lse.len(),
                t.len()
            )));
        }
        match (g, logits, lse) {
            (CpuBuffer::F32(g), CpuBuffer::F32(x), CpuBuffer::F32(l)) => {
                Ok(f32b(cross_entropy::backward(g, x, t, l, classes)))
            }
            (CpuBuffer::F64(g), CpuBuffer::F64(x), CpuBuffer::F64(l)) => {
                Ok(f64b(cross_entropy::backward(g, x, t, l, classes)))
            }
            _ => Err(Error::DType(format!(
                "{WHAT} needs float buffers of one dtype, got g {}, logits {}, lse {}",
                g.dtype(),
                logits.dtype(),
                lse.dtype()
            ))),
        }
    }

    fn topk_gate(
        &self,
        logits: &CpuBuffer,
        scores: Option<&CpuBuffer>,
        rows: usize,
        n: usize,
        k: usize,
        renormalise: bool,
    ) -> Result<(CpuBuffer, CpuBuffer, CpuBuffer)> {
        const WHAT: &str = "topk_gate";
        check_gate_sizes(WHAT, rows, n, k)?;
        let scores_buf = scores.unwrap_or(logits);
        check_lengths(
            WHAT,
            &[
                ("logits", logits.len(), rows * n),
                ("scores", scores_buf.len(), rows * n),
            ],
        )?;
        let dims = (rows, n, k);
        match (logits, scores_buf) {
            (CpuBuffer::F32(l), CpuBuffer::F32(s)) => {
                let s = scores.map(|_| s.as_slice());
                let (p, i, w) = routing::topk_gate(l, s, dims, renormalise);
                Ok((f32b(p), i32b(i), f32b(w)))
            }
            (CpuBuffer::F64(l), CpuBuffer::F64(s)) => {
                let s = scores.map(|_| s.as_slice());
                let (p, i, w) = routing::topk_gate(l, s, dims, renormalise);
                Ok((f64b(p), i32b(i), f64b(w)))
            }
            (l, s) => Err(Error::DType(format!(
                "{WHAT} needs float logits and scores of one dtype, got {} and {}",
                l.dtype(),
                s.dtype()
            ))),
        }
    }

    fn topk_gate_backward(
        &self,
        weights: &CpuBuffer,
        idx: &CpuBuffer,
        d_weights: &CpuBuffer,
        probs: Option<&CpuBuffer>,
        (rows, n, k): (usize, usize, usize),
    ) -> Result<CpuBuffer> {
        const WHAT: &str = "topk_gate backward";
        check_gate_sizes(WHAT, rows, n, k)?;
        let idx = idx.indices(WHAT)?;
        let p_buf = probs.unwrap_or(weights);
        check_gate_backward_lengths(
            WHAT,
            [weights.len(), idx.len(), d_weights.len(), p_buf.len()],
            probs.is_some(),
            (rows, n, k),
        )?;
        let dims = (rows, n, k);
        match (weights, d_weights, p_buf) {
            (CpuBuffer::F32(w), CpuBuffer::F32(a), CpuBuffer::F32(p)) => Ok(f32b(
                routing::topk_gate_backward(w, idx, a, probs.map(|_| p.as_slice()), dims),
            )),
            (CpuBuffer::F64(w), CpuBuffer::F64(a), CpuBuffer::F64(p)) => Ok(f64b(
                routing::topk_gate_backward(w, idx, a, probs.map(|_| p.as_slice()), dims),
            )),
            _ => Err(Error::DType(format!(
                "{WHAT} needs float weights, gradient and probabilities of one dtype, got {}, {}, {}",
                weights.dtype(),
                d_weights.dtype(),
                p_buf.dtype()
            ))),
        }
    }

    fn softmax_backward(
        &self,
        y: &CpuBuffer,
        dy: &CpuBuffer,
        rows: usize,
        n: usize,
    ) -> Result<CpuBuffer> {
        const WHAT: &str = "softmax backward";
        check_gate_sizes(WHAT, rows, n, 1)?;
        check_lengths(
            WHAT,
            &[("y", y.len(), rows * n), ("dy", dy.len(), rows * n)],
        )?;
        match (y, dy) {
            (CpuBuffer::F32(y), CpuBuffer::F32(g)) => Ok(f32b(routing::softmax_backward(y, g, n))),
            (CpuBuffer::F64(y), CpuBuffer::F64(g)) => Ok(f64b(routing::softmax_backward(y, g, n))),
            _ => Err(Error::DType(format!(
                "{WHAT} needs float y and dy of one dtype, got {} and {}",
                y.dtype(),
                dy.dtype()
            ))),
        }
    }

    fn dispatch_plan(
        &self,
        token: &CpuBuffer,
        expert: &CpuBuffer,
        (weight, rank, valid): (&CpuBuffer, &CpuBuffer, &CpuBuffer),
        experts: usize,
        capacity: Option<usize>,
    ) -> Result<PlanBuffers<CpuBuffer>> {
        const WHAT: &str = "dispatch_plan";
        let (token, expert) = (token.indices(WHAT)?, expert.indices(WHAT)?);
        let a = token.len();
        check_lengths(
            WHAT,
            &[
                ("expert", expert.len(), a),
                ("weight", weight.len(), a),
                ("rank", rank.len(), a),
                ("valid", valid.len(), a),
            ],
        )?;
        check_dispatch_sizes(WHAT, experts, a)?;
        match (weight, rank, valid) {
            (CpuBuffer::F32(w), CpuBuffer::F32(r), CpuBuffer::F32(v)) => Ok(
                routing::dispatch_plan(token, expert, (w, r, v), experts, capacity),
            ),
            (CpuBuffer::F64(w), CpuBuffer::F64(r), CpuBuffer::F64(v)) => Ok(
                routing::dispatch_plan(token, expert, (w, r, v), experts, capacity),
            ),
            _ => Err(Error::DType(format!(
                "{WHAT} needs float weight, rank and valid of one dtype, got {}, {}, {}",
                weight.dtype(),
                rank.dtype(),
                valid.dtype()
            ))),
        }
    }

    fn conv2d_forward(
        &self,
        x: &CpuBuffer,
        w: &CpuBuffer,
        image_bank: Option<&CpuBuffer>,
        dims: Conv2dDims,
    ) -> Result<CpuBuffer> {
        conv2d::forward(x, w, image_bank, dims)
    }

    fn conv2d_input_grad(
        &self,
        dy: &CpuBuffer,
        w: &CpuBuffer,
        image_bank: Option<&CpuBuffer>,
        dims: Conv2dDims,
    ) -> Result<CpuBuffer> {
        conv2d::input_grad(dy, w, image_bank, dims)
    }

    fn conv2d_weight_grad(
        &self,
        x: &CpuBuffer,
        dy: &CpuBuffer,
        image_bank: Option<&CpuBuffer>,
        dims: Conv2dDims,
    ) -> Result<CpuBuffer> {
        conv2d::weight_grad(x, dy, image_bank, dims)
    }

    fn pool2d_forward(
        &self,
        kind: PoolKind,
        x: &CpuBuffer,
        dims: Pool2dDims,
    ) -> Result<(CpuBuffer, Option<CpuBuffer>)> {
        pool2d::forward(kind, x, dims)
    }

    fn pool2d_backward(
        &self,
        kind: PoolKind,
        dy: &CpuBuffer,
        argmax: Option<&CpuBuffer>,
        dims: Pool2dDims,
    ) -> Result<CpuBuffer> {
        pool2d::backward(kind, dy, argmax, dims)
    }
}
