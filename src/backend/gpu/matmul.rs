//! Launcher of the dense matrix product, [`matmul`]: batched `C[b] = A[b]·B[b]` through arbitrary
//! [`MatLayout`]s (transposes and broadcast batches are strides), the end of `Tensor::matmul` and
//! of its backward; and the helpers the expert bank's launchers share (`matmul_grouped.rs`:
//! `grouped_matmul`, `grouped_weight_grad`).
//!
//! The launcher checks dtypes and buffer lengths against the sizes (an [`Error`] naming them, never
//! a panic or a wgpu validation error), answers empty problems without a launch (an empty buffer,
//! or zeros when only the reduction is empty), splits the grid where a dimension would exceed
//! 65535 workgroups, and encodes the kernel; nothing is read back. The kernels compute one 64×64
//! output tile per 256-invocation workgroup; the shader's header describes the tiling.
//!
//! [`matmul`] has four kernels, [`MatmulKernel`] names them: the plain `matmul`, `matmul_wide`
//! (`shaders/matmul_wide.wgsl`: 128×128 output tiles, 8×8 per invocation), `matmul_subgroup`
//! (`shaders/matmul_subgroup.wgsl`: A shared by subgroup shuffles, on adapters with subgroups of 4
//! to 128 invocations) and `matmul_wide4` (`shaders/matmul_wide4.wgsl`: the wide kernel with
//! every global read and write a vec4, for operands whose contiguous axes are multiples of 4,
//! [`vec4_layouts`]). By default ([`MatmulKernel::Auto`]) a product with at least
//! [`WIDE_MIN_GROUPS`] 128×128 tiles runs `matmul_wide` and a smaller one `matmul`: on the one
//! real GPU measured (docs/gpu.md) the plain kernel ran 1.8× the subgroup one, and
//! `matmul_wide4` runs only when chosen, until a real GPU has measured it. Under the default a
//! product with few tiles and a long reduction is also split along k ([`split_k`]), and
//! `grouped_weight_grad` cuts each expert's rows the same way (few experts are few tiles with
//! long segments); `MOEGRAD_MATMUL=plain` runs both unsplit. [`MatmulKernel::Tuned`], the
//! default on a GPU, is `Auto` with the wide kernel's products given to whichever tile kernel
//! ran them fastest on this adapter, timed once per size class (`matmul_tune.rs`; the same
//! bits). `MOEGRAD_MATMUL=tuned|auto|plain|wide|subgroup|wide-vec4` chooses at start-up and
//! `GpuBackend::set_matmul_kernel` at run time.

use super::kernels::{Shader, grid_1d, u32_param};
use super::matmul_build::MatmulBuild;
use super::matmul_tune::{SizeClass, candidates};
use super::{GpuBackend, GpuBuffer, MatmulKernel};
use crate::backend::checks::check_matmul_bias;
use crate::backend::{
    AxisView, ElementwiseOps, ExpertBankDims, GroupedMatmulDims, MatLayout, MatmulDims, ReduceOp,
};
use crate::backend::{BinaryOp, MatmulOps};
use crate::{DType, Error, Result};

/// The kernels of `shaders/matmul.wgsl`.
pub(crate) static MATMUL_SHADER: Shader = Shader {
    name: "matmul",
    builtin: true,
    source: concat!(
        include_str!("../../../shaders/matmul_params.wgsl"),
        "\n",
        include_str!("../../../shaders/matmul.wgsl")
    ),
};

/// `matmul.wgsl` with the subgroup entry point appended, compiled only where the adapter has the
/// SUBGROUP feature (naga takes subgroup builtins without WGSL's `enable subgroups;`, which it
/// does not parse yet; wgpu checks the feature instead).
pub(crate) static MATMUL_SUBGROUP_SHADER: Shader = Shader {
    name: "matmul_subgroup",
    builtin: true,
    source: concat!(
        include_str!("../../../shaders/matmul_params.wgsl"),
        "\n",
        include_str!("../../../shaders/matmul.wgsl"),
        "\n",
        include_str!("../../../shaders/matmul_subgroup.wgsl")
    ),
};

/// `matmul.wgsl` with the wide entry point appended (`matmul_wide`: 128×128 output tiles).
pub(crate) static MATMUL_WIDE_SHADER: Shader = Shader {
    name: "matmul_wide",
    builtin: true,
    source: concat!(
        include_str!("../../../shaders/matmul_params.wgsl"),
        "\n",
        include_str!("../../../shaders/matmul.wgsl"),
        "\n",
        include_str!("../../../shaders/matmul_wide.wgsl")
    ),
};

/// `matmul_params.wgsl` with the vec4 entry point (`matmul_wide4`: `matmul_wide`'s tiling with
/// every global read and write a vec4).
pub(crate) static MATMUL_WIDE4_SHADER: Shader = Shader {
    name: "matmul_wide4",
    builtin: true,
    source: concat!(
        include_str!("../../../shaders/matmul_params.wgsl"),
        "\n",
        include_str!("../../../shaders/matmul_wide4.wgsl")
    ),
};

/// Output tile edge of the kernels of `matmul.wgsl` itself (rows and columns per workgroup).
pub(super) const TILE: usize = 64;

/// Output tile edge of `matmul_wide`.
pub(super) const WIDE_TILE: usize = 128;

/// The fewest 128×128 output tiles (times the batch) for which [`MatmulKernel::Auto`] runs
/// `matmul_wide`; below it the 64×64 tiles of `matmul` (with split-k) keep more of the GPU busy.
/// On the H200 the wide kernel was faster at every size measured, 1024 (64 wide tiles) included:
/// 12.7 against 10.9 TFLOP/s there, 13.0 against 12.0 at 2048 (docs/benchmarks.md).
pub const WIDE_MIN_GROUPS: usize = 64;

/// The workgroups split-k aims for (about one per multiprocessor of a large GPU; an H200 has
/// 132), and the shortest range of k a split walks.
const SPLIT_K_GROUPS: usize = 128;
const SPLIT_K_MIN_CHUNK: usize = 128;

/// Workgroups a dispatch may have in one dimension (WebGPU's guaranteed minimum).
const MAX_GROUPS: usize = 65_535;

/// Checks that a buffer holds i32 indices.
pub(super) fn check_i32(what: &str, name: &str, b: &GpuBuffer) -> Result<()> {
    match b.dtype() {
        DType::I32 => Ok(()),
        d => Err(Error::DType(format!("{what}: {name} must be i32, got {d}"))),
    }
}

/// Checks that a buffer holds at least `len` elements, the ones its sizes address (`len` is `None`
/// when the product of the sizes overflowed). Like the CPU backend, elements past them are ignored.
pub(super) fn check_len(
    what: &str,
    name: &str,
    b: &GpuBuffer,
    len: Option<usize>,
    shape: &str,
) -> Result<()> {
    match len {
        Some(len) if len <= b.len() => Ok(()),
        _ => Err(Error::Shape(format!(
            "{what}: {name} {shape} needs {} elements, its buffer holds {}",
            len.map_or("more than usize::MAX".to_string(), |l| l.to_string()),
            b.len()
        ))),
    }
}

/// A size or index as the u32 the kernels compute with, or an error naming it.
pub(super) fn to_u32(what: &str, name: &str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| {
        Error::Shape(format!(
            "{what}: {name} = {v} exceeds the GPU kernels' 32-bit indexing"
        ))
    })
}

/// The element count of an output of `shape` (its sizes' product, named by `names`, e.g.
/// `"batch·m·n"`), or an error unless it fits the kernels' 32-bit indexing.
pub(super) fn output_len(what: &str, shape: &[usize], names: &str) -> Result<usize> {
    let len = product(shape).ok_or_else(|| {
        Error::Shape(format!(
            "{what}: output {shape:?} has more than usize::MAX elements"
        ))
    })?;
    to_u32(what, names, len)?;
    Ok(len)
}

/// The product of sizes, `None` on overflow.
pub(super) fn product(sizes: &[usize]) -> Option<usize> {
    sizes.iter().try_fold(1usize, |acc, &s| acc.checked_mul(s))
}

/// `⌈n / TILE⌉`.
pub(super) fn tiles(n: usize) -> usize {
    n.div_ceil(TILE)
}

/// Splits `0..n` workgroups into dispatchable chunks `(first, count)`.
fn chunks(n: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..n)
        .step_by(MAX_GROUPS)
        .map(move |start| (start, MAX_GROUPS.min(n - start)))
}

/// Dispatches a grid of `groups` workgroups in chunks of at most [`MAX_GROUPS`] per dimension;
/// `params(base)` builds the params of the chunk whose first workgroup is `base`.
pub(super) fn launch_grid(
    be: &GpuBackend,
    (shader, entry): (&Shader, &str),
    buffers: &[&GpuBuffer],
    groups: [usize; 3],
    params: impl Fn([u32; 3]) -> Vec<u32>,
) -> Result<()> {
    for (z0, nz) in chunks(groups[2]) {
        for (y0, ny) in chunks(groups[1]) {
            for (x0, nx) in chunks(groups[0]) {
                // every count is ≤ MAX_GROUPS and every start < a size already checked to fit u32
                let base = [x0 as u32, y0 as u32, z0 as u32];
                let counts = [nx as u32, ny as u32, nz as u32];
                be.launch(shader, entry, buffers, &params(base), counts)?;
            }
        }
    }
    Ok(())
}

/// One operand's layout, validated: the strides of size-1 dimensions are zeroed (they are never
/// used) and every addressed element must lie inside the buffer.
struct Operand {
    offset: u32,
    batch_stride: u32,
    row_stride: u32,
    col_stride: u32,
}

/// Validates `layout` for a `[batch, rows, cols]` operand held in `buf` (all sizes ≥ 1).
fn operand(
    name: &str,
    buf: &GpuBuffer,
    l: MatLayout,
    [batch, rows, cols]: [usize; 3],
) -> Result<Operand> {
    const WHAT: &str = "matmul";
    let stride = |size: usize, s: usize| if size == 1 { 0 } else { s };
    let (bs, rs, cs) = (
        stride(batch, l.batch_stride),
        stride(rows, l.row_stride),
        stride(cols, l.col_stride),
    );
    let last = (batch - 1)
        .checked_mul(bs)
        .and_then(|v| v.checked_add((rows - 1).checked_mul(rs)?))
        .and_then(|v| v.checked_add((cols - 1).checked_mul(cs)?))
        .and_then(|v| v.checked_add(l.offset));
    match last {
        Some(last) if last < buf.len() => {}
        _ => {
            return Err(Error::Shape(format!(
                "{WHAT}: operand {name} [{batch}, {rows}, {cols}] with offset {} and strides \
                 ({}, {}, {}) reaches element {}, its buffer holds {}",
                l.offset,
                l.batch_stride,
                l.row_stride,
                l.col_stride,
                last.map_or("beyond usize::MAX".to_string(), |v| v.to_string()),
                buf.len()
            )));
        }
    }
    // Every value below is ≤ `last` < the buffer's length; still, say so if that is not a u32.
    Ok(Operand {
        offset: to_u32(WHAT, &format!("{name}'s offset"), l.offset)?,
        batch_stride: to_u32(WHAT, &format!("{name}'s batch stride"), bs)?,
        row_stride: to_u32(WHAT, &format!("{name}'s row stride"), rs)?,
        col_stride: to_u32(WHAT, &format!("{name}'s column stride"), cs)?,
    })
}

/// Batched matrix product `C[b] = A[b]·B[b]` (entry point `matmul`), `A[b]: m×k` and `B[b]: k×n`
/// read through their layouts, output contiguous `[batch, m, n]` of dtype `out`.
///
/// f32 operands give an f32 output (or f16, below). With f16 (adapters with `shader-f16`) the
/// product runs a build of the same kernels for its dtypes ([`MatmulBuild`]): f16·f16 → f16,
/// f16·f32 → f16 (an activation times an f32 weight, read where it is), f16·f16 → f32 (an f32
/// weight's gradient), f16·f32 → f32 (a router's logits from f16 tokens, and its gate's
/// gradient) and f32·f32 → f16 (those tokens' gradient); f32 sums in every build, and the plain
/// or wide kernel as for f32 (`wide-vec4` and `subgroup`, which have no f16 builds, give way to
/// `wide` and `plain`). Split-k runs where the output is f32 (an f16 output would round its
/// partial sums).
///
/// With `pending` (`[batch, m, n]` contiguous, of dtype `out`) the result is
/// `pending + (A·B + bias)`: each kernel adds it to the output element after rounding the
/// product to `out`, and rounds the sum once more (the bits of a separate add, in the product's
/// own pass); a split product adds it in the pass that sums its slices ([`sum_slices_plus`]).
///
/// # Errors
/// [`Error::DType`] for any other dtypes; [`Error::Shape`] when a layout addresses an
/// element outside its buffer, `pending` is not the output's length or dtype, or a size
/// exceeds 32-bit indexing; a GPU error from the launch.
pub(crate) fn matmul(
    be: &GpuBackend,
    (a, a_layout): (&GpuBuffer, MatLayout),
    (b, b_layout): (&GpuBuffer, MatLayout),
    (bias, pending): (Option<&GpuBuffer>, Option<&GpuBuffer>),
    dims: MatmulDims,
    out: DType,
) -> Result<GpuBuffer> {
    const WHAT: &str = "matmul";
    let build = MatmulBuild::of(be, WHAT, a, b, out)?;
    let MatmulDims { batch, m, k, n } = dims;
    check_matmul_bias(WHAT, bias, n, b.dtype())?;
    let out_len = output_len(WHAT, &[batch, m, n], "batch·m·n")?;
    if let Some(p) = pending.filter(|p| p.len() != out_len || p.dtype() != out) {
        return Err(Error::Shape(format!(
            "{WHAT}: the pending gradient holds {} {} values, the product [{batch}, {m}, {n}] \
             of {out}",
            p.len(),
            p.dtype()
        )));
    }
    if out_len == 0 {
        return be.alloc(0, out);
    }
    if k == 0 {
        if let Some(p) = pending {
            let zeros = be.full(out_len, 0.0, out)?;
            return add_pending(be, p, &zeros);
        }
        if bias.is_some() {
            return Err(Error::Invalid(format!(
                "{WHAT}: a product with a bias needs k ≥ 1 (Tensor::matmul_bias adds the bias                  itself when k = 0)"
            )));
        }
        return be.full(out_len, 0.0, out);
    }
    let la = operand("A", a, a_layout, [batch, m, k])?;
    let lb = operand("B", b, b_layout, [batch, k, n])?;
    let (a_k_fast, b_n_fast) = fast_axes(dims, a_layout, b_layout);
    let (m32, k32, n32, batch32) = (m as u32, k as u32, n as u32, batch as u32);

    let wide_groups = n.div_ceil(WIDE_TILE) * m.div_ceil(WIDE_TILE) * batch;
    let chosen = be.matmul_kernel();
    let f32_only = build == MatmulBuild::F32;
    let vec4 = f32_only
        && vec4_layouts(
            [(a, &la, a_k_fast), (b, &lb, b_n_fast)],
            dims,
            [a_layout, b_layout],
        );
    let by_size = matches!(chosen, MatmulKernel::Auto | MatmulKernel::Tuned);
    let kernel = match chosen {
        _ if by_size && wide_groups >= WIDE_MIN_GROUPS => MatmulKernel::Wide,
        _ if by_size => MatmulKernel::Plain,
        // the f16 builds exist for the plain and wide kernels only
        MatmulKernel::Wide | MatmulKernel::WideVec4 if !f32_only => MatmulKernel::Wide,
        MatmulKernel::Subgroup if !f32_only => MatmulKernel::Plain,
        MatmulKernel::WideVec4 if !vec4 => MatmulKernel::Wide,
        chosen => chosen,
    };
    // split-k: only where Auto (or Tuned) chose the plain kernel and the output is f32
    let (splits, chunk) = match (build.out(), by_size, kernel) {
        (DType::F32, true, MatmulKernel::Plain) => split_k(tiles(n) * tiles(m) * batch, k),
        _ => (1, k),
    };
    // (a split product whose slices would pass 32-bit indexing is not split)
    let fits = |l: Option<usize>| l.is_some_and(|l| u32::try_from(l).is_ok());
    let (splits, chunk) = match fits(out_len.checked_mul(splits)) {
        true => (splits, chunk),
        false => (1, k),
    };
    // the pending gradient goes into the kernel's store unless k is split (then after the sum)
    let in_kernel = pending.filter(|_| splits == 1);
    // one product with `kernel`, its k cut into `splits` ranges of `chunk`, into `c`
    let run = |kernel: MatmulKernel, c: &GpuBuffer, (splits, chunk): (usize, usize)| {
        let (entry, tile) = match kernel {
            MatmulKernel::Wide => ((build.wide(), "matmul_wide"), WIDE_TILE),
            MatmulKernel::WideVec4 => ((&MATMUL_WIDE4_SHADER, "matmul_wide4"), WIDE_TILE),
            MatmulKernel::Subgroup => ((&MATMUL_SUBGROUP_SHADER, "matmul_subgroup"), TILE),
            _ => ((build.plain(), "matmul"), TILE),
        };
        launch_grid(
            be,
            entry,
            // without a bias (a pending gradient), binding 4 (5) is B again, unread
            &[a, b, c, bias.unwrap_or(b), in_kernel.unwrap_or(b)],
            [n.div_ceil(tile), m.div_ceil(tile), batch * splits],
            |[x0, y0, z0]| {
                vec![
                    m32,
                    k32,
                    n32,
                    batch32,
                    la.offset,
                    la.batch_stride,
                    la.row_stride,
                    la.col_stride,
                    lb.offset,
                    lb.batch_stride,
                    lb.row_stride,
                    lb.col_stride,
                    a_k_fast as u32,
                    b_n_fast as u32,
                    x0,
                    y0,
                    z0,
                    splits as u32,
                    chunk as u32,
                    bias.is_some() as u32,
                    in_kernel.is_some() as u32,
                ]
            },
        )
    };
    let c = be.alloc(out_len * splits, out)?;
    let kernel = match (chosen, kernel) {
        // the unsplit wide kernel's products: the fastest tile kernel on this adapter, same bits
        (MatmulKernel::Tuned, MatmulKernel::Wide) => {
            let class = SizeClass::of(
                (build, be.shader_checks()),
                [batch, m, k, n],
                (a_k_fast, b_n_fast),
                vec4,
            );
            be.matmul_tuning().kernel(
                be,
                (class, [batch, m, k, n]),
                &candidates(be, build, vec4),
                MatmulKernel::Wide,
                |candidate| run(candidate, &c, (1, k)),
            )?
        }
        _ => kernel,
    };
    run(kernel, &c, (splits, chunk))?;
    match (pending, in_kernel) {
        // split along k: the pass that sums the slices adds it
        (Some(p), None) => sum_slices_plus(be, &c, splits, out_len, p),
        _ => sum_slices(be, c, splits, out_len),
    }
}

/// `pending + Σ slices` for split-k's f32 slices (`splits` of `len` elements one after
/// another) and an f32 `pending` of `len`, in one pass (`reduce.wgsl`'s `sum_slices_plus`): the
/// bits of [`sum_slices`] followed by the add kernel.
fn sum_slices_plus(
    be: &GpuBackend,
    slices: &GpuBuffer,
    splits: usize,
    len: usize,
    pending: &GpuBuffer,
) -> Result<GpuBuffer> {
    if slices.dtype() != DType::F32 || pending.dtype() != DType::F32 {
        return Err(Error::DType(format!(
            "matmul: split-k sums f32 slices into an f32 output, got {} slices and a {} \
             pending gradient",
            slices.dtype(),
            pending.dtype()
        )));
    }
    if slices.len() != splits * len || pending.len() != len {
        return Err(Error::Shape(format!(
            "matmul: {} slice elements and {} pending for {splits} slices of {len}",
            slices.len(),
            pending.len()
        )));
    }
    let out = be.alloc(len, DType::F32)?;
    let params = [
        1,
        u32_param(splits, "matmul: split-k slices")?,
        u32_param(len, "matmul: output size")?,
        0,
    ];
    be.launch(
        &super::reduce::REDUCE,
        "sum_slices_plus",
        &[slices, &out, pending],
        &params,
        grid_1d(len, 256)?,
    )?;
    Ok(out)
}

/// `pending + c` for two buffers of the same length (the add kernel), where a product could
/// not add its pending gradient itself.
fn add_pending(be: &GpuBackend, pending: &GpuBuffer, c: &GpuBuffer) -> Result<GpuBuffer> {
    let len = [c.len()];
    super::elementwise::binary(be, BinaryOp::Add, pending, &[1], c, &[1], &len)
}

/// The sum of `splits` slices of `len` elements held one after another in `slices` (the
/// partial sums of split-k and of the weight gradient's row splits), added in slice order
/// (deterministic); `slices` itself when there is one.
pub(super) fn sum_slices(
    be: &GpuBackend,
    slices: GpuBuffer,
    splits: usize,
    len: usize,
) -> Result<GpuBuffer> {
    if splits == 1 {
        return Ok(slices);
    }
    let view = AxisView {
        outer: 1,
        len: splits,
        inner: len,
    };
    super::reduce::reduce(be, ReduceOp::Sum, &slices, view)
}

/// Whether [`matmul`] under [`MatmulKernel::WideVec4`] runs `matmul_wide4` for these operands
/// (else `matmul_wide`): [`vec4_layouts`] on their checked layouts.
#[cfg(test)]
pub(crate) fn takes_vec4(
    a: &GpuBuffer,
    a_layout: MatLayout,
    b: &GpuBuffer,
    b_layout: MatLayout,
    dims: MatmulDims,
) -> bool {
    let MatmulDims { batch, m, k, n } = dims;
    let (Ok(la), Ok(lb)) = (
        operand("A", a, a_layout, [batch, m, k]),
        operand("B", b, b_layout, [batch, k, n]),
    ) else {
        return false;
    };
    let (a_k_fast, b_n_fast) = fast_axes(dims, a_layout, b_layout);
    vec4_layouts(
        [(a, &la, a_k_fast), (b, &lb, b_n_fast)],
        dims,
        [a_layout, b_layout],
    )
}

/// Which index of each operand walks memory fastest: `(a_k_fast, b_n_fast)`, k for A and n for
/// B when true (a size-1 dimension never does).
fn fast_axes(dims: MatmulDims, a: MatLayout, b: MatLayout) -> (bool, bool) {
    let MatmulDims { m, k, n, .. } = dims;
    (
        m == 1 || (k > 1 && a.col_stride <= a.row_stride),
        k == 1 || (n > 1 && b.col_stride <= b.row_stride),
    )
}

/// Whether `matmul_wide4` may read A and B and write C as aligned vec4s
/// (`shaders/matmul_wide4.wgsl`): `n` a multiple of 4, and each operand with a contiguous axis
/// (stride 1) of a length that is a multiple of 4, its offset and other strides multiples of 4,
/// and its buffer a whole number of vec4s. `operands` pairs each buffer with its checked layout
/// and whether its second axis (k for A, n for B) is the fast one; `layouts` are the layouts as
/// given (a size-1 axis's stride is ignored).
fn vec4_layouts(
    operands: [(&GpuBuffer, &Operand, bool); 2],
    dims: MatmulDims,
    layouts: [MatLayout; 2],
) -> bool {
    let MatmulDims { m, k, n, .. } = dims;
    let four = |v: u32| v.is_multiple_of(4);
    let fits = |(buf, l, second_fast): (&GpuBuffer, &Operand, bool),
                layout: MatLayout,
                (rows, cols): (usize, usize)| {
        let aligned = buf.len().is_multiple_of(4) && four(l.offset) && four(l.batch_stride);
        let axes = if second_fast {
            // the columns contiguous: rows step by a multiple of 4
            layout.col_stride == 1 && cols.is_multiple_of(4) && (rows == 1 || four(l.row_stride))
        } else {
            layout.row_stride == 1 && rows.is_multiple_of(4) && (cols == 1 || four(l.col_stride))
        };
        aligned && axes
    };
    let [a, b] = operands;
    n.is_multiple_of(4) && fits(a, layouts[0], (m, k)) && fits(b, layouts[1], (k, n))
}

/// Split-k for a product of `groups` 64×64 output tiles and reduction length `k`: `(splits,
/// chunk)`, `splits` ranges of `chunk` (a multiple of 16) covering `0..k`. A product with fewer
/// tiles than [`SPLIT_K_GROUPS`] leaves most of a GPU idle while each workgroup walks all of `k`
/// (a weight gradient `[128, 768]·[768, 512]` is 16 tiles walking 768); cutting `k` into ranges
/// of at least [`SPLIT_K_MIN_CHUNK`] gives about [`SPLIT_K_GROUPS`] workgroups, each walking a
/// range, then one reduction adds the ranges. `(1, k)`: no split.
pub(super) fn split_k(groups: usize, k: usize) -> (usize, usize) {
    if groups == 0 || groups >= SPLIT_K_GROUPS || k < 2 * SPLIT_K_MIN_CHUNK {
        return (1, k);
    }
    let splits = SPLIT_K_GROUPS
        .div_ceil(groups)
        .min(k / SPLIT_K_MIN_CHUNK)
        .max(1);
    let chunk = k.div_ceil(splits).next_multiple_of(16);
    (k.div_ceil(chunk), chunk)
}

impl MatmulOps for GpuBackend {
    fn matmul(
        &self,
        a: (&GpuBuffer, MatLayout),
        b: (&GpuBuffer, MatLayout),
        bias: Option<&GpuBuffer>,
        dims: MatmulDims,
        out: DType,
    ) -> Result<GpuBuffer> {
        matmul(self, a, b, (bias, None), dims, out)
    }

    fn matmul_plus(
        &self,
        a: (&GpuBuffer, MatLayout),
        b: (&GpuBuffer, MatLayout),
        bias: Option<&GpuBuffer>,
        dims: MatmulDims,
        out: DType,
        pending: &GpuBuffer,
    ) -> Result<GpuBuffer> {
        matmul(self, a, b, (bias, Some(pending)), dims, out)
    }

    fn grouped_matmul(
        &self,
        x: &GpuBuffer,
        w: &GpuBuffer,
        bias: Option<&GpuBuffer>,
        row_expert: &GpuBuffer,
        dims: GroupedMatmulDims,
    ) -> Result<GpuBuffer> {
        super::matmul_grouped::grouped_matmul(self, x, w, bias, row_expert, dims)
    }

    fn grouped_weight_grad(
        &self,
        x: &GpuBuffer,
        dy: &GpuBuffer,
        row_expert: &GpuBuffer,
        offsets: &GpuBuffer,
        bank: ExpertBankDims,
        out: DType,
    ) -> Result<GpuBuffer> {
        super::matmul_grouped::grouped_weight_grad(self, x, dy, row_expert, offsets, bank, out)
    }

    fn grouped_bias_grad(
        &self,
        dy: &GpuBuffer,
        routing: (&GpuBuffer, &GpuBuffer),
        sizes: (usize, usize),
        out: DType,
    ) -> Result<GpuBuffer> {
        super::matmul_grouped::grouped_bias_grad(self, dy, routing, sizes, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Split-k covers 0..k with whole slabs, never leaves a range empty, aims for about
    /// SPLIT_K_GROUPS workgroups, and leaves products with many tiles or a short k alone.
    #[test]
    fn split_k_ranges_cover_k() {
        assert_eq!(split_k(16, 768), (6, 128));
        assert_eq!(split_k(24, 512), (4, 128));
        assert_eq!(split_k(96, 128), (1, 128));
        assert_eq!(split_k(200, 4096), (1, 4096));
        assert_eq!(split_k(1, 255), (1, 255));
        for groups in [1, 2, 7, 16, 64, 127] {
            for k in [256, 257, 300, 1000, 4097, 100_000] {
                let (splits, chunk) = split_k(groups, k);
                assert_eq!(chunk % 16, 0, "{groups} groups, k {k}");
                assert!(
                    chunk >= SPLIT_K_MIN_CHUNK,
                    "{groups} groups, k {k}: chunk {chunk}"
                );
                assert!(
                    splits * chunk >= k,
                    "{groups} groups, k {k}: {splits} × {chunk}"
                );
                assert!(
                    (splits - 1) * chunk < k,
                    "{groups} groups, k {k}: an empty range"
                );
                assert!(
                    groups * splits < 2 * SPLIT_K_GROUPS,
                    "{groups} groups, k {k}"
                );
            }
        }
    }

    /// The shader parses and validates, and has the three entry points the launchers name.
    #[test]
    fn shader_parses_and_validates() {
        let (module, _) = super::super::kernels::validated_module(MATMUL_SHADER.source);
        let names: Vec<&str> = module
            .entry_points
            .iter()
            .map(|e| e.name.as_str())
            .collect();
        for entry in ["matmul", "grouped_matmul", "grouped_weight_grad"] {
            assert!(
                names.contains(&entry),
                "missing entry point {entry}: {names:?}"
            );
        }
    }

    /// The subgroup module (matmul.wgsl + matmul_subgroup.wgsl) validates with subgroup
    /// operations allowed, and not without them (so it is only ever built where they exist).
    #[test]
    fn subgroup_shader_validates_only_with_subgroups() {
        use wgpu::naga;
        let src = MATMUL_SUBGROUP_SHADER.source;
        let module = naga::front::wgsl::parse_str(src)
            .unwrap_or_else(|e| panic!("{}", e.emit_to_string(src)));
        // the error (boxed: it is large) of validating under `caps`, if any
        let validate = |caps| {
            naga::valid::Validator::new(naga::valid::ValidationFlags::all(), caps)
                .subgroup_stages(naga::valid::ShaderStages::COMPUTE)
                .subgroup_operations(naga::valid::SubgroupOperationSet::all())
                .validate(&module)
                .err()
                .map(Box::new)
        };
        if let Some(e) = validate(naga::valid::Capabilities::SUBGROUP) {
            panic!("{}", e.emit_to_string(src));
        }
        assert!(validate(naga::valid::Capabilities::empty()).is_some());
        assert!(
            module
                .entry_points
                .iter()
                .any(|e| e.name == "matmul_subgroup")
        );
    }

    #[test]
    fn grid_chunks_cover_the_range() {
        let v: Vec<_> = chunks(2 * MAX_GROUPS + 3).collect();
        assert_eq!(
            v,
            vec![
                (0, MAX_GROUPS),
                (MAX_GROUPS, MAX_GROUPS),
                (2 * MAX_GROUPS, 3)
            ]
        );
        assert_eq!(chunks(0).count(), 0);
        assert_eq!(tiles(1), 1);
        assert_eq!(tiles(64), 1);
        assert_eq!(tiles(65), 2);
    }
}
