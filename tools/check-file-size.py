#!/usr/bin/env python3
"""Fails on a Rust file whose non-test part is over the limit (600 lines).

The non-test part of a file is every line but those of its `#[cfg(test)]` items (an inline
`mod tests { ... }`, a test helper). Test files (`tests.rs`, anything under a `tests/`
folder of a crate's `src`, and the `tests` crate) are left out. Blank lines and comments
count: a file is read by people, not by the compiler.

Usage: tools/check-file-size.py [--limit N] [FILE ...]   (default: every tracked *.rs file)
"""

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from rust_source import cfg_test_lines  # noqa: E402


def is_test_file(rel):
    parts = Path(rel).parts
    return parts[0] == "tests" or Path(rel).name == "tests.rs" or "tests" in parts[1:-1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=600)
    ap.add_argument("files", nargs="*")
    args = ap.parse_args()
    files = args.files or subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.rs"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()
    over = []
    checked = 0
    for rel in files:
        if is_test_file(rel) or not (ROOT / rel).exists():
            continue
        checked += 1
        text = (ROOT / rel).read_text()
        total = text.count("\n") + (0 if text.endswith("\n") or not text else 1)
        part = total - cfg_test_lines(text)
        if part > args.limit:
            over.append((part, rel))
    for part, rel in sorted(over, reverse=True):
        print(f"{rel}: {part} non-test lines (limit {args.limit}): split it by what its parts do")
    if over:
        print(f"check-file-size: {len(over)} file(s) over {args.limit} lines")
        return 1
    print(f"check-file-size: {checked} files, none over {args.limit} non-test lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
