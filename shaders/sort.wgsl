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
// Scratch, for rows longer than one block: keys (array<u32>, [rows, p, KEY_WORDS]) and vals
// (array<u32>, [rows, p]); row r occupies elements r*p .. (r+1)*p.
//
// sort_local        one workgroup of 256 sorts one block of `block` = min(p, BLOCK_MAX) elements
//                   of a row in workgroup memory (16 KiB: BLOCK_MAX = 2048 one-word or 1024
//                   three-word keys with their indices). With k_fixed = 0 it runs every bitonic
//                   stage k = 2..block; with k_fixed = k > block it runs the last steps
//                   j = block/2..1 of stage k. The direction of each compare-exchange comes from
//                   the element's index in the row ((i & k) == 0: ascending), so blocks compose
//                   into the global network.
//                   With FROM_INPUT in flags (the first launch) it reads its block from x
//                   (binding 1, read, array<u32>: f32, i32 or u32 bits, [rows, len, KEY_WORDS])
//                   rather than the scratch, each word made an order-preserving u32: for f32
//                   (kind 0) NaN is taken as -inf (the CPU sorts NaN as the smallest value, equal
//                   to -inf) and -0 as +0, then the sign bit is flipped for positives and all
//                   bits for negatives; for i32 (kind 1) the sign bit is flipped; u32 (kind 2) is
//                   kept; descending complements every word; past len, the padding.
//                   With TO_OUTPUT (the last launch) it writes out[r, q] = the index at sorted
//                   position q, for q < len (binding 4, read_write, i32 [rows, len]), rather
//                   than the scratch. A row of at most BLOCK_MAX elements is one launch with
//                   both flags.
//                   params LocalParams { rows, len, p, block, k_fixed, kind, descending, flags };
//                   keys (binding 2), vals (binding 3), both read_write.
//                   Grid: rows * p / block workgroups, folded into x/y.
// sort_global_step  one compare-exchange step (stage k, distance j >= block) over the scratch:
//                   one invocation per pair, rows * p / 2 invocations.
//                   params StepParams { rows, p, k, j }; keys (binding 2), vals (binding 3).

// u32 words per key (the words build replaces this line)
const KEY_WORDS: u32 = 1u;

const WG: u32 = 256u;
// elements per block in workgroup memory: 4096 words of keys and indices, 16 KiB
const BLOCK_MAX: u32 = 4096u / (KEY_WORDS + 1u);
const PAD: u32 = 0xffffffffu;
// LocalParams.flags
const FROM_INPUT: u32 = 1u;
const TO_OUTPUT: u32 = 2u;

fn flat_index(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> u32 {
    return (wid.y * nwg.x + wid.x) * WG + lid;
}

struct LocalParams {
    rows: u32,
    len: u32,
    p: u32,
    block: u32,
    k_fixed: u32,
    kind: u32,
    descending: u32,
    flags: u32,
}
struct StepParams { rows: u32, p: u32, k: u32, j: u32 }

@group(0) @binding(1) var<storage, read> sort_x: array<u32>;
@group(0) @binding(2) var<storage, read_write> sort_keys: array<u32>;
@group(0) @binding(3) var<storage, read_write> sort_vals: array<u32>;
@group(0) @binding(4) var<storage, read_write> sort_out: array<i32>;

// ---- sort_local -----------------------------------------------------------------------------

@group(0) @binding(0) var<uniform> lp: LocalParams;

var<workgroup> sk: array<u32, BLOCK_MAX * KEY_WORDS>;
var<workgroup> sv: array<u32, BLOCK_MAX>;

// The order-preserving u32 of one word of x (see the header).
fn order_key(bits: u32) -> u32 {
    var key = bits;
    if (lp.kind == 1u) {
        key = bits ^ 0x80000000u;
    } else if (lp.kind == 0u) {
        var v = bits;
        if ((v & 0x7fffffffu) > 0x7f800000u) { v = 0xff800000u; } // NaN -> -inf
        if (v == 0x80000000u) { v = 0u; }                         // -0 -> +0
        if ((v & 0x80000000u) != 0u) { key = ~v; } else { key = v | 0x80000000u; }
    }
    if (lp.descending != 0u) { key = ~key; }
    return key;
}

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
    let first = (w % blocks_per_row) * lp.block; // index in the row of the block's first element
    let base = r * lp.p + first;
    let from_input = (lp.flags & FROM_INPUT) != 0u;
    for (var t = lid; t < lp.block; t = t + WG) {
        let q = first + t;
        if (!from_input) {
            for (var kw = 0u; kw < KEY_WORDS; kw = kw + 1u) {
                sk[t * KEY_WORDS + kw] = sort_keys[(base + t) * KEY_WORDS + kw];
            }
            sv[t] = sort_vals[base + t];
        } else if (q < lp.len) {
            for (var kw = 0u; kw < KEY_WORDS; kw = kw + 1u) {
                sk[t * KEY_WORDS + kw] = order_key(sort_x[(r * lp.len + q) * KEY_WORDS + kw]);
            }
            sv[t] = q;
        } else {
            for (var kw = 0u; kw < KEY_WORDS; kw = kw + 1u) {
                sk[t * KEY_WORDS + kw] = PAD;
            }
            sv[t] = PAD;
        }
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
    let to_output = (lp.flags & TO_OUTPUT) != 0u;
    for (var t = lid; t < lp.block; t = t + WG) {
        let q = first + t;
        if (!to_output) {
            for (var kw = 0u; kw < KEY_WORDS; kw = kw + 1u) {
                sort_keys[(base + t) * KEY_WORDS + kw] = sk[t * KEY_WORDS + kw];
            }
            sort_vals[base + t] = sv[t];
        } else if (q < lp.len) {
            sort_out[r * lp.len + q] = i32(sv[t]);
        }
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
