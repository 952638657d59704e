//! The WGSL the kernel cache compiles for a shader: its own text, or, in tests, the text with
//! every entry point's invocations' roles reversed within the workgroup, so that lavapipe runs
//! them in the opposite order and a race on workgroup memory shows.
//!
//! Lavapipe runs a workgroup's invocations in SIMD groups one after another between barriers,
//! always in the same order (invocation 0's group first). A kernel where one invocation reads
//! what another writes without a barrier between them gives the right answer there whenever
//! the writer's group happens to run first, and the wrong one on a GPU, where the order is
//! anyone's. [`reversed`] rewrites an entry point so that the hardware invocation `i` plays
//! the role of invocation `size − 1 − i`: its `local_invocation_index`, `local_invocation_id`
//! and `global_invocation_id` are replaced by the reversed ones at the top of its body. A kernel
//! free of such races computes exactly the same bits either way (every role does the same
//! work in the same order, only the hardware that runs it changes); one that has a race now
//! sees its writes in the other order. `src/backend/tests/invocation_order.rs` trains models
//! both ways and compares every bit. While [`REVERSED`] is set, the kernel cache
//! (`kernels.rs`) compiles every shader this way (under other cache keys). Shaders that use
//! subgroup builtins are left as they are: a subgroup's lanes are the hardware's, and a
//! shuffle names a hardware lane.

use super::kernels::Shader;
#[cfg(test)]
use crate::Error;
use crate::Result;
#[cfg(test)]
use std::sync::atomic::AtomicBool;

/// While set, the kernel cache compiles shaders with their invocations reversed.
#[cfg(test)]
pub(crate) static REVERSED: AtomicBool = AtomicBool::new(false);

/// Whether `shader` is compiled with its invocations reversed now: in tests, while
/// [`REVERSED`] is set (the cache keeps that build apart from the other).
pub(super) fn reversed_now(shader: &Shader) -> bool {
    #[cfg(test)]
    {
        REVERSED.load(std::sync::atomic::Ordering::SeqCst) && applies_to(shader.source)
    }
    #[cfg(not(test))]
    {
        let _ = shader;
        false
    }
}

/// The WGSL the kernel cache compiles for `shader`: its own, or in tests its text with the
/// invocations reversed ([`reversed_now`]).
pub(super) fn compiled_source(shader: &Shader) -> Result<std::borrow::Cow<'static, str>> {
    #[cfg(test)]
    if reversed_now(shader) {
        let text = reversed(shader.source).map_err(|e| {
            Error::Gpu(format!(
                "shader {}.wgsl, reversing its invocations: {e}",
                shader.name
            ))
        })?;
        return Ok(text.into());
    }
    Ok(shader.source.into())
}

#[cfg(test)]
/// Whether [`reversed`] rewrites `source` (it has no subgroup builtins).
pub(crate) fn applies_to(source: &str) -> bool {
    !source.contains("@builtin(subgroup")
}

#[cfg(test)]
/// The index just past the parenthesis that closes the one at `open`.
fn closing(text: &str, open: usize) -> Option<usize> {
    let mut depth = 0usize;
    for (i, c) in text[open..].char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth -= 1;
                if depth == 0 {
                    return Some(open + i + 1);
                }
            }
            _ => {}
        }
    }
    None
}

#[cfg(test)]
/// `text` split at its commas outside parentheses and angle brackets.
fn top_level_items(text: &str) -> Vec<&str> {
    let (mut depth, mut start, mut items) = (0i32, 0, Vec::new());
    for (i, c) in text.char_indices() {
        match c {
            '(' | '<' => depth += 1,
            ')' | '>' => depth -= 1,
            ',' if depth == 0 => {
                items.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    items.push(&text[start..]);
    items.into_iter().filter(|s| !s.trim().is_empty()).collect()
}

#[cfg(test)]
/// The name a parameter `@builtin(x) name: type` declares.
fn param_name(param: &str) -> Option<&str> {
    let after = &param[param.rfind(')')? + 1..];
    Some(after.split(':').next()?.trim())
}

#[cfg(test)]
/// `source` with every compute entry point's invocation builtins reversed (module docs), or an
/// error naming what could not be read.
pub(crate) fn reversed(source: &str) -> std::result::Result<String, String> {
    let mut out = String::with_capacity(source.len() + 4096);
    let mut at = 0;
    while let Some(found) = source[at..].find("@compute") {
        let start = at + found;
        let size_open = start
            + source[start..]
                .find("@workgroup_size(")
                .ok_or("an entry point without @workgroup_size")?
            + "@workgroup_size".len();
        let size_close = closing(source, size_open).ok_or("an unclosed @workgroup_size")?;
        let mut sizes: Vec<String> = top_level_items(&source[size_open + 1..size_close - 1])
            .into_iter()
            .map(|s| format!("u32({})", s.trim()))
            .collect();
        sizes.resize(3, "1u".to_string());
        let params_open = size_close
            + source[size_close..]
                .find('(')
                .ok_or("an entry point without parameters")?;
        let params_close = closing(source, params_open).ok_or("unclosed parameters")?;
        let body = params_close
            + source[params_close..]
                .find('{')
                .ok_or("an entry point without a body")?;

        let mut params = Vec::new();
        // the sizes written into each expression: a `let` of a constant expression alone trips
        // naga's override processing (ExpressionAlreadyInScope)
        let size = format!("vec3<u32>({})", sizes.join(", "));
        let total = sizes.join(" * ");
        let mut lets = Vec::new();
        let mut local_id = None;
        let mut global_id = None;
        for param in top_level_items(&source[params_open + 1..params_close - 1]) {
            let param = param.trim();
            let name = param_name(param).ok_or("a parameter without a name")?;
            let renamed = || param.replacen(name, &format!("{name}_hw"), 1);
            if param.contains("@builtin(local_invocation_index)") {
                params.push(renamed());
                lets.push(format!("let {name} = {total} - 1u - {name}_hw;"));
            } else if param.contains("@builtin(local_invocation_id)") {
                params.push(renamed());
                lets.push(format!("let {name} = {size} - vec3<u32>(1u) - {name}_hw;"));
                local_id = Some(format!("{name}_hw"));
            } else if param.contains("@builtin(global_invocation_id)") {
                params.push(renamed());
                global_id = Some(name.to_string());
            } else {
                params.push(param.to_string());
            }
        }
        if let Some(name) = global_id {
            let hw = local_id.unwrap_or_else(|| {
                params.push("@builtin(local_invocation_id) moegrad_local_hw: vec3<u32>".into());
                "moegrad_local_hw".into()
            });
            // the workgroup's first invocation, plus the reversed local id
            lets.push(format!(
                "let {name} = {name}_hw - {hw} + ({size} - vec3<u32>(1u) - {hw});"
            ));
        }
        out.push_str(&source[at..params_open]);
        out.push('(');
        out.push_str(&params.join(", "));
        out.push(')');
        out.push_str(&source[params_close..=body]);
        out.push('\n');
        for l in &lets {
            out.push_str("    ");
            out.push_str(l);
            out.push('\n');
        }
        at = body + 1;
    }
    out.push_str(&source[at..]);
    Ok(out)
}
