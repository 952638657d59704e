"""Checks a `moegrad export --format hf` directory with transformers itself: loads it with
`AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`, encodes a text (or
draws ids when the export has no tokenizer), and compares transformers' ids and logits with
those of `moegrad logits` on the checkpoint that was exported. Run in a throw-away venv (CI has
no Python):

    python3 -m venv /tmp/v && /tmp/v/bin/pip install torch numpy transformers safetensors
    /tmp/v/bin/python scripts/check_hf_export.py DIR --checkpoint RUN/checkpoint.safetensors \
        [--moegrad target/release/moegrad] [--text "ROMEO: ..."]

Prints one JSON line per export; exits 1 when an id differs or a logit differs by 1e-4 or more.
"""
import argparse, json, os, subprocess, sys, tempfile
import torch
import transformers as tf

TOL = 1e-4


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--moegrad", default="target/release/moegrad")
    ap.add_argument("--text", default="ROMEO:\nBut soft, what light through yonder window breaks?")
    a = ap.parse_args()

    model = tf.AutoModelForCausalLM.from_pretrained(a.dir, dtype=torch.float32).eval()
    block = model.config.max_position_embeddings if hasattr(model.config, "max_position_embeddings") \
        else model.config.n_positions
    has_tok = os.path.exists(os.path.join(a.dir, "tokenizer.json"))
    cmd = [a.moegrad, "logits", "--json", "--device", "cpu", "--checkpoint", a.checkpoint]
    report = {"dir": a.dir, "class": type(model).__name__, "transformers": tf.__version__,
              "torch": torch.__version__}
    if has_tok:
        tok = tf.AutoTokenizer.from_pretrained(a.dir)
        hf_ids = tok(a.text, add_special_tokens=False)["input_ids"][:block]
        # moegrad encodes the same text (cut to the same number of tokens by its own ids)
        out = json.loads(subprocess.run(cmd + ["--text", tok.decode(hf_ids)], check=True,
                                        capture_output=True, text=True).stdout)
        ids = out["ids"][0]
        report["tokenizer_ids_equal"] = ids == hf_ids
        report["tokens"] = len(ids)
        report["decode_roundtrip"] = tok.decode(ids) == tok.decode(hf_ids)
    else:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(model.config.vocab_size, (min(block, 12),), generator=g).tolist()
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump([ids], f)
        out = json.loads(subprocess.run(cmd + ["--ids", f.name], check=True,
                                        capture_output=True, text=True).stdout)
        report["tokenizer_ids_equal"] = None
        report["tokens"] = len(ids)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    mine = torch.tensor(out["logits"][0])
    err = float((logits - mine).abs().max())
    report["max_abs_logit_error"] = err
    ok = err < TOL and report["tokenizer_ids_equal"] is not False
    report["ok"] = ok
    print(json.dumps(report))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
