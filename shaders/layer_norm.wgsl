// layer_norm.wgsl: layer normalisation (or RMSNorm) of each row, the GPU end of
// `Tensor::layer_norm` and `Tensor::rms_norm` (forward) and of their backward rule. Launchers: src/backend/gpu/layer_norm.rs, one function per entry
// point family.
//
// Layout (contiguous): x, y, g (the upstream gradient) and dx are [rows, dim], element (r, j) at
// r·dim + j, of ln_elem (f32, or f16 in the f16 and f16-rows builds); gamma, beta, dgamma and
// dbeta are [dim], of ln_param (f32, f16 in the f16 build, f32 in the f16-rows build: mixed
// precision's f16 activations with f32 parameters); mean and rstd are [rows], f32 in every
// build.
// Math: mean_r = Σ_j x_rj / dim, var_r = Σ_j (x_rj − mean_r)² / dim (biased, two passes),
// rstd_r = 1/√(var_r + eps), x̂_rj = (x_rj − mean_r)·rstd_r, y_rj = x̂_rj·gamma_j + beta_j.
// Backward with h_rj = g_rj·gamma_j: dx_rj = rstd_r·(h_rj − mean_j(h_r) − x̂_rj·mean_j(h_r·x̂_r)),
// dgamma_j = Σ_r g_rj·x̂_rj, dbeta_j = Σ_r g_rj.
// RMSNorm (p.centered = 0): mean_r is 0 (so var_r is the mean square), beta is not read (y_rj =
// x̂_rj·gamma_j) and dx_rj = rstd_r·(h_rj − x̂_rj·mean_j(h_r·x̂_r)).
//
// ---- entry point `layer_norm_forward` ---------------------------------------------------------
//   binding 1 x, 2 gamma, 3 beta (read), 4 y, 5 mean, 6 rstd (written). One workgroup of WG = 64
//   invocations per row: invocation t handles j = t, t+64, ...; the row's sums are combined in a
//   tree in workgroup memory (mean first, then the centred squares). Grid: rows workgroups,
//   folded into x/y (row = wid.y·nwg.x + wid.x).
//
// ---- entry point `layer_norm_backward_x` ------------------------------------------------------
//   binding 1 g, 2 x, 3 gamma, 4 mean, 5 rstd, 7 pending (read), 6 dx (written). One workgroup
//   per row as in the forward: two tree sums (Σ h and Σ h·x̂), then every invocation writes its
//   elements of dx. With has_pending = 1, dx = pending + dx (the gradient x already had from its
//   other consumers, such as a residual connection, added here instead of by a launch of its
//   own; dx rounded to its dtype before the add, so that in f16 too it has the bits of the
//   separate add); otherwise binding 7 is g again, unread.
//
// ---- entry point `layer_norm_backward_params` -------------------------------------------------
//   binding 1 g, 2 x, 3 mean, 4 rstd (read), 5 dgamma, 6 dbeta (written). One workgroup of 256
//   per PCOLS = 8 neighbouring columns: invocation (c, s) = (lid % 8, lid / 8) sums column c's
//   rows s, s + 32, s + 64, … (32 strands, so a column's rows are walked 32 at a time rather
//   than one by one), then the 32 strands are added in a fixed tree in workgroup memory: the
//   sums are deterministic (though not in the CPU's row order). Grid: ⌈dim/8⌉ workgroups,
//   folded into x/y.
//
// params (binding 0, LnParams): rows, dim, eps (f32 bits), centered (1 layer norm, 0 RMSNorm),
// has_pending (layer_norm_backward_x only; 0 elsewhere).

struct LnParams { rows: u32, dim: u32, eps: f32, centered: u32, has_pending: u32 }

// The element type of x, y, g and dx: f32 here. The f16 builds (src/backend/gpu/half.rs,
// `f16_build`, `f16_rows_build`) make the alias `f16` and the store a conversion that rounds
// once; loads widen to f32, every sum stays f32, and mean and rstd are f32 in every build.
// f16 build: element type
alias ln_elem = f32;
fn ln_store(v: f32) -> ln_elem {
    return v;
}
// f16 build: end
// The element type of gamma, beta, dgamma and dbeta: f32 here and in the f16-rows build, f16 in
// the f16 build.
// f16 build: weight type
alias ln_param = f32;
fn ln_param_store(v: f32) -> ln_param {
    return v;
}
// f16 build: end

const WG: u32 = 64u;

@group(0) @binding(0) var<uniform> p: LnParams;

var<workgroup> partial: array<f32, 64>;
var<workgroup> partial2: array<f32, 64>;

// Sums `partial` (and `partial2`) over the workgroup; every invocation returns the totals.
fn tree_sum2(lid: u32) -> vec2<f32> {
    workgroupBarrier();
    for (var half = WG / 2u; half > 0u; half = half / 2u) {
        if (lid < half) {
            partial[lid] = partial[lid] + partial[lid + half];
            partial2[lid] = partial2[lid] + partial2[lid + half];
        }
        workgroupBarrier();
    }
    let total = vec2<f32>(partial[0], partial2[0]);
    workgroupBarrier(); // everyone has read the totals before the arrays are reused
    return total;
}

// ---- layer_norm_forward -----------------------------------------------------------------------

@group(0) @binding(1) var<storage, read> f_x: array<ln_elem>;
@group(0) @binding(2) var<storage, read> f_gamma: array<ln_param>;
@group(0) @binding(3) var<storage, read> f_beta: array<ln_param>;
@group(0) @binding(4) var<storage, read_write> f_y: array<ln_elem>;
@group(0) @binding(5) var<storage, read_write> f_mean: array<f32>;
@group(0) @binding(6) var<storage, read_write> f_rstd: array<f32>;

@compute @workgroup_size(64)
fn layer_norm_forward(@builtin(workgroup_id) wid: vec3<u32>,
                      @builtin(num_workgroups) nwg: vec3<u32>,
                      @builtin(local_invocation_index) lid: u32) {
    let r = wid.y * nwg.x + wid.x;
    // `r` is uniform across the workgroup, so every invocation leaves together (no barrier is
    // skipped by some and not others)
    if (r >= p.rows) { return; }
    let base = r * p.dim;
    let n = f32(p.dim);
    var mean = 0.0;
    if (p.centered != 0u) {
        var s = 0.0;
        for (var j = lid; j < p.dim; j = j + WG) { s = s + f32(f_x[base + j]); }
        partial[lid] = s;
        partial2[lid] = 0.0;
        mean = tree_sum2(lid).x / n;
    }
    var q = 0.0;
    for (var j = lid; j < p.dim; j = j + WG) {
        let c = f32(f_x[base + j]) - mean;
        q = q + c * c;
    }
    partial[lid] = q;
    partial2[lid] = 0.0;
    let rstd = 1.0 / sqrt(tree_sum2(lid).x / n + p.eps);
    for (var j = lid; j < p.dim; j = j + WG) {
        var y = (f32(f_x[base + j]) - mean) * rstd * f32(f_gamma[j]);
        if (p.centered != 0u) { y = y + f32(f_beta[j]); }
        f_y[base + j] = ln_store(y);
    }
    if (lid == 0u) {
        f_mean[r] = mean;
        f_rstd[r] = rstd;
    }
}

// ---- layer_norm_backward_x --------------------------------------------------------------------

@group(0) @binding(1) var<storage, read> b_g: array<ln_elem>;
@group(0) @binding(2) var<storage, read> b_x: array<ln_elem>;
@group(0) @binding(3) var<storage, read> b_gamma: array<ln_param>;
@group(0) @binding(4) var<storage, read> b_mean: array<f32>;
@group(0) @binding(5) var<storage, read> b_rstd: array<f32>;
@group(0) @binding(6) var<storage, read_write> b_dx: array<ln_elem>;
@group(0) @binding(7) var<storage, read> b_pending: array<ln_elem>;

@compute @workgroup_size(64)
fn layer_norm_backward_x(@builtin(workgroup_id) wid: vec3<u32>,
                         @builtin(num_workgroups) nwg: vec3<u32>,
                         @builtin(local_invocation_index) lid: u32) {
    let r = wid.y * nwg.x + wid.x;
    if (r >= p.rows) { return; }
    let base = r * p.dim;
    let mean = b_mean[r];
    let rstd = b_rstd[r];
    var sh = 0.0;
    var shx = 0.0;
    for (var j = lid; j < p.dim; j = j + WG) {
        let h = f32(b_g[base + j]) * f32(b_gamma[j]);
        sh = sh + h;
        shx = shx + h * (f32(b_x[base + j]) - mean) * rstd;
    }
    partial[lid] = sh;
    partial2[lid] = shx;
    var sums = tree_sum2(lid) / f32(p.dim);
    if (p.centered == 0u) { sums.x = 0.0; }
    for (var j = lid; j < p.dim; j = j + WG) {
        let h = f32(b_g[base + j]) * f32(b_gamma[j]);
        let xhat = (f32(b_x[base + j]) - mean) * rstd;
        let v = rstd * (h - sums.x - xhat * sums.y);
        if (p.has_pending == 1u) {
            // dx rounded to its dtype first, then added: the bits of a separate `pending + dx`
            b_dx[base + j] = ln_store(f32(b_pending[base + j]) + f32(ln_store(v)));
        } else {
            b_dx[base + j] = ln_store(v);
        }
    }
}

// ---- layer_norm_backward_params ---------------------------------------------------------------

@group(0) @binding(1) var<storage, read> c_g: array<ln_elem>;
@group(0) @binding(2) var<storage, read> c_x: array<ln_elem>;
@group(0) @binding(3) var<storage, read> c_mean: array<f32>;
@group(0) @binding(4) var<storage, read> c_rstd: array<f32>;
@group(0) @binding(5) var<storage, read_write> c_dgamma: array<ln_param>;
@group(0) @binding(6) var<storage, read_write> c_dbeta: array<ln_param>;

// columns per workgroup, and strands of rows per column (PCOLS · STRANDS = 256)
const PCOLS: u32 = 8u;
const STRANDS: u32 = 32u;

var<workgroup> strand_dg: array<f32, 256>;
var<workgroup> strand_db: array<f32, 256>;

@compute @workgroup_size(256)
fn layer_norm_backward_params(@builtin(workgroup_id) wid: vec3<u32>,
                              @builtin(num_workgroups) nwg: vec3<u32>,
                              @builtin(local_invocation_index) lid: u32) {
    let first = (wid.y * nwg.x + wid.x) * PCOLS;
    // `first` is uniform across the workgroup, so every invocation leaves together
    if (first >= p.dim) { return; }
    let c = lid % PCOLS;
    let s = lid / PCOLS;
    let j = first + c;
    var dg = 0.0;
    var db = 0.0;
    if (j < p.dim) {
        for (var r = s; r < p.rows; r = r + STRANDS) {
            let g = f32(c_g[r * p.dim + j]);
            dg = dg + g * (f32(c_x[r * p.dim + j]) - c_mean[r]) * c_rstd[r];
            db = db + g;
        }
    }
    strand_dg[lid] = dg;
    strand_db[lid] = db;
    workgroupBarrier();
    for (var half = STRANDS / 2u; half > 0u; half = half / 2u) {
        if (s < half) {
            strand_dg[lid] = strand_dg[lid] + strand_dg[lid + half * PCOLS];
            strand_db[lid] = strand_db[lid] + strand_db[lid + half * PCOLS];
        }
        workgroupBarrier();
    }
    if (s == 0u && j < p.dim) {
        c_dgamma[j] = ln_param_store(strand_dg[c]);
        c_dbeta[j] = ln_param_store(strand_db[c]);
    }
}
