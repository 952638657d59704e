//! MLPs: the builder [`mlp`] (`Linear → activation → ... → Linear` from a list of widths) and
//! [`Mlp`], the two-layer feed-forward block of transformers (dense or shared experts).

use super::module::join;
use super::{Activation, Linear};
use super::{Init, Module, Param, Parameters, Sequential};
use crate::{Device, Error, Result, Tensor};
use rand_chacha::ChaCha8Rng;

/// Builds `Linear(w0→w1), act, Linear(w1→w2), act, ..., Linear(→w_last)` (no activation after
/// the last layer). Kaiming init for ReLU-family activations, Xavier otherwise. With the gated
/// [`Activation::SwiGlu`] each hidden layer's `Linear` is twice as wide (gate and up halves).
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
        Activation::Relu | Activation::Gelu | Activation::Silu | Activation::SwiGlu => {
            Init::KaimingUniform
        }
        _ => Init::XavierUniform,
    };
    let mut net = Sequential::new();
    for (i, pair) in widths.windows(2).enumerate() {
        let last = i + 2 == widths.len();
        let layer_init = if last { Init::XavierUniform } else { init };
        // a gated activation halves the width: the layer before it is twice as wide
        let outputs = if last {
            pair[1]
        } else {
            act.input_width(pair[1])
        };
        net = net.push(Linear::new(pair[0], outputs, layer_init, rng, device)?);
        if !last {
            net = net.push(act);
        }
    }
    Ok(net)
}

/// A two-layer MLP `x → down(act(up(x)))`, the feed-forward block of Llama-style transformers
/// (with [`Activation::SwiGlu`]: `down(silu(x·W_gate) ⊙ x·W_up)`, gate and up side by side in
/// `up`) and of their shared experts.
pub struct Mlp {
    /// `d → act.input_width(hidden)`
    pub up: Linear,
    /// `hidden → d_out`
    pub down: Linear,
    /// the activation between them
    pub activation: Activation,
}

impl Mlp {
    /// An MLP `d → hidden → d_out` without biases (as in Llama, Mixtral, Qwen and DeepSeek), its
    /// weights drawn N(0, std²).
    ///
    /// # Example
    /// ```
    /// use moegrad::nn::{Activation, Mlp, Module};
    /// use moegrad::{DType, Device, Tensor};
    /// use rand::SeedableRng;
    /// # fn main() -> moegrad::Result<()> {
    /// let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
    /// let mlp = Mlp::normal_without_bias(8, 16, 8, Activation::SwiGlu, 0.02, &mut rng, Device::cpu())?;
    /// assert_eq!(mlp.up.weight.get().shape(), &[8, 32]); // gate and up side by side
    /// let y = mlp.forward(&Tensor::zeros(&[3, 8], DType::F32, Device::cpu())?)?;
    /// assert_eq!(y.shape(), &[3, 8]);
    /// # Ok(()) }
    /// ```
    pub fn normal_without_bias(
        d: usize,
        hidden: usize,
        d_out: usize,
        activation: Activation,
        std: f64,
        rng: &mut ChaCha8Rng,
        device: Device,
    ) -> Result<Mlp> {
        if d == 0 || hidden == 0 || d_out == 0 {
            return Err(Error::Invalid(format!(
                "an MLP needs widths of at least 1, got {d} → {hidden} → {d_out}"
            )));
        }
        Ok(Mlp {
            up: Linear::normal_without_bias(d, activation.input_width(hidden), std, rng, device)?,
            down: Linear::normal_without_bias(hidden, d_out, std, rng, device)?,
            activation,
        })
    }
}

impl Mlp {
    /// `residual + self.forward(x)`, with its bits, the residual added by the down
    /// projection's kernel ([`Linear::forward_add`]).
    ///
    /// # Errors
    /// Those of [`Module::forward`] and of the add.
    pub fn forward_add(&self, x: &Tensor, residual: &Tensor) -> Result<Tensor> {
        self.apply(x, Some(residual))
    }

    /// `down(act(up(x)))`, plus `residual` where given.
    fn apply(&self, x: &Tensor, residual: Option<&Tensor>) -> Result<Tensor> {
        let hidden = self.activation.apply(&self.up.forward(x)?)?;
        self.down.project(&hidden, residual)
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.apply(x, None)
    }
}

impl Parameters for Mlp {
    /// Names `<prefix>.up.*`, `<prefix>.down.*`.
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(String, &Param)) {
        self.up.visit_params(&join(prefix, "up"), f);
        self.down.visit_params(&join(prefix, "down"), f);
    }
}
