#!/usr/bin/env python3
"""Runs every example block of the README as written, from a fresh working directory.

Each fenced block of the checked files must be preceded by a marker comment:

    <!-- example: ci -->              run here (`make test` calls this script)
    <!-- example: own target: WHY --> not run here: WHY names the make target that runs it

An unmarked block fails the check, so a new example cannot be skipped silently. A `ci` block
runs in bash (`-e -o pipefail`) in a new temporary directory holding what a checkout after
`make setup` holds for it (`examples/`, `envs/`, and `target/release/rollarc` linked to the
binary under test), in its own process group, which is killed afterwards (a service started
with `&` included). A command followed by a comment-only line shows its output: the comment
(`# {"id":"job-1"}`) must equal what the command printed.

Usage: readme_examples.py [--binary target/debug/rollarc] [FILE.md ...] (default: README.md)
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```(\w*)\s*$")
MARKER = re.compile(r"^<!--\s*example:\s*(ci|own target:.*?)\s*-->\s*$")
PORTS = [8080]  # what the README's service listens on
TIMEOUT_S = 300
LINE_MARK = "@@readme-example-line"


def blocks(path: Path):
    """(first line number, language, marker or None, lines) of every fenced block."""
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        k = start - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        mk = MARKER.match(lines[k]) if k >= 0 else None
        yield start + 1, lang, (mk.group(1) if mk else None), lines[start + 1 : j]
        i = j + 1


def script(lines: list[str]) -> tuple[str, dict[int, str]]:
    """The block with a marker echoed after each command, and {command index: expected output}."""
    out, expected, n = [], {}, -1
    for line in lines:
        s = line.strip()
        if s.startswith("#"):
            if n >= 0 and s[1:].strip():
                expected[n] = s[1:].strip()
            continue
        if not s:
            continue
        n += 1
        out.append(line)
        out.append(f"echo {LINE_MARK} {n}")
    return "\n".join(out) + "\n", expected


def outputs(stdout: str) -> dict[int, str]:
    """What each command printed, by its index."""
    got, buf = {}, []
    for line in stdout.splitlines():
        # A command whose output has no final newline leaves the marker on its last line.
        before, mark, after = line.partition(LINE_MARK)
        if mark:
            buf.append(before)
            got[int(after.split()[0])] = "\n".join(buf).strip()
            buf = []
        else:
            buf.append(line)
    return got


def fresh_dir(binary: Path) -> Path:
    d = Path(tempfile.mkdtemp(prefix="rollarc-readme-"))
    for name in ["examples", "envs"]:
        shutil.copytree(ROOT / name, d / name)
    (d / "target" / "release").mkdir(parents=True)
    (d / "target" / "release" / "rollarc").symlink_to(binary.resolve())
    return d


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def run_block(where: str, lines: list[str], binary: Path) -> str | None:
    """None when the block ran as written, else what went wrong."""
    busy = [p for p in PORTS if not port_free(p)]
    if busy:
        return f"port {busy[0]} is taken on this machine: the README's service cannot start"
    text, expected = script(lines)
    d = fresh_dir(binary)
    env = dict(os.environ)
    env.pop("ROLLARC_TOKEN", None)
    p = subprocess.Popen(
        ["bash", "-e", "-o", "pipefail", "-c", text],
        cwd=d,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = p.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        stdout, stderr = p.communicate()
        return f"{where}: still running after {TIMEOUT_S} s\n{stderr[-2000:]}"
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        shutil.rmtree(d, ignore_errors=True)
    got = outputs(stdout)
    if p.returncode != 0:
        ran = max(got) + 1 if got else 0
        cmds = [l for l in lines if l.strip() and not l.strip().startswith("#")]
        failed = cmds[ran] if ran < len(cmds) else "?"
        return f"{where}: exit {p.returncode} at `{failed.strip()}`\n{stderr[-3000:]}"
    for n, want in expected.items():
        if got.get(n) != want:
            return f"{where}: command {n + 1} printed {got.get(n)!r}, the README shows {want!r}"
    return None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", default=str(ROOT / "target/debug/rollarc"))
    ap.add_argument("files", nargs="*", default=["README.md"])
    a = ap.parse_args()
    binary = Path(a.binary)
    if not binary.exists():
        print(f"readme examples: no binary at {binary} (cargo build first)", file=sys.stderr)
        return 2
    failures, ran, own = [], 0, 0
    for f in a.files:
        path = ROOT / f
        for line, lang, marker, body in blocks(path):
            where = f"{f}:{line}"
            if marker is None:
                failures.append(f"{where}: a ```{lang} block without an <!-- example: … --> marker")
                continue
            if marker.startswith("own target"):
                own += 1
                print(f"  {where}: {marker}")
                continue
            t = time.monotonic()
            err = run_block(where, body, binary)
            ran += 1
            if err:
                failures.append(err)
                print(f"  FAIL {where} ({time.monotonic() - t:.1f} s)")
            else:
                print(f"  ok   {where} ({time.monotonic() - t:.1f} s)")
    for e in failures:
        print(e, file=sys.stderr)
    print(f"readme examples: {ran} run, {own} in their own targets, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
