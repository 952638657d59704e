// rotary.wgsl: the rotary position embedding of Llama-style attention (half-split form), the GPU
// end of `nn::Rotary` (forward, and with `transpose` its backward rule). Launcher:
// src/backend/gpu/rotary.rs.
//
// Layout (contiguous): x and y are [batch, seq, head_dim], row q = b·seq + pos at q·head_dim;
// cos and sin are [table_rows, head_dim] (table_rows >= seq), position pos's row at
// pos·head_dim; sin carries rotate_half's sign (negative on the first half).
// Types: x and y are rt_elem (f32 here, f16 in the f16 build); cos and sin are f32 in both
// builds, so f16 heads (mixed precision) read the f32 tables where they are, never cast.
// Math, with h = head_dim/2 and j' the column paired with j (j + h for j < h, else j − h):
//   forward   y_pj = x_pj·cos_pj + x_pj'·sin_pj
//   transpose y_pj = x_pj·cos_pj + x_pj'·sin_pj'   (the backward: the rotation by −angle)
//
// ---- entry point `rotary` ---------------------------------------------------------------------
//   binding 1 x, 2 cos, 3 sin (read), 4 y (written). One invocation per element of y, 256 per
//   workgroup, over a 1-D grid the host folds into x and y when it needs more than 65535
//   workgroups: i = (wid.y·nwg.x + wid.x)·256 + lid, and invocations with i >= n do nothing.
// params (binding 0, RotaryParams): n = batch·seq·head_dim, seq, head_dim, transpose (0 or 1).

struct RotaryParams { n: u32, seq: u32, head_dim: u32, transpose: u32 }

const WG: u32 = 256u;

// The element type of x and y: f32 here. The f16 build (src/backend/gpu/half.rs) makes the
// alias `f16` and the store a conversion that rounds once; the arithmetic is f32 in both.
// f16 build: element type
alias rt_elem = f32;
fn rt_store(v: f32) -> rt_elem {
    return v;
}
// f16 build: end

@group(0) @binding(0) var<uniform> p: RotaryParams;
@group(0) @binding(1) var<storage, read> x: array<rt_elem>;
@group(0) @binding(2) var<storage, read> cos_table: array<f32>;
@group(0) @binding(3) var<storage, read> sin_table: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<rt_elem>;

@compute @workgroup_size(256)
fn rotary(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_index) lid: u32) {
    let i = (wid.y * nwg.x + wid.x) * WG + lid;
    if (i >= p.n) { return; }
    let dh = p.head_dim;
    let h = dh / 2u;
    let row = i / dh;
    let j = i - row * dh;
    let pair = select(j - h, j + h, j < h);
    let table = (row % p.seq) * dh;
    let sine = select(sin_table[table + j], sin_table[table + pair], p.transpose == 1u);
    y[i] = rt_store(f32(x[i]) * cos_table[table + j] + f32(x[row * dh + pair]) * sine);
}
