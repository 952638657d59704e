//! [`MatmulKernel::Tuned`]: the dense matmul's tile kernel chosen by timing the candidates on
//! this adapter, once per size class of product.
//!
//! `matmul`, `matmul_wide`, `matmul_wide4` and `matmul_subgroup` compute every element of a
//! product as the same chain of FMAs over k, so they give the same bits and differ only in
//! speed, and which is fastest depends on the GPU and its compiler: on the H200 the wide kernel
//! beat the plain one by 4–15% and the subgroup kernel ran at 0.56× the plain one
//! (docs/benchmarks.md); another vendor's compiler may rank them otherwise. So under `Tuned`,
//! the first product of a [`SizeClass`] (its dtypes and run-time checks, batch, m, n and k rounded up to powers of
//! two, which operand axes are contiguous, whether vec4 access is possible) runs every
//! candidate in turn on its own operands:
//!
//! 1. the device is drained, and each candidate runs once (compiling its pipeline);
//! 2. one run of the first candidate, timed, sets how many runs make a batch of about
//!    [`BATCH_TARGET`] (at most [`MAX_REPS`]);
//! 3. [`ROUNDS`] rounds time a batch of each candidate in turn, wall clock around a wait for the
//!    device; each candidate keeps its best time per run;
//! 4. [`fastest`] picks, preferring `Auto`'s kernel unless another is more than [`MARGIN`]
//!    faster (timing noise does not move the choice between equals).
//!
//! The choice is kept for the process; later products of the class run it with no timing.
//! Tuning waits for the device, once per class, usually in a model's first step; steady-state
//! steps have no host waits. A profile recording while a class is tuned counts the timing runs
//! among its matmul kernels. Only products `Auto` runs unsplit on the wide kernel are tuned
//! (at least `WIDE_MIN_GROUPS` tiles of 128×128): below that `Auto`'s split-k would change the
//! summation, and the choice would change bits.

use super::matmul_build::MatmulBuild;
use super::{GpuBackend, MatmulKernel, ShaderChecks};
use crate::Result;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a timed batch of one candidate aims to take, so that the wait's own latency (tens
/// of microseconds) is a small part of it.
pub(crate) const BATCH_TARGET: Duration = Duration::from_millis(2);

/// The most runs in one timed batch.
pub(crate) const MAX_REPS: usize = 16;

/// Timed rounds over the candidates; each keeps its best.
pub(crate) const ROUNDS: usize = 3;

/// How much faster than `Auto`'s kernel another must be to be chosen instead (a fraction).
pub(crate) const MARGIN: f64 = 0.03;

/// Products that share a tuned kernel: the build's dtypes, the run-time checks compiled in, the
/// batch and the three sizes rounded up to powers of two, the operands' contiguous axes, and
/// whether `matmul_wide4` may run them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct SizeClass {
    pub build: MatmulBuild,
    pub checks: ShaderChecks,
    pub batch: usize,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a_k_fast: bool,
    pub b_n_fast: bool,
    pub vec4: bool,
}

impl SizeClass {
    /// The class of a `[batch] m×k · k×n` product.
    pub(crate) fn of(
        (build, checks): (MatmulBuild, ShaderChecks),
        [batch, m, k, n]: [usize; 4],
        (a_k_fast, b_n_fast): (bool, bool),
        vec4: bool,
    ) -> SizeClass {
        let up = |v: usize| v.checked_next_power_of_two().unwrap_or(v);
        SizeClass {
            build,
            checks,
            batch: up(batch),
            m: up(m),
            n: up(n),
            k: up(k),
            a_k_fast,
            b_n_fast,
            vec4,
        }
    }
}

/// The tile kernels a product of `build` may be timed over, the wide one (`Auto`'s) first: the
/// plain one, `matmul_wide4` where its operands allow vec4 access (`vec4`), and the subgroup
/// kernel where the adapter has it; the last two have f32 builds only.
pub(crate) fn candidates(be: &GpuBackend, build: MatmulBuild, vec4: bool) -> Vec<MatmulKernel> {
    let mut candidates = vec![MatmulKernel::Wide, MatmulKernel::Plain];
    let f32_only = build == MatmulBuild::F32;
    if f32_only && vec4 {
        candidates.push(MatmulKernel::WideVec4);
    }
    if f32_only && be.subgroup_matmul_available() {
        candidates.push(MatmulKernel::Subgroup);
    }
    candidates
}

/// What tuning one size class measured and chose (`moegrad::gpu::matmul_tuning`).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct TunedMatmul {
    /// the product that was timed: `[batch, m, k, n]`; its class rounds each up to a power of two
    pub product: [usize; 4],
    /// the operands' dtypes: "f32", "f16", "f16·f32" (f16 rows, f32 weight) or "f16→f32"
    pub dtypes: &'static str,
    /// the run-time checks compiled into the kernels timed
    pub checks: ShaderChecks,
    /// the kernel chosen for the class
    pub kernel: MatmulKernel,
    /// each candidate's best time per run, in milliseconds (wall clock, including the launch)
    pub ms: Vec<(MatmulKernel, f64)>,
}

/// The tuned choices of one process, by size class.
#[derive(Default)]
pub(crate) struct MatmulTuning {
    chosen: Mutex<HashMap<SizeClass, TunedMatmul>>,
}

impl MatmulTuning {
    /// The kernel for `class`: the one chosen before, or, the first time, the fastest of
    /// `candidates` (`preferred`, `Auto`'s choice, among them) timed through `run`, which
    /// encodes one product with the kernel it is given.
    ///
    /// # Errors
    /// An error of `run` or of waiting for the device; nothing is kept then.
    pub(crate) fn kernel(
        &self,
        be: &GpuBackend,
        (class, product): (SizeClass, [usize; 4]),
        candidates: &[MatmulKernel],
        preferred: MatmulKernel,
        mut run: impl FnMut(MatmulKernel) -> Result<()>,
    ) -> Result<MatmulKernel> {
        // held while timing, so that two threads do not time the same class against each other
        let mut chosen = self.chosen.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(t) = chosen.get(&class) {
            return Ok(t.kernel);
        }
        let ms = time_candidates(be, candidates, &mut run)?;
        let kernel = fastest(&ms, preferred);
        chosen.insert(
            class,
            TunedMatmul {
                product,
                dtypes: class.build.name(),
                checks: class.checks,
                kernel,
                ms,
            },
        );
        Ok(kernel)
    }

    /// Every class tuned so far, smallest product first.
    pub(crate) fn records(&self) -> Vec<TunedMatmul> {
        let chosen = self.chosen.lock().unwrap_or_else(|e| e.into_inner());
        let mut all: Vec<TunedMatmul> = chosen.values().cloned().collect();
        all.sort_by_key(|t| (t.product.iter().product::<usize>(), t.product));
        all
    }
}

/// Each candidate's best milliseconds per run (steps 1–3 of the module docs).
fn time_candidates(
    be: &GpuBackend,
    candidates: &[MatmulKernel],
    run: &mut dyn FnMut(MatmulKernel) -> Result<()>,
) -> Result<Vec<(MatmulKernel, f64)>> {
    be.synchronize()?;
    for &c in candidates {
        run(c)?;
    }
    be.synchronize()?;
    let Some(&first) = candidates.first() else {
        return Ok(Vec::new());
    };
    let start = Instant::now();
    run(first)?;
    be.synchronize()?;
    let one = start.elapsed().as_secs_f64().max(1e-6);
    let reps = ((BATCH_TARGET.as_secs_f64() / one).ceil() as usize).clamp(1, MAX_REPS);
    let mut best = vec![f64::INFINITY; candidates.len()];
    for _ in 0..ROUNDS {
        for (i, &c) in candidates.iter().enumerate() {
            let start = Instant::now();
            for _ in 0..reps {
                run(c)?;
            }
            be.synchronize()?;
            let ms = start.elapsed().as_secs_f64() * 1e3 / reps as f64;
            best[i] = best[i].min(ms);
        }
    }
    Ok(candidates.iter().copied().zip(best).collect())
}

/// The fastest of `ms` (kernel, milliseconds per run), except that `preferred` is kept unless
/// the fastest beats it by more than [`MARGIN`]. A time that is not finite never wins; with
/// nothing timed, `preferred`.
pub(crate) fn fastest(ms: &[(MatmulKernel, f64)], preferred: MatmulKernel) -> MatmulKernel {
    let best = ms
        .iter()
        .filter(|(_, t)| t.is_finite())
        .min_by(|a, b| a.1.total_cmp(&b.1));
    let Some(&(best, best_ms)) = best else {
        return preferred;
    };
    match ms.iter().find(|(k, t)| *k == preferred && t.is_finite()) {
        Some(&(_, preferred_ms)) if best_ms * (1.0 + MARGIN) >= preferred_ms => preferred,
        _ => best,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use MatmulKernel::{Plain, Subgroup, Wide, WideVec4};

    #[test]
    fn fastest_keeps_the_preferred_kernel_unless_another_is_clearly_faster() {
        // a clear winner
        assert_eq!(
            fastest(&[(Wide, 10.0), (Plain, 12.0), (WideVec4, 6.0)], Wide),
            WideVec4
        );
        // within the margin: the preferred one stays
        assert_eq!(
            fastest(&[(Wide, 10.0), (Plain, 9.8), (WideVec4, 9.9)], Wide),
            Wide
        );
        // the preferred one is the fastest
        assert_eq!(
            fastest(&[(Plain, 12.0), (Wide, 10.0), (Subgroup, 20.0)], Wide),
            Wide
        );
        // just past the margin
        assert_eq!(fastest(&[(Wide, 10.0), (Plain, 9.5)], Wide), Plain);
        // nothing timed, or the preferred one not among them
        assert_eq!(fastest(&[], Wide), Wide);
        assert_eq!(fastest(&[(Plain, 3.0), (WideVec4, 2.0)], Wide), WideVec4);
        // a failed timing (infinite) never wins
        assert_eq!(fastest(&[(Wide, f64::INFINITY), (Plain, 5.0)], Wide), Plain);
    }

    #[test]
    fn size_classes_round_each_size_up_to_a_power_of_two() {
        let class = |p| {
            SizeClass::of(
                (MatmulBuild::F32, ShaderChecks::NoLoopCounter),
                p,
                (true, true),
                false,
            )
        };
        assert_eq!(class([1, 1000, 700, 1024]), class([1, 1024, 513, 900]));
        assert_ne!(class([1, 1024, 512, 1024]), class([1, 1024, 513, 1024]));
        assert_ne!(class([1, 1024, 512, 1024]), class([2, 1024, 512, 1024]));
        let c = class([3, 1000, 700, 1025]);
        assert_eq!((c.batch, c.m, c.k, c.n), (4, 1024, 1024, 2048));
    }
}
