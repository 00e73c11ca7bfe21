"""Packed variable-length batches from Python: ``clmha.Layer.forward(seq_lens=...)`` on NumPy
arrays, ``clmha.torch.MultiheadAttention`` with ``seq_lens=`` and with NestedTensor inputs
(PyTorch's fast-path form): forward and gradients (inputs and parameters) against PyTorch's
nn.MultiheadAttention in float64 run once per sequence (each sequence its own unbatched call,
the results one after another), self- and cross-attention, causal, a sequence without queries,
both cores; and the refusals (masks, weights, lengths that do not fit)."""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import clmha  # noqa: E402
import clmha.torch as ct  # noqa: E402
from helpers import TOL, layer_of, max_err, randn, record, torch_mha  # noqa: E402

E, H = 16, 4


def per_sequence(m, q, k, v, lens, kv_lens, is_causal=False):
    """PyTorch's float64 output for a packed batch: one unbatched call per sequence."""
    md = copy.deepcopy(m).double().eval()
    outs, q0, k0 = [], 0, 0
    with torch.no_grad():
        for L, S in zip(lens, kv_lens):
            if L:
                mask = torch.triu(torch.ones(L, S, dtype=torch.bool), 1) if is_causal else None
                o, _ = md(torch.from_numpy(q[q0:q0 + L]).double(),
                          torch.from_numpy(k[k0:k0 + S]).double(),
                          torch.from_numpy(v[k0:k0 + S]).double(), attn_mask=mask,
                          need_weights=False)
                outs.append(o.numpy())
            q0, k0 = q0 + L, k0 + S
    return np.concatenate(outs)


@pytest.mark.parametrize("impl", ["fused", "unfused"])
@pytest.mark.parametrize("causal", [False, True])
def test_layer_self_attention(ctx, rng, impl, causal):
    m = torch_mha(E, H)
    layer = layer_of(m, ctx)
    lens = [5, 1, 9, 3]
    q = randn(rng, sum(lens), E)
    out, w = layer.forward(q, seq_lens=lens, is_causal=causal, impl=impl)
    assert w is None and out.shape == q.shape
    err = max_err(out, per_sequence(m, q, q, q, lens, lens, causal))
    assert record(f"packed layer self {impl}", err) <= TOL


def test_layer_cross_attention_and_an_empty_sequence(ctx, rng):
    m = torch_mha(E, H, kdim=6, vdim=10, add_bias_kv=True, seed=3)
    layer = layer_of(m, ctx)
    lens, kv = [3, 0, 7], [4, 5, 2]  # the second sequence's keys are seen by no query
    q, k, v = randn(rng, 10, E), randn(rng, 11, 6), randn(rng, 11, 10)
    out, _ = layer.forward(q, k, v, seq_lens=lens, kv_seq_lens=np.array(kv))
    err = max_err(out, per_sequence(m, q, k, v, lens, kv))
    assert record("packed layer cross", err) <= TOL


def torch_per_sequence_grads(m, q, k, v, lens, kv_lens, gy, is_causal, self_attention):
    """PyTorch's float64 gradients of sum(out * gy) over the per-sequence calls."""
    md = copy.deepcopy(m).double()
    q64 = torch.from_numpy(q).double().requires_grad_(True)
    k64 = q64 if self_attention else torch.from_numpy(k).double().requires_grad_(True)
    v64 = q64 if self_attention else torch.from_numpy(v).double().requires_grad_(True)
    outs, q0, k0 = [], 0, 0
    for L, S in zip(lens, kv_lens):
        if L:
            mask = torch.triu(torch.ones(L, S, dtype=torch.bool), 1) if is_causal else None
            o, _ = md(q64[q0:q0 + L], k64[k0:k0 + S], v64[k0:k0 + S], attn_mask=mask,
                      need_weights=False)
            outs.append(o)
        q0, k0 = q0 + L, k0 + S
    out = torch.cat(outs)
    (out * torch.from_numpy(gy).double()).sum().backward()
    grads = {"query": q64.grad.numpy()}
    if not self_attention:
        grads["key"], grads["value"] = k64.grad.numpy(), v64.grad.numpy()
    for name, p in md.named_parameters():
        grads[name] = p.grad.numpy()
    return out.detach().numpy(), grads


@pytest.mark.parametrize("self_attention", [True, False])
def test_torch_module_seq_lens_gradients(ctx, rng, self_attention):
    m = torch_mha(E, H, seed=5)
    cm = ct.MultiheadAttention.from_torch(m, context=ctx)
    lens, kv = ([4, 7, 1], None) if self_attention else ([4, 0, 6], [3, 8, 5])
    kv_lens = kv or lens
    q = randn(rng, sum(lens), E)
    k = q if self_attention else randn(rng, sum(kv_lens), E)
    v = q if self_attention else randn(rng, sum(kv_lens), E)
    gy = randn(rng, sum(lens), E)
    want_out, want = torch_per_sequence_grads(m, q, k, v, lens, kv_lens, gy, True,
                                              self_attention)
    qt = torch.from_numpy(q).requires_grad_(True)
    kt = qt if self_attention else torch.from_numpy(k).requires_grad_(True)
    vt = qt if self_attention else torch.from_numpy(v).requires_grad_(True)
    out, w = cm(qt, kt, vt, need_weights=False, is_causal=True, seq_lens=lens,
                kv_seq_lens=kv)
    assert w is None
    assert record("packed torch forward", max_err(out.detach(), want_out)) <= TOL
    (out * torch.from_numpy(gy)).sum().backward()
    got = {"query": qt.grad}
    if not self_attention:
        got["key"], got["value"] = kt.grad, vt.grad
    for name, p in cm.named_parameters():
        got[name] = p.grad
    for name, g in want.items():
        err = max_err(got[name], g) / (1 + np.abs(g).max())
        assert record(f"packed torch grad {name}", err) <= TOL, name


def test_torch_nested_tensors(ctx, rng):
    m = torch_mha(E, H, seed=7, batch_first=True)
    cm = ct.MultiheadAttention.from_torch(m, context=ctx)
    lens = [3, 6, 2]
    parts = [torch.from_numpy(randn(rng, L, E)).requires_grad_(True) for L in lens]
    nq = torch.nested.as_nested_tensor(parts)
    out, w = cm(nq, nq, nq, need_weights=False)
    assert w is None and out.is_nested
    outs = out.unbind()
    q = np.concatenate([p.detach().numpy() for p in parts])
    want = per_sequence(m, q, q, q, lens, lens)
    got = np.concatenate([o.detach().numpy() for o in outs])
    assert record("packed torch nested", max_err(got, want)) <= TOL
    sum(o.sum() for o in outs).backward()
    gy = np.ones_like(q)
    _, grads = torch_per_sequence_grads(m, q, q, q, lens, lens, gy, False, True)
    got_gq = np.concatenate([p.grad.numpy() for p in parts])
    assert max_err(got_gq, grads["query"]) / (1 + np.abs(grads["query"]).max()) <= TOL


def test_refusals(ctx, rng):
    m = torch_mha(E, H)
    layer = layer_of(m, ctx)
    q = randn(rng, 6, E)
    with pytest.raises(clmha.Error, match="key_padding_mask"):
        layer.forward(q, seq_lens=[2, 4], key_padding_mask=np.zeros((2, 4), bool))
    with pytest.raises(clmha.Error, match="need_weights"):
        layer.forward(q, seq_lens=[2, 4], need_weights=True)
    with pytest.raises(clmha.Error, match="sum of seq_lens"):
        layer.forward(q, seq_lens=[2, 3])
    with pytest.raises(ValueError, match="kv_seq_lens needs seq_lens"):
        layer.forward(q, kv_seq_lens=[6])
    with pytest.raises(ValueError, match="one per sequence"):
        layer.forward(q, q, q, seq_lens=[2, 4], kv_seq_lens=[6])
    with pytest.raises(ValueError, match="lengths >= 0"):
        layer.forward(q, seq_lens=[-1, 7])
    with pytest.raises(TypeError):
        layer.forward(q, seq_lens=[2.5, 3.5])
    cm = ct.MultiheadAttention.from_torch(m, context=ctx)
    qt = torch.from_numpy(q)
    with pytest.raises(ValueError, match="need_weights=False"):
        cm(qt, qt, qt, seq_lens=[2, 4])
    nq = torch.nested.as_nested_tensor([qt[:2], qt[2:]])
    with pytest.raises(ValueError, match="need_weights=False"):
        cm(nq, nq, nq)
    with pytest.raises(TypeError, match="all be NestedTensors"):
        cm(nq, qt, qt, need_weights=False)


# ---- attention as a function -------------------------------------------------------------------

def sdpa_per_sequence(q, k, v, lens, kv_lens, is_causal=False, sinks=None):
    """Float64 (output, lse blocks) of a packed call: one SDPA per sequence ((L, H, D) rows
    as (H, L, D)), written out (torch 1.13 has no F.scaled_dot_product_attention)."""
    outs, lses, q0, k0 = [], [], 0, 0
    h, kvh = q.shape[1], k.shape[1]
    for L, S in zip(lens, kv_lens):
        if L:
            qi = q[q0:q0 + L].transpose(0, 1)
            ki = k[k0:k0 + S].transpose(0, 1).repeat_interleave(h // kvh, 0)
            vi = v[k0:k0 + S].transpose(0, 1).repeat_interleave(h // kvh, 0)
            s = qi @ ki.transpose(-2, -1) / np.sqrt(q.shape[-1])
            if is_causal:
                s = s.masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(), float("-inf"))
            if sinks is not None:
                s = torch.cat([s, sinks.reshape(h, 1, 1).expand(h, L, 1)], -1)
            lse = torch.logsumexp(s, -1)
            p = torch.exp(s - lse[..., None])[..., :S]
            outs.append((p @ vi).transpose(0, 1))
            lses.append(lse.reshape(-1))
        q0, k0 = q0 + L, k0 + S
    return torch.cat(outs), torch.cat(lses)


def test_numpy_sdpa_packed(ctx, rng):
    import clmha.numpy as cn

    lens, kv = [4, 0, 7, 2], [3, 5, 7, 6]
    q = randn(rng, sum(lens), 4, 8)
    k, v = randn(rng, sum(kv), 2, 8), randn(rng, sum(kv), 2, 6)
    sinks = randn(rng, 4)
    out, lse = cn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True,
                                               seq_lens=lens, kv_seq_lens=kv, sinks=sinks,
                                               return_lse=True, context=ctx)
    t = lambda a: torch.from_numpy(a).double().requires_grad_(True)  # noqa: E731
    qt, kt, vt, st = t(q), t(k), t(v), t(sinks)
    want, want_lse = sdpa_per_sequence(qt, kt, vt, lens, kv, True, st)
    assert out.shape == (sum(lens), 4, 6) and lse.shape == (4 * sum(lens),)
    assert record("packed sdpa forward", max_err(out, want.detach())) <= TOL
    assert record("packed sdpa lse", max_err(lse, want_lse.detach())) <= TOL
    gy = randn(rng, *out.shape)
    grads = cn.scaled_dot_product_attention_backward(
        gy, q, k, v, is_causal=True, enable_gqa=True, seq_lens=lens, kv_seq_lens=kv,
        sinks=sinks, context=ctx)
    (want * torch.from_numpy(gy).double()).sum().backward()
    for name, got, ref in (("query", grads[0], qt.grad), ("key", grads[1], kt.grad),
                           ("value", grads[2], vt.grad), ("sinks", grads[4], st.grad)):
        err = max_err(got, ref) / (1 + ref.abs().max().item())
        assert record(f"packed sdpa grad {name}", err) <= TOL, name


def test_torch_sdpa_packed(ctx, rng):
    lens = [5, 3]
    q = torch.from_numpy(randn(rng, 8, 2, 8)).requires_grad_(True)
    k = torch.from_numpy(randn(rng, 8, 2, 8)).requires_grad_(True)
    v = torch.from_numpy(randn(rng, 8, 2, 8)).requires_grad_(True)
    out = ct.scaled_dot_product_attention(q, k, v, is_causal=True, seq_lens=lens, context=ctx)
    q64, k64, v64 = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    want, _ = sdpa_per_sequence(q64, k64, v64, lens, lens, True)
    assert record("packed torch sdpa", max_err(out.detach(), want.detach())) <= TOL
    out.sum().backward()
    want.sum().backward()
    for got, ref in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert max_err(got, ref) / (1 + ref.abs().max().item()) <= TOL
    with pytest.raises(ValueError, match="attn_mask"):
        ct.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), seq_lens=lens,
                                        attn_mask=torch.ones(8, 8, dtype=torch.bool),
                                        context=ctx)


def test_pyopencl_sdpa_packed(pcl, rng):
    """The device form on pyopencl arrays: forward with lse, then the backward from them (the
    fused core's), the sinks' gradient summed over the sequences on the device."""
    import clmha.numpy as cn
    import pyopencl.array as cla

    _, queue, cctx = pcl
    lens, kv = [3, 6, 0], [5, 4, 2]
    q = randn(rng, sum(lens), 2, 8)
    k, v = randn(rng, sum(kv), 2, 8), randn(rng, sum(kv), 2, 8)
    sinks, gy = randn(rng, 2), randn(rng, sum(lens), 2, 8)
    dev = [cla.to_device(queue, a) for a in (q, k, v, sinks, gy)]
    out, lse = cn.scaled_dot_product_attention(dev[0], dev[1], dev[2], seq_lens=lens,
                                               kv_seq_lens=kv, sinks=dev[3], return_lse=True,
                                               context=cctx)
    grads = cn.scaled_dot_product_attention_backward(
        dev[4], dev[0], dev[1], dev[2], seq_lens=lens, kv_seq_lens=kv, sinks=dev[3],
        output=out, lse=lse, context=cctx)
    t = lambda a: torch.from_numpy(a).double().requires_grad_(True)  # noqa: E731
    qt, kt, vt, st = t(q), t(k), t(v), t(sinks)
    want, want_lse = sdpa_per_sequence(qt, kt, vt, lens, kv, False, st)
    assert max_err(out.get(), want.detach()) <= TOL
    assert max_err(lse.get(), want_lse.detach()) <= TOL
    (want * torch.from_numpy(gy).double()).sum().backward()
    for got, ref in ((grads[0], qt.grad), (grads[1], kt.grad), (grads[2], vt.grad),
                     (grads[4], st.grad)):
        err = max_err(got.get(), ref) / (1 + ref.abs().max().item())
        assert record("packed sdpa pyopencl grad", err) <= TOL
