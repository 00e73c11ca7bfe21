#!/usr/bin/env python3
"""One decode step of clmha (KV cache, split-K decode core) side by side with PyTorch's.

Run from the repository root with Debian's Python after building clmha:

    /usr/bin/python3 bench/decode_peers.py [--clmha build/clmha] [--cache-lens 4096,8192,...]
        [--batch 1] [--embed 512] [--heads 8] [--rounds 5] [--repeat 50]
        [--torch2-python /tmp/venv-torch2/bin/python | --no-torch2] [--json FILE]

The step (the same for every peer): one new token per sequence, x (N, 1, E); its query, key
and value projections (in_proj_weight, in_proj_bias); the new key and value written into a
cache of capacity S + 1 that holds S earlier tokens, (N, H, S + 1, D); one query row per head
attending over the S + 1 cached keys (softmax(q k^T / sqrt(D)) v); the head merge and the
output projection. need_weights is off; nothing is recomputed for the earlier tokens.
  clmha        `clmha bench --decode --json --cache-len S` (device buffers; clmha_kv_cache; each
               step appends one token and is rolled back with clmha_kv_cache_truncate());
  torch 1.13   Debian's python3-torch under torch.no_grad(): F.linear, index copy into
               preallocated cache tensors, (q @ k^T * scale).softmax(-1) @ v (1.13 has no public
               scaled_dot_product_attention), F.linear;
  torch 2      the same with F.scaled_dot_product_attention(q, k, v) for the attention, under
               PyTorch 2.x from PyPI (a venv, --torch2-python).
Every peer runs in its own process, in turns (clmha, torch 1.13, torch 2, then again) so that a
busy machine slows them alike; each process times R steps after 3 warm-up steps and reports the
median; the table gives the median over the rounds. Threads: 2 everywhere (as
bench/backward_peers.py; OPENBLAS_CORETYPE for this CPU for the PyTorch processes).

Grouped-query attention (--gqa-kv-heads G, default 2): clmha's step with G key/value heads (the
same H query heads) in the same turns, and the speed-up over the step with H.

Bandwidth: the bytes of cached keys and values a step reads, 2 * N * H * (S + 1) * D * 4, per
second of the step; clmha's process also measures the device's copy bandwidth
(clEnqueueCopyBuffer of 256 MiB, bytes read + written) in the same run: the table gives the
step's bandwidth as a fraction of it. Ratios are clmha's time / the peer's (below 1: clmha
faster).

Internal: --worker N S E H R prints one PyTorch peer's median step time as JSON.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

import openblas_core  # bench/openblas_core.py

OPENBLAS_DIRS = ["/usr/lib/x86_64-linux-gnu/openblas-pthread"]


def worker(n, s, e, h, repeat, threads):
    import time

    import torch
    import torch.nn.functional as F
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    d = e // h
    w_in = torch.randn(3 * e, e) / e ** 0.5
    b_in = torch.randn(3 * e) * 0.1
    w_out = torch.randn(e, e) / e ** 0.5
    b_out = torch.randn(e) * 0.1
    kc = torch.randn(n, h, s + 1, d)
    vc = torch.randn(n, h, s + 1, d)
    x = torch.randn(n, 1, e)
    sdpa = getattr(F, "scaled_dot_product_attention", None)
    scale = 1.0 / d ** 0.5

    def step():
        qkv = F.linear(x, w_in, b_in)  # (N, 1, 3E)
        q, k, v = qkv.split(e, dim=-1)
        q = q.view(n, 1, h, d).transpose(1, 2)  # (N, H, 1, D)
        kc[:, :, s] = k.view(n, h, d)
        vc[:, :, s] = v.view(n, h, d)
        if sdpa is not None:
            o = sdpa(q, kc, vc)
        else:
            o = torch.matmul(torch.softmax(torch.matmul(q, kc.transpose(2, 3)) * scale, -1), vc)
        o = o.transpose(1, 2).reshape(n, 1, e)
        return F.linear(o, w_out, b_out)

    with torch.no_grad():
        for _ in range(3):
            step()
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    print(json.dumps({"ms": statistics.median(times), "torch": torch.__version__,
                      "attention": "sdpa" if sdpa is not None else "matmul+softmax"}))


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clmha", default="build/clmha")
    ap.add_argument("--cache-lens", default="4096,8192,16384,32768")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--embed", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default=None)
    ap.add_argument("--torch2-python", default="/tmp/venv-torch2/bin/python")
    ap.add_argument("--no-torch2", action="store_true")
    ap.add_argument("--gqa-kv-heads", type=int, default=2,
                    help="also time clmha with this many key/value heads (grouped-query "
                         "attention; 0: not)")
    ap.add_argument("--json", default=None, help="write the results to this file")
    ap.add_argument("--worker", nargs=5, type=int, metavar=("N", "S", "E", "H", "R"))
    return ap.parse_args(argv)


def run_json(cmd, env):
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip()}")
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    return [json.loads(ln) for ln in lines]


def main(argv):
    a = parse_args(argv)
    if a.worker:
        worker(*a.worker, a.threads)
        return 0
    lens = [int(v) for v in a.cache_lens.split(",")]
    base = dict(os.environ)
    t = str(a.threads)
    base.update(OMP_NUM_THREADS=t, OPENBLAS_NUM_THREADS=t, MKL_NUM_THREADS=t)
    base.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    clmha_env = dict(base, POCL_CPU_MAX_CU_NUM=t)
    torch_env = openblas_core.with_coretype(base)
    torch1_env = dict(torch_env)
    openblas = next((d for d in OPENBLAS_DIRS if os.path.exists(os.path.join(d, "libblas.so.3"))),
                    None)
    if openblas:
        old = torch1_env.get("LD_LIBRARY_PATH")
        torch1_env["LD_LIBRARY_PATH"] = openblas + (":" + old if old else "")
    peers = {"torch1": ("/usr/bin/python3", torch1_env)}
    if not a.no_torch2 and os.access(a.torch2_python, os.X_OK):
        peers["torch2"] = (a.torch2_python, torch_env)
    me = os.path.abspath(__file__)
    res = {s: {"clmha": [], "copy": [], "fraction": [], "gqa": [], **{p: [] for p in peers}}
           for s in lens}
    versions = {}
    for r in range(a.rounds):
        for s in lens:
            cmd = [a.clmha, "bench", "--decode", "--json", "--cache-len", str(s), "--batch",
                   str(a.batch), "--embed", str(a.embed), "--heads", str(a.heads), "--repeat",
                   str(a.repeat)]
            if a.device is not None:
                cmd += ["--device", a.device]
            c = run_json(cmd, clmha_env)[0]
            res[s]["clmha"].append(c["ms"])
            res[s]["copy"].append(c["copy_gbps"])
            res[s]["fraction"].append(c["fraction_of_copy"])
            if a.gqa_kv_heads:
                g = run_json(cmd + ["--kv-heads", str(a.gqa_kv_heads)], clmha_env)[0]
                res[s]["gqa"].append(g["ms"])
            for p, (py, env) in peers.items():
                w = run_json([py, me, "--worker", str(a.batch), str(s), str(a.embed),
                              str(a.heads), str(a.repeat)], env)[0]
                res[s][p].append(w["ms"])
                versions[p] = f"{w['torch']} ({w['attention']})"
        print(f"round {r + 1}/{a.rounds} done", file=sys.stderr)
    d = a.embed // a.heads
    print(f"decode step: N {a.batch}, E {a.embed}, H {a.heads} (D {d}), {a.threads} threads, "
          f"{a.rounds} rounds of {a.repeat} steps; medians over rounds")
    for p, v in versions.items():
        print(f"  {p}: PyTorch {v}")
    head = ["cache S", "clmha ms", "kv GB/s", "copy GB/s", "of copy"]
    if a.gqa_kv_heads:
        head += [f"clmha {a.gqa_kv_heads} kv heads ms", "speed-up"]
    for p in peers:
        head += [f"{p} ms", f"clmha/{p}"]
    print(" | ".join(head))
    out = []
    for s in lens:
        m = {k: statistics.median(v) for k, v in res[s].items() if v}
        kv = 2.0 * a.batch * a.heads * (s + 1) * d * 4
        row = [str(s), f"{m['clmha']:.3f}", f"{kv / m['clmha'] / 1e6:.1f}", f"{m['copy']:.1f}",
               f"{m['fraction']:.2f}"]
        entry = {"cache_len": s, "kv_bytes": kv, **{k: m[k] for k in m}}
        if a.gqa_kv_heads:
            row += [f"{m['gqa']:.3f}", f"{m['clmha'] / m['gqa']:.2f}"]
            entry["gqa_speedup"] = m["clmha"] / m["gqa"]
        for p in peers:
            row += [f"{m[p]:.3f}", f"{m['clmha'] / m[p]:.2f}"]
            entry[f"clmha_over_{p}"] = m["clmha"] / m[p]
        print(" | ".join(row))
        out.append(entry)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"batch": a.batch, "embed": a.embed, "heads": a.heads,
                       "threads": a.threads, "rounds": a.rounds, "repeat": a.repeat,
                       "versions": versions, "results": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
