#!/usr/bin/env bash
# Installs what clmha needs on Debian 12 (as root, or with sudo):
#   bash tools/install-deps.sh          build the library and the clmha program, run the demo,
#                                       pip install . (the Python package) into a venv
#   bash tools/install-deps.sh --test   also the test suite and the benchmarks
#
# Default: CMake, a C compiler and pkg-config; the OpenCL ICD loader and headers, PoCL (a CPU
# OpenCL driver) and clinfo; CLBlast and cJSON (the library links them), libpng (the program's
# heatmaps); oneDNN (libdnnl2) and OpenBLAS (libopenblas0-pthread), the host BLAS in which a CPU
# driver's matrix products run (float32 and float64 layers; loaded at run time); python3-dev,
# python3-venv and python3-pip (pip install . of the Python package, in a venv).
# --test adds Criterion (the test suites), oclgrind and valgrind (the checking runs of .ci/run),
# python3-torch and python3-numpy (the golden data, the ctypes example, the benchmarks against
# PyTorch), doxygen (the API reference) and Open MPI (the ring-attention example).
set -euo pipefail
test_tools=false
for arg in "$@"; do
  case "$arg" in
    --test) test_tools=true ;;
    -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "install-deps.sh: unknown option '$arg' (try --help)" >&2; exit 2 ;;
  esac
done
packages=(
  build-essential cmake pkg-config
  ocl-icd-opencl-dev opencl-c-headers pocl-opencl-icd clinfo
  libclblast-dev libcjson-dev libpng-dev
  libdnnl2 libopenblas0-pthread
  python3-dev python3-venv python3-pip
)
if $test_tools; then
  packages+=(
    libcriterion-dev oclgrind valgrind python3-numpy python3-torch doxygen
    libopenmpi-dev openmpi-bin
  )
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${packages[@]}"
