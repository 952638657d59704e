// matmul_subgroup.wgsl: entry point `matmul_subgroup`, the batched matmul of matmul.wgsl with its
// A operand shared through subgroup shuffles instead of workgroup memory. Not a module of its
// own: the launcher (src/backend/gpu/matmul.rs) compiles matmul.wgsl + this file, on adapters
// that report the SUBGROUP feature with subgroups of 4 to 128 invocations (naga reads subgroup
// builtins without `enable subgroups;`, a directive it does not parse yet); elsewhere, or with
// MOEGRAD_MATMUL=plain, `matmul` runs.
//
// Same params, bindings, grid and 64×64 output tile as `matmul`; B is staged in workgroup memory
// as there. The difference is A:
//   * an invocation's place in the tile comes from its subgroup, v = subgroup_id · S +
//     subgroup_invocation_id (S = subgroup size, which divides 256, so v runs over 0..255):
//     tx = v % 16, ty = v / 16, the 4×4 micro-tile of `matmul`;
//   * the L = min(S, 16) invocations of a subgroup that share ty need the same 4×16 block of A
//     per slab (rows 4·ty..4·ty+3, the slab's 16 k). Element f = 16·i + kk of the block is loaded
//     by lane (first lane of the L) + f % L into its register f / L (64/L registers each: 4 when
//     S ≥ 16, 8 on lavapipe's S = 8, 16 at S = 4); neighbouring lanes read neighbouring k;
//   * the multiply step fetches A(4·ty + i, kk) with subgroupShuffle from that lane: no A
//     stores to workgroup memory, half the staging traffic, and the same barriers for B.
// The sums run over k in the same order as `matmul`'s (FMA by FMA), so the two kernels agree to
// the bit on the same adapter; tests/gpu_matmul.rs checks both against the CPU.

// One-dimensional workgroups of 256 (the subgroup builtins need a 1-D workgroup).
@compute @workgroup_size(256)
fn matmul_subgroup(@builtin(workgroup_id) wid: vec3<u32>,
                   @builtin(subgroup_id) sg_id: u32,
                   @builtin(subgroup_size) sg_size: u32,
                   @builtin(subgroup_invocation_id) lane: u32) {
    let bi = mp.batch_base + wid.z;
    if bi >= mp.batch {
        return;
    }
    let v = sg_id * sg_size + lane;
    let tx = v & 15u;
    let ty = v >> 4u;
    let span = min(sg_size, 16u);
    let first = lane - lane % span;
    let per_lane = 64u / span;
    let n0 = (mp.tile_n_base + wid.x) * TILE;
    let m0 = (mp.tile_m_base + wid.y) * TILE;
    let a_base = mp.a_offset + bi * mp.a_batch_stride;
    let b_base = mp.b_offset + bi * mp.b_batch_stride;
    let b_fast = mp.b_n_fast != 0u;

    var acc = acc_zero();
    var rb = mm_load_b(v, 0u, mp.k, n0, b_base);
    var ra: array<f32, 16>;
    let slabs = (mp.k + SLAB - 1u) / SLAB;
    for (var s = 0u; s < slabs; s++) {
        for (var l = 0u; l < 4u; l++) {
            let q = b_slot(v, l, b_fast);
            b_tile[q.x * ROW4 + (q.y >> 2u)][q.y & 3u] = rb[l];
        }
        // this lane's share of the slab's A block
        for (var j = 0u; j < 16u; j++) {
            var value = 0.0;
            if j < per_lane {
                let f = (lane - first) + span * j;
                let row = m0 + ty * 4u + (f >> 4u);
                let kc = s * SLAB + (f & 15u);
                if row < mp.m && kc < mp.k {
                    value = mm_a[a_base + row * mp.a_row_stride + kc * mp.a_col_stride];
                }
            }
            ra[j] = value;
        }
        workgroupBarrier();
        if s + 1u < slabs {
            rb = mm_load_b(v, (s + 1u) * SLAB, mp.k, n0, b_base);
        }
        for (var kk = 0u; kk < SLAB; kk++) {
            let b = b_tile[kk * ROW4 + tx];
            let f0 = kk;
            let f1 = 16u + kk;
            let f2 = 32u + kk;
            let f3 = 48u + kk;
            let a0 = subgroupShuffle(ra[f0 / span], first + f0 % span);
            let a1 = subgroupShuffle(ra[f1 / span], first + f1 % span);
            let a2 = subgroupShuffle(ra[f2 / span], first + f2 % span);
            let a3 = subgroupShuffle(ra[f3 / span], first + f3 % span);
            acc.r0 = fma(vec4<f32>(a0), b, acc.r0);
            acc.r1 = fma(vec4<f32>(a1), b, acc.r1);
            acc.r2 = fma(vec4<f32>(a2), b, acc.r2);
            acc.r3 = fma(vec4<f32>(a3), b, acc.r3);
        }
        workgroupBarrier();
    }

    let c_base = bi * mp.m * mp.n;
    for (var i = 0u; i < 4u; i++) {
        let row = m0 + ty * 4u + i;
        if row < mp.m {
            let out = acc_row(acc, i);
            for (var j = 0u; j < 4u; j++) {
                let col = n0 + tx * 4u + j;
                if col < mp.n {
                    let at = c_base + row * mp.n + col;
                    mm_c[at] = mm_output(out[j], at, col, true);
                }
            }
        }
    }
}
