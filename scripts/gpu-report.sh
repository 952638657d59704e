#!/usr/bin/env bash
# One command for whoever has a real GPU (docs/gpu.md, "Measuring on a real GPU"): builds moegrad,
# runs `moegrad bench all --json` with the matmul sizes 1024-8192, times the `gpt` and `moe-gpt`
# training steps on the GPU, and, when Python's torch sees a CUDA GPU, the PyTorch peers on it in
# the same session (torch.matmul with TF32 off and on, the MoE layer step, the char-LM steps of
# gpt and moe-gpt, the CNN epochs), alternating moegrad and peer rounds; writes everything to one
# JSON file.
#
#   scripts/gpu-report.sh [OUT.json]          (default: gpu-report.json)
#
# Environment: PYTHON (default python3) with torch and numpy installed (a throw-away venv:
# python3 -m venv /tmp/v && /tmp/v/bin/pip install torch numpy), PEERS (default ../shared/peers,
# the peer scripts), ROUNDS (default 2), MOEGRAD_BIN (a moegrad binary built elsewhere: skips
# the build), STEP_TIMEOUT (seconds any one measurement may take, default 300: a step that runs
# past it, or fails, is recorded as an error and the report goes on). Without torch or without a
# CUDA GPU the peers are skipped and the report says so. Nothing is downloaded at run time beyond
# what cargo and pip fetch when you set them up. FOCUS=targets measures only what issue 29's open
# targets need, for a short lease of a GPU (a few minutes on an H200): each round the matmul at
# 1024-8192 under the default kernel (tuned: what it timed for each candidate is in the JSON's
# gpu_tuned), auto and wide-vec4, `bench moe` (the dense router both ways),
# the moe-gpt training step, and their peers (torch.matmul, the MoE layer step, the char-LM
# step); FOCUS=all (the default) measures everything above. In both, the matmul, `bench moe`
# and the moe-gpt step also run with MOEGRAD_SHADER_CHECKS=full (wgpu's loop counter in every
# loop, which moegrad's kernels leave out by default: docs/gpu.md), to measure what it costs,
# FOCUS=targets runs the matmul once more with MOEGRAD_SHADER_CHECKS=none (no bounds checks
# either: whether they are what holds the kernels at ~13 TFLOP/s), and `bench moe` once more with MOEGRAD_BIND_GROUPS=create (a bind group created per dispatch,
# as before bind groups were reused), and once with MOEGRAD_MATMUL=plain (no split-k, no row
# splits of the expert bank's weight gradient and the 64×64 grouped kernel instead of
# grouped_matmul_wide: what the splits and the wide kernels gain at small n), and
# `bench gpu-step` (the host's milliseconds per step,
# bind groups reused and created, beside the kernels' GPU milliseconds). FOCUS=targets also
# profiles the top-2 layer step at n = 2 (MOEGRAD_PROFILE=1: GPU milliseconds per kernel) once.
# FOCUS=quick is the least that tells whether the open targets moved, for a lease of a few
# minutes (one round unless ROUNDS says otherwise): the matmul at 1024 and 4096 under the
# default kernel (its gpu_tuned: every candidate's time) and once more at 4096 unchecked,
# `bench moe` at n = 2 and 8 (top-2 only) and the n = 2 profile, `bench gpu-step` (each model's
# kernels by GPU time: gpu_kernels), torch.matmul and the MoE layer step's peer.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu-report.json}
PYTHON=${PYTHON:-python3}
PEERS=${PEERS:-../shared/peers}
ROUNDS_SET=${ROUNDS:-}
ROUNDS=${ROUNDS:-2}
STEP_TIMEOUT=${STEP_TIMEOUT:-300}
FOCUS=${FOCUS:-all}
case "$FOCUS" in
  all|targets) ;;
  quick) ROUNDS=${ROUNDS_SET:-1} ;;
  *) echo "gpu-report: FOCUS=$FOCUS is not all, targets or quick" >&2; exit 2 ;;
esac
export FOCUS
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

if [ -n "${MOEGRAD_BIN:-}" ]; then
  BIN=$MOEGRAD_BIN
else
  cargo build --release -p moegrad-cli >&2 || exit 1
  BIN=./target/release/moegrad
fi

# measure NAME CMD...: runs CMD under the step timeout, its stdout into $TMP/NAME.json; a failure
# leaves the command's last words in the file instead, for the report to show.
measure() {
  local name=$1; shift
  local t0=$SECONDS
  echo "gpu-report: $name" >&2
  timeout "$STEP_TIMEOUT" "$@" > "$TMP/$name.json" 2> "$TMP/$name.err"
  local rc=$?
  if [ "$rc" != 0 ]; then
    local why="exit status $rc"
    [ "$rc" = 124 ] && why="timed out after STEP_TIMEOUT=$STEP_TIMEOUT s"
    printf '{"error": %s}\n' "$("$PYTHON" -c 'import json,sys; print(json.dumps(sys.argv[1] + ": " + sys.stdin.read()[-2000:]))' "$why" < "$TMP/$name.err")" > "$TMP/$name.json"
  fi
  # the figures go to stderr as well, so that a log of a run cut short still holds them
  echo "gpu-report: $name took $((SECONDS - t0)) s: $(tail -n 1 "$TMP/$name.json")" >&2
}

# measure_profile NAME CMD...: as measure, for a command run with MOEGRAD_PROFILE=1, whose
# profile table (ops and GPU kernels) goes to stderr: the file holds {"result": its JSON,
# "profile": the table}.
measure_profile() {
  local name=$1; shift
  measure "$name" env MOEGRAD_PROFILE=1 "$@"
  if [ -s "$TMP/$name.err" ] && ! grep -q '^{"error"' "$TMP/$name.json"; then
    "$PYTHON" - "$TMP/$name.json" "$TMP/$name.err" <<'PY'
import json, sys
out, err = sys.argv[1], sys.argv[2]
text = open(out).read().strip()
result = json.loads(text.splitlines()[-1]) if text else None
with open(out, "w") as f:
    f.write(json.dumps({"result": result, "profile": open(err).read()[-20000:]}) + "\n")
PY
  fi
}

"$BIN" info > "$TMP/info.txt" 2>&1 || true

have_cuda=0
if "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  have_cuda=1
fi

# f16-mixed runs where `moegrad info` says the adapter has shader-f16
have_f16=0
if grep -q "half precision: *yes" "$TMP/info.txt" 2>/dev/null; then
  have_f16=1
fi

# the moegrad side of pytorch_charlm_step.py: a run of 50 and one of 250 iterations (ms_per_iter
# excludes the one evaluation at the end); the report's steady-state step is their difference
# over 200 iterations, which leaves out the first steps' pipeline compilation
TRAIN=(train --data shakespeare --device gpu --eval-windows 12 --warmup-steps 10 --overwrite --json)

for round in $(seq 1 "$ROUNDS"); do
  echo "gpu-report: round $round/$ROUNDS" >&2
  if [ "$FOCUS" = quick ]; then
    measure "moegrad-matmul-$round" "$BIN" bench matmul --device gpu --sizes 1024,4096 --json
    measure "moegrad-matmul-unchecked-$round" env MOEGRAD_SHADER_CHECKS=none "$BIN" bench \
      matmul --device gpu --sizes 4096 --json
    measure "moegrad-moe-$round" "$BIN" bench moe --device gpu --experts 2,8 --dense-experts \
      --json
    measure "moegrad-gpu-step-$round" "$BIN" bench gpu-step --json
    if [ "$round" = 1 ]; then
      measure_profile "moegrad-moe-n2-profile-$round" "$BIN" bench moe --device gpu --experts 2 \
        --dense-experts --json
    fi
  elif [ "$FOCUS" = targets ]; then
    # the default (tuned: its JSON's gpu_tuned holds every candidate's time per size), auto's
    # fixed choice, and the vec4 kernel alone
    measure "moegrad-matmul-$round" "$BIN" bench matmul --device gpu --sizes 1024,2048,4096,8192 --json
    measure "moegrad-matmul-auto-$round" env MOEGRAD_MATMUL=auto "$BIN" bench matmul \
      --device gpu --sizes 1024,2048,4096,8192 --json
    measure "moegrad-matmul-wide-vec4-$round" env MOEGRAD_MATMUL=wide-vec4 "$BIN" bench matmul \
      --device gpu --sizes 1024,2048,4096,8192 --json
    measure "moegrad-matmul-full-checks-$round" env MOEGRAD_SHADER_CHECKS=full "$BIN" bench \
      matmul --device gpu --sizes 1024,2048,4096,8192 --json
    # no bounds checks either: whether the checks on every index are what holds the kernels at
    # ~13 TFLOP/s (measurement only: an out-of-range index is then undefined behaviour)
    measure "moegrad-matmul-unchecked-$round" env MOEGRAD_SHADER_CHECKS=none "$BIN" bench \
      matmul --device gpu --sizes 1024,2048,4096,8192 --json
    measure "moegrad-moe-$round" "$BIN" bench moe --device gpu --json
    measure "moegrad-moe-full-checks-$round" env MOEGRAD_SHADER_CHECKS=full "$BIN" bench moe \
      --device gpu --json
    measure "moegrad-moe-create-bind-groups-$round" env MOEGRAD_BIND_GROUPS=create "$BIN" bench \
      moe --device gpu --json
    measure "moegrad-moe-unsplit-$round" env MOEGRAD_MATMUL=plain "$BIN" bench moe --device gpu \
      --json
    measure "moegrad-gpu-step-$round" "$BIN" bench gpu-step --json
    # where the n = 2 layer step's time goes, kernel by kernel (the open MoE target)
    if [ "$round" = 1 ]; then
      measure_profile "moegrad-moe-n2-profile-$round" "$BIN" bench moe --device gpu --experts 2 \
        --dense-experts --json
    fi
  elif [ "$round" = 1 ]; then
    measure "moegrad-all-$round" "$BIN" bench all --device gpu --sizes 1024,2048,4096,8192 --json
  else
    measure "moegrad-matmul-$round" "$BIN" bench matmul --device gpu --sizes 1024,2048,4096,8192 --json
    measure "moegrad-matmul-auto-$round" env MOEGRAD_MATMUL=auto "$BIN" bench matmul \
      --device gpu --sizes 1024,2048,4096,8192 --json
    # the vec4 wide kernel, not auto's choice (round 1's bench all times every kernel once)
    measure "moegrad-matmul-wide-vec4-$round" env MOEGRAD_MATMUL=wide-vec4 "$BIN" bench matmul \
      --device gpu --sizes 1024,2048,4096,8192 --json
    measure "moegrad-moe-$round" "$BIN" bench moe --device gpu --json
    measure "moegrad-moe-full-checks-$round" env MOEGRAD_SHADER_CHECKS=full "$BIN" bench moe \
      --device gpu --json
    measure "moegrad-moe-create-bind-groups-$round" env MOEGRAD_BIND_GROUPS=create "$BIN" bench \
      moe --device gpu --json
    measure "moegrad-moe-unsplit-$round" env MOEGRAD_MATMUL=plain "$BIN" bench moe --device gpu \
      --json
  fi
  models=(gpt moe-gpt)
  if [ "$FOCUS" = targets ]; then
    models=(moe-gpt)
  elif [ "$FOCUS" = quick ]; then
    models=()
  fi
  for model in ${models[@]+"${models[@]}"}; do
    for iters in 50 250; do
      measure "moegrad-$model-$iters-$round" "$BIN" "${TRAIN[@]}" --model "$model" \
        --iters "$iters" --eval-every "$iters" --out "$TMP/run-$model"
      # the moe-gpt step again with wgpu's loop counters compiled in (what leaving them out gains)
      if [ "$model" = moe-gpt ]; then
        measure "moegrad-$model-full-checks-$iters-$round" env MOEGRAD_SHADER_CHECKS=full "$BIN" \
          "${TRAIN[@]}" --model "$model" --iters "$iters" --eval-every "$iters" \
          --out "$TMP/run-$model-full-checks"
      fi
      # the same in f16-mixed, where the adapter has shader-f16 (issue 29: f16-mixed vs f32)
      if [ "$have_f16" = 1 ] && [ "$FOCUS" = all ]; then
        measure "moegrad-$model-f16-$iters-$round" "$BIN" "${TRAIN[@]}" --model "$model" \
          --precision f16-mixed --iters "$iters" --eval-every "$iters" --out "$TMP/run-$model-f16"
      fi
    done
  done
  if [ "$have_cuda" = 1 ]; then
    measure "torch-matmul-$round" "$PYTHON" - <<'PY'
import json, torch
rows = []
for tf32 in (False, True):  # f32 as moegrad's WGSL kernels; then TF32, what torch users often get
    torch.backends.cuda.matmul.allow_tf32 = tf32
    for n in (1024, 2048, 4096, 8192):
        a = torch.randn(n, n, device="cuda"); b = torch.randn(n, n, device="cuda")
        for _ in range(3): a @ b
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        reps = 20; start.record()
        for _ in range(reps): a @ b
        end.record(); torch.cuda.synchronize(); ms = start.elapsed_time(end) / reps
        rows.append({"n": n, "tf32": tf32, "gflops": 2 * n**3 / ms / 1e6, "ms": ms})
print(json.dumps({"torch_matmul": rows, "gpu": torch.cuda.get_device_name(0),
                  "torch": torch.__version__, "cuda": torch.version.cuda}))
PY
    measure "torch-moe-$round" env PEER_DEVICE=cuda "$PYTHON" "$PEERS/pytorch_moe_step.py"
    if [ "$FOCUS" != quick ]; then
      measure "torch-charlm-$round" env PEER_DEVICE=cuda "$PYTHON" "$PEERS/pytorch_charlm_step.py" 1 50
    fi
    if [ "$FOCUS" = all ]; then
      measure "torch-cnn-$round" env PEER_DEVICE=cuda "$PYTHON" "$PEERS/pytorch_cnn_epoch.py" 1 64
    fi
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
    except Exception as e:  # a measurement that printed no JSON: say so in the report
        return {"error": f"{os.path.basename(path)}: {e}"}
report = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
          "focus": os.environ.get("FOCUS", "all"),
          "peers": "PyTorch CUDA eager" if cuda else "skipped: torch sees no CUDA GPU",
          "moegrad_info": open(os.path.join(tmp, "info.txt")).read(), "rounds": {}}
for path in sorted(glob.glob(os.path.join(tmp, "*-[0-9]*.json"))):
    name, rnd = os.path.basename(path)[:-5].rsplit("-", 1)
    report["rounds"].setdefault(rnd, {})[name] = load(path)
for rnd in report["rounds"].values():  # the steady-state char-LM steps (see TRAIN above)
    for model in ("gpt", "moe-gpt", "gpt-f16", "moe-gpt-f16", "moe-gpt-full-checks"):
        short, long = rnd.get(f"moegrad-{model}-50"), rnd.get(f"moegrad-{model}-250")
        try:
            ms = (long["ms_per_iter"] * 250 - short["ms_per_iter"] * 50) / 200
            rnd[f"moegrad-{model}-steady"] = {"ms_per_iter": ms}
        except (TypeError, KeyError):
            pass
with open(out, "w") as f:
    json.dump(report, f, indent=1)
print(f"gpu-report: wrote {out}", file=sys.stderr)
PY
