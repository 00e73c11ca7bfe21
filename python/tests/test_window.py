"""Sliding-window attention from Python (``window=(left, right)``): clmha.Layer (and its layer
files), clmha.torch.MultiheadAttention, clmha.numpy.scaled_dot_product_attention(_backward) and
clmha.torch.scaled_dot_product_attention, forward and gradients, against the float64 formula
with the window written as an explicit mask (key j for query i iff i - left <= j <= i + right,
-1 leaving a side unbounded: helpers.window_keep), PyTorch's nn.MultiheadAttention for the layer
and helpers.sdpa_ref for the function. The calls run through impl "auto" (the unfused core,
which runs windows) and without a KV cache: the fused and decode cores take windows later."""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import clmha  # noqa: E402
import clmha.numpy as cn  # noqa: E402
import clmha.torch as ct  # noqa: E402
from helpers import (TOL, layer_of, max_err, randn, record, ref_forward,  # noqa: E402
                     safetensors_write, sdpa_ref, sdpa_ref_np, torch_grads, torch_mha,
                     window_keep)

E, H, N = 16, 4, 2
SDPA_TOL = 1e-5


def outside(L, S, window):
    """The window as nn.MultiheadAttention's bool attn_mask: True = may NOT attend."""
    return ~window_keep(L, S, window)


def with_window(am, L, S, window):
    """attn_mask @p am (None, bool True = masked, or float) with the window folded in."""
    out = outside(L, S, window)
    if am is None:
        return out
    if am.dtype == np.bool_:
        return am | out
    return np.where(out, -np.inf, am).astype(am.dtype)


def test_window_keep_is_the_formula():
    keep = window_keep(4, 6, (1, 2))
    for i in range(4):
        for j in range(6):
            assert keep[i, j] == (i - 1 <= j <= i + 2)
    assert window_keep(3, 3, (-1, 0)).tolist() == np.tril(np.ones((3, 3), bool)).tolist()
    assert window_keep(3, 3, (-1, -1)).all() and window_keep(3, 3, None).all()


# ---- clmha.Layer -------------------------------------------------------------------------------

LAYER_CASES = {
    # name: (module options, cross, window, is_causal, key_padding_mask, attn_mask kind)
    "self_causal_3_0": ({}, False, (3, 0), True, False, None),
    "cross_2_2_kpm": ({}, True, (2, 2), False, True, None),
    "self_left_unbounded_float_mask_zero_attn": (dict(add_zero_attn=True), False, (-1, 1), False,
                                                 False, "float"),
    "cross_bias_kv_bool_mask_batch_first": (dict(add_bias_kv=True, batch_first=True), True,
                                            (1, 3), False, True, "bool"),
    "self_right_unbounded": ({}, False, (0, -1), False, False, None),
}


def _layer_inputs(rng, m, cross, L, S, kpm, am):
    shape = (lambda T, F: (N, T, F)) if m.batch_first else (lambda T, F: (T, N, F))
    q = randn(rng, *shape(L, E))
    k = randn(rng, *shape(S, m.kdim)) if cross else None
    v = randn(rng, *shape(S, m.vdim)) if cross else None
    Sk = S if cross else L
    kpm_a = None
    if kpm:
        kpm_a = np.zeros((N, Sk), bool)
        kpm_a[1, -2:] = True  # the last keys of batch item 1
    am_a = None
    if am == "float":
        am_a = randn(rng, L, Sk)
    elif am == "bool":
        am_a = rng.random((L, Sk)) < 0.2
    return q, k, v, kpm_a, am_a


@pytest.mark.parametrize("name", sorted(LAYER_CASES))
def test_layer_forward(ctx, rng, name):
    opts, cross, window, causal, kpm, am_kind = LAYER_CASES[name]
    m = torch_mha(E, H, **opts)
    layer = layer_of(m, ctx, window=window)
    assert layer.window == window
    L, S = 6, (7 if cross else 6)
    q, k, v, kpm_a, am_a = _layer_inputs(rng, m, cross, L, S, kpm, am_kind)
    Sk = S if cross else L
    for per_head in (False, True):
        out, w = layer.forward(q, k, v, key_padding_mask=kpm_a, attn_mask=am_a,
                               is_causal=causal, need_weights=True,
                               average_attn_weights=not per_head)
        am_ref = with_window(am_a, L, Sk, window)
        if causal:
            am_ref = am_ref | np.triu(np.ones((L, Sk), bool), 1)
        ref_out, ref_w = ref_forward(m, q, k, v, key_padding_mask=kpm_a, attn_mask=am_ref,
                                     need_weights=True, average_attn_weights=not per_head)
        assert record(f"window layer {name} output", max_err(out, ref_out)) <= TOL
        assert record(f"window layer {name} weights", max_err(w, ref_w)) <= TOL
    # the window changes the result (the comparison can fail)
    no_window = layer_of(m, ctx)
    out0, _ = no_window.forward(q, k, v, key_padding_mask=kpm_a, attn_mask=am_a,
                                is_causal=causal)
    assert max_err(out0, ref_out) > 100 * TOL


@pytest.mark.parametrize("window", [(2, 0), (1, 1)])
def test_layer_backward(ctx, rng, window):
    m = torch_mha(E, H, add_bias_kv=True)
    layer = layer_of(m, ctx, window=window)
    L, S = 6, 7
    q, k, v = randn(rng, L, N, E), randn(rng, S, N, E), randn(rng, S, N, E)
    kpm = np.zeros((N, S), bool)
    kpm[0, 0] = True
    am = randn(rng, L, S)
    saved = layer.saved()
    out, w = layer.forward(q, k, v, key_padding_mask=kpm, attn_mask=am, need_weights=True,
                           save=saved)
    gout, gw = randn(rng, *out.shape), randn(rng, *w.shape)
    grads = layer.backward(saved, gout, gw)
    # PyTorch: the window as -inf in the float mask; the mask's gradient is 0 outside it
    ref_out, ref = torch_grads(m, q, k, v, kpm, with_window(am, L, S, window), gout, gw)
    assert max_err(out, ref_out) <= TOL
    assert set(ref) <= set(grads), (sorted(ref), sorted(grads))
    for name, g in ref.items():
        err = max_err(grads[name], g) / (1 + np.abs(g).max())
        record(f"window layer backward {window} d{name} (rel)", err)
        assert err <= TOL, name
    assert np.all(grads["attn_mask"][outside(L, S, window)] == 0)


def test_layer_file_round_trip(ctx, tmp_path, rng):
    m = torch_mha(E, H)
    layer = layer_of(m, ctx, window=(1023, 0))
    path = str(tmp_path / "swa.safetensors")
    layer.save(path)
    loaded = clmha.Layer.load(path, context=ctx)
    assert loaded.window == (1023, 0)
    assert "window=(1023, 0)" in repr(loaded)
    q = randn(rng, 5, N, E)
    a, _ = layer.forward(q, is_causal=True)
    b, _ = loaded.forward(q, is_causal=True)
    assert np.array_equal(a, b)
    # a file without the key: no window
    plain = layer_of(m, ctx)
    assert plain.window is None and "window" not in repr(plain)
    plain.save(path)
    assert clmha.Layer.load(path, context=ctx).window is None


def test_layer_file_metadata(ctx, tmp_path, rng):
    path = str(tmp_path / "meta.safetensors")
    tensors = {"in_proj_weight": randn(rng, 3 * E, E), "out_proj.weight": randn(rng, E, E)}
    for text, want in (("3,0", (3, 0)), ("-1,2", (-1, 2)), ("0,-1", (0, -1))):
        safetensors_write(path, tensors, {"num_heads": str(H), "window": text})
        assert clmha.Layer.load(path, context=ctx).window == want
    for bad in ("abc", "-2,0", "5", "1,2,3", "1, 0"):
        safetensors_write(path, tensors, {"num_heads": str(H), "window": bad})
        with pytest.raises(clmha.Error) as e:
            clmha.Layer.load(path, context=ctx)
        assert e.value.status_name == "INVALID_FILE"
        assert f'window is "{bad}"' in str(e.value), str(e.value)


def test_layer_from_state_dict(ctx):
    m = torch_mha(E, H)
    layer = clmha.Layer.from_state_dict(m.state_dict(), H, context=ctx, window=(4, 1))
    assert layer.window == (4, 1)


@pytest.mark.parametrize("bad, exc", [((-2, 0), ValueError), ((0, -5), ValueError),
                                      ((2 ** 63, 0), ValueError), ("3,0", TypeError),
                                      ((1,), TypeError), ((1, 2, 3), TypeError),
                                      ((1.5, 0), TypeError), ((True, 0), TypeError), (3, TypeError)])
def test_window_errors(ctx, bad, exc):
    with pytest.raises(exc):
        clmha.Layer(E, H, window=bad, context=ctx)
    with pytest.raises(exc):
        ct.MultiheadAttention(E, H, window=bad, context=ctx)
    q = np.zeros((N, H, 3, 8), np.float32)
    with pytest.raises(exc):
        cn.scaled_dot_product_attention(q, q, q, window=bad, context=ctx)
    with pytest.raises(exc):
        ct.scaled_dot_product_attention(torch.from_numpy(q), torch.from_numpy(q),
                                        torch.from_numpy(q), window=bad, context=ctx)


# ---- clmha.torch.MultiheadAttention ------------------------------------------------------------

def test_torch_module_forward_and_gradients(ctx):
    g = torch.Generator().manual_seed(7)
    tm = torch_mha(E, H, batch_first=True)
    cm = ct.MultiheadAttention(E, H, batch_first=True, context=ctx, window=(2, 1))
    cm.load_state_dict(tm.state_dict())
    cm.eval()
    L, S = 6, 8
    q = torch.randn(N, L, E, generator=g).requires_grad_()
    k = torch.randn(N, S, E, generator=g).requires_grad_()
    v = torch.randn(N, S, E, generator=g).requires_grad_()
    out, w = cm(q, k, v, need_weights=True)
    # PyTorch float64 with the window as its attn_mask
    md = copy.deepcopy(tm).double()
    q2, k2, v2 = (t.detach().double().requires_grad_() for t in (q, k, v))
    mask = torch.from_numpy(outside(L, S, (2, 1)))
    ro, rw = md(q2, k2, v2, attn_mask=mask, need_weights=True)
    assert record("window torch module output", (out.double() - ro).abs().max().item()) <= TOL
    assert record("window torch module weights", (w.double() - rw).abs().max().item()) <= TOL
    gout = torch.randn(out.shape, generator=g)
    gw = torch.randn(w.shape, generator=g)
    torch.autograd.backward([out, w], [gout, gw])
    torch.autograd.backward([ro, rw], [gout.double(), gw.double()])
    for name, a, b in (("query", q, q2), ("key", k, k2), ("value", v, v2)):
        e = (a.grad.double() - b.grad).abs().max().item() / (1 + b.grad.abs().max().item())
        assert record(f"window torch module grad {name} (rel)", e) <= TOL, name
    for (name, p), (_, p2) in zip(cm.named_parameters(), md.named_parameters()):
        e = (p.grad.double() - p2.grad).abs().max().item() / (1 + p2.grad.abs().max().item())
        assert record(f"window torch module grad {name} (rel)", e) <= TOL, name


def test_torch_module_window_attribute_from_torch_and_export(ctx, tmp_path):
    tm = torch_mha(E, H)
    cm = ct.MultiheadAttention(E, H, context=ctx, window=(3, 0))
    cm.load_state_dict(tm.state_dict())
    x = torch.randn(5, N, E)
    a, _ = cm(x, x, x, need_weights=False, is_causal=True)
    assert cm._layer().window == (3, 0)
    # from_torch keeps a clmha module's window
    again = ct.MultiheadAttention.from_torch(cm, context=ctx)
    assert again.window == (3, 0)
    b, _ = again(x, x, x, need_weights=False, is_causal=True)
    assert torch.equal(a, b)
    # export writes it; clmha.Layer.load reads it
    path = str(tmp_path / "m.safetensors")
    ct.export(cm, path)
    assert clmha.Layer.load(path, context=ctx).window == (3, 0)
    # a new window makes a new layer; None takes it off
    cm.window = (0, 0)
    c, _ = cm(x, x, x, need_weights=False)
    assert cm._layer().window == (0, 0)
    ro, _ = ref_forward(tm, x.numpy(), attn_mask=outside(5, 5, (0, 0)))
    assert max_err(c.detach().numpy(), ro) <= TOL
    cm.window = None
    assert cm._layer().window is None
    d, _ = cm(x, x, x, need_weights=False)
    ro, _ = ref_forward(tm, x.numpy())
    assert max_err(d.detach().numpy(), ro) <= TOL


# ---- attention as a function -------------------------------------------------------------------

SDPA_CASES = {
    # name: (N, H, H_kv, L, S, window, is_causal, mask kind)
    "gqa_left_unbounded": (2, 4, 2, 6, 6, (-1, 1), False, None),
    "window_2_2_bool_mask": (2, 2, 2, 5, 8, (2, 2), False, "bool"),
    "causal_2": (1, 3, 3, 7, 7, (2, -1), True, None),
    "float_mask_L_gt_S": (2, 2, 1, 8, 5, (4, 0), False, "float"),
}


def _sdpa_inputs(rng, n, h, hkv, L, S, D=8, mask=None):
    q, k, v = randn(rng, n, h, L, D), randn(rng, n, hkv, S, D), randn(rng, n, hkv, S, D)
    m = None
    if mask == "bool":
        m = rng.random((n, 1, L, S)) < 0.8
        m[..., :] |= window_keep(L, S, (0, 0))  # the diagonal: no row loses every key
    elif mask == "float":
        m = randn(rng, L, S)
    return q, k, v, m


@pytest.mark.parametrize("name", sorted(SDPA_CASES))
def test_numpy_sdpa(ctx, rng, name):
    n, h, hkv, L, S, window, causal, mask = SDPA_CASES[name]
    q, k, v, m = _sdpa_inputs(rng, n, h, hkv, L, S, mask=mask)
    gqa = hkv != h
    out, lse = cn.scaled_dot_product_attention(q, k, v, m, is_causal=causal, enable_gqa=gqa,
                                               window=window, return_lse=True, context=ctx)
    ref = sdpa_ref_np(q, k, v, m, is_causal=causal, enable_gqa=gqa, window=window)
    assert record(f"window sdpa {name} output", max_err(out, ref)) <= SDPA_TOL
    assert max_err(out, sdpa_ref_np(q, k, v, m, is_causal=causal, enable_gqa=gqa)) > 100 * SDPA_TOL
    _, w = cn.scaled_dot_product_attention(q, k, v, m, is_causal=causal, enable_gqa=gqa,
                                           window=window, return_weights=True, context=ctx)
    keep = window_keep(L, S, window)
    assert np.all(w[..., ~keep] == 0)
    # the log-sum-exp of the windowed scores
    t = lambda a: torch.from_numpy(np.asarray(a, np.float64))  # noqa: E731
    kk = t(k).repeat_interleave(h // hkv, dim=-3)
    scores = t(q) @ kk.transpose(-2, -1) / np.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(), float("-inf"))
    scores = scores.masked_fill(torch.from_numpy(~keep), float("-inf"))
    if m is not None:
        scores = (scores.masked_fill(~torch.from_numpy(m), float("-inf")) if m.dtype == np.bool_
                  else scores + t(m))
    assert max_err(lse, torch.logsumexp(scores, -1).numpy()) <= SDPA_TOL
    # backward: query, key, value and a float mask's gradient
    g = randn(rng, *out.shape)
    grads = cn.scaled_dot_product_attention_backward(g, q, k, v, m, is_causal=causal,
                                                     enable_gqa=gqa, window=window, context=ctx)
    d = {x: t(a).requires_grad_() for x, a in (("q", q), ("k", k), ("v", v))}
    mt = None
    if m is not None:
        mt = torch.from_numpy(m) if m.dtype == np.bool_ else t(m).requires_grad_()
    r = sdpa_ref(d["q"], d["k"], d["v"], mt, is_causal=causal, enable_gqa=gqa, window=window)
    r.backward(t(g))
    for got, x in zip(grads[:3], ("q", "k", "v")):
        want = d[x].grad.numpy()
        e = record(f"window sdpa {name} grad {x}", max_err(got, want))
        assert e <= SDPA_TOL * max(1.0, np.abs(want).max()), x
    if mt is not None and mt.requires_grad:
        assert max_err(grads[3], mt.grad.numpy()) <= SDPA_TOL * max(1.0, mt.grad.abs().max())
        assert np.all(grads[3][~keep] == 0)
    else:
        assert grads[3] is None


def test_numpy_sdpa_layouts_and_shapes(ctx, rng):
    L, S, D, window = 6, 7, 8, (1, 2)
    # NLHD: the window runs along L and S whatever the layout
    q, k, v = randn(rng, N, L, H, D), randn(rng, N, S, H, D), randn(rng, N, S, H, D)
    out = cn.scaled_dot_product_attention(q, k, v, layout="NLHD", window=window, context=ctx)
    tr = lambda a: np.ascontiguousarray(a.swapaxes(1, 2))  # noqa: E731
    ref = sdpa_ref_np(tr(q), tr(k), tr(v), window=window)
    assert max_err(out, tr(ref)) <= SDPA_TOL
    # 2-D (L, D) and 5-D (..., H, L, D): the leading dimensions fold, the rows stay rows
    q2, k2, v2 = randn(rng, L, D), randn(rng, S, D), randn(rng, S, D)
    out2 = cn.scaled_dot_product_attention(q2, k2, v2, window=window, context=ctx)
    assert max_err(out2, sdpa_ref_np(q2, k2, v2, window=window)) <= SDPA_TOL
    q5, k5, v5 = randn(rng, 3, N, H, L, D), randn(rng, 3, N, H, S, D), randn(rng, 3, N, H, S, D)
    out5 = cn.scaled_dot_product_attention(q5, k5, v5, window=window, context=ctx)
    assert max_err(out5, sdpa_ref_np(q5, k5, v5, window=window)) <= SDPA_TOL


def test_torch_sdpa_forward_and_gradients(ctx):
    g = torch.Generator().manual_seed(11)
    q = torch.randn(N, H, 6, 8, generator=g).requires_grad_()
    k = torch.randn(N, 2, 9, 8, generator=g).requires_grad_()
    v = torch.randn(N, 2, 9, 8, generator=g).requires_grad_()
    am = torch.randn(N, 1, 6, 9, generator=g).requires_grad_()
    window = (3, 1)
    out = ct.scaled_dot_product_attention(q, k, v, am, enable_gqa=True, window=window,
                                          context=ctx)
    d = {n: t.detach().double().requires_grad_() for n, t in (("q", q), ("k", k), ("v", v),
                                                              ("m", am))}
    r = sdpa_ref(d["q"], d["k"], d["v"], d["m"], enable_gqa=True, window=window)
    assert record("window torch sdpa output", (out.double() - r).abs().max().item()) <= SDPA_TOL
    go = torch.randn(out.shape, generator=g)
    out.backward(go)
    r.backward(go.double())
    for name, a in (("q", q), ("k", k), ("v", v), ("m", am)):
        b = d[name].grad
        e = record(f"window torch sdpa grad {name}", (a.grad.double() - b).abs().max().item())
        assert e <= SDPA_TOL * max(1.0, b.abs().max().item()), name
    assert (am.grad[..., ~torch.from_numpy(window_keep(6, 9, window))] == 0).all()
