// reduce.wgsl: reductions and prefix sums along one axis. Launchers: src/backend/gpu/reduce.rs.
//
// The input x is viewed as [outer, len, inner] around the axis (backend::AxisView): element
// (o, j, i) sits at o*len*inner + j*inner + i. Outputs are indexed by r = o*inner + i.
// Max and min ignore NaN like Rust's f32::max/min (an all-NaN or empty line gives -inf / +inf);
// argmax is the first index of the largest non-NaN value (0 when there is none), as on the CPU.
//
// reduce_serial  Tensor::sum/max/min/argmax, short axes. One invocation per output r walks
//                j = 0..len in order (sums match the CPU's order exactly).
//                params ReduceParams { outer, len, inner, op } with op REDUCE_SUM (0), _MAX (1),
//                _MIN (2), _ARGMAX (3); x (binding 1, read, array<rd_elem>) -> out (binding 2,
//                read_write, array<u32>: f32 bits, or i32 for argmax) [outer*inner].
//                Workgroup 256; grid folded into x/y over outer*inner invocations.
// reduce_rows    The same for long axes: one workgroup of 256 per output; invocation t folds
//                j = t, t+256, ... and the workgroup combines the 256 partial results in a tree
//                in workgroup memory. Grid: outer*inner workgroups, folded into x/y.
// reduce_serial_values, reduce_rows_values
//                The same walks for sum, max and min, storing the result in the element type
//                (out: binding 2, read_write, array<rd_elem>): an f16 tensor's sum rounded once
//                from its f32 sum, in the kernel. reduce_serial / reduce_rows are then for
//                argmax and for an f16 tensor's sum kept in f32 (ReduceOps::sum_unrounded).
// sum_slices_plus  split-k's sum of slices plus the product's addend, in one pass (below).
// cumsum_serial  Tensor::cumsum. One invocation per line (o, i), inclusive running sum along j
//                (from the end when reverse = 1); same order as the CPU.
//                params ScanParams { outer, len, inner, reverse }; x (binding 1, read, f32) ->
//                out (binding 2, read_write, f32), both [outer, len, inner].
// cumsum_rows    The same for long axes: one workgroup per line scans chunks of 256 elements
//                (Hillis-Steele in workgroup memory) and carries the running total between chunks.

const WG: u32 = 256u;

var<private> INF_BITS: u32 = 0x7f800000u;

fn inf_f32() -> f32 { return bitcast<f32>(INF_BITS); }
fn is_nan(x: f32) -> bool { return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u; }
fn rmax(a: f32, b: f32) -> f32 { return select(b, a, a > b || is_nan(b)); }
fn rmin(a: f32, b: f32) -> f32 { return select(b, a, a < b || is_nan(b)); }

// The element type of the reduced and scanned tensors: f32 here. The f16 build
// (src/backend/gpu/half.rs, `f16_build`) makes the alias between the markers `f16` and the
// cumulative sums' store a conversion; reads widen to f32, so the sums run in f32 either way.
// reduce_serial / reduce_rows write f32 bits (or i32 for argmax) in both builds;
// reduce_serial_values / reduce_rows_values store through rd_store (f16 in the f16 build).
// f16 build: element type
alias rd_elem = f32;
fn rd_store(v: f32) -> rd_elem {
    return v;
}
// f16 build: end

struct ReduceParams { outer: u32, len: u32, inner: u32, op: u32 }

// A partial result: a value and, for argmax, its index (0xffffffff when empty).
struct Acc { v: f32, idx: u32 }

const NO_INDEX: u32 = 0xffffffffu;

// ReduceParams.op: the codes of reduce.rs's `reduce_code`, checked against it by a unit test there
const REDUCE_SUM: u32 = 0u;
const REDUCE_MAX: u32 = 1u;
const REDUCE_MIN: u32 = 2u;
const REDUCE_ARGMAX: u32 = 3u;

fn identity(op: u32) -> Acc {
    switch op {
        case REDUCE_SUM: { return Acc(0.0, NO_INDEX); }
        case REDUCE_MIN: { return Acc(inf_f32(), NO_INDEX); }
        default: { return Acc(-inf_f32(), NO_INDEX); }
    }
}

// Argmax order: a non-NaN value beats NaN, a larger value beats a smaller one, and between equal
// values the smaller index wins. This is associative and commutative, so any combination order
// gives the CPU's "first maximum".
fn argmax_better(a: Acc, b: Acc) -> bool {
    if (b.idx == NO_INDEX) { return true; }
    if (a.idx == NO_INDEX) { return false; }
    let an = is_nan(a.v);
    let bn = is_nan(b.v);
    if (an != bn) { return bn; }
    if (!an && a.v != b.v) { return a.v > b.v; }
    return a.idx < b.idx;
}

fn combine(op: u32, a: Acc, b: Acc) -> Acc {
    switch op {
        case REDUCE_SUM: { return Acc(a.v + b.v, NO_INDEX); }
        case REDUCE_MAX: { return Acc(rmax(a.v, b.v), NO_INDEX); }
        case REDUCE_MIN: { return Acc(rmin(a.v, b.v), NO_INDEX); }
        default: {
            if (argmax_better(a, b)) { return a; }
            return b;
        }
    }
}

fn finish(op: u32, a: Acc) -> u32 {
    if (op == REDUCE_ARGMAX) { return select(a.idx, 0u, a.idx == NO_INDEX); }
    return bitcast<u32>(a.v);
}

// ---- reduce_serial --------------------------------------------------------------------------

@group(0) @binding(0) var<uniform> rs_p: ReduceParams;
@group(0) @binding(1) var<storage, read> rs_x: array<rd_elem>;
@group(0) @binding(2) var<storage, read_write> rs_out: array<u32>;
@group(0) @binding(2) var<storage, read_write> rs_values: array<rd_elem>;

// Output r's line combined in order, j = 0..len.
fn serial_line(r: u32) -> Acc {
    let o = r / rs_p.inner;
    let i = r % rs_p.inner;
    let base = o * rs_p.len * rs_p.inner + i;
    var acc = identity(rs_p.op);
    for (var j = 0u; j < rs_p.len; j = j + 1u) {
        acc = combine(rs_p.op, acc, Acc(f32(rs_x[base + j * rs_p.inner]), j));
    }
    return acc;
}

@compute @workgroup_size(256)
fn reduce_serial(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32) {
    let r = (wid.y * nwg.x + wid.x) * WG + lid;
    if (r >= rs_p.outer * rs_p.inner) { return; }
    rs_out[r] = finish(rs_p.op, serial_line(r));
}

@compute @workgroup_size(256)
fn reduce_serial_values(@builtin(workgroup_id) wid: vec3<u32>,
                        @builtin(num_workgroups) nwg: vec3<u32>,
                        @builtin(local_invocation_index) lid: u32) {
    let r = (wid.y * nwg.x + wid.x) * WG + lid;
    if (r >= rs_p.outer * rs_p.inner) { return; }
    rs_values[r] = rd_store(serial_line(r).v);
}

// ---- sum_slices_plus ------------------------------------------------------------------------

// split-k's last pass where the product adds a pending gradient or a residual
// (src/backend/gpu/matmul.rs, `sum_slices_plus`): out[r] = pending[r] + Σ_j x[j·inner + r],
// the slices summed in order as reduce_serial sums them (ReduceParams { 1, len = slices, inner,
// REDUCE_SUM }), then the addend added: the bits of reduce_serial followed by the add kernel.
// x (binding 1, read) [len, inner] -> out (binding 2, read_write, f32 bits) [inner]; pending
// (binding 3, read, f32) [inner]. Workgroup 256; grid folded into x/y over inner invocations.
@group(0) @binding(0) var<uniform> sp_p: ReduceParams;
@group(0) @binding(1) var<storage, read> sp_x: array<rd_elem>;
@group(0) @binding(2) var<storage, read_write> sp_out: array<u32>;
@group(0) @binding(3) var<storage, read> sp_pending: array<f32>;

@compute @workgroup_size(256)
fn sum_slices_plus(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_index) lid: u32) {
    let r = (wid.y * nwg.x + wid.x) * WG + lid;
    if (r >= sp_p.inner) { return; }
    var acc = identity(REDUCE_SUM);
    for (var j = 0u; j < sp_p.len; j = j + 1u) {
        acc = combine(REDUCE_SUM, acc, Acc(f32(sp_x[j * sp_p.inner + r]), j));
    }
    sp_out[r] = bitcast<u32>(sp_pending[r] + acc.v);
}

// ---- reduce_rows ----------------------------------------------------------------------------

@group(0) @binding(0) var<uniform> rr_p: ReduceParams;
@group(0) @binding(1) var<storage, read> rr_x: array<rd_elem>;
@group(0) @binding(2) var<storage, read_write> rr_out: array<u32>;
@group(0) @binding(2) var<storage, read_write> rr_values: array<rd_elem>;

var<workgroup> rr_v: array<f32, 256>;
var<workgroup> rr_i: array<u32, 256>;

@compute @workgroup_size(256)
fn reduce_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let r = wid.y * nwg.x + wid.x;
    if (r >= rr_p.outer * rr_p.inner) { return; }
    rows_line(r, lid);
    if (lid == 0u) { rr_out[r] = finish(rr_p.op, Acc(rr_v[0], rr_i[0])); }
}

@compute @workgroup_size(256)
fn reduce_rows_values(@builtin(workgroup_id) wid: vec3<u32>,
                      @builtin(num_workgroups) nwg: vec3<u32>,
                      @builtin(local_invocation_index) lid: u32) {
    let r = wid.y * nwg.x + wid.x;
    if (r >= rr_p.outer * rr_p.inner) { return; }
    rows_line(r, lid);
    if (lid == 0u) { rr_values[r] = rd_store(rr_v[0]); }
}

// Output r's line combined by the workgroup (called by all 256 invocations): the result is
// left in rr_v[0] and rr_i[0].
fn rows_line(r: u32, lid: u32) {
    let o = r / rr_p.inner;
    let i = r % rr_p.inner;
    let base = o * rr_p.len * rr_p.inner + i;
    let op = rr_p.op;
    var acc = identity(op);
    for (var j = lid; j < rr_p.len; j = j + WG) {
        acc = combine(op, acc, Acc(f32(rr_x[base + j * rr_p.inner]), j));
    }
    rr_v[lid] = acc.v;
    rr_i[lid] = acc.idx;
    workgroupBarrier();
    for (var half = WG / 2u; half > 0u; half = half / 2u) {
        if (lid < half) {
            let c = combine(op, Acc(rr_v[lid], rr_i[lid]), Acc(rr_v[lid + half], rr_i[lid + half]));
            rr_v[lid] = c.v;
            rr_i[lid] = c.idx;
        }
        workgroupBarrier();
    }
}

// ---- cumsum_serial --------------------------------------------------------------------------

struct ScanParams { outer: u32, len: u32, inner: u32, reverse: u32 }

@group(0) @binding(0) var<uniform> cs_p: ScanParams;
@group(0) @binding(1) var<storage, read> cs_x: array<rd_elem>;
@group(0) @binding(2) var<storage, read_write> cs_out: array<rd_elem>;

@compute @workgroup_size(256)
fn cumsum_serial(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32) {
    let r = (wid.y * nwg.x + wid.x) * WG + lid;
    if (r >= cs_p.outer * cs_p.inner) { return; }
    let o = r / cs_p.inner;
    let i = r % cs_p.inner;
    let base = o * cs_p.len * cs_p.inner + i;
    var acc = 0.0;
    for (var step = 0u; step < cs_p.len; step = step + 1u) {
        let j = select(step, cs_p.len - 1u - step, cs_p.reverse != 0u);
        let at = base + j * cs_p.inner;
        acc = acc + f32(cs_x[at]);
        cs_out[at] = rd_store(acc);
    }
}

// ---- cumsum_rows ----------------------------------------------------------------------------

@group(0) @binding(0) var<uniform> cr_p: ScanParams;
@group(0) @binding(1) var<storage, read> cr_x: array<rd_elem>;
@group(0) @binding(2) var<storage, read_write> cr_out: array<rd_elem>;

var<workgroup> cr_s: array<f32, 256>;

@compute @workgroup_size(256)
fn cumsum_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let r = wid.y * nwg.x + wid.x;
    if (r >= cr_p.outer * cr_p.inner) { return; }
    let len = cr_p.len;
    let o = r / cr_p.inner;
    let i = r % cr_p.inner;
    let base = o * len * cr_p.inner + i;
    var carry = 0.0;
    for (var start = 0u; start < len; start = start + WG) {
        let step = start + lid;
        let j = select(step, len - 1u - step, cr_p.reverse != 0u);
        var v = 0.0;
        if (step < len) { v = f32(cr_x[base + j * cr_p.inner]); }
        cr_s[lid] = v;
        workgroupBarrier();
        for (var off = 1u; off < WG; off = off * 2u) {
            var t = cr_s[lid];
            if (lid >= off) { t = t + cr_s[lid - off]; }
            workgroupBarrier();
            cr_s[lid] = t;
            workgroupBarrier();
        }
        if (step < len) { cr_out[base + j * cr_p.inner] = rd_store(carry + cr_s[lid]); }
        carry = carry + cr_s[WG - 1u];
        workgroupBarrier();
    }
}
