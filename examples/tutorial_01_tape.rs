//! Tutorial chapter 1 (`docs/tutorial/01-tensors-and-the-tape.md`): tensors, the tape that ops
//! record, `backward`, and `gradcheck`. Every claim the chapter makes is asserted here.
//!
//! Run with `cargo run --release --example tutorial_01_tape`.

use moegrad::gradcheck::{GradcheckOptions, gradcheck};
use moegrad::{DType, Device, Tensor};

fn main() -> moegrad::Result<()> {
    let cpu = Device::cpu();

    // 1. A tensor: data, a shape, a dtype, a device. Shapes broadcast as in NumPy.
    let a = Tensor::from_f32(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3], cpu)?;
    let row = Tensor::from_f32(vec![10.0, 20.0, 30.0], &[3], cpu)?;
    let sum = a.add(&row)?;
    assert_eq!(sum.shape(), &[2, 3]);
    assert_eq!(sum.to_vec_f32()?, vec![11.0, 22.0, 33.0, 14.0, 25.0, 36.0]);
    println!(
        "a + row = {:?} (shape {:?})",
        sum.to_vec_f32()?,
        sum.shape()
    );

    // Bad input is an error value, never a panic: [2, 3]·[2, 3] does not multiply.
    let err = a
        .matmul(&a)
        .expect_err("a [2,3]·[2,3] matmul must be refused");
    println!("a.matmul(&a) is refused: {err}");

    // 2. The tape. A tensor made with `with_grad` is a leaf that requires a gradient; every op
    // with such an input records a node (its name, inputs and backward rule).
    let w = Tensor::from_f64(vec![0.5, -1.0, 0.25, 2.0, 0.0, -0.5], &[3, 2], cpu)?.with_grad()?;
    let b = Tensor::from_f64(vec![0.1, -0.2], &[2], cpu)?.with_grad()?;
    let x = Tensor::from_f64(vec![1.0, 2.0, -1.0, 0.5, -0.5, 3.0], &[2, 3], cpu)?;
    let target = Tensor::from_f64(vec![1.0, 0.0, -1.0, 2.0], &[2, 2], cpu)?;
    assert!(w.is_leaf() && w.requires_grad());
    assert!(!x.requires_grad(), "data do not require gradients");
    let pred = x.matmul(&w)?.add(&b)?;
    let err_t = pred.sub(&target)?;
    let loss = err_t.mul(&err_t)?.mean_all()?;
    assert_eq!(pred.op_name(), Some("add"));
    // mean_all is written as two ops, sum_all then mul_scalar(1/N), each recording its own
    // node: the last node recorded is the multiplication.
    assert_eq!(loss.op_name(), Some("mul_scalar"));
    println!(
        "loss = {:.6}, made by {:?} from a {:?} made by {:?}",
        loss.item()?,
        loss.op_name(),
        pred.shape(),
        pred.op_name()
    );

    // 3. backward walks the tape in reverse and leaves ∂loss/∂leaf on every leaf.
    loss.backward()?;
    let gw = w
        .grad()
        .expect("w requires grad, so backward gives it a gradient");
    let gb = b.grad().expect("b requires grad");
    assert!(
        x.grad().is_none(),
        "x does not require grad, so it gets none"
    );

    // The same gradients by hand: L = (1/N) Σ (xW + b − t)², N = 4, so
    // ∂L/∂W = (2/N)·xᵀ(xW + b − t) and ∂L/∂b = (2/N)·Σ_rows (xW + b − t).
    let (gw_hand, gb_hand) = moegrad::no_grad(|| -> moegrad::Result<(Tensor, Tensor)> {
        let r = x.matmul(&w)?.add(&b)?.sub(&target)?.mul_scalar(2.0 / 4.0)?;
        Ok((x.transpose(0, 1)?.matmul(&r)?, r.sum(&[0], false)?))
    })?;
    for (auto, hand, name) in [(&gw, &gw_hand, "W"), (&gb, &gb_hand, "b")] {
        for (p, q) in auto.to_vec_f64()?.iter().zip(hand.to_vec_f64()?) {
            assert!((p - q).abs() < 1e-12, "∂L/∂{name}: tape {p} vs hand {q}");
        }
    }
    println!("∂L/∂W = {:?} (= (2/N)·xᵀ(xW + b − t))", gw.to_vec_f64()?);
    println!("∂L/∂b = {:?}", gb.to_vec_f64()?);

    // The graph is released after backward: a second backward through it is an error.
    let again = loss.backward().expect_err("the tape was released");
    println!("a second backward is refused: {again}");

    // Gradients accumulate until zero_grad: a new forward and backward adds to them.
    let loss2 = x.matmul(&w)?.add(&b)?.sub(&target)?.powf(2.0)?.mean_all()?;
    loss2.backward()?;
    let doubled = w.grad().expect("still there").to_vec_f64()?;
    for (twice, once) in doubled.iter().zip(gw.to_vec_f64()?) {
        assert!(
            (twice - 2.0 * once).abs() < 1e-12,
            "accumulated {twice} vs 2·{once}"
        );
    }
    w.zero_grad();
    assert!(w.grad().is_none());
    println!("gradients accumulate over backward calls until zero_grad");

    // no_grad: nothing is recorded, so the result is off the tape.
    let frozen = moegrad::no_grad(|| x.matmul(&w))?;
    assert!(!frozen.requires_grad() && frozen.op_name().is_none());

    // 4. gradcheck: the Jacobian from backward against central differences, in f64 on the CPU.
    // Here the same loss as a function of (W, b), plus a softmax to make it less linear.
    let report = gradcheck(
        |t| {
            let r = x.matmul(&t[0])?.add(&t[1])?.softmax(-1)?.sub(&target)?;
            r.mul(&r)?.mean_all()
        },
        &[w.detach(), b.detach()],
        &GradcheckOptions::default(),
    )?;
    println!("gradcheck passed: {report:?}");

    // gradcheck is a check that can fail: a function whose gradient is wrong at the point
    // (relu at 0: the tape says relu'(0) = 0, the central difference (ε − 0)/2ε says ½) is
    // reported as a failure.
    let kink = Tensor::from_f64(vec![0.0, 1.0], &[2], cpu)?;
    let failed = gradcheck(
        |t| t[0].relu()?.sum_all(),
        &[kink],
        &GradcheckOptions::default(),
    );
    assert!(failed.is_err(), "relu at 0 must not pass gradcheck");
    println!(
        "gradcheck refuses relu at its kink: {}",
        failed.err().map(|e| e.to_string()).unwrap_or_default()
    );

    // dtypes: the same ops in f32 (the training dtype) as in f64 (the checking dtype).
    let x32 = x.to_dtype(DType::F32)?;
    assert_eq!(x32.dtype(), DType::F32);

    // 5. The same forward and backward on the GPU, when there is one: every op above is also a
    // WGSL kernel, and the gradients agree with the CPU's to f32 rounding.
    gpu_part(&x, &w, &b, &target)?;

    println!("tutorial_01_tape: all checks passed");
    Ok(())
}

/// Runs the linear fit of part 2 in f32 on the GPU and compares its gradients with the CPU's.
/// Without a GPU adapter it prints why and skips, unless `MOEGRAD_REQUIRE_GPU=1` (as in CI),
/// which makes a missing adapter an error.
fn gpu_part(x: &Tensor, w: &Tensor, b: &Tensor, target: &Tensor) -> moegrad::Result<()> {
    let gpu = match Device::gpu() {
        Ok(gpu) => gpu,
        Err(e) if std::env::var("MOEGRAD_REQUIRE_GPU").as_deref() == Ok("1") => return Err(e),
        Err(e) => {
            println!("GPU part skipped: no GPU adapter ({e})");
            return Ok(());
        }
    };
    let on = |t: &Tensor, dev: Device| t.to_dtype(DType::F32)?.to_device(dev);
    let mut grads = Vec::new();
    for dev in [Device::cpu(), gpu] {
        let (w, b) = (on(w, dev)?.with_grad()?, on(b, dev)?.with_grad()?);
        let r = on(x, dev)?.matmul(&w)?.add(&b)?.sub(&on(target, dev)?)?;
        r.mul(&r)?.mean_all()?.backward()?;
        let gw = w.grad().expect("w requires grad").to_vec_f32()?;
        grads.push(gw);
    }
    for (c, g) in grads[0].iter().zip(&grads[1]) {
        assert!(
            (c - g).abs() <= 1e-5 * (1.0 + c.abs()),
            "∂L/∂W: CPU {c} vs GPU {g}"
        );
    }
    println!("GPU: the same gradients as the CPU ({:?})", grads[1]);
    Ok(())
}
