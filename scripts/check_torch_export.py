#!/usr/bin/env python3
"""Checks a `moegrad export --format torch --test-data` directory with PyTorch alone.

    python3 scripts/check_torch_export.py DIR

Imports DIR/model.py, builds the model config.json describes, loads model.safetensors with
`load_state_dict(..., strict=True)` (every name and shape must match), runs the test split of
test_data.safetensors in eval mode, and compares the accuracy per task with moegrad's
(moegrad_eval.json, computed by the export on the same data), and the logits of the first
examples with moegrad's. Exits 1 when the accuracies differ by more than `--tolerance`
examples per task (default 0: the same count of correct answers) or a logit by more than
`--logits-tolerance` (default 1e-4).

Needs torch and safetensors (a throw-away venv: python3 -m venv /tmp/v &&
/tmp/v/bin/pip install torch safetensors numpy); moegrad's tests do not run it (CI has no
Python); docs/interop.md records its output.
"""

import argparse
import importlib.util
import json
import os
import sys

import torch
from safetensors.torch import load_file


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--tolerance", type=int, default=0, help="examples per task that may differ")
    ap.add_argument("--logits-tolerance", type=float, default=1e-4)
    args = ap.parse_args()

    spec = importlib.util.spec_from_file_location("moegrad_export_model", os.path.join(args.dir, "model.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = json.load(open(os.path.join(args.dir, "config.json")))
    model = module.build(config)
    model.load_state_dict(load_file(os.path.join(args.dir, "model.safetensors")), strict=True)
    model.eval()

    data = load_file(os.path.join(args.dir, "test_data.safetensors"))
    images, labels = data["images"], data["labels"]
    moegrad = json.load(open(os.path.join(args.dir, "moegrad_eval.json")))
    n, tasks = labels.shape
    correct = [0] * tasks
    with torch.no_grad():
        for start in range(0, n, args.batch):
            logits = model(images[start : start + args.batch])
            for t in range(tasks):
                pred = logits[t].argmax(-1)
                correct[t] += int((pred == labels[start : start + args.batch, t]).sum())

    with torch.no_grad():
        first = model(images[: moegrad["logits_examples"]])
    logit_diff = max(
        (first[t] - torch.tensor(moegrad["logits"][t]).reshape(first[t].shape)).abs().max().item()
        for t in range(tasks)
    )

    ok = logit_diff <= args.logits_tolerance
    router = f", router {config['router']}" if "router" in config else ""
    print(f"{args.dir}: model {config['model']}{router}, {n} test examples, torch {torch.__version__}")
    for t in range(tasks):
        ours = correct[t]
        theirs = round(moegrad["test_accuracy"][t] * n)
        same = abs(ours - theirs) <= args.tolerance
        ok &= same
        print(
            f"  task {t}: PyTorch {100 * ours / n:.2f}% ({ours}/{n}), moegrad {100 * theirs / n:.2f}% "
            f"({theirs}/{n}): {'equal' if ours == theirs else 'differ by ' + str(abs(ours - theirs))}"
        )
    print(
        f"  logits of the first {moegrad['logits_examples']} examples: max |PyTorch - moegrad| = "
        f"{logit_diff:.2e} (tolerance {args.logits_tolerance:.0e})"
    )
    print("OK" if ok else "MISMATCH")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
