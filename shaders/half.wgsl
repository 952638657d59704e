// half.wgsl: conversions between f32 and f16 tensors, the two ends of `Tensor::to_dtype` to and
// from `DType::F16`. Launchers: src/backend/gpu/half.rs. Compiled after `enable f16;` and
// shaders/f16_convert.wgsl (which defines `f16_of`), only on adapters with wgpu's SHADER_F16.
//
// Both entries run 256 invocations per workgroup over a 1-D grid that the host folds into x and y
// when it needs more than 65535 workgroups; the flat index is
// i = (workgroup_id.y * num_workgroups.x + workgroup_id.x) * 256 + local_invocation_index,
// and invocations with i >= n do nothing.
//
// f32_to_f16  params HalfParams { n }: x (binding 1, read, array<f32>, [n]) ->
//             out (binding 2, read_write, array<f16>, [n]), out[i] = f16_of(x[i]) (round to a
//             neighbouring f16, ±inf past the largest, NaN kept).
// f16_to_f32  params HalfParams { n }: x (binding 1, read, array<f16>, [n]) ->
//             out (binding 2, read_write, array<f32>, [n]), exact.

const WG: u32 = 256u;

struct HalfParams { n: u32 }

fn half_index(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> u32 {
    return (wid.y * nwg.x + wid.x) * WG + lid;
}

// ---- f32_to_f16 ------------------------------------------------------------------------------

@group(0) @binding(0) var<uniform> to_half_p: HalfParams;
@group(0) @binding(1) var<storage, read> to_half_x: array<f32>;
@group(0) @binding(2) var<storage, read_write> to_half_out: array<f16>;

@compute @workgroup_size(256)
fn f32_to_f16(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let i = half_index(wid, nwg, lid);
    if i < to_half_p.n {
        to_half_out[i] = f16_of(to_half_x[i]);
    }
}

// ---- f16_to_f32 ------------------------------------------------------------------------------

@group(0) @binding(0) var<uniform> to_single_p: HalfParams;
@group(0) @binding(1) var<storage, read> to_single_x: array<f16>;
@group(0) @binding(2) var<storage, read_write> to_single_out: array<f32>;

@compute @workgroup_size(256)
fn f16_to_f32(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let i = half_index(wid, nwg, lid);
    if i < to_single_p.n {
        to_single_out[i] = f32(to_single_x[i]);
    }
}
