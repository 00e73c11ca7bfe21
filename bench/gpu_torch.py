#!/usr/bin/env python3
"""clmha on a GPU against PyTorch on the same GPU (CUDA), side by side in one run.

For each shape this runs `clmha bench --json` (the OpenCL device $CLMHA_DEVICE or --device
selects, normally the GPU's) and PyTorch's nn.MultiheadAttention on CUDA in turns, ROUNDS
times each: the forward pass (need_weights=False, eval) and, with --backward, the training step
(forward + backward of a sum of the output, as `clmha bench --backward` times it). Each turn
reports the median of REPEAT timed calls after warm-ups; the table gives the median over the
turns and clmha's time over PyTorch's (a ratio above 1: clmha slower). The same layer sizes,
float32 (PyTorch's default: no TF32, torch.backends.cuda.matmul.allow_tf32 left False).

    python3 bench/gpu_torch.py --clmha build/clmha                 # N 8, E 1024, H 16; L 512, 1024
    python3 bench/gpu_torch.py --lengths 256 2048 --batch 4 --backward --rounds 5

Needs a CUDA build of PyTorch and a GPU OpenCL driver (the NVIDIA one on an NVIDIA GPU).
Figures: docs/performance.md, "On a GPU".
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def clmha_turn(a, length, backward):
    cmd = [a.clmha, "bench", "--json", "--batch", str(a.batch), "--tgt-len", str(length),
           "--embed", str(a.embed), "--heads", str(a.heads), "--repeat", str(a.repeat)]
    if backward:
        cmd.append("--backward")
    if a.device:
        cmd += ["--device", a.device]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"gpu_torch: {' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def torch_turn(torch, a, length, backward):
    m = torch.nn.MultiheadAttention(a.embed, a.heads).cuda()  # (L, N, E), as clmha bench
    x = torch.randn(length, a.batch, a.embed, device="cuda", requires_grad=backward)
    m.train(backward)

    def call():
        if backward:
            y, _ = m(x, x, x, need_weights=False)
            y.sum().backward()
        else:
            with torch.no_grad():
                m(x, x, x, need_weights=False)

    for _ in range(3):
        call()
    times = []
    for _ in range(a.repeat):
        torch.cuda.synchronize()
        t = time.perf_counter()
        call()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clmha", default=os.path.join(ROOT, "build", "clmha"))
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--embed", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="turns per side (default 3)")
    ap.add_argument("--repeat", type=int, default=20, help="timed calls per turn (default 20)")
    ap.add_argument("--backward", action="store_true", help="also time the training step")
    ap.add_argument("--device", help="clmha --device SPEC")
    a = ap.parse_args(argv)
    import torch  # here, so that --help works without it
    if not torch.cuda.is_available():
        sys.exit("gpu_torch: PyTorch sees no CUDA device")

    print(f"clmha {a.clmha} against torch {torch.__version__} on {torch.cuda.get_device_name()}; "
          f"N {a.batch}, E {a.embed}, H {a.heads}, float32, {a.rounds} rounds")
    print(f"{'pass':9} {'L':>6} {'clmha ms':>9} {'torch ms':>9} {'ratio':>6}  device (clmha)")
    for backward in ([False, True] if a.backward else [False]):
        for length in a.lengths:
            ours, theirs, device = [], [], ""
            for _ in range(a.rounds):
                r = clmha_turn(a, length, backward)
                ours.append(r["ms"])
                device = r["device"]
                theirs.append(torch_turn(torch, a, length, backward))
            mo, mt = statistics.median(ours), statistics.median(theirs)
            name = "step" if backward else "forward"
            print(f"{name:9} {length:6d} {mo:9.3f} {mt:9.3f} {mo / mt:6.2f}  {device}")


if __name__ == "__main__":
    main()
