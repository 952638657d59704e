#!/usr/bin/env bash
# The Llama-style families' CPU training step against transformers' own (issue 26; docs/families.md,
# docs/benchmarks.md): for each round and each family, transformers' step
# (`$PEERS/pytorch_hf_moe_step.py THREADS 30 FAMILY`: 3 warm-up steps, then 30 timed) and then
# moegrad's (`moegrad train --model FAMILY --tokenizer bpe:512 --device cpu` with
# RAYON_NUM_THREADS=THREADS, at the same configuration), alternating, so both see the machine in
# the same state. moegrad's figure is its steady-state step: two runs of 30 and 150 iterations,
# each evaluating only at its end (evaluation is not timed), give (150·t150 − 30·t30)/120, the
# time of steps 31 to 150, so its warm-up is left out as transformers' is. Prints one line per
# measurement, then the best round of each program per family, their ratio, and each MoE family's
# step over moegrad's own `llama` step.
#
#   scripts/families-speed.sh [ROUNDS] [FAMILY ...]     (default: 3 rounds of all five families)
#
# Environment: PYTHON (default python3) with torch and transformers installed (a throw-away venv:
# python3 -m venv /tmp/v && /tmp/v/bin/pip install torch numpy transformers), PEERS (default
# ../shared/peers), THREADS (default 2), MOEGRAD_BIN (a moegrad binary built elsewhere: skips the
# build). On a machine with other work running, single rounds swing by more than any change
# (docs/benchmarks.md): read the best rounds, over several.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
PEERS=${PEERS:-../shared/peers}
THREADS=${THREADS:-2}
ROUNDS=${1:-3}
shift || true
FAMILIES=("$@")
[ ${#FAMILIES[@]} -eq 0 ] && FAMILIES=(llama mixtral qwen2-moe olmoe deepseek-moe)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

if [ -n "${MOEGRAD_BIN:-}" ]; then
  BIN=$MOEGRAD_BIN
else
  cargo build --release -p moegrad-cli >&2 || exit 1
  BIN=./target/release/moegrad
fi
if ! "$PYTHON" -c "import torch, transformers" 2>/dev/null; then
  echo "families-speed: $PYTHON has no torch and transformers (see the header of this script)" >&2
  exit 1
fi

# moegrad_ms FAMILY ITERS: moegrad's ms per training step over a run of ITERS steps
moegrad_ms() {
  RAYON_NUM_THREADS=$THREADS "$BIN" train --data shakespeare --model "$1" --tokenizer bpe:512 \
    --device cpu --iters "$2" --eval-every "$2" --eval-windows 8 --out "$TMP/run-$1" --overwrite \
    --json 2>/dev/null | "$PYTHON" -c 'import json, sys; print(json.load(sys.stdin)["ms_per_iter"])'
}

# transformers_ms FAMILY: transformers' ms per training step
transformers_ms() {
  local peer=$1
  case $1 in qwen2-moe) peer=qwen2_moe ;; deepseek-moe) peer=deepseek_v3 ;; esac
  "$PYTHON" "$PEERS/pytorch_hf_moe_step.py" "$THREADS" 30 "$peer" 2>/dev/null |
    "$PYTHON" -c 'import json, sys; print(json.load(sys.stdin)["hf_step"][0]["ms_per_iter"])'
}

for r in $(seq 1 "$ROUNDS"); do
  for f in "${FAMILIES[@]}"; do
    hf=$(transformers_ms "$f") || hf=nan
    short=$(moegrad_ms "$f" 30) || short=nan
    long=$(moegrad_ms "$f" 150) || long=nan
    "$PYTHON" - "$r" "$f" "$hf" "$short" "$long" <<'EOF' | tee -a "$TMP/rounds"
import sys
r, f, hf, short, long = sys.argv[1], sys.argv[2], *map(float, sys.argv[3:])
steady = (150 * long - 30 * short) / 120
print(f"round {r} {f:13} transformers {hf:6.1f} ms  moegrad {steady:6.1f} ms "
      f"(150-step mean {long:.1f})  ratio {hf / steady:.2f}")
EOF
  done
done

"$PYTHON" - "$TMP/rounds" <<'EOF'
import sys
best = {}
for line in open(sys.argv[1]):
    w = line.split()
    f, hf, mg = w[2], float(w[4]), float(w[7])
    b = best.setdefault(f, [float("inf"), float("inf")])
    b[0], b[1] = min(b[0], hf), min(b[1], mg)
print("\nbest rounds: family, transformers ms, moegrad ms, ratio, moegrad over its own llama")
llama = best.get("llama", [None, None])[1]
for f, (hf, mg) in best.items():
    own = f"{mg / llama:.2f}" if llama else "-"
    print(f"{f:13} {hf:6.1f} {mg:6.1f} {hf / mg:5.2f}x {own}")
EOF
