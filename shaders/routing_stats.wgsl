// routing_stats.wgsl: one training step's routing statistics added into a window's sums, the
// GPU end of `moe::RoutingWindow::add` (src/moe/diagnostics.rs). Launcher:
// src/backend/gpu/routing_stats.rs, same name. The CPU (src/backend/cpu/routing_stats.rs)
// adds in the same order; only `log` may differ in its last bits.
//
// Layout (all f32, contiguous): probs [T, P] (the router's distribution, one row per token),
// logits [L] (the router's logits, any shape flattened), routed and kept [n] (assignments per
// expert before and after capacity), acc and out [P + 2n + 3]:
//   out[c]          = acc[c] + Σ_t probs[t, c]                  c < P   (the distribution's sum)
//   out[P + e]      = acc[P + e] + routed[e]                    e < n
//   out[P + n + e]  = acc[P + n + e] + kept[e]                  e < n
//   out[P + 2n]     = acc[P + 2n] − Σ_{t,c} p·ln(p + 1e-12)     (the tokens' entropies' sum)
//   out[P + 2n + 1] = acc[P + 2n + 1] + Σ_i logits[i]²
//   out[P + 2n + 2] = max(acc[P + 2n + 2], max_i |logits[i]|)   (NaN wins)
// Without acc (params.has_acc = 0, binding 1 is probs again, unread) acc counts as zeros.
//
// ---- entry point `routing_stats` ---------------------------------------------------------
//   binding 1 acc (read), 2 probs (read), 3 logits (read), 4 routed (read), 5 kept (read),
//   6 out (written). One workgroup of WG = 256 invocations (the statistics of a step are small:
//   one launch in place of the eighteen the composition took). The columns of probs are taken
//   in chunks of C = min(P − base, 256); within a chunk, invocation j < G·C (G = ⌊256/C⌋ row
//   groups) owns column base + j mod C and the rows j / C, j / C + G, ..., adding p and
//   p·ln(p + 1e-12) as it goes (neighbouring invocations read neighbouring columns), and
//   invocation c < C then adds the G partial sums of its column in order. The entropy, square
//   and maximum partials of the 256 invocations are combined in a tree (halving the stride).
//
// params (binding 0, StatsParams): rows (T), cols (P), logits (L), experts (n), has_acc.

struct StatsParams { rows: u32, cols: u32, logits: u32, experts: u32, has_acc: u32 }

const WG: u32 = 256u;

@group(0) @binding(0) var<uniform> p: StatsParams;
@group(0) @binding(1) var<storage, read> acc: array<f32>;
@group(0) @binding(2) var<storage, read> probs: array<f32>;
@group(0) @binding(3) var<storage, read> logits: array<f32>;
@group(0) @binding(4) var<storage, read> routed: array<f32>;
@group(0) @binding(5) var<storage, read> kept: array<f32>;
@group(0) @binding(6) var<storage, read_write> out: array<f32>;

var<workgroup> column_sums: array<f32, 256>;
var<workgroup> entropy_sums: array<f32, 256>;
var<workgroup> square_sums: array<f32, 256>;
var<workgroup> maxima: array<f32, 256>;

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

@compute @workgroup_size(256)
fn routing_stats(@builtin(local_invocation_index) lid: u32) {
    var entropy = 0.0;
    for (var base = 0u; base < p.cols; base = base + WG) {
        let chunk = min(p.cols - base, WG);
        let groups = WG / chunk;
        var s = 0.0;
        if (lid < groups * chunk) {
            let col = base + lid % chunk;
            for (var t = lid / chunk; t < p.rows; t = t + groups) {
                let v = probs[t * p.cols + col];
                s = s + v;
                entropy = entropy + v * log(v + 1e-12);
            }
        }
        column_sums[lid] = s;
        workgroupBarrier();
        if (lid < chunk) {
            var total = 0.0;
            for (var g = 0u; g < groups; g = g + 1u) { total = total + column_sums[lid + g * chunk]; }
            out[base + lid] = before(base + lid) + total;
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
