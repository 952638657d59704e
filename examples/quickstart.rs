//! The smallest moegrad program: a tensor, an op, a gradient, checked against finite differences.
//!
//! Run with `cargo run --release --example quickstart` (on the GPU when there is one; set
//! `MOEGRAD_DEVICE=cpu` to force the CPU).

use moegrad::prelude::*;

fn main() -> Result<()> {
    let dev = Device::best()?;
    // loss = Σ relu(x·w): one matmul, one activation, one reduction.
    let w = Tensor::from_f32(vec![0.5, -1.0, 2.0, 0.0], &[2, 2], dev)?.with_grad()?;
    let x = Tensor::from_f32(vec![1.0, 2.0], &[1, 2], dev)?;
    let loss = x.matmul(&w)?.relu()?.sum_all()?;
    loss.backward()?;
    println!("loss = {}", loss.item()?);
    if let Some(g) = w.grad() {
        println!("dloss/dw = {:?}", g.to_vec_f32()?);
    }

    // The same function checked in f64 on the CPU against central differences.
    let w64 = Tensor::from_f64(vec![0.5, -1.0, 2.0, 0.1], &[2, 2], Device::cpu())?;
    let x64 = x.to_device(Device::cpu())?.to_dtype(DType::F64)?;
    let report = gradcheck(
        |t| x64.matmul(&t[0])?.relu()?.sum_all(),
        &[w64],
        &GradcheckOptions::default(),
    )?;
    println!("gradcheck passed: {report:?}");
    Ok(())
}
