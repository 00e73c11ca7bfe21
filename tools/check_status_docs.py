#!/usr/bin/env python3
"""Checks that each public function's @return list in include/clmha.h names the statuses its
implementation returns.

For every `CLMHA_API clmha_status NAME(...)` in the header it finds the definition
`clmha_status NAME(` in src/ and collects the statuses (the names of CLMHA_STATUS_MAP) written
in its body, and in the bodies of the static functions of the same file that it calls (one level
deep), except in comparisons (`== CLMHA_X`, `!= CLMHA_X`). CLMHA__STRUCT_IN counts as
CLMHA_INVALID_ARGUMENT and CLMHA_UNSUPPORTED, CLMHA__STRUCT_OUT_CHECK as CLMHA_INVALID_ARGUMENT
(src/base/struct_in.h). Every status found must appear in the function's doc block after @return.

Approximate, on purpose: a status passed up unchanged from a function of another file (an
OpenCL failure mapped by clmha__cl_fail, a status returned by a callee) is not seen, so this is
a lower bound on what a function returns: it catches a status written in the function and left
out of its docs, not every omission. Exit status 1 lists the omissions.

Usage: check_status_docs.py [SOURCE_ROOT]
"""
import os
import re
import sys

ROOT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")
MACROS = {
    "CLMHA__STRUCT_IN": {"INVALID_ARGUMENT", "UNSUPPORTED"},
    "CLMHA__STRUCT_OUT_CHECK": {"INVALID_ARGUMENT"},
}


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def body_at(text, start):
    """The text between the brace at or after @p start and its match."""
    i = text.index("{", start)
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j + 1]
    return text[i:]


def statuses_in(body, names):
    body = re.sub(r"[!=]=\s*CLMHA_[A-Z_]+", " ", body)
    found = {m for m in re.findall(r"\bCLMHA_([A-Z_]+)\b", body) if m in names}
    for macro, codes in MACROS.items():
        if re.search(r"\b" + macro + r"\s*\(", body):
            found |= codes
    found.discard("SUCCESS")
    return found


def main():
    header = read(os.path.join(ROOT, "include", "clmha.h"))
    names = set(re.findall(r"^\s*X\(([A-Z_]+),\s*-?\d+,", header, flags=re.M))
    if not names:
        print("check_status_docs: no CLMHA_STATUS_MAP in include/clmha.h")
        return 1
    docs = {}
    lines = header.split("\n")
    for n, line in enumerate(lines):
        m = re.match(r"CLMHA_API clmha_status (clmha_\w+)\(", line)
        if not m:
            continue
        k = n - 1
        while k >= 0 and lines[k].startswith("///"):
            k -= 1
        block = "\n".join(lines[k + 1:n])
        ret = block.split("@return", 1)
        docs[m.group(1)] = set(re.findall(r"CLMHA_([A-Z_]+)", ret[1])) if len(ret) > 1 else set()

    sources = {}
    for folder, _, files in os.walk(os.path.join(ROOT, "src")):
        for f in files:
            if f.endswith(".c"):
                path = os.path.join(folder, f)
                sources[os.path.relpath(path, ROOT)] = strip_comments(read(path))

    problems = []
    for func, documented in sorted(docs.items()):
        where = [(p, t) for p, t in sources.items()
                 if re.search(r"^clmha_status " + func + r"\(", t, flags=re.M)]
        if len(where) != 1:
            problems.append(f"{func}: {len(where)} definitions found in src/")
            continue
        path, text = where[0]
        body = body_at(text, re.search(r"^clmha_status " + func + r"\(", text, flags=re.M).start())
        found = statuses_in(body, names)
        statics = set(re.findall(r"^static [^;{(]*?\b(\w+)\(", text, flags=re.M))
        for helper in sorted(statics):
            if re.search(r"\b" + helper + r"\s*\(", body):
                m = re.search(r"^static [^;{(]*?\b" + helper + r"\([^;]*?\)\s*\{", text,
                              flags=re.M | re.S)
                if m:
                    found |= statuses_in(body_at(text, m.start()), names)
        missing = sorted(found - documented)
        if missing:
            problems.append(f"{func} ({path}) returns, undocumented: " +
                            ", ".join("CLMHA_" + s for s in missing))
    for p in problems:
        print(p)
    print(f"check_status_docs: {len(docs)} functions, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
