#!/usr/bin/env python3
"""Serve a reasoning-gym dataset through the rollarc environment protocol (v1 or v2).

Usage: reasoning_gym_bridge.py NAME [--config JSON] [--size N] [--seed S]
                               [--answer auto|tagged|plain] [--instruction TEXT]

One problem per episode, answered in one turn. `reset` with seed k serves problem k mod N of
the dataset NAME generated with SEED and CONFIG (reasoning-gym's own generator: the same seed
gives the same problems on every machine); its answer is the trajectory's reference. `step`
extracts the answer from the response and scores it with the dataset's own verifier
(`score_answer`): the reward is its score (0..1), success a score of 1.

Answer extraction (--answer): `tagged` takes the last <answer>...</answer>; `plain` the whole
response; `number` the last number in it (for numeric tasks and small models that answer in a
sentence); `auto` (default) the last <answer> tag, else the last \\boxed{...}, else the last
non-empty line. The instruction appended to each question says how to answer (default: put
the final answer inside <answer></answer>).

The bridge answers in the version of each request (1 or 2). Errors are {"ok":false,...}
replies; a bad NAME or CONFIG is reported on every request (and on stderr).
"""
import json
import re
import sys

VERSIONS = (1, 2)
MAX_LINE = 1 << 20
DEFAULT_INSTRUCTION = "Give only the final answer inside <answer></answer>."

TAG = re.compile(r"<answer>(.*?)</answer>", re.S)
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_boxed(text):
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def extract(response, mode):
    text = response or ""
    if mode == "plain":
        return text.strip()
    if mode == "number":
        numbers = NUMBER.findall(text)
        return numbers[-1].replace(",", "") if numbers else ""
    tags = TAG.findall(text)
    if tags:
        return tags[-1].strip()
    if mode == "tagged":
        return ""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    lines = [l.strip() for l in text.strip().splitlines() if l.strip()]
    return lines[-1] if lines else ""


class Bridge:
    def __init__(self, name, config, size, seed, mode, instruction):
        import reasoning_gym

        self.dataset = reasoning_gym.create_dataset(name, size=size, seed=seed, **config)
        self.size = size
        self.mode = mode
        self.instruction = instruction
        self.entry = None

    def reset(self, seed):
        self.entry = self.dataset[int(seed) % self.size]
        question = self.entry["question"]
        if self.instruction:
            question = question.rstrip() + "\n" + self.instruction
        return {"observation": question, "info": {"reference": {"answer": str(self.entry["answer"])}}}

    def step(self, action):
        if self.entry is None:
            raise ValueError("step after the episode ended; reset first")
        entry, self.entry = self.entry, None
        answer = extract(action, self.mode)
        score = float(self.dataset.score_answer(answer=answer or None, entry=entry) or 0.0)
        return {
            "observation": "",
            "reward": score,
            "terminated": True,
            "truncated": False,
            "info": {
                "success": score >= 1.0,
                "invalid_action": not answer,
                "extracted": answer,
                "reference": {"answer": str(entry["answer"])},
            },
        }


def reply(out, version, **fields):
    msg = {"v": version}
    msg.update(fields)
    out.write(json.dumps(msg) + "\n")
    out.flush()


def parse_args(argv):
    if len(argv) < 2 or argv[1] in ("-h", "--help"):
        sys.stderr.write(__doc__)
        sys.exit(2)
    opts = {"--config": "{}", "--size": "100000", "--seed": "0", "--answer": "auto",
            "--instruction": DEFAULT_INSTRUCTION}
    rest = argv[2:]
    while rest:
        key = rest.pop(0)
        if key not in opts or not rest:
            sys.stderr.write("unknown or incomplete option %r\n%s" % (key, __doc__))
            sys.exit(2)
        opts[key] = rest.pop(0)
    if opts["--answer"] not in ("auto", "tagged", "plain", "number"):
        sys.stderr.write("--answer must be auto, tagged, plain or number, not %r\n" % opts["--answer"])
        sys.exit(2)
    return (argv[1], json.loads(opts["--config"]), int(opts["--size"]), int(opts["--seed"]),
            opts["--answer"], opts["--instruction"])


def main(argv):
    name, config, size, seed, mode, instruction = parse_args(argv)
    out = sys.stdout
    try:
        bridge = Bridge(name, config, size, seed, mode, instruction)
        startup_error = None
    except Exception as e:  # noqa: BLE001 - reported through the protocol
        bridge = None
        startup_error = "cannot create reasoning-gym dataset %r with %s: %s: %s" % (
            name, json.dumps(config), type(e).__name__, e)
        sys.stderr.write(startup_error + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        if len(line) > MAX_LINE:
            reply(out, 1, ok=False, error="message of more than %d bytes (starts %r)" % (MAX_LINE, line[:200]))
            continue
        try:
            req = json.loads(line)
        except ValueError as e:
            reply(out, 1, ok=False, error="malformed message %r: %s" % (line[:200], e))
            continue
        version = req.get("v") if isinstance(req, dict) else None
        if version not in VERSIONS:
            reply(out, 1, ok=False, error="protocol version must be 1 or 2 in %r" % (line[:200],))
            continue
        op = req.get("op")
        if op == "close":
            reply(out, version, ok=True)
            return 0
        if bridge is None:
            reply(out, version, ok=False, error=startup_error)
            continue
        try:
            if op == "reset":
                reply(out, version, ok=True, **bridge.reset(req.get("seed", 0)))
            elif op == "step":
                reply(out, version, ok=True, **bridge.step(req.get("action", "")))
            else:
                reply(out, version, ok=False, error="unknown op %r" % (op,))
        except Exception as e:  # noqa: BLE001
            reply(out, version, ok=False, error="%s: %s" % (type(e).__name__, e))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
