//! Synthetic data with a known mixture of experts: generator B of the DSelect-k paper (Hazimeh
//! et al. 2021, Fig. 2; docs/routers.md, `dselect-k`), the test of whether a gate finds the right
//! experts.
//!
//! **The true model.** 4 experts, each a dense layer `R^10 → R^4` with ReLU,
//! `f_i(x) = ReLU(W_iᵀ x)`, weights iid N(0, 1); the output is a logistic unit on their
//! average, `logit(x) = vᵀ (¼ Σ_i f_i(x)) + c`, `v` iid N(0, 1), and the label is
//! `1[logit(x) > 0]`. The offset `c` is minus the median of `vᵀ(¼ Σ_i f_i(x))` over the
//! generated inputs, so the two classes are balanced. Inputs `x ~ N(0, I_10)`: 20,000 of them,
//! 10,000 for training and 10,000 for testing (the paper's sizes).
//!
//! **The bank the model is given.** 16 experts of the same form, **frozen**: 4 are exact copies
//! of the true experts, at positions drawn from the seed ([`SyntheticB::true_experts`]); the
//! other 12 are drawn like the true ones but take no part in the labels. A gate choosing k = 4
//! experts followed by a trainable logistic unit is trained on top; the question is which experts
//! the gate ends up selecting (the paper: DSelect-k recovers all 4; Top-k recovers 1 and
//! oscillates).
//!
//! Everything is a deterministic function of the seed.

use super::Dataset;
use crate::{Error, Result};
use rand::seq::SliceRandom;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Input width of generator B.
pub const SYNTHETIC_B_INPUT: usize = 10;
/// Output width of each expert.
pub const SYNTHETIC_B_EXPERT_OUT: usize = 4;
/// Number of true experts.
pub const SYNTHETIC_B_TRUE: usize = 4;

/// Generator B's data and the frozen expert bank to train a gate over.
#[derive(Clone, Debug)]
pub struct SyntheticB {
    /// 10,000 training examples `[10]`, labels 0/1 (one task)
    pub train: Dataset,
    /// 10,000 test examples
    pub test: Dataset,
    /// the bank's expert weights, `[n, 10, 4]` row-major (`f_e(x) = ReLU(x · W_e)`)
    pub expert_weights: Vec<f32>,
    /// number of experts in the bank
    pub experts: usize,
    /// where the 4 true experts sit in the bank, ascending
    pub true_experts: Vec<usize>,
    /// the true logistic unit's weights `v` `[4]`
    pub head: Vec<f64>,
    /// the true logistic unit's offset `c` (balances the classes)
    pub offset: f64,
}

/// A standard normal draw (Box–Muller).
fn normal(rng: &mut ChaCha8Rng) -> f64 {
    let u1: f64 = rng.random_range(f64::EPSILON..1.0);
    let u2: f64 = rng.random_range(0.0..1.0);
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// `ReLU(x · W)` for one expert `W: [10, 4]` (row-major) and one input `x: [10]`.
fn expert_out(w: &[f64], x: &[f64]) -> [f64; SYNTHETIC_B_EXPERT_OUT] {
    let mut out = [0.0; SYNTHETIC_B_EXPERT_OUT];
    for (j, o) in out.iter_mut().enumerate() {
        let s: f64 = (0..SYNTHETIC_B_INPUT)
            .map(|i| x[i] * w[i * SYNTHETIC_B_EXPERT_OUT + j])
            .sum();
        *o = s.max(0.0);
    }
    out
}

impl SyntheticB {
    /// Generates the data and a bank of `experts` (≥ 4) experts from `seed`, with
    /// `train`/`test` examples (the paper: 10,000 each).
    ///
    /// # Errors
    /// Fewer than 4 experts, or no examples.
    pub fn generate(seed: u64, experts: usize, train: usize, test: usize) -> Result<SyntheticB> {
        if experts < SYNTHETIC_B_TRUE {
            return Err(Error::Invalid(format!(
                "synthetic-b: the bank needs at least {SYNTHETIC_B_TRUE} experts (the true ones), got --experts {experts}"
            )));
        }
        if train == 0 || test == 0 {
            return Err(Error::Invalid(
                "synthetic-b: the training and test sets must not be empty".into(),
            ));
        }
        // the bank (f32 weights and a slot index per expert) and the examples (f64 while drawn,
        // then f32), counted before anything is allocated
        let per_expert = (SYNTHETIC_B_INPUT * SYNTHETIC_B_EXPERT_OUT * 4 + 8) as u64;
        let per_example = (SYNTHETIC_B_INPUT * (8 + 4 + 4) + 8 + 8 + 4) as u64;
        let bytes = (experts as u64)
            .checked_mul(per_expert)
            .zip((train as u64).checked_add(test as u64))
            .and_then(|(bank, n)| bank.checked_add(n.checked_mul(per_example)?));
        crate::memory::check_fits(
            &format!(
                "synthetic-b with --experts {experts}, {train} training and {test} test examples"
            ),
            bytes,
        )?;
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x7379_6e42);
        let per = SYNTHETIC_B_INPUT * SYNTHETIC_B_EXPERT_OUT;
        let truth: Vec<Vec<f64>> = (0..SYNTHETIC_B_TRUE)
            .map(|_| (0..per).map(|_| normal(&mut rng)).collect())
            .collect();
        let v: Vec<f64> = (0..SYNTHETIC_B_EXPERT_OUT)
            .map(|_| normal(&mut rng))
            .collect();

        let total = train + test;
        let xs: Vec<f64> = (0..total * SYNTHETIC_B_INPUT)
            .map(|_| normal(&mut rng))
            .collect();
        let raw: Vec<f64> = xs
            .chunks(SYNTHETIC_B_INPUT)
            .map(|x| {
                let mut avg = [0.0; SYNTHETIC_B_EXPERT_OUT];
                for w in &truth {
                    for (a, o) in avg.iter_mut().zip(expert_out(w, x)) {
                        *a += o / SYNTHETIC_B_TRUE as f64;
                    }
                }
                avg.iter().zip(&v).map(|(a, b)| a * b).sum()
            })
            .collect();
        let mut sorted = raw.clone();
        sorted.sort_by(f64::total_cmp);
        let c = -sorted[sorted.len() / 2];
        let labels: Vec<i32> = raw.iter().map(|r| i32::from(r + c > 0.0)).collect();

        // the bank: the true experts at seeded positions, fresh draws elsewhere
        let mut slots: Vec<usize> = (0..experts).collect();
        slots.shuffle(&mut rng);
        let mut true_experts = slots[..SYNTHETIC_B_TRUE].to_vec();
        let mut bank = vec![0f32; experts * per];
        for (t, &e) in true_experts.iter().enumerate() {
            for (dst, src) in bank[e * per..(e + 1) * per].iter_mut().zip(&truth[t]) {
                *dst = *src as f32;
            }
        }
        for &e in &slots[SYNTHETIC_B_TRUE..] {
            for dst in &mut bank[e * per..(e + 1) * per] {
                *dst = normal(&mut rng) as f32;
            }
        }
        true_experts.sort_unstable();

        let feats: Vec<f32> = xs.iter().map(|&x| x as f32).collect();
        let split = train * SYNTHETIC_B_INPUT;
        Ok(SyntheticB {
            train: Dataset::new(
                feats[..split].to_vec(),
                vec![SYNTHETIC_B_INPUT],
                vec![labels[..train].to_vec()],
            )?,
            test: Dataset::new(
                feats[split..].to_vec(),
                vec![SYNTHETIC_B_INPUT],
                vec![labels[train..].to_vec()],
            )?,
            expert_weights: bank,
            experts,
            true_experts,
            head: v,
            offset: c,
        })
    }
}
