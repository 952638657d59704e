//! [`MatmulKernel`]: the choice of kernel for the GPU's dense `matmul` (`matmul.rs` launches
//! it), made at start-up by `MOEGRAD_MATMUL` (by default `tuned` on a GPU, `auto` on a software
//! adapter) or at run time by `GpuBackend::set_matmul_kernel`.

use crate::{Error, Result};

/// Which kernel computes `matmul` on the GPU (f32 operands; f16 ones run the f16 build of
/// `matmul`, or of `matmul_wide` where `Auto`, `Tuned`, `Wide` or `WideVec4` choose the wide
/// kernel). The kernels compute each element as the same chain of FMAs, so they agree to the
/// bit; `Auto` and `Tuned` may also split a long f32 reduction (split-k, in the launcher), whose
/// partial sums are then added in a fixed order: deterministic, but not the same bits as one
/// chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum MatmulKernel {
    /// chosen per product: [`MatmulKernel::Wide`] when it has at least 64 output tiles of
    /// 128×128 (`WIDE_MIN_GROUPS` in the launcher), [`MatmulKernel::Plain`] otherwise, with its reduction split into
    /// ranges (split-k) when the product has few tiles and a long `k` (the default)
    Auto,
    /// `matmul`: 64×64 output tiles, A and B staged in workgroup memory (every adapter)
    Plain,
    /// `matmul_wide`: 128×128 output tiles, 8×8 per invocation (every adapter)
    Wide,
    /// `matmul_subgroup`: B staged, A shared through subgroup shuffles (adapters with subgroups
    /// of 4 to 128 invocations)
    Subgroup,
    /// `matmul_wide4`: `matmul_wide` with vec4 reads and writes, for operands whose contiguous
    /// axes are multiples of 4 (n too), and `matmul_wide` for the others (every adapter; not
    /// yet measured on a real GPU, so not `Auto`'s choice)
    WideVec4,
    /// `Auto`, except that where `Auto` runs the wide kernel the tile kernel is the fastest of
    /// `plain`, `wide`, `wide-vec4` and `subgroup` (those the operands and adapter allow),
    /// timed on this adapter the first time a product of that size class runs
    /// (`matmul_tune.rs`). The same bits as `Auto`, whichever wins. The default on a GPU; a
    /// software adapter (lavapipe) keeps `Auto`, where timing would cost seconds and measure a
    /// CPU.
    Tuned,
}

impl MatmulKernel {
    /// Every choice, in the order `MOEGRAD_MATMUL` lists them.
    pub const ALL: [MatmulKernel; 6] = [
        MatmulKernel::Auto,
        MatmulKernel::Plain,
        MatmulKernel::Wide,
        MatmulKernel::Subgroup,
        MatmulKernel::WideVec4,
        MatmulKernel::Tuned,
    ];

    /// Parses `auto`, `plain`, `wide`, `subgroup`, `wide-vec4` or `tuned` (`MOEGRAD_MATMUL`).
    pub fn from_name(name: &str) -> Result<MatmulKernel> {
        let name = name.trim();
        Self::ALL
            .into_iter()
            .find(|k| k.name() == name)
            .ok_or_else(|| {
                Error::Invalid(format!(
                    "MOEGRAD_MATMUL={name:?} is not auto, plain, wide, subgroup, wide-vec4 or tuned"
                ))
            })
    }

    /// The name, as `MOEGRAD_MATMUL` spells it.
    pub fn name(self) -> &'static str {
        match self {
            MatmulKernel::Auto => "auto",
            MatmulKernel::Plain => "plain",
            MatmulKernel::Wide => "wide",
            MatmulKernel::Subgroup => "subgroup",
            MatmulKernel::WideVec4 => "wide-vec4",
            MatmulKernel::Tuned => "tuned",
        }
    }
}
