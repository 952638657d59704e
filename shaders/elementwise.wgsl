// elementwise.wgsl: one output element per invocation. Launchers: src/backend/gpu/elementwise.rs.
//
// Every entry runs 256 invocations per workgroup over a 1-D grid that the host folds into x and y
// when it needs more than 65535 workgroups; the flat index is
// i = (workgroup_id.y * num_workgroups.x + workgroup_id.x) * 256 + local_invocation_index,
// and invocations with i >= n do nothing. Floats follow the CPU backend (src/backend/cpu.rs):
// max/min ignore a NaN operand like Rust's f32::max/min, comparisons give 1.0 or 0.0.
//
// fill        Tensor::full/zeros/ones. params FillParams { n, bits }.
//             out (binding 1, read_write, array<u32>): out[i] = bits (an f32 or i32 bit pattern).
// cast_dtype  Tensor::to_dtype. params CastParams { n, mode }: mode 0 f32 -> i32 (truncation
//             toward zero, saturating, NaN -> 0, as Rust's `as`), 1 i32 -> f32, 2 copy.
//             x (binding 1, read, array<u32>) -> out (binding 2, read_write, array<u32>).
// (unary, binary and where_cond read and write `ew_elem`: f32, or f16 in the f16 build.)
// unary       neg, exp, log, relu, gelu, ... (backend::UnaryOp). params UnaryParams { n, op, p0, p1 }
//             with op the UnaryOp's code (its row in src/backend/elementwise_ops.rs) and p0, p1
//             its f32 parameters (Powf p; Clamp lo, hi; AddScalar c; MulScalar c).
//             x (binding 1, read, array<f32>) -> out (binding 2, read_write, array<f32>), both [n].
// binary      a + b, a < b, ... with broadcasting (backend::BinaryOp, op = its code, the row in
//             src/backend/elementwise_ops.rs; GeluBackward is a * gelu'(b)).
//             params BinaryParams { w: array<vec4<u32>, 7> } read as 28 words:
//             w[0] = n, w[1] = rank (<= 8), w[2] = op, w[4..12] = out shape,
//             w[12..20] = a strides, w[20..28] = b strides (elements; 0 for a broadcast dim).
//             a (binding 1, read, f32), b (binding 2, read, f32) -> out (binding 3, read_write,
//             f32, contiguous over the shape).
// where_cond  Tensor::where_. params WhereParams { w: array<vec4<u32>, 9> }: w[0] = n, w[1] = rank,
//             w[4..12] shape, w[12..20] cond strides, w[20..28] a strides, w[28..36] b strides.
//             cond, a, b (bindings 1-3, read, f32) -> out (binding 4): cond != 0 ? a : b.

const WG: u32 = 256u;

// The element type of the float tensors of `unary`, `binary` and `where_cond`: f32 here. The f16
// build (src/backend/gpu/half.rs, `f16_build`) makes the alias between the markers `f16` and the
// store a conversion that rounds once; loads widen to f32 (`f32(...)`), so every op computes in
// f32 in both builds. `fill` and `cast_dtype` move 32-bit words and are the same in both.
// f16 build: element type
alias ew_elem = f32;
fn ew_store(v: f32) -> ew_elem {
    return v;
}
// f16 build: end

// Bit patterns made at run time (a NaN or infinite constant expression is a WGSL error).
var<private> NAN_BITS: u32 = 0x7fc00000u;
var<private> INF_BITS: u32 = 0x7f800000u;

fn nan_f32() -> f32 { return bitcast<f32>(NAN_BITS); }
fn inf_f32() -> f32 { return bitcast<f32>(INF_BITS); }
fn is_nan(x: f32) -> bool { return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u; }
fn is_inf(x: f32) -> bool { return (bitcast<u32>(x) & 0x7fffffffu) == 0x7f800000u; }

// Rust's f32::max / f32::min: a NaN operand is ignored.
fn rmax(a: f32, b: f32) -> f32 { return select(b, a, a > b || is_nan(b)); }
fn rmin(a: f32, b: f32) -> f32 { return select(b, a, a < b || is_nan(b)); }

fn flat_index(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> u32 {
    return (wid.y * nwg.x + wid.x) * WG + lid;
}

// tanh without overflow for large |x| (some drivers evaluate tanh through exp(2x)).
fn tanh_safe(x: f32) -> f32 {
    let a = abs(x);
    if (a < 0.5) { return tanh(x); }
    let e = exp(-2.0 * a);
    return sign(x) * (1.0 - e) / (1.0 + e);
}

// ln(1 + y), accurate for small y.
fn log1p_f(y: f32) -> f32 {
    let u = 1.0 + y;
    if (u == 1.0) { return y; }
    return log(u) * y / (u - 1.0);
}

fn log_f(x: f32) -> f32 {
    if (x < 0.0) { return nan_f32(); }
    if (x == 0.0) { return -inf_f32(); }
    return log(x);
}

fn sqrt_f(x: f32) -> f32 {
    if (x < 0.0) { return nan_f32(); }
    return sqrt(x);
}

// Rust's f32::powf: negative bases with integer exponents, x^0 = 1, 1^y = 1, signed zeros.
fn powf(x: f32, y: f32) -> f32 {
    if (y == 0.0 || x == 1.0) { return 1.0; }
    if (is_nan(x) || is_nan(y)) { return nan_f32(); }
    if (y == 1.0) { return x; }
    if (y == 2.0) { return x * x; }
    let ax = abs(x);
    if (ax == 1.0 && is_inf(y)) { return 1.0; }
    let y_int = floor(y) == y;
    let y_odd = y_int && abs(y) < 16777216.0 && (i32(y) & 1) == 1;
    if (x == 0.0) {
        if (y > 0.0) { return select(0.0, x, y_odd); }
        return select(inf_f32(), 1.0 / x, y_odd);
    }
    var r: f32;
    if (y == 0.5) { r = sqrt(ax); } else if (y == -1.0) { r = 1.0 / ax; } else { r = exp2(y * log2(ax)); }
    if (x < 0.0) {
        if (!y_int) { return nan_f32(); }
        if (y_odd) { return -r; }
    }
    return r;
}

const GELU_K: f32 = 0.7978845608028654; // sqrt(2/pi)
const GELU_C: f32 = 0.044715;

// `apply_unary(op, x, p0, p1)` and `apply_binary(op, a, b)`, which the unary and binary entry
// points call, and the op codes they switch on (UNARY_NEG, ..., BINARY_GELU_BACKWARD) are not in
// this file: the launcher appends them, generated from the op table in
// src/backend/elementwise_ops.rs (each row holds its op's CPU math and its WGSL body, and its
// index in the table is its code). The helpers those bodies call are below.

// GELU's slope (tanh form): 0.5·(1 + tanh u) + 0.5·x·(1 − tanh² u)·u', u = K·(x + C·x³).
fn gelu_grad(x: f32) -> f32 {
    let inner = GELU_K * (x + GELU_C * x * x * x);
    let t = tanh_safe(inner);
    let dinner = GELU_K * (1.0 + 3.0 * GELU_C * x * x);
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dinner;
}

// ---- fill -----------------------------------------------------------------------------------

struct FillParams { n: u32, bits: u32 }

@group(0) @binding(0) var<uniform> fill_p: FillParams;
@group(0) @binding(1) var<storage, read_write> fill_out: array<u32>;

@compute @workgroup_size(256)
fn fill(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let i = flat_index(wid, nwg, lid);
    if (i < fill_p.n) { fill_out[i] = fill_p.bits; }
}

// ---- cast_dtype -----------------------------------------------------------------------------

struct CastParams { n: u32, mode: u32 }

@group(0) @binding(0) var<uniform> cast_p: CastParams;
@group(0) @binding(1) var<storage, read> cast_x: array<u32>;
@group(0) @binding(2) var<storage, read_write> cast_out: array<u32>;

@compute @workgroup_size(256)
fn cast_dtype(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let i = flat_index(wid, nwg, lid);
    if (i >= cast_p.n) { return; }
    let v = cast_x[i];
    if (cast_p.mode == 0u) {
        let x = bitcast<f32>(v);
        var r: i32;
        if (is_nan(x)) {
            r = 0;
        } else if (x >= 2147483648.0) {
            r = 2147483647;
        } else if (x <= -2147483648.0) {
            r = bitcast<i32>(0x80000000u);
        } else {
            r = i32(x);
        }
        cast_out[i] = bitcast<u32>(r);
    } else if (cast_p.mode == 1u) {
        cast_out[i] = bitcast<u32>(f32(bitcast<i32>(v)));
    } else {
        cast_out[i] = v;
    }
}

// ---- unary ----------------------------------------------------------------------------------

struct UnaryParams { n: u32, op: u32, p0: f32, p1: f32 }

@group(0) @binding(0) var<uniform> un_p: UnaryParams;
@group(0) @binding(1) var<storage, read> un_x: array<ew_elem>;
@group(0) @binding(2) var<storage, read_write> un_out: array<ew_elem>;

@compute @workgroup_size(256)
fn unary(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
         @builtin(local_invocation_index) lid: u32) {
    let i = flat_index(wid, nwg, lid);
    if (i < un_p.n) { un_out[i] = ew_store(apply_unary(un_p.op, f32(un_x[i]), un_p.p0, un_p.p1)); }
}

// ---- binary ---------------------------------------------------------------------------------

struct BinaryParams { w: array<vec4<u32>, 7> }

@group(0) @binding(0) var<uniform> bin_p: BinaryParams;
@group(0) @binding(1) var<storage, read> bin_a: array<ew_elem>;
@group(0) @binding(2) var<storage, read> bin_b: array<ew_elem>;
@group(0) @binding(3) var<storage, read_write> bin_out: array<ew_elem>;

fn bin_w(i: u32) -> u32 { return bin_p.w[i >> 2u][i & 3u]; }

@compute @workgroup_size(256)
fn binary(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_index) lid: u32) {
    let i = flat_index(wid, nwg, lid);
    if (i >= bin_w(0u)) { return; }
    var rem = i;
    var oa = 0u;
    var ob = 0u;
    for (var d = bin_w(1u); d > 0u; d = d - 1u) {
        let s = bin_w(3u + d);
        let c = rem % s;
        rem = rem / s;
        oa = oa + c * bin_w(11u + d);
        ob = ob + c * bin_w(19u + d);
    }
    bin_out[i] = ew_store(apply_binary(bin_w(2u), f32(bin_a[oa]), f32(bin_b[ob])));
}

// ---- where_cond -----------------------------------------------------------------------------

struct WhereParams { w: array<vec4<u32>, 9> }

@group(0) @binding(0) var<uniform> wh_p: WhereParams;
@group(0) @binding(1) var<storage, read> wh_c: array<ew_elem>;
@group(0) @binding(2) var<storage, read> wh_a: array<ew_elem>;
@group(0) @binding(3) var<storage, read> wh_b: array<ew_elem>;
@group(0) @binding(4) var<storage, read_write> wh_out: array<ew_elem>;

fn wh_w(i: u32) -> u32 { return wh_p.w[i >> 2u][i & 3u]; }

@compute @workgroup_size(256)
fn where_cond(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let i = flat_index(wid, nwg, lid);
    if (i >= wh_w(0u)) { return; }
    var rem = i;
    var oc = 0u;
    var oa = 0u;
    var ob = 0u;
    for (var d = wh_w(1u); d > 0u; d = d - 1u) {
        let s = wh_w(3u + d);
        let c = rem % s;
        rem = rem / s;
        oc = oc + c * wh_w(11u + d);
        oa = oa + c * wh_w(19u + d);
        ob = ob + c * wh_w(27u + d);
    }
    wh_out[i] = select(wh_b[ob], wh_a[oa], !(f32(wh_c[oc]) == 0.0));
}
