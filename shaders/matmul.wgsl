// Matrix products: the kernels behind `Tensor::matmul` (and its backward), the MoE expert bank's
// grouped matmul and its weight gradient. Rust launchers: src/backend/gpu/matmul.rs, one function
// per entry point, same names.
//
// All three entry points share one tiling scheme:
//   * a workgroup of 16×16 = 256 invocations computes one 64×64 tile of the output;
//   * invocation (tx, ty) = (lid % 16, lid / 16) owns a 4×4 micro-tile: output rows 4·ty..4·ty+3
//     and columns 4·tx..4·tx+3 of the tile, accumulated in four vec4 registers;
//   * the reduction runs in slabs of 16: each invocation loads 4 elements of the 64×16 A slab and
//     4 of the 16×64 B slab into registers (the next slab is fetched while the current one is being
//     multiplied), stores them into workgroup memory, and every invocation then does 16 steps of
//     "one vec4 of A, one vec4 of B, 16 FMAs";
//   * workgroup memory holds each slab k-major as rows of 17 vec4 (64 floats + 4 of padding, which
//     spreads the stores of a column over the memory banks); 2 × 16 × 17 × 16 B = 8.5 KiB;
//   * elements outside the matrices are loaded as 0 and never stored, so any size works (m, n or
//     k = 1, sizes that are not multiples of 64 or 16);
//   * the grid is split on the host when a dimension would exceed 65535 workgroups: the
//     `*_base` params give the index of this launch's first workgroup in each dimension.
// Every param is a u32. Indices are element indices (not bytes) and fit in u32 because the
// launchers check every addressed element against its buffer's length first.
//
// ---- entry point `matmul` ---------------------------------------------------------------------
// Batched C[b] = A[b]·B[b], A[b]: m×k, B[b]: k×n, f32 (or f16 per the build: see the type
// blocks before the entry; the products are summed in f32 in every build).
//   binding 0  uniform MatmulParams
//   binding 1  a: array<mm_elem>, read: A(b, r, c) = a[a_offset + b·a_batch_stride + r·a_row_stride + c·a_col_stride]
//   binding 2  b: array<mm_weight>, read: B(b, r, c) likewise with the b_* params
//   binding 3  c: array<mm_out>, written: contiguous [batch, m, n]
//   binding 4  bias: array<mm_weight>, read: [n], added per column where has_bias = 1
//   binding 5  pending: array<mm_out>, read: [batch, m, n], added to C where has_pending = 1
//              (matmul_params.wgsl: after C's rounding, rounded again; never with split-k)
// A transposed operand just swaps its two strides; a broadcast batch has batch stride 0.
// `a_k_fast` (1 when a_col_stride ≤ a_row_stride) and `b_n_fast` (1 when b_col_stride ≤
// b_row_stride) say which index walks memory fastest, so that neighbouring invocations read
// neighbouring addresses whether or not the operand is transposed.
// Grid: (⌈n/64⌉, ⌈m/64⌉, batch) workgroups, x over column tiles, y over row tiles, z over batch.
// Split-k (`matmul` only, for products with few tiles and a long reduction): with k_splits = S
// > 1 the grid's z runs over batch·S, z = b·S + s; workgroup (…, z) sums k in
// [s·k_chunk, min(k, (s+1)·k_chunk)) and writes c[s, b, m, n] ([S, batch, m, n]); the launcher
// then adds the S slices in order (a reduction kernel). With S = 1 (every other case) it is the
// plain product.
//
// ---- entry point `grouped_matmul` -------------------------------------------------------------
// The MoE expert bank: out[r] = x[r]·W[e_r] (or x[r]·W[e_r]ᵀ when transpose_w = 1), plus the
// expert's bias b[e_r] when has_bias = 1, f32 (x and out mm_elem, w and bias mm_weight: f16 in
// the f16 build, f16 rows with f32 weights in the f16-rows build; f32 sums).
//   binding 0  uniform GroupedParams (rows = R, k, m, experts = n, transpose_w, bases, has_bias)
//   binding 1  x: array<mm_elem>, read, [R, k] row-major
//   binding 2  w: array<mm_weight>, read, [n, k, m] (transpose_w = 0) or [n, m, k] (transpose_w = 1)
//   binding 3  row_expert: array<i32>, read, [R]
//   binding 4  out: array<mm_elem>, written, [R, m]
//   binding 5  bias: array<mm_weight>, read, [n, m] (has_bias = 1; any buffer, unread, otherwise)
// Grid: (⌈m/64⌉, ⌈R/64⌉, 1). A tile's 64 rows are cut into runs of equal expert (rows arrive
// sorted by expert, so a tile usually holds one run, two at a boundary); each run is multiplied
// by its own expert's weights and written, rows of other runs being masked to 0 in A and not
// stored. Rows whose expert is outside 0..n form runs that skip the product and store zeros.
// Unsorted rows are correct too, only slower (up to 64 runs a tile).
//
// ---- entry point `grouped_weight_grad` --------------------------------------------------------
// The expert bank's weight gradient: dW[e] = Σ_{r in offsets[e]..offsets[e+1], row_expert[r] = e}
// x[r]ᵀ·dy[r], f32 (x and dy mm_elem, dw mm_out: f16 and f16, or f16 and f32, per the build;
// f32 sums).
//   binding 0  uniform WeightGradParams (rows = R, k, m, experts = n, bases, row_splits = S,
//              x_ones)
//   binding 1  x: array<mm_elem>, read, [R, k]; with x_ones = 1 unread (any buffer): x is a
//              column of ones (k = 1), and dw[e] = Σ dy[r] is the bank's bias gradient
//   binding 2  dy: array<mm_elem>, read, [R, m]
//   binding 3  row_expert: array<i32>, read, [R]
//   binding 4  offsets: array<i32>, read, [n + 1] (clamped to 0..R on the device)
//   binding 5  dw: array<mm_out>, written, [S, n, k, m]
// Grid: (⌈m/64⌉, ⌈k/64⌉, n·S): one workgroup per (m tile, k tile, expert, split), reducing over
// its share of that expert's rows 16 at a time. Every element of dw is written: an expert with
// no rows (or a split with none) gets 0.
// Row splits (few experts, so few tiles, each with many rows: the bank of a small-n MoE layer):
// with S > 1, z = e·S + s, and split s of expert e sums the rows lo + [s·c, min(len, (s+1)·c))
// of its segment lo..lo+len, c = ⌈len/S⌉ rounded up to a slab (the segment's length is known
// only on the device, so each workgroup cuts its own); it writes slice s of dw, and the launcher
// adds the S slices in order (a reduction kernel). With S = 1 it is the plain gradient.

const TILE: u32 = 64u;
const SLAB: u32 = 16u;
// vec4s per staged row: 64 floats and one vec4 of padding
const ROW4: u32 = 17u;

// Staged slabs: a_tile[kk·ROW4 + r/4][r%4] = A(r, kk), b_tile[kk·ROW4 + c/4][c%4] = B(kk, c).
var<workgroup> a_tile: array<vec4<f32>, 272>;
var<workgroup> b_tile: array<vec4<f32>, 272>;

// One invocation's 4×4 micro-tile: row i of it is `ri`, its four columns the vec4's lanes.
struct Acc {
    r0: vec4<f32>,
    r1: vec4<f32>,
    r2: vec4<f32>,
    r3: vec4<f32>,
}

fn acc_zero() -> Acc {
    let z = vec4<f32>(0.0);
    return Acc(z, z, z, z);
}

// Element l (0..3) of invocation lid's share of a 64×16 A slab, as (row, kk). With k_fast,
// 16 neighbouring invocations walk along k; otherwise 64 walk down the rows.
fn a_slot(lid: u32, l: u32, k_fast: bool) -> vec2<u32> {
    let i = lid + l * 256u;
    if k_fast {
        return vec2<u32>(i >> 4u, i & 15u);
    }
    return vec2<u32>(i & 63u, i >> 6u);
}

// Element l (0..3) of invocation lid's share of a 16×64 B slab, as (kk, col). With n_fast,
// 64 neighbouring invocations walk along the columns; otherwise 16 walk along k.
fn b_slot(lid: u32, l: u32, n_fast: bool) -> vec2<u32> {
    let i = lid + l * 256u;
    if n_fast {
        return vec2<u32>(i >> 6u, i & 63u);
    }
    return vec2<u32>(i & 15u, i >> 4u);
}

// Stores the registers loaded through a_slot / b_slot into the staged slabs. Written out for
// l = 0..3 (and the loads and stores of `matmul` below likewise) rather than as a loop over a
// vec4's components: a component picked by a loop variable is a dynamic index into a register
// vector, which a driver that does not unroll the loop keeps in local memory.
fn stage(lid: u32, a_k_fast: bool, a: vec4<f32>, b_n_fast: bool, b: vec4<f32>) {
    stage_elem(lid, 0u, a_k_fast, a.x, b_n_fast, b.x);
    stage_elem(lid, 1u, a_k_fast, a.y, b_n_fast, b.y);
    stage_elem(lid, 2u, a_k_fast, a.z, b_n_fast, b.z);
    stage_elem(lid, 3u, a_k_fast, a.w, b_n_fast, b.w);
}

fn stage_elem(lid: u32, l: u32, a_k_fast: bool, a: f32, b_n_fast: bool, b: f32) {
    let p = a_slot(lid, l, a_k_fast);
    a_tile[p.y * ROW4 + (p.x >> 2u)][p.x & 3u] = a;
    let q = b_slot(lid, l, b_n_fast);
    b_tile[q.x * ROW4 + (q.y >> 2u)][q.y & 3u] = b;
}

// acc += (staged A rows 4·ty..4·ty+3) · (staged B columns 4·tx..4·tx+3) over one slab.
fn multiply_slab(tx: u32, ty: u32, acc: ptr<function, Acc>) {
    var c = *acc;
    for (var kk = 0u; kk < SLAB; kk++) {
        let a = a_tile[kk * ROW4 + ty];
        let b = b_tile[kk * ROW4 + tx];
        c.r0 = fma(vec4<f32>(a.x), b, c.r0);
        c.r1 = fma(vec4<f32>(a.y), b, c.r1);
        c.r2 = fma(vec4<f32>(a.z), b, c.r2);
        c.r3 = fma(vec4<f32>(a.w), b, c.r3);
    }
    *acc = c;
}

fn acc_row(acc: Acc, i: u32) -> vec4<f32> {
    switch i {
        case 0u: {
            return acc.r0;
        }
        case 1u: {
            return acc.r1;
        }
        case 2u: {
            return acc.r2;
        }
        default: {
            return acc.r3;
        }
    }
}

// ================================================================================================
// matmul

// MatmulParams: shaders/matmul_params.wgsl, which the launcher puts before this file.

// The tensors' types, in three blocks that src/backend/gpu/half.rs rewrites for half precision
// (each alias between a block's markers made `f16`, each store a conversion that rounds once per
// stored element); loads widen to f32 (`f32(...)`) and the sums stay f32 in every build:
//   * element type `mm_elem`: `matmul`'s A, the grouped entries' rows x and dy;
//   * weight type `mm_weight`: `matmul`'s B, the expert bank's weights and biases;
//   * output type `mm_out`: `matmul`'s C and the bank's weight gradient dW (`grouped_matmul`'s
//     rows out are mm_elem).
// The builds: f32 (this text); f16 (`f16_build`: all three f16); f16 rows (`f16_rows_build`:
// element and output f16, weights f32, as mixed precision reads a product's f32 weights and
// an expert bank where they are instead of an f16 copy); f16 operands with f32 outputs
// (`f16_to_f32_build`: element and weight f16, output f32, for the gradient of an f32 weight
// from f16 activations and gradients, written in f32 without a second rounding).
// f16 build: element type
alias mm_elem = f32;
fn mm_store_value(v: f32) -> mm_elem {
    return v;
}
// f16 build: end
// f16 build: weight type
alias mm_weight = f32;
// f16 build: end
// f16 build: output type
alias mm_out = f32;
fn mm_store_out(v: f32) -> mm_out {
    return v;
}
// f16 build: end

@group(0) @binding(0) var<uniform> mp: MatmulParams;
@group(0) @binding(1) var<storage, read> mm_a: array<mm_elem>;
@group(0) @binding(2) var<storage, read> mm_b: array<mm_weight>;
@group(0) @binding(3) var<storage, read_write> mm_c: array<mm_out>;
@group(0) @binding(4) var<storage, read> mm_bias: array<mm_weight>;
@group(0) @binding(5) var<storage, read> mm_pending: array<mm_out>;

// `v` (an output element of column col < n) plus bias[col] when the product has a bias and
// `with_bias` (false for split-k's slices after the first), else `v` itself.
fn mm_biased(v: f32, col: u32, with_bias: bool) -> f32 {
    if mp.has_bias == 0u || !with_bias {
        return v;
    }
    return v + f32(mm_bias[col]);
}

// The value `matmul` (and the wide and subgroup entries) store at output element `at` of column
// col: the sum `v` with its bias (mm_biased) rounded to C's type, plus pending[at] where
// has_pending = 1, added in f32 and rounded again (the bits of a separate `pending + C`).
fn mm_output(v: f32, at: u32, col: u32, with_bias: bool) -> mm_out {
    let y = mm_store_out(mm_biased(v, col, with_bias));
    if mp.has_pending == 0u {
        return y;
    }
    return mm_store_out(f32(mm_pending[at]) + f32(y));
}

// A slab of A: rows m0.., k from k0, elements at k_end or past read as 0.
fn mm_load_a(lid: u32, m0: u32, k0: u32, k_end: u32, base: u32) -> vec4<f32> {
    return vec4<f32>(mm_a_elem(lid, 0u, m0, k0, k_end, base),
                     mm_a_elem(lid, 1u, m0, k0, k_end, base),
                     mm_a_elem(lid, 2u, m0, k0, k_end, base),
                     mm_a_elem(lid, 3u, m0, k0, k_end, base));
}

// Element l of mm_load_a's vector.
fn mm_a_elem(lid: u32, l: u32, m0: u32, k0: u32, k_end: u32, base: u32) -> f32 {
    let p = a_slot(lid, l, mp.a_k_fast != 0u);
    let row = m0 + p.x;
    let kc = k0 + p.y;
    if row < mp.m && kc < k_end {
        return f32(mm_a[base + row * mp.a_row_stride + kc * mp.a_col_stride]);
    }
    return 0.0;
}

// A slab of B: k from k0, columns n0.., elements at k_end or past read as 0.
fn mm_load_b(lid: u32, k0: u32, k_end: u32, n0: u32, base: u32) -> vec4<f32> {
    return vec4<f32>(mm_b_elem(lid, 0u, k0, k_end, n0, base),
                     mm_b_elem(lid, 1u, k0, k_end, n0, base),
                     mm_b_elem(lid, 2u, k0, k_end, n0, base),
                     mm_b_elem(lid, 3u, k0, k_end, n0, base));
}

// Element l of mm_load_b's vector.
fn mm_b_elem(lid: u32, l: u32, k0: u32, k_end: u32, n0: u32, base: u32) -> f32 {
    let q = b_slot(lid, l, mp.b_n_fast != 0u);
    let kc = k0 + q.x;
    let col = n0 + q.y;
    if kc < k_end && col < mp.n {
        return f32(mm_b[base + kc * mp.b_row_stride + col * mp.b_col_stride]);
    }
    return 0.0;
}

// Stores the four values of `v` at row `row` (a row index, inside the matrix), columns
// col0..col0+3, those inside the matrix, with the bias where `with_bias` and the pending
// gradient (see mm_output).
fn mm_store_quad(c_base: u32, row: u32, col0: u32, v: vec4<f32>, with_bias: bool) {
    let r = c_base + row * mp.n;
    if col0 < mp.n {
        mm_c[r + col0] = mm_output(v.x, r + col0, col0, with_bias);
    }
    if col0 + 1u < mp.n {
        mm_c[r + col0 + 1u] = mm_output(v.y, r + col0 + 1u, col0 + 1u, with_bias);
    }
    if col0 + 2u < mp.n {
        mm_c[r + col0 + 2u] = mm_output(v.z, r + col0 + 2u, col0 + 2u, with_bias);
    }
    if col0 + 3u < mp.n {
        mm_c[r + col0 + 3u] = mm_output(v.w, r + col0 + 3u, col0 + 3u, with_bias);
    }
}

@compute @workgroup_size(16, 16, 1)
fn matmul(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let z = mp.batch_base + wid.z;
    let bi = z / mp.k_splits;
    let split = z % mp.k_splits;
    if bi >= mp.batch {
        return;
    }
    let k_begin = split * mp.k_chunk;
    let k_end = min(mp.k, k_begin + mp.k_chunk);
    let tx = lid & 15u;
    let ty = lid >> 4u;
    let n0 = (mp.tile_n_base + wid.x) * TILE;
    let m0 = (mp.tile_m_base + wid.y) * TILE;
    let a_base = mp.a_offset + bi * mp.a_batch_stride;
    let b_base = mp.b_offset + bi * mp.b_batch_stride;
    let a_fast = mp.a_k_fast != 0u;
    let b_fast = mp.b_n_fast != 0u;

    var acc = acc_zero();
    var ra = mm_load_a(lid, m0, k_begin, k_end, a_base);
    var rb = mm_load_b(lid, k_begin, k_end, n0, b_base);
    let slabs = (k_end - k_begin + SLAB - 1u) / SLAB;
    for (var s = 0u; s < slabs; s++) {
        stage(lid, a_fast, ra, b_fast, rb);
        workgroupBarrier();
        if s + 1u < slabs {
            let k0 = k_begin + (s + 1u) * SLAB;
            ra = mm_load_a(lid, m0, k0, k_end, a_base);
            rb = mm_load_b(lid, k0, k_end, n0, b_base);
        }
        multiply_slab(tx, ty, &acc);
        workgroupBarrier();
    }

    // slice `split` of a split-k product's [k_splits, batch, m, n] partial sums (the product
    // itself when k_splits = 1)
    let c_base = (split * mp.batch + bi) * mp.m * mp.n;
    let row0 = m0 + ty * 4u;
    let col0 = n0 + tx * 4u;
    // the bias once: in the first slice of a split-k product
    let with_bias = split == 0u;
    if row0 < mp.m {
        mm_store_quad(c_base, row0, col0, acc.r0, with_bias);
    }
    if row0 + 1u < mp.m {
        mm_store_quad(c_base, row0 + 1u, col0, acc.r1, with_bias);
    }
    if row0 + 2u < mp.m {
        mm_store_quad(c_base, row0 + 2u, col0, acc.r2, with_bias);
    }
    if row0 + 3u < mp.m {
        mm_store_quad(c_base, row0 + 3u, col0, acc.r3, with_bias);
    }
}

// ================================================================================================
// grouped_matmul

struct GroupedParams {
    rows: u32,
    k: u32,
    m: u32,
    experts: u32,
    transpose_w: u32,
    // first column tile and row tile of this launch
    tile_c_base: u32,
    tile_r_base: u32,
    // 1: add bias[e] to each row of expert e
    has_bias: u32,
}

// The expert weights and biases are `mm_weight` (f32 in the f16-rows build, so mixed
// precision's banks are read straight from their f32 master copies: see the element blocks above).

@group(0) @binding(0) var<uniform> gp: GroupedParams;
@group(0) @binding(1) var<storage, read> gm_x: array<mm_elem>;
@group(0) @binding(2) var<storage, read> gm_w: array<mm_weight>;
@group(0) @binding(3) var<storage, read> gm_expert: array<i32>;
@group(0) @binding(4) var<storage, read_write> gm_out: array<mm_elem>;
@group(0) @binding(5) var<storage, read> gm_bias: array<mm_weight>;

// Expert of each of the tile's rows (-1 for an expert outside 0..n), and for each row the end of
// the run of equal experts it starts; room for the 128 rows of `grouped_matmul_wide`'s tiles
// (matmul_wide.wgsl), which shares them.
var<workgroup> run_expert: array<i32, 128>;
var<workgroup> run_end: array<u32, 128>;

// Fills run_expert and run_end for the tile_rows rows from r0 (one invocation per row, lid <
// tile_rows); every invocation calls it, and it ends with the workgroup's writes visible.
fn mark_runs(lid: u32, r0: u32, tile_rows: u32) {
    if lid < tile_rows {
        var e = gm_expert[r0 + lid];
        if e < 0 || u32(e) >= gp.experts {
            e = -1;
        }
        run_expert[lid] = e;
    }
    workgroupBarrier();
    if lid < tile_rows {
        let e = run_expert[lid];
        var end = lid + 1u;
        while end < tile_rows && run_expert[end] == e {
            end++;
        }
        run_end[lid] = end;
    }
}

// A slab of x: tile rows [lo, hi) only, the others read as 0. (Written out for l = 0..3, as
// `stage` is, and so are the other loads and stores of the grouped kernels.)
fn gm_load_x(lid: u32, r0: u32, lo: u32, hi: u32, k0: u32) -> vec4<f32> {
    return vec4<f32>(gm_x_elem(lid, 0u, r0, lo, hi, k0), gm_x_elem(lid, 1u, r0, lo, hi, k0),
                     gm_x_elem(lid, 2u, r0, lo, hi, k0), gm_x_elem(lid, 3u, r0, lo, hi, k0));
}

fn gm_x_elem(lid: u32, l: u32, r0: u32, lo: u32, hi: u32, k0: u32) -> f32 {
    return gm_x_at(a_slot(lid, l, true), r0, lo, hi, k0);
}

// The x slab's element at p = (tile row, kk) from k0: tile rows [lo, hi) only, 0 elsewhere
// (both grouped kernels, each with its own slot map).
fn gm_x_at(p: vec2<u32>, r0: u32, lo: u32, hi: u32, k0: u32) -> f32 {
    let kc = k0 + p.y;
    if p.x >= lo && p.x < hi && kc < gp.k {
        return f32(gm_x[(r0 + p.x) * gp.k + kc]);
    }
    return 0.0;
}

// A slab of W[e] (or W[e]ᵀ), as the k×m right operand.
fn gm_load_w(lid: u32, k0: u32, c0: u32, base: u32) -> vec4<f32> {
    return vec4<f32>(gm_w_elem(lid, 0u, k0, c0, base), gm_w_elem(lid, 1u, k0, c0, base),
                     gm_w_elem(lid, 2u, k0, c0, base), gm_w_elem(lid, 3u, k0, c0, base));
}

fn gm_w_elem(lid: u32, l: u32, k0: u32, c0: u32, base: u32) -> f32 {
    return gm_w_at(b_slot(lid, l, gp.transpose_w == 0u), k0, c0, base);
}

// The slab of W[e] (or W[e]ᵀ) at q = (kk, column) from (k0, c0), as the k×m operand, 0 outside
// (both grouped kernels, each with its own slot map).
fn gm_w_at(q: vec2<u32>, k0: u32, c0: u32, base: u32) -> f32 {
    let n_fast = gp.transpose_w == 0u;
    let kc = k0 + q.x;
    let col = c0 + q.y;
    if kc < gp.k && col < gp.m {
        if n_fast {
            return f32(gm_w[base + kc * gp.m + col]);
        }
        return f32(gm_w[base + col * gp.k + kc]);
    }
    return 0.0;
}

// Stores output row `row` (of the whole output), columns col0..col0+3 from `v` (plus expert
// e's bias when with_bias), those inside the matrix.
fn gm_store_quad(row: u32, col0: u32, v: vec4<f32>, with_bias: bool, e: i32) {
    gm_store_one(row, col0, v.x, with_bias, e);
    gm_store_one(row, col0 + 1u, v.y, with_bias, e);
    gm_store_one(row, col0 + 2u, v.z, with_bias, e);
    gm_store_one(row, col0 + 3u, v.w, with_bias, e);
}

fn gm_store_one(row: u32, col: u32, value: f32, with_bias: bool, e: i32) {
    if col < gp.m {
        var out = value;
        if with_bias {
            out += f32(gm_bias[u32(e) * gp.m + col]);
        }
        gm_out[row * gp.m + col] = mm_store_value(out);
    }
}

@compute @workgroup_size(16, 16, 1)
fn grouped_matmul(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let r0 = (gp.tile_r_base + wid.y) * TILE;
    if r0 >= gp.rows {
        return;
    }
    let tx = lid & 15u;
    let ty = lid >> 4u;
    let c0 = (gp.tile_c_base + wid.x) * TILE;
    let tile_rows = min(TILE, gp.rows - r0);
    let n_fast = gp.transpose_w == 0u;

    mark_runs(lid, r0, tile_rows);

    // One pass per run of equal experts; workgroupUniformLoad (a barrier, then a load every
    // invocation agrees on) makes the run bounds uniform so the slab loop may use barriers.
    var lo = 0u;
    loop {
        if lo >= tile_rows {
            break;
        }
        let e = workgroupUniformLoad(&run_expert[lo]);
        let hi = workgroupUniformLoad(&run_end[lo]);
        var acc = acc_zero();
        if e >= 0 {
            let w_base = u32(e) * gp.k * gp.m;
            var ra = gm_load_x(lid, r0, lo, hi, 0u);
            var rb = gm_load_w(lid, 0u, c0, w_base);
            let slabs = (gp.k + SLAB - 1u) / SLAB;
            for (var s = 0u; s < slabs; s++) {
                stage(lid, true, ra, n_fast, rb);
                workgroupBarrier();
                if s + 1u < slabs {
                    ra = gm_load_x(lid, r0, lo, hi, (s + 1u) * SLAB);
                    rb = gm_load_w(lid, (s + 1u) * SLAB, c0, w_base);
                }
                multiply_slab(tx, ty, &acc);
                workgroupBarrier();
            }
        }
        // rows of this run only (zeros for an out-of-range expert, which gets no bias either)
        let with_bias = gp.has_bias == 1u && e >= 0;
        for (var i = 0u; i < 4u; i++) {
            let tr = ty * 4u + i;
            if tr >= lo && tr < hi {
                gm_store_quad(r0 + tr, c0 + tx * 4u, acc_row(acc, i), with_bias, e);
            }
        }
        lo = hi;
    }
}

// ================================================================================================
// grouped_weight_grad

struct WeightGradParams {
    rows: u32,
    k: u32,
    m: u32,
    experts: u32,
    // first m tile, k tile and (expert, split) of this launch
    tile_c_base: u32,
    tile_k_base: u32,
    expert_base: u32,
    // S: the ranges each expert's rows are cut into (1: none)
    row_splits: u32,
    // 1: x is a column of ones, not read (the bias gradient)
    x_ones: u32,
}

@group(0) @binding(0) var<uniform> wp: WeightGradParams;
@group(0) @binding(1) var<storage, read> wg_x: array<mm_elem>;
@group(0) @binding(2) var<storage, read> wg_dy: array<mm_elem>;
@group(0) @binding(3) var<storage, read> wg_expert: array<i32>;
@group(0) @binding(4) var<storage, read> wg_offsets: array<i32>;
@group(0) @binding(5) var<storage, read_write> wg_dw: array<mm_out>;

// Loads one slab: A(i, rr) = x[row, k0 + i] and B(rr, c) = dy[row, c0 + c] for the 16 rows
// row = first + rr, both 0 unless row < hi and row_expert[row] = e. The A slot (rows fast) and
// the B slot (columns fast) of element l name the same rr, so row_expert is read once.
fn wg_load(lid: u32, first: u32, hi: u32, e: i32, k0: u32, c0: u32) -> array<vec4<f32>, 2> {
    let v0 = wg_elem(lid, 0u, first, hi, e, k0, c0);
    let v1 = wg_elem(lid, 1u, first, hi, e, k0, c0);
    let v2 = wg_elem(lid, 2u, first, hi, e, k0, c0);
    let v3 = wg_elem(lid, 3u, first, hi, e, k0, c0);
    return array<vec4<f32>, 2>(vec4<f32>(v0.x, v1.x, v2.x, v3.x),
                               vec4<f32>(v0.y, v1.y, v2.y, v3.y));
}

// Element l of wg_load's A and B vectors, as (a, b).
fn wg_elem(lid: u32, l: u32, first: u32, hi: u32, e: i32, k0: u32, c0: u32) -> vec2<f32> {
    var v = vec2<f32>(0.0);
    let p = a_slot(lid, l, false);
    let q = b_slot(lid, l, true);
    let row = first + p.y;
    if row < hi && wg_expert[row] == e {
        if k0 + p.x < wp.k {
            if wp.x_ones == 1u {
                v.x = 1.0;
            } else {
                v.x = f32(wg_x[row * wp.k + k0 + p.x]);
            }
        }
        if c0 + q.y < wp.m {
            v.y = f32(wg_dy[row * wp.m + c0 + q.y]);
        }
    }
    return v;
}

// Stores dW[e] row `row`, columns col0..col0+3 from `v`, those inside the matrix.
fn wg_store_quad(base: u32, row: u32, col0: u32, v: vec4<f32>) {
    let r = base + row * wp.m;
    if col0 < wp.m {
        wg_dw[r + col0] = mm_store_out(v.x);
    }
    if col0 + 1u < wp.m {
        wg_dw[r + col0 + 1u] = mm_store_out(v.y);
    }
    if col0 + 2u < wp.m {
        wg_dw[r + col0 + 2u] = mm_store_out(v.z);
    }
    if col0 + 3u < wp.m {
        wg_dw[r + col0 + 3u] = mm_store_out(v.w);
    }
}

@compute @workgroup_size(16, 16, 1)
fn grouped_weight_grad(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let z = wp.expert_base + wid.z;
    let e = z / wp.row_splits;
    let split = z % wp.row_splits;
    if e >= wp.experts {
        return;
    }
    let tx = lid & 15u;
    let ty = lid >> 4u;
    let c0 = (wp.tile_c_base + wid.x) * TILE;
    let k0 = (wp.tile_k_base + wid.y) * TILE;
    let rows = i32(wp.rows);
    let first = u32(clamp(wg_offsets[e], 0, rows));
    let last = max(first, u32(clamp(wg_offsets[e + 1u], 0, rows)));
    // this split's share of the segment (all of it when row_splits = 1)
    let share = ((last - first + wp.row_splits - 1u) / wp.row_splits + SLAB - 1u) / SLAB * SLAB;
    let lo = min(last, first + split * share);
    let hi = min(last, lo + share);

    var acc = acc_zero();
    let slabs = (hi - lo + SLAB - 1u) / SLAB;
    var r = wg_load(lid, lo, hi, i32(e), k0, c0);
    for (var s = 0u; s < slabs; s++) {
        stage(lid, false, r[0], true, r[1]);
        workgroupBarrier();
        if s + 1u < slabs {
            r = wg_load(lid, lo + (s + 1u) * SLAB, hi, i32(e), k0, c0);
        }
        multiply_slab(tx, ty, &acc);
        workgroupBarrier();
    }

    let base = (split * wp.experts + e) * wp.k * wp.m;
    for (var i = 0u; i < 4u; i++) {
        let row = k0 + ty * 4u + i;
        if row < wp.k {
            wg_store_quad(base, row, c0 + tx * 4u, acc_row(acc, i));
        }
    }
}
