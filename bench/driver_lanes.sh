#!/usr/bin/env bash
# Per OpenCL driver: the golden cases' max error against PyTorch and the forward time at the two
# shapes the README reports (E 512, H 8: N 8, L = S = 128 and N 1, L = S = 2048), each driver
# alone in its lane (tools/ocl-driver.sh). Prints one Markdown table row per driver.
#
#   bench/driver_lanes.sh [-B build] [--repeat R] [--long-repeat R2] [--long-timeout SEC] [DRIVER...]
#
# Default drivers: pocl intel rusticl clover pocl-pypi. Times are medians of R runs (default 5;
# R2 at L 2048, default 3)
# from `clmha bench` (device buffers, no host copies), with CLBlast's stored tuning where the
# device has one (`clmha tune`), else its defaults. A shape that does not finish within the
# long timeout (default 600 s; Mesa's llvmpipe needs ~70 s per forward at L 2048) is reported as
# "> timeout". The errors come from test_golden's per-case lines (max over the 57 cases of
# |output - PyTorch|, both attention cores).
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=build
REPEAT=5
LONG_REPEAT=3
LONG_TIMEOUT=600
DRIVERS=()
while [ $# -gt 0 ]; do
    case "$1" in
        -B) BUILD="$2"; shift 2 ;;
        --repeat) REPEAT="$2"; shift 2 ;;
        --long-repeat) LONG_REPEAT="$2"; shift 2 ;;
        --long-timeout) LONG_TIMEOUT="$2"; shift 2 ;;
        -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) DRIVERS+=("$1"); shift ;;
    esac
done
[ ${#DRIVERS[@]} -gt 0 ] || DRIVERS=(pocl intel rusticl clover pocl-pypi)
[ -x "$BUILD/clmha" ] && [ -x "$BUILD/tests/test_golden" ] ||
    { echo "driver_lanes: build first ($BUILD/clmha, $BUILD/tests/test_golden)" >&2; exit 2; }

# Median ms of one shape, or a reason.
bench_ms() {  # DRIVER TIMEOUT REPEAT ARGS...
    local drv=$1 t=$2 r=$3
    shift 3
    local out
    out=$(timeout "$t" tools/ocl-driver.sh "$drv" -- "$BUILD/clmha" bench --json --repeat "$r" \
          "$@" 2>/dev/null) || { [ $? -eq 124 ] && echo "> ${t} s" || echo "failed"; return; }
    /usr/bin/python3 -c 'import json,sys; print("%.1f" % json.loads(sys.stdin.read())["ms"])' \
        <<<"$out" 2>/dev/null || echo "failed"
}

echo "| driver | device | test_golden | max error vs PyTorch | N 8, L 128 (ms) | N 1, L 2048 (ms) |"
echo "|---|---|---|---|---|---|"
for d in "${DRIVERS[@]}"; do
    dev=$(tools/ocl-driver.sh "$d" -- "$BUILD/clmha" devices 2>/dev/null | sed -n 's/^\[0:0\] //p' | head -1)
    golden=$(timeout 3600 tools/ocl-driver.sh "$d" -- "$BUILD/tests/test_golden" --verbose 2>&1)
    summary=$(grep -o 'Tested: [0-9]* | Passing: [0-9]*' <<<"$golden" | tail -1 |
              sed 's/Tested: \([0-9]*\) | Passing: \([0-9]*\)/\2 of \1 tests pass/')
    maxerr=$(grep -o 'out_maxabs=[0-9.e+-]*\|fused=[0-9.e+-]*\|unfused=[0-9.e+-]*' <<<"$golden" |
             cut -d= -f2 | sort -g | tail -1)
    cases=$(grep -c '^golden ' <<<"$golden")
    short=$(bench_ms "$d" 600 "$REPEAT" --batch 8 --tgt-len 128)
    long=$(bench_ms "$d" "$LONG_TIMEOUT" "$LONG_REPEAT" --batch 1 --tgt-len 2048)
    echo "| $d | ${dev:-?} | ${summary:-no result}, $cases cases | ${maxerr:-?} | $short | $long |"
done
