#!/usr/bin/env python3
"""clmha's training step (forward + backward) side by side with PyTorch's, on the CPU.

Run from the repository root with Debian's Python after building clmha:

    /usr/bin/python3 bench/backward_peers.py [--clmha build/clmha] [--impl auto[,fused,unfused]]
        [--same-blas] [--shapes NxL ...] [--rounds 3] [--repeat 5]
        [--torch2-python PATH | --no-torch2]
        [--memory-length 16384 | --no-memory] [--memory-limit-gib 10] [--json FILE]

Peers, every one in its own process, run in turns (clmha, PyTorch 1.13, PyTorch 2, then again)
so that a busy machine slows them alike; each process times R steps after a warm-up step and
reports their median; the table gives the median over the rounds:
  clmha        `clmha bench --backward --json --batch-first --impl I` (device buffers; forward
               with args.save, then clmha_layer_backward() for the gradients of the query and of
               every parameter; a random layer and grad_output), once per core of --impl
               (default auto, what a caller gets: at L >= 512 its forward runs the host fused
               core, its backward the fused core's);
  torch 1.13   Debian's python3-torch (/usr/bin/python3): nn.MultiheadAttention(E, H,
               batch_first=True) in train mode (dropout 0), x = randn(N, L, E) with
               requires_grad, out, _ = mha(x, x, x, need_weights=False), then
               out.backward(g) (the gradient of sum(out * g), g = randn(N, L, E)); the gradients
               are set to None before every step, so they are written, not accumulated;
  torch 2      the same code under PyTorch 2.x from PyPI (a venv, --torch2-python), whose
               nn.MultiheadAttention calls F.scaled_dot_product_attention when need_weights is
               False (a flash-attention kernel on the CPU, forward and backward).
Threads: 2 everywhere (torch.set_num_threads, OMP_NUM_THREADS, OPENBLAS_NUM_THREADS,
MKL_NUM_THREADS; POCL_CPU_MAX_CU_NUM for clmha's PoCL device, which has 2 compute units here
anyway); OMP_WAIT_POLICY=PASSIVE for PyTorch (as bench/compare.py: PyTorch's spinning OpenMP
threads fight OpenBLAS's), the default for clmha (whose oneDNN was slower with PASSIVE).
--same-blas adds, per core, a clmha peer whose products run in OpenBLAS with the PyTorch
processes' OPENBLAS_CORETYPE (CLMHA_HOST_BLAS=libopenblas.so.0): the same BLAS on both sides.
OPENBLAS_CORETYPE for this CPU (bench/openblas_core.py: Cooperlake, SkylakeX or Haswell) for the
PyTorch processes: OpenBLAS 0.3.21 takes AMD's Zen 3 and 4 for a Prescott otherwise and runs sgemm
~5x slower. Debian's PyTorch loads
libblas.so.3, which is the reference BLAS unless OpenBLAS is installed and selected: this script
puts libopenblas0-pthread's directory (or --openblas-dir) first on LD_LIBRARY_PATH of the
PyTorch 1.13 processes, and prints the BLAS each peer loaded.

FLOPs (the same for every peer, as `clmha bench --backward` counts them): P = the forward's
projection GEMMs = 8*N*L*E^2 and A = its attention products (Q K^T, weights V) = 4*N*L^2*E
(self-attention, S = L); forward = P + A, backward = 2*P + 2.5*A (FlashAttention's convention:
the backward's 5 attention products against the forward's 2), step = 3*P + 3.5*A.
GFLOP/s = FLOPs / median time. Ratios are clmha's time / the peer's (above 1: clmha slower),
one column per clmha core.

Memory (--memory-length, default 16384, N 1): one step of each peer in a fresh process (clmha:
`clmha bench --backward --repeat 0`, its first step, which also gives the step's time); its peak
resident memory comes from os.wait4 (the child's own ru_maxrss, as getrusage(RUSAGE_CHILDREN)
gives it for one child). The PyTorch processes run under RLIMIT_AS = --memory-limit-gib (default
10 GiB, so that the shared machine's other work is not pushed into the OOM killer): PyTorch
1.13's MultiheadAttention materialises the N*H*L*S scores (8 GiB at L 16384) and its backward
more; where an allocation fails the table says in which pass and what it asked for. clmha's
line also gives its own accounting: layer scratch + saved state + the backward's scratch.

Internal: --worker time|memory N L E H R runs one PyTorch peer and prints one JSON line.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import openblas_core  # bench/openblas_core.py

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OPENBLAS_DIRS = ["/usr/lib/x86_64-linux-gnu/openblas-pthread",
                 "/usr/lib/aarch64-linux-gnu/openblas-pthread"]
DEFAULT_SHAPES = [(1, 2048), (8, 128)]
DEFAULT_TORCH2 = "/tmp/venv-torch2/bin/python3"
GIB = 1024 ** 3
MIB = 1024 ** 2


# ---- the PyTorch worker (runs in its own process) ------------------------------------------------

def rss_now():
    """Resident bytes of this process now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def loaded_blas():
    """Names of the BLAS libraries mapped into this process."""
    libs = set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            base = os.path.basename(parts[-1]) if len(parts) >= 6 else ""
            if any(k in base for k in ("blas", "mkl", "blis")):
                libs.add(base)
    return sorted(libs)


def worker(mode, n, l, e, h, repeat, threads):
    """One PyTorch peer: `time` prints the medians of `repeat` steps after a warm-up; `memory`
    runs one step and prints the resident memory after each part (or where it failed)."""
    import torch
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(e, h, batch_first=True)
    mha.train()
    x = torch.randn(n, l, e, requires_grad=True)
    g = torch.randn(n, l, e)
    config = torch.__config__.show()
    blas_info = config.split("BLAS_INFO=", 1)[1].split(",", 1)[0] if "BLAS_INFO=" in config \
        else "?"
    info = {"torch": torch.__version__, "threads": torch.get_num_threads(),
            "blas_info": blas_info, "blas": loaded_blas()}

    def clear():
        x.grad = None
        mha.zero_grad(set_to_none=True)

    if mode == "memory":
        info["rss_setup"] = rss_now()
        stage = "forward"
        try:
            out, _ = mha(x, x, x, need_weights=False)
            info["rss_after_forward"] = rss_now()
            stage = "backward"
            out.backward(g)
            info["rss_after_backward"] = rss_now()
            info["ok"] = True
        except (RuntimeError, MemoryError) as err:
            info["ok"] = False
            info["failed_in"] = stage
            info["error"] = " ".join(str(err).split())[:300]
        info["peak_rss"] = rss_peak()
        print(json.dumps(info), flush=True)
        return 0

    step, fwd, bwd = [], [], []
    for i in range(repeat + 1):  # the first is the warm-up
        clear()
        t0 = time.perf_counter()
        out, _ = mha(x, x, x, need_weights=False)
        t1 = time.perf_counter()
        out.backward(g)
        t2 = time.perf_counter()
        if i:
            step.append((t2 - t0) * 1e3)
            fwd.append((t1 - t0) * 1e3)
            bwd.append((t2 - t1) * 1e3)
    info.update(ms=statistics.median(step), forward_ms=statistics.median(fwd),
                backward_ms=statistics.median(bwd), peak_rss=rss_peak())
    print(json.dumps(info), flush=True)
    return 0


# ---- the driver ----------------------------------------------------------------------------------

def parse_args(argv):
    ap = argparse.ArgumentParser(
        description="clmha's forward + backward against PyTorch 1.13 and 2.x on the CPU: "
                    "ms, GFLOP/s, time ratios, peak memory.",
        epilog="Shapes: NxL (self-attention, S = L), E and H from --embed and --heads. "
               "Default: 1x2048 and 8x128.")
    ap.add_argument("--clmha", default=os.path.join(ROOT, "build", "clmha"),
                    help="the built clmha program (default: build/clmha)")
    ap.add_argument("--device", help="clmha --device SPEC")
    ap.add_argument("--impl", default="auto",
                    help="clmha's attention core, forward and backward: auto, fused, unfused, "
                    "or several (e.g. auto,fused: each is a peer of its own); default auto")
    ap.add_argument("--same-blas", action="store_true",
                    help="also time clmha with its products in OpenBLAS set up as for PyTorch "
                    "1.13 (CLMHA_HOST_BLAS=libopenblas.so.0, OPENBLAS_CORETYPE for this CPU): "
                    "a peer of its own per core")
    ap.add_argument("--shapes", nargs="+", metavar="NxL", help="timed shapes")
    ap.add_argument("--embed", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3,
                    help="turns of every peer per shape (default 3)")
    ap.add_argument("--repeat", type=int, default=5,
                    help="timed steps per turn, after a warm-up (default 5)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--torch1-python", default="/usr/bin/python3",
                    help="Python with PyTorch 1.13 (default: Debian's /usr/bin/python3)")
    ap.add_argument("--torch2-python", default=DEFAULT_TORCH2,
                    help="Python with PyTorch 2.x (default: " + DEFAULT_TORCH2 + "; skipped "
                    "with a note when it is missing)")
    ap.add_argument("--no-torch2", action="store_true", help="leave PyTorch 2 out")
    ap.add_argument("--openblas-dir",
                    help="folder with OpenBLAS's libblas.so.3 for Debian's PyTorch (default: "
                    "libopenblas0-pthread's, when installed)")
    ap.add_argument("--memory-length", type=int, default=16384,
                    help="L = S of the memory case, N 1 (default 16384)")
    ap.add_argument("--no-memory", action="store_true", help="leave the memory case out")
    ap.add_argument("--memory-limit-gib", type=float, default=10.0,
                    help="RLIMIT_AS of the PyTorch processes in the memory case (default 10)")
    ap.add_argument("--json", metavar="FILE", help="also write every measurement here")
    ap.add_argument("--worker", nargs=6, metavar=("MODE", "N", "L", "E", "H", "R"),
                    help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return a
    if a.rounds < 1 or a.repeat < 1 or a.threads < 1:
        ap.error("--rounds, --repeat and --threads must be at least 1")
    if a.embed % a.heads:
        ap.error(f"--embed {a.embed} is not a multiple of --heads {a.heads}")
    a.impls = list(dict.fromkeys(a.impl.split(",")))
    if not a.impls or any(i not in ("auto", "fused", "unfused") for i in a.impls):
        ap.error(f"--impl {a.impl}: expected auto, fused or unfused, or a list of them")
    a.shape_list = DEFAULT_SHAPES
    if a.shapes:
        try:
            a.shape_list = [tuple(int(v) for v in s.lower().split("x")) for s in a.shapes]
        except ValueError:
            a.shape_list = [()]
        if any(len(s) != 2 or min(s) < 1 for s in a.shape_list):
            ap.error("--shapes: expected NxL with positive integers, e.g. 1x2048")
    return a


def flops(n, l, e):
    """(projections P, attention A) of one self-attention forward pass."""
    return 8.0 * n * l * e * e, 4.0 * n * l * l * e


def cpu_name():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "?"


class Peers:
    """How to start each peer: command lines and environments."""

    def __init__(self, a):
        self.a = a
        base = dict(os.environ)
        t = str(a.threads)
        base.update(OMP_NUM_THREADS=t, OPENBLAS_NUM_THREADS=t, MKL_NUM_THREADS=t)
        # clmha keeps OpenMP's default wait policy: PASSIVE made its oneDNN products slower (a
        # step at N 8, L 128 39-44 against 33-37 ms, 3 runs each, 2026-12-02).
        self.clmha_env = dict(base, POCL_CPU_MAX_CU_NUM=t)
        base.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        # --same-blas: clmha's products in the BLAS PyTorch 1.13 gets, set up as for it.
        self.clmha_same_env = openblas_core.with_coretype(
            dict(self.clmha_env, CLMHA_HOST_BLAS="libopenblas.so.0"))
        torch_env = openblas_core.with_coretype(base)
        self.torch2_env = dict(torch_env)
        self.torch1_env = dict(torch_env)
        self.openblas = a.openblas_dir or next(
            (d for d in OPENBLAS_DIRS if os.path.exists(os.path.join(d, "libblas.so.3"))), None)
        if self.openblas:
            old = self.torch1_env.get("LD_LIBRARY_PATH")
            self.torch1_env["LD_LIBRARY_PATH"] = self.openblas + (":" + old if old else "")
        self.names = ["clmha:" + i for i in a.impls]
        if a.same_blas:
            self.names += ["clmha:" + i + ":openblas" for i in a.impls]
        self.names.append("torch1")
        self.torch2_note = None
        if a.no_torch2:
            self.torch2_note = "left out (--no-torch2)"
        elif not os.access(a.torch2_python, os.X_OK):
            self.torch2_note = (f"not run: {a.torch2_python} does not exist (python3 -m venv "
                                f"/tmp/venv-torch2 && /tmp/venv-torch2/bin/pip install torch "
                                f"numpy)")
        else:
            self.names.append("torch2")

    def clmha_cmd(self, name, n, l, repeat):
        a = self.a
        cmd = [a.clmha, "bench", "--backward", "--json", "--batch-first", "--batch", str(n),
               "--tgt-len", str(l), "--embed", str(a.embed), "--heads", str(a.heads),
               "--repeat", str(repeat), "--impl", name.split(":")[1]]
        if a.device is not None:
            cmd += ["--device", a.device]
        return cmd, self.clmha_same_env if name.endswith(":openblas") else self.clmha_env

    def torch_cmd(self, name, mode, n, l, repeat):
        a = self.a
        py = a.torch1_python if name == "torch1" else a.torch2_python
        env = self.torch1_env if name == "torch1" else self.torch2_env
        return ([py, os.path.abspath(__file__), "--threads", str(a.threads), "--worker", mode,
                 str(n), str(l), str(a.embed), str(a.heads), str(repeat)], env)


def run_child(cmd, env, limit_bytes=None):
    """Runs cmd; returns (its last stdout line parsed as JSON or None, stderr's tail, exit
    status, the child's peak resident bytes from wait4). A negative status is a signal."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        def limit():
            if limit_bytes:
                resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))
        p = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, preexec_fn=limit)
        _, status, ru = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        lines = [x for x in out.read().splitlines() if x.strip()]
        tail = " ".join(err.read().split())[-400:]
        parsed = None
        if lines:
            try:
                parsed = json.loads(lines[-1])
            except ValueError:
                pass
        return parsed, tail, p.returncode, ru.ru_maxrss * 1024


def measure_times(peers, n, l):
    """Per peer: the median over rounds of each turn's medians (step, forward, backward)."""
    a = peers.a
    turns = {name: [] for name in peers.names}
    for r in range(a.rounds):
        for name in peers.names:
            if name.startswith("clmha"):
                cmd, env = peers.clmha_cmd(name, n, l, a.repeat)
            else:
                cmd, env = peers.torch_cmd(name, "time", n, l, a.repeat)
            res, tail, rc, _ = run_child(cmd, env)
            if rc != 0 or res is None:
                raise SystemExit(f"backward_peers.py: {name} failed at N {n}, L {l} (exit "
                                 f"{rc}): {tail}")
            turns[name].append(res)
            print(f"  round {r + 1}: {name:22s} {res['ms']:9.2f} ms (forward "
                  f"{res['forward_ms']:.2f}, backward {res['backward_ms']:.2f})", flush=True)
    summary = {}
    for name, rs in turns.items():
        summary[name] = {k: statistics.median(x[k] for x in rs)
                         for k in ("ms", "forward_ms", "backward_ms")}
        summary[name]["turns"] = rs
    return summary


def measure_memory(peers, l):
    a = peers.a
    out = {}
    for name in peers.names:
        if name.startswith("clmha"):
            cmd, env = peers.clmha_cmd(name, 1, l, 0)  # --repeat 0: one step, memory only
            res, tail, rc, peak = run_child(cmd, env)
        else:
            cmd, env = peers.torch_cmd(name, "memory", 1, l, 1)
            res, tail, rc, peak = run_child(cmd, env, int(a.memory_limit_gib * GIB))
        entry = {"peak_rss": peak, "exit": rc, "result": res}
        if rc != 0 or res is None:
            entry["error"] = (f"killed by signal {-rc}" if rc < 0 else f"exit {rc}") + \
                (f": {tail}" if tail else "")
        out[name] = entry
        print(f"  {name:13s} peak resident {peak / MIB:9.1f} MiB"
              + (f"  ({entry['error']})" if "error" in entry else "")
              + (f"  (failed in the {res['failed_in']}: {res['error'][:160]})"
                 if res and res.get("ok") is False else ""), flush=True)
    return out


def label(name, info):
    if name.startswith("clmha"):
        return "clmha, " + name.split(":")[1] + (", OpenBLAS" if name.endswith(":openblas")
                                                 else "")
    return f"PyTorch {info.get('torch', '?')}" if info else name


def print_tables(peers, timing, memory, a):
    e = a.embed
    print(f"\n## Forward + backward, E {e}, H {a.heads}, self-attention, batch_first "
          f"(medians of {a.rounds} rounds x {a.repeat} steps)\n")
    names = peers.names
    ours = [x for x in names if x.startswith("clmha")]
    head = ("| shape | peer | step ms | forward ms | backward ms | step GFLOP/s | "
            + " | ".join(f"{label(x, None)} / peer" for x in ours) + " |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for (n, l), per in timing:
        p, at = flops(n, l, e)
        total = 3 * p + 3.5 * at
        for name in names:
            m = per[name]
            info = m["turns"][0]
            ratios = " | ".join(f"{per[x]['ms'] / m['ms']:.2f}" if x != name else ""
                                for x in ours)
            print(f"| N {n}, L {l} | {label(name, info)} | {m['ms']:.1f} | {m['forward_ms']:.1f} "
                  f"| {m['backward_ms']:.1f} | {total / m['ms'] / 1e6:.1f} | {ratios} |")
    if memory:
        l = a.memory_length
        print(f"\n## Memory of one step, N 1, L = S {l}, E {e}, H {a.heads}\n")
        print("| peer | peak resident memory | notes |")
        print("|---|---|---|")
        for name in names:
            m = memory[name]
            res = m["result"] or {}
            if name.startswith("clmha") and "training_scratch_bytes" in res:
                tr = res["training_scratch_bytes"]
                note = (f"step scratch {tr / MIB:.0f} MiB = layer scratch (forward and "
                        f"backward) {res['scratch_bytes'] / MIB:.0f} + saved "
                        f"{res['saved_bytes'] / MIB:.0f} MiB "
                        f"({'< 1 GiB' if tr < GIB else 'NOT < 1 GiB'}); first step "
                        f"{res['ms'] / 1e3:.1f} s")
            elif not name.startswith("clmha") and res.get("ok"):
                note = (f"after setup {res['rss_setup'] / MIB:.0f} MiB; forward + backward "
                        f"added {(m['peak_rss'] - res['rss_setup']) / MIB:.0f} MiB")
            elif res.get("ok") is False:
                note = (f"fails in the {res['failed_in']} under RLIMIT_AS "
                        f"{a.memory_limit_gib:g} GiB: {res['error'][:200]}")
            else:
                note = m.get("error", "")
            print(f"| {label(name, res)} | {m['peak_rss'] / MIB:.0f} MiB | {note} |")
    if peers.torch2_note:
        print(f"\nPyTorch 2: {peers.torch2_note}")


def main(argv=None):
    a = parse_args(sys.argv[1:] if argv is None else argv)
    if a.worker:
        mode, *nums = a.worker
        n, l, e, h, r = (int(v) for v in nums)
        return worker(mode, n, l, e, h, r, a.threads)
    if not os.access(a.clmha, os.X_OK):
        print(f"backward_peers.py: {a.clmha}: not an executable (build clmha first), or pass "
              f"--clmha PATH", file=sys.stderr)
        return 2
    peers = Peers(a)
    print(f"cpu:     {cpu_name()}, {os.cpu_count()} logical cores; {a.threads} threads per peer")
    print(f"openblas for PyTorch 1.13: {peers.openblas or 'none found: reference BLAS (slow)'}"
          f"; OPENBLAS_CORETYPE={peers.torch1_env.get('OPENBLAS_CORETYPE', 'unset')}")
    timing = []
    for (n, l) in a.shape_list:
        print(f"\n[N {n}, L = S {l}]", flush=True)
        timing.append(((n, l), measure_times(peers, n, l)))
    for (n, l), per in timing:
        for name in peers.names:
            if not name.startswith("clmha"):
                t = per[name]["turns"][0]
                print(f"{name} N {n} L {l}: PyTorch {t['torch']}, BLAS_INFO={t['blas_info']}, "
                      f"loaded: {', '.join(t['blas'])}")
    memory = None
    if not a.no_memory:
        print(f"\n[memory: N 1, L = S {a.memory_length}]", flush=True)
        memory = measure_memory(peers, a.memory_length)
    print_tables(peers, timing, memory, a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(),
                       "threads": a.threads, "embed_dim": a.embed, "num_heads": a.heads,
                       "rounds": a.rounds, "repeat": a.repeat, "impls": a.impls,
                       "openblas_dir": peers.openblas, "torch2_note": peers.torch2_note,
                       "timing": [{"batch": n, "tgt_len": l, "peers": per}
                                  for (n, l), per in timing],
                       "memory_length": None if a.no_memory else a.memory_length,
                       "memory": memory}, f, indent=1)
        print(f"\nwrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
