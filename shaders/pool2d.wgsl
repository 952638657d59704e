// pool2d.wgsl: 2-D max and average pooling, the GPU end of `Tensor::max_pool2d` /
// `Tensor::avg_pool2d` (and their `_padded` forms) and of their backward rules. Launchers:
// src/backend/gpu/pool2d.rs, one function per entry point, same names.
//
// Layout (contiguous, element indices; backend::Pool2dDims): x, dx are [planes, H, W], y, dy
// and argmax (i32) are [planes, OH, OW]; a plane is one channel of one image. Window (oy, ox)
// covers rows oy·stride − padding .. + kernel and the same columns, clipped to the plane (max
// pooling pads with −∞, average pooling with zeros that count: every mean divides by kernel²).
// argmax holds the position row·W + col in its plane of the input each maximum came from, the
// first maximum in row-then-column order; NaN counts as the largest value.
//
// Every entry runs 256 invocations per workgroup, one element per invocation, over a 1-D grid
// the host folds into x/y: i = (workgroup_id.y · num_workgroups.x + workgroup_id.x) · 256 + local
// index; invocations with i ≥ n do nothing.
//
// ---- entry point `max_pool2d_forward` ---------------------------------------------------------
//   binding 1 x (read), 2 y, 3 argmax (written). Invocation = one output.
// ---- entry point `avg_pool2d_forward` ---------------------------------------------------------
//   binding 1 x (read), 2 y (written). Invocation = one output.
// ---- entry point `max_pool2d_backward` --------------------------------------------------------
//   binding 1 dy, 2 argmax (read), 3 dx (written). Invocation = one input pixel: the sum of dy
//   over the outputs whose window covers it and whose argmax names it, in output order (the
//   CPU's order). No atomics.
// ---- entry point `avg_pool2d_backward` --------------------------------------------------------
//   binding 1 dy (read), 2 dx (written). Invocation = one input pixel: Σ dy·(1/kernel²) over the
//   outputs whose window covers it, in output order.
//
// params (binding 0, PoolParams, all u32): planes, height, width, kernel, stride, padding, out_h,
// out_w, n (invocations: outputs for the forward entries, input pixels for the backward ones).
//
// x, y, dy and dx are of pl_elem: f32 here, f16 in the f16 build (src/backend/gpu/half.rs,
// POOL2D_F16_SHADER, mixed precision's image models). Loads widen to f32, every comparison and
// sum is f32, and each output is rounded once (pl_store): a maximum is stored exactly, a mean or
// a gradient's sum as the f16 nearest the f32 result.

struct PoolParams {
    planes: u32,
    height: u32,
    width: u32,
    kernel: u32,
    stride: u32,
    padding: u32,
    out_h: u32,
    out_w: u32,
    n: u32,
}

@group(0) @binding(0) var<uniform> pp: PoolParams;

// The element type of x, y, dy and dx, and the store of an f32 value as one.
// f16 build: element type
alias pl_elem = f32;
fn pl_store(v: f32) -> pl_elem {
    return v;
}
// f16 build: end

const WG: u32 = 256u;

fn flat_index(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> u32 {
    return (wid.y * nwg.x + wid.x) * WG + lid;
}

// The rows (or columns) lo..hi that window o covers in a plane side of `size`: (lo, hi).
fn span(o: u32, size: u32) -> vec2<u32> {
    let start = o * pp.stride;
    let lo = min(max(start, pp.padding) - pp.padding, size);
    let hi = min(max(start + pp.kernel, pp.padding) - pp.padding, size);
    return vec2<u32>(lo, hi);
}

// The outputs lo..hi along one side whose windows cover input coordinate v.
fn covering(v: u32, outs: u32) -> vec2<u32> {
    // window o covers v when o·s − p ≤ v ≤ o·s − p + k − 1
    let top = v + pp.padding;                       // o·s ≤ top
    let hi = min(top / pp.stride + 1u, outs);
    var lo = 0u;
    if (top + 1u > pp.kernel) {
        lo = (top + 1u - pp.kernel + pp.stride - 1u) / pp.stride;  // o·s ≥ top − k + 1
    }
    return vec2<u32>(min(lo, hi), hi);
}

// ---- max_pool2d_forward -----------------------------------------------------------------------

@group(0) @binding(1) var<storage, read> mf_x: array<pl_elem>;
@group(0) @binding(2) var<storage, read_write> mf_y: array<pl_elem>;
@group(0) @binding(3) var<storage, read_write> mf_arg: array<i32>;

@compute @workgroup_size(256)
fn max_pool2d_forward(@builtin(workgroup_id) wid: vec3<u32>,
                      @builtin(num_workgroups) nwg: vec3<u32>,
                      @builtin(local_invocation_index) li: u32) {
    let i = flat_index(wid, nwg, li);
    if (i >= pp.n) {
        return;
    }
    let out_plane = pp.out_h * pp.out_w;
    let plane = i / out_plane;
    let oy = (i % out_plane) / pp.out_w;
    let ox = i % pp.out_w;
    let rows = span(oy, pp.height);
    let cols = span(ox, pp.width);
    let base = plane * pp.height * pp.width;
    var best_at = rows.x * pp.width + cols.x;
    var best = f32(mf_x[base + best_at]);
    for (var r = rows.x; r < rows.y; r++) {
        for (var c = cols.x; c < cols.y; c++) {
            let v = f32(mf_x[base + r * pp.width + c]);
            // v != v: v is NaN
            if (v > best || (v != v && best == best)) {
                best = v;
                best_at = r * pp.width + c;
            }
        }
    }
    mf_y[i] = pl_store(best);
    mf_arg[i] = i32(best_at);
}

// ---- avg_pool2d_forward -----------------------------------------------------------------------

@group(0) @binding(1) var<storage, read> af_x: array<pl_elem>;
@group(0) @binding(2) var<storage, read_write> af_y: array<pl_elem>;

@compute @workgroup_size(256)
fn avg_pool2d_forward(@builtin(workgroup_id) wid: vec3<u32>,
                      @builtin(num_workgroups) nwg: vec3<u32>,
                      @builtin(local_invocation_index) li: u32) {
    let i = flat_index(wid, nwg, li);
    if (i >= pp.n) {
        return;
    }
    let out_plane = pp.out_h * pp.out_w;
    let plane = i / out_plane;
    let rows = span((i % out_plane) / pp.out_w, pp.height);
    let cols = span(i % pp.out_w, pp.width);
    let base = plane * pp.height * pp.width;
    var sum = 0.0;
    for (var r = rows.x; r < rows.y; r++) {
        for (var c = cols.x; c < cols.y; c++) {
            sum += f32(af_x[base + r * pp.width + c]);
        }
    }
    af_y[i] = pl_store(sum * (1.0 / f32(pp.kernel * pp.kernel)));
}

// ---- max_pool2d_backward ----------------------------------------------------------------------

@group(0) @binding(1) var<storage, read> mb_dy: array<pl_elem>;
@group(0) @binding(2) var<storage, read> mb_arg: array<i32>;
@group(0) @binding(3) var<storage, read_write> mb_dx: array<pl_elem>;

@compute @workgroup_size(256)
fn max_pool2d_backward(@builtin(workgroup_id) wid: vec3<u32>,
                       @builtin(num_workgroups) nwg: vec3<u32>,
                       @builtin(local_invocation_index) li: u32) {
    let i = flat_index(wid, nwg, li);
    if (i >= pp.n) {
        return;
    }
    let in_plane = pp.height * pp.width;
    let plane = i / in_plane;
    let at = i % in_plane;
    let oys = covering(at / pp.width, pp.out_h);
    let oxs = covering(at % pp.width, pp.out_w);
    let base = plane * pp.out_h * pp.out_w;
    var sum = 0.0;
    for (var oy = oys.x; oy < oys.y; oy++) {
        for (var ox = oxs.x; ox < oxs.y; ox++) {
            let o = base + oy * pp.out_w + ox;
            if (mb_arg[o] == i32(at)) {
                sum += f32(mb_dy[o]);
            }
        }
    }
    mb_dx[i] = pl_store(sum);
}

// ---- avg_pool2d_backward ----------------------------------------------------------------------

@group(0) @binding(1) var<storage, read> ab_dy: array<pl_elem>;
@group(0) @binding(2) var<storage, read_write> ab_dx: array<pl_elem>;

@compute @workgroup_size(256)
fn avg_pool2d_backward(@builtin(workgroup_id) wid: vec3<u32>,
                       @builtin(num_workgroups) nwg: vec3<u32>,
                       @builtin(local_invocation_index) li: u32) {
    let i = flat_index(wid, nwg, li);
    if (i >= pp.n) {
        return;
    }
    let in_plane = pp.height * pp.width;
    let plane = i / in_plane;
    let at = i % in_plane;
    let oys = covering(at / pp.width, pp.out_h);
    let oxs = covering(at % pp.width, pp.out_w);
    let base = plane * pp.out_h * pp.out_w;
    let area = 1.0 / f32(pp.kernel * pp.kernel);
    var sum = 0.0;
    for (var oy = oys.x; oy < oys.y; oy++) {
        for (var ox = oxs.x; ox < oxs.y; ox++) {
            sum += f32(ab_dy[base + oy * pp.out_w + ox]) * area;
        }
    }
    ab_dx[i] = pl_store(sum);
}
