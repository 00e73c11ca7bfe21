#!/usr/bin/env python3
"""Writes a torch.nn.MultiheadAttention to the .safetensors layer file clmha reads.

The file holds the module's state_dict under PyTorch's names (in_proj_weight, or q_proj_weight,
k_proj_weight and v_proj_weight; in_proj_bias, out_proj.weight, out_proj.bias, bias_k, bias_v:
whichever the module has) and a __metadata__ with num_heads, batch_first, add_zero_attn
("true"/"false"), dropout (decimal) and, for a sliding window, window ("LEFT,RIGHT", each -1 or
an integer >= 0: query i attends key j only when i - LEFT <= j <= i + RIGHT, -1 leaving a side
unbounded; nn.MultiheadAttention has no window, so it is an option here). clmha derives embed_dim, kdim, vdim, bias and
add_bias_kv from the tensors present. The format is written by hand (8-byte little-endian
header length, JSON header padded with spaces to a multiple of 8, raw little-endian data), so
the `safetensors` package is not needed; the files also load with safetensors.torch.load_file.

As a module (run with a Python that has PyTorch, e.g. Debian's /usr/bin/python3):

    from export_mha import export, load
    export(module, "layer.safetensors")                  # F32
    export(module, "layer16.safetensors", dtype="F16")   # or "F64"
    export(module, "swa.safetensors", window=(1023, 0))   # a sliding window
    module2 = load("layer.safetensors")                  # back to nn.MultiheadAttention

As a command, making a layer with random parameters:

    /usr/bin/python3 tools/export_mha.py --embed-dim 16 --num-heads 4 [--kdim K] [--vdim V]
        [--no-bias] [--add-bias-kv] [--add-zero-attn] [--batch-first] [--dropout P]
        [--dtype F32|F16|F64] [--window LEFT,RIGHT] [--torch-init] [--seed 0] out.safetensors

Parameters are drawn from N(0, 0.3^2) (all of them, biases included, so that every parameter
matters), or left as PyTorch initialises them with --torch-init.
"""

import argparse
import json
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


def metadata_of(module, add_zero_attn=None, window=None):
    """The __metadata__ clmha reads, from the module's attributes; window (left, right) or
    None (no window key)."""
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


def export(module: torch.nn.MultiheadAttention, path, add_zero_attn=None, dtype="F32",
           window=None):
    """Writes `module` (its state_dict and configuration) to `path`. dtype: "F32", "F16" or
    "F64"; the parameters are rounded to it from the module's own precision. add_zero_attn
    overrides the module's attribute when not None. window: (left, right), a sliding window
    (-1: that side unbounded), or None (the default: the module's `window` attribute if it has
    one, as clmha.torch.MultiheadAttention does, else none)."""
    if window is None:
        window = getattr(module, "window", None)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    tensors = []
    for name, value in module.state_dict().items():
        arr = value.detach().cpu().double().numpy() if dtype == "F64" else \
            value.detach().cpu().float().numpy()
        tensors.append((name, arr.astype(DTYPES[dtype])))
    data = encode(tensors, metadata_of(module, add_zero_attn, window))
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
    clmha_layer_save(). nn.MultiheadAttention has no sliding window: a file's window is left out
    (read(path)[1]["window"], parse_window(), has it)."""
    tensors, meta = read(path)
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
    m = random_module(a.embed_dim, a.num_heads, a.kdim, a.vdim, not a.no_bias, a.add_bias_kv,
                      a.add_zero_attn, a.batch_first, a.dropout, a.seed, a.torch_init)
    if a.dtype == "F64":
        m = m.double()
    export(m, a.out, dtype=a.dtype, window=window)
    shapes = ", ".join(f"{k} {tuple(v.shape)}" for k, v in m.state_dict().items())
    print(f"wrote {a.out}: {shapes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
