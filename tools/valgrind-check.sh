#!/usr/bin/env bash
# Runs Criterion test executables under valgrind's memcheck and fails on any memory error or
# definite leak that the OpenCL driver suppressions (tests/sanitizers/valgrind.supp) do not cover.
#
# usage: tools/valgrind-check.sh [-B BUILD_DIR] [TEST[:FILTER] ...]
#   BUILD_DIR  a configured and built tree (default: build); not a sanitizer build
#   TEST       a test executable of BUILD_DIR/tests, optionally with a Criterion --filter
#              pattern, e.g. test_faults:'faults/nan*'. Default: test_faults test_concurrency
#              test_backward_errors test_interop test_errors test_device, and the error
#              tests of test_kv_cache and test_partial (the whole suite under valgrind takes
#              hours on PoCL).
#
# environment:
#   POCL_CACHE_DIR         PoCL's kernel cache (default: BUILD_DIR/valgrind-pocl-cache). Under
#                          valgrind PoCL sees a different CPU (valgrind's CPUID), so it needs its
#                          own cache, and compiling the kernels under memcheck is slow enough to
#                          trip the tests' timeouts. So while the cache has no stamp file the
#                          script first runs the tests under valgrind --tool=none (no checking)
#                          to fill it. Keep the folder between CI runs to skip that step.
#   CLMHA_VALGRIND_WARMUP  1: always run the warm-up pass, 0: never (default: when not stamped)
#   CLMHA_VALGRIND_LOGS    folder for the per-process logs (default: BUILD_DIR/valgrind-logs)
#   VALGRIND               the valgrind program (default: valgrind)
#   VALGRIND_EXTRA         more valgrind options
#   CLMHA_TEST_FIRST_CALL_ROUNDS  rounds of test_concurrency's first-call test (default here: 1)
#   CLMHA_VALGRIND_JOBS    test programs run at a time, in the warm-up and under memcheck
#                          (default: the CPU count). Valgrind runs a process's threads one at a
#                          time, so each program keeps about one core busy: on the 2-core CI
#                          machine two at a time took the check from ~20 to ~11 minutes.
#
# How: Criterion runs every test in a child process (re-executed), so valgrind follows children
# (--trace-children=yes) but not the linker and compilers PoCL starts to build kernels. Criterion
# ignores a worker's exit status once its test has passed, so valgrind's --error-exitcode alone
# would miss errors found at a worker's exit (leaks): the script reads every process's log and
# fails when any reports errors.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
build="$root/build"
if [ "${1:-}" = "-B" ]; then
  [ $# -ge 2 ] || { echo "usage: $0 [-B BUILD_DIR] [TEST[:FILTER] ...]" >&2; exit 2; }
  build="$(cd "$2" && pwd)"
  shift 2
fi
case "${1:-}" in -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;; esac

tests=("$@")
if [ ${#tests[@]} -eq 0 ]; then
  # The longest first (3.3, 2.8, 2.1, 1.9 and 1.6 minutes on the 2-core CI machine), as they
  # run $CLMHA_VALGRIND_JOBS at a time.
  tests=(test_faults test_concurrency test_backward_errors test_interop test_errors test_device
         "test_kv_cache:kv_cache/errors" "test_partial:partial/errors")
fi
valgrind="${VALGRIND:-valgrind}"
command -v "$valgrind" >/dev/null || { echo "valgrind-check: $valgrind not found" >&2; exit 2; }
supp="$root/tests/sanitizers/valgrind.supp"
logs="${CLMHA_VALGRIND_LOGS:-$build/valgrind-logs}"
export POCL_CACHE_DIR="${POCL_CACHE_DIR:-$build/valgrind-pocl-cache}"
# test_concurrency's first-call stress test forks a fresh process per round: under memcheck one
# round per mode looks for memory errors; the race itself is hunted by the release, ASan and TSan
# runs with more rounds.
export CLMHA_TEST_FIRST_CALL_ROUNDS="${CLMHA_TEST_FIRST_CALL_ROUNDS:-1}"
jobs="${CLMHA_VALGRIND_JOBS:-$(nproc 2>/dev/null || echo 1)}"
case "$jobs" in
  ''|*[!0-9]*|0) echo "valgrind-check: CLMHA_VALGRIND_JOBS must be a positive number" >&2; exit 2 ;;
esac
mkdir -p "$POCL_CACHE_DIR"
rm -rf "$logs"
mkdir -p "$logs"
# Runs its arguments in the background, first waiting while $jobs of them run.
spawn() {
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
  "$@" &
}

# shellcheck disable=SC2206
extra=(${VALGRIND_EXTRA:-})
vg_opts=(
  --tool=memcheck
  --trace-children=yes
  "--trace-children-skip=*/ld,*/ld.*,*/ld.lld*,*/clang*,*/collect2,*/cc1*,*/gcc*,*/cc"
  --child-silent-after-fork=yes
  --leak-check=full
  --show-leak-kinds=definite
  --errors-for-leak-kinds=definite
  --error-exitcode=1
  --num-callers=40
  "--suppressions=$supp"
  "${extra[@]}"
)

# Warm-up: fill PoCL's kernel cache as seen under valgrind, without checking anything.
stamp="$POCL_CACHE_DIR/.clmha-valgrind-warm"
warmup="${CLMHA_VALGRIND_WARMUP:-}"
[ -z "$warmup" ] && { [ -e "$stamp" ] && warmup=0 || warmup=1; }
if [ "$warmup" = 1 ]; then
  echo "valgrind-check: warming PoCL's kernel cache under valgrind --tool=none ($POCL_CACHE_DIR)"
  start=$(date +%s)
  warm_one() {  # SPEC
    local name="${1%%:*}" args=(--jobs 1)
    [ "$name" != "$1" ] && args+=(--filter "${1#*:}")
    (cd "$build/tests" && "$valgrind" --tool=none -q --trace-children=yes \
       "--trace-children-skip=*/ld,*/ld.*,*/ld.lld*,*/clang*,*/collect2,*/cc1*,*/gcc*,*/cc" \
       "$build/tests/$name" "${args[@]}") >"$logs/warmup-$name.txt" 2>&1 || true
  }
  for spec in "${tests[@]}"; do
    [ -x "$build/tests/${spec%%:*}" ] && spawn warm_one "$spec"
  done
  wait
  touch "$stamp"
  echo "valgrind-check: warm-up took $(( $(date +%s) - start )) s"
fi

# Runs one test program under memcheck; its exit status and seconds go to files in its log
# folder, which the report below reads.
check_one() {  # SPEC DIR
  local name="${1%%:*}" dir="$2" args=(--jobs 1 --verbose) start code
  [ "$name" != "$1" ] && args+=(--filter "${1#*:}")
  start=$(date +%s)
  set +e
  (cd "$build/tests" && "$valgrind" "${vg_opts[@]}" "--log-file=$dir/vg.%p.log" \
     "$build/tests/$name" "${args[@]}") >"$dir/output.txt" 2>&1
  code=$?
  set -e
  echo "$(( $(date +%s) - start ))" >"$dir/seconds"
  echo "$code" >"$dir/exit"
}
status=0
for spec in "${tests[@]}"; do
  name="${spec%%:*}"
  mkdir -p "$logs/$name"
  [ -x "$build/tests/$name" ] && spawn check_one "$spec" "$logs/$name"
done
wait
printf '%-18s %-6s %6s %7s %14s %8s\n' test exit procs errors "definite(B)" seconds
for spec in "${tests[@]}"; do
  name="${spec%%:*}"
  exe="$build/tests/$name"
  if [ ! -x "$exe" ]; then
    echo "valgrind-check: $exe not found (build the tests first)" >&2
    status=1
    continue
  fi
  dir="$logs/$name"
  code=$(cat "$dir/exit" 2>/dev/null || echo 255)
  seconds=$(cat "$dir/seconds" 2>/dev/null || echo 0)
  procs=0
  errors=0
  definite=0
  bad_logs=()
  for log in "$dir"/vg.*.log; do
    [ -s "$log" ] || continue
    grep -q "Command:" "$log" || continue
    procs=$((procs + 1))
    n=$(sed -n 's/.*ERROR SUMMARY: \([0-9,]*\) errors.*/\1/p' "$log" | tr -d , | tail -1)
    if [ -z "$n" ]; then
      echo "valgrind-check: $log has no ERROR SUMMARY (process killed?)" >&2
      bad_logs+=("$log")
      continue
    fi
    d=$(sed -n 's/.*definitely lost: \([0-9,]*\) bytes.*/\1/p' "$log" | tr -d , | tail -1)
    definite=$((definite + ${d:-0}))
    if [ "$n" -gt 0 ]; then
      errors=$((errors + n))
      bad_logs+=("$log")
    fi
  done
  printf '%-18s %-6s %6d %7d %14d %8d\n' "$name" "$code" "$procs" "$errors" "$definite" "$seconds"
  if [ "$code" -ne 0 ] || [ ${#bad_logs[@]} -gt 0 ]; then
    status=1
    [ "$code" -ne 0 ] && { echo "--- $name exited with $code:"; tail -n 40 "$dir/output.txt"; }
    for log in "${bad_logs[@]}"; do
      echo "--- $log:"
      # The error records only (not the heap and leak summaries).
      awk '/^==[0-9]+== (Invalid|Conditional|Use of|Syscall|Mismatched|Source and|Argument|[0-9,]+ (\([0-9, a-z]+\) )?bytes in [0-9,]+ blocks are definitely)/ {p=1}
           p && /^==[0-9]+== $/ {p=0; print ""}
           p {print}' "$log" | head -n 200
    done
  fi
done
echo "logs: $logs  (PoCL cache: $POCL_CACHE_DIR)"
if [ "$status" -eq 0 ]; then
  echo "valgrind-check: PASS"
else
  echo "valgrind-check: FAIL"
fi
exit "$status"
