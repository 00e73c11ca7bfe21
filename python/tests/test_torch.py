"""clmha.torch.MultiheadAttention against torch.nn.MultiheadAttention: forward options, state_dict
both ways, gradients, from_torch, dropout, a training loop, export, dtypes."""

import copy
import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import clmha  # noqa: E402
import clmha.torch as ct  # noqa: E402
from helpers import (TOL, causal_float_mask, max_err, randn, record,  # noqa: E402
                     torch_grads, torch_mha)

E, H, N, L, S = 16, 2, 2, 5, 6


def _pair(ctx, **opts):
    tm = torch_mha(E, H, **opts)
    cm = ct.MultiheadAttention(E, H, context=ctx, **opts)
    cm.load_state_dict(tm.state_dict())
    return tm, cm.eval()


def _ref(tm, q, k, v, **kw):
    md = copy.deepcopy(tm).double().eval()
    conv = lambda t: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() \
        else t  # noqa: E731
    with torch.no_grad():
        out, w = md(conv(q), conv(k), conv(v), **{a: conv(b) for a, b in kw.items()})
    return out, w


def _kpm(g, n, s, unbatched=False):
    m = torch.rand(n, s, generator=g) < 0.3
    m[:, 0] = False
    return m[0] if unbatched else m


def _am(g, *shape):
    m = torch.rand(*shape, generator=g) < 0.3
    m[..., 0] = False
    return m


OPTIONS = {
    "self": ({}, False, False, lambda g: {}),
    "cross_kdim_vdim": (dict(kdim=8, vdim=12), True, False, lambda g: {}),
    "batch_first": (dict(batch_first=True), True, False, lambda g: {}),
    "unbatched": ({}, True, True, lambda g: dict(key_padding_mask=_kpm(g, 1, S, True),
                                                 attn_mask=torch.randn(L, S, generator=g))),
    "kpm_bool": ({}, True, False, lambda g: dict(key_padding_mask=_kpm(g, N, S))),
    "kpm_float": ({}, True, False, lambda g: dict(key_padding_mask=torch.randn(N, S,
                                                                               generator=g))),
    "attn2d_bool": ({}, True, False, lambda g: dict(attn_mask=_am(g, L, S))),
    "attn3d_bool": ({}, True, False, lambda g: dict(attn_mask=_am(g, N * H, L, S))),
    "attn2d_float": ({}, True, False, lambda g: dict(attn_mask=torch.randn(L, S, generator=g))),
    "attn3d_float": ({}, True, False, lambda g: dict(
        attn_mask=torch.randn(N * H, L, S, generator=g))),
    "weights_per_head": ({}, True, False, lambda g: dict(average_attn_weights=False)),
    "no_weights": ({}, True, False, lambda g: dict(need_weights=False)),
    "add_bias_kv": (dict(add_bias_kv=True), True, False,
                    lambda g: dict(key_padding_mask=_kpm(g, N, S))),
    "add_zero_attn": (dict(add_zero_attn=True), True, False,
                      lambda g: dict(attn_mask=torch.randn(L, S, generator=g))),
    "no_bias": (dict(bias=False), True, False, lambda g: {}),
}


def _inputs(g, m, cross, unbatched, dtype=torch.float32):
    shape = (lambda T, F: (T, F)) if unbatched else \
        ((lambda T, F: (N, T, F)) if m.batch_first else (lambda T, F: (T, N, F)))
    q = torch.randn(*shape(L, E), generator=g).to(dtype)
    if not cross:
        return q, q, q
    return (q, torch.randn(*shape(S, m.kdim), generator=g).to(dtype),
            torch.randn(*shape(S, m.vdim), generator=g).to(dtype))


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_forward_parity(ctx, name):
    opts, cross, unbatched, masks = OPTIONS[name]
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    tm, cm = _pair(ctx, **opts)
    assert list(cm.state_dict()) == list(tm.state_dict())
    q, k, v = _inputs(g, tm, cross, unbatched)
    kw = masks(g)
    out, w = cm(q, k, v, **kw)
    ref, rw = _ref(tm, q, k, v, **kw)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    assert record(f"torch forward {name}", max_err(out.detach(), ref)) <= TOL
    if kw.get("need_weights", True):
        assert record(f"torch weights {name}", max_err(w.detach(), rw)) <= TOL
    else:
        assert w is None
    # the other way: clmha's own parameters into torch's module
    cm2 = ct.MultiheadAttention(E, H, context=ctx, **opts).eval()
    with torch.no_grad():
        for p in cm2.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    tm2 = torch.nn.MultiheadAttention(E, H, **opts).eval()
    tm2.load_state_dict(cm2.state_dict())
    out2, _ = cm2(q, k, v, **kw)
    ref2, _ = _ref(tm2, q, k, v, **kw)
    assert max_err(out2.detach(), ref2) <= TOL


def test_is_causal(ctx):
    tm, cm = _pair(ctx, batch_first=True)
    x = torch.randn(N, L, E)
    out, _ = cm(x, x, x, is_causal=True, need_weights=False)
    ref, _ = _ref(tm, x, x, x, attn_mask=torch.from_numpy(causal_float_mask(L)),
                  need_weights=False)
    assert record("torch forward is_causal", max_err(out.detach(), ref)) <= TOL
    full, _ = _ref(tm, x, x, x, need_weights=False)
    assert max_err(out.detach(), full) > 1e-3


def test_state_dict_keys_and_from_torch(ctx):
    for opts in ({}, dict(kdim=8, vdim=12, add_bias_kv=True), dict(bias=False)):
        tm = torch_mha(E, H, **opts)
        cm = ct.MultiheadAttention.from_torch(tm, context=ctx)
        assert isinstance(cm, ct.MultiheadAttention) and isinstance(cm, torch.nn.MultiheadAttention)
        assert list(cm.state_dict()) == list(tm.state_dict())
        for k, v in tm.state_dict().items():
            assert torch.equal(cm.state_dict()[k], v), k
        q = torch.randn(L, N, E)
        k = torch.randn(S, N, tm.kdim)
        v = torch.randn(S, N, tm.vdim)
        out, w = cm(q, k, v)
        ref, rw = _ref(tm, q, k, v)
        assert record("from_torch", max_err(out.detach(), ref)) <= TOL
        assert max_err(w.detach(), rw) <= TOL


def _grad_check(ctx, opts, call, name):
    """@p call(module, q, k, v) -> (q, k, v, kwargs, self_attention, key_is_value)."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    tm, cm = _pair(ctx, **opts)
    q, k, v, kw, self_att, key_is_value = call(g, tm)
    leaves = [t for t in (q, k, v) if t.requires_grad]
    mask_leaves = {a: b for a, b in kw.items() if isinstance(b, torch.Tensor) and b.requires_grad}
    out, w = cm(q, k, v, **kw)
    gout = torch.randn(out.shape, generator=g)
    need_w = kw.get("need_weights", True)
    gw = torch.randn(w.shape, generator=g) if need_w else None
    loss = (out * gout).sum() + ((w * gw).sum() if need_w else 0)
    loss.backward()
    np_ = lambda t: None if t is None else t.detach().numpy()  # noqa: E731
    kpm, am = kw.get("key_padding_mask"), kw.get("attn_mask")
    kk = None if self_att else k
    vv = None if (self_att or key_is_value) else v
    _, ref = torch_grads(tm, np_(q), np_(kk if kk is not None else q),
                         np_(vv if vv is not None else (kk if kk is not None else q)),
                         np_(kpm), np_(am), np_(gout), np_(gw), need_weights=need_w,
                         self_attention=self_att,
                         average_attn_weights=kw.get("average_attn_weights", True))
    # what clmha.torch gives to each leaf: summed over every use of a shared tensor
    if key_is_value and not self_att:
        ref["key"] = ref["key"] + ref.pop("value")
    got = {"query": q.grad}
    if not self_att:
        got["key"] = k.grad
        if not key_is_value:
            got["value"] = v.grad
    for pname, p in cm.named_parameters():
        got[pname] = p.grad
    for mname, m in mask_leaves.items():
        got[mname] = m.grad
    assert leaves
    for key, r in ref.items():
        assert got.get(key) is not None, f"no gradient for {key}"
        err = max_err(got[key], r) / (1 + np.abs(r).max())
        record(f"torch grad {name} d{key} (rel)", err)
        assert err <= TOL, key
    return ref


def test_gradients_self_attention(ctx):
    def call(g, tm):
        x = torch.randn(L, N, E, generator=g).requires_grad_()
        return x, x, x, dict(attn_mask=torch.randn(L, L, generator=g).requires_grad_(),
                             key_padding_mask=_kpm(g, N, L)), True, False
    _grad_check(ctx, dict(add_bias_kv=True), call, "self")


def test_gradients_cross_float_masks(ctx):
    def call(g, tm):
        q = torch.randn(N, L, E, generator=g).requires_grad_()
        k = torch.randn(N, S, 8, generator=g).requires_grad_()
        v = torch.randn(N, S, 12, generator=g).requires_grad_()
        return q, k, v, dict(
            attn_mask=torch.randn(N * H, L, S, generator=g).requires_grad_(),
            key_padding_mask=torch.randn(N, S, generator=g).requires_grad_(),
            average_attn_weights=False), False, False
    _grad_check(ctx, dict(kdim=8, vdim=12, batch_first=True, add_zero_attn=True), call,
                "cross")


def test_gradients_key_is_value(ctx):
    def call(g, tm):
        q = torch.randn(L, N, E, generator=g).requires_grad_()
        kv = torch.randn(S, N, E, generator=g).requires_grad_()
        return q, kv, kv, dict(need_weights=False), False, True
    _grad_check(ctx, {}, call, "key_is_value")


def test_no_grad_saves_nothing(ctx, monkeypatch):
    """Under torch.no_grad() (inference) the forward keeps no state for a backward pass: the
    parameters require grad, but no graph is recorded; with grad enabled it saves once."""
    tm, cm = _pair(ctx, batch_first=True)
    made = []
    real = clmha.Layer.saved
    monkeypatch.setattr(clmha.Layer, "saved", lambda self: made.append(1) or real(self))
    x = torch.randn(N, L, E)
    with torch.no_grad():
        out, _ = cm(x, x, x, need_weights=False)
    assert made == [], "an inference call made a saved state"
    assert max_err(out, _ref(tm, x, x, x)[0]) <= TOL
    out, _ = cm(x, x, x, need_weights=False)  # the parameters require grad
    assert made == [1]
    out.sum().backward()
    assert cm.in_proj_weight.grad is not None


def test_key_is_value_forward(ctx):
    tm, cm = _pair(ctx, batch_first=True)
    q, kv = torch.randn(N, L, E), torch.randn(N, S, E)
    out, w = cm(q, kv, kv)
    ref, rw = _ref(tm, q, kv, kv)
    assert record("torch key is value", max_err(out.detach(), ref)) <= TOL
    assert max_err(w.detach(), rw) <= TOL


def test_dropout_deterministic(ctx):
    tm = torch_mha(E, H, dropout=0.3, batch_first=True)
    x = torch.randn(N, 12, E)

    def run():
        cm = ct.MultiheadAttention.from_torch(tm, context=ctx).train()
        torch.manual_seed(5)
        return cm(x, x, x, need_weights=False)[0].detach()

    a, b = run(), run()
    assert torch.equal(a, b)
    cm = ct.MultiheadAttention.from_torch(tm, context=ctx).train()
    torch.manual_seed(6)
    c = cm(x, x, x, need_weights=False)[0].detach()
    assert max_err(a, c) > 1e-3
    ref, _ = _ref(tm, x, x, x, need_weights=False)
    assert max_err(a, ref) > 1e-3  # dropout was applied
    cm.eval()
    e = cm(x, x, x, need_weights=False)[0].detach()
    assert max_err(e, ref) <= TOL


def test_dropout_reseed_same_module(ctx):
    """As in PyTorch: torch.manual_seed(s) before a call makes that call's dropout the same."""
    tm = torch_mha(E, H, dropout=0.3, batch_first=True)
    cm = ct.MultiheadAttention.from_torch(tm, context=ctx).train()
    x = torch.randn(N, 12, E)
    torch.manual_seed(11)
    a = cm(x, x, x, need_weights=False)[0].detach()
    torch.manual_seed(11)
    b = cm(x, x, x, need_weights=False)[0].detach()
    assert torch.equal(a, b)


class _Tiny(torch.nn.Module):
    def __init__(self, attn, V=10, E=16):
        super().__init__()
        self.emb = torch.nn.Embedding(V, E)
        self.attn = attn
        self.out = torch.nn.Linear(E, V)

    def forward(self, tokens):
        x = self.emb(tokens)
        y, _ = self.attn(x, x, x, need_weights=False)
        return self.out(y + x)


def test_training_loop_matches_torch(ctx):
    V, B, T, steps = 10, 3, 7, 20
    torch.manual_seed(0)
    ref_model = _Tiny(torch.nn.MultiheadAttention(E, H, batch_first=True), V, E)
    cl_model = _Tiny(ct.MultiheadAttention(E, H, batch_first=True, context=ctx), V, E)
    cl_model.load_state_dict(ref_model.state_dict())
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, V, (B, T), generator=g) for _ in range(steps)]
    losses = {}
    for name, model in (("torch", ref_model), ("clmha", cl_model)):
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        losses[name] = []
        for tokens in batches:
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(tokens).reshape(-1, V),
                                                     tokens.reshape(-1))
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
    lt, lc = np.array(losses["torch"]), np.array(losses["clmha"])
    rel = np.max(np.abs(lt - lc) / np.abs(lt))
    assert lt[-1] < lt[0]  # it learns
    pmax = 0.0
    sd_t, sd_c = ref_model.state_dict(), cl_model.state_dict()
    assert list(sd_t) == list(sd_c)
    for k in sd_t:
        d = max_err(sd_t[k], sd_c[k]) / (1 + sd_t[k].abs().max().item())
        pmax = max(pmax, d)
    record("training loop loss (rel)", rel)
    record("training loop final params (rel)", pmax)
    print(f"training loop: losses {lt[0]:.4f} -> {lt[-1]:.4f}; max rel loss diff {rel:.3g}; "
          f"max param diff / (1+max|p|) {pmax:.3g}")
    assert rel <= 1e-4
    assert pmax <= 1e-4


def test_export_then_load(ctx, tmp_path):
    for opts in (dict(batch_first=True, add_bias_kv=True), dict(kdim=8, vdim=12)):
        tm = torch_mha(E, H, **opts)
        cm = ct.MultiheadAttention.from_torch(tm, context=ctx)
        q = torch.randn(L, N, E) if not tm.batch_first else torch.randn(N, L, E)
        kshape = (S, N, tm.kdim) if not tm.batch_first else (N, S, tm.kdim)
        vshape = (S, N, tm.vdim) if not tm.batch_first else (N, S, tm.vdim)
        k, v = torch.randn(kshape), torch.randn(vshape)
        for i, module in enumerate((tm, cm)):
            path = tmp_path / f"m{i}.safetensors"
            ct.export(module, path)
            layer = clmha.Layer.load(path, ctx)
            assert layer.batch_first == tm.batch_first
            assert layer.add_bias_kv == (tm.bias_k is not None)
            out, _ = layer.forward(q.numpy(), k.numpy(), v.numpy())
            mod_out, _ = cm(q, k, v)
            assert max_err(out, mod_out.detach()) <= 1e-6
            ref, _ = _ref(tm, q, k, v)
            assert record("export -> Layer.load", max_err(out, ref)) <= TOL


def test_float64_module(ctx):
    if not clmha.devices()[0].fp64:
        pytest.skip("no fp64")
    tm = torch_mha(E, H, add_bias_kv=True).double()
    cm = ct.MultiheadAttention(E, H, add_bias_kv=True, dtype=torch.float64, context=ctx)
    cm.load_state_dict(tm.state_dict())
    q, kv = torch.randn(L, N, E, dtype=torch.float64), torch.randn(S, N, E, dtype=torch.float64)
    am = torch.randn(L, S, dtype=torch.float64)
    out, w = cm(q, kv, kv, attn_mask=am)
    with torch.no_grad():
        ref, rw = tm(q, kv, kv, attn_mask=am)
    assert out.dtype == torch.float64
    assert record("torch float64 module", max_err(out.detach(), ref)) <= 1e-12
    assert max_err(w.detach(), rw) <= 1e-12


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16bit_module(ctx, dtype):
    r = 2.0 ** -11 if dtype == torch.float16 else 2.0 ** -8
    tm = torch_mha(E, H, batch_first=True)
    cm = ct.MultiheadAttention(E, H, batch_first=True, dtype=dtype, context=ctx)
    cm.load_state_dict(tm.state_dict())  # rounded to the dtype
    tm_r = copy.deepcopy(tm)
    tm_r.load_state_dict({k: v.to(dtype).double() for k, v in tm.state_dict().items()})
    q, kv = torch.randn(N, L, E).to(dtype), torch.randn(N, S, E).to(dtype)
    out, w = cm(q, kv, kv)
    assert out.dtype == dtype and w.dtype == dtype
    ref, rw = _ref(tm_r, q.double(), kv.double(), kv.double())
    for got, y, what in ((out, ref, "output"), (w, rw, "weights")):
        y = y.numpy()
        t = 1e-5 * (1 + np.abs(y).max())
        bound = r * (np.abs(y) + t) + t
        err = np.abs(got.detach().double().numpy() - y)
        record(f"torch {dtype} module {what} (err/bound)", (err / bound).max())
        assert np.all(err <= 2 * bound), (err / bound).max()
