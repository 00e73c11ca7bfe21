#!/usr/bin/env python3
"""Generates the golden cases of attention as a function (clmha_attention_forward / _backward)
with PyTorch in float64.

Every case draws its inputs in float32 with NumPy (a fixed seed per case: NumPy's generator
gives the same numbers on every CPU), then computes PyTorch's scaled_dot_product_attention
semantics in float64 on exactly those values, forward and backward, and writes
tests/golden/sdpa/<case>.txt plus tests/golden/sdpa/cases.inc (the case names, #included by
tests/device/test_sdpa_golden.c). Files of cases no longer generated are removed.

Run with a Python that has PyTorch (tested with Debian's python3-torch 1.13):

    /usr/bin/python3 tools/make_sdpa_golden.py [--out tests/golden/sdpa] [--check]

--check regenerates in memory and exits non-zero when a file on disk differs: the float64
results within the tolerance of tools/golden_compare.py (PyTorch's float64 digits vary between
CPU models), everything else (header, shapes, the float32 inputs, masks) identically.

How the expected values come from PyTorch. torch >= 2.1 has
torch.nn.functional.scaled_dot_product_attention (with its scale argument); 1.13 has none. So
the formula is written out in torch ops, in float64, and differentiated by autograd:

    k, v = k.repeat_interleave(H // H_kv, dim=-3), likewise v     (GQA: SDPA's enable_gqa)
    scores = q @ k.transpose(-2, -1) * scale                       (scale: 1/sqrt(D) unless given)
    scores = softcap * tanh(scores / softcap)                      (softcap > 0 only)
    scores = scores - slope[h] * |i - j|                           (alibi: query head h, row i,
                                                                    key j)
    scores = scores + attn_mask                                    (float mask)
    scores = scores.masked_fill(~attn_mask, -inf)                  (bool mask: True = may attend)
    scores = scores.masked_fill(~ones(L, S, bool).tril(), -inf)    (is_causal: top-left aligned)
    scores = scores.masked_fill(~inside, -inf)                     (window (left, right): inside
                                                                    [i, j] iff i - left <= j <=
                                                                    i + right, -1 unbounded)
    weights = softmax(scores, -1); output = weights @ v; lse = logsumexp(scores, -1)

and with attention sinks (sinks: H logits, one per query head, with a zero value), the softmax
and the lse over [scores, sinks[h]], the sink's column dropped from the weights:

    scores = cat([scores, sinks[h] per row], -1)                  (sinks only)
    weights = softmax(scores, -1)[..., :-1]; lse = logsumexp(scores, -1)

with one convention of clmha's where PyTorch has none (documented in include/clmha.h): a query
row whose every key is masked gives zero weights, a zero output row and zero gradients (its lse
is -inf); PyTorch's own SDPA gives NaN there (2.5's math backend zeros). The formula replaces
such a row's scores by zeros before the softmax and its weights by zeros after it (torch.where,
so autograd gives zero gradients through it). Only the case `bool_nhls_dead_row` has such a row;
its header comment says so.

The gradients are autograd's, of loss = sum(grad_output * output), with respect to query, key
and value (GQA: key/value in their own H_kv heads, summed over each group by autograd) and a
float mask in its own shape (summed over the dimensions it is broadcast along, by autograd).
Where the installed torch has F.scaled_dot_product_attention (>= 2.1), every case without a
fully masked row is also run through it in float64 (k and v repeat_interleave'd as above) and
its output, dq, dk and dv must agree with the formula's to 1e-12; the file's values are then
SDPA's (lse and weights, which SDPA does not return, and a float mask's gradient stay the
formula's). Where it has not, but has 1.13's prototype F._scaled_dot_product_attention
(default scale only, a float or boolean mask, is_causal; the weights returned), every case
without a fully masked row is run through that too (a given scale put into q as
q * scale * sqrt(D); K/V repeated for GQA) and its output, weights and the gradients of q, k, v
and a float mask must agree with the formula's to 1e-12 (measured: 7e-16 at most). The header
comment does not say which torch ran, so --check compares the same text on either. Neither of
PyTorch's functions has a sliding window: the window cases give them the window as an explicit
boolean mask, folded into the case's attn_mask (and, with is_causal, the causal mask with it,
as SDPA takes no attn_mask together with is_causal). Nor has either ALiBi: the ALiBi cases give
them its bias as a float (H, L, S) attn_mask (a bool mask, the window and is_causal folded in as
-inf, a float mask added), and the mask's gradient flows back through that sum. Nor has either
sinks: the sinks cases are checked, as the softcap ones, against the NumPy row loops
(loop_formula, which adds exp(sinks_h - m) to each row's denominator itself), their gradients
(grad.sinks too, f64 (H), after the others) being autograd's of the formula. Soft-capping
cannot be a mask (it sits between the product and the mask): the softcap cases are checked
instead against a second, independent float64 computation in NumPy (loops over the rows:
output, lse and weights to 1e-12; loop_formula), their gradients being autograd's through tanh.

File format: tools/make_golden.py's text format (tests/support/golden.h), with an `sdpa` line
in place of its layer and call lines:

    case <name>
    sdpa layout <nhld|nlhd> is_causal <0|1> scale <s> enable_gqa <0|1> attn <kind>
         [window <left> <right>] [softcap <c>] [alibi] [sinks]
    tensor <name> <f32|u8|f64> <ndim> <d0> ... <dn-1>
    <values, C order>
    ...
    end

scale 0 means 1/sqrt(D) (clmha_attention_args::scale's convention), anything else is the
scores' factor as passed. attn is none, bool_attend (u8, 1 = may attend: SDPA's boolean mask)
or float (f32, added to the scaled scores, -inf where forbidden). window (the window cases
only): clmha_attention_args::window_left and window_right; softcap and alibi (the score-variant
cases only): clmha_attention_args::softcap and ::alibi, the slopes being the f32 tensor
alibi_slopes (H) after the mask when the case has its own (clmha_attention_args::alibi_slopes),
else the geometric ones (clmha_alibi_slopes(), make_golden.geometric_slopes()); sinks (the
attention-sink cases only): clmha_attention_args::sinks, the f32 tensor sinks (H) after the
mask (and the slopes), drawn by make_golden.sinks_of(), and its gradient grad.sinks (f64, (H))
last. Tensors, in order:
query, key, value (f32: (N, H, L, D), (N, H_kv, S, D) in layout nhld, (N, L, H, D),
(N, S, H_kv, D) in nlhd; without N when unbatched), attn_mask (its own shape: one of those
clmha_attention_args documents), output (f64, the query's layout), lse (f64, (N, H, L)),
weights (f64, (N, H, L, S); lse and weights in that order whatever the layout, as clmha writes
them), grad_output (f32, the output's shape; drawn after everything else), grad.query,
grad.key, grad.value (f64, the inputs' shapes) and grad.attn_mask (f64, float masks only).
"""

import argparse
import math
import os
import sys
import zlib

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import golden_compare  # noqa: E402
# (the same tensor lines, slopes and sinks as the layer cases)
from make_golden import (custom_slopes, geometric_slopes, sinks_of,  # noqa: E402
                         tensor_text)

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "..", "tests", "golden", "sdpa")
KINDS = ("none", "bool_attend", "float")
SDPA_AGREEMENT = 1e-12  # the formula against F.scaled_dot_product_attention, where it exists

# ------------------------------------------------------------------------------------------
# Cases
# ------------------------------------------------------------------------------------------


def C(name, **kw):
    d = dict(name=name, N=2, H=2, H_kv=None, L=4, S=None, D=8, layout="nhld", batched=True,
             attn="none", mask_shape=None, causal=False, scale=0.0, dead_row=False,
             window=None, softcap=0.0, alibi=None, sinks=False)
    for k in kw:
        if k not in d:
            raise KeyError(k)
    d.update(kw)
    if d["S"] is None:
        d["S"] = d["L"]
    if d["H_kv"] is None:
        d["H_kv"] = d["H"]
    assert d["H"] % d["H_kv"] == 0 and d["layout"] in ("nhld", "nlhd") and d["attn"] in KINDS
    assert (d["attn"] == "none") == (d["mask_shape"] is None)
    assert not (d["causal"] and d["attn"] != "none"), "SDPA refuses is_causal with attn_mask"
    assert not d["dead_row"] or d["attn"] != "none"
    assert d["alibi"] in (None, "geometric", "custom") and d["softcap"] >= 0.0
    if not d["batched"]:
        assert d["N"] == 1
    return d


CASES = [
    C("nhld_basic", N=2, H=2, L=3, S=5),
    C("nlhd_scale", layout="nlhd", N=1, H=3, L=5, S=3, scale=0.3),
    C("bool_ls", attn="bool_attend", mask_shape="LS", L=4, S=5, D=4),
    C("bool_n1ls", layout="nlhd", attn="bool_attend", mask_shape="N1LS", L=4, S=5, D=4),
    C("bool_nhls_dead_row", attn="bool_attend", mask_shape="NHLS", L=4, S=5, D=4,
      dead_row=True),
    C("bool_n11s", layout="nlhd", attn="bool_attend", mask_shape="N11S", N=3, L=3, S=4, D=4),
    C("float_ls", layout="nlhd", attn="float", mask_shape="LS", L=4, S=5, D=4),
    C("float_n1ls", attn="float", mask_shape="N1LS", L=4, S=5, D=4),
    C("float_nhls", layout="nlhd", attn="float", mask_shape="NHLS", L=3, S=5, D=4),
    C("float_n11s", attn="float", mask_shape="N11S", N=3, L=4, S=4, D=4),
    C("causal_L3_S7", layout="nlhd", N=1, causal=True, L=3, S=7),
    C("causal_L7_S3", N=1, causal=True, L=7, S=3, scale=0.5),
    C("gqa_4_2_causal", N=1, H=4, H_kv=2, causal=True, L=4, S=4),
    C("gqa_6_3_float", layout="nlhd", N=1, H=6, H_kv=3, attn="float", mask_shape="NHLS",
      L=2, S=4, D=4),
    C("unbatched_d20_float", batched=False, N=1, H=2, L=3, S=4, D=20, attn="float",
      mask_shape="LS", scale=0.25),
    C("decode_L1", layout="nlhd", N=2, H=2, L=1, S=6),
    # sliding windows (tests/device/test_sdpa_golden.c runs these through impl auto and
    # unfused only, until the fused core takes windows)
    C("window_gqa_left_unbounded", N=2, H=4, H_kv=2, L=6, S=6, window=(-1, 1)),
    C("window_bool_n1ls_nlhd", layout="nlhd", attn="bool_attend", mask_shape="N1LS", L=5, S=7,
      D=4, window=(2, 1)),
    C("window_causal_scale_L6_S5", N=1, causal=True, L=6, S=5, window=(1, -1), scale=0.5),
    # score variants: soft-capping (c·tanh(s/c)) and ALiBi (-slope_h·|i - j|)
    C("softcap_alibi_gqa", N=2, H=4, H_kv=2, L=6, S=6, softcap=1.0, alibi="geometric"),
    C("alibi_custom_bool_mask_nlhd", layout="nlhd", H=3, attn="bool_attend", mask_shape="N1LS",
      L=5, S=7, D=4, alibi="custom"),
    C("softcap_causal_scale", N=1, H=2, causal=True, L=6, S=6, softcap=0.5, scale=0.5),
    C("alibi_geometric_h3_unbatched_float", batched=False, N=1, H=3, L=4, S=6, attn="float",
      mask_shape="LS", alibi="geometric", window=(2, -1)),
    # attention sinks (one zero-valued logit per head in every row's softmax), with grad.sinks
    C("sinks_gqa", N=2, H=4, H_kv=2, L=5, S=7, sinks=True),
    C("sinks_causal_nlhd_grads", layout="nlhd", N=1, H=3, causal=True, L=6, S=6, D=4,
      sinks=True),
]

# ------------------------------------------------------------------------------------------
# Drawing the inputs (NumPy, float32; the same numbers on every CPU)
# ------------------------------------------------------------------------------------------


def mask_shape(c):
    """The attn_mask's shape in the file (None without one)."""
    N, H, L, S = c["N"], c["H"], c["L"], c["S"]
    shapes = {"LS": (L, S), "N1LS": (N, 1, L, S), "NHLS": (N, H, L, S), "N11S": (N, 1, 1, S)}
    return None if c["mask_shape"] is None else shapes[c["mask_shape"]]


def allowed(c, mask):
    """(N, H, L, S) bool: where a query may attend, after the mask and is_causal."""
    N, H, L, S = c["N"], c["H"], c["L"], c["S"]
    ok = np.ones((N, H, L, S), dtype=bool)
    if c["attn"] == "bool_attend":
        ok &= np.broadcast_to(mask, ok.shape)
    elif c["attn"] == "float":
        ok &= np.broadcast_to(np.isfinite(mask), ok.shape)
    if c["causal"]:
        ok &= np.tril(np.ones((L, S), dtype=bool))
    if c["window"] is not None:
        ok &= window_inside(c).numpy()
    return ok


def window_inside(c):
    """The (L, S) bool tensor of keys inside the case's window (all True without one): key j
    for query i iff i - left <= j <= i + right, -1 leaving a side unbounded."""
    L, S = c["L"], c["S"]
    inside = torch.ones(L, S, dtype=torch.bool)
    if c["window"] is not None:
        i = torch.arange(L).reshape(L, 1)
        j = torch.arange(S).reshape(1, S)
        left, right = c["window"]
        if left >= 0:
            inside &= j >= i - left
        if right >= 0:
            inside &= j <= i + right
    return inside


def slopes_of(c):
    """The case's ALiBi slopes, float32 (H), None without ALiBi."""
    if c["alibi"] is None:
        return None
    return geometric_slopes(c["H"]) if c["alibi"] == "geometric" else \
        custom_slopes(c["name"], c["H"])


def alibi_bias(c):
    """ALiBi's additive float64 bias (H, L, S): -slope_h·|i - j|."""
    L, S = c["L"], c["S"]
    dist = (torch.arange(L).reshape(L, 1) - torch.arange(S).reshape(1, S)).abs().double()
    return -torch.from_numpy(slopes_of(c)).double().reshape(-1, 1, 1) * dist


def folded_mask(c, mask):
    """(mask, is_causal) for PyTorch's functions, which have neither a window nor ALiBi: the
    window (and then is_causal too) folded into the mask as an explicit boolean mask (True =
    may attend); with ALiBi the mask is its float bias (H, L, S), -inf where the window,
    is_causal or a bool mask forbid, plus a float mask."""
    if c["window"] is None and c["alibi"] is None:
        return mask, c["causal"]
    keep = window_inside(c)
    if c["causal"]:
        keep &= torch.ones(c["L"], c["S"], dtype=torch.bool).tril()
    if c["alibi"] is not None:
        bias = alibi_bias(c).masked_fill(~keep, -math.inf)
        if mask is None:
            return bias, False
        if mask.dtype == torch.bool:
            return bias.masked_fill(~mask, -math.inf), False
        return bias + mask, False
    if mask is None:
        return keep, False
    if mask.dtype == torch.bool:
        return mask & keep, False
    return mask.masked_fill(~keep, -math.inf), False


def draw_mask(c, rng):
    """The case's mask: bool (True = may attend, 70 %) or float32 (-inf 20 %, else uniform in
    [-2, 1)), redrawn until no row is fully masked; then, for dead_row, row 1 of the first
    plane fully masked."""
    shape = mask_shape(c)
    if shape is None:
        return None
    while True:
        if c["attn"] == "bool_attend":
            m = rng.random(shape) < 0.7
        else:
            forbid = rng.random(shape) < 0.2
            m = np.where(forbid, -np.inf, rng.uniform(-2.0, 1.0, shape)).astype(np.float32)
        if allowed(c, m).any(axis=-1).all():
            break
    if c["dead_row"]:
        plane = m.reshape(-1, c["L"], c["S"])
        plane[0, 1, :] = False if m.dtype == bool else -np.inf
        assert not allowed(c, m).any(axis=-1).all()
    return m


def draw(c):
    """The case's inputs in (N, H, L, D) order: q, k, v, mask, grad_output (float32)."""
    rng = np.random.default_rng(zlib.crc32(c["name"].encode()))
    N, H, Hkv, L, S, D = c["N"], c["H"], c["H_kv"], c["L"], c["S"], c["D"]
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    q, k, v = normal(N, H, L, D), normal(N, Hkv, S, D), normal(N, Hkv, S, D)
    mask = draw_mask(c, rng)
    g = normal(N, H, L, D)
    return q, k, v, mask, g

# ------------------------------------------------------------------------------------------
# PyTorch, float64
# ------------------------------------------------------------------------------------------


def scale_of(c):
    return c["scale"] if c["scale"] else 1.0 / math.sqrt(c["D"])


def formula(c, q, k, v, mask, sinks=None):
    """SDPA written out (see the module's docstring): output, lse, weights; ``sinks`` (H),
    a tensor (a leaf for its gradient), with the case's sinks."""
    groups = c["H"] // c["H_kv"]
    k = k.repeat_interleave(groups, dim=-3)
    v = v.repeat_interleave(groups, dim=-3)
    scores = q @ k.transpose(-2, -1) * scale_of(c)
    if c["softcap"]:
        scores = c["softcap"] * torch.tanh(scores / c["softcap"])
    if c["alibi"] is not None:
        scores = scores + alibi_bias(c)
    if c["attn"] == "float":
        scores = scores + mask
    elif c["attn"] == "bool_attend":
        scores = scores.masked_fill(~mask, -math.inf)
    if c["causal"]:
        L, S = c["L"], c["S"]
        scores = scores.masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(), -math.inf)
    if c["window"] is not None:
        scores = scores.masked_fill(~window_inside(c), -math.inf)
    if sinks is not None:  # one more logit per head, its column dropped from the weights
        col = sinks.reshape(-1, 1, 1).expand(scores.shape[:-1] + (1,))
        full = torch.cat([scores, col], dim=-1)
        p = torch.softmax(full, dim=-1)[..., :-1]
        return p @ v, torch.logsumexp(full.detach(), dim=-1), p
    dead = torch.isneginf(scores).all(dim=-1, keepdim=True)
    p = torch.softmax(torch.where(dead, torch.zeros_like(scores), scores), dim=-1)
    p = torch.where(dead, torch.zeros_like(p), p)
    return p @ v, torch.logsumexp(scores.detach(), dim=-1), p


def has_sdpa():
    """torch >= 2.1: F.scaled_dot_product_attention with its scale argument."""
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return hasattr(F, "scaled_dot_product_attention") and (major, minor) >= (2, 1)


def torch_sdpa(c, q, k, v, mask):
    """F.scaled_dot_product_attention in float64 (K/V repeated for GQA): the output."""
    groups = c["H"] // c["H_kv"]
    mask, causal = folded_mask(c, mask)
    return F.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3),
        attn_mask=mask, is_causal=causal, scale=scale_of(c))


def torch_prototype_sdpa(c, q, k, v, mask):
    """torch 1.13's prototype F._scaled_dot_product_attention in float64 (K/V repeated for
    GQA; it has no scale argument and scales by 1/sqrt(D): a given scale is put into q, times
    sqrt(D)): output and weights."""
    groups = c["H"] // c["H_kv"]
    if c["scale"]:
        q = q * (c["scale"] * math.sqrt(c["D"]))
    mask, causal = folded_mask(c, mask)
    return F._scaled_dot_product_attention(  # pylint: disable=protected-access
        q, k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3), mask,
        0.0, True, causal)


def with_grads(fn, c, inputs, g, mask_grad=True):
    """fn(c, *leaves) on float64 leaves made from inputs (q, k, v, mask); its result and the
    leaves' gradients of sum(g * output) (None for a leaf that takes none: a bool mask, or the
    mask without mask_grad)."""
    leaves = []
    for i, x in enumerate(inputs):
        if x is None:
            leaves.append(None)
            continue
        t = torch.from_numpy(x.astype(np.float64) if x.dtype != bool else x)
        if t.is_floating_point() and (i != 3 or mask_grad):
            t.requires_grad_(True)
        leaves.append(t)
    res = fn(c, *leaves)
    out = res[0] if isinstance(res, tuple) else res
    takes = [t for t in leaves if t is not None and t.requires_grad]
    grads = torch.autograd.grad(out, takes, torch.from_numpy(g.astype(np.float64)))
    it = iter(grads)
    gl = [next(it) if t is not None and t.requires_grad else None for t in leaves]
    return res, [None if x is None else x.detach().numpy() for x in gl]


def compute(c, q, k, v, mask, g):
    """The expected values, float64 arrays in (N, H, L|S, ...) order (the mask's gradient in
    the mask's shape): output, lse, weights, dq, dk, dv and dmask (None without a float mask).
    PyTorch's own SDPA where it has one, checked against the formula (module docstring)."""
    (out, lse, p), grads = with_grads(formula, c, (q, k, v, mask, sinks_of(c)), g)
    res = dict(output=out.detach().numpy(), lse=lse.numpy(), weights=p.detach().numpy(),
               dq=grads[0], dk=grads[1], dv=grads[2], dmask=grads[3], dsinks=grads[4])
    for name, x in res.items():
        assert x is None or not np.isnan(x).any(), f"{c['name']}: {name} has NaN"
    if c["dead_row"]:
        return res
    if c["softcap"] or c["sinks"]:  # no PyTorch function soft-caps or has sinks: the
        # independent NumPy loops instead
        agree(c, "loop_formula", loop_formula(c, q, k, v, mask), res)
        return res
    if has_sdpa():
        sout, sg = with_grads(torch_sdpa, c, (q, k, v, mask), g, mask_grad=False)
        theirs = dict(output=sout.detach().numpy(), dq=sg[0], dk=sg[1], dv=sg[2])
        agree(c, "F.scaled_dot_product_attention", theirs, res)
        res.update(theirs)
    elif hasattr(F, "_scaled_dot_product_attention"):
        (pout, pw), pg = with_grads(torch_prototype_sdpa, c, (q, k, v, mask), g)
        agree(c, "F._scaled_dot_product_attention", dict(
            output=pout.detach().numpy(), weights=pw.detach().numpy(), dq=pg[0], dk=pg[1],
            dv=pg[2], dmask=pg[3]), res)
    return res


def loop_formula(c, q, k, v, mask):
    """The forward in float64 NumPy, one query row at a time (independent of formula(): no
    torch, no broadcasting of the masks or the bias): output, lse and weights."""
    N, H, Hkv, L, S = c["N"], c["H"], c["H_kv"], c["L"], c["S"]
    slopes = slopes_of(c)
    sinks = sinks_of(c)
    inside = window_inside(c).numpy()
    full = None if mask is None else np.broadcast_to(mask, (N, H, L, S))
    out = np.zeros((N, H, L, v.shape[-1]))
    lse = np.full((N, H, L), -np.inf)
    w = np.zeros((N, H, L, S))
    for n in range(N):
        for h in range(H):
            g = h // (H // Hkv)
            for i in range(L):
                row = []
                for j in range(S):
                    s = float(np.dot(q[n, h, i].astype(np.float64), k[n, g, j].astype(np.float64)))
                    s *= scale_of(c)
                    if c["softcap"]:
                        s = c["softcap"] * math.tanh(s / c["softcap"])
                    if slopes is not None:
                        s -= float(slopes[h]) * abs(i - j)
                    if full is not None:
                        if full.dtype == bool:
                            s = s if full[n, h, i, j] else -math.inf
                        else:
                            s += float(full[n, h, i, j])
                    if (c["causal"] and j > i) or not inside[i, j]:
                        s = -math.inf
                    row.append(s)
                row = np.array(row)
                sink = -math.inf if sinks is None else float(sinks[h])
                if np.isneginf(row).all() and sink == -math.inf:
                    continue
                m = max(row.max(), sink)
                e = np.exp(row - m)
                den = e.sum() + (0.0 if sinks is None else math.exp(sink - m))
                w[n, h, i] = e / den
                lse[n, h, i] = m + math.log(den)
                out[n, h, i] = w[n, h, i] @ v[n, g].astype(np.float64)
    return dict(output=out, lse=lse, weights=w)


def agree(c, what, theirs, ours):
    """Asserts that PyTorch's function (what) gave the formula's values to SDPA_AGREEMENT."""
    for name, x in theirs.items():
        if x is None and ours[name] is None:
            continue
        err = float(np.abs(x - ours[name]).max())
        assert err <= SDPA_AGREEMENT, f"{c['name']}: {name}: {what} differs by {err:.3g}"

# ------------------------------------------------------------------------------------------
# Writing
# ------------------------------------------------------------------------------------------


def as_file(c, x, per_head_rows=True):
    """An (N, H, L|S, ...) array in the file's order: NLHD swaps the head and sequence
    dimensions (per_head_rows: a tensor with a feature dimension; lse and weights keep
    (N, H, L[, S]) in either layout); unbatched drops N."""
    if c["layout"] == "nlhd" and per_head_rows:
        x = x.swapaxes(1, 2)
    if not c["batched"]:
        x = x[0]
    return np.ascontiguousarray(x)


def generate(c):
    """The text of case c's file."""
    q, k, v, mask, g = draw(c)
    r = compute(c, q, k, v, mask, g)
    lines = ["# clmha SDPA golden case, generated by tools/make_sdpa_golden.py: PyTorch's",
             "# scaled_dot_product_attention semantics in float64 (see that script)"]
    if c["dead_row"]:
        lines += ["# row 1 of the mask's first (L, S) plane is fully masked: its output,",
                  "# weights and gradients are zero and its lse is -inf (clmha's convention;",
                  "# PyTorch's SDPA gives NaN there)"]
    lines += [f"case {c['name']}",
              f"sdpa layout {c['layout']} is_causal {int(c['causal'])} scale {float(c['scale'])!r}"
              f" enable_gqa {int(c['H_kv'] != c['H'])} attn {c['attn']}"
              + ("" if c["window"] is None else " window %d %d" % c["window"])
              + (f" softcap {c['softcap']!r}" if c["softcap"] else "")
              + (" alibi" if c["alibi"] is not None else "")
              + (" sinks" if c["sinks"] else "")]
    lines += tensor_text("query", "f32", as_file(c, q))
    lines += tensor_text("key", "f32", as_file(c, k))
    lines += tensor_text("value", "f32", as_file(c, v))
    if mask is not None:
        lines += tensor_text("attn_mask", "u8" if mask.dtype == bool else "f32", mask)
    if c["alibi"] == "custom":
        lines += tensor_text("alibi_slopes", "f32", slopes_of(c))
    if c["sinks"]:
        lines += tensor_text("sinks", "f32", sinks_of(c))
    lines += tensor_text("output", "f64", as_file(c, r["output"]))
    lines += tensor_text("lse", "f64", as_file(c, r["lse"], False))
    lines += tensor_text("weights", "f64", as_file(c, r["weights"], False))
    lines += tensor_text("grad_output", "f32", as_file(c, g))
    for name, key in (("query", "dq"), ("key", "dk"), ("value", "dv")):
        lines += tensor_text(f"grad.{name}", "f64", as_file(c, r[key]))
    if r["dmask"] is not None:
        assert r["dmask"].shape == mask.shape
        lines += tensor_text("grad.attn_mask", "f64", r["dmask"])
    if c["sinks"]:
        lines += tensor_text("grad.sinks", "f64", r["dsinks"])
    lines.append("end")
    return "\n".join(lines) + "\n"


def check(out_dir, files):
    """Compares the files on disk with files (name -> text): the .inc identically, the cases
    with golden_compare's tolerance on their f64 lines."""
    bad = 0
    for fn, want in files.items():
        p = os.path.join(out_dir, fn)
        if not os.path.exists(p):
            why = "missing"
        else:
            have = open(p).read()
            why = (("differs" if have != want else None) if fn.endswith(".inc")
                   else golden_compare.golden_text_differs(have, want))
        if why:
            print(f"differs: {p}: {why}", file=sys.stderr)
            bad += 1
    extra = sorted(fn for fn in os.listdir(out_dir) if fn not in files) \
        if os.path.isdir(out_dir) else []
    for fn in extra:
        print(f"differs: {os.path.join(out_dir, fn)}: not generated", file=sys.stderr)
    print(f"{len(files) - bad}/{len(files)} files match ({len(extra)} extra): float32 inputs"
          f" and masks identical, float64 results within {golden_compare.TOLERANCE}")
    return 1 if bad or extra else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--check", action="store_true",
                    help="compare with the files on disk instead of writing")
    args = ap.parse_args()
    out_dir = os.path.normpath(args.out)
    names = [c["name"] for c in CASES]
    assert len(set(names)) == len(names)
    torch.set_grad_enabled(True)
    files = {f"{c['name']}.txt": generate(c) for c in CASES}
    files["cases.inc"] = ("/* generated by tools/make_sdpa_golden.py: the SDPA golden case"
                          " names */\n" + "".join(f'"{n}",\n' for n in names))
    if args.check:
        return check(out_dir, files)
    os.makedirs(out_dir, exist_ok=True)
    for fn in os.listdir(out_dir):
        if fn not in files:
            os.remove(os.path.join(out_dir, fn))
    total = 0
    for fn, text in files.items():
        with open(os.path.join(out_dir, fn), "w") as f:
            f.write(text)
        total += len(text)
    how = "F.scaled_dot_product_attention"
    if not has_sdpa():
        how = f"the formula (torch {torch.__version__} has no SDPA)"
        if hasattr(F, "_scaled_dot_product_attention"):
            how += ", checked against its prototype F._scaled_dot_product_attention"
    print(f"wrote {len(CASES)} cases to {out_dir} ({total} bytes): {how}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
