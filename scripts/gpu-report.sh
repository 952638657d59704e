#!/usr/bin/env bash
# One command for whoever has a real GPU (docs/gpu.md, "Measuring on a real GPU"): builds moegrad,
# runs `moegrad bench all --json` and the matmul sizes 1024-8192, and, when Python's torch sees a
# CUDA GPU, the PyTorch peers on it in the same session (torch.matmul, the MoE layer step, the
# char-LM steps of gpt and moe-gpt, the transformers families), alternating moegrad and peer
# rounds; writes everything to one JSON file.
#
#   scripts/gpu-report.sh [OUT.json]          (default: gpu-report.json)
#
# Environment: PYTHON (default python3) with torch, numpy, transformers installed (a throw-away
# venv: python3 -m venv /tmp/v && /tmp/v/bin/pip install torch numpy transformers safetensors),
# PEERS (default ../shared/peers, the peer scripts), ROUNDS (default 2). Without torch or without
# a CUDA GPU the peers are skipped and the report says so. Nothing is downloaded at run time
# beyond what cargo and pip fetch when you set them up.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu-report.json}
PYTHON=${PYTHON:-python3}
PEERS=${PEERS:-../shared/peers}
ROUNDS=${ROUNDS:-2}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

cargo build --release -p moegrad-cli >&2
BIN=./target/release/moegrad
"$BIN" info --json > "$TMP/info.json" 2>/dev/null || "$BIN" info > "$TMP/info.txt" 2>&1 || true

have_cuda=0
if "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  have_cuda=1
fi

for round in $(seq 1 "$ROUNDS"); do
  echo "gpu-report: round $round/$ROUNDS: moegrad" >&2
  "$BIN" bench all --json > "$TMP/moegrad-all-$round.json"
  "$BIN" bench matmul --device gpu --sizes 1024,2048,4096,8192 --json > "$TMP/moegrad-matmul-$round.json"
  if [ "$have_cuda" = 1 ]; then
    echo "gpu-report: round $round/$ROUNDS: PyTorch CUDA peers" >&2
    "$PYTHON" - > "$TMP/torch-matmul-$round.json" <<'PY'
import json, time, torch
rows = []
for n in (1024, 2048, 4096, 8192):
    a = torch.randn(n, n, device="cuda"); b = torch.randn(n, n, device="cuda")
    torch.backends.cuda.matmul.allow_tf32 = False  # f32, as moegrad's WGSL kernels
    for _ in range(3): a @ b
    torch.cuda.synchronize(); reps = 10; t = time.perf_counter()
    for _ in range(reps): a @ b
    torch.cuda.synchronize(); dt = (time.perf_counter() - t) / reps
    rows.append({"n": n, "gflops": 2 * n**3 / dt / 1e9, "ms": dt * 1e3})
print(json.dumps({"torch_matmul_f32": rows, "gpu": torch.cuda.get_device_name(0),
                  "torch": torch.__version__, "cuda": torch.version.cuda}))
PY
    PEER_DEVICE=cuda "$PYTHON" "$PEERS/pytorch_moe_step.py" > "$TMP/torch-moe-$round.json"
    PEER_DEVICE=cuda "$PYTHON" "$PEERS/pytorch_charlm_step.py" 1 50 > "$TMP/torch-charlm-$round.json"
    PEER_DEVICE=cuda "$PYTHON" "$PEERS/pytorch_hf_moe_step.py" 1 20 > "$TMP/torch-hf-$round.json" || true
  fi
done

"$PYTHON" - "$TMP" "$OUT" "$have_cuda" <<'PY'
import glob, json, os, sys, datetime
tmp, out, cuda = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
def load(path):
    try:
        with open(path) as f:
            text = f.read().strip()
        return json.loads(text.splitlines()[-1]) if text else None
    except Exception as e:  # a peer that failed: say so in the report
        return {"error": f"{os.path.basename(path)}: {e}"}
report = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
          "peers": "PyTorch CUDA eager" if cuda else "skipped: torch sees no CUDA GPU",
          "rounds": {}}
info = os.path.join(tmp, "info.json")
report["moegrad_info"] = load(info) if os.path.exists(info) else open(os.path.join(tmp, "info.txt")).read()
for path in sorted(glob.glob(os.path.join(tmp, "*-[0-9]*.json"))):
    name, rnd = os.path.basename(path)[:-5].rsplit("-", 1)
    report["rounds"].setdefault(rnd, {})[name] = load(path)
with open(out, "w") as f:
    json.dump(report, f, indent=1)
print(f"gpu-report: wrote {out}", file=sys.stderr)
PY
