#!/usr/bin/env bash
# CLBlast's generic parameters, the device's built-in set and its stored tuning, side by side:
# runs `clmha bench` once per parameter source in turns (default, built-in, tuned, default, ...)
# on the same shapes, so that a shared, noisy machine slows all alike, and prints per shape the
# median of each source's medians and the ratios built-in/tuned and default/tuned (time ratios:
# above 1 is slower than tuned).
#
# usage: bench/builtin_ratio.sh TUNING_DIR [ROUNDS] [SHAPE ...]
#   TUNING_DIR  the folder holding the device's tuning file (`clmha tune` writes it:
#               $CLMHA_TUNING_DIR, else ~/.cache/clmha)
#   ROUNDS      turns per shape (default 5); each turn is one `clmha bench` run per source,
#               itself the median of 10 timed forwards after a warm-up
#   SHAPE       "N L" (E 512, H 8, self-attention; default: "8 128" "1 2048")
# The sources: CLMHA_TUNING=off (CLBlast's own parameters), CLMHA_TUNING=builtin (the device
# class's built-in set; the stored file is not read), and the stored tuning in TUNING_DIR.
# $CLMHA_BIN is the clmha program (default build/clmha). Prefix with
# `tools/ocl-driver.sh DRIVER --` to run on another driver.
set -euo pipefail
[ $# -ge 1 ] || { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2; }
dir="$1"
shift
rounds=5
if [ $# -gt 0 ] && [[ "$1" =~ ^[0-9]+$ ]]; then rounds="$1"; shift; fi
shapes=("$@")
[ ${#shapes[@]} -gt 0 ] || shapes=("8 128" "1 2048")
bin="${CLMHA_BIN:-build/clmha}"
[ -x "$bin" ] || { echo "builtin_ratio.sh: no $bin" >&2; exit 2; }

median() { sort -g | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
ms_of() {  # TUNING N L: that run's median in ms
    CLMHA_TUNING_DIR="$dir" CLMHA_TUNING="$1" "$bin" bench --batch "$2" --tgt-len "$3" \
        | sed -n 's/^time: *\([0-9.]*\) ms.*/\1/p'
}
"$bin" bench --batch 1 --tgt-len 16 --repeat 1 | sed -n 's/^device: */device:  /p'
for t in off builtin on; do
    printf '%-8s %s\n' "$t:" "$(CLMHA_TUNING_DIR="$dir" CLMHA_TUNING="$t" "$bin" bench --batch 1 \
        --tgt-len 16 --repeat 1 | sed -n 's/^tuning: *//p')"
done
printf '%-10s %12s %12s %12s %14s %14s\n' "N L" "default ms" "built-in ms" "tuned ms" \
    "built-in/tuned" "default/tuned"
for shape in "${shapes[@]}"; do
    read -r n l <<<"$shape"
    td=() tb=() tt=()
    for ((r = 0; r < rounds; ++r)); do
        td+=("$(ms_of off "$n" "$l")")
        tb+=("$(ms_of builtin "$n" "$l")")
        tt+=("$(ms_of on "$n" "$l")")
    done
    md=$(printf '%s\n' "${td[@]}" | median)
    mb=$(printf '%s\n' "${tb[@]}" | median)
    mt=$(printf '%s\n' "${tt[@]}" | median)
    printf '%-10s %12.2f %12.2f %12.2f %14.3f %14.3f\n' "$shape" "$md" "$mb" "$mt" \
        "$(awk -v a="$mb" -v b="$mt" 'BEGIN {print a / b}')" \
        "$(awk -v a="$md" -v b="$mt" 'BEGIN {print a / b}')"
done
