#!/usr/bin/env python3
"""Lists the Rust functions longer than a limit (default 80 lines), outside
tests: `fn` items found by brace matching after comments, strings and char
literals are blanked. Skipped: `#[cfg(test)]` modules (inline, and the files
a `#[cfg(test)] mod name;` names), files named `*tests.rs`, files under a
`tests/` or `benches/` folder, `target/`, and functions marked `#[test]`
(or any `#[...::test]`). A function's length runs from its `fn` line to its
closing brace, both counted.

Prints `file:line name length` for each, longest first; exits 1 if any.
No dependencies; reads files, writes nothing.

Usage: tools/fn_lengths.py [--limit N] [PATH...]   (default: the repository)
"""

import argparse
import os
import re
import sys

FN = re.compile(r"\bfn\s+([A-Za-z_][A-Za-z0-9_]*)")
CFG_TEST = re.compile(r"#\[cfg\(test\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+([A-Za-z_][A-Za-z0-9_]*)\s*([{;])")
TEST_ATTR = re.compile(r"#\[\s*(?:[A-Za-z_][A-Za-z0-9_]*::)*test\s*[\](]")
SKIP_DIRS = {"target", "tests", "benches", ".git", "node_modules"}


def blank(src):
    """`src` with comments, string and char literals replaced by spaces
    (newlines kept, so line numbers and brace depth stay right)."""
    out = list(src)
    i, n = 0, len(src)

    def wipe(a, b):
        for k in range(a, b):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            wipe(i, j)
            i = j
        elif src.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if src.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif src.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            wipe(i, j)
            i = j
        elif c == "r" and re.match(r'r#*"', src[i:i + 260]) and not (i and (src[i - 1].isalnum() or src[i - 1] == "_")):
            hashes = re.match(r'r(#*)"', src[i:]).group(1)
            end = src.find('"' + hashes, i + len(hashes) + 2)
            end = n if end < 0 else end + 1 + len(hashes)
            wipe(i, end)
            i = end
        elif c == '"':
            j = i + 1
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            wipe(i, j + 1)
            i = j + 1
        elif c == "'":
            # A char literal ('a', '\n', '\u{1F600}', '{'); otherwise a lifetime.
            m = re.match(r"'(?:\\(?:u\{[0-9a-fA-F]+\}|x[0-9a-fA-F]{2}|.)|[^\\'\n])'", src[i:i + 12])
            if m:
                wipe(i, i + m.end())
                i += m.end()
            else:
                i += 1
        else:
            i += 1
    return "".join(out)


def match_brace(text, open_at):
    """The index of the `}` closing the `{` at `open_at`."""
    depth = 0
    for k in range(open_at, len(text)):
        if text[k] == "{":
            depth += 1
        elif text[k] == "}":
            depth -= 1
            if depth == 0:
                return k
    return len(text) - 1


def body_start(text, at):
    """The `{` opening the body of the fn whose name ends at `at`, or None
    for a declaration without one (`;`)."""
    depth = 0
    for k in range(at, len(text)):
        c = text[k]
        if c in "([":
            depth += 1
        elif c in ")]":
            depth -= 1
        elif depth == 0 and c == "{":
            return k
        elif depth == 0 and c == ";":
            return None
    return None


def attributes_before(text, at):
    """The attributes (and qualifiers) written just before position `at`."""
    k = at
    while k > 0 and text[k - 1] not in ";}{":
        k -= 1
    # An attribute's own `]` can follow a `}` only through a nested item;
    # what lies between the last item end and the fn is its prefix.
    return text[k:at]


def test_files(path, text):
    """The files that `#[cfg(test)] mod name;` in `path` names."""
    d = os.path.dirname(path)
    stem = os.path.splitext(os.path.basename(path))[0]
    out = set()
    for m in CFG_TEST.finditer(text):
        if m.group(2) != ";":
            continue
        name = m.group(1)
        dirs = [d] if stem in ("mod", "lib", "main") else [d, os.path.join(d, stem)]
        for base in dirs:
            out.add(os.path.normpath(os.path.join(base, name + ".rs")))
            out.add(os.path.normpath(os.path.join(base, name, "mod.rs")))
    return out


def long_fns(path, text, limit):
    """(line, name, length) of each fn over `limit` lines outside tests."""
    skip = []  # [start, end) spans of inline test modules
    for m in CFG_TEST.finditer(text):
        if m.group(2) == "{":
            skip.append((m.start(), match_brace(text, m.end() - 1) + 1))
    found = []
    for m in FN.finditer(text):
        if any(a <= m.start() < b for a, b in skip):
            continue
        if TEST_ATTR.search(attributes_before(text, m.start())):
            continue
        open_at = body_start(text, m.end())
        if open_at is None:
            continue
        close_at = match_brace(text, open_at)
        first = text.count("\n", 0, m.start()) + 1
        last = text.count("\n", 0, close_at) + 1
        if last - first + 1 > limit:
            found.append((first, m.group(1), last - first + 1))
    return found


def rust_files(roots):
    for root in roots:
        if os.path.isfile(root):
            yield root
            continue
        for d, subdirs, files in os.walk(root):
            subdirs[:] = sorted(s for s in subdirs if s not in SKIP_DIRS)
            for f in sorted(files):
                if f.endswith(".rs") and not f.endswith("tests.rs"):
                    yield os.path.join(d, f)


def main():
    ap = argparse.ArgumentParser(description="Rust functions over a length limit, outside tests.")
    ap.add_argument("--limit", type=int, default=80, help="longest allowed, in lines (default 80)")
    ap.add_argument("paths", nargs="*", help="files or folders (default: the repository)")
    args = ap.parse_args()
    top = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    roots = args.paths or [top]
    texts = {}
    for path in rust_files(roots):
        with open(path, encoding="utf-8", errors="replace") as f:
            texts[os.path.normpath(path)] = blank(f.read())
    skip_files = set()
    for path, text in texts.items():
        skip_files |= test_files(path, text)
    rows = []
    for path, text in texts.items():
        if path in skip_files:
            continue
        rows += [(length, path, line, name) for line, name, length in long_fns(path, text, args.limit)]
    for length, path, line, name in sorted(rows, key=lambda r: (-r[0], r[1], r[2])):
        print(f"{os.path.relpath(path)}:{line} {name} {length}")
    return 1 if rows else 0


if __name__ == "__main__":
    sys.exit(main())
