// routing.wgsl: the MoE routing kernels: a top-k router's gate (softmax, selection and
// normalisation in one pass) and its backward, the row softmax and its backward, and the dispatch plan
// (assignments sorted by expert, with capacity).
// Launcher: src/backend/gpu/routing.rs (Tensor::topk_gate and its backward rules,
// moe::DispatchPlan::build). The CPU computes the same in src/backend/cpu/routing.rs.
//
// Values are ordered as sort.wgsl orders them: an order-preserving u32 key per f32 with NaN taken
// as -inf and -0 as +0; ties go to the lowest index.
//
// topk_gate            one invocation per row r of [rows, n], 64 per workgroup:
//                      probs[r] = softmax(logits[r]); idx[r, 0..k] = the k largest of scores[r]
//                      in descending order; weights[r, j] = the softmax over the k selected
//                      scores (renormalise = 1) or probs[r, idx[r, j]] (renormalise = 0).
//                      params GateParams { rows, n, k, renormalise }; logits (binding 1, read,
//                      f32 [rows, n]), scores (binding 2, read, f32 [rows, n]; the logits bound
//                      again when the router adds no noise) -> probs (binding 3, read_write,
//                      f32 [rows, n]), idx (binding 4, read_write, i32 [rows, k]), weights
//                      (binding 5, read_write, f32 [rows, k]). Cost per row: (k + 3)·n.
// softmax_rows         one invocation per row r of [rows, n], 64 per workgroup: probs[r] =
//                      softmax(logits[r]), as topk_gate computes it (the same function).
//                      params GateParams { rows, n } (k and renormalise unused); logits
//                      (binding 1) -> probs (binding 3) (bindings 2, 4 and 5 unused). Cost per
//                      row: 3·n, on one invocation: meant for rows of a router's width.
// topk_gate_backward   one invocation per row: the gradient of the gate's weights for the
//                      upstream d_weights = a. renormalise: out[r, idx_j] = w_j (a_j − Σ_i w_i a_i),
//                      zero elsewhere. Not renormalised: out[r, c] = p_c (a'_c − Σ_j a_j w_j), a'
//                      being a scattered to idx. params BackParams { rows, n, k, has_probs,
//                      has_pending }; weights (binding 1, read, f32 [rows, k]), idx (binding 2,
//                      read, i32), d_weights (binding 3, read, f32 [rows, k]), probs (binding 4,
//                      read, f32 [rows, n]; the weights again when has_probs = 0) -> out
//                      (binding 5, read_write, f32 [rows, n]). With has_pending = 1, out is
//                      pending (binding 6, read, f32 [rows, n]) + that gradient: the gradient
//                      the logits already have, folded in (the tape's folding rule); binding 6
//                      is any buffer, unread, otherwise.
// softmax_backward     one invocation per row of [rows, n]: out = y ⊙ (dy − Σ dy ⊙ y), plus
//                      pending with has_pending = 1. params BackParams { rows, n, has_pending }
//                      (k and has_probs unused); y (binding 1), dy (binding 3), out (binding 5),
//                      pending (binding 6) (binding 2 unused, binding 4 unused).
// The dispatch plan's order is by key (an assignment's key is e = expert[i] when valid[i] ≠ 0
// and 0 ≤ e < n, else n: the trash group), then, when the plan has a capacity (priority = 1),
// by rank ascending and weight descending, then by index. A dropless plan (priority = 0) keeps
// index order within a key: its rows are only ever all kept, so no priority is needed. Three
// ways to compute it (the launcher, src/backend/gpu/routing.rs, picks one):
//
// plan_sort            up to PLAN_SORT_MAX assignments, one dispatch: invocation i < A counts,
//                      over every assignment j, the keys below its own and the assignments of
//                      its key ordered before it, and writes order[below + before] = i (O(A) per
//                      invocation, tiles of 256 assignments staged in workgroup memory).
//                      Invocation A + e (e ≤ n) counts the keys below e and equal to e: offsets[e],
//                      routed[e] and kept[e] = min(routed[e], capacity).
//                      params PlanParams { a, n, capacity (0xffffffff: none), priority };
//                      expert (binding 1, read, i32 [A]), weight (binding 2, read, f32), rank
//                      (binding 3, read, f32), valid (binding 4, read, f32) -> order (binding 5,
//                      read_write, i32 [A]), offsets (binding 6, read_write, i32 [n + 1]),
//                      routed (binding 7, read_write, f32 [n]), kept (binding 8, read_write,
//                      f32 [n]). 256 invocations per workgroup over A + n + 1, grid folded into
//                      x/y. Then plan_rows.
// plan_chunk_counts,   a larger dropless plan, by a stable counting sort in three dispatches.
// plan_chunk_scan,     The assignments fall in C = ⌈A/256⌉ chunks of 256, and one u32 table
// plan_place           holds counts [(n + 1)·C], key-major (key e's count in chunk c at e·C + c),
//                      then [A] words key·256 + rank (assignment i's key, and its rank among
//                      the earlier assignments of its key in its chunk: below 256).
//                      plan_chunk_counts: one workgroup per chunk writes its column of counts
//                      and its assignments' keys and ranks. expert (binding 1, read, i32 [A]),
//                      valid (binding 2, read, f32 [A]) -> table (binding 3, read_write, u32).
//                      plan_chunk_scan: one workgroup replaces the counts by their exclusive
//                      prefix sums in key-major order (so e·C + c holds where key e's rows of
//                      chunk c start) and writes offsets[e] = the scanned e·C, routed[e] =
//                      offsets[e + 1] − offsets[e] and kept[e] = min(routed[e], capacity).
//                      table (binding 1, read_write) -> offsets (binding 2, read_write, i32
//                      [n + 1]), routed (binding 3, read_write, f32 [n]), kept (binding 4,
//                      read_write, f32 [n]).
//                      plan_place: one invocation per assignment i puts it at s = scanned
//                      count (key, chunk of i) + rank of i, and writes plan_rows's outputs there
//                      (below). table (binding 1, read), token (binding 2, read, i32 [A]) ->
//                      order (binding 3), position (binding 4), row_token (binding 5),
//                      row_expert (binding 6), row_expert_clamped (binding 7), all read_write
//                      i32 [A]; row_kept (binding 8, read_write, f32 [A]).
//                      params PlanParams for all three; grids folded into x/y.
// plan_keys            any other plan: one stable sort (sort.wgsl's words build) of three-word
//                      keys. This entry writes assignment i's key words: words[i] = (key,
//                      order_key(rank[i]), ~order_key(weight[i])), or (key, 0, 0) when
//                      priority = 0; as unsigned words, ascending order is the plan's
//                      (ties to the lower index, which the sort adds). params PlanParams; expert
//                      (binding 1, read, i32 [A]), weight (binding 2, read, f32), rank (binding
//                      3, read, f32), valid (binding 4, read, f32) -> words (binding 5,
//                      read_write, u32 [A, 3]). One invocation per assignment.
// plan_counts          from the sorted order, invocation e ≤ n binary-searches the first
//                      position whose key (words[order[s]].0) is at least e: offsets[e]; for
//                      e < n, routed[e] = offsets[e + 1] − offsets[e] and kept[e] =
//                      min(routed[e], capacity) (plan_sort's outputs). params PlanParams;
//                      order (binding 1, read, i32 [A]), words (binding 2, read, u32 [A, 3])
//                      -> offsets (binding 3, read_write, i32 [n + 1]), routed (binding 4,
//                      read_write, f32 [n]), kept (binding 5, read_write, f32 [n]). One
//                      invocation per key. Then plan_rows.
// plan_rows            one invocation per sorted row s < A: its assignment i = order[s], its key
//                      (the last e with offsets[e] ≤ s, by binary search), its position within
//                      the key s − offsets[key] and whether it is kept; and position[i] = s
//                      (order is a permutation of 0..A, so every position is written once).
//                      params PlanParams; order (binding 1, read, i32), token (binding 2, read,
//                      i32 [A]), offsets (binding 3, read, i32) -> row_token (binding 4),
//                      row_expert (binding 5, −1 when not kept), row_expert_clamped (binding 6,
//                      the key clamped to 0..n), all read_write i32 [A]; row_kept (binding 7,
//                      read_write, f32 [A], 1 or 0); position (binding 8, read_write, i32 [A]).

const WG: u32 = 256u;
const NONE: u32 = 0xffffffffu;

fn flat_index(wid: vec3<u32>, nwg: vec3<u32>, lid: u32, size: u32) -> u32 {
    return (wid.y * nwg.x + wid.x) * size + lid;
}

// The order-preserving key of an f32 (sort.wgsl's order_key).
fn order_key(x: f32) -> u32 {
    var v = bitcast<u32>(x);
    if ((v & 0x7fffffffu) > 0x7f800000u) { v = 0xff800000u; } // NaN -> -inf
    if (v == 0x80000000u) { v = 0u; }                         // -0 -> +0
    if ((v & 0x80000000u) != 0u) { return ~v; }
    return v | 0x80000000u;
}

// ---- topk_gate ------------------------------------------------------------------------------

struct GateParams { rows: u32, n: u32, k: u32, renormalise: u32 }

@group(0) @binding(0) var<uniform> gp: GateParams;
@group(0) @binding(1) var<storage, read> gate_logits: array<f32>;
@group(0) @binding(2) var<storage, read> gate_scores: array<f32>;
@group(0) @binding(3) var<storage, read_write> gate_probs: array<f32>;
@group(0) @binding(4) var<storage, read_write> gate_idx: array<i32>;
@group(0) @binding(5) var<storage, read_write> gate_weights: array<f32>;

// probs[base..base + n] = the softmax of logits[base..base + n]: e^(x − m) / Σ e^(x − m), m the
// row's maximum (the CPU's softmax_row in src/backend/cpu/routing.rs, term for term).
fn softmax_row(base: u32, n: u32) {
    var m = gate_logits[base];
    for (var c = 1u; c < n; c = c + 1u) { m = max(m, gate_logits[base + c]); }
    var total = 0.0;
    for (var c = 0u; c < n; c = c + 1u) {
        let e = exp(gate_logits[base + c] - m);
        gate_probs[base + c] = e;
        total = total + e;
    }
    for (var c = 0u; c < n; c = c + 1u) { gate_probs[base + c] = gate_probs[base + c] / total; }
}

@compute @workgroup_size(64)
fn softmax_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let r = flat_index(wid, nwg, lid, 64u);
    if (r >= gp.rows) { return; }
    softmax_row(r * gp.n, gp.n);
}

@compute @workgroup_size(64)
fn topk_gate(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_index) lid: u32) {
    let r = flat_index(wid, nwg, lid, 64u);
    if (r >= gp.rows) { return; }
    let n = gp.n;
    let base = r * n;
    softmax_row(base, n);
    // k passes, each taking the best score strictly after the previous pick in the order
    // (key descending, index ascending)
    var prev_key = 0u;
    var prev_c = 0u;
    var top = 0.0;
    for (var j = 0u; j < gp.k; j = j + 1u) {
        var best_key = 0u;
        var best_c = NONE;
        for (var c = 0u; c < n; c = c + 1u) {
            let kc = order_key(gate_scores[base + c]);
            let after_prev = j == 0u || kc < prev_key || (kc == prev_key && c > prev_c);
            if (after_prev && (best_c == NONE || kc > best_key)) {
                best_key = kc;
                best_c = c;
            }
        }
        prev_key = best_key;
        prev_c = best_c;
        gate_idx[r * gp.k + j] = i32(best_c);
        let s = gate_scores[base + best_c];
        if (j == 0u) { top = s; } else { top = max(top, s); }
    }
    if (gp.renormalise != 0u) {
        var sum = 0.0;
        for (var j = 0u; j < gp.k; j = j + 1u) {
            let e = exp(gate_scores[base + u32(gate_idx[r * gp.k + j])] - top);
            gate_weights[r * gp.k + j] = e;
            sum = sum + e;
        }
        for (var j = 0u; j < gp.k; j = j + 1u) {
            gate_weights[r * gp.k + j] = gate_weights[r * gp.k + j] / sum;
        }
    } else {
        for (var j = 0u; j < gp.k; j = j + 1u) {
            gate_weights[r * gp.k + j] = gate_probs[base + u32(gate_idx[r * gp.k + j])];
        }
    }
}

// ---- topk_gate_backward, softmax_backward ---------------------------------------------------

struct BackParams { rows: u32, n: u32, k: u32, has_probs: u32, has_pending: u32 }

@group(0) @binding(0) var<uniform> bp: BackParams;
@group(0) @binding(1) var<storage, read> back_w: array<f32>;
@group(0) @binding(2) var<storage, read> back_idx: array<i32>;
@group(0) @binding(3) var<storage, read> back_dw: array<f32>;
@group(0) @binding(4) var<storage, read> back_probs: array<f32>;
@group(0) @binding(5) var<storage, read_write> back_out: array<f32>;
@group(0) @binding(6) var<storage, read> back_pending: array<f32>;

@compute @workgroup_size(64)
fn topk_gate_backward(@builtin(workgroup_id) wid: vec3<u32>,
                      @builtin(num_workgroups) nwg: vec3<u32>,
                      @builtin(local_invocation_index) lid: u32) {
    let r = flat_index(wid, nwg, lid, 64u);
    if (r >= bp.rows) { return; }
    let n = bp.n;
    let k = bp.k;
    var dot = 0.0;
    for (var j = 0u; j < k; j = j + 1u) { dot = dot + back_w[r * k + j] * back_dw[r * k + j]; }
    if (bp.has_probs == 0u) {
        for (var c = 0u; c < n; c = c + 1u) { back_out[r * n + c] = 0.0; }
        for (var j = 0u; j < k; j = j + 1u) {
            let c = u32(back_idx[r * k + j]);
            if (c < n) { back_out[r * n + c] = back_w[r * k + j] * (back_dw[r * k + j] - dot); }
        }
    } else {
        for (var c = 0u; c < n; c = c + 1u) { back_out[r * n + c] = -back_probs[r * n + c] * dot; }
        for (var j = 0u; j < k; j = j + 1u) {
            let c = u32(back_idx[r * k + j]);
            if (c < n) {
                back_out[r * n + c] = back_out[r * n + c] + back_probs[r * n + c] * back_dw[r * k + j];
            }
        }
    }
    if (bp.has_pending == 1u) {
        for (var c = 0u; c < n; c = c + 1u) {
            back_out[r * n + c] = back_pending[r * n + c] + back_out[r * n + c];
        }
    }
}

@compute @workgroup_size(64)
fn softmax_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                    @builtin(local_invocation_index) lid: u32) {
    let r = flat_index(wid, nwg, lid, 64u);
    if (r >= bp.rows) { return; }
    let base = r * bp.n;
    var dot = 0.0;
    for (var c = 0u; c < bp.n; c = c + 1u) { dot = dot + back_w[base + c] * back_dw[base + c]; }
    for (var c = 0u; c < bp.n; c = c + 1u) {
        let d = back_w[base + c] * (back_dw[base + c] - dot);
        if (bp.has_pending == 1u) {
            back_out[base + c] = back_pending[base + c] + d;
        } else {
            back_out[base + c] = d;
        }
    }
}

// ---- plan_sort ------------------------------------------------------------------------------

struct PlanParams { a: u32, n: u32, capacity: u32, priority: u32 }

@group(0) @binding(0) var<uniform> pp: PlanParams;
@group(0) @binding(1) var<storage, read> plan_expert: array<i32>;
@group(0) @binding(2) var<storage, read> plan_weight: array<f32>;
@group(0) @binding(3) var<storage, read> plan_rank: array<f32>;
@group(0) @binding(4) var<storage, read> plan_valid: array<f32>;
@group(0) @binding(5) var<storage, read_write> plan_order: array<i32>;
@group(0) @binding(6) var<storage, read_write> plan_offsets: array<i32>;
@group(0) @binding(7) var<storage, read_write> plan_routed: array<f32>;
@group(0) @binding(8) var<storage, read_write> plan_kept: array<f32>;

var<workgroup> tile_key: array<u32, 256>;
var<workgroup> tile_rank: array<u32, 256>;
var<workgroup> tile_weight: array<u32, 256>;

// The group of assignment i: its expert, or n (trash) when invalid or out of range.
fn plan_key(i: u32) -> u32 {
    let e = plan_expert[i];
    if (plan_valid[i] != 0.0 && e >= 0 && u32(e) < pp.n) { return u32(e); }
    return pp.n;
}

@compute @workgroup_size(256)
fn plan_sort(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_index) lid: u32) {
    let t = flat_index(wid, nwg, lid, WG);
    let a = pp.a;
    let is_row = t < a;
    let is_expert = t >= a && t - a <= pp.n;
    var key = 0u;
    var rank = 0u;
    var weight = 0u;
    if (is_row) {
        key = plan_key(t);
        rank = order_key(plan_rank[t]);
        weight = order_key(plan_weight[t]);
    } else if (is_expert) {
        key = t - a;
    }
    var below = 0u;
    var same = 0u;
    for (var base = 0u; base < a; base = base + WG) {
        let j = base + lid;
        if (j < a) {
            tile_key[lid] = plan_key(j);
            tile_rank[lid] = order_key(plan_rank[j]);
            tile_weight[lid] = order_key(plan_weight[j]);
        }
        workgroupBarrier();
        let count = min(WG, a - base);
        for (var q = 0u; q < count; q = q + 1u) {
            let kq = tile_key[q];
            if (kq < key) {
                below = below + 1u;
            } else if (kq == key) {
                if (is_expert) {
                    same = same + 1u;
                } else {
                    let rq = tile_rank[q];
                    let wq = tile_weight[q];
                    let earlier = base + q < t;
                    let before = select(
                        earlier,
                        rq < rank || (rq == rank && (wq > weight || (wq == weight && earlier))),
                        pp.priority != 0u);
                    if (before) { same = same + 1u; }
                }
            }
        }
        workgroupBarrier();
    }
    if (is_row) {
        plan_order[below + same] = i32(t);
    } else if (is_expert) {
        plan_offsets[key] = i32(below);
        if (key < pp.n) {
            plan_routed[key] = f32(same);
            plan_kept[key] = f32(min(same, pp.capacity));
        }
    }
}

// ---- plan_chunk_counts, plan_chunk_scan, plan_place ------------------------------------------

// The chunks of 256 assignments, C = ⌈A/256⌉.
fn plan_chunks() -> u32 {
    return (pp.a + WG - 1u) / WG;
}

@group(0) @binding(1) var<storage, read> chunk_expert: array<i32>;
@group(0) @binding(2) var<storage, read> chunk_valid: array<f32>;
@group(0) @binding(3) var<storage, read_write> chunk_table: array<u32>;

var<workgroup> chunk_keys: array<u32, 256>;

@compute @workgroup_size(256)
fn plan_chunk_counts(@builtin(workgroup_id) wid: vec3<u32>,
                     @builtin(num_workgroups) nwg: vec3<u32>,
                     @builtin(local_invocation_index) lid: u32) {
    let chunk = wid.y * nwg.x + wid.x;
    let chunks = plan_chunks();
    // the same for the whole workgroup, so the barriers below stay in uniform control flow
    if (chunk >= chunks) { return; }
    let i = chunk * WG + lid;
    var key = NONE; // past A: matches no key
    if (i < pp.a) {
        let e = chunk_expert[i];
        key = pp.n;
        if (chunk_valid[i] != 0.0 && e >= 0 && u32(e) < pp.n) { key = u32(e); }
    }
    chunk_keys[lid] = key;
    // the chunk's column of counts starts at zero: keys absent from it keep that
    for (var e = lid; e <= pp.n; e = e + WG) { chunk_table[e * chunks + chunk] = 0u; }
    workgroupBarrier();
    storageBarrier();
    var before = 0u;
    var after = 0u;
    for (var q = 0u; q < WG; q = q + 1u) {
        if (chunk_keys[q] == key) {
            if (q < lid) { before = before + 1u; } else if (q > lid) { after = after + 1u; }
        }
    }
    if (i < pp.a) {
        let counts = (pp.n + 1u) * chunks;
        chunk_table[counts + i] = (key << 8u) | before;
        // the last assignment of its key in the chunk writes the key's count
        if (after == 0u) { chunk_table[key * chunks + chunk] = before + 1u; }
    }
}

@group(0) @binding(1) var<storage, read_write> scan_table: array<u32>;
@group(0) @binding(2) var<storage, read_write> scan_offsets: array<i32>;
@group(0) @binding(3) var<storage, read_write> scan_routed: array<f32>;
@group(0) @binding(4) var<storage, read_write> scan_kept: array<f32>;

var<workgroup> scan_sums: array<u32, 256>;

@compute @workgroup_size(256)
fn plan_chunk_scan(@builtin(local_invocation_index) lid: u32) {
    let chunks = plan_chunks();
    let len = (pp.n + 1u) * chunks;
    // invocation lid scans the counts start..end; the launcher keeps len small (COUNT_TABLE_MAX)
    let per = (len + WG - 1u) / WG;
    let start = min(lid * per, len);
    let end = min(start + per, len);
    var sum = 0u;
    for (var j = start; j < end; j = j + 1u) { sum = sum + scan_table[j]; }
    scan_sums[lid] = sum;
    workgroupBarrier();
    if (lid == 0u) {
        // 256 segment sums to their exclusive prefix sums, in one invocation
        var run = 0u;
        for (var q = 0u; q < WG; q = q + 1u) {
            let s = scan_sums[q];
            scan_sums[q] = run;
            run = run + s;
        }
    }
    workgroupBarrier();
    var run = scan_sums[lid];
    for (var j = start; j < end; j = j + 1u) {
        let c = scan_table[j];
        scan_table[j] = run;
        run = run + c;
    }
    storageBarrier();
    for (var e = lid; e <= pp.n; e = e + WG) {
        let first = scan_table[e * chunks];
        scan_offsets[e] = i32(first);
        if (e < pp.n) {
            let routed = scan_table[(e + 1u) * chunks] - first;
            scan_routed[e] = f32(routed);
            scan_kept[e] = f32(min(routed, pp.capacity));
        }
    }
}

@group(0) @binding(1) var<storage, read> place_table: array<u32>;
@group(0) @binding(2) var<storage, read> place_token: array<i32>;
@group(0) @binding(3) var<storage, read_write> place_order: array<i32>;
@group(0) @binding(4) var<storage, read_write> place_position: array<i32>;
@group(0) @binding(5) var<storage, read_write> place_row_token: array<i32>;
@group(0) @binding(6) var<storage, read_write> place_row_expert: array<i32>;
@group(0) @binding(7) var<storage, read_write> place_row_clamped: array<i32>;
@group(0) @binding(8) var<storage, read_write> place_row_kept: array<f32>;

@compute @workgroup_size(256)
fn plan_place(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let i = flat_index(wid, nwg, lid, WG);
    if (i >= pp.a) { return; }
    let chunks = plan_chunks();
    let counts = (pp.n + 1u) * chunks;
    let key = place_table[counts + i] >> 8u;
    let rank = place_table[counts + i] & 0xffu;
    let s = place_table[key * chunks + i / WG] + rank;
    place_order[s] = i32(i);
    place_position[i] = i32(s);
    place_row_token[s] = place_token[i];
    let kept = key < pp.n && s - place_table[key * chunks] < pp.capacity;
    if (kept) {
        place_row_expert[s] = i32(key);
        place_row_kept[s] = 1.0;
    } else {
        place_row_expert[s] = -1;
        place_row_kept[s] = 0.0;
    }
    place_row_clamped[s] = i32(min(key, pp.n - 1u));
}

// ---- plan_keys ------------------------------------------------------------------------------

@group(0) @binding(1) var<storage, read> keys_expert: array<i32>;
@group(0) @binding(2) var<storage, read> keys_weight: array<f32>;
@group(0) @binding(3) var<storage, read> keys_rank: array<f32>;
@group(0) @binding(4) var<storage, read> keys_valid: array<f32>;
@group(0) @binding(5) var<storage, read_write> keys_words: array<u32>;

@compute @workgroup_size(256)
fn plan_keys(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_index) lid: u32) {
    let i = flat_index(wid, nwg, lid, WG);
    if (i >= pp.a) { return; }
    let e = keys_expert[i];
    var key = pp.n;
    if (keys_valid[i] != 0.0 && e >= 0 && u32(e) < pp.n) { key = u32(e); }
    keys_words[3u * i] = key;
    var rank = 0u;
    var weight = 0u;
    if (pp.priority != 0u) {
        rank = order_key(keys_rank[i]);
        weight = ~order_key(keys_weight[i]);
    }
    keys_words[3u * i + 1u] = rank;
    keys_words[3u * i + 2u] = weight;
}

// ---- plan_counts ----------------------------------------------------------------------------

@group(0) @binding(1) var<storage, read> counts_order: array<i32>;
@group(0) @binding(2) var<storage, read> counts_words: array<u32>;
@group(0) @binding(3) var<storage, read_write> counts_offsets: array<i32>;
@group(0) @binding(4) var<storage, read_write> counts_routed: array<f32>;
@group(0) @binding(5) var<storage, read_write> counts_kept: array<f32>;

// The first sorted position whose key is ≥ e (A when there is none).
fn first_at_least(e: u32) -> u32 {
    var lo = 0u;
    var hi = pp.a;
    while (lo < hi) {
        let mid = (lo + hi) / 2u;
        if (counts_words[3u * u32(counts_order[mid])] < e) { lo = mid + 1u; } else { hi = mid; }
    }
    return lo;
}

@compute @workgroup_size(256)
fn plan_counts(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let e = flat_index(wid, nwg, lid, WG);
    if (e > pp.n) { return; }
    let start = first_at_least(e);
    counts_offsets[e] = i32(start);
    if (e < pp.n) {
        let routed = first_at_least(e + 1u) - start;
        counts_routed[e] = f32(routed);
        counts_kept[e] = f32(min(routed, pp.capacity));
    }
}

// ---- plan_rows ------------------------------------------------------------------------------

@group(0) @binding(1) var<storage, read> rows_order: array<i32>;
@group(0) @binding(2) var<storage, read> rows_token: array<i32>;
@group(0) @binding(3) var<storage, read> rows_offsets: array<i32>;
@group(0) @binding(4) var<storage, read_write> rows_out_token: array<i32>;
@group(0) @binding(5) var<storage, read_write> rows_out_expert: array<i32>;
@group(0) @binding(6) var<storage, read_write> rows_out_clamped: array<i32>;
@group(0) @binding(7) var<storage, read_write> rows_out_kept: array<f32>;
@group(0) @binding(8) var<storage, read_write> rows_out_position: array<i32>;

@compute @workgroup_size(256)
fn plan_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_index) lid: u32) {
    let s = flat_index(wid, nwg, lid, WG);
    if (s >= pp.a) { return; }
    let i = u32(rows_order[s]);
    rows_out_token[s] = rows_token[min(i, pp.a - 1u)];
    if (i < pp.a) { rows_out_position[i] = i32(s); }
    // the last key e in 0..=n whose rows start at or before s
    var lo = 0u;
    var hi = pp.n;
    while (lo < hi) {
        let mid = (lo + hi + 1u) / 2u;
        if (u32(rows_offsets[mid]) <= s) { lo = mid; } else { hi = mid - 1u; }
    }
    let key = lo;
    let pos = s - u32(rows_offsets[key]);
    let kept = key < pp.n && pos < pp.capacity;
    if (kept) {
        rows_out_expert[s] = i32(key);
        rows_out_kept[s] = 1.0;
    } else {
        rows_out_expert[s] = -1;
        rows_out_kept[s] = 0.0;
    }
    rows_out_clamped[s] = i32(min(key, pp.n - 1u));
}
