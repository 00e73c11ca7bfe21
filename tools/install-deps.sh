#!/usr/bin/env bash
# Installs everything clmha needs to build, test and run on Debian 12 (as root, or with sudo).
# oclgrind runs the kernels in a checking simulator; python3-torch/numpy make and check the golden
# data and run the ctypes example against PyTorch. On CPU devices the GEMMs run in a host BLAS:
# oneDNN (libdnnl2) for float32, OpenBLAS (libopenblas0-pthread, cblas_dgemm) for float64 layers.
# python3-dev, python3-venv and python3-pip build and install the Python package (pip install .).
set -euo pipefail
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends \
  build-essential cmake pkg-config \
  ocl-icd-opencl-dev opencl-c-headers pocl-opencl-icd clinfo \
  libclblast-dev libcriterion-dev libcjson-dev libpng-dev \
  oclgrind valgrind python3-numpy python3-torch doxygen \
  libdnnl2 libopenblas0-pthread libopenmpi-dev openmpi-bin \
  python3-dev python3-venv python3-pip
