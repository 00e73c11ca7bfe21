"""Failures: clmha.Error with status and a message naming the argument; Python-side TypeError /
ValueError before any call; object lifetimes; threads."""

import gc
import os
import subprocess
import sys
import threading
import zipfile

import numpy as np
import pytest

import clmha
from helpers import TOL, max_err, randn

E, H, N, L, S = 16, 2, 2, 5, 6


@pytest.fixture
def layer(ctx, rng):
    lay = clmha.Layer(E, H, context=ctx)
    for n in lay.parameter_names():
        lay[n] = randn(rng, *lay[n].shape, scale=0.3)
    return lay


def _error(fn, status=None):
    with pytest.raises(clmha.Error) as ei:
        fn()
    e = ei.value
    assert isinstance(e.status, int) and e.status < 0
    assert e.status_name in clmha.STATUS
    if status:
        assert e.status_name == status, (e.status_name, e.message)
    assert e.message
    return e


def test_wrong_feature_count(layer, rng):
    e = _error(lambda: layer.forward(randn(rng, L, N, 8)), "SHAPE_MISMATCH")
    assert "query" in e.message and "8" in e.message and str(E) in e.message


def test_mismatched_batch(layer, rng):
    e = _error(lambda: layer.forward(randn(rng, L, 2, E), randn(rng, S, 3, E)))
    assert "key" in e.message or "batch" in e.message


def test_bad_mask_shape(layer, rng):
    x = randn(rng, L, N, E)
    e = _error(lambda: layer.forward(x, key_padding_mask=np.zeros((N, L + 1), bool)))
    assert "key_padding_mask" in e.message
    e = _error(lambda: layer.forward(x, attn_mask=np.zeros((L, L + 2), np.float32)))
    assert "attn_mask" in e.message
    e = _error(lambda: layer.forward(x, attn_mask=np.zeros((3, L, L), np.float32)))
    assert "attn_mask" in e.message


def test_unknown_parameter_name(layer, rng):
    with pytest.raises(KeyError) as ei:
        layer["in_proj_wieght"]
    assert "in_proj_wieght" in str(ei.value) and "in_proj_weight" in str(ei.value)
    with pytest.raises(KeyError):
        layer["nope"] = np.zeros(3, np.float32)
    with pytest.raises(ValueError) as ei:
        layer["out_proj.bias"] = np.zeros(E + 1, np.float32)
    assert "out_proj.bias" in str(ei.value)


def test_load_failures(ctx, tmp_path):
    e = _error(lambda: clmha.Layer.load(tmp_path / "missing.safetensors", ctx))
    assert "missing.safetensors" in e.message
    _error(lambda: clmha.Layer.load(tmp_path, ctx))  # a directory
    # a torch.save() file: a zip archive
    path = tmp_path / "model.pt"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", b"\x80\x02}q\x00.")
        z.writestr("archive/version", b"3\n")
    torch = None
    try:
        import torch
    except ImportError:
        pass
    if torch is not None:
        torch.save(torch.nn.MultiheadAttention(E, H).state_dict(), tmp_path / "real.pt")
        paths = (path, tmp_path / "real.pt")
    else:
        paths = (path,)
    for p in paths:
        e = _error(lambda: clmha.Layer.load(p, ctx))
        assert "torch.save" in e.message or "safetensors" in e.message, e.message
        assert "save_file" in e.message or "convert" in e.message.lower(), e.message
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{]]]]")
    _error(lambda: clmha.Layer.load(garbage, ctx))


def test_bad_device_spec(has_device):
    e = _error(lambda: clmha.Context("no-such-device-xyz"))
    assert "no-such-device-xyz" in e.message
    with pytest.raises(TypeError):
        clmha.Context(3)


def test_python_input_errors(layer, ctx, rng):
    x = randn(rng, L, N, E)
    with pytest.raises(TypeError):
        layer.forward(x.astype(np.float64))  # wrong dtype for a float32 layer
    with pytest.raises(TypeError):
        layer.forward(x.astype(np.int32))
    with pytest.raises(ValueError, match="C-contiguous"):
        layer.forward(np.asfortranarray(randn(rng, L, N, E)))
    with pytest.raises(ValueError, match="C-contiguous"):
        layer.forward(randn(rng, N, L, E).transpose(1, 0, 2))
    with pytest.raises(ValueError, match="dimensions"):
        layer.forward(randn(rng, 1, L, N, E))
    with pytest.raises(ValueError, match="dimensions"):
        layer.forward(randn(rng, E))
    with pytest.raises(TypeError):
        layer.forward(x.tolist())
    with pytest.raises(ValueError, match="empty"):
        layer.forward(np.zeros((0, N, E), np.float32))
    with pytest.raises(TypeError):
        layer.forward(x, key_padding_mask=np.zeros((N, L), np.int64))
    with pytest.raises(ValueError):
        layer.forward(x, key_padding_mask=clmha.Mask(np.zeros((N, L), bool), per_batch=True))
    with pytest.raises(ValueError):
        layer.forward(x, attn_mask=clmha.Mask(np.zeros((L, L), np.float32), attend=True))
    with pytest.raises(ValueError):
        layer.forward(x, value=x.copy())  # value without key
    for bad in (dict(embed_dim=-1, num_heads=2), dict(embed_dim=E, num_heads=-2),
                dict(embed_dim=E, num_heads=2, kdim=-3), dict(embed_dim=1.5, num_heads=1),
                dict(embed_dim=True, num_heads=1)):
        with pytest.raises(TypeError):
            clmha.Layer(context=ctx, **bad)
    with pytest.raises(TypeError):
        clmha.Layer(E, H, dropout="0.1", context=ctx)
    with pytest.raises(TypeError):
        clmha.Layer(E, H, dtype="int8", context=ctx)
    with pytest.raises(TypeError):
        clmha.Layer(E, H, context="cpu")
    _error(lambda: clmha.Layer(E, 3, context=ctx))  # 16 heads of 3: not divisible
    other = clmha.Layer(E, H, context=ctx)
    cache = other.kv_cache(N, 8)
    with pytest.raises(ValueError, match="kv_cache"):
        layer.forward(x, is_causal=True, kv_cache=cache)
    with pytest.raises(ValueError):
        layer.kv_cache(-1, 8)
    with pytest.raises(ValueError):
        layer.kv_cache(N, 0)
    with pytest.raises(TypeError):
        clmha.Layer.load(123, ctx)
    with pytest.raises(TypeError):
        layer["out_proj.bias"] = np.zeros(E, np.int32)


def test_cache_and_saved_outlive_layer(ctx, rng):
    lay = clmha.Layer(E, H, context=ctx)
    for n in lay.parameter_names():
        lay[n] = randn(rng, *lay[n].shape, scale=0.3)
    x = randn(rng, 3, N, E)
    expect, _ = lay.forward(x, is_causal=True)
    cache = lay.kv_cache(N, 8)
    saved = lay.saved()
    lay.forward(x, save=saved)
    del lay
    gc.collect()
    cache.reset()
    assert cache.lengths.tolist() == [0] * N
    layer2 = cache._layer  # the cache keeps its layer alive: still usable
    y, _ = layer2.forward(x, is_causal=True, kv_cache=cache)
    assert max_err(y, expect) <= TOL
    assert saved.nbytes > 0
    grads = layer2.backward(saved, randn(rng, 3, N, E))
    assert grads["query"].shape == x.shape
    del layer2
    del cache
    gc.collect()
    del saved
    gc.collect()


_SCRIPT = r"""
import sys, numpy as np, clmha
order = sys.argv[1]
ctx = clmha.Context()
layer = clmha.Layer(16, 2, context=ctx)
layer["in_proj_weight"] = np.ones((48, 16), np.float32) * 0.01
cache = layer.kv_cache(1, 8)
saved = layer.saved()
x = np.ones((3, 1, 16), np.float32)
layer.forward(x, save=saved)
layer.forward(x, is_causal=True, kv_cache=cache)
g = layer.backward(saved, np.ones((3, 1, 16), np.float32))
objs = {"ctx": ctx, "layer": layer, "cache": cache, "saved": saved}
del ctx, layer, cache, saved
if order == "keep":
    keep = objs  # exit with every object alive
else:
    for name in order.split(","):
        del objs[name]
    keep = None
print("ok")
"""


@pytest.mark.parametrize("order", ["keep", "ctx,layer,cache,saved", "saved,cache,layer,ctx",
                                   "layer,ctx,saved,cache"])
def test_interpreter_exit_with_live_objects(has_device, order):
    r = subprocess.run([sys.executable, "-c", _SCRIPT, order], capture_output=True,
                       text=True, timeout=120, env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    assert "Segmentation" not in r.stderr
    assert r.stdout.strip() == "ok"


def test_threads_serialised(layer, rng):
    xs = [randn(rng, L, N, E) for _ in range(2)]
    expect = [layer.forward(x)[0] for x in xs]
    results = {}
    errors = []

    def work(i):
        try:
            for _ in range(15):
                y, _ = layer.forward(xs[i])
                assert np.array_equal(y, expect[i])
            results[i] = True
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert results == {0: True, 1: True}
