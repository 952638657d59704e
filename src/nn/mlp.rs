//! An MLP builder: `Linear → activation → ... → Linear` from a list of widths.

use super::{Activation, Linear};
use super::{Init, Sequential};
use crate::{Device, Error, Result};
use rand_chacha::ChaCha8Rng;

/// Builds `Linear(w0→w1), act, Linear(w1→w2), act, ..., Linear(→w_last)` (no activation after
/// the last layer). Kaiming init for ReLU-family activations, Xavier otherwise.
///
/// # Example
/// ```
/// use moegrad::{Device, Tensor, nn::{mlp, Activation, Module}};
/// use rand::SeedableRng;
/// let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
/// let net = mlp(&[4, 8, 3], Activation::Relu, &mut rng, Device::cpu()).unwrap();
/// let x = Tensor::zeros(&[2, 4], moegrad::DType::F32, Device::cpu()).unwrap();
/// assert_eq!(net.forward(&x).unwrap().shape(), &[2, 3]);
/// ```
pub fn mlp(
    widths: &[usize],
    act: Activation,
    rng: &mut ChaCha8Rng,
    device: Device,
) -> Result<Sequential> {
    if widths.len() < 2 || widths.contains(&0) {
        return Err(Error::Invalid(format!(
            "mlp needs at least two nonzero widths, got {widths:?}"
        )));
    }
    let init = match act {
        Activation::Relu | Activation::Gelu | Activation::Silu => Init::KaimingUniform,
        _ => Init::XavierUniform,
    };
    let mut net = Sequential::new();
    for (i, pair) in widths.windows(2).enumerate() {
        let last = i + 2 == widths.len();
        let layer_init = if last { Init::XavierUniform } else { init };
        net = net.push(Linear::new(pair[0], pair[1], layer_init, rng, device)?);
        if !last {
            net = net.push(act);
        }
    }
    Ok(net)
}
