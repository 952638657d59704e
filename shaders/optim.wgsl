// optim.wgsl: fused optimizer updates, one parameter element per invocation.
// Launchers: src/backend/gpu/optim.rs (called by optim::Adam / optim::Sgd through Backend).
//
// All entries: workgroup 256, 1-D grid folded into x/y,
// i = (workgroup_id.y * num_workgroups.x + workgroup_id.x) * 256 + local index, i < n.
// `scale` is a one-element buffer multiplying the gradient first (gradient clipping without a
// read-back); when has_scale is 0 the host binds the gradient there and the kernel ignores it.
// A negative scale skips the step: every value is written back unchanged (mixed precision's
// overflowed step, see loss_scale_factor below; the same rule as CpuBackend's updates).
// has_scale = 2: the buffer holds two values, the factor and the steps the loss scale skipped
// so far; Adam's bias corrections are then for step − skipped steps (PyTorch's GradScaler
// skips optimizer.step(), so its count leaves them out), computed on the device.
// Every buffer is f32 [n]; hyper-parameters are f32 (computed in f64 on the host, then rounded).
//
// adam_step     Adam / AdamW, the formulas of CpuBackend::adam_step_mut:
//               g = grad*scale (+ wd*p unless decoupled); m' = b1*m + (1-b1)*g;
//               v' = b2*v + (1-b2)*g*g; p' = p - lr*(m'/bc1)/(sqrt(v'/bc2) + eps)
//               (- lr*wd*p when decoupled); bc1, bc2 = 1 − β₁ᵗ, 1 − β₂ᵗ from the host, or
//               from t = step − skipped (adam_bias_corrections) after skipped steps.
//               params AdamParams; param, grad, scale, m, v (bindings 1-5, read) ->
//               new param, m, v (bindings 6-8, read_write).
// adam_in_place the same update written where the values are: params AdamParams; param (1,
//               read_write), grad, scale (2-3, read), m, v (4-5, read_write). The launcher uses
//               it when nothing else shares the parameter and moment buffers.
// adam_multi    the in-place update of up to ADAM_SLOTS = 12 parameters in one dispatch, their
//               moments living in two flat buffers (the optimizer's): params AdamMultiParams
//               { h: AdamParams with n = the elements of all slots, slots[s] = (start, len,
//               moment offset, decay) }; scale (1, read), m, v (2-3, read_write, f32 [total]),
//               then per slot s its gradient (4 + 2s, read) and parameter (5 + 2s, read_write).
//               Invocation t updates element t − start of the slot whose [start, start + len)
//               holds t; slots past the last one used have len 0 (and any buffers bound).
//               Needs 27 storage buffers per shader stage (the launcher falls back to
//               adam_in_place per parameter on devices with fewer).
// grad_sumsq    the squared norm of up to NORM_SLOTS = 24 gradients (gradient clipping): one
//               workgroup of 256 per 4096 elements of the gradients taken one after the other
//               writes the sum of their squares to partials[partial_offset + workgroup].
//               params NormParams { total elements, partial_offset, max_norm (unused), slots
//               (start, len) two per vec4 }; partials (1, read_write), gradient s (2 + s, read).
//               Slots past the last one used have len 0.
// grad_clip_scale one workgroup sums partials[0..total] (params NormParams, slots unused) and
//               writes norm = √sum and scale = clamp(max_norm · (1 / (norm + 1e-6)), 0, 1), the
//               factor the optimizer multiplies the gradients by: partials (1, read), norm (2,
//               read_write, [1]), scale (3, read_write, [1]).
// sgd_plain     SGD without momentum: p' = p - lr*(grad*scale + wd*p).
//               params SgdParams; param, grad, scale (1-3, read) -> new param (4, read_write).
// sgd_momentum  SGD with momentum mu: g = grad*scale + wd*p; b' = mu*b + g;
//               p' = p - lr*(nesterov ? g + mu*b' : b').
//               params SgdParams; param, grad, scale, buf (1-4, read) -> new param, new buf (5-6).
// sgd_plain_in_place, sgd_momentum_in_place
//               the same updates written where the values are: param (1, read_write), grad,
//               scale (2-3, read), and for momentum buf (4, read_write).

struct AdamParams {
    n: u32, has_scale: u32, decoupled: u32, step: u32,
    lr: f32, beta1: f32, one_minus_beta1: f32, beta2: f32,
    one_minus_beta2: f32, eps: f32, weight_decay: f32, lr_wd: f32,
    bias_correction1: f32, bias_correction2: f32, ln_beta1: f32, ln_beta2: f32,
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
    var sc = vec2<f32>(adam_scale[0], 0.0);
    if (ap.has_scale == 2u) { sc.y = adam_scale[1]; }
    let r = adam_update(adam_p[i], adam_g[i], sc, adam_m[i], adam_v[i]);
    adam_p_out[i] = r.x;
    adam_m_out[i] = r.y;
    adam_v_out[i] = r.z;
}

// One Adam update of one element: returns (new param, new m, new v). scale = (the factor,
// the steps skipped so far).
fn adam_update(p: f32, grad: f32, scale: vec2<f32>, m_old: f32, v_old: f32) -> vec3<f32> {
    return adam_math(ap, true, p, grad, scale, m_old, v_old);
}

// (1 − β₁ᵗ, 1 − β₂ᵗ) for t = step − skipped, at least 1; the host's values (rounded from f64)
// when nothing was skipped.
fn adam_bias_corrections(h: AdamParams, skipped: f32) -> vec2<f32> {
    if (skipped <= 0.0) { return vec2<f32>(h.bias_correction1, h.bias_correction2); }
    let t = max(f32(h.step) - skipped, 1.0);
    return vec2<f32>(one_minus_exp(t * h.ln_beta1), one_minus_exp(t * h.ln_beta2));
}

// 1 − eˣ for x ≤ 0 (βᵗ = e^(t·ln β)). Near 0, where 1 − exp(x) would lose the digits that
// matter (β₂ = 0.999: 1 − β₂ = 0.001), the series −x·(1 + x/2 + x²/6 + x³/24 + x⁴/120), whose
// truncation is below 2e-7 relative for |x| < 0.1.
fn one_minus_exp(x: f32) -> f32 {
    if (x > -0.1) {
        return -x * (1.0 + x * (0.5 + x * (1.0 / 6.0 + x * (1.0 / 24.0 + x * (1.0 / 120.0)))));
    }
    return 1.0 - exp(x);
}

// The Adam update under hyper-parameters h; `decay` false drops the weight decay (the
// parameters an optimizer exempts from it), exactly as weight_decay = lr_wd = 0 would.
fn adam_math(h: AdamParams, decay: bool, p: f32, grad: f32, scale: vec2<f32>, m_old: f32,
             v_old: f32) -> vec3<f32> {
    let wd = select(0.0, h.weight_decay, decay);
    let lr_wd = select(0.0, h.lr_wd, decay);
    if (h.has_scale != 0u && scale.x < 0.0) { return vec3<f32>(p, m_old, v_old); }
    var g = grad;
    if (h.has_scale != 0u) { g = g * scale.x; }
    if (h.decoupled == 0u) { g = g + wd * p; }
    let m = h.beta1 * m_old + h.one_minus_beta1 * g;
    let v = h.beta2 * v_old + h.one_minus_beta2 * g * g;
    let bc = adam_bias_corrections(h, scale.y);
    let update = (m / bc.x) / (sqrt(v / bc.y) + h.eps);
    var np = p - h.lr * update;
    if (h.decoupled != 0u) { np = np - lr_wd * p; }
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
    var sc = vec2<f32>(adami_scale[0], 0.0);
    if (ap.has_scale == 2u) { sc.y = adami_scale[1]; }
    let r = adam_update(adami_p[i], adami_g[i], sc, adami_m[i], adami_v[i]);
    adami_p[i] = r.x;
    adami_m[i] = r.y;
    adami_v[i] = r.z;
}

// ---- adam_multi -----------------------------------------------------------------------------

// Up to ADAM_SLOTS parameters per dispatch: slot s has its parameter at binding 5 + 2s and its
// gradient at binding 4 + 2s; WGSL cannot index bindings, so the loads and stores switch on s.

const ADAM_SLOTS: u32 = 12u;

struct AdamMultiParams { h: AdamParams, slots: array<vec4<u32>, 12> }

@group(0) @binding(0) var<uniform> amp: AdamMultiParams;
@group(0) @binding(1) var<storage, read> am_scale: array<f32>;
@group(0) @binding(2) var<storage, read_write> am_m: array<f32>;
@group(0) @binding(3) var<storage, read_write> am_v: array<f32>;
@group(0) @binding(4) var<storage, read> am_g0: array<f32>;
@group(0) @binding(5) var<storage, read_write> am_p0: array<f32>;
@group(0) @binding(6) var<storage, read> am_g1: array<f32>;
@group(0) @binding(7) var<storage, read_write> am_p1: array<f32>;
@group(0) @binding(8) var<storage, read> am_g2: array<f32>;
@group(0) @binding(9) var<storage, read_write> am_p2: array<f32>;
@group(0) @binding(10) var<storage, read> am_g3: array<f32>;
@group(0) @binding(11) var<storage, read_write> am_p3: array<f32>;
@group(0) @binding(12) var<storage, read> am_g4: array<f32>;
@group(0) @binding(13) var<storage, read_write> am_p4: array<f32>;
@group(0) @binding(14) var<storage, read> am_g5: array<f32>;
@group(0) @binding(15) var<storage, read_write> am_p5: array<f32>;
@group(0) @binding(16) var<storage, read> am_g6: array<f32>;
@group(0) @binding(17) var<storage, read_write> am_p6: array<f32>;
@group(0) @binding(18) var<storage, read> am_g7: array<f32>;
@group(0) @binding(19) var<storage, read_write> am_p7: array<f32>;
@group(0) @binding(20) var<storage, read> am_g8: array<f32>;
@group(0) @binding(21) var<storage, read_write> am_p8: array<f32>;
@group(0) @binding(22) var<storage, read> am_g9: array<f32>;
@group(0) @binding(23) var<storage, read_write> am_p9: array<f32>;
@group(0) @binding(24) var<storage, read> am_g10: array<f32>;
@group(0) @binding(25) var<storage, read_write> am_p10: array<f32>;
@group(0) @binding(26) var<storage, read> am_g11: array<f32>;
@group(0) @binding(27) var<storage, read_write> am_p11: array<f32>;

fn am_load_g(s: u32, i: u32) -> f32 {
    switch s {
        case 0u: { return am_g0[i]; }
        case 1u: { return am_g1[i]; }
        case 2u: { return am_g2[i]; }
        case 3u: { return am_g3[i]; }
        case 4u: { return am_g4[i]; }
        case 5u: { return am_g5[i]; }
        case 6u: { return am_g6[i]; }
        case 7u: { return am_g7[i]; }
        case 8u: { return am_g8[i]; }
        case 9u: { return am_g9[i]; }
        case 10u: { return am_g10[i]; }
        case 11u: { return am_g11[i]; }
        default: { return 0.0; }
    }
}

fn am_load_p(s: u32, i: u32) -> f32 {
    switch s {
        case 0u: { return am_p0[i]; }
        case 1u: { return am_p1[i]; }
        case 2u: { return am_p2[i]; }
        case 3u: { return am_p3[i]; }
        case 4u: { return am_p4[i]; }
        case 5u: { return am_p5[i]; }
        case 6u: { return am_p6[i]; }
        case 7u: { return am_p7[i]; }
        case 8u: { return am_p8[i]; }
        case 9u: { return am_p9[i]; }
        case 10u: { return am_p10[i]; }
        case 11u: { return am_p11[i]; }
        default: { return 0.0; }
    }
}

fn am_store_p(s: u32, i: u32, value: f32) {
    switch s {
        case 0u: { am_p0[i] = value; }
        case 1u: { am_p1[i] = value; }
        case 2u: { am_p2[i] = value; }
        case 3u: { am_p3[i] = value; }
        case 4u: { am_p4[i] = value; }
        case 5u: { am_p5[i] = value; }
        case 6u: { am_p6[i] = value; }
        case 7u: { am_p7[i] = value; }
        case 8u: { am_p8[i] = value; }
        case 9u: { am_p9[i] = value; }
        case 10u: { am_p10[i] = value; }
        case 11u: { am_p11[i] = value; }
        default: {}
    }
}

@compute @workgroup_size(256)
fn adam_multi(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let t = flat_index(wid, nwg, lid);
    if (t >= amp.h.n) { return; }
    var s = 0u;
    loop {
        if (s >= ADAM_SLOTS) { return; }
        let slot = amp.slots[s];
        if (t >= slot.x && t - slot.x < slot.y) { break; }
        s = s + 1u;
    }
    let slot = amp.slots[s];
    let i = t - slot.x;
    let at = slot.z + i;
    var sc = vec2<f32>(am_scale[0], 0.0);
    if (amp.h.has_scale == 2u) { sc.y = am_scale[1]; }
    let r = adam_math(amp.h, slot.w != 0u, am_load_p(s, i), am_load_g(s, i), sc, am_m[at],
                      am_v[at]);
    am_store_p(s, i, r.x);
    am_m[at] = r.y;
    am_v[at] = r.z;
}

// ---- grad_sumsq, grad_clip_scale ------------------------------------------------------------

// Up to NORM_SLOTS gradients per grad_sumsq dispatch, gradient s at binding 2 + s (read);
// WGSL cannot index bindings, so the load switches on s.

const NORM_SLOTS: u32 = 24u;
const NORM_CHUNK: u32 = 4096u; // elements per workgroup: 16 per invocation

struct NormParams { total: u32, partial_offset: u32, max_norm: f32, _pad: u32,
                    slots: array<vec4<u32>, 12> }

@group(0) @binding(0) var<uniform> np: NormParams;
@group(0) @binding(1) var<storage, read_write> gn_partials: array<f32>;
@group(0) @binding(2) var<storage, read> gn_g0: array<f32>;
@group(0) @binding(3) var<storage, read> gn_g1: array<f32>;
@group(0) @binding(4) var<storage, read> gn_g2: array<f32>;
@group(0) @binding(5) var<storage, read> gn_g3: array<f32>;
@group(0) @binding(6) var<storage, read> gn_g4: array<f32>;
@group(0) @binding(7) var<storage, read> gn_g5: array<f32>;
@group(0) @binding(8) var<storage, read> gn_g6: array<f32>;
@group(0) @binding(9) var<storage, read> gn_g7: array<f32>;
@group(0) @binding(10) var<storage, read> gn_g8: array<f32>;
@group(0) @binding(11) var<storage, read> gn_g9: array<f32>;
@group(0) @binding(12) var<storage, read> gn_g10: array<f32>;
@group(0) @binding(13) var<storage, read> gn_g11: array<f32>;
@group(0) @binding(14) var<storage, read> gn_g12: array<f32>;
@group(0) @binding(15) var<storage, read> gn_g13: array<f32>;
@group(0) @binding(16) var<storage, read> gn_g14: array<f32>;
@group(0) @binding(17) var<storage, read> gn_g15: array<f32>;
@group(0) @binding(18) var<storage, read> gn_g16: array<f32>;
@group(0) @binding(19) var<storage, read> gn_g17: array<f32>;
@group(0) @binding(20) var<storage, read> gn_g18: array<f32>;
@group(0) @binding(21) var<storage, read> gn_g19: array<f32>;
@group(0) @binding(22) var<storage, read> gn_g20: array<f32>;
@group(0) @binding(23) var<storage, read> gn_g21: array<f32>;
@group(0) @binding(24) var<storage, read> gn_g22: array<f32>;
@group(0) @binding(25) var<storage, read> gn_g23: array<f32>;

var<workgroup> gn_sums: array<f32, 256>;

fn gn_load(s: u32, i: u32) -> f32 {
    switch s {
        case 0u: { return gn_g0[i]; }
        case 1u: { return gn_g1[i]; }
        case 2u: { return gn_g2[i]; }
        case 3u: { return gn_g3[i]; }
        case 4u: { return gn_g4[i]; }
        case 5u: { return gn_g5[i]; }
        case 6u: { return gn_g6[i]; }
        case 7u: { return gn_g7[i]; }
        case 8u: { return gn_g8[i]; }
        case 9u: { return gn_g9[i]; }
        case 10u: { return gn_g10[i]; }
        case 11u: { return gn_g11[i]; }
        case 12u: { return gn_g12[i]; }
        case 13u: { return gn_g13[i]; }
        case 14u: { return gn_g14[i]; }
        case 15u: { return gn_g15[i]; }
        case 16u: { return gn_g16[i]; }
        case 17u: { return gn_g17[i]; }
        case 18u: { return gn_g18[i]; }
        case 19u: { return gn_g19[i]; }
        case 20u: { return gn_g20[i]; }
        case 21u: { return gn_g21[i]; }
        case 22u: { return gn_g22[i]; }
        case 23u: { return gn_g23[i]; }
        default: { return 0.0; }
    }
}

// (start, len) of slot s in the group's elements.
fn gn_slot(s: u32) -> vec2<u32> {
    let v = np.slots[s / 2u];
    if ((s & 1u) == 0u) { return v.xy; }
    return v.zw;
}

// Sums the workgroup's 256 values in gn_sums; the total ends in gn_sums[0].
fn gn_tree(lid: u32) {
    for (var half = 128u; half > 0u; half = half / 2u) {
        if (lid < half) { gn_sums[lid] = gn_sums[lid] + gn_sums[lid + half]; }
        workgroupBarrier();
    }
}

@compute @workgroup_size(256)
fn grad_sumsq(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let w = wid.y * nwg.x + wid.x;
    let c0 = w * NORM_CHUNK;
    let c1 = min(c0 + NORM_CHUNK, np.total);
    var acc = 0.0;
    for (var s = 0u; s < NORM_SLOTS; s = s + 1u) {
        let slot = gn_slot(s);
        let lo = max(slot.x, c0);
        let hi = min(slot.x + slot.y, c1);
        for (var t = lo + lid; t < hi; t = t + 256u) {
            let g = gn_load(s, t - slot.x);
            acc = acc + g * g;
        }
    }
    gn_sums[lid] = acc;
    workgroupBarrier();
    gn_tree(lid);
    if (lid == 0u && c0 < np.total) { gn_partials[np.partial_offset + w] = gn_sums[0]; }
}

// grad_clip_scale and loss_scale_factor: partials (1, read), norm (2), the gradients' factor
// (3, the `scale` the update kernels read).
@group(0) @binding(1) var<storage, read> gc_partials: array<f32>;
@group(0) @binding(2) var<storage, read_write> gc_norm: array<f32>;
@group(0) @binding(3) var<storage, read_write> gc_scale: array<f32>;

// partials[0..np.total] summed by the one workgroup of 256; every invocation gets the total.
fn partials_total(lid: u32) -> f32 {
    var acc = 0.0;
    for (var i = lid; i < np.total; i = i + 256u) { acc = acc + gc_partials[i]; }
    gn_sums[lid] = acc;
    workgroupBarrier();
    gn_tree(lid);
    return gn_sums[0];
}

@compute @workgroup_size(256)
fn grad_clip_scale(@builtin(local_invocation_index) lid: u32) {
    let total = partials_total(lid);
    if (lid == 0u) {
        let norm = sqrt(total);
        gc_norm[0] = norm;
        gc_scale[0] = clamp(np.max_norm * (1.0 / (norm + 1e-6)), 0.0, 1.0);
    }
}

// ---- loss_scale_factor ----------------------------------------------------------------------
// Mixed precision's dynamic loss scale (optim::LossScale), decided on the device after
// grad_sumsq summed the squares of the *scaled* gradients. One workgroup sums partials[0..total]
// (params NormParams: total, max_norm (0: no clipping), growth interval in the 4th word) and
// writes, from the current scale s = scale[0]:
//   sum not finite (an f16 overflow reached a gradient): factor = -1 (the update kernels skip
//     the step), norm = +inf, s ← max(s/2, 1), counts = (0 good steps, skipped + 1);
//   else: norm = √sum / s (the unscaled gradients' norm), factor = (1/s)·clip with
//     clip = clamp(max_norm / (norm + 1e-6), 0, 1) (1 without clipping); after `growth`
//     consecutive good steps s ← min(2s, 2^24) and the count restarts;
//   and factor[1] = the steps skipped so far (this one included), for Adam's bias corrections.
// Bindings: partials (1, read), norm (2, read_write [1]), factor (3, read_write [2]),
// scale (4, read_write [1]), counts (5, read_write [2]: good steps in a row, skipped steps).

@group(0) @binding(4) var<storage, read_write> ls_scale: array<f32>;
@group(0) @binding(5) var<storage, read_write> ls_counts: array<f32>;

@compute @workgroup_size(256)
fn loss_scale_factor(@builtin(local_invocation_index) lid: u32) {
    let sum = partials_total(lid);
    if (lid == 0u) {
        let s = ls_scale[0];
        // inf or NaN: all exponent bits set (a bit test, which no compiler folds away)
        let overflow = (bitcast<u32>(sum) & 0x7f800000u) == 0x7f800000u;
        if (overflow) {
            gc_scale[0] = -1.0;
            gc_norm[0] = bitcast<f32>(0x7f800000u);
            ls_scale[0] = max(s * 0.5, 1.0);
            ls_counts[0] = 0.0;
            ls_counts[1] = ls_counts[1] + 1.0;
            gc_scale[1] = ls_counts[1];
        } else {
            let norm = sqrt(sum) / s;
            var clip = 1.0;
            if (np.max_norm > 0.0) { clip = clamp(np.max_norm * (1.0 / (norm + 1e-6)), 0.0, 1.0); }
            gc_scale[0] = clip / s;
            gc_scale[1] = ls_counts[1];
            gc_norm[0] = norm;
            let good = ls_counts[0] + 1.0;
            if (good >= f32(np._pad)) {
                ls_scale[0] = min(s * 2.0, 16777216.0);
                ls_counts[0] = 0.0;
            } else {
                ls_counts[0] = good;
            }
        }
    }
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
    if (sp.has_scale != 0u && scale < 0.0) { return p; }
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
    if (smp.has_scale != 0u && scale < 0.0) { return vec2<f32>(p, buf); }
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
