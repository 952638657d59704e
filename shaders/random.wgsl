// random.wgsl: counter-based uniform random numbers. Launcher: src/backend/gpu/random.rs.
//
// random_uniform  Tensor::rand / dropout masks. out[i] = uniform_hash(seed, i) for i < n, the same
//                 bits as backend::uniform_hash on the CPU: h = fmix(fmix(i ^ seed_lo) + 0x9e3779b9
//                 ^ seed_hi) with fmix the MurmurHash3 32-bit finaliser, and the value is
//                 (h >> 8) / 2^24, exact in f32, in [0, 1).
//                 params RandomParams { n, seed_lo, seed_hi } (the low and high halves of the u64
//                 seed); out (binding 1, read_write, array<f32>) [n].
//                 Workgroup 256, one element per invocation, grid folded into x/y:
//                 i = (workgroup_id.y * num_workgroups.x + workgroup_id.x) * 256 + local index.

struct RandomParams { n: u32, seed_lo: u32, seed_hi: u32 }

@group(0) @binding(0) var<uniform> rp: RandomParams;
@group(0) @binding(1) var<storage, read_write> rand_out: array<f32>;

fn fmix(h0: u32) -> u32 {
    var h = h0;
    h = h ^ (h >> 16u);
    h = h * 0x85ebca6bu;
    h = h ^ (h >> 13u);
    h = h * 0xc2b2ae35u;
    h = h ^ (h >> 16u);
    return h;
}

@compute @workgroup_size(256)
fn random_uniform(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_index) lid: u32) {
    let i = (wid.y * nwg.x + wid.x) * 256u + lid;
    if (i >= rp.n) { return; }
    let h = fmix((fmix(i ^ rp.seed_lo) + 0x9e3779b9u) ^ rp.seed_hi);
    rand_out[i] = f32(h >> 8u) / 16777216.0;
}
