//! Helpers shared by the integration tests: device selection with the CI rule (GPU tests skip
//! with a printed reason, unless `MOEGRAD_REQUIRE_GPU=1`, which turns a missing adapter into a
//! failure), small tensor builders, and the test loss of a training run's model before its first
//! step (so that end-to-end tests can assert that learning happened).
#![allow(dead_code)]

use moegrad::data::{Dataset, Mnist, SyntheticB, multimnist};
use moegrad::train::{DataKind, TrainConfig, build_model, build_synthetic_b};
use moegrad::{DType, Device, Result, Tensor};

/// `len` values drawn uniformly from `[lo, hi)` with a fixed seed.
pub fn uniform_vec(len: usize, lo: f64, hi: f64, seed: u64) -> Vec<f64> {
    use rand::{RngExt, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    (0..len).map(|_| rng.random_range(lo..hi)).collect()
}

/// The GPU, or `None` (after printing why) when there is no adapter and the GPU is not required.
pub fn gpu_or_skip(test: &str) -> Option<Device> {
    match Device::gpu() {
        Ok(d) => Some(d),
        Err(e) => {
            if std::env::var("MOEGRAD_REQUIRE_GPU").as_deref() == Ok("1") {
                panic!("{test}: MOEGRAD_REQUIRE_GPU=1 but no GPU adapter: {e}");
            }
            eprintln!("skipping {test}: no GPU adapter ({e})");
            None
        }
    }
}

/// Every device available here: the CPU, and the GPU when there is one (see [`gpu_or_skip`]).
pub fn devices(test: &str) -> Vec<Device> {
    let mut v = vec![Device::cpu()];
    v.extend(gpu_or_skip(test));
    v
}

/// An f64 CPU tensor.
pub fn f64t(values: &[f64], shape: &[usize]) -> Tensor {
    Tensor::from_f64(values.to_vec(), shape, Device::cpu()).expect("valid test tensor")
}

/// A tensor of `values` (f64 on the host) in `dtype` on `dev`.
pub fn tensor_on(values: Vec<f64>, shape: &[usize], dtype: DType, dev: Device) -> Tensor {
    Tensor::from_f64(values, shape, Device::cpu())
        .and_then(|t| t.to_dtype(dtype))
        .and_then(|t| t.to_device(dev))
        .expect("valid test tensor")
}

/// Asserts two slices agree within `atol + rtol·|expected|`, naming the first bad element. A NaN
/// on either side is a failure, NaN against NaN included: a check that lets NaN match NaN passes
/// when both sides are broken the same way. A test that expects NaN at known places uses
/// [`assert_close_nan_aware`], which says so.
pub fn assert_close(what: &str, got: &[f64], expected: &[f64], atol: f64, rtol: f64) {
    assert_eq!(got.len(), expected.len(), "{what}: lengths differ");
    for (i, (g, e)) in got.iter().zip(expected).enumerate() {
        // written so that a NaN on either side makes the comparison false
        assert!(
            (g - e).abs() <= atol + rtol * e.abs(),
            "{what}: element {i}: got {g}, expected {e} (atol {atol}, rtol {rtol})"
        );
    }
}

/// [`assert_close`] for results that hold NaN on purpose (a NaN input propagating): the NaN
/// positions of `got` and `expected` must be the same, and must not be all of them (a result of
/// NaN only would check nothing); every other element must agree as in [`assert_close`].
pub fn assert_close_nan_aware(what: &str, got: &[f64], expected: &[f64], atol: f64, rtol: f64) {
    assert_eq!(got.len(), expected.len(), "{what}: lengths differ");
    assert!(
        expected.is_empty() || expected.iter().any(|e| !e.is_nan()),
        "{what}: every expected element is NaN: nothing would be compared"
    );
    for (i, (g, e)) in got.iter().zip(expected).enumerate() {
        let ok = if e.is_nan() {
            g.is_nan()
        } else {
            (g - e).abs() <= atol + rtol * e.abs()
        };
        assert!(
            ok,
            "{what}: element {i}: got {g}, expected {e} (atol {atol}, rtol {rtol}; NaN only where NaN is expected)"
        );
    }
}

/// The test split a training run with `cfg` evaluates on, built as `moegrad::train::run` builds
/// it (the first `cfg.test_limit` examples), with what is needed to build its model.
pub struct TestSplit {
    /// the test examples
    pub data: Dataset,
    /// image side (0 for synthetic-b)
    pub side: usize,
    /// number of tasks
    pub tasks: usize,
    /// generator B's frozen bank (synthetic-b only)
    pub bank: Option<SyntheticB>,
}

/// Loads the test split of `cfg`'s data (see [`TestSplit`]).
pub fn test_split(cfg: &TrainConfig) -> TestSplit {
    let (data, side, tasks, bank) = match cfg.data {
        DataKind::Mnist => {
            let t = Mnist::load(&cfg.data_dir).expect("MNIST loads").test;
            let d = Dataset::new(t.images, vec![1, t.rows, t.cols], vec![t.labels]);
            (d.expect("valid MNIST split"), t.rows, 1, None)
        }
        DataKind::Multimnist => {
            let t = Mnist::load(&cfg.data_dir).expect("MNIST loads").test;
            let m = multimnist::compose(&t, cfg.seed.wrapping_add(1)).expect("MultiMNIST composes");
            let side = multimnist::CANVAS;
            let d = Dataset::new(m.images, vec![1, side, side], m.labels.to_vec());
            (d.expect("valid MultiMNIST split"), side, 2, None)
        }
        DataKind::SyntheticB => {
            let g = SyntheticB::generate(cfg.seed, cfg.experts, 10_000, 10_000)
                .expect("generator B runs");
            (g.test.clone(), 0, 1, Some(g))
        }
        DataKind::Shakespeare | DataKind::Text => {
            panic!(
                "test_split is for the image datasets, not {}",
                cfg.data.name()
            )
        }
    };
    let n = cfg.test_limit;
    let data = if n == 0 || n >= data.len() {
        data
    } else {
        let per: usize = data.sample_shape.iter().product();
        let labels = data.labels.iter().map(|l| l[..n].to_vec()).collect();
        Dataset::new(data.features[..n * per].to_vec(), data.sample_shape, labels)
            .expect("valid limited split")
    };
    TestSplit {
        data,
        side,
        tasks,
        bank,
    }
}

/// The mean test loss and accuracies of the model a training run with `cfg` starts from (built
/// from `cfg.seed` as `run` builds it), on `split`: the loss that training must lower.
pub fn initial_test_metrics(cfg: &TrainConfig, split: &TestSplit) -> (f64, Vec<f64>) {
    let device = Device::from_name(&cfg.device).expect("a known device");
    let model = match &split.bank {
        Some(bank) => build_synthetic_b(cfg, bank, device),
        None => build_model(cfg, split.side, split.tasks, device),
    }
    .expect("the model builds");
    moegrad::train::evaluate(model.as_ref(), &split.data, cfg.batch.max(256), device)
        .expect("the initial model evaluates")
}

/// Output values and the gradients of three inputs through `f` for the upstream gradient `up`
/// (on `f`'s output device and dtype): the values-and-gradients run of the three-operand fused
/// ops' tests (attention's q, k, v; layer norm's x, gamma, beta).
pub fn run3(
    f: impl Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>,
    inputs: &[Tensor; 3],
    up: &[f64],
) -> (Vec<f64>, [Vec<f64>; 3]) {
    let leaves = inputs
        .clone()
        .map(|t| t.detach().with_grad().expect("a float leaf"));
    let y = f(&leaves[0], &leaves[1], &leaves[2]).expect("forward");
    let g = Tensor::from_f64(up.to_vec(), y.shape(), Device::cpu())
        .and_then(|g| g.to_dtype(y.dtype()))
        .and_then(|g| g.to_device(y.device()))
        .expect("upstream gradient");
    y.backward_with(&g).expect("backward");
    let grads = leaves.map(|t| t.grad().expect("a gradient").to_vec_f64().unwrap());
    (y.to_vec_f64().unwrap(), grads)
}

/// The transformers fixtures of `tests/fixtures/hf` (written by `scripts/make_hf_fixtures.py`).
pub const HF_FIXTURES: [&str; 6] = [
    "llama",
    "mixtral",
    "qwen2_moe",
    "olmoe",
    "deepseek_v3",
    "gpt2",
];

/// The directory of the transformers fixture `name`, from either crate of the workspace.
pub fn hf_fixture(name: &str) -> std::path::PathBuf {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let here = root.join("tests/fixtures/hf");
    let dir = if here.is_dir() {
        here
    } else {
        root.join("../tests/fixtures/hf")
    };
    dir.join(name)
}

/// The test loss of a layer's output `y`, `Σ c⊙y + 0.1·Σ y²` with `c` drawn uniformly from
/// `[−1, 1)` (seed 99, one per element), in y's dtype and on its device; its gradient is
/// `g = c + 0.2·y`.
pub fn test_loss(y: &Tensor) -> Result<Tensor> {
    let c = Tensor::from_f64(
        uniform_vec(y.numel(), -1.0, 1.0, 99),
        y.shape(),
        Device::cpu(),
    )?
    .to_dtype(y.dtype())?
    .to_device(y.device())?;
    y.mul(&c)?
        .sum_all()?
        .add(&y.mul(y)?.sum_all()?.mul_scalar(0.1)?)
}

/// Sets every parameter of `model` to values drawn uniformly from `[lo, hi)` (parameter `i` in
/// visiting order from seed `seed + i`), in `dtype` on `dev`.
pub fn fill_params_uniform(
    model: &dyn moegrad::nn::Parameters,
    (lo, hi): (f64, f64),
    seed: u64,
    dtype: DType,
    dev: Device,
) {
    for (i, (_, p)) in model.named_params().into_iter().enumerate() {
        let v = uniform_vec(p.get().numel(), lo, hi, seed + i as u64);
        p.set(tensor_on(v, p.get().shape(), dtype, dev))
            .expect("a parameter of the same shape");
    }
}

/// The value of `model`'s parameter `name`, on the host.
pub fn param_values(model: &dyn moegrad::nn::Parameters, name: &str) -> Vec<f64> {
    named_param(model, name).get().to_vec_f64().unwrap()
}

/// The gradient of `model`'s parameter `name`, on the host (panics when it has none).
pub fn param_grad(model: &dyn moegrad::nn::Parameters, name: &str) -> Vec<f64> {
    named_param(model, name)
        .grad()
        .unwrap()
        .to_vec_f64()
        .unwrap()
}

fn named_param(model: &dyn moegrad::nn::Parameters, name: &str) -> moegrad::nn::Param {
    model
        .named_params()
        .into_iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| panic!("no parameter {name}"))
        .1
}
