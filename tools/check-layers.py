#!/usr/bin/env python3
"""Fails when a workspace crate depends on a crate above or beside its layer.

The layers, lowest first: infra → functions → actors → gateway → job → {service, lab} →
engine (the `rollarc` binary). A crate may depend on the crates below it only: service and lab never on
each other, nothing on the binary, and only the binary (and the tests) on service. Cargo
refuses a cycle by itself; this holds the rest of the order (normal, dev and build
dependencies alike).

Usage: tools/check-layers.py
"""

import json
import subprocess
import sys

ALLOWED = {
    "infra": set(),
    # The quantised kernels: a leaf crate of their own (optimised in debug builds too).
    "qmat": set(),
    "functions": {"infra"},
    "actors": {"infra", "functions", "qmat"},
    "gateway": {"infra", "functions", "actors", "qmat"},
    "job": {"infra", "functions", "actors", "qmat", "gateway"},
    "service": {"infra", "functions", "actors", "qmat", "gateway", "job"},
    "lab": {"infra", "functions", "actors", "qmat", "gateway", "job"},
    "engine": {"infra", "functions", "actors", "qmat", "gateway", "job", "service", "lab"},
    "tests": {"infra", "functions", "actors", "qmat", "gateway", "job", "service", "lab", "engine"},
}


def main():
    meta = json.loads(subprocess.run(
        ["cargo", "metadata", "--no-deps", "--format-version", "1", "--offline"],
        capture_output=True, text=True, check=True,
    ).stdout)
    members = {p["name"]: p for p in meta["packages"]}
    bad = []
    for name, pkg in sorted(members.items()):
        if name not in ALLOWED:
            bad.append(f"{name}: a workspace crate with no layer; add it to tools/check-layers.py")
            continue
        for dep in pkg["dependencies"]:
            d = dep["name"]
            if d in members and d not in ALLOWED[name]:
                kind = dep["kind"] or "normal"
                bad.append(f"{name} -> {d} ({kind} dependency): {d} is not below {name}")
    for line in bad:
        print(line)
    if bad:
        print(f"check-layers: {len(bad)} dependency(ies) against the layer order")
        return 1
    print(f"check-layers: {len(members)} crates in layer order")
    return 0


if __name__ == "__main__":
    sys.exit(main())
