// matmul_wide4.wgsl: entry point `matmul_wide4`, the wide matmul of matmul_wide.wgsl (128×128
// output tiles, an 8×8 micro-tile per invocation, slabs of 8) with every global access a vec4:
// each invocation reads one vec4 of the A slab and one of the B slab per slab (where
// `matmul_wide` reads four scalars of each, each with its own bounds test), and writes its
// output rows as vec4s. f32 only. Not a module of its own: the launcher
// (src/backend/gpu/matmul.rs) compiles matmul_params.wgsl + this file, and runs it when
// MOEGRAD_MATMUL=wide-vec4 asks and the operands allow vec4 access (`vec4_layouts` there);
// otherwise `matmul_wide` runs.
//
//   binding 0  uniform MatmulParams (matmul_params.wgsl), filled as for `matmul`
//   binding 1  a: array<vec4<f32>>, read: A(b, r, c) = element a_offset + b·a_batch_stride
//              + r·a_row_stride + c·a_col_stride of the buffer seen as f32s
//   binding 2  b: array<vec4<f32>>, read: B likewise with the b_* params
//   binding 3  c: array<vec4<f32>>, written: contiguous [batch, m, n]
//   binding 4  bias: array<vec4<f32>>, read: [n], added per column where has_bias = 1
//   binding 5  pending: array<vec4<f32>>, read: [batch, m, n] like c, added to it where
//              has_pending = 1 (matmul_params.wgsl)
// What the launcher guarantees (else it runs `matmul_wide`): n is a multiple of 4; each operand
// has one contiguous axis (stride 1) whose length is a multiple of 4, and its offset, batch
// stride and other stride are multiples of 4. So every vec4 read or written lies wholly inside
// or wholly outside the matrix, and is aligned.
//   * A with k contiguous (a_k_fast = 1): invocation lid reads A(r, k0 + q..q+3), r = lid / 2,
//     q = 4·(lid % 2), and stores its four lanes down the staged column; with m contiguous it
//     reads A(4·(lid % 32)..+3, k0 + lid / 32), which is one staged vec4 as it is.
//   * B with n contiguous (b_n_fast = 1): B(k0 + lid / 32, 4·(lid % 32)..+3), one staged vec4;
//     with k contiguous: B(k0 + q..q+3, c), c = lid / 2, q = 4·(lid % 2), four lanes.
// Staging, the multiply and the FMA chain per output element (over k = 0, 1, 2, … in order,
// zeros past k) are `matmul_wide`'s, so the two agree to the bit (tests: gpu_matmul_kernels.rs).
// Grid: (⌈n/128⌉, ⌈m/128⌉, batch) workgroups, split on the host past 65535 per dimension (the
// `*_base` params).

const W4_TILE: u32 = 128u;
const W4_SLAB: u32 = 8u;
// vec4s per staged row: 128 floats and one vec4 of padding
const W4_ROW4: u32 = 33u;

@group(0) @binding(0) var<uniform> mp: MatmulParams;
@group(0) @binding(1) var<storage, read> w4_a: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> w4_b: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> w4_c: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read> w4_bias: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read> w4_pending: array<vec4<f32>>;

// `v` (columns c0..c0+3, c0 a multiple of 4 below n) plus their bias where has_bias = 1.
fn w4_biased(v: vec4<f32>, c0: u32) -> vec4<f32> {
    if mp.has_bias == 0u {
        return v;
    }
    return v + w4_bias[c0 >> 2u];
}

// The vec4 stored at element `at` (a multiple of 4) of columns c0..c0+3: w4_biased, plus the
// pending gradient there where has_pending = 1 (`pending + C`, as matmul.wgsl's mm_output).
fn w4_output(v: vec4<f32>, at: u32, c0: u32) -> vec4<f32> {
    let y = w4_biased(v, c0);
    if mp.has_pending == 0u {
        return y;
    }
    return w4_pending[at >> 2u] + y;
}

// Staged slabs: w4a_tile[kk·W4_ROW4 + r/4][r%4] = A(r, kk), w4b_tile[kk·W4_ROW4 + c/4][c%4] = B(kk, c).
var<workgroup> w4a_tile: array<vec4<f32>, 264>;
var<workgroup> w4b_tile: array<vec4<f32>, 264>;

// Invocation lid's vec4 of the A slab (rows m0.., k from k0), 0 outside the matrix.
fn w4_load_a(lid: u32, m0: u32, k0: u32, base: u32) -> vec4<f32> {
    if mp.a_k_fast != 0u {
        let row = m0 + (lid >> 1u);
        let kc = k0 + (lid & 1u) * 4u;
        if row < mp.m && kc < mp.k {
            return w4_a[(base + row * mp.a_row_stride + kc) >> 2u];
        }
    } else {
        let row = m0 + (lid & 31u) * 4u;
        let kc = k0 + (lid >> 5u);
        if row < mp.m && kc < mp.k {
            return w4_a[(base + kc * mp.a_col_stride + row) >> 2u];
        }
    }
    return vec4<f32>(0.0);
}

// Invocation lid's vec4 of the B slab (k from k0, columns n0..), 0 outside the matrix.
fn w4_load_b(lid: u32, k0: u32, n0: u32, base: u32) -> vec4<f32> {
    if mp.b_n_fast != 0u {
        let kc = k0 + (lid >> 5u);
        let col = n0 + (lid & 31u) * 4u;
        if kc < mp.k && col < mp.n {
            return w4_b[(base + kc * mp.b_row_stride + col) >> 2u];
        }
    } else {
        let col = n0 + (lid >> 1u);
        let kc = k0 + (lid & 1u) * 4u;
        if kc < mp.k && col < mp.n {
            return w4_b[(base + col * mp.b_col_stride + kc) >> 2u];
        }
    }
    return vec4<f32>(0.0);
}

// Stores the vec4s read by w4_load_a / w4_load_b into the staged slabs.
fn w4_stage(lid: u32, a: vec4<f32>, b: vec4<f32>) {
    if mp.a_k_fast != 0u {
        // a column of A's slab: written out per component (no vec4 indexed by a variable)
        let r = lid >> 1u;
        let at = (lid & 1u) * 4u * W4_ROW4 + (r >> 2u);
        w4a_tile[at][r & 3u] = a.x;
        w4a_tile[at + W4_ROW4][r & 3u] = a.y;
        w4a_tile[at + 2u * W4_ROW4][r & 3u] = a.z;
        w4a_tile[at + 3u * W4_ROW4][r & 3u] = a.w;
    } else {
        w4a_tile[(lid >> 5u) * W4_ROW4 + (lid & 31u)] = a;
    }
    if mp.b_n_fast != 0u {
        w4b_tile[(lid >> 5u) * W4_ROW4 + (lid & 31u)] = b;
    } else {
        let c = lid >> 1u;
        let bt = (lid & 1u) * 4u * W4_ROW4 + (c >> 2u);
        w4b_tile[bt][c & 3u] = b.x;
        w4b_tile[bt + W4_ROW4][c & 3u] = b.y;
        w4b_tile[bt + 2u * W4_ROW4][c & 3u] = b.z;
        w4b_tile[bt + 3u * W4_ROW4][c & 3u] = b.w;
    }
}

@compute @workgroup_size(256)
fn matmul_wide4(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let bi = mp.batch_base + wid.z;
    if bi >= mp.batch {
        return;
    }
    let tx = lid & 15u;
    let ty = lid >> 4u;
    let n0 = (mp.tile_n_base + wid.x) * W4_TILE;
    let m0 = (mp.tile_m_base + wid.y) * W4_TILE;
    let a_base = mp.a_offset + bi * mp.a_batch_stride;
    let b_base = mp.b_offset + bi * mp.b_batch_stride;

    var acc: array<vec4<f32>, 16>;
    var ra = w4_load_a(lid, m0, 0u, a_base);
    var rb = w4_load_b(lid, 0u, n0, b_base);
    let slabs = (mp.k + W4_SLAB - 1u) / W4_SLAB;
    for (var s = 0u; s < slabs; s++) {
        w4_stage(lid, ra, rb);
        workgroupBarrier();
        if s + 1u < slabs {
            ra = w4_load_a(lid, m0, (s + 1u) * W4_SLAB, a_base);
            rb = w4_load_b(lid, (s + 1u) * W4_SLAB, n0, b_base);
        }
        for (var kk = 0u; kk < W4_SLAB; kk++) {
            let a0 = w4a_tile[kk * W4_ROW4 + ty];
            let a1 = w4a_tile[kk * W4_ROW4 + ty + 16u];
            let b0 = w4b_tile[kk * W4_ROW4 + tx];
            let b1 = w4b_tile[kk * W4_ROW4 + tx + 16u];
            acc[0] = fma(vec4<f32>(a0.x), b0, acc[0]);
            acc[1] = fma(vec4<f32>(a0.x), b1, acc[1]);
            acc[2] = fma(vec4<f32>(a0.y), b0, acc[2]);
            acc[3] = fma(vec4<f32>(a0.y), b1, acc[3]);
            acc[4] = fma(vec4<f32>(a0.z), b0, acc[4]);
            acc[5] = fma(vec4<f32>(a0.z), b1, acc[5]);
            acc[6] = fma(vec4<f32>(a0.w), b0, acc[6]);
            acc[7] = fma(vec4<f32>(a0.w), b1, acc[7]);
            acc[8] = fma(vec4<f32>(a1.x), b0, acc[8]);
            acc[9] = fma(vec4<f32>(a1.x), b1, acc[9]);
            acc[10] = fma(vec4<f32>(a1.y), b0, acc[10]);
            acc[11] = fma(vec4<f32>(a1.y), b1, acc[11]);
            acc[12] = fma(vec4<f32>(a1.z), b0, acc[12]);
            acc[13] = fma(vec4<f32>(a1.z), b1, acc[13]);
            acc[14] = fma(vec4<f32>(a1.w), b0, acc[14]);
            acc[15] = fma(vec4<f32>(a1.w), b1, acc[15]);
        }
        workgroupBarrier();
    }

    // constant indices into acc throughout, so that it can stay in registers
    let c_base = bi * mp.m * mp.n;
    let r0 = m0 + ty * 4u;
    let c0 = n0 + tx * 4u;
    w4_store_row(c_base, r0, c0, acc[0], acc[1]);
    w4_store_row(c_base, r0 + 1u, c0, acc[2], acc[3]);
    w4_store_row(c_base, r0 + 2u, c0, acc[4], acc[5]);
    w4_store_row(c_base, r0 + 3u, c0, acc[6], acc[7]);
    w4_store_row(c_base, r0 + 64u, c0, acc[8], acc[9]);
    w4_store_row(c_base, r0 + 65u, c0, acc[10], acc[11]);
    w4_store_row(c_base, r0 + 66u, c0, acc[12], acc[13]);
    w4_store_row(c_base, r0 + 67u, c0, acc[14], acc[15]);
}

// Stores one micro-tile row: columns c0..c0+3 from `left`, c0+64..c0+67 from `right`, those
// inside the matrix (n is a multiple of 4: a vec4 is wholly inside or outside).
fn w4_store_row(c_base: u32, row: u32, c0: u32, left: vec4<f32>, right: vec4<f32>) {
    if row >= mp.m {
        return;
    }
    let at = c_base + row * mp.n;
    if c0 < mp.n {
        w4_c[(at + c0) >> 2u] = w4_output(left, at + c0, c0);
    }
    if c0 + 64u < mp.n {
        w4_c[(at + c0 + 64u) >> 2u] = w4_output(right, at + c0 + 64u, c0 + 64u);
    }
}
