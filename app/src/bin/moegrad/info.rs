//! `moegrad info`: the device moegrad would use, the GPU adapter, its limits and features.

use super::*;

/// Prints the device report, as text or (`json`) one JSON object.
pub(super) fn run_info(json: bool) -> Result<()> {
    let r = moegrad::info::device_report()?;
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&r).map_err(|e| moegrad::Error::Invalid(e.to_string()))?
        );
    } else {
        println!("device:      {}  ({})", r.device, r.reason);
        match (&r.gpu, &r.gpu_error) {
            (Some(g), _) => {
                println!(
                    "gpu adapter: {} ({}, {}, driver {})",
                    g.name, g.backend, g.device_type, g.driver
                );
                println!("gpu limits:");
                for (k, v) in &g.limits {
                    println!("  {k:<40} {v}");
                }
                println!(
                    "gpu optional features: {}",
                    if g.features.is_empty() {
                        "none".into()
                    } else {
                        g.features.join(", ")
                    }
                );
                let choice = match g.matmul_kernel.as_str() {
                    "auto" => " (wide tiles for large products, split-k for small ones)",
                    "tuned" => {
                        " (large products: the tile kernel timed fastest on this GPU, once per \
                         size; split-k for small ones)"
                    }
                    _ => "",
                };
                println!(
                    "gpu matmul kernel:     {}{choice}; subgroups of {}..{} invocations",
                    g.matmul_kernel, g.subgroup_sizes[0], g.subgroup_sizes[1]
                );
                let checks = match g.shader_checks.as_str() {
                    "no-loop-counter" => {
                        " (bounds checks and division guards kept, no loop counter)"
                    }
                    "full" => " (wgpu's default: bounds checks, loop counters, division guards)",
                    _ => " (no bounds checks, loop counters nor division guards: for measuring)",
                };
                println!("gpu shader checks:     {}{checks}", g.shader_checks);
                let groups = if g.bind_groups == "reuse" {
                    " (a dispatch binding the buffers an earlier one bound reuses its bind group)"
                } else {
                    " (a bind group created per dispatch: MOEGRAD_BIND_GROUPS=create)"
                };
                println!("gpu bind groups:       {}{groups}", g.bind_groups);
                println!(
                    "gpu half precision:    {}",
                    if g.f16 {
                        "yes (shader-f16): f16 tensors, and `train --precision f16-mixed`"
                    } else {
                        "no: the adapter does not offer shader-f16, so f16 tensors and \
                         `train --precision f16-mixed` are refused"
                    }
                );
            }
            (None, Some(e)) => println!("gpu adapter: none ({e})"),
            (None, None) => println!("gpu adapter: none"),
        }
        println!(
            "cpu:         {} threads, matmul by {}",
            r.cpu_threads, r.cpu_gemm
        );
    }
    Ok(())
}
