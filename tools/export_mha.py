#!/usr/bin/env python3
"""Writes a torch.nn.MultiheadAttention to the .safetensors layer file clmha reads.

The file holds the module's state_dict under PyTorch's names (in_proj_weight, or q_proj_weight,
k_proj_weight and v_proj_weight; in_proj_bias, out_proj.weight, out_proj.bias, bias_k, bias_v:
whichever the module has) and a __metadata__ with num_heads, batch_first, add_zero_attn
("true"/"false"), dropout (decimal) and, for a sliding window, window ("LEFT,RIGHT", each -1 or
an integer >= 0: query i attends key j only when i - LEFT <= j <= i + RIGHT, -1 leaving a side
unbounded; nn.MultiheadAttention has no window, so it is an option here), for soft-capping
softcap (a decimal c > 0: every scaled score s becomes c*tanh(s/c)) and for ALiBi alibi
("true", with the tensor alibi_slopes (H) when the slopes are not the geometric ones); for
attention sinks (gpt-oss's: one logit per head in every row's softmax denominator) the tensor
sinks (H), whose presence is what turns them on. clmha derives embed_dim, kdim, vdim, bias and
add_bias_kv from the tensors present. The format is
written by hand (8-byte little-endian header length, JSON header padded with spaces to a
multiple of 8, raw little-endian data), so
the `safetensors` package is not needed; the files also load with safetensors.torch.load_file.

As a module (run with a Python that has PyTorch, e.g. Debian's /usr/bin/python3):

    from export_mha import export, load
    export(module, "layer.safetensors")                  # F32
    export(module, "layer16.safetensors", dtype="F16")   # or "F64"
    export(module, "swa.safetensors", window=(1023, 0))   # a sliding window
    export(module, "v.safetensors", softcap=50.0, alibi=True)  # Gemma 2's cap, ALiBi
    export(module, "s.safetensors", sinks=np.zeros(num_heads))  # attention sinks
    module2 = load("layer.safetensors")                  # back to nn.MultiheadAttention

As a command, making a layer with random parameters:

    /usr/bin/python3 tools/export_mha.py --embed-dim 16 --num-heads 4 [--kdim K] [--vdim V]
        [--no-bias] [--add-bias-kv] [--add-zero-attn] [--batch-first] [--dropout P]
        [--dtype F32|F16|F64] [--window LEFT,RIGHT] [--softcap C] [--alibi] [--torch-init]
        [--seed 0] out.safetensors

Parameters are drawn from N(0, 0.3^2) (all of them, biases included, so that every parameter
matters), or left as PyTorch initialises them with --torch-init.
"""

import argparse
import json
import math
import sys

import numpy as np
import torch

DTYPES = {"F32": "<f4", "F16": "<f2", "F64": "<f8"}


def _bool_text(v):
    return "true" if bool(v) else "false"


def parse_window(text):
    """(left, right) from "LEFT,RIGHT" (each -1 or an integer >= 0, below 2^63); ValueError
    for anything else."""
    parts = text.split(",") if isinstance(text, str) else []
    try:
        bounds = tuple(_bound(p) for p in parts)
    except ValueError:
        bounds = ()
    if len(bounds) != 2:
        raise ValueError(f"window {text!r}: expected LEFT,RIGHT, two integers, each -1 "
                         f"(unbounded) or at least 0, such as 1023,0")
    return bounds


def _bound(p):
    if p != "-1" and not (p.isascii() and p.isdigit()):
        raise ValueError(p)
    v = int(p)
    if v >= 2 ** 63:
        raise ValueError(p)
    return v


def window_text(window):
    """The metadata value of a window (left, right): "LEFT,RIGHT"."""
    left, right = (int(x) for x in window)
    for v in (left, right):
        if v < -1 or v >= 2 ** 63:
            raise ValueError(f"window {window!r}: each bound must be -1 (unbounded) or from 0 "
                             f"to 2^63-1")
    return f"{left},{right}"


def softcap_text(softcap):
    """The metadata value of a softcap c (0 or positive and finite): Python's shortest
    decimal, which clmha reads back as the same double."""
    c = float(softcap)
    if not (c >= 0.0 and math.isfinite(c)):
        raise ValueError(f"softcap {softcap!r}: expected 0 (off) or a positive finite number")
    return repr(c)


def alibi_slopes(heads):
    """The ALiBi paper's slopes for `heads` heads, as clmha_alibi_slopes() gives them (float64
    here): 2^(-8(h+1)/H) for H a power of two, else those of the largest power of two P < H
    followed by every other slope of 2P."""
    p = 1
    while p * 2 <= heads:
        p *= 2
    return np.array([2.0 ** (-8.0 * (h + 1) / p) if h < p else
                     2.0 ** (-8.0 * (2 * (h - p) + 1) / (2 * p)) for h in range(heads)])


def metadata_of(module, add_zero_attn=None, window=None, softcap=None, alibi=False):
    """The __metadata__ clmha reads, from the module's attributes; window (left, right) or
    None (no window key); softcap c (None or 0: no softcap key); alibi (False: no alibi key)."""
    if add_zero_attn is None:
        add_zero_attn = getattr(module, "add_zero_attn", False)
    meta = {
        "format": "pt",
        "num_heads": str(int(module.num_heads)),
        "batch_first": _bool_text(getattr(module, "batch_first", False)),
        "add_zero_attn": _bool_text(add_zero_attn),
        "dropout": repr(float(module.dropout)),
    }
    if window is not None:
        meta["window"] = window_text(window)
    if softcap is not None and float(softcap) != 0.0:
        meta["softcap"] = softcap_text(softcap)
    if alibi:
        meta["alibi"] = "true"
    return meta


def encode(tensors, metadata):
    """The bytes of a safetensors file holding `tensors`: a list of (name, numpy array) whose
    arrays already have their file dtype ('<f4', '<f2' or '<f8')."""
    names = {"<f4": "F32", "<f2": "F16", "<f8": "F64"}
    header = {"__metadata__": dict(metadata)}
    blobs, offset = [], 0
    for name, arr in tensors:
        arr = np.ascontiguousarray(arr)
        dt = arr.dtype.newbyteorder("<").str if arr.dtype.byteorder == "=" else arr.dtype.str
        if dt not in names:
            raise ValueError(f"{name}: unsupported dtype {arr.dtype}")
        raw = arr.astype(dt, copy=False).tobytes()
        header[name] = {"dtype": names[dt], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + b"".join(blobs)


def _array(value, dtype):
    """A tensor or array-like as a numpy array of the file's dtype."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().double().numpy()
    arr = np.asarray(value, dtype=np.float64)
    return (arr if dtype == "F64" else arr.astype(np.float32)).astype(DTYPES[dtype])


def export(module: torch.nn.MultiheadAttention, path, add_zero_attn=None, dtype="F32",
           window=None, softcap=None, alibi=None, alibi_slopes=None, sinks=None):
    """Writes `module` (its state_dict and configuration) to `path`. dtype: "F32", "F16" or
    "F64"; the parameters are rounded to it from the module's own precision. add_zero_attn
    overrides the module's attribute when not None. window: (left, right), a sliding window
    (-1: that side unbounded), or None (the default: the module's `window` attribute if it has
    one, as clmha.torch.MultiheadAttention does, else none). softcap (c >= 0; 0: off), alibi
    (bool) and alibi_slopes ((num_heads,) values; None: the geometric slopes, no tensor
    written) likewise default to the module's attributes of those names, else off. sinks:
    attention sinks, (num_heads,) values written as the tensor sinks (None: the module's own
    `sinks` tensor or parameter if it has one, else none; a module's sinks = True without
    values: zeros, as a clmha layer starts)."""
    if window is None:
        window = getattr(module, "window", None)
    if softcap is None:
        softcap = getattr(module, "softcap", None)
    if alibi is None:
        alibi = bool(getattr(module, "alibi", False))
    if alibi_slopes is None:
        alibi_slopes = getattr(module, "alibi_slopes", None)
    if sinks is None:
        sinks = getattr(module, "sinks", None)
        if isinstance(sinks, bool):  # a flag rather than the values
            sinks = np.zeros(int(module.num_heads)) if sinks else None
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if alibi_slopes is not None and not alibi:
        raise ValueError("alibi_slopes given without alibi: only an ALiBi layer has slopes")
    tensors = []
    for name, value in module.state_dict().items():
        if name in ("alibi_slopes", "sinks"):  # a module's own: written once, below
            continue
        arr = value.detach().cpu().double().numpy() if dtype == "F64" else \
            value.detach().cpu().float().numpy()
        tensors.append((name, arr.astype(DTYPES[dtype])))
    if alibi and alibi_slopes is not None:
        slopes = _array(alibi_slopes, dtype)
        if slopes.shape != (int(module.num_heads),):
            raise ValueError(f"alibi_slopes has shape {slopes.shape}, expected "
                             f"({int(module.num_heads)},): one slope per head")
        tensors.append(("alibi_slopes", slopes))
    if sinks is not None:
        arr = _array(sinks, dtype)
        if arr.shape != (int(module.num_heads),):
            raise ValueError(f"sinks has shape {arr.shape}, expected "
                             f"({int(module.num_heads)},): one logit per head")
        tensors.append(("sinks", arr))
    data = encode(tensors, metadata_of(module, add_zero_attn, window, softcap, alibi))
    with open(path, "wb") as f:
        f.write(data)


def read(path):
    """Parses a safetensors file: (dict name -> numpy array, metadata dict)."""
    with open(path, "rb") as f:
        data = f.read()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n].decode("utf-8"))
    base = 8 + n
    meta = header.pop("__metadata__", {})
    out = {}
    for name, info in header.items():
        dt = {"F32": "<f4", "F16": "<f2", "F64": "<f8"}[info["dtype"]]
        b, e = info["data_offsets"]
        out[name] = np.frombuffer(data[base + b:base + e], dtype=dt).reshape(info["shape"])
    return out, meta


def load(path, dtype=torch.float32):
    """Builds an nn.MultiheadAttention (eval mode) from a layer file written by export() or by
    clmha_layer_save(). nn.MultiheadAttention has no sliding window, soft-capping, ALiBi or
    attention sinks: a file's window, softcap, alibi, alibi_slopes and sinks are left out
    (read(path) has them)."""
    tensors, meta = read(path)
    tensors.pop("alibi_slopes", None)
    tensors.pop("sinks", None)
    E = tensors["out_proj.weight"].shape[0]
    if "in_proj_weight" in tensors:
        kdim = vdim = E
    else:
        kdim = tensors["k_proj_weight"].shape[1]
        vdim = tensors["v_proj_weight"].shape[1]
    m = torch.nn.MultiheadAttention(
        E, int(meta["num_heads"]), dropout=float(meta.get("dropout", "0")),
        bias="in_proj_bias" in tensors, add_bias_kv="bias_k" in tensors,
        add_zero_attn=meta.get("add_zero_attn", "false") == "true", kdim=kdim, vdim=vdim,
        batch_first=meta.get("batch_first", "false") == "true").to(dtype)
    state = {k: torch.from_numpy(np.array(v, dtype=np.float64)).to(dtype)
             for k, v in tensors.items()}
    m.load_state_dict(state, strict=True)
    return m.eval()


def random_module(embed_dim, num_heads, kdim=None, vdim=None, bias=True, add_bias_kv=False,
                  add_zero_attn=False, batch_first=False, dropout=0.0, seed=0, torch_init=False):
    """An nn.MultiheadAttention (eval mode) with parameters drawn from N(0, 0.3^2)."""
    torch.manual_seed(seed)
    m = torch.nn.MultiheadAttention(embed_dim, num_heads, dropout=dropout, bias=bias,
                                    add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn,
                                    kdim=kdim, vdim=vdim, batch_first=batch_first)
    if not torch_init:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return m.eval()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--embed-dim", type=int, required=True)
    ap.add_argument("--num-heads", type=int, required=True)
    ap.add_argument("--kdim", type=int)
    ap.add_argument("--vdim", type=int)
    ap.add_argument("--no-bias", action="store_true")
    ap.add_argument("--add-bias-kv", action="store_true")
    ap.add_argument("--add-zero-attn", action="store_true")
    ap.add_argument("--batch-first", action="store_true")
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="F32")
    ap.add_argument("--window", metavar="LEFT,RIGHT",
                    help="a sliding window: query i attends key j only when i - LEFT <= j <= "
                         "i + RIGHT (-1: that side unbounded), written as metadata window")
    ap.add_argument("--softcap", metavar="C", type=float,
                    help="soft-capping: every scaled score s becomes C*tanh(s/C), written as "
                         "metadata softcap (0: off)")
    ap.add_argument("--alibi", action="store_true",
                    help="ALiBi with the geometric slopes, written as metadata alibi")
    ap.add_argument("--torch-init", action="store_true",
                    help="keep PyTorch's initialisation (zero biases) instead of N(0, 0.3^2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("out")
    argv = list(sys.argv[1:] if argv is None else argv)
    for i in range(len(argv) - 1):  # "--window -1,0": a value, not an option
        if argv[i] == "--window":
            argv[i:i + 2] = [f"--window={argv[i + 1]}"]
            break
    a = ap.parse_args(argv)
    window = None
    if a.window is not None:
        try:
            window = parse_window(a.window)
        except ValueError as e:
            ap.error(f"--window: {e}")
    if a.softcap is not None and not (a.softcap >= 0.0 and math.isfinite(a.softcap)):
        ap.error(f"--softcap {a.softcap!r}: expected 0 (off) or a positive finite number")
    m = random_module(a.embed_dim, a.num_heads, a.kdim, a.vdim, not a.no_bias, a.add_bias_kv,
                      a.add_zero_attn, a.batch_first, a.dropout, a.seed, a.torch_init)
    if a.dtype == "F64":
        m = m.double()
    export(m, a.out, dtype=a.dtype, window=window, softcap=a.softcap, alibi=a.alibi)
    shapes = ", ".join(f"{k} {tuple(v.shape)}" for k, v in m.state_dict().items())
    print(f"wrote {a.out}: {shapes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
