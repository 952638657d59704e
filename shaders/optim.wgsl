// optim.wgsl: fused optimizer updates, one parameter element per invocation.
// Launchers: src/backend/gpu/optim.rs (called by optim::Adam / optim::Sgd through Backend).
//
// All entries: workgroup 256, 1-D grid folded into x/y,
// i = (workgroup_id.y * num_workgroups.x + workgroup_id.x) * 256 + local index, i < n.
// `scale` is a one-element buffer multiplying the gradient first (gradient clipping without a
// read-back); when has_scale is 0 the host binds the gradient there and the kernel ignores it.
// Every buffer is f32 [n]; hyper-parameters are f32 (computed in f64 on the host, then rounded).
//
// adam_step     Adam / AdamW, the formulas of CpuBackend::adam_step_mut:
//               g = grad*scale (+ wd*p unless decoupled); m' = b1*m + (1-b1)*g;
//               v' = b2*v + (1-b2)*g*g; p' = p - lr*(m'/bc1)/(sqrt(v'/bc2) + eps)
//               (- lr*wd*p when decoupled).
//               params AdamParams; param, grad, scale, m, v (bindings 1-5, read) ->
//               new param, m, v (bindings 6-8, read_write).
// sgd_plain     SGD without momentum: p' = p - lr*(grad*scale + wd*p).
//               params SgdParams; param, grad, scale (1-3, read) -> new param (4, read_write).
// sgd_momentum  SGD with momentum mu: g = grad*scale + wd*p; b' = mu*b + g;
//               p' = p - lr*(nesterov ? g + mu*b' : b').
//               params SgdParams; param, grad, scale, buf (1-4, read) -> new param, new buf (5-6).

struct AdamParams {
    n: u32, has_scale: u32, decoupled: u32, _pad: u32,
    lr: f32, beta1: f32, one_minus_beta1: f32, beta2: f32,
    one_minus_beta2: f32, eps: f32, weight_decay: f32, lr_wd: f32,
    bias_correction1: f32, bias_correction2: f32,
}

struct SgdParams {
    n: u32, has_scale: u32, nesterov: u32, _pad: u32,
    lr: f32, momentum: f32, weight_decay: f32,
}

fn flat_index(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> u32 {
    return (wid.y * nwg.x + wid.x) * 256u + lid;
}

// ---- adam_step ------------------------------------------------------------------------------

@group(0) @binding(0) var<uniform> ap: AdamParams;
@group(0) @binding(1) var<storage, read> adam_p: array<f32>;
@group(0) @binding(2) var<storage, read> adam_g: array<f32>;
@group(0) @binding(3) var<storage, read> adam_scale: array<f32>;
@group(0) @binding(4) var<storage, read> adam_m: array<f32>;
@group(0) @binding(5) var<storage, read> adam_v: array<f32>;
@group(0) @binding(6) var<storage, read_write> adam_p_out: array<f32>;
@group(0) @binding(7) var<storage, read_write> adam_m_out: array<f32>;
@group(0) @binding(8) var<storage, read_write> adam_v_out: array<f32>;

@compute @workgroup_size(256)
fn adam_step(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_index) lid: u32) {
    let i = flat_index(wid, nwg, lid);
    if (i >= ap.n) { return; }
    let p = adam_p[i];
    var g = adam_g[i];
    if (ap.has_scale != 0u) { g = g * adam_scale[0]; }
    if (ap.decoupled == 0u) { g = g + ap.weight_decay * p; }
    let m = ap.beta1 * adam_m[i] + ap.one_minus_beta1 * g;
    let v = ap.beta2 * adam_v[i] + ap.one_minus_beta2 * g * g;
    let update = (m / ap.bias_correction1) / (sqrt(v / ap.bias_correction2) + ap.eps);
    var np = p - ap.lr * update;
    if (ap.decoupled != 0u) { np = np - ap.lr_wd * p; }
    adam_p_out[i] = np;
    adam_m_out[i] = m;
    adam_v_out[i] = v;
}

// ---- sgd_plain ------------------------------------------------------------------------------

@group(0) @binding(0) var<uniform> sp: SgdParams;
@group(0) @binding(1) var<storage, read> sgd_p: array<f32>;
@group(0) @binding(2) var<storage, read> sgd_g: array<f32>;
@group(0) @binding(3) var<storage, read> sgd_scale: array<f32>;
@group(0) @binding(4) var<storage, read_write> sgd_p_out: array<f32>;

@compute @workgroup_size(256)
fn sgd_plain(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_index) lid: u32) {
    let i = flat_index(wid, nwg, lid);
    if (i >= sp.n) { return; }
    let p = sgd_p[i];
    var g = sgd_g[i];
    if (sp.has_scale != 0u) { g = g * sgd_scale[0]; }
    g = g + sp.weight_decay * p;
    sgd_p_out[i] = p - sp.lr * g;
}

// ---- sgd_momentum ---------------------------------------------------------------------------

@group(0) @binding(0) var<uniform> smp: SgdParams;
@group(0) @binding(1) var<storage, read> sgdm_p: array<f32>;
@group(0) @binding(2) var<storage, read> sgdm_g: array<f32>;
@group(0) @binding(3) var<storage, read> sgdm_scale: array<f32>;
@group(0) @binding(4) var<storage, read> sgdm_buf: array<f32>;
@group(0) @binding(5) var<storage, read_write> sgdm_p_out: array<f32>;
@group(0) @binding(6) var<storage, read_write> sgdm_buf_out: array<f32>;

@compute @workgroup_size(256)
fn sgd_momentum(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let i = flat_index(wid, nwg, lid);
    if (i >= smp.n) { return; }
    let p = sgdm_p[i];
    var g = sgdm_g[i];
    if (smp.has_scale != 0u) { g = g * sgdm_scale[0]; }
    g = g + smp.weight_decay * p;
    let b = smp.momentum * sgdm_buf[i] + g;
    var step = b;
    if (smp.nesterov != 0u) { step = g + smp.momentum * b; }
    sgdm_p_out[i] = p - smp.lr * step;
    sgdm_buf_out[i] = b;
}
