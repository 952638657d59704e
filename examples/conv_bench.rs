//! Times 2-D convolution and pooling on the CPU in f32 at the layer shapes of the image models
//! (`cnn` on MNIST, batch 64; the CNN experts of `mmoe-cnn` on MultiMNIST, 512 routed images over
//! 8 experts): the dedicated kernels (`Tensor::conv2d` / `grouped_conv2d`, forward and forward +
//! backward), the composed im2col path they replaced (`Tensor::conv2d_unfolded`), and a direct
//! convolution written here as plain loops (each output row accumulated as `weight × input row`
//! over the window, which the compiler vectorises), the alternative to im2col + GEMM. Prints the
//! median milliseconds of each and the GFLOP/s of the forward pass.
//!
//! `cargo run --release --example conv_bench`

use moegrad::{DType, Device, Result, Tensor};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::time::Instant;

fn values(n: usize, rng: &mut ChaCha8Rng) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// Median milliseconds of `f` over `reps` runs after two warm-up runs.
fn time(reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..2 {
        f()?;
    }
    let mut ms = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t = Instant::now();
        f()?;
        ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    ms.sort_by(|a, b| a.total_cmp(b));
    Ok(ms[reps / 2])
}

/// One convolution layer of a model: `images` of `c × side × side`, `oc` 5×5 filters per bank.
struct Layer {
    name: &'static str,
    images: usize,
    c: usize,
    side: usize,
    oc: usize,
    banks: usize,
    /// whether backward computes the input gradient (not for a network's first layer)
    input_grad: bool,
}

const K: usize = 5;

/// Direct convolution, stride 1, no padding, one bank: for each image, output channel and
/// window offset, every output row adds `w × (the input row it reads)`.
fn direct_conv(x: &[f32], w: &[f32], l: &Layer) -> Vec<f32> {
    use rayon::prelude::*;
    let (side, o) = (l.side, l.side - K + 1);
    let mut y = vec![0.0f32; l.images * l.oc * o * o];
    y.par_chunks_mut(l.oc * o * o)
        .enumerate()
        .for_each(|(b, yb)| {
            let img = &x[b * l.c * side * side..(b + 1) * l.c * side * side];
            for (oc, plane) in yb.chunks_mut(o * o).enumerate() {
                for c in 0..l.c {
                    let src = &img[c * side * side..(c + 1) * side * side];
                    for i in 0..K {
                        for j in 0..K {
                            let wv = w[((oc * l.c + c) * K + i) * K + j];
                            for (oy, row) in plane.chunks_mut(o).enumerate() {
                                let s = &src[(oy + i) * side + j..][..o];
                                row.iter_mut().zip(s).for_each(|(r, &v)| *r += wv * v);
                            }
                        }
                    }
                }
            }
        });
    y
}

fn main() -> Result<()> {
    let dev = Device::cpu();
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let layers = [
        Layer {
            name: "cnn conv1   64×1×28² → 10",
            images: 64,
            c: 1,
            side: 28,
            oc: 10,
            banks: 1,
            input_grad: false,
        },
        Layer {
            name: "cnn conv2   64×10×12² → 20",
            images: 64,
            c: 10,
            side: 12,
            oc: 20,
            banks: 1,
            input_grad: true,
        },
        Layer {
            name: "mmoe conv1 512×1×36² → 10, 8 banks",
            images: 512,
            c: 1,
            side: 36,
            oc: 10,
            banks: 8,
            input_grad: false,
        },
        Layer {
            name: "mmoe conv2 512×10×16² → 20, 8 banks",
            images: 512,
            c: 10,
            side: 16,
            oc: 20,
            banks: 8,
            input_grad: true,
        },
    ];
    println!(
        "threads {}; median ms (forward GFLOP/s)",
        rayon::current_num_threads()
    );
    for l in &layers {
        let o = l.side - K + 1;
        let flops = 2.0 * (l.images * l.oc * o * o * l.c * K * K) as f64;
        let xv = values(l.images * l.c * l.side * l.side, &mut rng);
        let wv = values(l.banks * l.oc * l.c * K * K, &mut rng);
        let x = Tensor::from_f32(xv.clone(), &[l.images, l.c, l.side, l.side], dev)?;
        let w = Tensor::from_f32(wv.clone(), &[l.banks, l.oc, l.c, K, K], dev)?;
        let bank: Vec<i32> = (0..l.images)
            .map(|b| (b * l.banks / l.images) as i32)
            .collect();
        let bank = Tensor::from_i32(bank, &[l.images], dev)?;
        let conv = |x: &Tensor, w: &Tensor| x.grouped_conv2d(w, &bank, 1, 0);
        let fwd = time(21, || moegrad::no_grad(|| conv(&x, &w)).map(|_| ()))?;
        let (xg, wg) = (
            if l.input_grad {
                x.detach().with_grad()?
            } else {
                x.detach()
            },
            w.detach().with_grad()?,
        );
        let both = time(11, || {
            let y = conv(&xg, &wg)?;
            y.backward_with(&Tensor::ones(y.shape(), DType::F32, dev)?)
        })?;
        println!(
            "{:<38} kernels: forward {fwd:7.2} ({:5.1}), forward+backward {both:7.2}",
            l.name,
            flops / fwd / 1e6
        );
        let direct = time(21, || {
            std::hint::black_box(direct_conv(&xv, &wv, l));
            Ok(())
        })?;
        println!(
            "{:<38} direct loops: forward {direct:7.2} ({:5.1}){}",
            "",
            flops / direct / 1e6,
            if l.banks > 1 { " (one bank)" } else { "" }
        );
        if l.banks == 1 {
            let w4 = w.reshape(&[l.oc, l.c, K, K])?;
            let composed = time(5, || {
                moegrad::no_grad(|| x.conv2d_unfolded(&w4, None, 1, 0)).map(|_| ())
            })?;
            println!("{:<38} composed im2col: forward {composed:7.2}", "");
        }
        let h = conv(&x, &w)?;
        let pool_fwd = time(21, || moegrad::no_grad(|| h.max_pool2d(2, 2)).map(|_| ()))?;
        let hg = h.detach().with_grad()?;
        let pool_both = time(11, || {
            let p = hg.max_pool2d(2, 2)?;
            p.backward_with(&Tensor::ones(p.shape(), DType::F32, dev)?)
        })?;
        println!(
            "{:<38} max_pool2d 2×2: forward {pool_fwd:7.2}, forward+backward {pool_both:7.2}",
            ""
        );
    }
    Ok(())
}
