"""Attention as a function with a KV cache: clmha.KVCache.for_attention and the kv_cache= and
kv_append= arguments of clmha.numpy.scaled_dot_product_attention and
clmha.torch.scaled_dot_product_attention. A sequence decoded through the cache (a causal prefix
chunk, then token by token) gives the rows of the one-shot causal attention, computed by the
float64 formula written out with PyTorch (helpers.sdpa_ref), never by clmha; GQA, (N, H, L, D)
and unbatched (H, L, D) tensors; the lengths; truncate and re-feed (speculative rollback);
ragged appends; what the cache form refuses."""

import gc

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import clmha  # noqa: E402
import clmha.numpy as cn  # noqa: E402
import clmha.torch as ct  # noqa: E402
from helpers import record, sdpa_ref as ref  # noqa: E402  (ref: the float64 formula)

TOL = 1e-5
N, H, HKV, D, T, PREFIX, CAP = 2, 4, 2, 8, 11, 4, 16


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(4242)


def _numpy_entry(q, k, v, **kw):
    kw = {n: x.numpy() if isinstance(x, torch.Tensor) else x for n, x in kw.items()}
    out = cn.scaled_dot_product_attention(q.numpy(), k.numpy(), v.numpy(), **kw)
    return torch.from_numpy(out)


ENTRIES = {"numpy": _numpy_entry, "torch": ct.scaled_dot_product_attention}


def err(a, b):
    return (a.double() - b.double()).abs().max().item()


def sequence(n=N, heads=H, kv_heads=HKV, t=T):
    q = torch.randn(n, heads, t, D)
    k = torch.randn(n, kv_heads, t, D)
    v = torch.randn(n, kv_heads, t, D)
    want = ref(q.double(), k.double(), v.double(), is_causal=True, enable_gqa=True)
    return q, k, v, want


def feed(f, cache, q, k, v, t0, t1, **kw):
    """Tokens [t0, t1) of the sequence through the cache, causal (bottom-right aligned)."""
    return f(q[..., t0:t1, :], k[..., t0:t1, :], v[..., t0:t1, :], is_causal=True,
             enable_gqa=True, kv_cache=cache, **kw)


@pytest.mark.parametrize("entry", ENTRIES)
def test_decode_equals_one_shot_causal(ctx, entry):
    f = ENTRIES[entry]
    q, k, v, want = sequence()
    cache = clmha.KVCache.for_attention(N, HKV, D, CAP, context=ctx)
    assert (cache.batch, cache.kv_heads, cache.head_dim, cache.capacity) == (N, HKV, D, CAP)
    assert cache.layer is None and cache.context is ctx
    assert cache.lengths.tolist() == [0] * N
    outs = [feed(f, cache, q, k, v, 0, PREFIX)]
    assert cache.lengths.tolist() == [PREFIX] * N
    for t in range(PREFIX, T):
        outs.append(feed(f, cache, q, k, v, t, t + 1))
        assert cache.lengths.tolist() == [t + 1] * N
    got = torch.cat(outs, dim=2)
    assert got.shape == (N, H, T, D) and got.dtype == torch.float32
    assert record(f"sdpa kv cache decode ({entry})", err(got, want)) <= TOL
    assert repr(cache) == (f"clmha.KVCache(kv_heads={HKV}, head_dim={D}, batch={N}, "
                           f"capacity={CAP}, lengths={[T] * N})")

    # Speculative rollback: drop the last tokens, feed them again (a chunk, then one step).
    cache.truncate(PREFIX + 2)
    assert cache.lengths.tolist() == [PREFIX + 2] * N
    again = [feed(f, cache, q, k, v, PREFIX + 2, T - 1), feed(f, cache, q, k, v, T - 1, T)]
    e = err(torch.cat(again, dim=2), want[:, :, PREFIX + 2:])
    assert record(f"sdpa kv cache truncate and re-feed ({entry})", e) <= TOL
    assert err(torch.cat(again, dim=2), got[:, :, PREFIX + 2:]) <= TOL  # the first outputs
    assert cache.lengths.tolist() == [T] * N
    # Truncate per sequence and re-feed ragged: sequence 0 its last 4 tokens, sequence 1 its
    # last 3 (kv_append [4, 3]; the fourth row of sequence 1 is padding, not checked).
    cache.truncate([T - 4, T - 3])
    assert cache.lengths.tolist() == [T - 4, T - 3]
    pad = [torch.cat([x[1:, :, T - 3:], torch.zeros_like(x[1:, :, :1])], dim=2)
           for x in (q, k, v)]
    qn, kn, vn = (torch.cat([x[:1, :, T - 4:], p], dim=0) for x, p in zip((q, k, v), pad))
    out = f(qn, kn, vn, is_causal=True, enable_gqa=True, kv_cache=cache, kv_append=[4, 3])
    assert cache.lengths.tolist() == [T] * N
    e = max(err(out[0], want[0, :, T - 4:]), err(out[1, :, :3], want[1, :, T - 3:]))
    assert record(f"sdpa kv cache ragged re-feed ({entry})", e) <= TOL
    cache.reset()
    assert cache.lengths.tolist() == [0] * N
    got = feed(f, cache, q, k, v, 0, T)  # one chunk: the one-shot causal call
    assert err(got, want) <= TOL


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("dtype", ["float64", "float16", "bfloat16"])
def test_decode_in_other_dtypes(ctx, entry, dtype):
    """A cache for float64 calls holds doubles (KVCache.for_attention(dtype=)): the rows of the
    one-shot causal attention within 1e-12; a 16-bit call's cache holds floats: within the
    16-bit contract r·(|y| + t) + t of the formula on the same 16-bit values."""
    if dtype == "float64" and not clmha.devices()[0].fp64:
        pytest.skip("device has no fp64")
    if entry == "numpy" and dtype == "bfloat16":
        pytest.skip("NumPy has no bfloat16")
    f = ENTRIES[entry]
    tdt = getattr(torch, dtype)
    q, k, v, _ = sequence()
    q, k, v = q.to(tdt), k.to(tdt), v.to(tdt)
    want = ref(q.double(), k.double(), v.double(), is_causal=True, enable_gqa=True)
    cache = clmha.KVCache.for_attention(N, HKV, D, CAP, context=ctx, dtype=dtype)
    assert cache.dtype == dtype
    outs = [feed(f, cache, q, k, v, 0, PREFIX)]
    outs += [feed(f, cache, q, k, v, t, t + 1) for t in range(PREFIX, T)]
    got = torch.cat(outs, dim=2)
    assert got.dtype == tdt
    if dtype == "float64":
        assert record(f"sdpa kv cache float64 ({entry})", err(got, want)) <= 1e-12
        return
    r = 2.0 ** -11 if dtype == "float16" else 2.0 ** -8
    t = 1e-5 * (1 + want.abs().max().item())
    ratio = ((got.double() - want).abs() / (r * (want.abs() + t) + t)).max().item()
    assert record(f"sdpa kv cache {dtype} ({entry}, of the contract)", ratio) <= 1.0


@pytest.mark.parametrize("entry", ENTRIES)
def test_unbatched_3d(ctx, entry):
    f = ENTRIES[entry]
    q, k, v, want = sequence(n=1)
    q, k, v, want = q[0], k[0], v[0], want[0]
    cache = clmha.KVCache.for_attention(1, HKV, D, T, context=ctx)
    outs = [feed(f, cache, q, k, v, 0, 3, kv_append=[3])]
    outs += [feed(f, cache, q, k, v, t, t + 1, kv_append=1) for t in range(3, T)]
    got = torch.cat(outs, dim=1)
    assert got.shape == (H, T, D)
    assert record(f"sdpa kv cache unbatched ({entry})", err(got, want)) <= TOL
    assert cache.lengths.tolist() == [T]


def test_no_gqa_and_not_causal_steps(ctx):
    """H_kv = H without enable_gqa; a step without is_causal sees every cached token (with one
    new query, the same as the causal step)."""
    q, k, v, want = sequence(kv_heads=H)
    want = ref(q.double(), k.double(), v.double(), is_causal=True)
    cache = clmha.KVCache.for_attention(N, H, D, T, context=ctx)
    outs = [ct.scaled_dot_product_attention(q[:, :, :PREFIX], k[:, :, :PREFIX],
                                            v[:, :, :PREFIX], is_causal=True, kv_cache=cache)]
    for t in range(PREFIX, T):
        outs.append(ct.scaled_dot_product_attention(q[:, :, t:t + 1], k[:, :, t:t + 1],
                                                    v[:, :, t:t + 1], kv_cache=cache))
    assert record("sdpa kv cache H_kv = H", err(torch.cat(outs, dim=2), want)) <= TOL


@pytest.mark.parametrize("entry", ENTRIES)
def test_ragged_kv_append(ctx, entry):
    f = ENTRIES[entry]
    s_new = 3
    append = [3, 2]
    q, k, v = torch.randn(N, H, s_new, D), torch.randn(N, HKV, s_new, D), \
        torch.randn(N, HKV, s_new, D)
    cache = clmha.KVCache.for_attention(N, HKV, D, 8, context=ctx)
    out = f(q, k, v, enable_gqa=True, kv_cache=cache, kv_append=append)
    assert cache.lengths.tolist() == append
    worst = 0.0
    for n, s in enumerate(append):  # each sequence over its own appended tokens only
        want = ref(q[n].double(), k[n, :, :s].double(), v[n, :, :s].double(), enable_gqa=True)
        worst = max(worst, err(out[n], want))
    # A step of one token for every sequence: sequence 1's lies after its 2 tokens (the third,
    # not appended, is gone).
    q2, k2, v2 = torch.randn(N, H, 1, D), torch.randn(N, HKV, 1, D), torch.randn(N, HKV, 1, D)
    out2 = f(q2, k2, v2, is_causal=True, enable_gqa=True, kv_cache=cache,
             kv_append=np.array([1, 1]))
    assert cache.lengths.tolist() == [4, 3]
    for n, s in enumerate(append):
        kk = torch.cat([k[n, :, :s], k2[n]], dim=1).double()
        vv = torch.cat([v[n, :, :s], v2[n]], dim=1).double()
        worst = max(worst, err(out2[n], ref(q2[n].double(), kk, vv, enable_gqa=True)))
    assert record(f"sdpa kv cache ragged ({entry})", worst) <= TOL
    # kv_append 0: sequence 0 appends nothing and attends over what it holds.
    out3 = f(q2, k2, v2, enable_gqa=True, kv_cache=cache, kv_append=[0, 1])
    assert cache.lengths.tolist() == [4, 4]
    kk = torch.cat([k[0], k2[0]], dim=1).double()
    vv = torch.cat([v[0], v2[0]], dim=1).double()
    assert err(out3[0], ref(q2[0].double(), kk, vv, enable_gqa=True)) <= TOL


def test_default_context_is_the_caches(ctx):
    """Without context=, a call with a cache runs on the cache's context (ctx here, not the
    default context); for_attention without context takes the default one."""
    q, k, v, want = sequence()
    cache = clmha.KVCache.for_attention(N, HKV, D, T, context=ctx)
    assert ctx is not clmha.default_context()
    got = cn.scaled_dot_product_attention(q.numpy(), k.numpy(), v.numpy(), is_causal=True,
                                          enable_gqa=True, kv_cache=cache)
    assert err(torch.from_numpy(got), want) <= TOL
    assert clmha.KVCache.for_attention(1, 1, 4, 4).context is clmha.default_context()
    # The cache on another context than the call's: the C library's refusal.
    other = clmha.KVCache.for_attention(N, HKV, D, T, context=clmha.default_context())
    with pytest.raises(clmha.Error, match="on another context"):
        cn.scaled_dot_product_attention(q.numpy(), k.numpy(), v.numpy(), enable_gqa=True,
                                        kv_cache=other, context=ctx)
    assert other.lengths.tolist() == [0] * N


def test_cache_keeps_its_context_alive(has_device):
    context = clmha.Context()
    cache = clmha.KVCache.for_attention(1, 1, D, 4, context=context)
    del context
    gc.collect()
    q, k, v = torch.randn(1, 1, 2, D), torch.randn(1, 1, 2, D), torch.randn(1, 1, 2, D)
    got = ct.scaled_dot_product_attention(q, k, v, is_causal=True, kv_cache=cache)
    assert err(got, ref(q.double(), k.double(), v.double(), is_causal=True)) <= TOL
    assert cache.lengths.tolist() == [2]
    del cache
    gc.collect()


@pytest.mark.parametrize("entry", ENTRIES)
def test_refusals(ctx, entry):
    f = ENTRIES[entry]
    q, k, v = torch.randn(N, H, 1, D), torch.randn(N, HKV, 1, D), torch.randn(N, HKV, 1, D)
    cache = clmha.KVCache.for_attention(N, HKV, D, 2, context=ctx)
    kw = dict(enable_gqa=True, kv_cache=cache)
    with pytest.raises(clmha.Error, match="does not take attn_mask") as e:
        f(q, k, v, attn_mask=torch.ones(1, 1, dtype=torch.bool), **kw)
    assert e.value.status_name == "UNSUPPORTED"
    with pytest.raises(clmha.Error, match="dropout") as e:
        f(q, k, v, dropout_p=0.5, **kw)
    assert e.value.status_name == "UNSUPPORTED"
    with pytest.raises(clmha.Error, match="value head dimension D_v other than D"):
        f(q, k, torch.randn(N, HKV, 1, D + 2), **kw)
    if entry == "numpy":
        with pytest.raises(clmha.Error, match="log-sum-exp"):
            cn.scaled_dot_product_attention(q.numpy(), k.numpy(), v.numpy(), return_lse=True,
                                            **kw)
    else:
        with pytest.raises(RuntimeError, match="no backward") as e:
            f(q.requires_grad_(), k, v, **kw)
        assert not isinstance(e.value, clmha.Error)
        with pytest.raises(RuntimeError, match="no backward"):
            f(q.detach(), k, v.requires_grad_(), **kw)
        with torch.no_grad():  # under no_grad: no graph, the call runs
            out = f(q, k, v, **kw)
        assert not out.requires_grad
        cache.reset()
        q, v = q.detach(), v.detach()
    assert cache.lengths.tolist() == [0] * N  # the refused calls appended nothing
    # Another number of key/value heads than the cache holds; another batch.
    wrong = clmha.KVCache.for_attention(N, H, D, 4, context=ctx)
    with pytest.raises(clmha.Error, match="kv_cache holds 4 key/value heads of 8 floats"):
        f(q, k, v, enable_gqa=True, kv_cache=wrong)
    with pytest.raises(clmha.Error, match="batch"):
        f(q[:1], k[:1], v[:1], **kw)
    # A layer's cache here; this cache in a layer's forward.
    layer = clmha.Layer(H * D, H, num_kv_heads=HKV, context=ctx)
    with pytest.raises(clmha.Error, match="made for a layer"):
        f(q, k, v, enable_gqa=True, kv_cache=layer.kv_cache(N, 4))
    with pytest.raises(clmha.Error, match="made for attention as a function"):
        layer.forward(np.zeros((1, N, H * D), np.float32), is_causal=True, kv_cache=cache)
    # kv_append: N counts, with a cache; past the capacity.
    with pytest.raises(ValueError, match="kv_append has 1 counts"):
        f(q, k, v, kv_append=[1], **kw)
    with pytest.raises(ValueError, match="kv_append's counts"):
        f(q, k, v, kv_append=[1, -1], **kw)
    with pytest.raises(clmha.Error, match="kv_append is set but kv_cache is NULL"):
        f(q, k, v, enable_gqa=True, kv_append=[1, 1])
    with pytest.raises(TypeError, match="kv_cache must be a clmha.KVCache"):
        f(q, k, v, enable_gqa=True, kv_cache="cache")
    f(q, k, v, **kw)
    f(q, k, v, **kw)
    with pytest.raises(clmha.Error) as e:
        f(q, k, v, **kw)
    assert e.value.status_name == "SHAPE_MISMATCH"
    assert cache.lengths.tolist() == [2] * N


def test_for_attention_arguments(ctx):
    for bad in (dict(batch=0), dict(kv_heads=-1), dict(head_dim=2.0), dict(capacity=True)):
        args = {**dict(batch=1, kv_heads=1, head_dim=4, capacity=4), **bad}
        with pytest.raises(ValueError):
            clmha.KVCache.for_attention(**args, context=ctx)
    with pytest.raises(TypeError, match="context must be a clmha.Context"):
        clmha.KVCache.for_attention(1, 1, 4, 4, context="cpu")
    with pytest.raises(clmha.Error) as e:
        clmha.KVCache.for_attention(1, 1, 4, 2 ** 32, context=ctx)
    assert e.value.status_name == "INVALID_ARGUMENT"
    cache = clmha.KVCache.for_attention(2, 1, 4, 4, context=ctx)
    with pytest.raises(clmha.Error):
        cache.truncate([1, 0])  # longer than the sequence holds
    with pytest.raises(clmha.Error):
        cache.truncate([0])  # not the batch
    with pytest.raises(ValueError):
        cache.truncate(-1)
