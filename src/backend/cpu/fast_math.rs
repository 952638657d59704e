//! Vectorisable f32 transcendental functions ([`exp_f32`], [`ln_f32`], GELU and its slope)
//! and the loop [`map1_f32_wide`] that applies them with AVX2 when the processor has it. The
//! `unary` primitive uses them for f32 `exp`, `log` and GELU; the fused softmax, attention and
//! cross-entropy kernels call [`exp_f32`] directly.

use super::{CpuBackend, CpuBuffer, MAP_CHUNK, f32b, write_chunks};
use std::mem::MaybeUninit;

/// `e^x` in f32 by straight-line arithmetic that the compiler vectorises, where the C library's
/// `expf` is one call per element (softmax over `[4096, 64]` router logits spent 0.55 ms per exp
/// pass in it, against 0.06 ms here, dev-2core).
///
/// `x = n·ln 2 + r` with `n = round(x·log₂e)` and `|r| ≤ ln 2 / 2` (ln 2 is split into a short
/// head, whose product with `n` is exact, and a tail); `e^r` is its Taylor polynomial of degree 7
/// (truncation error below 6·10⁻⁹ relative) in Horner form; `2^n` is built from exponent bits in
/// two halves so that each stays a normal number down to the subnormal results. Within a few
/// ulp of the correctly rounded value (`tests/cpu_kernels.rs` checks 4 ulp over the whole
/// range); `+inf` above ln(f32::MAX), `0` below ln of the smallest subnormal, NaN stays NaN.
#[inline(always)]
pub(super) fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4; // 355/512: 9 significant bits, so n·LN2_HI is exact
    const LN2_LO: f32 = -2.121_944_4e-4; // ln 2 − LN2_HI
    const HI: f32 = 88.722_84; // ln(f32::MAX)
    const LO: f32 = -103.972_08; // ln of the smallest subnormal
    const ROUND: f32 = 12_582_912.0; // 1.5·2²³: adding and subtracting it rounds to an integer
    let xc = x.clamp(LO, HI); // a NaN stays NaN and is passed through at the end
    let shifted = xc * LOG2E + ROUND; // n sits in the low mantissa bits
    let n = shifted - ROUND;
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0
                    + r * (1.0 / 24.0
                        + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    let n = shifted.to_bits() as i32 - ROUND.to_bits() as i32; // no float-to-int conversion
    let half = n >> 1;
    let pow2 = |e: i32| f32::from_bits(((e + 127) as u32) << 23);
    let y = p * pow2(half) * pow2(n - half);
    if x > HI {
        f32::INFINITY
    } else if x < LO {
        0.0
    } else if x.is_nan() {
        x
    } else {
        y
    }
}

/// `ln x` in f32 by straight-line arithmetic the compiler vectorises (see [`exp_f32`]).
///
/// `x = 2^e · f` with `f` in `[√½, √2)` (read from the exponent bits; subnormal inputs are
/// first scaled by 2²³), then `ln f = 2·atanh(s) = 2(s + s³/3 + s⁵/5 + s⁷/7 + s⁹/9)` with
/// `s = (f − 1)/(f + 1)`, `|s| ≤ 0.172` (the next term is below 10⁻⁹ relative), and
/// `ln x = e·ln 2 + ln f` with ln 2 split as in [`exp_f32`]. Within a few ulp of the correctly
/// rounded value (`tests/cpu_kernels.rs` checks 4 ulp over every positive f32); `ln 0 = −∞`,
/// `ln x = NaN` for `x < 0` and NaN, `ln ∞ = ∞`.
#[inline(always)]
pub(super) fn ln_f32(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const SQRT_HALF_BITS: i32 = 0x3f35_04f3;
    let subnormal = x < f32::MIN_POSITIVE;
    let xs = if subnormal { x * 8_388_608.0 } else { x }; // 2²³
    let bits = xs.to_bits() as i32;
    // e = ⌊log₂(x / √½)⌋, so that f = x / 2^e lands in [√½, √2)
    let e = (bits - SQRT_HALF_BITS) >> 23;
    let f = f32::from_bits((bits - (e << 23)) as u32);
    let e = (e - if subnormal { 23 } else { 0 }) as f32;
    let s = (f - 1.0) / (f + 1.0);
    let s2 = s * s;
    let tail = s2 * (1.0 / 3.0 + s2 * (1.0 / 5.0 + s2 * (1.0 / 7.0 + s2 * (1.0 / 9.0))));
    let y = e * LN2_HI + ((2.0 * s + 2.0 * s * tail) + e * LN2_LO);
    if x == 0.0 {
        f32::NEG_INFINITY
    } else if x.is_nan() || x < 0.0 {
        f32::NAN
    } else if x == f32::INFINITY {
        x
    } else {
        y
    }
}

/// GELU's tanh form through the logistic function, `0.5·x·(1 + tanh u) = x·σ(2u)` with
/// `u = √(2/π)·(x + 0.044715·x³)`, so that it needs one [`exp_f32`] and vectorises (the C library's
/// `tanhf` was a quarter of a GPT training step, dev-2core). Returns `(gelu(x), gelu'(x))`, where
/// `gelu'(x) = σ(2u) + x·σ(2u)·(1 − σ(2u))·2u'` and `u' = √(2/π)·(1 + 3·0.044715·x²)`.
/// Large `|x|` give the exact limits (`x` and slope 1, `0` and slope 0): `e^{−2u}` overflows to ∞
/// for very negative `x`, giving `σ = 0`, and the slope's second term is taken as 0 wherever `σ`
/// saturates.
#[inline(always)]
pub(super) fn gelu_and_grad_f32(x: f32) -> (f32, f32) {
    const K: f32 = 0.797_884_6; // √(2/π)
    const A: f32 = 0.044_715;
    let u = K * (x + A * x * x * x);
    let s = 1.0 / (1.0 + exp_f32(-2.0 * u));
    let du = K * (1.0 + 3.0 * A * x * x);
    // where σ saturates to exactly 0 or 1 the second term is 0 (x·du may be infinite there)
    let ds = s * (1.0 - s);
    let slope = if ds == 0.0 { 0.0 } else { x * ds * 2.0 * du };
    (x * s, s + slope)
}

/// SiLU and its slope at `x`: `silu(x) = x·σ(x)`, `silu'(x) = σ(x)·(1 + x·(1 − σ(x)))`, both
/// from one exponential. Very negative `x` give `σ = 0` (`e^{−x}` overflows to ∞): value −0,
/// slope 0.
#[inline(always)]
pub(super) fn silu_and_grad_f32(x: f32) -> (f32, f32) {
    let s = 1.0 / (1.0 + exp_f32(-x));
    (x * s, s * (1.0 + x * (1.0 - s)))
}

/// Whether the processor has AVX2, for which the wide loops below are also compiled (eight
/// lanes instead of the four of SSE2, which the baseline x86-64 build targets); `false` off
/// x86-64.
pub(super) fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Runs `body` compiled for AVX2 where `avx2` says the processor has it ([`has_avx2`]: the f32
/// functions above vectorise eight wide there instead of four), else as the baseline build.
/// Everything `body` calls inline is compiled for AVX2 with it, so a kernel's generic row loop
/// becomes a wide loop by being called through here.
#[inline(always)]
pub(super) fn with_avx2<R>(avx2: bool, body: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn wide<R>(body: impl FnOnce() -> R) -> R {
        body()
    }
    #[cfg(target_arch = "x86_64")]
    if avx2 {
        // SAFETY: AVX2 was detected on this processor.
        return unsafe { wide(body) };
    }
    let _ = avx2;
    body()
}

/// The float types of the fused kernels that exponentiate (attention's scores, the
/// cross-entropy's log-sum-exp), with the exponential they use: the vectorisable [`exp_f32`] in
/// f32 (one call to the C library per element cost more than the rest of those kernels), the
/// standard one in f64 (the references the tests compare with).
pub(super) trait ExpFloat: num_traits::Float + Send + Sync + 'static {
    /// `e^self`
    fn exp_fast(self) -> Self;
}

impl ExpFloat for f32 {
    #[inline(always)]
    fn exp_fast(self) -> f32 {
        exp_f32(self)
    }
}

impl ExpFloat for f64 {
    #[inline(always)]
    fn exp_fast(self) -> f64 {
        self.exp()
    }
}

/// The f32 functions with a vectorisable implementation here.
#[derive(Clone, Copy)]
pub(super) enum WideF32 {
    /// [`exp_f32`]
    Exp,
    /// [`ln_f32`]
    Ln,
    /// GELU, tanh form ([`gelu_and_grad_f32`])
    Gelu,
    /// GELU's derivative ([`gelu_and_grad_f32`])
    GeluGrad,
}

/// `out[i] = f(x[i])` for one of the vectorisable f32 functions: `map1`, with each chunk's
/// loop compiled for AVX2 when the processor has it (eight lanes instead of the four of SSE2,
/// which the baseline x86-64 build targets).
pub(super) fn map1_f32_wide(x: &[f32], f: WideF32) -> Vec<f32> {
    #[inline(always)]
    fn chunk_loop(f: WideF32, x: &[f32], o: &mut [MaybeUninit<f32>]) {
        match f {
            WideF32::Exp => o.iter_mut().zip(x).for_each(|(o, &x)| {
                o.write(exp_f32(x));
            }),
            WideF32::Ln => o.iter_mut().zip(x).for_each(|(o, &x)| {
                o.write(ln_f32(x));
            }),
            WideF32::Gelu => o.iter_mut().zip(x).for_each(|(o, &x)| {
                o.write(gelu_and_grad_f32(x).0);
            }),
            WideF32::GeluGrad => o.iter_mut().zip(x).for_each(|(o, &x)| {
                o.write(gelu_and_grad_f32(x).1);
            }),
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn chunk_loop_avx2(f: WideF32, x: &[f32], o: &mut [MaybeUninit<f32>]) {
        chunk_loop(f, x, o)
    }
    let avx2 = has_avx2();
    let body = |k: usize, o: &mut [MaybeUninit<f32>]| {
        let x = &x[k * MAP_CHUNK..k * MAP_CHUNK + o.len()];
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            // SAFETY: AVX2 was detected on this processor.
            return unsafe { chunk_loop_avx2(f, x, o) };
        }
        let _ = avx2;
        chunk_loop(f, x, o)
    };
    // SAFETY: chunk k of the output is zipped with the same-length chunk k of `x`.
    unsafe { write_chunks(x.len(), MAP_CHUNK, body) }
}

/// `out[i] = g[i]·gelu'(x[i])`, GELU's backward in one pass over two equal-length buffers
/// (`BinaryOp::GeluBackward`), compiled for AVX2 when the processor has it like
/// [`map1_f32_wide`]. Composed, it took two passes and a buffer for the slope.
pub(super) fn gelu_backward_f32(g: &[f32], x: &[f32]) -> Vec<f32> {
    #[inline(always)]
    fn chunk_loop(g: &[f32], x: &[f32], o: &mut [MaybeUninit<f32>]) {
        for ((o, &g), &x) in o.iter_mut().zip(g).zip(x) {
            o.write(g * gelu_and_grad_f32(x).1);
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn chunk_loop_avx2(g: &[f32], x: &[f32], o: &mut [MaybeUninit<f32>]) {
        chunk_loop(g, x, o)
    }
    let avx2 = has_avx2();
    let n = g.len().min(x.len());
    let body = |k: usize, o: &mut [MaybeUninit<f32>]| {
        let r = k * MAP_CHUNK..k * MAP_CHUNK + o.len();
        let (g, x) = (&g[r.clone()], &x[r]);
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            // SAFETY: AVX2 was detected on this processor.
            return unsafe { chunk_loop_avx2(g, x, o) };
        }
        let _ = avx2;
        chunk_loop(g, x, o)
    };
    // SAFETY: chunk k of the output is zipped with the same-length chunks k of `g` and `x`.
    unsafe { write_chunks(n, MAP_CHUNK, body) }
}

/// A function and its slope, `(f(x[i]), f'(x[i]))`, in one pass for GELU
/// ([`gelu_and_grad_f32`]) or SiLU ([`silu_and_grad_f32`]): both come from one exponential, so
/// a forward pass that keeps the slope makes the backward a plain product (`Tensor::gelu`,
/// `Tensor::silu` on the CPU in f32). AVX2 and threads as in [`map1_f32_wide`].
pub(super) fn value_and_slope_f32(x: &[f32], silu: bool) -> (Vec<f32>, Vec<f32>) {
    #[inline(always)]
    fn chunk_loop(x: &[f32], y: &mut [MaybeUninit<f32>], s: &mut [MaybeUninit<f32>], silu: bool) {
        if silu {
            for ((y, s), &x) in y.iter_mut().zip(s.iter_mut()).zip(x) {
                let (value, slope) = silu_and_grad_f32(x);
                y.write(value);
                s.write(slope);
            }
        } else {
            for ((y, s), &x) in y.iter_mut().zip(s.iter_mut()).zip(x) {
                let (value, slope) = gelu_and_grad_f32(x);
                y.write(value);
                s.write(slope);
            }
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn chunk_loop_avx2(
        x: &[f32],
        y: &mut [MaybeUninit<f32>],
        s: &mut [MaybeUninit<f32>],
        silu: bool,
    ) {
        chunk_loop(x, y, s, silu)
    }
    let avx2 = has_avx2();
    let n = x.len();
    let take =
        |n: usize| super::buffer_pool::take::<f32>(n).unwrap_or_else(|_| Vec::with_capacity(n));
    let (mut y, mut s) = (take(n), take(n));
    let body = |x: &[f32], y: &mut [MaybeUninit<f32>], s: &mut [MaybeUninit<f32>]| {
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            // SAFETY: AVX2 was detected on this processor.
            return unsafe { chunk_loop_avx2(x, y, s, silu) };
        }
        let _ = avx2;
        chunk_loop(x, y, s, silu)
    };
    let (ys, ss) = (
        &mut y.spare_capacity_mut()[..n],
        &mut s.spare_capacity_mut()[..n],
    );
    if n >= super::PAR_MIN {
        use rayon::prelude::*;
        x.par_chunks(MAP_CHUNK)
            .zip(ys.par_chunks_mut(MAP_CHUNK))
            .zip(ss.par_chunks_mut(MAP_CHUNK))
            .for_each(|((x, y), s)| body(x, y, s));
    } else {
        body(x, ys, ss);
    }
    // SAFETY: the chunks cover all n elements of both outputs, and `chunk_loop` wrote each.
    unsafe {
        y.set_len(n);
        s.set_len(n);
    }
    (y, s)
}

impl CpuBackend {
    /// GELU (tanh form) or SiLU and its slope at `x` in one pass (`value_and_slope_f32`), for
    /// f32 `x`; `None` for other dtypes.
    pub(crate) fn value_and_slope(
        &self,
        x: &CpuBuffer,
        silu: bool,
    ) -> Option<(CpuBuffer, CpuBuffer)> {
        match x {
            CpuBuffer::F32(v) => {
                let (y, s) = value_and_slope_f32(v, silu);
                Some((f32b(y), f32b(s)))
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Distance in units in the last place between two finite f32 of one sign (or both zero).
    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    #[test]
    fn exp_is_within_4_ulp_of_the_rounded_exp_over_the_whole_range() {
        // every 997th f32 bit pattern between the underflow and overflow thresholds, both signs
        let mut worst = (0u32, 0.0f32);
        for bits in (0u32..=u32::MAX).step_by(997) {
            let x = f32::from_bits(bits);
            if !x.is_finite() || !(-103.0..=88.7).contains(&x) {
                continue;
            }
            let want = (x as f64).exp() as f32;
            let got = exp_f32(x);
            let d = if want < f32::MIN_POSITIVE {
                // subnormal results: compare absolutely, at the subnormal spacing
                ((got - want).abs() / f32::from_bits(1)) as u32
            } else {
                ulps(got, want)
            };
            if d > worst.0 {
                worst = (d, x);
            }
        }
        assert!(
            worst.0 <= 4,
            "exp_f32 is {} ulp off at x = {}",
            worst.0,
            worst.1
        );
        assert_eq!(exp_f32(0.0), 1.0);
        assert_eq!(exp_f32(-0.0), 1.0);
        assert_eq!(exp_f32(1.0), std::f32::consts::E);
        assert_eq!(exp_f32(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp_f32(89.0), f32::INFINITY);
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_f32(-200.0), 0.0);
        assert!(exp_f32(f32::NAN).is_nan());
        assert!(exp_f32(88.72).is_finite() && exp_f32(88.72) > 3.3e38);
    }

    #[test]
    fn ln_is_within_4_ulp_of_the_rounded_ln_over_every_positive_float() {
        let mut worst = (0u32, 0.0f32);
        // every 331st positive bit pattern: subnormals, around 1, up to f32::MAX
        for bits in (1u32..0x7f80_0000).step_by(331) {
            let x = f32::from_bits(bits);
            let want = (x as f64).ln() as f32;
            let d = ulps(ln_f32(x), want);
            if d > worst.0 {
                worst = (d, x);
            }
        }
        assert!(
            worst.0 <= 4,
            "ln_f32 is {} ulp off at x = {}",
            worst.0,
            worst.1
        );
        assert_eq!(ln_f32(1.0), 0.0);
        assert_eq!(ln_f32(std::f32::consts::E), 1.0);
        assert_eq!(ln_f32(2.0), std::f32::consts::LN_2);
        assert_eq!(ln_f32(0.0), f32::NEG_INFINITY);
        assert_eq!(ln_f32(-0.0), f32::NEG_INFINITY);
        assert_eq!(ln_f32(f32::INFINITY), f32::INFINITY);
        assert!(ln_f32(-1.0).is_nan() && ln_f32(f32::NAN).is_nan());
        assert!(ln_f32(f32::NEG_INFINITY).is_nan());
    }
}
