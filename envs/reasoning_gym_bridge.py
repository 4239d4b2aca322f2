#!/usr/bin/env python3
"""Serve a reasoning-gym dataset through the rollarc environment protocol (v1, v2 or v3).

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

The bridge answers in the version of each request. Version 3 serves many episodes in this
one process, each request naming its episode (see the protocol in docs/environments.md): the
dataset is shared, and each episode holds only its problem. Problems are generated when an
episode asks for them (reasoning-gym derives problem k from SEED and k alone), never up front.
Errors are {"ok":false,...} replies; a bad NAME or CONFIG is reported on every request (and on
stderr).
"""
import json
import re
import sys

VERSIONS = (1, 2, 3)
MAX_OPEN = 4096
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


class Problems:
    """The dataset, shared by every episode of this process."""

    def __init__(self, name, config, size, seed, mode, instruction):
        import reasoning_gym

        self.dataset = reasoning_gym.create_dataset(name, size=size, seed=seed, **config)
        self.size = size
        self.mode = mode
        self.instruction = instruction


class Episode:
    """One episode: the problem it was reset on, until it is answered."""

    def __init__(self, problems):
        self.problems = problems
        self.entry = None

    def reset(self, seed):
        p = self.problems
        self.entry = p.dataset[int(seed) % p.size]
        question = self.entry["question"]
        if p.instruction:
            question = question.rstrip() + "\n" + p.instruction
        return {"observation": question, "info": {"reference": {"answer": str(self.entry["answer"])}}}

    def step(self, action):
        if self.entry is None:
            raise ValueError("step after the episode ended; reset first")
        entry, self.entry = self.entry, None
        answer = extract(action, self.problems.mode)
        score = float(self.problems.dataset.score_answer(answer=answer or None, entry=entry) or 0.0)
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


def reply(out, version, episode=None, **fields):
    msg = {"v": version}
    if episode is not None:
        msg["episode"] = episode
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
        problems = Problems(name, config, size, seed, mode, instruction)
        startup_error = None
    except Exception as e:  # noqa: BLE001 - reported through the protocol
        problems = None
        startup_error = "cannot create reasoning-gym dataset %r with %s: %s: %s" % (
            name, json.dumps(config), type(e).__name__, e)
        sys.stderr.write(startup_error + "\n")
    single = None  # versions 1 and 2: one episode at a time
    episodes = {}  # version 3: by id
    last = 1
    for line in sys.stdin:
        if not line.strip():
            continue
        if len(line) > MAX_LINE:
            reply(out, last, ok=False, error="message of more than %d bytes (starts %r)" % (MAX_LINE, line[:200]))
            continue
        try:
            req = json.loads(line)
        except ValueError as e:
            reply(out, last, ok=False, error="malformed message %r: %s" % (line[:200], e))
            continue
        version = req.get("v") if isinstance(req, dict) else None
        if version not in VERSIONS:
            reply(out, last, ok=False, error="protocol version must be 1, 2 or 3 in %r" % (line[:200],))
            continue
        last = version
        episode = req.get("episode") if version == 3 else None
        if version == 3 and not (isinstance(episode, str) and episode):
            reply(out, 3, ok=False, error="a version-3 request needs an episode id: %r" % (line[:200],))
            continue
        op = req.get("op")
        if op == "close":
            reply(out, version, episode, ok=True)
            if version < 3:
                return 0
            episodes.pop(episode, None)
            continue
        if problems is None:
            reply(out, version, episode, ok=False, error=startup_error)
            continue
        try:
            if version < 3:
                single = single or Episode(problems)
                ep = single
            elif op == "reset" and episode not in episodes:
                if len(episodes) >= MAX_OPEN:
                    raise ValueError("%d episodes are open; close one first" % MAX_OPEN)
                ep = episodes[episode] = Episode(problems)
            else:
                ep = episodes.get(episode)
                if ep is None:
                    raise ValueError("episode %r is not open: reset it first" % (episode,))
            if op == "reset":
                reply(out, version, episode, ok=True, **ep.reset(req.get("seed", 0)))
            elif op == "step":
                reply(out, version, episode, ok=True, **ep.step(req.get("action", "")))
            else:
                reply(out, version, episode, ok=False, error="unknown op %r" % (op,))
        except Exception as e:  # noqa: BLE001
            reply(out, version, episode, ok=False, error="%s: %s" % (type(e).__name__, e))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
