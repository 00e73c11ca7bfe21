#!/usr/bin/env bash
# Runs a command with exactly one OpenCL driver visible: a test lane per driver.
#
#   tools/ocl-driver.sh DRIVER -- COMMAND [ARG...]   run COMMAND under DRIVER
#   tools/ocl-driver.sh DRIVER                       install DRIVER if needed, show its device
#   tools/ocl-driver.sh DRIVER --env                 print the environment as export lines
#   tools/ocl-driver.sh --list                       the drivers and whether they are installed
#
# DRIVER is one of
#   pocl       Debian's PoCL (pocl-opencl-icd), OpenCL 3.0 CPU driver, the project's default
#   intel      Intel's oneAPI OpenCL CPU runtime from PyPI (intel-opencl-rt), OpenCL 3.0
#   rusticl    Mesa's rusticl on llvmpipe (Debian's mesa-opencl-icd, unpacked, not installed)
#   clover     Mesa's clover on llvmpipe (the same unpacked package), OpenCL 1.1
#   pocl-pypi  PoCL from PyPI (pocl-binary-distribution)
#
# The ICD loader (ocl-icd) is pointed at a private vendors directory holding one .icd file that
# names the driver's library by absolute path (OCL_ICD_VENDORS), so the drivers registered in
# /etc/OpenCL/vendors are not seen. Nothing is written under /etc: what a driver needs is
# installed on first use into ${CLMHA_DRIVERS_DIR:-$HOME/.cache/clmha-drivers}/DRIVER (a Python
# venv, or an unpacked .deb), and only libraries that register no ICD are apt-installed (Mesa's
# dependencies: libclc-15, libllvmspirvlib15, ...). Installing is idempotent and locked, so lanes
# may start in parallel.
#
# Per-driver environment set for COMMAND:
#   intel     LD_PRELOAD of the wheel's libtbb.so.12: a process that loaded Debian's older
#             libtbb first (python3-torch does) would otherwise bind the runtime to it and fail.
#             The runtime has no on-disk program cache (none of its documented CL_CONFIG_*
#             settings is one), so every process compiles its kernels again.
#   rusticl   RUSTICL_ENABLE=llvmpipe (rusticl exposes no device without it).
#   clover    GALLIUM_PIPE_SEARCH_DIR to the unpacked pipe drivers (pipe_swrast.so), and LP_CL=1:
#             without either, clover lists its platform with no device.
# CLMHA_DRIVER is set to DRIVER; OCL_ICD_FILENAMES and CLMHA_DEVICE are cleared (one driver,
# one platform: the default device is the driver's).
set -euo pipefail

DRIVERS="pocl intel rusticl clover pocl-pypi"
ROOT="${CLMHA_DRIVERS_DIR:-$HOME/.cache/clmha-drivers}"
# Versions installed on first use; change them to move a lane to a newer driver.
INTEL_VERSION="${CLMHA_INTEL_OPENCL_VERSION:-2026.2.0}"
POCL_PYPI_VERSION="${CLMHA_POCL_PYPI_VERSION:-}"
MESA_DEPS=(libclc-15 libllvmspirvlib15 libllvm15 libclang-cpp15 libdrm2 libdrm-amdgpu1
           libdrm-nouveau2 libdrm-radeon1 libelf1 libexpat1 libsensors5 libzstd1 zlib1g)
# Debian's Python (python3-venv), not one found first on PATH.
PYTHON=/usr/bin/python3
[ -x "$PYTHON" ] || PYTHON=python3

die() { echo "ocl-driver: $*" >&2; exit 2; }
log() { echo "ocl-driver: $*" >&2; }

usage() {
    sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//' >&2
    echo "drivers: $DRIVERS (installed under $ROOT)" >&2
    exit 2
}

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

apt_install() {
    local missing=()
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" ||
            missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    log "apt-get install ${missing[*]}"
    # Waits for another apt run's lock; updates the package lists once if the install fails.
    local apt=(env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600)
    as_root "${apt[@]}" install -y -q --no-install-recommends "${missing[@]}" >&2 ||
        { as_root "${apt[@]}" update -q >&2 &&
          as_root "${apt[@]}" install -y -q --no-install-recommends "${missing[@]}" >&2; }
}

# The .icd file: one line, the library's absolute path.
write_icd() {  # dir name library
    [ -f "$3" ] || die "$3: no such library"
    mkdir -p "$1/vendors"
    rm -f "$1"/vendors/*.icd
    printf '%s\n' "$3" > "$1/vendors/$2.icd"
}

# A Python venv with the given pip requirements, in $1/venv.
make_venv() {  # dir requirement...
    local dir=$1; shift
    if ! "$PYTHON" -c 'import venv, ensurepip' 2>/dev/null; then apt_install python3-venv; fi
    rm -rf "$dir/venv"
    "$PYTHON" -m venv "$dir/venv"
    log "pip install $*"
    "$dir/venv/bin/pip" install -q --disable-pip-version-check "$@" >&2
}

setup_pocl() {  # Debian's PoCL: the library /etc/OpenCL/vendors/pocl.icd names
    local d=$1 lib
    apt_install pocl-opencl-icd
    lib=$(dpkg -L libpocl2 2>/dev/null | grep -E '/libpocl\.so\.2(\.[0-9.]+)?$' | sort | tail -n1)
    [ -n "$lib" ] || die "libpocl.so.2 not found (dpkg -L libpocl2)"
    write_icd "$d" pocl "$(readlink -f "$lib")"
}

setup_intel() {
    local d=$1
    make_venv "$d" "intel-opencl-rt==$INTEL_VERSION" "intel-cmplr-lib-rt==$INTEL_VERSION"
    write_icd "$d" intel-cpu "$d/venv/lib/libintelocl.so"
    [ -f "$d/venv/lib/libtbb.so.12" ] || die "$d/venv/lib/libtbb.so.12 missing (tbb wheel)"
}

setup_pocl_pypi() {
    local d=$1 lib
    make_venv "$d" "pocl-binary-distribution${POCL_PYPI_VERSION:+==$POCL_PYPI_VERSION}"
    # The wheel's library carries a hash in its name (libpocl-<hash>.so, beside pyopencl).
    lib=$(find "$d/venv" -name 'libpocl*.so*' -type f | sort | head -n1)
    [ -n "$lib" ] || die "libpocl.so not found in the pocl-binary-distribution wheel"
    write_icd "$d" pocl "$lib"
}

# Debian's mesa-opencl-icd unpacked into $ROOT/mesa/root (shared by rusticl and clover).
setup_mesa_tree() {
    local m="$ROOT/mesa"
    [ -f "$m/.unpacked" ] && return 0
    apt_install "${MESA_DEPS[@]}"
    rm -rf "$m" && mkdir -p "$m"
    (cd "$m" && apt-get download mesa-opencl-icd >&2) || {
        as_root apt-get update -q >&2 && (cd "$m" && apt-get download mesa-opencl-icd >&2); }
    dpkg-deb -x "$m"/mesa-opencl-icd_*.deb "$m/root"
    dpkg-deb -f "$m"/mesa-opencl-icd_*.deb Version > "$m/version"
    touch "$m/.unpacked"
}

setup_rusticl() {
    setup_mesa_tree
    write_icd "$1" rusticl "$ROOT/mesa/root/usr/lib/x86_64-linux-gnu/libRusticlOpenCL.so.1"
}

setup_clover() {
    setup_mesa_tree
    write_icd "$1" mesa "$ROOT/mesa/root/usr/lib/x86_64-linux-gnu/libMesaOpenCL.so.1"
}

# Installs DRIVER once (stamp file), under a lock.
ensure() {
    local drv=$1 d="$ROOT/$1"
    mkdir -p "$ROOT"
    exec 9> "$ROOT/.lock"
    flock 9
    if [ ! -f "$d/.ready" ]; then
        log "installing $drv into $d"
        rm -rf "$d" && mkdir -p "$d"
        "setup_${drv//-/_}" "$d"
        touch "$d/.ready"
    fi
    flock -u 9
    exec 9>&-
}

# Exports the lane's environment.
lane_env() {
    local drv=$1 d="$ROOT/$1"
    export OCL_ICD_VENDORS="$d/vendors" CLMHA_DRIVER="$drv"
    unset OCL_ICD_FILENAMES CLMHA_DEVICE
    case $drv in
    intel) export LD_PRELOAD="$d/venv/lib/libtbb.so.12${LD_PRELOAD:+:$LD_PRELOAD}" ;;
    rusticl) export RUSTICL_ENABLE="${RUSTICL_ENABLE:-llvmpipe}" ;;
    clover)
        export LP_CL=1
        export GALLIUM_PIPE_SEARCH_DIR="$ROOT/mesa/root/usr/lib/x86_64-linux-gnu/gallium-pipe" ;;
    esac
}

[ $# -ge 1 ] || usage
case $1 in
-h | --help) usage ;;
--list)
    for drv in $DRIVERS; do
        if [ -f "$ROOT/$drv/.ready" ]; then
            echo "$drv: installed, $(cat "$ROOT/$drv"/vendors/*.icd)"
        else
            echo "$drv: not installed"
        fi
    done
    exit 0 ;;
esac
drv=$1; shift
case " $DRIVERS " in *" $drv "*) ;; *) die "unknown driver '$drv' (one of: $DRIVERS)" ;; esac
ensure "$drv"
lane_env "$drv"

if [ $# -eq 0 ]; then
    clinfo -l
    exit 0
fi
case $1 in
--env)
    for v in OCL_ICD_VENDORS CLMHA_DRIVER LD_PRELOAD RUSTICL_ENABLE LP_CL \
             GALLIUM_PIPE_SEARCH_DIR; do
        [ -n "${!v:-}" ] && printf 'export %s=%q\n' "$v" "${!v}"
    done
    echo "unset OCL_ICD_FILENAMES CLMHA_DEVICE"
    exit 0 ;;
--) shift ;;
esac
[ $# -ge 1 ] || usage
exec "$@"
