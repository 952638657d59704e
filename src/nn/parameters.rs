//! [`Parameters`], the one parameter protocol: what every part of a model that owns parameters
//! answers, whatever else it does. Layers ([`super::Module`]), routers
//! ([`crate::moe::Router`]), the MoE layer, the models `moegrad train` builds
//! ([`crate::train::TaskModel`]) and the language model ([`crate::lm::Gpt`]) all implement
//! it, so the optimizers, gradient clipping, checkpoints and resume read any of them the same
//! way: the named parameters, the training flag, and the non-parameter state a checkpoint saves.

use super::Param;
use crate::{Result, Tensor};

/// A part of a model with parameters: visits them by name, switches between training and
/// evaluation, and lists (and restores) the non-trainable state carried from step to step.
///
/// Names are dot-separated and relative to the part (`weight`, `layers.0.weight`); a part holding
/// others passes each a prefix ([`super::join`]) when visiting, and scopes their state names the
/// same way, routing a loaded entry back with [`super::within`]. Only
/// [`Parameters::visit_params`] is required.
pub trait Parameters: Send + Sync {
    /// Calls `f(name, param)` for every parameter, names prefixed by `prefix` (dot-separated,
    /// e.g. `layers.0.weight`, as PyTorch names them).
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(String, &Param));

    /// Switches between training (dropout active, router noise on, training capacity) and
    /// evaluation. Default: nothing to do.
    fn set_training(&self, _training: bool) {}

    /// Non-trainable state carried from step to step (a dropout layer's mask counter, a router's
    /// noise counter or running baseline), by name relative to this part
    /// (`router.noise_calls` in an MoE layer); checkpoints save it under `state.<full name>` so
    /// a resumed run continues exactly as an uninterrupted one. Default: none.
    fn state(&self) -> Result<Vec<(String, Tensor)>> {
        Ok(Vec::new())
    }

    /// Restores one entry of [`Parameters::state`] by its name relative to this part; a name
    /// this part does not hold is an error naming it.
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
