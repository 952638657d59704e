#!/usr/bin/env bash
# Trains the three image models docs/interop.md records (cnn and moe-mlp on MNIST, mmoe-cnn on
# MultiMNIST), exports each with `moegrad export --format torch --test-data`, and checks it with
# PyTorch alone (scripts/check_torch_export.py). Usage:
#   PYTHON=/tmp/v/bin/python scripts/record_torch_exports.sh [WORKDIR]
# (PYTHON: an interpreter with torch and safetensors; the README's venv line installs them.)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WORK=${1:-/tmp/moegrad-torch-exports}
rm -rf "$WORK" && mkdir -p "$WORK"
cargo build --release -q -p moegrad-cli
M=target/release/moegrad
run() { # name, then train flags
  local name=$1; shift
  "$M" train --device cpu --out "$WORK/$name" "$@" | tail -1
  "$M" export --checkpoint "$WORK/$name/checkpoint.safetensors" --format torch --test-data --out "$WORK/$name-torch"
  "$PYTHON" scripts/check_torch_export.py "$WORK/$name-torch"
}
run cnn --data mnist --model cnn --epochs 3
run moe-mlp --data mnist --model moe-mlp --router topk --epochs 3
run mmoe-cnn --data multimnist --model mmoe-cnn --router moesart --epochs 2
