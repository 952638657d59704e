//! `moegrad export --format torch` (`moegrad::train::export_torch`), checked without Python:
//!
//! * a reference written here from the definitions, in f64 on the host, computes each model
//!   from the exported tensors alone, under `model.py`'s names and PyTorch's layouts (`[out, in]`
//!   linear maps, `[OC, C, 5, 5]` convolutions, one module per expert, routers' gates
//!   `[n, d]`), consuming every tensor exactly once (what `load_state_dict(strict=True)`
//!   demands), and its logits match the ones moegrad wrote to `moegrad_eval.json`;
//! * moegrad's accuracy in `moegrad_eval.json` is the run's own final test accuracy, and
//!   `test_data.safetensors` holds the test split;
//! * what `model.py` cannot represent is refused in one line naming the setting, and a failed
//!   export leaves no directory.
//!
//! `scripts/check_torch_export.py` checks the same exports with PyTorch itself
//! (docs/interop.md).

use safetensors::SafeTensors;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("moegrad-torch-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn moegrad(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_moegrad"))
        .args(args)
        .current_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join(".."))
        .output()
        .expect("moegrad runs")
}

fn ok(what: &str, o: Output) -> String {
    assert!(
        o.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Trains `model` on `data` for one short epoch into `dir/run`; returns the run's summary JSON.
fn train(dir: &Path, model: &str, data: &str, extra: &[&str]) -> Value {
    let out = dir.join("run");
    let mut args = vec![
        "train",
        "--data",
        data,
        "--model",
        model,
        "--epochs",
        "1",
        "--train-limit",
        "256",
        "--test-limit",
        "96",
        "--experts",
        "4",
        "--device",
        "cpu",
        "--json",
        "--out",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let text = ok(&format!("train {model} {extra:?}"), moegrad(&args));
    serde_json::from_str(text.lines().last().unwrap()).unwrap()
}

fn export(dir: &Path, test_data: bool) -> Output {
    let ck = dir.join("run/checkpoint.safetensors");
    let out = dir.join("torch");
    let mut args = vec![
        "export",
        "--checkpoint",
        ck.to_str().unwrap(),
        "--format",
        "torch",
        "--out",
        out.to_str().unwrap(),
    ];
    if test_data {
        args.push("--test-data");
    }
    moegrad(&args)
}

// ------------------------------------------------------------------ the f64 reference

/// A host tensor: shape and values.
#[derive(Clone, Debug)]
struct T {
    shape: Vec<usize>,
    v: Vec<f64>,
}

/// The exported tensors, each taken once (a second take, or one left over, fails the test).
struct Weights(BTreeMap<String, T>);

impl Weights {
    fn read(path: &Path) -> Weights {
        let bytes = std::fs::read(path).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let mut map = BTreeMap::new();
        for (name, view) in st.tensors() {
            assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name}");
            let v = view
                .data()
                .chunks(4)
                .map(|c| f64::from(f32::from_le_bytes([c[0], c[1], c[2], c[3]])))
                .collect();
            map.insert(
                name.clone(),
                T {
                    shape: view.shape().to_vec(),
                    v,
                },
            );
        }
        Weights(map)
    }
    fn take(&mut self, name: &str, shape: &[usize]) -> T {
        let t = self
            .0
            .remove(name)
            .unwrap_or_else(|| panic!("{name} is not in model.safetensors (or taken twice)"));
        assert_eq!(t.shape, shape, "{name}");
        t
    }
    fn linear(&mut self, name: &str, d_in: usize, d_out: usize) -> (T, T) {
        (
            self.take(&format!("{name}.weight"), &[d_out, d_in]),
            self.take(&format!("{name}.bias"), &[d_out]),
        )
    }
    fn conv(&mut self, name: &str, c: usize, oc: usize) -> (T, T) {
        (
            self.take(&format!("{name}.weight"), &[oc, c, 5, 5]),
            self.take(&format!("{name}.bias"), &[oc]),
        )
    }
}

/// `x [B, in] · wᵀ + b` with `w [out, in]` (PyTorch's `nn.Linear`).
fn linear(x: &T, (w, b): &(T, T)) -> T {
    let (bsz, din, dout) = (x.shape[0], x.shape[1], w.shape[0]);
    assert_eq!(w.shape[1], din);
    let mut v = vec![0.0; bsz * dout];
    for r in 0..bsz {
        for o in 0..dout {
            v[r * dout + o] = b.v[o]
                + (0..din)
                    .map(|i| x.v[r * din + i] * w.v[o * din + i])
                    .sum::<f64>();
        }
    }
    T {
        shape: vec![bsz, dout],
        v,
    }
}

fn relu(x: &T) -> T {
    T {
        shape: x.shape.clone(),
        v: x.v.iter().map(|a| a.max(0.0)).collect(),
    }
}

/// A valid 5×5 convolution, ReLU and 2×2 max-pool of `x [B, C, H, W]` (`w [OC, C, 5, 5]`).
fn conv_relu_pool(x: &T, (w, b): &(T, T)) -> T {
    let (bsz, c, h, wd) = (x.shape[0], x.shape[1], x.shape[2], x.shape[3]);
    let oc = w.shape[0];
    let (oh, ow) = (h - 4, wd - 4);
    let (ph, pw) = (oh / 2, ow / 2);
    let mut out = vec![f64::NEG_INFINITY; bsz * oc * ph * pw];
    for n in 0..bsz {
        for o in 0..oc {
            for y in 0..ph * 2 {
                for xx in 0..pw * 2 {
                    let mut s = b.v[o];
                    for ci in 0..c {
                        for ky in 0..5 {
                            for kx in 0..5 {
                                s += x.v[((n * c + ci) * h + y + ky) * wd + xx + kx]
                                    * w.v[((o * c + ci) * 5 + ky) * 5 + kx];
                            }
                        }
                    }
                    let cell = &mut out[((n * oc + o) * ph + y / 2) * pw + xx / 2];
                    *cell = cell.max(s.max(0.0));
                }
            }
        }
    }
    T {
        shape: vec![bsz, oc, ph, pw],
        v: out,
    }
}

fn flatten(x: &T) -> T {
    let b = x.shape[0];
    T {
        shape: vec![b, x.v.len() / b],
        v: x.v.clone(),
    }
}

fn rows(x: &T) -> Vec<&[f64]> {
    x.v.chunks(x.shape[1]).collect()
}

/// The dense gates `[B, n]` of router `rule` from its gate logits (softmax or top-k
/// renormalised, the two rules this test exports).
fn gates(logits: &T, rule: &str, k: usize) -> Vec<Vec<f64>> {
    rows(logits)
        .into_iter()
        .map(|l| {
            let m = l.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = l.iter().map(|a| (a - m).exp()).collect();
            let z: f64 = e.iter().sum();
            let p: Vec<f64> = e.iter().map(|a| a / z).collect();
            match rule {
                "softmax" => p,
                "topk" => {
                    let mut order: Vec<usize> = (0..p.len()).collect();
                    order.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
                    let kept: f64 = order[..k].iter().map(|&i| p[i]).sum();
                    let mut g = vec![0.0; p.len()];
                    for &i in &order[..k] {
                        g[i] = p[i] / kept;
                    }
                    g
                }
                other => panic!("no reference for router {other}"),
            }
        })
        .collect()
}

/// One expert of `model.py` on `x`: the MLP `d → hidden → 64` or the CNN expert.
fn expert(w: &mut Weights, e: usize, x: &T, cnn: bool, side: usize, hidden: usize) -> T {
    let p = |s: &str| format!("moe.experts.{e}.{s}");
    if cnn {
        let img = T {
            shape: vec![x.shape[0], 1, side, side],
            v: x.v.clone(),
        };
        let after = ((side - 4) / 2 - 4) / 2;
        let h = conv_relu_pool(&img, &w.conv(&p("conv1"), 1, 10));
        let h = conv_relu_pool(&h, &w.conv(&p("conv2"), 10, 20));
        let h = relu(&linear(
            &flatten(&h),
            &w.linear(&p("fc1"), 20 * after * after, 50),
        ));
        relu(&linear(&h, &w.linear(&p("fc2"), 50, 50)))
    } else {
        let h = relu(&linear(x, &w.linear(&p("fc1"), side * side, hidden)));
        linear(&h, &w.linear(&p("fc2"), hidden, 64))
    }
}

/// The logits per task of the exported model on `images` (`config.json` says which model).
fn reference(cfg: &Value, w: &mut Weights, images: &T) -> Vec<T> {
    let model = cfg["model"].as_str().unwrap();
    let (side, tasks) = (
        cfg["side"].as_u64().unwrap() as usize,
        cfg["tasks"].as_u64().unwrap() as usize,
    );
    let x = flatten(images);
    let head = |w: &mut Weights, h: &T, name: String, d: usize| linear(h, &w.linear(&name, d, 10));
    let out = match model {
        "cnn" => {
            let after = ((side - 4) / 2 - 4) / 2;
            let h = conv_relu_pool(images, &w.conv("conv1", 1, 10));
            let h = conv_relu_pool(&h, &w.conv("conv2", 10, 20));
            let h = relu(&linear(
                &flatten(&h),
                &w.linear("fc", 20 * after * after, 50),
            ));
            (0..tasks)
                .map(|t| head(w, &h, format!("heads.{t}"), 50))
                .collect()
        }
        "moe-mlp" | "moe-cnn" | "mmoe-cnn" => {
            let n = cfg["experts"].as_u64().unwrap() as usize;
            let k = cfg["k"].as_u64().unwrap() as usize;
            let hidden = cfg["expert_hidden"].as_u64().unwrap() as usize;
            let rule = cfg["router"].as_str().unwrap();
            let cnn = model != "moe-mlp";
            let d_out = if cnn { 50 } else { 64 };
            let d = side * side;
            let routers = if model == "mmoe-cnn" { tasks } else { 1 };
            let g: Vec<Vec<Vec<f64>>> = (0..routers)
                .map(|r| {
                    gates(
                        &linear(&x, &w.linear(&format!("routers.{r}.gate"), d, n)),
                        rule,
                        k,
                    )
                })
                .collect();
            // every expert on every row (the reference is dense; a zero gate adds nothing)
            let outs: Vec<T> = (0..n)
                .map(|e| expert(w, e, &x, cnn, side, hidden))
                .collect();
            let mixed: Vec<T> = g
                .iter()
                .map(|gr| {
                    let mut v = vec![0.0; x.shape[0] * d_out];
                    for (row, gate) in gr.iter().enumerate() {
                        for (e, o) in outs.iter().enumerate() {
                            for j in 0..d_out {
                                v[row * d_out + j] += gate[e] * o.v[row * d_out + j];
                            }
                        }
                    }
                    let t = T {
                        shape: vec![x.shape[0], d_out],
                        v,
                    };
                    if cnn { t } else { relu(&t) }
                })
                .collect();
            (0..tasks)
                .map(|t| {
                    if model == "mmoe-cnn" {
                        let h = relu(&linear(
                            &mixed[t],
                            &w.linear(&format!("towers.{t}.0"), 50, 50),
                        ));
                        linear(&h, &w.linear(&format!("towers.{t}.2"), 50, 10))
                    } else {
                        head(w, &mixed[0], format!("heads.{t}"), d_out)
                    }
                })
                .collect()
        }
        other => panic!("no reference for {other}"),
    };
    let left: Vec<&String> = w.0.keys().collect();
    assert!(
        left.is_empty(),
        "model.safetensors holds tensors model.py does not: {left:?}"
    );
    out
}

/// The first `n` images of `test_data.safetensors` and all of its labels.
fn test_data(path: &Path, n: usize) -> (T, Vec<i64>, Vec<usize>) {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let images = st.tensor("images").unwrap();
    let labels = st.tensor("labels").unwrap();
    assert_eq!(images.dtype(), safetensors::Dtype::F32);
    assert_eq!(labels.dtype(), safetensors::Dtype::I64);
    let mut shape = images.shape().to_vec();
    let per: usize = shape[1..].iter().product();
    let v = images.data()[..n * per * 4]
        .chunks(4)
        .map(|c| f64::from(f32::from_le_bytes([c[0], c[1], c[2], c[3]])))
        .collect();
    let labels_shape = labels.shape().to_vec();
    let labels = labels
        .data()
        .chunks(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    shape[0] = n;
    (T { shape, v }, labels, labels_shape)
}

fn check_export(name: &str, model: &str, data: &str, extra: &[&str]) {
    let dir = scratch(name);
    let summary = train(&dir, model, data, extra);
    ok(&format!("export {name}"), export(&dir, true));
    let out = dir.join("torch");
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    let eval: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("moegrad_eval.json")).unwrap())
            .unwrap();
    // moegrad's accuracy on the exported data is the run's own final test accuracy
    let acc: Vec<f64> = match &summary["test_accuracy"] {
        Value::Array(a) => a.iter().map(|v| v.as_f64().unwrap()).collect(),
        v => vec![v.as_f64().unwrap()],
    };
    let written: Vec<f64> = eval["test_accuracy"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    assert_eq!(
        written, acc,
        "{name}: moegrad_eval.json vs the run's summary"
    );
    let n = eval["logits_examples"].as_u64().unwrap() as usize;
    let (images, labels, labels_shape) = test_data(&out.join("test_data.safetensors"), n);
    assert_eq!(labels_shape, vec![96, acc.len()], "{name}: labels");
    assert!(
        labels.iter().all(|&l| (0..10).contains(&l)),
        "{name}: labels"
    );
    assert!(out.join("model.py").is_file(), "{name}: model.py");

    let mut w = Weights::read(&out.join("model.safetensors"));
    let ours = reference(&cfg, &mut w, &images);
    for (t, logits) in ours.iter().enumerate() {
        let theirs: Vec<f64> = eval["logits"][t]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        assert_eq!(logits.v.len(), theirs.len(), "{name}: task {t}");
        let worst = logits
            .v
            .iter()
            .zip(&theirs)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        assert!(
            worst < 1e-4,
            "{name}: task {t}: the reference from the exported tensors differs from moegrad by {worst:e}"
        );
    }
}

#[test]
fn a_cnn_export_computes_moegrads_logits_under_pytorch_names_and_layouts() {
    check_export("cnn", "cnn", "mnist", &[]);
}

#[test]
fn moe_exports_compute_moegrads_logits_under_pytorch_names_and_layouts() {
    check_export(
        "moe-mlp-topk",
        "moe-mlp",
        "mnist",
        &["--router", "topk", "--k", "2"],
    );
    check_export(
        "moe-cnn-softmax",
        "moe-cnn",
        "multimnist",
        &["--router", "softmax"],
    );
    check_export(
        "mmoe-cnn-topk",
        "mmoe-cnn",
        "multimnist",
        &["--router", "topk", "--k", "2"],
    );
}

/// Asserts `o` failed with one stderr line containing every one of `parts`.
fn fails_with(what: &str, o: &Output, parts: &[&str]) {
    let e = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{what}: stderr {e}");
    let lines: Vec<&str> = e.lines().filter(|l| !l.contains("using CPU")).collect();
    assert_eq!(lines.len(), 1, "{what}: expected one line, got {e}");
    for p in parts {
        assert!(lines[0].contains(p), "{what}: {p:?} not in {e}");
    }
}

#[test]
fn what_model_py_cannot_represent_is_refused_naming_it_and_leaves_no_directory() {
    // (name, model, data, training flags, what the one-line error must say)
    type Case<'a> = (&'a str, &'a str, &'a str, &'a [&'a str], &'a [&'a str]);
    let cases: [Case; 5] = [
        (
            "ec",
            "moe-mlp",
            "mnist",
            &["--router", "expert-choice"],
            &["--router expert-choice", "depends on the batch"],
        ),
        (
            "hash",
            "moe-mlp",
            "mnist",
            &["--router", "hash"],
            &["--router hash", "projection"],
        ),
        (
            "sm",
            "moe-mlp",
            "mnist",
            &["--router", "sparsemixer"],
            &["--router sparsemixer"],
        ),
        (
            "cap",
            "moe-mlp",
            "mnist",
            &["--router", "topk", "--eval-capacity-factor", "1.0"],
            &["--eval-capacity-factor 1", "drops tokens"],
        ),
        (
            "bias",
            "moe-mlp",
            "mnist",
            &["--router", "topk", "--balance", "quantile"],
            &["--balance quantile", "selection bias"],
        ),
    ];
    for (name, model, data, extra, parts) in cases {
        let dir = scratch(name);
        train(&dir, model, data, extra);
        let o = export(&dir, false);
        fails_with(name, &o, parts);
        assert!(
            !dir.join("torch").exists(),
            "{name}: a refused export left a directory"
        );
        let stray: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .filter(|n| n.to_string_lossy().contains("tmp"))
            .collect();
        assert!(stray.is_empty(), "{name}: temporaries left: {stray:?}");
    }
}

#[test]
fn a_language_model_or_an_occupied_directory_is_refused() {
    let dir = scratch("lm");
    let o = moegrad(&[
        "train",
        "--data",
        "shakespeare",
        "--model",
        "gpt",
        "--iters",
        "2",
        "--eval-every",
        "2",
        "--eval-windows",
        "1",
        "--layers",
        "1",
        "--d-model",
        "16",
        "--heads",
        "2",
        "--device",
        "cpu",
        "--out",
        dir.join("run").to_str().unwrap(),
    ]);
    ok("train gpt", o);
    fails_with("lm", &export(&dir, false), &["--model gpt", "--format hf"]);
    assert!(!dir.join("torch").exists());

    let dir = scratch("occupied");
    train(&dir, "cnn", "mnist", &[]);
    std::fs::create_dir(dir.join("torch")).unwrap();
    std::fs::write(dir.join("torch/mine.txt"), "keep me").unwrap();
    fails_with(
        "occupied",
        &export(&dir, false),
        &["not an empty directory"],
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("torch/mine.txt")).unwrap(),
        "keep me"
    );
}
