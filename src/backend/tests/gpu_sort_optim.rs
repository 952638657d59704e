//! GPU primitives against the CPU backend, continued (`gpu_primitives.rs` has the buffers,
//! elementwise ops, reductions and layout, and the helpers used here): the stable argsort,
//! random numbers bit for bit, a one-dimensional launch past 65,535 workgroups, the fused Adam
//! and SGD steps (and that they update in place unless the buffer is shared), and the command
//! batching and buffer pool over long chains and steady training steps.
//!
//! Without a GPU adapter each test prints "skipping ..." and passes; with `MOEGRAD_REQUIRE_GPU=1`
//! a missing adapter fails.

use super::gpu_primitives::*;
use crate::backend::gpu::GpuBuffer;
use crate::backend::{
    AdamHyper, BinaryOp, ElementwiseOps, HostData, OptimOps, ReduceOps, SgdHyper, UnaryOp,
};
use crate::{DType, Error};
use rand::RngExt;

// ---- sorting ----------------------------------------------------------------------------------

#[test]
fn argsort_is_stable_and_matches_cpu() {
    let Some((g, _l)) = gpu("argsort_is_stable_and_matches_cpu") else {
        return;
    };
    let mut r = rng(10);
    for (rows, len) in [
        (1usize, 1usize),
        (3, 5),
        (2, 0),
        (0, 4),
        (7, 64),
        (300, 6),
        (5, 1000),
        (2, 1024),
        (3, 1500),
        (1, 2048),
        (2, 2049),
        (1, 5000),
    ] {
        // few distinct values: many ties, which must keep index order
        let mut x: Vec<f32> = (0..rows * len)
            .map(|_| r.random_range(0..8) as f32 * 0.5 - 2.0)
            .collect();
        for (k, v) in x.iter_mut().enumerate() {
            match k % 97 {
                3 => *v = f32::NAN,
                5 => *v = -0.0,
                6 => *v = f32::NEG_INFINITY,
                7 => *v = f32::INFINITY,
                _ => {}
            }
        }
        for descending in [false, true] {
            let got = g.argsort(&up(&g, &x), rows, len, descending).unwrap();
            let want = CPU.argsort(&cpu(&x), rows, len, descending).unwrap();
            assert_eq!(
                g_down(&g, &got),
                c_down(&want),
                "argsort [{rows}, {len}] descending {descending}"
            );
        }
    }
    assert!(matches!(
        g.argsort(&up_i(&g, &[3, 1]), 1, 2, false),
        Err(Error::DType(_))
    ));
    assert!(matches!(
        g.argsort(&up(&g, &[3.0, 1.0]), 2, 2, false),
        Err(Error::Shape(_))
    ));
}

/// `sort_key_words` (the dispatch plan's one-pass sort) against a sort of the tuples (words as
/// unsigned, then index) on the host: few distinct words, so every word and the index decide
/// somewhere; words with the sign bit set (unsigned, not signed, order) and keys of all ones
/// (the padding's words: the index still puts them before the padding); one block, a row past
/// 1024 (the global steps) and several rows.
#[test]
fn sorting_by_key_words_is_lexicographic_and_stable() {
    use crate::backend::gpu::{KEY_WORDS, sort_key_words};
    let Some((g, _l)) = gpu("sorting_by_key_words_is_lexicographic_and_stable") else {
        return;
    };
    let mut r = rng(11);
    let pick = [0u32, 1, 2, 0x8000_0000, u32::MAX];
    for (rows, len) in [
        (1usize, 1usize),
        (1, 7),
        (3, 300),
        (1, 1024),
        (2, 1500),
        (1, 5000),
    ] {
        let words: Vec<u32> = (0..rows * len * KEY_WORDS)
            .map(|_| pick[r.random_range(0..pick.len())])
            .collect();
        let bits: Vec<i32> = words.iter().map(|&w| w as i32).collect();
        let got = sort_key_words(&g, &up_i(&g, &bits), rows, len).unwrap();
        let mut want = Vec::with_capacity(rows * len);
        for row in 0..rows {
            let key = |q: usize| &words[(row * len + q) * KEY_WORDS..][..KEY_WORDS];
            let mut order: Vec<usize> = (0..len).collect();
            order.sort_by(|&a, &b| key(a).cmp(key(b)).then(a.cmp(&b)));
            want.extend(order.into_iter().map(|q| q as i32));
        }
        assert_eq!(
            g_down(&g, &got),
            HostData::I32(want),
            "sort by key words [{rows}, {len}]"
        );
    }
    assert!(matches!(
        sort_key_words(&g, &up(&g, &[1.0; 6]), 1, 2),
        Err(Error::DType(_))
    ));
    assert!(matches!(
        sort_key_words(&g, &up_i(&g, &[1; 6]), 1, 3),
        Err(Error::Shape(_))
    ));
}

// ---- random -----------------------------------------------------------------------------------

#[test]
fn random_uniform_is_bit_identical_to_cpu() {
    let Some((g, _l)) = gpu("random_uniform_is_bit_identical_to_cpu") else {
        return;
    };
    for (len, seed) in [(0usize, 1u64), (1, 0), (1000, 42), (4099, u64::MAX - 5)] {
        let got = f32s(g_down(
            &g,
            &g.random_uniform(len, seed, DType::F32).unwrap(),
        ));
        let want = f32s(c_down(&CPU.random_uniform(len, seed, DType::F32).unwrap()));
        assert_bits(&format!("random_uniform {len} {seed}"), &got, &want);
        assert!(got.iter().all(|&u| (0.0..1.0).contains(&u)));
    }
    let got = g_down(&g, &g.random_uniform(10, 3, DType::I32).unwrap());
    assert_eq!(got, c_down(&CPU.random_uniform(10, 3, DType::I32).unwrap()));
}

/// More than 65535 workgroups of 256: the grid folds into x and y.
#[test]
fn one_dimensional_launch_beyond_65535_workgroups() {
    let Some((g, _l)) = gpu("one_dimensional_launch_beyond_65535_workgroups") else {
        return;
    };
    let len = 65_535 * 256 + 1_001;
    let seed = 0x1234_5678_9abc_def0;
    let got = f32s(g_down(
        &g,
        &g.random_uniform(len, seed, DType::F32).unwrap(),
    ));
    let want = f32s(c_down(&CPU.random_uniform(len, seed, DType::F32).unwrap()));
    assert_bits("random_uniform beyond 65535 workgroups", &got, &want);
    drop((got, want));
    let x = g.full(len, 1.5, DType::F32).unwrap();
    let y = f32s(g_down(&g, &g.unary(UnaryOp::MulScalar(2.0), &x).unwrap()));
    assert_eq!(y.len(), len);
    assert!(y.iter().all(|&v| v == 3.0), "every folded workgroup ran");
    drop(y);
    // the newest op of the table (softsign) on the folded grid, against the CPU, over values of
    // both signs
    let gx = g
        .unary(
            UnaryOp::AddScalar(-0.5),
            &g.random_uniform(len, seed, DType::F32).unwrap(),
        )
        .unwrap();
    let cx = CPU
        .unary(
            UnaryOp::AddScalar(-0.5),
            &CPU.random_uniform(len, seed, DType::F32).unwrap(),
        )
        .unwrap();
    let got = f32s(g_down(&g, &g.unary(UnaryOp::Softsign, &gx).unwrap()));
    let want = f32s(c_down(&CPU.unary(UnaryOp::Softsign, &cx).unwrap()));
    assert_eq!(got.len(), len);
    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
        assert!(
            (a - b).abs() <= 1e-6,
            "softsign beyond 65535 workgroups: element {i}: got {a}, expected {b}"
        );
    }
}

// ---- optimizers -------------------------------------------------------------------------------

#[test]
fn adam_and_sgd_steps_match_cpu() {
    let Some((g, _l)) = gpu("adam_and_sgd_steps_match_cpu") else {
        return;
    };
    let mut r = rng(11);
    for n in [0usize, 1, 1000] {
        let p = rand_vec(&mut r, n, -1.0, 1.0);
        let grad = rand_vec(&mut r, n, -1.0, 1.0);
        let m = rand_vec(&mut r, n, -0.1, 0.1);
        let v = rand_vec(&mut r, n, 0.0, 0.01);
        // a factor; a factor and no skipped step; a factor after two skipped steps (a loss
        // scale's: the bias corrections are then for step 3 − 2 = 1)
        let scales: [&[f32]; 3] = [&[0.37], &[0.37, 0.0], &[0.37, 2.0]];
        for (decoupled, scale) in [
            (false, None),
            (true, Some(scales[0])),
            (false, Some(scales[0])),
            (true, Some(scales[1])),
            (false, Some(scales[2])),
            (true, Some(scales[2])),
        ] {
            let h = AdamHyper {
                lr: 1e-3,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.01,
                decoupled,
                step: 3,
                bias_correction1: 1.0 - 0.9f64.powi(3),
                bias_correction2: 1.0 - 0.999f64.powi(3),
            };
            let gs = scale.map(|s| up(&g, s));
            let cs = scale.map(cpu);
            let (gp, gm, gv) = g
                .adam_step(
                    &up(&g, &p),
                    &up(&g, &grad),
                    gs.as_ref(),
                    &up(&g, &m),
                    &up(&g, &v),
                    h,
                )
                .unwrap();
            let (cp, cm, cv) = CPU
                .adam_step(&cpu(&p), &cpu(&grad), cs.as_ref(), &cpu(&m), &cpu(&v), h)
                .unwrap();
            let what = format!("adam n={n} decoupled={decoupled} scale={scale:?}");
            assert_close(&what, &f32s(g_down(&g, &gp)), &f32s(c_down(&cp)), 1e-6, 0.0);
            assert_close(&what, &f32s(g_down(&g, &gm)), &f32s(c_down(&cm)), 1e-6, 0.0);
            assert_close(&what, &f32s(g_down(&g, &gv)), &f32s(c_down(&cv)), 1e-6, 0.0);
            if scale == Some(scales[2]) {
                // the CPU's reference: Adam's first step under the factor alone
                let first = AdamHyper {
                    step: 1,
                    bias_correction1: 1.0 - 0.9,
                    bias_correction2: 1.0 - 0.999,
                    ..h
                };
                let (fp, _, _) = CPU
                    .adam_step(
                        &cpu(&p),
                        &cpu(&grad),
                        Some(&cpu(scales[0])),
                        &cpu(&m),
                        &cpu(&v),
                        first,
                    )
                    .unwrap();
                assert_eq!(
                    f32s(c_down(&cp)),
                    f32s(c_down(&fp)),
                    "{what}: not step 1's update"
                );
                // and the in-place kernel, which the optimizer runs
                let (mut ip, mut im, mut iv) = (up(&g, &p), up(&g, &m), up(&g, &v));
                g.adam_step_mut(&mut ip, &up(&g, &grad), gs.as_ref(), &mut im, &mut iv, h)
                    .unwrap();
                assert_close(&what, &f32s(g_down(&g, &ip)), &f32s(c_down(&fp)), 1e-6, 0.0);
            }
        }
        for (momentum, nesterov, with_scale) in
            [(0.0, false, false), (0.9, false, true), (0.9, true, false)]
        {
            let h = SgdHyper {
                lr: 0.05,
                momentum,
                weight_decay: 1e-3,
                nesterov,
            };
            // SGD takes a loss scale's two values too, and has no step count to correct
            let scale: &[f32] = if momentum > 0.0 {
                &[0.37, 2.0]
            } else {
                &[0.37]
            };
            let gs = with_scale.then(|| up(&g, scale));
            let cs = with_scale.then(|| cpu(scale));
            let (gp, gb) = g
                .sgd_step(&up(&g, &p), &up(&g, &grad), gs.as_ref(), &up(&g, &m), h)
                .unwrap();
            let (cp, cb) = CPU
                .sgd_step(&cpu(&p), &cpu(&grad), cs.as_ref(), &cpu(&m), h)
                .unwrap();
            let what = format!("sgd n={n} momentum={momentum} nesterov={nesterov}");
            assert_close(&what, &f32s(g_down(&g, &gp)), &f32s(c_down(&cp)), 1e-6, 0.0);
            assert_close(&what, &f32s(g_down(&g, &gb)), &f32s(c_down(&cb)), 1e-6, 0.0);
        }
    }
    let (a, b) = (up(&g, &[1.0, 2.0]), up(&g, &[1.0]));
    let h = SgdHyper {
        lr: 0.1,
        momentum: 0.0,
        weight_decay: 0.0,
        nesterov: false,
    };
    assert!(matches!(
        g.sgd_step(&a, &b, None, &a, h),
        Err(Error::Shape(_))
    ));
    // a gradient scale holds one value or two (a loss scale's factor and skipped steps)
    let c = up(&g, &[1.0, 2.0, 3.0]);
    assert!(matches!(
        g.sgd_step(&c, &c, Some(&c), &c, h),
        Err(Error::Shape(_))
    ));
}

/// The optimizers' `_mut` updates write the parameter and its state where they are when nothing
/// else shares them: the values match the CPU, a kernel queued earlier that reads the parameter
/// still sees the old values, no buffer is taken from the pool, and a tensor kept from before
/// the step (sharing the buffer) keeps its old values while the parameter moves on.
#[test]
fn optimizer_steps_update_in_place_unless_shared() {
    let Some((g, _l)) = gpu("optimizer_steps_update_in_place_unless_shared") else {
        return;
    };
    let mut r = rng(12);
    let n = 1 << 16;
    let (p, grad) = (
        rand_vec(&mut r, n, -1.0, 1.0),
        rand_vec(&mut r, n, -1.0, 1.0),
    );
    let (m, v) = (
        rand_vec(&mut r, n, -0.1, 0.1),
        rand_vec(&mut r, n, 0.0, 0.01),
    );
    let h = AdamHyper {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
        decoupled: true,
        step: 2,
        bias_correction1: 1.0 - 0.9f64.powi(2),
        bias_correction2: 1.0 - 0.999f64.powi(2),
    };
    let (cp, cm, cv) = CPU
        .adam_step(&cpu(&p), &cpu(&grad), None, &cpu(&m), &cpu(&v), h)
        .unwrap();
    let (cp, cm, cv) = (f32s(c_down(&cp)), f32s(c_down(&cm)), f32s(c_down(&cv)));
    let tanh_p: Vec<f32> = p.iter().map(|x| x.tanh()).collect();
    for shared in [false, true] {
        let (mut gp, gg, mut gm, mut gv) = (up(&g, &p), up(&g, &grad), up(&g, &m), up(&g, &v));
        let kept = shared.then(|| gp.clone());
        // queued before the update and not yet submitted: must read the old parameter
        let read_before = g.unary(UnaryOp::Tanh, &gp).unwrap();
        let before = g.pool_stats().in_use_bytes;
        g.reset_peak();
        g.adam_step_mut(&mut gp, &gg, None, &mut gm, &mut gv, h)
            .unwrap();
        g.synchronize().unwrap();
        let grew = g.pool_stats().peak_bytes - before;
        let what = format!("adam_step_mut shared={shared}");
        assert_close(&what, &f32s(g_down(&g, &gp)), &cp, 1e-6, 0.0);
        assert_close(&what, &f32s(g_down(&g, &gm)), &cm, 1e-6, 0.0);
        assert_close(&what, &f32s(g_down(&g, &gv)), &cv, 1e-6, 0.0);
        assert_close(&what, &f32s(g_down(&g, &read_before)), &tanh_p, 1e-6, 1e-6);
        let bytes = (n * 4) as u64;
        if let Some(kept) = kept {
            assert_eq!(
                f32s(g_down(&g, &kept)),
                p,
                "{what}: the kept tensor changed"
            );
            assert!(
                grew >= 3 * bytes,
                "{what}: fresh buffers expected, grew {grew}"
            );
        } else {
            assert!(
                grew < bytes,
                "{what}: updated in place, yet {grew} more bytes in use"
            );
        }
    }
    for (momentum, nesterov) in [(0.0, false), (0.9, true)] {
        let h = SgdHyper {
            lr: 0.05,
            momentum,
            weight_decay: 1e-3,
            nesterov,
        };
        let (cp, cb) = CPU
            .sgd_step(&cpu(&p), &cpu(&grad), None, &cpu(&m), h)
            .unwrap();
        for shared in [false, true] {
            let (mut gp, gg, mut gb) = (up(&g, &p), up(&g, &grad), up(&g, &m));
            let kept = shared.then(|| (gp.clone(), gb.clone()));
            g.synchronize().unwrap();
            let before = g.pool_stats().in_use_bytes;
            g.reset_peak();
            g.sgd_step_mut(&mut gp, &gg, None, &mut gb, h).unwrap();
            g.synchronize().unwrap();
            let grew = g.pool_stats().peak_bytes - before;
            let what = format!("sgd_step_mut momentum={momentum} shared={shared}");
            assert_close(&what, &f32s(g_down(&g, &gp)), &f32s(c_down(&cp)), 1e-6, 0.0);
            assert_close(&what, &f32s(g_down(&g, &gb)), &f32s(c_down(&cb)), 1e-6, 0.0);
            if let Some((kp, kb)) = kept {
                assert_eq!(
                    f32s(g_down(&g, &kp)),
                    p,
                    "{what}: the kept parameter changed"
                );
                assert_eq!(f32s(g_down(&g, &kb)), m, "{what}: the kept buffer changed");
            } else {
                assert!(grew < (n * 4) as u64, "{what}: {grew} more bytes in use");
            }
        }
    }
}

// ---- batching, ordering and the pool ----------------------------------------------------------

/// A long dependent chain (many batches of 64 dispatches) with uploads, downloads and dropped
/// buffers interleaved: every value must come out as if each op ran at once.
#[test]
fn long_chains_with_interleaved_uploads_keep_order() {
    let Some((g, _l)) = gpu("long_chains_with_interleaved_uploads_keep_order") else {
        return;
    };
    let n = 1000;
    let mut x = g.full(n, 0.0, DType::F32).unwrap();
    let mut expect = 0.0f32;
    for step in 0..300 {
        // a fresh upload each step, added in, then dropped: its pooled buffer is reused at once
        let inc = up(&g, &vec![step as f32; n]);
        x = g.binary(BinaryOp::Add, &x, &[1], &inc, &[1], &[n]).unwrap();
        expect += step as f32;
        drop(inc);
        if step % 97 == 0 {
            let seen = f32s(g_down(&g, &x));
            assert!(seen.iter().all(|&v| v == expect), "step {step}");
        }
    }
    let seen = f32s(g_down(&g, &x));
    assert!(seen.iter().all(|&v| v == expect));
    g.synchronize().unwrap();
}

/// After a warm-up, repeating the same step takes every buffer from the pool: the bytes in use
/// return to where they were and no buffer is created. (Buffers the user drops stay held by the
/// pending batch until it is submitted, so the warm-up must span a few batches of 64 dispatches.)
#[test]
fn steady_state_steps_reuse_pooled_buffers() {
    let Some((g, _l)) = gpu("steady_state_steps_reuse_pooled_buffers") else {
        return;
    };
    let n = 4096;
    let p0 = up(&g, &vec![0.5; n]);
    let step = |p: &GpuBuffer| -> GpuBuffer {
        let y = g.unary(UnaryOp::Tanh, p).unwrap();
        let grad = g.binary(BinaryOp::Mul, &y, &[1], p, &[1], &[n]).unwrap();
        let h = SgdHyper {
            lr: 0.01,
            momentum: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        };
        g.sgd_step(p, &grad, None, &grad, h).unwrap().0
    };
    let mut p = step(&p0);
    for _ in 0..70 {
        p = step(&p);
    }
    g.synchronize().unwrap();
    let before = g.pool_stats().in_use_bytes;
    g.reset_peak();
    let free_before = g.pool_free_bytes();
    for _ in 0..70 {
        p = step(&p);
    }
    g.synchronize().unwrap();
    let after = g.pool_stats();
    assert_eq!(
        after.in_use_bytes, before,
        "bytes in use return to the baseline"
    );
    assert!(
        g.pool_free_bytes() <= free_before,
        "no new buffers were created in the steady state"
    );
    assert!(after.peak_bytes >= before, "peak {after:?}");
    drop(p);
}
