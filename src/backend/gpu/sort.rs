//! Launcher of `shaders/sort.wgsl`: [`argsort`], a stable per-row argsort of any length, and
//! [`sort_key_words`], the same sort on keys of [`KEY_WORDS`] u32 words (the MoE dispatch plan's
//! expert, rank and weight, sorted in one pass rather than three).
//!
//! Rows are padded to a power of two `p` and sorted as (key, index) pairs by a bitonic network:
//! `sort_local` sorts blocks of up to 2048 pairs (1024 of three-word keys) in workgroup memory,
//! then each larger stage `k` runs `sort_global_step` for the distances `j` of a block or more
//! and `sort_local` for the rest. The first launch reads the input and the last writes the
//! output, so a row of up to 2048 elements takes one launch, 8192 take 6 (three-word keys: 10)
//! and 65536 take 21.

use super::kernels::{Shader, grid_1d, u32_param};
use super::{GpuBackend, GpuBuffer};
use crate::{DType, Error, Result};
use std::sync::LazyLock;

/// The kernels of `shaders/sort.wgsl`.
pub(crate) static SORT: Shader = Shader {
    name: "sort",
    builtin: true,
    source: include_str!("../../../shaders/sort.wgsl"),
};

/// u32 words per key of [`SORT_WORDS`].
pub(crate) const KEY_WORDS: usize = 3;

/// The words build of `shaders/sort.wgsl`: the same kernels on keys of [`KEY_WORDS`] u32 words
/// (the file's `KEY_WORDS` line replaced).
pub(crate) static SORT_WORDS: LazyLock<Shader> = LazyLock::new(|| {
    const LINE: &str = "const KEY_WORDS: u32 = 1u;";
    assert!(SORT.source.contains(LINE), "sort.wgsl declares {LINE}");
    Shader {
        name: "sort_words",
        builtin: true,
        source: String::leak(
            SORT.source
                .replace(LINE, &format!("const KEY_WORDS: u32 = {KEY_WORDS}u;")),
        ),
    }
});

/// How the first `sort_local` launch reads a key word (the shader's `kind`).
#[derive(Clone, Copy)]
enum WordKind {
    F32 = 0,
    I32 = 1,
    U32 = 2,
}

/// Invocations per workgroup of every kernel in the file.
const WG: u32 = 256;
/// The u32 words of keys and indices `sort_local` holds in workgroup memory: a block is
/// `BLOCK_WORDS / (key words + 1)` elements, 2048 of one-word keys (`BLOCK_MAX` in the shader).
const BLOCK_WORDS: usize = 4096;
/// `LocalParams.flags`: the launch reads its block from the input (the first launch)...
const FROM_INPUT: u32 = 1;
/// ... or writes it to the output (the last).
const TO_OUTPUT: u32 = 2;

/// `ReduceOps::argsort`: per row of `x` viewed as `[rows, len]`, the indices that sort it, stable,
/// NaN as the smallest value (as on the CPU). Output I32 `[rows, len]`.
pub(crate) fn argsort(
    be: &GpuBackend,
    x: &GpuBuffer,
    rows: usize,
    len: usize,
    descending: bool,
) -> Result<GpuBuffer> {
    super::half::expect_f32("argsort", &[("x", x)])?;
    sort_rows(be, x, rows, len, descending)
}

/// The stable ascending order of each row of `words` viewed as `[rows, len, KEY_WORDS]`: keys
/// of [`KEY_WORDS`] u32 words (I32 buffer, bits taken as unsigned) compared in order, ties in
/// index order. Output I32 `[rows, len]`.
pub(crate) fn sort_key_words(
    be: &GpuBackend,
    words: &GpuBuffer,
    rows: usize,
    len: usize,
) -> Result<GpuBuffer> {
    if words.dtype() != DType::I32 {
        return Err(Error::DType(format!(
            "sort by key words: the words must be an i32 buffer, got {}",
            words.dtype()
        )));
    }
    bitonic(
        be,
        &SORT_WORDS,
        words,
        (rows, len, KEY_WORDS),
        WordKind::U32,
        false,
    )
}

/// Stable argsort of each row of an f32 or i32 buffer `[rows, len]` (i32 keys compare as
/// integers; scatter_add sorts its indices with this).
pub(crate) fn sort_rows(
    be: &GpuBackend,
    x: &GpuBuffer,
    rows: usize,
    len: usize,
    descending: bool,
) -> Result<GpuBuffer> {
    let kind = match x.dtype() {
        DType::I32 => WordKind::I32,
        _ => WordKind::F32,
    };
    bitonic(be, &SORT, x, (rows, len, 1), kind, descending)
}

/// The bitonic sort of `shader` (`SORT`, or `SORT_WORDS` with `words` = [`KEY_WORDS`]) over
/// `x` viewed as `[rows, len, words]`.
fn bitonic(
    be: &GpuBackend,
    shader: &Shader,
    x: &GpuBuffer,
    (rows, len, words): (usize, usize, usize),
    kind: WordKind,
    descending: bool,
) -> Result<GpuBuffer> {
    if rows.checked_mul(len).and_then(|e| e.checked_mul(words)) != Some(x.len()) {
        let shape = match words {
            1 => format!("[{rows}, {len}]"),
            w => format!("[{rows}, {len}] keys of {w} words"),
        };
        return Err(Error::Shape(format!(
            "argsort: {shape} does not match a buffer of {} elements",
            x.len()
        )));
    }
    let out = be.alloc(rows * len, DType::I32)?;
    if x.is_empty() {
        return Ok(out);
    }
    let p = len.next_power_of_two();
    let padded = rows.saturating_mul(p);
    let block_max = BLOCK_WORDS / (words + 1);
    let block = p.min(block_max);
    u32_param(
        padded.saturating_mul(words),
        "argsort: rows × padded length × key words",
    )?;
    let (rows32, p32) = (
        u32_param(rows, "argsort: rows")?,
        u32_param(p, "argsort: padded row length")?,
    );
    let local = |k_fixed: usize, flags: u32| {
        [
            rows32,
            len as u32, // ≤ p
            p32,
            block as u32,
            k_fixed as u32,
            kind as u32,
            descending as u32,
            flags,
        ]
    };
    // the scratch, which a row of one block never touches (it is bound all the same)
    let one_block = p <= block_max;
    let scratch = |n: usize| be.alloc(if one_block { 1 } else { n }, DType::I32);
    let (keys, vals) = (scratch(padded * words)?, scratch(padded)?);
    let local_groups = grid_1d(rows * (p / block) * WG as usize, WG)?;
    let last = |k: usize| if k == p { TO_OUTPUT } else { 0 };
    be.launch(
        shader,
        "sort_local",
        &[x, &keys, &vals, &out],
        &local(0, FROM_INPUT | last(block)),
        local_groups,
    )?;
    let mut k = 2 * block;
    while k <= p {
        let mut j = k / 2;
        while j >= block {
            be.launch(
                shader,
                "sort_global_step",
                // binding 1 (x) is unread by this entry
                &[x, &keys, &vals],
                &[rows32, p32, k as u32, j as u32],
                grid_1d(padded / 2, WG)?,
            )?;
            j /= 2;
        }
        be.launch(
            shader,
            "sort_local",
            &[x, &keys, &vals, &out],
            &local(k, last(k)),
            local_groups,
        )?;
        k *= 2;
    }
    Ok(out)
}
