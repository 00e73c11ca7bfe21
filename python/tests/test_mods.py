"""User score and mask functions from Python (FlexAttention's score_mod and mask_mod as OpenCL C
source, ``score_mod=``, ``mask_mod=``, ``mod_params=``) on clmha.torch.MultiheadAttention,
clmha.torch.scaled_dot_product_attention, clmha.Layer and clmha.numpy's function: forward and
gradients against the float64 formula written out in torch ops (helpers.mha_ref, sdpa_ref) with
the variant the functions reproduce spelled out there: ALiBi from slopes in p (an explicit bias
-slope_h * |i - j|), soft-capping p[0] * tanh(s / p[0]), document masking from segment ids in p
(an explicit boolean mask); p changed between calls; the errors (a source that does not compile,
p without a source, p of a wrong dtype or shape, a backward without clmha_score_mod_grad). Each
forward check also asserts that the reference without the function is far off."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import clmha  # noqa: E402
import clmha.numpy as cn  # noqa: E402
import clmha.torch as ct  # noqa: E402
from helpers import (TOL, max_err, mha_ref, randn, record, sdpa_ref, sdpa_ref_np,  # noqa: E402
                     torch_mha)

E, H, N = 16, 4, 2
SDPA_TOL = 1e-5
SLOPES = np.array([0.9, -0.3, 0.45, 0.05], np.float32)  # one negative: the sign matters

ALIBI_SCORE = """
clmha_real clmha_score_mod(clmha_real s, int b, int h, int q, int k, __global const float *p) {
    return s - p[h] * fabs((clmha_real)(q - k));
}"""
ALIBI = ALIBI_SCORE + """
clmha_real clmha_score_mod_grad(clmha_real s, int b, int h, int q, int k,
                                __global const float *p) {
    return 1;
}"""
SOFTCAP = """
clmha_real clmha_score_mod(clmha_real s, int b, int h, int q, int k, __global const float *p) {
    return p[0] * tanh(s / p[0]);
}
clmha_real clmha_score_mod_grad(clmha_real s, int b, int h, int q, int k,
                                __global const float *p) {
    clmha_real t = tanh(s / p[0]);
    return 1 - t * t;
}"""
SEQ = 6  # the documents' sequence length, written into the mask's source
DOCS = f"""
int clmha_mask_mod(int b, int h, int q, int k, __global const float *p) {{
    return p[b * {SEQ} + q] == p[b * {SEQ} + k];  // the same document
}}"""
SEGMENTS = np.array([[0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 2, 2]], np.float32)  # (N, SEQ)


def rel(a, b):
    return max_err(a, b) / (1 + np.abs(np.asarray(b, np.float64)).max())


def same_doc(segments):
    """(N, SEQ, SEQ) bool: True where query and key are in the same document."""
    return segments[:, :, None] == segments[:, None, :]


def module_and_inputs(ctx, gen, cross, **mods):
    tm = torch_mha(E, H, batch_first=True)
    cm = ct.MultiheadAttention(E, H, batch_first=True, context=ctx, **mods)
    cm.load_state_dict(tm.state_dict())
    L, S = SEQ, (SEQ + 2 if cross else SEQ)
    q = (torch.randn(N, L, E, generator=gen) * 1.5).requires_grad_()
    if not cross:
        return tm, cm, (q,)
    k = (torch.randn(N, S, E, generator=gen) * 1.5).requires_grad_()
    v = torch.randn(N, S, E, generator=gen).requires_grad_()
    return tm, cm, (q, k, v)


def check_module(name, tm, cm, inputs, ref_opts, wrong_opts, gen, weights):
    """cm's output and gradients (inputs, parameters) against mha_ref's: with ``weights`` the
    per-head weights too and their gradient (the unfused cores), else without (the fused
    forward and backward). The reference without the function (``wrong_opts``) is far off."""
    for p in [*inputs, *cm.parameters()]:
        p.grad = None
    q, k, v = inputs if len(inputs) == 3 else inputs * 3
    out, w = cm(q, k, v, need_weights=weights, average_attn_weights=False)
    gout = torch.randn(out.shape, generator=gen)
    gw = torch.randn(w.shape, generator=gen) if weights else None
    torch.autograd.backward([out, w] if weights else [out], [gout, gw] if weights else [gout])
    arrays = [t.detach().numpy() for t in inputs]
    ro, rw, ref = mha_ref(tm, *arrays, need_weights=weights, average_attn_weights=False,
                          grad_output=gout.numpy(), grad_weights=None if gw is None else
                          gw.numpy(), **ref_opts)
    core = "unfused" if weights else "fused"
    assert record(f"mods torch module {name} output ({core})", max_err(out.detach(), ro)) <= TOL
    if weights:
        assert record(f"mods torch module {name} weights", max_err(w.detach(), rw)) <= TOL
    got = dict(query=q.grad, **{n: p.grad for n, p in cm.named_parameters()})
    if len(inputs) == 3:
        got.update(key=k.grad, value=v.grad)
    assert set(ref) == set(got), (sorted(ref), sorted(got))
    for n, want in ref.items():
        err = record(f"mods torch module {name} grad {n} ({core}, rel)", rel(got[n], want))
        assert err <= TOL, n
    bad, _, _ = mha_ref(tm, *arrays, need_weights=False, **wrong_opts)
    assert max_err(out.detach(), bad) > 30 * TOL


# ---- (a) ALiBi from p, (b) soft-capping from p, (c) document masks from p: the module -------


def test_module_score_mod_alibi(ctx):
    g = torch.Generator().manual_seed(1)
    p = torch.from_numpy(SLOPES.copy())
    tm, cm, inputs = module_and_inputs(ctx, g, True, score_mod=ALIBI, mod_params=p)
    assert cm.mod_params is p  # a float32 tensor is kept itself, as register_buffer keeps it
    check_module("alibi", tm, cm, inputs, dict(alibi_slopes=SLOPES), {}, g, False)
    assert not cm.mod_params.requires_grad and cm.mod_params.grad is None
    assert "mod_params" not in cm.state_dict()


def test_module_score_mod_softcap(ctx):
    g = torch.Generator().manual_seed(2)
    tm, cm, inputs = module_and_inputs(ctx, g, True, score_mod=SOFTCAP,
                                       mod_params=torch.tensor([0.8], dtype=torch.float64))
    assert cm.mod_params.dtype == torch.float32  # kept as float32
    check_module("softcap", tm, cm, inputs, dict(softcap=0.8), {}, g, False)


def test_module_mask_mod_documents(ctx):
    g = torch.Generator().manual_seed(3)
    tm, cm, inputs = module_and_inputs(ctx, g, False, mask_mod=DOCS,
                                       mod_params=torch.from_numpy(SEGMENTS.ravel()))
    # mha_ref's (N*H, L, S) attn_mask: True = may NOT attend
    forbid = np.repeat(~same_doc(SEGMENTS), H, axis=0)
    check_module("documents", tm, cm, inputs, dict(attn_mask=forbid), {}, g, False)


def test_module_score_and_mask_mod_together(ctx):
    """Both functions, one p: ALiBi's slopes in p[0:H], the segments after them."""
    g = torch.Generator().manual_seed(4)
    score = ALIBI
    mask = DOCS.replace(f"p[b * {SEQ}", f"p[{H} + b * {SEQ}")
    p = np.concatenate([SLOPES, SEGMENTS.ravel()])
    tm, cm, inputs = module_and_inputs(ctx, g, False, score_mod=score, mask_mod=mask,
                                       mod_params=torch.from_numpy(p))
    forbid = np.repeat(~same_doc(SEGMENTS), H, axis=0)
    check_module("alibi+documents", tm, cm, inputs,
                 dict(attn_mask=forbid, alibi_slopes=SLOPES), dict(attn_mask=forbid), g, True)


# ---- (d) p changed between calls ------------------------------------------------------------


def test_module_mod_params_updates(ctx):
    tm = torch_mha(E, H, batch_first=True)
    cm = ct.MultiheadAttention(E, H, batch_first=True, context=ctx, mask_mod=DOCS,
                               mod_params=torch.from_numpy(SEGMENTS.ravel().copy()))
    cm.load_state_dict(tm.state_dict())
    x = randn(np.random.default_rng(5), N, SEQ, E, scale=1.5)
    xt = torch.from_numpy(x)

    def check(segments, what):
        with torch.no_grad():
            out, _ = cm(xt, xt, xt, need_weights=False)
        forbid = np.repeat(~same_doc(segments), H, axis=0)
        ro, _, _ = mha_ref(tm, x, attn_mask=forbid, need_weights=False)
        assert record(f"mods torch module update {what}", max_err(out, ro)) <= TOL, what
        return out

    first = check(SEGMENTS, "first")
    layer = cm._clmha
    other = np.array([[0, 1, 2, 3, 4, 5], [0, 0, 0, 0, 0, 0]], np.float32)
    cm.mod_params.copy_(torch.from_numpy(other.ravel()))  # in place
    assert max_err(check(other, "in place"), first) > 30 * TOL
    cm.mod_params[:SEQ] = 0.0  # one more in-place change: batch item 0 one document
    check(np.stack([np.zeros(SEQ, np.float32), other[1]]), "slice")
    cm.mod_params = torch.from_numpy(SEGMENTS.ravel().copy())  # a new tensor
    check(SEGMENTS, "assigned")
    assert cm._clmha is layer  # the same count: p pushed to the same layer
    # another count (a longer p, the mask reading its first N * SEQ values): a new layer
    cm.mod_params = torch.cat([torch.from_numpy(other.ravel()), torch.zeros(3)])
    check(other, "new count")
    assert cm._clmha is not layer and cm._clmha.mod_params_count == N * SEQ + 3
    # from_torch carries the functions and p
    again = ct.MultiheadAttention.from_torch(cm, context=ctx)
    assert again.mask_mod == DOCS and torch.equal(again.mod_params, cm.mod_params)


def test_layer_set_mod_params(ctx, rng):
    """The lower-level layer: a soft-capping score_mod against the built-in softcap, p set
    between calls, and its backward."""
    m = torch_mha(E, H)
    sd = {k: v.detach().numpy() for k, v in m.state_dict().items()}
    layer = clmha.Layer.from_state_dict(sd, H, context=ctx, score_mod=SOFTCAP,
                                        mod_params=np.array([0.8]))
    assert layer.mod_source.strip().startswith("clmha_real clmha_score_mod")
    assert layer.mod_params_count == 1 and layer.mod_params.dtype == np.float32
    assert "mod_params_count=1" in repr(layer)
    x = randn(rng, 5, N, E, scale=1.5)
    for c in (0.8, 2.5):
        layer.mod_params = [c]
        saved = layer.saved()
        out, _ = layer.forward(x, save=saved, need_weights=False)
        gout = randn(rng, *out.shape)
        grads = layer.backward(saved, gout)
        ro, _, ref = mha_ref(m, x, softcap=c, need_weights=False, grad_output=gout)
        assert record("mods layer softcap output", max_err(out, ro)) <= TOL
        for n, want in ref.items():
            assert record(f"mods layer softcap grad {n} (rel)", rel(grads[n], want)) <= TOL, n
    assert np.array_equal(layer.mod_params, [2.5])
    with pytest.raises(ValueError, match="made with 1"):
        layer.set_mod_params(np.ones(2, np.float32))
    with pytest.raises(ValueError, match="without score_mod or mask_mod"):
        clmha.Layer(E, H, context=ctx).mod_params = [1.0]


def test_layer_file_keeps_user_functions(ctx, rng, tmp_path):
    """A layer file holds the user functions (``__metadata__`` mod_source) and p (the tensor
    mod_params): the loaded layer has both and computes what the saved one did."""
    m = torch_mha(E, H)
    sd = {k: v.detach().numpy() for k, v in m.state_dict().items()}
    layer = clmha.Layer.from_state_dict(sd, H, context=ctx, score_mod=SOFTCAP,
                                        mod_params=np.array([0.8]))
    layer.mod_params = [2.5]
    path = tmp_path / "mods.safetensors"
    layer.save(path)
    loaded = clmha.Layer.load(path, context=ctx)
    assert loaded.mod_source == layer.mod_source
    assert np.array_equal(loaded.mod_params, [2.5])
    x = randn(rng, 5, N, E, scale=1.5)
    want, _ = layer.forward(x, need_weights=False)
    got, _ = loaded.forward(x, need_weights=False)
    assert np.array_equal(got, want)
    ro, _, _ = mha_ref(m, x, softcap=2.5, need_weights=False)
    assert record("mods layer file softcap output", max_err(got, ro)) <= TOL


# ---- the function: torch and NumPy ----------------------------------------------------------


def sdpa_case(gen, L=SEQ, S=SEQ + 2):
    q = (torch.randn(N, H, L, E // H, generator=gen) * 1.5).requires_grad_()
    k = (torch.randn(N, H, S, E // H, generator=gen) * 1.5).requires_grad_()
    v = torch.randn(N, H, S, E // H, generator=gen).requires_grad_()
    return q, k, v


@pytest.mark.parametrize("case", ["alibi", "softcap", "documents"])
def test_torch_sdpa(ctx, case):
    g = torch.Generator().manual_seed(11)
    S = SEQ if case == "documents" else SEQ + 2
    q, k, v = sdpa_case(g, S=S)
    mods, ref_opts, mask = {
        "alibi": (dict(score_mod=ALIBI, mod_params=torch.from_numpy(SLOPES)),
                  dict(alibi_slopes=SLOPES), None),
        "softcap": (dict(score_mod=SOFTCAP, mod_params=torch.tensor([0.7])),
                    dict(softcap=0.7), None),
        "documents": (dict(mask_mod=DOCS, mod_params=torch.from_numpy(SEGMENTS.ravel())),
                      {}, torch.from_numpy(same_doc(SEGMENTS))[:, None]),  # True = may attend
    }[case]
    out = ct.scaled_dot_product_attention(q, k, v, context=ctx, **mods)
    d = [t.detach().double().requires_grad_() for t in (q, k, v)]
    r = sdpa_ref(*d, mask, **ref_opts)
    assert record(f"mods torch sdpa {case} output", max_err(out.detach(), r.detach())) <= SDPA_TOL
    go = torch.randn(out.shape, generator=g)
    out.backward(go)
    r.backward(go.double())
    for name, a, b in zip("qkv", (q, k, v), d):
        e = record(f"mods torch sdpa {case} grad {name}", max_err(a.grad, b.grad))
        assert e <= SDPA_TOL * max(1.0, b.grad.abs().max().item()), name
    bad = sdpa_ref(*(t.detach() for t in d))
    assert max_err(out.detach(), bad) > 30 * SDPA_TOL
    assert mods["mod_params"].grad is None


def test_numpy_sdpa_and_mod_params_per_call(ctx, rng):
    q, k, v = (randn(rng, N, H, SEQ, E // H, scale=1.5) for _ in range(3))
    for segments in (SEGMENTS, SEGMENTS[::-1].copy()):
        mask = same_doc(segments)[:, None]
        out = cn.scaled_dot_product_attention(q, k, v, mask_mod=DOCS, context=ctx,
                                              mod_params=segments.ravel())
        assert record("mods numpy sdpa documents", max_err(out, sdpa_ref_np(q, k, v, mask))) \
            <= SDPA_TOL
    # the backward, with both functions (p: slopes, then segments)
    mask_src = DOCS.replace(f"p[b * {SEQ}", f"p[{H} + b * {SEQ}")
    p = np.concatenate([SLOPES, SEGMENTS.ravel()])
    go = randn(rng, N, H, SEQ, E // H)
    grads = cn.scaled_dot_product_attention_backward(go, q, k, v, score_mod=ALIBI,
                                                     mask_mod=mask_src, mod_params=p,
                                                     context=ctx)
    d = [torch.from_numpy(a.astype(np.float64)).requires_grad_() for a in (q, k, v)]
    r = sdpa_ref(*d, torch.from_numpy(same_doc(SEGMENTS))[:, None], alibi_slopes=SLOPES)
    r.backward(torch.from_numpy(go.astype(np.float64)))
    for name, a, b in zip("qkv", grads, d):
        e = record(f"mods numpy sdpa backward grad {name}", max_err(a, b.grad))
        assert e <= SDPA_TOL * max(1.0, b.grad.abs().max().item()), name


def test_pyopencl_sdpa(pcl, rng):
    """The device form: p as a float32 pyopencl array (read in place) or NumPy (uploaded)."""
    import pyopencl.array as cla

    _, queue, pctx = pcl
    q, k, v = (randn(rng, N, H, SEQ, E // H, scale=1.5) for _ in range(3))
    dev = [cla.to_device(queue, a) for a in (q, k, v)]
    want = sdpa_ref_np(q, k, v, same_doc(SEGMENTS)[:, None])
    for p in (cla.to_device(queue, SEGMENTS.ravel()), SEGMENTS.ravel()):
        out = cn.scaled_dot_product_attention(*dev, mask_mod=DOCS, mod_params=p, context=pctx)
        assert record("mods pyopencl sdpa documents", max_err(out.get(), want)) <= SDPA_TOL
    with pytest.raises(TypeError, match="float32"):
        cn.scaled_dot_product_attention(*dev, mask_mod=DOCS, context=pctx,
                                        mod_params=cla.to_device(queue, np.ones(3)))
    with pytest.raises(ValueError, match="one-dimensional"):
        cn.scaled_dot_product_attention(*dev, mask_mod=DOCS, context=pctx,
                                        mod_params=cla.to_device(queue, SEGMENTS))
    with pytest.raises(ValueError, match="without score_mod or mask_mod"):
        cn.scaled_dot_product_attention(*dev, context=pctx,
                                        mod_params=cla.to_device(queue, SEGMENTS.ravel()))


# ---- (e) the errors -------------------------------------------------------------------------


def test_errors(ctx, rng):
    q = torch.randn(1, H, 4, E // H)
    x = torch.randn(1, 4, E)
    # a source that does not compile: clmha.Error with the build log
    broken = "clmha_real clmha_score_mod(clmha_real s, int b, int h, int q, int k, oops) {"
    with pytest.raises(clmha.Error) as e:
        ct.scaled_dot_product_attention(q, q, q, score_mod=broken, context=ctx)
    assert e.value.status_name == "BUILD_FAILED" and "error" in e.value.message
    assert "oops" in e.value.message or "mod_source" in e.value.message
    cm = ct.MultiheadAttention(E, H, batch_first=True, context=ctx, mask_mod="int clmha_mask_mod(")
    with pytest.raises(clmha.Error, match="BUILD_FAILED|build failed"):
        cm(x, x, x)
    with pytest.raises(clmha.Error, match="BUILD_FAILED|build failed"):
        clmha.Layer(E, H, context=ctx, score_mod=broken)
    # p without a source; of an integer dtype; not 1-D; a Python callable; no function named
    for make in (lambda **kw: ct.scaled_dot_product_attention(q, q, q, context=ctx, **kw),
                 lambda **kw: ct.MultiheadAttention(E, H, context=ctx, **kw),
                 lambda **kw: clmha.Layer(E, H, context=ctx, **kw),
                 lambda **kw: cn.scaled_dot_product_attention(
                     q.numpy(), q.numpy(), q.numpy(), context=ctx,
                     **{n: (a.numpy() if torch.is_tensor(a) else a) for n, a in kw.items()})):
        with pytest.raises(ValueError, match="without score_mod or mask_mod"):
            make(mod_params=torch.ones(3))
        with pytest.raises(TypeError, match="floating point"):
            make(mask_mod=DOCS, mod_params=torch.ones(3, dtype=torch.int64))
        with pytest.raises(ValueError, match="one-dimensional"):
            make(mask_mod=DOCS, mod_params=torch.ones(2, 3))
        with pytest.raises(TypeError, match="OpenCL C source"):
            make(score_mod=lambda s, b, h, q, k: s)
        with pytest.raises(ValueError, match="defines no clmha_mask_mod"):
            make(mask_mod=ALIBI)
    # a score_mod without its derivative: the forward runs, the backward raises
    qg = q.clone().requires_grad_()
    out = ct.scaled_dot_product_attention(qg, q, q, score_mod=ALIBI_SCORE,
                                          mod_params=torch.from_numpy(SLOPES), context=ctx)
    with pytest.raises(clmha.Error, match="clmha_score_mod_grad"):
        out.sum().backward()
    with pytest.raises(clmha.Error, match="clmha_score_mod_grad"):
        cn.scaled_dot_product_attention_backward(q.numpy(), q.numpy(), q.numpy(), q.numpy(),
                                                 score_mod=ALIBI_SCORE, mod_params=SLOPES,
                                                 context=ctx)
    cm = ct.MultiheadAttention(E, H, batch_first=True, context=ctx, score_mod=ALIBI_SCORE,
                               mod_params=torch.from_numpy(SLOPES))
    xg = x.clone().requires_grad_()
    out, _ = cm(xg, xg, xg, need_weights=False)
    with pytest.raises(clmha.Error, match="clmha_score_mod_grad"):
        out.sum().backward()
