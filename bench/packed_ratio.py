#!/usr/bin/env python3
"""A packed variable-length batch against the same sequences padded, side by side in one run.

N sequences (default 8) of lengths drawn uniformly from [--lo, --hi] (default 64 … 448; seed 8:
40% of the padded batch is padding), E 512, H 8, self-attention, float32, the default device.
Two calls of one clmha.Layer on NumPy arrays (clmha_layer_forward_host: the inputs are copied in
and the results out on every call):

  packed   query (T, E), T the sum of the lengths, seq_lens= (clmha_forward_args::seq_lens):
           every sequence's projections and attention over its own tokens only;
  padded   query (N, L_max, E) batch first, the tokens beyond each length zero, and a boolean
           key_padding_mask (N, L_max) that hides them (PyTorch's way without NestedTensors).

The forward alone (need_weights=False: the fused core) and the training step (forward with
save, then Layer.backward: the gradients of the query and of every parameter, read back). The
two run in interleaved rounds: each round times --repeat calls of each (after one untimed
call; the order alternates with the round) and keeps their median; the table gives the median
over the rounds of each, and the ratio padded / packed, against the target 0.85 / (1 - p), p the
padded batch's fraction of padding tokens.

    /tmp/build-py/venv/bin/python bench/packed_ratio.py [--rounds 5] [--repeat 3] [--causal]
        [--n 8] [--lo 64] [--hi 448] [--seed 8] [--embed 512] [--heads 8] [--json FILE]

Needs a Python where `import clmha` works (pip install .) and NumPy.
"""
import argparse
import json
import statistics
import time

import numpy as np

import clmha


def timed(fn, repeat):
    fn()  # untimed: scratch, kernels
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--lo", type=int, default=64)
    ap.add_argument("--hi", type=int, default=448)
    ap.add_argument("--seed", type=int, default=8)  # 40% padding
    ap.add_argument("--embed", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args()

    rng = np.random.default_rng(a.seed)
    lens = rng.integers(a.lo, a.hi + 1, a.n).tolist()
    n, e, lmax, t = a.n, a.embed, max(lens), sum(lens)
    pad = 1.0 - t / (n * lmax)
    layer = clmha.Layer(e, a.heads, batch_first=True)
    bound = 1.0 / np.sqrt(e)
    layer.load_state_dict({
        "in_proj_weight": rng.uniform(-bound, bound, (3 * e, e)).astype(np.float32),
        "in_proj_bias": rng.uniform(-bound, bound, 3 * e).astype(np.float32),
        "out_proj.weight": rng.uniform(-bound, bound, (e, e)).astype(np.float32),
        "out_proj.bias": rng.uniform(-bound, bound, e).astype(np.float32)})
    packed_q = rng.standard_normal((t, e)).astype(np.float32)
    padded_q = np.zeros((n, lmax, e), np.float32)
    kpm = np.ones((n, lmax), bool)
    t0 = 0
    for i, length in enumerate(lens):
        padded_q[i, :length] = packed_q[t0:t0 + length]
        kpm[i, :length] = False
        t0 += length
    packed_gy = rng.standard_normal((t, e)).astype(np.float32)
    padded_gy = np.zeros_like(padded_q)
    t0 = 0
    for i, length in enumerate(lens):
        padded_gy[i, :length] = packed_gy[t0:t0 + length]
        t0 += length

    def forward(packed):
        if packed:
            return lambda: layer.forward(packed_q, seq_lens=lens, is_causal=a.causal)
        return lambda: layer.forward(padded_q, key_padding_mask=kpm, is_causal=a.causal)

    def step(packed):
        def run():
            s = layer.saved()
            if packed:
                layer.forward(packed_q, seq_lens=lens, is_causal=a.causal, save=s)
                layer.backward(s, packed_gy)
            else:
                layer.forward(padded_q, key_padding_mask=kpm, is_causal=a.causal, save=s)
                layer.backward(s, padded_gy)
        return run

    # The packed call's output is the padded call's real rows (a check, not a timing).
    out_p, _ = layer.forward(packed_q, seq_lens=lens, is_causal=a.causal)
    out_d, _ = layer.forward(padded_q, key_padding_mask=kpm, is_causal=a.causal)
    rows = np.concatenate([out_d[i, :length] for i, length in enumerate(lens)])
    agree = float(np.abs(out_p - rows).max())

    results = {}
    for what, make in (("forward", forward), ("training step", step)):
        got = {True: [], False: []}
        for r in range(a.rounds):
            for packed in ((True, False) if r % 2 == 0 else (False, True)):
                got[packed].append(timed(make(packed), a.repeat))
        p_ms = statistics.median(got[True]) * 1e3
        d_ms = statistics.median(got[False]) * 1e3
        results[what] = {"packed_ms": p_ms, "padded_ms": d_ms, "ratio": d_ms / p_ms}

    target = 0.85 / (1.0 - pad)
    print(f"device: {clmha.default_context().device_name}")
    print(f"lengths {lens} (T {t}, L_max {lmax}, padding {pad:.1%}), E {e}, H {a.heads}"
          f"{', causal' if a.causal else ''}; packed vs padded rows: max |diff| {agree:.2e}")
    print(f"{'':14} {'packed ms':>10} {'padded ms':>10} {'padded/packed':>14} "
          f"{'target':>8}")
    for what, r in results.items():
        print(f"{what:14} {r['packed_ms']:10.1f} {r['padded_ms']:10.1f} {r['ratio']:14.2f} "
              f"{target:8.2f} {'met' if r['ratio'] >= target else 'NOT met'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"lengths": lens, "padding": pad, "target": target, "causal": a.causal,
                       "max_abs_diff": agree, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
