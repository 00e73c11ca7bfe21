"""The Python forms of the remaining C capabilities: bake and scratch, the layer's attention
core, per-stage profiling, the GEMM path, GEMM tuning (export, import, tune) and partial
attention (attend, merge, project_heads) against PyTorch's float64 nn.MultiheadAttention."""

import json
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import clmha
from helpers import TOL, layer_of, max_err, randn, record, ref_forward, torch_mha

E, H, N, L = 16, 2, 2, 5
STAGES = ("project", "split", "scores", "softmax", "av", "fused", "merge", "out_proj",
          "weights")


def _layer(ctx, rng, **opts):
    layer = clmha.Layer(E, H, context=ctx, **opts)
    for name in layer.parameter_names():
        layer[name] = randn(rng, *layer[name].shape, scale=0.4)
    return layer


# ---- bake, impl, profiling ---------------------------------------------------------------------


def test_bake_and_scratch_bytes(ctx, rng):
    layer = _layer(ctx, rng)
    before = layer.scratch_bytes
    layer.bake(1, 4)
    small = layer.scratch_bytes
    assert small > before
    layer.bake(4, 32, 48, need_weights=True)
    assert layer.scratch_bytes > small
    layer.bake(1, 4)  # never shrinks
    assert layer.scratch_bytes >= small
    with pytest.raises(ValueError):
        layer.bake(0, 4)
    with pytest.raises(TypeError):
        layer.bake(1.5, 4)
    with pytest.raises(TypeError):
        layer.bake(1, 4, src_len=True)


def test_impl_property(ctx, rng):
    layer = _layer(ctx, rng)
    x = randn(rng, L, N, E)
    assert layer.impl == "auto"
    ref, _ = layer.forward(x)
    for impl in ("unfused", "fused", "auto", "fused"):
        layer.impl = impl
        assert layer.impl == impl
        out, _ = layer.forward(x)
        assert max_err(out, ref) <= TOL
    with pytest.raises(ValueError):
        layer.impl = "flash"
    assert layer.impl == "fused"
    with pytest.raises(clmha.Error) as e:  # the fused core returns no weights
        layer.forward(x, need_weights=True)
    assert e.value.status_name == "INVALID_ARGUMENT"
    with pytest.raises(clmha.Error):
        layer.bake(1, 4, need_weights=True)
    layer.impl = "unfused"
    out, w = layer.forward(x, need_weights=True)
    assert w is not None and max_err(out, ref) <= TOL


def test_profiling_stage_times(ctx, rng):
    layer = _layer(ctx, rng)
    assert layer.profiling is False
    with pytest.raises(clmha.Error) as e:  # profiling off
        layer.stage_times()
    assert e.value.status_name == "INVALID_ARGUMENT"
    layer.profiling = True
    assert layer.profiling is True
    with pytest.raises(clmha.Error):  # no profiled call yet
        layer.stage_times()
    layer.forward(randn(rng, L, N, E), need_weights=True)
    times = layer.stage_times()
    assert tuple(times) == STAGES
    assert all(isinstance(v, float) and v >= 0 for v in times.values())
    assert sum(times.values()) > 0
    layer.profiling = False
    with pytest.raises(clmha.Error):
        layer.stage_times()
    with pytest.raises(TypeError):
        layer.profiling = "yes"


# ---- the GEMM path and its tuning --------------------------------------------------------------


def test_gemm_set_and_note(has_device):
    c = clmha.Context()  # a context of its own: set_gemm before any work on it
    assert c.gemm in ("host", "clblast")
    assert c.gemm_note
    c.set_gemm("clblast")
    assert c.gemm == "clblast"
    assert "CLBlast" in c.gemm_note
    try:
        c.set_gemm("host")
        assert c.gemm == "host"
    except clmha.Error as e:  # not a CPU device, no native kernels or no host BLAS
        assert e.status_name == "UNSUPPORTED"
        assert c.gemm == "clblast"
    c.set_gemm("auto")
    assert c.gemm in ("host", "clblast") and c.gemm_note
    with pytest.raises(ValueError):
        c.set_gemm("cublas")
    with pytest.raises(TypeError):
        c.set_gemm(2)


def test_tuning_export_import(ctx):
    assert ctx.tuning_source in ("clblast", "builtin", "stored", "imported", "tuned")
    assert ctx.tuning_note
    if ctx.tuning_source == "clblast":  # CLMHA_TUNING=off, or a device without a built-in set
        with pytest.raises(clmha.Error) as e:
            ctx.tuning_export()
        assert e.value.status_name == "NOT_READY"
        return
    text = ctx.tuning_export()
    doc = json.loads(text)
    assert doc["format"] == "clmha-gemm-tuning" and doc["kernels"]
    ctx.tuning_import(text)  # the same parameters again
    assert ctx.tuning_source == "imported"
    assert "imported" in ctx.tuning_note
    assert json.loads(ctx.tuning_export())["kernels"] == doc["kernels"]
    with pytest.raises(clmha.Error) as e:
        ctx.tuning_import("{not json")
    assert e.value.status_name == "INVALID_FILE"
    with pytest.raises(TypeError):
        ctx.tuning_import(doc)


def test_tune_argument_checks(ctx):
    with pytest.raises(ValueError):
        ctx.tune(0)
    with pytest.raises(ValueError):
        ctx.tune(math.inf)
    with pytest.raises(TypeError):
        ctx.tune("1")
    with pytest.raises(ValueError):
        ctx.tune(1, shapes=())
    with pytest.raises(ValueError):
        ctx.tune(1, shapes=((1, 8, 16),))
    with pytest.raises(ValueError):
        ctx.tune(1, shapes=((1, 8, 18, 4),))  # E not a multiple of H
    with pytest.raises(ValueError):
        ctx.tune(1, shapes=[(1, 8, 16, 2)] * 5)
    with pytest.raises(TypeError):
        ctx.tune(1, progress="print")
    with pytest.raises(ValueError):
        ctx.tune(1, trace=True)  # trace lines go to progress
    with pytest.raises(ValueError):
        ctx.tune(1, candidates=0)
    with pytest.raises(TypeError):
        ctx.tune(1, candidates="2")
    with pytest.raises(TypeError):
        ctx.tune(1, candidates=True)


_TUNE_SCRIPT = textwrap.dedent("""
    import clmha, numpy as np

    c = clmha.Context()
    calls = []
    report = c.tune(1, shapes=((1, 8, 16, 2),), store=False,
                    progress=lambda f, m: calls.append((f, m)))
    assert report["layer"] == "1,8,16,2", report
    assert report["stored"] is False and report["seconds"] > 0, report
    assert isinstance(report["parameters"], str) and isinstance(report["message"], str)
    assert calls and all(0 <= f <= 1 and isinstance(m, str) for f, m in calls), calls
    assert c.tuning_source == ("tuned" if report["improved"] else c.tuning_source)

    class Stop(Exception):
        pass

    seen = []
    def failing(fraction, message):
        seen.append(message)
        raise Stop("from the callback")
    try:
        c.tune(1, shapes=((1, 8, 16, 2),), store=False, progress=failing)
        raise SystemExit("the callback's exception was not re-raised")
    except Stop:
        pass
    assert len(seen) == 1, seen  # later progress calls are skipped
    layer = clmha.Layer(16, 2, context=c)  # the context still works
    layer.forward(np.zeros((4, 1, 16), np.float32))
    # A budget it does not reach, one candidate per search: the fused tiles and the decode
    # split (and CLBlast's two GEMM kernels where the products run there).
    bounded = c.tune(600, shapes=((1, 8, 16, 2),), store=False, candidates=1)
    assert 1 <= bounded["candidates"] <= 4 and bounded["seconds"] < 300, bounded
    print("ok", report["seconds"], report["improved"])
""")


def test_tune_tiny_budget(has_device, tmp_path):
    """clmha_context_tune with a 1 s budget, in a process of its own: a tuning applies to the
    device process-wide and would change the fused tiles of the other tests' layers."""
    env = dict(os.environ, CLMHA_TUNING_DIR=str(tmp_path))
    run = subprocess.run([sys.executable, "-c", _TUNE_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith("ok")
    assert not os.listdir(tmp_path)  # store=False wrote nothing


# ---- partial attention -------------------------------------------------------------------------


CASES = {
    "cross": dict(),
    "bias_kv_zero_attn_kvdim": dict(add_bias_kv=True, add_zero_attn=True, kdim=12, vdim=10),
    "batch_first": dict(batch_first=True, kdim=12, vdim=12),
}


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")
@pytest.mark.parametrize("name", sorted(CASES))
def test_partial_attention_merge(pcl, rng, torch_mod, name):
    import pyopencl.array as cla

    _, queue, c = pcl
    opts = CASES[name]
    m = torch_mha(E, H, **opts)
    layer = layer_of(m, c)
    S, cut, bf = 7, 3, opts.get("batch_first", False)
    kd, vd = opts.get("kdim", E), opts.get("vdim", E)
    q = randn(rng, *((N, L, E) if bf else (L, N, E)))
    k = randn(rng, *((N, S, kd) if bf else (S, N, kd)))
    v = randn(rng, *((N, S, vd) if bf else (S, N, vd)))
    kpm = np.zeros((N, S), bool)
    kpm[1, cut:] = True  # batch item 1 has no key in the second range: its lse rows are -inf
    am = randn(rng, L, S)
    ref, _ = ref_forward(m, q, k, v, key_padding_mask=kpm, attn_mask=am)
    one_shot, _ = layer.forward(cla.to_device(queue, q), cla.to_device(queue, k),
                                cla.to_device(queue, v), key_padding_mask=kpm, attn_mask=am)
    assert record(f"one-shot forward ({name})", max_err(one_shot.get(), ref)) <= TOL

    def keys(a, lo, hi):
        return cla.to_device(queue, np.ascontiguousarray(a[:, lo:hi] if bf else a[lo:hi]))

    dq = cla.to_device(queue, q)
    parts = []
    for lo, hi in ((0, cut), (cut, S)):
        parts.append(layer.attend(dq, keys(k, lo, hi), keys(v, lo, hi),
                                  appended_keys=(lo == 0),
                                  key_padding_mask=np.ascontiguousarray(kpm[:, lo:hi]),
                                  attn_mask=np.ascontiguousarray(am[:, lo:hi])))
    (heads, lse), (heads2, lse2) = parts
    assert heads.shape == (N * H, L, E // H) and lse.shape == (N * H * L,)
    assert heads.dtype == np.float32 and heads.events and lse.events
    empty = lse2.get().reshape(N, H * L)[1]
    assert np.all(np.isneginf(empty)) and not np.any(heads2.get()[H:])
    c.attention_merge(heads, lse, heads2, lse2)
    out = layer.project_heads(heads)
    assert out.shape == ref.shape and out.events
    err = record(f"attend + merge + project_heads ({name})", max_err(out.get(), ref))
    assert err <= TOL
    given = cla.empty(queue, ref.shape, np.float32)
    assert layer.project_heads(heads, N, L, out=given) is given
    assert max_err(given.get(), ref) <= TOL


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_partial_attention_16bit(pcl, rng, torch_mod, dtype):
    """A 16-bit layer's attend (16-bit query, key, value; float32 heads and lse), merge and
    project_heads (16-bit output): within one rounding of its one-shot forward and within the
    dtype's forward contract of PyTorch's float64 module on the same values."""
    import pyopencl.array as cla

    _, queue, c = pcl
    m = torch_mha(E, H)
    layer = layer_of(m, c, dtype=dtype)
    el = np.float16 if dtype == "float16" else np.uint16
    to16 = (lambda a: a.astype(np.float16)) if dtype == "float16" else \
        (lambda a: torch_mod.from_numpy(a).bfloat16().view(torch_mod.int16).numpy().view(el))
    wide = (lambda a: a.astype(np.float64)) if dtype == "float16" else \
        (lambda a: torch_mod.from_numpy(a.view(np.int16)).view(torch_mod.bfloat16).double()
         .numpy())
    S, cut = 9, 4
    q16, k16, v16 = to16(randn(rng, L, N, E)), to16(randn(rng, S, N, E)), to16(randn(rng, S, N, E))
    one, _ = layer.forward(cla.to_device(queue, q16), cla.to_device(queue, k16),
                           cla.to_device(queue, v16))
    dq = cla.to_device(queue, q16)
    parts = [layer.attend(dq, cla.to_device(queue, np.ascontiguousarray(k16[lo:hi])),
                          cla.to_device(queue, np.ascontiguousarray(v16[lo:hi])),
                          appended_keys=(lo == 0)) for lo, hi in ((0, cut), (cut, S))]
    (heads, lse), (heads2, lse2) = parts
    assert heads.dtype == np.float32 and lse.dtype == np.float32
    c.attention_merge(heads, lse, heads2, lse2)
    out = layer.project_heads(heads)
    assert out.dtype == el and out.shape == (L, N, E)
    got, want = wide(out.get()), wide(one.get())
    r = 2.0 ** -11 if dtype == "float16" else 2.0 ** -8
    assert np.all(np.abs(got - want) <= 2 * r * np.abs(want) + 1e-6), \
        np.abs(got - want).max()
    mt = torch_mha(E, H)
    mt.load_state_dict({k: torch_mod.from_numpy(layer[k].astype(np.float32)).double()
                        for k in layer.parameter_names()})
    ref, _ = ref_forward(mt.double(), wide(q16), wide(k16), wide(v16))
    t = 1e-5 * (1 + np.abs(ref).max())
    ratio = (np.abs(got - ref) / (r * (np.abs(ref) + t) + t)).max()
    record(f"attend + merge + project_heads {dtype} (of the contract)", ratio)
    assert ratio <= 1.0


def test_partial_attention_float64(pcl, rng, torch_mod):
    """A float64 layer's attend (float64 heads and lse), merge (clmha_attention_merge_f64) and
    project_heads: within 1e-12 of PyTorch's float64 module, causal ranges at their positions."""
    import pyopencl.array as cla

    if not clmha.devices()[0].fp64:
        pytest.skip("device has no fp64")
    _, queue, c = pcl
    m = torch_mha(E, H, add_bias_kv=True)
    layer = layer_of(m, c, dtype="float64")
    S, cut = 9, 4
    q, k, v = (randn(rng, S, N, E).astype(np.float64) for _ in range(3))
    i, j = np.arange(S)[:, None], np.arange(S)[None, :]
    ref, _ = ref_forward(m, q, k, v, attn_mask=j > i)  # (PyTorch lets every row see bias_k)
    dq = cla.to_device(queue, q)
    parts = [layer.attend(dq, cla.to_device(queue, np.ascontiguousarray(k[lo:hi])),
                          cla.to_device(queue, np.ascontiguousarray(v[lo:hi])), is_causal=True,
                          key_position=lo, appended_keys=(lo == 0))
             for lo, hi in ((0, cut), (cut, S))]
    (heads, lse), (heads2, lse2) = parts
    assert heads.dtype == np.float64 and lse.dtype == np.float64
    c.attention_merge(heads, lse, heads2, lse2)
    out = layer.project_heads(heads)
    assert out.dtype == np.float64
    err = np.abs(out.get() - ref).max()
    record("attend + merge + project_heads float64", err)
    assert err <= 1e-12


@pytest.mark.parametrize("user", [False, True])
def test_partial_attention_positions(pcl, rng, torch_mod, user):
    """Key ranges at their sequence positions (key_position): is_causal and a window (2, 0),
    built in or as a user mask function, against PyTorch with the same boolean mask."""
    import pyopencl.array as cla

    _, queue, c = pcl
    m = torch_mha(E, H)
    mask_mod = ("int clmha_mask_mod(int b, int h, int q, int k, __global const float *p) "
                "{ return k >= q - 2; }")
    layer = layer_of(m, c, **({"mask_mod": mask_mod} if user else {"window": (2, 0)}))
    L = S = 9
    q, k, v = (randn(rng, L, N, E) for _ in range(3))
    i, j = np.arange(L)[:, None], np.arange(S)[None, :]
    forbidden = (j > i) | (j < i - 2)  # torch's bool mask: True = may not attend
    ref, _ = ref_forward(m, q, k, v, attn_mask=forbidden)
    dq = cla.to_device(queue, q)
    parts = [layer.attend(dq, cla.to_device(queue, np.ascontiguousarray(k[lo:hi])),
                          cla.to_device(queue, np.ascontiguousarray(v[lo:hi])), is_causal=True,
                          key_position=lo, appended_keys=lo == 0)
             for lo, hi in ((0, 4), (4, 9))]
    (heads, lse), (heads2, lse2) = parts
    c.attention_merge(heads, lse, heads2, lse2)
    err = record(f"attend at key positions ({'user mask' if user else 'window'})",
                 max_err(layer.project_heads(heads).get(), ref))
    assert err <= TOL
    with pytest.raises(ValueError):
        layer.attend(dq, cla.to_device(queue, k), cla.to_device(queue, v), key_position=-1)


def test_partial_attention_errors(pcl, rng):
    import pyopencl.array as cla

    _, queue, c = pcl
    layer = _layer(c, rng)
    x = randn(rng, L, N, E)
    dx = cla.to_device(queue, x)
    with pytest.raises(clmha.Error) as e:  # the fused core only: no unfused core, no weights
        layer.attend(dx, impl="unfused")
    assert e.value.status_name == "UNSUPPORTED"
    with pytest.raises(ValueError):
        layer.attend(dx, impl="flash")
    with pytest.raises(TypeError):  # device buffers only
        layer.attend(x)
    with pytest.raises(TypeError):
        layer.attend(dx, x)
    heads, lse = layer.attend(dx)
    with pytest.raises(TypeError):  # one dtype for the four arrays
        c.attention_merge(heads, lse, heads.astype(np.float64), lse.astype(np.float64))
    with pytest.raises(ValueError):
        layer.attend(dx, heads_out=cla.empty(queue, (1, 2, 3), np.float32))
    with pytest.raises(ValueError):
        c.attention_merge(heads, lse, heads[:1], lse)
    with pytest.raises(TypeError):
        c.attention_merge(heads, lse, heads.get(), lse)
    with pytest.raises(ValueError):
        layer.project_heads(heads, N + 1, L)
    with pytest.raises(ValueError):
        layer.project_heads(heads, out=cla.empty(queue, (3,), np.float32))
    plain = clmha.Context()
    with pytest.raises(ValueError):  # not a pyopencl context
        plain.attention_merge(heads, lse, heads, lse)
