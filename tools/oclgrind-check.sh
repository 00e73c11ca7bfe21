#!/usr/bin/env bash
# Runs every OpenCL kernel clmha launches (cl/*.cl, cl/cores/*.cl, and the CLBlast GEMMs it
# calls) under Oclgrind, the OpenCL device simulator, on the small cases of
# tests/sanitizers/oclgrind_driver.c, and fails when Oclgrind reports anything or a case gives a
# wrong result.
#
# Usage: tools/oclgrind-check.sh [DRIVER]      (default: build/oclgrind_driver)
# Builds nothing: build the driver first (cmake --build build --target oclgrind_driver).
# Needs `oclgrind` (Debian/Ubuntu package oclgrind, tested with 21.10) and perl. The two
# configurations took 17 min one after the other on a shared 2-core machine (9 min of CPU),
# mostly pass 2; they now run side by side. OCLGRIND_CHECK_MAX_ERRORS (default 20): messages
# Oclgrind reports per process.
# Anything Oclgrind logs, a driver exit status other than 0 (a wrong result) or output on the
# driver's stderr fails the check.
#
# Two configurations, each checked by the two passes below (and the cpu one's pass 1 once more
# with the fused core's lanes mapping, the "cpu-pocl" row forced: ~75 s):
#   cpu  Oclgrind's own device as clmha detects it (a CPU-type device: the "cpu" row of the
#        device class table, src/device/device_class.c): split/merge one work-item per tile
#        row, the fused kernel's query rows and accumulators private, Oclgrind's limits (work-groups of
#        1024, 32 KiB of local memory);
#   gpu  a GPU-like device: Oclgrind limited to work-groups of 256 and 48 KiB of local memory
#        (--max-wgsize, --local-mem-size), and the driver forcing the "gpu" row (--class gpu):
#        split/merge coalesced (3-D, one work-item per float), the fused kernel's query rows in
#        padded local memory with coalesced loads and stores, its accumulators in local memory
#        where the private budget (128 floats) is too small (head_dim 128), masked_softmax over
#        256 work-items.
#
# Two passes:
#
# 1. All cases in one process, kernels compiled as clmha builds them (optimised), with
#      checks always on in Oclgrind: out-of-bounds reads and writes (global, local, private,
#        constant), reads of write-only and writes to read-only buffers, invalid and misaligned
#        accesses, work-group divergence at barriers;
#      --data-races --uniform-writes: data races on global and local memory, within a work-group
#        and between work-groups, including those where every work-item writes the same value;
#      --check-api: errors returned by the OpenCL calls.
#
# 2. --uninitialized: reads of uninitialised memory (private, local, global) flowing into stores,
#    branches or addresses, plus the checks of pass 1. Oclgrind 21.10's plugin has limits that
#    shape this pass:
#      - it aborts with "Unsupported instruction: freeze" on the LLVM `freeze` that the optimiser
#        emits for our 64-bit div/rem pairs, so the kernels are built with -cl-opt-disable here
#        (Oclgrind's --build-options, appended to every program's options, CLBlast's included);
#      - a buffer released and a new one given the same buffer number keeps the old buffer's
#        shadow size, so kernel writes past it are forgotten and later reads reported as
#        uninitialised: every case therefore runs in a process of its own;
#      - a host write at an offset (clEnqueueWriteBuffer into part of a buffer) re-creates the
#        whole buffer's shadow, sized to that write: the layers whose parameters are written as
#        slices of one buffer (q/k/v_proj_weight when kdim or vdim != embed_dim, bias_k/bias_v of
#        add_bias_kv) would give false reports, so this pass runs only the driver's
#        --whole-writes cases. Those layers still run under every check of pass 1.
#
# The script also checks that every kernel defined in cl/*.cl and cl/cores/*.cl ran at least
# once (Oclgrind's --inst-counts names each kernel invocation). Exit status: 0 when clean, 1 on any report, wrong
# result or kernel not reached, 2 on a usage or setup problem.
set -u

here=$(cd "$(dirname "$0")" && pwd)
cl_dir="$here/../cl"
driver=${1:-build/oclgrind_driver}
max_errors=${OCLGRIND_CHECK_MAX_ERRORS:-20}  # per process; the count shown is then a minimum

if ! command -v oclgrind >/dev/null 2>&1; then
    echo "oclgrind-check: oclgrind not found (apt-get install oclgrind)" >&2
    exit 2
fi
if [ ! -x "$driver" ]; then
    echo "oclgrind-check: no driver at $driver (build the oclgrind_driver target first)" >&2
    exit 2
fi
case "$driver" in */*) ;; *) driver=./$driver ;; esac

tmp=$(mktemp -d "${TMPDIR:-/tmp}/oclgrind-check.XXXXXX") || exit 2
trap 'rm -rf "$tmp"' EXIT
unset CLMHA_DEVICE  # under Oclgrind its simulator is the only device
start=$(date +%s.%N)
status=0

# Oclgrind's log: each message is a block of lines that follows an empty line; its first lines
# are not indented (the message), the rest start with a tab (kernel, work-item, instruction,
# source line; lines holding only a tab stay inside the block).

# Number of messages in an Oclgrind log, not counting the notice "Oclgrind: N errors generated -
# suppressing further errors".
count_messages() {
    awk 'BEGIN { n = 0; start = 1 }
         $0 == "" { start = 1; next }
         { if (start && $0 !~ /^Oclgrind: [0-9]+ errors generated/) n++; start = 0 }
         END { print n }' "$1"
}

# One line per kind of message in an Oclgrind log, with its count: the message (addresses
# elided), the kernel, and the source lines it points at (line numbers of input.cl are those of
# the program source: cl/*.cl, cl/cores/*.cl for clmha's kernels).
digest() {
    awk 'function flush() {
             if (hdr != "") {
                 key = hdr
                 if (kern != "") key = key "  [kernel " kern "]"
                 if (where != "") key = key where
                 if (!(key in cnt)) keys[++nk] = key
                 cnt[key]++
             }
             hdr = ""; kern = ""; where = ""; want = 0
         }
         $0 == "" { flush(); next }
         { line = $0; gsub(/^[[:space:]]+|[[:space:]]+$/, "", line) }
         $0 !~ /^[[:space:]]/ {
             gsub(/0x[0-9a-fA-F]+/, "0x...", line)
             hdr = hdr == "" ? line : hdr " " line
             next
         }
         want { where = where " " line; want = 0; next }
         line ~ /^Kernel: / { kern = substr(line, 9); next }
         line ~ /^At line / {
             sub(/ of input\.cl:$/, ":", line)
             where = where "  " line
             want = 1
         }
         END { flush(); for (i = 1; i <= nk; i++) printf "%6d x %s\n", cnt[keys[i]], keys[i] }' "$1"
}

# Runs the driver under Oclgrind. $1: name of the run (log files $tmp/$1.*), then the oclgrind
# options, "--", the driver arguments. Records failures in $status.
errors=0
capped=0
run() {
    local name=$1
    shift
    local opts=()
    while [ "$1" != "--" ]; do
        opts+=("$1")
        shift
    done
    shift
    : >"$tmp/$name.log"
    oclgrind "${opts[@]}" --max-errors "$max_errors" --log "$tmp/$name.log" \
        "$driver" "$@" >"$tmp/$name.out" 2>"$tmp/$name.err"
    local rc=$? n
    grep -E '^(device:|case )' "$tmp/$name.out"
    n=$(count_messages "$tmp/$name.log")
    errors=$((errors + n))
    grep -q '^Oclgrind: [0-9]* errors generated' "$tmp/$name.log" && capped=1
    if [ "$rc" -ne 0 ] || [ "$n" -ne 0 ] || [ -s "$tmp/$name.err" ]; then
        status=1
        echo "---- $name: exit status $rc, $n Oclgrind message(s) (oclgrind ${opts[*]} $driver $*)"
        sed 's/^/  /' "$tmp/$name.err" | head -n 20
        digest "$tmp/$name.log"
        echo "  first message:"
        awk '$0 != "" { p = 1 } p && $0 == "" { exit } p' "$tmp/$name.log" | sed 's/^/  /' |
            head -n 16
    fi
}

# The configurations: name, Oclgrind's device limits, the driver's class option. The two run
# side by side (Oclgrind keeps about one core busy), each in a subshell that prints its report
# to $tmp/CONFIG.report and its status, message count and cap to $tmp/CONFIG.result.
gpu_limits=(--max-wgsize 256 --local-mem-size 49152)
check_config() {
    local config=$1 limits class uninit_cases k
    if [ "$config" = cpu ]; then
        limits=() class=()
    else
        limits=("${gpu_limits[@]}") class=(--class gpu)
    fi
    uninit_cases=$("$driver" --whole-writes --list "${class[@]}") ||
        { echo "2 0 0" >"$tmp/$config.result"; return; }
    echo "== $config, pass 1: memory checks, data races, API checks; every case; optimised kernels"
    run "$config-all" "${limits[@]}" --check-api --data-races --uniform-writes --inst-counts \
        -- -v "${class[@]}"
    if [ "$config" = cpu ]; then
        # The fused core's lanes mapping (PoCL's, the default of CI's device) under pass 1's
        # checks: the driver forcing the "cpu-pocl" row. Without --inst-counts, with which
        # Oclgrind 21.10 aborts here ("malloc assertion failure") from the second fused case on.
        echo "== cpu, pass 1 with the lanes mapping (--class cpu-pocl)"
        run "cpu-lanes-all" --check-api --data-races --uniform-writes -- -v --class cpu-pocl
    fi

    echo "== $config, pass 2: uninitialised values (plus pass 1 checks); -cl-opt-disable; one" \
        "process a case"
    # Without --inst-counts: Oclgrind 21.10 aborts ("double free or corruption") when it is
    # combined with --uninitialized on the fused case with two query tiles (case 26), every
    # time, while either plugin alone runs clean (also under valgrind). Pass 1 already names
    # every kernel invocation.
    for k in $uninit_cases; do
        run "$config-uninit-$k" "${limits[@]}" --check-api --data-races --uninitialized \
            --build-options -cl-opt-disable -- "${class[@]}" "$k"
    done
    echo "$status $errors $capped" >"$tmp/$config.result"
}
for config in cpu gpu; do
    check_config "$config" >"$tmp/$config.report" 2>&1 &
done
wait
for config in cpu gpu; do
    cat "$tmp/$config.report"
    read -r s e c <"$tmp/$config.result" 2>/dev/null || s=2 e=0 c=0
    [ "$s" -ne 0 ] && status=$s
    errors=$((errors + e))
    [ "$c" -eq 1 ] && capped=1
done

# Kernels seen: every invocation of pass 1 (both configurations) is named by --inst-counts. (For
# these small shapes CLBlast picks its direct GEMM kernels, XgemmDirect*; its indirect Xgemm path
# is not reached.)
cat "$tmp"/*.out | sed -n "s/^Instructions executed for kernel '\(.*\)':.*/\1/p" |
    sort | uniq -c | awk '{ printf "%s x%s\n", $2, $1 }' >"$tmp/kernels"
missing=""
# shellcheck disable=SC2016  # a perl program: $1 is perl's
kernel_names='s{//[^\n]*}{}g; s{/\*.*?\*/}{}gs;
              while (/\b(?:__)?kernel\b[^;{]*?\bvoid\s+(\w+)\s*\(/g) { print "$1\n" }'
for k in $(perl -0777 -ne "$kernel_names" "$cl_dir"/*.cl "$cl_dir"/cores/*.cl); do
    grep -q "^$k x" "$tmp/kernels" || missing="$missing $k"
done
if [ -n "$missing" ]; then
    status=1
    echo "---- kernels of cl/*.cl, cl/cores/*.cl that never ran:$missing" \
        "(add a case to tests/sanitizers/oclgrind_driver.c)"
fi

cases_all=$(sed -n 's/^cases: \([0-9]*\).*/\1/p' "$tmp/cpu-all.out" "$tmp/gpu-all.out" |
    paste -sd/)
cases_uninit=$(ls "$tmp" | grep -c '^cpu-uninit-.*\.out$')/$(ls "$tmp" | grep -c '^gpu-uninit-.*\.out$')
end=$(date +%s.%N)
echo "== summary"
echo "kernels seen (invocations, pass 1): $(tr '\n' ' ' <"$tmp/kernels")"
echo "cases (cpu/gpu configuration): ${cases_all:-0} (pass 1), $cases_uninit (pass 2," \
    "uninitialised values)"
if [ "$capped" -eq 1 ]; then
    echo "errors: at least $errors (Oclgrind stops reporting after $max_errors a process)"
else
    echo "errors: $errors"
fi
awk -v s="$start" -v e="$end" 'BEGIN { printf "time: %.1f s\n", e - s }'
if [ "$status" -ne 0 ]; then
    echo "oclgrind-check: FAILED"
else
    echo "oclgrind-check: OK"
fi
exit "$status"
