//! The WGSL the kernel cache compiles for a shader: its own text, or, in tests, the text with
//! every entry point's invocations' roles permuted within the workgroup, so that lavapipe runs
//! them in another order and a race on workgroup memory shows.
//!
//! Lavapipe runs a workgroup's invocations in SIMD groups (8 lanes in lockstep) one after
//! another between barriers, always in the same order (invocation 0's group first). A kernel
//! where one invocation reads what another writes without a barrier between them gives the
//! right answer there whenever the order happens to suit it, and the wrong one on a GPU, where
//! the order is anyone's. [`rewritten`] makes hardware invocation `i` play the role of another
//! ([`Roles`]): `size − 1 − i` (reversed: the group that ran last runs first), or
//! `(77·i + 3) mod size` (scrambled: neighbouring roles in different groups, so that a race
//! between them no longer runs in lockstep). It replaces `local_invocation_index`,
//! `local_invocation_id` and `global_invocation_id` by the role's at the top of each entry
//! point. A kernel free of such races computes exactly the same bits whichever way (every role
//! does the same work in the same order, only the hardware that runs it changes); one that has
//! a race sees its writes in another order. `src/backend/tests/invocation_order.rs` trains
//! models all three ways and compares every bit. While [`set_roles`] has chosen a permutation,
//! the kernel cache (`kernels.rs`) compiles every shader so, under keys of its own. Shaders
//! with subgroup builtins are left as they are: a subgroup's lanes are the hardware's, and a
//! shuffle names a hardware lane.

use super::kernels::Shader;
#[cfg(test)]
use crate::Error;
use crate::Result;
#[cfg(test)]
use std::sync::atomic::{AtomicU8, Ordering};

/// Which invocation of a workgroup plays which role: as the hardware numbers them, or (tests
/// only) permuted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Roles {
    /// hardware invocation `i` is invocation `i` (what every build outside tests compiles)
    AsRun,
    /// hardware invocation `i` is invocation `size − 1 − i`: the SIMD group that ran last runs
    /// first
    #[cfg_attr(not(test), allow(dead_code))]
    Reversed,
    /// hardware invocation `i` is invocation `(77·i + 3) mod size`: neighbouring invocations
    /// land in different SIMD groups, so a race between them no longer runs in lockstep
    #[cfg_attr(not(test), allow(dead_code))]
    Scrambled,
}

/// The [`Roles`] the kernel cache compiles with now (tests set it; 0 = as run).
#[cfg(test)]
static ROLES: AtomicU8 = AtomicU8::new(0);

/// Makes the kernel cache compile every shader (but those with subgroup builtins) with
/// `roles` from now on; [`Roles::AsRun`] restores the shaders as written.
#[cfg(test)]
pub(crate) fn set_roles(roles: Roles) {
    ROLES.store(roles as u8, Ordering::SeqCst);
}

/// The roles `shader` is compiled with now: in tests, those [`set_roles`] chose where
/// [`applies_to`] the shader; otherwise as run.
pub(super) fn roles_now(shader: &Shader) -> Roles {
    // the atomic first: a launch as run does not read the shader's text
    #[cfg(test)]
    match ROLES.load(Ordering::SeqCst) {
        1 if applies_to(shader.source) => return Roles::Reversed,
        2 if applies_to(shader.source) => return Roles::Scrambled,
        _ => {}
    }
    let _ = shader;
    Roles::AsRun
}

/// The WGSL the kernel cache compiles for `shader`: its own text, or in tests its text with
/// the invocations permuted ([`roles_now`]).
pub(super) fn compiled_source(shader: &Shader) -> Result<std::borrow::Cow<'static, str>> {
    #[cfg(test)]
    if let roles @ (Roles::Reversed | Roles::Scrambled) = roles_now(shader) {
        let text = rewritten(shader.source, roles).map_err(|e| {
            Error::Gpu(format!(
                "shader {}.wgsl, permuting its invocations: {e}",
                shader.name
            ))
        })?;
        return Ok(text.into());
    }
    Ok(shader.source.into())
}

#[cfg(test)]
/// Whether [`rewritten`] may permute `source`'s invocations (it has no subgroup builtins).
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
/// `param` (`@builtin(x) name: type`) with its name replaced by `name_hw`.
fn renamed(param: &str, name: &str) -> String {
    let cut = param.rfind(')').map_or(0, |i| i + 1);
    let (attribute, rest) = param.split_at(cut);
    format!(
        "{attribute}{}",
        rest.replacen(name, &format!("{name}_hw"), 1)
    )
}

#[cfg(test)]
/// The role the hardware invocation `hw` (a WGSL expression) plays among `total`, as WGSL.
fn role_of(roles: Roles, hw: &str, total: u32) -> String {
    match roles {
        Roles::AsRun => hw.to_string(),
        Roles::Reversed => format!("{}u - {hw}", total - 1),
        // an odd multiplier is a bijection modulo a power of two, and takes neighbouring roles
        // to hardware invocations far apart (in other SIMD groups)
        Roles::Scrambled => format!("({hw} * {SCRAMBLE}u + 3u) % {total}u"),
    }
}

/// The multiplier of [`Roles::Scrambled`]: odd, so a bijection on any power-of-two workgroup.
#[cfg(test)]
const SCRAMBLE: u32 = 77;

#[cfg(test)]
/// `source` with every compute entry point's invocation builtins permuted as `roles` says
/// (module docs), or an error naming what could not be read. Workgroup sizes must be integer
/// literals whose product is a power of two (every built-in kernel's are).
pub(crate) fn rewritten(source: &str, roles: Roles) -> std::result::Result<String, String> {
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
        let mut size = [1u32; 3];
        for (i, s) in top_level_items(&source[size_open + 1..size_close - 1])
            .into_iter()
            .enumerate()
        {
            let literal = s.trim().trim_end_matches(['u', 'i']);
            size[i] = literal
                .parse()
                .map_err(|_| format!("a workgroup size that is not a literal: {s}"))?;
        }
        let [x, y, _] = size;
        let total: u32 = size.iter().product();
        if !total.is_power_of_two() {
            return Err(format!(
                "a workgroup of {total} invocations, not a power of two"
            ));
        }
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
        let (mut index, mut local_id, mut global_id) = (None, None, None);
        for param in top_level_items(&source[params_open + 1..params_close - 1]) {
            let param = param.trim();
            let name = param_name(param).ok_or("a parameter without a name")?;
            let slot = if param.contains("@builtin(local_invocation_index)") {
                &mut index
            } else if param.contains("@builtin(local_invocation_id)") {
                &mut local_id
            } else if param.contains("@builtin(global_invocation_id)") {
                &mut global_id
            } else {
                params.push(param.to_string());
                continue;
            };
            params.push(renamed(param, name));
            *slot = Some(name.to_string());
        }
        // the hardware's index, from which every role id is derived
        let hw = match &index {
            Some(name) => format!("{name}_hw"),
            None => {
                params.push("@builtin(local_invocation_index) moegrad_hw: u32".into());
                "moegrad_hw".into()
            }
        };
        let as_id = |i: &str| {
            format!(
                "vec3<u32>({i} % {x}u, ({i} / {x}u) % {y}u, {i} / {}u)",
                x * y
            )
        };
        let mut lets = vec![format!(
            "let moegrad_role = {};",
            role_of(roles, &hw, total)
        )];
        if let Some(name) = &index {
            lets.push(format!("let {name} = moegrad_role;"));
        }
        if let Some(name) = &local_id {
            lets.push(format!("let {name} = {};", as_id("moegrad_role")));
        }
        if let Some(name) = &global_id {
            // the workgroup's first invocation, plus the role's local id
            lets.push(format!(
                "let {name} = {name}_hw - {} + {};",
                as_id(&hw),
                as_id("moegrad_role")
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
