"""clmha.Layer on NumPy arrays against PyTorch's float64 nn.MultiheadAttention, option by
option; devices, contexts, parameters, files, dropout, dtypes and the backward pass."""

import copy
import zlib

import numpy as np
import pytest

import clmha
from helpers import (TOL, torch_grads, causal_float_mask, layer_of, max_err, randn, record, ref_forward,
                     t64, torch_mha)

torch = pytest.importorskip("torch")

E, H, N, L, S = 16, 2, 2, 5, 6


# ---- devices and contexts ----------------------------------------------------------------------

def test_devices_fields(has_device):
    devs = clmha.devices()
    assert devs
    for i, d in enumerate(devs):
        assert d.index == i
        assert isinstance(d.spec, str) and d.spec
        assert d.type in ("cpu", "gpu", "accelerator", "default", "custom", "other")
        assert d.platform_name and d.device_name
        assert d.compute_units >= 1
        assert d.global_mem_bytes > 0 and d.local_mem_bytes > 0 and d.max_alloc_bytes > 0
        assert isinstance(d.fp16, bool) and isinstance(d.fp64, bool)
        assert isinstance(d.note, str)
        assert d.spec in str(d)


def test_context_default_and_spec(has_device):
    d = clmha.devices()[0]
    c0 = clmha.Context()
    c1 = clmha.Context(d.spec)
    c2 = clmha.Context(d)
    for c in (c0, c1, c2):
        assert " / " in c.device_name
        assert c.gemm in ("host", "clblast")
        assert c.pyopencl_queue is None
        assert c.cl_context_int_ptr != 0
    assert d.device_name in c1.device_name and d.device_name in c2.device_name
    # a layer on each gives the same result
    rng = np.random.default_rng(0)
    x = randn(rng, L, N, E)
    outs = []
    for c in (c1, c2):
        layer = clmha.Layer(E, H, context=c)
        layer["in_proj_weight"] = randn(np.random.default_rng(1), 3 * E, E)
        layer["out_proj.weight"] = randn(np.random.default_rng(2), E, E)
        outs.append(layer.forward(x)[0])
    assert np.array_equal(outs[0], outs[1])
    assert np.abs(outs[0]).max() > 0


# ---- parameters and files ----------------------------------------------------------------------

def test_layer_kwargs_and_parameters(ctx, rng):
    layer = clmha.Layer(E, H, kdim=8, vdim=12, add_bias_kv=True, batch_first=True, context=ctx)
    assert (layer.embed_dim, layer.num_heads, layer.kdim, layer.vdim) == (E, H, 8, 12)
    assert layer.batch_first and layer.add_bias_kv and layer.bias and not layer.add_zero_attn
    assert layer.head_dim == E // H and layer.dtype == "float32"
    assert layer.parameter_names() == ("q_proj_weight", "k_proj_weight", "v_proj_weight",
                                       "in_proj_bias", "bias_k", "bias_v", "out_proj.weight",
                                       "out_proj.bias")
    shapes = {"q_proj_weight": (E, E), "k_proj_weight": (E, 8), "v_proj_weight": (E, 12),
              "in_proj_bias": (3 * E,), "bias_k": (1, 1, E), "bias_v": (1, 1, E),
              "out_proj.weight": (E, E), "out_proj.bias": (E,)}
    for name in layer.parameter_names():
        assert layer[name].shape == shapes[name]
        assert not layer[name].any()  # parameters start at zero
    values = {n: randn(rng, *s) for n, s in shapes.items()}
    for n, v in values.items():
        layer[n] = v
    for n, v in values.items():
        assert np.array_equal(layer[n], v), n
    sd = layer.state_dict()
    assert list(sd) == list(layer.parameter_names())
    other = clmha.Layer(E, H, kdim=8, vdim=12, add_bias_kv=True, batch_first=True, context=ctx)
    other.load_state_dict(sd)
    for n, v in values.items():
        assert np.array_equal(other[n], v)
    # the same parameters: the same output
    q, k, v = randn(rng, N, L, E), randn(rng, N, S, 8), randn(rng, N, S, 12)
    assert np.array_equal(layer.forward(q, k, v)[0], other.forward(q, k, v)[0])
    with pytest.raises(KeyError):
        other.load_state_dict({k2: v2 for k2, v2 in sd.items() if k2 != "bias_k"})


def test_save_load_round_trip(ctx, rng, tmp_path):
    m = torch_mha(E, H, add_bias_kv=True)
    layer = layer_of(m, ctx)
    path = tmp_path / "layer.safetensors"
    layer.save(path)
    assert path.stat().st_size > 0
    back = clmha.Layer.load(path, ctx)
    assert back.parameter_names() == layer.parameter_names()
    assert back.add_bias_kv and back.num_heads == H and back.embed_dim == E
    for n in layer.parameter_names():
        assert np.array_equal(back[n], layer[n]), n
    x = randn(rng, L, N, E)
    assert np.array_equal(back.forward(x)[0], layer.forward(x)[0])
    ref, _ = ref_forward(m, x)
    assert record("save/load", max_err(back.forward(x)[0], ref)) <= TOL
    back2 = clmha.Layer.load(str(path), ctx)  # str path too
    assert np.array_equal(back2.forward(x)[0], layer.forward(x)[0])


# ---- forward parity, option by option ----------------------------------------------------------

def _kpm_bool(rng, n, s):
    m = rng.random((n, s)) < 0.3
    m[:, 0] = False  # no fully masked row (PyTorch gives NaN there)
    return m


def _attn_bool(rng, shape):
    m = rng.random(shape) < 0.3
    m[..., 0] = False
    return m


def _float(rng, *shape):
    return randn(rng, *shape)


CASES = {
    # name: (module options, cross, unbatched, masks(rng) -> dict, forward options)
    "self": ({}, False, False, None, {}),
    "cross_kdim_vdim": (dict(kdim=8, vdim=12), True, False, None, {}),
    "cross_same_dim": ({}, True, False, None, {}),
    "batch_first": (dict(batch_first=True), True, False, None, {}),
    "unbatched": ({}, True, True, None, {}),
    "unbatched_masks": ({}, True, True, lambda r: dict(
        key_padding_mask=_kpm_bool(r, 1, S)[0], attn_mask=_float(r, L, S)), {}),
    "kpm_bool": ({}, True, False, lambda r: dict(key_padding_mask=_kpm_bool(r, N, S)), {}),
    "kpm_float": ({}, True, False, lambda r: dict(key_padding_mask=_float(r, N, S)), {}),
    "attn2d_bool": ({}, True, False, lambda r: dict(attn_mask=_attn_bool(r, (L, S))), {}),
    "attn3d_bool": ({}, True, False, lambda r: dict(attn_mask=_attn_bool(r, (N * H, L, S))), {}),
    "attn2d_float": ({}, True, False, lambda r: dict(attn_mask=_float(r, L, S)), {}),
    "attn3d_float": ({}, True, False, lambda r: dict(attn_mask=_float(r, N * H, L, S)), {}),
    "kpm_bool_attn_float": ({}, True, False, lambda r: dict(
        key_padding_mask=_kpm_bool(r, N, S), attn_mask=_float(r, L, S)), {}),
    "weights_avg": ({}, True, False, lambda r: dict(key_padding_mask=_kpm_bool(r, N, S)),
                    dict(need_weights=True)),
    "weights_per_head": ({}, True, False, lambda r: dict(attn_mask=_float(r, N * H, L, S)),
                         dict(need_weights=True, average_attn_weights=False)),
    "weights_unbatched": ({}, False, True, None, dict(need_weights=True,
                                                      average_attn_weights=False)),
    "add_bias_kv": (dict(add_bias_kv=True), True, False, lambda r: dict(
        key_padding_mask=_kpm_bool(r, N, S), attn_mask=_float(r, L, S)),
        dict(need_weights=True)),
    "add_zero_attn": (dict(add_zero_attn=True), True, False, lambda r: dict(
        key_padding_mask=_kpm_bool(r, N, S)), dict(need_weights=True)),
    "bias_kv_zero_attn": (dict(add_bias_kv=True, add_zero_attn=True), False, False, None,
                          dict(need_weights=True, average_attn_weights=False)),
    "no_bias": (dict(bias=False), True, False, None, {}),
    "no_bias_kdim": (dict(bias=False, kdim=8, vdim=8, batch_first=True), True, False,
                     lambda r: dict(attn_mask=_attn_bool(r, (L, S))), dict(need_weights=True)),
}


def _inputs(rng, m, cross, unbatched):
    bf = m.batch_first
    shape = (lambda T, F: (T, F)) if unbatched else \
        ((lambda T, F: (N, T, F)) if bf else (lambda T, F: (T, N, F)))
    q = randn(rng, *shape(L, E))
    if not cross:
        return q, None, None
    return q, randn(rng, *shape(S, m.kdim)), randn(rng, *shape(S, m.vdim))


@pytest.mark.parametrize("impl", ["auto", "unfused", "fused"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_parity(ctx, name, impl):
    opts, cross, unbatched, masks, fw = CASES[name]
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    m = torch_mha(E, H, **opts)
    layer = layer_of(m, ctx)
    q, k, v = _inputs(rng, m, cross, unbatched)
    mk = masks(rng) if masks else {}
    if impl == "fused" and fw.get("need_weights"):
        with pytest.raises(clmha.Error) as ei:  # the fused core returns no weights
            layer.forward(q, k, v, impl=impl, **mk, **fw)
        assert ei.value.status_name == "INVALID_ARGUMENT" and "need_weights" in ei.value.message
        fw = {}
    out, w = layer.forward(q, k, v, impl=impl, **mk, **fw)
    ref, rw = ref_forward(m, q, k, v, **mk, **fw)
    assert out.shape == ref.shape and out.dtype == np.float32
    assert record(f"forward {name}", max_err(out, ref)) <= TOL
    if fw.get("need_weights"):
        assert w is not None and w.shape == rw.shape
        assert record(f"weights {name}", max_err(w, rw)) <= TOL
    else:
        assert w is None


def test_is_causal(ctx, rng):
    for bf in (False, True):
        m = torch_mha(E, H, batch_first=bf)
        layer = layer_of(m, ctx)
        x = randn(rng, *((N, L, E) if bf else (L, N, E)))
        for impl in ("fused", "unfused"):
            out, _ = layer.forward(x, is_causal=True, impl=impl)
            ref, _ = ref_forward(m, x, attn_mask=causal_float_mask(L))
            assert record("forward is_causal", max_err(out, ref)) <= TOL
        # the causal mask matters
        full, _ = ref_forward(m, x)
        assert max_err(out, full) > 1e-3
        # cross-attention: top-left aligned (L, S)
        kv = randn(rng, *((N, S, E) if bf else (S, N, E)))
        out, w = layer.forward(x, kv, is_causal=True, need_weights=True)
        ref, rw = ref_forward(m, x, kv, attn_mask=causal_float_mask(L, S), need_weights=True)
        assert record("forward is_causal cross", max_err(out, ref)) <= TOL
        assert max_err(w, rw) <= TOL


def test_mask_attend_per_batch(ctx, rng):
    m = torch_mha(E, H, batch_first=True)
    layer = layer_of(m, ctx)
    q, k, v = randn(rng, N, L, E), randn(rng, N, S, E), randn(rng, N, S, E)
    attend = rng.random((N, L, S)) < 0.7
    attend[..., 2] = True
    out, w = layer.forward(q, k, v, attn_mask=clmha.Mask(attend, attend=True, per_batch=True),
                           need_weights=True, average_attn_weights=False)
    torch_mask = np.repeat(~attend, H, axis=0)  # (N*H, L, S), True = may not attend
    ref, rw = ref_forward(m, q, k, v, attn_mask=torch_mask, need_weights=True,
                          average_attn_weights=False)
    assert record("Mask(attend, per_batch)", max_err(out, ref)) <= TOL
    assert max_err(w, rw) <= TOL
    # attend=True on a 2-D mask, and a per-batch float mask
    a2 = attend[0]
    out, _ = layer.forward(q, k, v, attn_mask=clmha.Mask(a2, attend=True))
    ref, _ = ref_forward(m, q, k, v, attn_mask=~a2)
    assert max_err(out, ref) <= TOL
    fm = randn(rng, N, L, S)
    out, _ = layer.forward(q, k, v, attn_mask=clmha.Mask(fm, per_batch=True))
    ref, _ = ref_forward(m, q, k, v, attn_mask=np.repeat(fm, H, axis=0))
    assert record("Mask(float, per_batch)", max_err(out, ref)) <= TOL
    # without the polarity the result differs (the mask is really read)
    out_ignore, _ = layer.forward(q, k, v, attn_mask=attend[0])
    assert max_err(out_ignore, ref) > 1e-3


def test_fully_masked_row_gives_zeros(ctx, rng):
    m = torch_mha(E, H)
    layer = layer_of(m, ctx)
    x = randn(rng, L, N, E)
    mask = np.zeros((L, L), bool)
    mask[1, :] = True  # row 1 sees nothing
    out, w = layer.forward(x, attn_mask=mask, need_weights=True)
    bias = m.out_proj.bias.detach().numpy()
    assert np.allclose(out[1], bias[None, :], atol=1e-6)
    assert np.all(w[:, 1, :] == 0)
    assert np.all(np.isfinite(out))
    ref, _ = ref_forward(m, x, attn_mask=mask)
    rows = [i for i in range(L) if i != 1]
    assert max_err(out[rows], ref[rows]) <= TOL


def test_impl_fused_vs_unfused(ctx, rng):
    m = torch_mha(32, 4, batch_first=True)
    layer = layer_of(m, ctx)
    q, kv = randn(rng, 3, 7, 32), randn(rng, 3, 11, 32)
    kpm = _kpm_bool(rng, 3, 11)
    am = _float(rng, 7, 11)
    ref, _ = ref_forward(m, q, kv, key_padding_mask=kpm, attn_mask=am)
    outs = {impl: layer.forward(q, kv, key_padding_mask=kpm, attn_mask=am, impl=impl)[0]
            for impl in ("fused", "unfused", "auto")}
    for impl, out in outs.items():
        assert record(f"impl {impl}", max_err(out, ref)) <= TOL
    assert max_err(outs["fused"], outs["unfused"]) <= TOL
    with pytest.raises(ValueError):
        layer.forward(q, impl="fast")


# ---- dropout -----------------------------------------------------------------------------------

def test_dropout(ctx, rng):
    p = 0.4
    m = torch_mha(E, H, dropout=p, batch_first=True)
    layer = layer_of(m, ctx)
    assert layer.dropout == pytest.approx(p)
    Lq = 12
    x = randn(rng, N, Lq, E)
    ref, _ = ref_forward(m, x)
    ev, _ = layer.forward(x)  # training=False: no dropout
    assert max_err(ev, ref) <= TOL
    a, wa = layer.forward(x, training=True, seed=7, offset=3, need_weights=True,
                          average_attn_weights=False, impl="unfused")
    b, wb = layer.forward(x, training=True, seed=7, offset=3, need_weights=True,
                          average_attn_weights=False, impl="unfused")
    c, wc = layer.forward(x, training=True, seed=7, offset=4, need_weights=True,
                          average_attn_weights=False, impl="unfused")
    d, _ = layer.forward(x, training=True, seed=8, offset=3)
    assert np.array_equal(a, b) and np.array_equal(wa, wb)
    assert max_err(a, c) > 1e-3 and max_err(a, d) > 1e-3
    assert max_err(a, ref) > 1e-3
    # the dropped fraction is about p; kept weights are scaled by 1/(1-p)
    _, wfull = ref_forward(m, x, need_weights=True, average_attn_weights=False)
    dropped = (wa == 0)
    frac = dropped.mean()
    assert abs(frac - p) < 0.05, frac
    assert max_err(wa[~dropped], wfull[~dropped] / (1 - p)) <= TOL
    # the output is the dropped weights times the values, projected
    md = copy.deepcopy(m).double()
    xt = t64(x)
    w_in, b_in = md.in_proj_weight.detach(), md.in_proj_bias.detach()
    vproj = (xt @ w_in[2 * E:].T + b_in[2 * E:]).view(N, Lq, H, E // H).transpose(1, 2)
    heads = (torch.from_numpy(wa.astype(np.float64)) @ vproj).transpose(1, 2).reshape(N, Lq, E)
    y = md.out_proj(heads).detach().numpy()
    assert record("dropout output from its weights", max_err(a, y)) <= TOL
    # the fused core draws the same pattern
    f, _ = layer.forward(x, training=True, seed=7, offset=3, impl="fused")
    assert record("dropout fused vs unfused", max_err(f, a)) <= TOL


# ---- grouped-query attention -------------------------------------------------------------------

def _gqa_reference(params, q, kv, H, G):
    P = {k: torch.from_numpy(v.astype(np.float64)) for k, v in params.items()}
    Eq = P["q_proj_weight"].shape[0]
    D = Eq // H
    q, kv = t64(q), t64(kv)
    bq, bk, bv = P["in_proj_bias"].split([Eq, G * D, G * D])
    n, lq, s = q.shape[0], q.shape[1], kv.shape[1]
    qh = (q @ P["q_proj_weight"].T + bq).view(n, lq, H, D).transpose(1, 2)
    kh = (kv @ P["k_proj_weight"].T + bk).view(n, s, G, D).transpose(1, 2)
    vh = (kv @ P["v_proj_weight"].T + bv).view(n, s, G, D).transpose(1, 2)
    kh = kh.repeat_interleave(H // G, dim=1)
    vh = vh.repeat_interleave(H // G, dim=1)
    w = torch.softmax(qh @ kh.transpose(-2, -1) / np.sqrt(D), -1)
    o = (w @ vh).transpose(1, 2).reshape(n, lq, Eq)
    return (o @ P["out_proj.weight"].T + P["out_proj.bias"]).numpy(), w.numpy()


@pytest.mark.parametrize("G", [1, 2])
def test_grouped_query(ctx, rng, G):
    Hq, Eq = 4, 16
    D = Eq // Hq
    layer = clmha.Layer(Eq, Hq, num_kv_heads=G, batch_first=True, context=ctx)
    assert layer.num_kv_heads == G
    assert layer["k_proj_weight"].shape == (G * D, Eq)
    params = {n: randn(rng, *layer[n].shape, scale=0.4) for n in layer.parameter_names()}
    layer.load_state_dict(params)
    q, kv = randn(rng, N, L, Eq), randn(rng, N, S, Eq)
    ref, rw = _gqa_reference(params, q, kv, Hq, G)
    for impl in ("fused", "unfused"):
        out, _ = layer.forward(q, kv, impl=impl)
        assert record(f"GQA G={G} {impl}", max_err(out, ref)) <= TOL
    out, w = layer.forward(q, kv, need_weights=True, average_attn_weights=False)
    assert max_err(w, rw) <= TOL


# ---- dtypes ------------------------------------------------------------------------------------

def test_float64_layer(ctx, rng):
    if not clmha.devices()[0].fp64:
        pytest.skip("device has no fp64")
    m = torch_mha(E, H, kdim=8, vdim=12, add_bias_kv=True)
    layer = layer_of(m, ctx, dtype="float64")
    assert layer.dtype == "float64"
    sd = layer.state_dict()
    assert sd["in_proj_bias"].dtype == np.float64
    q = rng.standard_normal((L, N, E))
    k, v = rng.standard_normal((S, N, 8)), rng.standard_normal((S, N, 12))
    am = rng.standard_normal((L, S))
    out, w = layer.forward(q, k, v, attn_mask=am, need_weights=True)
    ref, rw = ref_forward(m, q, k, v, attn_mask=am, need_weights=True)
    assert out.dtype == np.float64
    assert record("float64 layer", max_err(out, ref)) <= 1e-12
    assert max_err(w, rw) <= 1e-12
    # parameters set in float64 are kept exactly
    x = rng.standard_normal((E,))
    layer["out_proj.bias"] = x
    assert np.array_equal(layer["out_proj.bias"], x)
    with pytest.raises(TypeError):
        layer.forward(q.astype(np.float32))


def _bf16(a):
    return torch.from_numpy(np.asarray(a, np.float32)).bfloat16().float().numpy()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16bit_layers(ctx, rng, dtype):
    r = 2.0 ** -11 if dtype == "float16" else 2.0 ** -8
    rnd = (lambda a: np.asarray(a, np.float32).astype(np.float16).astype(np.float32)) \
        if dtype == "float16" else _bf16
    m = torch_mha(E, H, batch_first=True)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.from_numpy(rnd(p.detach().numpy())))
    layer = layer_of(m, ctx, dtype=dtype)
    assert layer.dtype == dtype
    q, kv = rnd(randn(rng, N, L, E)), rnd(randn(rng, N, S, E))
    am = rnd(randn(rng, L, S))
    if dtype == "float16":
        out, w = layer.forward(q.astype(np.float16), kv.astype(np.float16), attn_mask=am,
                               need_weights=True)
        assert out.dtype == np.float16
    else:
        out, w = layer.forward(q, kv, attn_mask=am, need_weights=True)
        assert out.dtype == np.float32
        assert np.array_equal(_bf16(out), out)  # bfloat16 values
    ref, rw = ref_forward(m, q, kv, attn_mask=am, need_weights=True)
    for got, y, what in ((out, ref, "output"), (w, rw, "weights")):
        t = 1e-5 * (1 + np.abs(y).max())
        bound = r * (np.abs(y) + t) + t
        err = np.abs(got.astype(np.float64) - y)
        record(f"{dtype} {what} (err/bound)", (err / bound).max())
        assert np.all(err <= bound), (err / bound).max()


# ---- backward ----------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["cross_float_masks", "self_bias_kv", "kdim_zero_attn"])
def test_backward(ctx, rng, variant):
    opts = {"cross_float_masks": dict(batch_first=True),
            "self_bias_kv": dict(add_bias_kv=True),
            "kdim_zero_attn": dict(kdim=8, vdim=12, add_zero_attn=True)}[variant]
    m = torch_mha(E, H, **opts)
    layer = layer_of(m, ctx)
    self_att = variant == "self_bias_kv"
    shape = (lambda T, F: (N, T, F)) if m.batch_first else (lambda T, F: (T, N, F))
    q = randn(rng, *shape(L, E))
    Sk = L if self_att else S
    k = None if self_att else randn(rng, *shape(S, m.kdim))
    v = None if self_att else randn(rng, *shape(S, m.vdim))
    kpm = randn(rng, N, Sk) if variant != "self_bias_kv" else _kpm_bool(rng, N, Sk)
    am = randn(rng, L, Sk) if variant == "cross_float_masks" else randn(rng, N * H, L, Sk)
    saved = layer.saved()
    out, w = layer.forward(q, k, v, key_padding_mask=kpm, attn_mask=am, need_weights=True,
                           save=saved)
    assert saved.nbytes > 0
    gout = randn(rng, *out.shape)
    gw = randn(rng, *w.shape)
    grads = layer.backward(saved, gout, gw)
    ref_out, ref = torch_grads(m, q, k, v, kpm, am, gout, gw, self_attention=self_att)
    assert max_err(out, ref_out) <= TOL
    assert set(ref) <= set(grads), (sorted(ref), sorted(grads))
    for name, g in ref.items():
        err = max_err(grads[name], g) / (1 + np.abs(g).max())
        record(f"backward {variant} d{name} (rel)", err)
        assert err <= TOL, name
    # without the weights' gradient: the output's alone
    saved2 = layer.saved()
    layer.forward(q, k, v, key_padding_mask=kpm, attn_mask=am, save=saved2)
    g2 = layer.backward(saved2, gout, parameters=False, masks=False)
    _, ref2 = torch_grads(m, q, k, v, kpm, am, gout, None, need_weights=False,
                           self_attention=self_att)
    assert "in_proj_bias" not in g2 and "attn_mask" not in g2
    assert max_err(g2["query"], ref2["query"]) / (1 + np.abs(ref2["query"]).max()) <= TOL


def test_backward_rejects_foreign_saved(ctx, rng):
    a, b = clmha.Layer(E, H, context=ctx), clmha.Layer(E, H, context=ctx)
    s = a.saved()
    with pytest.raises(ValueError):
        b.forward(randn(rng, L, N, E), save=s)
    with pytest.raises(ValueError):
        a.backward(s, randn(rng, L, N, E))  # never filled
