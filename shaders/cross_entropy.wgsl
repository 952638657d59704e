// cross_entropy.wgsl: softmax cross-entropy of each row of logits against an integer target, the
// GPU end of `Tensor::cross_entropy_per_row` (forward) and of its backward rule. Launchers:
// src/backend/gpu/cross_entropy.rs, one function per entry point, same names.
//
// Layout (contiguous): logits and dlogits are ce_elem [rows, classes] (f32, or f16 in the f16
// build: mixed precision's logits, read without an f32 copy), element (r, c) at r·classes + c;
// targets is i32 [rows]; loss and lse are f32 [rows] in both builds, g (the upstream gradient
// of the loss) f32 [rows], or [1] broadcast to every row (g_stride 0: the gradient of the mean
// loss), and the arithmetic is f32.
// Math: lse_r = m_r + ln Σ_c e^(x_rc − m_r) with m_r = max_c x_rc; loss_r = lse_r − x_r,t_r;
// dlogits_rc = s·g_r·(e^(x_rc − lse_r) − [c = t_r]) with s = g_scale and g_r = g[r·g_stride]
// (1/rows and 0 for the mean loss, 1 and 1 per row). A target outside 0..classes (which the CPU
// refuses; checking here would need a read-back) gives loss 0 and a zero gradient for its row.
//
// ---- entry point `cross_entropy_forward` -------------------------------------------------------
//   binding 1 logits (read), 2 targets (read, i32), 3 loss, 4 lse (written). One workgroup of
//   WG = 64 invocations per row: invocation t takes c = t, t+64, ...; the row's maximum, then its
//   sum of exponentials, are combined in a tree in workgroup memory. Grid: rows workgroups,
//   folded into x/y (row = wid.y·nwg.x + wid.x).
//
// ---- entry point `cross_entropy_backward` ------------------------------------------------------
//   binding 1 g, 2 logits (read), 3 targets (read, i32), 4 lse (read), 5 dlogits (written). One
//   invocation per element (workgroup 256, grid folded into x/y over rows·classes invocations).
//
// params (binding 0, XentParams): rows, classes, g_scale (f32), g_stride (backward only).

struct XentParams { rows: u32, classes: u32, g_scale: f32, g_stride: u32 }

const WG: u32 = 64u;

// f16 build: element type
alias ce_elem = f32;
fn ce_store(v: f32) -> ce_elem {
    return v;
}
// f16 build: end

@group(0) @binding(0) var<uniform> p: XentParams;

var<workgroup> partial: array<f32, 64>;

fn is_nan(x: f32) -> bool { return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u; }

// ---- cross_entropy_forward --------------------------------------------------------------------

@group(0) @binding(1) var<storage, read> f_x: array<ce_elem>;
@group(0) @binding(2) var<storage, read> f_t: array<i32>;
@group(0) @binding(3) var<storage, read_write> f_loss: array<f32>;
@group(0) @binding(4) var<storage, read_write> f_lse: array<f32>;

@compute @workgroup_size(64)
fn cross_entropy_forward(@builtin(workgroup_id) wid: vec3<u32>,
                         @builtin(num_workgroups) nwg: vec3<u32>,
                         @builtin(local_invocation_index) lid: u32) {
    let r = wid.y * nwg.x + wid.x;
    // `r` is uniform across the workgroup: all invocations leave together
    if (r >= p.rows) { return; }
    let base = r * p.classes;
    // the maximum (a NaN logit propagates: the loss of its row is NaN, as on the CPU)
    var m = -3.4028235e38;
    var nan = false;
    for (var c = lid; c < p.classes; c = c + WG) {
        let v = f32(f_x[base + c]);
        nan = nan || is_nan(v);
        m = max(m, v);
    }
    partial[lid] = select(m, bitcast<f32>(0x7fc00000u), nan);
    workgroupBarrier();
    for (var half = WG / 2u; half > 0u; half = half / 2u) {
        if (lid < half) {
            let a = partial[lid];
            let b = partial[lid + half];
            partial[lid] = select(max(a, b), a + b, is_nan(a) || is_nan(b));
        }
        workgroupBarrier();
    }
    let row_max = partial[0];
    workgroupBarrier();
    var s = 0.0;
    for (var c = lid; c < p.classes; c = c + WG) { s = s + exp(f32(f_x[base + c]) - row_max); }
    partial[lid] = s;
    workgroupBarrier();
    for (var half = WG / 2u; half > 0u; half = half / 2u) {
        if (lid < half) { partial[lid] = partial[lid] + partial[lid + half]; }
        workgroupBarrier();
    }
    if (lid == 0u) {
        let lse = row_max + log(partial[0]);
        let t = f_t[r];
        var loss = 0.0;
        if (t >= 0 && u32(t) < p.classes) { loss = lse - f32(f_x[base + u32(t)]); }
        f_loss[r] = loss;
        f_lse[r] = lse;
    }
}

// ---- cross_entropy_backward -------------------------------------------------------------------

@group(0) @binding(1) var<storage, read> b_g: array<f32>;
@group(0) @binding(2) var<storage, read> b_x: array<ce_elem>;
@group(0) @binding(3) var<storage, read> b_t: array<i32>;
@group(0) @binding(4) var<storage, read> b_lse: array<f32>;
@group(0) @binding(5) var<storage, read_write> b_dx: array<ce_elem>;

@compute @workgroup_size(256)
fn cross_entropy_backward(@builtin(global_invocation_id) gid: vec3<u32>,
                          @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 256u + gid.x;
    if (i >= p.rows * p.classes) { return; }
    let r = i / p.classes;
    let c = i % p.classes;
    let t = b_t[r];
    if (t < 0 || u32(t) >= p.classes) {
        b_dx[i] = ce_store(0.0);
        return;
    }
    let onehot = select(0.0, 1.0, u32(t) == c);
    let g = b_g[r * p.g_stride] * p.g_scale;
    b_dx[i] = ce_store(g * (exp(f32(b_x[i]) - b_lse[r]) - onehot));
}
