//! The [`Module`] trait every layer implements, and [`Sequential`] to chain them.

use super::Param;
use crate::{Result, Tensor};

/// A layer or model: a forward function plus the parameters it owns.
pub trait Module: Send + Sync {
    /// Applies the layer.
    fn forward(&self, x: &Tensor) -> Result<Tensor>;

    /// Calls `f(name, param)` for every parameter, names prefixed by `prefix` (dot-separated,
    /// e.g. `layers.0.weight`, as PyTorch names them).
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(String, &Param));

    /// Switches between training (dropout active, noise on) and evaluation. Default: nothing to do.
    fn set_training(&self, _training: bool) {}

    /// Non-trainable state carried from step to step (a dropout layer's mask counter), by name
    /// relative to the layer (`3.dropout_calls` in a [`Sequential`]); checkpoints save it so a
    /// resumed run draws the masks an uninterrupted one would. Default: none.
    fn state(&self) -> Result<Vec<(String, Tensor)>> {
        Ok(Vec::new())
    }

    /// Restores one entry of [`Module::state`]; an unknown name is an error naming it.
    fn load_state(&self, name: &str, _value: &Tensor) -> Result<()> {
        Err(crate::Error::Invalid(format!(
            "this layer has no state named {name:?}"
        )))
    }

    /// Every parameter with its name.
    fn named_params(&self) -> Vec<(String, Param)> {
        let mut out = Vec::new();
        self.visit_params("", &mut |n, p| out.push((n, p.clone())));
        out
    }

    /// Every parameter.
    fn params(&self) -> Vec<Param> {
        self.named_params().into_iter().map(|(_, p)| p).collect()
    }

    /// Total number of trainable scalars.
    fn num_params(&self) -> usize {
        self.params().iter().map(|p| p.get().numel()).sum()
    }
}

/// Joins a prefix and a name with a dot.
pub fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else {
        format!("{prefix}.{name}")
    }
}

/// The rest of `name` below `scope` (`within("moe.router", "moe.router.noise_calls")` is
/// `Some("noise_calls")`), or None when `name` is not under it; every name is under the empty
/// scope. The inverse of [`join`], for routing a state entry to the part that owns it.
pub fn within<'a>(scope: &str, name: &'a str) -> Option<&'a str> {
    if scope.is_empty() {
        return Some(name);
    }
    name.strip_prefix(scope)?.strip_prefix('.')
}

/// Layers applied one after another; parameters are named `<index>.<name>`.
#[derive(Default)]
pub struct Sequential {
    layers: Vec<Box<dyn Module>>,
}

impl Sequential {
    /// An empty chain.
    pub fn new() -> Sequential {
        Sequential { layers: Vec::new() }
    }
    /// Appends a layer (builder style).
    pub fn push(mut self, layer: impl Module + 'static) -> Sequential {
        self.layers.push(Box::new(layer));
        self
    }
    /// Number of layers.
    pub fn len(&self) -> usize {
        self.layers.len()
    }
    /// True when there are no layers.
    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }
}

impl Module for Sequential {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = x.clone();
        for l in &self.layers {
            h = l.forward(&h)?;
        }
        Ok(h)
    }
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(String, &Param)) {
        for (i, l) in self.layers.iter().enumerate() {
            l.visit_params(&join(prefix, &i.to_string()), f);
        }
    }
    fn set_training(&self, training: bool) {
        for l in &self.layers {
            l.set_training(training);
        }
    }
    fn state(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        for (i, l) in self.layers.iter().enumerate() {
            for (name, t) in l.state()? {
                out.push((join(&i.to_string(), &name), t));
            }
        }
        Ok(out)
    }
    fn load_state(&self, name: &str, value: &Tensor) -> Result<()> {
        let layer = name
            .split_once('.')
            .and_then(|(i, rest)| Some((self.layers.get(i.parse::<usize>().ok()?)?, rest)));
        match layer {
            Some((l, rest)) => l.load_state(rest, value),
            None => Err(crate::Error::Invalid(format!(
                "no state named {name:?} in a chain of {} layers",
                self.layers.len()
            ))),
        }
    }
}
