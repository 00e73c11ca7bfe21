#!/usr/bin/env python3
"""Compares clmha's forward pass with PyTorch and with OpenBLAS, on the same shapes and weights.

Run from the repository root with Debian's Python (python3-torch, python3-numpy,
python3-matplotlib), after building clmha:

    /usr/bin/python3 bench/compare.py [--clmha build/clmha] [--quick] [--repeat R]
        [--shapes NxLxExH | NxLxSxExH ...] [--batch-first] [--out docs/bench.png]

For every shape it
  1. exports one nn.MultiheadAttention (PyTorch's initialisation, small random biases, eval())
     to a .safetensors layer file with tools/export_mha.py;
  2. checks that `clmha run` on that layer and a random .npy input gives PyTorch's output
     (max abs difference <= 1e-4);
  3. times clmha's device-buffer forward with `clmha bench --json --layer <file>` (median of R
     runs after a warm-up, each run waited for with clFinish; with its split across stages);
  4. times PyTorch's module(query, key, value, need_weights=False) on the CPU under
     torch.no_grad() with torch.set_num_threads(--threads) (median of R after a warm-up);
  5. times "the limit": the forward pass's own matrix products in OpenBLAS sgemm through numpy,
     at their shapes and nothing else (no softmax, no head split/merge, no bias):
     the input projection(s) (N*L, E) x (E, 3E) (self-attention; (E, E) and (E, 2E) for
     cross-attention), the batched Q*K^T (N*H, L, D) x (N*H, D, S) and weights*V
     (N*H, L, S) x (N*H, S, D), and the output projection (N*L, E) x (E, E). These are exactly
     the FLOPs counted for all three, so the ratio ours/OpenBLAS is the fraction of the
     achievable GEMM speed at these shapes that clmha reaches. A square sgemm (2048^3) is timed
     once too, as the machine's peak (the dashed line of the plot).
Self-attention (key = value = query) when S = L, else cross-attention with key = value.

FLOPs per forward (all three): 2*N*E^2*(2L + 2S) + 4*N*L*S*E; for self-attention (L = S)
8*N*L*E^2 + 4*N*L^2*E. GFLOP/s = FLOPs / median time. The ratios are speed ratios
(ours / theirs in GFLOP/s, i.e. their time / our time): below 1 means clmha is slower.

BLAS: Debian's default libblas.so.3 is the reference BLAS unless OpenBLAS is installed *and*
selected. The script re-runs itself with the OpenBLAS of libopenblas0-pthread first on the
library path (so that numpy and PyTorch both use it, in this process only) when it is installed
(--blas system keeps whatever libblas.so.3 the system selects); it prints which BLAS is loaded.

PyTorch runs with OMP_WAIT_POLICY=PASSIVE (unless set): otherwise its OpenMP threads spin
between parallel regions and fight OpenBLAS's threads (and anything else) for the cores; on 2
shared cores that made it 2-3x slower than with 1 thread.

Repeats: at least --repeat timed runs; more (up to 200) for fast shapes, until a measurement
takes about 2 s (short runs are noisy on a shared machine); fewer (down to 3) when R runs would
take longer than --budget seconds. clmha's repeats are sized from its speed on the previous
(smaller) shape. The default run (N = 1, E = 512, H = 8, L = S = 128 ... 4096, plus N = 8,
L = 128) takes about 5 minutes on 2 CPU cores; --quick (L = 128, 512, 2048 and N = 8,
L = 128; 3 repeats) about 1 minute.
"""

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OPENBLAS_DIRS = ["/usr/lib/x86_64-linux-gnu/openblas-pthread",
                 "/usr/lib/aarch64-linux-gnu/openblas-pthread",
                 "/usr/lib/x86_64-linux-gnu/openblas-openmp"]
REEXEC_MARK = "CLMHA_COMPARE_REEXEC"
ISSUE_SHAPES = [(8, 128, 128, 512, 8), (1, 2048, 2048, 512, 8)]
DEFAULT_LENGTHS = [128, 256, 512, 1024, 2048, 4096]
QUICK_LENGTHS = [128, 512, 2048]
TOLERANCE = 1e-4


def parse_args(argv):
    ap = argparse.ArgumentParser(
        description="clmha vs PyTorch vs OpenBLAS on the CPU: GFLOP/s, ratios and a plot.",
        epilog="Shapes: NxLxExH (self-attention, S = L) or NxLxSxExH (cross-attention, "
               "key = value of length S). Default: 1xLx512x8 for L = "
               + ", ".join(map(str, DEFAULT_LENGTHS)) + ", and 8x128x512x8.")
    ap.add_argument("--clmha", default=os.path.join(ROOT, "build", "clmha"),
                    help="the built clmha program (default: build/clmha)")
    ap.add_argument("--shapes", nargs="+", metavar="SHAPE", help="shapes to measure (see below)")
    ap.add_argument("--quick", action="store_true",
                    help="fewer lengths (128, 512, 2048) and 3 repeats")
    ap.add_argument("--repeat", type=int, help="timed runs per measurement (default 10, "
                    "--quick 3; fewer for large shapes, see --budget)")
    ap.add_argument("--budget", type=float, default=20.0,
                    help="seconds one measurement should take at most; repeats shrink to fit, "
                    "down to 3 (default 20)")
    ap.add_argument("--batch-first", action="store_true",
                    help="layer and inputs batch_first (N, L, E)")
    ap.add_argument("--threads", type=int, default=2,
                    help="CPU threads for PyTorch and OpenBLAS (default 2)")
    ap.add_argument("--device", help="clmha --device SPEC (default: $CLMHA_DEVICE, else the "
                    "first GPU, else the first device)")
    ap.add_argument("--blas", choices=["openblas", "system"], default="openblas",
                    help="openblas (default): use libopenblas0-pthread's OpenBLAS when "
                    "installed; system: whatever libblas.so.3 the system selects")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "bench.png"),
                    help="the plot (PNG; default docs/bench.png)")
    ap.add_argument("--results", help="also write every measurement to this JSON file")
    ap.add_argument("--replot", metavar="RESULTS.json",
                    help="measure nothing: print the tables and draw the plot from a file "
                    "written by --results")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.repeat is None:
        a.repeat = 3 if a.quick else 10
    if a.repeat < 1:
        ap.error("--repeat must be at least 1")
    if a.threads < 1:
        ap.error("--threads must be at least 1")
    if a.shapes:
        try:
            a.shape_list = [parse_shape(s) for s in a.shapes]
        except ValueError as e:
            ap.error(str(e))
    else:
        lengths = QUICK_LENGTHS if a.quick else DEFAULT_LENGTHS
        a.shape_list = [(1, n, n, 512, 8) for n in lengths] + [(8, 128, 128, 512, 8)]
    return a


def parse_shape(text):
    """'NxLxExH' -> (N, L, L, E, H); 'NxLxSxExH' -> (N, L, S, E, H)."""
    parts = text.lower().split("x")
    try:
        v = [int(p) for p in parts]
    except ValueError:
        v = []
    if len(v) not in (4, 5) or min(v) < 1:
        raise ValueError(f"shape '{text}': expected NxLxExH or NxLxSxExH, positive integers")
    n, l, s, e, h = (v[0], v[1], v[1], v[2], v[3]) if len(v) == 4 else tuple(v)
    if e % h:
        raise ValueError(f"shape '{text}': E = {e} is not a multiple of H = {h}")
    return (n, l, s, e, h)


def reexec_with_openblas(a):
    """Runs this script again with OpenBLAS first on the library path (numpy and torch load
    libblas.so.3 at import, so it has to be set before the process starts)."""
    if a.blas != "openblas" or os.environ.get(REEXEC_MARK):
        return
    for d in OPENBLAS_DIRS:
        if os.path.exists(os.path.join(d, "libblas.so.3")):
            env = dict(os.environ)
            env[REEXEC_MARK] = env.get("LD_LIBRARY_PATH", "") or "-"
            env["LD_LIBRARY_PATH"] = d + (":" + env["LD_LIBRARY_PATH"]
                                          if env.get("LD_LIBRARY_PATH") else "")
            sys.stdout.flush()
            os.execve(sys.executable, [sys.executable, os.path.abspath(__file__)] + sys.argv[1:],
                      env)
    print("note: OpenBLAS not found (Debian: apt-get install libopenblas0-pthread); using the "
          "system's libblas.so.3", file=sys.stderr)


def child_env():
    """The environment for clmha: without the library path this script added for itself."""
    env = dict(os.environ)
    old = env.pop(REEXEC_MARK, None)
    if old is not None:
        if old == "-":
            env.pop("LD_LIBRARY_PATH", None)
        else:
            env["LD_LIBRARY_PATH"] = old
    return env


def loaded_blas():
    """The BLAS libraries mapped into this process."""
    libs = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                base = os.path.basename(path)
                if "blas" in base or "mkl" in base or "blis" in base:
                    libs.add(path)
    except OSError:
        pass
    return sorted(libs)


def blas_name(libs):
    if any("openblas" in p for p in libs):
        return "OpenBLAS"
    if any("mkl" in p for p in libs):
        return "MKL"
    if any("blis" in p for p in libs):
        return "BLIS"
    if any("/blas/libblas" in p for p in libs):
        return "reference BLAS (netlib; slow: install libopenblas0-pthread)"
    return "unknown BLAS (" + ", ".join(libs) + ")"


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def flops_of(n, l, s, e, h):
    return 2.0 * n * e * e * (2 * l + 2 * s) + 4.0 * n * l * s * e


def repeats_for(est_s, repeat, budget_s, min_time_s=2.0, most=200):
    """How many timed runs for a measurement whose single run takes about est_s: at least
    `repeat`, more (up to `most`) while they take under min_time_s (fast shapes are noisy on a
    shared machine), fewer (down to 3) when they would take longer than budget_s."""
    est_s = max(est_s, 1e-6)
    r = max(repeat, min(most, math.ceil(min_time_s / est_s)))
    return max(1, min(r, max(3, int(budget_s / est_s))))


def median_time(fn, repeat, budget_s):
    """Median and minimum seconds of fn() after one warm-up call, and the number of runs."""
    t0 = time.perf_counter()
    fn()
    r = repeats_for(time.perf_counter() - t0, repeat, budget_s)
    times = []
    for _ in range(r):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times), r


def time_gemms(np, n, l, s, e, h, a):
    """Median and minimum seconds of the forward pass's matrix products alone, at their
    shapes, in numpy (BLAS sgemm; numpy runs a stacked matmul as one sgemm per matrix)."""
    self_attn = l == s
    d = e // h
    g = np.random.default_rng(a.seed + 2)
    xq = g.standard_normal((n * l, e), dtype=np.float32)
    xk = xq if self_attn else g.standard_normal((n * s, e), dtype=np.float32)
    w_in = g.standard_normal((e, 3 * e), dtype=np.float32)
    w_q, w_kv = w_in[:, :e].copy(), w_in[:, e:].copy()
    w_out = g.standard_normal((e, e), dtype=np.float32)
    qh = g.standard_normal((n * h, l, d), dtype=np.float32)
    kt = g.standard_normal((n * h, d, s), dtype=np.float32)
    vh = g.standard_normal((n * h, s, d), dtype=np.float32)
    sc = np.empty((n * h, l, s), dtype=np.float32)
    av = np.empty((n * h, l, d), dtype=np.float32)
    merged = av.reshape(n * l, e)  # the head merge itself is not a GEMM: a view will do
    yq = np.empty((n * l, 3 * e if self_attn else e), dtype=np.float32)
    ykv = None if self_attn else np.empty((n * s, 2 * e), dtype=np.float32)
    yo = np.empty((n * l, e), dtype=np.float32)

    def gemms():
        if self_attn:
            np.matmul(xq, w_in, out=yq)        # packed Q, K, V projection
        else:
            np.matmul(xq, w_q, out=yq)         # Q projection
            np.matmul(xk, w_kv, out=ykv)       # K and V projections (key = value)
        np.matmul(qh, kt, out=sc)              # Q K^T, per batch item and head
        np.matmul(sc, vh, out=av)              # weights V
        np.matmul(merged, w_out, out=yo)       # output projection
    return median_time(gemms, a.repeat, a.budget)


def sgemm_peak(np, a, m=2048):
    """GFLOP/s and seconds of a square m x m x m sgemm."""
    g = np.random.default_rng(a.seed)
    x = g.standard_normal((m, m), dtype=np.float32)
    y = g.standard_normal((m, m), dtype=np.float32)
    z = np.empty((m, m), dtype=np.float32)
    t, _, _ = median_time(lambda: np.matmul(x, y, out=z), 5, a.budget)
    return 2.0 * m ** 3 / t / 1e9, t


def main(argv=None):
    a = parse_args(sys.argv[1:] if argv is None else argv)
    if a.replot:
        with open(a.replot) as f:
            saved = json.load(f)
        a.threads, a.batch_first = saved["threads"], saved["batch_first"]
        report(saved["results"], saved["device"], saved["blas"], saved["peak_gflops"], a)
        plot(saved["results"], saved["device"], saved["blas"], saved["peak_gflops"], a)
        print(f"plot:     {a.out}")
        return 0
    reexec_with_openblas(a)
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(a.threads)
    # PyTorch's OpenMP threads otherwise spin between parallel regions, fighting OpenBLAS's own
    # threads for the cores: on 2 busy cores that made PyTorch 2-3x slower than with 1 thread.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    import numpy as np
    import torch
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from export_mha import export

    torch.set_num_threads(a.threads)
    blas_libs = loaded_blas()
    if not os.access(a.clmha, os.X_OK):
        print(f"compare.py: {a.clmha}: not an executable (build clmha first: cmake -S . -B build "
              f"&& cmake --build build -j), or pass --clmha PATH", file=sys.stderr)
        return 2
    out_dir = os.path.dirname(os.path.abspath(a.out))
    if not os.path.isdir(out_dir):
        print(f"compare.py: --out {a.out}: the folder {out_dir} does not exist", file=sys.stderr)
        return 2

    env = child_env()
    print(f"cpu:      {cpu_name()}, {os.cpu_count()} logical cores; PyTorch "
          f"{torch.__version__} with {a.threads} threads (OMP_WAIT_POLICY="
          f"{os.environ['OMP_WAIT_POLICY']}), numpy {np.__version__}")
    print(f"blas:     {blas_name(blas_libs)}")

    # The machine's sgemm peak: a square product.
    m = 2048
    peak, t = sgemm_peak(np, a, m)
    print(f"peak:     square sgemm {m}^3: {peak:.1f} GFLOP/s ({t * 1e3:.1f} ms)")

    shapes = sorted(dict.fromkeys(a.shape_list), key=lambda s: flops_of(*s))
    results = []
    device = None
    est_gflops = None  # clmha's speed on the previous shape, to size the repeats
    with tempfile.TemporaryDirectory(prefix="clmha-compare-") as tmp:
        for (n, l, s, e, h) in shapes:
            fl = flops_of(n, l, s, e, h)
            self_attn = l == s
            tag = f"N={n} L={l} S={s} E={e} H={h}"
            print(f"\n[{tag}] {'self' if self_attn else 'cross'}-attention, "
                  f"{fl / 1e9:.3f} GFLOP per forward", flush=True)

            # The layer: PyTorch's initialisation with small random biases (so that they count).
            torch.manual_seed(a.seed)
            mha = torch.nn.MultiheadAttention(e, h, batch_first=a.batch_first)
            with torch.no_grad():
                for name, p in mha.named_parameters():
                    if name.endswith("bias"):
                        p.uniform_(-0.1, 0.1)
            mha.eval()
            layer = os.path.join(tmp, f"layer_{e}_{h}.safetensors")
            export(mha, layer)
            gen = torch.Generator().manual_seed(a.seed + 1)
            qshape = (n, l, e) if a.batch_first else (l, n, e)
            kshape = (n, s, e) if a.batch_first else (s, n, e)
            query = torch.randn(qshape, generator=gen)
            key = query if self_attn else torch.randn(kshape, generator=gen)

            # 1. Same output as PyTorch.
            with torch.no_grad():
                ref, _ = mha(query, key, key, need_weights=False)
            qf, kf, of = (os.path.join(tmp, f) for f in ("q.npy", "k.npy", "o.npy"))
            np.save(qf, query.numpy())
            cmd = [a.clmha, "run", "--layer", layer, "--query", qf, "--output", of]
            if not self_attn:
                np.save(kf, key.numpy())
                cmd += ["--key", kf]
            if a.device is not None:
                cmd += ["--device", a.device]
            p = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if p.returncode != 0:
                print(f"compare.py: clmha run failed ({p.returncode}): {p.stderr.strip()}",
                      file=sys.stderr)
                return 1
            diff = float(np.max(np.abs(np.load(of) - ref.numpy())))
            print(f"  check:  max |clmha - PyTorch| = {diff:.3g} "
                  f"({'ok' if diff <= TOLERANCE else 'FAIL'}, tolerance {TOLERANCE:g})",
                  flush=True)

            # 2. clmha bench on the same layer file.
            r_ours = a.repeat
            if est_gflops:
                r_ours = repeats_for(fl / (est_gflops * 1e9), a.repeat, a.budget)
            cmd = [a.clmha, "bench", "--json", "--layer", layer, "--batch", str(n),
                   "--tgt-len", str(l), "--src-len", str(s), "--repeat", str(r_ours)]
            if a.batch_first:
                cmd.append("--batch-first")
            if a.device is not None:
                cmd += ["--device", a.device]
            p = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if p.returncode != 0:
                print(f"compare.py: clmha bench failed ({p.returncode}): {p.stderr.strip()}",
                      file=sys.stderr)
                return 1
            ours = json.loads(p.stdout.strip().splitlines()[-1])
            device = ours["device"]
            est_gflops = ours["gflops"]
            print(f"  clmha:   {ours['ms']:10.2f} ms  {ours['gflops']:7.2f} GFLOP/s "
                  f"(median of {r_ours}; scratch {ours['scratch_bytes'] / 2**20:.1f} MiB)",
                  flush=True)

            # 3. PyTorch.
            def torch_forward():
                with torch.no_grad():
                    mha(query, key, key, need_weights=False)
            t_torch, min_torch, r_torch = median_time(torch_forward, a.repeat, a.budget)
            print(f"  PyTorch: {t_torch * 1e3:10.2f} ms  {fl / t_torch / 1e9:7.2f} GFLOP/s "
                  f"(median of {r_torch})", flush=True)

            # 4. The GEMMs alone, in OpenBLAS.
            t_blas, min_blas, r_blas = time_gemms(np, n, l, s, e, h, a)
            print(f"  OpenBLAS GEMMs: {t_blas * 1e3:5.2f} ms  {fl / t_blas / 1e9:7.2f} GFLOP/s "
                  f"(median of {r_blas})", flush=True)

            results.append({
                "batch": n, "tgt_len": l, "src_len": s, "embed_dim": e, "num_heads": h,
                "attention": "self" if self_attn else "cross", "flops": fl,
                "max_abs_diff": diff, "check_ok": diff <= TOLERANCE,
                "clmha": {"ms": ours["ms"], "ms_min": ours["ms_min"], "gflops": ours["gflops"],
                          "repeat": r_ours, "scratch_bytes": ours["scratch_bytes"],
                          "stages": ours["stages"]},
                "pytorch": {"ms": t_torch * 1e3, "ms_min": min_torch * 1e3,
                            "gflops": fl / t_torch / 1e9, "repeat": r_torch},
                "openblas": {"ms": t_blas * 1e3, "ms_min": min_blas * 1e3,
                             "gflops": fl / t_blas / 1e9, "repeat": r_blas},
            })

    report(results, device, blas_name(blas_libs), peak, a)
    if a.results:
        with open(a.results, "w") as f:
            json.dump({"device": device, "blas": blas_name(blas_libs), "threads": a.threads,
                       "peak_gflops": peak, "batch_first": a.batch_first,
                       "results": results}, f, indent=1)
        print(f"results:  {a.results}")
    plot(results, device, blas_name(blas_libs), peak, a)
    print(f"plot:     {a.out}")
    return 0 if all(r["check_ok"] for r in results) else 1


def report(results, device, blas, peak, a):
    print(f"\ndevice:   {device}")
    print(f"compared: clmha (device buffers) vs PyTorch nn.MultiheadAttention "
          f"(CPU, {a.threads} threads, need_weights=False, batch_first={a.batch_first}) vs "
          f"{blas} sgemm on the forward's GEMM shapes")
    print("ratios:   speed ratios (clmha GFLOP/s / theirs); below 1 = clmha slower\n")
    head = (f"{'N':>2} {'L':>5} {'S':>5} {'E':>4} {'H':>2} | {'clmha ms':>9} {'GF/s':>6} | "
            f"{'torch ms':>9} {'GF/s':>6} | {'BLAS ms':>8} {'GF/s':>6} | "
            f"{'/torch':>6} {'/BLAS':>6} | {'max diff':>8}")
    print(head)
    print("-" * len(head))
    for r in results:
        c, t, b = r["clmha"], r["pytorch"], r["openblas"]
        print(f"{r['batch']:>2} {r['tgt_len']:>5} {r['src_len']:>5} {r['embed_dim']:>4} "
              f"{r['num_heads']:>2} | {c['ms']:9.2f} {c['gflops']:6.2f} | {t['ms']:9.2f} "
              f"{t['gflops']:6.2f} | {b['ms']:8.2f} {b['gflops']:6.2f} | "
              f"{c['gflops'] / t['gflops']:6.3f} {c['gflops'] / b['gflops']:6.3f} | "
              f"{r['max_abs_diff']:8.1e}{'' if r['check_ok'] else ' FAIL'}")
    print(f"(square sgemm peak: {peak:.1f} GFLOP/s)")

    names = list(results[0]["clmha"]["stages"]) if results else []
    print("\nclmha's time per stage (one profiled run, % of its total):")
    print(f"{'N':>2} {'L':>5} {'S':>5} | " + " ".join(f"{k:>8}" for k in names))
    for r in results:
        st = r["clmha"]["stages"]
        tot = sum(st.values()) or 1.0
        print(f"{r['batch']:>2} {r['tgt_len']:>5} {r['src_len']:>5} | "
              + " ".join(f"{100 * st[k] / tot:7.1f}%" for k in names))

    print("\nthe issue's shapes, clmha vs PyTorch:")
    for shape in ISSUE_SHAPES:
        hit = [r for r in results if (r["batch"], r["tgt_len"], r["src_len"], r["embed_dim"],
                                      r["num_heads"]) == shape]
        n, l, s, e, h = shape
        if not hit:
            print(f"  N={n} L={l} E={e} H={h}: not measured (not among --shapes)")
            continue
        r = hit[0]
        ratio = r["clmha"]["gflops"] / r["pytorch"]["gflops"]
        print(f"  N={n} L={l} E={e} H={h}: clmha {r['clmha']['ms']:.2f} ms, PyTorch "
              f"{r['pytorch']['ms']:.2f} ms: speed ratio {ratio:.3f} (PyTorch is "
              f"{1 / ratio:.1f}x {'faster' if ratio < 1 else 'slower'}); vs OpenBLAS GEMMs "
              f"{r['clmha']['gflops'] / r['openblas']['gflops']:.3f}")


def plot(results, device, blas, peak, a):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    # One series per (N, E, H, self/cross), x = L.
    groups = {}
    for r in results:
        key = (r["batch"], r["embed_dim"], r["num_heads"], r["attention"])
        groups.setdefault(key, []).append(r)
    impls = [("clmha", "clmha (OpenCL: " + short(device) + ")", "tab:blue", "o"),
             ("pytorch", f"PyTorch {a.threads} threads", "tab:orange", "s"),
             ("openblas", f"{blas.split(' (')[0]} sgemm, the forward's GEMMs only",
              "tab:green", "^")]
    styles = ["-", "--", ":", "-."]
    fig, ax = plt.subplots(figsize=(9, 5.6), dpi=120)
    main_key = max(groups, key=lambda k: len(groups[k]))
    for gi, (key, rs) in enumerate(sorted(groups.items(), key=lambda kv: kv[0] != main_key)):
        rs = sorted(rs, key=lambda r: r["tgt_len"])
        n, e, h, kind = key
        xs = [r["tgt_len"] for r in rs]
        for impl, label, color, marker in impls:
            ys = [r[impl]["gflops"] for r in rs]
            lab = label if gi == 0 else None
            if len(rs) > 1:
                ax.plot(xs, ys, styles[gi % len(styles)], color=color, marker=marker, label=lab)
            else:
                ax.plot(xs, ys, linestyle="none", color=color, marker=marker, markersize=9,
                        markerfacecolor="none", markeredgewidth=1.8, label=lab)
        if gi > 0:
            ax.annotate(f"N={n}" + ("" if kind == "self" else f", {kind}"),
                        (xs[-1], rs[-1]["clmha"]["gflops"]), textcoords="offset points",
                        xytext=(6, -12), fontsize=8)
    ax.axhline(peak, color="gray", linestyle="--", linewidth=1)
    ax.annotate(f"square sgemm peak, {peak:.0f} GFLOP/s", (0.01, peak),
                xycoords=("axes fraction", "data"), xytext=(0, 4), textcoords="offset points",
                color="gray", fontsize=8)
    bad = [r for r in results if not r["check_ok"]]
    if bad:
        ax.plot([r["tgt_len"] for r in bad], [r["clmha"]["gflops"] for r in bad], "x",
                color="red", markersize=12, markeredgewidth=2,
                label="clmha output differs from PyTorch's (> 1e-4)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    lowest = min(min(r[k]["gflops"] for k in ("clmha", "pytorch", "openblas")) for r in results)
    ax.set_ylim(bottom=lowest / 1.6, top=max(peak, ax.get_ylim()[1]) * 1.25)
    xs_all = sorted({r["tgt_len"] for r in results})
    ax.set_xticks(xs_all)
    ax.set_xticklabels([str(x) for x in xs_all])
    n0, e0, h0, kind0 = main_key
    if kind0 == "self":
        ax.set_xlabel("sequence length L = S (self-attention)")
        ax.set_ylabel("GFLOP/s   (FLOPs = 8NLE² + 4NL²E)")
    else:
        ax.set_xlabel("target length L (cross-attention)")
        ax.set_ylabel("GFLOP/s   (FLOPs = 2NE²(2L + 2S) + 4NLSE)")
    title = (f"nn.MultiheadAttention forward, N={n0}, E={e0}, H={h0}, "
             f"{os.cpu_count()} CPU cores")
    if len(groups) > 1:
        title += "\nhollow markers: the other shapes, labelled"
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2,
              frameon=False)
    fig.tight_layout()
    fig.savefig(a.out)
    plt.close(fig)


def short(device):
    if not device:
        return "?"
    return device.split(" / ")[0].replace("Portable Computing Language", "PoCL") + \
        (" CPU" if "pthread" in device or "cpu" in device.lower() else "")


if __name__ == "__main__":
    sys.exit(main())
