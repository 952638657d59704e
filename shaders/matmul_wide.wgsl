// matmul_wide.wgsl: entry points `matmul_wide`, the batched matmul of matmul.wgsl with a 128×128
// output tile and an 8×8 micro-tile per invocation, for products large enough to fill a GPU with
// such tiles, and `grouped_matmul_wide`, the expert bank's grouped matmul with the same tiling
// (at the end of the file). Not a module of its own: the launcher (src/backend/gpu/matmul.rs) compiles
// matmul.wgsl + this file, and runs it when the product has enough 128×128 tiles (`Auto`,
// `WIDE_MIN_GROUPS` there) or when MOEGRAD_MATMUL=wide.
//
// Same params, bindings and types as `matmul` (MatmulParams, mm_a, mm_b, mm_c; f32, or f16 per
// the build, through matmul.wgsl's type blocks like `matmul`). What differs is the tiling:
//   * a workgroup of 256 invocations computes one 128×128 tile of the output;
//   * invocation (tx, ty) = (lid % 16, lid / 16) owns an 8×8 micro-tile: rows 4·ty..4·ty+3 and
//     64+4·ty..64+4·ty+3 of the tile, columns 4·tx..4·tx+3 and 64+4·tx..64+4·tx+3, in sixteen
//     vec4 registers: acc[2·i + h] is micro-tile row i (the first four rows, then the four 64
//     further down) and column half h (h = 1: 64 columns to the right);
//   * the reduction runs in slabs of 8: each invocation loads 4 elements of the 128×8 A slab and
//     4 of the 8×128 B slab into registers (the next slab is fetched while the current one is
//     multiplied), stores them into workgroup memory, and then does 8 steps of "two vec4 of A,
//     two vec4 of B, 64 FMAs": twice `matmul`'s FMAs per value read from workgroup memory;
//   * workgroup memory holds each slab k-major as rows of 33 vec4 (128 floats and one vec4 of
//     padding); 2 × 8 × 33 × 16 B = 8.25 KiB;
//   * out-of-range elements load as 0 and are never stored (any m, n, k).
// Each output element is the same chain of FMAs over k = 0, 1, 2, … as in `matmul`, so the two
// kernels agree to the bit on the same adapter (tests/gpu_matmul.rs checks it).
// Grid: (⌈n/128⌉, ⌈m/128⌉, batch) workgroups, split on the host past 65535 per dimension (the
// `*_base` params).

const WIDE: u32 = 128u;
const WIDE_SLAB: u32 = 8u;
// vec4s per staged row: 128 floats and one vec4 of padding
const WIDE_ROW4: u32 = 33u;

// Staged slabs: wa_tile[kk·WIDE_ROW4 + r/4][r%4] = A(r, kk), wb_tile[kk·WIDE_ROW4 + c/4][c%4] = B(kk, c).
var<workgroup> wa_tile: array<vec4<f32>, 264>;
var<workgroup> wb_tile: array<vec4<f32>, 264>;

// Element l (0..3) of invocation lid's share of a 128×8 A slab, as (row, kk). With k_fast,
// 8 neighbouring invocations walk along k; otherwise 128 walk down the rows.
fn wa_slot(lid: u32, l: u32, k_fast: bool) -> vec2<u32> {
    let i = lid + l * 256u;
    if k_fast {
        return vec2<u32>(i >> 3u, i & 7u);
    }
    return vec2<u32>(i & 127u, i >> 7u);
}

// Element l (0..3) of invocation lid's share of an 8×128 B slab, as (kk, col). With n_fast,
// 128 neighbouring invocations walk along the columns; otherwise 8 walk along k.
fn wb_slot(lid: u32, l: u32, n_fast: bool) -> vec2<u32> {
    let i = lid + l * 256u;
    if n_fast {
        return vec2<u32>(i >> 7u, i & 127u);
    }
    return vec2<u32>(i & 7u, i >> 3u);
}

// The loads, the staging and the stores below are written out for l (or j) = 0, 1, 2, 3 rather
// than as loops over a vec4's components: a component picked by a loop variable is a dynamic
// index into a register vector, which a driver that does not unroll the loop keeps in local
// memory. Written out, every index is a constant whatever the driver does (same bits).

// Element l of invocation lid's share of the A slab at k0 (0 outside the matrix).
fn wide_a_elem(lid: u32, l: u32, m0: u32, k0: u32, base: u32) -> f32 {
    let p = wa_slot(lid, l, mp.a_k_fast != 0u);
    let row = m0 + p.x;
    let kc = k0 + p.y;
    if row < mp.m && kc < mp.k {
        return f32(mm_a[base + row * mp.a_row_stride + kc * mp.a_col_stride]);
    }
    return 0.0;
}

fn wide_load_a(lid: u32, m0: u32, k0: u32, base: u32) -> vec4<f32> {
    return vec4<f32>(wide_a_elem(lid, 0u, m0, k0, base), wide_a_elem(lid, 1u, m0, k0, base),
                     wide_a_elem(lid, 2u, m0, k0, base), wide_a_elem(lid, 3u, m0, k0, base));
}

// Element l of invocation lid's share of the B slab at k0 (0 outside the matrix).
fn wide_b_elem(lid: u32, l: u32, k0: u32, n0: u32, base: u32) -> f32 {
    let q = wb_slot(lid, l, mp.b_n_fast != 0u);
    let kc = k0 + q.x;
    let col = n0 + q.y;
    if kc < mp.k && col < mp.n {
        return f32(mm_b[base + kc * mp.b_row_stride + col * mp.b_col_stride]);
    }
    return 0.0;
}

fn wide_load_b(lid: u32, k0: u32, n0: u32, base: u32) -> vec4<f32> {
    return vec4<f32>(wide_b_elem(lid, 0u, k0, n0, base), wide_b_elem(lid, 1u, k0, n0, base),
                     wide_b_elem(lid, 2u, k0, n0, base), wide_b_elem(lid, 3u, k0, n0, base));
}

// Stores element l of the registers loaded through wa_slot / wb_slot into the staged slabs.
fn wide_stage_elem(lid: u32, l: u32, a_k_fast: bool, a: f32, b_n_fast: bool, b: f32) {
    let p = wa_slot(lid, l, a_k_fast);
    wa_tile[p.y * WIDE_ROW4 + (p.x >> 2u)][p.x & 3u] = a;
    let q = wb_slot(lid, l, b_n_fast);
    wb_tile[q.x * WIDE_ROW4 + (q.y >> 2u)][q.y & 3u] = b;
}

fn wide_stage(lid: u32, a_k_fast: bool, a: vec4<f32>, b_n_fast: bool, b: vec4<f32>) {
    wide_stage_elem(lid, 0u, a_k_fast, a.x, b_n_fast, b.x);
    wide_stage_elem(lid, 1u, a_k_fast, a.y, b_n_fast, b.y);
    wide_stage_elem(lid, 2u, a_k_fast, a.z, b_n_fast, b.z);
    wide_stage_elem(lid, 3u, a_k_fast, a.w, b_n_fast, b.w);
}

// The 8 steps of one staged slab for invocation (tx, ty): per step two vec4 of A, two of B and
// 64 FMAs into its sixteen accumulators (acc[2·i + h]: micro-tile row i, column half h).
fn wide_multiply_slab(tx: u32, ty: u32, acc: ptr<function, array<vec4<f32>, 16>>) {
    for (var kk = 0u; kk < WIDE_SLAB; kk++) {
        let a0 = wa_tile[kk * WIDE_ROW4 + ty];
        let a1 = wa_tile[kk * WIDE_ROW4 + ty + 16u];
        let b0 = wb_tile[kk * WIDE_ROW4 + tx];
        let b1 = wb_tile[kk * WIDE_ROW4 + tx + 16u];
        (*acc)[0] = fma(vec4<f32>(a0.x), b0, (*acc)[0]);
        (*acc)[1] = fma(vec4<f32>(a0.x), b1, (*acc)[1]);
        (*acc)[2] = fma(vec4<f32>(a0.y), b0, (*acc)[2]);
        (*acc)[3] = fma(vec4<f32>(a0.y), b1, (*acc)[3]);
        (*acc)[4] = fma(vec4<f32>(a0.z), b0, (*acc)[4]);
        (*acc)[5] = fma(vec4<f32>(a0.z), b1, (*acc)[5]);
        (*acc)[6] = fma(vec4<f32>(a0.w), b0, (*acc)[6]);
        (*acc)[7] = fma(vec4<f32>(a0.w), b1, (*acc)[7]);
        (*acc)[8] = fma(vec4<f32>(a1.x), b0, (*acc)[8]);
        (*acc)[9] = fma(vec4<f32>(a1.x), b1, (*acc)[9]);
        (*acc)[10] = fma(vec4<f32>(a1.y), b0, (*acc)[10]);
        (*acc)[11] = fma(vec4<f32>(a1.y), b1, (*acc)[11]);
        (*acc)[12] = fma(vec4<f32>(a1.z), b0, (*acc)[12]);
        (*acc)[13] = fma(vec4<f32>(a1.z), b1, (*acc)[13]);
        (*acc)[14] = fma(vec4<f32>(a1.w), b0, (*acc)[14]);
        (*acc)[15] = fma(vec4<f32>(a1.w), b1, (*acc)[15]);
    }
}

@compute @workgroup_size(256)
fn matmul_wide(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let bi = mp.batch_base + wid.z;
    if bi >= mp.batch {
        return;
    }
    let tx = lid & 15u;
    let ty = lid >> 4u;
    let n0 = (mp.tile_n_base + wid.x) * WIDE;
    let m0 = (mp.tile_m_base + wid.y) * WIDE;
    let a_base = mp.a_offset + bi * mp.a_batch_stride;
    let b_base = mp.b_offset + bi * mp.b_batch_stride;
    let a_fast = mp.a_k_fast != 0u;
    let b_fast = mp.b_n_fast != 0u;

    var acc: array<vec4<f32>, 16>;
    var ra = wide_load_a(lid, m0, 0u, a_base);
    var rb = wide_load_b(lid, 0u, n0, b_base);
    let slabs = (mp.k + WIDE_SLAB - 1u) / WIDE_SLAB;
    for (var s = 0u; s < slabs; s++) {
        wide_stage(lid, a_fast, ra, b_fast, rb);
        workgroupBarrier();
        if s + 1u < slabs {
            ra = wide_load_a(lid, m0, (s + 1u) * WIDE_SLAB, a_base);
            rb = wide_load_b(lid, (s + 1u) * WIDE_SLAB, n0, b_base);
        }
        wide_multiply_slab(tx, ty, &acc);
        workgroupBarrier();
    }

    // constant indices into acc throughout, so that it can stay in registers
    let c_base = bi * mp.m * mp.n;
    let r0 = m0 + ty * 4u;
    let c0 = n0 + tx * 4u;
    wide_store_row(c_base, r0, c0, acc[0], acc[1]);
    wide_store_row(c_base, r0 + 1u, c0, acc[2], acc[3]);
    wide_store_row(c_base, r0 + 2u, c0, acc[4], acc[5]);
    wide_store_row(c_base, r0 + 3u, c0, acc[6], acc[7]);
    wide_store_row(c_base, r0 + 64u, c0, acc[8], acc[9]);
    wide_store_row(c_base, r0 + 65u, c0, acc[10], acc[11]);
    wide_store_row(c_base, r0 + 66u, c0, acc[12], acc[13]);
    wide_store_row(c_base, r0 + 67u, c0, acc[14], acc[15]);
}

// Stores one micro-tile row: columns c0..c0+3 from `left`, c0+64..c0+67 from `right`, those
// inside the matrix.
fn wide_store_row(c_base: u32, row: u32, c0: u32, left: vec4<f32>, right: vec4<f32>) {
    if row >= mp.m {
        return;
    }
    let r = c_base + row * mp.n;
    wide_store_pair(r, c0, left.x, right.x);
    wide_store_pair(r, c0 + 1u, left.y, right.y);
    wide_store_pair(r, c0 + 2u, left.z, right.z);
    wide_store_pair(r, c0 + 3u, left.w, right.w);
}

// Stores `left` at column col and `right` at col + 64 of the row starting at `row_base`, where
// inside the matrix, each with its column's bias (has_bias = 1) and its pending gradient
// (has_pending = 1; see mm_output).
fn wide_store_pair(row_base: u32, col: u32, left: f32, right: f32) {
    if col < mp.n {
        mm_c[row_base + col] = mm_output(left, row_base + col, col, true);
    }
    if col + 64u < mp.n {
        mm_c[row_base + col + 64u] = mm_output(right, row_base + col + 64u, col + 64u, true);
    }
}

// ================================================================================================
// grouped_matmul_wide: `grouped_matmul` (matmul.wgsl: same GroupedParams, bindings and types)
// with this file's tiling: 128×128 output tiles, an 8×8 micro-tile per invocation, slabs of 8.
// A tile's 128 rows are cut into runs of equal expert as `grouped_matmul` cuts its 64; each run
// is multiplied by its expert's weights (rows of other runs load as 0) and stored, with the
// expert's bias when has_bias = 1; rows of an expert outside 0..n store zeros. Each output is the
// same chain of FMAs over k as in `grouped_matmul`, then the bias added, so the two agree to the
// bit. Grid: (⌈m/128⌉, ⌈R/128⌉, 1), split on the host past 65535 per dimension (the bases).

// The slabs of x (tile rows [lo, hi) only) and of W[e] (or W[e]ᵀ) at k0, invocation lid's four
// elements of each through this file's slot maps, read by matmul.wgsl's gm_x_at / gm_w_at.
fn gw_load_x(lid: u32, r0: u32, lo: u32, hi: u32, k0: u32) -> vec4<f32> {
    return vec4<f32>(gm_x_at(wa_slot(lid, 0u, true), r0, lo, hi, k0),
                     gm_x_at(wa_slot(lid, 1u, true), r0, lo, hi, k0),
                     gm_x_at(wa_slot(lid, 2u, true), r0, lo, hi, k0),
                     gm_x_at(wa_slot(lid, 3u, true), r0, lo, hi, k0));
}

fn gw_load_w(lid: u32, k0: u32, c0: u32, base: u32) -> vec4<f32> {
    let n_fast = gp.transpose_w == 0u;
    return vec4<f32>(gm_w_at(wb_slot(lid, 0u, n_fast), k0, c0, base),
                     gm_w_at(wb_slot(lid, 1u, n_fast), k0, c0, base),
                     gm_w_at(wb_slot(lid, 2u, n_fast), k0, c0, base),
                     gm_w_at(wb_slot(lid, 3u, n_fast), k0, c0, base));
}

// Stores tile row tr (whole-output row r0 + tr) of the run [lo, hi): columns c0..c0+3 from
// `left` and c0+64..c0+67 from `right`, those inside the matrix (gm_store_quad adds the bias).
fn gw_store_row(r0: u32, tr: u32, lo: u32, hi: u32, c0: u32, halves: array<vec4<f32>, 2>,
                with_bias: bool, e: i32) {
    if tr >= lo && tr < hi {
        gm_store_quad(r0 + tr, c0, halves[0], with_bias, e);
        gm_store_quad(r0 + tr, c0 + 64u, halves[1], with_bias, e);
    }
}

@compute @workgroup_size(256)
fn grouped_matmul_wide(@builtin(local_invocation_index) lid: u32,
                       @builtin(workgroup_id) wid: vec3<u32>) {
    let r0 = (gp.tile_r_base + wid.y) * WIDE;
    if r0 >= gp.rows {
        return;
    }
    let tx = lid & 15u;
    let ty = lid >> 4u;
    let c0 = (gp.tile_c_base + wid.x) * WIDE;
    let tile_rows = min(WIDE, gp.rows - r0);
    let n_fast = gp.transpose_w == 0u;

    // matmul.wgsl's run_expert / run_end, filled for this tile's 128 rows
    mark_runs(lid, r0, tile_rows);

    // one pass per run of equal experts, its bounds made uniform as in grouped_matmul
    var lo = 0u;
    loop {
        if lo >= tile_rows {
            break;
        }
        let e = workgroupUniformLoad(&run_expert[lo]);
        let hi = workgroupUniformLoad(&run_end[lo]);
        var acc: array<vec4<f32>, 16>;
        if e >= 0 {
            let w_base = u32(e) * gp.k * gp.m;
            var ra = gw_load_x(lid, r0, lo, hi, 0u);
            var rb = gw_load_w(lid, 0u, c0, w_base);
            let slabs = (gp.k + WIDE_SLAB - 1u) / WIDE_SLAB;
            for (var s = 0u; s < slabs; s++) {
                wide_stage(lid, true, ra, n_fast, rb);
                workgroupBarrier();
                if s + 1u < slabs {
                    ra = gw_load_x(lid, r0, lo, hi, (s + 1u) * WIDE_SLAB);
                    rb = gw_load_w(lid, (s + 1u) * WIDE_SLAB, c0, w_base);
                }
                wide_multiply_slab(tx, ty, &acc);
                workgroupBarrier();
            }
        }
        // rows of this run only (zeros for an out-of-range expert, which gets no bias either);
        // constant indices into acc throughout
        let with_bias = gp.has_bias == 1u && e >= 0;
        let c = c0 + tx * 4u;
        let t = ty * 4u;
        gw_store_row(r0, t, lo, hi, c, array(acc[0], acc[1]), with_bias, e);
        gw_store_row(r0, t + 1u, lo, hi, c, array(acc[2], acc[3]), with_bias, e);
        gw_store_row(r0, t + 2u, lo, hi, c, array(acc[4], acc[5]), with_bias, e);
        gw_store_row(r0, t + 3u, lo, hi, c, array(acc[6], acc[7]), with_bias, e);
        gw_store_row(r0, t + 64u, lo, hi, c, array(acc[8], acc[9]), with_bias, e);
        gw_store_row(r0, t + 65u, lo, hi, c, array(acc[10], acc[11]), with_bias, e);
        gw_store_row(r0, t + 66u, lo, hi, c, array(acc[12], acc[13]), with_bias, e);
        gw_store_row(r0, t + 67u, lo, hi, c, array(acc[14], acc[15]), with_bias, e);
        lo = hi;
    }
}
