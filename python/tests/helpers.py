"""Shared helpers: random data, PyTorch float64 references, error bookkeeping."""

import math

import numpy as np

import clmha

TOL = 1e-4  # max abs error on unit-scale float32 inputs

#: measured max errors, printed at the end of the session (pytest -s shows them)
MEASURED = {}


def record(name, err):
    MEASURED[name] = max(MEASURED.get(name, 0.0), float(err))
    return err


def randn(rng, *shape, scale=1.0, dtype=np.float32):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def max_err(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def torch_mha(E, H, seed=0, **opts):
    """A float32 torch.nn.MultiheadAttention with random parameters (biases nonzero)."""
    import torch
    torch.manual_seed(seed)
    m = torch.nn.MultiheadAttention(E, H, **opts)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * (0.4 if p.dim() > 1 else 0.2))
    return m.eval()


def layer_of(m, ctx, dtype="float32", **extra):
    """A clmha.Layer with @p m's configuration and parameters."""
    layer = clmha.Layer(m.embed_dim, m.num_heads, bias=m.in_proj_bias is not None,
                        add_bias_kv=m.bias_k is not None, add_zero_attn=m.add_zero_attn,
                        kdim=m.kdim, vdim=m.vdim, batch_first=m.batch_first,
                        dropout=m.dropout, dtype=dtype, context=ctx, **extra)
    layer.load_state_dict({k: v.detach().double().numpy() if dtype == "float64"
                           else v.detach().numpy() for k, v in m.state_dict().items()})
    return layer


def t64(a):
    import torch
    if a is None:
        return None
    a = np.asarray(a)
    return torch.from_numpy(a if a.dtype == np.bool_ else a.astype(np.float64))


def ref_forward(m, q, k=None, v=None, **kw):
    """PyTorch's float64 forward of module @p m (a copy in .double()) on numpy inputs."""
    import copy
    import torch
    md = copy.deepcopy(m).double().eval()
    k = q if k is None else k
    v = k if v is None else v
    kw = {name: (t64(x) if isinstance(x, np.ndarray) else x) for name, x in kw.items()}
    kw.setdefault("need_weights", False)
    with torch.no_grad():
        out, w = md(t64(q), t64(k), t64(v), **kw)
    return out.numpy(), (w.numpy() if w is not None else None)


def causal_float_mask(L, S=None):
    S = L if S is None else S
    m = np.zeros((L, S))
    m[np.triu_indices(L, 1, S)] = -np.inf
    return m


def safetensors_write(path, tensors, metadata=None):
    """A .safetensors file written by hand: 8-byte LE header length, JSON header, raw data."""
    import json
    header, blobs, offset = {}, [], 0
    codes = {np.dtype("<f4"): "F32", np.dtype("<f8"): "F64", np.dtype("<f2"): "F16"}
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        if a.dtype not in codes:
            a = a.astype("<f4")
        raw = a.tobytes()
        header[name] = {"dtype": codes[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + b"".join(blobs))


def window_keep(L, S, window):
    """The sliding window (left, right) written as a bool (L, S) mask, True = may attend: key j
    for query i iff i - left <= j <= i + right, -1 leaving a side unbounded (None: all True)."""
    keep = np.ones((L, S), dtype=bool)
    if window is not None:
        i, j = np.arange(L)[:, None], np.arange(S)[None, :]
        if window[0] >= 0:
            keep &= j >= i - window[0]
        if window[1] >= 0:
            keep &= j <= i + window[1]
    return keep


def sdpa_ref(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, keep=None,
             dropout_p=0.0, window=None):
    """PyTorch's scaled_dot_product_attention written out in torch ops (1.13 has none):
    softmax(q kᵀ·scale + mask) v, autograd following it (pass float64 tensors for the float64
    formula). A bool mask is True = may attend; is_causal masks key j > query i (top-left);
    enable_gqa repeats key/value head h for H / H_kv query heads; ``window`` (left, right) is
    window_keep() as one more bool mask. ``keep``: the dropout's kept weights (bool,
    (..., H, L, S)), scaled by 1/(1 - dropout_p)."""
    import torch
    if enable_gqa:
        r = q.size(-3) // k.size(-3)
        k = k.repeat_interleave(r, dim=-3)
        v = v.repeat_interleave(r, dim=-3)
    scores = q @ k.transpose(-2, -1) * (1 / math.sqrt(q.size(-1)) if scale is None else scale)
    if is_causal:
        causal = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if window is not None:
        inside = torch.from_numpy(window_keep(q.size(-2), k.size(-2), window))
        scores = scores.masked_fill(~inside, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask
    p = torch.softmax(scores, dim=-1)
    if keep is not None:
        p = p * keep / (1 - dropout_p)
    return p @ v


def sdpa_ref_np(q, k, v, attn_mask=None, **kw):
    """sdpa_ref in float64 on NumPy arrays (bool masks stay bool): a float64 NumPy array."""
    import torch
    t = lambda a: None if a is None else torch.from_numpy(  # noqa: E731
        a if a.dtype == np.bool_ else np.asarray(a, np.float64))
    return sdpa_ref(t(q), t(k), t(v), t(attn_mask), **kw).numpy()


def torch_grads(m, q, k, v, kpm, am, gout, gw, need_weights=True, self_attention=False,
                average_attn_weights=True):
    """PyTorch float64 autograd of sum(out*gout) + sum(w*gw): gradients by clmha's names."""
    import copy
    import torch
    md = copy.deepcopy(m).double()
    qt = t64(q).requires_grad_()
    kt = qt if self_attention else t64(k).requires_grad_()
    vt = qt if self_attention else t64(v).requires_grad_()
    kpm_t = t64(kpm).requires_grad_() if kpm is not None and kpm.dtype != np.bool_ else t64(kpm)
    am_t = t64(am).requires_grad_() if am is not None and am.dtype != np.bool_ else t64(am)
    kpm_arg, am_arg = kpm_t, am_t
    if kpm_t is not None and kpm_t.requires_grad:
        # PyTorch 1.13 gives no gradient to a float key_padding_mask: fold it into the
        # (N*H, L, S) attn_mask inside autograd (the same sum of masks)
        n, s_len = kpm_t.shape
        l_len = q.shape[1] if m.batch_first else q.shape[0]
        base = am_t if am_t is not None else torch.zeros(l_len, s_len, dtype=torch.float64)
        if base.dim() == 2:
            base = base.unsqueeze(0).expand(n * m.num_heads, l_len, s_len)
        am_arg = base + kpm_t.repeat_interleave(m.num_heads, dim=0)[:, None, :]
        kpm_arg = None
    out, w = md(qt, kt, vt, key_padding_mask=kpm_arg, attn_mask=am_arg,
                need_weights=need_weights, average_attn_weights=average_attn_weights)
    loss = (out * t64(gout)).sum() + ((w * t64(gw)).sum() if need_weights else 0)
    loss.backward()
    g = {"query": qt.grad.numpy()}
    if not self_attention:
        g["key"], g["value"] = kt.grad.numpy(), vt.grad.numpy()
    for n, p in md.named_parameters():
        g[n] = p.grad.numpy()
    if kpm_t is not None and kpm_t.requires_grad:
        g["key_padding_mask"] = kpm_t.grad.numpy()
    if am_t is not None and am_t.requires_grad:
        g["attn_mask"] = am_t.grad.numpy()
    return out.detach().numpy(), g
