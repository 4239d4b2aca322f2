#!/usr/bin/env python3
"""Serve any gymnasium environment through the rollarc environment protocol (v1).

Usage: gymnasium_bridge.py ENV_ID [--kwargs JSON]

Reads one JSON request per line on stdin, writes one JSON response per line on stdout:
  {"v":1,"op":"reset","seed":N}      -> {"v":1,"ok":true,"observation":TEXT}
  {"v":1,"op":"step","action":TEXT}  -> {"v":1,"ok":true,"observation":TEXT,"reward":R,
                                          "terminated":B,"truncated":B,"info":{...}}
  {"v":1,"op":"close"}               -> {"v":1,"ok":true} and exit
Errors are {"v":1,"ok":false,"error":TEXT}; the bridge never exits on bad input.

Observations are the environment's text rendering (render_mode "ansi"), with highlighted
cells shown as [x], followed by the raw observation. Actions are a name (see ACTION_NAMES) or
an index of a Discrete action space. An unknown action is reported as invalid and does not
step the environment.
"""
import json
import re
import sys

import gymnasium as gym

VERSION = 1
MAX_LINE = 1 << 20
PENALTY = -0.1

ACTION_NAMES = {
    "FrozenLake": ["left", "down", "right", "up"],
    "Taxi": ["south", "north", "east", "west", "pickup", "dropoff"],
    "CliffWalking": ["up", "right", "down", "left"],
    "Blackjack": ["stick", "hit"],
}

HIGHLIGHT = re.compile(r"\x1b\[4\dm(.)\x1b\[0m")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def family(env_id):
    return env_id.split("-")[0].split("/")[-1]


def success(env_id, reward, terminated):
    fam = family(env_id)
    if fam == "CliffWalking":
        return bool(terminated)
    return bool(terminated and reward > 0)


class Bridge:
    def __init__(self, env_id, kwargs):
        self.env_id = env_id
        spec = gym.spec(env_id)
        modes = (spec.kwargs or {}).get("render_modes") or []
        try:
            probe = gym.make(env_id, **kwargs)
            modes = probe.metadata.get("render_modes", modes)
            probe.close()
        except Exception:  # noqa: BLE001 - report through the protocol instead
            pass
        mode = "ansi" if "ansi" in modes else None
        self.env = gym.make(env_id, render_mode=mode, **kwargs) if mode else gym.make(env_id, **kwargs)
        self.has_text = mode == "ansi"
        self.names = ACTION_NAMES.get(family(env_id))
        self.obs = None
        self.done = True

    def text(self):
        parts = []
        if self.has_text:
            rendered = self.env.render() or ""
            rendered = HIGHLIGHT.sub(lambda m: "[" + m.group(1) + "]", rendered)
            parts.append(ANSI.sub("", rendered).strip("\n"))
        parts.append("observation: " + json.dumps(self.obs, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o)))
        return "\n".join(parts) + "\n"

    def parse_action(self, action):
        space = self.env.action_space
        word = (action or "").strip().split()[0].strip(".,!").lower() if (action or "").strip() else ""
        if self.names and word in self.names:
            return self.names.index(word)
        if word.lstrip("-").isdigit() and isinstance(space, gym.spaces.Discrete):
            a = int(word)
            if 0 <= a < space.n:
                return a
        return None

    def reset(self, seed):
        self.obs, _ = self.env.reset(seed=int(seed))
        self.done = False
        return {"observation": self.text()}

    def step(self, action):
        if self.done:
            raise ValueError("step after the episode ended; reset first")
        a = self.parse_action(action)
        if a is None:
            return {"observation": self.text(), "reward": PENALTY, "terminated": False, "truncated": False,
                    "info": {"invalid_action": True, "success": False}}
        self.obs, reward, terminated, truncated, _ = self.env.step(a)
        self.done = bool(terminated or truncated)
        return {"observation": self.text(), "reward": float(reward), "terminated": bool(terminated),
                "truncated": bool(truncated),
                "info": {"invalid_action": False, "success": success(self.env_id, float(reward), terminated)}}


def reply(out, **fields):
    msg = {"v": VERSION}
    msg.update(fields)
    out.write(json.dumps(msg) + "\n")
    out.flush()


def main(argv):
    if len(argv) < 2:
        sys.stderr.write(__doc__)
        return 2
    kwargs = {}
    if len(argv) >= 4 and argv[2] == "--kwargs":
        kwargs = json.loads(argv[3])
    out = sys.stdout
    try:
        bridge = Bridge(argv[1], kwargs)
    except Exception as e:  # noqa: BLE001
        bridge = None
        startup_error = "cannot create %s: %s" % (argv[1], e)
    for line in sys.stdin:
        if not line.strip():
            continue
        if len(line) > MAX_LINE:
            reply(out, ok=False, error="message of more than %d bytes (starts %r)" % (MAX_LINE, line[:200]))
            continue
        try:
            req = json.loads(line)
        except ValueError as e:
            reply(out, ok=False, error="malformed message %r: %s" % (line[:200], e))
            continue
        if not isinstance(req, dict) or req.get("v") != VERSION:
            reply(out, ok=False, error="protocol version must be %d in %r" % (VERSION, line[:200]))
            continue
        op = req.get("op")
        if op == "close":
            reply(out, ok=True)
            return 0
        if bridge is None:
            reply(out, ok=False, error=startup_error)
            continue
        try:
            if op == "reset":
                reply(out, ok=True, **bridge.reset(req.get("seed", 0)))
            elif op == "step":
                reply(out, ok=True, **bridge.step(req.get("action", "")))
            else:
                reply(out, ok=False, error="unknown op %r" % (op,))
        except Exception as e:  # noqa: BLE001
            reply(out, ok=False, error=str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
