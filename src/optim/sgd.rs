//! Stochastic gradient descent with optional (Nesterov) momentum and L2 weight decay, as PyTorch
//! defines it: `g ← g·scale + λ·p;  b ← μ·b + g;  p ← p − lr·(nesterov ? g + μ·b : b)`.

use super::Optimizer;
use super::adam::check_lr;
use crate::backend::SgdHyper;
use crate::nn::Param;
use crate::{Error, Result, Tensor};
use std::collections::BTreeMap;

/// SGD.
pub struct Sgd {
    /// learning rate
    pub lr: f64,
    /// momentum μ (default 0)
    pub momentum: f64,
    /// weight decay λ (default 0)
    pub weight_decay: f64,
    /// Nesterov momentum (default false)
    pub nesterov: bool,
    steps: u64,
    buffers: BTreeMap<String, Tensor>,
}

impl Sgd {
    /// Plain SGD with learning rate `lr`.
    pub fn new(lr: f64) -> Result<Sgd> {
        check_lr(lr)?;
        Ok(Sgd {
            lr,
            momentum: 0.0,
            weight_decay: 0.0,
            nesterov: false,
            steps: 0,
            buffers: BTreeMap::new(),
        })
    }
    /// SGD with momentum `momentum`.
    pub fn with_momentum(lr: f64, momentum: f64) -> Result<Sgd> {
        let mut s = Sgd::new(lr)?;
        s.momentum = momentum;
        Ok(s)
    }
}

impl Optimizer for Sgd {
    fn step(&mut self, params: &[(String, Param)], grad_scale: Option<&Tensor>) -> Result<()> {
        let _profile = crate::profile::scope("sgd step", crate::profile::Pass::Optimizer);
        self.steps += 1;
        let h = SgdHyper {
            lr: self.lr,
            momentum: self.momentum,
            weight_decay: self.weight_decay,
            nesterov: self.nesterov,
        };
        let scale = grad_scale.map(|s| s.storage());
        for (name, param) in params {
            let buffers = &mut self.buffers;
            let momentum = self.momentum != 0.0;
            param.update(|p, g| {
                // SGD reads the gradient once: a deferred expert-bank gradient is computed here
                let g = &g.to_dense()?;
                if !momentum {
                    // plain SGD: the kernel ignores the buffer; pass the gradient's own storage
                    let mut unused = g.storage().clone();
                    return p.sgd_step_mut(g.storage(), scale, &mut unused, h);
                }
                if !buffers.contains_key(name) {
                    buffers.insert(name.clone(), Tensor::zeros_like(g)?);
                }
                match buffers.get_mut(name) {
                    Some(b) => p.sgd_step_mut(g.storage(), scale, b.storage_mut(), h),
                    None => Err(Error::Invalid(format!(
                        "sgd: no momentum buffer for {name}"
                    ))),
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
        self.buffers
            .iter()
            .map(|(n, b)| (format!("sgd.momentum.{n}"), b.clone()))
            .collect()
    }
    fn load_state(&mut self, tensors: &BTreeMap<String, Tensor>, steps: u64) -> Result<()> {
        self.buffers = tensors
            .iter()
            .filter_map(|(k, t)| {
                k.strip_prefix("sgd.momentum.")
                    .map(|n| (n.to_string(), t.clone()))
            })
            .collect();
        self.steps = steps;
        Ok(())
    }
}
