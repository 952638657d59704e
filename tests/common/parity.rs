//! The GPU parity harness shared by `tests/gpu_parity.rs` (fixed cases),
//! `tests/gpu_parity_props.rs` and `tests/gpu_parity_fused.rs` (property tests over random shapes): [`parity`] runs one function
//! on f64 CPU copies and on f32 copies on the device under test of the same f32-representable
//! inputs, back-propagates one random upstream gradient on both and compares outputs and input
//! gradients; [`parity_outputs`] does the same for a function of several outputs (the fused ops
//! of `tests/gpu_parity_fused.rs`); [`Gen`] makes the inputs. Included with
//! `#[path = "common/parity.rs"] mod parity;` next to `mod common;` (it uses `crate::common`).
#![allow(dead_code)]

use moegrad::{DType, Device, Result, Tensor};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

// ---- tolerances -----------------------------------------------------------------------------

#[derive(Clone, Copy, Debug)]
pub struct Tol {
    pub atol: f64,
    pub rtol: f64,
}

/// Elementwise ops.
pub const TIGHT: Tol = Tol {
    atol: 1e-4,
    rtol: 1e-3,
};
/// Matmul, reductions, softmax family, losses (f32 accumulation over up to 64 terms).
pub const LOOSE: Tol = Tol {
    atol: 5e-4,
    rtol: 5e-3,
};

// ---- the harness ----------------------------------------------------------------------------

/// A fresh leaf of `t`'s values, tracking gradients if it is a float tensor.
fn fresh_leaf(t: &Tensor) -> Tensor {
    let fresh = t.detach();
    if fresh.dtype().is_float() {
        fresh.with_grad().unwrap()
    } else {
        fresh
    }
}

/// Input `i`'s copy for the device under test: f32 on `dev` (I32 stays I32), with grad if float.
pub fn device_copy(t: &Tensor, dev: Device) -> Tensor {
    if t.dtype() == DType::I32 {
        fresh_leaf(&t.to_device(dev).unwrap())
    } else {
        fresh_leaf(&t.to_dtype(DType::F32).unwrap().to_device(dev).unwrap())
    }
}

/// The CPU reference copy: f64 (I32 stays I32), with grad if float.
pub fn reference_copy(t: &Tensor) -> Tensor {
    fresh_leaf(t)
}

pub fn seed_of(name: &str) -> u64 {
    // FNV-1a, so each op gets its own fixed stream.
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// Runs `f` on f64 CPU copies and f32 copies on `dev` of `inputs`, back-propagates the same
/// random upstream gradient on both, and compares outputs and every float input's gradient.
pub fn parity(
    name: &str,
    dev: Device,
    tol: Tol,
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
    inputs: &[Tensor],
) {
    parity_outputs(name, dev, tol, |t| Ok(vec![f(t)?]), inputs);
}

/// [`parity`] for a function of several outputs (a fused op's probabilities, indices and
/// weights): runs `f` on f64 CPU copies and f32 copies on `dev` of `inputs`, compares every
/// output (I32 ones exactly), back-propagates the same random upstream gradient `up_i` into
/// every float output `y_i` on both sides (through `Σ_i ⟨up_i, y_i⟩` when there are several),
/// and compares every float input's gradient.
pub fn parity_outputs(
    name: &str,
    dev: Device,
    tol: Tol,
    f: impl Fn(&[Tensor]) -> Result<Vec<Tensor>>,
    inputs: &[Tensor],
) {
    let cpu: Vec<Tensor> = inputs.iter().map(reference_copy).collect();
    let gpu: Vec<Tensor> = inputs.iter().map(|t| device_copy(t, dev)).collect();
    let yc = f(&cpu).unwrap_or_else(|e| panic!("{name}: reference forward failed: {e}"));
    let yg = f(&gpu).unwrap_or_else(|e| panic!("{name}: {dev} forward failed: {e}"));
    assert_eq!(yc.len(), yg.len(), "{name}: output counts differ");
    let output = |o: usize| {
        if yc.len() == 1 {
            "output".to_string()
        } else {
            format!("output {o}")
        }
    };
    let mut rng = ChaCha8Rng::seed_from_u64(seed_of(name) ^ 0xbac4);
    // (reference output, output under test, upstream gradient) for every float output with grad
    let mut seeds: Vec<(&Tensor, &Tensor, Vec<f64>)> = Vec::new();
    for (o, (c, g)) in yc.iter().zip(&yg).enumerate() {
        let out = output(o);
        assert_eq!(c.shape(), g.shape(), "{name}: {out} shapes differ");
        assert_eq!(g.device(), dev, "{name}: {out} left the device");
        if c.dtype() == DType::I32 || g.dtype() == DType::I32 {
            assert_eq!(c.dtype(), g.dtype(), "{name}: {out} dtypes differ");
            assert_eq!(
                c.to_vec_i32().unwrap(),
                g.to_vec_i32().unwrap(),
                "{name}: integer {out} differs"
            );
            continue;
        }
        let (vc, vg) = (c.to_vec_f64().unwrap(), g.to_vec_f64().unwrap());
        crate::common::assert_close(&format!("{name}: {out}"), &vg, &vc, tol.atol, tol.rtol);
        assert_eq!(
            c.requires_grad(),
            g.requires_grad(),
            "{name}: requires_grad of the {out} differs"
        );
        if c.requires_grad() {
            let up: Vec<f64> = (0..c.numel())
                .map(|_| rng.random_range(-1.0f64..1.0) as f32 as f64)
                .collect();
            seeds.push((c, g, up));
        }
    }
    if seeds.is_empty() {
        return;
    }
    // `up` as a tensor like `y` (its dtype, on its device)
    let upstream = |up: &[f64], y: &Tensor| {
        Tensor::from_f64(up.to_vec(), y.shape(), Device::cpu())
            .and_then(|u| u.to_dtype(y.dtype()))
            .and_then(|u| u.to_device(y.device()))
            .unwrap()
    };
    if let [(c, g, up)] = &seeds[..] {
        c.backward_with(&upstream(up, c))
            .unwrap_or_else(|e| panic!("{name}: reference backward failed: {e}"));
        g.backward_with(&upstream(up, g))
            .unwrap_or_else(|e| panic!("{name}: {dev} backward failed: {e}"));
    } else {
        // Σ_i ⟨up_i, y_i⟩ over the reference outputs (`reference`) or those under test
        let loss = |reference: bool| {
            let terms = seeds.iter().map(|(c, g, up)| {
                let y = if reference { c } else { g };
                y.mul(&upstream(up, y)).unwrap().sum_all().unwrap()
            });
            terms.reduce(|a, t| a.add(&t).unwrap()).unwrap()
        };
        loss(true)
            .backward()
            .unwrap_or_else(|e| panic!("{name}: reference backward failed: {e}"));
        loss(false)
            .backward()
            .unwrap_or_else(|e| panic!("{name}: {dev} backward failed: {e}"));
    }
    for (i, (c, g)) in cpu.iter().zip(&gpu).enumerate() {
        match (c.grad(), g.grad()) {
            (None, None) => {}
            (Some(gc), Some(gg)) => {
                assert_eq!(
                    gg.device(),
                    dev,
                    "{name}: input {i}'s gradient left the device"
                );
                assert_eq!(gg.dtype(), DType::F32, "{name}: input {i}'s gradient dtype");
                assert_eq!(gc.shape(), gg.shape(), "{name}: input {i}'s gradient shape");
                crate::common::assert_close(
                    &format!("{name}: grad of input {i}"),
                    &gg.to_vec_f64().unwrap(),
                    &gc.to_vec_f64().unwrap(),
                    tol.atol,
                    tol.rtol,
                );
            }
            (c, g) => panic!(
                "{name}: input {i} got a gradient on one side only (reference {}, {dev} {})",
                c.is_some(),
                g.is_some()
            ),
        }
    }
}

// ---- op tables ------------------------------------------------------------------------------

/// A binary tensor op, as the case tables list them.
pub type BinaryFn = fn(&Tensor, &Tensor) -> Result<Tensor>;

/// The six comparisons by name (outputs 1 where true and 0 where false, no gradient).
pub const COMPARISONS: [(&str, BinaryFn); 6] = [
    ("gt", Tensor::gt),
    ("ge", Tensor::ge),
    ("lt", Tensor::lt),
    ("le", Tensor::le),
    ("eq", Tensor::eq),
    ("ne", Tensor::ne),
];

// ---- random inputs --------------------------------------------------------------------------

#[derive(Clone, Copy)]
pub enum V {
    Smooth,
    Distinct,
    Positive,
    NonZero,
}

/// Fixed-seed generator of shapes and f32-representable f64 values.
pub struct Gen(pub ChaCha8Rng);

impl Gen {
    pub fn new(op: &str, case: u64) -> Gen {
        Gen(ChaCha8Rng::seed_from_u64(
            seed_of(op) ^ case.wrapping_mul(0x9e37),
        ))
    }
    /// A generator seeded directly (the property tests draw the seed).
    pub fn from_seed(seed: u64) -> Gen {
        Gen(ChaCha8Rng::seed_from_u64(seed))
    }
    pub fn dim(&mut self, lo: usize, hi: usize) -> usize {
        self.0.random_range(lo..=hi)
    }
    pub fn flip(&mut self) -> bool {
        self.0.random_range(0..2) == 1
    }
    pub fn vals(&mut self, n: usize, kind: V) -> Vec<f64> {
        let v: Vec<f64> = match kind {
            V::Smooth => (0..n).map(|_| self.0.random_range(-2.0..2.0)).collect(),
            V::Positive => (0..n).map(|_| self.0.random_range(0.2..3.0)).collect(),
            V::NonZero => (0..n)
                .map(|_| {
                    let m = self.0.random_range(0.5..2.0);
                    if self.flip() { m } else { -m }
                })
                .collect(),
            V::Distinct => {
                // A shuffled ladder with gaps 0.05, centred, shifted off 0 by half a step.
                let mut ids: Vec<usize> = (0..n).collect();
                for i in (1..n).rev() {
                    let j = self.0.random_range(0..=i);
                    ids.swap(i, j);
                }
                ids.iter()
                    .map(|&p| (p as f64 - (n / 2) as f64 + 0.5) * 0.05)
                    .collect()
            }
        };
        v.into_iter().map(|x| x as f32 as f64).collect()
    }
    pub fn tensor(&mut self, shape: &[usize], kind: V) -> Tensor {
        let n = shape.iter().product();
        crate::common::f64t(&self.vals(n, kind), shape)
    }
    pub fn ints(&mut self, shape: &[usize], hi: usize) -> Tensor {
        let n: usize = shape.iter().product();
        let v = (0..n).map(|_| self.0.random_range(0..hi) as i32).collect();
        Tensor::from_i32(v, shape, Device::cpu()).unwrap()
    }
    /// Two shapes that broadcast to `s`: each dim set to 1 on one side or neither, some leading
    /// dims dropped from one side, the sides in random order.
    pub fn broadcast_pair(&mut self, s: &[usize]) -> (Vec<usize>, Vec<usize>) {
        let mut a = s.to_vec();
        let mut b = s.to_vec();
        for d in 0..s.len() {
            match self.dim(0, 3) {
                0 => a[d] = 1,
                1 => b[d] = 1,
                _ => {}
            }
        }
        let drop = self.dim(0, b.len() - 1);
        b.drain(..drop);
        if self.flip() { (b, a) } else { (a, b) }
    }
    pub fn axis(&mut self, rank: usize) -> isize {
        let a = self.dim(0, rank - 1) as isize;
        if self.flip() { a - rank as isize } else { a }
    }
}

// ---- the tests ------------------------------------------------------------------------------

/// Declares one `#[test]` per case function `$cases::$case(dev: Device)`, run on the GPU (it
/// prints "skipping" and passes without an adapter, naming itself `$prefix::$case`), and the test
/// `$cpu_check`, which runs every case with the CPU's f32 backend in the GPU's place, so the
/// harness and the cases run on machines without an adapter too.
#[allow(unused_macros)]
macro_rules! gpu_and_cpu_f32_tests {
    ($cases:ident, $prefix:literal, $(#[$doc:meta])* fn $cpu_check:ident; $($case:ident),* $(,)?) => {
        $(
            #[test]
            fn $case() {
                let Some(dev) = crate::common::gpu_or_skip(concat!($prefix, "::", stringify!($case)))
                else {
                    return;
                };
                $cases::$case(dev);
            }
        )*

        $(#[$doc])*
        #[test]
        fn $cpu_check() {
            $( $cases::$case(moegrad::Device::cpu()); )*
        }
    };
}
#[allow(unused_imports)]
pub(crate) use gpu_and_cpu_f32_tests;
