#!/usr/bin/env bash
# Builds clmha's libFuzzer harnesses (clang, ASan + UBSan) in build-fuzz/ and runs each for
# SECONDS (default 60), one after the other, starting from a copy of its seed corpus
# fuzz/corpus/<harness>/ plus the reproducers in tests/fuzz_regressions/<harness>/. Every
# crash-*, leak-*, timeout-* and oom-* file a run leaves is copied to
# tests/fuzz_regressions/<harness>/, where tests/unit/test_fuzz_regressions.c replays it.
#
#   tools/fuzz.sh [SECONDS] [HARNESS...]     HARNESS: safetensors, npy, forward_args,
#                                            backward_args, kv_ops, variants (default all)
#
# backward_args, kv_ops and variants run on the OpenCL device (clmha_context_create_from_env:
# CLMHA_DEVICE picks it); their leak checks skip the driver stack's own allocations
# (tests/sanitizers/lsan.supp, with full stacks so that the suppressions match).
#
# SECONDS 0 only replays the seeds and reproducers once through the sanitized harnesses (the
# Criterion test replays them too, but without ASan and UBSan).
#
# Environment: CLMHA_FUZZ_BUILD (build folder, default build-fuzz), CLMHA_FUZZ_JOBS (parallel
# build jobs), CLMHA_FUZZ_KEEP=1 (keep the work folder with the grown corpora and logs),
# FUZZ_ARGS (extra libFuzzer flags). Exit status: 0 when no run found anything, 1 otherwise,
# 2 on a usage or build error.
set -euo pipefail

usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; }

seconds=60
if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then
  seconds=$1
  shift
elif [[ $# -gt 0 && ( $1 == -h || $1 == --help ) ]]; then
  usage
  exit 0
fi
all=(safetensors npy forward_args backward_args kv_ops variants)
device_harnesses=" backward_args kv_ops variants "
harnesses=("$@")
[[ ${#harnesses[@]} -eq 0 ]] && harnesses=("${all[@]}")
for h in "${harnesses[@]}"; do
  case $h in
  safetensors | npy | forward_args | backward_args | kv_ops | variants) ;;
  *) echo "fuzz.sh: unknown harness '$h' (${all[*]})" >&2; exit 2 ;;
  esac
done

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${CLMHA_FUZZ_BUILD:-$root/build-fuzz}
jobs=${CLMHA_FUZZ_JOBS:-$(nproc 2>/dev/null || echo 2)}

command -v clang >/dev/null || { echo "fuzz.sh: clang not found" >&2; exit 2; }
echo "== building the harnesses in $build"
mkdir -p "$build"
cmake -S "$root" -B "$build" -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCLMHA_FUZZ=ON -DCLMHA_BUILD_TESTS=OFF >"$build/configure.log" 2>&1 ||
  { cat "$build/configure.log" >&2; echo "fuzz.sh: configuring failed" >&2; exit 2; }
targets=()
for h in "${harnesses[@]}"; do targets+=("fuzz_$h"); done
cmake --build "$build" --parallel "$jobs" --target "${targets[@]}" >/dev/null ||
  { echo "fuzz.sh: building failed (rerun: cmake --build $build --target ${targets[*]})" >&2; exit 2; }

work=$(mktemp -d "${TMPDIR:-/tmp}/clmha-fuzz.XXXXXX")
if [[ ${CLMHA_FUZZ_KEEP:-0} == 1 ]]; then
  echo "== work folder (kept): $work"
else
  trap 'rm -rf "$work"' EXIT
fi

# Every sanitizer report ends the run and leaves a reproducer.
export ASAN_OPTIONS="detect_leaks=1:allocator_may_return_null=1:${ASAN_OPTIONS:-}"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:${UBSAN_OPTIONS:-}"
host_asan=$ASAN_OPTIONS
host_lsan=${LSAN_OPTIONS:-}
# The options of harness $1's run: a device harness's leak check skips the driver stack
# (uninstrumented C++ whose stacks the fast unwinder cuts short).
sanitizer_env() {
  if [[ $device_harnesses == *" $1 "* ]]; then
    export ASAN_OPTIONS="$host_asan:fast_unwind_on_malloc=0"
    LSAN_OPTIONS="suppressions=$root/tests/sanitizers/lsan.supp:print_suppressions=0"
    export LSAN_OPTIONS="$LSAN_OPTIONS:use_tls=0:$host_lsan"
  else
    export ASAN_OPTIONS=$host_asan LSAN_OPTIONS=$host_lsan
  fi
}

found=0
summary=()

if [[ $seconds -eq 0 ]]; then
  for h in "${harnesses[@]}"; do
    inputs=("$root/fuzz/corpus/$h/"*)
    regressions=$root/tests/fuzz_regressions/$h
    if [[ -d $regressions ]] && compgen -G "$regressions/*" >/dev/null; then
      inputs+=("$regressions/"*)
    fi
    log=$work/$h.replay.log
    sanitizer_env "$h"
    set +e
    "$build/fuzz/fuzz_$h" "${inputs[@]}" >"$log" 2>&1
    rc=$?
    set -e
    line="fuzz_$h: replayed ${#inputs[@]} inputs: "
    if [[ $rc -eq 0 ]]; then
      line+="ok"
    else
      found=1
      line+="FAILED (exit $rc) on $(sed -n 's/^Running: //p' "$log" | tail -n 1)"
      grep -m 1 -E 'ERROR: (Address|Undefined|Leak)Sanitizer|runtime error|fuzz invariant failed|deadly signal' "$log" || true
    fi
    echo "$line"
    summary+=("$line")
  done
  echo "== summary"
  printf '%s\n' "${summary[@]}"
  exit "$found"
fi

declare -A max_len=([safetensors]=8192 [npy]=4096 [forward_args]=256 [backward_args]=64
  [kv_ops]=128 [variants]=64)
# Seconds one input may take: a device harness's first call of a new kernel configuration waits
# for the driver to compile it (PoCL: several seconds under load, more with two jobs on two
# cores), which is not a hang.
declare -A unit_timeout=([backward_args]=120 [kv_ops]=120 [variants]=120)
for h in "${harnesses[@]}"; do
  corpus=$work/$h/corpus
  artifacts=$work/$h/artifacts
  mkdir -p "$corpus" "$artifacts"
  cp "$root/fuzz/corpus/$h/"* "$corpus/"
  regressions=$root/tests/fuzz_regressions/$h
  if [[ -d $regressions ]] && compgen -G "$regressions/*" >/dev/null; then
    cp "$regressions/"* "$corpus/"
  fi
  dict=()
  [[ -f $root/fuzz/dict/$h.dict ]] && dict=(-dict="$root/fuzz/dict/$h.dict")
  log=$work/$h/fuzz.log
  sanitizer_env "$h"
  echo "== fuzz_$h for ${seconds}s (log: $log)"
  start=$SECONDS
  set +e
  # shellcheck disable=SC2086
  "$build/fuzz/fuzz_$h" "$corpus" -max_total_time="$seconds" -max_len="${max_len[$h]}" \
    -timeout="${unit_timeout[$h]:-10}" -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="$artifacts/" \
    "${dict[@]}" ${FUZZ_ARGS:-} >"$log" 2>&1
  rc=$?
  set -e
  took=$((SECONDS - start))
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
  speed=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -n 1)
  cov=$(grep -oE 'cov: [0-9]+ ft: [0-9]+ corp: [0-9]+/[0-9]+[a-zA-Z]*' "$log" | tail -n 1 || true)
  new=()
  for f in "$artifacts"/crash-* "$artifacts"/leak-* "$artifacts"/timeout-* "$artifacts"/oom-*; do
    [[ -e $f ]] || continue
    mkdir -p "$regressions"
    cp "$f" "$regressions/"
    new+=("tests/fuzz_regressions/$h/$(basename "$f")")
  done
  line="fuzz_$h: ${execs:-?} executions in ${took}s, ${speed:-?} exec/s, ${cov:-no coverage line}"
  if [[ ${#new[@]} -gt 0 || $rc -ne 0 ]]; then
    found=1
    line+=", exit $rc"
    [[ ${#new[@]} -gt 0 ]] && line+=", reproducers: ${new[*]}"
    grep -m 1 -E 'ERROR: (Address|Undefined|Leak)Sanitizer|runtime error|fuzz invariant failed|deadly signal|timeout|out-of-memory' "$log" || true
  fi
  echo "$line"
  summary+=("$line")
done

echo "== summary"
printf '%s\n' "${summary[@]}"
exit "$found"
