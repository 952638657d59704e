//! The backend codes no tensor op reaches on the GPU (`BinaryOp::Pow` with broadcasting,
//! `UnaryOp::GeluGrad`) and `random_uniform`, as a property over random shapes (the strategy
//! of `tests/gpu_parity_props.rs`, whose other properties go through the tensor API): on the
//! GPU, and with the CPU's f32 backend in its place, against the CPU backend in f64 (bit for bit
//! in f32 for the random numbers).
//!
//! Without a GPU adapter the GPU test prints "skipping" and passes, unless
//! `MOEGRAD_REQUIRE_GPU=1`.

use proptest::prelude::*;

/// Elements a random shape may hold (lavapipe runs every case).
const CAP: usize = 12_000;

/// One dim: mostly 1–70, sometimes 1 or a workgroup edge (255, 256, 257).
fn dim() -> impl Strategy<Value = usize> {
    prop_oneof![
        6 => 1usize..=70,
        1 => Just(1usize),
        1 => prop::sample::select(vec![255usize, 256, 257]),
    ]
}

/// `s` with its largest dim halved until it holds at most `cap` elements.
fn fit(mut s: Vec<usize>, cap: usize) -> Vec<usize> {
    while s.iter().product::<usize>() > cap {
        let i = (0..s.len())
            .max_by_key(|&i| s[i])
            .expect("a non-empty shape");
        s[i] = (s[i] / 2).max(1);
    }
    s
}

/// A shape of rank 1–4 and at most [`CAP`] elements, and a seed for the values.
fn shape_and_seed() -> impl Strategy<Value = (Vec<usize>, u64)> {
    (
        prop::collection::vec(dim(), 1..=4).prop_map(|s| fit(s, CAP)),
        any::<u64>(),
    )
}

mod cases {
    use super::super::folded_grids::host_f64;
    use super::{broadcast_strides, shape_and_seed};
    use crate::backend::cpu::CpuBackend;
    use crate::backend::gpu::GpuBackend;
    use crate::backend::{Backend, BinaryOp, BufferOps, ElementwiseOps, HostData, UnaryOp};
    use crate::parity::{Gen, V};
    use crate::property::check_property;
    use crate::{DType, Device, common};

    /// The backend codes no tensor op reaches on the GPU (`BinaryOp::Pow` with broadcasting,
    /// `UnaryOp::GeluGrad`), and `random_uniform`, against the CPU backend through the `Backend`
    /// trait: f64 for the functions, bit for bit in f32 for the random numbers.
    pub fn backend_only_codes(dev: Device) {
        let _lock = (dev == Device::Gpu).then(super::super::gpu_lock);
        check_property("backend_only_codes", 16, shape_and_seed(), |(s, seed)| {
            let mut g = Gen::from_seed(seed);
            let (sa, sb) = g.broadcast_pair(&s);
            let base = g.vals(sa.iter().product(), V::Positive);
            let exponent = g.vals(sb.iter().product(), V::Smooth);
            let x = g.vals(s.iter().product(), V::Smooth);
            let reference = codes(&CpuBackend, &s, (&sa, &base), (&sb, &exponent), &x, true);
            let got = match dev {
                Device::Cpu => codes(&CpuBackend, &s, (&sa, &base), (&sb, &exponent), &x, false),
                Device::Gpu => {
                    let be = GpuBackend::get().expect("the GPU opened");
                    codes(&be, &s, (&sa, &base), (&sb, &exponent), &x, false)
                }
            };
            let what = format!("{sa:?} pow {sb:?}");
            common::assert_close(&what, &got.0, &reference.0, 1e-4, 1e-3);
            common::assert_close(
                &format!("gelu_grad {s:?}"),
                &got.1,
                &reference.1,
                1e-4,
                1e-3,
            );
            let n = s.iter().product::<usize>();
            let random = match dev {
                Device::Cpu => {
                    CpuBackend.download(&CpuBackend.random_uniform(n, seed, DType::F32).unwrap())
                }
                Device::Gpu => {
                    let be = GpuBackend::get().expect("the GPU opened");
                    be.download(&be.random_uniform(n, seed, DType::F32).unwrap())
                }
            };
            let want =
                CpuBackend.download(&CpuBackend.random_uniform(n, seed, DType::F32).unwrap());
            assert_eq!(
                random.unwrap(),
                want.unwrap(),
                "random_uniform {n} seed {seed}"
            );
        });
    }

    /// `a^b` broadcast over `out` and `gelu'(x)` on backend `be`, in f64 or f32.
    fn codes<B: Backend>(
        be: &B,
        out: &[usize],
        (sa, a): (&[usize], &[f64]),
        (sb, b): (&[usize], &[f64]),
        x: &[f64],
        f64: bool,
    ) -> (Vec<f64>, Vec<f64>) {
        let up = |v: &[f64]| {
            let h = if f64 {
                HostData::F64(v.to_vec())
            } else {
                HostData::F32(v.iter().map(|&x| x as f32).collect())
            };
            be.upload(&h).unwrap()
        };
        let pow = be
            .binary(
                BinaryOp::Pow,
                &up(a),
                &broadcast_strides(sa, out),
                &up(b),
                &broadcast_strides(sb, out),
                out,
            )
            .unwrap();
        let gelu_grad = be.unary(UnaryOp::GeluGrad, &up(x)).unwrap();
        (
            host_f64(be.download(&pow).unwrap()),
            host_f64(be.download(&gelu_grad).unwrap()),
        )
    }
}

/// Strides that read a tensor of shape `s` broadcast to `out` (0 along a broadcast dim).
fn broadcast_strides(s: &[usize], out: &[usize]) -> Vec<usize> {
    let pad = out.len() - s.len();
    let mut strides = vec![0; out.len()];
    let mut step = 1;
    for d in (0..s.len()).rev() {
        strides[pad + d] = if s[d] == 1 { 0 } else { step };
        step *= s[d];
    }
    strides
}

crate::parity::gpu_and_cpu_f32_tests!(
    cases,
    "backend_codes",
    /// The backend-only codes with the CPU's f32 backend standing in for the GPU.
    fn backend_codes_hold_with_the_cpu_f32_backend;
    backend_only_codes,
);
