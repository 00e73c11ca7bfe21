#!/usr/bin/env python3
"""Generates the golden cases of the `clmha run` and `clmha sdpa` commands with PyTorch.

For every case it writes tests/cli/<case>/:

    layer.safetensors       the layer, written by tools/export_mha.py (F32; F16 / F64 cases)
    query.npy               float32 inputs; key.npy and value.npy only for cross-attention
    key_padding_mask.npy    optional: bool (True = may not attend) or float32 (added)
    attn_mask.npy           optional: bool or float32, (L, S) or (N*H, L, S) / (H, L, S)
    args                    one line: the extra flags (--is-causal --need-weights --window L,R
                            --softcap C --alibi ...), may be empty
    expected_output.npy     float64
    expected_weights.npy    float64, only with --need-weights
    grad_output.npy         gradient cases: float32, the output's gradient (--grad-output)
    grad_weights.npy        gradient cases with weights: float32, their gradient (--grad-weights)
    expected_grads/         gradient cases: float64, one <name>.npy per gradient that
                            `clmha run --grads-dir` writes (query, key, value as given, the
                            parameters by state_dict name, float masks; sinks.npy for a layer
                            with sinks)

Seed-module and model cases (module="continuiti", "classic" or "model") hold in layer.safetensors
a state_dict as `safetensors.torch.save_file(module.state_dict(), path)` writes it: no
metadata, so `args` passes --num-heads (and --prefix for a model's file). Their expected output
is the module's own forward in float64 (continuiti's MultiHeadAttention, the classic
w_q/w_k/w_v/w_concat module, written out below as ../shared/seeds/ 000 and 001 define them).

tests/cli/torch_save/ holds two small files written by torch.save (module.pt, the default zip
format; legacy.pt, the legacy pickle format) that `clmha run --layer` must refuse with how to
convert them; --check does not compare them (torch versions write different bytes).

and tests/cli/cases.inc, the list of case names (`"name",` lines) for tests/cli/test_cli.c. Case
folders no longer generated (those holding an `args` file) are removed.

The `clmha sdpa` cases (SDPA_CASES, folders tests/cli/sdpa_<name>/, listed in
tests/cli/sdpa_cases.inc) hold already projected heads instead of a layer:

    query.npy, key.npy, value.npy   float32, (N, H, L, D) / (N, H_kv, S, D) with --layout nhld,
                                    (N, L, H, D) / (N, S, H_kv, D) with --layout nlhd; 3-D
                                    unbatched (no N)
    attn_mask.npy           optional: bool (True = may attend, SDPA's polarity) or float32
                            (added to the scores), in a shape SDPA broadcasts to (N, H, L, S)
    alibi_slopes.npy        optional: float32 (H), ALiBi's slopes (--alibi-slopes)
    sinks.npy               optional: float32 (H), attention sinks (--sinks)
    args                    one line: the extra flags (--layout nlhd --is-causal --enable-gqa
                            --scale S --window L,R --softcap C --alibi --kv-cache-prefix P),
                            may be empty
    expected_output.npy     float64
    expected_lse.npy        float64, only for cases run with --lse-output: the log-sum-exp of
                            every score row, (N, H, L)
    expected_weights.npy    float64, only for cases run with --weights-output: (N, H, L, S)
    grad_output.npy         gradient cases: float32, the output's gradient (--grad-output)
    expected_grads/         gradient cases: float64, query.npy, key.npy, value.npy,
                            attn_mask.npy (float masks) and sinks.npy (with sinks.npy), as
                            `clmha sdpa --grads-dir` writes them

Their expected values are scaled dot-product attention written out in float64 (PyTorch 1.13 has
no F.scaled_dot_product_attention): softmax(q @ k^T * scale + mask) @ v with scale 1/sqrt(D)
unless the case sets one, a bool mask as masked_fill(~mask, -inf), is_causal as the top-left
tril(ones(L, S)) mask, a window (--window LEFT,RIGHT) as the boolean (L, S) mask of keys j
with i - LEFT <= j <= i + RIGHT (-1: unbounded), grouped-query attention as repeat_interleave of the key/value heads by
H / H_kv, the log-sum-exp as torch.logsumexp of the masked scores; gradients by torch.autograd
on the same float64 computation (a float mask's gradient summed over its broadcast dimensions by
autograd). Masks are drawn so that no query row is fully masked. A case with kv_prefix P passes
--kv-cache-prefix P only in `args` (incremental decoding through a KV cache: a call for tokens
[0, P), then one per token); its expected output stays the one-shot call's, which the decoded
causal output equals.

Expected values: nn.MultiheadAttention in float64 (eval mode, so dropout is inactive) on
exactly the float32 inputs and on the parameters the layer file holds as clmha reads them: F16
values converted exactly, F64 values rounded to float32 (clmha keeps float parameters), masks as
PyTorch 1.13 takes them (float masks in float64). PyTorch 1.13 has no is_causal: the causal cases
pass the boolean mask triu(ones(L, S), 1) (True = masked), or-ed into the case's own boolean
attn_mask. Masks are drawn so that no query row is fully masked. PyTorch 1.13 cannot take a
float key_padding_mask together with a float attn_mask: such cases pass it the sum of the two as
one (N*H, L, S) float attn_mask (the additive semantics clmha implements), built by autograd
operations so that both masks get their gradients.

Sliding-window cases: `file_window` (left, right) is written into layer.safetensors as
__metadata__ window, `window` is passed as `--window LEFT,RIGHT` (which replaces the file's); the
window in effect is given to PyTorch 1.13 (which has none) as an explicit boolean mask, key j
allowed for query i iff i - left <= j <= i + right (-1: that side unbounded), or-ed into the
case's boolean attn_mask (with causality) or filled with -inf into a float one. PyTorch pads the
attn_mask with zeros for the keys of add_bias_kv and add_zero_attn: they are not windowed, as in
clmha.

Soft-capping and ALiBi cases: `file_softcap`, `file_alibi` (and `file_slopes`, drawn alibi_slopes)
go into layer.safetensors as __metadata__ softcap, alibi and the tensor alibi_slopes; `softcap` and
`alibi` are passed as --softcap C and --alibi. PyTorch 1.13 has neither: those cases' module is
written out in float64 (manual_mha(), which gives nn.MultiheadAttention's results on every other
case to 3e-16), the scaled score s becoming c*tanh(s/c) (every key, the appended ones too), then
-slope_h*|i - j| for the real keys j < S (not those of add_bias_kv and add_zero_attn; the
geometric slopes unless the file has its own), then the masks. The sdpa cases apply the same to
their scores (score_mods()).

Attention sinks: `file_sinks` draws (H) sinks into layer.safetensors as the tensor sinks; the
sdpa cases' `sinks` writes them to sinks.npy (--sinks). PyTorch 1.13 has none: manual_mha() and
sdpa_reference() append the head's sink to every row of the masked scores as one more logit
column (a key with no value), take the softmax over the row with it and drop that column
(sink_softmax()); the log-sum-exp includes it, and the sinks' gradient comes from autograd.

Expected gradients: torch.autograd on the same float64 module, from the float32 grad_output
(and grad_weights) drawn for the case; the query's gradient in self-attention is the whole
gradient of the one tensor passed as query, key and value, as in PyTorch.

Run with a Python that has PyTorch (tested with Debian's python3-torch 1.13):

    /usr/bin/python3 tools/make_cli_cases.py [--out tests/cli] [--check]

--check regenerates into a temporary folder and exits non-zero when any file differs: the float64
expected outputs within the tolerance of tools/golden_compare.py (PyTorch's float64 digits vary
between CPU models), every other file byte for byte.
"""

import argparse
import copy
import json
import math
import os
import shutil
import sys
import tempfile
import zlib

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import export_mha  # noqa: E402
import golden_compare  # noqa: E402
from make_golden import window_outside, with_masked  # noqa: E402

torch.set_grad_enabled(True)  # keeps nn.MultiheadAttention off its native fast path


def C(name, **kw):
    d = dict(name=name, E=8, H=2, kdim=None, vdim=None, bias=True, add_bias_kv=False,
             add_zero_attn=False, batch_first=False, dropout=0.0, dtype="F32",
             L=5, S=None, N=2, cross=False, kpm=None, attn=None, causal=False,
             need_weights=True, per_head=False, grads=False, given=None, module="mha",
             prefix=None, window=None, file_window=None, softcap=None, alibi=False,
             file_softcap=None, file_alibi=False, file_slopes=False, file_sinks=False,
             seq_lens=None, kv_seq_lens=None)
    for k in kw:
        if k not in d:
            raise KeyError(k)
    d.update(kw)
    if d["seq_lens"] is not None:  # a packed batch: (T, E) query, (T_kv, kdim) key, ...
        assert d["kv_seq_lens"] is None or len(d["kv_seq_lens"]) == len(d["seq_lens"])
        assert d["kv_seq_lens"] is None or d["cross"]
        d["N"], d["L"] = None, sum(d["seq_lens"])
        d["S"] = sum(d["kv_seq_lens"] or d["seq_lens"])
        assert d["L"] <= 12 and d["S"] <= 12 and not d["need_weights"]
    if d["S"] is None:
        d["S"] = d["L"]
    if d["given"] is None:
        d["given"] = "qkv" if d["cross"] else "q"
    assert d["given"] in ("q", "qk", "qv", "qkv")
    if d["given"] != "qkv":  # key or value is the query's tensor
        assert d["S"] == d["L"] and d["kdim"] is None
    if d["given"] in ("q", "qv"):
        assert d["vdim"] is None
    packed = d["seq_lens"] is not None
    assert d["E"] <= 16 and (packed or (d["L"] <= 7 and d["S"] <= 7)) and (d["N"] or 1) <= 2
    assert not d["file_slopes"] or d["file_alibi"]
    return d


# kpm: None | "bool" | "float"; attn: None | "bool2d" | "float2d" | "bool3d" | "float3d"
CASES = [
    C("self_attention"),
    C("cross_attention", cross=True, L=3, S=6),
    C("kdim_vdim", E=12, H=3, kdim=5, vdim=7, cross=True, L=4, S=6),
    C("no_bias", bias=False, cross=True, L=4, S=5, need_weights=False),
    C("add_bias_kv", add_bias_kv=True),
    C("add_zero_attn", add_zero_attn=True, cross=True, L=4, S=3, per_head=True),
    C("batch_first", batch_first=True, cross=True, L=3, S=5),
    C("kpm_bool", kpm="bool", cross=True, L=4, S=6),
    C("kpm_float", kpm="float", cross=True, L=4, S=6),
    C("attn_mask_bool_2d", attn="bool2d", L=6),
    C("attn_mask_float_3d", attn="float3d", cross=True, L=4, S=5, per_head=True),
    C("causal", causal=True, L=6),
    C("causal_cross", causal=True, cross=True, L=4, S=7),
    C("causal_kpm", causal=True, kpm="bool", L=6, batch_first=True),
    C("unbatched_weights", N=None, L=5),
    C("unbatched_masks", N=None, cross=True, L=4, S=6, kpm="bool", attn="float3d",
      per_head=True),
    C("per_head_weights", E=16, H=4, L=4, per_head=True),
    C("dropout_eval", dropout=0.5),
    C("layer_f16", dtype="F16", cross=True, L=3, S=4),
    C("layer_f64", dtype="F64", H=4, kdim=6, vdim=8, add_bias_kv=True, cross=True, L=4, S=5),
    # Gradient cases (`clmha run --grad-output --grads-dir`).
    C("grad_self", grads=True, need_weights=False),
    C("grad_kdim_vdim", grads=True, E=12, H=3, kdim=5, vdim=7, cross=True, L=4, S=6,
      need_weights=False),
    C("grad_float_masks_bias_kv", grads=True, add_bias_kv=True, cross=True, L=4, S=6,
      kpm="float", attn="float2d", need_weights=False),
    C("grad_batch_first", grads=True, batch_first=True, cross=True, L=3, S=5, attn="float3d",
      need_weights=False),
    C("grad_unbatched", grads=True, N=None, L=5, attn="float3d", need_weights=False),
    C("grad_weights_per_head", grads=True, cross=True, L=4, S=5, per_head=True),
    C("grad_key_only", grads=True, given="qk", causal=True, L=5, need_weights=False),
    C("grad_value_only", grads=True, given="qv", L=4, need_weights=False),
    # Sliding windows: the layer file's (metadata window), and --window replacing it. The keys
    # of add_bias_kv and add_zero_attn are not windowed.
    C("window_file_causal_bias_kv", file_window=(2, 0), causal=True, add_bias_kv=True, L=7,
      per_head=True),
    C("grad_window_override_cross", grads=True, file_window=(0, 0), window=(2, 1), cross=True,
      add_zero_attn=True, kpm="bool", attn="float2d", L=6, S=7, need_weights=False),
    # Soft-capping and ALiBi: the layer file's (metadata softcap and alibi, the tensor
    # alibi_slopes), and --softcap / --alibi over a file without them. The appended keys of
    # add_bias_kv are soft-capped but get no ALiBi term.
    C("softcap_alibi_file_causal", file_softcap=2.0, file_alibi=True, file_slopes=True,
      causal=True, L=7, per_head=True),
    C("grad_softcap_override_cross", grads=True, softcap=1.5, alibi=True, cross=True,
      add_bias_kv=True, attn="float2d", L=5, S=7, need_weights=False),
    # Attention sinks: the layer file's tensor sinks (one logit per head in every row's
    # softmax denominator). The first also runs through --decode-chunk 2 causally, the third
    # (no masks, no causality) with the whole key in the first call.
    C("sinks_file_causal_weights", file_sinks=True, causal=True, H=4, E=16, L=6, per_head=True),
    C("grad_sinks_cross_float_mask", grads=True, file_sinks=True, cross=True, add_bias_kv=True,
      attn="float2d", L=5, S=6, need_weights=False),
    C("sinks_cross_decode_chunk", file_sinks=True, cross=True, batch_first=True, L=5, S=6,
      file_softcap=3.0),
    # Seed modules and a model's checkpoint (need_weights: the seed modules return none).
    C("seed_continuiti", module="continuiti", batch_first=True, cross=True, L=4, S=5,
      need_weights=False),
    C("seed_continuiti_no_bias", module="continuiti", bias=False, batch_first=True, L=5,
      need_weights=False),
    C("seed_classic", module="classic", E=12, H=3, batch_first=True, cross=True, L=3, S=6,
      need_weights=False),
    C("model_prefix", module="model", prefix="encoder.layers.1.self_attn", cross=True, L=4,
      S=5),
    C("model_prefix_continuiti", module="model", prefix="head.attention.", batch_first=True,
      L=5, need_weights=False),
    # Packed batches (--seq-lens, --kv-seq-lens): each sequence is its own unbatched call of the
    # module, the results one after another; a sequence may have no queries (its keys are then
    # seen by none and get zero gradients).
    C("packed_self_causal", seq_lens=(3, 1, 5), causal=True, need_weights=False),
    C("packed_cross_kdim_bias_kv", E=12, H=3, kdim=5, vdim=7, cross=True, seq_lens=(2, 0, 4),
      kv_seq_lens=(3, 2, 5), add_bias_kv=True, need_weights=False),
    C("grad_packed_cross_causal", grads=True, cross=True, seq_lens=(4, 1, 3),
      kv_seq_lens=(2, 6, 3), causal=True, need_weights=False),
    C("grad_packed_self_zero_attn", grads=True, seq_lens=(5, 2), add_zero_attn=True,
      need_weights=False),
]


def packed_forward(c, m64, q64, k64, v64):
    """A packed case's output: one unbatched call of the module per sequence (a sequence
    without queries skipped), the outputs one after another."""
    outs, q0, k0 = [], 0, 0
    for L, S in zip(c["seq_lens"], c["kv_seq_lens"] or c["seq_lens"]):
        if L:
            causal = torch.triu(torch.ones(L, S, dtype=torch.bool), 1) if c["causal"] else None
            out, _ = m64(q64[q0:q0 + L], k64[k0:k0 + S], v64[k0:k0 + S], attn_mask=causal,
                         need_weights=False)
            outs.append(out)
        q0, k0 = q0 + L, k0 + S
    return torch.cat(outs)


# ---- the seed modules (../shared/seeds/), written out as their sources define them ----------

class ContinuitiScaledDotProductAttention(torch.nn.Module):
    """continuiti's default attention: torch.nn.functional.scaled_dot_product_attention(query,
    key, value, attn_mask, dropout_p), written out (PyTorch 1.13 has no such function);
    dropout_p 0 and no mask here."""

    def forward(self, query, key, value, attn_mask=None):
        assert attn_mask is None
        scores = query @ key.transpose(-2, -1) / math.sqrt(query.size(-1))
        return torch.softmax(scores, dim=-1) @ value


class ContinuitiMultiHeadAttention(torch.nn.Module):
    """continuiti.networks.MultiHeadAttention (seed 000), without its mask branch."""

    def __init__(self, hidden_dim, n_heads, attention=None, dropout_p=0, bias=True):
        super().__init__()
        self.hidden_dim = hidden_dim
        self.n_heads = n_heads
        self.dropout_p = dropout_p
        self.bias = bias
        if attention is None:
            attention = ContinuitiScaledDotProductAttention()
        self.attention = attention
        self.head_dim = hidden_dim // n_heads
        assert self.head_dim * n_heads == hidden_dim, "hidden_dim must be divisible by n_heads"
        self.query_project = torch.nn.Linear(hidden_dim, hidden_dim, bias=bias)
        self.key_project = torch.nn.Linear(hidden_dim, hidden_dim, bias=bias)
        self.value_project = torch.nn.Linear(hidden_dim, hidden_dim, bias=bias)
        self.out_project = torch.nn.Linear(hidden_dim, hidden_dim, bias=bias)

    def forward(self, query, key, value, attn_mask=None):
        assert query.ndim == key.ndim == value.ndim == 3
        batch_size = query.size(0)
        query = self.query_project(query)
        key = self.key_project(key)
        value = self.value_project(value)
        query = query.view(batch_size, -1, self.n_heads, self.head_dim).transpose(1, 2)
        key = key.view(batch_size, -1, self.n_heads, self.head_dim).transpose(1, 2)
        value = value.view(batch_size, -1, self.n_heads, self.head_dim).transpose(1, 2)
        attn_out = self.attention(query=query, key=key, value=value, attn_mask=attn_mask)
        attn_out = attn_out.transpose(1, 2).reshape(batch_size, -1, self.hidden_dim)
        return self.out_project(attn_out)


class ScaleDotProductAttention(torch.nn.Module):
    """The classic module's attention (hyunwoongko/transformer, which seed 001 cites)."""

    def __init__(self):
        super().__init__()
        self.softmax = torch.nn.Softmax(dim=-1)

    def forward(self, q, k, v, mask=None, e=1e-12):
        batch_size, head, length, d_tensor = k.size()
        score = (q @ k.transpose(2, 3)) / math.sqrt(d_tensor)
        if mask is not None:
            score = score.masked_fill(mask == 0, -10000)
        score = self.softmax(score)
        return score @ v, score


class ClassicMultiHeadAttention(torch.nn.Module):
    """The classic split-heads module (seed 001); concat() returns its tensor (the seed's ends
    in a bare `return`)."""

    def __init__(self, d_model, n_head):
        super().__init__()
        self.n_head = n_head
        self.attention = ScaleDotProductAttention()
        self.w_q = torch.nn.Linear(d_model, d_model)
        self.w_k = torch.nn.Linear(d_model, d_model)
        self.w_v = torch.nn.Linear(d_model, d_model)
        self.w_concat = torch.nn.Linear(d_model, d_model)

    def forward(self, q, k, v, mask=None):
        q, k, v = self.w_q(q), self.w_k(k), self.w_v(v)
        q, k, v = self.split(q), self.split(k), self.split(v)
        out, attention = self.attention(q, k, v, mask=mask)
        out = self.concat(out)
        return self.w_concat(out)

    def split(self, tensor):
        batch_size, length, d_model = tensor.size()
        d_tensor = d_model // self.n_head
        return tensor.view(batch_size, length, self.n_head, d_tensor).transpose(1, 2)

    def concat(self, tensor):
        batch_size, head, length, d_tensor = tensor.size()
        d_model = head * d_tensor
        return tensor.transpose(1, 2).contiguous().view(batch_size, length, d_model)


class SmallModel(torch.nn.Module):
    """A model whose state_dict holds two nn.MultiheadAttention (encoder.layers.{0,1}.self_attn,
    sequence first), a Linear and a LayerNorm per layer, and a continuiti attention
    (head.attention)."""

    def __init__(self, E, H):
        super().__init__()
        layer = lambda: torch.nn.ModuleDict(dict(  # noqa: E731
            self_attn=torch.nn.MultiheadAttention(E, H), linear1=torch.nn.Linear(E, 2 * E),
            norm1=torch.nn.LayerNorm(E)))
        self.encoder = torch.nn.Module()
        self.encoder.layers = torch.nn.ModuleList([layer(), layer()])
        self.head = torch.nn.Module()
        self.head.attention = ContinuitiMultiHeadAttention(E, H)


def save_file(state, path):
    """safetensors.torch.save_file(state, path) without metadata, written by hand: the tensors
    as float32, by name."""
    header, blobs, offset = {}, [], 0
    for name in sorted(state):
        raw = state[name].detach().cpu().float().numpy().astype("<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(state[name].shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + b"".join(blobs))


def make_seed_layer(c, path, given_dir=None):
    """The layer file of a seed or model case; returns the float64 module (a callable on
    (query, key, value)) that computes the expected output from what clmha reads."""
    seed = seed_of(c["name"])
    torch.manual_seed(seed)
    if c["module"] == "continuiti":
        m = ContinuitiMultiHeadAttention(c["E"], c["H"], bias=c["bias"])
    elif c["module"] == "classic":
        m = ClassicMultiHeadAttention(c["E"], c["H"])
    else:
        m = SmallModel(c["E"], c["H"])
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    save_file(m.state_dict(), path)
    if given_dir is not None:
        adopt_committed_layer(path, given_dir)
    tensors, _ = export_mha.read(path)
    m64 = copy.deepcopy(m).double().eval()
    m64.load_state_dict({k: torch.from_numpy(v.astype(np.float64)) for k, v in tensors.items()},
                        strict=True)
    if c["module"] != "model":
        return m64
    sub = m64
    for part in c["prefix"].strip(".").split("."):
        sub = getattr(sub, part) if not part.isdigit() else sub[int(part)]
    return sub


def write_torch_save(out_dir):
    """tests/cli/torch_save/: a module saved by torch.save (zip) and its state_dict in the
    legacy pickle format."""
    d = os.path.join(out_dir, "torch_save")
    os.makedirs(d, exist_ok=True)
    torch.manual_seed(0)
    m = torch.nn.MultiheadAttention(4, 2)
    torch.save(m, os.path.join(d, "module.pt"))
    torch.save(m.state_dict(), os.path.join(d, "legacy.pt"), _use_new_zipfile_serialization=False)


def adopt_committed_layer(path, given_dir):
    """--check: the committed layer file in given_dir replaces the drawn one at path once it is
    shown to be the same draw (its header identical, each tensor by golden_compare.check_draw)."""
    committed = os.path.join(given_dir, os.path.basename(path))
    with open(committed, "rb") as f:
        blob = f.read()
    if header_of(blob) != header_of(open(path, "rb").read()):
        raise golden_compare.NotThisDraw("layer.safetensors: header differs from the draw")
    drawn, _ = export_mha.read(path)
    have, _ = export_mha.read(committed)
    for k, v in drawn.items():
        golden_compare.check_draw(f"layer.safetensors {k}", have[k], v)
    with open(path, "wb") as f:
        f.write(blob)


def seed_of(name):
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


def layout(c, seq, feat):
    if c["N"] is None:
        return (seq, feat)
    return (c["N"], seq, feat) if c["batch_first"] else (seq, c["N"], feat)


def make_layer(c, path, given_dir=None):
    """Writes the layer file; returns the float64 module holding what clmha reads from it.
    With given_dir (--check), the committed layer file there replaces the drawn one once it is
    shown to be the same draw (golden_compare.check_draw, tensor by tensor)."""
    seed = seed_of(c["name"])
    m = export_mha.random_module(c["E"], c["H"], c["kdim"], c["vdim"], c["bias"],
                                 c["add_bias_kv"], c["add_zero_attn"], c["batch_first"],
                                 c["dropout"], seed)
    if c["dtype"] == "F64":  # parameters that float32 cannot hold exactly
        m = m.double()
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.3)
    slopes = None
    if c["file_slopes"]:  # a draw of its own: the other tensors stay those of the seed
        slopes = np.random.default_rng(seed + 3).uniform(0.05, 1.0, c["H"]).astype(np.float32)
    sinks = None
    if c["file_sinks"]:  # likewise
        sinks = np.random.default_rng(seed + 4).uniform(-1.0, 2.0, c["H"]).astype(np.float32)
    export_mha.export(m, path, dtype=c["dtype"], window=c["file_window"],
                      softcap=c["file_softcap"], alibi=c["file_alibi"], alibi_slopes=slopes,
                      sinks=sinks)
    if given_dir is not None:
        adopt_committed_layer(path, given_dir)
    tensors, _ = export_mha.read(path)
    file_slopes = tensors.pop("alibi_slopes", None)
    file_sinks = tensors.pop("sinks", None)
    m64 = copy.deepcopy(m).double().eval()
    state = {k: torch.from_numpy(v.astype(np.float32).astype(np.float64))
             for k, v in tensors.items()}
    m64.load_state_dict(state, strict=True)
    # The slopes as clmha reads them (float32), None: the layer's geometric ones.
    m64.clmha_alibi_slopes = None if file_slopes is None else \
        file_slopes.astype(np.float32).astype(np.float64)
    # The sinks likewise (None: the layer has none).
    m64.clmha_sinks = None if file_sinks is None else \
        file_sinks.astype(np.float32).astype(np.float64)
    return m64


def header_of(blob):
    """The length word and JSON header of a safetensors file."""
    return blob[:8 + int.from_bytes(blob[:8], "little")]


def window_keep(L, S, window):
    """The bool (L, S) of keys j that query i may attend under the sliding window (left, right):
    i - left <= j <= i + right, -1 leaving a side unbounded; all True for None."""
    if window is None:
        return np.ones((L, S), dtype=bool)
    return ~window_outside(L, S, window).numpy()


def case_window(c):
    """The window in effect: --window's, else the layer file's, else None."""
    return c["window"] if c["window"] is not None else c["file_window"]


def case_variants(c, m64):
    """(softcap, slopes) in effect: --softcap's, else the layer file's (None: off); with ALiBi
    (--alibi or the file's) the file's alibi_slopes, else the geometric slopes as a float32
    layer holds them; None without ALiBi."""
    softcap = c["softcap"] if c["softcap"] is not None else c["file_softcap"]
    slopes = None
    if c["alibi"] or c["file_alibi"]:
        slopes = getattr(m64, "clmha_alibi_slopes", None)
        if slopes is None:
            slopes = export_mha.alibi_slopes(c["H"]).astype(np.float32).astype(np.float64)
    return (softcap or None), slopes


def score_mods(scores, softcap, slopes, real):
    """Scaled scores (..., H, L, S') with soft-capping (c*tanh(s/c), every key) and ALiBi
    (-slope_h*|i - j| for the real keys j < @p real, query i at position i) applied; the heads
    are the third dimension from the end."""
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if slopes is not None:
        L, Sp = scores.shape[-2], scores.shape[-1]
        dist = (torch.arange(L).reshape(L, 1) - torch.arange(Sp).reshape(1, Sp)).abs().double()
        dist[:, real:] = 0
        scores = scores - torch.from_numpy(np.asarray(slopes)).reshape(-1, 1, 1) * dist
    return scores


def sink_softmax(scores, sinks):
    """softmax over the last dimension of scores (..., H, L, S) with attention sinks: the head's
    sink (sinks, (H) tensor, or None: a plain softmax) as one more logit column, dropped after
    the softmax (a key with no value). (weights, log-sum-exp of the rows with the sink)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1), torch.logsumexp(scores, dim=-1)
    col = sinks.reshape(-1, 1, 1).expand(scores.shape[:-1] + (1,))
    full = torch.cat([scores, col], dim=-1)
    return torch.softmax(full, dim=-1)[..., :-1], torch.logsumexp(full, dim=-1)


def manual_mha(m, query, key, value, kpm, attn, need_weights, per_head, softcap, slopes,
               sinks=None):
    """nn.MultiheadAttention's forward (PyTorch 1.13, eval mode) written out in float64 on
    m's parameters, with soft-capping and ALiBi (score_mods()) applied to the scaled scores
    before the masks: kpm and attn as the module takes them (bool True = masked, or float
    added; the appended keys of add_bias_kv and add_zero_attn unmasked), and attention sinks
    (sinks, (H), or None) in the softmax (sink_softmax()). (output, weights)."""
    batched = query.dim() == 3
    if not batched:
        query, key, value = (x.unsqueeze(1) for x in (query, key, value))
        kpm = None if kpm is None else kpm.unsqueeze(0)
    elif m.batch_first:
        query, key, value = (x.transpose(0, 1) for x in (query, key, value))
    L, N, E = query.shape
    S, H = key.shape[0], m.num_heads
    D = E // H
    if m._qkv_same_embed_dim:
        w_q, w_k, w_v = m.in_proj_weight.chunk(3)
    else:
        w_q, w_k, w_v = m.q_proj_weight, m.k_proj_weight, m.v_proj_weight
    b_q = b_k = b_v = None
    if m.in_proj_bias is not None:
        b_q, b_k, b_v = m.in_proj_bias.chunk(3)
    lin = torch.nn.functional.linear
    q, k, v = lin(query, w_q, b_q), lin(key, w_k, b_k), lin(value, w_v, b_v)
    if m.bias_k is not None:
        k = torch.cat([k, m.bias_k.repeat(1, N, 1)])
        v = torch.cat([v, m.bias_v.repeat(1, N, 1)])
    q = q.reshape(L, N * H, D).transpose(0, 1)
    k = k.reshape(-1, N * H, D).transpose(0, 1)
    v = v.reshape(-1, N * H, D).transpose(0, 1)
    if m.add_zero_attn:
        k = torch.cat([k, torch.zeros(N * H, 1, D, dtype=k.dtype)], dim=1)
        v = torch.cat([v, torch.zeros(N * H, 1, D, dtype=v.dtype)], dim=1)
    Sp = k.shape[1]
    scores = (q @ k.transpose(1, 2) / math.sqrt(D)).reshape(N, H, L, Sp)
    scores = score_mods(scores, softcap, slopes, S).reshape(N * H, L, Sp)
    pad = torch.nn.functional.pad
    if attn is not None:
        a = pad(attn, (0, Sp - S))
        a = a if a.dim() == 3 else a.unsqueeze(0)
        scores = scores.masked_fill(a, -math.inf) if a.dtype == torch.bool else scores + a
    if kpm is not None:
        km = pad(kpm, (0, Sp - S)).reshape(N, 1, 1, Sp).expand(N, H, L, Sp).reshape(N * H, L, Sp)
        scores = scores.masked_fill(km, -math.inf) if km.dtype == torch.bool else scores + km
    w = sink_softmax(scores.reshape(N, H, L, Sp), sinks)[0].reshape(N * H, L, Sp)
    o = (w @ v).transpose(0, 1).reshape(L, N, E)
    out = lin(o, m.out_proj.weight, m.out_proj.bias)
    w = w.reshape(N, H, L, Sp)
    if not per_head:
        w = w.mean(dim=1)
    if not batched:
        out, w = out.squeeze(1), w.squeeze(0)
    elif m.batch_first:
        out = out.transpose(0, 1)
    return out, (w if need_weights else None)


def draw_masks(c, rng):
    """(kpm, attn, masked): the masks as stored (bool True = may not attend, or float32) and
    the bool (N*H, L, S) of positions that the masks and causality forbid."""
    N, H, L, S = c["N"], c["H"], c["L"], c["S"]
    Nb = N or 1
    kpm = attn = None
    masked = np.zeros((Nb * H, L, S), dtype=bool)
    if c["kpm"]:
        shape = (N, S) if N else (S,)
        if c["kpm"] == "bool":
            kpm = rng.random(shape) < 0.3
            km = kpm.reshape(Nb, 1, 1, S)
        else:
            kpm = rng.standard_normal(shape).astype(np.float32)
            kpm[rng.random(shape) < 0.2] = -np.inf
            km = np.isneginf(kpm).reshape(Nb, 1, 1, S)
        masked |= np.broadcast_to(km, (Nb, H, L, S)).reshape(Nb * H, L, S)
    if c["attn"]:
        shape = (L, S) if c["attn"].endswith("2d") else ((Nb * H, L, S) if N else (H, L, S))
        if c["attn"].startswith("bool"):
            attn = rng.random(shape) < 0.3
            masked |= attn
        else:
            attn = rng.standard_normal(shape).astype(np.float32)
            attn[rng.random(shape) < 0.2] = -np.inf
            masked |= np.isneginf(attn)
    if c["causal"]:
        masked |= np.triu(np.ones((L, S), dtype=bool), 1)
    masked |= ~window_keep(L, S, case_window(c))
    return kpm, attn, masked


def generate(c, out_dir, given_root=None):
    """Writes case c into out_dir/<name>. With given_root (--check), the float32 inputs are the
    committed ones under given_root/<name>, after checking that they are this case's draw, so
    that the float64 expectations are recomputed on exactly the committed inputs."""
    name = c["name"]
    d = os.path.join(out_dir, name)
    os.makedirs(d, exist_ok=True)
    given = None if given_root is None else os.path.join(given_root, name)
    if c["module"] == "mha":
        m64 = make_layer(c, os.path.join(d, "layer.safetensors"), given)
    else:
        m64 = make_seed_layer(c, os.path.join(d, "layer.safetensors"), given)

    def take(fn, drawn):
        if given is None:
            return drawn
        p = os.path.join(given, fn)
        if not os.path.isfile(p):
            raise golden_compare.NotThisDraw(f"{fn}: missing")
        return golden_compare.check_draw(fn, np.load(p, allow_pickle=False), drawn)

    gen = torch.Generator().manual_seed(seed_of(name) + 2)
    rng = np.random.default_rng(seed_of(name))
    E, L, S = c["E"], c["L"], c["S"]
    kdim, vdim = c["kdim"] or E, c["vdim"] or E

    query = torch.randn(layout(c, L, E), generator=gen).numpy().astype(np.float32)
    query = take("query.npy", query)
    np.save(os.path.join(d, "query.npy"), query)
    key = value = query
    if "k" in c["given"]:
        key = torch.randn(layout(c, S, kdim), generator=gen).numpy().astype(np.float32)
        key = take("key.npy", key)
        np.save(os.path.join(d, "key.npy"), key)
    value = key
    if "v" in c["given"]:
        value = torch.randn(layout(c, S, vdim), generator=gen).numpy().astype(np.float32)
        value = take("value.npy", value)
        np.save(os.path.join(d, "value.npy"), value)

    for _ in range(1000):
        kpm, attn, masked = draw_masks(c, rng)
        if not masked.all(axis=-1).any():
            break
    else:
        raise RuntimeError(f"{name}: could not draw masks without fully masked rows")
    if kpm is not None:
        np.save(os.path.join(d, "key_padding_mask.npy"), kpm)
    if attn is not None:
        np.save(os.path.join(d, "attn_mask.npy"), attn)

    # PyTorch 1.13: float masks in the module's precision; causality as a boolean mask.
    def t(a):
        if a is None:
            return None
        x = torch.from_numpy(np.ascontiguousarray(a))
        return x if x.dtype == torch.bool else x.double()

    kpm_t, attn_t = t(kpm), t(attn)
    if c["grads"]:
        for x in (kpm_t, attn_t):
            if x is not None and x.dtype != torch.bool:
                x.requires_grad_(True)
    attn_in = attn_t
    if c["causal"]:
        attn_in = with_masked(attn_in, torch.triu(torch.ones(L, S, dtype=torch.bool), 1))
    if case_window(c) is not None:  # the window as one more boolean mask (True = masked)
        attn_in = with_masked(attn_in, window_outside(L, S, case_window(c)))
    kpm_in = kpm_t
    if kpm_t is not None and kpm_t.dtype != torch.bool and attn_in is not None:
        # One additive (N*H, L, S) mask: attn_mask + key_padding_mask (see the docstring).
        assert attn_in.dtype != torch.bool, "float key_padding_mask with a boolean attn_mask"
        Nb, H = c["N"] or 1, c["H"]
        a3 = attn_in if attn_in.dim() == 3 else attn_in.unsqueeze(0).expand(Nb * H, L, S)
        k3 = kpm_t.reshape(Nb, 1, 1, S).expand(Nb, H, L, S).reshape(Nb * H, L, S)
        attn_in, kpm_in = a3 + k3, None
        if c["N"] is None:
            attn_in = attn_in.reshape(H, L, S)
    q64 = torch.from_numpy(query).double().requires_grad_(c["grads"])
    k64, v64 = q64, q64
    if "k" in c["given"]:
        k64 = torch.from_numpy(key).double().requires_grad_(c["grads"])
    v64 = k64
    if "v" in c["given"]:
        v64 = torch.from_numpy(value).double().requires_grad_(c["grads"])
    softcap, slopes = case_variants(c, m64)
    sinks_t = None
    if getattr(m64, "clmha_sinks", None) is not None:
        sinks_t = torch.from_numpy(m64.clmha_sinks).requires_grad_(c["grads"])
    if c["seq_lens"] is not None:
        assert not softcap and slopes is None and sinks_t is None and kpm is None and attn is None
        out_t, w_t = packed_forward(c, m64, q64, k64, v64), None
    elif softcap or slopes is not None or sinks_t is not None:
        # PyTorch 1.13 has none of them: written out in float64
        assert isinstance(m64, torch.nn.MultiheadAttention)
        out_t, w_t = manual_mha(m64, q64, k64, v64, kpm_in, attn_in, c["need_weights"],
                                c["per_head"], softcap, slopes, sinks_t)
    elif isinstance(m64, torch.nn.MultiheadAttention):
        out_t, w_t = m64(q64, k64, v64, key_padding_mask=kpm_in, attn_mask=attn_in,
                         need_weights=c["need_weights"], average_attn_weights=not c["per_head"])
    else:  # a seed module: batch first, no masks, no weights
        assert c["batch_first"] and kpm_in is None and attn_in is None
        assert not c["need_weights"] and not c["grads"]
        out_t, w_t = m64(q64, k64, v64), None
    out = out_t.detach().numpy()
    assert out.shape == layout(c, L, E) and np.isfinite(out).all(), name
    np.save(os.path.join(d, "expected_output.npy"), out.astype(np.float64))
    if c["need_weights"]:
        w = w_t.detach().numpy()
        assert np.isfinite(w).all(), name
        np.save(os.path.join(d, "expected_weights.npy"), w.astype(np.float64))

    if c["grads"]:
        gy = torch.randn(out.shape, generator=gen).numpy().astype(np.float32)
        gy = take("grad_output.npy", gy)
        np.save(os.path.join(d, "grad_output.npy"), gy)
        outs, grads = [out_t], [torch.from_numpy(gy).double()]
        if c["need_weights"]:
            gw = torch.randn(w_t.shape, generator=gen).numpy().astype(np.float32)
            gw = take("grad_weights.npy", gw)
            np.save(os.path.join(d, "grad_weights.npy"), gw)
            outs.append(w_t)
            grads.append(torch.from_numpy(gw).double())
        torch.autograd.backward(outs, grads)
        g = {"query": q64.grad}
        if "k" in c["given"]:
            g["key"] = k64.grad
        if "v" in c["given"]:
            g["value"] = v64.grad
        for pname, p in m64.named_parameters():
            g[pname] = p.grad
        if attn_t is not None and attn_t.dtype != torch.bool:
            g["attn_mask"] = attn_t.grad
        if kpm_t is not None and kpm_t.dtype != torch.bool:
            g["key_padding_mask"] = kpm_t.grad
        if sinks_t is not None:
            g["sinks"] = sinks_t.grad
        os.makedirs(os.path.join(d, "expected_grads"), exist_ok=True)
        for gname, gv in g.items():
            gv = gv.detach().numpy().astype(np.float64)
            assert np.isfinite(gv).all(), f"{name}: {gname}"
            np.save(os.path.join(d, "expected_grads", gname + ".npy"), gv)

    flags = []
    if c["causal"]:
        flags.append("--is-causal")
    if c["seq_lens"] is not None:
        flags += ["--seq-lens", ",".join(map(str, c["seq_lens"]))]
    if c["kv_seq_lens"] is not None:
        flags += ["--kv-seq-lens", ",".join(map(str, c["kv_seq_lens"]))]
    if c["need_weights"]:
        flags.append("--need-weights")
    if c["per_head"]:
        flags.append("--per-head-weights")
    if c["window"] is not None:
        flags += ["--window", "%d,%d" % c["window"]]
    if c["softcap"] is not None:
        flags += ["--softcap", repr(float(c["softcap"]))]
    if c["alibi"]:
        flags.append("--alibi")
    if c["module"] != "mha":  # a state_dict without metadata
        if c["prefix"]:
            flags += ["--prefix", c["prefix"]]
        flags += ["--num-heads", str(c["H"])]
    with open(os.path.join(d, "args"), "w") as f:
        f.write(" ".join(flags) + "\n")


# ---- the `clmha sdpa` cases --------------------------------------------------------------------

def SC(name, **kw):
    d = dict(name=name, N=2, H=2, Hkv=None, L=5, S=None, D=8, Dv=None, layout="nhld", mask=None,
             mask_shape=None, causal=False, scale=None, lse=False, weights=False, grads=False,
             kv_prefix=None, window=None, softcap=None, alibi=False, slopes=False, sinks=False,
             seq_lens=None, kv_seq_lens=None)
    for k in kw:
        if k not in d:
            raise KeyError(k)
    d.update(kw)
    if d["seq_lens"] is not None:  # packed: (T, H, D) tensors, as nlhd without N
        assert not (d["mask"] or d["weights"] or d["kv_prefix"])
        d["N"], d["layout"] = None, "nlhd"
        d["L"], d["S"] = sum(d["seq_lens"]), sum(d["kv_seq_lens"] or d["seq_lens"])
    d["S"] = d["S"] or d["L"]
    d["Hkv"] = d["Hkv"] or d["H"]
    d["Dv"] = d["Dv"] or d["D"]
    assert name.startswith("sdpa_") and d["H"] % d["Hkv"] == 0
    assert not (d["lse"] and d["weights"]) and not (d["causal"] and d["mask"])
    assert (d["mask"] is None) == (d["mask_shape"] is None)
    assert not d["slopes"] or d["alibi"]
    assert d["kv_prefix"] is None or (  # what `clmha sdpa --kv-cache-prefix` takes
        1 <= d["kv_prefix"] <= d["S"] == d["L"] and d["Dv"] == d["D"] and not (
            d["mask"] or d["lse"] or d["weights"] or d["grads"]))
    return d


# mask: None | "bool" | "float"; mask_shape: the letters of its dimensions, "1" for a size 1
SDPA_CASES = [
    SC("sdpa_nhld_bool_mask", mask="bool", mask_shape="N1LS", L=5, S=6, weights=True),
    SC("sdpa_nlhd_causal_gqa", layout="nlhd", H=4, Hkv=2, L=5, S=7, causal=True, lse=True,
       grads=True),
    SC("sdpa_unbatched_float_mask_scale", N=None, L=4, S=6, mask="float", mask_shape="HLS",
       scale=0.3, lse=True, grads=True),
    SC("sdpa_gqa_bool_mask_grads", H=4, Hkv=1, L=4, S=5, mask="bool", mask_shape="LS",
       grads=True),
    SC("sdpa_nlhd_key_rows_float", layout="nlhd", L=3, S=6, D=4, mask="float",
       mask_shape="N11S", lse=True, grads=True),
    SC("sdpa_value_width_differs", layout="nlhd", H=4, Hkv=2, L=4, S=6, D=12, Dv=6,
       causal=True, lse=True, grads=True),
    SC("sdpa_kv_cache_decode", layout="nlhd", H=4, Hkv=2, L=9, D=8, causal=True, kv_prefix=4),
    SC("sdpa_key_rows_per_head_float", H=3, L=4, S=6, mask="float", mask_shape="NH1S",
       lse=True, grads=True),
    SC("sdpa_one_key_row_bool", layout="nlhd", H=3, L=4, S=7, mask="bool", mask_shape="S",
       grads=True),
    # Sliding windows (--window LEFT,RIGHT), with a mask and with is_causal.
    SC("sdpa_window_gqa_bool_mask_grads", layout="nlhd", H=4, Hkv=2, L=6, S=7, mask="bool",
       mask_shape="N1LS", window=(2, 1), lse=True, grads=True),
    SC("sdpa_window_causal_weights_grads", L=7, S=6, causal=True, window=(2, -1), weights=True,
       grads=True),
    # Soft-capping and ALiBi (--softcap C --alibi [--alibi-slopes A.npy]).
    SC("sdpa_softcap_alibi_gqa_grads", H=4, Hkv=2, L=5, S=6, mask="float", mask_shape="N1LS",
       softcap=1.5, alibi=True, slopes=True, lse=True, grads=True),
    SC("sdpa_softcap_alibi_kv_cache_decode", layout="nlhd", H=4, Hkv=1, L=7, causal=True,
       softcap=2.0, alibi=True, kv_prefix=3),
    # Attention sinks (--sinks S.npy): gradients through both backward cores (the float mask's
    # gradient runs the unfused one), and decoding through a KV cache.
    SC("sdpa_sinks_gqa_grads", H=4, Hkv=2, L=5, S=6, causal=True, sinks=True, lse=True,
       grads=True),
    SC("sdpa_sinks_float_mask_grads", layout="nlhd", H=3, L=4, S=5, mask="float",
       mask_shape="N1LS", sinks=True, lse=True, grads=True),
    SC("sdpa_sinks_kv_cache_decode", layout="nlhd", H=4, Hkv=1, L=7, causal=True, sinks=True,
       kv_prefix=3),
    # Packed batches (--seq-lens, --kv-seq-lens): (T, H, D) tensors, each sequence its own call
    # (a sequence may have no queries); the log-sum-exp as each sequence's (H, L_i) block.
    SC("sdpa_packed_causal_gqa", H=4, Hkv=2, seq_lens=(3, 1, 5), causal=True, lse=True,
       grads=True),
    SC("sdpa_packed_cross_window_sinks", H=2, D=8, Dv=6, seq_lens=(2, 0, 4),
       kv_seq_lens=(3, 2, 5), window=(1, 0), sinks=True, lse=True, grads=True),
]


def sdpa_packed_reference(c, q, k, v, slopes, sinks):
    """(output, lse) of a packed case: sdpa_reference() once per sequence on its rows, the
    outputs one after another and each sequence's (H, L_i) log-sum-exp block in turn."""
    outs, lses, q0, k0 = [], [], 0, 0
    for L, S in zip(c["seq_lens"], c["kv_seq_lens"] or c["seq_lens"]):
        if L:
            one = dict(c, L=L, S=S)
            out, lse, _ = sdpa_reference(one, q[q0:q0 + L], k[k0:k0 + S], v[k0:k0 + S], None,
                                         slopes, sinks)
            outs.append(out)
            lses.append(lse.reshape(-1))
        q0, k0 = q0 + L, k0 + S
    return torch.cat(outs), torch.cat(lses), None


def sdpa_shape(c, which):
    """The shape of query ("q"), key ("kv"), value ("v") or the mask ("mask") of case c."""
    N, L, S, D = c["N"], c["L"], c["S"], c["Dv"] if which == "v" else c["D"]
    if which == "mask":
        sizes = dict(N=N or 1, H=c["H"], L=L, S=S)
        return tuple(1 if x == "1" else sizes[x] for x in c["mask_shape"])
    h, t = (c["H"], L) if which == "q" else (c["Hkv"], S)
    dims = (t, h, D) if c["layout"] == "nlhd" else (h, t, D)
    return dims if N is None else (N,) + dims


def sdpa_draw_mask(c, rng):
    """The mask as stored (bool True = may attend, or float32 with some -inf) and the bool
    (N, H, L, S) of positions that it and causality forbid."""
    Nb, H, L, S = c["N"] or 1, c["H"], c["L"], c["S"]
    forbidden = np.zeros((Nb, H, L, S), dtype=bool)
    mask = None
    if c["mask"]:
        shape = sdpa_shape(c, "mask")
        if c["mask"] == "bool":
            mask = rng.random(shape) >= 0.3
            forbidden |= np.broadcast_to(~mask, forbidden.shape)
        else:
            mask = rng.standard_normal(shape).astype(np.float32)
            mask[rng.random(shape) < 0.2] = -np.inf
            forbidden |= np.broadcast_to(np.isneginf(mask), forbidden.shape)
    if c["causal"]:
        forbidden |= ~np.tril(np.ones((L, S), dtype=bool))
    forbidden |= ~window_keep(L, S, c["window"])
    return mask, forbidden


def sdpa_reference(c, q, k, v, mask, slopes=None, sinks=None):
    """(output, lse, weights) of scaled dot-product attention in float64, written out (torch
    1.13 has no F.scaled_dot_product_attention), in the case's layout; lse and weights
    (N, H, L) and (N, H, L, S) whatever the layout. sinks: (H) attention sinks, or None."""
    if c["layout"] == "nlhd":
        q, k, v = (x.transpose(-3, -2) for x in (q, k, v))
    group = c["H"] // c["Hkv"]
    k = k.repeat_interleave(group, dim=-3)
    v = v.repeat_interleave(group, dim=-3)
    scale = c["scale"] if c["scale"] is not None else 1 / math.sqrt(c["D"])
    scores = q @ k.transpose(-2, -1) * scale
    scores = score_mods(scores, c["softcap"], slopes, c["S"])
    if c["causal"]:
        keep = torch.ones(c["L"], c["S"], dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if c["window"] is not None:
        keep = torch.from_numpy(window_keep(c["L"], c["S"], c["window"]))
        scores = scores.masked_fill(~keep, float("-inf"))
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif mask is not None:
        scores = scores + mask
    weights, lse = sink_softmax(scores, sinks)
    out = weights @ v
    if c["layout"] == "nlhd":
        out = out.transpose(-3, -2)
    return out, lse, weights


def sdpa_generate(c, out_dir, given_root=None):
    """Writes sdpa case c into out_dir/<name>; with given_root (--check), the committed float32
    inputs replace the drawn ones once shown to be the draw (as generate() does)."""
    name = c["name"]
    d = os.path.join(out_dir, name)
    os.makedirs(d, exist_ok=True)
    given = None if given_root is None else os.path.join(given_root, name)

    def take(fn, drawn):
        if given is not None:
            p = os.path.join(given, fn)
            if not os.path.isfile(p):
                raise golden_compare.NotThisDraw(f"{fn}: missing")
            drawn = golden_compare.check_draw(fn, np.load(p, allow_pickle=False), drawn)
        np.save(os.path.join(d, fn), drawn)
        return torch.from_numpy(drawn).double().requires_grad_(c["grads"])

    gen = torch.Generator().manual_seed(seed_of(name) + 2)
    rng = np.random.default_rng(seed_of(name))
    draw = lambda shape: torch.randn(shape, generator=gen).numpy().astype(np.float32)  # noqa
    q = take("query.npy", draw(sdpa_shape(c, "q")))
    k = take("key.npy", draw(sdpa_shape(c, "kv")))
    v = take("value.npy", draw(sdpa_shape(c, "v")))
    for _ in range(1000):
        mask, forbidden = sdpa_draw_mask(c, rng)
        if not forbidden.all(axis=-1).any():
            break
    else:
        raise RuntimeError(f"{name}: could not draw a mask without fully masked rows")
    mask_t = None
    if mask is not None:
        np.save(os.path.join(d, "attn_mask.npy"), mask)
        mask_t = torch.from_numpy(mask)
        if mask_t.dtype != torch.bool:
            mask_t = mask_t.double().requires_grad_(c["grads"])
    slopes = None
    if c["slopes"]:  # the --alibi-slopes file, a draw of its own
        slopes = np.random.default_rng(seed_of(name) + 3).uniform(0.05, 1.0, c["H"])
        slopes = slopes.astype(np.float32)
        if given is not None:
            p = os.path.join(given, "alibi_slopes.npy")
            if not os.path.isfile(p):
                raise golden_compare.NotThisDraw("alibi_slopes.npy: missing")
            slopes = golden_compare.check_draw("alibi_slopes.npy",
                                               np.load(p, allow_pickle=False), slopes)
        np.save(os.path.join(d, "alibi_slopes.npy"), slopes)
        slopes = slopes.astype(np.float64)
    elif c["alibi"]:  # the geometric slopes, as float32
        slopes = export_mha.alibi_slopes(c["H"]).astype(np.float32).astype(np.float64)
    sinks = None
    if c["sinks"]:  # the --sinks file, a draw of its own
        drawn = np.random.default_rng(seed_of(name) + 4).uniform(-1.0, 2.0, c["H"])
        sinks = take("sinks.npy", drawn.astype(np.float32))
    if c["seq_lens"] is not None:
        out, lse, weights = sdpa_packed_reference(c, q, k, v, slopes, sinks)
    else:
        out, lse, weights = sdpa_reference(c, q, k, v, mask_t, slopes, sinks)
    results = {"expected_output.npy": out}
    if c["lse"]:
        results["expected_lse.npy"] = lse
    if c["weights"]:
        results["expected_weights.npy"] = weights
    for fn, t in results.items():
        a = t.detach().numpy().astype(np.float64)
        assert np.isfinite(a).all(), f"{name}: {fn}"
        np.save(os.path.join(d, fn), a)
    if c["grads"]:
        gy = draw(tuple(out.shape))
        if given is not None:
            gy = golden_compare.check_draw("grad_output.npy", np.load(
                os.path.join(given, "grad_output.npy"), allow_pickle=False), gy)
        np.save(os.path.join(d, "grad_output.npy"), gy)
        out.backward(torch.from_numpy(gy).double())
        g = {"query": q.grad, "key": k.grad, "value": v.grad}
        if mask_t is not None and mask_t.dtype != torch.bool:
            g["attn_mask"] = mask_t.grad
        if sinks is not None:
            g["sinks"] = sinks.grad
        os.makedirs(os.path.join(d, "expected_grads"), exist_ok=True)
        for gname, gv in g.items():
            gv = gv.detach().numpy().astype(np.float64)
            assert np.isfinite(gv).all(), f"{name}: {gname}"
            np.save(os.path.join(d, "expected_grads", gname + ".npy"), gv)
    packed = c["seq_lens"] is not None
    flags = ["--layout", "nlhd"] if c["layout"] == "nlhd" and not packed else []
    if packed:
        flags += ["--seq-lens", ",".join(map(str, c["seq_lens"]))]
    if c["kv_seq_lens"] is not None:
        flags += ["--kv-seq-lens", ",".join(map(str, c["kv_seq_lens"]))]
    if c["causal"]:
        flags.append("--is-causal")
    if c["Hkv"] != c["H"]:
        flags.append("--enable-gqa")
    if c["scale"] is not None:
        flags += ["--scale", repr(c["scale"])]
    if c["window"] is not None:
        flags += ["--window", "%d,%d" % c["window"]]
    if c["softcap"] is not None:
        flags += ["--softcap", repr(float(c["softcap"]))]
    if c["alibi"]:
        flags.append("--alibi")
    if c["kv_prefix"] is not None:
        flags += ["--kv-cache-prefix", str(c["kv_prefix"])]
    with open(os.path.join(d, "args"), "w") as f:
        f.write(" ".join(flags) + "\n")


def write_all(out_dir, given_root=None):
    names = [c["name"] for c in CASES + SDPA_CASES]
    assert len(set(names)) == len(names)
    os.makedirs(out_dir, exist_ok=True)
    for entry in os.listdir(out_dir):
        p = os.path.join(out_dir, entry)
        if entry not in names and os.path.isfile(os.path.join(p, "args")):
            shutil.rmtree(p)
    not_drawn = []
    for c in CASES + SDPA_CASES:
        shutil.rmtree(os.path.join(out_dir, c["name"]), ignore_errors=True)
        try:
            (sdpa_generate if c in SDPA_CASES else generate)(c, out_dir, given_root)
        except golden_compare.NotThisDraw as e:
            not_drawn.append(f"{os.path.join(given_root, c['name'])}: {e}")
    write_torch_save(out_dir)
    for fn, cmd, cases in (("cases.inc", "run", CASES), ("sdpa_cases.inc", "sdpa", SDPA_CASES)):
        with open(os.path.join(out_dir, fn), "w") as f:
            f.write(f"/* generated by tools/make_cli_cases.py: the `clmha {cmd}` case names */\n")
            f.write("".join(f'"{c["name"]}",\n' for c in cases))
    return not_drawn


def tree(d):
    files = {}
    for root, _, fns in os.walk(d):
        for fn in fns:
            p = os.path.join(root, fn)
            with open(p, "rb") as f:
                files[os.path.relpath(p, d)] = f.read()
    return files


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--out", default=os.path.join(here, "..", "tests", "cli"))
    ap.add_argument("--check", action="store_true",
                    help="compare with the files on disk instead of writing")
    a = ap.parse_args()
    out_dir = os.path.normpath(a.out)
    if a.check:
        with tempfile.TemporaryDirectory() as tmp:
            not_drawn = write_all(tmp, out_dir)
            want, have = tree(tmp), tree(out_dir)
        names = {c["name"] for c in CASES + SDPA_CASES}
        lists = ("cases.inc", "sdpa_cases.inc")
        have = {k: v for k, v in have.items()
                if k in lists or k.split(os.sep)[0] in names}
        want = {k: v for k, v in want.items()  # not torch_save/ (see the docstring)
                if k in lists or k.split(os.sep)[0] in names}
        for why in not_drawn:
            print(f"differs: {why}", file=sys.stderr)
        failed = {why.split(": ")[0] for why in not_drawn}
        want = {k: v for k, v in want.items()
                if os.path.join(out_dir, k.split(os.sep)[0]) not in failed}
        have = {k: v for k, v in have.items()
                if os.path.join(out_dir, k.split(os.sep)[0]) not in failed}
        bad = 0
        for k in sorted(set(want) | set(have)):
            why = golden_compare.file_differs(k, have.get(k), want.get(k))
            if why:
                print(f"differs: {os.path.join(out_dir, k)}: {why}", file=sys.stderr)
                bad += 1
        if not_drawn:
            print(f"{len(not_drawn)} case(s) not this script's draw")
        print(f"{len(want) - bad}/{len(want)} files of the other cases match: float32 inputs this script's draw "
              f"({golden_compare.F32_TOLERANCE}), float64 results recomputed on them "
              f"({golden_compare.TOLERANCE}), all else identical")
        return 1 if bad or not_drawn else 0
    write_all(out_dir)
    size = sum(len(v) for v in tree(out_dir).values())
    print(f"wrote {len(CASES) + len(SDPA_CASES)} cases to {out_dir} ({size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
