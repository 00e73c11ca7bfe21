"""The seed modules (../shared/seeds/: continuiti's MultiHeadAttention and the classic
w_q/w_k/w_v/w_concat module), written out as the seeds define them, against clmha."""

import copy
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import clmha  # noqa: E402
import clmha.torch as ct  # noqa: E402
from helpers import TOL, max_err, record, safetensors_write, sdpa_ref  # noqa: E402

E, H, N, L, S = 16, 4, 2, 5, 7


# ---- seed 000: continuiti.networks.MultiHeadAttention ------------------------------------------

class ScaledDotProductAttention(nn.Module):
    """continuiti's default attention, torch's scaled_dot_product_attention(query, key, value,
    attn_mask, dropout_p) written out (PyTorch 1.13 has none): softmax(QK^T/sqrt(d) + mask)V,
    a bool mask True = may attend."""

    def forward(self, query, key, value, attn_mask=None, dropout_p=0.0):
        return sdpa_ref(query, key, value, attn_mask)


class ContinuitiMultiHeadAttention(nn.Module):
    def __init__(self, hidden_dim, n_heads, attention=None, dropout_p=0, bias=True):
        super().__init__()
        self.hidden_dim = hidden_dim
        self.n_heads = n_heads
        self.dropout_p = dropout_p
        self.bias = bias
        if attention is None:
            attention = ScaledDotProductAttention()
        self.attention = attention
        self.head_dim = hidden_dim // n_heads
        assert self.head_dim * n_heads == hidden_dim, "hidden_dim must be divisible by n_heads"
        self.query_project = nn.Linear(hidden_dim, hidden_dim, bias=bias)
        self.key_project = nn.Linear(hidden_dim, hidden_dim, bias=bias)
        self.value_project = nn.Linear(hidden_dim, hidden_dim, bias=bias)
        self.out_project = nn.Linear(hidden_dim, hidden_dim, bias=bias)

    def forward(self, query, key, value, attn_mask=None):
        assert query.ndim == key.ndim == value.ndim == 3
        assert query.size(0) == key.size(0) == value.size(0)
        assert query.size(-1) == key.size(-1) == value.size(-1)
        batch_size = query.size(0)
        src_len = key.size(1)
        tgt_len = query.size(1)
        query = self.query_project(query)
        key = self.key_project(key)
        value = self.value_project(value)
        query = query.view(batch_size, -1, self.n_heads, self.head_dim).transpose(1, 2)
        key = key.view(batch_size, -1, self.n_heads, self.head_dim).transpose(1, 2)
        value = value.view(batch_size, -1, self.n_heads, self.head_dim).transpose(1, 2)
        if attn_mask is not None:
            assert attn_mask.size(0) == batch_size
            assert attn_mask.size(1) == tgt_len
            assert attn_mask.size(2) == src_len
            attn_mask = attn_mask.unsqueeze(1)
            attn_mask = attn_mask.repeat(1, self.n_heads, 1, 1)
        attn_out = self.attention(query=query, key=key, value=value, attn_mask=attn_mask)
        attn_out = attn_out.transpose(1, 2).reshape(batch_size, -1, self.hidden_dim)
        return self.out_project(attn_out)


# ---- seed 001: the classic module ---------------------------------------------------------------

class ScaleDotProductAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, q, k, v, mask=None, e=1e-12):
        batch_size, head, length, d_tensor = k.size()
        k_t = k.transpose(2, 3)
        score = (q @ k_t) / math.sqrt(d_tensor)
        if mask is not None:
            score = score.masked_fill(mask == 0, -10000)
        score = self.softmax(score)
        v = score @ v
        return v, score


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, n_head):
        super().__init__()
        self.n_head = n_head
        self.attention = ScaleDotProductAttention()
        self.w_q = nn.Linear(d_model, d_model)
        self.w_k = nn.Linear(d_model, d_model)
        self.w_v = nn.Linear(d_model, d_model)
        self.w_concat = nn.Linear(d_model, d_model)

    def forward(self, q, k, v, mask=None):
        q, k, v = self.w_q(q), self.w_k(k), self.w_v(v)
        q, k, v = self.split(q), self.split(k), self.split(v)
        out, attention = self.attention(q, k, v, mask=mask)
        out = self.concat(out)
        out = self.w_concat(out)
        return out

    def split(self, tensor):
        batch_size, length, d_model = tensor.size()
        d_tensor = d_model // self.n_head
        tensor = tensor.view(batch_size, length, self.n_head, d_tensor).transpose(1, 2)
        return tensor

    def concat(self, tensor):
        batch_size, head, length, d_tensor = tensor.size()
        d_model = head * d_tensor
        tensor = tensor.transpose(1, 2).contiguous().view(batch_size, length, d_model)
        return tensor  # the seed's ends in a bare `return`


def _randomize(m, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m.eval()


def _seed_module(kind, bias=True):
    torch.manual_seed(0)
    if kind == "continuiti":
        return _randomize(ContinuitiMultiHeadAttention(E, H, bias=bias))
    return _randomize(MultiHeadAttention(E, H))


def _attend_mask(g):
    m = torch.rand(N, L, S, generator=g) < 0.7
    m[..., 0] = True
    return m


KINDS = [("continuiti", True), ("continuiti", False), ("classic", True)]


def _call_mask(kind, mask):
    """The mask as the seed module takes it."""
    if mask is None or kind == "continuiti":
        return mask
    return mask.unsqueeze(1)  # the classic module's callers pass (N, 1, L, S)


@pytest.mark.parametrize("kind,bias", KINDS)
@pytest.mark.parametrize("masked", [False, True])
def test_from_torch_forward(ctx, kind, bias, masked):
    seed = _seed_module(kind, bias)
    cm = ct.MultiheadAttention.from_torch(seed, context=ctx)
    assert isinstance(cm, ct.ContinuitiAttention if kind == "continuiti"
                      else ct.SplitHeadsAttention)
    assert list(cm.state_dict()) == list(seed.state_dict())
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(N, L, E, generator=g), torch.randn(N, S, E, generator=g),
               torch.randn(N, S, E, generator=g))
    mask = _attend_mask(g) if masked else None
    out = cm(q, k, v, _call_mask(kind, mask))
    with torch.no_grad():
        ref = copy.deepcopy(seed).double()(q.double(), k.double(), v.double(),
                                           _call_mask(kind, mask))
    assert out.shape == (N, L, E)
    assert record(f"seed {kind} bias={bias} masked={masked}", max_err(out.detach(), ref)) <= TOL
    if masked:  # the mask is really applied
        with torch.no_grad():
            unmasked = copy.deepcopy(seed).double()(q.double(), k.double(), v.double())
        assert max_err(out.detach(), unmasked) > 1e-3


def test_continuiti_float_mask(ctx):
    seed = _seed_module("continuiti")
    cm = ct.MultiheadAttention.from_torch(seed, context=ctx)
    g = torch.Generator().manual_seed(4)
    q, kv = torch.randn(N, L, E, generator=g), torch.randn(N, S, E, generator=g)
    fm = torch.randn(N, L, S, generator=g)
    out = cm(q, kv, kv, fm)
    with torch.no_grad():
        ref = copy.deepcopy(seed).double()(q.double(), kv.double(), kv.double(), fm.double())
    assert record("seed continuiti float mask", max_err(out.detach(), ref)) <= TOL


@pytest.mark.parametrize("kind,bias", KINDS)
def test_gradients_reach_seed_parameters(ctx, kind, bias):
    seed = _seed_module(kind, bias)
    cm = ct.MultiheadAttention.from_torch(seed, context=ctx)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(N, L, E, generator=g).requires_grad_()
    k = torch.randn(N, S, E, generator=g).requires_grad_()
    v = torch.randn(N, S, E, generator=g).requires_grad_()
    mask = _attend_mask(g)
    gout = torch.randn(N, L, E, generator=g)
    (cm(q, k, v, _call_mask(kind, mask)) * gout).sum().backward()
    ref_mod = copy.deepcopy(seed).double()
    q2, k2, v2 = (t.detach().double().requires_grad_() for t in (q, k, v))
    (ref_mod(q2, k2, v2, _call_mask(kind, mask)) * gout.double()).sum().backward()
    ref = dict(ref_mod.named_parameters())
    names = [n for n, _ in cm.named_parameters()]
    assert sorted(names) == sorted(ref)
    for name, p in cm.named_parameters():
        assert p.grad is not None, name
        r = ref[name].grad
        err = max_err(p.grad, r) / (1 + r.abs().max().item())
        record(f"seed {kind} grad {name.split('.')[0]} (rel)", err)
        assert err <= TOL, name
    for a, b, what in ((q, q2, "query"), (k, k2, "key"), (v, v2, "value")):
        err = max_err(a.grad, b.grad) / (1 + b.grad.abs().max().item())
        record(f"seed {kind} grad {what} (rel)", err)
        assert err <= TOL, what


@pytest.mark.parametrize("kind,bias", KINDS)
def test_layer_from_state_dict(ctx, kind, bias):
    seed = _seed_module(kind, bias)
    layer = clmha.Layer.from_state_dict(seed.state_dict(), H, context=ctx)
    assert layer.batch_first and layer.bias == bias and layer.num_heads == H
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(N, L, E, generator=g), torch.randn(N, S, E, generator=g),
               torch.randn(N, S, E, generator=g))
    mask = _attend_mask(g)
    out, _ = layer.forward(q.numpy(), k.numpy(), v.numpy(),
                           attn_mask=clmha.Mask(mask.numpy(), attend=True, per_batch=True))
    with torch.no_grad():
        ref = copy.deepcopy(seed).double()(q.double(), k.double(), v.double(),
                                           _call_mask(kind, mask))
    assert record(f"seed {kind} Layer.from_state_dict", max_err(out, ref)) <= TOL


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList([nn.ModuleDict(dict(
            self_attn=_randomize(nn.MultiheadAttention(E, H), 1), linear=nn.Linear(E, E)))
            for _ in range(2)])
        self.head = nn.Module()
        self.head.attention = _seed_module("continuiti")
        self.decoder = _seed_module("classic")


def test_whole_model_prefix(ctx, tmp_path):
    torch.manual_seed(0)
    model = _Model().eval()
    sd = model.state_dict()
    g = torch.Generator().manual_seed(7)
    q, kv = torch.randn(N, L, E, generator=g), torch.randn(N, S, E, generator=g)
    path = tmp_path / "model.safetensors"
    safetensors_write(path, {k: v.numpy() for k, v in sd.items()})
    for prefix, module in (("encoder.layers.1.self_attn.", model.encoder.layers[1].self_attn),
                           ("head.attention.", model.head.attention),
                           ("decoder.", model.decoder)):
        bf = not isinstance(module, nn.MultiheadAttention)
        qq, kk = (q, kv) if bf else (q.transpose(0, 1).contiguous(),
                                      kv.transpose(0, 1).contiguous())
        with torch.no_grad():
            md = copy.deepcopy(module).double()
            ref = md(qq.double(), kk.double(), kk.double())
            ref = ref[0] if isinstance(ref, tuple) else ref
        a = clmha.Layer.from_state_dict(sd, H, prefix=prefix, context=ctx)
        b = clmha.Layer.load(path, ctx, prefix=prefix, num_heads=H)
        assert a.batch_first == bf and b.batch_first == bf
        for layer, how in ((a, "from_state_dict"), (b, "load")):
            out, _ = layer.forward(qq.numpy(), kk.numpy())
            assert record(f"prefix {prefix} {how}", max_err(out, ref)) <= TOL
    with pytest.raises(KeyError):
        clmha.Layer.from_state_dict(sd, H, prefix="nothing.", context=ctx)
    with pytest.raises(clmha.Error) as ei:
        clmha.Layer.load(path, ctx, prefix="nothing.", num_heads=H)
    assert "encoder.layers.0.self_attn" in ei.value.message  # lists the attention modules


def test_seed_safetensors_without_prefix(ctx, tmp_path):
    seed = _seed_module("continuiti", bias=False)
    path = tmp_path / "c.safetensors"
    safetensors_write(path, {k: v.numpy() for k, v in seed.state_dict().items()})
    layer = clmha.Layer.load(path, ctx, num_heads=H)
    assert not layer.bias and layer.batch_first
    q = torch.randn(N, L, E)
    out, _ = layer.forward(q.numpy())
    with torch.no_grad():
        ref = copy.deepcopy(seed).double()(q.double(), q.double(), q.double())
    assert record("seed continuiti file", max_err(out, ref)) <= TOL


def test_export_seed(ctx, tmp_path):
    seed = _seed_module("classic")
    path = tmp_path / "classic.safetensors"
    ct.export(seed, path)
    layer = clmha.Layer.load(path, ctx)
    assert layer.num_heads == H
    q = torch.randn(N, L, E)
    out, _ = layer.forward(q.numpy())
    with torch.no_grad():
        ref = copy.deepcopy(seed).double()(q.double(), q.double(), q.double())
    assert record("seed export", max_err(out, ref)) <= TOL
