//! A step profile: the wall time spent in each op, forward and backward separately, summed over a
//! run (`moegrad train --profile`, or `MOEGRAD_PROFILE=1` for any command).
//!
//! How it is measured:
//!
//! * **Scopes.** Every differentiable op opens a scope as its first statement
//!   (`let _profile = profile::op("matmul");`); the backward walk opens one around each node's
//!   backward rule, named after the op that recorded the node; the optimizers open one around
//!   their step. A scope measures wall time from its opening to its end.
//! * **Outermost scope wins.** Scopes nest on a thread: only the outermost one open is timed, and
//!   the work of the scopes inside it counts to it. A composed op such as `layer_norm` or
//!   `cross_entropy` is therefore reported as itself and not as the primitives it calls, the
//!   tensor ops inside a backward rule count to that rule, and those inside the optimizer step to
//!   the step. A node recorded inside a composed op is attributed, backward, to that op as well.
//! * **Per thread.** A profile records the thread that enabled it; ops run on other threads are
//!   not recorded separately (the parallel work of the CPU kernels is inside the calling op's
//!   time). Profiles of different threads (tests running in parallel) do not mix.
//! * **Steps.** A training loop marks each step with [`step`]. Once a step has been marked, only
//!   work inside steps is recorded (evaluation and checkpoints between steps are not part of a
//!   step), and the report's shares are of the summed step time; the time of a step outside
//!   every scope (assembling and uploading the batch, bookkeeping, reading the loss back) is
//!   reported as `other`, so the shares add up to 100%. Without steps, shares are of the wall
//!   time since [`enable`].
//! * **Off costs one relaxed atomic load per op**: while no thread records, a scope is inert.
//! * **On the GPU** an op's wall time is the time to encode its kernels, not to run them; the
//!   report then adds the GPU time per kernel from timestamp queries where the adapter offers
//!   them (see `backend/gpu/timing.rs`), and says so where it does not.
//!
//! # Example
//! ```
//! use moegrad::{Device, Tensor, profile};
//! # fn main() -> moegrad::Result<()> {
//! let dev = Device::cpu();
//! let w = Tensor::from_f32(vec![0.5; 16], &[4, 4], dev)?.with_grad()?;
//! let x = Tensor::from_f32(vec![1.0; 8], &[2, 4], dev)?;
//! profile::enable();
//! let loss = x.matmul(&w)?.relu()?.sum_all()?;
//! loss.backward()?;
//! let report = profile::disable().expect("enabled above");
//! let calls = |op: &str, pass| {
//!     report.ops.iter().find(|o| o.op == op && o.pass == pass).map_or(0, |o| o.calls)
//! };
//! assert_eq!(calls("matmul", profile::Pass::Forward), 1);
//! assert_eq!(calls("matmul", profile::Pass::Backward), 1);
//! println!("{}", report.table(15));
//! # Ok(()) }
//! ```

use serde::Serialize;
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Threads recording a profile now; while it is zero every scope is inert after one load.
static RECORDING_THREADS: AtomicUsize = AtomicUsize::new(0);

/// Which part of a step a time belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Pass {
    /// an op's forward computation
    Forward,
    /// a node's backward rule (and summing the gradients it produced into its inputs')
    Backward,
    /// the optimizer's step and gradient clipping
    Optimizer,
    /// the step time outside every scope (only in [`Report::rows`])
    Other,
}

impl Pass {
    /// The name used in the table and the JSON.
    pub fn name(self) -> &'static str {
        match self {
            Pass::Forward => "forward",
            Pass::Backward => "backward",
            Pass::Optimizer => "optimizer",
            Pass::Other => "other",
        }
    }
}

/// Calls and summed wall time of one (op, pass).
#[derive(Clone, Copy, Debug, Default)]
struct Tally {
    calls: u64,
    time: Duration,
}

/// The profile of one thread while it records.
struct Recorder {
    started: Instant,
    /// open scopes on this thread (only the outermost is timed)
    depth: usize,
    /// the outermost scope open now, if it is an op's forward
    open_forward_op: Option<&'static str>,
    tallies: HashMap<(&'static str, Pass), Tally>,
    /// set by the first [`step`]: from then on only work inside steps is recorded
    steps_only: bool,
    step_started: Option<Instant>,
    steps: u64,
    step_time: Duration,
    /// time of the scopes that ended inside a step
    scoped_in_steps: Duration,
}

impl Recorder {
    fn new() -> Recorder {
        Recorder {
            started: Instant::now(),
            depth: 0,
            open_forward_op: None,
            tallies: HashMap::new(),
            steps_only: false,
            step_started: None,
            steps: 0,
            step_time: Duration::ZERO,
            scoped_in_steps: Duration::ZERO,
        }
    }

    fn report(&self) -> Report {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let mut ops: Vec<OpTime> = self
            .tallies
            .iter()
            .map(|(&(op, pass), t)| OpTime {
                op: op.to_string(),
                pass,
                calls: t.calls,
                ms: ms(t.time),
            })
            .collect();
        ops.sort_by(|a, b| {
            b.ms.total_cmp(&a.ms)
                .then_with(|| a.op.cmp(&b.op))
                .then(a.pass.cmp(&b.pass))
        });
        let wall_ms = ms(self.started.elapsed());
        let (base_ms, scoped_ms) = if self.steps > 0 {
            (ms(self.step_time), ms(self.scoped_in_steps))
        } else {
            (wall_ms, ops.iter().map(|o| o.ms).sum())
        };
        Report {
            ops,
            steps: self.steps,
            step_ms: ms(self.step_time),
            wall_ms,
            other_ms: (base_ms - scoped_ms).max(0.0),
            gpu: None,
        }
    }
}

thread_local! {
    static RECORDER: RefCell<Option<Recorder>> = const { RefCell::new(None) };
}

/// Runs `f` on this thread's recorder, if it records (and the thread is not being torn down).
fn with_recorder<R>(f: impl FnOnce(&mut Recorder) -> R) -> Option<R> {
    RECORDER
        .try_with(|cell| cell.try_borrow_mut().ok()?.as_mut().map(f))
        .ok()
        .flatten()
}

/// Starts (or restarts, from zero) recording a profile on this thread; also starts timing the
/// GPU kernels it launches where the adapter has timestamp queries.
pub fn enable() {
    let fresh = RECORDER
        .try_with(|cell| {
            let mut slot = cell.borrow_mut();
            let fresh = slot.is_none();
            *slot = Some(Recorder::new());
            fresh
        })
        .unwrap_or(false);
    if fresh {
        RECORDING_THREADS.fetch_add(1, Ordering::Relaxed);
    }
    crate::backend::gpu::timing::start();
}

/// Whether this thread records now: it has a profile, and is inside a step once steps are
/// marked (the GPU kernels it launches are timed then).
pub(crate) fn records_now() -> bool {
    RECORDING_THREADS.load(Ordering::Relaxed) > 0
        && with_recorder(|r| !r.steps_only || r.step_started.is_some()).unwrap_or(false)
}

/// Whether this thread records a profile.
pub fn is_enabled() -> bool {
    RECORDING_THREADS.load(Ordering::Relaxed) > 0 && with_recorder(|_| ()).is_some()
}

/// The profile recorded on this thread so far (recording goes on), or `None` when it does not
/// record.
pub fn report() -> Option<Report> {
    let mut report = with_recorder(|r| r.report())?;
    report.gpu = crate::backend::gpu::timing::report(false);
    Some(report)
}

/// Stops recording on this thread and returns the profile (`None` when it did not record).
pub fn disable() -> Option<Report> {
    let recorder = RECORDER
        .try_with(|cell| cell.try_borrow_mut().ok()?.take())
        .ok()
        .flatten()?;
    RECORDING_THREADS.fetch_sub(1, Ordering::Relaxed);
    let mut report = recorder.report();
    report.gpu = crate::backend::gpu::timing::report(true);
    Some(report)
}

/// A timed region (see the module docs); ends when dropped.
#[must_use = "a scope measures until it is dropped; bind it with `let _profile = ...`"]
pub struct Scope {
    state: ScopeState,
}

enum ScopeState {
    /// nothing recorded (profiling off, or outside a step once steps are marked)
    Inert,
    /// inside another scope: counts to it
    Nested,
    /// the outermost scope: timed from `started`
    Outer {
        name: &'static str,
        pass: Pass,
        started: Instant,
    },
}

/// Opens a scope for the forward computation of the op `name`.
pub(crate) fn op(name: &'static str) -> Scope {
    scope(name, Pass::Forward)
}

/// Opens a scope named `name` in `pass`.
pub(crate) fn scope(name: &'static str, pass: Pass) -> Scope {
    if RECORDING_THREADS.load(Ordering::Relaxed) == 0 {
        return Scope {
            state: ScopeState::Inert,
        };
    }
    let state = with_recorder(|r| {
        if r.steps_only && r.step_started.is_none() {
            return ScopeState::Inert;
        }
        r.depth += 1;
        if r.depth > 1 {
            return ScopeState::Nested;
        }
        r.open_forward_op = (pass == Pass::Forward).then_some(name);
        ScopeState::Outer {
            name,
            pass,
            started: Instant::now(),
        }
    });
    Scope {
        state: state.unwrap_or(ScopeState::Inert),
    }
}

impl Drop for Scope {
    fn drop(&mut self) {
        let ended = match self.state {
            ScopeState::Inert => return,
            ScopeState::Nested => None,
            ScopeState::Outer { .. } => Some(Instant::now()),
        };
        let state = &self.state;
        with_recorder(|r| {
            r.depth = r.depth.saturating_sub(1);
            if let (
                ScopeState::Outer {
                    name,
                    pass,
                    started,
                },
                Some(ended),
            ) = (state, ended)
            {
                let took = ended.saturating_duration_since(*started);
                let t = r.tallies.entry((name, *pass)).or_default();
                t.calls += 1;
                t.time += took;
                if r.step_started.is_some() {
                    r.scoped_in_steps += took;
                }
                r.open_forward_op = None;
            }
        });
    }
}

/// The op whose forward scope is the outermost one open on this thread, if profiling: a node
/// recorded now is attributed to it in the backward pass.
pub(crate) fn current_forward_op() -> Option<&'static str> {
    if RECORDING_THREADS.load(Ordering::Relaxed) == 0 {
        return None;
    }
    with_recorder(|r| r.open_forward_op).flatten()
}

/// One training step, timed until dropped (see the module docs); nested steps count once.
#[must_use = "a step is timed until it is dropped; bind it with `let _step = ...`"]
pub struct Step {
    outer: bool,
}

/// Marks the start of a training step on this thread; the step ends when the guard drops.
/// From the first step on, the profile records only work inside steps.
pub fn step() -> Step {
    if RECORDING_THREADS.load(Ordering::Relaxed) == 0 {
        return Step { outer: false };
    }
    let outer = with_recorder(|r| {
        r.steps_only = true;
        if r.step_started.is_some() {
            return false;
        }
        r.step_started = Some(Instant::now());
        true
    });
    Step {
        outer: outer.unwrap_or(false),
    }
}

impl Drop for Step {
    fn drop(&mut self) {
        if !self.outer {
            return;
        }
        with_recorder(|r| {
            if let Some(started) = r.step_started.take() {
                r.step_time += started.elapsed();
                r.steps += 1;
            }
        });
    }
}

/// Stops this thread's profile when dropped (see [`start`]).
pub struct Recording {
    _private: (),
}

/// [`enable`], returning a guard that disables the profile when dropped (on an early return
/// too); [`Recording::finish`] takes the report.
pub fn start() -> Recording {
    enable();
    Recording { _private: () }
}

impl Recording {
    /// Stops recording and returns the profile.
    pub fn finish(self) -> Option<Report> {
        disable()
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        disable();
    }
}

/// Whether the environment asks for a profile of any run: `MOEGRAD_PROFILE` set to anything
/// but empty, `0`, `false`, `no` or `off`.
pub fn requested_by_env() -> bool {
    std::env::var("MOEGRAD_PROFILE").is_ok_and(|v| {
        let v = v.trim().to_ascii_lowercase();
        !matches!(v.as_str(), "" | "0" | "false" | "no" | "off")
    })
}

/// The wall time of one op in one pass, summed over the run.
#[derive(Clone, Debug, Serialize)]
pub struct OpTime {
    /// op name, e.g. `matmul`, `layer_norm`, `adam step`
    pub op: String,
    /// forward, backward or optimizer
    pub pass: Pass,
    /// times the scope was opened (outermost)
    pub calls: u64,
    /// milliseconds, summed
    pub ms: f64,
}

/// One row of the profile as printed and in `--json` (`profile`): an op in a pass, or the
/// remainder `other`, with its share of the step time.
#[derive(Clone, Debug, Serialize)]
pub struct ProfileRow {
    /// op name (`other` for the remainder)
    pub op: String,
    /// `forward`, `backward`, `optimizer` or `other`
    pub pass: Pass,
    /// calls (for `other`: the steps)
    pub calls: u64,
    /// milliseconds, summed over the run
    pub ms: f64,
    /// fraction of the summed step time (of the wall time when no steps were marked)
    pub share: f64,
}

/// GPU time per kernel, from timestamp queries.
#[derive(Clone, Debug, Serialize)]
pub struct GpuProfile {
    /// the adapter, e.g. `llvmpipe (LLVM 15.0.6, 256 bits)`
    pub adapter: String,
    /// whether the adapter has timestamp queries (`kernels[].ms` are null without them)
    pub timestamps: bool,
    /// what the figures are, or why there are none
    pub note: String,
    /// per kernel (`shader.entry`), sorted by time (by calls without timestamps)
    pub kernels: Vec<KernelTime>,
}

/// The GPU time of one kernel, summed over the run.
#[derive(Clone, Debug, Serialize)]
pub struct KernelTime {
    /// `shader.entry_point`, e.g. `matmul.matmul_tiled`
    pub kernel: String,
    /// dispatches
    pub calls: u64,
    /// milliseconds on the GPU between the start and end timestamps of its dispatches (None
    /// without timestamp queries)
    pub ms: Option<f64>,
}

/// A recorded profile.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// every (op, pass) recorded, longest first
    pub ops: Vec<OpTime>,
    /// steps marked with [`step`]
    pub steps: u64,
    /// their summed wall time, ms
    pub step_ms: f64,
    /// wall time since [`enable`], ms
    pub wall_ms: f64,
    /// the step time (the wall time without steps) outside every scope, ms
    pub other_ms: f64,
    /// GPU time per kernel, when GPU kernels ran while recording
    pub gpu: Option<GpuProfile>,
}

impl Report {
    /// The time the shares are of: the summed step time, or the wall time without steps.
    pub fn base_ms(&self) -> f64 {
        if self.steps > 0 {
            self.step_ms
        } else {
            self.wall_ms
        }
    }

    /// Every op, longest first, then `other`, each with its share of [`Report::base_ms`].
    pub fn rows(&self) -> Vec<ProfileRow> {
        let base = self.base_ms();
        let share = |ms: f64| if base > 0.0 { ms / base } else { 0.0 };
        let mut rows: Vec<ProfileRow> = self
            .ops
            .iter()
            .map(|o| ProfileRow {
                op: o.op.clone(),
                pass: o.pass,
                calls: o.calls,
                ms: o.ms,
                share: share(o.ms),
            })
            .collect();
        rows.push(ProfileRow {
            op: "other".into(),
            pass: Pass::Other,
            calls: self.steps,
            ms: self.other_ms,
            share: share(self.other_ms),
        });
        rows
    }

    /// The profile as a table: the `top` longest ops, the rest summed in one line, `other`, and
    /// the GPU kernels when there are any.
    pub fn table(&self, top: usize) -> String {
        table(&self.rows(), self.gpu.as_ref(), top)
    }
}

/// Formats profile rows (as [`Report::rows`] makes them: `other` last, its calls the steps) as a
/// table of the `top` longest ops, then the GPU kernels (the `top` longest) when given.
pub fn table(rows: &[ProfileRow], gpu: Option<&GpuProfile>, top: usize) -> String {
    use std::fmt::Write;
    let (ops, other): (Vec<&ProfileRow>, Vec<&ProfileRow>) =
        rows.iter().partition(|r| r.pass != Pass::Other);
    let total: f64 = rows.iter().map(|r| r.ms).sum();
    let steps = other.first().map_or(0, |o| o.calls);
    let mut s = String::new();
    let _ = if steps > 0 {
        writeln!(
            s,
            "profile: {steps} steps, {:.1} ms ({:.2} ms/step); wall time per op, summed",
            total,
            total / steps as f64
        )
    } else {
        writeln!(
            s,
            "profile: {total:.1} ms of wall time; wall time per op, summed"
        )
    };
    let _ = writeln!(
        s,
        "{:<28} {:<9} {:>8} {:>11} {:>7}",
        "op", "pass", "calls", "ms", "share"
    );
    let share = |r: &ProfileRow| format!("{:.1}%", 100.0 * r.share);
    for r in ops.iter().take(top) {
        let _ = writeln!(
            s,
            "{:<28} {:<9} {:>8} {:>11.1} {:>7}",
            r.op,
            r.pass.name(),
            r.calls,
            r.ms,
            share(r)
        );
    }
    if ops.len() > top {
        let rest = &ops[top..];
        let _ = writeln!(
            s,
            "{:<28} {:<9} {:>8} {:>11.1} {:>6.1}%",
            format!("({} more)", rest.len()),
            "",
            rest.iter().map(|r| r.calls).sum::<u64>(),
            rest.iter().map(|r| r.ms).sum::<f64>(),
            100.0 * rest.iter().map(|r| r.share).sum::<f64>()
        );
    }
    for r in &other {
        let _ = writeln!(
            s,
            "{:<28} {:<9} {:>8} {:>11.1} {:>7}",
            "other (outside the ops)",
            "",
            "",
            r.ms,
            share(r)
        );
    }
    if let Some(g) = gpu {
        let _ = writeln!(s, "GPU {}: {}", g.adapter, g.note);
        if !g.kernels.is_empty() {
            let gpu_total: f64 = g.kernels.iter().filter_map(|k| k.ms).sum();
            let _ = writeln!(
                s,
                "{:<38} {:>8} {:>11} {:>7}",
                "kernel", "calls", "GPU ms", "share"
            );
            for k in g.kernels.iter().take(top) {
                let (ms, sh) = match k.ms {
                    Some(ms) if gpu_total > 0.0 => (
                        format!("{ms:.2}"),
                        format!("{:.1}%", 100.0 * ms / gpu_total),
                    ),
                    Some(ms) => (format!("{ms:.2}"), String::new()),
                    None => ("-".into(), String::new()),
                };
                let _ = writeln!(s, "{:<38} {:>8} {:>11} {:>7}", k.kernel, k.calls, ms, sh);
            }
            if g.kernels.len() > top {
                let _ = writeln!(s, "({} more kernels)", g.kernels.len() - top);
            }
        }
    }
    s
}
