//! Tutorial chapter 2 (`docs/tutorial/02-new-op.md`): writing a new op.
//!
//! The op is *squareplus* (So and Barron, 2021), a smooth ReLU that needs no `exp`:
//!
//! ```text
//! y = (x + √(x² + b)) / 2          dy/dx = (1 + x / √(x² + b)) / 2
//! ```
//!
//! It is built three ways, using only moegrad's public API, as a crate of your own would:
//! 1. composed of existing ops (the tape derives its backward);
//! 2. as a custom op ([`moegrad::autograd::custom_op`]) with a hand-written CPU kernel (host code
//!    on `&[f64]` / `&[f32]`) for the forward and the backward;
//! 3. the same custom op with WGSL kernels ([`moegrad::wgsl::WgslKernel`]) when the tensor is on
//!    the GPU.
//!
//! Each claim is checked (values and gradients agree, gradcheck passes in f64, the GPU agrees
//! with the CPU); a failed check ends the program with an error. The GPU part is skipped, with
//! the reason printed, when no GPU adapter can be opened.
//!
//! Run with `cargo run --release --example custom_op`.

use moegrad::HostData;
use moegrad::autograd::custom_op;
use moegrad::gradcheck::{GradcheckOptions, gradcheck};
use moegrad::wgsl::WgslKernel;
use moegrad::{DType, Device, Error, Result, Tensor};

/// The constant `b` of squareplus (the paper's default is 4: y(0) = 1).
const B: f64 = 4.0;

/// 1. Squareplus composed of existing ops; `backward` differentiates each of them.
fn squareplus_composed(x: &Tensor) -> Result<Tensor> {
    x.mul(x)?.add_scalar(B)?.sqrt()?.add(x)?.mul_scalar(0.5)
}

/// Applies `f` to every value of a float tensor on the CPU, keeping its dtype (host code: a
/// plain loop over `&[f64]` or `&[f32]`).
fn map_host(x: &Tensor, f: impl Fn(f64) -> f64) -> Result<Tensor> {
    match x.to_host()? {
        HostData::F64(v) => {
            Tensor::from_f64(v.iter().map(|&a| f(a)).collect(), x.shape(), x.device())
        }
        HostData::F32(v) => Tensor::from_f32(
            v.iter().map(|&a| f(a as f64) as f32).collect(),
            x.shape(),
            x.device(),
        ),
        other => Err(Error::DType(format!(
            "squareplus needs a float tensor, got {}",
            other.dtype()
        ))),
    }
}

/// The WGSL kernels of the op: the forward reads `x` and writes `y`; the backward reads `x` and
/// `∂L/∂y` and writes `∂L/∂x`. One invocation handles one element; `p.n` is the element count.
const SQUAREPLUS_WGSL: &str = r#"
struct Params { n: u32, b: f32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(256)
fn squareplus_forward(@builtin(global_invocation_id) id: vec3<u32>) {
    let i = id.x;
    if i >= p.n { return; }
    let v = x[i];
    y[i] = 0.5 * (v + sqrt(v * v + p.b));
}
"#;

const SQUAREPLUS_BACKWARD_WGSL: &str = r#"
struct Params { n: u32, b: f32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> grad_y: array<f32>;
@group(0) @binding(3) var<storage, read_write> grad_x: array<f32>;

@compute @workgroup_size(256)
fn squareplus_backward(@builtin(global_invocation_id) id: vec3<u32>) {
    let i = id.x;
    if i >= p.n { return; }
    let v = x[i];
    grad_x[i] = grad_y[i] * 0.5 * (1.0 + v / sqrt(v * v + p.b));
}
"#;

/// The two GPU kernels, validated once.
#[derive(Clone)]
struct SquareplusKernels {
    forward: WgslKernel,
    backward: WgslKernel,
}

impl SquareplusKernels {
    fn new() -> Result<SquareplusKernels> {
        Ok(SquareplusKernels {
            forward: WgslKernel::new("squareplus", SQUAREPLUS_WGSL, "squareplus_forward")?,
            backward: WgslKernel::new(
                "squareplus_backward",
                SQUAREPLUS_BACKWARD_WGSL,
                "squareplus_backward",
            )?,
        })
    }

    /// Runs `kernel` over the elements of `inputs[0]` (1-D grid of 256-wide workgroups).
    fn run(kernel: &WgslKernel, inputs: &[&Tensor]) -> Result<Tensor> {
        let x = inputs[0];
        let n = u32::try_from(x.numel())
            .map_err(|_| Error::Invalid(format!("squareplus: {} elements", x.numel())))?;
        let groups = n.div_ceil(kernel.workgroup_size()[0]);
        kernel.run(
            inputs,
            x.shape(),
            DType::F32,
            &[n, (B as f32).to_bits()],
            [groups, 1, 1],
        )
    }
}

/// 2. and 3. Squareplus as one custom op: host code on the CPU, the WGSL kernels on the GPU.
fn squareplus(x: &Tensor, kernels: &SquareplusKernels) -> Result<Tensor> {
    let k = kernels.clone();
    custom_op(
        "squareplus",
        &[x],
        |inputs| {
            let x = &inputs[0];
            match x.device() {
                Device::Cpu => map_host(x, |v| 0.5 * (v + (v * v + B).sqrt())),
                Device::Gpu => SquareplusKernels::run(&kernels.forward, &[x]),
            }
        },
        move |ctx| {
            let (x, g) = (&ctx.inputs[0], ctx.grad_output);
            let grad = match x.device() {
                // dy/dx on the host, then the chain rule's product with ∂L/∂y
                Device::Cpu => map_host(x, |v| 0.5 * (1.0 + v / (v * v + B).sqrt()))?.mul(g)?,
                Device::Gpu => SquareplusKernels::run(&k.backward, &[x, g])?,
            };
            Ok(vec![Some(grad)])
        },
    )
}

/// Fails with a message unless `ok`.
fn check(ok: bool, what: impl FnOnce() -> String) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(Error::Invalid(format!("check failed: {}", what())))
    }
}

/// The largest `|a − b| / (1 + |b|)` over two equally long lists.
fn max_rel_diff(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(a, b)| (a - b).abs() / (1.0 + b.abs()))
        .fold(0.0, f64::max)
}

/// The value of `f(x)` and the gradient of `Σ c ⊙ f(x)` with respect to `x` (c fixed).
fn value_and_grad(
    x: &Tensor,
    c: &Tensor,
    f: impl Fn(&Tensor) -> Result<Tensor>,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let x = x.detach().with_grad()?;
    let y = f(&x)?;
    y.mul(c)?.sum_all()?.backward()?;
    let grad = x
        .grad()
        .ok_or_else(|| Error::Autograd("x got no gradient".into()))?;
    Ok((y.to_vec_f64()?, grad.to_vec_f64()?))
}

fn main() -> Result<()> {
    let kernels = SquareplusKernels::new()?;
    let cpu = Device::cpu();
    let values: Vec<f64> = (0..12).map(|i| (i as f64 - 5.5) * 0.7).collect();
    let weights: Vec<f64> = (0..12).map(|i| ((i * 7) % 5) as f64 - 2.0).collect();
    let x = Tensor::from_f64(values.clone(), &[3, 4], cpu)?;
    let c = Tensor::from_f64(weights.clone(), &[3, 4], cpu)?;

    // The custom op agrees with the composed one, in value and gradient.
    let (y_composed, g_composed) = value_and_grad(&x, &c, squareplus_composed)?;
    let (y_custom, g_custom) = value_and_grad(&x, &c, |x| squareplus(x, &kernels))?;
    let (dy, dg) = (
        max_rel_diff(&y_custom, &y_composed),
        max_rel_diff(&g_custom, &g_composed),
    );
    check(dy < 1e-12 && dg < 1e-12, || {
        format!("custom vs composed on the CPU: values differ by {dy:e}, gradients by {dg:e}")
    })?;
    println!(
        "custom op (CPU kernel) = composed ops: values within {dy:.1e}, gradients within {dg:.1e}"
    );

    // The hand-written backward against central differences, in f64.
    let opts = GradcheckOptions::default();
    let report = gradcheck(
        |t| squareplus(&t[0], &kernels),
        std::slice::from_ref(&x),
        &opts,
    )?;
    println!("gradcheck of the custom op passed: {report:?}");
    gradcheck(
        |t| squareplus_composed(&t[0]),
        std::slice::from_ref(&x),
        &opts,
    )?;
    println!("gradcheck of the composed op passed");

    // The WGSL kernels against the CPU kernel, in f32.
    match Device::gpu() {
        Err(e) => println!("GPU part skipped: no GPU adapter could be opened ({e})"),
        Ok(gpu) => {
            let x32 = x.to_dtype(DType::F32)?;
            let c32 = c.to_dtype(DType::F32)?;
            let (y_cpu, g_cpu) = value_and_grad(&x32, &c32, |x| squareplus(x, &kernels))?;
            let (y_gpu, g_gpu) = value_and_grad(&x32.to_device(gpu)?, &c32.to_device(gpu)?, |x| {
                let y = squareplus(x, &kernels)?;
                check(y.device() == gpu, || {
                    format!("the output is on {}", y.device())
                })?;
                Ok(y)
            })?;
            let (dy, dg) = (max_rel_diff(&y_gpu, &y_cpu), max_rel_diff(&g_gpu, &g_cpu));
            check(dy < 1e-5 && dg < 1e-5, || {
                format!("GPU vs CPU: values differ by {dy:e}, gradients by {dg:e} (tolerance 1e-5)")
            })?;
            println!("GPU (WGSL kernels) = CPU: values within {dy:.1e}, gradients within {dg:.1e}");
        }
    }
    println!("custom_op example: all checks passed");
    Ok(())
}
