"""Runs the ```python blocks of one README section, each in a fresh namespace, in the current
folder: python3 tools/readme_examples.py README.md "## Python". Exit 1 on the first failure."""

import re
import sys
import traceback


def main(path: str, heading: str) -> int:
    text = open(path, encoding="utf-8").read()
    start = text.index(heading + "\n")
    end = text.find("\n## ", start + len(heading))
    blocks = re.findall(r"```python\n(.*?)```", text[start:end if end >= 0 else None], re.S)
    if not blocks:
        print(f"readme_examples: no python block under {heading!r}")
        return 1
    for i, code in enumerate(blocks, 1):
        try:
            exec(compile(code, f"{path} ({heading}, example {i})", "exec"), {"__name__": "__main__"})
        except Exception:
            traceback.print_exc()
            return 1
        print(f"readme_examples: {heading} example {i} ran")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
