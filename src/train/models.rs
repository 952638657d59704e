//! The models `moegrad train` builds: an MLP and a LeNet-style CNN, each with one 10-way head per
//! task (one for MNIST, two for MultiMNIST) over a shared trunk.
//!
//! The CNN is the expert network of the MOESART paper's MultiMNIST setup: conv 5×5×10, ReLU,
//! max-pool 2; conv 5×5×20, ReLU, max-pool 2; dense 50, ReLU; then the heads.

use super::config::ModelKind;
use crate::nn::{
    Activation, Conv2d, Flatten, Init, Linear, MaxPool2d, Module, Param, Sequential, join,
};
use crate::{Device, Result, Tensor};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// A shared trunk and one classification head per task.
pub struct MultiHead {
    /// the shared layers
    pub trunk: Sequential,
    /// one head per task
    pub heads: Vec<Linear>,
}

impl MultiHead {
    /// Logits `[B, 10]` per task.
    pub fn forward_tasks(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        let h = self.trunk.forward(x)?;
        self.heads.iter().map(|head| head.forward(&h)).collect()
    }

    /// Every parameter with its name (`trunk.*`, `heads.<t>.*`).
    pub fn named_params(&self) -> Vec<(String, Param)> {
        let mut out = Vec::new();
        self.trunk
            .visit_params("trunk", &mut |n, p| out.push((n, p.clone())));
        for (t, head) in self.heads.iter().enumerate() {
            head.visit_params(&join("heads", &t.to_string()), &mut |n, p| {
                out.push((n, p.clone()))
            });
        }
        out
    }

    /// Switches dropout and noise between training and evaluation.
    pub fn set_training(&self, on: bool) {
        self.trunk.set_training(on);
    }
}

/// Builds the model for images of `side × side` pixels and `tasks` heads, from `seed`.
pub fn build(
    kind: ModelKind,
    side: usize,
    tasks: usize,
    seed: u64,
    device: Device,
) -> Result<MultiHead> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (trunk, width) = match kind {
        ModelKind::Mlp => {
            let t = Sequential::new()
                .push(Flatten)
                .push(Linear::new(
                    side * side,
                    256,
                    Init::KaimingUniform,
                    &mut rng,
                    device,
                )?)
                .push(Activation::Relu)
                .push(Linear::new(
                    256,
                    128,
                    Init::KaimingUniform,
                    &mut rng,
                    device,
                )?)
                .push(Activation::Relu);
            (t, 128)
        }
        ModelKind::Cnn => {
            let after = ((side - 4) / 2 - 4) / 2;
            let t = Sequential::new()
                .push(Conv2d::new(1, 10, 5, 1, 0, &mut rng, device)?)
                .push(Activation::Relu)
                .push(MaxPool2d {
                    kernel: 2,
                    stride: 2,
                })
                .push(Conv2d::new(10, 20, 5, 1, 0, &mut rng, device)?)
                .push(Activation::Relu)
                .push(MaxPool2d {
                    kernel: 2,
                    stride: 2,
                })
                .push(Flatten)
                .push(Linear::new(
                    20 * after * after,
                    50,
                    Init::KaimingUniform,
                    &mut rng,
                    device,
                )?)
                .push(Activation::Relu);
            (t, 50)
        }
    };
    let heads = (0..tasks)
        .map(|_| Linear::new(width, 10, Init::XavierUniform, &mut rng, device))
        .collect::<Result<Vec<_>>>()?;
    Ok(MultiHead { trunk, heads })
}
