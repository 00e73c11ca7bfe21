#!/usr/bin/env python3
"""Layers of other dtypes against float32, side by side in one run.

For each shape this runs `clmha bench --dtype T` for each dtype T (default f32, f16, bf16; f64
with --dtypes f32 f64) in turn, ROUNDS times each, and reports per dtype the median of the
per-run medians, its ratio to float32, the GFLOP/s, the bytes of the call's inputs and outputs
(halved in 16 bits, doubled in float64) and the layer's scratch (16-bit layers keep float32
copies of their tensors there). Optionally under one driver lane (tools/ocl-driver.sh).

    /usr/bin/python3 bench/dtype_ratio.py                        # N 8, L 128 and N 1, L 2048
    /usr/bin/python3 bench/dtype_ratio.py --driver intel --rounds 3
    /usr/bin/python3 bench/dtype_ratio.py --shapes 8x128 --rounds 7
    /usr/bin/python3 bench/dtype_ratio.py --dtypes f32 f64
    /usr/bin/python3 bench/dtype_ratio.py --backward --dtypes f32 bf16 f16   # training steps
    /usr/bin/python3 bench/dtype_ratio.py --decode --dtypes f32 f64 --shapes 1x4096 8x1024

With --backward each call times a training step (`clmha bench --backward`: the forward with
save and the backward pass, gradients in the layer's dtype) instead of a forward call; with
--decode a decode step (`clmha bench --decode`: one new token per sequence over a KV cache of
S tokens, shapes NxS; the cache of the default kind, doubles for f64) and the bytes of keys and
values it reads.

Needs only the clmha program (build/clmha by default); no third-party Python package.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench(args, dtype, n, length):
    cmd = [args.clmha, "bench", "--json", "--dtype", dtype, "--batch", str(n), "--embed",
           str(args.embed), "--heads", str(args.heads), "--repeat", str(args.repeat)]
    cmd += ["--decode", "--cache-len", str(length)] if args.decode else ["--tgt-len", str(length)]
    if args.backward:
        cmd.append("--backward")
    if args.driver:
        cmd = [os.path.join(ROOT, "tools", "ocl-driver.sh"), args.driver, "--"] + cmd
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"dtype_ratio: {' '.join(cmd)} failed ({done.returncode}): "
                 f"{done.stderr.strip()}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clmha", default=os.path.join(ROOT, "build", "clmha"))
    ap.add_argument("--shapes", nargs="+", default=["8x128", "1x2048"],
                    help="NxL (self-attention, L = S)")
    ap.add_argument("--embed", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=5, help="timed runs per clmha bench call")
    ap.add_argument("--rounds", type=int, default=5, help="calls per dtype, interleaved")
    ap.add_argument("--backward", action="store_true",
                    help="time training steps (forward with save + backward)")
    ap.add_argument("--decode", action="store_true",
                    help="time decode steps over a KV cache (shapes NxS: S cached tokens)")
    ap.add_argument("--driver", help="tools/ocl-driver.sh lane (default: the default device)")
    ap.add_argument("--dtypes", nargs="+", default=["f32", "f16", "bf16"],
                    choices=["f32", "f64", "f16", "bf16"], help="the first is the baseline")
    args = ap.parse_args(argv)
    dtypes = args.dtypes
    if args.backward and args.decode:
        sys.exit("dtype_ratio: --backward or --decode, not both")
    if args.decode:
        print(f"| shape | dtype | median ms per token | vs {args.dtypes[0]} | K/V read (bytes) | "
              "K/V GB/s |")
        print("|---|---|---|---|---|---|")
    else:
        print(f"| shape | dtype | median ms | vs {args.dtypes[0]} | GFLOP/s | tensors (bytes) | "
              "scratch (MiB) |")
        print("|---|---|---|---|---|---|---|")
    device = None
    for shape in args.shapes:
        n, length = (int(x) for x in shape.split("x"))
        runs = {t: [] for t in dtypes}
        for _ in range(args.rounds):
            for t in dtypes:
                r = bench(args, t, n, length)
                device = r["device"]
                runs[t].append(r)
        base = statistics.median(r["ms"] for r in runs[dtypes[0]])
        for t in dtypes:
            ms = statistics.median(r["ms"] for r in runs[t])
            last = runs[t][-1]
            if args.decode:
                print(f"| N {n}, S {length} | {last['dtype']} | {ms:.4f} | {ms / base:.2f} | "
                      f"{last['kv_bytes']:.0f} | {last['kv_bytes'] / ms / 1e6:.1f} |")
                continue
            print(f"| N {n}, L {length} | {last['dtype']} | {ms:.3f} | {ms / base:.2f} | "
                  f"{last['flops'] / ms / 1e6:.1f} | {last.get('io_bytes', '-')} | "
                  f"{last['scratch_bytes'] / 2**20:.1f} |")
    what = ("training steps" if args.backward else "decode steps" if args.decode
            else "forward calls")
    print(f"\n{what}; device: {device}; E {args.embed}, H {args.heads}; medians of {args.rounds} "
          f"interleaved calls of {args.repeat} timed runs each")


if __name__ == "__main__":
    main()
