#!/usr/bin/env python3
"""How close the forward pass's projections come to the machine's best CPU BLAS.

Run from the repository root after building clmha (Debian's /usr/bin/python3 with numpy):

    /usr/bin/python3 bench/gemm_limit.py [--clmha build/clmha] [--rounds R] [--shapes N,L ...]
        [--openblas PATH]

For each self-attention shape (E 512, H 8, need_weights off, fused core) it alternates, for R
rounds:
  - `clmha bench --json` (median of 10 forwards; one more run with profiling gives the stage
    times): the `project` stage is the packed QKV projection, a (N*L, E) x (E, 3E) product, and
    `out_proj` an (N*L, E) x (E, E) product, bias added by the GEMM's beta (clmha's GEMM path is
    printed: host BLAS or CLBlast);
  - the same two products, alone, in each CPU BLAS found: oneDNN's dnnl_sgemm (libdnnl.so.2/.3)
    and OpenBLAS's cblas_sgemm (--openblas, default libopenblas.so.0; OPENBLAS_CORETYPE is set
    for it to SkylakeX on AVX-512 CPUs unless already set, since 0.3.21 takes recent Intel CPUs
    for a Prescott), median of 10 calls each after a warm-up, in this process with the BLAS's
    default threads.
It prints per shape the medians over rounds of GFLOP/s of clmha's two stages and of each BLAS,
and the ratio clmha / best BLAS (issue 16's target: >= 0.70).
"""
import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

E = 512


def load_blas(openblas):
    """[(name, sgemm(a, b, c) computing c = a @ b.T)] for each BLAS that loads."""
    found = []
    for soname in ("libdnnl.so.3", "libdnnl.so.2"):
        try:
            lib = ctypes.CDLL(soname)
        except OSError:
            continue
        f = lib.dnnl_sgemm
        i64 = ctypes.c_int64

        def dnnl(a, b, c, f=f, i64=i64):
            m, k = a.shape
            n = b.shape[0]
            f(ctypes.c_char(b"N"), ctypes.c_char(b"T"), i64(m), i64(n), i64(k),
              ctypes.c_float(1), a.ctypes.data_as(ctypes.c_void_p), i64(k),
              b.ctypes.data_as(ctypes.c_void_p), i64(k), ctypes.c_float(0),
              c.ctypes.data_as(ctypes.c_void_p), i64(n))
        found.append(("oneDNN " + soname, dnnl))
        break
    try:
        lib = ctypes.CDLL(openblas)
    except OSError:
        return found
    f = lib.cblas_sgemm

    def cblas(a, b, c, f=f):
        m, k = a.shape
        n = b.shape[0]
        f(101, 111, 112, m, n, k, ctypes.c_float(1), a.ctypes.data_as(ctypes.c_void_p), k,
          b.ctypes.data_as(ctypes.c_void_p), k, ctypes.c_float(0),
          c.ctypes.data_as(ctypes.c_void_p), n)
    found.append(("OpenBLAS", cblas))
    return found


def blas_gflops(sgemm, m, n, k, calls=10):
    """Median GFLOP/s of c (m, n) = a (m, k) @ b (n, k).T."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k), dtype=np.float32)
    b = rng.standard_normal((n, k), dtype=np.float32)
    c = np.zeros((m, n), np.float32)
    sgemm(a, b, c)
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        sgemm(a, b, c)
        times.append(time.perf_counter() - t)
    return 2.0 * m * n * k / statistics.median(times) / 1e9


def clmha_stages(clmha, n, l):
    out = subprocess.run([clmha, "bench", "--batch", str(n), "--tgt-len", str(l), "--repeat",
                          "10", "--json"], check=True, capture_output=True, text=True).stdout
    r = json.loads(out.splitlines()[0])
    rows = n * l
    proj = 2.0 * rows * 3 * E * E / r["stages"]["project"] / 1e6
    outp = 2.0 * rows * E * E / r["stages"]["out_proj"] / 1e6
    return r["gemm"], proj, outp


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clmha", default="build/clmha")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shapes", nargs="*", default=["8,128", "1,2048", "1,128"])
    ap.add_argument("--openblas", default="libopenblas.so.0")
    args = ap.parse_args()
    if "OPENBLAS_CORETYPE" not in os.environ and "avx512f" in open("/proc/cpuinfo").read():
        os.environ["OPENBLAS_CORETYPE"] = "SkylakeX"  # read when OpenBLAS loads, below
    blas = load_blas(args.openblas)
    if not blas:
        sys.exit("gemm_limit: no CPU BLAS found (install libdnnl2 or libopenblas0-pthread)")
    print(f"{'N,L':>8} {'stage':>9} {'clmha':>8} " +
          " ".join(f"{name[:14]:>14}" for name, _ in blas) + f" {'clmha/best':>10}")
    path = None
    for shape in args.shapes:
        n, l = (int(x) for x in shape.split(","))
        res = {"project": [], "out_proj": []}
        ref = {(s, name): [] for s in res for name, _ in blas}
        for _ in range(args.rounds):
            path, proj, outp = clmha_stages(args.clmha, n, l)
            res["project"].append(proj)
            res["out_proj"].append(outp)
            for name, f in blas:
                ref[("project", name)].append(blas_gflops(f, n * l, 3 * E, E))
                ref[("out_proj", name)].append(blas_gflops(f, n * l, E, E))
        for stage in res:
            ours = statistics.median(res[stage])
            theirs = [statistics.median(ref[(stage, name)]) for name, _ in blas]
            print(f"{shape:>8} {stage:>9} {ours:8.1f} " +
                  " ".join(f"{t:14.1f}" for t in theirs) + f" {ours / max(theirs):10.2f}")
    print(f"GFLOP/s, medians of {args.rounds} interleaved rounds; clmha's GEMMs: {path}")


if __name__ == "__main__":
    main()
