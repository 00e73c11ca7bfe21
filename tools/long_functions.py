#!/usr/bin/env python3
"""Lists the C functions of src/ (.c and .h files) longer than N lines, longest first.

A function's length counts its lines from the first line of its definition (the return type)
to its closing brace, both included. The scanner is simple on purpose: it blanks comments,
string and character literals and preprocessor lines (continuations included), then matches
braces at file scope; a `{` at depth 0 opens a function definition when the text before it
(back to the previous `;`, `}` or start of file) ends with a parameter list and is not a
struct, union or enum body or an initializer. Code whose braces differ between #if branches
would confuse it; src/ has none.

Usage: tools/long_functions.py [ROOT] [--min N]
         lists the functions over N lines (default 80) as `LENGTH  path:line  function`
       tools/long_functions.py [ROOT] --max N --allow FILE
         the same check as a test: fails when a function over N lines is not named in FILE
         (lines `path:function  # why kept`, path relative to ROOT; `#` starts a comment).
         Entries naming no function over N lines are reported, not failed: trim them.
       tools/long_functions.py [ROOT] --unused
         lists the internal functions of src/ (static or clmha__) that no code uses: whose
         name appears in no function body, initializer or macro of src/, tests/, fuzz/, bench/,
         examples/ or tools/ (one pass: a function used only by an unused one is not listed).
ROOT: the repository (default: this script's parent). Exit status: 0 when clean, 1 when a
function over --max is not allowed, 2 on a usage error.
"""
import argparse
import collections
import os
import re
import sys

IDENT = re.compile(r"[A-Za-z_]\w*")
NOT_FUNCTIONS = {"struct", "union", "enum"}
# The folders, besides src/, whose code may use the library's internal functions (--unused).
USERS = ["tests", "fuzz", "bench", "examples", "tools"]


def blank(text):
    """(code, directives): @text with comments and the insides of string and character literals
    replaced by spaces, newlines kept; code has the preprocessor lines (continuations included)
    blanked too, directives has only them."""
    code, directives = [], []
    i, n = 0, len(text)
    line_start = True  # only whitespace since the last newline
    in_directive = False

    def emit(piece):
        blanked = re.sub(r"[^\n]", " ", piece)
        code.append(blanked if in_directive else piece)
        directives.append(piece if in_directive else blanked)

    while i < n:
        c = text[i]
        if c == "/" and text.startswith("/*", i):
            end = text.find("*/", i + 2)
            end = n if end < 0 else end + 2
            emit(re.sub(r"[^\n]", " ", text[i:end]))
            i = end
            continue
        if c == "/" and text.startswith("//", i):
            end = text.find("\n", i)
            end = n if end < 0 else end
            emit(" " * (end - i))
            i = end
            continue
        if c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            emit(c + " " * (j - i - 2) + c if j - i >= 2 else c)
            i = j
            line_start = False
            continue
        if c == "\\" and text.startswith("\\\n", i):  # a continued line stays in its directive
            emit(text[i:i + 2])
            i += 2
            continue
        if c == "#" and line_start:
            in_directive = True
        if c == "\n":
            line_start = True
            in_directive = False
        elif not c.isspace():
            line_start = False
        emit(c)
        i += 1
    return "".join(code), "".join(directives)


def function_name(head):
    """The name defined by the file-scope text @head that precedes a `{`, or None."""
    head = head.strip()
    if not head.endswith(")"):
        return None
    if "=" in head.split("(")[0]:
        return None
    words = IDENT.findall(head.split("(")[0])
    if not words or NOT_FUNCTIONS & set(words):
        return None
    return declarator_name(head)


def declarator_name(text):
    """The name declared by @text, which ends with a parameter list: the identifier before that
    last balanced (...) group, or, for a function returning a function pointer
    (`int (*name(int))(void)`), the name inside the group before it."""
    depth = 0
    for k in range(len(text) - 1, -1, -1):
        if text[k] == ")":
            depth += 1
        elif text[k] == "(":
            depth -= 1
            if depth == 0:
                before = text[:k].rstrip()
                if before.endswith(")"):  # the declarator is in parentheses
                    inner_end = len(before) - 1
                    inner_depth = 0
                    for j in range(inner_end, -1, -1):
                        inner_depth += {")": 1, "(": -1}.get(before[j], 0)
                        if inner_depth == 0:
                            return declarator_name(before[j + 1:inner_end])
                    return None
                m = re.search(r"([A-Za-z_]\w*)$", before)
                return m.group(1) if m else None
    return None


def functions(path, refs=None):
    """(name, first line, length in lines) of each function defined in the C file @path. When
    @refs (a Counter) is given, adds to it the identifiers that the file uses: those in braces
    (function bodies, initializers) and in preprocessor lines other than #include."""
    with open(path, encoding="utf-8", errors="replace") as f:
        code, directives = blank(f.read())
    if refs is not None:
        for line in directives.splitlines():
            if not re.match(r"\s*#\s*include\b", line):
                refs.update(IDENT.findall(line))
    found = []
    depth = 0
    head_start = 0  # offset just after the previous `;` or `}` at file scope
    open_at = None  # (name, offset of the definition's first character) of the open function
    line_of = []  # newline offsets, for offset -> line
    for k, c in enumerate(code):
        if c == "\n":
            line_of.append(k)

    def line_at(offset):
        lo, hi = 0, len(line_of)
        while lo < hi:
            mid = (lo + hi) // 2
            if line_of[mid] < offset:
                lo = mid + 1
            else:
                hi = mid
        return lo + 1

    body_start = 0
    for k, c in enumerate(code):
        if c == "{":
            if depth == 0:
                body_start = k
                head = code[head_start:k]
                name = function_name(head)
                first = head_start + (len(head) - len(head.lstrip()))
                open_at = (name, first) if name else None
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                if refs is not None:
                    refs.update(IDENT.findall(code[body_start:k]))
                if open_at:
                    start = line_at(open_at[1])
                    found.append((open_at[0], start, line_at(k) - start + 1))
                open_at = None
                head_start = k + 1
            depth = max(depth, 0)
        elif c == ";" and depth == 0:
            head_start = k + 1
    return found


def c_files(root, folder):
    """The C (and C++) files under @root/@folder, as (path, path relative to @root)."""
    for parent, dirs, files in os.walk(os.path.join(root, folder)):
        dirs.sort()
        for name in sorted(files):
            if name.endswith((".c", ".h", ".cpp")):
                path = os.path.join(parent, name)
                yield path, os.path.relpath(path, root).replace(os.sep, "/")


def scan(root, refs=None):
    """(length, path relative to @root, line, name) of every function under @root/src; with
    @refs, also counts the identifiers used in src/ and in USERS."""
    result = []
    for path, rel in c_files(root, "src"):
        for fn, line, length in functions(path, refs):
            result.append((length, rel, line, fn))
    if refs is not None:
        for folder in USERS:
            for path, rel in c_files(root, folder):
                functions(path, refs)
    result.sort(key=lambda r: (-r[0], r[1], r[2]))
    return result


def unused(root):
    """(path, line, name) of the functions of src/ whose name no code uses: internal ones
    (static or clmha__) only, since the public clmha_ functions are used by programs."""
    refs = collections.Counter()
    found = scan(root, refs)
    result = []
    for _, rel, line, name in found:
        if name == "main" or (name.startswith("clmha_") and not name.startswith("clmha__")):
            continue
        # Uses are counted by name over all files: a static name that several files define is
        # listed only when none of them uses it.
        if refs[name] == 0:
            result.append((rel, line, name))
    return sorted(result)


def read_allow(path):
    """The set of `path:function` entries of the allow file @path."""
    allowed = set()
    with open(path, encoding="utf-8") as f:
        for number, raw in enumerate(f, 1):
            entry = raw.split("#", 1)[0].strip()
            if not entry:
                continue
            if entry.count(":") != 1 or " " in entry:
                raise ValueError(f"{path}:{number}: expected `path:function  # why`, got {entry!r}")
            allowed.add(entry)
    return allowed


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("root", nargs="?",
                        default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    parser.add_argument("--min", type=int, default=80, metavar="N",
                        help="list the functions longer than N lines (default 80)")
    parser.add_argument("--max", type=int, metavar="N",
                        help="fail when a function longer than N lines is not in --allow")
    parser.add_argument("--allow", metavar="FILE", help="the allowed functions, with --max")
    parser.add_argument("--unused", action="store_true",
                        help="list instead the internal functions that no code uses")
    args = parser.parse_args(argv)
    if (args.max is None) != (args.allow is None):
        parser.error("--max and --allow go together")
    root = os.path.abspath(args.root)
    if not os.path.isdir(os.path.join(root, "src")):
        parser.error(f"{root} has no src/ folder")
    if args.unused:
        for rel, line, name in unused(root):
            print(f"{rel}:{line}  {name}")
        return 0
    found = scan(root)

    if args.max is None:
        for length, rel, line, name in found:
            if length > args.min:
                print(f"{length:5d}  {rel}:{line}  {name}")
        return 0

    try:
        allowed = read_allow(args.allow)
    except (OSError, ValueError) as e:
        print(f"long_functions.py: {e}", file=sys.stderr)
        return 2
    failures = 0
    long_ones = set()
    for length, rel, line, name in found:
        if length <= args.max:
            continue
        long_ones.add(f"{rel}:{name}")
        if f"{rel}:{name}" not in allowed:
            print(f"{rel}:{line}: {name} is {length} lines (over {args.max}, not in "
                  f"{os.path.basename(args.allow)}): split it, or list it there and say why")
            failures += 1
    for entry in sorted(allowed - long_ones):
        print(f"note: {entry} is allowed but is not over {args.max} lines (or is gone): "
              f"remove it from {os.path.basename(args.allow)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
