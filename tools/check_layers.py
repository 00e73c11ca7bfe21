#!/usr/bin/env python3
"""Checks that the library's sources include headers of their own layer or lower layers only.

The layers of src/, lowest first (docs/design.md, "Source tree", shows the same table). A file
may include a header of its own layer or of a lower one, and the public headers of include/.
Every quoted #include is resolved the way the compiler does it with src/ and include/ on the
include path (the including file's folder first, then src/, then include/); an include that
resolves to none of them is a violation too, and so is a library file that no layer holds.

Usage: tools/check_layers.py [ROOT]   (ROOT: the repository, default: this script's parent)
       tools/check_layers.py --table  (prints the layer table)
Exit status: 0 when clean, 1 with one line per violation, 2 on a usage error.
"""
import os
import re
import sys

# (rank, name, paths under src/: a folder ends with "/"). Layers of equal rank may include each
# other's headers.
LAYERS = [
    (1, "base", ["base/"]),
    (2, "errors", ["errors/"]),
    (3, "device", ["device/"]),
    (4, "tuning", ["tuning/"]),  # the tuning store
    (5, "context", ["context/"]),
    (6, "layer", ["layer/"]),
    (7, "cores", ["cores/"]),
    (7, "cache", ["cache/"]),  # the KV cache of incremental decoding (its core is cores/decode.c)
    (8, "forward", ["forward/"]),
    (9, "backward", ["backward/"]),  # training: the backward pass (the saved state is forward/)
    (9, "formats", ["formats/"]),
    (9, "reference", ["reference/"]),
    (10, "tuner", ["tuner/"]),  # the search of clmha_context_tune()
]

# The program (clmha), on top of the library: it uses include/clmha.h and, of the library's
# sources, only base/ (compiled into its support library); never the library's internals.
PROGRAM = ["cli/"]
PROGRAM_MAY_USE = ["cli/", "base/"]

# Headers generated at build time (into <build>/include), with the layer of include/.
GENERATED = {"clmha_version.h"}

INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"')


def matches(rel, paths):
    return any(rel.startswith(p) if p.endswith("/") else rel == p for p in paths)


def layer_of(rel):
    """The (rank, name) of src/-relative path @rel, "program", or None."""
    if matches(rel, PROGRAM):
        return "program"
    for rank, name, paths in LAYERS:
        if matches(rel, paths):
            return rank, name
    return None


def resolve(root, including_dir, name):
    """(where, src-relative path or None) of an include: where is "src", "include" or None."""
    src = os.path.join(root, "src")
    for base in (including_dir, src):
        path = os.path.normpath(os.path.join(base, name))
        if os.path.isfile(path) and path.startswith(src + os.sep):
            return "src", os.path.relpath(path, src).replace(os.sep, "/")
    if os.path.isfile(os.path.join(root, "include", name)) or name in GENERATED:
        return "include", None
    return None, None


def check(root):
    src = os.path.join(root, "src")
    problems = []
    for folder, dirs, files in os.walk(src):
        dirs.sort()
        for f in sorted(files):
            if not f.endswith((".c", ".h")):
                continue
            path = os.path.join(folder, f)
            rel = os.path.relpath(path, src).replace(os.sep, "/")
            own = layer_of(rel)
            if own is None:
                problems.append(f"src/{rel}: in no layer of tools/check_layers.py's table")
                continue
            with open(path, encoding="utf-8") as text:
                for number, line in enumerate(text, 1):
                    m = INCLUDE.match(line)
                    if not m:
                        continue
                    name = m.group(1)
                    where, target = resolve(root, folder, name)
                    at = f"src/{rel}:{number}: #include \"{name}\""
                    if where is None:
                        problems.append(f"{at}: no such header in src/ or include/")
                        continue
                    if where == "include":
                        continue
                    if own == "program":
                        if not matches(target, PROGRAM_MAY_USE):
                            problems.append(f"{at} (src/{target}): the program includes a "
                                            "library internal (it may use src/base/ only)")
                        continue
                    theirs = layer_of(target)
                    if theirs is None or theirs == "program":
                        what = "the program" if theirs else "no layer"
                        problems.append(f"{at} (src/{target}): a header of {what}, included "
                                        f"by layer {own[1]} ({own[0]})")
                    elif theirs[0] > own[0]:
                        problems.append(f"{at} (src/{target}): layer {own[1]} ({own[0]}) "
                                        f"includes higher layer {theirs[1]} ({theirs[0]})")
    return problems


def main(argv):
    if len(argv) > 2 or (len(argv) == 2 and argv[1] in ("-h", "--help")):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    if len(argv) == 2 and argv[1] == "--table":
        for rank, name, paths in LAYERS:
            print(f"{rank:>2}  {name:<10} " + " ".join("src/" + p for p in paths))
        return 0
    root = argv[1] if len(argv) == 2 else os.path.join(os.path.dirname(__file__), "..")
    root = os.path.abspath(root)
    if not os.path.isdir(os.path.join(root, "src")):
        print(f"check_layers: {root} has no src/", file=sys.stderr)
        return 2
    problems = check(root)
    for p in problems:
        print(p)
    if problems:
        print(f"check_layers: {len(problems)} violation(s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
