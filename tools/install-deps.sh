#!/usr/bin/env bash
# Installs what clmha needs on Debian 12 (as root, or with sudo):
#   bash tools/install-deps.sh          build the library and the clmha program, run the demo
#   bash tools/install-deps.sh --test   also the test suite, the benchmarks and the Python package
#
# Default: CMake, a C compiler and pkg-config; the OpenCL ICD loader and headers, PoCL (a CPU
# OpenCL driver) and clinfo; CLBlast and cJSON (the library links them), libpng (the program's
# heatmaps); oneDNN (libdnnl2) and OpenBLAS (libopenblas0-pthread), the host BLAS in which a CPU
# driver's matrix products run (float32 and float64 layers; loaded at run time).
# --test adds Criterion (the test suites), oclgrind and valgrind (the checking runs of .ci/run),
# python3-torch and python3-numpy (the golden data, the ctypes example, the benchmarks against
# PyTorch), doxygen (the API reference), Open MPI (the ring-attention example) and
# python3-dev, python3-venv and python3-pip (pip install . of the Python package).
set -euo pipefail
test_tools=false
for arg in "$@"; do
  case "$arg" in
    --test) test_tools=true ;;
    -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "install-deps.sh: unknown option '$arg' (try --help)" >&2; exit 2 ;;
  esac
done
packages=(
  build-essential cmake pkg-config
  ocl-icd-opencl-dev opencl-c-headers pocl-opencl-icd clinfo
  libclblast-dev libcjson-dev libpng-dev
  libdnnl2 libopenblas0-pthread
)
if $test_tools; then
  packages+=(
    libcriterion-dev oclgrind valgrind python3-numpy python3-torch doxygen
    libopenmpi-dev openmpi-bin python3-dev python3-venv python3-pip
  )
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${packages[@]}"
