"""Keeps the prose's lists of files true.

  python3 tools/check_docs.py [ROOT]
      fails (exit 1) when a folder of src/ or a kernel file (cl/*.cl, cl/cores/*.cl) is not named
      in README.md's "Layout" section, or a file of src/ is not named in docs/design.md's
      "Source tree" section (in the table row of its folder, by file name or by name without
      extension: `message` covers message.c and message.h).

  python3 tools/check_docs.py [ROOT] --readme-c BUILD_DIR
      compiles the first ```c block of README.md's "C quick start" as written, with the compile
      line the README gives against a build tree (cc -std=c11 ... -Lbuild -lclmha), and runs it in
      ROOT. Exit 1 when it does not compile or fails; 77 (CTest: skipped) when no OpenCL device
      exists.
"""

import os
import re
import subprocess
import sys
import tempfile


def section(text: str, heading: str) -> str:
    """The text under a "## heading" line, up to the next "## " heading."""
    m = re.search(r"^" + re.escape(heading) + r"[^\n]*\n", text, re.M)
    if not m:
        raise SystemExit(f"check_docs: no section {heading!r}")
    end = re.search(r"^## ", text[m.end():], re.M)
    return text[m.end():m.end() + end.start()] if end else text[m.end():]


def check_layout(root: str) -> list:
    errors = []
    readme = section(open(os.path.join(root, "README.md"), encoding="utf-8").read(), "## Layout")
    named = set(re.findall(r"`([^`]+)`", readme))
    src = os.path.join(root, "src")
    for folder in sorted(os.listdir(src)):
        if os.path.isdir(os.path.join(src, folder)) and f"src/{folder}/" not in named:
            errors.append(f"README.md, Layout: src/{folder}/ is not named (`src/{folder}/`)")
    for sub in ("cl", "cl/cores"):
        for name in sorted(os.listdir(os.path.join(root, sub))):
            if name.endswith(".cl") and f"{sub}/{name}" not in named:
                errors.append(f"README.md, Layout: {sub}/{name} is not named (`{sub}/{name}`)")
    design = section(open(os.path.join(root, "docs", "design.md"), encoding="utf-8").read(),
                     "## Source tree")
    rows = {}
    for line in design.splitlines():
        m = re.match(r"\|\s*`src/([a-z_]+)/`\s*\|(.*)\|\s*$", line)
        if m:
            rows[m.group(1)] = set(re.findall(r"`([^`]+)`", m.group(2)))
    for folder in sorted(os.listdir(src)):
        path = os.path.join(src, folder)
        if not os.path.isdir(path):
            continue
        if folder not in rows:
            errors.append(f"docs/design.md, Source tree: no table row for `src/{folder}/`")
            continue
        # `a`/`b`/`c` and `a.c`, `a.h` all count; so does `folder/a.c`.
        words = set()
        for token in rows[folder]:
            for part in re.split(r"[/\s,]+", token):
                words.add(part)
        for name in sorted(os.listdir(path)):
            if not name.endswith((".c", ".h")):
                continue
            stem = name.rsplit(".", 1)[0]
            if not ({name, stem} & words):
                errors.append(f"docs/design.md, Source tree: src/{folder}/{name} is not named "
                              f"in the `src/{folder}/` row")
    return errors


def run_readme_c(root: str, build: str) -> int:
    text = section(open(os.path.join(root, "README.md"), encoding="utf-8").read(),
                   "## C quick start")
    blocks = re.findall(r"```c\n(.*?)```", text, re.S)
    if not blocks:
        print("check_docs: no ```c block under '## C quick start'")
        return 1
    cc = os.environ.get("CC", "cc")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "app.c")
        exe = os.path.join(tmp, "app")
        with open(src, "w", encoding="utf-8") as f:
            f.write(blocks[0])
        cmd = [cc, "-std=c11", "-Wall", "-Wextra", "-Wpedantic", "-Werror", src,
               "-I" + os.path.join(root, "include"), "-I" + os.path.join(build, "include"),
               "-L" + build, "-lclmha", "-Wl,-rpath," + os.path.abspath(build), "-o", exe]
        print(" ".join(cmd))
        if subprocess.run(cmd).returncode != 0:
            print("check_docs: README.md's C quick start does not compile")
            return 1
        run = subprocess.run([exe], cwd=root, capture_output=True, text=True)
        sys.stdout.write(run.stdout)
        sys.stderr.write(run.stderr)
        if run.returncode != 0:
            if "no OpenCL device found" in run.stderr:
                print("check_docs: no OpenCL device: skipped")
                return 77
            print(f"check_docs: README.md's C quick start exited {run.returncode}")
            return 1
    print("check_docs: README.md's C quick start compiled and ran")
    return 0


def main(argv: list) -> int:
    args = [a for a in argv if not a.startswith("--")]
    root = os.path.abspath(args[0]) if args else os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))
    if "--readme-c" in argv:
        i = argv.index("--readme-c")
        if i + 1 >= len(argv):
            print("check_docs: --readme-c needs the build folder")
            return 2
        return run_readme_c(root, argv[i + 1])
    errors = check_layout(root)
    for e in errors:
        print(e)
    if errors:
        print(f"check_docs: {len(errors)} file(s) missing from the prose")
        return 1
    print("check_docs: README's Layout and docs/design.md's source tree name every folder and file")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
