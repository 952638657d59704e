// conv2d.wgsl: 2-D convolution (cross-correlation, as in PyTorch), the GPU end of
// `Tensor::conv2d` / `Tensor::grouped_conv2d` and of their backward rule. Launchers:
// src/backend/gpu/conv2d.rs, one function per entry point, same names.
//
// Layout (contiguous, element indices; backend::Conv2dDims):
//   x, dx   [B, C, H, W]                      element (b, c, y, x) at ((b·C + c)·H + y)·W + x
//   w, dw   [G, OC, C, KH, KW]                bank g's weight; (g, o, k) at (g·OC + o)·K + k with
//                                             the window index k = (c·KH + i)·KW + j, K = C·KH·KW
//   y, dy   [B, OC, OH, OW]                   (b, o, p) at (b·OC + o)·P + p, p = oy·OW + ox, P = OH·OW
//   bank    [B] i32                           the weight bank of each image (has_bank = 0: bank 0
//                                             for every image, and the buffer is a placeholder)
// Window element (k, p) of image b reads pixel (c, oy·stride + i − padding, ox·stride + j −
// padding) of x[b], zero outside the image. An image whose bank is outside 0..G gets y = 0 and
// contributes nothing to dw (dx = 0).
//
// Types: x, dx, y and dy are of cv_elem, w and dw of cv_weight: f32 here; the f16 build
// (src/backend/gpu/half.rs, CONV2D_F16_SHADER) makes both f16, the f16-rows build
// (CONV2D_F16_ROWS_SHADER, mixed precision's image models) only cv_elem, so an f16 image is
// convolved with the f32 weight read where it is and the weight's gradient is written in f32.
// Loads widen to f32, every sum is f32 (the same FMA chain in every build), and each output is
// rounded once by its store (cv_store, cv_weight_store).
//
// params (binding 0, ConvParams, all u32): batch, channels, height, width, out_channels,
// kernel_h, kernel_w, stride, padding, out_h, out_w, banks, image_base (first image of this
// launch: the host splits more than 65535 images), has_bank, has_bias (conv2d_forward only:
// add bias[o], binding 5, to channel o's outputs of every image whose bank is in range, in f32
// before the store's rounding; with has_bias = 0 binding 5 is any buffer of cv_weight, unread).
//
// ---- entry point `conv2d_forward` -------------------------------------------------------------
//   binding 1 x, 2 w, 3 bank, 5 bias (read), 4 y (written). An implicit GEMM per image,
//   y_b [OC, P] = w_g [OC, K] · cols_b [K, P], the windows gathered on the fly. Workgroup
//   (64, 4) = 256 invocations owns a tile of 16 output channels × 64 positions of one image;
//   invocation (lx, ly) accumulates channels 4·ly .. 4·ly + 3 at position lx. The K axis is walked
//   in chunks of 16: the workgroup stages w [16 × 16] and the windows [16 × 64] in workgroup
//   memory (one and four loads per invocation), waits, and runs the chunk from there.
//   Grid: (⌈P/64⌉, ⌈OC/16⌉, images in this launch).
//
// ---- entry point `conv2d_input_grad` ----------------------------------------------------------
//   binding 1 dy, 2 w, 3 bank (read), 4 dx (written). The gather form of col2im, no atomics:
//   one invocation per input pixel (b, c, y, x) sums w[g, o, c, i, j] · dy[b, o, oy, ox] over
//   the outputs (oy, ox) whose window (i, j) lands on the pixel. Workgroup 256 = 256 pixels of
//   one (b, c) plane; the taps w[g, o, c, :, :] are staged in workgroup memory for a block of
//   ⌊1024 / (KH·KW)⌋ output channels at a time (KH·KW ≤ 1024, checked by the launcher).
//   Grid: (⌈H·W/256⌉, C, images in this launch).
//
// ---- entry point `conv2d_weight_grad` ---------------------------------------------------------
//   binding 1 x, 2 dy, 3 bank (read), 4 dw (written). dw_g [OC, K] = Σ_{b of bank g} dy_b [OC, P]
//   · cols_bᵀ [P, K], in image order. Workgroup (16, 16) owns a tile of 16 channels × 16 window
//   elements of one bank and walks the images of that bank (the bank test is uniform across the
//   workgroup) and their positions in chunks of 16, staging dy [16 × 16] and the windows
//   [16 × 16]. No atomics: each output has one owner. Grid: (⌈K/16⌉, ⌈OC/16⌉, G).

struct ConvParams {
    batch: u32,
    channels: u32,
    height: u32,
    width: u32,
    out_channels: u32,
    kernel_h: u32,
    kernel_w: u32,
    stride: u32,
    padding: u32,
    out_h: u32,
    out_w: u32,
    banks: u32,
    image_base: u32,
    has_bank: u32,
    has_bias: u32,
}

@group(0) @binding(0) var<uniform> cv: ConvParams;

// The images' and their gradients' element type, and the store of an f32 value as one.
// f16 build: element type
alias cv_elem = f32;
fn cv_store(v: f32) -> cv_elem {
    return v;
}
// f16 build: end
// The weights' and their gradients' type (f32 in the f16-rows build), and its store.
// f16 build: weight type
alias cv_weight = f32;
fn cv_weight_store(v: f32) -> cv_weight {
    return v;
}
// f16 build: end

// The largest number of taps staged by conv2d_input_grad.
const TAP_STAGE: u32 = 1024u;

// Window element k of position p of image b: the index of the pixel it reads in x, or -1 in the
// padding or past the ends of the window or the positions.
fn window_pixel(b: u32, k: u32, p: u32) -> i32 {
    let taps = cv.kernel_h * cv.kernel_w;
    let positions = cv.out_h * cv.out_w;
    if (k >= cv.channels * taps || p >= positions) {
        return -1;
    }
    let c = k / taps;
    let i = (k / cv.kernel_w) % cv.kernel_h;
    let j = k % cv.kernel_w;
    let iy = i32((p / cv.out_w) * cv.stride + i) - i32(cv.padding);
    let ix = i32((p % cv.out_w) * cv.stride + j) - i32(cv.padding);
    if (iy < 0 || ix < 0 || iy >= i32(cv.height) || ix >= i32(cv.width)) {
        return -1;
    }
    return i32(((b * cv.channels + c) * cv.height + u32(iy)) * cv.width + u32(ix));
}

// The bank an image's entry `raw` names, or -1 when it is out of range (0 without a bank buffer).
fn checked_bank(raw: i32) -> i32 {
    if (cv.has_bank == 0u) {
        return 0;
    }
    if (raw < 0 || raw >= i32(cv.banks)) {
        return -1;
    }
    return raw;
}

// ---- conv2d_forward ---------------------------------------------------------------------------

@group(0) @binding(1) var<storage, read> fw_x: array<cv_elem>;
@group(0) @binding(2) var<storage, read> fw_w: array<cv_weight>;
@group(0) @binding(3) var<storage, read> fw_bank: array<i32>;
@group(0) @binding(4) var<storage, read_write> fw_y: array<cv_elem>;
@group(0) @binding(5) var<storage, read> fw_bias: array<cv_weight>;

var<workgroup> fw_wtile: array<f32, 256>;   // [16 channels][16 window elements]
var<workgroup> fw_xtile: array<f32, 1024>;  // [16 window elements][64 positions]

@compute @workgroup_size(64, 4)
fn conv2d_forward(@builtin(workgroup_id) wid: vec3<u32>,
                  @builtin(local_invocation_id) lid: vec3<u32>,
                  @builtin(local_invocation_index) li: u32) {
    let b = cv.image_base + wid.z;
    let g = checked_bank(fw_bank[min(b, arrayLength(&fw_bank) - 1u)]);
    let valid = g >= 0;
    let gb = u32(max(g, 0));
    let window = cv.channels * cv.kernel_h * cv.kernel_w;
    let positions = cv.out_h * cv.out_w;
    let p0 = wid.x * 64u;
    let o0 = wid.y * 16u;
    var acc = vec4<f32>(0.0);
    for (var k0 = 0u; k0 < window; k0 += 16u) {
        // weight tile: invocation li loads (channel li / 16, element li % 16)
        let wo = o0 + li / 16u;
        let wk = k0 + li % 16u;
        var wv = 0.0;
        if (valid && wo < cv.out_channels && wk < window) {
            wv = f32(fw_w[(gb * cv.out_channels + wo) * window + wk]);
        }
        fw_wtile[li] = wv;
        // window tile: four elements each, rows 4·r + li / 64 ... of position li % 64
        for (var r = 0u; r < 4u; r++) {
            let e = r * 256u + li;
            let at = window_pixel(b, k0 + e / 64u, p0 + e % 64u);
            fw_xtile[e] = select(0.0, f32(fw_x[max(at, 0)]), at >= 0);
        }
        workgroupBarrier();
        for (var kk = 0u; kk < 16u; kk++) {
            let a = fw_xtile[kk * 64u + lid.x];
            let row = lid.y * 4u;
            acc += a * vec4<f32>(
                fw_wtile[row * 16u + kk],
                fw_wtile[(row + 1u) * 16u + kk],
                fw_wtile[(row + 2u) * 16u + kk],
                fw_wtile[(row + 3u) * 16u + kk],
            );
        }
        workgroupBarrier();
    }
    let p = p0 + lid.x;
    if (p >= positions || b >= cv.batch) {
        return;
    }
    for (var r = 0u; r < 4u; r++) {
        let o = o0 + lid.y * 4u + r;
        if (o < cv.out_channels) {
            var v = acc[r];
            if (cv.has_bias != 0u) {
                v += f32(fw_bias[o]);
            }
            fw_y[(b * cv.out_channels + o) * positions + p] = cv_store(select(0.0, v, valid));
        }
    }
}

// ---- conv2d_input_grad ------------------------------------------------------------------------

@group(0) @binding(1) var<storage, read> ig_dy: array<cv_elem>;
@group(0) @binding(2) var<storage, read> ig_w: array<cv_weight>;
@group(0) @binding(3) var<storage, read> ig_bank: array<i32>;
@group(0) @binding(4) var<storage, read_write> ig_dx: array<cv_elem>;

var<workgroup> ig_taps: array<f32, TAP_STAGE>;  // [channels of the block][KH][KW]

@compute @workgroup_size(256)
fn conv2d_input_grad(@builtin(workgroup_id) wid: vec3<u32>,
                     @builtin(local_invocation_index) li: u32) {
    let b = cv.image_base + wid.z;
    let c = wid.y;
    let g = checked_bank(ig_bank[min(b, arrayLength(&ig_bank) - 1u)]);
    let valid = g >= 0;
    let gb = u32(max(g, 0));
    let taps = cv.kernel_h * cv.kernel_w;
    let window = cv.channels * taps;
    let positions = cv.out_h * cv.out_w;
    let pix = wid.x * 256u + li;
    let inside = pix < cv.height * cv.width;
    let y = i32(pix / cv.width) + i32(cv.padding);
    let x = i32(pix % cv.width) + i32(cv.padding);
    let s = i32(cv.stride);
    let block = max(TAP_STAGE / taps, 1u);
    var acc = 0.0;
    for (var o0 = 0u; o0 < cv.out_channels; o0 += block) {
        let count = min(block, cv.out_channels - o0);
        for (var t = li; t < count * taps; t += 256u) {
            let o = o0 + t / taps;
            var v = 0.0;
            if (valid) {
                v = f32(ig_w[(gb * cv.out_channels + o) * window + c * taps + t % taps]);
            }
            ig_taps[t] = v;
        }
        workgroupBarrier();
        if (inside && valid) {
            for (var i = 0u; i < cv.kernel_h; i++) {
                let ny = y - i32(i);
                if (ny < 0 || ny % s != 0 || ny / s >= i32(cv.out_h)) {
                    continue;
                }
                let oy = u32(ny / s);
                for (var j = 0u; j < cv.kernel_w; j++) {
                    let nx = x - i32(j);
                    if (nx < 0 || nx % s != 0 || nx / s >= i32(cv.out_w)) {
                        continue;
                    }
                    let p = oy * cv.out_w + u32(nx / s);
                    for (var ol = 0u; ol < count; ol++) {
                        acc += ig_taps[ol * taps + i * cv.kernel_w + j]
                            * f32(ig_dy[(b * cv.out_channels + o0 + ol) * positions + p]);
                    }
                }
            }
        }
        workgroupBarrier();
    }
    if (inside && b < cv.batch) {
        ig_dx[(b * cv.channels + c) * cv.height * cv.width + pix] = cv_store(acc);
    }
}

// ---- conv2d_weight_grad -----------------------------------------------------------------------

@group(0) @binding(1) var<storage, read> wg_x: array<cv_elem>;
@group(0) @binding(2) var<storage, read> wg_dy: array<cv_elem>;
@group(0) @binding(3) var<storage, read> wg_bank: array<i32>;
@group(0) @binding(4) var<storage, read_write> wg_dw: array<cv_weight>;

var<workgroup> wg_dytile: array<f32, 256>;  // [16 channels][16 positions]
var<workgroup> wg_xtile: array<f32, 256>;   // [16 window elements][16 positions]

@compute @workgroup_size(16, 16)
fn conv2d_weight_grad(@builtin(workgroup_id) wid: vec3<u32>,
                      @builtin(local_invocation_id) lid: vec3<u32>) {
    let g = i32(wid.z);
    let window = cv.channels * cv.kernel_h * cv.kernel_w;
    let positions = cv.out_h * cv.out_w;
    let k0 = wid.x * 16u;
    let o0 = wid.y * 16u;
    var acc = 0.0;
    for (var b = 0u; b < cv.batch; b++) {
        if (checked_bank(wg_bank[min(b, arrayLength(&wg_bank) - 1u)]) != g) {
            continue;
        }
        for (var p0 = 0u; p0 < positions; p0 += 16u) {
            // invocation (lx, ly) loads dy (channel o0 + ly, position p0 + lx) and the window
            // element (k0 + ly, position p0 + lx)
            let o = o0 + lid.y;
            let p = p0 + lid.x;
            var d = 0.0;
            if (o < cv.out_channels && p < positions) {
                d = f32(wg_dy[(b * cv.out_channels + o) * positions + p]);
            }
            wg_dytile[lid.y * 16u + lid.x] = d;
            let at = window_pixel(b, k0 + lid.y, p);
            wg_xtile[lid.y * 16u + lid.x] = select(0.0, f32(wg_x[max(at, 0)]), at >= 0);
            workgroupBarrier();
            for (var q = 0u; q < 16u; q++) {
                acc += wg_dytile[lid.y * 16u + q] * wg_xtile[lid.x * 16u + q];
            }
            workgroupBarrier();
        }
    }
    let o = o0 + lid.y;
    let k = k0 + lid.x;
    if (o < cv.out_channels && k < window) {
        wg_dw[(u32(g) * cv.out_channels + o) * window + k] = cv_weight_store(acc);
    }
}
