// mse.wgsl: the mean squared error of a prediction against a target, the GPU end of
// `Tensor::mse` (forward) and of its backward rule. Launchers: src/backend/gpu/mse.rs, one
// function per entry point, same names.
//
// Layout: x (the prediction), t (the target) and dx are f32 [N], contiguous; partials is f32
// [P], out and g (the upstream gradient of the loss) f32 [1].
// Math: loss = (1/N) Σ_i (x_i − t_i)²; dx_i = (2/N)·g·(x_i − t_i).
//
// ---- entry point `mse_partials` --------------------------------------------------------------
//   binding 1 x (read), 2 t (read), 3 partials (written). P workgroups of WG = 256 invocations
//   (P = params.partials ≤ 65,535, one grid row): invocation j of workgroup w adds (x_i − t_i)²
//   for i = w·256 + j, then every P·256 further on; the workgroup's 256 sums are added in a tree
//   in workgroup memory into partials[w]. For a given N the order of every addition is fixed.
//
// ---- entry point `mse_finish` ----------------------------------------------------------------
//   binding 1 partials (read), 2 out (written). One workgroup of 256: invocation j adds
//   partials j, j + 256, ...; a tree adds the 256 sums, and out[0] = total / N.
//
// ---- entry point `mse_backward` --------------------------------------------------------------
//   binding 1 g (read), 2 x (read), 3 t (read), 4 dx (written). One invocation per element
//   (workgroup 256, grid folded into x/y: i = (wid.y·nwg.x + wid.x)·256 + lid).
//
// params (binding 0, MseParams): n (N), partials (P).

struct MseParams { n: u32, partials: u32 }

const WG: u32 = 256u;

@group(0) @binding(0) var<uniform> p: MseParams;

var<workgroup> sums: array<f32, 256>;

// Adds sums[0..256] in a tree (halving the stride) into sums[0]; every invocation calls it.
fn add_up(lid: u32) {
    for (var stride = WG / 2u; stride > 0u; stride = stride / 2u) {
        workgroupBarrier();
        if (lid < stride) { sums[lid] = sums[lid] + sums[lid + stride]; }
    }
    workgroupBarrier();
}

@group(0) @binding(1) var<storage, read> part_x: array<f32>;
@group(0) @binding(2) var<storage, read> part_t: array<f32>;
@group(0) @binding(3) var<storage, read_write> part_out: array<f32>;

@compute @workgroup_size(256)
fn mse_partials(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let stride = p.partials * WG;
    var s = 0.0;
    for (var i = wid.x * WG + lid; i < p.n; i = i + stride) {
        let d = part_x[i] - part_t[i];
        s = s + d * d;
    }
    sums[lid] = s;
    add_up(lid);
    if (lid == 0u) { part_out[wid.x] = sums[0]; }
}

@group(0) @binding(1) var<storage, read> finish_partials: array<f32>;
@group(0) @binding(2) var<storage, read_write> finish_out: array<f32>;

@compute @workgroup_size(256)
fn mse_finish(@builtin(local_invocation_index) lid: u32) {
    var s = 0.0;
    for (var j = lid; j < p.partials; j = j + WG) { s = s + finish_partials[j]; }
    sums[lid] = s;
    add_up(lid);
    if (lid == 0u) { finish_out[0] = sums[0] / f32(p.n); }
}

@group(0) @binding(1) var<storage, read> back_g: array<f32>;
@group(0) @binding(2) var<storage, read> back_x: array<f32>;
@group(0) @binding(3) var<storage, read> back_t: array<f32>;
@group(0) @binding(4) var<storage, read_write> back_dx: array<f32>;

@compute @workgroup_size(256)
fn mse_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let i = (wid.y * nwg.x + wid.x) * WG + lid;
    if (i >= p.n) { return; }
    let scale = 2.0 * back_g[0] / f32(p.n);
    back_dx[i] = scale * (back_x[i] - back_t[i]);
}
