// elementwise.wgsl: fill (more entries follow).
//
// fill: out[i] = params.bits for i < params.n. Params { n: u32, bits: u32 }; out: array<u32>
// (f32 or i32 bit patterns). Workgroup 256, one element per invocation, grid folded in x/y.

struct FillParams { n: u32, bits: u32 }

@group(0) @binding(0) var<uniform> fill_p: FillParams;
@group(0) @binding(1) var<storage, read_write> fill_out: array<u32>;

@compute @workgroup_size(256)
fn fill(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let i = (wid.y * nwg.x + wid.x) * 256u + lid;
    if (i < fill_p.n) { fill_out[i] = fill_p.bits; }
}
