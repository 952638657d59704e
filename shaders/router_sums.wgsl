// router_sums.wgsl: sums over a router's distribution, in one workgroup each: a training
// step's routing statistics added into a window's sums (`routing_stats`, the GPU end of
// `moe::RoutingWindow::add`, src/moe/diagnostics.rs) and the Switch balance loss
// (`balance_loss`, the forward of `moe::aux_loss::balance_loss`; its backward is a broadcast
// product, `ElementwiseOps::binary`). Launchers: src/backend/gpu/router_sums.rs, same names.
// The CPU (src/backend/cpu/router_sums.rs) adds in the same order; only `log` may differ in its
// last bits.
//
// Layout (all f32, contiguous): probs [T, P] (the router's distribution, one row per token).
//
// ---- column sums, both entry points --------------------------------------------------------
//   The columns of probs are taken in chunks of C = min(P − base, 256); within a chunk,
//   invocation j < G·C (G = ⌊256/C⌋ row groups) owns column base + j mod C and the rows j / C,
//   j / C + G, ... (neighbouring invocations read neighbouring columns), and invocation c < C
//   then adds the G partial sums of its column in order. Scalars over the 256 invocations are
//   combined in a tree (halving the stride).
//
// ---- entry point `routing_stats` ---------------------------------------------------------
//   binding 1 acc (read), 2 probs (read), 3 logits (read) [L] (the router's logits, any shape
//   flattened), 4 routed (read) and 5 kept (read) [n] (assignments per expert before and after
//   capacity), 6 out (written) [P + 2n + 3]; acc as out:
//     out[c]          = acc[c] + Σ_t probs[t, c]                  c < P (the distribution's sum)
//     out[P + e]      = acc[P + e] + routed[e]                    e < n
//     out[P + n + e]  = acc[P + n + e] + kept[e]                  e < n
//     out[P + 2n]     = acc[P + 2n] − Σ_{t,c} p·ln(p + 1e-12)     (the tokens' entropies' sum)
//     out[P + 2n + 1] = acc[P + 2n + 1] + Σ_i logits[i]²
//     out[P + 2n + 2] = max(acc[P + 2n + 2], max_i |logits[i]|)   (NaN wins)
//   Without acc (params.has_acc = 0, binding 1 is probs again, unread) acc counts as zeros.
//   One launch in place of the eighteen the composition took.
//
// ---- entry point `balance_loss` ----------------------------------------------------------
//   binding 2 probs (read), 4 counts (read) [P] (assignments per expert, constant), 6 out
//   (written) [1], 7 coef (written) [P] (bindings 1, 3 and 5 unused: the launcher binds probs
//   there):
//     total     = max(Σ_e counts[e], 1)   (the counts' tree sum)
//     coef[e]   = scale · (counts[e] / total)
//     out[0]    = Σ_e coef[e] · Σ_t probs[t, e]   (the loss; the terms in a tree)
//   scale = α·n/T: loss = α·n·Σ_e f_e·P_e, Switch's (Fedus et al. 2021, Eq. 4), and
//   ∂loss/∂probs[t, e] = coef[e], which the backward broadcasts.
//
// params (binding 0, SumsParams): rows (T), cols (P), logits (L), experts (n), has_acc, scale
// (f32 bits; the unused ones 0).

struct SumsParams { rows: u32, cols: u32, logits: u32, experts: u32, has_acc: u32, scale: u32 }

const WG: u32 = 256u;

@group(0) @binding(0) var<uniform> p: SumsParams;
@group(0) @binding(1) var<storage, read> acc: array<f32>;
@group(0) @binding(2) var<storage, read> probs: array<f32>;
@group(0) @binding(3) var<storage, read> logits: array<f32>;
@group(0) @binding(4) var<storage, read> routed: array<f32>;
@group(0) @binding(5) var<storage, read> kept: array<f32>;
@group(0) @binding(6) var<storage, read_write> out: array<f32>;
@group(0) @binding(7) var<storage, read_write> coef_out: array<f32>;

var<workgroup> column_sums: array<f32, 256>;
var<workgroup> entropy_sums: array<f32, 256>;
var<workgroup> square_sums: array<f32, 256>;
var<workgroup> maxima: array<f32, 256>;
var<workgroup> scalars: array<f32, 256>;

// acc[i], or 0 without a window to add to.
fn before(i: u32) -> f32 {
    if (p.has_acc == 0u) { return 0.0; }
    return acc[i];
}

// Whether x is NaN, from its bits (a compiler may fold `x != x` to false).
fn is_nan(x: f32) -> bool { return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u; }

// The larger of a and b, NaN when either is NaN.
fn nan_max(a: f32, b: f32) -> f32 {
    if (is_nan(b) || b > a) { return b; }
    return a;
}

// Invocation lid's partial sum of its column of the chunk at `base` (0 for an idle one), and the
// sum of p·ln(p + 1e-12) over the same elements when `entropy` (else 0).
fn column_partial(base: u32, lid: u32, entropy: bool) -> vec2<f32> {
    let chunk = min(p.cols - base, WG);
    let groups = WG / chunk;
    var s = vec2<f32>(0.0, 0.0);
    if (lid < groups * chunk) {
        let col = base + lid % chunk;
        for (var t = lid / chunk; t < p.rows; t = t + groups) {
            let v = probs[t * p.cols + col];
            s.x = s.x + v;
            if (entropy) { s.y = s.y + v * log(v + 1e-12); }
        }
    }
    return s;
}

// The sum of column base + lid (lid < the chunk's width) from the partials in column_sums.
fn column_total(base: u32, lid: u32) -> f32 {
    let chunk = min(p.cols - base, WG);
    var total = 0.0;
    for (var g = 0u; g < WG / chunk; g = g + 1u) { total = total + column_sums[lid + g * chunk]; }
    return total;
}

// Adds scalars[0..256] in a tree into scalars[0]; every invocation calls it.
fn add_scalars(lid: u32) {
    for (var stride = WG / 2u; stride > 0u; stride = stride / 2u) {
        workgroupBarrier();
        if (lid < stride) { scalars[lid] = scalars[lid] + scalars[lid + stride]; }
    }
    workgroupBarrier();
}

@compute @workgroup_size(256)
fn routing_stats(@builtin(local_invocation_index) lid: u32) {
    var entropy = 0.0;
    for (var base = 0u; base < p.cols; base = base + WG) {
        let part = column_partial(base, lid, true);
        entropy = entropy + part.y;
        column_sums[lid] = part.x;
        workgroupBarrier();
        if (lid < min(p.cols - base, WG)) {
            out[base + lid] = before(base + lid) + column_total(base, lid);
        }
        workgroupBarrier();
    }
    var square = 0.0;
    var largest = 0.0;
    for (var i = lid; i < p.logits; i = i + WG) {
        let v = logits[i];
        square = square + v * v;
        largest = nan_max(largest, abs(v));
    }
    entropy_sums[lid] = entropy;
    square_sums[lid] = square;
    maxima[lid] = largest;
    for (var stride = WG / 2u; stride > 0u; stride = stride / 2u) {
        workgroupBarrier();
        if (lid < stride) {
            entropy_sums[lid] = entropy_sums[lid] + entropy_sums[lid + stride];
            square_sums[lid] = square_sums[lid] + square_sums[lid + stride];
            maxima[lid] = nan_max(maxima[lid], maxima[lid + stride]);
        }
    }
    workgroupBarrier();
    let n = p.experts;
    for (var e = lid; e < n; e = e + WG) {
        out[p.cols + e] = before(p.cols + e) + routed[e];
        out[p.cols + n + e] = before(p.cols + n + e) + kept[e];
    }
    if (lid == 0u) {
        let at = p.cols + 2u * n;
        out[at] = before(at) - entropy_sums[0];
        out[at + 1u] = before(at + 1u) + square_sums[0];
        out[at + 2u] = nan_max(before(at + 2u), maxima[0]);
    }
}

@compute @workgroup_size(256)
fn balance_loss(@builtin(local_invocation_index) lid: u32) {
    // the counts (binding 4, `routed`) summed in a tree
    var c = 0.0;
    for (var e = lid; e < p.cols; e = e + WG) { c = c + routed[e]; }
    scalars[lid] = c;
    add_scalars(lid);
    let total = max(scalars[0], 1.0);
    workgroupBarrier();
    let scale = bitcast<f32>(p.scale);
    var loss = 0.0;
    for (var base = 0u; base < p.cols; base = base + WG) {
        column_sums[lid] = column_partial(base, lid, false).x;
        workgroupBarrier();
        if (lid < min(p.cols - base, WG)) {
            let coef = scale * (routed[base + lid] / total);
            coef_out[base + lid] = coef;
            loss = loss + coef * column_total(base, lid);
        }
        workgroupBarrier();
    }
    scalars[lid] = loss;
    add_scalars(lid);
    if (lid == 0u) { out[0] = scalars[0]; }
}
