#!/usr/bin/env python3
"""Fails on an import cycle between the modules of a crate.

A crate's modules form a tree. At every node of that tree, the child subtrees are
collapsed into one vertex each, and every path that a file of one subtree names into
another (`use crate::a::b`, `super::x`, `crate::a::f()` in code) is an edge between
them. Those edges must form a DAG at every level: a module may use its siblings, or be
used by them, never both (directly or through a ring of siblings). Edges between a
module and its own ancestors or descendants are the tree itself and do not count.

Test code (`tests.rs` files, `tests/` folders, and `#[cfg(test)]` items in a file) is left
out: the layering is about what ships.

Usage: tools/check-cycles.py [CRATE_DIR ...]   (default: every workspace member)
Exit status 1 and one line per cycle (with an example edge for each step) if any.
"""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from rust_source import drop_cfg_test_items, strip_comments_and_strings  # noqa: E402


def workspace_members():
    text = (ROOT / "Cargo.toml").read_text()
    m = re.search(r"members\s*=\s*\[(.*?)\]", text, re.S)
    return [s for s in re.findall(r'"([^"]+)"', m.group(1))]


class Crate:
    def __init__(self, crate_dir):
        self.dir = crate_dir
        self.src = crate_dir / "src"
        self.modules = {}  # tuple path -> file
        self.aliases = {}  # tuple path -> tuple path (pub use a::b;)
        roots = [p for p in (self.src / "lib.rs", self.src / "main.rs") if p.exists()]
        for root in roots[:1]:
            self.walk(root, ())

    def child_file(self, file, name):
        base = file.parent if file.name in ("lib.rs", "main.rs", "mod.rs") else file.parent / file.stem
        for cand in (base / f"{name}.rs", base / name / "mod.rs"):
            if cand.exists():
                return cand
        return None

    def walk(self, file, path):
        self.modules[path] = file
        text = drop_cfg_test_items(strip_comments_and_strings(file.read_text()))
        for m in re.finditer(r"(?m)^\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+([A-Za-z_][A-Za-z0-9_]*)\s*;", text):
            name = m.group(1)
            if name == "tests":
                continue
            child = self.child_file(file, name)
            if child is not None:
                self.walk(child, path + (name,))
        # Inline modules (`mod x { ... }`) count as part of their file.
        for m in re.finditer(r"(?m)^\s*pub(?:\([^)]*\))?\s+use\s+([A-Za-z_][A-Za-z0-9_:]*)\s*(?:as\s+(\w+))?\s*;", text):
            target = m.group(1).split("::")
            name = m.group(2) or target[-1]
            self.aliases[path + (name,)] = (path, target)

    def resolve_alias(self, path):
        for _ in range(8):
            hit = None
            for k in range(len(path), 0, -1):
                if path[:k] in self.aliases and path[:k] not in self.modules:
                    hit = k
                    break
            if hit is None:
                return path
            base, target = self.aliases[path[:hit]]
            resolved = self.absolute(base, target)
            if resolved is None:
                return path
            path = resolved + path[hit:]
        return path

    def absolute(self, cur, segs):
        """An absolute module path for `segs` as written in module `cur`, or None if external."""
        if not segs:
            return None
        if segs[0] == "crate":
            return tuple(segs[1:])
        if segs[0] in ("self", "super"):
            base = list(cur)
            i = 0
            while i < len(segs) and segs[i] in ("self", "super"):
                if segs[i] == "super":
                    if not base:
                        return None
                    base.pop()
                i += 1
            return tuple(base) + tuple(segs[i:])
        # A path starting with a child module's name (`use child::X` in 2018+ is relative).
        if cur + (segs[0],) in self.modules:
            return cur + tuple(segs)
        return None

    def owner(self, path):
        """The deepest module file that `path` names."""
        path = self.resolve_alias(path)
        for k in range(len(path), -1, -1):
            if path[:k] in self.modules:
                return path[:k]
        return ()


def use_paths(text):
    """Every path a file names: the leaves of `use` trees and `crate::`/`super::`/`self::` paths."""
    found = []
    for m in re.finditer(r"\buse\s+([^;]+);", text):
        found.extend(expand_use_tree(re.sub(r"\s+", "", m.group(1))))
    for m in re.finditer(r"(?<![\w:])((?:crate|super|self)(?:::(?:super|[A-Za-z_]\w*))+)", text):
        found.append(m.group(1).split("::"))
    return found


def expand_use_tree(tree, prefix=()):
    out = []
    depth, start, parts = 0, 0, []
    for i, ch in enumerate(tree):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(tree[start:i])
            start = i + 1
    parts.append(tree[start:])
    for part in parts:
        if not part:
            continue
        brace = part.find("{")
        if brace >= 0:
            head = [s for s in part[:brace].split("::") if s]
            out.extend(expand_use_tree(part[brace + 1:part.rfind("}")], prefix + tuple(head)))
        else:
            # `use a::b as c` arrives here as `a::b` (aliases are stripped before parsing).
            segs = [s for s in part.split("::") if s and s != "*"]
            full = list(prefix) + segs
            if full and full[-1] == "self":
                full = full[:-1]
            out.append(full)
    return out


def edges_of(crate):
    edges = {}  # (from_mod, to_mod) -> example (file, path text)
    for mod, file in crate.modules.items():
        text = drop_cfg_test_items(strip_comments_and_strings(file.read_text()))
        # `use a::b as c;` -> strip the alias before expanding.
        text = re.sub(r"\s+as\s+[A-Za-z_]\w*", "", text)
        for segs in use_paths(text):
            path = crate.absolute(mod, segs)
            if path is None:
                continue
            target = crate.owner(path)
            if target != mod:
                edges.setdefault((mod, target), (file, "::".join(segs)))
    return edges


def sibling_cycles(crate, edges):
    problems = []
    for parent in sorted(crate.modules):
        children = sorted(m[-1] for m in crate.modules if len(m) == len(parent) + 1 and m[:len(parent)] == parent)
        if len(children) < 2:
            continue
        graph = {c: {} for c in children}
        n = len(parent)
        for (a, b), example in edges.items():
            if len(a) > n and len(b) > n and a[:n] == parent and b[:n] == parent and a[n] != b[n]:
                graph[a[n]].setdefault(b[n], example)
        for scc in strongly_connected(graph):
            if len(scc) > 1:
                problems.append((parent, scc, graph))
    return problems


def strongly_connected(graph):
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def main(argv):
    dirs = [Path(a) for a in argv] or [ROOT / m for m in workspace_members()]
    failed = 0
    modules = 0
    for d in dirs:
        crate = Crate(d.resolve())
        modules += len(crate.modules)
        edges = edges_of(crate)
        for parent, scc, graph in sibling_cycles(crate, edges):
            failed += 1
            where = "::".join(("crate",) + parent)
            print(f"{d.name}: import cycle between modules of {where}: {' <-> '.join(scc)}")
            members = set(scc)
            for a in scc:
                for b, (file, path) in sorted(graph[a].items()):
                    if b in members:
                        print(f"    {a} -> {b}: {file.relative_to(ROOT)} uses {path}")
    if failed:
        print(f"check-cycles: {failed} cycle(s)")
        return 1
    print(f"check-cycles: {modules} modules in {len(dirs)} crates, no import cycle")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
