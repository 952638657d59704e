//! `moegrad bench moe`: one MoE layer's training step (routing, dispatch, the expert bank,
//! combine, MSE, backward, Adam) timed for the top-k router over several numbers of experts and
//! for the dense softmax router both through the dispatch plan and on the all-experts path, on
//! each device, with its peak memory and (on the GPU) dispatches per step. A cell whose largest
//! tensor cannot be bound on the GPU is reported as skipped, with the reason, rather than ending
//! the benchmark.

use super::random_f32;
use moegrad::nn::Parameters;
use moegrad::{Device, Result};
use serde::Serialize;
use std::time::Instant;

/// One MoE training-step measurement.
#[derive(Clone, Debug, Serialize)]
pub struct MoeRecord {
    /// "cpu" or "gpu"
    pub device: String,
    /// "topk" or "softmax"
    pub router: String,
    /// experts
    pub n: usize,
    /// experts per token (n for the dense router)
    pub k: usize,
    /// how the layer ran the experts: "plan" (the dispatch plan and grouped products) or
    /// "all-experts" (the dense router's two wide products, `MoeLayer::set_all_experts_path`);
    /// the dense router is measured both ways
    pub path: String,
    /// median milliseconds per step (forward, backward, Adam)
    pub step_ms: f64,
    /// median milliseconds of the forward pass (routing, dispatch, experts, combine, MSE),
    /// timed in separate steps with the device synchronised after each phase
    pub forward_ms: f64,
    /// median milliseconds of `backward()`, timed like `forward_ms`
    pub backward_ms: f64,
    /// median milliseconds of the Adam step over every parameter, timed like `forward_ms`: the
    /// one phase whose work grows with n whatever the routing, since every expert that received
    /// a token has parameters to update
    pub optimizer_ms: f64,
    /// tokens per second
    pub tokens_per_s: f64,
    /// peak bytes during the step above the bytes held before it (CPU heap; GPU pool)
    pub peak_bytes: usize,
    /// the gradients the step stored: parameter-sized, except that an expert bank whose
    /// gradient is deferred (computed inside Adam, see `autograd/deferred.rs`) stores none
    pub gradient_bytes: usize,
    /// `peak_bytes` minus `gradient_bytes` (Adam updates the parameters and its moments in
    /// place): the activation memory and temporaries, including the rows a deferred gradient
    /// keeps until the optimizer step
    pub activation_bytes: usize,
    /// GPU: kernel dispatches per whole step (forward, backward, Adam); None on the CPU
    pub dispatches: Option<u64>,
    /// GPU: bind groups created over the timed steps (0 once the warm-up has settled the buffer
    /// pool: every dispatch reuses one, see docs/gpu.md); None on the CPU
    pub bind_groups_created: Option<u64>,
}

/// The result of `moegrad bench moe`.
#[derive(Clone, Debug, Serialize)]
pub struct MoeBench {
    /// workload: tokens, width, expert hidden width
    pub workload: String,
    /// one record per device, router and n
    pub moe: Vec<MoeRecord>,
    /// the cells not run on a device, with the reason (a tensor larger than the GPU can bind)
    pub skipped: Vec<MoeSkipped>,
}

/// A cell of `bench moe` that was not run.
#[derive(Clone, Debug, Serialize)]
pub struct MoeSkipped {
    /// "cpu" or "gpu"
    pub device: String,
    /// "topk" or "softmax"
    pub router: String,
    /// experts
    pub n: usize,
    /// experts per token
    pub k: usize,
    /// "plan" or "all-experts"
    pub path: String,
    /// why, with the sizes at fault
    pub reason: String,
}

/// Heap bytes held now (CPU) or bytes checked out of the GPU pool.
fn bytes_in_use(device: Device) -> usize {
    match device {
        Device::Cpu => moegrad::memory::live_bytes(),
        Device::Gpu => moegrad::gpu::memory()
            .map(|m| m.in_use_bytes as usize)
            .unwrap_or(0),
    }
}

fn peak_in_use(device: Device) -> usize {
    match device {
        Device::Cpu => moegrad::memory::peak_bytes(),
        Device::Gpu => moegrad::gpu::memory()
            .map(|m| m.peak_bytes as usize)
            .unwrap_or(0),
    }
}

fn reset_peak(device: Device) {
    match device {
        Device::Cpu => moegrad::memory::reset_peak(),
        Device::Gpu => {
            // without an adapter there is no GPU peak to reset
            let _ = moegrad::gpu::reset_peak_memory();
        }
    }
}

/// The MoE workload: `tokens` tokens of width `d`, bias-free experts `d → hidden → d`
/// (`x → relu(x·W1)·W2`, as in the PyTorch peer), top-`k`.
#[derive(Clone, Copy, Debug)]
pub struct MoeWorkload {
    /// tokens per step (T)
    pub tokens: usize,
    /// model width (d)
    pub d: usize,
    /// expert hidden width
    pub hidden: usize,
    /// experts per token for the sparse router
    pub k: usize,
}

impl MoeWorkload {
    /// About the bytes one training step with `n` experts, `k` per token, holds: the bank's
    /// weights with their gradients and two Adam moments (`16·n·2·d·hidden`), the input and
    /// target (`2·T·d` floats), and per routed token its dispatched row, hidden activation and
    /// output with their gradients (`2·T·k·(2d + 2·hidden)` floats). `None` past 64 bits.
    pub fn step_bytes(&self, n: usize, k: usize) -> Option<u64> {
        let (t, d, h) = (self.tokens as u64, self.d as u64, self.hidden as u64);
        let bank = (n as u64).checked_mul(2)?.checked_mul(d)?.checked_mul(h)?;
        let io = t.checked_mul(2)?.checked_mul(d)?;
        let rows = t.checked_mul(k as u64)?;
        let per_row = d.checked_add(h)?.checked_mul(4)?;
        let acts = rows.checked_mul(per_row)?;
        bank.checked_mul(4)?
            .checked_add(io)?
            .checked_add(acts)?
            .checked_mul(4)
    }
}

impl MoeWorkload {
    /// The bytes of the step's largest tensor with `k` experts per token: the `[T·k, hidden]`
    /// hidden activations (or `[T·k, d]` rows where `d` is wider), f32, and their gradients
    /// (on the all-experts path, the `[T, n·hidden]` product: the same size). `None` past 64
    /// bits.
    pub fn largest_tensor_bytes(&self, k: usize) -> Option<u64> {
        (self.tokens as u64)
            .checked_mul(k as u64)?
            .checked_mul(self.d.max(self.hidden) as u64)?
            .checked_mul(4)
    }

    /// Why a step with `k` experts per token cannot run on a GPU that binds at most `limit`
    /// bytes in one storage buffer (`max_storage_buffer_binding_size`), or `None` when it can.
    pub fn exceeds_binding(&self, k: usize, limit: u64) -> Option<String> {
        match self.largest_tensor_bytes(k) {
            Some(bytes) if bytes <= limit => None,
            bytes => Some(format!(
                "its [{} tokens × {k} experts, {}] f32 activations take {} bytes, more than this \
                 GPU binds in one buffer (max_storage_buffer_binding_size, {limit} bytes); \
                 fewer --tokens run it",
                self.tokens,
                self.d.max(self.hidden),
                bytes.map_or("over 2^64".into(), |b| b.to_string())
            )),
        }
    }
}

/// The GPU's `max_storage_buffer_binding_size`, as moegrad opened the device (`None` when the
/// limit is not reported).
fn gpu_binding_limit() -> Result<Option<u64>> {
    Ok(moegrad::gpu::info()?
        .limits
        .iter()
        .find(|(name, _)| name == "max_storage_buffer_binding_size")
        .map(|&(_, v)| v))
}

/// What [`moe_step`] measured.
#[derive(Clone, Copy, Debug)]
pub struct MoeStepTimes {
    /// median ms per whole step
    pub step_ms: f64,
    /// median ms of the forward pass, backward pass and optimizer step, each timed with the
    /// device synchronised around it (so on a GPU their sum can exceed `step_ms`)
    pub phases_ms: [f64; 3],
    /// peak bytes above those held before a step
    pub peak_bytes: usize,
    /// bytes of the gradients stored by backward (deferred ones store none)
    pub gradient_bytes: usize,
    /// `peak_bytes` less `gradient_bytes`
    pub activation_bytes: usize,
    /// GPU kernel dispatches per whole step (None on the CPU)
    pub dispatches: Option<u64>,
    /// GPU bind groups created over the timed steps (None on the CPU)
    pub bind_groups_created: Option<u64>,
}

/// Warm-up steps of [`moe_step`] on the GPU: the first compiles pipelines, fills the buffer
/// pool and creates the optimizer's state; the next settle which pooled buffer each tensor
/// gets, so that the timed steps reuse their bind groups (measured on lavapipe: none created
/// over the timed steps of any router or n after 8; the CPU takes 2).
pub const GPU_WARMUP_STEPS: usize = 8;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Times one MoE layer's training step (MSE against a fixed target, backward, Adam) with
/// `router` over `n` experts, `k` per token (`all_experts`: the layer's
/// `set_all_experts_path`): `reps` whole steps, then `reps` steps timed phase by phase.
pub fn moe_step(
    device: Device,
    (router, n, k): (&str, usize, usize),
    all_experts: Option<bool>,
    w: MoeWorkload,
    reps: usize,
) -> Result<MoeStepTimes> {
    let (tokens, d, hidden) = (w.tokens, w.d, w.hidden);
    use moegrad::moe::{MoeConfig, MoeLayer};
    use moegrad::optim::{Adam, Optimizer};
    let mut cfg = MoeConfig::new(d, hidden, n, k);
    cfg.router = router.into();
    // bias-free experts, like the PyTorch peer's
    cfg.expert_bias = false;
    let mut layer = MoeLayer::new(&cfg, device)?;
    layer.set_all_experts_path(all_experts);
    let mut params = Vec::new();
    layer.visit_params("", &mut |name, p| params.push((name, p.clone())));
    // bytes of the gradients backward stored in the last step (a deferred one stores none)
    let mut gradient_bytes = 0;
    let mut opt = Adam::new(1e-3)?;
    let x = random_f32(&[tokens, d], 7, device)?;
    let target = random_f32(&[tokens, d], 8, device)?;
    // one step, with the clock read (after a device sync) between its phases when `clock`
    let mut step = |clock: Option<&mut Vec<[f64; 3]>>| -> Result<()> {
        let sync_now = |on: bool| -> Result<Instant> {
            if on {
                device.synchronize()?;
            }
            Ok(Instant::now())
        };
        let timed = clock.is_some();
        let t0 = sync_now(timed)?;
        let out = layer.forward(&x)?;
        let loss = out.y.mse(&target)?;
        let t1 = sync_now(timed)?;
        loss.backward()?;
        let t2 = sync_now(timed)?;
        gradient_bytes = params
            .iter()
            .map(|(_, p)| p.get())
            .filter(|p| !p.grad_is_deferred())
            .map(|p| p.numel() * 4)
            .sum();
        opt.step(&params, None)?;
        let t3 = sync_now(timed)?;
        if let Some(clock) = clock {
            let ms = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e3;
            clock.push([ms(t0, t1), ms(t1, t2), ms(t2, t3)]);
        }
        Ok(())
    };
    // warm-up: pipelines, pool, optimizer state, and on the GPU the steps that settle which
    // pooled buffer each tensor gets, so the timed steps reuse their bind groups
    let warmups = if device.is_gpu() { GPU_WARMUP_STEPS } else { 2 };
    for _ in 0..warmups {
        step(None)?;
        device.synchronize()?;
    }
    let mut times = Vec::new();
    let mut peak = 0;
    device.reset_gpu_stats();
    for _ in 0..reps.max(1) {
        let before = bytes_in_use(device);
        reset_peak(device);
        let t = Instant::now();
        step(None)?;
        device.synchronize()?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
        peak = peak.max(peak_in_use(device).saturating_sub(before));
    }
    let counts = device.gpu_stats();
    let dispatches = counts.map(|s| s.dispatches / reps.max(1) as u64);
    let bind_groups_created = counts.map(|s| s.bind_groups_created);
    let mut phases = Vec::new();
    for _ in 0..reps.max(1) {
        step(Some(&mut phases))?;
    }
    let phase = |i: usize| median(phases.iter().map(|p| p[i]).collect());
    // The step's parameter-sized allocations are the stored gradients: Adam updates the
    // parameters and its moments in place. The rest of the peak is activations and temporaries.
    Ok(MoeStepTimes {
        step_ms: median(times),
        phases_ms: [phase(0), phase(1), phase(2)],
        peak_bytes: peak,
        gradient_bytes,
        activation_bytes: peak.saturating_sub(gradient_bytes),
        dispatches,
        bind_groups_created,
    })
}

/// `moegrad bench moe` on every device: top-k over `ns` and the dense softmax router over `dense_ns`.
pub fn bench_moe(
    devices: &[Device],
    ns: &[usize],
    dense_ns: &[usize],
    w: MoeWorkload,
) -> Result<MoeBench> {
    let mut out = MoeBench {
        workload: format!(
            "T = {}, d = {}, expert hidden {}, k = {}",
            w.tokens, w.d, w.hidden, w.k
        ),
        moe: Vec::new(),
        skipped: Vec::new(),
    };
    // every configuration is checked before the first is measured
    for (dense, list) in [(false, ns), (true, dense_ns)] {
        for &n in list {
            let k = if dense { n } else { w.k.min(n) };
            moegrad::memory::check_fits(
                &format!(
                    "bench moe --tokens {} (n = {n} experts, k = {k}, d = {}, hidden {})",
                    w.tokens, w.d, w.hidden
                ),
                w.step_bytes(n, k),
            )?;
        }
    }
    for &dev in devices {
        let bind_limit = match dev {
            Device::Gpu => gpu_binding_limit()?,
            Device::Cpu => None,
        };
        // top-k through the plan; the dense router both ways
        for (router, list, paths) in [
            ("topk", ns, &[false][..]),
            ("softmax", dense_ns, &[true, false][..]),
        ] {
            for (&n, &all_experts) in list.iter().flat_map(|n| paths.iter().map(move |p| (n, p))) {
                let kk = if router == "softmax" { n } else { w.k.min(n) };
                let path = if all_experts { "all-experts" } else { "plan" };
                if let Some(reason) = bind_limit.and_then(|l| w.exceeds_binding(kk, l)) {
                    out.skipped.push(MoeSkipped {
                        device: dev.to_string(),
                        router: router.into(),
                        n,
                        k: kk,
                        path: path.into(),
                        reason,
                    });
                    continue;
                }
                let reps = if router == "softmax" && n > 8 { 2 } else { 5 };
                let t = moe_step(dev, (router, n, kk), Some(all_experts), w, reps)?;
                out.moe.push(MoeRecord {
                    device: dev.to_string(),
                    router: router.into(),
                    n,
                    k: kk,
                    path: path.into(),
                    step_ms: t.step_ms,
                    forward_ms: t.phases_ms[0],
                    backward_ms: t.phases_ms[1],
                    optimizer_ms: t.phases_ms[2],
                    tokens_per_s: w.tokens as f64 / (t.step_ms / 1e3),
                    peak_bytes: t.peak_bytes,
                    gradient_bytes: t.gradient_bytes,
                    activation_bytes: t.activation_bytes,
                    dispatches: t.dispatches,
                    bind_groups_created: t.bind_groups_created,
                });
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::MoeWorkload;

    /// `bench moe`'s default workload on lavapipe (128 MiB bindings): the dense router at
    /// n = 64 does not fit, at n = 16 it fits exactly (the limit is inclusive, as the GPU
    /// allocator's), and a width above the hidden one is the one that counts.
    #[test]
    fn a_cell_past_the_binding_limit_is_named_with_its_sizes() {
        let w = MoeWorkload {
            tokens: 4096,
            d: 256,
            hidden: 512,
            k: 2,
        };
        let limit = 128 << 20;
        let reason = w.exceeds_binding(64, limit).expect("n = 64 does not fit");
        for part in [
            "4096 tokens × 64 experts, 512",
            "536870912 bytes",
            "134217728 bytes",
        ] {
            assert!(reason.contains(part), "{part:?} in {reason:?}");
        }
        assert_eq!(w.exceeds_binding(16, limit), None);
        assert!(w.exceeds_binding(17, limit).is_some());
        let wide = MoeWorkload { d: 1024, ..w };
        assert!(wide.exceeds_binding(16, limit).is_some());
        assert_eq!(wide.exceeds_binding(8, limit), None);
        let huge = MoeWorkload {
            tokens: usize::MAX,
            ..w
        };
        assert!(huge.exceeds_binding(2, u64::MAX).is_some());
    }
}
