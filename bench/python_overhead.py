#!/usr/bin/env python3
"""What the Python package costs: clmha.torch.MultiheadAttention against `clmha bench`, and
against PyTorch's own attention in the same process.

Run from the repository root, with a Python where `import clmha` works (pip install .), after
building the `clmha` program (cmake --build build --target clmha_cli):

    /tmp/venv-sys/bin/python3 bench/python_overhead.py [--rounds 5] [--repeat 5]
        [--shapes 8x128 1x2048] [--clmha build/clmha] [--python-only] [--profile]
        [--threads 2] [--device SPEC] [--json FILE]
    /tmp/venv-torch2/bin/python3 bench/python_overhead.py ...   # adds the SDPA peer

For every shape (NxL, self-attention, E --embed 512, H --heads 8, batch_first, float32) and
every pass, the forward alone and the training step (forward + backward), the peers run in
interleaved rounds: in round r each peer takes one turn, in an order that rotates with r, and a
turn makes one untimed call, then times --repeat calls and reports their median; the table gives
each peer's median over the rounds, so a busy moment of the shared machine slows every peer
alike. The peers:

  C        `clmha bench --json --batch-first --impl fused` (a child process; step: --backward,
           its "ms"). Device buffers: the inputs stay on the device, nothing is copied to or from
           host memory, every run is waited for with clFinish. A random layer and input.
  Chost    `clmha bench --host` (step: --host --backward): the host-array calls
           clmha_layer_forward_host (and clmha_layer_backward_host) from C, the calls the
           package makes: the inputs are copied in and the results (the gradients) out on
           every run, through the layer's staging buffers. The Python layer's own price is
           module / Chost.
  Ldev     (where pyopencl is installed) clmha.Layer.forward on pyopencl arrays, a layer on
           Context.from_pyopencl() of the same device: the device-buffer call C times
           (clmha_layer_forward, into a preallocated out=, then queue.finish()), from Python:
           cffi, the argument structs and pyopencl's events, no host copies. Step:
           forward(save=) and Layer.backward on pyopencl arrays (clmha_layer_backward: new
           gradient arrays on the device, nothing read back), then queue.finish().
  Layer    clmha.Layer.forward on NumPy arrays, in this process (need_weights=False: the fused
           core, as C). clmha_layer_forward_host: the query is uploaded to a new device buffer,
           the output read back into a new array, plus the cffi argument structs. Step:
           Layer.saved(), forward(save=), Layer.backward(saved, grad_output): the backward pass
           uploads the query and grad_output again and reads back the gradients of the query
           and of every parameter (1 M floats at E 512).
  module   clmha.torch.MultiheadAttention(E, H, batch_first=True): module(x, x, x,
           need_weights=False), the forward under torch.no_grad() (no saved state); step: x and
           the parameters require grad, out.backward(g) (the gradient of sum(out * g)), the
           gradients set to None before every call, so they are written, not accumulated. The
           parameters do not change between calls (no copy to the layer; --profile times that
           copy, which a training loop pays after every optimizer step).
  torch    torch.nn.MultiheadAttention with the same parameters, need_weights=False; forward in
           eval() under torch.no_grad() (its native fast path), step in train() (dropout 0). On
           PyTorch 2 it calls F.scaled_dot_product_attention inside.
  sdpa     (PyTorch 2 only; left out on 1.13, which has no F.scaled_dot_product_attention) the
           same layer written out: F.linear to Q, K, V, view to (N, H, L, D),
           F.scaled_dot_product_attention, back to (N, L, E), F.linear (out_proj); the same
           parameters and gradients as torch.

Ratios (medians over the rounds, the same pass and shape): module / Chost is what the Python
layer adds to the C call it makes (cffi, the argument structs, the torch wrapper); Chost / C
is what the host copies cost in C; module / C is the whole price of
calling clmha from PyTorch on host tensors: the host copies of clmha_layer_forward_host (and
clmha_layer_backward_host), cffi, and the torch wrapper (autograd.Function, the parameter
version check, tensor <-> ndarray); Layer / C is the host copies and cffi; Ldev / C is cffi and
the Python code without host copies, so Layer / Ldev is the host copies' share; module / Layer
the torch wrapper alone. "module / Chost paired" and "module / C paired" are the median (and
range) over the rounds of the ratio taken within each round, which a busy moment of the
machine disturbs less.
module / torch and module / sdpa: above 1, clmha's module is slower.

Threads: --threads (default 2) for everything: OMP_NUM_THREADS, OPENBLAS_NUM_THREADS,
MKL_NUM_THREADS and POCL_CPU_MAX_CU_NUM are set (where not already set) before torch and
clmha are imported, torch.set_num_threads(threads), and the `clmha bench` child gets the same
environment. clmha on PoCL runs its GEMMs in the host BLAS (oneDNN) on those threads; Debian's
PyTorch 1.13 runs them in libblas.so.3 (OpenBLAS where selected: OPENBLAS_CORETYPE is set for the
CPU by bench/openblas_core.py, as bench/peers.py does, or OpenBLAS 0.3.21 takes AMD's Zen 3 and 4
for a Prescott); OMP_WAIT_POLICY is left as it is (one process: PyTorch and clmha share it).

--profile: at the first shape, where module / C goes: the pieces of the module's Python code
timed alone (the layer lookup and parameter version check, the tensor -> ndarray conversion,
the ndarray -> tensor one, the parameter copy to the layer that a training loop pays after
every optimizer step), and with pyopencl the host copies alone (the same OpenCL calls that
clmha_layer_forward_host and clmha_layer_backward_host make around the device call); then
Ldev, Layer and module (forward) and Layer and module (step) alternated call by call, whose
ratios within an iteration are steadier than the rounds' on a busy machine; and cProfile's
top entries for the module's forward and step.
--python-only: leaves C out (no clmha program needed); the module / C ratios are then absent.

Internal: none; one process (plus the `clmha bench` children).
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import openblas_core  # bench/openblas_core.py

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_SHAPES = ["8x128", "1x2048"]
PASSES = ("forward", "step")
PEERS = ("C", "Chost", "Ldev", "Layer", "module", "torch", "sdpa")
C_PEERS = ("C", "Chost")  # `clmha bench` children


def cpu_name():
    """lscpu's model name (the hypervisor may give a short one), and the core count."""
    name = "?"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                name = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores"


def thread_env(threads):
    """The environment every peer runs under (set here before torch and clmha load)."""
    t = str(threads)
    env = {"OMP_NUM_THREADS": t, "OPENBLAS_NUM_THREADS": t, "MKL_NUM_THREADS": t,
           "POCL_CPU_MAX_CU_NUM": t}
    return openblas_core.with_coretype(env)


def parse_args(argv):
    ap = argparse.ArgumentParser(
        description="clmha.torch.MultiheadAttention against `clmha bench` (C) and PyTorch's "
                    "attention in the same process: forward and forward + backward, "
                    "interleaved rounds, medians, ratios.")
    ap.add_argument("--shapes", nargs="+", metavar="NxL", default=DEFAULT_SHAPES,
                    help="self-attention shapes (default: 8x128 1x2048)")
    ap.add_argument("--embed", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5, help="turns per peer (default 5)")
    ap.add_argument("--repeat", type=int, default=5,
                    help="timed calls per turn, after the warm-up (default 5)")
    ap.add_argument("--passes", default="forward,step",
                    help="forward, step or forward,step (default)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clmha", help="the clmha program (default: build/clmha, else "
                                    "build-bench/clmha)")
    ap.add_argument("--device", help="clmha device spec (clmha --device; clmha.Context)")
    ap.add_argument("--python-only", action="store_true",
                    help="leave out the C peer (no clmha program needed)")
    ap.add_argument("--profile", action="store_true",
                    help="also time the module's pieces and print cProfile's top entries")
    ap.add_argument("--json", metavar="FILE", help="also write every measurement here")
    a = ap.parse_args(argv)
    if a.rounds < 1 or a.repeat < 1 or a.threads < 1:
        ap.error("--rounds, --repeat and --threads must be at least 1")
    if a.embed % a.heads:
        ap.error(f"--embed {a.embed} is not a multiple of --heads {a.heads}")
    try:
        a.shape_list = [tuple(int(v) for v in s.lower().split("x")) for s in a.shapes]
    except ValueError:
        a.shape_list = [()]
    if any(len(s) != 2 or min(s) < 1 for s in a.shape_list):
        ap.error("--shapes: expected NxL with positive integers, e.g. 8x128")
    a.pass_list = [p for p in a.passes.split(",") if p]
    if not a.pass_list or any(p not in PASSES for p in a.pass_list):
        ap.error("--passes: forward, step or forward,step")
    if not a.python_only:
        if a.clmha is None:
            a.clmha = next((p for p in (os.path.join(ROOT, "build", "clmha"),
                                        os.path.join(ROOT, "build-bench", "clmha"))
                            if os.access(p, os.X_OK)), os.path.join(ROOT, "build", "clmha"))
        if not os.access(a.clmha, os.X_OK):
            ap.error(f"{a.clmha}: not an executable (build it: cmake --build build --target "
                     f"clmha_cli), or pass --clmha PATH or --python-only")
    return a


# ---- the peers -----------------------------------------------------------------------------------

def median_ms(fn, repeat, before=None):
    """The median of @p repeat timed calls of fn (before() runs untimed ahead of each)."""
    times = []
    for _ in range(repeat):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


class Case:
    """One shape's in-process peers: the same parameters, input and output gradient for all."""

    def __init__(self, a, n, l):
        import numpy as np
        import torch
        import clmha
        import clmha.torch

        self.n, self.l = n, l
        e, h = a.embed, a.heads
        torch.manual_seed(0)
        self.ref = torch.nn.MultiheadAttention(e, h, batch_first=True)
        with torch.no_grad():  # PyTorch starts the biases at 0; give them values
            self.ref.in_proj_bias.uniform_(-0.1, 0.1)
            self.ref.out_proj.bias.uniform_(-0.1, 0.1)
        self.context = clmha.Context(a.device) if a.device else None
        self.mod = clmha.torch.MultiheadAttention(e, h, batch_first=True, context=self.context)
        self.mod.load_state_dict(self.ref.state_dict())
        self.layer = clmha.Layer(e, h, batch_first=True, context=self.context)
        self.layer.load_state_dict({k: v.detach().numpy()
                                    for k, v in self.ref.state_dict().items()})
        self.x = torch.randn(n, l, e)
        self.g = torch.randn(n, l, e)
        self.xg = self.x.clone().requires_grad_(True)
        self.x_np = self.x.numpy()
        self.g_np = self.g.numpy()
        self.has_sdpa = hasattr(torch.nn.functional, "scaled_dot_product_attention")
        self.dev = self._device_layer(clmha, (self.context or clmha.default_context()))
        self.torch = torch
        self.np = np

    def _device_layer(self, clmha, ctx):
        """(layer, query, out, queue) on a pyopencl context of @p ctx's device, or None."""
        try:
            import pyopencl as cl
            import pyopencl.array as cla
        except ImportError:
            return None
        plat_name, _, dev_name = ctx.device_name.partition(" / ")
        device = next((d for p in cl.get_platforms() if p.name == plat_name
                       for d in p.get_devices() if d.name == dev_name), None)
        if device is None:
            return None
        context = cl.Context([device])
        queue = cl.CommandQueue(context)
        cctx = clmha.Context.from_pyopencl(context, queue)
        layer = clmha.Layer(self.layer.embed_dim, self.layer.num_heads, batch_first=True,
                            context=cctx)
        layer.load_state_dict(self.layer.state_dict())
        x = cla.to_device(queue, self.x_np)
        out = cla.empty(queue, self.x_np.shape, self.x_np.dtype)
        return layer, x, out, queue, cctx, cla.to_device(queue, self.g_np)

    # forward ------------------------------------------------------------------------------------

    def fwd_ldev(self):
        layer, x, out, queue, _, _ = self.dev
        layer.forward(x, need_weights=False, out=out)
        queue.finish()

    def fwd_layer(self):
        self.layer.forward(self.x_np, need_weights=False)

    def fwd_module(self):
        with self.torch.no_grad():
            self.mod(self.x, self.x, self.x, need_weights=False)

    def fwd_torch(self):
        self.ref.eval()
        with self.torch.no_grad():
            self.ref(self.x, self.x, self.x, need_weights=False)

    def _sdpa(self, x):
        F = self.torch.nn.functional
        m = self.ref
        n, l, e = x.shape
        h = m.num_heads
        q, k, v = F.linear(x, m.in_proj_weight, m.in_proj_bias).chunk(3, dim=-1)
        q, k, v = (t.view(n, l, h, e // h).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v)
        return F.linear(o.transpose(1, 2).reshape(n, l, e), m.out_proj.weight, m.out_proj.bias)

    def fwd_sdpa(self):
        with self.torch.no_grad():
            self._sdpa(self.x)

    # step -----------------------------------------------------------------------------------------

    def step_ldev(self):
        layer, x, out, queue, _, g = self.dev
        saved = layer.saved()
        layer.forward(x, need_weights=False, out=out, save=saved)
        layer.backward(saved, g)
        queue.finish()

    def step_layer(self):
        saved = self.layer.saved()
        self.layer.forward(self.x_np, need_weights=False, save=saved)
        self.layer.backward(saved, self.g_np)

    def clear_module(self):
        self.xg.grad = None
        self.mod.zero_grad(set_to_none=True)

    def step_module(self):
        out, _ = self.mod(self.xg, self.xg, self.xg, need_weights=False)
        out.backward(self.g)

    def clear_torch(self):
        self.xg.grad = None
        self.ref.zero_grad(set_to_none=True)

    def step_torch(self):
        self.ref.train()
        out, _ = self.ref(self.xg, self.xg, self.xg, need_weights=False)
        out.backward(self.g)

    def step_sdpa(self):
        self._sdpa(self.xg).backward(self.g)

    def runner(self, peer, pass_):
        """(fn, before) for a turn of @p peer, or None where it does not run here."""
        if peer == "sdpa" and not self.has_sdpa:
            return None
        if peer == "Ldev" and self.dev is None:
            return None
        if pass_ == "forward":
            return getattr(self, "fwd_" + peer.lower()), None
        before = {"module": self.clear_module, "torch": self.clear_torch,
                  "sdpa": self.clear_torch}.get(peer)
        return getattr(self, "step_" + peer.lower()), before

    def check(self):
        """The module and the Layer agree with PyTorch (so every peer computes the same)."""
        torch = self.torch
        with torch.no_grad():
            want, _ = self.ref.train()(self.x, self.x, self.x, need_weights=False)
            got, _ = self.mod(self.x, self.x, self.x, need_weights=False)
            lay, _ = self.layer.forward(self.x_np, need_weights=False)
            errs = {"module": float((got - want).abs().max()),
                    "Layer": float(abs(lay - want.numpy()).max())}
            if self.dev is not None:
                self.fwd_ldev()
                errs["Ldev"] = float(abs(self.dev[2].get() - want.numpy()).max())
            if self.has_sdpa:
                errs["sdpa"] = float((self._sdpa(self.x) - want).abs().max())
        return errs


def run_c(a, env, n, l, pass_, host=False):
    """One `clmha bench` turn (with --host: on host arrays): its JSON line."""
    cmd = [a.clmha, "bench", "--json", "--batch-first", "--impl", "fused", "--batch", str(n),
           "--tgt-len", str(l), "--embed", str(a.embed), "--heads", str(a.heads),
           "--repeat", str(a.repeat)]
    if pass_ == "step":
        cmd.append("--backward")
    if host:
        cmd.append("--host")
    if a.device:
        cmd += ["--device", a.device]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    lines = [x for x in p.stdout.splitlines() if x.strip().startswith("{")]
    if p.returncode != 0 or not lines:
        raise SystemExit(f"python_overhead.py: {' '.join(cmd)} failed (exit {p.returncode}): "
                         f"{' '.join(p.stderr.split())[-400:]}")
    return json.loads(lines[-1])


# ---- --profile -----------------------------------------------------------------------------------

def profile(case, a):
    """Prints the module's pieces timed alone and cProfile's top entries; returns the pieces."""
    import cProfile
    import io
    import pstats

    import numpy as np

    import clmha.torch as ct

    torch, mod, x = case.torch, case.mod, case.x
    reps = max(20, a.repeat * 4)
    out_np, _ = case.layer.forward(case.x_np, need_weights=False)
    params = [mod._param(nm) for nm in mod._param_names()]

    def bump():  # what an optimizer step does to the version counters (values unchanged)
        with torch.no_grad():
            for p in params:
                p.add_(0.0)

    pieces = {
        "module._layer(), parameters unchanged": median_ms(mod._layer, reps),
        "module._layer() after an optimizer step (parameter copy to the layer)":
            median_ms(mod._layer, reps, before=bump),
        "_host(query): tensor -> ndarray": median_ms(lambda: ct._host(x, "query", "float32"),
                                                      reps),
        "torch.from_numpy(out).to(float32)":
            median_ms(lambda: torch.from_numpy(out_np).to(torch.float32), reps),
    }
    if case.dev is not None:
        import pyopencl as cl

        queue = case.dev[3]
        mf = cl.mem_flags
        host_out = np.empty_like(case.x_np)
        n_params = sum(int(np.prod(case.layer._shape(nm))) for nm in case.layer.parameter_names())
        host_grads = np.empty(n_params, np.float32)

        def copies(uploads, downloads):
            """What clmha_layer_forward_host / _backward_host do around the device call: each
            upload a new buffer made with COPY_HOST_PTR, each result a new buffer (first
            touched here by a fill, as the kernels would) read back with a blocking read."""
            ins = [cl.Buffer(queue.context, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=u)
                   for u in uploads]  # released after the reads, as there
            for d in downloads:
                o = cl.Buffer(queue.context, mf.READ_WRITE, d.nbytes)
                cl.enqueue_fill_buffer(queue, o, np.float32(0), 0, d.nbytes)
                cl.enqueue_copy(queue, d, o, is_blocking=True)
            return ins

        pieces["host copies of a forward: query in, output out (pyopencl, same calls)"] = \
            median_ms(lambda: copies([case.x_np], [host_out]), reps)
        pieces["host copies of a backward: query and grad_output in, the gradients out"] = \
            median_ms(lambda: copies([case.x_np, case.g_np], [host_out, host_grads]), reps)
        pieces["np.zeros for the gradients (Layer.backward's arrays)"] = \
            median_ms(lambda: [np.zeros(case.layer._shape(nm), np.float32)
                               for nm in case.layer.parameter_names()]
                      + [np.zeros(case.x_np.shape, np.float32)], reps)
    print(f"\n## Pieces of the module at N {case.n}, L {case.l} (medians of {reps} calls, ms)\n")
    print("| piece | ms |")
    print("|---|---|")
    for k, v in pieces.items():
        print(f"| {k} | {v:.3f} |")

    # The whole calls, alternated call by call: a busy machine's slow spells hit each alike, so
    # the ratios within one iteration are steadier than turns a second apart.
    alt_reps = max(30, a.repeat * 6)
    alternated = {}
    for title, fns in (("forward", [("Ldev", case.fwd_ldev, None)] * (case.dev is not None)
                        + [("Layer", case.fwd_layer, None), ("module", case.fwd_module, None)]),
                       ("step", [("Ldev", case.step_ldev, None)] * (case.dev is not None)
                        + [("Layer", case.step_layer, None),
                                 ("module", case.step_module, case.clear_module)])):
        times = {name: [] for name, _, _ in fns}
        for i in range(alt_reps):
            for name, fn, before in fns[i % len(fns):] + fns[:i % len(fns)]:
                times[name].append(median_ms(fn, 1, before))
        names = [name for name, _, _ in fns]
        pairs = [(x, y) for x in names for y in names if names.index(y) < names.index(x)]
        entry = {"ms": {k: statistics.median(v) for k, v in times.items()}, "ratios": {}}
        for x, y in pairs:
            r = sorted(tx / ty for tx, ty in zip(times[x], times[y]))
            entry["ratios"][f"{x}/{y}"] = (statistics.median(r), r[len(r) // 4],
                                           r[(3 * len(r)) // 4])
        alternated[title] = entry
    print(f"\n## Alternated call by call at N {case.n}, L {case.l} ({alt_reps} calls each; "
          f"ratio: median over the iterations (quartiles))\n")
    print("| pass | ms (medians) | ratios |")
    print("|---|---|---|")
    for title, entry in alternated.items():
        print(f"| {title} | " + ", ".join(f"{k} {v:.2f}" for k, v in entry["ms"].items())
              + " | " + ", ".join(f"{k} {m:.3f} ({lo:.3f}-{hi:.3f})"
                                  for k, (m, lo, hi) in entry["ratios"].items()) + " |")
    pieces["alternated"] = alternated

    for title, fn, before in (("forward", case.fwd_module, None),
                              ("step", case.step_module, case.clear_module)):
        prof = cProfile.Profile()
        for _ in range(reps):
            if before:
                before()
            prof.enable()
            fn()
            prof.disable()
        s = io.StringIO()
        st = pstats.Stats(prof, stream=s).sort_stats("tottime")
        st.print_stats(12)
        print(f"\n## cProfile, module {title}, N {case.n}, L {case.l}, {reps} calls "
              f"(sorted by own time)\n")
        body = s.getvalue().splitlines()
        start = next((i for i, ln in enumerate(body) if ln.strip().startswith("ncalls")), 0)
        print("\n".join(ln for ln in body[start:] if ln.strip()))
    return pieces


# ---- the driver ----------------------------------------------------------------------------------

def main(argv=None):
    a = parse_args(sys.argv[1:] if argv is None else argv)
    env = thread_env(a.threads)
    for k, v in env.items():
        os.environ.setdefault(k, v)
    child_env = dict(os.environ)

    import numpy as np
    import torch
    import clmha

    torch.set_num_threads(a.threads)
    peers = [p for p in PEERS if not (a.python_only and p in C_PEERS)]
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpu": cpu_name(), "python": platform.python_version(), "torch": torch.__version__,
            "numpy": np.__version__, "torch_threads": torch.get_num_threads(),
            "env": {k: os.environ.get(k) for k in list(env) + ["OMP_WAIT_POLICY"]},
            "embed": a.embed, "heads": a.heads, "rounds": a.rounds, "repeat": a.repeat,
            "clmha_program": None if a.python_only else a.clmha}
    ctx = clmha.Context(a.device) if a.device else clmha.default_context()
    meta["device"] = ctx.device_name
    meta["gemm"] = ctx.gemm
    print(f"# python_overhead.py: {meta['date']}, {meta['cpu']}")
    print(f"# clmha device: {meta['device']} (GEMMs: {meta['gemm']}); Python "
          f"{meta['python']}, torch {meta['torch']} ({meta['torch_threads']} threads), "
          f"numpy {meta['numpy']}; env {meta['env']}")

    results = []  # per shape: {pass: {peer: [turn medians]}}
    pieces = None
    c_info = {}
    for (n, l) in a.shape_list:
        case = Case(a, n, l)
        errs = case.check()
        print(f"\n# N {n}, L {l}: max |output - torch| " +
              ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))
        turns = {p: {q: [] for q in peers} for p in a.pass_list}
        # warm-up: first calls (kernel builds, the layer made, buffers sized)
        for p in a.pass_list:
            for q in peers:
                r = case.runner(q, p) if q not in C_PEERS else None
                if r:
                    fn, before = r
                    for _ in range(2):
                        if before:
                            before()
                        fn()
        for rnd in range(a.rounds):
            for p in a.pass_list:
                order = peers[rnd % len(peers):] + peers[:rnd % len(peers)]
                line = []
                for q in order:
                    if q in C_PEERS:
                        res = run_c(a, child_env, n, l, p, host=q == "Chost")
                        c_info.setdefault("gemm", res.get("gemm"))
                        c_info.setdefault("device", res.get("device"))
                        ms = float(res["ms"])
                    else:
                        r = case.runner(q, p)
                        if r is None:
                            continue
                        # One untimed call first: the turn after a `clmha bench` child
                        # otherwise pays for waking this process's threads and caches.
                        if r[1]:
                            r[1]()
                        r[0]()
                        ms = median_ms(r[0], a.repeat, before=r[1])
                    turns[p][q].append(ms)
                    line.append(f"{q} {ms:.2f}")
                print(f"  round {rnd + 1} {p:7s}: " + ", ".join(line), flush=True)
        if a.profile and pieces is None:
            pieces = profile(case, a)
        results.append(((n, l), turns, errs))
        del case

    # ---- the table -----------------------------------------------------------------------------
    meta["c"] = c_info
    print(f"\n## clmha.torch against `clmha bench` and PyTorch {torch.__version__}, E {a.embed}, "
          f"H {a.heads}, self-attention, batch_first, need_weights=False "
          f"(ms: medians of {a.rounds} rounds x {a.repeat} calls)\n")
    cols = [q for q in peers if any(t[p][q] for _, t, _ in results for p in a.pass_list)]
    ratio_names = []
    if "C" in cols:
        ratio_names += [("module", "Chost"), ("Layer", "Chost"), ("Chost", "C"),
                        ("module", "C"), ("Layer", "C")]
        if "Ldev" in cols:
            ratio_names += [("Ldev", "C"), ("Layer", "Ldev")]
    ratio_names += [("module", "Layer"), ("module", "torch")]
    if "sdpa" in cols:
        ratio_names.append(("module", "sdpa"))
    head = ("| shape | pass | " + " | ".join(cols) + " | "
            + " | ".join(f"{x} / {y}" for x, y in ratio_names)
            + (" | module / Chost paired (range) | module / C paired (range) |"
               if "C" in cols else " |"))
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    out_rows = []
    for (n, l), turns, errs in results:
        for p in a.pass_list:
            med = {q: statistics.median(turns[p][q]) for q in cols if turns[p][q]}
            ratios = {f"{x}/{y}": med[x] / med[y] for x, y in ratio_names
                      if x in med and y in med}
            paired = {}
            for c in C_PEERS:
                if turns[p].get(c) and turns[p]["module"]:
                    per = sorted(m / x for m, x in zip(turns[p]["module"], turns[p][c]))
                    paired[c] = (statistics.median(per), per[0], per[-1])
                    ratios[f"paired module/{c}"] = paired[c][0]
            print(f"| N {n}, L {l} | {'forward' if p == 'forward' else 'forward+backward'} | "
                  + " | ".join(f"{med[q]:.2f}" if q in med else "-" for q in cols) + " | "
                  + " | ".join(f"{ratios[f'{x}/{y}']:.3f}" if f"{x}/{y}" in ratios else "-"
                               for x, y in ratio_names)
                  + ("".join(f" | {paired[c][0]:.3f} ({paired[c][1]:.2f}-{paired[c][2]:.2f})"
                             if c in paired else " | -" for c in ("Chost", "C")) + " |"
                     if "C" in cols else " |"))
            out_rows.append({"batch": n, "tgt_len": l, "pass": p, "ms": med,
                             "turns": {q: turns[p][q] for q in cols}, "ratios": ratios,
                             "max_abs_error": errs})
    print("\n(C: `clmha bench`, device buffers, no host copies; Chost: `clmha bench --host`, the "
          "host-array\ncall the package makes, from C. module / Chost: what the Python layer "
          "adds to that C call\n(cffi, the torch wrapper); Chost / C: the host copies' price in "
          "C; module / C: the package's\nwhole price on host tensors; Layer / Chost: cffi and "
          "the NumPy checks; Ldev / C: cffi\nwithout host copies; module / Layer: the torch "
          "wrapper. Above 1: the first named is slower.\nPaired: module / Chost and module / C "
          "within each round, median (range) over the rounds.)")
    if "sdpa" not in cols:
        print(f"sdpa: left out (torch {torch.__version__} has no "
              f"F.scaled_dot_product_attention)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "rows": out_rows, "pieces": pieces}, f, indent=1)
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
