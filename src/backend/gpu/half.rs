//! Half precision on the GPU: whether the adapter can store f16 ([`GpuBackend::check_f16`]),
//! the launchers of `shaders/half.wgsl` that convert between f32 and f16 buffers ([`to_f16`],
//! [`to_f32`]: the device end of `Tensor::to_dtype` to and from `DType::F16`), and the f16
//! builds of `shaders/matmul.wgsl` (all three entries: `matmul` and the expert bank's
//! `grouped_matmul` and `grouped_weight_grad`), `elementwise.wgsl`, `layout.wgsl` and
//! `reduce.wgsl` ([`MATMUL_F16_SHADER`], [`ELEMENTWISE_F16_SHADER`], [`LAYOUT_F16_SHADER`],
//! [`REDUCE_F16_SHADER`]; likewise the norms, SwiGLU, rotary, attention, cross-entropy, the
//! convolutions and pooling), made from the f32 builds' sources by [`f16_build`]; and the mixed
//! builds of the products, f16 tensors with f32 weights ([`f16_rows_build`]), f16 operands with
//! f32 outputs ([`f16_to_f32_build`]), f16 activations with f32 weights and outputs
//! ([`f16_elements_build`]) or f32 operands with an f16 output ([`f16_output_build`]: the last
//! two for a router computed in f32 from f16 tokens), which `matmul_build.rs` picks by dtype,
//! and of the MoE
//! combine, f16 rows with f32 weights ([`LAYOUT_F16_ROWS_SHADER`]), of the convolutions,
//! f16 images with f32 weights ([`CONV2D_F16_ROWS_SHADER`]), and of the rotary embedding, f16
//! heads with f32 tables ([`ROTARY_F16_SHADER`]).
//!
//! f16 is a storage format here: every f16 kernel computes in f32 and converts once on the way
//! in and once on the way out, with `f16_of` (`shaders/f16_convert.wgsl`), which rounds to a
//! neighbouring f16, gives ±inf past the largest finite one (65504) and keeps NaN. The shaders
//! start with `enable f16;`, so they are only compiled on adapters with wgpu's `SHADER_F16`;
//! elsewhere every f16 request is an error saying so.

use super::kernels::{Shader, grid_1d, u32_param};
use super::{GpuBackend, GpuBuffer};
use crate::{DType, Error, Result};
use std::sync::LazyLock;

/// WGSL's f16 extension and the shared conversion, the start of every f16 shader.
const F16_PRELUDE: &str = concat!(
    "enable f16;\n",
    include_str!("../../../shaders/f16_convert.wgsl")
);

/// The kernels of `shaders/half.wgsl` after [`F16_PRELUDE`].
pub(crate) static HALF_SHADER: LazyLock<Shader> = LazyLock::new(|| Shader {
    name: "half",
    builtin: true,
    source: String::leak(format!(
        "{F16_PRELUDE}\n{}",
        include_str!("../../../shaders/half.wgsl")
    )),
});

/// The marker lines around a shader's element block: the alias of its tensors' element type
/// (`alias X = f32;`, or `u32` for kernels that only move words) and, where the kernel
/// computes, the function that stores an f32 value as one (`return v;`). A shader may also have
/// a weight block (`shaders/matmul.wgsl`'s `mm_weight`), made f16 by [`f16_build`] and
/// [`f16_to_f32_build`] and left f32 by [`f16_rows_build`], and an output block (`mm_out`),
/// made f16 by [`f16_build`] and [`f16_rows_build`] and left f32 by [`f16_to_f32_build`].
const ELEMENT_BEGIN: &str = "// f16 build: element type\n";
const WEIGHT_BEGIN: &str = "// f16 build: weight type\n";
const OUTPUT_BEGIN: &str = "// f16 build: output type\n";
const BLOCK_END: &str = "// f16 build: end\n";

/// `source` with every block that starts with one of `begins` (and ends at [`BLOCK_END`])
/// rewritten for f16: each `alias X = …;` made `alias X = f16;` and each `return v;` made
/// `f16_of`-rounding.
fn rewrite_blocks(source: &str, begins: &[&str]) -> String {
    let mut out = String::with_capacity(source.len() + 64);
    let mut rest = source;
    loop {
        let next = begins
            .iter()
            .filter_map(|b| rest.find(b))
            .min()
            .and_then(|b| Some((b, b + rest[b..].find(BLOCK_END)?)));
        let Some((b, e)) = next else {
            out.push_str(rest);
            return out;
        };
        out.push_str(&rest[..b]);
        for line in rest[b..e].lines() {
            match line
                .strip_prefix("alias ")
                .and_then(|r| r.split_once(" = "))
            {
                // `alias X = f32;` (or `u32;` for word copies) becomes `alias X = f16;`
                Some((name, _)) => out.push_str(&format!("alias {name} = f16;\n")),
                None => out.push_str(&format!(
                    "{}\n",
                    line.replace("return v;", "return f16_of(v);")
                )),
            }
        }
        rest = &rest[e..];
    }
}

/// The f16 build of a shader whose float tensors are declared through an element block (see
/// `shaders/matmul.wgsl`): [`F16_PRELUDE`], then the source with the element (and weight)
/// blocks' aliases made `f16` and their stores made `f16_of`-rounding. Everything else (the
/// f32 arithmetic, the f32 loads through `f32(...)`) is the same text. A source without the
/// block comes back unchanged after the prelude, which the tests of every f16 kernel would
/// catch (its tensors would be read as f32).
fn f16_build(source: &str) -> String {
    format!(
        "{F16_PRELUDE}\n{}",
        rewrite_blocks(source, &[ELEMENT_BEGIN, WEIGHT_BEGIN, OUTPUT_BEGIN])
    )
}

/// [`f16_build`] without the weight block: f16 tensors, f32 weights.
fn f16_rows_build(source: &str) -> String {
    format!(
        "{F16_PRELUDE}\n{}",
        rewrite_blocks(source, &[ELEMENT_BEGIN, OUTPUT_BEGIN])
    )
}

/// [`f16_build`] without the output block: f16 operands, f32 outputs (a weight's gradient from
/// f16 activations and gradients, stored without rounding to f16 first).
fn f16_to_f32_build(source: &str) -> String {
    format!(
        "{F16_PRELUDE}\n{}",
        rewrite_blocks(source, &[ELEMENT_BEGIN, WEIGHT_BEGIN])
    )
}

/// [`f16_build`] with only the element block: f16 activations, f32 weights and f32 outputs (a
/// router's logits from f16 tokens and its f32 gate, and the gate's gradient from the tokens).
fn f16_elements_build(source: &str) -> String {
    format!(
        "{F16_PRELUDE}\n{}",
        rewrite_blocks(source, &[ELEMENT_BEGIN])
    )
}

/// [`f16_build`] with only the output block: f32 operands, an f16 output (the gradient of
/// f16 tokens from a router's f32 logits' gradient and its f32 gate).
fn f16_output_build(source: &str) -> String {
    format!("{F16_PRELUDE}\n{}", rewrite_blocks(source, &[OUTPUT_BEGIN]))
}

/// `shaders/matmul.wgsl` built with f16 operands and outputs for its three entries (`matmul`,
/// `grouped_matmul`, `grouped_weight_grad`), accumulating in f32 as the f32 build does.
pub(crate) static MATMUL_F16_SHADER: LazyLock<Shader> = LazyLock::new(|| Shader {
    name: "matmul_f16",
    builtin: true,
    source: String::leak(f16_build(super::matmul::MATMUL_SHADER.source)),
});

/// `matmul_wide` (with `matmul.wgsl` before it) built with f16 operands and output: the wide
/// 128×128 tiles for large f16 products, with the same f32 FMA chain as the f16 `matmul`, so
/// the same bits.
pub(crate) static MATMUL_WIDE_F16_SHADER: LazyLock<Shader> = LazyLock::new(|| Shader {
    name: "matmul_wide_f16",
    builtin: true,
    source: String::leak(f16_build(super::matmul::MATMUL_WIDE_SHADER.source)),
});

/// The layout kernels (`copy_strided`, `concat_part`, `gather`) built to move f16 values.
pub(crate) static LAYOUT_F16_SHADER: LazyLock<Shader> = LazyLock::new(|| Shader {
    name: "layout_f16",
    builtin: true,
    source: String::leak(f16_build(super::layout::LAYOUT.source)),
});

/// The layout kernels built as [`LAYOUT_F16_SHADER`] except the MoE combine's weights and their
/// gradient, left f32 (`f16_rows_build`): mixed precision's combine of f16 expert outputs with
/// the router's f32 gate weights, with no cast of the weights forward or of their gradient
/// backward.
pub(crate) static LAYOUT_F16_ROWS_SHADER: LazyLock<Shader> = LazyLock::new(|| Shader {
    name: "layout_f16_rows",
    builtin: true,
    source: String::leak(f16_rows_build(super::layout::LAYOUT.source)),
});

/// The reductions and cumulative sums built to read f16 tensors (and write f16 cumulative sums).
pub(crate) static REDUCE_F16_SHADER: LazyLock<Shader> = LazyLock::new(|| Shader {
    name: "reduce_f16",
    builtin: true,
    source: String::leak(f16_build(super::reduce::REDUCE.source)),
});

/// The elementwise kernels (with their generated op table) built for f16 tensors: `unary`,
/// `binary` and `where_cond` read and write f16 and compute in f32.
pub(crate) static ELEMENTWISE_F16_SHADER: LazyLock<Shader> = LazyLock::new(|| Shader {
    name: "elementwise_f16",
    builtin: true,
    source: String::leak(f16_build(super::elementwise::ELEMENTWISE.source)),
});

/// Layer norm and RMSNorm (forward, input and parameter gradients) built for f16 tensors, with
/// f32 sums and f32 per-row statistics.
pub(crate) static LAYER_NORM_F16_SHADER: LazyLock<Shader> = LazyLock::new(|| Shader {
    name: "layer_norm_f16",
    builtin: true,
    source: String::leak(f16_build(super::layer_norm::LAYER_NORM_SHADER.source)),
});

/// Layer norm and RMSNorm built for f16 rows with f32 parameters (`gamma`, `beta` read and
/// `dgamma`, `dbeta` written in f32): mixed precision's norms, whose parameters are never cast.
pub(crate) static LAYER_NORM_F16_ROWS_SHADER: LazyLock<Shader> = LazyLock::new(|| Shader {
    name: "layer_norm_f16_rows",
    builtin: true,
    source: String::leak(f16_rows_build(super::layer_norm::LAYER_NORM_SHADER.source)),
});

/// The fused SwiGLU (forward and backward) built for f16 tensors, computing in f32.
pub(crate) static SWIGLU_F16_SHADER: LazyLock<Shader> = LazyLock::new(|| Shader {
    name: "swiglu_f16",
    builtin: true,
    source: String::leak(f16_build(super::swiglu::SWIGLU_SHADER.source)),
});

/// The rotary position embedding built for f16 heads and gradients with the f32 tables read
/// where they are (mixed precision: the tables are never cast), computing in f32.
pub(crate) static ROTARY_F16_SHADER: LazyLock<Shader> = LazyLock::new(|| Shader {
    name: "rotary_f16",
    builtin: true,
    source: String::leak(f16_build(super::rotary::ROTARY_SHADER.source)),
});

/// `shaders/matmul.wgsl` with f16 rows and outputs and f32 weights: `matmul` with A f16, B f32
/// and C f16 (an activation times an f32 weight), `grouped_matmul` with f16 rows and outputs
/// and f32 expert weights and biases (mixed precision's expert banks); f32 sums.
pub(crate) static MATMUL_F16_ROWS_SHADER: LazyLock<Shader> = LazyLock::new(|| Shader {
    name: "matmul_f16_rows",
    builtin: true,
    source: String::leak(f16_rows_build(super::matmul::MATMUL_SHADER.source)),
});

/// `matmul_wide` built as [`MATMUL_F16_ROWS_SHADER`]: A f16, B f32, C f16.
pub(crate) static MATMUL_WIDE_F16_ROWS_SHADER: LazyLock<Shader> = LazyLock::new(|| Shader {
    name: "matmul_wide_f16_rows",
    builtin: true,
    source: String::leak(f16_rows_build(super::matmul::MATMUL_WIDE_SHADER.source)),
});

/// `shaders/matmul.wgsl` with f16 operands and f32 outputs: `matmul` with A and B f16 and C f32,
/// `grouped_weight_grad` with f16 rows and gradients and an f32 dW (the gradient of an f32
/// weight in mixed precision, summed and stored in f32); f32 sums.
pub(crate) static MATMUL_F16_TO_F32_SHADER: LazyLock<Shader> = LazyLock::new(|| Shader {
    name: "matmul_f16_to_f32",
    builtin: true,
    source: String::leak(f16_to_f32_build(super::matmul::MATMUL_SHADER.source)),
});

/// `matmul_wide` built as [`MATMUL_F16_TO_F32_SHADER`]: A and B f16, C f32.
pub(crate) static MATMUL_WIDE_F16_TO_F32_SHADER: LazyLock<Shader> = LazyLock::new(|| Shader {
    name: "matmul_wide_f16_to_f32",
    builtin: true,
    source: String::leak(f16_to_f32_build(super::matmul::MATMUL_WIDE_SHADER.source)),
});

/// `shaders/matmul.wgsl` with f16 A and f32 B and C: `matmul` reading f16 activations and an
/// f32 weight into an f32 product (a router's logits under mixed precision, computed in f32
/// from the f16 tokens where they are, without an f32 copy of them), and the weight's f32
/// gradient `xᵀ·dlogits` from the f16 tokens and the f32 gradient; f32 sums.
pub(crate) static MATMUL_F16_ELEMENTS_SHADER: LazyLock<Shader> = LazyLock::new(|| Shader {
    name: "matmul_f16_elements",
    builtin: true,
    source: String::leak(f16_elements_build(super::matmul::MATMUL_SHADER.source)),
});

/// `matmul_wide` built as [`MATMUL_F16_ELEMENTS_SHADER`]: A f16, B and C f32.
pub(crate) static MATMUL_WIDE_F16_ELEMENTS_SHADER: LazyLock<Shader> = LazyLock::new(|| Shader {
    name: "matmul_wide_f16_elements",
    builtin: true,
    source: String::leak(f16_elements_build(super::matmul::MATMUL_WIDE_SHADER.source)),
});

/// `shaders/matmul.wgsl` with f32 A and B and an f16 C: `matmul` of f32 operands stored in f16
/// once (the f16 tokens' gradient `dlogits·Wᵀ` of a router computed in f32), rounding the f32
/// sum once as a cast of the f32 product would; f32 sums.
pub(crate) static MATMUL_F16_OUTPUT_SHADER: LazyLock<Shader> = LazyLock::new(|| Shader {
    name: "matmul_f16_output",
    builtin: true,
    source: String::leak(f16_output_build(super::matmul::MATMUL_SHADER.source)),
});

/// `matmul_wide` built as [`MATMUL_F16_OUTPUT_SHADER`]: A and B f32, C f16.
pub(crate) static MATMUL_WIDE_F16_OUTPUT_SHADER: LazyLock<Shader> = LazyLock::new(|| Shader {
    name: "matmul_wide_f16_output",
    builtin: true,
    source: String::leak(f16_output_build(super::matmul::MATMUL_WIDE_SHADER.source)),
});

/// The softmax cross-entropy (`cross_entropy.wgsl`) reading f16 logits and writing their f16
/// gradient; the loss, the log-sum-exp and the arithmetic stay f32.
pub(crate) static CROSS_ENTROPY_F16_SHADER: LazyLock<Shader> = LazyLock::new(|| Shader {
    name: "cross_entropy_f16",
    builtin: true,
    source: String::leak(f16_build(super::cross_entropy::CROSS_ENTROPY_SHADER.source)),
});

/// Causal attention (`attention.wgsl`, forward and backward) built for f16 queries, keys,
/// values, outputs and gradients, computing in f32; the row log-sum-exp and `delta` stay f32.
pub(crate) static ATTENTION_F16_SHADER: LazyLock<Shader> = LazyLock::new(|| Shader {
    name: "attention_f16",
    builtin: true,
    source: String::leak(f16_build(super::attention::ATTENTION_SHADER.source)),
});

/// The convolutions (`conv2d.wgsl`: forward, input and weight gradients) built for f16 images,
/// weights and gradients, with f32 sums.
pub(crate) static CONV2D_F16_SHADER: LazyLock<Shader> = LazyLock::new(|| Shader {
    name: "conv2d_f16",
    builtin: true,
    source: String::leak(f16_build(super::conv2d::CONV2D_SHADER.source)),
});

/// The convolutions built for f16 images and gradients with f32 weights (`w` read and `dw`
/// written in f32): mixed precision's image models, whose weights are never cast.
pub(crate) static CONV2D_F16_ROWS_SHADER: LazyLock<Shader> = LazyLock::new(|| Shader {
    name: "conv2d_f16_rows",
    builtin: true,
    source: String::leak(f16_rows_build(super::conv2d::CONV2D_SHADER.source)),
});

/// Max and average pooling (`pool2d.wgsl`, forward and backward) built for f16 images and
/// gradients, comparing and summing in f32 (argmax stays i32).
pub(crate) static POOL2D_F16_SHADER: LazyLock<Shader> = LazyLock::new(|| Shader {
    name: "pool2d_f16",
    builtin: true,
    source: String::leak(f16_build(super::pool2d::POOL2D_SHADER.source)),
});

/// Invocations per workgroup of both kernels of `half.wgsl`.
const WG: u32 = 256;

impl GpuBackend {
    /// Whether the device was opened with wgpu's `SHADER_F16`, which f16 tensors need.
    pub(crate) fn has_f16(&self) -> bool {
        self.inner.ctx.features.contains(wgpu::Features::SHADER_F16)
    }

    /// An error naming the adapter unless it has `SHADER_F16`; `what` says what needed it.
    pub(crate) fn check_f16(&self, what: &str) -> Result<()> {
        if self.has_f16() {
            return Ok(());
        }
        Err(Error::DType(format!(
            "{what} needs half precision on the GPU, and this adapter ({}, {:?}) does not \
             offer wgpu's SHADER_F16 (`moegrad info` lists its features); keep it in f32",
            self.inner.ctx.adapter_info.name, self.inner.ctx.adapter_info.backend
        )))
    }
}

/// The error of an op given f16 operands that has no f16 kernel (yet): which op, and what to do.
pub(crate) fn no_f16_kernel(op: &str) -> Error {
    Error::DType(format!(
        "{op} has no f16 kernel: cast its f16 operands to f32 first (Tensor::to_dtype); f16 \
         kernels exist for the casts, matmul and the expert bank, the elementwise, layout and \
         reduction kernels, layer norm / RMSNorm, SwiGLU, the rotary embedding, \
         causal attention, the convolutions and pooling"
    ))
}

/// An error unless every buffer holds f32: for an f16 one, [`no_f16_kernel`] (the kernel has no
/// f16 build; say what to do), for another dtype one naming the buffer. The check of every
/// f32-only launcher.
pub(crate) fn expect_f32(what: &str, bufs: &[(&str, &GpuBuffer)]) -> Result<()> {
    match bufs.iter().find(|(_, b)| b.dtype() != DType::F32) {
        None => Ok(()),
        Some(_) if bufs.iter().any(|(_, b)| b.dtype() == DType::F16) => Err(no_f16_kernel(what)),
        Some((name, b)) => Err(Error::DType(format!(
            "{what}: {name} must be f32 on the GPU, got {}",
            b.dtype()
        ))),
    }
}

/// The dtype of a kernel's float operands: all f32, or all f16 (the f16 build of the same
/// kernel: f16 reads and writes, f32 sums); anything else is an error naming the operands.
pub(crate) fn float_operands(what: &str, operands: &[(&str, &GpuBuffer)]) -> Result<DType> {
    let dtype = operands.first().map_or(DType::F32, |(_, b)| b.dtype());
    if dtype == DType::F16 && operands.iter().all(|(_, b)| b.dtype() == DType::F16) {
        return Ok(DType::F16);
    }
    if let Some((name, b)) = operands.iter().find(|(_, b)| b.dtype() == DType::F16) {
        let names: Vec<String> = operands
            .iter()
            .map(|(n, b)| format!("{n} is {}", b.dtype()))
            .collect();
        return Err(Error::DType(format!(
            "{what}: {}: an f16 kernel needs every float operand in f16 ({name} is {}; cast the \
             others with Tensor::to_dtype)",
            names.join(", "),
            b.dtype()
        )));
    }
    expect_f32(what, operands)?;
    Ok(DType::F32)
}

/// One launch of `entry` from `x` into a new buffer of `dtype`.
fn convert(be: &GpuBackend, x: &GpuBuffer, entry: &str, dtype: DType) -> Result<GpuBuffer> {
    be.check_f16("a cast between f32 and f16")?;
    let out = be.alloc(x.len(), dtype)?;
    let n = u32_param(x.len(), "cast: length")?;
    be.launch(&HALF_SHADER, entry, &[x, &out], &[n], grid_1d(x.len(), WG)?)?;
    Ok(out)
}

/// An f32 buffer converted to f16 (entry `f32_to_f16`).
pub(crate) fn to_f16(be: &GpuBackend, x: &GpuBuffer) -> Result<GpuBuffer> {
    convert(be, x, "f32_to_f16", DType::F16)
}

/// An f16 buffer converted to f32, exactly (entry `f16_to_f32`).
pub(crate) fn to_f32(be: &GpuBackend, x: &GpuBuffer) -> Result<GpuBuffer> {
    convert(be, x, "f16_to_f32", DType::F32)
}
