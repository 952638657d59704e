// swiglu.wgsl: the gated linear unit of Llama-style feed-forward blocks, the GPU end of
// `Tensor::swiglu` (forward) and of its backward rule. Launchers: src/backend/gpu/swiglu.rs.
//
// Layout (contiguous; f32, or f16 in the f16 build: see sw_elem): x and dx are [rows, 2·half], row r holding the gate a_rj = x[r·2h + j]
// then the up projection b_rj = x[r·2h + h + j] (h = half); y and g (the upstream gradient) are
// [rows, half], element (r, j) at r·h + j.
// Math: σ(a) = 1/(1 + e^(−a)), silu(a) = a·σ(a), silu'(a) = σ(a)·(1 + a·(1 − σ(a))).
//
// ---- entry point `swiglu_forward` -------------------------------------------------------------
//   binding 1 x (read), 2 y (written): y_rj = silu(a_rj)·b_rj.
// ---- entry point `swiglu_backward` ------------------------------------------------------------
//   binding 1 x, 2 g (read), 3 dx (written): dx_rj = g_rj·b_rj·silu'(a_rj) (gate half),
//   dx_r(h+j) = g_rj·silu(a_rj) (up half); σ(a) is recomputed from x.
//
// Both run one invocation per (r, j) of [rows, half], 256 per workgroup, over a 1-D grid the
// host folds into x and y when it needs more than 65535 workgroups: i = (wid.y·nwg.x + wid.x)·256
// + lid, and invocations with i >= rows·half do nothing.
// params (binding 0, SwiGluParams): n = rows·half, half.

struct SwiGluParams { n: u32, half: u32 }

const WG: u32 = 256u;

@group(0) @binding(0) var<uniform> p: SwiGluParams;

// The element type of x, y, g and dx: f32 here. The f16 build (src/backend/gpu/half.rs,
// `f16_build`) makes the alias `f16` and the store a conversion that rounds once; the arithmetic
// is f32 in both.
// f16 build: element type
alias sw_elem = f32;
fn sw_store(v: f32) -> sw_elem {
    return v;
}
// f16 build: end

fn flat_index(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> u32 {
    return (wid.y * nwg.x + wid.x) * WG + lid;
}

// σ(a) without overflow warnings: exp(−a) may be +inf for a very negative a, and 1/inf is 0.
fn sigmoid(a: f32) -> f32 {
    return 1.0 / (1.0 + exp(-a));
}

// ---- swiglu_forward ---------------------------------------------------------------------------

@group(0) @binding(1) var<storage, read> f_x: array<sw_elem>;
@group(0) @binding(2) var<storage, read_write> f_y: array<sw_elem>;

@compute @workgroup_size(256)
fn swiglu_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_index) lid: u32) {
    let i = flat_index(wid, nwg, lid);
    if (i >= p.n) { return; }
    let r = i / p.half;
    let j = i - r * p.half;
    let a = f32(f_x[r * 2u * p.half + j]);
    let b = f32(f_x[r * 2u * p.half + p.half + j]);
    f_y[i] = sw_store(a * sigmoid(a) * b);
}

// ---- swiglu_backward --------------------------------------------------------------------------

@group(0) @binding(1) var<storage, read> b_x: array<sw_elem>;
@group(0) @binding(2) var<storage, read> b_g: array<sw_elem>;
@group(0) @binding(3) var<storage, read_write> b_dx: array<sw_elem>;

@compute @workgroup_size(256)
fn swiglu_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_index) lid: u32) {
    let i = flat_index(wid, nwg, lid);
    if (i >= p.n) { return; }
    let r = i / p.half;
    let j = i - r * p.half;
    let at = r * 2u * p.half + j;
    let a = f32(b_x[at]);
    let b = f32(b_x[at + p.half]);
    let g = f32(b_g[i]);
    let s = sigmoid(a);
    b_dx[at] = sw_store(g * b * (s * (1.0 + a * (1.0 - s))));
    b_dx[at + p.half] = sw_store(g * (a * s));
}
