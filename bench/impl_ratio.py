#!/usr/bin/env python3
"""Fused against unfused attention core, side by side in one run.

For each source length S (self-attention, L = S) this runs `clmha bench --impl fused` and
`clmha bench --impl unfused` alternately, ROUNDS times each, and reports the median of the
per-run medians, the fused/unfused time ratio, each core's time in the attention stages alone
(fused vs scores + softmax + av, from the profiled run) and each layer's device scratch.

    /usr/bin/python3 bench/impl_ratio.py                  # S = 1024, 2048, 4096; N 1, E 512, H 8
    /usr/bin/python3 bench/impl_ratio.py --lengths 512 1024 --batch 2 --rounds 5

Needs only the clmha program (build/clmha by default); no third-party Python package.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench(clmha, impl, n, length, e, h, repeat, device):
    cmd = [clmha, "bench", "--json", "--impl", impl, "--batch", str(n), "--tgt-len", str(length),
           "--embed", str(e), "--heads", str(h), "--repeat", str(repeat)]
    if device:
        cmd += ["--device", device]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"impl_ratio: {' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clmha", default=os.path.join(ROOT, "build", "clmha"))
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--embed", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="alternating runs per core (default 3)")
    ap.add_argument("--repeat", type=int, default=3, help="timed forwards per run (default 3)")
    ap.add_argument("--device", help="clmha --device SPEC")
    ap.add_argument("--json", help="also write the raw results to this file")
    a = ap.parse_args(argv)

    rows, raw = [], []
    for length in a.lengths:
        runs = {"fused": [], "unfused": []}
        for _ in range(a.rounds):
            for impl in ("fused", "unfused"):
                r = bench(a.clmha, impl, a.batch, length, a.embed, a.heads, a.repeat, a.device)
                if r["impl"] != impl:
                    sys.exit(f"impl_ratio: asked for {impl}, clmha ran {r['impl']}")
                runs[impl].append(r)
                raw.append(r)
        med = {k: statistics.median(x["ms"] for x in v) for k, v in runs.items()}
        core = {"fused": statistics.median(x["stages"]["fused"] for x in runs["fused"]),
                "unfused": statistics.median(x["stages"]["scores"] + x["stages"]["softmax"] +
                                             x["stages"]["av"] for x in runs["unfused"])}
        scratch = {k: v[0]["scratch_bytes"] for k, v in runs.items()}
        rows.append((length, med, core, scratch, runs["fused"][0]["device"]))

    print(f"device: {rows[0][4]}")
    print(f"N {a.batch}, E {a.embed}, H {a.heads}, self-attention L = S; medians of {a.rounds} "
          f"alternating runs x {a.repeat} forwards")
    print(f"{'S':>6} {'fused ms':>10} {'unfused ms':>11} {'ratio':>7} {'core ratio':>11} "
          f"{'fused MiB':>10} {'unfused MiB':>12}")
    for length, med, core, scratch, _ in rows:
        print(f"{length:>6} {med['fused']:>10.1f} {med['unfused']:>11.1f} "
              f"{med['fused'] / med['unfused']:>7.3f} {core['fused'] / core['unfused']:>11.3f} "
              f"{scratch['fused'] / 2**20:>10.1f} {scratch['unfused'] / 2**20:>12.1f}")
    print("ratio: fused / unfused time per forward (< 1: fused faster); core ratio: the fused "
          "stage against scores + softmax + av, from one profiled run each")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(raw, f, indent=1)


if __name__ == "__main__":
    main()
