//! Launcher of `shaders/sort.wgsl`: [`argsort`], a stable per-row argsort of any length.
//!
//! Rows are padded to a power of two `p` and sorted as (key, index) pairs by a bitonic network:
//! `sort_local` sorts blocks of up to 1024 pairs in workgroup memory, then each larger stage `k`
//! runs `sort_global_step` for the distances `j ≥ 1024` and `sort_local` for the rest. A row of
//! `len ≤ 1024` therefore takes one sorting launch; `len = 65536` takes 27.

use super::kernels::{Shader, grid_1d, u32_param};
use super::{GpuBackend, GpuBuffer};
use crate::{DType, Error, Result};

/// The kernels of `shaders/sort.wgsl`.
pub(crate) static SORT: Shader = Shader {
    name: "sort",
    builtin: true,
    source: include_str!("../../../shaders/sort.wgsl"),
};

/// Invocations per workgroup of every kernel in the file.
const WG: u32 = 256;
/// The most pairs `sort_local` holds in workgroup memory (matches `BLOCK_MAX` in the shader).
const BLOCK_MAX: usize = 1024;

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

/// Stable argsort of each row of an f32 or i32 buffer `[rows, len]` (i32 keys compare as
/// integers; scatter_add sorts its indices with this).
pub(crate) fn sort_rows(
    be: &GpuBackend,
    x: &GpuBuffer,
    rows: usize,
    len: usize,
    descending: bool,
) -> Result<GpuBuffer> {
    if rows.checked_mul(len) != Some(x.len()) {
        return Err(Error::Shape(format!(
            "argsort: [{rows}, {len}] does not match a buffer of {} elements",
            x.len()
        )));
    }
    let out = be.alloc(x.len(), DType::I32)?;
    if x.is_empty() {
        return Ok(out);
    }
    let p = len.next_power_of_two();
    let padded = rows.saturating_mul(p);
    let block = p.min(BLOCK_MAX);
    let (rows32, len32, p32, block32) = (
        u32_param(rows, "argsort: rows")?,
        u32_param(len, "argsort: row length")?,
        u32_param(p, "argsort: padded row length")?,
        block as u32,
    );
    u32_param(padded, "argsort: rows × padded length")?;
    let kind = match x.dtype() {
        DType::I32 => 1,
        _ => 0,
    };
    let keys = be.alloc(padded, DType::I32)?;
    let vals = be.alloc(padded, DType::I32)?;
    let init = [rows32, len32, p32, kind, descending as u32];
    be.launch(
        &SORT,
        "sort_init",
        &[x, &keys, &vals],
        &init,
        grid_1d(padded, WG)?,
    )?;
    let local_groups = grid_1d(rows * (p / block) * WG as usize, WG)?;
    be.launch(
        &SORT,
        "sort_local",
        &[x, &keys, &vals],
        &[rows32, p32, block32, 0],
        local_groups,
    )?;
    let mut k = 2 * block;
    while k <= p {
        let mut j = k / 2;
        while j >= block {
            be.launch(
                &SORT,
                "sort_global_step",
                &[x, &keys, &vals],
                &[rows32, p32, k as u32, j as u32],
                grid_1d(padded / 2, WG)?,
            )?;
            j /= 2;
        }
        be.launch(
            &SORT,
            "sort_local",
            &[x, &keys, &vals],
            &[rows32, p32, block32, k as u32],
            local_groups,
        )?;
        k *= 2;
    }
    be.launch(
        &SORT,
        "sort_finish",
        &[x, &keys, &vals, &out],
        &init,
        grid_1d(x.len(), WG)?,
    )?;
    Ok(out)
}
