#!/usr/bin/env python3
"""Attention variants against the plain call, side by side in one run.

For each shape this runs `clmha bench` for the plain layer and for each variant (soft-capping,
ALiBi, sinks, a sliding window; ALiBi and the window as user functions, bench/mods/*.cl; the
`--variants` names below) in turn, ROUNDS times each, interleaved, and reports
per variant the median of the per-run medians of the whole call and of its attention stage
(`stages.fused` of the JSON line, or the three unfused stages), and their ratios to the plain
call. With --backward the training step (forward + backward) instead; with --causal every call
is causal. Optionally under one driver lane (tools/ocl-driver.sh).

    /usr/bin/python3 bench/variant_ratio.py                          # N 1, L 2048 and 4096
    /usr/bin/python3 bench/variant_ratio.py --shapes 1x16384 --causal --rounds 3 --repeat 2
    /usr/bin/python3 bench/variant_ratio.py --backward --shapes 8x128 1x2048
    /usr/bin/python3 bench/variant_ratio.py --variants softcap alibi --driver intel
    /usr/bin/python3 bench/variant_ratio.py --variants alibi user-alibi window user-window \
        --causal --shapes 1x4096 1x16384

Needs only the clmha program (build/clmha by default); no third-party Python package.
"""
import argparse
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The variants' `clmha bench` flags (softcap 50: Gemma 2's attention cap).
VARIANTS = {
    "plain": [],
    "softcap": ["--softcap", "50"],
    "alibi": ["--alibi"],
    "sinks": ["--sinks"],
    "all": ["--softcap", "50", "--alibi", "--sinks"],
    "window": ["--window", "1023,0"],
    # ALiBi as clmha_score_mod (p: the geometric slopes, written per head count), and the window
    # (1023, 0) as clmha_mask_mod, against the built-in ones.
    "user-alibi": ["--score-mod", os.path.join(ROOT, "bench", "mods", "alibi.cl"),
                   "--mod-params", "{slopes}"],
    "user-window": ["--score-mod", os.path.join(ROOT, "bench", "mods", "window.cl"),
                    "--mod-params", "{window}"],
}


def write_npy(path, values):
    """A 1-D float32 .npy of @values (no NumPy needed)."""
    header = "{'descr': '<f4', 'fortran_order': False, 'shape': (%d,), }" % len(values)
    header += " " * (63 - (10 + len(header)) % 64) + "\n"
    with open(path, "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode())
        f.write(struct.pack("<%df" % len(values), *values))


def alibi_slopes(heads):
    """The ALiBi paper's slopes (clmha_alibi_slopes())."""
    p = 1 << (heads.bit_length() - 1)
    base = [2.0 ** (-8.0 * (h + 1) / p) for h in range(p)]
    extra = [2.0 ** (-8.0 * (h + 1) / (2 * p)) for h in range(2 * p)][0::2]
    return (base + extra)[:heads]


def bench(args, variant, n, length):
    cmd = [args.clmha, "bench", "--json", "--batch", str(n), "--tgt-len", str(length),
           "--embed", str(args.embed), "--heads", str(args.heads), "--repeat", str(args.repeat)]
    cmd += [a.format(**args.files) for a in VARIANTS[variant]]
    if args.causal:
        cmd.append("--causal")
    if args.backward:
        cmd.append("--backward")
    if args.driver:
        cmd = [os.path.join(ROOT, "tools", "ocl-driver.sh"), args.driver, "--"] + cmd
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"variant_ratio: {' '.join(cmd)} failed ({done.returncode}): "
                 f"{done.stderr.strip()}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def attention_ms(run):
    """The attention stage of a forward bench line (fused, or the unfused core's three)."""
    st = run.get("stages") or {}
    return sum(st.get(k, 0.0) for k in ("fused", "scores", "softmax", "av")) or None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clmha", default=os.path.join(ROOT, "build", "clmha"))
    ap.add_argument("--shapes", nargs="+", default=["1x2048", "1x4096"],
                    help="NxL (self-attention, L = S)")
    ap.add_argument("--embed", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=5, help="timed runs per clmha bench call")
    ap.add_argument("--rounds", type=int, default=5, help="calls per variant, interleaved")
    ap.add_argument("--causal", action="store_true", help="every call is_causal")
    ap.add_argument("--backward", action="store_true", help="the training step")
    ap.add_argument("--driver", help="tools/ocl-driver.sh lane (default: the default device)")
    ap.add_argument("--variants", nargs="+", default=["softcap", "alibi", "sinks", "all"],
                    choices=[v for v in VARIANTS if v != "plain"])
    args = ap.parse_args(argv)
    names = ["plain"] + args.variants
    tmp = tempfile.TemporaryDirectory()
    args.files = {"slopes": os.path.join(tmp.name, "slopes.npy"),
                  "window": os.path.join(tmp.name, "window.npy")}
    write_npy(args.files["slopes"], alibi_slopes(args.heads))
    write_npy(args.files["window"], [1023.0])
    what = "step" if args.backward else "forward"
    print(f"| shape | variant | {what} ms | vs plain | attention ms | vs plain |")
    print("|---|---|---|---|---|---|")
    device = None
    for shape in args.shapes:
        n, length = (int(x) for x in shape.split("x"))
        runs = {v: [] for v in names}
        for _ in range(args.rounds):
            for v in names:
                runs[v].append(bench(args, v, n, length))
        device = runs["plain"][0].get("device")
        whole = {v: statistics.median(r["ms"] for r in runs[v]) for v in names}
        stage = {}
        for v in names:
            xs = [attention_ms(r) for r in runs[v]]
            stage[v] = statistics.median(xs) if all(x is not None for x in xs) else None
        for v in names:
            s = stage[v]
            s_text = "—" if s is None else f"{s:.1f}"
            s_ratio = "—" if s is None or not stage["plain"] else f"{s / stage['plain']:.2f}"
            print(f"| N {n}, L {length}{' causal' if args.causal else ''} | {v} | "
                  f"{whole[v]:.1f} | {whole[v] / whole['plain']:.2f} | {s_text} | {s_ratio} |")
        for user, builtin in (("user-alibi", "alibi"), ("user-window", "window")):
            if user in whole and builtin in whole:
                print(f"| N {n}, L {length} | {user} / {builtin} | | "
                      f"{whole[user] / whole[builtin]:.2f} | | "
                      f"{'—' if not stage[builtin] else f'{stage[user] / stage[builtin]:.2f}'} |")
    print(f"\ndevice: {device}; {args.rounds} interleaved rounds, each the median of "
          f"{args.repeat} runs; medians of the rounds")


if __name__ == "__main__":
    main()
