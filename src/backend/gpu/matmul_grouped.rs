//! Launchers of the MoE expert bank's kernels (`shaders/matmul.wgsl`, `shaders/matmul_wide.wgsl`),
//! one function per product:
//!
//! - [`grouped_matmul`]: `out[r] = x[r]·W[e_r]` (or `W[e_r]ᵀ`), rows sorted by expert, each
//!   expert's weights read only for its own rows: the entry `grouped_matmul` (64×64 tiles) or,
//!   where the dense matmul would run its wide kernel, `grouped_matmul_wide` (128×128 tiles, 8×8
//!   per invocation; the same bits);
//! - [`grouped_weight_grad`]: the weight gradient, `dW[e] = Σ x[r]ᵀ·dy[r]` over the rows of
//!   expert `e`'s segment, exactly zero for an expert without rows, its rows cut into ranges
//!   when there are few tiles (as `matmul.rs`'s split-k cuts k);
//! - [`grouped_bias_grad`]: the bias gradient `db[e] = Σ dy[r]`, the same kernel reading a
//!   column of ones it is not given.
//!
//! Both check dtypes and lengths against the sizes (an [`Error`] naming them), answer empty
//! problems without a launch, split the grid past 65535 workgroups per dimension, and read
//! nothing back; they share `matmul.rs`'s helpers.

use super::half::float_operands;
use super::matmul::{
    TILE, WIDE_MIN_GROUPS, WIDE_TILE, check_i32, check_len, launch_grid, output_len, product,
    split_k, sum_slices, tiles, to_u32,
};
use super::matmul_build::MatmulBuild;
use super::{GpuBackend, GpuBuffer, MatmulKernel};
use crate::backend::{ElementwiseOps, ExpertBankDims, GroupedMatmulDims};
use crate::{DType, Error, Result};

/// The MoE expert bank's grouped matmul (entry point `grouped_matmul`, or `grouped_matmul_wide`
/// where [`grouped_runs_wide`] says so): `out[r] = x[r]·W[e_r]`,
/// or `x[r]·W[e_r]ᵀ` with `transpose_w`. `x: [rows, k]`, `w: [experts, k, m]` (`[experts, m, k]`
/// when transposed), `row_expert: [rows]` i32; output `[rows, m]`, zeros for rows whose expert is
/// outside `0..experts`. Rows should be sorted by expert; the result does not depend on it.
///
/// # Errors
/// [`Error::DType`] unless x, w (and the bias) are all f32 or all f16 (the f16 build), or for
/// non-i32 experts; [`Error::Shape`] when a buffer's length
/// does not match the sizes or a size exceeds 32-bit indexing; a GPU error from the launch.
pub(crate) fn grouped_matmul(
    be: &GpuBackend,
    x: &GpuBuffer,
    w: &GpuBuffer,
    bias: Option<&GpuBuffer>,
    row_expert: &GpuBuffer,
    dims: GroupedMatmulDims,
) -> Result<GpuBuffer> {
    let GroupedMatmulDims {
        rows,
        k,
        m,
        experts,
        transpose_w,
    } = dims;
    const WHAT: &str = "grouped_matmul";
    let mut weights = vec![("w", w)];
    weights.extend(bias.map(|b| ("bias", b)));
    // f16 rows with f32 weights: mixed precision's expert banks, read in f32 where they are
    let f16_rows = x.dtype() == DType::F16 && float_operands(WHAT, &weights)? == DType::F32;
    let (dtype, build) = if f16_rows {
        be.check_f16(WHAT)?;
        (DType::F16, MatmulBuild::F16Rows)
    } else {
        let mut floats = vec![("x", x)];
        floats.extend(weights);
        match float_operands(WHAT, &floats)? {
            DType::F16 => (DType::F16, MatmulBuild::F16),
            dtype => (dtype, MatmulBuild::F32),
        }
    };
    check_i32(WHAT, "row_expert", row_expert)?;
    check_len(WHAT, "x", x, product(&[rows, k]), &format!("[{rows}, {k}]"))?;
    let w_shape = if transpose_w {
        format!("[{experts}, {m}, {k}]")
    } else {
        format!("[{experts}, {k}, {m}]")
    };
    check_len(WHAT, "w", w, product(&[experts, k, m]), &w_shape)?;
    check_len(
        WHAT,
        "row_expert",
        row_expert,
        Some(rows),
        &format!("[{rows}]"),
    )?;
    crate::backend::checks::check_grouped_bias(WHAT, bias, dims)?;
    let out_len = output_len(WHAT, &[rows, m], "rows·m")?;
    if out_len == 0 {
        return be.alloc(0, dtype);
    }
    if experts == 0 || (k == 0 && bias.is_none()) {
        return be.full(out_len, 0.0, dtype);
    }
    // both products were checked not to overflow above
    to_u32(WHAT, "rows·k", rows * k)?;
    to_u32(WHAT, "experts·k·m", experts * k * m)?;
    to_u32(WHAT, "experts", experts)?;
    let (rows32, k32, m32, experts32) = (rows as u32, k as u32, m as u32, experts as u32);

    let out = be.alloc(out_len, dtype)?;
    let wide = grouped_runs_wide(be.matmul_kernel(), rows, m);
    let (shader, entry, tile) = match wide {
        true => (build.wide(), "grouped_matmul_wide", WIDE_TILE),
        false => (build.plain(), "grouped_matmul", TILE),
    };
    launch_grid(
        be,
        (shader, entry),
        // without a bias, `w` stands in for the unread bias binding
        &[x, w, row_expert, &out, bias.unwrap_or(w)],
        [m.div_ceil(tile), rows.div_ceil(tile), 1],
        |[x0, y0, _]| {
            let has_bias = bias.is_some() as u32;
            vec![
                rows32,
                k32,
                m32,
                experts32,
                transpose_w as u32,
                x0,
                y0,
                has_bias,
            ]
        },
    )?;
    Ok(out)
}

/// Whether [`grouped_matmul`] runs `grouped_matmul_wide` (128×128 tiles) for `rows` rows of
/// `m` outputs under `kernel`: as the dense `matmul` chooses its wide kernel (`auto` and `tuned`
/// from [`WIDE_MIN_GROUPS`] tiles of 128×128, which leaves enough workgroups to fill a GPU;
/// `wide` and `wide-vec4` always), and the 64×64 kernel otherwise (`plain`, `subgroup`, small
/// products). The two give the same bits.
pub(crate) fn grouped_runs_wide(kernel: MatmulKernel, rows: usize, m: usize) -> bool {
    match kernel {
        MatmulKernel::Auto | MatmulKernel::Tuned => {
            m.div_ceil(WIDE_TILE) * rows.div_ceil(WIDE_TILE) >= WIDE_MIN_GROUPS
        }
        MatmulKernel::Wide | MatmulKernel::WideVec4 => true,
        MatmulKernel::Plain | MatmulKernel::Subgroup => false,
    }
}

/// The weight gradient of [`grouped_matmul`] (entry point `grouped_weight_grad`):
/// `dW[e] = Σ x[r]ᵀ·dy[r]` over the rows `r` in `offsets[e]..offsets[e+1]` (clamped to
/// `0..rows`) with `row_expert[r] = e`. `x: [rows, k]`, `dy: [rows, m]`, `row_expert: [rows]` and
/// `offsets: [experts + 1]` i32, `rows` being `row_expert`'s length; output `[experts, k, m]`, an
/// expert without rows getting exactly zero, of dtype `out`: f32 from f32 rows, f16 or f32
/// (an f32 bank's gradient in mixed precision, summed and stored in f32) from f16 rows.
///
/// An f32 gradient under [`MatmulKernel::Auto`] (or `Tuned`) with fewer than `SPLIT_K_GROUPS`
/// workgroups (64×64 tiles × experts) cuts each expert's segment into ranges (as [`split_k`]
/// cuts k for the segments' mean length), one workgroup each, and adds the ranges' partial
/// gradients in order afterwards: deterministic, a different summation order from the unsplit
/// kernel.
///
/// # Errors
/// [`Error::DType`] unless x and dy are both f32 (output f32) or both f16, or for non-i32
/// indices; [`Error::Shape`] when a buffer's length
/// does not match the sizes or a size exceeds 32-bit indexing; a GPU error from the launch.
pub(crate) fn grouped_weight_grad(
    be: &GpuBackend,
    x: &GpuBuffer,
    dy: &GpuBuffer,
    row_expert: &GpuBuffer,
    offsets: &GpuBuffer,
    bank: ExpertBankDims,
    out: DType,
) -> Result<GpuBuffer> {
    weight_grad(be, Some(x), dy, (row_expert, offsets), bank, out)
}

/// The bias gradient of [`grouped_matmul`]: `db[e] = Σ dy[r]` over the rows of expert `e`'s
/// segment, `[experts, m]` of dtype `out`: [`grouped_weight_grad`] with `x` a column of ones,
/// which the kernel does not read (`x_ones`), so no buffer of ones is filled each step. The
/// same bits as that product with a column of ones.
///
/// # Errors
/// Those of [`grouped_weight_grad`].
pub(crate) fn grouped_bias_grad(
    be: &GpuBackend,
    dy: &GpuBuffer,
    (row_expert, offsets): (&GpuBuffer, &GpuBuffer),
    (m, experts): (usize, usize),
    out: DType,
) -> Result<GpuBuffer> {
    let bank = ExpertBankDims { k: 1, m, experts };
    weight_grad(be, None, dy, (row_expert, offsets), bank, out)
}

/// [`grouped_weight_grad`], or with `x = None` [`grouped_bias_grad`] (`k` = 1).
fn weight_grad(
    be: &GpuBackend,
    x: Option<&GpuBuffer>,
    dy: &GpuBuffer,
    (row_expert, offsets): (&GpuBuffer, &GpuBuffer),
    bank: ExpertBankDims,
    out: DType,
) -> Result<GpuBuffer> {
    let ExpertBankDims { k, m, experts } = bank;
    const WHAT: &str = "grouped_weight_grad";
    // the column of ones has dy's dtype
    let build = MatmulBuild::of_weight_grad(be, WHAT, x.unwrap_or(dy), dy, out)?;
    let dtype = build.out();
    check_i32(WHAT, "row_expert", row_expert)?;
    check_i32(WHAT, "offsets", offsets)?;
    let rows = row_expert.len();
    if let Some(x) = x {
        check_len(WHAT, "x", x, product(&[rows, k]), &format!("[{rows}, {k}]"))?;
    }
    check_len(
        WHAT,
        "dy",
        dy,
        product(&[rows, m]),
        &format!("[{rows}, {m}]"),
    )?;
    if experts.checked_add(1) != Some(offsets.len()) {
        return Err(Error::Shape(format!(
            "{WHAT}: {} offsets for {experts} experts (needs {experts} + 1)",
            offsets.len()
        )));
    }
    let out_len = output_len(WHAT, &[experts, k, m], "experts·k·m")?;
    if out_len == 0 {
        return be.alloc(0, dtype);
    }
    if rows == 0 {
        return be.full(out_len, 0.0, dtype);
    }
    // both products were checked not to overflow above
    to_u32(WHAT, "rows·k", rows * k)?;
    to_u32(WHAT, "rows·m", rows * m)?;
    if rows > i32::MAX as usize {
        return Err(Error::Shape(format!(
            "{WHAT}: {rows} rows exceed the i32 row indices"
        )));
    }
    let (rows32, k32, m32, experts32) = (rows as u32, k as u32, m as u32, experts as u32);

    // row splits, as `matmul`'s split-k: under the default kernel choice, for an f32 gradient
    // with few tiles (few experts) and long segments, sized from the segments' mean length (the
    // lengths themselves are on the device)
    let splits = match (dtype, be.matmul_kernel()) {
        (DType::F32, MatmulKernel::Auto | MatmulKernel::Tuned) => {
            split_k(tiles(m) * tiles(k) * experts, rows / experts.max(1)).0
        }
        _ => 1,
    };
    let splits = match out_len.checked_mul(splits).map(u32::try_from) {
        Some(Ok(_)) => splits,
        _ => 1,
    };
    let dw = be.alloc(out_len * splits, dtype)?;
    // x_ones: the bias gradient's column of ones, unread (dy stands in at its binding)
    let x_ones = x.is_none() as u32;
    launch_grid(
        be,
        (build.plain(), "grouped_weight_grad"),
        &[x.unwrap_or(dy), dy, row_expert, offsets, &dw],
        [tiles(m), tiles(k), experts * splits],
        |[x0, y0, z0]| {
            vec![
                rows32,
                k32,
                m32,
                experts32,
                x0,
                y0,
                z0,
                splits as u32,
                x_ones,
            ]
        },
    )?;
    sum_slices(be, dw, splits, out_len)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The grouped matmul takes the wide kernel where the dense matmul would: from 64 tiles of
    /// 128×128 under auto and tuned, always under wide and wide-vec4, never under plain and
    /// subgroup.
    #[test]
    fn wide_grouped_kernel_follows_the_dense_choice() {
        use MatmulKernel::*;
        // 8192 rows of 512 outputs: 64·4 = 256 wide tiles; 1024 rows of 256: 8·2 = 16
        for kernel in [Auto, Tuned] {
            assert!(grouped_runs_wide(kernel, 8192, 512));
            assert!(grouped_runs_wide(kernel, 8192, 128));
            assert!(!grouped_runs_wide(kernel, 1024, 256));
            // the edge: 64 tiles of 128 rows by one of 128 columns, and 63
            assert!(grouped_runs_wide(kernel, 64 * 128, 100));
            assert!(!grouped_runs_wide(kernel, 63 * 128, 100));
        }
        for kernel in [Wide, WideVec4] {
            assert!(grouped_runs_wide(kernel, 3, 5));
        }
        for kernel in [Plain, Subgroup] {
            assert!(!grouped_runs_wide(kernel, 8192, 512));
        }
    }
}
