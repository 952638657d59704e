"""moegrad's image models as PyTorch modules, written by `moegrad export --format torch`.

The export directory holds this file, `config.json` (which model, its sizes and its router)
and `model.safetensors` (the weights under the names below, PyTorch's [out, in] layouts):

    import json, safetensors.torch
    from model import build
    model = build(json.load(open("config.json")))
    model.load_state_dict(safetensors.torch.load_file("model.safetensors"))
    model.eval()
    logits = model(images)          # images [B, 1, side, side]; one [B, 10] tensor per task

The models (moegrad's src/train/models.rs):
  * `mlp`, `cnn`: a shared trunk, a linear head per task.
  * `moe-mlp`, `moe-cnn`: one MoE layer (MLP experts d -> hidden -> 64, ReLU after the layer;
    or the CNN experts, output 50) on the flattened image, a linear head per task.
  * `mmoe-cnn`: multi-gate MoE: one router per task over shared CNN experts, a tower per task.

Routers are written at inference, the rule moegrad applies when not training (docs/routers.md):
noise, jitter and sampling are training-only, so every router here is deterministic. A router
returns dense gates [B, n], zero for the experts a token does not use; an expert runs only on
the rows that use it. Training these modules in PyTorch would need each router's training rule
and gradient estimator, which this file does not have.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn


# ---------------------------------------------------------------- experts and trunks


class MlpExpert(nn.Module):
    """x -> relu(fc1 x) -> fc2 (moegrad's ExpertBank with ReLU, one expert)."""

    def __init__(self, d, hidden, d_out):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


class CnnExpert(nn.Module):
    """The MOESART MultiMNIST expert: conv 5x5x10, ReLU, max-pool 2; conv 5x5x20, ReLU,
    max-pool 2; dense 50, ReLU; dense 50, ReLU (moegrad's CnnExpertBank, one expert)."""

    def __init__(self, side):
        super().__init__()
        after = ((side - 4) // 2 - 4) // 2
        self.side = side
        self.conv1 = nn.Conv2d(1, 10, 5)
        self.conv2 = nn.Conv2d(10, 20, 5)
        self.fc1 = nn.Linear(20 * after * after, 50)
        self.fc2 = nn.Linear(50, 50)

    def forward(self, x):
        x = x.reshape(-1, 1, self.side, self.side)
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return F.relu(self.fc2(x))


class Mlp(nn.Module):
    """`mlp`: flatten, 256 ReLU, 128 ReLU, a head per task."""

    def __init__(self, side, tasks):
        super().__init__()
        self.fc1 = nn.Linear(side * side, 256)
        self.fc2 = nn.Linear(256, 128)
        self.heads = nn.ModuleList(nn.Linear(128, 10) for _ in range(tasks))

    def forward(self, images):
        h = F.relu(self.fc2(F.relu(self.fc1(images.flatten(1)))))
        return [head(h) for head in self.heads]


class Cnn(nn.Module):
    """`cnn`: the CNN expert's layers as a trunk (conv, conv, dense 50) and a head per task."""

    def __init__(self, side, tasks):
        super().__init__()
        after = ((side - 4) // 2 - 4) // 2
        self.conv1 = nn.Conv2d(1, 10, 5)
        self.conv2 = nn.Conv2d(10, 20, 5)
        self.fc = nn.Linear(20 * after * after, 50)
        self.heads = nn.ModuleList(nn.Linear(50, 10) for _ in range(tasks))

    def forward(self, images):
        x = F.max_pool2d(F.relu(self.conv1(images)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        h = F.relu(self.fc(x.flatten(1)))
        return [head(h) for head in self.heads]


# ---------------------------------------------------------------- routers at inference


def dense_gates(n, experts, weights):
    """Scatters per-slot `weights` [B, s] of `experts` [B, s] into dense gates [B, n]."""
    gates = torch.zeros(weights.shape[0], n, dtype=weights.dtype, device=weights.device)
    return gates.scatter_add(1, experts, weights)


class LinearRouter(nn.Module):
    """The routers whose scores are one linear map `gate` (logits = gate(x)), by their rule:

    * `softmax`: every expert, g = softmax(logits) (dense MoE);
    * `topk`, `topk-noisy`: p = softmax(logits), the k largest, renormalised (Shazeer et al.
      2017; the noise is training-only);
    * `topk-unnorm`, `default-moe`, `smoe`, `vmoe`: the k largest of p, weights p (not renormalised);
    * `switch`, `st`, `gumbel-st`, `reinforce`, `reinmax`: the argmax, weight p of it (Switch;
      the estimators sample only in training);
    * `moesart`: the k largest logits, weights 1/k (MOESART's inference, its strategy (iii)
      with every r_i = 1);
    * `threshold`: no bias; the largest p in order while the probability before them is below
      max(eval_t, 0.5/n), at most max_k, weights p.
    """

    def __init__(self, rule, d, n, k, bias, options):
        super().__init__()
        self.rule, self.n, self.k, self.options = rule, n, k, options
        self.gate = nn.Linear(d, n, bias=bias)

    def forward(self, x):
        logits = self.gate(x)
        p = logits.softmax(-1)
        rule, n, k = self.rule, self.n, self.k
        if rule == "softmax":
            return p
        if rule in ("topk", "topk-noisy"):
            w, idx = p.topk(k, dim=-1)
            return dense_gates(n, idx, w / w.sum(-1, keepdim=True))
        if rule in ("topk-unnorm", "default-moe", "smoe", "vmoe"):
            w, idx = p.topk(k, dim=-1)
            return dense_gates(n, idx, w)
        if rule in ("switch", "st", "gumbel-st", "reinforce", "reinmax"):
            w, idx = p.topk(1, dim=-1)
            return dense_gates(n, idx, w)
        if rule == "moesart":
            _, idx = logits.topk(k, dim=-1)
            return dense_gates(n, idx, torch.full(idx.shape, 1.0 / k, dtype=p.dtype))
        if rule == "threshold":
            w, idx = p.topk(min(n, self.options["max_k"]), dim=-1)
            before = w.cumsum(-1) - w
            keep = (before < max(self.options["eval_t"], 0.5 / n)).to(w.dtype)
            return dense_gates(n, idx, w * keep)
        raise ValueError(f"router {rule!r} is not one of LinearRouter's rules")


class XMoeCosineRouter(nn.Module):
    """`xmoe-cosine` (X-MoE, Chi et al. 2022): logits = cos(proj x, e_i) / exp(log_temperature),
    p = softmax, the k largest, weights p."""

    def __init__(self, d, n, k, proj_dim):
        super().__init__()
        self.k, self.n = k, n
        self.proj = nn.Linear(d, proj_dim, bias=False)
        self.expert_embeddings = nn.Parameter(torch.zeros(n, proj_dim))
        self.log_temperature = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        h = self.proj(x)
        h_norm = (h * h).sum(1, keepdim=True).add(1e-12).sqrt()
        a = self.expert_embeddings
        a_norm = (a * a).sum(1).add(1e-12).sqrt()
        logits = (h @ a.t()) / h_norm / a_norm / self.log_temperature.exp()
        w, idx = logits.softmax(-1).topk(self.k, dim=-1)
        return dense_gates(self.n, idx, w)


def smooth_step(t, gamma):
    """DSelect-k's smooth step: 0 below -gamma/2, 1 above gamma/2, a cubic between."""
    h = gamma / 2
    c = t.clamp(-h, h)
    cubic = -2 / gamma**3 * c**3 + 1.5 / gamma * c + 0.5
    return torch.where(t >= h, torch.ones_like(t), torch.where(t <= -h, torch.zeros_like(t), cubic))


class DSelectKRouter(nn.Module):
    """`dselect-k` and `dselect-k-static` (Hazimeh et al. 2021): k selectors, each the pmf of an
    m-bit code with bit j on with probability S(z_j) (S the smooth step), mixed by
    softmax(alpha): q = sum_i softmax(alpha)_i r(z_i) over the 2^m codes. With n < 2^m the codes
    n..2^m fold back onto experts 0.. (`unused=wrap`) or are dropped (`unused=penalty`).
    Per example, alpha and z are linear in x; static, they are parameters shared by all."""

    def __init__(self, d, n, k, gamma, unused, static, alpha_bias, z_bias):
        super().__init__()
        self.n, self.k, self.gamma, self.unused, self.static = n, k, gamma, unused, static
        self.m = max(1, math.ceil(math.log2(max(n, 2))))
        if static:
            self.alpha = nn.Parameter(torch.zeros(k))
            self.z = nn.Parameter(torch.zeros(k, self.m))
        else:
            self.alpha = nn.Linear(d, k, bias=alpha_bias)
            self.z = nn.Linear(d, k * self.m, bias=z_bias)

    def forward(self, x):
        b, k, m, n = x.shape[0], self.k, self.m, self.n
        if self.static:
            alpha = self.alpha.reshape(1, k).expand(b, k)
            z = self.z.reshape(1, k, m).expand(b, k, m)
        else:
            alpha, z = self.alpha(x), self.z(x).reshape(b, k, m)
        u = smooth_step(z, self.gamma)  # [B, k, m]
        codes = torch.arange(1 << m)
        bits = ((codes.reshape(1, -1) >> torch.arange(m).reshape(-1, 1)) & 1).to(u.dtype)  # [m, 2^m]
        r = torch.ones(b, k, 1 << m, dtype=u.dtype)
        for j in range(m):
            uj = u[:, :, j : j + 1]
            r = r * ((1 - uj) + (2 * uj - 1) * bits[j])
        q = (r * alpha.softmax(-1).reshape(b, k, 1)).sum(1)  # [B, 2^m]
        if (1 << m) == n:
            return q
        used, extra = q[:, :n], q[:, n:]
        if self.unused == "wrap":
            return used + F.pad(extra, (0, 2 * n - (1 << m)))
        return used


def build_router(cfg):
    """The router of `cfg` (config.json's `router`, `d`, `experts`, `k`, `router_options`)."""
    rule, d, n, k, o = cfg["router"], cfg["d"], cfg["experts"], cfg["k"], cfg["router_options"]
    if rule == "xmoe-cosine":
        return XMoeCosineRouter(d, n, k, o["proj_dim"])
    if rule in ("dselect-k", "dselect-k-static"):
        static = rule == "dselect-k-static"
        return DSelectKRouter(d, n, k, o["gamma"], o["unused"], static, o["alpha_bias"], o["z_bias"])
    return LinearRouter(rule, d, n, k, rule != "threshold" and cfg["gate_bias"], o)


# ---------------------------------------------------------------- the MoE models


class MoE(nn.Module):
    """n experts; y = sum_e gate_e(x) * expert_e(x), each expert run only on its rows."""

    def __init__(self, experts):
        super().__init__()
        self.experts = nn.ModuleList(experts)

    def forward(self, x, gates):
        y = None
        for e, expert in enumerate(self.experts):
            rows = (gates[:, e] != 0).nonzero().flatten()
            if rows.numel() == 0:
                continue
            out = expert(x[rows]) * gates[rows, e : e + 1]
            if y is None:
                y = torch.zeros(x.shape[0], out.shape[1], dtype=out.dtype)
            y = y.index_add(0, rows, out)
        if y is None:
            y = torch.zeros(x.shape[0], self.experts[0].fc2.out_features, dtype=x.dtype)
        return y


class MoeModel(nn.Module):
    """`moe-mlp`, `moe-cnn` (one router, a linear head per task) and `mmoe-cnn` (a router per
    task, each task's rows its own mixture, a tower dense 50 ReLU -> 10 per task)."""

    def __init__(self, cfg):
        super().__init__()
        side, tasks, n = cfg["side"], cfg["tasks"], cfg["experts"]
        self.multi_gate = cfg["model"] == "mmoe-cnn"
        self.relu_after = cfg["model"] == "moe-mlp"
        if cfg["model"] == "moe-mlp":
            experts = [MlpExpert(side * side, cfg["expert_hidden"], 64) for _ in range(n)]
            d_out = 64
        else:
            experts = [CnnExpert(side) for _ in range(n)]
            d_out = 50
        self.moe = MoE(experts)
        self.routers = nn.ModuleList(build_router(cfg) for _ in range(tasks if self.multi_gate else 1))
        if self.multi_gate:
            self.towers = nn.ModuleList(
                nn.Sequential(nn.Linear(d_out, 50), nn.ReLU(), nn.Linear(50, 10)) for _ in range(tasks)
            )
        else:
            self.heads = nn.ModuleList(nn.Linear(d_out, 10) for _ in range(tasks))

    def forward(self, images):
        x = images.flatten(1)
        outs = [self.moe(x, router(x)) for router in self.routers]
        if self.relu_after:
            outs = [F.relu(h) for h in outs]
        if self.multi_gate:
            return [tower(h) for tower, h in zip(self.towers, outs)]
        return [head(outs[0]) for head in self.heads]


def build(cfg):
    """The model config.json describes, with untrained weights (load the state dict next)."""
    model = cfg["model"]
    if model == "mlp":
        return Mlp(cfg["side"], cfg["tasks"])
    if model == "cnn":
        return Cnn(cfg["side"], cfg["tasks"])
    if model in ("moe-mlp", "moe-cnn", "mmoe-cnn"):
        return MoeModel(cfg)
    raise ValueError(f"unknown model {model!r}")
