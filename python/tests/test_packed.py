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
