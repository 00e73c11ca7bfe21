#!/usr/bin/env python3
"""Checks that the arrows between src/'s files run down the layers, never up, and never in circles.

The layers of src/, lowest first (docs/design.md, "Source tree", shows the same table). Two checks:

Includes (the default). A file may include a header of its own layer or of a lower one, and the
public headers of include/. Every quoted #include is resolved the way the compiler does it with
src/ and include/ on the include path (the including file's folder first, then src/, then
include/); an include that resolves to none of them is a violation too, and so is a library file
that no layer holds.

Symbols (--objects BUILD_DIR). Who calls whom, read from the object files of a CMake build tree:
`nm` lists each object's defined and undefined global symbols, and an undefined symbol that
another src/ file defines is an arrow from the one file to the other (a call, or a use of its
data). This sees what includes cannot: a call of a public clmha_* function of a higher layer
goes through include/clmha.h. A violation is an arrow into a higher layer (the library calling
the program counts too), or a circle: files that reach each other through their arrows (A calls B
and B calls A, or longer), in the library and in the program (src/cli/) alike.

Usage: tools/check_layers.py [ROOT]                         (the include check)
       tools/check_layers.py --objects BUILD_DIR [ROOT]     (the symbol check, after a build)
       tools/check_layers.py --table                        (prints the layer table)
ROOT is the repository (default: this script's parent). $NM names the nm to run (default: nm).
Exit status: 0 when clean, 1 with one line per violation, 2 on a usage error (or a build tree
without the library's object files).
"""
import os
import re
import subprocess
import sys

# (rank, name, paths under src/: a folder ends with "/"). Layers of equal rank may include each
# other's headers.
LAYERS = [
    (1, "base", ["base/"]),
    (2, "errors", ["errors/"]),
    (3, "device", ["device/"]),
    (4, "tuning_store", ["tuning_store/"]),  # the tuned parameters, persisted and built in
    (5, "context", ["context/"]),
    (6, "layer", ["layer/"]),
    (7, "cores", ["cores/"]),
    (7, "cache", ["cache/"]),  # the KV cache of incremental decoding (its core is cores/decode.c)
    (8, "forward", ["forward/"]),
    (9, "backward", ["backward/"]),  # training: the backward pass (the saved state is forward/)
    (9, "formats", ["formats/"]),
    (9, "reference", ["reference/"]),
    (10, "tuning_search", ["tuning_search/"]),  # the search of clmha_context_tune()
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


# ---- the symbol check ---------------------------------------------------------------------------

# One more rank than the library's top layer: the program sits above every layer.
PROGRAM_RANK = max(rank for rank, _, _ in LAYERS) + 1

# A file in a CMake dependency list: "<source>" "<object>" "<compiler>" "<depfile>".
DEPEND_ENTRY = re.compile(r'^\s*"([^"]+)"\s+"([^"]+)"\s+"[^"]*"\s+"[^"]*"\s*$')


def rank_of(rel):
    """The rank and name of src/-relative path @rel ((PROGRAM_RANK, "program") for src/cli/)."""
    own = layer_of(rel)
    if own == "program":
        return PROGRAM_RANK, "program"
    return own


def object_files(build, src):
    """{src/-relative source: object path} of the build tree @build, from each target's
    CMakeFiles/<target>.dir/DependInfo.cmake (the sources the target compiles now, so an object
    left behind by a removed file does not count); where a target has none (an older CMake),
    from the objects under its folder whose source still exists. A source compiled by several
    targets (src/base/ is in the library and in the program's support library) counts once."""
    found = {}
    cmakefiles = os.path.join(build, "CMakeFiles")
    for target in sorted(os.listdir(cmakefiles)):
        folder = os.path.join(cmakefiles, target)
        if not target.endswith(".dir") or not os.path.isdir(folder):
            continue
        pairs = []
        info = os.path.join(folder, "DependInfo.cmake")
        if os.path.isfile(info):
            with open(info, encoding="utf-8") as text:
                for line in text:
                    m = DEPEND_ENTRY.match(line)
                    if m:
                        source, obj = m.group(1), os.path.join(build, m.group(2))
                        pairs.append((os.path.realpath(source), obj))
        else:
            for where, _, files in os.walk(folder):
                for f in files:
                    if f.endswith(".c.o"):
                        obj = os.path.join(where, f)
                        source = os.path.relpath(obj[:-2], folder)
                        pairs.append((os.path.realpath(os.path.join(src, "..", source)), obj))
        for source, obj in pairs:
            if source.startswith(src + os.sep) and os.path.isfile(source):
                found.setdefault(os.path.relpath(source, src).replace(os.sep, "/"), obj)
    return found


def symbols(nm, obj):
    """(defined, undefined) global symbols of object file @obj."""
    out = subprocess.run([nm, "-P", "-g", obj], check=True, capture_output=True, text=True).stdout
    defined, undefined = set(), set()
    for line in out.splitlines():
        fields = line.split()
        if len(fields) < 2 or line.endswith(":"):
            continue
        name, kind = fields[0], fields[1]
        if kind == "U":
            undefined.add(name)
        elif kind not in ("w", "v"):  # w, v: a weak symbol that stays undefined
            defined.add(name)
    return defined, undefined


def call_graph(objects, nm):
    """{caller: {callee: sorted symbols}} between the src/ files of @objects, and the problems
    found on the way (a symbol two files define)."""
    defined_in, undefined = {}, {}
    problems = []
    for rel, obj in sorted(objects.items()):
        defined, undefined[rel] = symbols(nm, obj)
        for name in defined:
            if name in defined_in and defined_in[name] != rel:
                problems.append(f"src/{rel}: defines {name}, which src/{defined_in[name]} "
                                "defines too")
            defined_in.setdefault(name, rel)
    graph = {rel: {} for rel in objects}
    for rel in sorted(objects):
        for name in sorted(undefined[rel]):
            callee = defined_in.get(name)
            if callee is not None and callee != rel:
                graph[rel].setdefault(callee, []).append(name)
    return graph, problems


def circles(graph):
    """The strongly connected components of @graph with more than one file (Tarjan's
    algorithm), each a sorted list."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def shortest_cycle(graph, component):
    """A shortest circle through the first file of @component, as a list of files that starts
    and ends with it (a breadth-first search inside the component)."""
    start = component[0]
    inside = set(component)
    came_from = {start: None}
    queue = [start]
    for v in queue:
        for w in sorted(graph[v]):
            if w == start:
                path = [v]
                while came_from[path[-1]] is not None:
                    path.append(came_from[path[-1]])
                return [start] + path[::-1][1:] + [start] if len(path) > 1 else [start, v, start]
            if w in inside and w not in came_from:
                came_from[w] = v
                queue.append(w)
    return component + [start]


def arrow(graph, a, b):
    """"src/a -> src/b (sym, sym, +n)": an arrow with the first symbols it stands for."""
    names = graph[a][b]
    shown = ", ".join(names[:2]) + (f", +{len(names) - 2}" if len(names) > 2 else "")
    return f"src/{a} -> src/{b} ({shown})"


def check_symbols(root, build, nm):
    """Problems of the symbol check, and a summary line; None when @build holds no object of
    the library."""
    src = os.path.realpath(os.path.join(root, "src"))
    objects = object_files(build, src)
    if not any(rel.startswith(("errors/", "context/")) for rel in objects):
        return None
    missing = sorted(rel for rel, obj in objects.items() if not os.path.isfile(obj))
    for rel in missing:
        del objects[rel]
    graph, problems = call_graph(objects, nm)
    problems[:0] = [f"src/{rel}: its object file is missing (build before the check)"
                    for rel in missing]
    upward = 0
    for a in sorted(graph):
        own = rank_of(a)
        if own is None:
            problems.append(f"src/{a}: in no layer of tools/check_layers.py's table")
            continue
        for b in sorted(graph[a]):
            theirs = rank_of(b)
            if theirs is not None and theirs[0] > own[0]:
                upward += 1
                problems.append(f"{arrow(graph, a, b)}: layer {own[1]} ({own[0]}) calls higher "
                                f"layer {theirs[1]} ({theirs[0]})")
    found = circles(graph)
    for component in found:
        cycle = shortest_cycle(graph, component)
        steps = " -> ".join("src/" + f for f in cycle)
        names = "; ".join(", ".join(graph[a][b][:2]) for a, b in zip(cycle, cycle[1:]))
        rest = sorted(set(component) - set(cycle))
        more = f"; files reached from it and back: src/{', src/'.join(rest)}" if rest else ""
        problems.append(f"circle: {steps}: {names}{more}")
    arrows = sum(len(callees) for callees in graph.values())
    program = sum(1 for rel in objects if rank_of(rel) == (PROGRAM_RANK, "program"))
    summary = (f"check_layers --objects: {len(objects)} files ({len(objects) - program} library, "
               f"{program} program), {arrows} arrows between them: {upward} upward, "
               f"{len(found)} circle(s)")
    return problems, summary


def main(argv):
    args = argv[1:]
    build = None
    if len(args) >= 2 and args[0] == "--objects":
        build, args = args[1], args[2:]
    if len(args) > 1 or (args and args[0].startswith("-") and args != ["--table"]):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    if args == ["--table"]:
        if build is not None:
            print(__doc__.strip(), file=sys.stderr)
            return 2
        for rank, name, paths in LAYERS:
            print(f"{rank:>2}  {name:<14} " + " ".join("src/" + p for p in paths))
        return 0
    root = args[0] if args else os.path.join(os.path.dirname(__file__), "..")
    root = os.path.abspath(root)
    if not os.path.isdir(os.path.join(root, "src")):
        print(f"check_layers: {root} has no src/", file=sys.stderr)
        return 2
    if build is None:
        problems = check(root)
    else:
        if not os.path.isdir(os.path.join(build, "CMakeFiles")):
            print(f"check_layers: {build} is not a CMake build tree", file=sys.stderr)
            return 2
        result = check_symbols(root, os.path.abspath(build), os.environ.get("NM", "nm"))
        if result is None:
            print(f"check_layers: {build} holds no object file of the library (build it first)",
                  file=sys.stderr)
            return 2
        problems, summary = result
    for p in problems:
        print(p)
    if build is not None:
        print(summary)
    sys.stdout.flush()
    if problems:
        print(f"check_layers: {len(problems)} violation(s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
