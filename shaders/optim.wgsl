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
// adam_in_place the same update written where the values are: params AdamParams; param (1,
//               read_write), grad, scale (2-3, read), m, v (4-5, read_write). The launcher uses
//               it when nothing else shares the parameter and moment buffers.
// sgd_plain     SGD without momentum: p' = p - lr*(grad*scale + wd*p).
//               params SgdParams; param, grad, scale (1-3, read) -> new param (4, read_write).
// sgd_momentum  SGD with momentum mu: g = grad*scale + wd*p; b' = mu*b + g;
//               p' = p - lr*(nesterov ? g + mu*b' : b').
//               params SgdParams; param, grad, scale, buf (1-4, read) -> new param, new buf (5-6).
// sgd_plain_in_place, sgd_momentum_in_place
//               the same updates written where the values are: param (1, read_write), grad,
//               scale (2-3, read), and for momentum buf (4, read_write).

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
    let r = adam_update(adam_p[i], adam_g[i], adam_scale[0], adam_m[i], adam_v[i]);
    adam_p_out[i] = r.x;
    adam_m_out[i] = r.y;
    adam_v_out[i] = r.z;
}

// One Adam update of one element: returns (new param, new m, new v).
fn adam_update(p: f32, grad: f32, scale: f32, m_old: f32, v_old: f32) -> vec3<f32> {
    var g = grad;
    if (ap.has_scale != 0u) { g = g * scale; }
    if (ap.decoupled == 0u) { g = g + ap.weight_decay * p; }
    let m = ap.beta1 * m_old + ap.one_minus_beta1 * g;
    let v = ap.beta2 * v_old + ap.one_minus_beta2 * g * g;
    let update = (m / ap.bias_correction1) / (sqrt(v / ap.bias_correction2) + ap.eps);
    var np = p - ap.lr * update;
    if (ap.decoupled != 0u) { np = np - ap.lr_wd * p; }
    return vec3<f32>(np, m, v);
}

// ---- adam_in_place --------------------------------------------------------------------------

@group(0) @binding(1) var<storage, read_write> adami_p: array<f32>;
@group(0) @binding(2) var<storage, read> adami_g: array<f32>;
@group(0) @binding(3) var<storage, read> adami_scale: array<f32>;
@group(0) @binding(4) var<storage, read_write> adami_m: array<f32>;
@group(0) @binding(5) var<storage, read_write> adami_v: array<f32>;

@compute @workgroup_size(256)
fn adam_in_place(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32) {
    let i = flat_index(wid, nwg, lid);
    if (i >= ap.n) { return; }
    let r = adam_update(adami_p[i], adami_g[i], adami_scale[0], adami_m[i], adami_v[i]);
    adami_p[i] = r.x;
    adami_m[i] = r.y;
    adami_v[i] = r.z;
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
    sgd_p_out[i] = sgd_plain_update(sgd_p[i], sgd_g[i], sgd_scale[0]);
}

// One plain SGD update of one element: the new param.
fn sgd_plain_update(p: f32, grad: f32, scale: f32) -> f32 {
    var g = grad;
    if (sp.has_scale != 0u) { g = g * scale; }
    g = g + sp.weight_decay * p;
    return p - sp.lr * g;
}

// ---- sgd_plain_in_place ---------------------------------------------------------------------

@group(0) @binding(1) var<storage, read_write> sgdi_p: array<f32>;
@group(0) @binding(2) var<storage, read> sgdi_g: array<f32>;
@group(0) @binding(3) var<storage, read> sgdi_scale: array<f32>;

@compute @workgroup_size(256)
fn sgd_plain_in_place(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                      @builtin(local_invocation_index) lid: u32) {
    let i = flat_index(wid, nwg, lid);
    if (i >= sp.n) { return; }
    sgdi_p[i] = sgd_plain_update(sgdi_p[i], sgdi_g[i], sgdi_scale[0]);
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
    let r = sgd_momentum_update(sgdm_p[i], sgdm_g[i], sgdm_scale[0], sgdm_buf[i]);
    sgdm_p_out[i] = r.x;
    sgdm_buf_out[i] = r.y;
}

// One momentum SGD update of one element: returns (new param, new buf).
fn sgd_momentum_update(p: f32, grad: f32, scale: f32, buf: f32) -> vec2<f32> {
    var g = grad;
    if (smp.has_scale != 0u) { g = g * scale; }
    g = g + smp.weight_decay * p;
    let b = smp.momentum * buf + g;
    var step = b;
    if (smp.nesterov != 0u) { step = g + smp.momentum * b; }
    return vec2<f32>(p - smp.lr * step, b);
}

// ---- sgd_momentum_in_place ------------------------------------------------------------------

@group(0) @binding(1) var<storage, read_write> sgdmi_p: array<f32>;
@group(0) @binding(2) var<storage, read> sgdmi_g: array<f32>;
@group(0) @binding(3) var<storage, read> sgdmi_scale: array<f32>;
@group(0) @binding(4) var<storage, read_write> sgdmi_buf: array<f32>;

@compute @workgroup_size(256)
fn sgd_momentum_in_place(@builtin(workgroup_id) wid: vec3<u32>,
                         @builtin(num_workgroups) nwg: vec3<u32>,
                         @builtin(local_invocation_index) lid: u32) {
    let i = flat_index(wid, nwg, lid);
    if (i >= smp.n) { return; }
    let r = sgd_momentum_update(sgdmi_p[i], sgdmi_g[i], sgdmi_scale[0], sgdmi_buf[i]);
    sgdmi_p[i] = r.x;
    sgdmi_buf[i] = r.y;
}
