#!/usr/bin/env python3
"""Find the circles inside a folder: file A calls a function defined in file
B of the same folder, and B calls one defined in A. Data should flow one way
through pipeline/ and gateway/ (docs/architecture.md), so every such pair is
reported with the functions that close it.

    scripts/check-circles.py [--known FILE] DIR...

Without --known, any circle fails (exit 1). With --known, the circles listed
in FILE (lines "dir/a.c dir/b.c", # comments) are reported as known and only
new ones fail, so the list can only shrink as circles are cut.

The reading is textual: a definition is a line at column 0 that names a
function and opens its body with "{" (the house style; a one-line body
counts); a call is the name followed by
"(" outside comments and strings. Static functions are private to their file
and cannot close a circle.
"""
import re
import sys
from pathlib import Path

DEF = re.compile(r"^[A-Za-z_][\w \*]*?\b(rk_\w+)\s*\([^;{]*\)\s*\{", re.M)
COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
STRING = re.compile(r'"(?:\\.|[^"\\])*"')


def strip(text):
    return STRING.sub('""', COMMENT.sub(" ", text))


def circles(folder):
    files = sorted(Path(folder).glob("*.c"))
    code = {f: strip(f.read_text()) for f in files}
    defined = {}  # function -> file
    for f, text in code.items():
        for m in DEF.finditer(text):
            defined[m.group(1)] = f
    calls = {f: {} for f in files}  # f -> {g: [functions of g that f calls]}
    for f, text in code.items():
        for name in set(re.findall(r"\b(rk_\w+)\s*\(", text)):
            g = defined.get(name)
            if g and g != f:
                calls[f].setdefault(g, []).append(name)
    found = []
    for i, a in enumerate(files):
        for b in files[i + 1:]:
            if b in calls[a] and a in calls[b]:
                found.append((a, b, sorted(calls[a][b]), sorted(calls[b][a])))
    return found


def main(argv):
    known = set()
    if len(argv) > 2 and argv[1] == "--known":
        for line in Path(argv[2]).read_text().splitlines():
            line = line.split("#")[0].split()
            if len(line) == 2:
                known.add(tuple(sorted(line)))
        argv = argv[2:]
    new = 0
    for folder in argv[1:]:
        for a, b, ab, ba in circles(folder):
            pair = tuple(sorted((str(a), str(b))))
            tag = "known circle" if pair in known else "circle"
            new += pair not in known
            print(f"{tag}: {a} calls {', '.join(ab[:4])}{' ...' if len(ab) > 4 else ''}; "
                  f"{b} calls back {', '.join(ba[:4])}{' ...' if len(ba) > 4 else ''}")
            known.discard(pair)
    for pair in sorted(known):
        print(f"circles: {pair[0]} {pair[1]} is listed as known but is gone: remove it from the list")
        new += 1
    print("circles: ok" if new == 0 else f"circles: {new} new")
    return 1 if new else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
