#!/usr/bin/env python3
"""Where a forward pass's time goes at small shapes: per stage, its time, its work and its limit.

Run from the repository root after building clmha (Debian's /usr/bin/python3 with numpy):

    /usr/bin/python3 bench/small_stages.py [--clmha build/clmha] [--rounds R]
        [--shapes N,L ...] [--openblas PATH]

For each self-attention shape (E 512, H 8, batch_first, need_weights off, fused core) it
alternates, for R rounds (default 5):
  - `clmha bench --json` (median of 20 forwards on device buffers, each waited for; one more run
    with profiling gives the stage times from PoCL's own command timestamps: a marker ends each
    stage, so a stage's time includes the scheduling gap before its first command);
  - a tiny forward (N 1, L 8, E 8, H 1): what a pass costs with no work, i.e. the fixed cost of
    enqueueing its commands, the driver's scheduling of them and the host's wait;
  - the two products alone in the best CPU BLAS found (bench/gemm_limit.py's load_blas: oneDNN
    and OpenBLAS, median of 10 calls, each library with its own threading): the limit of the
    `project` and `out_proj` stages (clmha splits a product by columns over oneDNN's threads,
    which can pass it: a ratio above 1).
It prints per shape and stage the median time, the work (GFLOP, or MB moved for the stages that
copy: split, merge), the rate and the limit, and the gap: the forward's time less its stages'.
Limits: the GEMM stages against that BLAS; the fused core against the two cores' FMA peak
(--peak GFLOP/s, default 237: 2 Zen 4 cores); the copies (split adds the bias on the way)
against a numpy copy of 4 MB, measured at the start (one thread: a floor for two).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gemm_limit import blas_gflops, load_blas  # noqa: E402

E, H = 512, 8


def bench(clmha, n, l, e=E, h=H):
    out = subprocess.run([clmha, "bench", "--batch", str(n), "--tgt-len", str(l), "--embed",
                          str(e), "--heads", str(h), "--batch-first", "--impl", "fused",
                          "--repeat", "20", "--json"],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[0])


def copy_gbps(mb=4.0):
    """A numpy copy of mb MB (read + write), GB/s: the copies' yardstick."""
    import time
    a = np.ones(int(mb * 1e6 / 4), np.float32)
    b = np.empty_like(a)
    t = []
    for _ in range(20):
        s = time.perf_counter()
        np.copyto(b, a)
        t.append(time.perf_counter() - s)
    return 2 * a.nbytes / statistics.median(t) / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clmha", default="build/clmha")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shapes", nargs="*", default=["1,128", "8,128", "1,512"])
    ap.add_argument("--openblas", default="libopenblas.so.0")
    ap.add_argument("--peak", type=float, default=237.0)
    args = ap.parse_args()
    if "OPENBLAS_CORETYPE" not in os.environ and "avx512f" in open("/proc/cpuinfo").read():
        os.environ["OPENBLAS_CORETYPE"] = "SkylakeX"
    blas = load_blas(args.openblas)
    copy = copy_gbps()
    stages = ["project", "split", "fused", "merge", "out_proj"]
    for shape in args.shapes:
        n, l = (int(x) for x in shape.split(","))
        rows = n * l
        got = {s: [] for s in stages + ["forward", "tiny", "blas_proj", "blas_out"]}
        for _ in range(args.rounds):
            r = bench(args.clmha, n, l)
            for s in stages:
                got[s].append(r["stages"][s])
            got["forward"].append(r["ms"])
            got["tiny"].append(bench(args.clmha, 1, 8, 8, 1)["ms"])
            if blas:
                got["blas_proj"].append(max(blas_gflops(f, rows, 3 * E, E) for _, f in blas))
                got["blas_out"].append(max(blas_gflops(f, rows, E, E) for _, f in blas))
        med = {k: statistics.median(v) if v else 0.0 for k, v in got.items()}
        work = {"project": 2.0 * rows * 3 * E * E / 1e9, "out_proj": 2.0 * rows * E * E / 1e9,
                "fused": 4.0 * n * l * l * E / 1e9,
                "split": 2 * 3 * rows * E * 4 / 1e6, "merge": 2 * rows * E * 4 / 1e6}
        limit = {"project": med["blas_proj"], "out_proj": med["blas_out"], "fused": args.peak,
                 "split": copy, "merge": copy}
        print(f"\nN {n}, L {l} (E {E}, H {H}): forward {med['forward']:.3f} ms, "
              f"stages sum {sum(med[s] for s in stages):.3f} ms, "
              f"a tiny forward {med['tiny']:.3f} ms")
        print(f"{'stage':>9} {'ms':>8} {'share':>6} {'work':>12} {'rate':>10} {'limit':>10} "
              f"{'of limit':>8}")
        for s in stages:
            ms = med[s]
            unit = "GB/s" if s in ("split", "merge") else "GFLOP/s"
            rate = (work[s] / 1e3 if unit == "GB/s" else work[s]) / (ms / 1e3) if ms else 0.0
            w = f"{work[s]:.1f} MB" if unit == "GB/s" else f"{work[s]:.4f} GF"
            print(f"{s:>9} {ms:8.3f} {ms / med['forward']:6.1%} {w:>12} {rate:10.1f} "
                  f"{limit[s]:10.1f} {rate / limit[s] if limit[s] else 0:8.2f}  ({unit})")
        gap = med["forward"] - sum(med[s] for s in stages)
        print(f"{'gap':>9} {gap:8.3f} {gap / med['forward']:6.1%}  (forward less its stages: "
              f"enqueueing, the wait)")
    print(f"\nmedians of {args.rounds} interleaved rounds; copy yardstick {copy:.1f} GB/s")


if __name__ == "__main__":
    main()
