//! The layer norm's backward with the gradient its input already has folded into `dx`
//! (`NnOps::layer_norm_backward` with `pending`, reached through the tape's folding rules,
//! `Tensor::record_folding`): at the backend, `pending + dx` to the bit of the separate add, on
//! the CPU (f32, f64) and the GPU (f32, f16, f16 rows with f32 gamma); through the tape, a
//! residual connection `x + layer_norm(x)` gives `x` the bits of the two paths' gradients
//! added, and on the GPU its backward is the norm's two launches, no add.

use super::gpu_matmul::gpu;
use crate::backend::cpu::CpuBackend;
use crate::backend::{ElementwiseOps, HostData, LayerNormDims, NnOps};
use crate::{DType, Device, Tensor};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// `n` values in [-2, 2) that f32 holds.
pub(super) fn values(rng: &mut ChaCha8Rng, n: usize) -> Vec<f64> {
    (0..n)
        .map(|_| rng.random_range(-2.0f32..2.0) as f64)
        .collect()
}

/// The devices and dtypes a folding rule's tape test runs on: the CPU in f64 and f32, and the
/// GPU in f32 when `gpu` is there.
pub(super) fn fold_devices<T>(gpu: &Option<T>) -> Vec<(Device, DType)> {
    let mut devices = vec![(Device::Cpu, DType::F64), (Device::Cpu, DType::F32)];
    if gpu.is_some() {
        devices.push((Device::Gpu, DType::F32));
    }
    devices
}

/// `v` as a tensor of `shape` in `dtype` on `dev`.
pub(super) fn placed(v: &[f64], shape: &[usize], dtype: DType, dev: Device) -> Tensor {
    Tensor::from_f64(v.to_vec(), shape, Device::Cpu)
        .and_then(|t| t.to_dtype(dtype))
        .and_then(|t| t.to_device(dev))
        .unwrap()
}

/// `layer_norm_backward` with `pending` against the same without it followed by the tape's add
/// (`pending + dx`), on backend `be` with rows in `dtype` and gamma, beta in `param_dtype`: the
/// bits of dx, dgamma and dbeta (in f16 too: the kernel rounds dx to f16 before it adds the
/// pending gradient, as the add does).
fn fold_matches_the_sum<B: NnOps + ElementwiseOps>(
    be: &B,
    (dtype, param_dtype): (DType, DType),
    what: &str,
) {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    for (rows, dim) in [(1, 1), (5, 37), (3, 64), (7, 300)] {
        let up_as = |v: Vec<f64>, dtype: DType| {
            let data = match dtype {
                DType::F64 => HostData::F64(v),
                _ => HostData::F32(v.iter().map(|&x| x as f32).collect()),
            };
            let b = be.upload(&data).unwrap();
            match dtype {
                DType::F16 => be.cast(&b, DType::F16).unwrap(),
                _ => b,
            }
        };
        let up = |v: Vec<f64>| up_as(v, dtype);
        let n = rows * dim;
        let (x, g, pending) = (
            up(values(&mut rng, n)),
            up(values(&mut rng, n)),
            up(values(&mut rng, n)),
        );
        let (gamma, beta) = (
            up_as(values(&mut rng, dim), param_dtype),
            up_as(values(&mut rng, dim), param_dtype),
        );
        let dims = LayerNormDims {
            rows,
            dim,
            eps: 1e-5,
            centered: true,
        };
        let (_, mean, rstd) = be.layer_norm_forward(&x, &gamma, &beta, dims).unwrap();
        let stats = (&mean, &rstd);
        let (dx, dg, db) = be
            .layer_norm_backward(&g, &x, &gamma, stats, None, dims)
            .unwrap();
        let summed = be
            .binary(
                crate::backend::BinaryOp::Add,
                &pending,
                &[1],
                &dx,
                &[1],
                &[n],
            )
            .unwrap();
        let (fdx, fdg, fdb) = be
            .layer_norm_backward(&g, &x, &gamma, stats, Some(&pending), dims)
            .unwrap();
        let host = |b| be.download(b).unwrap();
        let at = format!("{what}, {rows}×{dim}");
        assert_eq!(
            host(&fdx),
            host(&summed),
            "{at}: dx with the pending gradient"
        );
        assert_eq!(host(&fdg), host(&dg), "{at}: dgamma");
        assert_eq!(host(&fdb), host(&db), "{at}: dbeta");
        // a pending gradient of the wrong length is an error, not a launch
        let short = up(vec![0.0; n + 1]);
        let err = be.layer_norm_backward(&g, &x, &gamma, stats, Some(&short), dims);
        assert!(
            matches!(err, Err(crate::Error::Shape(ref m)) if m.contains("pending gradient")),
            "{at}: {:?}",
            err.err()
        );
    }
}

#[test]
fn the_folded_dx_is_the_sum_to_the_bit_on_each_device() {
    let gpu = gpu("the_folded_dx_is_the_sum_to_the_bit_on_each_device");
    fold_matches_the_sum(&CpuBackend, (DType::F32, DType::F32), "CPU f32");
    fold_matches_the_sum(&CpuBackend, (DType::F64, DType::F64), "CPU f64");
    if let Some((be, _lock)) = &gpu {
        fold_matches_the_sum(be, (DType::F32, DType::F32), "GPU f32");
        if be.has_f16() {
            fold_matches_the_sum(be, (DType::F16, DType::F16), "GPU f16");
            fold_matches_the_sum(be, (DType::F16, DType::F32), "GPU f16 rows, f32 gamma");
        }
    }
}

/// `x + layer_norm(x)` backward from an upstream `w`: x's gradient is `w + dx(w)` to the bit
/// (what the tape's add gave before the fold), and on the GPU the walk runs the norm's two
/// kernels and nothing else.
#[test]
fn a_residual_connection_folds_into_the_norm_backward() {
    let gpu = gpu("a_residual_connection_folds_into_the_norm_backward");
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let (rows, dim) = (6, 45);
    let host = [
        values(&mut rng, rows * dim),
        values(&mut rng, dim),
        values(&mut rng, dim),
        values(&mut rng, rows * dim),
    ];
    for (dev, dtype) in fold_devices(&gpu) {
        let t = |v: &[f64], shape: &[usize]| placed(v, shape, dtype, dev);
        let x = t(&host[0], &[rows, dim]).with_grad().unwrap();
        let gamma = t(&host[1], &[dim]).with_grad().unwrap();
        let beta = t(&host[2], &[dim]).with_grad().unwrap();
        let w = t(&host[3], &[rows, dim]);
        let y = x.add(&x.layer_norm(&gamma, &beta, 1e-5).unwrap()).unwrap();
        let before = dev.gpu_stats();
        y.backward_with(&w).unwrap();
        if let (Some(b), Some(a)) = (before, dev.gpu_stats()) {
            assert_eq!(
                a.since(&b).dispatches,
                2,
                "GPU: the norm's dx (with the residual's gradient added) and its parameters"
            );
        }
        // the norm's dx alone, then the tape's add
        let x2 = t(&host[0], &[rows, dim]).with_grad().unwrap();
        let (g2, b2) = (gamma.detach(), beta.detach());
        x2.layer_norm(&g2, &b2, 1e-5)
            .unwrap()
            .backward_with(&w)
            .unwrap();
        let want = w.add(&x2.grad().unwrap()).unwrap();
        assert_eq!(
            x.grad().unwrap().to_vec_f64().unwrap(),
            want.to_vec_f64().unwrap(),
            "{dev} {dtype}: x's gradient"
        );
    }
}

/// The pending gradient past 65,535 rows (one workgroup a row, the grid folded into x and y):
/// every row of the folded grid adds its own rows of `pending`, to the bit of the unfolded dx
/// plus `pending` added on the host, from a NaN-poisoned pool so that an unwritten element
/// shows.
#[test]
fn the_fold_reads_its_rows_past_the_grid_limit() {
    use super::folded_grids::{fold_gpu, host_f64, poison_pool, random_f32, up_f32};
    use crate::backend::BufferOps;
    let Some((be, _lock)) = fold_gpu("the_fold_reads_its_rows_past_the_grid_limit") else {
        return;
    };
    let (rows, dim) = (crate::fold::smallest_folding(1), 3);
    crate::fold::assert_past_limit("layer_norm_backward_x", crate::fold::groups(rows, 1));
    let n = rows * dim;
    let pending = random_f32(53, n);
    let [x, g, p] =
        [random_f32(51, n), random_f32(52, n), pending.clone()].map(|v| up_f32(&be, &v));
    let (gamma, beta) = (
        up_f32(&be, &random_f32(54, dim)),
        up_f32(&be, &random_f32(55, dim)),
    );
    let dims = LayerNormDims {
        rows,
        dim,
        eps: 1e-5,
        centered: true,
    };
    let (_, mean, rstd) = be.layer_norm_forward(&x, &gamma, &beta, dims).unwrap();
    let stats = (&mean, &rstd);
    let (dx, _, _) = be
        .layer_norm_backward(&g, &x, &gamma, stats, None, dims)
        .unwrap();
    let dx = host_f64(be.download(&dx).unwrap());
    poison_pool(&be, n);
    let (folded, _, _) = be
        .layer_norm_backward(&g, &x, &gamma, stats, Some(&p), dims)
        .unwrap();
    let folded = host_f64(be.download(&folded).unwrap());
    let want: Vec<f64> = pending
        .iter()
        .zip(&dx)
        .map(|(&p, &d)| f64::from(p + d as f32))
        .collect();
    if let Some(i) = (0..n).find(|&i| folded[i].to_bits() != want[i].to_bits()) {
        panic!(
            "row {} of {rows}: dx {} with the pending gradient, expected {}",
            i / dim,
            folded[i],
            want[i]
        );
    }
}
