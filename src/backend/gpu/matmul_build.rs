//! [`MatmulBuild`]: which build of the matrix-product kernels (`shaders/matmul.wgsl` and
//! `shaders/matmul_wide.wgsl`) a product's operand and output dtypes call for.
//!
//! The kernels read three kinds of tensor through three type blocks in `matmul.wgsl`: the
//! element type (`matmul`'s A, the expert bank's rows), the weight type (`matmul`'s B, the
//! bank's weights and biases) and the output type (`matmul`'s C, the bank's weight gradient).
//! Each build makes some of them f16 (`src/backend/gpu/half.rs` rewrites the blocks); every
//! build sums in f32. Mixed precision needs all six: f16 activations meet f32 weights
//! without an f16 copy of the weights ([`MatmulBuild::F16Rows`]), and an f32 weight gets its
//! gradient from f16 activations and gradients in f32, with no f16 rounding on the way
//! ([`MatmulBuild::F16ToF32`]); a router, which computes in f32 (selective precision), reads
//! the f16 tokens where they are into f32 logits and gives its gate an f32 gradient from them
//! ([`MatmulBuild::F16Elements`]), and the tokens get their gradient stored in f16 straight
//! from the f32 product ([`MatmulBuild::F16Output`]): the bits of casting the tokens up and
//! the gradient down, without the two casts or the f32 copy of the tokens.

use super::half::{
    MATMUL_F16_ELEMENTS_SHADER, MATMUL_F16_OUTPUT_SHADER, MATMUL_F16_ROWS_SHADER,
    MATMUL_F16_SHADER, MATMUL_F16_TO_F32_SHADER, MATMUL_WIDE_F16_ELEMENTS_SHADER,
    MATMUL_WIDE_F16_OUTPUT_SHADER, MATMUL_WIDE_F16_ROWS_SHADER, MATMUL_WIDE_F16_SHADER,
    MATMUL_WIDE_F16_TO_F32_SHADER,
};
use super::kernels::Shader;
use super::matmul::{MATMUL_SHADER, MATMUL_WIDE_SHADER};
use super::{GpuBackend, GpuBuffer};
use crate::{DType, Error, Result};

/// The build of the matmul kernels for one product: `A·B → C` by dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum MatmulBuild {
    /// f32 · f32 → f32
    F32,
    /// f16 · f16 → f16
    F16,
    /// f16 · f32 → f16: f16 activations times f32 weights, read where they are
    F16Rows,
    /// f16 · f16 → f32: the gradient of an f32 weight from f16 tensors
    F16ToF32,
    /// f16 · f32 → f32: a router's f32 logits from f16 tokens, and its gate's gradient
    F16Elements,
    /// f32 · f32 → f16: the f16 tokens' gradient from a router's f32 logits' gradient
    F16Output,
}

impl MatmulBuild {
    /// The dtypes, as `A·B → C` reads them in a report: "f32", "f16", "f16·f32" or "f16→f32".
    pub(crate) fn name(self) -> &'static str {
        match self {
            MatmulBuild::F32 => "f32",
            MatmulBuild::F16 => "f16",
            MatmulBuild::F16Rows => "f16·f32",
            MatmulBuild::F16ToF32 => "f16→f32",
            MatmulBuild::F16Elements => "f16·f32→f32",
            MatmulBuild::F16Output => "f32→f16",
        }
    }

    /// The build for A of `a`, B of `b` and an output of `out`; an error naming the three for
    /// any other combination, and for an f16 one on an adapter without `SHADER_F16`.
    pub(crate) fn of(
        be: &GpuBackend,
        what: &str,
        a: &GpuBuffer,
        b: &GpuBuffer,
        out: DType,
    ) -> Result<MatmulBuild> {
        use DType::{F16, F32};
        let build = match (a.dtype(), b.dtype(), out) {
            (F32, F32, F32) => MatmulBuild::F32,
            (F16, F16, F16) => MatmulBuild::F16,
            (F16, F32, F16) => MatmulBuild::F16Rows,
            (F16, F16, F32) => MatmulBuild::F16ToF32,
            (F16, F32, F32) => MatmulBuild::F16Elements,
            (F32, F32, F16) => MatmulBuild::F16Output,
            (da, db, dc) => {
                return Err(Error::DType(format!(
                    "{what}: A is {da}, B is {db} and the output {dc}; the GPU computes f32·f32 \
                     → f32 or f16, f16·f16 → f16 or f32, and f16·f32 → f16 or f32 (cast the \
                     others with Tensor::to_dtype)"
                )));
            }
        };
        if build != MatmulBuild::F32 {
            be.check_f16(what)?;
        }
        Ok(build)
    }

    /// The build of the grouped weight gradient for rows `x` and gradients `dy` and an output
    /// of `out`: f32 from f32 ([`MatmulBuild::F32`]), f16 or f32 from f16 ([`MatmulBuild::F16`],
    /// [`MatmulBuild::F16ToF32`]); an error naming them otherwise.
    pub(crate) fn of_weight_grad(
        be: &GpuBackend,
        what: &str,
        x: &GpuBuffer,
        dy: &GpuBuffer,
        out: DType,
    ) -> Result<MatmulBuild> {
        match MatmulBuild::of(be, what, x, dy, out)? {
            MatmulBuild::F16Rows | MatmulBuild::F16Elements | MatmulBuild::F16Output => {
                Err(Error::DType(format!(
                    "{what}: x is {} and dy {}, into {out}; x and dy must both be f32 (into \
                     f32), or both f16 (into f16 or f32)",
                    x.dtype(),
                    dy.dtype()
                )))
            }
            build => Ok(build),
        }
    }

    /// The output's dtype.
    pub(crate) fn out(self) -> DType {
        match self {
            MatmulBuild::F32 | MatmulBuild::F16ToF32 | MatmulBuild::F16Elements => DType::F32,
            MatmulBuild::F16 | MatmulBuild::F16Rows | MatmulBuild::F16Output => DType::F16,
        }
    }

    /// `shaders/matmul.wgsl` in this build (entries `matmul`, `grouped_matmul`,
    /// `grouped_weight_grad`).
    pub(crate) fn plain(self) -> &'static Shader {
        match self {
            MatmulBuild::F32 => &MATMUL_SHADER,
            MatmulBuild::F16 => &MATMUL_F16_SHADER,
            MatmulBuild::F16Rows => &MATMUL_F16_ROWS_SHADER,
            MatmulBuild::F16ToF32 => &MATMUL_F16_TO_F32_SHADER,
            MatmulBuild::F16Elements => &MATMUL_F16_ELEMENTS_SHADER,
            MatmulBuild::F16Output => &MATMUL_F16_OUTPUT_SHADER,
        }
    }

    /// `shaders/matmul_wide.wgsl` in this build (entry `matmul_wide`).
    pub(crate) fn wide(self) -> &'static Shader {
        match self {
            MatmulBuild::F32 => &MATMUL_WIDE_SHADER,
            MatmulBuild::F16 => &MATMUL_WIDE_F16_SHADER,
            MatmulBuild::F16Rows => &MATMUL_WIDE_F16_ROWS_SHADER,
            MatmulBuild::F16ToF32 => &MATMUL_WIDE_F16_TO_F32_SHADER,
            MatmulBuild::F16Elements => &MATMUL_WIDE_F16_ELEMENTS_SHADER,
            MatmulBuild::F16Output => &MATMUL_WIDE_F16_OUTPUT_SHADER,
        }
    }
}
