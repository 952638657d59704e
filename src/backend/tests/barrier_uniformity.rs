//! Every workgroup barrier of every built-in kernel is reached by all of its workgroup's
//! invocations or by none, and every subgroup operation by all of its subgroup's lanes: checked
//! on naga's IR, without a GPU.
//!
//! WGSL requires `workgroupBarrier`, `storageBarrier` and `workgroupUniformLoad` to sit in
//! uniform control flow. A barrier that only some invocations reach is undefined behaviour:
//! on lavapipe, which runs a workgroup's invocations as SIMD lanes of CPU threads, such a kernel
//! usually still gives the right answer, while on a real GPU it can hang or read half-written
//! workgroup memory. naga (what wgpu uses) records which statements need uniformity but does
//! not reject a barrier outside it, so nothing else in CI would catch one. This module is a
//! small uniformity analysis of its own, run on every pipeline of
//! [`super::shader_backends`] (each entry point with each set of override constants):
//!
//! - a value is *non-uniform* when it may differ between the invocations of one workgroup: the
//!   invocation's ids (`local_invocation_id`/`_index`, `global_invocation_id`, the subgroup
//!   ids), atomics' and subgroup operations' results, and anything computed from them; a local
//!   `var` is non-uniform once any store gives it a non-uniform value, or stores to it where
//!   control flow is non-uniform (found by iterating to a fixed point);
//! - a load from memory at a uniform address is uniform (the workgroup's invocations read one
//!   location), which is what the hardware does, where WGSL's own rules are stricter for
//!   workgroup and read-write storage memory;
//! - control flow is non-uniform inside an `if`, `switch` or loop whose condition is, after an
//!   `if` whose branch made some invocations `return`, `break` or `continue`, and, in a loop
//!   that some invocations left, in every later iteration; a function called where control flow
//!   is non-uniform is analysed so, with its arguments' uniformity.
//!
//! A subgroup operation (`subgroupShuffle`, `subgroupAdd`, ...) in non-uniform control flow is
//! flagged as well: lanes that did not come along give undefined values.
//!
//! The planted cases below show each rule catching what it should and passing what it should.

use super::shader_backends::{modules, pipelines};
use naga::{
    AddressSpace, Barrier, Binding, Block, BuiltIn, Expression, Function, Handle, Module, Span,
    Statement, TypeInner,
};
use std::collections::{BTreeSet, HashMap};

/// How some, not all, invocations left a block: by `break`, `continue` or `return`.
#[derive(Clone, Copy, Default)]
struct Exits {
    broke: bool,
    continued: bool,
    returned: bool,
}

impl Exits {
    fn any(self) -> bool {
        self.broke || self.continued || self.returned
    }

    fn or(self, other: Exits) -> Exits {
        Exits {
            broke: self.broke || other.broke,
            continued: self.continued || other.continued,
            returned: self.returned || other.returned,
        }
    }
}

/// What a call site needs to know of a function it called.
struct Summary {
    /// its result may differ between invocations
    result: bool,
    /// it stores a non-uniform value (or stores in non-uniform control flow) through each
    /// pointer argument
    writes_through: Vec<bool>,
}

/// One pass over one function, given which arguments are non-uniform and whether it is entered
/// in non-uniform control flow.
struct Pass<'m> {
    module: &'m Module,
    source: &'m str,
    func: &'m Function,
    name: &'m str,
    args: Vec<bool>,
    locals: Vec<bool>,
    calls: HashMap<Handle<Expression>, bool>,
    memo: Vec<Option<bool>>,
    changed: bool,
    summary: Summary,
    problems: BTreeSet<String>,
}

/// Where the pointer expression `p` points: a local variable, a pointer argument, or other
/// memory.
enum Root {
    Local(usize),
    Argument(usize),
    Other,
}

impl<'m> Pass<'m> {
    /// Whether expression `e` may differ between the invocations of a workgroup.
    fn non_uniform(&mut self, e: Handle<Expression>) -> bool {
        if let Some(v) = self.memo[e.index()] {
            return v;
        }
        let func = self.func;
        let v = match &func.expressions[e] {
            Expression::Literal(_)
            | Expression::Constant(_)
            | Expression::Override(_)
            | Expression::ZeroValue(_)
            | Expression::WorkGroupUniformLoadResult { .. } => false,
            Expression::Compose { components, .. } => {
                components.iter().any(|&c| self.non_uniform(c))
            }
            &Expression::Access { base, index } => self.non_uniform(base) | self.non_uniform(index),
            &Expression::AccessIndex { base, .. } => self.non_uniform(base),
            &Expression::Splat { value, .. } => self.non_uniform(value),
            &Expression::Swizzle { vector, .. } => self.non_uniform(vector),
            &Expression::FunctionArgument(i) => self.args[i as usize],
            &Expression::GlobalVariable(g) => matches!(
                self.module.global_variables[g].space,
                AddressSpace::Private | AddressSpace::Function
            ),
            &Expression::LocalVariable(l) => self.locals[l.index()],
            // an atomic's value may change between two invocations' loads
            &Expression::Load { pointer } => self.non_uniform(pointer) | self.atomic(pointer),
            &Expression::Unary { expr, .. } => self.non_uniform(expr),
            &Expression::Binary { left, right, .. } => {
                self.non_uniform(left) | self.non_uniform(right)
            }
            &Expression::Select {
                condition,
                accept,
                reject,
            } => self.non_uniform(condition) | self.non_uniform(accept) | self.non_uniform(reject),
            &Expression::Relational { argument, .. } => self.non_uniform(argument),
            &Expression::Math {
                arg,
                arg1,
                arg2,
                arg3,
                ..
            } => [Some(arg), arg1, arg2, arg3]
                .into_iter()
                .flatten()
                .fold(false, |acc, a| self.non_uniform(a) | acc),
            &Expression::As { expr, .. } => self.non_uniform(expr),
            &Expression::ArrayLength(x) => self.non_uniform(x),
            Expression::CallResult(_) => self.calls.get(&e).copied().unwrap_or(true),
            // atomics, subgroup operations, images, ray queries, cooperative matrices
            _ => true,
        };
        self.memo[e.index()] = Some(v);
        v
    }

    /// Whether `p` points into a global variable that holds atomics.
    fn atomic(&self, p: Handle<Expression>) -> bool {
        let mut e = p;
        loop {
            match self.func.expressions[e] {
                Expression::Access { base, .. } | Expression::AccessIndex { base, .. } => e = base,
                Expression::GlobalVariable(g) => {
                    let ty = self.module.global_variables[g].ty;
                    return holds_atomics(self.module, ty);
                }
                _ => return false,
            }
        }
    }

    fn root(&self, p: Handle<Expression>) -> Root {
        match self.func.expressions[p] {
            Expression::Access { base, .. } | Expression::AccessIndex { base, .. } => {
                self.root(base)
            }
            Expression::LocalVariable(l) => Root::Local(l.index()),
            Expression::FunctionArgument(i) => Root::Argument(i as usize),
            _ => Root::Other,
        }
    }

    /// Records that the store (or write through a call) at `p` makes its target non-uniform.
    fn taint(&mut self, p: Handle<Expression>) {
        match self.root(p) {
            Root::Local(l) if !self.locals[l] => {
                self.locals[l] = true;
                self.changed = true;
            }
            Root::Argument(i) => self.summary.writes_through[i] = true,
            _ => {}
        }
    }

    fn problem(&mut self, what: &str, span: &Span) {
        let line = if span.is_defined() {
            format!(
                "line {} of the shader text",
                span.location(self.source).line_number
            )
        } else {
            "(no span)".to_string()
        };
        self.problems.insert(format!(
            "{what} in non-uniform control flow, in `{}` at {line}",
            self.name
        ));
    }

    fn block(&mut self, b: &'m Block, mut non_uniform: bool) -> Exits {
        let mut exits = Exits::default();
        for (s, span) in b.span_iter() {
            let e = self.statement(s, span, non_uniform);
            // the statements after one that some invocations left by are run by the rest only
            non_uniform |= e.any();
            exits = exits.or(e);
        }
        exits
    }

    fn statement(&mut self, s: &'m Statement, span: &Span, non_uniform: bool) -> Exits {
        let left = |broke, continued, returned| Exits {
            broke: broke && non_uniform,
            continued: continued && non_uniform,
            returned: returned && non_uniform,
        };
        match s {
            Statement::Block(b) => self.block(b, non_uniform),
            &Statement::If {
                condition,
                ref accept,
                ref reject,
            } => {
                let inner = non_uniform | self.non_uniform(condition);
                self.block(accept, inner).or(self.block(reject, inner))
            }
            &Statement::Switch {
                selector,
                ref cases,
            } => {
                let inner = non_uniform | self.non_uniform(selector);
                let mut exits = Exits::default();
                for case in cases {
                    exits = exits.or(self.block(&case.body, inner));
                }
                // a `break` leaves the switch, not an enclosing loop
                Exits {
                    broke: false,
                    ..exits
                }
            }
            Statement::Loop {
                body,
                continuing,
                break_if,
            } => {
                // iterations after some invocations left the loop run with the rest only
                let mut left_loop = false;
                loop {
                    let inner = non_uniform | left_loop;
                    let b = self.block(body, inner);
                    let c = self.block(continuing, inner | b.broke | b.returned);
                    let exit_if = break_if.is_some_and(|e| self.non_uniform(e));
                    let now = left_loop | b.broke | b.returned | c.broke | c.returned | exit_if;
                    if now == left_loop {
                        return Exits {
                            returned: b.returned | c.returned,
                            ..Exits::default()
                        };
                    }
                    left_loop = now;
                }
            }
            Statement::Break => left(true, false, false),
            Statement::Continue => left(false, true, false),
            Statement::Kill => left(false, false, true),
            &Statement::Return { value } => {
                if let Some(v) = value {
                    self.summary.result |= non_uniform | self.non_uniform(v);
                }
                left(false, false, true)
            }
            &Statement::ControlBarrier(b) | &Statement::MemoryBarrier(b) => {
                if non_uniform && b != Barrier::SUB_GROUP {
                    self.problem("a barrier", span);
                }
                Exits::default()
            }
            // a subgroup operation reads the other lanes of its subgroup: a lane that did not
            // come along gives an undefined value (the analysis is per workgroup, so a branch
            // uniform per subgroup only would be flagged too; no kernel has one)
            Statement::SubgroupBallot { .. }
            | Statement::SubgroupGather { .. }
            | Statement::SubgroupCollectiveOperation { .. } => {
                if non_uniform {
                    self.problem("a subgroup operation", span);
                }
                Exits::default()
            }
            Statement::WorkGroupUniformLoad { .. } => {
                if non_uniform {
                    self.problem("a workgroupUniformLoad", span);
                }
                Exits::default()
            }
            &Statement::Store { pointer, value } => {
                if non_uniform | self.non_uniform(value) | self.non_uniform(pointer) {
                    self.taint(pointer);
                }
                Exits::default()
            }
            &Statement::Call {
                function,
                ref arguments,
                result,
            } => {
                let args: Vec<bool> = arguments.iter().map(|&a| self.non_uniform(a)).collect();
                let callee = &self.module.functions[function];
                let name = callee.name.as_deref().unwrap_or("?");
                let (summary, problems) =
                    analyse(self.module, self.source, (callee, name), args, non_uniform);
                self.problems.extend(problems);
                if let Some(r) = result {
                    self.calls.insert(r, summary.result);
                }
                for (&a, &written) in arguments.iter().zip(&summary.writes_through) {
                    if written {
                        self.taint(a);
                    }
                }
                Exits::default()
            }
            _ => Exits::default(),
        }
    }
}

/// Whether type `ty` is, or contains, an atomic.
fn holds_atomics(module: &Module, ty: Handle<naga::Type>) -> bool {
    match &module.types[ty].inner {
        TypeInner::Atomic(_) => true,
        &TypeInner::Array { base, .. } => holds_atomics(module, base),
        TypeInner::Struct { members, .. } => members.iter().any(|m| holds_atomics(module, m.ty)),
        _ => false,
    }
}

/// Analyses `func` entered with arguments of the given uniformity (`args[i]`: non-uniform) in
/// uniform control flow or not: its summary for the caller and the barriers it found outside
/// uniform control flow.
fn analyse<'m>(
    module: &'m Module,
    source: &'m str,
    (func, name): (&'m Function, &'m str),
    args: Vec<bool>,
    non_uniform: bool,
) -> (Summary, BTreeSet<String>) {
    let mut locals = vec![false; func.local_variables.len()];
    loop {
        let mut pass = Pass {
            module,
            source,
            func,
            name,
            args: args.clone(),
            locals: locals.clone(),
            calls: HashMap::new(),
            memo: vec![None; func.expressions.len()],
            changed: false,
            summary: Summary {
                result: false,
                writes_through: vec![false; args.len()],
            },
            problems: BTreeSet::new(),
        };
        for (h, var) in func.local_variables.iter() {
            if let Some(init) = var.init
                && !pass.locals[h.index()]
                && pass.non_uniform(init)
            {
                pass.locals[h.index()] = true;
                pass.changed = true;
            }
        }
        pass.block(&func.body, non_uniform);
        if !pass.changed {
            return (pass.summary, pass.problems);
        }
        locals = pass.locals;
    }
}

/// The barriers of `module`'s entry point `entry` outside uniform control flow (`source`: the
/// WGSL text, for line numbers).
fn non_uniform_barriers(module: &Module, source: &str, entry: &str) -> Vec<String> {
    let ep = module
        .entry_points
        .iter()
        .find(|ep| ep.name == entry)
        .expect("an entry point of the module");
    // per-workgroup built-ins are the same for every invocation; anything else may differ
    let args = ep
        .function
        .arguments
        .iter()
        .map(|a| {
            !matches!(
                a.binding,
                Some(Binding::BuiltIn(
                    BuiltIn::WorkGroupId | BuiltIn::NumWorkGroups | BuiltIn::WorkGroupSize
                ))
            )
        })
        .collect();
    let (_, problems) = analyse(module, source, (&ep.function, entry), args, false);
    problems.into_iter().collect()
}

#[test]
fn every_barrier_of_every_kernel_is_in_uniform_control_flow() {
    let modules = modules();
    let pipelines = pipelines(&modules);
    let mut failures = Vec::new();
    for p in &pipelines {
        let (m, _) = p
            .specialised()
            .unwrap_or_else(|e| panic!("{}: {e}", p.name()));
        for problem in non_uniform_barriers(&m, p.shader.source, &p.entry) {
            failures.push(format!("{}: {problem}", p.name()));
        }
    }
    eprintln!(
        "{} pipelines' barriers checked for uniform control flow",
        pipelines.len()
    );
    assert!(
        failures.is_empty(),
        "{} barriers some invocations of a workgroup may skip (undefined behaviour on a GPU):\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// The problems the analysis finds in the entry point `main` of a WGSL snippet.
fn problems_in(wgsl: &str) -> Vec<String> {
    let module = naga::front::wgsl::parse_str(wgsl).expect("the snippet parses");
    naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        naga::valid::Capabilities::all(),
    )
    .subgroup_stages(naga::valid::ShaderStages::COMPUTE)
    .subgroup_operations(naga::valid::SubgroupOperationSet::all())
    .validate(&module)
    .expect("the snippet validates");
    non_uniform_barriers(&module, wgsl, "main")
}

const SNIPPET_HEAD: &str = "
struct P { n: u32 }
@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read_write> out: array<u32>;
var<workgroup> shared_mem: array<u32, 64>;
fn sync() { workgroupBarrier(); }
fn store_to(v: ptr<function, u32>, x: u32) { *v = x; }
";

fn snippet(body: &str) -> String {
    format!(
        "{SNIPPET_HEAD}
@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {{
{body}
}}"
    )
}

#[test]
fn the_analysis_finds_barriers_some_invocations_skip() {
    let planted = [
        (
            "a barrier under an if on the invocation",
            "if lid < 8u { workgroupBarrier(); }",
        ),
        (
            "a barrier after a return some invocations take",
            "if lid >= p.n { return; }\nworkgroupBarrier();",
        ),
        (
            "a loop bounded by the invocation",
            "for (var i = lid; i < p.n; i += 64u) { workgroupBarrier(); }",
        ),
        (
            "a helper with a barrier, called by some invocations",
            "if lid == 0u { sync(); }",
        ),
        (
            "a var made non-uniform by a store, then a loop bound",
            "var n = p.n;\nif lid > 3u { n = 1u; }\nfor (var i = 0u; i < n; i++) { workgroupBarrier(); }",
        ),
        (
            "a break some invocations take, before a barrier in a later iteration",
            "for (var i = 0u; i < p.n; i++) { workgroupBarrier(); if out[lid] == 0u { break; } }",
        ),
        (
            "a continue some invocations take, before the barrier of that iteration",
            "for (var i = 0u; i < p.n; i++) { if lid == i { continue; } workgroupBarrier(); }",
        ),
        (
            "a var set through a pointer to the invocation's index",
            "var n = 0u;\nstore_to(&n, lid);\nif n < 4u { workgroupBarrier(); }",
        ),
        (
            "a switch on the invocation",
            "switch lid { case 0u: { workgroupBarrier(); } default: {} }",
        ),
        (
            "an atomic's result",
            "if atomicLoad(&counter) == 0u { workgroupBarrier(); }",
        ),
        (
            "a subgroup shuffle under an if on the invocation",
            "var x = 0u;\nif lid < 3u { x = subgroupShuffle(lid, 0u); }\nout[lid] = x;",
        ),
    ];
    for (what, body) in planted {
        let src = if body.contains("counter") {
            format!("var<workgroup> counter: atomic<u32>;\n{}", snippet(body))
        } else {
            snippet(body)
        };
        let found = problems_in(&src);
        assert!(!found.is_empty(), "{what}: not found in\n{body}");
    }
}

#[test]
fn the_analysis_passes_barriers_every_invocation_reaches() {
    let uniform = [
        (
            "a return on the workgroup's id",
            "if wid.x >= p.n { return; }\nworkgroupBarrier();",
        ),
        (
            "a loop over a uniform count",
            "for (var s = 0u; s < p.n; s++) { workgroupBarrier(); }",
        ),
        (
            "a non-uniform branch that reconverges",
            "if lid < 8u { shared_mem[lid] = 1u; }\nworkgroupBarrier();",
        ),
        (
            "a loop bound read from workgroup memory at a uniform address",
            "if lid == 0u { shared_mem[0] = p.n; }\nworkgroupBarrier();\n\
          for (var i = 0u; i < shared_mem[0]; i++) { workgroupBarrier(); }",
        ),
        (
            "a var set through a pointer to a uniform value",
            "var n = 0u;\nstore_to(&n, p.n);\nfor (var i = 0u; i < n; i++) { sync(); }",
        ),
        (
            "a break every invocation takes together",
            "for (var i = 0u; i < 4u; i++) { workgroupBarrier(); if i + p.n > 8u { break; } }",
        ),
    ];
    for (what, body) in uniform {
        let found = problems_in(&snippet(body));
        assert!(found.is_empty(), "{what}: flagged:\n{}", found.join("\n"));
    }
}
