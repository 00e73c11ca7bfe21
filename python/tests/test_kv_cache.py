"""Incremental decoding through Layer.kv_cache against the one-shot causal forward and PyTorch."""

import numpy as np
import pytest

import clmha
from helpers import TOL, causal_float_mask, layer_of, max_err, randn, record, ref_forward, \
    torch_mha

torch = pytest.importorskip("torch")

E, H, N, T = 16, 2, 2, 9


@pytest.mark.parametrize("batch_first", [False, True])
def test_token_by_token_equals_one_shot(ctx, rng, batch_first):
    m = torch_mha(E, H, batch_first=batch_first)
    layer = layer_of(m, ctx)
    x = randn(rng, *((N, T, E) if batch_first else (T, N, E)))
    one_shot, _ = layer.forward(x, is_causal=True)
    ref, _ = ref_forward(m, x, attn_mask=causal_float_mask(T))
    assert record("one-shot causal", max_err(one_shot, ref)) <= TOL
    cache = layer.kv_cache(N, 16)
    assert cache.batch == N and cache.capacity == 16
    assert cache.lengths.tolist() == [0] * N
    steps = []
    for t in range(T):
        xt = np.ascontiguousarray(x[:, t:t + 1] if batch_first else x[t:t + 1])
        y, w = layer.forward(xt, is_causal=True, kv_cache=cache)
        assert w is None
        steps.append(y)
        assert cache.lengths.tolist() == [t + 1] * N
    got = np.concatenate(steps, axis=1 if batch_first else 0)
    assert record("kv cache token by token", max_err(got, ref)) <= TOL
    assert max_err(got, one_shot) <= TOL


@pytest.mark.parametrize("page_size", [0, 8])
def test_float64_layer(ctx, rng, page_size):
    """A float64 layer's cache holds doubles and its decode core computes in float64: token by
    token and in chunks, float64 outputs within 1e-12 of PyTorch's float64 module (GQA too)."""
    if not clmha.devices()[0].fp64:
        pytest.skip("device has no fp64")
    m = torch_mha(E, H, add_bias_kv=True)
    layer = layer_of(m, ctx, dtype="float64")
    x = randn(rng, T, N, E).astype(np.float64)
    ref, _ = ref_forward(m, x, attn_mask=causal_float_mask(T))
    cache = layer.kv_cache(N, None if page_size else T, page_size=page_size,
                           num_pages=N * 2 if page_size else 0)
    outs, pos = [], 0
    for c in (1, 3, 5):
        y, _ = layer.forward(np.ascontiguousarray(x[pos:pos + c]), is_causal=True,
                             kv_cache=cache)
        assert y.dtype == np.float64
        outs.append(y)
        pos += c
    err = np.abs(np.concatenate(outs) - ref).max()
    record(f"kv cache float64, pages of {page_size}", err)
    assert err <= 1e-12


def test_chunks_truncate_reset(ctx, rng):
    m = torch_mha(E, H)
    layer = layer_of(m, ctx)
    x = randn(rng, T, N, E)
    ref, _ = ref_forward(m, x, attn_mask=causal_float_mask(T))
    cache = layer.kv_cache(N, T)
    outs, pos = [], 0
    for c in (3, 1, 4, 1):
        y, _ = layer.forward(np.ascontiguousarray(x[pos:pos + c]), is_causal=True,
                             kv_cache=cache)
        outs.append(y)
        pos += c
    assert cache.lengths.tolist() == [T] * N
    assert record("kv cache chunks", max_err(np.concatenate(outs), ref)) <= TOL
    # truncate back to 4 tokens and decode the rest again: the same outputs
    cache.truncate(4)
    assert cache.lengths.tolist() == [4] * N
    y, _ = layer.forward(np.ascontiguousarray(x[4:]), is_causal=True, kv_cache=cache)
    assert max_err(y, ref[4:]) <= TOL
    cache.truncate([2, 5])
    assert cache.lengths.tolist() == [2, 5]
    with pytest.raises(ValueError):
        cache.truncate(-1)
    cache.reset()
    assert cache.lengths.tolist() == [0] * N
    y, _ = layer.forward(np.ascontiguousarray(x[:2]), is_causal=True, kv_cache=cache)
    assert max_err(y, ref[:2]) <= TOL


def test_ragged_kv_append(ctx, rng):
    m = torch_mha(E, H, batch_first=True)
    layer = layer_of(m, ctx)
    x = randn(rng, 2, 4, E)
    cache = layer.kv_cache(2, 8)
    layer.forward(np.ascontiguousarray(x[:, :2]), is_causal=True, kv_cache=cache,
                  kv_append=[2, 1])
    assert cache.lengths.tolist() == [2, 1]


def test_unbatched_and_gqa_cache(ctx, rng):
    layer = clmha.Layer(E, 4, num_kv_heads=2, context=ctx)
    for n in layer.parameter_names():
        layer[n] = randn(rng, *layer[n].shape, scale=0.4)
    x = randn(rng, 6, E)  # unbatched (L, E)
    one, _ = layer.forward(x, is_causal=True)
    cache = layer.kv_cache(1, 6)
    got = np.concatenate([layer.forward(np.ascontiguousarray(x[t:t + 1]), is_causal=True,
                                        kv_cache=cache)[0] for t in range(6)])
    assert record("kv cache GQA unbatched", max_err(got, one)) <= TOL


def test_capacity_overflow(ctx, rng):
    m = torch_mha(E, H)
    layer = layer_of(m, ctx)
    cache = layer.kv_cache(N, 4)
    layer.forward(randn(rng, 3, N, E), is_causal=True, kv_cache=cache)
    with pytest.raises(clmha.Error) as ei:
        layer.forward(randn(rng, 2, N, E), is_causal=True, kv_cache=cache)
    assert ei.value.status == clmha.STATUS["SHAPE_MISMATCH"]
    assert ei.value.message
    assert cache.lengths.tolist() == [3] * N  # nothing changed
    layer.forward(randn(rng, 1, N, E), is_causal=True, kv_cache=cache)
    assert cache.lengths.tolist() == [4] * N
    with pytest.raises((ValueError, TypeError)):
        layer.kv_cache(0, 4)
    with pytest.raises((ValueError, TypeError)):
        layer.kv_cache(N, -1)


# ---- paged caches ------------------------------------------------------------------------------

def test_paged_cache_is_the_contiguous_one(ctx, rng):
    """The same calls through a paged cache and a contiguous one: the same bits; a fork shares
    a prompt and copies a shared, partly filled page when a sequence appends into it; an
    exhausted pool raises clmha.Error and changes nothing."""
    layer = clmha.Layer(32, 4, num_kv_heads=2, context=ctx)
    for name in layer.parameter_names():
        layer[name] = rng.normal(0, 0.2, layer[name].shape).astype(np.float32)
    a = layer.kv_cache(3, 64)
    b = layer.kv_cache(3, page_size=16, num_pages=12)
    assert b.page_size == 16 and b.num_pages == 12 and b.capacity == 192
    prompt = rng.standard_normal((21, 1, 32)).astype(np.float32)
    ya, _ = layer.forward(np.repeat(prompt, 3, axis=1), kv_cache=a, is_causal=True)
    yb, _ = layer.forward(np.repeat(prompt, 3, axis=1), kv_cache=b, is_causal=True,
                          kv_append=[21, 0, 0])
    assert np.array_equal(ya[:, 0], yb[:, 0])
    b.fork(0, 1)
    b.fork(0, 2)
    assert b.free_pages == 10 and b.lengths.tolist() == [21, 21, 21]
    for step in range(5):
        x = rng.standard_normal((1, 3, 32)).astype(np.float32)
        oa, _ = layer.forward(x, kv_cache=a, is_causal=True)
        ob, _ = layer.forward(x, kv_cache=b, is_causal=True)
        assert np.array_equal(oa, ob), step
    assert b.free_pages == 8  # two copies on write
    big = rng.standard_normal((40, 3, 32)).astype(np.float32)
    with pytest.raises(clmha.Error, match="pool is exhausted"):
        layer.forward(big, kv_cache=b, is_causal=True)
    assert b.lengths.tolist() == [26, 26, 26] and b.free_pages == 8
    with pytest.raises(clmha.Error):
        a.fork(0, 1)
    with pytest.raises(ValueError):
        layer.kv_cache(3, 64, page_size=16, num_pages=4)
    with pytest.raises(clmha.Error):
        layer.kv_cache(3, page_size=24, num_pages=4)
    b.reset()
    assert b.free_pages == 12
    assert "page_size=16" in repr(b)


@pytest.mark.parametrize("kind,bound", [("float16", 1e-3), ("bfloat16", 5e-3), ("int8", 1e-2),
                                        ("int4", 2e-1)])
def test_narrow_cache(ctx, rng, kind, bound):
    """A float16, bfloat16, int8 or int4 cache (kv_dtype=) against the float32 one: within the
    stated contract of the output's largest value on unit-scale data (docs/accuracy.md); paged
    (pages of 32 or 8) or not, the same bits."""
    layer = clmha.Layer(64, 2, context=ctx)
    limit = 1 / np.sqrt(64)
    for name in layer.parameter_names():
        layer[name] = rng.uniform(-limit, limit, layer[name].shape).astype(np.float32)
    f = layer.kv_cache(2, 128)
    q = layer.kv_cache(2, 128, kv_dtype=kind)
    p = layer.kv_cache(2, page_size=32, num_pages=8, kv_dtype=kind)
    p8 = layer.kv_cache(2, page_size=8, num_pages=26, kv_dtype=kind)  # blocks from two pages
    x = rng.standard_normal((100, 2, 64)).astype(np.float32)
    outs = [layer.forward(x, kv_cache=c, is_causal=True)[0] for c in (f, q, p, p8)]
    rel = np.abs(outs[1] - outs[0]).max() / np.abs(outs[0]).max()
    assert record(f"{kind} cache rel err", rel) <= bound
    assert np.array_equal(outs[1], outs[2]) and np.array_equal(outs[1], outs[3])
    with pytest.raises(ValueError, match="kv_dtype"):
        layer.kv_cache(2, 16, kv_dtype="int2")
    odd = clmha.Layer(6, 2, context=ctx)  # head_dim 3: int4 keeps two dimensions a byte
    with pytest.raises(clmha.Error, match="even head_dim"):
        odd.kv_cache(1, 16, kv_dtype="int4")
