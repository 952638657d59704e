"""Writes tests/fixtures/deepseek_router/router.json: transformers' own DeepseekV3TopkRouter
applied to random tokens, for tests/routers_deepseek_v3.rs (CI has no Python; the output is
committed). Run once, in a throw-away venv with torch and transformers (5.24 was used):

    /tmp/v/bin/python scripts/make_deepseek_router_fixture.py tests/fixtures/deepseek_router/router.json

Settings: n = 16 experts in n_group = 4 groups, topk_group = 2, k = 3, routed_scaling_factor = 2.5,
a nonzero e_score_correction_bias, norm_topk_prob both ways. A draw where some token has a near-tie
(between the topk_group-th and next group score, or the k-th and next masked expert score, closer
than 1e-4, where f32 rounding could pick another) is redrawn with the next seed.

JSON: {"transformers", "tokens", "d", "experts", "k", "n_group", "topk_group",
"routed_scaling_factor", "x" ([T, d] row-major), "weight" (torch's [n, d] row-major),
"bias" ([n]), "cases": [{"norm_topk_prob", "indices" ([T, k], sorted ascending per token),
"weights" ([T, k], in the order of "indices")}]}.
"""
import json, os, sys
import torch
import transformers as tf
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

OUT = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/deepseek_router/router.json"
T, D, N, K, G, TG, RSF = 10, 8, 16, 3, 4, 2, 2.5


def config(norm):
    return tf.DeepseekV3Config(hidden_size=D, n_routed_experts=N, num_experts_per_tok=K, n_group=G,
                               topk_group=TG, norm_topk_prob=norm, routed_scaling_factor=RSF)


def margins(router, x):
    """The smallest gap, over tokens, at the group and at the expert selection boundary."""
    with torch.no_grad():
        s = torch.sigmoid(x @ router.weight.T) + router.e_score_correction_bias
        gs = s.view(T, G, N // G).topk(2, dim=-1)[0].sum(-1).sort(dim=-1, descending=True)[0]
        m1 = (gs[:, TG - 1] - gs[:, TG]).min().item()
        keep = torch.zeros(T, G).scatter_(1, torch.topk(s.view(T, G, -1).topk(2, -1)[0].sum(-1), TG)[1], 1)
        masked = s.masked_fill(~keep.unsqueeze(-1).expand(T, G, N // G).reshape(T, N).bool(), -1e9)
        ms = masked.sort(dim=-1, descending=True)[0]
        m2 = (ms[:, K - 1] - ms[:, K]).min().item()
    return min(m1, m2)


def main():
    seed = 0
    while True:
        torch.manual_seed(seed)
        x = torch.randn(T, D)
        weight = torch.randn(N, D) * 0.7
        bias = torch.randn(N) * 0.1
        r = DeepseekV3TopkRouter(config(True))
        with torch.no_grad():
            r.weight.copy_(weight)
            r.e_score_correction_bias.copy_(bias)
        if margins(r, x) > 1e-4:
            break
        seed += 1
    cases = []
    for norm in (True, False):
        r = DeepseekV3TopkRouter(config(norm))
        with torch.no_grad():
            r.weight.copy_(weight)
            r.e_score_correction_bias.copy_(bias)
            _, w, idx = r(x)
        order = idx.argsort(dim=-1)
        cases.append({"norm_topk_prob": norm,
                      "indices": idx.gather(1, order).tolist(),
                      "weights": w.gather(1, order).tolist()})
    os.makedirs(os.path.dirname(OUT) or ".", exist_ok=True)
    with open(OUT, "w") as f:
        json.dump({"transformers": tf.__version__, "seed": seed, "tokens": T, "d": D, "experts": N,
                   "k": K, "n_group": G, "topk_group": TG, "routed_scaling_factor": RSF,
                   "x": x.flatten().tolist(), "weight": weight.flatten().tolist(),
                   "bias": bias.tolist(), "cases": cases}, f)
    print(f"wrote {OUT} (seed {seed}, margin {margins(r, x):.2e})")


main()
