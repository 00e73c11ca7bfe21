#!/usr/bin/env python3
"""clmha's forward pass against the CPU runtimes people use, side by side on one machine.

Run from the repository root with Debian's Python after building clmha:

    /usr/bin/python3 bench/peers.py [--rounds 7 | --quick] [--shapes NxL | NxLxS ...]
        [--clmha build/clmha] [--clmha-label L] [--clmha-env K=V ...]
        [--clmha2 other/clmha --clmha2-label L2 --clmha2-env K=V ...]
        [--torch2-python /tmp/venv-torch2/bin/python3]
        [--peers-python /tmp/venv-peers/bin/python3] [--only clmha,ort-mha,...] [--tinygrad]
        [--markdown FILE] [--json FILE] [--plot docs/peers.png]
    /usr/bin/python3 bench/peers.py --replot results.jsonl    # table and plot from --json

The peers (PyPI ones in a venv: python3 -m venv /tmp/venv-peers &&
/tmp/venv-peers/bin/pip install onnxruntime openvino onnx numpy; PyTorch 2 in its own venv,
/tmp/venv-torch2, pip install torch numpy):
  clmha        `clmha bench --json --layer F --batch-first` (device buffers, every run waited
               for with clFinish; it reports the median of R runs after a warm-up); its output
               from `clmha run`. --clmha2 adds a second build (or, with --clmha2-env, the same
               build in another configuration) as a second column.
  torch1.13    Debian's python3-torch: nn.MultiheadAttention(E, H, batch_first=True).eval(),
               module(q, k, k, need_weights=False) under torch.inference_mode() (self-attention
               passes the same tensor three times: the module's native fast path). Its matrix
               products go to libblas.so.3 (not oneDNN: with the reference BLAS it is ~30x
               slower), which is Debian's reference BLAS unless OpenBLAS is selected: the worker
               gets libopenblas0-pthread's directory (--openblas-dir, found when installed or
               unpacked with `apt-get download libopenblas0-pthread; dpkg -x ...`) first on
               LD_LIBRARY_PATH and OPENBLAS_CORETYPE for this CPU (bench/openblas_core.py:
               Cooperlake, SkylakeX or Haswell; OpenBLAS 0.3.21 takes AMD's Zen 3 and 4 for a
               Prescott otherwise: ~5x slower).
  torch2       the same module under PyTorch 2.x from PyPI; with need_weights=False it calls
               F.scaled_dot_product_attention (its CPU flash kernel).
  ort-mha      ONNX Runtime, a hand-built graph: Q, K, V projections as MatMul, then
               com.microsoft.MultiHeadAttention (its `bias` input adds the projections' biases),
               then MatMul + Add for the output projection.
  ort-onnx     ONNX Runtime on the model torch.onnx.export writes for the module (below).
  openvino     OpenVINO's CPU plugin on that exported model (openvino.Core().read_model, i.e.
               convert_model), INFERENCE_PRECISION_HINT f32, 1 stream, latency hint.
  tinygrad     (with --tinygrad; pip install tinygrad in the peers' venv) on its default device,
               OpenCL here, i.e. the same PoCL device as clmha: the projections as matmuls and
               Tensor.scaled_dot_product_attention in a TinyJit; timed up to the output in
               host memory (.numpy(), its way of waiting for the device).
The exported model: torch.onnx.export (PyTorch 1.13, opset 17) of the module in train mode with
dropout 0, the same arithmetic (eval mode's self-attention fast path has no ONNX export).
Every peer gets 2 threads (--threads: torch.set_num_threads, intra_op_num_threads,
INFERENCE_NUM_THREADS, OMP/OPENBLAS/MKL_NUM_THREADS), OMP_WAIT_POLICY=PASSIVE (spinning OpenMP
threads fight the other threads for 2 shared cores); clmha runs on its default OpenCL device
(--device).

Method. For every shape the driver has Debian's PyTorch make one layer (PyTorch's
initialisation, biases uniform in +-0.1; seed --seed), write it as a .safetensors file (which
every peer loads), the inputs as .npy files, the exported ONNX model and a float64 reference
output (the module in double precision). Every peer but clmha runs in its own long-lived
worker process (its own Python) which loads the shape, writes its output (for the error column)
and warms up; then in round r = 1..R every tool runs once, in an order that rotates with r,
a timed batch (as many forwards as take about --batch-seconds, at least 3, or 1 where one
takes over a second), and reports the batch's median. The table gives per tool the median
over the rounds, so a busy moment of the shared machine slows every tool alike instead of one.

Columns:
  shape        N (batch), L (target length), S (source length; S = L: self-attention, key =
               value = query; else cross-attention, key = value), E = 512, H = 8
  GFLOP        FLOPs per forward = 2*N*E^2*(2L + 2S) + 4*N*L*S*E (the projections and the two
               attention products; softmax etc. not counted), the same for every tool
  a tool       its median ms per forward and, in parentheses, GFLOP/s = FLOPs / time; the
               fastest tool of the row in bold; "failed"/"-" where the tool did not run
  clmha / fastest   a speed ratio: the fastest peer's time / clmha's (below 1: clmha slower)
The error table gives max |output - float64 reference| per tool (float32 outputs).
--json writes one JSON object per line and tool (ms per round, repeats, error, versions);
--plot (default docs/peers.png) draws GFLOP/s per shape and tool.

Time: the default run (6 shapes, 7 rounds, 0.4 s batches) takes about 7-9 minutes on 2 busy
cores with every peer and one clmha (~1 more for a second clmha, ~2 for tinygrad); --quick
(3 rounds, 0.2 s batches) about 3. A peer whose Python or package is missing is left out
with a note, one that fails at a shape shows "failed" there (the reason under the table), and
the others go on.

Internal: --prepare DIR N L S E H SEED and --worker KIND are the processes the driver starts.
"""

import argparse
import json
import math
import os
import select
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

import openblas_core  # bench/openblas_core.py

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPT = os.path.abspath(__file__)
DEFAULT_SHAPES = ["1x128", "8x128", "1x512", "1x2048", "1x4096", "4x64x1024"]
DEFAULT_TORCH1 = "/usr/bin/python3"
DEFAULT_TORCH2 = "/tmp/venv-torch2/bin/python3"
DEFAULT_PEERS = "/tmp/venv-peers/bin/python3"
OPENBLAS_DIRS = ["/usr/lib/x86_64-linux-gnu/openblas-pthread",
                 "/tmp/peers-openblas/root/usr/lib/x86_64-linux-gnu/openblas-pthread",
                 "/tmp/openblas-deb/usr/lib/x86_64-linux-gnu/openblas-pthread"]
TOOLS = ["clmha", "clmha2", "torch1.13", "torch2", "ort-mha", "ort-onnx", "openvino",
         "tinygrad"]
LABELS = {"torch1.13": "PyTorch 1.13", "torch2": "PyTorch 2 SDPA",
          "ort-mha": "ONNX Runtime MHA op", "ort-onnx": "ONNX Runtime exported",
          "openvino": "OpenVINO", "tinygrad": "tinygrad"}
TOLERANCE = 1e-4


# ---- shared by every process (numpy only) -------------------------------------------------------

def flops_of(n, l, s, e):
    return 2.0 * n * e * e * (2 * l + 2 * s) + 4.0 * n * l * s * e


def read_safetensors(path):
    """The tensors of a .safetensors file as numpy arrays (name -> array), and its metadata."""
    import numpy as np
    with open(path, "rb") as f:
        data = f.read()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    meta = header.pop("__metadata__", {})
    dtypes = {"F32": "<f4", "F16": "<f2", "F64": "<f8"}
    out = {}
    for name, info in header.items():
        b, e = info["data_offsets"]
        out[name] = np.frombuffer(data[8 + size + b:8 + size + e],
                                  dtype=dtypes[info["dtype"]]).reshape(info["shape"])
    return out, meta


def load_inputs(case):
    """The query and the key (= value; the query itself in self-attention) of a case."""
    import numpy as np
    q = np.load(case["query"])
    return q, (np.load(case["key"]) if case["key"] else q)


# ---- the prepare step (Debian's PyTorch, a child process) ---------------------------------------

def prepare(out_dir, n, l, s, e, h, seed):
    """Writes the layer, the inputs, the exported ONNX model and the float64 reference of one
    shape into out_dir; prints the case (a JSON object with the file names)."""
    import numpy as np
    import torch
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from export_mha import export

    torch.manual_seed(seed)
    mha = torch.nn.MultiheadAttention(e, h, batch_first=True)
    with torch.no_grad():
        for name, p in mha.named_parameters():
            if name.endswith("bias"):
                p.uniform_(-0.1, 0.1)
    mha.eval()
    gen = torch.Generator().manual_seed(seed + 1)
    query = torch.randn((n, l, e), generator=gen)
    key = query if s == l else torch.randn((n, s, e), generator=gen)
    case = {"n": n, "l": l, "s": s, "e": e, "h": h,
            "layer": os.path.join(out_dir, "layer.safetensors"),
            "query": os.path.join(out_dir, "query.npy"),
            "key": None if s == l else os.path.join(out_dir, "key.npy"),
            "reference": os.path.join(out_dir, "reference.npy"),
            "onnx": os.path.join(out_dir, "model.onnx")}
    export(mha, case["layer"])
    np.save(case["query"], query.numpy())
    if case["key"]:
        np.save(case["key"], key.numpy())
    with torch.no_grad():
        m64 = torch.nn.MultiheadAttention(e, h, batch_first=True).double().eval()
        m64.load_state_dict({k: v.double() for k, v in mha.state_dict().items()})
        q64, k64 = query.double(), key.double()
        ref, _ = m64(q64, k64 if s != l else q64, k64 if s != l else q64, need_weights=False)
    np.save(case["reference"], ref.numpy())
    try:
        export_onnx(torch, mha, query, None if s == l else key, case["onnx"])
    except Exception as ex:  # the ONNX peers then say so; the others run
        case["onnx"] = None
        case["onnx_error"] = f"{type(ex).__name__}: {ex}"[:300]
    print(json.dumps(case), flush=True)


def export_onnx(torch, mha, query, key, path):
    """torch.onnx.export of module(query, key, key, need_weights=False)[0] (static shapes)."""
    class Forward(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, q, k=None):
            k = q if k is None else k
            return self.m(q, k, k, need_weights=False)[0]

    args = (query,) if key is None else (query, key)
    names = ["query"] if key is None else ["query", "key"]
    # In train mode with dropout 0 (the same arithmetic): eval mode's self-attention takes the
    # native fast path, aten::_native_multi_head_attention, which has no ONNX export.
    assert mha.dropout == 0.0
    try:
        with torch.no_grad():
            torch.onnx.export(Forward(mha).train(), args, path, input_names=names,
                              output_names=["output"], opset_version=17,
                              training=torch.onnx.TrainingMode.PRESERVE)
    finally:
        mha.eval()


# ---- the workers (each in its own process and Python) -------------------------------------------

class TorchWorker:
    """nn.MultiheadAttention under whichever PyTorch this Python has."""

    def __init__(self, threads):
        import torch
        self.torch = torch
        torch.set_num_threads(threads)
        self.info = {"version": f"PyTorch {torch.__version__}",
                     "blas": loaded_libraries(("openblas", "libblas", "mkl", "dnnl")),
                     "threads": torch.get_num_threads()}

    def load(self, case):
        torch = self.torch
        tensors, _ = read_safetensors(case["layer"])
        m = torch.nn.MultiheadAttention(case["e"], case["h"], batch_first=True)
        m.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in tensors.items()})
        self.m = m.eval()
        q, k = load_inputs(case)
        self.q = torch.from_numpy(q)
        self.k = self.q if case["key"] is None else torch.from_numpy(k)
        return self.forward

    def forward(self):
        with self.torch.inference_mode():
            return self.m(self.q, self.k, self.k, need_weights=False)[0].numpy()


class OrtWorker:
    """ONNX Runtime on the CPU: the exported model, or (mha=True) a graph around
    com.microsoft.MultiHeadAttention built here."""

    def __init__(self, threads, mha):
        import onnxruntime as ort
        self.ort, self.threads, self.mha = ort, threads, mha
        self.info = {"version": f"ONNX Runtime {ort.__version__}",
                     "graph": "com.microsoft.MultiHeadAttention" if mha else "torch.onnx.export"}

    def load(self, case):
        ort = self.ort
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = self.threads
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if self.mha:
            model = mha_graph(case).SerializeToString()
        elif case["onnx"]:
            model = case["onnx"]
        else:
            raise RuntimeError("no exported model: " + case.get("onnx_error", "?"))
        self.sess = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
        q, k = load_inputs(case)
        self.feeds = {"query": q} if case["key"] is None else {"query": q, "key": k}
        return self.forward

    def forward(self):
        return self.sess.run(None, self.feeds)[0]


def mha_graph(case):
    """The forward pass as an ONNX graph: x W_q^T, k W_k^T, k W_v^T (MatMul), then
    com.microsoft.MultiHeadAttention with the three biases as its `bias` input, then
    o W_out^T + b_out (MatMul + Add)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    w, _ = read_safetensors(case["layer"])
    e = case["e"]
    w_in = np.asarray(w["in_proj_weight"], dtype=np.float32)
    inits = [numpy_helper.from_array(np.ascontiguousarray(w_in[i * e:(i + 1) * e].T), name)
             for i, name in enumerate(("w_q", "w_k", "w_v"))]
    inits += [numpy_helper.from_array(np.asarray(w["in_proj_bias"], np.float32), "b_in"),
              numpy_helper.from_array(np.ascontiguousarray(
                  np.asarray(w["out_proj.weight"], np.float32).T), "w_out"),
              numpy_helper.from_array(np.asarray(w["out_proj.bias"], np.float32), "b_out")]
    kv = "query" if case["key"] is None else "key"
    nodes = [helper.make_node("MatMul", ["query", "w_q"], ["q"]),
             helper.make_node("MatMul", [kv, "w_k"], ["k"]),
             helper.make_node("MatMul", [kv, "w_v"], ["v"]),
             helper.make_node("MultiHeadAttention", ["q", "k", "v", "b_in"], ["attn"],
                              domain="com.microsoft", num_heads=case["h"]),
             helper.make_node("MatMul", ["attn", "w_out"], ["proj"]),
             helper.make_node("Add", ["proj", "b_out"], ["output"])]
    n, l, s = case["n"], case["l"], case["s"]
    inputs = [helper.make_tensor_value_info("query", TensorProto.FLOAT, [n, l, e])]
    if case["key"] is not None:
        inputs.append(helper.make_tensor_value_info("key", TensorProto.FLOAT, [n, s, e]))
    graph = helper.make_graph(nodes, "mha", inputs,
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT,
                                                             [n, l, e])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid("com.microsoft", 1)])


class OpenVinoWorker:
    """OpenVINO's CPU plugin on the exported ONNX model, f32, --threads threads, 1 stream."""

    def __init__(self, threads):
        import openvino as ov
        self.core, self.threads = ov.Core(), threads
        self.info = {"version": f"OpenVINO {ov.__version__.split('-')[0]}",
                     "cpu": self.core.get_property("CPU", "FULL_DEVICE_NAME")}

    def load(self, case):
        if not case["onnx"]:
            raise RuntimeError("no exported model: " + case.get("onnx_error", "?"))
        model = self.core.read_model(case["onnx"])
        config = {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": self.threads,
                  "NUM_STREAMS": 1, "PERFORMANCE_HINT": "LATENCY"}
        self.compiled = self.core.compile_model(model, "CPU", config)
        self.request = self.compiled.create_infer_request()
        q, k = load_inputs(case)
        self.feeds = {"query": q} if case["key"] is None else {"query": q, "key": k}
        return self.forward

    def forward(self):
        self.request.infer(self.feeds, share_inputs=True)
        return self.request.get_output_tensor(0).data


class TinygradWorker:
    """tinygrad on its default device (OpenCL here: the same PoCL device as clmha): the
    projections as matmuls, Tensor.scaled_dot_product_attention, the forward in a TinyJit."""

    def __init__(self, threads):
        import tinygrad
        from tinygrad import Device, Tensor, TinyJit
        self.Tensor, self.TinyJit = Tensor, TinyJit
        version = getattr(tinygrad, "__version__", None)
        if version is None:
            from importlib.metadata import version as dist_version
            version = dist_version("tinygrad")
        self.info = {"version": f"tinygrad {version}", "device": Device.DEFAULT}

    def load(self, case):
        Tensor = self.Tensor
        w, _ = read_safetensors(case["layer"])
        n, l, s, e, h = (case[k] for k in ("n", "l", "s", "e", "h"))
        d = e // h
        w_in = Tensor(w["in_proj_weight"].copy()).realize()
        b_in = Tensor(w["in_proj_bias"].copy()).realize()
        w_out = Tensor(w["out_proj.weight"].copy()).realize()
        b_out = Tensor(w["out_proj.bias"].copy()).realize()
        q, k = load_inputs(case)
        # Self-attention passes the query alone (TinyJit refuses the same tensor twice).
        self.inputs = [Tensor(q).realize()] + ([] if case["key"] is None
                                               else [Tensor(k).realize()])

        def heads(x, i, length):
            y = x.linear(w_in[i * e:(i + 1) * e].T, b_in[i * e:(i + 1) * e])
            return y.reshape(n, length, h, d).transpose(1, 2)

        @self.TinyJit
        def forward(query, key=None):
            key = query if key is None else key
            o = heads(query, 0, l).scaled_dot_product_attention(heads(key, 1, s), heads(key, 2, s))
            return o.transpose(1, 2).reshape(n, l, e).linear(w_out.T, b_out).realize()

        self.jit = forward
        return self.forward

    def forward(self):
        return self.jit(*self.inputs).numpy()


WORKERS = {"torch": TorchWorker,
           "tinygrad": TinygradWorker,
           "ort-mha": lambda t: OrtWorker(t, mha=True),
           "ort-onnx": lambda t: OrtWorker(t, mha=False),
           "openvino": OpenVinoWorker}


def loaded_libraries(words):
    """The shared libraries mapped into this process whose file name has one of `words`."""
    libs = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and any(w in os.path.basename(parts[-1]) for w in words):
                    libs.add(os.path.basename(parts[-1]))
    except OSError:
        pass
    return sorted(libs)


def timed(fn, repeat):
    """Median and minimum milliseconds of `repeat` calls of fn."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), min(times)


def worker_main(kind, threads):
    """Serves the driver: one JSON request per line on stdin, one JSON reply per line on the
    original stdout (libraries' own printing goes to stderr)."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def reply(obj):
        proto.write(json.dumps(obj) + "\n")

    try:
        worker = WORKERS[kind](threads)
    except Exception as ex:
        reply({"error": f"{type(ex).__name__}: {ex}"[:500]})
        return 1
    reply({"ready": True, "info": worker.info})
    forward = None
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["cmd"] == "quit":
                break
            if req["cmd"] == "load":
                forward = None
                forward = worker.load(req["case"])
                import numpy as np
                np.save(req["output"], np.asarray(forward(), dtype=np.float32))
                t0 = time.perf_counter()
                forward()  # warm-up
                reply({"est_ms": (time.perf_counter() - t0) * 1e3})
            elif req["cmd"] == "time":
                ms, ms_min = timed(forward, req["repeat"])
                reply({"ms": ms, "ms_min": ms_min})
        except Exception as ex:
            reply({"error": f"{type(ex).__name__}: {ex}"[:500]})
    return 0


# ---- the driver ---------------------------------------------------------------------------------

class PeerError(Exception):
    pass


class WorkerPeer:
    """A worker process of one tool, driven over its stdin and stdout."""

    def __init__(self, name, label, python, kind, env, a, log_dir):
        self.name, self.label, self.python, self.kind = name, label, python, kind
        self.env, self.timeout, self.threads = env, a.timeout, a.threads
        self.log = os.path.join(log_dir, f"{name}.log")
        self.proc, self.info = None, {}

    def start(self):
        if not os.access(self.python, os.X_OK):
            raise PeerError(f"no Python at {self.python}")
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [self.python, SCRIPT, "--worker", self.kind, "--threads", str(self.threads)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=self.env,
                text=True, bufsize=1)
        self.info = self._reply().get("info", {})

    def _reply(self):
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close()
            raise PeerError(("no answer within %d s" % self.timeout if not ready else
                             "the worker ended") + "; " + self.log_tail())
        obj = json.loads(line)
        if "error" in obj:
            raise PeerError(obj["error"])
        return obj

    def call(self, **req):
        if self.proc is None or self.proc.poll() is not None:
            raise PeerError("the worker is not running")
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def load(self, case, output):
        return self.call(cmd="load", case=case, output=output)["est_ms"]

    def time(self, repeat):
        return self.call(cmd="time", repeat=repeat)

    def log_tail(self):
        try:
            with open(self.log) as f:
                return " | ".join(f.read().strip().splitlines()[-3:])[-400:]
        except OSError:
            return ""

    def close(self):
        if self.proc and self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


class ClmhaPeer:
    """clmha through its program: `clmha run` for the output, `clmha bench --json` for the
    time (it warms up itself and reports the median of its R timed runs)."""

    def __init__(self, name, label, binary, env, a):
        self.name, self.label, self.binary, self.env = name, label, binary, env
        self.device, self.timeout = a.device, a.timeout
        self.case, self.info, self.stages = None, {}, None

    def start(self):
        if not os.access(self.binary, os.X_OK):
            raise PeerError(f"{self.binary}: not an executable (build clmha first)")
        self.info = {"binary": self.binary,
                     "env": {k: v for k, v in self.env.items() if os.environ.get(k) != v}}

    def _run(self, args):
        cmd = [self.binary] + args + (["--device", self.device] if self.device else [])
        try:
            p = subprocess.run(cmd, env=self.env, capture_output=True, text=True,
                               timeout=self.timeout)
        except subprocess.TimeoutExpired:
            raise PeerError(f"clmha {args[0]}: no result within {self.timeout} s")
        if p.returncode != 0:
            raise PeerError(f"clmha {args[0]} failed ({p.returncode}): {p.stderr.strip()[-300:]}")
        return p.stdout

    def load(self, case, output):
        self.case = case
        args = ["run", "--layer", case["layer"], "--query", case["query"], "--output", output]
        self._run(args + (["--key", case["key"]] if case["key"] else []))
        return self.time(1)["ms"]

    def time(self, repeat):
        c = self.case
        out = self._run(["bench", "--json", "--layer", c["layer"], "--batch-first",
                         "--batch", str(c["n"]), "--tgt-len", str(c["l"]),
                         "--src-len", str(c["s"]), "--repeat", str(repeat)])
        r = json.loads(out.strip().splitlines()[-1])
        self.info["device"], self.stages = r["device"], r["stages"]
        return {"ms": r["ms"], "ms_min": r["ms_min"]}

    def close(self):
        pass


def parse_env(items, flag):
    env = {}
    for item in items or []:
        if "=" not in item:
            raise SystemExit(f"peers.py: {flag} {item}: expected KEY=VALUE")
        k, v = item.split("=", 1)
        env[k] = v
    return env


def base_env(threads):
    env = dict(os.environ)
    t = str(threads)
    env.update(OMP_NUM_THREADS=t, OPENBLAS_NUM_THREADS=t, MKL_NUM_THREADS=t)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def torch1_env(a):
    """Debian's PyTorch: OpenBLAS first on the library path and its core type, when found."""
    env = base_env(a.threads)
    ob = a.openblas_dir or next((d for d in OPENBLAS_DIRS
                                 if os.path.exists(os.path.join(d, "libblas.so.3"))), None)
    if ob:
        old = env.get("LD_LIBRARY_PATH")
        env["LD_LIBRARY_PATH"] = ob + (":" + old if old else "")
        if a.openblas_coretype:
            env["OPENBLAS_CORETYPE"] = a.openblas_coretype
    return env, ob


def make_peers(a, log_dir):
    """The tools to run, in table order, as (peer, None) or (None, note) when left out."""
    peers = []
    for name, binary, label, extra in (("clmha", a.clmha, a.clmha_label, a.clmha_env),
                                       ("clmha2", a.clmha2, a.clmha2_label, a.clmha2_env)):
        if binary:
            env = base_env(a.threads)
            env.update(parse_env(extra, f"--{name}-env"))
            peers.append(ClmhaPeer(name, label or name, binary, env, a))
    t1env, ob = torch1_env(a)
    a.torch1_blas = f"OpenBLAS ({ob}, OPENBLAS_CORETYPE={a.openblas_coretype})" if ob else \
        "libblas.so.3 as the system selects it (no OpenBLAS found: see --openblas-dir)"
    specs = [("torch1.13", a.torch1_python, "torch", t1env),
             ("torch2", a.torch2_python, "torch", base_env(a.threads)),
             ("ort-mha", a.peers_python, "ort-mha", base_env(a.threads)),
             ("ort-onnx", a.peers_python, "ort-onnx", base_env(a.threads)),
             ("openvino", a.peers_python, "openvino", base_env(a.threads)),
             ("tinygrad", a.peers_python, "tinygrad", base_env(a.threads))]
    for name, python, kind, env in specs:
        peers.append(WorkerPeer(name, LABELS[name], python, kind, env, a, log_dir))
    chosen = [p for p in peers if p.name in a.only] if a.only else \
        [p for p in peers if p.name != "tinygrad" or a.tinygrad]
    started, notes = [], {}
    for p in chosen:
        try:
            p.start()
            started.append(p)
            print(f"  {p.label:<24} {json.dumps(p.info)}", flush=True)
        except PeerError as ex:
            notes[p.name] = f"{p.label}: left out: {ex}"
            print(f"  {p.label:<24} LEFT OUT: {ex}", flush=True)
    return started, notes


def prepare_case(a, shape, out_dir):
    n, l, s = shape
    env, _ = torch1_env(a)
    p = subprocess.run([a.torch1_python, SCRIPT, "--prepare", out_dir, str(n), str(l), str(s),
                        str(a.embed), str(a.heads), str(a.seed)],
                       env=env, capture_output=True, text=True, timeout=a.timeout)
    if p.returncode != 0:
        raise SystemExit(f"peers.py: preparing {shape} failed: {p.stderr.strip()[-800:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def repeats_for(est_ms, batch_seconds):
    """Forwards per timed batch: about batch_seconds' worth, at least 3 (1 for a forward of
    over a second: the rounds give its median), at most 200."""
    least = 1 if est_ms > 1000 else 3
    return max(least, min(200, math.ceil(batch_seconds * 1e3 / max(est_ms, 1e-3))))


def measure_shape(a, peers, shape, tmp):
    """Loads one shape into every peer, checks the outputs, runs the rounds; returns one
    result dict per peer."""
    import numpy as np
    n, l, s = shape
    case_dir = os.path.join(tmp, f"{n}x{l}x{s}")
    os.makedirs(case_dir, exist_ok=True)
    case = prepare_case(a, shape, case_dir)
    ref = np.load(case["reference"])
    fl = flops_of(n, l, s, a.embed)
    print(f"\n[N={n} L={l} S={s}] {'self' if l == s else 'cross'}-attention, "
          f"{fl / 1e9:.3f} GFLOP per forward", flush=True)
    if not case["onnx"]:
        print(f"  torch.onnx.export failed: {case['onnx_error']}", flush=True)
    res = {}
    for p in peers:
        r = res[p.name] = {"tool": p.name, "label": p.label, "n": n, "l": l, "s": s,
                           "e": a.embed, "h": a.heads, "flops": fl, "rounds_ms": []}
        out = os.path.join(case_dir, f"out-{p.name}.npy")
        try:
            est = p.load(case, out)
            r["error"] = float(np.max(np.abs(np.load(out).astype(np.float64) - ref)))
            r["repeat"] = repeats_for(est, a.batch_seconds)
            print(f"  {p.label:<24} loaded: max |err| {r['error']:.2e}, ~{est:.2f} ms, "
                  f"batches of {r['repeat']}", flush=True)
        except PeerError as ex:
            r["note"] = f"failed: {ex}"
            print(f"  {p.label:<24} FAILED: {ex}", flush=True)
    live = [p for p in peers if "repeat" in res[p.name]]
    for rnd in range(a.rounds):
        k = rnd % max(1, len(live))
        line = []
        for p in live[k:] + live[:k]:
            r = res[p.name]
            try:
                t = p.time(r["repeat"])
                r["rounds_ms"].append(t["ms"])
                line.append(f"{p.name} {t['ms']:.2f}")
            except PeerError as ex:
                r["note"] = f"failed in round {rnd + 1}: {ex}"
                line.append(f"{p.name} failed")
        print(f"  round {rnd + 1}: " + ", ".join(line) + " ms", flush=True)
    for p in peers:
        r = res[p.name]
        if r["rounds_ms"]:
            r["ms"] = statistics.median(r["rounds_ms"])
            r["gflops"] = fl / (r["ms"] * 1e-3) / 1e9
        if isinstance(p, ClmhaPeer) and p.stages:
            r["stages_ms"] = p.stages
        r["info"] = p.info
    return list(res.values())


# ---- the report ---------------------------------------------------------------------------------

def by_shape(results):
    """Results grouped per shape, shapes in first-seen order, tools in TOOLS order."""
    groups = {}
    for r in results:
        groups.setdefault((r["n"], r["l"], r["s"]), {})[r["tool"]] = r
    return groups


def shape_text(n, l, s):
    return f"N={n}, L={l}" + ("" if s == l else f", S={s}")


def ms_text(ms):
    """Three significant digits, without an exponent."""
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}"


def tool_columns(results):
    present = {r["tool"] for r in results}
    labels = {r["tool"]: r["label"] for r in results}
    return [(t, labels[t]) for t in TOOLS if t in present]


def ratios(row):
    """clmha's (and clmha2's) speed against the fastest peer that is not clmha."""
    peers = [r["ms"] for t, r in row.items() if not t.startswith("clmha") and r.get("ms")]
    if not peers:
        return {}
    best = min(peers)
    return {t: best / r["ms"] for t, r in row.items() if t.startswith("clmha") and r.get("ms")}


def markdown(results, notes):
    cols = tool_columns(results)
    clmhas = [(t, lab) for t, lab in cols if t.startswith("clmha")]
    ratio_heads = [f"{lab} / fastest" for _, lab in clmhas]
    def row_text(cells):
        return "| " + " | ".join(cells) + " |"

    heads = ["shape", "GFLOP"] + [lab for _, lab in cols] + ratio_heads
    lines = [row_text(heads), "|---" * len(heads) + "|"]
    err = [row_text(["shape"] + [lab for _, lab in cols]), "|---" * (1 + len(cols)) + "|"]
    for (n, l, s), row in by_shape(results).items():
        times = [r["ms"] for r in row.values() if r.get("ms")]
        best = min(times) if times else None
        cells, ecells = [], []
        for t, _ in cols:
            r = row.get(t, {})
            if r.get("ms"):
                c = f"{ms_text(r['ms'])} ({r['gflops']:.0f})"
                cells.append(f"**{c}**" if r["ms"] == best else c)
            else:
                cells.append("failed" if r.get("note") else "—")
            e = r.get("error")
            bad = e is not None and e > TOLERANCE
            ecells.append("—" if e is None else f"{e:.1e}" + (" (> 1e-4)" if bad else ""))
        rat = ratios(row)
        fl = next(iter(row.values()))["flops"]
        lines.append(row_text([shape_text(n, l, s), f"{fl / 1e9:.2f}"] + cells
                              + [f"{rat[t]:.2f}" if t in rat else "—" for t, _ in clmhas]))
        err.append(row_text([shape_text(n, l, s)] + ecells))
    text = ["Median ms per forward over the rounds (GFLOP/s); fastest in bold; "
            "clmha / fastest: speed ratio against the fastest peer (below 1: clmha slower).",
            "", *lines, "", "Max |output − float64 PyTorch| per tool:", "", *err]
    failures = sorted({f"{r['label']}, {shape_text(r['n'], r['l'], r['s'])}: {r['note']}"
                       for r in results if r.get("note")})
    if notes or failures:
        text += [""] + [f"- {v}" for v in notes.values()] + [f"- {f}" for f in failures]
    return "\n".join(text) + "\n"


def plot(results, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = by_shape(results)
    cols = tool_columns(results)
    colors = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(10, 5.4), dpi=120)
    width = 0.8 / max(1, len(cols))
    for i, (t, lab) in enumerate(cols):
        xs, ys = [], []
        for g, row in enumerate(groups.values()):
            if row.get(t, {}).get("gflops"):
                xs.append(g - 0.4 + width * (i + 0.5))
                ys.append(row[t]["gflops"])
        ax.bar(xs, ys, width, label=lab, color=colors(i),
               edgecolor="black" if t.startswith("clmha") else None)
    clmhas = [lab for t, lab in cols if t.startswith("clmha")]
    for g, row in enumerate(groups.values()):
        rat = ratios(row)
        if rat:
            top = max(r.get("gflops") or 0 for r in row.values())
            ax.annotate(", ".join(f"{rat[t]:.2f}" for t, _ in cols if t in rat), (g, top),
                        xytext=(0, 4), textcoords="offset points", ha="center", fontsize=8)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([shape_text(*k) for k in groups])
    ax.set_ylabel("GFLOP/s  (FLOPs = 2NE²(2L + 2S) + 4NLSE)")
    ax.set_title(textwrap.fill(title, 120) + "\nnumbers above the bars: speed of "
                 + ", ".join(clmhas) + " / the fastest peer's", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.08),
              frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def parse_shape(text):
    """'NxL' (self-attention) or 'NxLxS' (cross-attention) -> (N, L, S)."""
    try:
        v = [int(p) for p in text.lower().split("x")]
    except ValueError:
        v = []
    if len(v) not in (2, 3) or min(v) < 1:
        raise argparse.ArgumentTypeError(f"shape '{text}': expected NxL or NxLxS")
    return (v[0], v[1], v[1] if len(v) == 2 else v[2])


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="See the module docstring (the top of this file).")
    ap.add_argument("--shapes", nargs="+", type=parse_shape, metavar="NxL[xS]",
                    default=[parse_shape(s) for s in DEFAULT_SHAPES],
                    help="default: " + " ".join(DEFAULT_SHAPES))
    ap.add_argument("--embed", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--rounds", type=int, help="interleaved rounds per shape (default 7; "
                    "--quick 3)")
    ap.add_argument("--batch-seconds", type=float, help="about how long one timed batch takes "
                    "(default 0.4 s, --quick 0.2 s; at least 3 forwards)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", type=lambda t: t.split(","), help="comma-separated tools of: "
                    + ", ".join(TOOLS))
    ap.add_argument("--tinygrad", action="store_true", help="add tinygrad (slow: ~2 more "
                    "minutes; also with --only ...,tinygrad)")
    ap.add_argument("--clmha", default=os.path.join(ROOT, "build", "clmha"))
    ap.add_argument("--clmha-label", default="clmha")
    ap.add_argument("--clmha-env", action="append", metavar="K=V",
                    help="environment for clmha (repeatable), e.g. CLMHA_GEMM=clblast")
    ap.add_argument("--clmha2", help="a second clmha program (or the same one with "
                    "--clmha2-env) as another column")
    ap.add_argument("--clmha2-label", default="clmha (2)")
    ap.add_argument("--clmha2-env", action="append", metavar="K=V")
    ap.add_argument("--device", help="clmha --device SPEC")
    ap.add_argument("--torch1-python", default=DEFAULT_TORCH1)
    ap.add_argument("--torch2-python", default=DEFAULT_TORCH2)
    ap.add_argument("--peers-python", default=DEFAULT_PEERS,
                    help="a Python with onnxruntime, onnx and openvino")
    ap.add_argument("--openblas-dir", help="directory with OpenBLAS's libblas.so.3 for "
                    "PyTorch 1.13 (default: the first of " + ", ".join(OPENBLAS_DIRS) + ")")
    ap.add_argument("--openblas-coretype", default=openblas_core.coretype(),
                    help="OPENBLAS_CORETYPE for PyTorch 1.13 (default for this CPU: %(default)s)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds one step may take")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--markdown", help="also write the tables to this file")
    ap.add_argument("--json", help="write one JSON object per tool and shape to this file")
    ap.add_argument("--plot", default=os.path.join(ROOT, "docs", "peers.png"),
                    help="the plot (default docs/peers.png; 'none': no plot)")
    ap.add_argument("--replot", metavar="FILE.jsonl", help="measure nothing: tables and plot "
                    "from a --json file")
    a = ap.parse_args(argv)
    if a.rounds is None:
        a.rounds = 3 if a.quick else 7
    if a.batch_seconds is None:
        a.batch_seconds = 0.2 if a.quick else 0.4
    if a.rounds < 1 or a.threads < 1:
        ap.error("--rounds and --threads must be at least 1")
    if a.only and not set(a.only) <= set(TOOLS):
        ap.error("--only: unknown tool(s) " + ", ".join(sorted(set(a.only) - set(TOOLS))))
    return a


def write_outputs(a, results, notes, header):
    table = markdown(results, notes)
    print("\n" + table)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(header + "\n\n" + table)
        print(f"markdown: {a.markdown}")
    if a.plot and a.plot != "none":
        try:
            plot(results, a.plot, header)
            print(f"plot:     {a.plot}")
        except ImportError as ex:
            print(f"no plot ({ex}: apt-get install python3-matplotlib)")


def header_line(a):
    cpu = "?"
    with open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    return (f"nn.MultiheadAttention forward, E={a.embed}, H={a.heads}, batch_first, "
            f"need_weights=False, {a.threads} threads each; {cpu}, {os.cpu_count()} cores; "
            f"median of {a.rounds} interleaved rounds")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker_main(argv[1], int(argv[3]) if len(argv) > 3 else 2)
    if argv[:1] == ["--prepare"]:
        prepare(argv[1], *map(int, argv[2:8]))
        return 0
    a = parse_args(argv)
    if a.replot:
        with open(a.replot) as f:
            rows = [json.loads(ln) for ln in f if ln.strip()]
        head = next((r for r in rows if "header" in r), {"header": ""})["header"]
        results = [r for r in rows if "tool" in r]
        notes = next((r["notes"] for r in rows if "notes" in r), {})
        write_outputs(a, results, notes, head)
        return 0
    header = header_line(a)
    print(header)
    t_start = time.time()
    results = []
    with tempfile.TemporaryDirectory(prefix="clmha-peers-") as tmp:
        peers, notes = make_peers(a, tmp)
        print(f"  PyTorch 1.13 BLAS: {a.torch1_blas}")
        try:
            for shape in dict.fromkeys(a.shapes):
                results += measure_shape(a, peers, shape, tmp)
        finally:
            for p in peers:
                p.close()
    print(f"\n({time.time() - t_start:.0f} s)")
    if a.json:
        with open(a.json, "w") as f:
            f.write(json.dumps({"header": header, "torch1_blas": a.torch1_blas}) + "\n")
            f.write(json.dumps({"notes": notes}) + "\n")
            for r in results:
                f.write(json.dumps(r) + "\n")
        print(f"json:     {a.json}")
    write_outputs(a, results, notes, header)
    return 0 if all(r.get("error", 0) <= TOLERANCE for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
