#!/usr/bin/env bash
# Builds and installs the Python package into a fresh venv and runs its pytest suite there:
#   bash tools/python-check.sh [DIR]        (DIR: where the venv goes, default build-py)
# The venv is made by Debian's /usr/bin/python3 with --system-site-packages, so PyTorch 1.13
# (python3-torch) and NumPy come from Debian; pip, pytest and pyopencl from PyPI. The tests run
# from outside the source tree, on the installed package; then the README's Python examples and
# examples/python_train.py.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-build-py}
rm -rf "$dir/venv"
mkdir -p "$dir"
/usr/bin/python3 -m venv --system-site-packages "$dir/venv"
dir=$(cd "$dir" && pwd)
py="$dir/venv/bin/python"
"$py" -m pip install -q --disable-pip-version-check pytest pyopencl
t0=$SECONDS
"$py" -m pip install -q --disable-pip-version-check .
echo "python-check: pip install . took $((SECONDS - t0)) s"
t0=$SECONDS
src=$PWD
(cd "$dir" && "$py" -m pytest -q -p no:cacheprovider "$src/python/tests")
echo "python-check: pytest took $((SECONDS - t0)) s"
# The README's Python examples, as written, and the training example (exits 1 unless it learns).
t0=$SECONDS
(cd "$dir" && "$py" "$src/tools/readme_examples.py" "$src/README.md" "## Python")
"$py" examples/python_train.py --log-every 100
echo "python-check: examples took $((SECONDS - t0)) s"
