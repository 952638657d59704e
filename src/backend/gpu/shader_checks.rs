//! [`ShaderChecks`]: which run-time checks wgpu compiles into moegrad's own kernels.
//!
//! wgpu translates WGSL for the driver through naga, and by default adds three kinds of code
//! that WebGPU's safety model asks for:
//!
//! - **bounds checks**: every index into an array (workgroup tiles, local arrays) is clamped
//!   into range, and on drivers without robust buffer access so is every buffer index;
//! - **a loop counter in every loop**: a 64-bit count (two u32) incremented on each iteration,
//!   ending the loop after 2⁶⁴ of them, so that the driver's compiler may not assume a loop
//!   ends and optimise on that assumption. The counter is another exit the compiler cannot see
//!   through, which keeps it from counting the iterations and unrolling: wgpu issue 7698
//!   reports a compute pass going from 0.1 ms to 10 ms when it arrived (wgpu 25);
//! - **integer-division guards**: `a / b` and `a % b` take a select that avoids division by
//!   zero and `i32::MIN / -1`, as WGSL defines them.
//!
//! moegrad's kernels are its own code, tested on every adapter it runs on: every loop in
//! `shaders/` runs a count its parameters fix (ranges over sizes, slabs of a reduction, steps of
//! a sort, binary searches that shrink an interval) and none waits on another invocation, so
//! the loop counter buys nothing. By default ([`ShaderChecks::NoLoopCounter`]) they are compiled
//! without it and with bounds checks and division guards kept; a kernel a user writes
//! (`moegrad::wgsl`) is always compiled with every check. `MOEGRAD_SHADER_CHECKS=full` brings
//! wgpu's default back (to measure what the counter costs); `none` drops the bounds checks and
//! guards too, as Burn's CubeCL does, for measurement only: an out-of-range index is then
//! undefined behaviour on the device.

use crate::{Error, Result};

/// The run-time checks compiled into moegrad's built-in kernels (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ShaderChecks {
    /// wgpu's default: bounds checks, a loop counter in every loop, integer-division guards
    Full,
    /// bounds checks and integer-division guards, no loop counter (the default)
    NoLoopCounter,
    /// none of the three: an out-of-range index or a division by zero is undefined behaviour on
    /// the device; for measuring what the checks cost
    Unchecked,
}

impl ShaderChecks {
    /// Every choice, in the order `MOEGRAD_SHADER_CHECKS` lists them.
    pub const ALL: [ShaderChecks; 3] = [
        ShaderChecks::Full,
        ShaderChecks::NoLoopCounter,
        ShaderChecks::Unchecked,
    ];

    /// Parses `full`, `no-loop-counter` or `none` (`MOEGRAD_SHADER_CHECKS`).
    pub fn from_name(name: &str) -> Result<ShaderChecks> {
        let name = name.trim();
        Self::ALL
            .into_iter()
            .find(|c| c.name() == name)
            .ok_or_else(|| {
                Error::Invalid(format!(
                    "MOEGRAD_SHADER_CHECKS={name:?} is not full, no-loop-counter or none"
                ))
            })
    }

    /// The name, as `MOEGRAD_SHADER_CHECKS` spells it.
    pub fn name(self) -> &'static str {
        match self {
            ShaderChecks::Full => "full",
            ShaderChecks::NoLoopCounter => "no-loop-counter",
            ShaderChecks::Unchecked => "none",
        }
    }

    /// The choice of `MOEGRAD_SHADER_CHECKS`, or [`ShaderChecks::NoLoopCounter`] when unset.
    pub(crate) fn from_env() -> Result<ShaderChecks> {
        match std::env::var("MOEGRAD_SHADER_CHECKS") {
            Ok(name) => ShaderChecks::from_name(&name),
            Err(_) => Ok(ShaderChecks::NoLoopCounter),
        }
    }

    /// What wgpu is told when it compiles a built-in kernel.
    pub(crate) fn runtime_checks(self) -> wgpu::ShaderRuntimeChecks {
        let full = wgpu::ShaderRuntimeChecks::checked();
        match self {
            ShaderChecks::Full => full,
            ShaderChecks::NoLoopCounter => wgpu::ShaderRuntimeChecks {
                force_loop_bounding: false,
                ..full
            },
            ShaderChecks::Unchecked => wgpu::ShaderRuntimeChecks::unchecked(),
        }
    }
}
