// attention.wgsl: causal multi-head self-attention, the GPU end of `Tensor::causal_attention`
// (forward) and of its backward rule. Launchers: src/backend/gpu/attention.rs, one function per
// entry point, same names.
//
// Layout (element indices; Q, K, V, O, dO, dQ, dK, dV are at_elem: f32, or f16 in the f16
// build; lse and delta are f32 in both). There are heads = B·H (batch entry, head) pairs, head
// index hd = b·H + h with H = `group`, and every tensor holds a row of HEAD_DIM elements per
// (head, position t):
//   Q, K, V, dQ, dK, dV: row (hd, t) starts at row_start(hd, t, qkv_row), plus `part` for K and
//   dK and 2·part for V and dV;  O, dO: at row_start(hd, t, o_row);
//   row_start(hd, t, row) = ((hd / group)·seq + t)·row + (hd % group)·head_dim;
//   lse and delta: [heads, seq], element (hd, t) at hd·seq + t.
// Two layouts use it (src/backend/gpu/attention.rs, `Qkv`):
//   separate [heads, seq, HEAD_DIM] buffers: group 1, qkv_row = o_row = HEAD_DIM, part 0;
//   q, k, v packed per position, [B, seq, 3, H, HEAD_DIM] with O [B, seq, H, HEAD_DIM] (the
//   projection's own layout, no permute either side): group H, qkv_row 3·H·HEAD_DIM,
//   part H·HEAD_DIM, o_row H·HEAD_DIM.
// The score of query i and key j is s_ij = scale·q_i·k_j with
// scale = 1/√HEAD_DIM; key j is visible to query i when j ≤ i (the causal mask).
//
// Scheme shared by the three tiled entry points: a workgroup of 256 invocations owns ROWS = 64
// consecutive rows of one head (queries, or keys for dK/dV), LANES = 4 invocations per row:
// invocation lid is lane lid / 64 of row lid % 64, so each 64 consecutive invocations are one
// lane of every row. Each invocation keeps its row's vectors (q, the output accumulator, ...)
// in registers. The rows of the other side are walked in stages of STAGE rows: the workgroup
// copies a stage (STAGE × HEAD_DIM of each of two matrices) into workgroup memory, waits, and
// each invocation runs through the staged rows its row can see whose index within the stage is
// its lane modulo LANES (lane, lane + 4, ...), reading them as broadcasts (the invocations of
// one lane read the same staged row); two barriers per stage. An invocation forms the dot
// products of its (at most LANE_STAGE = 8) staged rows together, dimension by dimension: eight
// independent sums instead of one chain of HEAD_DIM dependent additions after another, each
// sum still over c = 0, 1, ... in order. At the end `sum_over_lanes` adds
// the four lanes' partial vectors of each row in lane order through workgroup memory, and lane
// 0 stores the row. Four lanes per row give a short sequence (the baby GPT's 64 positions: one
// workgroup per head) four times the invocations and each a quarter of the serial work. Stages
// wholly after every query of the workgroup (fully masked) are skipped. Rows past seq load
// nothing and store nothing, so any seq ≥ 1 works.
// Specialisation (pipeline-overridable constants, one pipeline per value, set by the launcher):
// HEAD_DIM (1..=MAX_DIM = 128, the register arrays' size) and STAGE = min(32, 1984 / HEAD_DIM),
// so that two stages of STAGE × HEAD_DIM floats and two rows of STAGE floats fit in 16 KiB of
// workgroup memory (WebGPU's guaranteed minimum).
// Grid of the tiled entries: (⌈seq/64⌉, heads in this launch, 1), workgroups of 256;
// `head_base` is the first head of the launch (the host splits more than 65535 heads into
// several launches).
//
// ---- entry point `attention_forward` ----------------------------------------------------------
//   binding 1 q, 2 k, 3 v (read), 4 o (written, [heads, seq, HEAD_DIM]), 5 lse (written,
//   [heads, seq]). Invocation = one lane of a query. Stages K and V; per stage it computes its
//   lane's visible scores, then the online softmax update: running max m and sum l, the
//   accumulator rescaled by e^(m_old − m_new) once per stage, acc += Σ_j e^(s_j − m)·v_j. The
//   lanes' states merge as FlashAttention's blocks do: M = max m_p, L = Σ_p e^(m_p − M)·l_p,
//   o = Σ_p e^(m_p − M)·acc_p / L, lse = M + ln L.
//
// ---- entry point `attention_delta` -------------------------------------------------------------
//   binding 1 o, 2 dO (read), 3 delta (written, [heads, seq]): delta_i = Σ_c dO_ic·O_ic, the
//   D of the backward pass. One invocation per row, workgroup 256, grid folded into x/y over
//   `rows` = heads·seq invocations.
//
// ---- entry point `attention_backward_kv` -------------------------------------------------------
//   binding 1 q, 2 k, 3 v, 4 dO, 5 lse, 6 delta (read), 7 dk, 8 dv (written). Invocation = one
//   lane of a key. Stages Q, dO, lse and delta of the queries from its workgroup's first key to
//   the end; for each visible query of its lane: p = e^(s − lse), ds = scale·p·(dO·v − delta),
//   dv += p·dO, dk += ds·q; the lanes' dk and dv are summed. No atomics: each key row has one
//   owner, its lane 0.
//
// ---- entry point `attention_backward_kv_packed` ------------------------------------------------
//   attention_backward_kv for q, k, v packed in one buffer (part > 0): binding 1, 2 and 3 the
//   same qkv, 7 the packed gradient (written): dK at part + row_start(hd, t, qkv_row) + c, dV
//   at 2·part + row_start(hd, t, qkv_row) + c (one writable binding for both: WebGPU lets no two
//   writable bindings of a dispatch alias). attention_backward_q then writes dQ (part 0) into
//   the same buffer at its binding 7.
//
// ---- entry point `attention_backward_q` --------------------------------------------------------
//   binding 1 q, 2 k, 3 v, 4 dO, 5 lse, 6 delta (read), 7 dq (written). Invocation = one lane
//   of a query. Stages K and V of the keys up to its workgroup's last query; for each visible
//   key of its lane: p and ds as above, dq += ds·k; the lanes' dq are summed.
//
// params (binding 0, AttnParams, all 32-bit): seq, scale (f32), head_base, rows (delta only:
// heads·seq), head_dim (= HEAD_DIM in the tiled entries, which use the constant for their
// loops), part, group, qkv_row, o_row (the layout above). With q, k and v packed in one buffer
// bound three times, K is read from element `part` on and V from 2·part on, and
// attention_backward_kv_packed and attention_backward_q write dK, dV and dQ into one packed
// gradient laid out the same way, each only its own parts.

override HEAD_DIM: u32 = 32u;
override STAGE: u32 = 32u;

// rows per workgroup of the tiled entries
const ROWS: u32 = 64u;
// invocations per row: lanes that split the staged rows between them
const LANES: u32 = 4u;
// invocations per workgroup of the tiled entries: ROWS · LANES
const INVOCATIONS: u32 = 256u;
// a lane's share of one stage's rows: MAX_STAGE / LANES
const LANE_STAGE: u32 = 8u;
// dimensions per round of sum_over_lanes: (LANES − 1)·MERGE_DIMS·ROWS ≤ STAGE_FLOATS
const MERGE_DIMS: u32 = 8u;
// size of the register arrays: the largest HEAD_DIM
const MAX_DIM: u32 = 128u;
// the largest STAGE
const MAX_STAGE: u32 = 32u;
// floats per staged matrix: STAGE·HEAD_DIM ≤ 1984, so 2·1984 + 2·32 floats = 16128 bytes
const STAGE_FLOATS: u32 = 1984u;
// key_grads' row index for a key past seq (no row: nothing is stored)
const PAST_SEQ: u32 = 0xffffffffu;
// stands for −∞ as the running maximum before any score (WGSL has no infinite literal)
const NEG_BIG: f32 = -3.0e38;

struct AttnParams {
    seq: u32,
    scale: f32,
    head_base: u32,
    rows: u32,
    head_dim: u32,
    part: u32,
    group: u32,
    qkv_row: u32,
    o_row: u32,
}

// The element type of the tensors (not of lse and delta): f32 here. The f16 build
// (src/backend/gpu/half.rs, `f16_build`) makes the alias `f16` and the store a conversion that
// rounds once; every load goes through f32(...), so the arithmetic is f32 in both.
// f16 build: element type
alias at_elem = f32;
fn at_store(v: f32) -> at_elem {
    return v;
}
// f16 build: end

@group(0) @binding(0) var<uniform> ap: AttnParams;
@group(0) @binding(1) var<storage, read> at_q: array<at_elem>;
@group(0) @binding(2) var<storage, read> at_k: array<at_elem>;
@group(0) @binding(3) var<storage, read> at_v: array<at_elem>;

// two staged matrices (row j at j·HEAD_DIM) and two staged row vectors
var<workgroup> stage_a: array<f32, STAGE_FLOATS>;
var<workgroup> stage_b: array<f32, STAGE_FLOATS>;
var<workgroup> stage_r: array<f32, MAX_STAGE>;
var<workgroup> stage_s: array<f32, MAX_STAGE>;

// Where row t of head `head` starts in a tensor whose positions are `row` elements apart: the
// head's batch entry is head / group, its head within the entry head % group (the layout table
// in the header). q, k, v and their gradients use row = qkv_row (k and v then add part and
// 2·part), o and dO row = o_row.
fn row_start(head: u32, t: u32, row: u32) -> u32 {
    return ((head / ap.group) * ap.seq + t) * row + (head % ap.group) * ap.head_dim;
}

// Copies rows first..first+STAGE of the head's K into stage_a and of its V into stage_b (zeros
// past seq); the workgroup's invocations share the copy.
fn stage_keys(head: u32, first: u32, lid: u32) {
    for (var e = lid; e < STAGE * HEAD_DIM; e += INVOCATIONS) {
        var kv = vec2<f32>(0.0);
        if (first + e / HEAD_DIM < ap.seq) {
            let at = row_start(head, first + e / HEAD_DIM, ap.qkv_row) + e % HEAD_DIM;
            kv = vec2<f32>(f32(at_k[ap.part + at]), f32(at_v[2u * ap.part + at]));
        }
        stage_a[e] = kv.x;
        stage_b[e] = kv.y;
    }
}

// How many of the STAGE rows starting at `first` the query `query` sees (keys ≤ query < seq).
fn visible_keys(query: u32, first: u32) -> u32 {
    if (query >= ap.seq || query < first) { return 0u; }
    return min(STAGE, query + 1u - first);
}

// The lanes' partial vectors of each row, added: after every invocation of the workgroup has
// called it (it has barriers), lane 0's `*v` holds Σ_lane scale_lane·v_lane over HEAD_DIM,
// lanes in increasing order, for its row (`scale` is the calling lane's factor); the other
// lanes' `*v` are unchanged. Lanes 1..3 hand over MERGE_DIMS dimensions per round through
// stage_a, at [((lane − 1)·MERGE_DIMS + i)·ROWS + row] (a lane's 64 rows side by side), so the
// stage must be free: call it after the last stage's barrier.
fn sum_over_lanes(lid: u32, v: ptr<function, array<f32, MAX_DIM>>, scale: f32) {
    let row = lid % ROWS;
    let lane = lid / ROWS;
    for (var c0 = 0u; c0 < HEAD_DIM; c0 += MERGE_DIMS) {
        let dims = min(MERGE_DIMS, HEAD_DIM - c0);
        if (lane > 0u) {
            for (var i = 0u; i < dims; i++) {
                stage_a[((lane - 1u) * MERGE_DIMS + i) * ROWS + row] = (*v)[c0 + i] * scale;
            }
        }
        workgroupBarrier();
        if (lane == 0u) {
            for (var i = 0u; i < dims; i++) {
                var t = (*v)[c0 + i] * scale;
                for (var p = 1u; p < LANES; p++) {
                    t += stage_a[((p - 1u) * MERGE_DIMS + i) * ROWS + row];
                }
                (*v)[c0 + i] = t;
            }
        }
        workgroupBarrier();
    }
}

// ---- forward ----------------------------------------------------------------------------------

@group(0) @binding(4) var<storage, read_write> fw_o: array<at_elem>;
@group(0) @binding(5) var<storage, read_write> fw_lse: array<f32>;

@compute @workgroup_size(256)
fn attention_forward(@builtin(local_invocation_index) lid: u32,
                     @builtin(workgroup_id) wid: vec3<u32>) {
    let head = ap.head_base + wid.y;
    let q0 = wid.x * ROWS;
    let row = lid % ROWS;
    let lane = lid / ROWS;
    let query = q0 + row;
    // q pre-multiplied by the scale, so q·k is the score
    var q: array<f32, MAX_DIM>;
    var acc: array<f32, MAX_DIM>;
    if (query < ap.seq) {
        let at = row_start(head, query, ap.qkv_row);
        for (var c = 0u; c < HEAD_DIM; c++) { q[c] = f32(at_q[at + c]) * ap.scale; }
    }
    var m = NEG_BIG;
    var l = 0.0;
    let key_end = min(q0 + ROWS, ap.seq);
    for (var k0 = 0u; k0 < key_end; k0 += STAGE) {
        stage_keys(head, k0, lid);
        workgroupBarrier();
        let count = visible_keys(query, k0);
        // this lane's keys of the stage: lane, lane + LANES, ... below count
        if (lane < count) {
            // s[i]: the score of staged key lane + i·LANES (below count), all of the lane's
            // at once, dimension by dimension (independent sums, each over c = 0, 1, ... in order)
            var s: array<f32, LANE_STAGE>;
            for (var c = 0u; c < HEAD_DIM; c++) {
                let qc = q[c];
                for (var i = 0u; i < LANE_STAGE; i++) {
                    let j = lane + i * LANES;
                    if (j < count) { s[i] += qc * stage_a[j * HEAD_DIM + c]; }
                }
            }
            var stage_max = m;
            for (var i = 0u; i < LANE_STAGE; i++) {
                if (lane + i * LANES < count) { stage_max = max(stage_max, s[i]); }
            }
            // key k0 + lane ≤ query is visible here, so stage_max is a real score;
            // e^(NEG_BIG − it) = 0
            let rescale = exp(m - stage_max);
            l *= rescale;
            for (var c = 0u; c < HEAD_DIM; c++) { acc[c] *= rescale; }
            for (var i = 0u; i < LANE_STAGE; i++) {
                let j = lane + i * LANES;
                if (j < count) {
                    let p = exp(s[i] - stage_max);
                    l += p;
                    for (var c = 0u; c < HEAD_DIM; c++) { acc[c] += p * stage_b[j * HEAD_DIM + c]; }
                }
            }
            m = stage_max;
        }
        workgroupBarrier();
    }
    // the lanes' (m, l) side by side in stage_b: m at lane·ROWS + row, l at (LANES + lane)·ROWS
    // + row. Key 0 is lane 0's, so for a query below seq the largest m is a real score and a
    // lane that saw no key (m = NEG_BIG, l = 0, acc = 0) adds e^(NEG_BIG − M)·0 = 0.
    stage_b[lane * ROWS + row] = m;
    stage_b[(LANES + lane) * ROWS + row] = l;
    workgroupBarrier();
    var m_all = NEG_BIG;
    for (var p = 0u; p < LANES; p++) { m_all = max(m_all, stage_b[p * ROWS + row]); }
    var l_all = 0.0;
    for (var p = 0u; p < LANES; p++) {
        l_all += exp(stage_b[p * ROWS + row] - m_all) * stage_b[(LANES + p) * ROWS + row];
    }
    sum_over_lanes(lid, &acc, exp(m - m_all));
    if (lane == 0u && query < ap.seq) {
        let inv = 1.0 / l_all;
        let at = row_start(head, query, ap.o_row);
        for (var c = 0u; c < HEAD_DIM; c++) { fw_o[at + c] = at_store(acc[c] * inv); }
        fw_lse[head * ap.seq + query] = m_all + log(l_all);
    }
}

// ---- delta = rowsum(dO ∘ O) ------------------------------------------------------------------

@group(0) @binding(1) var<storage, read> dl_o: array<at_elem>;
@group(0) @binding(2) var<storage, read> dl_do: array<at_elem>;
@group(0) @binding(3) var<storage, read_write> dl_delta: array<f32>;

@compute @workgroup_size(256)
fn attention_delta(@builtin(workgroup_id) wid: vec3<u32>,
                   @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_index) lid: u32) {
    let row = (wid.y * nwg.x + wid.x) * 256u + lid;
    if (row >= ap.rows) { return; }
    var s = 0.0;
    let at = row_start(row / ap.seq, row % ap.seq, ap.o_row);
    for (var c = 0u; c < ap.head_dim; c++) { s += f32(dl_do[at + c]) * f32(dl_o[at + c]); }
    dl_delta[row] = s;
}

// ---- backward ---------------------------------------------------------------------------------

@group(0) @binding(4) var<storage, read> bw_do: array<at_elem>;
@group(0) @binding(5) var<storage, read> bw_lse: array<f32>;
@group(0) @binding(6) var<storage, read> bw_delta: array<f32>;
@group(0) @binding(7) var<storage, read_write> bw_dk: array<at_elem>;
@group(0) @binding(8) var<storage, read_write> bw_dv: array<at_elem>;
@group(0) @binding(7) var<storage, read_write> bw_dq: array<at_elem>;
// the packed gradient [3, heads, seq, HEAD_DIM] of attention_backward_kv_packed
@group(0) @binding(7) var<storage, read_write> bw_dkv: array<at_elem>;

// dK and dV of invocation lid's key in workgroup wid (the two kv entry points' shared work),
// summed over the key's lanes into lane 0's `dk` and `dv`; returns, to lane 0, the key row's
// first element index row_start(head, key, qkv_row) (part 0: add part for dK, 2·part for dV),
// and PAST_SEQ to the other lanes and for a key past seq (nothing to store). Every invocation of
// the workgroup calls it (it has barriers).
fn key_grads(lid: u32, wid: vec3<u32>, dk: ptr<function, array<f32, MAX_DIM>>,
             dv: ptr<function, array<f32, MAX_DIM>>) -> u32 {
    let head = ap.head_base + wid.y;
    let k0 = wid.x * ROWS;
    let lane = lid / ROWS;
    let key = k0 + lid % ROWS;
    let key_at = row_start(head, key, ap.qkv_row);
    // k pre-multiplied by the scale, so q·k is the score
    var k: array<f32, MAX_DIM>;
    var v: array<f32, MAX_DIM>;
    if (key < ap.seq) {
        for (var c = 0u; c < HEAD_DIM; c++) {
            k[c] = f32(at_k[ap.part + key_at + c]) * ap.scale;
            v[c] = f32(at_v[2u * ap.part + key_at + c]);
        }
    }
    // queries before the workgroup's first key see none of its keys
    for (var first = k0; first < ap.seq; first += STAGE) {
        // stage Q → stage_a, dO → stage_b, lse → stage_r, delta → stage_s
        for (var e = lid; e < STAGE * HEAD_DIM; e += INVOCATIONS) {
            var qd = vec2<f32>(0.0);
            let t = first + e / HEAD_DIM;
            if (t < ap.seq) {
                let c = e % HEAD_DIM;
                let at_qr = row_start(head, t, ap.qkv_row) + c;
                let at_or = row_start(head, t, ap.o_row) + c;
                qd = vec2<f32>(f32(at_q[at_qr]), f32(bw_do[at_or]));
            }
            stage_a[e] = qd.x;
            stage_b[e] = qd.y;
        }
        if (lid < STAGE) {
            var ld = vec2<f32>(0.0);
            if (first + lid < ap.seq) {
                let row = head * ap.seq + first + lid;
                ld = vec2<f32>(bw_lse[row], bw_delta[row]);
            }
            stage_r[lid] = ld.x;
            stage_s[lid] = ld.y;
        }
        workgroupBarrier();
        if (key < ap.seq) {
            // staged queries first + j with key ≤ query < seq, this lane's: j0 + lane, + LANES, ...
            let j0 = select(0u, key - first, key > first);
            let j1 = min(STAGE, ap.seq - first);
            // s[i], dp[i]: q·k and dO·v of staged query j0 + lane + i·LANES (below j1), all of
            // the lane's at once, dimension by dimension (each sum over c in order)
            var s: array<f32, LANE_STAGE>;
            var dp: array<f32, LANE_STAGE>;
            for (var c = 0u; c < HEAD_DIM && j0 + lane < j1; c++) {
                let kc = k[c];
                let vc = v[c];
                for (var i = 0u; i < LANE_STAGE; i++) {
                    let j = j0 + lane + i * LANES;
                    if (j < j1) {
                        s[i] += stage_a[j * HEAD_DIM + c] * kc;
                        dp[i] += stage_b[j * HEAD_DIM + c] * vc;
                    }
                }
            }
            for (var i = 0u; i < LANE_STAGE; i++) {
                let j = j0 + lane + i * LANES;
                if (j < j1) {
                    let p = exp(s[i] - stage_r[j]);
                    let ds = p * (dp[i] - stage_s[j]) * ap.scale;
                    for (var c = 0u; c < HEAD_DIM; c++) {
                        (*dv)[c] += p * stage_b[j * HEAD_DIM + c];
                        (*dk)[c] += ds * stage_a[j * HEAD_DIM + c];
                    }
                }
            }
        }
        workgroupBarrier();
    }
    sum_over_lanes(lid, dk, 1.0);
    sum_over_lanes(lid, dv, 1.0);
    return select(PAST_SEQ, key_at, key < ap.seq && lane == 0u);
}

@compute @workgroup_size(256)
fn attention_backward_kv(@builtin(local_invocation_index) lid: u32,
                         @builtin(workgroup_id) wid: vec3<u32>) {
    var dk: array<f32, MAX_DIM>;
    var dv: array<f32, MAX_DIM>;
    let at = key_grads(lid, wid, &dk, &dv);
    if (at != PAST_SEQ) {
        for (var c = 0u; c < HEAD_DIM; c++) {
            bw_dk[at + c] = at_store(dk[c]);
            bw_dv[at + c] = at_store(dv[c]);
        }
    }
}

@compute @workgroup_size(256)
fn attention_backward_kv_packed(@builtin(local_invocation_index) lid: u32,
                                @builtin(workgroup_id) wid: vec3<u32>) {
    var dk: array<f32, MAX_DIM>;
    var dv: array<f32, MAX_DIM>;
    let at = key_grads(lid, wid, &dk, &dv);
    if (at != PAST_SEQ) {
        for (var c = 0u; c < HEAD_DIM; c++) {
            bw_dkv[ap.part + at + c] = at_store(dk[c]);
            bw_dkv[2u * ap.part + at + c] = at_store(dv[c]);
        }
    }
}


@compute @workgroup_size(256)
fn attention_backward_q(@builtin(local_invocation_index) lid: u32,
                        @builtin(workgroup_id) wid: vec3<u32>) {
    let head = ap.head_base + wid.y;
    let q0 = wid.x * ROWS;
    let lane = lid / ROWS;
    let query = q0 + lid % ROWS;
    let query_at = row_start(head, query, ap.qkv_row);
    // q pre-multiplied by the scale, so q·k is the score
    var q: array<f32, MAX_DIM>;
    var g: array<f32, MAX_DIM>;
    var dq: array<f32, MAX_DIM>;
    var lse = 0.0;
    var delta = 0.0;
    if (query < ap.seq) {
        let do_at = row_start(head, query, ap.o_row);
        for (var c = 0u; c < HEAD_DIM; c++) {
            q[c] = f32(at_q[query_at + c]) * ap.scale;
            g[c] = f32(bw_do[do_at + c]);
        }
        lse = bw_lse[head * ap.seq + query];
        delta = bw_delta[head * ap.seq + query];
    }
    let key_end = min(q0 + ROWS, ap.seq);
    for (var k0 = 0u; k0 < key_end; k0 += STAGE) {
        stage_keys(head, k0, lid);
        workgroupBarrier();
        let count = visible_keys(query, k0);
        // s[i], dp[i]: q·k and dO·v of staged key lane + i·LANES (below count), all of the
        // lane's at once, dimension by dimension (each sum over c in order)
        var s: array<f32, LANE_STAGE>;
        var dp: array<f32, LANE_STAGE>;
        for (var c = 0u; c < HEAD_DIM && lane < count; c++) {
            let qc = q[c];
            let gc = g[c];
            for (var i = 0u; i < LANE_STAGE; i++) {
                let j = lane + i * LANES;
                if (j < count) {
                    s[i] += qc * stage_a[j * HEAD_DIM + c];
                    dp[i] += gc * stage_b[j * HEAD_DIM + c];
                }
            }
        }
        for (var i = 0u; i < LANE_STAGE; i++) {
            let j = lane + i * LANES;
            if (j < count) {
                let p = exp(s[i] - lse);
                let ds = p * (dp[i] - delta) * ap.scale;
                for (var c = 0u; c < HEAD_DIM; c++) { dq[c] += ds * stage_a[j * HEAD_DIM + c]; }
            }
        }
        workgroupBarrier();
    }
    sum_over_lanes(lid, &dq, 1.0);
    if (lane == 0u && query < ap.seq) {
        for (var c = 0u; c < HEAD_DIM; c++) { bw_dq[query_at + c] = at_store(dq[c]); }
    }
}
