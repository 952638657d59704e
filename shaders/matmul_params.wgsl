// matmul_params.wgsl: the uniform parameter block of the dense matrix products, `MatmulParams`,
// shared by matmul.wgsl's `matmul` (and the `matmul_wide` / `matmul_subgroup` entries appended to
// it) and by matmul_wide4.wgsl. Not a module of its own: src/backend/gpu/matmul.rs prepends it to
// each, and fills it alike for every kernel (`matmul` there). Every field is a u32; indices are
// element indices. A(b, r, c) = a[a_offset + b·a_batch_stride + r·a_row_stride + c·a_col_stride],
// B likewise with the b_* fields; `a_k_fast` / `b_n_fast` say which index walks memory fastest.
// With has_bias = 1 every kernel adds bias[col] (binding 4, n values of B's type, read) to each
// output element of column col after its product's sum, in f32, before the one rounding of the
// store (split-k: slice 0 only, so the slices' sum adds it once); with has_bias = 0 binding 4
// is any buffer and is not read. With has_pending = 1 (never with split-k) every kernel adds
// pending[i] (binding 5, contiguous [batch, m, n] of C's type, read) to output element i after
// the element is rounded to C's type, in f32, and rounds the sum once more: the bits of adding
// the gradient a tensor already had to the product afterwards (`pending + C`), in the same
// pass; with has_pending = 0 binding 5 is any buffer and is not read.

struct MatmulParams {
    m: u32,
    k: u32,
    n: u32,
    batch: u32,
    a_offset: u32,
    a_batch_stride: u32,
    a_row_stride: u32,
    a_col_stride: u32,
    b_offset: u32,
    b_batch_stride: u32,
    b_row_stride: u32,
    b_col_stride: u32,
    a_k_fast: u32,
    b_n_fast: u32,
    // first column tile, row tile and batch entry of this launch
    tile_n_base: u32,
    tile_m_base: u32,
    batch_base: u32,
    // split-k (entry `matmul` only; 1 and ≥ k elsewhere): the reduction is cut into k_splits
    // ranges of k_chunk (a multiple of SLAB), each summed by its own workgroups into its own
    // slice of c
    k_splits: u32,
    k_chunk: u32,
    has_bias: u32,
    has_pending: u32,
}
