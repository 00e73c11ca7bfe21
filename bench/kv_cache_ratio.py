#!/usr/bin/env python3
"""KV cache kinds against the contiguous float32 cache: one decode step, side by side.

For each cache length S this runs `clmha bench --decode --json` (one new token per sequence over
a cache of S tokens, E 512, H 8, self-attention; see `clmha bench --help`) for the contiguous
cache and for each variant (`--variants`: paged caches of P-token pages, `page16`, `page64`,
`page256`, ...; the narrower caches `f16`, `bf16`, `int8`, `int4`; both, `page64+int8`), ROUNDS times each, interleaved (the order rotates with the round), and reports
per variant the median over the rounds of the per-run medians (ms per token) and of the decode
core's stage (the profiled steps' "fused" stage: the append and the attention kernels), and
their ratios to the contiguous cache's.

    /usr/bin/python3 bench/kv_cache_ratio.py                          # S 4096 and 32768
    /usr/bin/python3 bench/kv_cache_ratio.py --cache-lens 4096 --batch 8 --rounds 7
    /usr/bin/python3 bench/kv_cache_ratio.py --variants page16 int8 --driver intel

Needs only the clmha program (build/clmha by default); no third-party Python package.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def flags_of(variant):
    """The `clmha bench` flags of a variant name: contiguous, pageP, int8, or parts joined by
    "+" (page64+int8)."""
    flags = []
    for part in variant.split("+"):
        if part == "contiguous":
            continue
        if part.startswith("page") and part[4:].isdigit():
            flags += ["--page-size", part[4:]]
        elif part in ("int8", "int4", "f16", "bf16"):
            flags += ["--kv-dtype", part]
        else:
            raise SystemExit(f"unknown variant {variant!r}: contiguous, pageP (P a power of "
                             f"two), f16, bf16, int8, int4, or parts joined by '+'")
    return flags


def run(args, cache_len, variant):
    cmd = [args.clmha, "bench", "--decode", "--json", "--cache-len", str(cache_len),
           "--batch", str(args.batch), "--repeat", str(args.repeat)] + flags_of(variant)
    if args.driver:
        cmd = [os.path.join(ROOT, "tools", "ocl-driver.sh"), args.driver, "--"] + cmd
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    line = [x for x in out.splitlines() if x.startswith("{")][-1]
    return json.loads(line)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clmha", default=os.path.join(ROOT, "build", "clmha"))
    ap.add_argument("--cache-lens", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--variants", nargs="+",
                    default=["page16", "page64", "page256", "int8", "page64+int8"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--driver", help="run under tools/ocl-driver.sh DRIVER")
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args()
    variants = ["contiguous"] + a.variants
    results = []
    device = None
    for s in a.cache_lens:
        times = {v: [] for v in variants}
        core = {v: [] for v in variants}
        for r in range(a.rounds):
            order = variants[r % len(variants):] + variants[:r % len(variants)]
            for v in order:
                j = run(a, s, v)
                device = j["device"]
                times[v].append(j["ms"])
                core[v].append(j["stages"]["fused"])
        base = statistics.median(times["contiguous"])
        base_core = statistics.median(core["contiguous"])
        for v in variants:
            ms, cm = statistics.median(times[v]), statistics.median(core[v])
            results.append({"cache_len": s, "batch": a.batch, "variant": v, "ms": ms,
                            "ratio": ms / base, "core_ms": cm, "core_ratio": cm / base_core,
                            "runs": times[v]})
    print(f"device: {device}; N {a.batch}, E 512, H 8; {a.rounds} interleaved rounds of "
          f"{a.repeat} steps, medians")
    print(f"{'S':>7} {'variant':>12} {'ms/token':>10} {'ratio':>7} {'core ms':>9} {'ratio':>7}")
    for r in results:
        print(f"{r['cache_len']:>7} {r['variant']:>12} {r['ms']:>10.4f} {r['ratio']:>7.3f} "
              f"{r['core_ms']:>9.4f} {r['core_ratio']:>7.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": device, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
