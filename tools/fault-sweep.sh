#!/usr/bin/env bash
# The whole fault sweep (tests/faults/): every injection point of every scenario, for each kind
# of call (OpenCL calls, allocations, file calls, the GEMM libraries' calls through the host
# BLAS and through CLBlast), the `clmha run` program included. Prints each kind's table; exit
# status 0 when every run passed, 1 otherwise, 2 when the build lacks the sweep.
#
#   tools/fault-sweep.sh [BUILD-DIR] [KIND...]     KIND: cl alloc io blas clblast (default all)
#
# BUILD-DIR (default build) is a CMake build with tests and without sanitizers. The OpenCL
# sweep takes the longest (~11000 points, a process each: ~90 minutes on 2 cores, 60 of them
# the tuning scenario's 8000).
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
shift || true
kinds=("$@")
[ ${#kinds[@]} -eq 0 ] && kinds=(cl alloc io blas clblast)
sweep=$build/tests/fault_sweep inject=$build/tests/libclmha_faults.so program=$build/clmha
for f in "$sweep" "$inject" "$program"; do
    if [ ! -e "$f" ]; then
        echo "fault-sweep: $f is missing (build the tests without sanitizers first)" >&2
        exit 2
    fi
done
status=0
for kind in "${kinds[@]}"; do
    case $kind in
        cl | alloc | io | blas) env=() arg=$kind ;;
        clblast) env=(CLMHA_GEMM=clblast) arg=blas ;;
        *) echo "fault-sweep: unknown kind '$kind' (cl, alloc, io, blas, clblast)" >&2; exit 2 ;;
    esac
    echo "== $kind"
    env "${env[@]}" "$sweep" "$inject" --kind "$arg" --program "$program" \
        --case tests/cli/grad_self || status=1
done
exit $status
