// layout.wgsl: kernels that move elements. Launchers: src/backend/gpu/layout.rs.
//
// Every entry runs 256 invocations per workgroup, one output element per invocation, over a 1-D
// grid the host folds into x/y: i = (workgroup_id.y * num_workgroups.x + workgroup_id.x) * 256
// + local index; invocations with i >= n do nothing. copy_strided, concat and gather move raw 32-bit
// words, so they serve f32 and i32 alike (and f16 values in the f16 build, see lay_elem). Gathered/scattered tensors are viewed as
// [outer, len, inner] (backend::AxisView); an index tensor is read at o*s0 + j*s1 + i*s2.
//
// copy_strided         Tensor::contiguous (transpose, permute, expand, slice). params
//                      CopyParams { w: array<vec4<u32>, 5> }: w[0] = n, w[1] = rank (<= 8),
//                      w[2] = element offset, w[4..12] = shape, w[12..20] = strides of x.
//                      x (binding 1, read, array<u32>) -> out (binding 2, read_write, [n]):
//                      out[i] = x[offset + sum_d coord_d(i) * stride_d].
// concat_part          Tensor::cat, one launch per part p: out[o, start + j, i] = part[o, j, i].
//                      params ConcatParams { outer, part_len, inner, total_len, start };
//                      part (binding 1, read, array<u32>) [outer, part_len, inner] ->
//                      out (binding 2, read_write) [outer, total_len, inner].
// gather               Tensor::gather / index_select: out[o, j, i] = x[o, idx[o*s0+j*s1+i*s2], i]
//                      for j < m; an index outside 0..len gives 0 (the CPU rejects it up front).
//                      params GatherParams { outer, len, inner, m, s0, s1, s2 }; x (binding 1,
//                      read, array<u32>) [outer, len, inner], idx (binding 2, read, array<i32>)
//                      -> out (binding 3, read_write) [outer, m, inner].
// scatter_add_loop     the adjoint of gather, deterministic and free of races without atomics: one
//                      invocation per OUTPUT element (o, k, i) loops over the source rows
//                      j = 0..m in order and adds src[o, j, i] where idx[o*s0+j*s1+i*s2] == k.
//                      The additions happen in the CPU's order, so results match it bit for bit.
//                      Cost m per output: used when m is small, when outputs × m is small, or
//                      when the index varies along i.
//                      params ScatterParams { outer, len, inner, m, s0, s1, s2, key_row };
//                      src (binding 1, read, sc_elem) [outer, m, inner], idx (binding 2, read,
//                      i32) -> out (binding 3, read_write, sc_elem) [outer, len, inner].
// scatter_add_sorted   the same result when the index is one per source row (s2 = 0), in
//                      O(log m + hits) per output: keys (binding 4, read, i32) holds row o's
//                      indices contiguously at o*key_row (key_row = 0 when every o shares one
//                      row), perm (binding 5, read, i32) the stable ascending argsort of each key
//                      row. Output (o, k, i) binary-searches the run of k in keys[perm[..]] and
//                      adds src[o, perm[p], i] over it: the rows that hit k in increasing j, again
//                      the CPU's order. Bindings: src 1, out 3, keys 4, perm 5 (idx 2 unused).
// scatter_add_wide     the same result for outputs that many source rows hit (an MoE layer's
//                      per-expert sums over its assignments: a few outputs, thousands of rows
//                      each), where the loop and the sorted entries would each walk a long
//                      chain of dependent reads: one WORKGROUP per output element (o, k, i) (the
//                      workgroup's flat index). Its 256 invocations test 256 consecutive source
//                      rows at a time (neighbouring reads), stage each row's value and whether it
//                      hits k in workgroup memory, and invocation 0 adds the hits in increasing
//                      j: the CPU's order and bits again, with m/256 rounds of global reads
//                      instead of m (or hits) in a chain. Bindings as scatter_add_loop's.
// scatter_add_columns  the same result when the index is one per source row (s2 = 0: the
//                      backward of index_select, such as an embedding's): one WORKGROUP per
//                      output row (o, k) and block of 256 inner columns, invocation = column
//                      i. The indices of 256 source rows at a time are staged in workgroup
//                      memory (one read of neighbouring words), and every invocation walks them
//                      in increasing j, adding src[o, j, i] at each hit: the test is the same
//                      for the whole workgroup (no divergence), the source read neighbouring
//                      columns, and each output's additions the CPU's, in its order. Where
//                      scatter_add_wide runs a workgroup per output element and walks the
//                      staged rows with one invocation, this walks them once per 256 outputs
//                      with every invocation. Bindings as scatter_add_loop's. Grid:
//                      outer·len·⌈inner/256⌉ workgroups, folded into x/y.
// weighted_scatter_loop, weighted_scatter_sorted
//                      Tensor::weighted_index_scatter (the MoE combine), forward: the two
//                      scatter_add kernels with outer = 1, s0 = 0, s1 = 1, s2 = 0, each source
//                      row scaled by its weight as it is added: out[k, i] = Σ_{j : idx[j] = k}
//                      w[j]·src[j, i], each product rounded to sc_elem first (as the composition
//                      mul-then-scatter rounds it), the sum in f32 in increasing j. Bindings as
//                      scatter_add's, plus w (binding 6, read, ws_weight) [m]; the loop entry reads
//                      idx (2) and not keys or perm (4, 5).
// weighted_gather_slots
//                      the same forward when each output's rows are listed k to an output (an
//                      MoE plan's `position` for a token-choice routing: token t's k rows are
//                      slots[t·k..t·k+k], in any order): output (t, i) adds w[r]·src[r, i] over
//                      those rows in increasing r, each step taking the smallest row above the
//                      last (k² reads of slots, no sort of idx), so the same terms in the same
//                      order as the two entries above, and the same bits. params ScatterParams
//                      with m = k, and key_row = 1 to add the rows unweighted (scatter_add's
//                      sum: index_select's backward), s0 = 1 when w is per slot (row slots[s]
//                      weighted by w[s], the routing's own order) rather than per row, and
//                      s2 = 1 to add addend[t, i] (binding 7, read, sc_elem [len, inner]: an MoE
//                      block's residual) to the sum rounded to sc_elem, in f32, rounding once
//                      more (the bits of adding it afterwards; binding 7 unread with s2 = 0);
//                      src 1, out 3, slots 4 (read, i32 [len·k]), w 6 (idx 2 and perm 5 unread,
//                      and w when key_row = 1).
// weighted_scatter_backward
//                      its backward, one workgroup per source row j (the workgroup's flat index):
//                      d_src[j, i] = w[j]·dy[idx[j], i] and d_w[j] = Σ_i dy[idx[j], i]·src[j, i]
//                      (zero for an index outside 0..len). params ScatterParams (len, inner, m,
//                      s0); src 1, idx 2, dy 3, w 4 (read, ws_weight), d_src 5 [m, inner],
//                      d_w 6 [m] (written, ws_weight), order 7 (read, i32 [m]). With s0 = 1
//                      the weights are per slot and order maps each row to its slot: row j's
//                      weight is w[order[j]] and its gradient goes to d_w[order[j]] (order
//                      unread otherwise).

const WG: u32 = 256u;

// The element copy_strided, concat_part and gather move: a 32-bit word (f32 or i32) here. The
// f16 build (src/backend/gpu/half.rs, `f16_build`) makes the aliases between the markers `f16`, so
// the same kernels move f16 values; nothing is converted either way. scatter_add adds, so its
// element is f32 here (sc_elem), f16 in the f16 build, where it sums in f32 and rounds once
// (sc_store).
// f16 build: element type
alias lay_elem = u32;
alias sc_elem = f32;
fn sc_store(v: f32) -> sc_elem {
    return v;
}
// f16 build: end
// The combine's weights (ws_w, wb_w) and their gradient (wb_dw): sc_elem's type here and in the
// f16 build; the f16-rows build (`f16_rows_build`) leaves them f32, so the combine of f16 rows
// reads f32 weights (mixed precision's gate weights, which the router keeps in f32) and writes
// their gradient in f32, unrounded.
// f16 build: weight type
alias ws_weight = f32;
fn ws_weight_store(v: f32) -> ws_weight {
    return v;
}
// f16 build: end

fn flat_index(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> u32 {
    return (wid.y * nwg.x + wid.x) * WG + lid;
}

// ---- copy_strided ---------------------------------------------------------------------------

struct CopyParams { w: array<vec4<u32>, 5> }

@group(0) @binding(0) var<uniform> cp: CopyParams;
@group(0) @binding(1) var<storage, read> copy_x: array<lay_elem>;
@group(0) @binding(2) var<storage, read_write> copy_out: array<lay_elem>;

fn cp_w(i: u32) -> u32 { return cp.w[i >> 2u][i & 3u]; }

@compute @workgroup_size(256)
fn copy_strided(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let i = flat_index(wid, nwg, lid);
    if (i >= cp_w(0u)) { return; }
    var rem = i;
    var off = cp_w(2u);
    for (var d = cp_w(1u); d > 0u; d = d - 1u) {
        let s = cp_w(3u + d);
        off = off + (rem % s) * cp_w(11u + d);
        rem = rem / s;
    }
    copy_out[i] = copy_x[off];
}

// ---- concat_part ----------------------------------------------------------------------------

struct ConcatParams { outer: u32, part_len: u32, inner: u32, total_len: u32, start: u32 }

@group(0) @binding(0) var<uniform> ccp: ConcatParams;
@group(0) @binding(1) var<storage, read> cat_part: array<lay_elem>;
@group(0) @binding(2) var<storage, read_write> cat_out: array<lay_elem>;

@compute @workgroup_size(256)
fn concat_part(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let i = flat_index(wid, nwg, lid);
    let seg = ccp.part_len * ccp.inner;
    if (i >= ccp.outer * seg) { return; }
    let o = i / seg;
    let rem = i % seg;
    cat_out[o * ccp.total_len * ccp.inner + ccp.start * ccp.inner + rem] = cat_part[i];
}

// ---- gather ---------------------------------------------------------------------------------

struct GatherParams { outer: u32, len: u32, inner: u32, m: u32, s0: u32, s1: u32, s2: u32 }

@group(0) @binding(0) var<uniform> gp: GatherParams;
@group(0) @binding(1) var<storage, read> gather_x: array<lay_elem>;
@group(0) @binding(2) var<storage, read> gather_idx: array<i32>;
@group(0) @binding(3) var<storage, read_write> gather_out: array<lay_elem>;

@compute @workgroup_size(256)
fn gather(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_index) lid: u32) {
    let t = flat_index(wid, nwg, lid);
    if (t >= gp.outer * gp.m * gp.inner) { return; }
    let i = t % gp.inner;
    let j = (t / gp.inner) % gp.m;
    let o = t / (gp.inner * gp.m);
    let k = gather_idx[o * gp.s0 + j * gp.s1 + i * gp.s2];
    var v = lay_elem(0);
    if (k >= 0 && u32(k) < gp.len) { v = gather_x[(o * gp.len + u32(k)) * gp.inner + i]; }
    gather_out[t] = v;
}

// ---- scatter_add ----------------------------------------------------------------------------

struct ScatterParams {
    outer: u32, len: u32, inner: u32, m: u32,
    s0: u32, s1: u32, s2: u32, key_row: u32,
}

@group(0) @binding(0) var<uniform> sp: ScatterParams;
@group(0) @binding(1) var<storage, read> sc_src: array<sc_elem>;
@group(0) @binding(2) var<storage, read> sc_idx: array<i32>;
@group(0) @binding(3) var<storage, read_write> sc_out: array<sc_elem>;
@group(0) @binding(4) var<storage, read> sc_keys: array<i32>;
@group(0) @binding(5) var<storage, read> sc_perm: array<i32>;

@compute @workgroup_size(256)
fn scatter_add_loop(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                    @builtin(local_invocation_index) lid: u32) {
    let t = flat_index(wid, nwg, lid);
    if (t >= sp.outer * sp.len * sp.inner) { return; }
    let i = t % sp.inner;
    let k = i32((t / sp.inner) % sp.len);
    let o = t / (sp.inner * sp.len);
    var acc = 0.0;
    for (var j = 0u; j < sp.m; j = j + 1u) {
        if (sc_idx[o * sp.s0 + j * sp.s1 + i * sp.s2] == k) {
            acc = acc + f32(sc_src[(o * sp.m + j) * sp.inner + i]);
        }
    }
    sc_out[t] = sc_store(acc);
}

// One chunk of source rows of scatter_add_wide: row base + q's value and whether it hits.
var<workgroup> sw_value: array<f32, 256>;
var<workgroup> sw_hit: array<u32, 256>;

@compute @workgroup_size(256)
fn scatter_add_wide(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                    @builtin(local_invocation_index) lid: u32) {
    // one output element per workgroup: t is the same for all its invocations (uniform)
    let t = wid.y * nwg.x + wid.x;
    if (t >= sp.outer * sp.len * sp.inner) { return; }
    let i = t % sp.inner;
    let k = i32((t / sp.inner) % sp.len);
    let o = t / (sp.inner * sp.len);
    var acc = 0.0;
    for (var base = 0u; base < sp.m; base = base + WG) {
        let j = base + lid;
        var hit = 0u;
        var value = 0.0;
        if (j < sp.m && sc_idx[o * sp.s0 + j * sp.s1 + i * sp.s2] == k) {
            hit = 1u;
            value = f32(sc_src[(o * sp.m + j) * sp.inner + i]);
        }
        sw_value[lid] = value;
        sw_hit[lid] = hit;
        workgroupBarrier();
        if (lid == 0u) {
            // only the hits are added (adding 0 for a miss could flush a subnormal sum)
            let count = min(WG, sp.m - base);
            for (var q = 0u; q < count; q = q + 1u) {
                if (sw_hit[q] != 0u) { acc = acc + sw_value[q]; }
            }
        }
        workgroupBarrier();
    }
    if (lid == 0u) { sc_out[t] = sc_store(acc); }
}

// One chunk of source rows' indices of scatter_add_columns (row base + q at q).
var<workgroup> scol_idx: array<i32, 256>;

@compute @workgroup_size(256)
fn scatter_add_columns(@builtin(workgroup_id) wid: vec3<u32>,
                       @builtin(num_workgroups) nwg: vec3<u32>,
                       @builtin(local_invocation_index) lid: u32) {
    // one output row and column block per workgroup: g is the same for all its invocations
    let blocks = (sp.inner + WG - 1u) / WG;
    let g = wid.y * nwg.x + wid.x;
    if (g >= sp.outer * sp.len * blocks) { return; }
    let k = i32((g / blocks) % sp.len);
    let o = g / (blocks * sp.len);
    let i = (g % blocks) * WG + lid;
    var acc = 0.0;
    for (var base = 0u; base < sp.m; base = base + WG) {
        // −1 (no row past m) is never an output's k
        var key = -1;
        if (base + lid < sp.m) { key = sc_idx[o * sp.s0 + (base + lid) * sp.s1]; }
        scol_idx[lid] = key;
        workgroupBarrier();
        if (i < sp.inner) {
            // only the hits are added (adding 0 for a miss could flush a subnormal sum)
            let count = min(WG, sp.m - base);
            for (var q = 0u; q < count; q = q + 1u) {
                if (scol_idx[q] == k) {
                    acc = acc + f32(sc_src[(o * sp.m + base + q) * sp.inner + i]);
                }
            }
        }
        workgroupBarrier();
    }
    if (i < sp.inner) { sc_out[(o * sp.len + u32(k)) * sp.inner + i] = sc_store(acc); }
}

// The key at sorted position p of key row `row`.
fn sorted_key(row: u32, p: u32) -> i32 {
    return sc_keys[row + u32(sc_perm[row + p])];
}

@compute @workgroup_size(256)
fn scatter_add_sorted(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                      @builtin(local_invocation_index) lid: u32) {
    let t = flat_index(wid, nwg, lid);
    if (t >= sp.outer * sp.len * sp.inner) { return; }
    let i = t % sp.inner;
    let k = i32((t / sp.inner) % sp.len);
    let o = t / (sp.inner * sp.len);
    let row = o * sp.key_row;
    // first sorted position whose key is >= k
    var lo = 0u;
    var hi = sp.m;
    while (lo < hi) {
        let mid = (lo + hi) / 2u;
        if (sorted_key(row, mid) < k) { lo = mid + 1u; } else { hi = mid; }
    }
    var acc = 0.0;
    for (var p = lo; p < sp.m; p = p + 1u) {
        let j = sc_perm[row + p];
        if (sc_keys[row + u32(j)] != k) { break; }
        acc = acc + f32(sc_src[(o * sp.m + u32(j)) * sp.inner + i]);
    }
    sc_out[t] = sc_store(acc);
}

// ---- weighted_scatter (the MoE combine) -----------------------------------------------------

@group(0) @binding(6) var<storage, read> ws_w: array<ws_weight>;

// Source row j's element i scaled by its weight, rounded as a stored product.
fn weighted_term(j: u32, i: u32) -> f32 {
    return weighted_term_by(j, j, i);
}

// Source row j's element i scaled by the weight ws_w[wj], rounded as a stored product.
fn weighted_term_by(wj: u32, j: u32, i: u32) -> f32 {
    return f32(sc_store(f32(ws_w[wj]) * f32(sc_src[j * sp.inner + i])));
}

@compute @workgroup_size(256)
fn weighted_scatter_loop(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                         @builtin(local_invocation_index) lid: u32) {
    let t = flat_index(wid, nwg, lid);
    if (t >= sp.len * sp.inner) { return; }
    let i = t % sp.inner;
    let k = i32(t / sp.inner);
    var acc = 0.0;
    for (var j = 0u; j < sp.m; j = j + 1u) {
        if (sc_idx[j] == k) { acc = acc + weighted_term(j, i); }
    }
    sc_out[t] = sc_store(acc);
}

@compute @workgroup_size(256)
fn weighted_scatter_sorted(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                           @builtin(local_invocation_index) lid: u32) {
    let t = flat_index(wid, nwg, lid);
    if (t >= sp.len * sp.inner) { return; }
    let i = t % sp.inner;
    let k = i32(t / sp.inner);
    // first sorted position whose key is >= k
    var lo = 0u;
    var hi = sp.m;
    while (lo < hi) {
        let mid = (lo + hi) / 2u;
        if (sorted_key(0u, mid) < k) { lo = mid + 1u; } else { hi = mid; }
    }
    var acc = 0.0;
    for (var p = lo; p < sp.m; p = p + 1u) {
        let j = u32(sc_perm[p]);
        if (sc_keys[j] != k) { break; }
        acc = acc + weighted_term(j, i);
    }
    sc_out[t] = sc_store(acc);
}

@group(0) @binding(7) var<storage, read> gs_addend: array<sc_elem>;

@compute @workgroup_size(256)
fn weighted_gather_slots(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                         @builtin(local_invocation_index) lid: u32) {
    let t = flat_index(wid, nwg, lid);
    if (t >= sp.len * sp.inner) { return; }
    let i = t % sp.inner;
    let first = (t / sp.inner) * sp.m;
    var acc = 0.0;
    var last = -1;
    for (var step = 0u; step < sp.m; step = step + 1u) {
        // the smallest of the output's rows above the last one added (the rows are distinct),
        // and its slot
        var next = 2147483647;
        var slot = first;
        for (var j = 0u; j < sp.m; j = j + 1u) {
            let r = sc_keys[first + j];
            if (r > last && r < next) {
                next = r;
                slot = first + j;
            }
        }
        if (sp.key_row != 0u) {
            acc = acc + f32(sc_src[u32(next) * sp.inner + i]);
        } else {
            acc = acc + weighted_term_by(select(u32(next), slot, sp.s0 == 1u), u32(next), i);
        }
        last = next;
    }
    if (sp.s2 == 1u) {
        sc_out[t] = sc_store(f32(gs_addend[t]) + f32(sc_store(acc)));
    } else {
        sc_out[t] = sc_store(acc);
    }
}

@group(0) @binding(3) var<storage, read> wb_dy: array<sc_elem>;
@group(0) @binding(4) var<storage, read> wb_w: array<ws_weight>;
@group(0) @binding(5) var<storage, read_write> wb_dsrc: array<sc_elem>;
@group(0) @binding(6) var<storage, read_write> wb_dw: array<ws_weight>;
@group(0) @binding(7) var<storage, read> wb_order: array<i32>;
var<workgroup> wb_partial: array<f32, 256>;

@compute @workgroup_size(256)
fn weighted_scatter_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                             @builtin(local_invocation_index) lid: u32) {
    // one row per workgroup; j is the same for all its invocations (uniform)
    let j = wid.y * nwg.x + wid.x;
    if (j >= sp.m) { return; }
    let k = sc_idx[j];
    let hit = k >= 0 && u32(k) < sp.len;
    // the weight's index: the row's, or its slot's (weights per slot)
    var wj = j;
    if (sp.s0 == 1u) { wj = u32(wb_order[j]); }
    let w = f32(wb_w[wj]);
    var acc = 0.0;
    for (var i = lid; i < sp.inner; i = i + WG) {
        var g = 0.0;
        if (hit) { g = f32(wb_dy[u32(k) * sp.inner + i]); }
        wb_dsrc[j * sp.inner + i] = sc_store(w * g);
        acc = acc + f32(sc_store(g * f32(sc_src[j * sp.inner + i])));
    }
    wb_partial[lid] = acc;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s = s / 2u) {
        if (lid < s) { wb_partial[lid] = wb_partial[lid] + wb_partial[lid + s]; }
        workgroupBarrier();
    }
    if (lid == 0u) { wb_dw[wj] = ws_weight_store(wb_partial[0]); }
}
