// sort.wgsl: stable per-row argsort by bitonic sorting of (key, index) pairs.
// Launcher: src/backend/gpu/sort.rs (Tensor::argsort, topk, the MoE dispatch plan, scatter_add).
//
// A key is KEY_WORDS u32 words compared in order (lexicographically, as unsigned). This file
// sorts one-word keys; the launcher's words build (`SORT_WORDS` in sort.rs) is this file with
// KEY_WORDS = 3, which the MoE dispatch plan sorts its (expert, rank, weight) keys with in one
// pass. Stability comes from the keys themselves: every element is sorted as the tuple (key
// words, original index) under a total order, so equal keys keep index order whatever the
// sorting network does, in both directions (descending flips the key, not the index). Each row
// of `len` elements is padded to p = next power of two with all words and the index
// 0xffffffff, which sort last.
// Scratch: keys (array<u32>, [rows, p, KEY_WORDS]) and vals (array<u32>, [rows, p]); row r
// occupies elements r*p .. (r+1)*p.
//
// sort_init         x (binding 1, read, array<u32>: f32, i32 or u32 bits) [rows, len, KEY_WORDS]
//                   -> keys (binding 2, read_write), vals (binding 3, read_write). Each word
//                   becomes an order-preserving u32: for f32 (kind 0), NaN is taken as -inf (the
//                   CPU sorts NaN as the smallest value, equal to -inf) and -0 as +0; then the
//                   sign bit is flipped for positives and all bits for negatives; for i32 (kind
//                   1) the sign bit is flipped; u32 (kind 2) is kept; descending complements
//                   every word. params InitParams { rows, len, p, kind, descending }.
//                   One invocation per padded element, 256 per workgroup, grid folded into x/y.
// sort_local        one workgroup of 256 sorts one block of `block` = min(p, 1024) elements of a
//                   row in workgroup memory (4·(KEY_WORDS + 1) KiB). With k_fixed = 0 it runs
//                   every bitonic stage k = 2..block; with k_fixed = k > block it runs the last
//                   steps j = block/2..1 of stage k. The direction of each compare-exchange
//                   comes from the element's index in the row ((i & k) == 0: ascending), so
//                   blocks compose into the global network. params LocalParams { rows, p,
//                   block, k_fixed }; keys (binding 2), vals (binding 3), both read_write.
//                   Grid: rows * p / block workgroups, folded.
// sort_global_step  one compare-exchange step (stage k, distance j >= block) over global memory:
//                   one invocation per pair, rows * p / 2 invocations.
//                   params StepParams { rows, p, k, j }; keys (binding 2), vals (binding 3).
// sort_finish       out[r, q] = vals[r, q] as i32 for q < len. params InitParams (kind and
//                   descending unused); vals (binding 3), out (binding 4, read_write, i32)
//                   [rows, len]. One invocation per output element.

// u32 words per key (the words build replaces this line)
const KEY_WORDS: u32 = 1u;
const WG: u32 = 256u;
const BLOCK_MAX: u32 = 1024u;
const PAD: u32 = 0xffffffffu;

fn flat_index(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> u32 {
    return (wid.y * nwg.x + wid.x) * WG + lid;
}


struct InitParams { rows: u32, len: u32, p: u32, kind: u32, descending: u32 }
struct LocalParams { rows: u32, p: u32, block: u32, k_fixed: u32 }
struct StepParams { rows: u32, p: u32, k: u32, j: u32 }

@group(0) @binding(1) var<storage, read> sort_x: array<u32>;
@group(0) @binding(2) var<storage, read_write> sort_keys: array<u32>;
@group(0) @binding(3) var<storage, read_write> sort_vals: array<u32>;

// ---- sort_init ------------------------------------------------------------------------------

@group(0) @binding(0) var<uniform> ip: InitParams;

fn order_key(bits: u32) -> u32 {
    if (ip.kind == 2u) { return bits; }
    if (ip.kind == 1u) { return bits ^ 0x80000000u; }
    var v = bits;
    if ((v & 0x7fffffffu) > 0x7f800000u) { v = 0xff800000u; } // NaN -> -inf
    if (v == 0x80000000u) { v = 0u; }                         // -0 -> +0
    if ((v & 0x80000000u) != 0u) { return ~v; }
    return v | 0x80000000u;
}

@compute @workgroup_size(256)
fn sort_init(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_index) lid: u32) {
    let t = flat_index(wid, nwg, lid);
    if (t >= ip.rows * ip.p) { return; }
    let r = t / ip.p;
    let q = t % ip.p;
    for (var w = 0u; w < KEY_WORDS; w = w + 1u) {
        var key = PAD;
        if (q < ip.len) {
            key = order_key(sort_x[(r * ip.len + q) * KEY_WORDS + w]);
            if (ip.descending != 0u) { key = ~key; }
        }
        sort_keys[t * KEY_WORDS + w] = key;
    }
    if (q < ip.len) {
        sort_vals[t] = q;
    } else {
        sort_vals[t] = PAD;
    }
}

// ---- sort_local -----------------------------------------------------------------------------

@group(0) @binding(0) var<uniform> lp: LocalParams;

var<workgroup> sk: array<u32, 1024 * KEY_WORDS>;
var<workgroup> sv: array<u32, 1024>;

// True when block element a comes after block element b in ascending order: its key words
// compare greater, or are equal and its index is greater.
fn local_after(a: u32, b: u32) -> bool {
    for (var w = 0u; w < KEY_WORDS; w = w + 1u) {
        let ka = sk[a * KEY_WORDS + w];
        let kb = sk[b * KEY_WORDS + w];
        if (ka != kb) { return ka > kb; }
    }
    return sv[a] > sv[b];
}

// One compare-exchange step (stage k, distance j) over the block in workgroup memory.
fn local_step(lid: u32, first: u32, k: u32, j: u32) {
    for (var t = lid; t < lp.block / 2u; t = t + WG) {
        let a = 2u * j * (t / j) + (t % j);
        let b = a + j;
        let ascending = ((first + a) & k) == 0u;
        if (local_after(a, b) == ascending) {
            for (var w = 0u; w < KEY_WORDS; w = w + 1u) {
                let tk = sk[a * KEY_WORDS + w];
                sk[a * KEY_WORDS + w] = sk[b * KEY_WORDS + w];
                sk[b * KEY_WORDS + w] = tk;
            }
            let tv = sv[a];
            sv[a] = sv[b];
            sv[b] = tv;
        }
    }
    workgroupBarrier();
}

@compute @workgroup_size(256)
fn sort_local(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let w = wid.y * nwg.x + wid.x;
    let blocks_per_row = lp.p / lp.block;
    if (w >= lp.rows * blocks_per_row) { return; }
    let r = w / blocks_per_row;
    let first = (w % blocks_per_row) * lp.block; // index in the row of the block's first pair
    let base = r * lp.p + first;
    for (var t = lid; t < lp.block; t = t + WG) {
        for (var w = 0u; w < KEY_WORDS; w = w + 1u) {
            sk[t * KEY_WORDS + w] = sort_keys[(base + t) * KEY_WORDS + w];
        }
        sv[t] = sort_vals[base + t];
    }
    workgroupBarrier();
    if (lp.k_fixed == 0u) {
        for (var k = 2u; k <= lp.block; k = k * 2u) {
            for (var j = k / 2u; j > 0u; j = j / 2u) {
                local_step(lid, first, k, j);
            }
        }
    } else {
        for (var j = lp.block / 2u; j > 0u; j = j / 2u) {
            local_step(lid, first, lp.k_fixed, j);
        }
    }
    for (var t = lid; t < lp.block; t = t + WG) {
        for (var w = 0u; w < KEY_WORDS; w = w + 1u) {
            sort_keys[(base + t) * KEY_WORDS + w] = sk[t * KEY_WORDS + w];
        }
        sort_vals[base + t] = sv[t];
    }
}

// ---- sort_global_step -----------------------------------------------------------------------

@group(0) @binding(0) var<uniform> gs: StepParams;

@compute @workgroup_size(256)
fn sort_global_step(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                    @builtin(local_invocation_index) lid: u32) {
    let t = flat_index(wid, nwg, lid);
    let half = gs.p / 2u;
    if (t >= gs.rows * half) { return; }
    let r = t / half;
    let q = t % half;
    let a = 2u * gs.j * (q / gs.j) + (q % gs.j);
    let b = a + gs.j;
    let ascending = (a & gs.k) == 0u;
    let ia = r * gs.p + a;
    let ib = r * gs.p + b;
    let va = sort_vals[ia];
    let vb = sort_vals[ib];
    // whether element a comes after element b: the first differing word decides, else the index
    var decided = false;
    var a_after = va > vb;
    for (var w = 0u; w < KEY_WORDS; w = w + 1u) {
        let ka = sort_keys[ia * KEY_WORDS + w];
        let kb = sort_keys[ib * KEY_WORDS + w];
        if (!decided && ka != kb) {
            a_after = ka > kb;
            decided = true;
        }
    }
    if (a_after == ascending) {
        for (var w = 0u; w < KEY_WORDS; w = w + 1u) {
            let ka = sort_keys[ia * KEY_WORDS + w];
            sort_keys[ia * KEY_WORDS + w] = sort_keys[ib * KEY_WORDS + w];
            sort_keys[ib * KEY_WORDS + w] = ka;
        }
        sort_vals[ia] = vb;
        sort_vals[ib] = va;
    }
}

// ---- sort_finish ----------------------------------------------------------------------------

@group(0) @binding(0) var<uniform> fp: InitParams;
@group(0) @binding(4) var<storage, read_write> sort_out: array<i32>;

@compute @workgroup_size(256)
fn sort_finish(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let t = flat_index(wid, nwg, lid);
    if (t >= fp.rows * fp.len) { return; }
    let r = t / fp.len;
    let q = t % fp.len;
    sort_out[t] = i32(sort_vals[r * fp.p + q]);
}
