#!/usr/bin/env python3
"""Generates the golden test cases of clmha with PyTorch.

Every case draws its parameters and inputs in float32 (fixed seeds), then runs
torch.nn.MultiheadAttention in float64 on exactly those values (module.eval()), and writes
tests/golden/<case>.txt plus tests/golden/cases.inc (the list of case names, #included by
tests/device/test_golden.c). The float16 / bfloat16 layer cases (DTYPE_CASES, see below) are written as
tests/golden/dtype_<f16|bf16>_<name>.txt and listed in tests/golden/dtype_cases.inc only (so
that the float32 tests do not see them); the float64 layer cases (F64_CASES) likewise as
tests/golden/f64_<name>.txt, listed in tests/golden/f64_cases.inc only (tests/device/test_f64.c). Files
of cases no longer generated are removed.

Run with a Python that has PyTorch (tested with Debian's python3-torch 1.13):

    /usr/bin/python3 tools/make_golden.py [--out tests/golden] [--check]

--check regenerates in memory and exits non-zero when any file on disk differs: float64 results
within the tolerance of tools/golden_compare.py (PyTorch's float64 digits vary between CPU
models; its tighter F64_TOLERANCE for the float64 layer cases), everything else identically.

File format (text, whitespace separated, '#' starts a comment line):

    case <name>
    layer embed_dim <E> num_heads <H> kdim <K> vdim <V> bias <0|1> add_bias_kv <0|1>
          add_zero_attn <0|1> batch_first <0|1> dropout <p> [num_kv_heads <G>]
          [dtype <f16|bf16|f64>] [window <left> <right>] [softcap <c>] [alibi]
          [sinks]                                                             (one line)
    call need_weights <0|1> per_head_weights <0|1> is_causal <0|1> training 0
         kpm <kind> attn <kind> attn_per_batch <0|1>                        (one line)
    tensor <name> <f32|u8|f64> <ndim> <d0> ... <dn-1>
    <values, C order>
    ...
    end

Tensors: the parameters by state_dict name, query (key, value when the case has them separately),
the masks (u8 or f32), then the float64 results output and weights (with need_weights), then the
backward pass: grad_output (f32, the output's shape) and grad_weights (f32, with need_weights),
drawn after everything else so that adding them changed no other value, and the float64
gradients of loss = sum(grad_output * output) + sum(grad_weights * weights):
grad.query (the whole tensor's in self-attention), grad.key, grad.value (when given
separately), grad.<state_dict name> of every parameter, grad.attn_mask / grad.key_padding_mask
of float masks (in the file's mask shape).

num_kv_heads is written only by grouped-query attention (GQA) cases, whose G key/value heads
(G < H, G divides H) are each shared by H/G query heads: query head h reads key/value head
h // (H/G) (scaled_dot_product_attention(enable_gqa=True), i.e. K/V heads repeat_interleave'd
by H/G). Their parameters are q_proj_weight (E, E), k_proj_weight (G*D, kdim), v_proj_weight
(G*D, vdim), in_proj_bias (E + 2*G*D,) (q, k, v), bias_k / bias_v (1, 1, G*D), out_proj.*
(D = E/H; never a packed in_proj_weight), and their gradients have the same shapes.

dtype is written only by the float16 / bfloat16 and float64 layer cases (absent: a float32
layer); it follows num_kv_heads when both are present (no dtype case is GQA today). A 16-bit
layer's parameters, inputs and outputs are 16-bit (it computes in float32 inside). These cases
are forward only and hold: the parameters, query (key, value) and the float masks as f32 tensors
whose values are the float32 draw (made exactly as for the other cases, fixed seeds) rounded to
the dtype (round to nearest even; exactly representable in it, -inf stays -inf); the float64
output (and weights with need_weights) of nn.MultiheadAttention (float64, eval) on exactly those
rounded values, checked against the independent float64 implementation; no grad_* tensors; and
then PyTorch's own result in the dtype, converted to float32: torch.output (and torch.weights
with need_weights, averaged or per head as the call line says), made as follows:
- bf16: nn.MultiheadAttention run natively in bfloat16 on CPU: the module .to(torch.bfloat16),
  the inputs and the float masks .to(torch.bfloat16) (bool masks as they are; the causal mask is
  merged into attn_mask as for every case; a float key_padding_mask together with an attn_mask
  would be passed pre-combined, in bfloat16).
- f16: PyTorch 1.13 on CPU cannot run float16 matmuls (and CPU autocast knows only bfloat16), so
  CUDA autocast's float16 policy is emulated (emulated_mha: F.multi_head_attention_forward of
  1.13 step by step, in float32 tensors, with r(x) = x.to(float16).to(float32) where a float16
  kernel returns float16): Q, K, V = r(linear(x, W, b)) (float16 operands, float32 accumulation
  and bias: a float16 GEMM's result); bias_k/bias_v and the zero key appended as they are;
  q_scaled = r(Q / sqrt(D)) (1.13 scales q before the product, in q's dtype); scores =
  r(bmm(q_scaled, K^T)); the additive mask (float32) added and the softmax taken in float32
  (autocast's float32 softmax); out = r(linear(r(bmm(r(P), V)), out_proj)) with P the float32
  probabilities; weights = r(P) per head, or r(mean over heads of P) (averaged in float32,
  rounded once: a float16 layer returns float16 weights). Differences from a literal CUDA
  autocast run: 1.13's baddbmm would round (scores + mask) to float16 once, here the float32
  mask is added to the rounded scores without rounding again; and under autocast 1.13 would
  return float32 weights. Every case asserts that emulated_mha run in float64 without rounding
  equals nn.MultiheadAttention's float64 result to 1e-12 (so its structure is PyTorch's), and
  that its float16 results are float16 values. The dtype cases have head dims 4 and 16, so
  1/sqrt(D) is a power of two and the scaling is exact but for float16 underflow.
No dtype case has a fully masked row (the masks are redrawn as for every case; a row masked
after the masks' rounding would fail the generator). --check recomputes a dtype case on the
committed values after checking that each is the draw rounded to the dtype (equal, or, as the
float32 draw may differ in its last bits between CPU models, representable in the dtype and
within one step of it: eps * max|draw|), compares the float64 results with golden_compare's
tolerance, and keeps the committed torch.output / torch.weights when the recomputed ones are
within TORCH_BASELINE_STEPS (4) steps of the dtype (eps * max|value|) of them.

The float64 layer cases (dtype f64, F64_CASES) are forward only too; everything in them is
float64, so that a float64 layer is checked to its contract of 1e-12 on values that float32
cannot hold (the generator asserts that no finite input value is float32-representable). They
hold as f64 tensors the parameters of nn.MultiheadAttention made with dtype=torch.float64
(PyTorch's initialisation drawn in float64, then in_proj_bias, bias_k, bias_v and out_proj.bias
replaced by torch.randn(dtype=torch.float64) * 0.1), query (key, value) drawn by
torch.randn(dtype=torch.float64) and the float masks (NumPy's float64 normal draws, -inf where
forbidden); boolean masks as u8. output (and weights) are that module's float64 results (eval;
masks combined as for every case, checked against the pre-combined additive mask and the
independent implementation to 1e-12); no grad_* tensors and no torch.* baseline (the float64
result is PyTorch's own). --check takes the committed float64 inputs when each is the case's
draw within golden_compare.F64_DRAW_TOLERANCE (PyTorch's float64 draws too differ in their last
bits between CPU models) and compares the recomputed results within its F64_TOLERANCE.

window is written only by the sliding-window cases (clmha_layer_desc::window; absent: none),
last on the layer line: query i attends key j only when i - left <= j <= i + right, -1 leaving
a side unbounded; the keys of bias_k/bias_v and of add_zero_attn are never windowed.

softcap <c> and alibi are written only by the score-variant cases (clmha_layer_desc::softcap
and ::alibi; absent: off), after window: every scaled score s (the appended keys' too) becomes
c·tanh(s/c); then the real keys j < S get ALiBi's -slope_h·|i - j| (query i at position i); then
the masks. An ALiBi case with its own slopes writes them as the f32 tensor alibi_slopes (H)
after the other parameters; without it the layer's geometric slopes apply
(clmha_alibi_slopes(), geometric_slopes() here). alibi_slopes has no gradient (no grad.*).

sinks is written only by the attention-sink cases (clmha_layer_desc::sinks), last on the layer
line: the layer parameter sinks (H), the f32 tensor sinks after the other parameters (before
alibi_slopes), drawn by sinks_of() from a generator of the case's own, is one more logit per
head in every row's softmax with a zero value; its gradient is grad.sinks (f64, (H)), after
grad.out_proj.bias.

Mask kinds: none, bool_ignore (1 = may not attend, nn.MultiheadAttention's bool masks),
bool_attend (1 = may attend, SDPA / continuiti polarity), float (added to the scaled scores).

How the golden values are obtained from PyTorch 1.13 (which lacks some of clmha's features):
- bool_attend masks are passed to PyTorch inverted.
- attn_per_batch: the file's (N, L, S) mask is expanded with repeat_interleave(H, dim=0) to
  (N*H, L, S) (continuiti's mask.unsqueeze(1).repeat(1, H, 1, 1)).
- is_causal: the boolean mask triu(ones(L, S), 1) (True = masked) is combined with the case's
  own attn_mask (logical or / masked_fill -inf); the file holds only the case's own attn_mask.
- Masks combine as PyTorch 2.x does: each converted to an additive float mask (-inf where a
  bool mask forbids) and summed. PyTorch 1.13 cannot combine a float key_padding_mask with an
  attn_mask, so for such cases the generator builds the summed additive (N*H, L, S) float64
  mask itself and passes only that (PyTorch then pads it for bias_k / the zero key). Wherever
  PyTorch's own combination works, the generator also runs the pre-combined path and asserts
  both agree, and it checks every case against an independent float64 implementation.
- window: the boolean (L, S) mask of the keys outside the window (True = masked) is combined
  with attn_mask exactly as the causal mask is (after it); the file holds only the case's own
  attn_mask and the window line. PyTorch pads attn_mask with zeros for bias_k and the zero key:
  they are not windowed, as in clmha.
- ALiBi: the bias -slope_h·|i - j| (N*H, L, S) is folded into attn_mask as a float mask (a
  bool attn_mask becomes -inf there), which PyTorch pads with zeros for bias_k and the zero
  key: they get no ALiBi term, as in clmha. It is part of the pre-combined additive mask too.
- softcap: PyTorch has no soft-capping, and it sits between the product and the mask, so no
  mask can express it. Those cases take their golden from softcap_mha: PyTorch 1.13's
  F.multi_head_attention_forward written out step by step in float64 torch ops (emulated_mha,
  as the float16 baseline uses it, without rounding) with c·tanh(s/c) applied to the scaled
  scores, on the pre-combined additive mask (ALiBi included); every such case asserts that it
  equals nn.MultiheadAttention to 1e-12 with the soft-capping taken out, and that it and its
  autograd gradients equal the independent implementation's (which applies its own tanh and
  computes its own ALiBi bias) to 1e-12. No softcap case is GQA.
- sinks: PyTorch has no attention sinks either. Those cases take their golden from softcap_mha
  too (soft-capping 0 where the case has none), whose softmax runs over [scores + mask, sink]
  with the sink's column dropped (a sink column of value sinks_h per head: its value is zero),
  checked equal to nn.MultiheadAttention without the sinks (and the soft-capping); the
  independent implementation adds exp(sinks_h - m) to each row's denominator itself, and both
  must agree to 1e-12, gradients (grad.sinks included, autograd's) too. No sinks case is GQA.
- Fully masked rows: PyTorch gives NaN; clmha defines zero attention weights and a zero
  attention result there (output row = out_proj.bias). Such NaN entries are replaced following
  that rule (a comment line in the file says so).
- Gradients: PyTorch autograd in float64 (module .double(), inputs and float masks as leaves;
  the float masks' expansion and combination are torch ops on the file's tensors, so their
  gradients are w.r.t. those). The independent implementation is differentiable too, with zero
  gradients on fully masked rows; every case without such a row asserts that its gradients
  equal autograd's to 1e-12 (each mask path PyTorch can take), and the cases with one take their
  gradients from it (PyTorch's are NaN there).
- GQA cases (PyTorch 1.13 has no GQA): the parameters are drawn as nn.MultiheadAttention
  draws them (xavier_uniform_ on the G*D-row k/v_proj_weight), then the float64 golden is
  torch.nn.functional.multi_head_attention_forward (use_separate_proj_weight) on full (E, .)
  K/V projections built inside autograd from the GQA leaves: each key/value head's rows of
  k/v_proj_weight, of the k/v parts of in_proj_bias and of bias_k/bias_v repeat_interleave'd
  H/G times. So the gradients are autograd's w.r.t. the GQA leaves. The independent float64
  implementation groups the query heads instead (einsum over (N, G, H/G, L, D) against the G
  projected key/value heads, nothing expanded); both must agree to 1e-12 as for every case.
"""

import argparse
import copy
import math
import os
import sys
import zlib

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import golden_compare  # noqa: E402

torch.set_grad_enabled(True)  # keeps nn.MultiheadAttention off its native fast path

KINDS = ("none", "bool_ignore", "bool_attend", "float")

# The 16-bit layer dtypes of the dtype cases: the file's token and the torch dtype.
LAYER_DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16}

# ------------------------------------------------------------------------------------------
# Cases
# ------------------------------------------------------------------------------------------


def C(name, **kw):
    d = dict(
        name=name, E=8, H=2, kdim=None, vdim=None, bias=True, add_bias_kv=False,
        add_zero_attn=False, batch_first=False, dropout=0.0, L=5, S=None, N=2,
        mode="self",  # self | cross | kv_same (key and value are one tensor, query differs)
        need_weights=True, per_head=False, causal=False,
        kpm="none", attn="none", attn_shape="2d",  # 2d | 3d | per_batch
        special=None,  # full_kpm | full_attn_row | partial_head | full_float_row | full_kpm_appended
        kv_heads=None,  # grouped-query attention: key/value heads (None: H)
        dtype="f32",  # f32 | f16 | bf16 | f64: the layer's dtype (DTYPE_CASES, F64_CASES)
        window=None,  # a sliding window (left, right), -1: that side unbounded
        softcap=0.0,  # logit soft-capping c (0: off)
        alibi=None,  # ALiBi: None (off), "geometric" (the layer's default slopes) or "custom"
        sinks=False,  # attention sinks: the parameter sinks (H), sinks_of()
    )
    for k in kw:
        if k not in d:
            raise KeyError(k)
    d.update(kw)
    if d["S"] is None:
        d["S"] = d["L"]
    if d["mode"] == "self":
        assert d["S"] == d["L"]
    assert d["E"] % d["H"] == 0
    if d["kv_heads"] is not None:
        assert 1 <= d["kv_heads"] <= d["H"] and d["H"] % d["kv_heads"] == 0
    assert d["dtype"] in ("f32", "f64") + tuple(LAYER_DTYPES)
    assert d["alibi"] in (None, "geometric", "custom") and d["softcap"] >= 0.0
    assert not (d["softcap"] and d["kv_heads"] is not None), "softcap_mha has no GQA"
    assert not (d["sinks"] and d["kv_heads"] is not None), "softcap_mha has no GQA"
    return d


def kv_heads(c):
    """The case's key/value heads G (H without GQA)."""
    return c["H"] if c["kv_heads"] is None else c["kv_heads"]


def is_gqa(c):
    return kv_heads(c) < c["H"]


CASES = [
    # basics
    C("self_basic"),
    C("self_per_head", per_head=True),
    C("self_no_weights", need_weights=False),
    C("self_batch_first", batch_first=True, N=3, L=4),
    C("cross_batch_first", batch_first=True, mode="cross", L=3, S=5, kpm="bool_ignore"),
    C("unbatched_weights", N=None, L=4),
    C("unbatched_per_head", N=None, L=4, per_head=True),
    C("unbatched_no_weights", N=None, L=4, need_weights=False),
    C("cross_L3_S7", mode="cross", L=3, S=7),
    C("cross_L7_S2", mode="cross", L=7, S=2, per_head=True),
    C("kdim_vdim", E=12, H=3, kdim=5, vdim=7, mode="cross", L=4, S=6),
    C("key_is_value", mode="kv_same", L=4, S=6),
    C("kdim_eq_vdim_key_is_value", E=12, H=2, kdim=6, vdim=6, mode="kv_same", L=3, S=5),
    C("no_bias", bias=False, mode="cross", L=4, S=5),
    C("add_bias_kv", add_bias_kv=True),
    C("add_zero_attn", add_zero_attn=True, per_head=True),
    C("bias_kv_and_zero_attn", add_bias_kv=True, add_zero_attn=True, mode="cross", L=3, S=4),
    # masks
    C("kpm_bool", kpm="bool_ignore", mode="cross", L=4, S=6),
    C("kpm_float", kpm="float", mode="cross", L=4, S=6),
    C("kpm_attend", kpm="bool_attend", mode="cross", L=4, S=6, N=3),
    C("attn2d_bool", attn="bool_ignore"),
    C("attn2d_float", attn="float", mode="cross", L=4, S=6),
    C("attn3d_bool", attn="bool_ignore", attn_shape="3d", per_head=True),
    C("attn3d_float", attn="float", attn_shape="3d", mode="cross", L=4, S=6),
    C("attn2d_attend", attn="bool_attend", mode="cross", L=5, S=7),
    C("attn3d_attend", attn="bool_attend", attn_shape="3d", H=4, per_head=True),
    C("per_batch_attend", attn="bool_attend", attn_shape="per_batch", N=3, L=4, S=6,
      mode="cross", per_head=True),
    C("per_batch_float", attn="float", attn_shape="per_batch", batch_first=True, L=4),
    C("kpm_bool_attn_float", kpm="bool_ignore", attn="float", attn_shape="3d",
      mode="cross", L=4, S=6),
    C("kpm_float_attn_float", kpm="float", attn="float", mode="cross", L=4, S=6),
    C("kpm_float_attn_bool", kpm="float", attn="bool_ignore", attn_shape="3d", per_head=True),
    C("kpm_float_attn_attend_per_batch", kpm="float", attn="bool_attend",
      attn_shape="per_batch", mode="cross", L=3, S=5),
    # causal
    C("causal_square", causal=True, L=6),
    C("causal_L3_S7", causal=True, mode="cross", L=3, S=7, per_head=True),
    C("causal_L7_S3", causal=True, mode="cross", L=7, S=3),
    C("causal_attn_kpm", causal=True, attn="bool_ignore", kpm="bool_ignore", L=6),
    C("causal_float_all", causal=True, attn="float", attn_shape="3d", kpm="float",
      mode="cross", L=5, S=6, batch_first=True),
    # masks with appended keys (bias_k/bias_v, zero attention)
    C("bias_kv_masks", add_bias_kv=True, kpm="bool_ignore", attn="float", attn_shape="3d",
      mode="cross", L=4, S=5, per_head=True),
    C("zero_attn_masks", add_zero_attn=True, kpm="float", attn="bool_attend",
      mode="cross", L=4, S=5),
    C("appended_masks_causal", add_bias_kv=True, add_zero_attn=True, kpm="bool_attend",
      attn="float", attn_shape="per_batch", causal=True, L=5),
    C("bias_kv_per_batch_bool_kpm_float", add_bias_kv=True, attn="bool_ignore",
      attn_shape="per_batch", kpm="float", mode="cross", L=3, S=6, per_head=True),
    C("zero_attn_attn_float_kpm_bool", add_zero_attn=True, attn="float", kpm="bool_ignore",
      causal=True, mode="cross", L=6, S=4),
    # kdim/vdim and unbatched with masks
    C("kdim_vdim_masks", E=12, H=3, kdim=5, vdim=7, mode="cross", L=4, S=6,
      kpm="bool_ignore", attn="float", attn_shape="3d", per_head=True),
    C("unbatched_masks", N=None, mode="cross", L=4, S=6, kpm="bool_ignore", attn="float",
      attn_shape="3d", per_head=True),
    C("unbatched_masks_float_kpm_causal", N=None, L=5, kpm="float", attn="bool_attend",
      causal=True, add_zero_attn=True),
    # float masks (with their gradients) with the other options
    C("kdim_vdim_float_masks", E=12, H=3, kdim=5, vdim=7, mode="cross", L=3, S=4, kpm="float",
      attn="float", per_head=True),
    C("appended_float_masks_batch_first", add_bias_kv=True, add_zero_attn=True, kpm="float",
      attn="float", attn_shape="per_batch", batch_first=True, mode="cross", L=3, S=4,
      per_head=True),
    C("unbatched_float_masks_kv_same", N=None, mode="kv_same", L=3, S=5, kpm="float",
      attn="float"),
    C("causal_L2_S5_float_kpm", causal=True, mode="cross", L=2, S=5, kpm="float",
      per_head=True),
    C("no_bias_self_float_attn3d", bias=False, attn="float", attn_shape="3d", L=4),
    # sizes
    C("head_dim_1", E=4, H=4, L=4, per_head=True),
    C("e60_h5", E=60, H=5, kdim=4, vdim=6, mode="cross", L=3, S=4, N=2, kpm="bool_ignore"),
    C("tgt_len_1", mode="cross", L=1, S=5, N=3),
    C("src_len_1", mode="cross", L=4, S=1, per_head=True),
    C("large_33", E=16, H=2, L=33, N=1, kpm="bool_ignore", causal=True),
    C("large_cross_5_33", E=16, H=2, mode="cross", L=5, S=33, N=1, attn="float"),
    # fully masked rows
    C("full_kpm", kpm="bool_ignore", mode="cross", L=4, S=5, special="full_kpm"),
    C("full_attn_row", attn="bool_ignore", per_head=True, special="full_attn_row"),
    C("full_float_row", attn="float", kpm="float", mode="cross", L=4, S=5,
      special="full_float_row"),
    C("full_partial_head", attn="bool_ignore", attn_shape="3d", special="partial_head"),
    C("full_kpm_zero_attn", kpm="bool_ignore", add_zero_attn=True, mode="cross", L=4, S=5,
      per_head=True, special="full_kpm_appended"),
    # dropout is inactive in eval
    C("dropout_eval", dropout=0.5, L=4, attn="bool_ignore"),
    # causal self-attention as incremental decoding reproduces it through a KV cache
    # (tests/device/test_kv_cache.c), with the appended keys visible to every query
    C("decode_causal_bias_kv", E=16, H=4, L=7, causal=True, add_bias_kv=True,
      need_weights=False),
    C("decode_causal_zero_attn_batch_first", E=16, H=4, L=6, N=3, causal=True,
      add_zero_attn=True, batch_first=True, need_weights=False),
    C("decode_causal_appended_unbatched", N=None, L=5, causal=True, add_bias_kv=True,
      add_zero_attn=True, need_weights=False),
    C("decode_causal_long", E=16, H=2, L=40, N=1, causal=True, need_weights=False),
    # grouped-query attention: G key/value heads, each shared by H/G query heads
    C("gqa_self_causal", E=16, H=4, kv_heads=2, causal=True, L=7, N=2, need_weights=False),
    C("gqa_mqa_cross", E=16, H=4, kv_heads=1, mode="cross", L=4, S=6, per_head=True),
    C("gqa_kdim_vdim_masks", E=24, H=6, kv_heads=3, kdim=5, vdim=7, mode="cross", L=4, S=6,
      kpm="bool_ignore", attn="float", attn_shape="3d"),
    C("gqa_bias_kv_zero_attn", E=16, H=4, kv_heads=2, add_bias_kv=True, add_zero_attn=True,
      causal=True, L=6, need_weights=False),
    C("gqa_batch_first", E=16, H=4, kv_heads=2, batch_first=True, N=3, L=5, mode="cross", S=4),
    C("gqa_unbatched", E=16, H=4, kv_heads=2, N=None, L=5, causal=True, need_weights=False),
    C("gqa_decode_long", E=32, H=8, kv_heads=2, L=24, N=1, causal=True, need_weights=False),
    # sliding windows (the appended keys of add_bias_kv / add_zero_attn are not windowed). The
    # C tests run these through impl auto and unfused only, and no KV cache, until the fused
    # and decode cores take windows (tests/device/test_golden.c, test_backward.c,
    # test_kv_cache.c).
    C("window_self_causal_3_0", causal=True, window=(3, 0), L=7, per_head=True),
    C("window_cross_2_2_kpm", mode="cross", L=5, S=7, kpm="bool_ignore", window=(2, 2),
      add_zero_attn=True),
    C("window_left_unbounded_float_attn_bias_kv", mode="cross", L=6, S=5, attn="float",
      window=(-1, 1), add_bias_kv=True, batch_first=True),
    # score variants: soft-capping (c·tanh(s/c), the appended keys' scores too) and ALiBi
    # (-slope_h·|i - j| for the real keys); the causal self-attention ones are fed through a
    # KV cache too (tests/device/test_kv_cache.c)
    C("softcap_self_causal", softcap=1.5, causal=True, L=7, per_head=True),
    C("alibi_geometric_cross_kpm", E=16, H=4, alibi="geometric", mode="cross", L=5, S=7,
      kpm="bool_ignore", add_zero_attn=True, per_head=True),
    C("softcap_alibi_custom_float_attn_bias_kv", E=12, H=3, softcap=1.0, alibi="custom",
      mode="cross", L=6, S=5, attn="float", add_bias_kv=True, batch_first=True),
    C("alibi_window_gqa", E=16, H=4, kv_heads=2, alibi="custom", window=(3, 0), causal=True,
      L=7, need_weights=False),
    # attention sinks (one zero-valued logit per head in every row's softmax, the parameter
    # sinks with its gradient); the causal self-attention one is fed through a KV cache too
    C("sinks_self_causal_weights", E=16, H=4, sinks=True, causal=True, L=6, per_head=True),
    C("sinks_softcap_alibi_cross_float_attn", E=12, H=3, sinks=True, softcap=1.5,
      alibi="custom", mode="cross", L=5, S=6, attn="float", batch_first=True),
    C("sinks_bias_kv_zero_attn_kpm", sinks=True, mode="cross", L=4, S=6, kpm="bool_ignore",
      add_bias_kv=True, add_zero_attn=True, per_head=True),
]

# float16 / bfloat16 layers (forward only): every case once per 16-bit dtype, written as
# dtype_<dtype>_<name>.txt and listed in dtype_cases.inc (not in cases.inc). Head dims are
# 4 or 16, so that the scaling by 1/sqrt(D) is exact in every dtype. No case has a fully
# masked row (draw_masks is redrawn as for every case).
DTYPE_BASE_CASES = [
    C("self_weights", E=8, H=2, L=5),
    C("cross_kdim_vdim", E=8, H=2, kdim=6, vdim=5, bias=False, mode="cross", L=4, S=6,
      need_weights=False),
    C("masks_per_head", E=12, H=3, mode="cross", L=4, S=6, attn="float", kpm="bool_ignore",
      per_head=True),
    C("bias_kv_zero_attn", E=16, H=4, add_bias_kv=True, add_zero_attn=True, batch_first=True,
      mode="cross", L=5, S=4, kpm="float"),
    C("causal_attn3d", E=16, H=4, L=6, causal=True, attn="float", attn_shape="3d",
      need_weights=False),
    C("unbatched", E=8, H=2, N=None, mode="cross", L=4, S=6),
    C("large", E=64, H=4, mode="cross", L=33, S=47, N=2, need_weights=False),
]
DTYPE_CASES = [dict(c, name=f"dtype_{dt}_{c['name']}", dtype=dt)
               for dt in LAYER_DTYPES for c in DTYPE_BASE_CASES]

# float64 layers (forward only), written as f64_<name>.txt and listed in f64_cases.inc: float64
# parameters, inputs and float masks that float32 cannot hold, so that a layer computing in
# float32 anywhere misses the 1e-12 of the contract. No case has a fully masked row.
# tests/device/test_f64.c runs every case through the fused core too (without weights): fused_tiles
# crosses its tile edges, head_dim_32 has the largest head dim.
F64_BASE_CASES = [
    C("self_bias", E=8, H=2, L=5),
    C("cross_kdim_vdim", E=12, H=3, kdim=5, vdim=7, bias=False, mode="cross", L=4, S=6),
    C("kpm_bool_per_head", mode="cross", L=4, S=6, N=3, kpm="bool_ignore", per_head=True),
    C("attn2d_float", mode="cross", L=4, S=6, attn="float"),
    C("attn3d_float_kpm_float", E=12, H=3, mode="cross", L=4, S=5, attn="float",
      attn_shape="3d", kpm="float", per_head=True),
    C("bias_kv_zero_attn", E=16, H=4, add_bias_kv=True, add_zero_attn=True, mode="cross", L=3,
      S=4, kpm="bool_ignore", per_head=True),
    C("batch_first_per_batch", batch_first=True, N=3, mode="cross", L=4, S=5,
      attn="bool_attend", attn_shape="per_batch"),
    C("unbatched", N=None, mode="cross", L=4, S=6, attn="float", attn_shape="3d"),
    C("causal_attn_float", causal=True, L=6, attn="float", per_head=True),
    C("fused_tiles", E=32, H=4, mode="cross", L=37, S=45, N=2, kpm="bool_ignore",
      causal=True, need_weights=False),
    C("head_dim_32", E=64, H=2, mode="cross", L=17, S=33, N=2, batch_first=True,
      attn="float", need_weights=False),
]
F64_CASES = [dict(c, name=f"f64_{c['name']}", dtype="f64") for c in F64_BASE_CASES]


# ------------------------------------------------------------------------------------------
# Generation
# ------------------------------------------------------------------------------------------

def seed_of(name):
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


def f32(a):
    return np.asarray(a, dtype=np.float32)


def make_module(c, gen, given=None, dtype=torch.float32):
    """The case's nn.MultiheadAttention (eval) made in dtype (float32, or float64 for the
    float64 layer cases: PyTorch's initialisation then draws float64 values) with the global
    RNG seeded by the name, in_proj_bias, bias_k, bias_v and out_proj.bias overwritten by gen's
    normal draws times 0.1. Returns (module, params in state_dict order as arrays of dtype,
    kdim, vdim)."""
    E, H = c["E"], c["H"]
    kdim = c["kdim"] if c["kdim"] is not None else E
    vdim = c["vdim"] if c["vdim"] is not None else E
    torch.manual_seed(seed_of(c["name"]))
    m = torch.nn.MultiheadAttention(E, H, dropout=c["dropout"], bias=c["bias"],
                                    add_bias_kv=c["add_bias_kv"],
                                    add_zero_attn=c["add_zero_attn"], kdim=kdim, vdim=vdim,
                                    batch_first=c["batch_first"], dtype=dtype)
    with torch.no_grad():
        for name in ("in_proj_bias", "bias_k", "bias_v"):
            p = getattr(m, name)
            if p is not None:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=dtype) * 0.1)
        if m.out_proj.bias is not None:
            m.out_proj.bias.copy_(torch.randn(m.out_proj.bias.shape, generator=gen,
                                              dtype=dtype) * 0.1)
    m.eval()
    if given is not None:  # --check: the committed parameters, if they are this draw
        take = given.take if dtype == torch.float32 else given.take_f64
        m.load_state_dict({k: torch.from_numpy(take(k, v.detach().numpy()))
                           for k, v in m.state_dict().items()}, strict=True)
    params = [(k, v.detach().numpy().copy()) for k, v in m.state_dict().items()]
    return m, params, kdim, vdim


def make_gqa_params(c, gen, given=None):
    """make_module for a GQA case (no nn.MultiheadAttention has G < H key/value heads): the
    parameters drawn as make_module draws them (global RNG seeded by the name: out_proj's
    Linear initialisation, then xavier_uniform_ of q/k/v_proj_weight as _reset_parameters does;
    gen: in_proj_bias, bias_k, bias_v, out_proj.bias times 0.1), k/v with G*D rows. Returns
    (None, params in state_dict order, kdim, vdim)."""
    E, H, G = c["E"], c["H"], kv_heads(c)
    GD = G * (E // H)
    kdim = c["kdim"] if c["kdim"] is not None else E
    vdim = c["vdim"] if c["vdim"] is not None else E
    torch.manual_seed(seed_of(c["name"]))
    with torch.no_grad():
        out_proj = torch.nn.Linear(E, E, bias=c["bias"])
        P = {"q_proj_weight": torch.empty(E, E), "k_proj_weight": torch.empty(GD, kdim),
             "v_proj_weight": torch.empty(GD, vdim)}
        for w in P.values():
            torch.nn.init.xavier_uniform_(w)
        if c["bias"]:
            P["in_proj_bias"] = torch.randn(E + 2 * GD, generator=gen) * 0.1
        if c["add_bias_kv"]:
            P["bias_k"] = torch.randn((1, 1, GD), generator=gen) * 0.1
            P["bias_v"] = torch.randn((1, 1, GD), generator=gen) * 0.1
        P["out_proj.weight"] = out_proj.weight.detach().clone()
        if c["bias"]:
            P["out_proj.bias"] = torch.randn(E, generator=gen) * 0.1
    params = []
    for k, v in P.items():
        a = v.detach().float().numpy().copy()
        if given is not None:  # --check: the committed parameters, if they are this draw
            a = given.take(k, a)
        params.append((k, a))
    return None, params, kdim, vdim


def gqa_expand(c, P):
    """The full multi-head attention parameters of a GQA case's (float64, possibly leaf)
    parameters P: each key/value head's rows of k/v_proj_weight, of the k/v parts of
    in_proj_bias and of bias_k/bias_v repeat_interleave'd H/G times (query head h reads
    key/value head h // (H/G)). Differentiable (torch ops only)."""
    E, H, G = c["E"], c["H"], kv_heads(c)
    D = E // H
    GD = G * D

    def rep(t):  # (G*D, ...) -> (E, ...)
        rest = tuple(t.shape[1:])
        return t.reshape((G, D) + rest).repeat_interleave(H // G, dim=0).reshape((E,) + rest)

    X = {"q_proj_weight": P["q_proj_weight"], "k_proj_weight": rep(P["k_proj_weight"]),
         "v_proj_weight": rep(P["v_proj_weight"]), "in_proj_bias": None, "bias_k": None,
         "bias_v": None, "out_proj.weight": P["out_proj.weight"],
         "out_proj.bias": P.get("out_proj.bias")}
    if "in_proj_bias" in P:
        bq, bk, bv = P["in_proj_bias"].split([E, GD, GD])
        X["in_proj_bias"] = torch.cat([bq, rep(bk), rep(bv)])
    if "bias_k" in P:
        X["bias_k"] = rep(P["bias_k"].reshape(GD)).reshape(1, 1, E)
        X["bias_v"] = rep(P["bias_v"].reshape(GD)).reshape(1, 1, E)
    return X


def gqa_forward(c, P, q, k, v, key_padding_mask=None, attn_mask=None, need_weights=True,
                average_attn_weights=True):
    """nn.MultiheadAttention.forward (eval) of a GQA case in PyTorch: F.multi_head_attention_
    forward with separate projection weights, the K/V ones expanded by gqa_expand."""
    X = gqa_expand(c, P)
    bf = c["batch_first"] and c["N"] is not None
    if bf:
        q, k, v = (x.transpose(1, 0) for x in (q, k, v))
    out, w = torch.nn.functional.multi_head_attention_forward(
        q, k, v, c["E"], c["H"], None, X["in_proj_bias"], X["bias_k"], X["bias_v"],
        c["add_zero_attn"], 0.0, X["out_proj.weight"], X["out_proj.bias"], training=False,
        key_padding_mask=key_padding_mask, need_weights=need_weights, attn_mask=attn_mask,
        use_separate_proj_weight=True, q_proj_weight=X["q_proj_weight"],
        k_proj_weight=X["k_proj_weight"], v_proj_weight=X["v_proj_weight"],
        average_attn_weights=average_attn_weights)
    return (out.transpose(1, 0) if bf else out), w


class SoftcapModule:
    """Stands for the float64 nn.MultiheadAttention of a softcap case in run_torch and
    torch_grads: softcap_mha on the parameters P (float64, possibly leaves). It takes the
    pre-combined additive mask only (key_padding_mask None, attn_mask (NH, L, S) float)."""

    def __init__(self, c, P):
        self.c, self.P = c, P

    def __call__(self, q, k, v, key_padding_mask=None, attn_mask=None, need_weights=True,
                 average_attn_weights=True):
        assert key_padding_mask is None
        assert attn_mask is None or (attn_mask.dtype == torch.float64 and attn_mask.dim() == 3)
        c = dict(self.c, need_weights=need_weights, per_head=not average_attn_weights)
        return softcap_mha(c, self.P, q, k, v, attn_mask)


def softcap_mha(c, P, q, k, v, tot):
    """F.multi_head_attention_forward of PyTorch 1.13 (eval, no GQA) in float64 with the case's
    soft-capping on the scaled scores: emulated_mha without rounding (tot: the additive mask
    (NH, L, S), ALiBi included; None: none). Returns (output, weights or None) as the case's
    need_weights / per_head say."""
    if tot is None:
        Nb = 1 if c["N"] is None else c["N"]
        tot = torch.zeros(Nb * c["H"], c["L"], c["S"], dtype=torch.float64)
    return emulated_mha(c, P, q, k, v, tot, lambda t: t)


class GQAModule:
    """Stands for the float64 nn.MultiheadAttention of a GQA case in run_torch."""

    def __init__(self, c, P):
        self.c, self.P = c, P

    def __call__(self, q, k, v, **kw):
        return gqa_forward(self.c, self.P, q, k, v, **kw)


def input_shape(c, seq, feat):
    N = c["N"]
    if N is None:
        return (seq, feat)
    return (N, seq, feat) if c["batch_first"] else (seq, N, feat)


def draw_masks(c, rng, conv=f32):
    """Returns (kpm_masked, attn_masked) in 'masked' terms before polarity: for bool kinds a
    bool array (True = may not attend), for float an array made by conv from NumPy's float64
    draw (f32: float32; the float64 layer cases keep float64); None for none."""
    N, H, L, S = c["N"], c["H"], c["L"], c["S"]
    batched = N is not None
    kpm = attn = None
    if c["kpm"] != "none":
        shape = (N, S) if batched else (S,)
        if c["kpm"] == "float":
            kpm = conv(rng.standard_normal(shape))
            kpm[rng.random(shape) < 0.15] = -np.inf
        else:
            kpm = rng.random(shape) < 0.25
    if c["attn"] != "none":
        if c["attn_shape"] == "2d":
            shape = (L, S)
        elif c["attn_shape"] == "3d":
            shape = (N * H, L, S) if batched else (H, L, S)
        else:
            assert batched
            shape = (N, L, S)
        if c["attn"] == "float":
            attn = conv(rng.standard_normal(shape))
            attn[rng.random(shape) < 0.15] = -np.inf
        else:
            attn = rng.random(shape) < 0.25
    return kpm, attn


def as_tensor(m):
    """A mask as a tensor: tensors as they are (a float64 leaf keeps its gradient), arrays
    converted."""
    return m if torch.is_tensor(m) else torch.from_numpy(np.asarray(m))


def additive(c, kpm, attn, alibi=True):
    """The summed additive float64 mask (NH, L, S) (NH = N*H, or H unbatched) from the masks in
    'masked' terms (arrays or tensors), with the causal mask included, and (with alibi) the
    case's ALiBi bias. This is clmha's (PyTorch 2.x's) semantics. Differentiable in float masks
    given as float64 tensors."""
    N, H, L, S = c["N"], c["H"], c["L"], c["S"]
    Nb = 1 if N is None else N
    tot = torch.zeros(Nb * H, L, S, dtype=torch.float64)
    if attn is not None:
        a = as_tensor(attn)
        if c["attn_shape"] == "per_batch":
            a = a.repeat_interleave(H, dim=0)
        if a.dtype == torch.bool:
            a = torch.zeros(a.shape, dtype=torch.float64).masked_fill(a, -math.inf)
        tot = tot + a.double()
    if kpm is not None:
        k = as_tensor(kpm).reshape(Nb, S)
        if k.dtype == torch.bool:
            k = torch.zeros(k.shape, dtype=torch.float64).masked_fill(k, -math.inf)
        k = k.double().reshape(Nb, 1, 1, S).expand(Nb, H, 1, S).reshape(Nb * H, 1, S)
        tot = tot + k
    if c["causal"]:
        tot = tot.masked_fill(torch.triu(torch.ones(L, S, dtype=torch.bool), 1), -math.inf)
    if c["window"] is not None:
        tot = tot.masked_fill(window_outside(L, S, c["window"]), -math.inf)
    if alibi and c["alibi"] is not None:
        tot = tot + alibi_additive(c)
    return tot


def geometric_slopes(H):
    """The ALiBi paper's slopes for H heads as float32 (clmha_alibi_slopes(), src/layer/alibi.c):
    2^(-8(h+1)/H) for H a power of two, else those of the largest power of two P < H, then
    every other slope of 2P heads."""
    p = 1
    while p * 2 <= H:
        p *= 2
    out = [2.0 ** (-8.0 * (h + 1) / p) if h < p else 2.0 ** (-8.0 * (2 * (h - p) + 1) / (2 * p))
           for h in range(H)]
    return np.array(out, dtype=np.float32)


def custom_slopes(name, H):
    """A case's own ALiBi slopes: float32 uniform in [0.1, 1) from a generator of its own (the
    name's seed, stream 1), so that no other draw of the case changes."""
    rng = np.random.default_rng([seed_of(name), 1])
    return rng.uniform(0.1, 1.0, H).astype(np.float32)


def sinks_of(c):
    """A sinks case's attention sinks, float32 (H), uniform in [-1, 2) from a generator of its
    own (the name's seed, stream 2), so that no other draw of the case changes; None
    without sinks."""
    if not c["sinks"]:
        return None
    rng = np.random.default_rng([seed_of(c["name"]), 2])
    return rng.uniform(-1.0, 2.0, c["H"]).astype(np.float32)


def slopes_of(c):
    """The case's ALiBi slopes as float32 (H) (what the layer holds), None without ALiBi."""
    if c["alibi"] is None:
        return None
    return geometric_slopes(c["H"]) if c["alibi"] == "geometric" else \
        custom_slopes(c["name"], c["H"])


def alibi_additive(c):
    """ALiBi's additive bias (NH, L, S), float64: -slope_h·|i - j| for query i and real key j,
    per batch item and head (NH = N*H, or H unbatched)."""
    L, S = c["L"], c["S"]
    Nb = 1 if c["N"] is None else c["N"]
    dist = (torch.arange(L).reshape(L, 1) - torch.arange(S).reshape(1, S)).abs().double()
    slopes = torch.from_numpy(slopes_of(c)).double().repeat(Nb)
    return -slopes.reshape(Nb * c["H"], 1, 1) * dist


def with_masked(attn, masked):
    """attn_mask @p attn (None, bool with True = masked, or float) with the keys of the bool
    @p masked forbidden too, in @p attn's kind."""
    if attn is None:
        return masked
    if attn.dtype == torch.bool:
        return attn | masked
    return attn.masked_fill(masked, -math.inf)


def window_outside(L, S, window):
    """The bool (L, S) of keys outside the sliding window (left, right) (True = masked): key j
    is inside for query i iff i - left <= j <= i + right, -1 leaving a side unbounded."""
    i = torch.arange(L).reshape(L, 1)
    j = torch.arange(S).reshape(1, S)
    inside = torch.ones(L, S, dtype=torch.bool)
    if window[0] >= 0:
        inside &= j >= i - window[0]
    if window[1] >= 0:
        inside &= j <= i + window[1]
    return ~inside


def has_full_row(c, kpm, attn):
    if c["kpm"] == "none" and c["attn"] == "none" and not c["causal"] and c["window"] is None:
        return False
    tot = additive(c, kpm, attn)
    return bool(torch.isneginf(tot).all(dim=-1).any())


def apply_special(c, kpm, attn):
    sp = c["special"]
    if sp is None:
        return
    if sp in ("full_kpm", "full_kpm_appended"):
        assert kpm is not None and c["N"] is not None
        n = 1 if sp == "full_kpm" else 0
        if kpm.dtype == np.bool_:
            kpm[n, :] = True
        else:
            kpm[n, :] = -np.inf
    elif sp == "full_attn_row":
        assert attn is not None and attn.dtype == np.bool_ and attn.ndim == 2
        attn[2, :] = True
    elif sp == "full_float_row":
        assert attn is not None and attn.dtype != np.bool_ and attn.ndim == 2
        attn[0, :] = -np.inf
    elif sp == "partial_head":
        assert attn is not None and attn.dtype == np.bool_ and attn.ndim == 3
        attn[0, 1, :] = True  # batch 0, head 0, query 1 only
    else:
        raise ValueError(sp)


def to_file_mask(kind, m):
    """Mask in 'masked' terms -> the array stored in the file for that kind (float masks as
    they are: float32, float64 in the float64 layer cases)."""
    if m is None:
        return None
    if kind == "bool_ignore":
        return m.astype(np.uint8)
    if kind == "bool_attend":
        return (~m).astype(np.uint8)
    return m



def split_heads(c, Q, K, V, L, N, H, D):
    """Rows (L or S', N, E) of the projections as (N*H, rows, D) heads, with the zero key and
    value of add_zero_attn appended to K and V."""
    Q = Q.reshape(L, N * H, D).transpose(0, 1)
    K = K.reshape(K.shape[0], N * H, D).transpose(0, 1)
    V = V.reshape(V.shape[0], N * H, D).transpose(0, 1)
    if c["add_zero_attn"]:
        K = torch.cat([K, torch.zeros(N * H, 1, D, dtype=K.dtype)], dim=1)
        V = torch.cat([V, torch.zeros(N * H, 1, D, dtype=V.dtype)], dim=1)
    return Q, K, V

def sequence_first(c, q, k, v):
    """q, k, v of the case's layout as (rows, N, features): unbatched inputs get N 1,
    batch_first ones are transposed."""
    if c["N"] is None:
        return q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
    if c["batch_first"]:
        return q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    return q, k, v


def own_mha(c, P, q, k, v, tot):
    """Independent float64 implementation with clmha's semantics (fully masked rows -> zero
    weights and a zero attention result). q, k, v: float64 in the file's layouts. tot: the
    additive mask (NH, L, S) without ALiBi (additive(..., alibi=False)): the soft-capping
    (tanh of the scaled scores) and the ALiBi bias (its own, from the slopes and positions) are
    applied here. Returns (output, per-head weights (N, H, L, S')). Differentiable (torch ops
    only), with zero gradients on fully masked rows where PyTorch's are NaN."""
    E, H = c["E"], c["H"]
    D = E // H
    batched = c["N"] is not None
    q, k, v = sequence_first(c, q, k, v)
    L, N, _ = q.shape
    S = k.shape[0]
    if "in_proj_weight" in P:
        Wq, Wk, Wv = P["in_proj_weight"].chunk(3)
    else:
        Wq, Wk, Wv = P["q_proj_weight"], P["k_proj_weight"], P["v_proj_weight"]
    G = kv_heads(c)
    GD = G * D  # E without GQA
    if c["alibi"] is not None:  # query head h, row i, key j: -slope_h·|i - j|, per batch item
        slopes = torch.from_numpy(slopes_of(c).astype(np.float64))
        rows = torch.arange(L, dtype=torch.float64).reshape(1, 1, L, 1)
        cols = torch.arange(S, dtype=torch.float64).reshape(1, 1, 1, S)
        bias = -slopes.reshape(1, H, 1, 1) * (rows - cols).abs()
        tot = tot + bias.expand(N, H, L, S).reshape(N * H, L, S)
    cap = c["softcap"]
    soft = (lambda x: cap * torch.tanh(x / cap)) if cap else (lambda x: x)  # noqa: E731
    if "in_proj_bias" in P:
        bq, bk, bv = P["in_proj_bias"].split([E, GD, GD])
    else:
        bq = torch.zeros(E, dtype=torch.float64)
        bk = bv = torch.zeros(GD, dtype=torch.float64)
    Q = q @ Wq.T + bq
    K = k @ Wk.T + bk
    V = v @ Wv.T + bv
    if "bias_k" in P:
        K = torch.cat([K, P["bias_k"].reshape(1, 1, GD).expand(1, N, GD)])
        V = torch.cat([V, P["bias_v"].reshape(1, 1, GD).expand(1, N, GD)])
    if G < H:
        # GQA: the query heads grouped by the key/value head they read, (N, G, H/G, L, D)
        # against (N, G, S', D); nothing is expanded
        R = H // G
        Qg = Q.reshape(L, N, G, R, D).permute(1, 2, 3, 0, 4)
        Kg = K.reshape(K.shape[0], N, G, D).permute(1, 2, 0, 3)
        Vg = V.reshape(V.shape[0], N, G, D).permute(1, 2, 0, 3)
        if c["add_zero_attn"]:
            Kg = torch.cat([Kg, torch.zeros(N, G, 1, D, dtype=torch.float64)], dim=2)
            Vg = torch.cat([Vg, torch.zeros(N, G, 1, D, dtype=torch.float64)], dim=2)
        Sp = Kg.shape[2]
        mask = torch.cat([tot, torch.zeros(N * H, L, Sp - S, dtype=torch.float64)], dim=-1)
        sc = torch.einsum("ngrld,ngsd->ngrls", Qg / math.sqrt(D), Kg).reshape(N * H, L, Sp)
        sc = soft(sc) + mask
    else:
        Q, K, V = split_heads(c, Q, K, V, L, N, H, D)
        Sp = K.shape[1]
        mask = torch.cat([tot, torch.zeros(N * H, L, Sp - S, dtype=torch.float64)], dim=-1)
        sc = soft((Q / math.sqrt(D)) @ K.transpose(1, 2)) + mask
    # The softmax is shift-invariant: the row maximum carries no gradient. Every torch.where
    # below selects finite values on both sides, so their gradients are never 0 * inf = NaN.
    # Sinks: each row's denominator gains exp(sinks_h - m) (a logit with a zero value).
    mx = sc.max(dim=-1, keepdim=True).values.detach()
    sink = None
    if "sinks" in P:
        sink = P["sinks"].reshape(1, H, 1, 1).expand(N, H, L, 1).reshape(N * H, L, 1)
        mx = torch.maximum(mx, sink.detach())
    full = torch.isneginf(mx)
    ex = torch.exp(sc - torch.where(full, torch.zeros_like(mx), mx))
    den = ex.sum(dim=-1, keepdim=True)
    if sink is not None:
        den = den + torch.exp(sink - torch.where(full, torch.zeros_like(mx), mx))
    W = torch.where(full, torch.zeros_like(ex), ex / torch.where(full, torch.ones_like(den), den))
    if G < H:
        A = torch.einsum("ngrls,ngsd->ngrld", W.reshape(N, G, H // G, L, Sp), Vg)
        A = A.reshape(N, H, L, D).permute(2, 0, 1, 3).reshape(L * N, E)
    else:
        A = (W @ V).transpose(0, 1).reshape(L * N, E)
    out = A @ P["out_proj.weight"].T
    if "out_proj.bias" in P:
        out = out + P["out_proj.bias"]
    out = out.reshape(L, N, E)
    W = W.reshape(N, H, L, Sp)
    if not batched:
        out = out.squeeze(1)
    elif c["batch_first"]:
        out = out.transpose(0, 1)
    return out, W


def pytorch_masks(c, kpm, attn):
    """The masks handed to PyTorch 1.13's own mask handling (bool True = may not attend), from
    the masks in 'masked' terms as tensors: float masks in float64 (differentiable when they
    are leaves), the per_batch attn_mask expanded to (N*H, L, S), the causal mask merged into
    attn_mask."""
    L, S, H = c["L"], c["S"], c["H"]
    kpm_t = attn_t = None
    if kpm is not None:
        kpm_t = kpm if kpm.dtype == torch.bool else kpm.double()
    if attn is not None:
        attn_t = attn if attn.dtype == torch.bool else attn.double()
        if c["attn_shape"] == "per_batch":
            attn_t = attn_t.repeat_interleave(H, dim=0)
    if c["causal"]:
        attn_t = with_masked(attn_t, torch.triu(torch.ones(L, S, dtype=torch.bool), 1))
    if c["window"] is not None:  # as the causal mask
        attn_t = with_masked(attn_t, window_outside(L, S, c["window"]))
    if c["alibi"] is not None:  # a float (N*H, L, S) attn_mask: ALiBi's bias, masked
        bias = alibi_additive(c)
        if attn_t is None:
            attn_t = bias
        elif attn_t.dtype == torch.bool:
            attn_t = bias.masked_fill(attn_t, -math.inf)
        else:
            attn_t = bias + attn_t
    return kpm_t, attn_t


def run_torch(m64, q, k, v, kpm_t, attn_t, need_weights, average):
    out, w = m64(q, k, v, key_padding_mask=kpm_t, attn_mask=attn_t,
                 need_weights=need_weights, average_attn_weights=average)
    return out.detach(), (None if w is None else w.detach())


# ------------------------------------------------------------------------------------------
# Gradients
# ------------------------------------------------------------------------------------------

def grad_leaves(c, params, query, key, value, kpm, attn):
    """float64 leaves that require gradients: the parameters (by state_dict name), the inputs
    (key and value alias query or key as the case's mode says) and the float masks."""
    P = {k: torch.from_numpy(v).double().requires_grad_() for k, v in params}
    q = torch.from_numpy(query).double().requires_grad_()
    if c["mode"] == "self":
        k = v = q
    elif c["mode"] == "kv_same":
        k = v = torch.from_numpy(key).double().requires_grad_()
    else:
        k = torch.from_numpy(key).double().requires_grad_()
        v = torch.from_numpy(value).double().requires_grad_()
    masks = {}
    for name, m in (("key_padding_mask", kpm), ("attn_mask", attn)):
        if m is None:
            masks[name] = None
        elif m.dtype == np.bool_:
            masks[name] = torch.from_numpy(m.copy())
        else:
            masks[name] = torch.from_numpy(m.copy()).double().requires_grad_()
    return P, q, k, v, masks


def collect_grads(c, P, q, k, v, masks):
    """The gradients by file tensor name (grad.<name>), in file order; a tensor nothing flowed
    into gets zeros."""
    def g(t):
        return (torch.zeros_like(t) if t.grad is None else t.grad).detach().numpy().copy()

    out = [("grad.query", g(q))]
    if c["mode"] != "self":
        out.append(("grad.key", g(k)))
    if c["mode"] == "cross":
        out.append(("grad.value", g(v)))
    out += [(f"grad.{name}", g(t)) for name, t in P.items()]
    for name in ("attn_mask", "key_padding_mask"):
        t = masks[name]
        if t is not None and t.dtype != torch.bool:
            out.append((f"grad.{name}", g(t)))
    return out


def loss_of(out, w, grad_output, grad_weights):
    loss = (out * torch.from_numpy(grad_output).double()).sum()
    if grad_weights is not None:
        loss = loss + (w * torch.from_numpy(grad_weights).double()).sum()
    return loss


def torch_grads(c, m32, params, query, key, value, kpm, attn, grad_output, grad_weights,
                native):
    """Gradients by nn.MultiheadAttention's autograd in float64, through PyTorch's own mask
    handling (native) or the pre-combined additive mask; the float masks' gradients are taken
    w.r.t. the file's mask tensors (the expansion and combination are torch ops)."""
    P, q, k, v, masks = grad_leaves(c, params, query, key, value, kpm, attn)
    if is_gqa(c):  # the GQA leaves themselves, expanded inside autograd
        m = GQAModule(c, P)
    elif c["softcap"] or c["sinks"]:  # softcap_mha on the leaves
        m = SoftcapModule(c, P)
    else:
        m = copy.deepcopy(m32).double().eval()
        with torch.no_grad():
            for name, t in m.named_parameters():
                t.copy_(P[name])
    if native:
        kpm_t, attn_t = pytorch_masks(c, masks["key_padding_mask"], masks["attn_mask"])
    else:
        kpm_t = None
        attn_t = additive(c, masks["key_padding_mask"], masks["attn_mask"])
    out, w = m(q, k, v, key_padding_mask=kpm_t, attn_mask=attn_t,
               need_weights=c["need_weights"], average_attn_weights=not c["per_head"])
    loss_of(out, w, grad_output, grad_weights).backward()
    if not is_gqa(c) and not (c["softcap"] or c["sinks"]):
        for name, t in m.named_parameters():  # the module's parameters stand for the leaves
            P[name].grad = t.grad
    return collect_grads(c, P, q, k, v, masks)


def own_grads(c, params, query, key, value, kpm, attn, grad_output, grad_weights):
    """Gradients of own_mha (clmha's rule on fully masked rows: zero weights, zero gradients)."""
    P, q, k, v, masks = grad_leaves(c, params, query, key, value, kpm, attn)
    tot = additive(c, masks["key_padding_mask"], masks["attn_mask"], alibi=False)
    out, wph = own_mha(c, P, q, k, v, tot)
    w = None
    if c["need_weights"]:
        w = wph if c["per_head"] else wph.sum(dim=1) / c["H"]
        if c["N"] is None:
            w = w.squeeze(0)
    loss_of(out, w, grad_output, grad_weights).backward()
    return collect_grads(c, P, q, k, v, masks)


# Per case: the largest |PyTorch - own_mha| of the output, the per-head weights and each
# gradient (NaN entries skipped), filled by generate().
OWN_DIFFS = {}


def maxdiff(a, b):
    ok = ~(torch.isnan(a) | torch.isnan(b))
    d = (a - b)[ok].abs()
    return d.max().item() if d.numel() else 0.0


def same(a, b, tol=1e-12):
    """Equal up to tol*(1+max|a|), NaN where the other is NaN."""
    if (a is None) != (b is None):
        return False
    if a is None:
        return True
    if a.shape != b.shape:
        return False
    na, nb = torch.isnan(a), torch.isnan(b)
    if not torch.equal(na, nb):
        return False
    d = (a - b)[~na].abs()
    scale = 1.0 + (a[~na].abs().max().item() if (~na).any() else 0.0)
    return d.numel() == 0 or d.max().item() <= tol * scale


def generate(c, given=None):
    """The text of case c's golden file. With given (a golden_compare.GivenInputs of the
    committed file), the float32 inputs are the committed ones, after checking that they are
    this case's draw up to float32 rounding, so that the float64 results are recomputed on
    exactly the committed inputs."""
    name = c["name"]
    seed = seed_of(name)
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    E, H, L, S, N = c["E"], c["H"], c["L"], c["S"], c["N"]
    batched = N is not None
    m32, params, kdim, vdim = (make_gqa_params if is_gqa(c) else make_module)(c, gen, given)
    if c["mode"] == "self":
        assert kdim == E and vdim == E
    if c["sinks"]:  # a parameter after PyTorch's (its own generator: no other draw changes)
        sinks = sinks_of(c)
        params = params + [("sinks", sinks if given is None else given.take("sinks", sinks))]

    def draw(shape):
        return f32(torch.randn(shape, generator=gen).numpy())

    query, key, value = draw_inputs(c, draw, kdim, vdim)  # float32
    if given is not None:
        query = given.take("query", query)
        key = None if key is None else given.take("key", key)
        value = None if value is None else given.take("value", value)

    # masks, redrawn until no row is fully masked (the dedicated cases add theirs afterwards)
    for _ in range(1000):
        kpm, attn = draw_masks(c, rng)
        if not has_full_row(c, kpm, attn):
            break
    else:
        raise RuntimeError(f"{name}: could not draw masks without fully masked rows")
    apply_special(c, kpm, attn)

    # float64 module and tensors
    if is_gqa(c):
        m64 = GQAModule(c, {k2: torch.from_numpy(v2).double() for k2, v2 in params})
    else:
        m64 = copy.deepcopy(m32).double().eval()
    if c["softcap"] or c["sinks"]:
        # softcap_mha; without the soft-capping and the sinks it must be nn.MultiheadAttention
        P64 = {k2: torch.from_numpy(v2).double() for k2, v2 in params}
        nn_m64, m64 = m64, SoftcapModule(c, P64)
    q64 = torch.from_numpy(query).double()
    if c["mode"] == "self":
        k64 = v64 = q64
    elif c["mode"] == "kv_same":
        k64 = torch.from_numpy(key).double()
        v64 = k64
    else:
        k64 = torch.from_numpy(key).double()
        v64 = torch.from_numpy(value).double()

    kpm_t, attn_t = pytorch_masks(c, None if kpm is None else torch.from_numpy(kpm.copy()),
                                  None if attn is None else torch.from_numpy(attn.copy()))
    tot = additive(c, kpm, attn)
    # (softcap_mha takes only the pre-combined mask)
    native_ok = not (kpm_t is not None and kpm_t.dtype != torch.bool and attn_t is not None) \
        and not c["softcap"] and not c["sinks"]
    if c["softcap"] or c["sinks"]:
        plain = SoftcapModule(dict(c, softcap=0.0, sinks=False),
                              {k2: v2 for k2, v2 in P64.items() if k2 != "sinks"})
        for avg_ in (True, False):
            a = run_torch(nn_m64, q64, k64, v64, None, tot, True, avg_)
            b = run_torch(plain, q64, k64, v64, None, tot, True, avg_)
            if not (same(a[0], b[0]) and same(a[1], b[1])):
                raise AssertionError(f"{name}: softcap_mha without soft-capping and sinks"
                                     f" differs from nn.MultiheadAttention")

    nw, avg = c["need_weights"], not c["per_head"]
    comb = run_torch(m64, q64, k64, v64, None, tot if (kpm_t is not None or attn_t is not None)
                     else None, nw, avg)
    notes = []
    if is_gqa(c):
        notes.append(f"grouped-query attention, {kv_heads(c)} key/value heads for {H} heads:"
                     " PyTorch's multi_head_attention_forward on K/V projections expanded from"
                     " the GQA parameters (each key/value head repeat_interleave'd H/G times,"
                     " inside autograd), checked against an independent grouped implementation")
    if native_ok:
        out, w = run_torch(m64, q64, k64, v64, kpm_t, attn_t, nw, avg)
        if not (same(out, comb[0]) and same(w, comb[1])):
            raise AssertionError(f"{name}: pre-combined mask path differs from PyTorch's own")
        _, wph = run_torch(m64, q64, k64, v64, kpm_t, attn_t, True, False)
        notes.append("golden computed by PyTorch with its own mask handling"
                     " (checked equal to the pre-combined additive mask path)")
    elif c["sinks"]:
        out, w = comb
        _, wph = run_torch(m64, q64, k64, v64, None, tot, True, False)
        notes.append("attention sinks" + (f" and soft-capping {c['softcap']!r}" if c["softcap"]
                                          else "") +
                     ": golden computed by softcap_mha (PyTorch 1.13's multi_head_attention_"
                     "forward written out in float64 torch ops, the softmax over [scores, sink]"
                     " with the sink's column dropped" + (", c*tanh(s/c) on the scaled scores"
                                                         if c["softcap"] else "") +
                     "; checked equal to nn.MultiheadAttention without them) on a pre-combined"
                     " additive (N*H, L, S) float mask")
    elif c["softcap"]:
        out, w = comb
        _, wph = run_torch(m64, q64, k64, v64, None, tot, True, False)
        notes.append(f"soft-capping {c['softcap']!r}: golden computed by softcap_mha (PyTorch"
                     " 1.13's multi_head_attention_forward written out in float64 torch ops, with"
                     " c*tanh(s/c) on the scaled scores; checked equal to nn.MultiheadAttention"
                     " without it) on a pre-combined additive (N*H, L, S) float mask")
    else:
        out, w = comb
        _, wph = run_torch(m64, q64, k64, v64, None, tot, True, False)
        notes.append("golden computed by PyTorch with a pre-combined additive (N*H, L, S) float"
                     " mask (PyTorch 1.13 cannot combine a float key_padding_mask with attn_mask)")

    # independent implementation with clmha's semantics
    P = {k2: torch.from_numpy(v2).double() for k2, v2 in params}
    own_out, own_wph = own_mha(c, P, q64, k64, v64, additive(c, kpm, attn, alibi=False))
    if not batched:
        wph = wph.unsqueeze(0)
    diffs = {"output": maxdiff(out, own_out), "weights": maxdiff(wph, own_wph)}
    if not same(wph, torch.where(torch.isnan(wph), wph, own_wph)):
        raise AssertionError(f"{name}: own implementation disagrees with PyTorch (weights)")
    nan_rows = torch.isnan(wph).any(dim=-1)  # (N, H, L)
    if not torch.equal(nan_rows, torch.isnan(wph).all(dim=-1)):
        raise AssertionError(f"{name}: partially NaN weight rows")
    expect_full = c["special"] in ("full_kpm", "full_attn_row", "full_float_row",
                                   "partial_head")
    if bool(nan_rows.any()) != expect_full:
        raise AssertionError(f"{name}: fully masked rows present={bool(nan_rows.any())}, "
                             f"expected={expect_full}")
    if c["special"] == "full_kpm_appended":
        Sp = own_wph.shape[-1]
        assert torch.equal(own_wph[0, :, :, Sp - 1], torch.ones(H, L, dtype=torch.float64))
        notes.append("batch item 0 has every key masked; with add_zero_attn PyTorch gives all"
                     " the weight to the appended zero key (no NaN)")

    # map NaN rows to positions in the output
    row_nan = nan_rows.any(dim=1)  # (N, L): some head fully masked
    if batched:
        out_rows = row_nan.transpose(0, 1) if not c["batch_first"] else row_nan  # as out[:2]
    else:
        out_rows = row_nan[0]
    out_nan = torch.isnan(out).any(dim=-1)
    if not torch.equal(out_nan, out_rows) or not torch.equal(torch.isnan(out).all(-1), out_nan):
        raise AssertionError(f"{name}: NaN output rows do not match fully masked rows")
    if not same(out, torch.where(torch.isnan(out), out, own_out)):
        raise AssertionError(f"{name}: own implementation disagrees with PyTorch (output)")
    if out_nan.any():
        all_heads = nan_rows.all(dim=1)  # (N, L)
        bias = P.get("out_proj.bias", torch.zeros(E, dtype=torch.float64))
        for n in range(row_nan.shape[0]):
            for i in range(L):
                if bool(all_heads[n, i]):
                    idx = (i, n) if batched and not c["batch_first"] else (n, i)
                    row = own_out[idx] if batched else own_out[i]
                    if not torch.equal(row, bias):
                        raise AssertionError(f"{name}: fully masked row != out_proj.bias")
        out = torch.where(torch.isnan(out), own_out, out)
        if w is not None:
            if avg:
                own_w = own_wph.sum(dim=1) / H
            else:
                own_w = own_wph
            if not batched:
                own_w = own_w.squeeze(0)
            w = torch.where(torch.isnan(w), own_w, w)
        if bool(all_heads[row_nan].all()):
            notes.append("PyTorch gives NaN for fully masked query rows; replaced by clmha's"
                         " rule: zero attention weights, zero attention result, so the output"
                         " row is out_proj.bias (0 without bias)")
        else:
            notes.append("PyTorch gives NaN for every head of a query row when one head's row"
                         " is fully masked; replaced by clmha's rule: that head has zero"
                         " weights and a zero attention result, the other heads are unchanged"
                         " (values from an independent float64 implementation that matches"
                         " PyTorch on every non-NaN entry)")
    assert not torch.isnan(out).any()
    assert w is None or not torch.isnan(w).any()

    # expected shapes
    Sp = S + int(c["add_bias_kv"]) + int(c["add_zero_attn"])
    assert tuple(out.shape) == input_shape(c, L, E)
    if nw:
        if batched:
            ws = (N, L, Sp) if avg else (N, H, L, Sp)
        else:
            ws = (L, Sp) if avg else (H, L, Sp)
        assert tuple(w.shape) == ws, (w.shape, ws)

    # gradients: grad_output and grad_weights drawn last, so that every tensor above keeps the
    # value it had before gradients were added to the files
    grad_output = draw(tuple(out.shape))
    grad_weights = draw(tuple(w.shape)) if nw else None
    if given is not None:
        grad_output = given.take("grad_output", grad_output)
        if nw:
            grad_weights = given.take("grad_weights", grad_weights)
    gargs = (params, query, key, value, kpm, attn, grad_output, grad_weights)
    grads = own_grads(c, *gargs)
    if bool(nan_rows.any()):
        notes.append("gradients: PyTorch's are NaN on fully masked rows; these follow clmha's"
                     " rule (zero there) from the independent float64 implementation's autograd")
    else:
        chosen = None  # the path the forward golden took: PyTorch's own masks when it can
        for native in ([True, False] if native_ok else [False]):
            tg = torch_grads(c, m32, *gargs, native)
            for (n1, a), (n2, b) in zip(tg, grads):
                assert n1 == n2, (n1, n2)
                diffs[n1] = max(diffs.get(n1, 0.0),
                                maxdiff(torch.from_numpy(a), torch.from_numpy(b)))
                if not same(torch.from_numpy(a), torch.from_numpy(b)):
                    raise AssertionError(f"{name}: own implementation's {n1} differs from"
                                         f" PyTorch autograd's (native masks {native})")
            chosen = chosen or tg
        grads = chosen
        notes.append("gradients: PyTorch autograd in float64 (checked equal to the independent"
                     " implementation's autograd)")

    OWN_DIFFS[name] = diffs

    # file text
    lines = [f"# clmha golden case, generated by tools/make_golden.py (PyTorch {torch.__version__})",
             "# inputs and parameters drawn in float32; expected values computed in float64"]
    lines += ["# " + t for t in notes]
    if c["alibi"] is not None:
        lines.append(f"# ALiBi ({c['alibi']} slopes): the float bias -slope_h*|i - j| over the"
                     " real keys, part of the additive mask (and of attn_mask for PyTorch)")
    lines += case_lines(name, c, E, H, kdim, vdim,
                        (f" num_kv_heads {kv_heads(c)}" if is_gqa(c) else "")
                        + ("" if c["window"] is None else " window %d %d" % c["window"])
                        + (f" softcap {c['softcap']!r}" if c["softcap"] else "")
                        + (" alibi" if c["alibi"] is not None else "")
                        + (" sinks" if c["sinks"] else ""),
                        params + ([("alibi_slopes", slopes_of(c))] if c["alibi"] == "custom"
                                  else []),
                        query, key, value, kpm, attn)
    lines += tensor_text("output", "f64", out.numpy())
    if nw:
        lines += tensor_text("weights", "f64", w.numpy())
    lines += tensor_text("grad_output", "f32", grad_output)
    if nw:
        lines += tensor_text("grad_weights", "f32", grad_weights)
    for gname, garr in grads:
        lines += tensor_text(gname, "f64", garr)
    lines.append("end")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------
# float16 / bfloat16 layers
# ------------------------------------------------------------------------------------------

# Per dtype case: PyTorch's own error in the dtype (max |torch.output - output|, and of the
# weights) and the largest |output| / |weights|, filled by generate_dtype().
DTYPE_ERRORS = {}

# --check: the committed torch.output / torch.weights of a dtype case are kept when the
# recomputed ones are within this many steps of the dtype (eps) of their largest magnitude
# (float32 kernels, and PyTorch's bfloat16 ones, round differently between CPU models).
TORCH_BASELINE_STEPS = 4


def round_to(a, dt):
    """The float32 array a rounded to the layer dtype dt (to nearest even), as float32."""
    t = torch.from_numpy(np.array(a, dtype=np.float32))
    return t.to(LAYER_DTYPES[dt]).to(torch.float32).numpy().copy()


def committed(given, name, shape):
    """The committed tensor `name` (--check), which must have the shape `shape`."""
    if name not in given.tensors:
        raise golden_compare.NotThisDraw(f"{name}: not in the committed file")
    have = given.tensors[name]
    if have.shape != shape:
        raise golden_compare.NotThisDraw(f"{name}: shape {have.shape}, expected {shape}")
    return have


def take_rounded(given, name, drawn, dt):
    """The float32 draw `drawn` rounded to dt, or with given (--check) the committed tensor
    `name` after checking that it is this draw rounded to dt: equal to it, or (the float32 draw
    may differ in its last bits between CPU models, and its rounding then by one step of dt)
    exactly representable in dt and within one step of dt (eps * max |drawn|) of it."""
    want = round_to(drawn, dt)
    if given is None:
        return want
    have = committed(given, name, want.shape)
    if np.array_equal(have, want):
        return have.copy()
    if not np.array_equal(round_to(have, dt), have):
        raise golden_compare.NotThisDraw(f"{name}: not exactly representable in {dt}")
    fin = np.isfinite(want)
    if not np.array_equal(np.isfinite(have), fin) or (have[~fin] != want[~fin]).any():
        raise golden_compare.NotThisDraw(f"{name}: non-finite values differ from the draw")
    step = torch.finfo(LAYER_DTYPES[dt]).eps * (np.abs(drawn[fin]).max() if fin.any() else 0.0)
    diff = np.abs(have[fin].astype(np.float64) - want[fin])
    if (diff > step).any():
        raise golden_compare.NotThisDraw(f"{name}: differs from the case's draw rounded to {dt}"
                                         f" by up to {diff.max():.3g} (> one step, {step:.3g})")
    return have.copy()


def take_baseline(given, name, computed, dt):
    """PyTorch's result in the dtype (float32 array), or with given (--check) the committed one
    when the recomputed one is within TORCH_BASELINE_STEPS steps of dt of it."""
    if given is None:
        return computed
    have = committed(given, name, computed.shape)
    tol = (TORCH_BASELINE_STEPS * torch.finfo(LAYER_DTYPES[dt]).eps *
           max(float(np.abs(computed).max()), 1e-30))
    diff = float(np.abs(have.astype(np.float64) - computed).max())
    if not np.isfinite(have).all() or diff > tol:
        raise golden_compare.NotThisDraw(f"{name}: recomputed PyTorch {dt} result differs by "
                                         f"{diff:.3g} > {tol:.3g}")
    return have.copy()


def emulated_mha(c, P, q, k, v, tot, rnd):
    """F.multi_head_attention_forward of PyTorch 1.13 (eval, no GQA) step by step, in the
    floating dtype of the given tensors, with rnd applied wherever a float16 kernel under CUDA
    autocast returns float16: rnd(x) = x.half().float() on float32 tensors gives the float16
    baseline, rnd = identity on float64 tensors the structural check against
    nn.MultiheadAttention. P: the parameters by state_dict name; q, k, v in the file's layouts
    (k and v the same tensor as q in self-attention); tot: the additive mask (NH, L, S) in the
    tensors' dtype. Returns (output, weights or None, as the case's need_weights/per_head)."""
    E, H = c["E"], c["H"]
    D = E // H
    F = torch.nn.functional
    batched = c["N"] is not None
    q, k, v = sequence_first(c, q, k, v)
    L, N, _ = q.shape
    if "in_proj_weight" in P:
        Wq, Wk, Wv = P["in_proj_weight"].chunk(3)
    else:
        Wq, Wk, Wv = P["q_proj_weight"], P["k_proj_weight"], P["v_proj_weight"]
    bq = bk = bv = None
    if "in_proj_bias" in P:
        bq, bk, bv = P["in_proj_bias"].chunk(3)
    # in projections: float16 GEMMs (float16 operands, float32 accumulation and bias)
    Q = rnd(F.linear(q, Wq, bq))
    K = rnd(F.linear(k, Wk, bk))
    V = rnd(F.linear(v, Wv, bv))
    if "bias_k" in P:
        K = torch.cat([K, P["bias_k"].repeat(1, N, 1)])
        V = torch.cat([V, P["bias_v"].repeat(1, N, 1)])
    Q, K, V = split_heads(c, Q, K, V, L, N, H, D)
    Sp = K.shape[1]
    mask = torch.cat([tot, torch.zeros(N * H, L, Sp - tot.shape[-1], dtype=tot.dtype)], dim=-1)
    # q / sqrt(D) as 1.13 does it (on the float16 q), Q K^T a float16 GEMM, then the mask
    # added and the softmax taken in float32 (autocast's float32 softmax)
    Qs = rnd(Q / math.sqrt(D))
    sc = rnd(torch.bmm(Qs, K.transpose(1, 2)))
    if c["softcap"]:  # clmha's soft-capping of the scaled scores (softcap_mha), before the mask
        sc = c["softcap"] * torch.tanh(sc / c["softcap"])
    sc = sc + mask
    if c.get("sinks") and "sinks" in P:  # one more logit per head, its column dropped after
        sink = P["sinks"].to(sc.dtype).repeat(N).reshape(N * H, 1, 1).expand(N * H, L, 1)
        W = torch.softmax(torch.cat([sc, sink], dim=-1), dim=-1)[..., :-1]
    else:
        W = torch.softmax(sc, dim=-1)
    # probabilities rounded to float16 for the float16 GEMM weights . V
    A = rnd(torch.bmm(rnd(W), V))
    A = A.transpose(0, 1).reshape(L * N, E)
    out = rnd(F.linear(A, P["out_proj.weight"], P.get("out_proj.bias"))).reshape(L, N, E)
    w = None
    if c["need_weights"]:
        # returned in float16: averaged over the heads in float32, rounded once
        w = W.reshape(N, H, L, Sp)
        if not c["per_head"]:
            w = w.sum(dim=1) / H
        w = rnd(w)
        if not batched:
            w = w.squeeze(0)
    if not batched:
        out = out.squeeze(1)
    elif c["batch_first"]:
        out = out.transpose(0, 1)
    return out, w


def torch_float64(name, c, m64, q64, k64, v64, kpm_t, attn_t, tot):
    """PyTorch's float64 output and weights of case c (module m64, inputs q64, k64, v64, the
    masks as PyTorch takes them, kpm_t and attn_t, and their additive combination tot): with
    PyTorch's own mask handling where 1.13 has it, checked equal to the pre-combined additive
    mask path, else through that path. Returns (out, w, notes, native_ok)."""
    has_mask = kpm_t is not None or attn_t is not None
    native_ok = not (kpm_t is not None and kpm_t.dtype != torch.bool and attn_t is not None)
    nw, avg = c["need_weights"], not c["per_head"]
    comb = run_torch(m64, q64, k64, v64, None, tot if has_mask else None, nw, avg)
    notes = []
    if native_ok:
        out, w = run_torch(m64, q64, k64, v64, kpm_t, attn_t, nw, avg)
        if not (same(out, comb[0]) and same(w, comb[1])):
            raise AssertionError(f"{name}: pre-combined mask path differs from PyTorch's own")
        notes.append("golden computed by PyTorch with its own mask handling"
                     " (checked equal to the pre-combined additive mask path)")
    else:
        out, w = comb
        notes.append("golden computed by PyTorch with a pre-combined additive (N*H, L, S) float"
                     " mask (PyTorch 1.13 cannot combine a float key_padding_mask with attn_mask)")
    assert not torch.isnan(out).any() and (w is None or not torch.isnan(w).any())
    return out, w, notes, native_ok


def generate_dtype(c, given=None):
    """The text of dtype case c's golden file (float16 / bfloat16 layer, forward only). With
    given (a golden_compare.GivenInputs of the committed file), the rounded inputs and PyTorch's
    dtype results are the committed ones after checking them (take_rounded, take_baseline)."""
    name, dt = c["name"], c["dtype"]
    assert dt in LAYER_DTYPES and not is_gqa(c) and c["special"] is None
    tdt = LAYER_DTYPES[dt]
    seed = seed_of(name)
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    E, H, L, S, N = c["E"], c["H"], c["L"], c["S"], c["N"]
    batched = N is not None
    m32, params, kdim, vdim = make_module(c, gen)
    if c["mode"] == "self":
        assert kdim == E and vdim == E

    def draw(shape):
        return f32(torch.randn(shape, generator=gen).numpy())

    query, key, value = draw_inputs(c, draw, kdim, vdim)  # exactly as generate() draws them
    for _ in range(1000):
        kpm, attn = draw_masks(c, rng)
        if not has_full_row(c, kpm, attn):
            break
    else:
        raise RuntimeError(f"{name}: could not draw masks without fully masked rows")

    # every parameter, input and float mask rounded to the dtype
    params = [(k2, take_rounded(given, k2, v2, dt)) for k2, v2 in params]
    m32.load_state_dict({k2: torch.from_numpy(v2) for k2, v2 in params}, strict=True)
    query = take_rounded(given, "query", query, dt)
    key = None if key is None else take_rounded(given, "key", key, dt)
    value = None if value is None else take_rounded(given, "value", value, dt)
    if kpm is not None and kpm.dtype != np.bool_:
        kpm = round_to(kpm, dt)
    if attn is not None and attn.dtype != np.bool_:
        attn = round_to(attn, dt)
    tot = additive(c, kpm, attn)
    if bool(torch.isneginf(tot).all(dim=-1).any()):
        raise AssertionError(f"{name}: fully masked row after rounding the masks")

    def inputs(conv):
        """q, k, v converted by conv (k, v the same tensor as q in self-attention)."""
        q = conv(torch.from_numpy(query))
        if c["mode"] == "self":
            return q, q, q
        k = conv(torch.from_numpy(key))
        return q, k, (k if c["mode"] == "kv_same" else conv(torch.from_numpy(value)))

    # float64 golden on exactly the rounded values
    m64 = copy.deepcopy(m32).double().eval()
    q64, k64, v64 = inputs(lambda t: t.double())
    kpm_t, attn_t = pytorch_masks(c, None if kpm is None else torch.from_numpy(kpm.copy()),
                                  None if attn is None else torch.from_numpy(attn.copy()))
    nw, avg = c["need_weights"], not c["per_head"]
    out, w, notes, native_ok = torch_float64(name, c, m64, q64, k64, v64, kpm_t, attn_t, tot)

    # independent implementation, and the emulation's structure, in float64
    P64 = {k2: torch.from_numpy(v2).double() for k2, v2 in params}
    own_out, own_wph = own_mha(c, P64, q64, k64, v64, tot)
    own_w = None
    if nw:
        own_w = own_wph if c["per_head"] else own_wph.sum(dim=1) / H
        if not batched:
            own_w = own_w.squeeze(0)
    if not (same(out, own_out) and same(w, own_w)):
        raise AssertionError(f"{name}: own implementation disagrees with PyTorch")
    emu_out, emu_w = emulated_mha(c, P64, q64, k64, v64, tot, lambda t: t)
    if not (same(out, emu_out) and same(w, emu_w)):
        raise AssertionError(f"{name}: the float16 emulation run in float64 without rounding"
                             " disagrees with nn.MultiheadAttention")

    # PyTorch's own result in the dtype
    if dt == "bf16":
        mb = copy.deepcopy(m32).to(tdt).eval()
        qb, kb, vb = inputs(lambda t: t.to(tdt))

        def cast(t):  # float masks to bfloat16, bool ones as they are
            return t if t is None or t.dtype == torch.bool else t.to(tdt)

        if native_ok:
            tout, tw = run_torch(mb, qb, kb, vb, cast(kpm_t), cast(attn_t), nw, avg)
        else:
            tout, tw = run_torch(mb, qb, kb, vb, None, cast(tot), nw, avg)
        assert tout.dtype == tdt and (tw is None or tw.dtype == tdt)
        notes.append("torch.output / torch.weights: nn.MultiheadAttention run natively in"
                     " bfloat16 on CPU (module, inputs and float masks .to(torch.bfloat16))")
    else:
        P32 = {k2: torch.from_numpy(v2) for k2, v2 in params}
        q32, k32, v32 = inputs(lambda t: t.float())

        def r16(t):
            return t.to(torch.float16).to(torch.float32)

        tout, tw = emulated_mha(c, P32, q32, k32, v32, tot.float(), r16)
        assert torch.equal(r16(tout), tout) and (tw is None or torch.equal(r16(tw), tw))
        notes.append("torch.output / torch.weights: CUDA autocast's float16 policy emulated in"
                     " PyTorch on CPU (tools/make_golden.py emulated_mha): every linear / bmm"
                     " takes float16 operands, accumulates in float32 and rounds to float16;"
                     " q / sqrt(D) in float16; mask added and softmax in float32; probabilities"
                     " rounded to float16 before weights . V; weights returned in float16")
    tout = take_baseline(given, "torch.output", tout.float().numpy().copy(), dt)
    if nw:
        tw = take_baseline(given, "torch.weights", tw.float().numpy().copy(), dt)
    DTYPE_ERRORS[name] = {
        "output_err": maxdiff(torch.from_numpy(tout).double(), out),
        "output_max": out.abs().max().item(),
        "weights_err": maxdiff(torch.from_numpy(tw).double(), w) if nw else None,
        "weights_max": w.abs().max().item() if nw else None,
    }

    # expected shapes
    Sp = S + int(c["add_bias_kv"]) + int(c["add_zero_attn"])
    assert tuple(out.shape) == input_shape(c, L, E) == tout.shape
    if nw:
        if batched:
            ws = (N, L, Sp) if avg else (N, H, L, Sp)
        else:
            ws = (L, Sp) if avg else (H, L, Sp)
        assert tuple(w.shape) == ws == tw.shape, (w.shape, ws)

    long_name = {"f16": "float16", "bf16": "bfloat16"}[dt]
    lines = ["# clmha golden case, generated by tools/make_golden.py"
             f" (PyTorch {torch.__version__})",
             f"# {long_name} layer (forward only): parameters, inputs and float masks drawn in"
             f" float32, then rounded to {long_name} (the f32 values here are exactly"
             f" representable in it); expected values computed in float64 on exactly those values"]
    lines += ["# " + t for t in notes]
    lines += case_lines(name, c, E, H, kdim, vdim, f" dtype {dt}", params, query, key, value,
                        kpm, attn)
    lines += tensor_text("output", "f64", out.numpy())
    if nw:
        lines += tensor_text("weights", "f64", w.numpy())
    lines += tensor_text("torch.output", "f32", tout)
    if nw:
        lines += tensor_text("torch.weights", "f32", tw)
    lines.append("end")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------
# float64 layers
# ------------------------------------------------------------------------------------------

def f64(a):
    return np.asarray(a, dtype=np.float64)


def generate_f64(c, given=None):
    """The text of float64 layer case c's golden file (forward only): nn.MultiheadAttention made
    in float64 (make_module), inputs drawn by torch.randn in float64, float masks by NumPy in
    float64, the expected output and weights PyTorch's float64 results on them. With given (a
    golden_compare.GivenInputs of the committed file), the parameters, inputs and float masks
    are the committed ones after checking that they are this draw (check_draw_f64), so that the
    results are recomputed on exactly them."""
    name = c["name"]
    assert c["dtype"] == "f64" and not is_gqa(c) and c["special"] is None
    seed = seed_of(name)
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    E, H, L, S, N = c["E"], c["H"], c["L"], c["S"], c["N"]
    batched = N is not None
    m64, params, kdim, vdim = make_module(c, gen, given, torch.float64)
    if c["mode"] == "self":
        assert kdim == E and vdim == E

    def draw(shape):
        return torch.randn(shape, generator=gen, dtype=torch.float64).numpy()

    def take(tname, drawn):  # the committed float64 tensor when checking
        return drawn if given is None or drawn is None else given.take_f64(tname, drawn)

    query, key, value = draw_inputs(c, draw, kdim, vdim)
    query, key, value = take("query", query), take("key", key), take("value", value)
    for _ in range(1000):
        kpm, attn = draw_masks(c, rng, f64)
        if not has_full_row(c, kpm, attn):
            break
    else:
        raise RuntimeError(f"{name}: could not draw masks without fully masked rows")
    if kpm is not None and kpm.dtype != np.bool_:
        kpm = take("key_padding_mask", kpm)
    if attn is not None and attn.dtype != np.bool_:
        attn = take("attn_mask", attn)
    # A layer that rounded any of these to float32 would be off by some 1e-8, far beyond the
    # contract's 1e-12: every finite value must be one that float32 cannot hold.
    floats = params + [("query", query), ("key", key), ("value", value),
                       ("key_padding_mask", kpm), ("attn_mask", attn)]
    for tname, a in floats:
        if a is None or a.dtype == np.bool_:
            continue
        fin = a[np.isfinite(a)]
        if (fin.astype(np.float32).astype(np.float64) == fin).any():
            raise AssertionError(f"{name}: {tname} holds float32-representable values")

    q64 = torch.from_numpy(query)
    if c["mode"] == "self":
        k64 = v64 = q64
    else:
        k64 = torch.from_numpy(key)
        v64 = k64 if c["mode"] == "kv_same" else torch.from_numpy(value)
    tot = additive(c, kpm, attn)
    kpm_t, attn_t = pytorch_masks(c, None if kpm is None else torch.from_numpy(kpm.copy()),
                                  None if attn is None else torch.from_numpy(attn.copy()))
    nw, avg = c["need_weights"], not c["per_head"]
    out, w, notes, native_ok = torch_float64(name, c, m64, q64, k64, v64, kpm_t, attn_t, tot)

    # independent implementation
    P64 = {k2: torch.from_numpy(v2) for k2, v2 in params}
    own_out, own_wph = own_mha(c, P64, q64, k64, v64, tot)
    own_w = None
    if nw:
        own_w = own_wph if c["per_head"] else own_wph.sum(dim=1) / H
        if not batched:
            own_w = own_w.squeeze(0)
    if not (same(out, own_out) and same(w, own_w)):
        raise AssertionError(f"{name}: own implementation disagrees with PyTorch")

    # expected shapes
    Sp = S + int(c["add_bias_kv"]) + int(c["add_zero_attn"])
    assert tuple(out.shape) == input_shape(c, L, E)
    if nw:
        if batched:
            ws = (N, L, Sp) if avg else (N, H, L, Sp)
        else:
            ws = (L, Sp) if avg else (H, L, Sp)
        assert tuple(w.shape) == ws, (w.shape, ws)

    lines = ["# clmha golden case, generated by tools/make_golden.py"
             f" (PyTorch {torch.__version__})",
             "# float64 layer (forward only): parameters (PyTorch's initialisation in float64),"
             " inputs and float masks drawn in float64, none of them float32-representable;"
             " expected values computed by PyTorch in float64"]
    lines += ["# " + t for t in notes]
    lines += case_lines(name, c, E, H, kdim, vdim, " dtype f64", params, query, key, value,
                        kpm, attn, "f64")
    lines += tensor_text("output", "f64", out.numpy())
    if nw:
        lines += tensor_text("weights", "f64", w.numpy())
    lines.append("end")
    return "\n".join(lines) + "\n"


def generator_of(c):
    """The function that makes the text of case c's file."""
    return {"f32": generate, "f64": generate_f64}.get(c["dtype"], generate_dtype)


def fmt(dtype, x):
    if dtype == "u8":
        return "1" if x else "0"
    if dtype == "f32":
        return "%.9g" % float(np.float32(x))
    return "%.17g" % float(x)


def tensor_text(name, dtype, arr):
    arr = np.asarray(arr)
    if dtype == "f32":
        assert arr.dtype == np.float32
    elif dtype == "f64":
        assert arr.dtype == np.float64
    shape = arr.shape if arr.ndim > 0 else (1,)
    assert 1 <= len(shape) <= 4
    out = [f"tensor {name} {dtype} {len(shape)} " + " ".join(str(d) for d in shape)]
    flat = arr.reshape(-1)
    per = 16 if dtype == "u8" else (8 if dtype == "f32" else 4)
    row = shape[-1]
    for start in range(0, flat.size, row):
        seg = flat[start:start + row]
        for j in range(0, seg.size, per):
            out.append(" ".join(fmt(dtype, x) for x in seg[j:j + per]))
    return out



def draw_inputs(c, draw, kdim, vdim):
    """The case's query, key and value (None where the mode has none) drawn with draw(shape),
    in that order."""
    E, L, S = c["E"], c["L"], c["S"]
    query = draw(input_shape(c, L, E))
    key = value = None
    if c["mode"] == "cross":
        key = draw(input_shape(c, S, kdim))
        value = draw(input_shape(c, S, vdim))
    elif c["mode"] == "kv_same":
        assert kdim == vdim
        key = draw(input_shape(c, S, kdim))
    return query, key, value


def case_lines(name, c, E, H, kdim, vdim, layer_tail, params, query, key, value, kpm, attn,
               fdt="f32"):
    """The lines of a case file from its name through its inputs: the case, layer (ending
    with layer_tail) and call lines, the parameters, query, key, value and masks, the float
    ones as tensors of dtype fdt (f32, or f64 for the float64 layer cases)."""
    lines = [f"case {name}",
             f"layer embed_dim {E} num_heads {H} kdim {kdim} vdim {vdim} "
             f"bias {int(c['bias'])} add_bias_kv {int(c['add_bias_kv'])} "
             f"add_zero_attn {int(c['add_zero_attn'])} batch_first {int(c['batch_first'])} "
             f"dropout {c['dropout']:.9g}" + layer_tail,
             f"call need_weights {int(c['need_weights'])} per_head_weights {int(c['per_head'])} "
             f"is_causal {int(c['causal'])} training 0 kpm {c['kpm']} attn {c['attn']} "
             f"attn_per_batch {int(c['attn_shape'] == 'per_batch')}"]
    for pname, arr in params:
        lines += tensor_text(pname, fdt, arr)
    lines += tensor_text("query", fdt, query)
    if key is not None:
        lines += tensor_text("key", fdt, key)
    if value is not None:
        lines += tensor_text("value", fdt, value)
    if kpm is not None:
        fm = to_file_mask(c["kpm"], kpm)
        lines += tensor_text("key_padding_mask", "u8" if fm.dtype == np.uint8 else fdt, fm)
    if attn is not None:
        fm = to_file_mask(c["attn"], attn)
        lines += tensor_text("attn_mask", "u8" if fm.dtype == np.uint8 else fdt, fm)
    return lines

def check(out_dir, incs):
    """Recomputes every case on its committed inputs and compares (golden_compare): the float64
    layer cases with its F64_TOLERANCE, the others with its TOLERANCE.
    incs: the expected text of cases.inc, dtype_cases.inc and f64_cases.inc by file name."""
    bad = 0
    want = dict(incs)
    for c in CASES + DTYPE_CASES + F64_CASES:
        want[f"{c['name']}.txt"] = c
    for fn, c in want.items():
        p = os.path.join(out_dir, fn)
        if not os.path.exists(p):
            why = "missing"
        elif fn in incs:
            why = None if open(p).read() == c else "differs"
        else:
            have = open(p).read()
            tol = ((golden_compare.F64_ATOL, golden_compare.F64_RTOL) if c["dtype"] == "f64"
                   else (golden_compare.ATOL, golden_compare.RTOL))
            try:
                why = golden_compare.golden_text_differs(
                    have, generator_of(c)(c, golden_compare.GivenInputs(have)), *tol)
            except golden_compare.NotThisDraw as e:
                why = str(e)
        if why:
            print(f"differs: {p}: {why}", file=sys.stderr)
            bad += 1
    print(f"{len(want) - bad}/{len(want)} files match: float32 inputs this script's draw "
          f"({golden_compare.F32_TOLERANCE}; float16/bfloat16 cases: rounded to the dtype, within"
          f" one step of it), float64 results recomputed on them ({golden_compare.TOLERANCE}),"
          f" PyTorch's float16/bfloat16 results within {TORCH_BASELINE_STEPS} steps of the dtype"
          f" of their largest magnitude; float64 layer cases: inputs this script's draw"
          f" ({golden_compare.F64_DRAW_TOLERANCE}), results recomputed on them"
          f" ({golden_compare.F64_TOLERANCE}); all else identical")
    return 1 if bad else 0


def print_dtype_errors():
    """The table of PyTorch's own errors in the dtype cases generated in this run."""
    if not DTYPE_ERRORS:
        return
    print(f"{'case':40s} {'torch.output err':>16s} {'max|output|':>12s} "
          f"{'torch.weights err':>17s} {'max|weights|':>12s}")
    for n, d in DTYPE_ERRORS.items():
        we = "-" if d["weights_err"] is None else f"{d['weights_err']:.3e}"
        wm = "-" if d["weights_max"] is None else f"{d['weights_max']:.3e}"
        print(f"{n:40s} {d['output_err']:16.3e} {d['output_max']:12.3e} {we:>17s} {wm:>12s}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--out", default=os.path.join(here, "..", "tests", "golden"))
    ap.add_argument("--check", action="store_true",
                    help="compare with the files on disk instead of writing")
    ap.add_argument("--only", nargs="+", metavar="CASE",
                    help="write only these cases' files (and the .inc files), keep the others")
    args = ap.parse_args()
    out_dir = os.path.normpath(args.out)
    names = [c["name"] for c in CASES]
    dtype_names = [c["name"] for c in DTYPE_CASES]
    f64_names = [c["name"] for c in F64_CASES]
    all_names = names + dtype_names + f64_names
    assert len(set(all_names)) == len(all_names)
    incs = {
        "cases.inc": ("/* generated by tools/make_golden.py: the golden case names */\n" +
                      "".join(f'"{n}",\n' for n in names)),
        "dtype_cases.inc": ("/* generated by tools/make_golden.py: the golden case names of"
                            " float16/bfloat16 layers */\n" +
                            "".join(f'"{n}",\n' for n in dtype_names)),
        "f64_cases.inc": ("/* generated by tools/make_golden.py: the golden case names of"
                          " float64 layers */\n" +
                          "".join(f'"{n}",\n' for n in f64_names)),
    }
    if args.check:
        return check(out_dir, incs)
    if args.only:
        unknown = set(args.only) - set(all_names)
        if unknown:
            ap.error(f"unknown cases: {' '.join(sorted(unknown))}")
    todo = [c for c in CASES + DTYPE_CASES + F64_CASES
            if not args.only or c["name"] in args.only]
    files = {f"{c['name']}.txt": generator_of(c)(c) for c in todo}
    files.update(incs)
    os.makedirs(out_dir, exist_ok=True)
    for fn in os.listdir(out_dir) if not args.only else ():
        if (fn.endswith(".txt") or fn in incs) and fn not in files:
            os.remove(os.path.join(out_dir, fn))
    total = 0
    for fn, text in files.items():
        with open(os.path.join(out_dir, fn), "w") as f:
            f.write(text)
        total += len(text)
    print(f"wrote {len(todo)} cases to {out_dir} ({total} bytes)")
    print_dtype_errors()
    return 0


if __name__ == "__main__":
    sys.exit(main())
