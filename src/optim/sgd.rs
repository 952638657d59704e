//! Stochastic gradient descent with optional (Nesterov) momentum and L2 weight decay, as PyTorch
//! defines it: `g ← g·scale + λ·p;  b ← μ·b + g;  p ← p − lr·(nesterov ? g + μ·b : b)`.

use super::Optimizer;
use super::adam::check_lr;
use crate::backend::SgdHyper;
use crate::nn::Param;
use crate::{Result, Tensor};
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
        self.steps += 1;
        let h = SgdHyper {
            lr: self.lr,
            momentum: self.momentum,
            weight_decay: self.weight_decay,
            nesterov: self.nesterov,
        };
        for (name, param) in params {
            let p = param.get();
            let Some(g) = p.grad() else { continue };
            let buf = match self.buffers.get(name) {
                Some(b) => b.clone(),
                None => p.zeros_like()?,
            };
            let (np, nb) = p.storage().sgd_step(
                g.storage(),
                grad_scale.map(|s| s.storage()),
                buf.storage(),
                h,
            )?;
            let shape = p.shape().to_vec();
            param.set(Tensor::from_storage(np, shape.clone()))?;
            if self.momentum != 0.0 {
                self.buffers
                    .insert(name.clone(), Tensor::from_storage(nb, shape));
            }
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
