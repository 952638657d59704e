//! The [`Module`] trait every layer implements (a forward function on top of the
//! [`Parameters`] protocol), [`Sequential`] to chain them, and the name helpers [`join`] and
//! [`within`].

use super::{Param, Parameters};
use crate::{Result, Tensor};

/// A layer: a forward function over one tensor, plus the parameters it owns (the
/// [`Parameters`] protocol: names, training flag, step-to-step state).
pub trait Module: Parameters {
    /// Applies the layer.
    fn forward(&self, x: &Tensor) -> Result<Tensor>;
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
}

impl Parameters for Sequential {
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
