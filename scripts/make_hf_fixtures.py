"""Writes the Hugging Face parity fixtures of tests/hf_parity.rs: tiny random models of each family
transformers defines, with awkward settings, saved by transformers itself, and transformers' logits for
fixed token ids. Run once, in a throw-away venv (CI has no Python; the outputs are committed):

    python3 -m venv /tmp/v && /tmp/v/bin/pip install torch numpy transformers safetensors
    /tmp/v/bin/python scripts/make_hf_fixtures.py tests/fixtures/hf [FAMILY ...]

(naming families writes only those; `gpt2` was added later, with `... tests/fixtures/hf gpt2`).

Each fixture directory holds what `save_pretrained` writes (config.json, model.safetensors: with
transformers 5.x, the per-expert names the Hub's checkpoints use, e.g.
`block_sparse_moe.experts.E.w1.weight`, `mlp.experts.E.gate_proj.weight`) and `expected.json`:
{"transformers": version, "ids": [[...], ...], "logits": [...] (row-major [B, T, V], f32),
"min_topk_margin": ...}. Where a family routes, `stacked/model.safetensors` holds the model's own
`state_dict()`: transformers v5's stacked experts (`mlp.experts.gate_up_proj` [E, 2I, d],
`mlp.experts.down_proj` [E, d, I]), so both layouts are imported and checked.

Weights are redrawn larger than transformers' 0.02 initialisation (N(0, 0.25²), norms 1 ± 0.2,
biases N(0, 0.1²)) so that every part of the model moves the logits; a model whose routing has a
near-tie (the k-th and (k+1)-th router probabilities of some token closer than 1e-3, where float
rounding could pick another expert) is redrawn with the next seed.
"""
import json, os, sys
import torch
import transformers as tf
from safetensors.torch import load_file, save_file

OUT = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/hf"
ONLY = set(sys.argv[2:])
B, T = 2, 7


def fixtures():
    # grouped-query attention (4 query heads, 2 kv heads), odd widths, tied embeddings,
    # a non-default rope_theta
    yield "llama", tf.LlamaForCausalLM, tf.LlamaConfig(
        vocab_size=61, hidden_size=48, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, rope_theta=5000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True)
    # multi-query attention (1 kv head), top-2 of 4 renormalised, untied
    yield "mixtral", tf.MixtralForCausalLM, tf.MixtralConfig(
        vocab_size=53, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=16,
        rope_theta=1e6, rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None)
    # top-2 of 6 not renormalised, a gated shared expert, q/k/v biases, a dense layer among MoE
    # layers (mlp_only_layers), odd widths
    yield "qwen2_moe", tf.Qwen2MoeForCausalLM, tf.Qwen2MoeConfig(
        vocab_size=57, hidden_size=32, intermediate_size=44, moe_intermediate_size=20,
        shared_expert_intermediate_size=28, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        num_experts=6, num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1],
        max_position_embeddings=16, rope_theta=20000.0, tie_word_embeddings=False, use_sliding_window=False)
    # q/k RMSNorm, top-2 of 8 renormalised (norm_topk_prob on, the other way round from qwen2_moe)
    yield "olmoe", tf.OlmoeForCausalLM, tf.OlmoeConfig(
        vocab_size=50, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        max_position_embeddings=16, rms_norm_eps=1e-5, tie_word_embeddings=False)
    # the first layer dense, then MoE with a shared expert; sigmoid group-limited routing with a
    # nonzero correction bias (set in redraw), top-3 of 8 in 2 of 4 groups, renormalised and
    # scaled; latent attention with a low-rank query, values wider than the query/key heads,
    # interleaved rotary columns
    yield "deepseek_v3", tf.DeepseekV3ForCausalLM, tf.DeepseekV3Config(
        vocab_size=59, hidden_size=32, intermediate_size=40, moe_intermediate_size=12, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=3,
        n_group=4, topk_group=2, first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
        q_lora_rank=12, kv_lora_rank=10, qk_rope_head_dim=4, qk_nope_head_dim=6, v_head_dim=14,
        max_position_embeddings=16, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
    # GPT-2 (moegrad's --model gpt): odd widths, 3 heads, an MLP width that is not 4d, and a
    # byte-level BPE tokenizer.json (trained below) whose 262 tokens are the vocabulary
    yield "gpt2", tf.GPT2LMHeadModel, tf.GPT2Config(
        vocab_size=262, n_embd=24, n_layer=2, n_head=3, n_inner=40, n_positions=16,
        activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def write_tokenizer(d, vocab):
    """A byte-level BPE of `vocab` tokens trained on a few lines, saved as d/tokenizer.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    text = ["To be, or not to be, that is the question:", "Whether 'tis nobler in the mind to suffer"]
    tok.train_from_iterator(text, trainer)
    assert tok.get_vocab_size() == vocab, tok.get_vocab_size()
    tok.save(os.path.join(d, "tokenizer.json"))


def redraw(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or ".ln_" in name:
                p.copy_(1.0 + 0.2 * (torch.rand(p.shape, generator=g) * 2 - 1))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.25 * torch.randn(p.shape, generator=g))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek's selection-only bias
                buf.copy_(0.05 * torch.randn(buf.shape, generator=g))


def routing_margin(model, cfg, logits_seen):
    """The smallest gap, over tokens and MoE layers, between the last choice a router made and
    the first it did not (experts, and for DeepSeek also groups): near 0, float rounding could
    route differently."""
    k = cfg.num_experts_per_tok
    margin = float("inf")
    for gate, logits in logits_seen:
        logits = logits.float()
        if hasattr(gate, "e_score_correction_bias"):
            s = logits.sigmoid() + gate.e_score_correction_bias
            n_group, topk_group = gate.num_group, gate.topk_group
            gs = s.view(-1, n_group, s.shape[-1] // n_group).topk(2, dim=-1)[0].sum(-1)
            top_g = gs.topk(min(topk_group + 1, n_group), dim=-1)
            if topk_group < n_group:
                margin = min(margin, float((top_g.values[:, topk_group - 1] - top_g.values[:, topk_group]).min()))
            mask = torch.zeros_like(gs).scatter_(1, top_g.indices[:, :topk_group], 1)
            mask = mask.unsqueeze(-1).expand(-1, n_group, s.shape[-1] // n_group).reshape(s.shape)
            s = s.masked_fill(~mask.bool(), float("-inf"))
        else:
            s = torch.softmax(logits, dim=-1)
        top = torch.topk(s, k + 1, dim=-1).values
        margin = min(margin, float((top[:, k - 1] - top[:, k]).min()))
    return margin


def main():
    for name, cls, cfg in fixtures():
        if ONLY and name not in ONLY:
            continue
        k = getattr(cfg, "num_experts_per_tok", 0) if name not in ("llama", "gpt2") else 0
        for seed in range(100):
            torch.manual_seed(seed)
            model = cls(cfg).eval()
            redraw(model, 1000 + seed)
            ids = torch.randint(cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))
            seen = []
            hooks = [m.register_forward_hook(lambda mod, inp, out: seen.append((mod, out[0])))
                     for n, m in model.named_modules() if n.endswith("mlp.gate") or n.endswith("block_sparse_moe.gate")]
            with torch.no_grad():
                out = model(input_ids=ids)
            for h in hooks:
                h.remove()
            margin = routing_margin(model, cfg, seen) if k else float("inf")
            if margin > 1e-3:
                break
        d = os.path.join(OUT, name)
        model.save_pretrained(d, safe_serialization=True)
        for extra in ("generation_config.json",):
            if os.path.exists(os.path.join(d, extra)):
                os.remove(os.path.join(d, extra))
        if name == "gpt2":
            write_tokenizer(d, cfg.vocab_size)
        tensors = load_file(os.path.join(d, "model.safetensors"))
        if k:
            state = {n: t.contiguous() for n, t in model.state_dict().items()}
            if cfg.tie_word_embeddings:
                state.pop("lm_head.weight", None)
            assert any(".experts.gate_up_proj" in n for n in state), "expected stacked experts"
            os.makedirs(os.path.join(d, "stacked"), exist_ok=True)
            save_file(state, os.path.join(d, "stacked", "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(d, "expected.json"), "w") as f:
            json.dump({"transformers": tf.__version__, "torch": torch.__version__, "seed": seed,
                       "ids": ids.tolist(), "logits": [round(float(v), 7) for v in out.logits.flatten()],
                       "shape": list(out.logits.shape), "min_topk_margin": None if margin == float("inf") else margin}, f)
        print(name, "seed", seed, "margin", margin, "tensors", len(tensors),
              "bytes", sum(os.path.getsize(os.path.join(r, x)) for r, _, fs in os.walk(d) for x in fs))


if __name__ == "__main__":
    main()
