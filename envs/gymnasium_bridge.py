#!/usr/bin/env python3
"""Serve any gymnasium environment through the rollarc environment protocol (v1, v2 or v3).

Usage: gymnasium_bridge.py ENV [--kwargs JSON] [--path DIR]...

ENV is a registered id (`FrozenLake-v1`, `module:Name-v0` to import the registering module
first) or a class of your own, `module:Class` (a gymnasium.Env subclass), with the module
found on the --path directories (then the working directory).

Reads one JSON request per line on stdin, writes one JSON response per line on stdout:
  {"v":1,"op":"reset","seed":N}      -> {"v":1,"ok":true,"observation":TEXT}
  {"v":1,"op":"step","action":TEXT}  -> {"v":1,"ok":true,"observation":TEXT,"reward":R,
                                          "terminated":B,"truncated":B,"info":{...}}
  {"v":1,"op":"close"}               -> {"v":1,"ok":true} and exit
Errors are {"v":1,"ok":false,"error":TEXT}; the bridge never exits on bad input.

Each observation is sent once: the environment's text rendering (render_mode "ansi", with
highlighted cells shown as [x]) when it has one, else the raw observation as JSON. The
bridge answers in the version of each request; a crash's traceback goes to stderr. Version 3
serves many episodes in this one process, each request naming its episode
({"v":3,"op":"reset","episode":"4.1","seed":N}, replies carry the same "episode"): each open
episode has an environment of its own, and a closed episode's environment is kept for the
next one. Actions are a name (see ACTION_NAMES) or
an index of a Discrete action space. An unknown action is reported as invalid and does not
step the environment.
"""
import importlib
import json
import re
import sys
import traceback

import gymnasium as gym

VERSIONS = (1, 2, 3)
MAX_OPEN = 4096
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


def user_class(env_id):
    """The gymnasium.Env subclass named by `module:Class`, or None for a registered id."""
    if ":" not in env_id:
        return None
    module, name = env_id.split(":", 1)
    obj = getattr(importlib.import_module(module), name, None)
    if isinstance(obj, type) and issubclass(obj, gym.Env):
        return obj
    return None


def make(env_id, kwargs):
    """The environment, rendering as text when it can; returns (env, has_text)."""
    cls = user_class(env_id)
    if cls is not None:
        modes = (getattr(cls, "metadata", None) or {}).get("render_modes", [])
        if "ansi" in modes:
            return cls(render_mode="ansi", **kwargs), True
        return cls(**kwargs), False
    probe = gym.make(env_id, **kwargs)
    modes = probe.metadata.get("render_modes", [])
    if "ansi" not in modes:
        return probe, False
    probe.close()
    return gym.make(env_id, render_mode="ansi", **kwargs), True


class Bridge:
    def __init__(self, env_id, kwargs):
        self.env_id = env_id
        self.env, self.has_text = make(env_id, kwargs)
        self.names = ACTION_NAMES.get(family(env_id))
        self.obs = None
        self.done = True

    def text(self):
        if self.has_text:
            rendered = self.env.render() or ""
            rendered = HIGHLIGHT.sub(lambda m: "[" + m.group(1) + "]", rendered)
            return ANSI.sub("", rendered).strip("\n") + "\n"
        raw = json.dumps(self.obs, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o))
        return "observation: " + raw + "\n"

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


def reply(out, version, episode=None, **fields):
    msg = {"v": version}
    if episode is not None:
        msg["episode"] = episode
    msg.update(fields)
    out.write(json.dumps(msg) + "\n")
    out.flush()


def main(argv):
    if len(argv) < 2 or argv[1] in ("-h", "--help"):
        sys.stderr.write(__doc__)
        return 2
    kwargs = {}
    paths = []
    rest = argv[2:]
    while rest:
        key = rest.pop(0)
        if key not in ("--kwargs", "--path") or not rest:
            sys.stderr.write("unknown or incomplete option %r\n%s" % (key, __doc__))
            return 2
        value = rest.pop(0)
        if key == "--kwargs":
            kwargs = json.loads(value)
        else:
            paths.append(value)
    sys.path[:0] = paths
    out = sys.stdout
    try:
        first = Bridge(argv[1], kwargs)
        startup_error = None
    except Exception as e:  # noqa: BLE001
        first = None
        startup_error = "cannot create %s: %s: %s" % (argv[1], type(e).__name__, e)
        traceback.print_exc(file=sys.stderr)
    spare = [first] if first else []  # environments no open episode holds
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
            if episode in episodes:
                spare.append(episodes.pop(episode))
            continue
        if startup_error is not None:
            reply(out, version, episode, ok=False, error=startup_error)
            continue
        try:
            if version < 3:
                single = single or (spare.pop() if spare else Bridge(argv[1], kwargs))
                bridge = single
            elif op == "reset" and episode not in episodes:
                if len(episodes) >= MAX_OPEN:
                    raise ValueError("%d episodes are open; close one first" % MAX_OPEN)
                bridge = spare.pop() if spare else Bridge(argv[1], kwargs)
                episodes[episode] = bridge
            else:
                bridge = episodes.get(episode)
                if bridge is None:
                    raise ValueError("episode %r is not open: reset it first" % (episode,))
            if op == "reset":
                reply(out, version, episode, ok=True, **bridge.reset(req.get("seed", 0)))
            elif op == "step":
                reply(out, version, episode, ok=True, **bridge.step(req.get("action", "")))
            else:
                reply(out, version, episode, ok=False, error="unknown op %r" % (op,))
        except Exception as e:  # noqa: BLE001
            traceback.print_exc(file=sys.stderr)
            reply(out, version, episode, ok=False, error="%s: %s" % (type(e).__name__, e))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
