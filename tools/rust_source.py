"""Light Rust source helpers shared by the lint scripts (no parser: comments, strings and
`#[cfg(test)]` items are all they need to see)."""

import re

_CHAR = re.compile(r"'(\\.|[^\\'])'|'\\u\{[0-9a-fA-F]+\}'|'\\x[0-9a-fA-F]{2}'")


def strip_comments_and_strings(src):
    """`src` with comments removed and string/char literals emptied; line count kept."""
    out = []
    i, n = 0, len(src)
    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            i = n if j < 0 else j
        elif src.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if src.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif src.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    if src[i] == "\n":
                        out.append("\n")
                    i += 1
        elif c in "rb" and re.match(r'b?r#*"', src[i:i + 10]) and (i == 0 or not (src[i - 1].isalnum() or src[i - 1] == "_")):
            m = re.match(r'b?r(#*)"', src[i:])
            end = '"' + m.group(1)
            j = src.find(end, i + len(m.group(0)))
            j = n if j < 0 else j + len(end)
            out.append("\n" * src.count("\n", i, j) + '""')
            i = j
        elif c == '"':
            j = i + 1
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            out.append("\n" * src.count("\n", i, j) + '""')
            i = j + 1
        elif c == "'" and _CHAR.match(src, i):
            m = _CHAR.match(src, i)
            out.append("' '")
            i = m.end()
        else:
            out.append(c)
            i += 1
    return "".join(out)


def cfg_test_spans(code):
    """(start, end) character spans of the `#[cfg(test)]` items of stripped source `code`:
    the attribute through the item's closing brace, or its `;`."""
    spans = []
    for m in re.finditer(r"#\[cfg\(test\)\]", code):
        depth, k = 0, m.end()
        while k < len(code):
            ch = code[k]
            if ch == ";" and depth == 0:
                k += 1
                break
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    k += 1
                    break
            k += 1
        spans.append((m.start(), k))
    return spans


def drop_cfg_test_items(code):
    """Stripped source with its `#[cfg(test)]` items blanked (newlines kept)."""
    for start, end in reversed(cfg_test_spans(code)):
        code = code[:start] + re.sub(r"[^\n]", " ", code[start:end]) + code[end:]
    return code


def cfg_test_lines(src):
    """Lines of `src` inside `#[cfg(test)]` items (a one-line `mod tests;` counts one)."""
    code = strip_comments_and_strings(src)
    lines = 0
    for start, end in cfg_test_spans(code):
        lines += code.count("\n", start, end) + 1
    return lines
