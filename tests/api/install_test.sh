#!/usr/bin/env bash
# Installs a built clmha into a temporary prefix and builds and runs a small consumer against it:
#   1. CMake:      find_package(clmha) + clmha::clmha (shared) and clmha::clmha_static
#   2. pkg-config: cc main.c $(pkg-config --cflags --libs clmha), and the static library with
#                  pkg-config --static
# and checks the installed `clmha` program runs from the prefix.
#
# Usage: tests/api/install_test.sh <build dir> <source dir>
# Exit status: 0 pass, 77 no OpenCL device (the consumers built but could not run), else failure.
# Environment: CC (default cc), CMAKE_GENERATOR (passed through to cmake), KEEP=1 keeps the
# temporary folder.
set -euo pipefail

if [ $# -ne 2 ]; then
    echo "usage: $0 <build dir> <source dir>" >&2
    exit 2
fi
build=$(cd "$1" && pwd)
src=$(cd "$2" && pwd)
cc=${CC:-cc}
work=$(mktemp -d "${TMPDIR:-/tmp}/clmha-install-test.XXXXXX")
if [ "${KEEP:-0}" = 1 ]; then
    echo "keeping $work"
else
    trap 'rm -rf "$work"' EXIT
fi
prefix=$work/prefix
skipped=0

step() { printf '\n== %s\n' "$*"; }
fail() {
    echo "FAIL: $*" >&2
    exit 1
}
# Runs a consumer; 77 (no device) is remembered, any other failure ends the test.
run_consumer() {
    local rc=0
    "$@" || rc=$?
    if [ $rc -eq 77 ]; then
        skipped=1
    elif [ $rc -ne 0 ]; then
        fail "$* exited with $rc"
    fi
}

step "install $build into $prefix"
cmake --install "$build" --prefix "$prefix"

# GNUInstallDirs picks lib, lib64 or lib/<multiarch> depending on the configured prefix.
shared_lib=$(find "$prefix" -name 'libclmha.so' -print -quit)
[ -n "$shared_lib" ] || fail "no libclmha.so under $prefix"
libdir=$(dirname "$shared_lib")
for f in "$libdir/libclmha.a" "$prefix/include/clmha.h" "$prefix/include/clmha_version.h" \
    "$prefix/share/doc/clmha/LICENSE" "$prefix/bin/clmha" "$libdir/cmake/clmha/clmhaConfig.cmake" \
    "$libdir/cmake/clmha/clmhaConfigVersion.cmake" "$libdir/pkgconfig/clmha.pc"; do
    [ -e "$f" ] || fail "$f was not installed"
done
version=$(sed -n 's/^#define CLMHA_VERSION_STRING "\(.*\)"$/\1/p' "$prefix/include/clmha_version.h")
[ -n "$version" ] || fail "no CLMHA_VERSION_STRING in the installed clmha_version.h"
major=${version%%.*}
minor=${version#*.}
minor=${minor%%.*}

step "soname (docs/abi.md: MAJOR.MINOR before 1.0, then MAJOR)"
if [ "$major" -eq 0 ]; then soversion=$major.$minor; else soversion=$major; fi
want_soname=libclmha.so.$soversion
[ -e "$libdir/$want_soname" ] || fail "$libdir/$want_soname was not installed"
if command -v readelf >/dev/null 2>&1; then
    soname=$(readelf -d "$shared_lib" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
    [ "$soname" = "$want_soname" ] || fail "SONAME is '$soname', expected '$want_soname'"
    echo "SONAME $soname"
else
    echo "no readelf: only the file $want_soname was checked"
fi

step "installed program"
# libclmha found through its RPATH ($ORIGIN/../lib...), not the build tree: LD_LIBRARY_PATH
# keeps only what points outside the build tree (where a machine without packages keeps CLBlast
# and cJSON, as .gpu/gpu-check on a GPU host does).
lib_path=$(printf '%s' "${LD_LIBRARY_PATH:-}" | tr ':' '\n' | grep -v -e '^$' -e "^$build" | paste -sd: || true)
if command -v ldd >/dev/null; then
    where=$(LD_LIBRARY_PATH="$lib_path" ldd "$prefix/bin/clmha" | awk '/libclmha/ {print $3}')
    case $where in "$prefix"/*) ;; *) fail "the installed clmha loads libclmha from '$where'" ;; esac
fi
out=$(LD_LIBRARY_PATH="$lib_path" "$prefix/bin/clmha" --version)
echo "$out"
[ "$out" = "clmha $version" ] || fail "clmha --version printed '$out', expected 'clmha $version'"

step "CMake consumer: find_package(clmha $version)"
cmake -S "$src/tests/api/install_consumer" -B "$work/cmake-build" \
    -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release \
    -DCLMHA_REQUEST_VERSION="$version" -DCMAKE_C_COMPILER="$cc"
cmake --build "$work/cmake-build"
# Nothing of the build or source tree may leak into the consumer's build.
if grep -rl -e "$build/" -e "$src/include" "$work/cmake-build/CMakeFiles" >/dev/null 2>&1; then
    fail "the consumer's build refers to clmha's build or source tree"
fi
run_consumer "$work/cmake-build/consumer_shared"
run_consumer "$work/cmake-build/consumer_static"
if ldd "$work/cmake-build/consumer_static" | grep -q libclmha; then
    fail "consumer_static is linked to libclmha.so"
fi

step "CMake consumer: an incompatible major version is refused"
if cmake -S "$src/tests/api/install_consumer" -B "$work/cmake-build-major" \
    -DCMAKE_PREFIX_PATH="$prefix" -DCLMHA_REQUEST_VERSION="$((major + 1)).0" \
    -DCMAKE_C_COMPILER="$cc" >"$work/major.log" 2>&1; then
    fail "find_package(clmha $((major + 1)).0) accepted version $version"
fi
echo "refused, as it should be"
if [ "$major" -eq 0 ] && [ "$minor" -gt 0 ]; then
    # Before 1.0 a minor release may break the ABI: a program asking for 0.(minor-1) must not
    # get this library (SameMajorVersion would accept it, SameMinorVersion does not).
    step "CMake consumer: before 1.0 an older minor version is refused too"
    if cmake -S "$src/tests/api/install_consumer" -B "$work/cmake-build-minor" \
        -DCMAKE_PREFIX_PATH="$prefix" -DCLMHA_REQUEST_VERSION="0.$((minor - 1))" \
        -DCMAKE_C_COMPILER="$cc" >"$work/minor.log" 2>&1; then
        fail "find_package(clmha 0.$((minor - 1))) accepted version $version"
    fi
    echo "refused, as it should be"
fi

step "pkg-config consumer"
# The prefix first; the caller's path after it, where a machine without packages keeps CLBlast's
# and cJSON's .pc files (as .gpu/gpu-check on a GPU host does).
export PKG_CONFIG_PATH="$libdir/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
# A sysroot for those (PKG_CONFIG_SYSROOT_DIR) would be put in front of the prefix too.
unset PKG_CONFIG_SYSROOT_DIR
pkg-config --exists --print-errors clmha
[ "$(pkg-config --modversion clmha)" = "$version" ] || fail "pkg-config --modversion clmha"
cflags=$(pkg-config --cflags clmha)
libs=$(pkg-config --libs clmha)
echo "cflags: $cflags"
echo "libs:   $libs"
# shellcheck disable=SC2086  # word splitting of the flags is intended
"$cc" -std=c11 -Wall -Wextra -Wpedantic -Werror "$src/tests/api/install_consumer/main.c" \
    -o "$work/pc_shared" $cflags $libs -lm
LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" run_consumer "$work/pc_shared"

step "pkg-config consumer, static library (pkg-config --static)"
static_libs=$(pkg-config --static --libs clmha)
echo "libs:   $static_libs"
# -lclmha would pick libclmha.so; name the archive instead, keeping the other flags.
static_libs=$(printf '%s\n' "$static_libs" | sed "s|-lclmha\b|$libdir/libclmha.a|")
static_cflags=$(pkg-config --static --cflags clmha)  # with Cflags.private: -DCLMHA_STATIC
echo "cflags: $static_cflags"
# shellcheck disable=SC2086
"$cc" -std=c11 "$src/tests/api/install_consumer/main.c" -o "$work/pc_static" $static_cflags \
    -DCLMHA_EXPECT_STATIC $static_libs -lm
if ldd "$work/pc_static" | grep -q libclmha; then
    fail "pc_static is linked to libclmha.so"
fi
run_consumer "$work/pc_static"

if [ $skipped -eq 1 ]; then
    echo "install test: everything built; the consumers were skipped (no OpenCL device)"
    exit 77
fi
echo "install test: PASS"
