//! The elementwise op table: every [`UnaryOp`] and [`BinaryOp`] written once, as its name, its
//! doc comment and its math.
//!
//! Each row of the two `*_ops!` tables below declares one enum variant and gives the formula the
//! CPU backend evaluates (generic over `num_traits::Float`, so one body serves f32 and f64) and,
//! after `wgsl`, the same formula in WGSL for the GPU. From the rows the macros generate
//! everything a device needs:
//!
//! - `UnaryOp::apply` / `BinaryOp::apply`: the CPU math (`backend/cpu/elementwise.rs` calls it;
//!   a few hot ops there have hand-vectorised loops that must give the same values);
//! - `code()`: the op's number in the GPU kernel, its position in its table;
//! - [`wgsl_elementwise_ops`]: the WGSL constants `UNARY_NEG`, … `BINARY_GELU_BACKWARD` holding
//!   those numbers and the functions `apply_unary` / `apply_binary`, a `case` per row, appended
//!   to `shaders/elementwise.wgsl` when it is compiled (the helpers the bodies call, such as
//!   `gelu_grad`, `log_f` or `rmax`, live in that file).
//!
//! A new elementwise op is therefore a row here (its CPU math and its WGSL line: a row without
//! either does not compile), a `Tensor` method with its backward rule in `ops/elementwise.rs`,
//! and its tests (docs/adding-an-op.md). The tables are device-neutral: no backend type appears
//! here.

use num_traits::Float;

/// `v` in the dtype `T` (every f64 constant of the tables is representable in f32 and f64).
fn lit<T: Float>(v: f64) -> T {
    T::from(v).unwrap_or_else(T::nan)
}

/// `1` where `p` holds, else `0`, in the dtype `T`.
fn flag<T: Float>(p: bool) -> T {
    if p { T::one() } else { T::zero() }
}

/// `"GeluGrad"` -> `"GELU_GRAD"`: the WGSL spelling of a variant's name.
fn upper_snake(name: &str) -> String {
    let mut s = String::new();
    for (i, ch) in name.chars().enumerate() {
        if ch.is_ascii_uppercase() && i > 0 {
            s.push('_');
        }
        s.push(ch.to_ascii_uppercase());
    }
    s
}

/// Declares `UnaryOp` from rows `Name(params: f64) => |x| math`, with `apply`, `code`,
/// `params` and `NAMES` (see the module doc).
macro_rules! unary_ops {
    ($( $(#[$doc:meta])* $name:ident $( ( $($p:ident : f64),+ ) )? => |$x:ident| $body:expr, wgsl $wgsl:literal );+ $(;)?) => {
        /// Elementwise functions of one input. Parameters are carried as f64 and rounded to the
        /// buffer's dtype. The rows of the table in `backend/elementwise_ops.rs`.
        #[derive(Clone, Copy, Debug, PartialEq)]
        pub enum UnaryOp {
            $( $(#[$doc])* $name $( ( $( unary_ops!(@f64 $p) ),+ ) )? ),+
        }

        impl UnaryOp {
            /// The variant names in table order (a variant's index is its [`UnaryOp::code`]).
            pub(crate) const NAMES: &'static [&'static str] = &[$( stringify!($name) ),+];
            /// Each op's WGSL body in table order (statements over `x`, `p0`, `p1` that
            /// `return` an f32), from which `apply_unary` is generated.
            pub(crate) const WGSL: &'static [&'static str] = &[$( $wgsl ),+];

            /// The op applied to one value: the CPU backend's math, from the table's row.
            #[inline]
            pub(crate) fn apply<T: Float>(self, x: T) -> T {
                match self {
                    $( UnaryOp::$name $( ( $($p),+ ) )? => {
                        $( $( let $p: T = lit($p); )+ )?
                        let $x = x;
                        $body
                    } )+
                }
            }

            /// The op's number in the GPU kernel: its index in the table.
            pub(crate) fn code(self) -> u32 {
                #[allow(dead_code)]
                enum Code { $( $name ),+ }
                match self {
                    $( UnaryOp::$name { .. } => Code::$name as u32, )+
                }
            }

            /// The op's constant parameters in declaration order, padded with zeros to two.
            pub(crate) fn params(self) -> [f64; 2] {
                let given: &[f64] = match self {
                    $( UnaryOp::$name $( ( $($p),+ ) )? => &[ $( $($p),+ )? ], )+
                };
                [given.first().copied().unwrap_or(0.0), given.get(1).copied().unwrap_or(0.0)]
            }
        }
    };
    (@f64 $p:ident) => { f64 };
}

/// Declares `BinaryOp` from rows `Name => |a, b| math`, with `apply`, `code` and `NAMES`.
macro_rules! binary_ops {
    ($( $(#[$doc:meta])* $name:ident => |$a:ident, $b:ident| $body:expr, wgsl $wgsl:literal );+ $(;)?) => {
        /// Elementwise functions of two inputs (with broadcasting through strides). Comparisons
        /// return 1 or 0 in the inputs' dtype. The rows of the table in
        /// `backend/elementwise_ops.rs`.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum BinaryOp {
            $( $(#[$doc])* $name ),+
        }

        impl BinaryOp {
            /// The variant names in table order (a variant's index is its [`BinaryOp::code`]).
            pub(crate) const NAMES: &'static [&'static str] = &[$( stringify!($name) ),+];
            /// Each op's WGSL body in table order (statements over `a`, `b` that `return` an
            /// f32), from which `apply_binary` is generated.
            pub(crate) const WGSL: &'static [&'static str] = &[$( $wgsl ),+];

            /// The op applied to one pair of values: the CPU backend's math.
            #[inline]
            pub(crate) fn apply<T: Float>(self, a: T, b: T) -> T {
                match self {
                    $( BinaryOp::$name => {
                        let ($a, $b) = (a, b);
                        $body
                    } )+
                }
            }

            /// The op's number in the GPU kernel: its index in the table.
            pub(crate) fn code(self) -> u32 {
                self as u32
            }
        }
    };
}

unary_ops! {
    /// `-x`
    Neg => |x| -x, wgsl "return -x;";
    /// `e^x`
    Exp => |x| x.exp(), wgsl "return exp(x);";
    /// natural logarithm
    Log => |x| x.ln(), wgsl "return log_f(x);";
    /// square root
    Sqrt => |x| x.sqrt(), wgsl "return sqrt_f(x);";
    /// `|x|`
    Abs => |x| x.abs(), wgsl "return abs(x);";
    /// `max(x, 0)`
    Relu => |x| x.max(T::zero()), wgsl "return rmax(x, 0.0);";
    /// GELU, tanh approximation: `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`
    Gelu => |x| {
        let k: T = lit(0.797_884_560_802_865_4); // sqrt(2/pi)
        let inner = k * (x + lit::<T>(0.044715) * x * x * x);
        lit::<T>(0.5) * x * (T::one() + inner.tanh())
    }, wgsl "let inner = GELU_K * (x + GELU_C * x * x * x); return 0.5 * x * (1.0 + tanh_safe(inner));";
    /// derivative of [`UnaryOp::Gelu`]
    GeluGrad => |x| {
        let k: T = lit(0.797_884_560_802_865_4);
        let inner = k * (x + lit::<T>(0.044715) * x * x * x);
        let t = inner.tanh();
        let dinner = k * (T::one() + lit::<T>(3.0 * 0.044715) * x * x);
        lit::<T>(0.5) * (T::one() + t) + lit::<T>(0.5) * x * (T::one() - t * t) * dinner
    }, wgsl "return gelu_grad(x);";
    /// `x·σ(x)`
    Silu => |x| x / (T::one() + (-x).exp()), wgsl "return x / (1.0 + exp(-x));";
    /// `tanh(x)`
    Tanh => |x| x.tanh(), wgsl "return tanh_safe(x);";
    /// `1 / (1 + e^-x)`
    Sigmoid => |x| T::one() / (T::one() + (-x).exp()), wgsl "return 1.0 / (1.0 + exp(-x));";
    /// `ln(1 + e^x)`, computed stably as `max(x,0) + ln(1 + e^-|x|)`
    Softplus => |x| x.max(T::zero()) + (-x.abs()).exp().ln_1p(), wgsl "return rmax(x, 0.0) + log1p_f(exp(-abs(x)));";
    /// `1 / x`
    Recip => |x| T::one() / x, wgsl "return 1.0 / x;";
    /// `1` where `x > 0`, else `0`
    Step => |x| flag(x > T::zero()), wgsl "return select(0.0, 1.0, x > 0.0);";
    /// `-1`, `0` or `1`
    Sign => |x| flag::<T>(x > T::zero()) - flag::<T>(x < T::zero()), wgsl "if (x > 0.0) { return 1.0; } if (x < 0.0) { return -1.0; } return 0.0;";
    /// `x^p` for a constant `p`
    Powf(p: f64) => |x| x.powf(p), wgsl "return powf(x, p0);";
    /// `min(max(x, lo), hi)`
    Clamp(lo: f64, hi: f64) => |x| x.max(lo).min(hi), wgsl "return rmin(rmax(x, p0), p1);";
    /// `x + c`
    AddScalar(c: f64) => |x| x + c, wgsl "return x + p0;";
    /// `x · c`
    MulScalar(c: f64) => |x| x * c, wgsl "return x * p0;";
    /// softsign, `x / (1 + |x|)`: a sigmoid-shaped squashing into (−1, 1) with polynomial tails
    Softsign => |x| x / (T::one() + x.abs()), wgsl "return x / (1.0 + abs(x));";
}

binary_ops! {
    /// `a + b`
    Add => |a, b| a + b, wgsl "return a + b;";
    /// `a - b`
    Sub => |a, b| a - b, wgsl "return a - b;";
    /// `a · b`
    Mul => |a, b| a * b, wgsl "return a * b;";
    /// `a / b`
    Div => |a, b| a / b, wgsl "return a / b;";
    /// `max(a, b)`
    Max => |a, b| a.max(b), wgsl "return rmax(a, b);";
    /// `min(a, b)`
    Min => |a, b| a.min(b), wgsl "return rmin(a, b);";
    /// `a^b` (no tensor op uses it yet: `Tensor::powf` is the unary `Powf`; the backend's own
    /// tests check it on both devices)
    #[cfg_attr(not(test), allow(dead_code))]
    Pow => |a, b| a.powf(b), wgsl "return powf(a, b);";
    /// `a > b`
    Gt => |a, b| flag(a > b), wgsl "return select(0.0, 1.0, a > b);";
    /// `a >= b`
    Ge => |a, b| flag(a >= b), wgsl "return select(0.0, 1.0, a >= b);";
    /// `a < b`
    Lt => |a, b| flag(a < b), wgsl "return select(0.0, 1.0, a < b);";
    /// `a <= b`
    Le => |a, b| flag(a <= b), wgsl "return select(0.0, 1.0, a <= b);";
    /// `a == b`
    Eq => |a, b| flag(a == b), wgsl "return select(0.0, 1.0, a == b);";
    /// `a != b`
    Ne => |a, b| flag(a != b), wgsl "return select(1.0, 0.0, a == b);";
    /// `a · gelu'(b)`: GELU's backward in one pass, the upstream gradient `a` times the slope of
    /// GELU (tanh form) at the input `b`
    GeluBackward => |a, b| a * UnaryOp::GeluGrad.apply(b), wgsl "return a * gelu_grad(b);";
}

/// The WGSL name of unary op `name` (`"GeluGrad"` -> `"UNARY_GELU_GRAD"`).
pub(crate) fn unary_wgsl_name(name: &str) -> String {
    format!("UNARY_{}", upper_snake(name))
}

/// The WGSL name of binary op `name` (`"GeluBackward"` -> `"BINARY_GELU_BACKWARD"`).
pub(crate) fn binary_wgsl_name(name: &str) -> String {
    format!("BINARY_{}", upper_snake(name))
}

/// The WGSL the op tables generate for `shaders/elementwise.wgsl`, appended to it when it is
/// compiled: one `const UNARY_…: u32 = code;` line per unary op and one `BINARY_…` per binary
/// op (the codes the launchers pass), and the two functions the kernels call,
/// `apply_unary(op, x, p0, p1)` and `apply_binary(op, a, b)`, each a `switch` with one `case`
/// per row holding the row's WGSL body (an unknown code gives NaN).
pub(crate) fn wgsl_elementwise_ops() -> String {
    let mut s = String::from("\n// ---- generated from src/backend/elementwise_ops.rs ----\n");
    let unary: Vec<String> = UnaryOp::NAMES.iter().map(|n| unary_wgsl_name(n)).collect();
    let binary: Vec<String> = BinaryOp::NAMES
        .iter()
        .map(|n| binary_wgsl_name(n))
        .collect();
    for (code, name) in unary.iter().enumerate().chain(binary.iter().enumerate()) {
        s.push_str(&format!("const {name}: u32 = {code}u;\n"));
    }
    let switch = |names: &[String], bodies: &[&str]| -> String {
        let cases: String = names
            .iter()
            .zip(bodies)
            .map(|(name, body)| format!("        case {name}: {{ {body} }}\n"))
            .collect();
        format!("    switch op {{\n{cases}        default: {{ return nan_f32(); }}\n    }}\n")
    };
    s.push_str("\nfn apply_unary(op: u32, x: f32, p0: f32, p1: f32) -> f32 {\n");
    s.push_str(&switch(&unary, UnaryOp::WGSL));
    s.push_str("}\n\nfn apply_binary(op: u32, a: f32, b: f32) -> f32 {\n");
    s.push_str(&switch(&binary, BinaryOp::WGSL));
    s.push_str("}\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_table_positions_and_names_are_wgsl_spelled() {
        assert_eq!(UnaryOp::Neg.code(), 0);
        assert_eq!(UnaryOp::Powf(3.0).code(), 15);
        assert_eq!(
            UnaryOp::NAMES[UnaryOp::Clamp(0.0, 1.0).code() as usize],
            "Clamp"
        );
        assert_eq!(
            BinaryOp::NAMES[BinaryOp::GeluBackward.code() as usize],
            "GeluBackward"
        );
        assert_eq!(UnaryOp::Clamp(-1.0, 2.0).params(), [-1.0, 2.0]);
        assert_eq!(UnaryOp::Exp.params(), [0.0, 0.0]);
        assert_eq!(unary_wgsl_name("GeluGrad"), "UNARY_GELU_GRAD");
        assert_eq!(binary_wgsl_name("GeluBackward"), "BINARY_GELU_BACKWARD");
        let wgsl = wgsl_elementwise_ops();
        assert!(wgsl.contains("const UNARY_MUL_SCALAR: u32 = 18u;"));
        assert!(wgsl.contains("const BINARY_NE: u32 = 12u;"));
        // each row's body lands in its op's case
        assert!(wgsl.contains("case UNARY_SOFTSIGN: { return x / (1.0 + abs(x)); }"));
        assert!(wgsl.contains("case BINARY_GELU_BACKWARD: { return a * gelu_grad(b); }"));
        assert_eq!(wgsl.matches("case UNARY_").count(), UnaryOp::NAMES.len());
        assert_eq!(wgsl.matches("case BINARY_").count(), BinaryOp::NAMES.len());
    }

    #[test]
    fn softsign_follows_its_definition() {
        for x in [-3.0f64, -0.5, 0.0, 0.25, 7.0] {
            assert_eq!(UnaryOp::Softsign.apply(x), x / (1.0 + x.abs()));
        }
    }
}
