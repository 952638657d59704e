// f16_convert.wgsl: the one f32 -> f16 conversion of every f16 kernel (prepended, after
// `enable f16;`, to shaders/half.wgsl and to the f16 build of shaders/matmul.wgsl).
//
// WGSL leaves the conversion of a value outside f16's finite range indeterminate; here it is
// IEEE's: magnitudes that round past the largest f16 (65504, i.e. |x| >= 65520) become ±inf, NaN
// stays NaN (tested by bits, as a compiler may assume x == x), everything else is `f16(x)`. A
// loss scaler's overflow test relies on the infinities.

// The largest finite f16, as a run-time value: ±inf is made from it by f16 arithmetic (naga
// accepts neither an overflowing constant nor a bitcast of a constant to f16).
var<private> f16_largest: f32 = 65504.0;

fn f16_of(x: f32) -> f16 {
    if (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u {
        // NaN: the hardware conversion of the NaN itself. Making one by arithmetic (inf − inf)
        // does not survive a driver that assumes no NaN arises: NVIDIA's Vulkan driver folded
        // it to 0 (H200, driver 580.159.04).
        return f16(x);
    }
    let inf = f16(f16_largest) * f16(2.0);
    if abs(x) >= 65520.0 {
        return select(inf, -inf, x < 0.0);
    }
    return f16(x);
}
