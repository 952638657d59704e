//! The public custom-op API (`moegrad::autograd::custom_op`) and user WGSL kernels
//! (`moegrad::wgsl::WgslKernel`): a correct op records and differentiates; every misuse is an
//! error naming what is wrong, never a panic. The parts that need a GPU follow the suite's rule
//! (`common::gpu_or_skip`): they skip with a printed reason, or fail under `MOEGRAD_REQUIRE_GPU=1`.

mod common;

use moegrad::autograd::custom_op;
use moegrad::wgsl::WgslKernel;
use moegrad::{DType, Device, Error, Tensor};

fn leaf(values: Vec<f64>) -> Tensor {
    let n = values.len();
    Tensor::from_f64(values, &[n], Device::cpu())
        .unwrap()
        .with_grad()
        .unwrap()
}

/// `y = 2x` with the backward rule given by `rule`, summed and back-propagated.
fn backward_with_rule(
    rule: impl FnOnce(&Tensor) -> moegrad::Result<Vec<Option<Tensor>>> + Send + 'static,
) -> moegrad::Result<Tensor> {
    let x = leaf(vec![1.0, 2.0, 3.0]);
    let y = custom_op(
        "double",
        &[&x],
        |inputs| inputs[0].mul_scalar(2.0),
        move |ctx| rule(ctx.grad_output),
    )?;
    y.sum_all()?.backward()?;
    Ok(x)
}

#[test]
fn a_custom_op_records_and_its_rule_gives_the_gradient() {
    let x = backward_with_rule(|g| Ok(vec![Some(g.mul_scalar(2.0)?)])).unwrap();
    assert_eq!(x.grad().unwrap().to_vec_f64().unwrap(), vec![2.0; 3]);
    // untracked when no input requires grad: the forward's value as it is
    let c = Tensor::from_f64(vec![1.0], &[1], Device::cpu()).unwrap();
    let y = custom_op(
        "double",
        &[&c],
        |i| i[0].mul_scalar(2.0),
        |_| Ok(vec![None]),
    )
    .unwrap();
    assert!(y.is_leaf() && !y.requires_grad());
    assert_eq!(y.to_vec_f64().unwrap(), vec![2.0]);
}

#[test]
fn a_rule_returning_the_wrong_number_of_gradients_is_an_error() {
    let g2 = |g: &Tensor| Ok(vec![Some(g.clone()), Some(g.clone())]);
    let e = backward_with_rule(g2).unwrap_err();
    assert!(
        matches!(&e, Error::Autograd(m) if m.contains("'double'") && m.contains("2 gradient(s) for 1 input(s)")),
        "{e}"
    );
}

#[test]
fn a_gradient_of_the_wrong_shape_dtype_or_device_is_an_error() {
    let wrong_shape = |_: &Tensor| Ok(vec![Some(Tensor::zeros(&[2], DType::F64, Device::cpu())?)]);
    let e = backward_with_rule(wrong_shape).unwrap_err();
    assert!(
        matches!(&e, Error::Autograd(m) if m.contains("[2]") && m.contains("[3]")),
        "{e}"
    );
    let wrong_dtype = |g: &Tensor| Ok(vec![Some(g.to_dtype(DType::F32)?)]);
    let e = backward_with_rule(wrong_dtype).unwrap_err();
    assert!(
        matches!(&e, Error::Autograd(m) if m.contains("f32") && m.contains("f64")),
        "{e}"
    );
    if let Some(gpu) =
        common::gpu_or_skip("a_gradient_of_the_wrong_shape_dtype_or_device_is_an_error")
    {
        let on_gpu = move |g: &Tensor| Ok(vec![Some(g.to_device(gpu)?)]);
        let e = backward_with_rule(on_gpu).unwrap_err();
        assert!(
            matches!(&e, Error::Autograd(m) if m.contains("input 0")),
            "{e}"
        );
    }
}

#[test]
fn bad_inputs_and_outputs_are_errors() {
    let e = custom_op(
        "none",
        &[],
        |_| Tensor::zeros(&[1], DType::F32, Device::cpu()),
        |_| Ok(vec![]),
    )
    .unwrap_err();
    assert!(
        matches!(&e, Error::Invalid(m) if m.contains("at least one input")),
        "{e}"
    );
    let Some(gpu) = common::gpu_or_skip("bad_inputs_and_outputs_are_errors (the device checks)")
    else {
        return;
    };
    let a = leaf(vec![1.0]).to_dtype(DType::F32).unwrap();
    let b = Tensor::from_f32(vec![1.0], &[1], gpu).unwrap();
    let e = custom_op(
        "mixed",
        &[&a, &b],
        |i| Ok(i[0].clone()),
        |_| Ok(vec![None, None]),
    )
    .unwrap_err();
    assert!(
        matches!(&e, Error::Device(m) if m.contains("input 1")),
        "{e}"
    );
    let e = custom_op("moved", &[&a], |i| i[0].to_device(gpu), |_| Ok(vec![None])).unwrap_err();
    assert!(
        matches!(&e, Error::Device(m) if m.contains("'moved'")),
        "{e}"
    );
}

const COPY: &str = "
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@compute @workgroup_size(64)
fn copy(@builtin(global_invocation_id) id: vec3<u32>) {
    if id.x < arrayLength(&x) { y[id.x] = x[id.x] + 1.0; }
}";

#[test]
fn wgsl_kernels_that_break_the_rules_are_errors() {
    let bad = |source: &str, entry: &str| match WgslKernel::new("k", source, entry) {
        Err(Error::Gpu(m)) => m,
        other => panic!("expected a GPU error, got {other:?}"),
    };
    assert!(bad("fn main( {", "main").contains("does not parse"));
    // a type error (naga's front end reports it, with the line)
    assert!(bad("fn f() -> f32 { return true; }", "f").contains("return true"));
    assert!(bad(COPY, "nope").contains("no @compute entry point named \"nope\""));
    let output_read_only = "
        @group(0) @binding(1) var<storage, read> x: array<f32>;
        @group(0) @binding(2) var<storage, read> y: array<f32>;
        @compute @workgroup_size(1) fn main() { let a = x[0] + y[0]; }";
    assert!(
        bad(output_read_only, "main")
            .contains("output @binding(2) must be var<storage, read_write>")
    );
    let input_writable = COPY.replace("<storage, read>", "<storage, read_write>");
    assert!(bad(&input_writable, "copy").contains("must be var<storage, read>"));
    let skipped = COPY.replace("@binding(2)", "@binding(3)");
    assert!(bad(&skipped, "copy").contains("none skipped"));
    let k = WgslKernel::new("copy", COPY, "copy").unwrap();
    assert_eq!((k.inputs(), k.workgroup_size()), (1, [64, 1, 1]));
    // on CPU tensors and with the wrong number of inputs: errors before any GPU is touched
    let cpu = Tensor::from_f32(vec![1.0], &[1], Device::cpu()).unwrap();
    let e = k
        .run(&[&cpu], &[1], DType::F32, &[], [1, 1, 1])
        .unwrap_err();
    assert!(
        matches!(&e, Error::Device(m) if m.contains("input 0")),
        "{e}"
    );
    let e = k
        .run(&[&cpu, &cpu], &[1], DType::F32, &[], [1, 1, 1])
        .unwrap_err();
    assert!(
        matches!(&e, Error::Invalid(m) if m.contains("reads 1 input(s), 2 given")),
        "{e}"
    );
}

#[test]
fn a_wgsl_kernel_runs_on_gpu_tensors() {
    let Some(gpu) = common::gpu_or_skip("a_wgsl_kernel_runs_on_gpu_tensors") else {
        return;
    };
    let k = WgslKernel::new("copy", COPY, "copy").unwrap();
    let x = Tensor::from_f32(vec![1.0, 2.0, 3.0], &[3], gpu).unwrap();
    let y = k.run(&[&x], &[3], DType::F32, &[], [1, 1, 1]).unwrap();
    assert_eq!(y.device(), gpu);
    assert_eq!(y.to_vec_f32().unwrap(), vec![2.0, 3.0, 4.0]);
    let e = k
        .run(&[&x], &[3], DType::F32, &[], [u32::MAX, 1, 1])
        .unwrap_err();
    assert!(
        matches!(&e, Error::Invalid(m) if m.contains("device limit")),
        "{e}"
    );
}
