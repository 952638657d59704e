//! The names and layouts of transformers' Llama-style checkpoints, mapped onto a [`Decoder`](super::Decoder)'s
//! parameters (used by `hf_import.rs`):
//!
//! | moegrad                               | transformers (`[out, in]` matrices, transposed here)           |
//! |---------------------------------------|----------------------------------------------------------------|
//! | `embed.weight` `[V, d]`               | `model.embed_tokens.weight` (as is)                            |
//! | `layers.L.attn_norm.weight`           | `model.layers.L.input_layernorm.weight`                        |
//! | `layers.L.attn.{q,k,v,o}.weight`      | `model.layers.L.self_attn.{q,k,v,o}_proj.weight`ᵀ              |
//! | `layers.L.attn.{q,k,v}.bias`          | `model.layers.L.self_attn.{q,k,v}_proj.bias`                   |
//! | `layers.L.attn.{q,k}_norm.weight`     | `model.layers.L.self_attn.{q,k}_norm.weight`                   |
//! | `layers.L.ffn_norm.weight`            | `model.layers.L.post_attention_layernorm.weight`               |
//! | `layers.L.mlp.up.weight` `[d, 2I]`    | `[gate_projᵀ | up_projᵀ]` of `model.layers.L.mlp`              |
//! | `layers.L.mlp.down.weight`            | `model.layers.L.mlp.down_proj.weight`ᵀ                         |
//! | `layers.L.moe.router.weight` `[d, E]` | `model.layers.L.mlp.gate.weight`ᵀ (Mixtral: `block_sparse_moe.gate`) |
//! | `layers.L.moe.experts.w1` `[E, d, 2I]`| per expert `[gateᵀ | upᵀ]`, or v5's `mlp.experts.gate_up_proj` `[E, 2I, d]` |
//! | `layers.L.moe.experts.w2` `[E, I, d]` | per expert `downᵀ`, or v5's `mlp.experts.down_proj` `[E, d, I]` |
//! | `layers.L.moe.shared.{up,down}.weight`| `model.layers.L.mlp.shared_expert.*` (as the dense MLP)       |
//! | `layers.L.moe.shared.gate.weight` `[d, 1]` | `model.layers.L.mlp.shared_expert_gate.weight`ᵀ          |
//! | `norm.weight`                         | `model.norm.weight`                                            |
//! | `head.weight` `[d, V]`                | `lm_head.weight`ᵀ (absent when tied)                           |
//!
//! DeepSeek-V3's `model.layers.L.mlp.gate.e_score_correction_bias` becomes the `deepseek-v3`
//! router's state `layers.L.moe.router.e_score_correction_bias`; its latent attention's
//! `self_attn.{q_proj, q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm,
//! kv_b_proj, o_proj}` become `attn.{q, q_down, q_norm, q_up, kv_down, kv_norm, kv_up, o}`, the
//! rotary rows reordered from interleaved to half-split pairs; its shared experts are
//! `mlp.shared_experts.*`.
//!
//! Per-expert names: Mixtral `block_sparse_moe.experts.E.{w1, w3, w2}.weight` (gate, up, down),
//! the others `mlp.experts.E.{gate_proj, up_proj, down_proj}.weight`.

use super::decoder_config::{DecoderConfig, Family, LatentConfig};
use super::hf_import::HostTensor;
use crate::{Error, Result};
use std::collections::{BTreeMap, BTreeSet};

/// The checkpoint's tensors, handed out by moegrad parameter name; remembers which were used.
pub(super) struct Source {
    tensors: BTreeMap<String, HostTensor>,
    used: BTreeSet<String>,
    family: Family,
    experts: usize,
    /// latent attention's sizes, and whether its rotary columns come interleaved
    latent: Option<(LatentConfig, usize, bool)>,
}

/// A tensor as `(shape, values)`.
type Values = (Vec<usize>, Vec<f32>);

impl Source {
    pub(super) fn new(
        tensors: BTreeMap<String, HostTensor>,
        cfg: &DecoderConfig,
        interleaved: bool,
    ) -> Source {
        Source {
            tensors,
            used: BTreeSet::new(),
            family: cfg.family,
            experts: cfg.moe.as_ref().map_or(0, |m| m.experts),
            latent: cfg.latent.map(|l| (l, cfg.heads, interleaved)),
        }
    }

    /// `name`ᵀ after reordering its rows (`[out, in]`: output features) so that new row `i` is
    /// old row `order[i]`.
    fn transposed_reordered(
        &mut self,
        name: &str,
        for_param: &str,
        order: &[usize],
    ) -> Result<Values> {
        let (r, c, v) = self.matrix(name, for_param)?;
        if order.len() != r {
            return Err(Error::Io(format!(
                "{name} has {r} rows, expected {} for moegrad's {for_param}",
                order.len()
            )));
        }
        let rows: Vec<f32> = order
            .iter()
            .flat_map(|&i| v[i * c..(i + 1) * c].to_vec())
            .collect();
        Ok((vec![c, r], transpose(&rows, r, c)))
    }

    /// The row order that turns DeepSeek's interleaved rotary pairs `(x0, x1), (x2, x3), …` into
    /// moegrad's half-split ones `(x0, x_{r/2}), …`: within each block of `block` rows, the last
    /// `r` (the rotary part) are taken even rows first, then odd; identity when not interleaved.
    fn rope_order(&self, rows: usize, block: usize) -> Vec<usize> {
        let Some((l, _, true)) = self.latent else {
            return (0..rows).collect();
        };
        let (r, keep) = (l.rope_dim, block - l.rope_dim);
        (0..rows)
            .map(|i| {
                let (base, j) = (i - i % block, i % block);
                if j < keep {
                    i
                } else {
                    let k = j - keep;
                    let from = if k < r / 2 {
                        2 * k
                    } else {
                        2 * (k - r / 2) + 1
                    };
                    base + keep + from
                }
            })
            .collect()
    }

    /// The tensor `name`, marked used.
    fn get(&mut self, name: &str, for_param: &str) -> Result<&HostTensor> {
        self.used.insert(name.to_string());
        self.tensors.get(name).ok_or_else(|| {
            Error::Io(format!(
                "the checkpoint has no tensor {name} (for moegrad's {for_param})"
            ))
        })
    }

    /// A 2-D `[rows, cols]` tensor, checked.
    fn matrix(&mut self, name: &str, for_param: &str) -> Result<(usize, usize, Vec<f32>)> {
        let t = self.get(name, for_param)?;
        match t.shape[..] {
            [r, c] => Ok((r, c, t.values.clone())),
            _ => Err(Error::Io(format!(
                "{name} has shape {:?}, expected a matrix",
                t.shape
            ))),
        }
    }

    /// `name`ᵀ: PyTorch's `[out, in]` as moegrad's `[in, out]`.
    fn transposed(&mut self, name: &str, for_param: &str) -> Result<Values> {
        let (r, c, v) = self.matrix(name, for_param)?;
        Ok((vec![c, r], transpose(&v, r, c)))
    }

    /// `[gateᵀ | upᵀ]` `[d, 2I]` from `gate` and `up` `[I, d]`.
    fn side_by_side(&mut self, gate: &str, up: &str, for_param: &str) -> Result<Values> {
        let (gi, gd, g) = self.matrix(gate, for_param)?;
        let (ui, ud, u) = self.matrix(up, for_param)?;
        if (gi, gd) != (ui, ud) {
            return Err(Error::Io(format!(
                "{gate} [{gi}, {gd}] and {up} [{ui}, {ud}] must have one shape"
            )));
        }
        let (gt, ut) = (transpose(&g, gi, gd), transpose(&u, ui, ud));
        let mut out = Vec::with_capacity(2 * gi * gd);
        for row in 0..gd {
            out.extend_from_slice(&gt[row * gi..(row + 1) * gi]);
            out.extend_from_slice(&ut[row * ui..(row + 1) * ui]);
        }
        Ok((vec![gd, 2 * gi], out))
    }

    /// DeepSeek's selection bias of MoE layer prefix `layers.L.moe` (`[E]`), which moegrad keeps
    /// as router state `layers.L.moe.router.e_score_correction_bias`.
    pub(super) fn correction_bias(&mut self, moe_scope: &str) -> Result<Values> {
        let layer = moe_scope
            .strip_prefix("layers.")
            .and_then(|r| r.strip_suffix(".moe"))
            .unwrap_or(moe_scope);
        let name = format!("model.layers.{layer}.mlp.gate.e_score_correction_bias");
        let t = self.get(&name, &format!("{moe_scope}.router state"))?;
        Ok((t.shape.clone(), t.values.clone()))
    }

    /// The values of moegrad's parameter `name` (see the module docs).
    pub(super) fn take(&mut self, name: &str) -> Result<Values> {
        let same = |s: &mut Source, hf: &str| -> Result<Values> {
            let t = s.get(hf, name)?;
            Ok((t.shape.clone(), t.values.clone()))
        };
        if name == "embed.weight" {
            return same(self, "model.embed_tokens.weight");
        }
        if name == "norm.weight" {
            return same(self, "model.norm.weight");
        }
        if name == "head.weight" {
            return self.transposed("lm_head.weight", name);
        }
        let Some((layer, rest)) = name.strip_prefix("layers.").and_then(|r| r.split_once('.'))
        else {
            return Err(Error::Io(format!(
                "moegrad's parameter {name} has no transformers counterpart"
            )));
        };
        let p = format!("model.layers.{layer}");
        let mlp = if self.family == Family::Mixtral {
            format!("{p}.block_sparse_moe")
        } else {
            format!("{p}.mlp")
        };
        if let Some((l, heads, _)) = self.latent
            && let Some(part) = rest.strip_prefix("attn.")
        {
            let a = format!("{p}.self_attn");
            let qk = l.nope_dim + l.rope_dim;
            return match part {
                "q.weight" => {
                    let order = self.rope_order(heads * qk, qk);
                    self.transposed_reordered(&format!("{a}.q_proj.weight"), name, &order)
                }
                "q_down.weight" => self.transposed(&format!("{a}.q_a_proj.weight"), name),
                "q_norm.weight" => same(self, &format!("{a}.q_a_layernorm.weight")),
                "q_up.weight" => {
                    let order = self.rope_order(heads * qk, qk);
                    self.transposed_reordered(&format!("{a}.q_b_proj.weight"), name, &order)
                }
                "kv_down.weight" => {
                    let rows = l.kv_rank + l.rope_dim;
                    let order = self.rope_order(rows, rows);
                    self.transposed_reordered(
                        &format!("{a}.kv_a_proj_with_mqa.weight"),
                        name,
                        &order,
                    )
                }
                "kv_norm.weight" => same(self, &format!("{a}.kv_a_layernorm.weight")),
                "kv_up.weight" => self.transposed(&format!("{a}.kv_b_proj.weight"), name),
                "o.weight" => self.transposed(&format!("{a}.o_proj.weight"), name),
                _ => Err(Error::Io(format!(
                    "moegrad's parameter {name} has no transformers counterpart"
                ))),
            };
        }
        // DeepSeek names its shared experts in the plural
        let shared = if self.family == Family::DeepseekMoe {
            format!("{p}.mlp.shared_experts")
        } else {
            format!("{p}.mlp.shared_expert")
        };
        match rest {
            "attn_norm.weight" => same(self, &format!("{p}.input_layernorm.weight")),
            "ffn_norm.weight" => same(self, &format!("{p}.post_attention_layernorm.weight")),
            "attn.q_norm.weight" | "attn.k_norm.weight" => {
                same(self, &format!("{p}.self_attn.{}", &rest["attn.".len()..]))
            }
            "mlp.up.weight" => self.side_by_side(
                &format!("{p}.mlp.gate_proj.weight"),
                &format!("{p}.mlp.up_proj.weight"),
                name,
            ),
            "mlp.down.weight" => self.transposed(&format!("{p}.mlp.down_proj.weight"), name),
            "moe.shared.up.weight" => self.side_by_side(
                &format!("{shared}.gate_proj.weight"),
                &format!("{shared}.up_proj.weight"),
                name,
            ),
            "moe.shared.down.weight" => {
                self.transposed(&format!("{shared}.down_proj.weight"), name)
            }
            "moe.shared.gate.weight" => {
                self.transposed(&format!("{p}.mlp.shared_expert_gate.weight"), name)
            }
            "moe.router.weight" => {
                // the stacked layout renames Mixtral's block_sparse_moe to mlp
                let legacy = format!("{mlp}.gate.weight");
                let stacked = format!("{p}.mlp.gate.weight");
                let which = if self.tensors.contains_key(&legacy) {
                    legacy
                } else {
                    stacked
                };
                self.transposed(&which, name)
            }
            "moe.experts.w1" | "moe.experts.w2" => self.experts(&p, &mlp, rest, name),
            other => {
                if let Some(proj) = other.strip_prefix("attn.")
                    && let Some((which, kind)) = proj.split_once('.')
                    && ["q", "k", "v", "o"].contains(&which)
                {
                    let hf = format!("{p}.self_attn.{which}_proj.{kind}");
                    return if kind == "weight" {
                        self.transposed(&hf, name)
                    } else {
                        same(self, &hf)
                    };
                }
                Err(Error::Io(format!(
                    "moegrad's parameter {name} has no transformers counterpart"
                )))
            }
        }
    }

    /// The stacked expert weights `w1` `[E, d, 2I]` or `w2` `[E, I, d]` of layer prefix `p`, from
    /// v5's stacked tensors when present, else from the per-expert ones.
    fn experts(&mut self, p: &str, mlp: &str, which: &str, name: &str) -> Result<Values> {
        let first = which == "moe.experts.w1";
        let stacked = format!(
            "{p}.mlp.experts.{}",
            if first { "gate_up_proj" } else { "down_proj" }
        );
        if self.tensors.contains_key(&stacked) {
            let t = self.get(&stacked, name)?;
            let [e, rows, cols] = t.shape[..] else {
                return Err(Error::Io(format!(
                    "{stacked} has shape {:?}, expected [experts, out, in]",
                    t.shape
                )));
            };
            // each expert's [out, in] transposed to [in, out]; gate_up_proj's rows are the gate
            // then the up projection, so its transpose is [gateᵀ | upᵀ] already
            let per = rows * cols;
            let mut out = Vec::with_capacity(e * per);
            for x in 0..e {
                out.extend(transpose(&t.values[x * per..(x + 1) * per], rows, cols));
            }
            return Ok((vec![e, cols, rows], out));
        }
        let (gate, up, down) = if self.family == Family::Mixtral {
            ("w1", "w3", "w2")
        } else {
            ("gate_proj", "up_proj", "down_proj")
        };
        let mut shape = Vec::new();
        let mut out = Vec::new();
        for x in 0..self.experts {
            let e = format!("{mlp}.experts.{x}");
            let (s, v) = if first {
                self.side_by_side(
                    &format!("{e}.{gate}.weight"),
                    &format!("{e}.{up}.weight"),
                    name,
                )?
            } else {
                self.transposed(&format!("{e}.{down}.weight"), name)?
            };
            if !shape.is_empty() && shape != s {
                return Err(Error::Io(format!(
                    "expert {x} of {mlp} has shape {s:?}, expert 0 {shape:?}"
                )));
            }
            shape = s;
            out.extend(v);
        }
        let mut full = vec![self.experts];
        full.extend(shape);
        Ok((full, out))
    }

    /// Fails on a tensor of the checkpoint no parameter took (a model the config does not
    /// describe), except a tied `lm_head.weight` equal to the embedding.
    pub(super) fn check_all_used(&self) -> Result<()> {
        for name in self.tensors.keys() {
            if self.used.contains(name) || name.ends_with("rotary_emb.inv_freq") {
                continue;
            }
            if name == "lm_head.weight"
                && self
                    .tensors
                    .get("model.embed_tokens.weight")
                    .map(|t| &t.values)
                    == self.tensors.get(name).map(|t| &t.values)
            {
                continue;
            }
            return Err(Error::Io(format!(
                "the checkpoint's tensor {name} belongs to no parameter of the model its config describes"
            )));
        }
        Ok(())
    }
}

/// `[r, c]` row-major → `[c, r]`.
pub(crate) fn transpose(v: &[f32], r: usize, c: usize) -> Vec<f32> {
    let mut out = vec![0.0; r * c];
    for i in 0..r {
        for j in 0..c {
            out[j * r + i] = v[i * c + j];
        }
    }
    out
}
