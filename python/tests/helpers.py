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


def alibi_bias(slopes, L, S, offset=0):
    """ALiBi's additive bias, float64 (H, L, S): -slopes[h] * |offset + i - j| (query i at
    position offset + i, key j at position j)."""
    slopes = np.asarray(slopes, np.float64)
    i = offset + np.arange(L)[:, None]
    j = np.arange(S)[None, :]
    return -slopes[:, None, None] * np.abs(i - j)[None]


def sdpa_ref(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, keep=None,
             dropout_p=0.0, window=None, softcap=0.0, alibi_slopes=None, sinks=None):
    """PyTorch's scaled_dot_product_attention written out in torch ops (1.13 has none):
    softmax(q kᵀ·scale + mask) v, autograd following it (pass float64 tensors for the float64
    formula). A bool mask is True = may attend; is_causal masks key j > query i (top-left);
    enable_gqa repeats key/value head h for H / H_kv query heads; ``window`` (left, right) is
    window_keep() as one more bool mask. ``keep``: the dropout's kept weights (bool,
    (..., H, L, S)), scaled by 1/(1 - dropout_p). ``softcap`` c > 0: the scaled scores s become
    c·tanh(s/c) first; ``alibi_slopes`` (H values): alibi_bias() added next, before the
    masks. ``sinks`` (H values, a tensor for its gradient, or an array): one more logit per
    head appended to each row of scores, after the masks, with a zero value: the softmax over
    [scores, sink] with the sink's column dropped (a fully masked row: zeros)."""
    import torch
    if enable_gqa:
        r = q.size(-3) // k.size(-3)
        k = k.repeat_interleave(r, dim=-3)
        v = v.repeat_interleave(r, dim=-3)
    scores = q @ k.transpose(-2, -1) * (1 / math.sqrt(q.size(-1)) if scale is None else scale)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        bias = torch.from_numpy(alibi_bias(alibi_slopes, q.size(-2), k.size(-2)))
        scores = scores + (bias[0] if q.dim() == 2 else bias).to(scores.dtype)
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
    if sinks is not None:
        st = sinks if torch.is_tensor(sinks) else torch.from_numpy(
            np.asarray(sinks, np.float64))
        col = st.to(scores.dtype).reshape((-1, 1, 1) if q.dim() > 2 else (1, 1))
        col = col.expand(scores.shape[:-1] + (1,))
        p = torch.softmax(torch.cat([scores, col], dim=-1), dim=-1)[..., :-1]
    else:
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


def mha_ref(m, q, k=None, v=None, *, key_padding_mask=None, attn_mask=None, is_causal=False,
            window=None, softcap=0.0, alibi_slopes=None, sinks=None, need_weights=True,
            average_attn_weights=True, grad_output=None, grad_weights=None):
    """nn.MultiheadAttention's forward (eval, PyTorch 2.x's mask semantics) written out in
    float64 torch ops, with clmha's score variants: the scaled scores s of every key (the keys
    of add_bias_kv and add_zero_attn too) become softcap·tanh(s/softcap), then the real keys get
    ALiBi's -slope_h·|i - j| (alibi_slopes: H values), then the masks (key_padding_mask (N, S) /
    attn_mask (L, S) or (N*H, L, S): bool True = may NOT attend, or float; is_causal; the
    window (left, right)) over the real keys, then the softmax, over one more logit per head
    with a zero value with sinks (@p sinks, H values, or the module's parameter ``sinks``: a
    row's weights sum below 1, a fully masked row gives zeros). @p m gives the configuration
    and the parameters (nn.MultiheadAttention or clmha.torch.MultiheadAttention, GQA included:
    its k/v_proj_weight rows are num_kv_heads heads, query head h reading head h // (H/G)).
    NumPy inputs (k None: self-attention). Returns (output, weights or None, gradients): the
    gradients of sum(output * grad_output) + sum(weights * grad_weights) by clmha's names
    (query, key, value, each parameter, float masks) when grad_output is given, else None."""
    import torch
    P = {n: p.detach().double().clone().requires_grad_() for n, p in m.named_parameters()}
    self_attention = k is None
    qt = t64(q).requires_grad_()
    kt = qt if self_attention else t64(k).requires_grad_()
    vt = kt if v is None else t64(v).requires_grad_()
    masks = {}
    for name, a in (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
        t = t64(a)
        masks[name] = t.requires_grad_() if t is not None and t.dtype != torch.bool else t
    E, H = m.embed_dim, m.num_heads
    D = E // H
    unbatched = qt.dim() == 2
    x = [t.unsqueeze(1) if unbatched else (t.transpose(0, 1) if m.batch_first else t)
         for t in (qt, kt, vt)]  # (rows, N, features)
    L, N, S = x[0].shape[0], x[0].shape[1], x[1].shape[0]
    if "in_proj_weight" in P:
        Wq, Wk, Wv = P["in_proj_weight"].chunk(3)
    else:
        Wq, Wk, Wv = P["q_proj_weight"], P["k_proj_weight"], P["v_proj_weight"]
    GD = Wk.shape[0]
    G = GD // D
    if "in_proj_bias" in P:
        bq, bk, bv = P["in_proj_bias"].split([E, GD, GD])
    else:
        bq = torch.zeros(E, dtype=torch.float64)
        bk = bv = torch.zeros(GD, dtype=torch.float64)
    Q, K, V = x[0] @ Wq.T + bq, x[1] @ Wk.T + bk, x[2] @ Wv.T + bv
    if "bias_k" in P:
        K = torch.cat([K, P["bias_k"].reshape(1, 1, GD).expand(1, N, GD)])
        V = torch.cat([V, P["bias_v"].reshape(1, 1, GD).expand(1, N, GD)])
    heads = lambda t, g: t.reshape(t.shape[0], N, g, D).permute(1, 2, 0, 3)  # noqa: E731
    Q, K, V = heads(Q, H), heads(K, G), heads(V, G)  # (N, heads, rows, D)
    if m.add_zero_attn:
        K = torch.cat([K, torch.zeros(N, G, 1, D, dtype=torch.float64)], dim=2)
        V = torch.cat([V, torch.zeros(N, G, 1, D, dtype=torch.float64)], dim=2)
    K, V = K.repeat_interleave(H // G, dim=1), V.repeat_interleave(H // G, dim=1)
    Sp = K.shape[2]
    s = Q @ K.transpose(-2, -1) / math.sqrt(D)  # (N, H, L, Sp)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    bias = torch.zeros(N, H, L, S, dtype=torch.float64)
    if alibi_slopes is not None:
        bias = bias + torch.from_numpy(alibi_bias(alibi_slopes, L, S))
    kpm, am = masks["key_padding_mask"], masks["attn_mask"]
    def as_bias(t):
        if t.dtype != torch.bool:
            return t
        return torch.zeros(t.shape, dtype=torch.float64).masked_fill(t, -math.inf)

    if kpm is not None:
        bias = bias + as_bias(kpm).reshape(N, 1, 1, S)
    if am is not None:
        bias = bias + (as_bias(am) if am.dim() == 2 else as_bias(am).reshape(N, H, L, S))
    if is_causal:
        bias = bias.masked_fill(torch.ones(L, S, dtype=torch.bool).triu(1), -math.inf)
    if window is not None:
        bias = bias.masked_fill(torch.from_numpy(~window_keep(L, S, window)), -math.inf)
    s = s + torch.cat([bias, torch.zeros(N, H, L, Sp - S, dtype=torch.float64)], dim=-1)
    own_sinks = None
    if sinks is not None:
        own_sinks = t64(sinks).requires_grad_()
    sink = own_sinks if own_sinks is not None else P.get("sinks")
    if sink is not None:  # the softmax over [scores, sink], the sink's column dropped
        col = sink.reshape(1, H, 1, 1).expand(N, H, L, 1)
        W = torch.softmax(torch.cat([s, col], dim=-1), dim=-1)[..., :-1]
    else:
        W = torch.softmax(s, dim=-1)
    A = (W @ V).permute(2, 0, 1, 3).reshape(L, N, E)
    out = A @ P["out_proj.weight"].T
    if "out_proj.bias" in P:
        out = out + P["out_proj.bias"]
    out = out.squeeze(1) if unbatched else (out.transpose(0, 1) if m.batch_first else out)
    w = None
    if need_weights:
        w = W.mean(dim=1) if average_attn_weights else W
        w = w.squeeze(0) if unbatched else w
    grads = None
    if grad_output is not None:
        loss = (out * t64(grad_output)).sum()
        if grad_weights is not None:
            loss = loss + (w * t64(grad_weights)).sum()
        loss.backward()
        grads = {"query": qt.grad.numpy()}
        if not self_attention:
            grads["key"] = kt.grad.numpy()
            if v is not None:
                grads["value"] = vt.grad.numpy()
        for n, p in P.items():
            grads[n] = p.grad.numpy()
        for n, t in masks.items():
            if t is not None and t.requires_grad:
                grads[n] = t.grad.numpy()
        if own_sinks is not None:
            grads["sinks"] = own_sinks.grad.numpy()
    return out.detach().numpy(), (None if w is None else w.detach().numpy()), grads
