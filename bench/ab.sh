#!/usr/bin/env bash
# Two builds of clmha side by side: runs bench_forward of build A and of build B in turns (A, B,
# A, B, ...) on the same shapes, so that a shared, noisy machine slows both alike, and prints per
# shape the median of each build's medians and the ratio B / A (below 1: B is faster).
#
# usage: bench/ab.sh BUILD_A BUILD_B [ROUNDS] [SHAPE ...]
#   BUILD_A, BUILD_B  build folders holding bench_forward (e.g. an old commit's and this one's)
#   ROUNDS            turns per shape (default 5); each turn is one bench_forward run, itself
#                     the median of 10 timed calls after a warm-up
#   SHAPE             "N L S E H need_weights" (default: three shapes of the README's table)
# example: git worktree add /tmp/old OLD && cmake -S /tmp/old -B /tmp/old/build &&
#          cmake --build /tmp/old/build --target bench_forward && bench/ab.sh /tmp/old/build build
set -euo pipefail
[ $# -ge 2 ] || { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2; }
a="$1/bench_forward" b="$2/bench_forward"
shift 2
rounds=5
if [ $# -gt 0 ] && [[ "$1" =~ ^[0-9]+$ ]]; then rounds="$1"; shift; fi
shapes=("$@")
[ ${#shapes[@]} -gt 0 ] || shapes=("8 128 128 512 8 0" "8 128 128 512 8 1" "1 1024 1024 512 8 0")
for f in "$a" "$b"; do [ -x "$f" ] || { echo "ab.sh: no $f" >&2; exit 2; }; done

median() { sort -g | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
ms_of() {  # BINARY N L S E H WEIGHTS: that run's median in ms
    "$1" "$2" "$3" "$4" "$5" "$6" 10 "$7" | sed -n 's/.*median \([0-9.]*\) ms.*/\1/p'
}
printf '%-24s %12s %12s %8s\n' "N L S E H weights" "A ms" "B ms" "B / A"
for shape in "${shapes[@]}"; do
    read -r n l s e h w <<<"$shape"
    ta=() tb=()
    for ((r = 0; r < rounds; ++r)); do
        ta+=("$(ms_of "$a" "$n" "$l" "$s" "$e" "$h" "${w:-0}")")
        tb+=("$(ms_of "$b" "$n" "$l" "$s" "$e" "$h" "${w:-0}")")
    done
    ma=$(printf '%s\n' "${ta[@]}" | median)
    mb=$(printf '%s\n' "${tb[@]}" | median)
    printf '%-24s %12.3f %12.3f %8.3f\n' "$shape" "$ma" "$mb" "$(awk -v a="$ma" -v b="$mb" 'BEGIN {print b / a}')"
done
