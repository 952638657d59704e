//! The step-to-step router state of a language model's MoE layers (noise counters, running
//! baselines, DeepSeek's correction bias), named by each layer's parameter scope: what
//! [`crate::nn::Parameters::state`] and `load_state` do for both the GPT and the decoder.

use crate::moe::MoeLayer;
use crate::nn::{Parameters, join, within};
use crate::{Error, Result, Tensor};

/// The state of every layer, named `<scope>.<name>` (e.g. `layers.1.moe.router.noise_calls`).
pub(super) fn state(layers: &[(String, &MoeLayer)]) -> Result<Vec<(String, Tensor)>> {
    let mut out = Vec::new();
    for (scope, layer) in layers {
        for (name, t) in layer.state()? {
            out.push((join(scope, &name), t));
        }
    }
    Ok(out)
}

/// Restores one entry of [`state`] by its full name; a name no layer holds is an error naming
/// it and the model (`what`).
pub(super) fn load_state(
    layers: &[(String, &MoeLayer)],
    name: &str,
    value: &Tensor,
    what: &str,
) -> Result<()> {
    for (scope, layer) in layers {
        if let Some(rest) = within(scope, name) {
            return layer.load_state(rest, value);
        }
    }
    Err(Error::Invalid(format!(
        "{what} has no state named {name:?}"
    )))
}
