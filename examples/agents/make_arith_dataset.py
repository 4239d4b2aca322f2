"""Writes the tool-agent demo's problems (`make run-agent`): multi-step arithmetic from
reasoning-gym (2-3 two-digit terms with + - *, phrased "What is …?" / "Evaluate: …"), which
SmolLM2-135M cannot work out in its head but can hand to a calculator tool.

    python3 examples/agents/make_arith_dataset.py OUT_DIR   # train.jsonl and heldout.jsonl
"""

import json
import os
import sys

import reasoning_gym as rg

CONFIG = dict(min_terms=2, max_terms=3, min_digits=2, max_digits=2, operators=["+", "-", "*"],
              allow_parentheses=False, allow_negation=False, format_style="natural")


def write(path, seed, size):
    with open(path, "w") as f:
        for x in rg.create_dataset("basic_arithmetic", seed=seed, size=size, **CONFIG):
            f.write(json.dumps({"question": x["question"], "answer": str(x["answer"])}) + "\n")


if __name__ == "__main__":
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    write(os.path.join(out, "train.jsonl"), seed=1, size=5000)
    write(os.path.join(out, "heldout.jsonl"), seed=999, size=100)
