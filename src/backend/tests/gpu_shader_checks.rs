//! The run-time checks compiled into the kernels (`ShaderChecks`): every choice gives the same
//! bits (the checks change what the driver's compiler may do, never a result of moegrad's
//! kernels), each choice compiles modules of its own (so switching takes effect), and a kernel
//! a user writes (`crate::wgsl`) is compiled with every check whatever the choice.

use super::folded_grids::poison_pool;
use super::gpu_primitives::gpu;
use crate::backend::gpu::{GpuBackend, MatmulKernel, ShaderChecks};
use crate::moe::{MoeConfig, MoeLayer};
use crate::nn::Parameters;
use crate::wgsl::WgslKernel;
use crate::{DType, Device, Tensor};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// `shape` of N(0, 1) values drawn with `seed`, on the GPU.
fn randn(shape: &[usize], seed: u64) -> Tensor {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    crate::nn::normal(shape, 1.0, &mut rng, Device::gpu().unwrap()).unwrap()
}

/// A top-2 MoE layer's forward and backward (routing, sorts, the dispatch plan, the grouped
/// products, the combine, the reductions), a product through the wide matmul kernel, and a
/// user's WGSL kernel: every value each gives, in order.
fn run_all(be: &GpuBackend) -> Vec<Vec<f32>> {
    let gpu = Device::gpu().unwrap();
    let mut out = Vec::new();

    let mut cfg = MoeConfig::new(24, 40, 6, 2);
    cfg.balance_loss = 0.01;
    cfg.z_loss = 0.001;
    cfg.seed = 5;
    let layer = MoeLayer::new(&cfg, gpu).unwrap();
    let x = randn(&[70, 24], 9).with_grad().unwrap();
    let moe = layer.forward(&x).unwrap();
    let loss = moe.y.mul(&moe.y).unwrap().sum_all().unwrap();
    let loss = loss.add(&moe.aux_loss).unwrap();
    loss.backward().unwrap();
    out.push(moe.y.to_vec_f32().unwrap());
    out.push(loss.to_vec_f32().unwrap());
    out.push(x.grad().unwrap().to_vec_f32().unwrap());
    layer.visit_params("", &mut |_, p| {
        out.push(
            p.grad()
                .map(|g| g.to_vec_f32().unwrap())
                .unwrap_or_default(),
        );
    });

    be.set_matmul_kernel(MatmulKernel::Wide).unwrap();
    let a = randn(&[300, 257], 1);
    let b = randn(&[257, 260], 2);
    poison_pool(be, 300 * 260);
    out.push(a.matmul(&b).unwrap().to_vec_f32().unwrap());
    be.set_matmul_kernel(MatmulKernel::Auto).unwrap();

    let triple = WgslKernel::new(
        "triple_for_shader_checks",
        "@group(0) @binding(1) var<storage, read> x: array<f32>;
         @group(0) @binding(2) var<storage, read_write> y: array<f32>;
         @compute @workgroup_size(64)
         fn main(@builtin(global_invocation_id) id: vec3<u32>) {
             for (var i = id.x; i < arrayLength(&x); i += 64u) { y[i] = 3.0 * x[i]; }
         }",
        "main",
    )
    .unwrap();
    let y = triple
        .run(&[&b], &[257, 260], DType::F32, &[], [1, 1, 1])
        .unwrap();
    out.push(y.to_vec_f32().unwrap());
    out
}

#[test]
fn every_choice_of_checks_gives_the_same_bits() {
    let Some((be, _lock)) = gpu("every_choice_of_checks_gives_the_same_bits") else {
        return;
    };
    let before = be.shader_checks();
    let mut results = Vec::new();
    for checks in ShaderChecks::ALL {
        be.set_shader_checks(checks);
        results.push((checks, run_all(&be)));
    }
    be.set_shader_checks(before);
    let (first, want) = &results[0];
    for (checks, got) in &results[1..] {
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert_eq!(g.len(), w.len(), "value set {i}");
            for (j, (a, b)) in g.iter().zip(w).enumerate() {
                assert!(
                    a.to_bits() == b.to_bits(),
                    "value set {i}, element {j}: {a} with {checks:?}, {b} with {first:?}"
                );
            }
        }
    }

    // each choice compiled its own modules; a user's kernel only ever with every check
    let modules = be.compiled_modules();
    for checks in ShaderChecks::ALL {
        for name in ["matmul", "matmul_wide", "routing", "layout", "reduce"] {
            assert!(
                modules.contains(&(name, checks)),
                "{name} was not compiled with {checks:?}: {modules:?}"
            );
        }
    }
    let user: Vec<_> = modules
        .iter()
        .filter(|(name, _)| name.ends_with("triple_for_shader_checks"))
        .collect();
    assert!(
        !user.is_empty(),
        "the user kernel was not compiled: {modules:?}"
    );
    assert!(
        user.iter().all(|(_, c)| *c == ShaderChecks::Full),
        "a user kernel compiled without every check: {user:?}"
    );
}

#[test]
fn the_default_drops_only_the_loop_counter() {
    let full = ShaderChecks::Full.runtime_checks();
    assert!(full.bounds_checks && full.force_loop_bounding && full.int_div_checks);
    let default = ShaderChecks::NoLoopCounter.runtime_checks();
    assert!(default.bounds_checks && default.int_div_checks && !default.force_loop_bounding);
    let none = ShaderChecks::Unchecked.runtime_checks();
    assert!(!none.bounds_checks && !none.force_loop_bounding && !none.int_div_checks);
    for c in ShaderChecks::ALL {
        assert_eq!(ShaderChecks::from_name(c.name()).unwrap(), c);
    }
    let err = ShaderChecks::from_name("fast").unwrap_err().to_string();
    assert!(err.contains("MOEGRAD_SHADER_CHECKS=\"fast\""), "{err}");
    if std::env::var_os("MOEGRAD_SHADER_CHECKS").is_none() {
        assert_eq!(
            ShaderChecks::from_env().unwrap(),
            ShaderChecks::NoLoopCounter
        );
    }
}
