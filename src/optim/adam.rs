//! Adam (Kingma & Ba, 2015) and AdamW (Loshchilov & Hutter, 2019), with bias correction:
//!
//! ```text
//! g ← g·scale (+ λ·p for Adam's L2 decay)
//! m ← β₁·m + (1−β₁)·g          v ← β₂·v + (1−β₂)·g²
//! p ← p − lr · (m / (1−β₁ᵗ)) / (√(v / (1−β₂ᵗ)) + ε)   (− lr·λ·p for AdamW)
//! ```

use super::Optimizer;
use crate::autograd::LeafGrad;
use crate::backend::AdamHyper;
use crate::nn::Param;
use crate::{Error, Result, Tensor};
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
    moments: BTreeMap<String, (Tensor, Tensor)>,
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
            bias_correction1: 1.0 - self.beta1.powi(t),
            bias_correction2: 1.0 - self.beta2.powi(t),
        };
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
                    // an expert bank's deferred gradient is computed inside the update, one
                    // expert at a time (see autograd/deferred.rs)
                    LeafGrad::Grouped(d) => d.adam_step_mut(p, scale, m, v, h),
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
        for (name, (m, v)) in &self.moments {
            out.push((format!("adam.m.{name}"), m.clone()));
            out.push((format!("adam.v.{name}"), v.clone()));
        }
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
        self.steps = steps;
        Ok(())
    }
}
