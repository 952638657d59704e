//! Adam (Kingma & Ba, 2015) and AdamW (Loshchilov & Hutter, 2019), with bias correction:
//!
//! ```text
//! g ← g·scale (+ λ·p for Adam's L2 decay)
//! m ← β₁·m + (1−β₁)·g          v ← β₂·v + (1−β₂)·g²
//! p ← p − lr · (m / (1−β₁ᵗ)) / (√(v / (1−β₂ᵗ)) + ε)   (− lr·λ·p for AdamW)
//! ```
//!
//! On the GPU the moments of every parameter live in two flat buffers, and one multi-tensor
//! kernel updates twelve parameters per dispatch (`GpuBackend::adam_multi_mut`): a small model's
//! whole step is one dispatch instead of one per parameter. Checkpoints still see one
//! `adam.m.<name>` / `adam.v.<name>` tensor per parameter. On the CPU, and on a GPU that binds
//! too few buffers per shader for the multi-tensor kernel, each parameter has its own update.

use super::{Optimizer, lazy_grad};
use crate::autograd::LeafGrad;
use crate::backend::gpu::{AdamSlot, GpuBackend};
use crate::backend::{AdamHyper, Storage};
use crate::nn::Param;
use crate::{DType, Device, Error, Result, Tensor};
use std::collections::BTreeMap;

/// Adam or AdamW.
pub struct Adam {
    /// learning rate (default 1e-3)
    pub lr: f64,
    /// β₁ (default 0.9)
    pub beta1: f64,
    /// β₂ (default 0.999)
    pub beta2: f64,
    /// ε (default 1e-8)
    pub eps: f64,
    /// weight decay λ (default 0)
    pub weight_decay: f64,
    /// decoupled weight decay (AdamW)
    pub decoupled: bool,
    /// parameters (by name) that take no weight decay (biases, norms, positional tables, as
    /// a GPT's AdamW is set up); empty by default
    pub no_decay: std::collections::BTreeSet<String>,
    steps: u64,
    /// per-parameter moments (the CPU's; on the GPU, loaded state not yet flattened)
    moments: BTreeMap<String, (Tensor, Tensor)>,
    /// every parameter's moments in two flat GPU buffers (the multi-tensor path)
    flat: Option<FlatMoments>,
}

/// Adam's moments on the GPU: two flat buffers holding every parameter's `m` and `v` one after
/// the other, so one kernel can update many parameters.
struct FlatMoments {
    /// parameter name → (offset in elements, shape)
    segments: BTreeMap<String, (usize, Vec<usize>)>,
    /// `[total]` first moments
    m: Tensor,
    /// `[total]` second moments
    v: Tensor,
}

impl FlatMoments {
    /// `name`'s `(m, v)` as tensors of its shape (copies).
    fn get(&self, name: &str) -> Result<Option<(Tensor, Tensor)>> {
        let Some((offset, shape)) = self.segments.get(name) else {
            return Ok(None);
        };
        let n: usize = shape.iter().product();
        let cut = |t: &Tensor| t.slice(0, *offset, offset + n)?.reshape(shape);
        Ok(Some((cut(&self.m)?, cut(&self.v)?)))
    }
}

impl Adam {
    /// Adam with the paper's defaults and learning rate `lr`.
    pub fn new(lr: f64) -> Result<Adam> {
        check_lr(lr)?;
        Ok(Adam {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            decoupled: false,
            no_decay: Default::default(),
            steps: 0,
            moments: BTreeMap::new(),
            flat: None,
        })
    }

    /// AdamW: Adam with decoupled weight decay `weight_decay` (PyTorch's default is 0.01).
    pub fn adamw(lr: f64, weight_decay: f64) -> Result<Adam> {
        let mut a = Adam::new(lr)?;
        a.weight_decay = weight_decay;
        a.decoupled = true;
        Ok(a)
    }
}

/// Errors unless `lr` is a finite positive number.
pub(crate) fn check_lr(lr: f64) -> Result<()> {
    if lr.is_finite() && lr > 0.0 {
        Ok(())
    } else {
        Err(Error::Invalid(format!(
            "learning rate must be a finite positive number, got {lr}"
        )))
    }
}

impl Optimizer for Adam {
    fn step(&mut self, params: &[(String, Param)], grad_scale: Option<&Tensor>) -> Result<()> {
        let _profile = crate::profile::scope("adam step", crate::profile::Pass::Optimizer);
        self.steps += 1;
        let t = self.steps as i32;
        let h = AdamHyper {
            lr: self.lr,
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            weight_decay: self.weight_decay,
            decoupled: self.decoupled,
            step: self.steps,
            bias_correction1: 1.0 - self.beta1.powi(t),
            bias_correction2: 1.0 - self.beta2.powi(t),
        };
        if multi_tensor(params) {
            return self.step_flat(params, grad_scale, h);
        }
        self.unflatten()?;
        let scale = grad_scale.map(|s| s.storage());
        let undecayed = AdamHyper {
            weight_decay: 0.0,
            ..h
        };
        for (name, param) in params {
            let h = if self.no_decay.contains(name) {
                undecayed
            } else {
                h
            };
            let moments = &mut self.moments;
            param.update(|p, g| {
                let (m, v) = match moments.get_mut(name) {
                    Some(mv) => mv,
                    None => {
                        let zeros = || g.zeros_like();
                        moments.insert(name.clone(), (zeros()?, zeros()?));
                        moments
                            .get_mut(name)
                            .ok_or_else(|| Error::Invalid(format!("adam: no moments for {name}")))?
                    }
                };
                let (m, v) = (m.storage_mut(), v.storage_mut());
                match g {
                    LeafGrad::Dense(g) => p.adam_step_mut(g.storage(), scale, m, v, h),
                    // a lazy gradient is fused into the update where Adam knows its recipe
                    // (an expert bank's, one expert at a time), else computed first
                    LeafGrad::Lazy(d) => lazy_grad::adam_step_mut(d.as_ref(), p, scale, m, v, h),
                }
            })?;
        }
        Ok(())
    }
    fn lr(&self) -> f64 {
        self.lr
    }
    fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }
    fn steps(&self) -> u64 {
        self.steps
    }
    fn state(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        let mut push = |name: &str, m: Tensor, v: Tensor| {
            out.push((format!("adam.m.{name}"), m));
            out.push((format!("adam.v.{name}"), v));
        };
        for (name, (m, v)) in &self.moments {
            push(name, m.clone(), v.clone());
        }
        if let Some(flat) = &self.flat {
            for name in flat.segments.keys() {
                // a copy out of a buffer this process made cannot fail but by running out of
                // device memory; the trait returns no Result, so such an entry is left out
                // and the checkpoint's load names it as missing
                if let Ok(Some((m, v))) = flat.get(name) {
                    push(name, m, v);
                }
            }
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }
    /// Restores the moments; every `adam.m.<name>` needs its `adam.v.<name>` of the same shape
    /// and the other way round (an error names the one missing or misshapen).
    fn load_state(&mut self, tensors: &BTreeMap<String, Tensor>, steps: u64) -> Result<()> {
        let mut moments = BTreeMap::new();
        for (key, m) in tensors {
            if let Some(name) = key.strip_prefix("adam.m.") {
                let v = tensors.get(&format!("adam.v.{name}")).ok_or_else(|| {
                    Error::Invalid(format!(
                        "optimizer state has adam.m.{name} but no adam.v.{name}"
                    ))
                })?;
                if m.shape() != v.shape() {
                    return Err(Error::Invalid(format!(
                        "optimizer state adam.m.{name} has shape {:?} but adam.v.{name} {:?}",
                        m.shape(),
                        v.shape()
                    )));
                }
                moments.insert(name.to_string(), (m.clone(), v.clone()));
            } else if let Some(name) = key.strip_prefix("adam.v.")
                && !tensors.contains_key(&format!("adam.m.{name}"))
            {
                return Err(Error::Invalid(format!(
                    "optimizer state has adam.v.{name} but no adam.m.{name}"
                )));
            }
        }
        self.moments = moments;
        self.flat = None;
        self.steps = steps;
        Ok(())
    }
}

/// Whether a step over `params` takes the multi-tensor path: every parameter an f32 tensor on a
/// GPU that can bind the multi-tensor kernel.
fn multi_tensor(params: &[(String, Param)]) -> bool {
    !params.is_empty()
        && params.iter().all(|(_, p)| {
            let t = p.get();
            t.device() == Device::Gpu && t.dtype() == DType::F32
        })
        && GpuBackend::get().is_ok_and(|g| g.adam_multi_supported())
}

impl Adam {
    /// The GPU step: one multi-tensor kernel over every parameter with a gradient.
    fn step_flat(
        &mut self,
        params: &[(String, Param)],
        grad_scale: Option<&Tensor>,
        h: AdamHyper,
    ) -> Result<()> {
        self.flatten(params)?;
        let be = GpuBackend::get()?;
        let scale = match grad_scale.map(|s| s.storage()) {
            None => None,
            Some(Storage::Gpu(s)) => Some(s),
            Some(Storage::Cpu(_)) => {
                return Err(Error::Device(
                    "adam: the gradient scale is on the CPU, the parameters on the GPU".into(),
                ));
            }
        };
        let no_decay = &self.no_decay;
        let flat = self
            .flat
            .as_mut()
            .ok_or_else(|| Error::Invalid("adam: the flat moments were not built".into()))?;
        let refs: Vec<&Param> = params.iter().map(|(_, p)| p).collect();
        Param::update_many(&refs, |updates| {
            let (Storage::Gpu(m), Storage::Gpu(v)) = (flat.m.storage_mut(), flat.v.storage_mut())
            else {
                return Err(Error::Device("adam: the moments left the GPU".into()));
            };
            let mut slots = Vec::with_capacity(updates.len());
            for (i, storage, grad) in updates.iter_mut() {
                let name = &params[*i].0;
                let (offset, shape) = flat
                    .segments
                    .get(name)
                    .ok_or_else(|| Error::Invalid(format!("adam: no moments for {name}")))?;
                let (Storage::Gpu(param), LeafGrad::Dense(g)) = (&mut **storage, &*grad) else {
                    return Err(Error::Device(format!(
                        "adam: {name} or its gradient is not an ordinary GPU tensor"
                    )));
                };
                let Storage::Gpu(g) = g.storage() else {
                    return Err(Error::Device(format!(
                        "adam: the gradient of {name} is on the CPU"
                    )));
                };
                if param.len() != shape.iter().product::<usize>() {
                    return Err(Error::Shape(format!(
                        "adam: {name} has {} elements, its moments {shape:?}",
                        param.len()
                    )));
                }
                slots.push(AdamSlot {
                    param,
                    grad: g,
                    offset: *offset,
                    decay: !no_decay.contains(name),
                });
            }
            be.adam_multi_mut(&mut slots, m, v, scale, h)
        })
    }

    /// Builds the flat moments when some parameter of `params` has none there yet: from the
    /// flat moments already made, the loaded per-parameter ones, and zeros for the rest.
    fn flatten(&mut self, params: &[(String, Param)]) -> Result<()> {
        let covered = |f: &FlatMoments| params.iter().all(|(n, _)| f.segments.contains_key(n));
        if self.flat.as_ref().is_some_and(covered) {
            return Ok(());
        }
        self.unflatten()?;
        let mut entries: Vec<(String, Vec<usize>)> = params
            .iter()
            .map(|(n, p)| (n.clone(), p.get().shape().to_vec()))
            .collect();
        for (name, (m, _)) in &self.moments {
            if !entries.iter().any(|(n, _)| n == name) {
                entries.push((name.clone(), m.shape().to_vec()));
            }
        }
        let (mut ms, mut vs) = (Vec::new(), Vec::new());
        let mut segments = BTreeMap::new();
        let mut offset = 0;
        for (name, shape) in entries {
            let n: usize = shape.iter().product();
            let (m, v) = match self.moments.remove(&name) {
                Some((m, v)) if m.numel() == n && v.numel() == n => (m, v),
                Some((m, _)) => {
                    return Err(Error::Shape(format!(
                        "adam: the moments of {name} have shape {:?}, the parameter {shape:?}",
                        m.shape()
                    )));
                }
                None => {
                    let zeros = || Tensor::zeros(&[n], DType::F32, Device::Gpu);
                    (zeros()?, zeros()?)
                }
            };
            let flat = |t: Tensor| {
                t.to_device(Device::Gpu)?
                    .to_dtype(DType::F32)?
                    .reshape(&[n])
            };
            ms.push(flat(m)?);
            vs.push(flat(v)?);
            segments.insert(name, (offset, shape));
            offset += n;
        }
        let join = |parts: Vec<Tensor>| -> Result<Tensor> {
            if parts.is_empty() {
                Tensor::zeros(&[0], DType::F32, Device::Gpu)
            } else {
                // a fresh buffer of its own (concat copies), updated in place from now on
                Tensor::concat(&parts, 0)
            }
        };
        self.flat = Some(FlatMoments {
            segments,
            m: join(ms)?,
            v: join(vs)?,
        });
        Ok(())
    }

    /// Moves the flat moments back to per-parameter tensors (before a CPU step).
    fn unflatten(&mut self) -> Result<()> {
        if let Some(flat) = self.flat.take() {
            for name in flat.segments.keys() {
                if let Some(mv) = flat.get(name)? {
                    self.moments.insert(name.clone(), mv);
                }
            }
        }
        Ok(())
    }
}
