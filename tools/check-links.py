#!/usr/bin/env python3
"""Fails on a broken relative link in the repository's markdown, or an orphan docs page.

Every markdown file git knows (`git ls-files '*.md'`, plus untracked ones that are not
ignored, so a new page is checked before it is committed) is scanned for inline links
`[text](target)` / `![alt](target)` and reference definitions `[label]: target`. Links
inside fenced code blocks and inline code spans are not links and are skipped, as are
links with a scheme (`http:`, `https:`, `mailto:`, …).

A relative target must name an existing file or folder, relative to the markdown file
(a leading `/` means the repository root). A `#anchor` on a markdown target (or on a
folder, meaning its README.md, or alone, meaning the file itself) must match one of its
headings under GitHub's slug rules: the heading's text lowercased, every character that
is not a letter, digit, space, `-` or `_` dropped, each space turned into `-`; the second
heading with the same slug gets `-1`, the third `-2`, and so on. `<a name=…>` / `id=…`
anchors count too. Anchors on other files (`#L10` on source) are not checked.

Every markdown file under docs/ must be linked from README.md or docs/README.md (the
index); one that is not is reported as an orphan page.

Usage: tools/check-links.py
Prints `FILE:LINE: broken link 'TARGET' (REASON)` per broken link and exits 1 if there is
any problem; otherwise prints a one-line summary and exits 0.
"""

import re
import subprocess
import sys
import unicodedata
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parent.parent
DOCS = "docs"
INDEXES = ("README.md", "docs/README.md")

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")
ATX = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
SETEXT = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
# [text](target "title") with one level of nested brackets in the text and one level of
# balanced parentheses in the target.
INLINE = re.compile(
    r"(?<!\\)\[((?:[^\[\]\\]|\\.|\[(?:[^\[\]\\]|\\.)*\])*)\]"
    r"\(\s*(<[^<>\n]*>|(?:[^\s()\\]|\\.|\((?:[^\s()\\]|\\.)*\))*)"
    r"(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^()]*\)))?\s*\)"
)
REFDEF = re.compile(r"^ {0,3}\[((?:[^\[\]\\]|\\.)+)\]:\s*(<[^<>\n]*>|\S+)")
HTML_ANCHOR = re.compile(r"<a\s[^>]*?\b(?:name|id)\s*=\s*[\"']([^\"']+)[\"']", re.I)
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def markdown_files():
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z", "--", "*.md"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout
    files = sorted({p for p in out.split("\0") if p})
    return [p for p in files if (ROOT / p).is_file()]


def strip_code_spans(line):
    """The line with every inline code span blanked (same length, so columns hold)."""
    out, i = [], 0
    while i < len(line):
        if line[i] == "\\" and i + 1 < len(line):
            out.append(line[i : i + 2])
            i += 2
            continue
        if line[i] != "`":
            out.append(line[i])
            i += 1
            continue
        j = i
        while j < len(line) and line[j] == "`":
            j += 1
        run = line[i:j]
        close = re.compile(r"(?<!`)" + re.escape(run) + r"(?!`)")
        m = close.search(line, j)
        if m is None:  # an unmatched run is literal backticks
            out.append(run)
            i = j
            continue
        out.append(" " * (m.end() - i))
        i = m.end()
    return "".join(out)


def prose_lines(text, spans=False):
    """(line number, line) of every line outside fenced code blocks; code spans blanked
    unless `spans` (headings keep their code's text).

    A code span that runs over a line break is left as it is (rare in this repository)."""
    fence = None
    for n, line in enumerate(text.split("\n"), 1):
        m = FENCE.match(line)
        if fence is None:
            if m and not (m.group(1)[0] == "`" and "`" in m.group(2)):
                fence = m.group(1)
                continue
            yield n, line if spans else strip_code_spans(line)
        elif m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not m.group(2).strip():
            fence = None


def heading_text(raw):
    """The text GitHub renders for a heading's source."""
    s = re.sub(r"!\[([^\]]*)\]\([^)]*\)", r"\1", raw)  # images: their alt text
    s = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", s)  # links: their text
    s = re.sub(r"\[([^\]]*)\]\[[^\]]*\]", r"\1", s)  # reference links
    s = re.sub(r"<[^>`]+>", "", s)  # inline HTML
    s = re.sub(r"\\(.)", r"\1", s)  # backslash escapes
    return s.strip()


def slug(text):
    """GitHub's heading anchor (github-slugger) for a heading's rendered text."""
    out = []
    for ch in text.lower():
        if ch in " -_":
            out.append(ch)
        elif unicodedata.category(ch)[0] in "LMN":
            out.append(ch)
    return "".join(out).replace(" ", "-")


def anchors(path, cache={}):
    """Every anchor a markdown file defines."""
    if path in cache:
        return cache[path]
    text = path.read_text(encoding="utf-8")
    seen, found = {}, set()

    def add(raw):
        base = slug(heading_text(raw))
        k = seen.get(base, 0)
        seen[base] = k + 1
        found.add(base if k == 0 else f"{base}-{k}")

    prev = None  # the previous prose line, for setext headings
    for _, line in prose_lines(text, spans=True):
        for m in HTML_ANCHOR.finditer(line):
            found.add(m.group(1))
        m = ATX.match(line)
        if m:
            add(m.group(2) or "")
            prev = None
            continue
        m = SETEXT.match(line)
        if m and prev is not None and prev.strip() and not prev.lstrip().startswith(("|", ">", "-", "*", "+")):
            add(prev)
            prev = None
            continue
        prev = line
    cache[path] = found
    return found


def links(text):
    """(line, target) of every link in a markdown file's prose."""
    for n, line in prose_lines(text):
        for m in INLINE.finditer(line):
            yield n, m.group(2)
        m = REFDEF.match(line)
        if m:
            yield n, m.group(2)


def resolve(md, target):
    """(resolved path or None, anchor or None, error or None) of a relative target."""
    if target.startswith("<") and target.endswith(">"):
        target = target[1:-1]
    path, _, anchor = target.partition("#")
    path = unquote(path)
    if not path:
        dest = md
    elif path.startswith("/"):
        dest = ROOT / path.lstrip("/")
    else:
        dest = md.parent / path
    if not dest.exists():
        return None, anchor, "no such file or folder"
    try:
        dest.resolve().relative_to(ROOT)
    except ValueError:
        return None, anchor, "outside the repository"
    if anchor:
        page = dest / "README.md" if dest.is_dir() else dest
        if page.suffix.lower() == ".md" and page.is_file():
            if unquote(anchor) not in anchors(page.resolve()):
                return dest, anchor, f"no heading '#{anchor}' in {page.resolve().relative_to(ROOT)}"
    return dest, anchor, None


def main():
    files = markdown_files()
    problems, checked = [], 0
    targets = {}  # markdown file (relative) -> set of resolved files/folders it links to
    for rel in files:
        md = ROOT / rel
        text = md.read_text(encoding="utf-8")
        out = targets.setdefault(rel, set())
        for n, target in links(text):
            if not target or SCHEME.match(target):
                continue
            checked += 1
            dest, _, err = resolve(md, target)
            if err:
                problems.append(f"{rel}:{n}: broken link '{target}' ({err})")
            elif dest is not None:
                dest = dest.resolve()
                out.add(dest)
                if dest.is_dir():
                    out.add(dest / "README.md")
    linked = set()
    for index in INDEXES:
        linked |= targets.get(index, set())
    for rel in files:
        if rel.startswith(DOCS + "/") and (ROOT / rel).resolve() not in linked:
            problems.append(
                f"{rel}: orphan page: not linked from {' or '.join(INDEXES)} "
                f"(add it to the index in {DOCS}/README.md)"
            )
    for p in problems:
        print(p)
    if problems:
        print(f"check-links: {len(problems)} problem(s) in {len(files)} files", file=sys.stderr)
        return 1
    print(f"check-links: {checked} links in {len(files)} files, all resolve")
    return 0


if __name__ == "__main__":
    sys.exit(main())
