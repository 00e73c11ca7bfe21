#!/usr/bin/env python3
"""clmha from Python through ctypes, on NumPy arrays, checked against PyTorch.

    python3 examples/ctypes_numpy.py path/to/libclmha.so

Creates a torch.nn.MultiheadAttention (batch_first, self-attention), copies its state_dict into
a clmha layer by PyTorch's parameter names, runs clmha_layer_forward_host on NumPy arrays with a
boolean key_padding_mask and compares output and averaged attention weights with PyTorch's
forward (tolerance 1e-4). The device is $CLMHA_DEVICE, else the first GPU, else any device.

Exit status: 0 pass, 1 failure, 2 usage, 77 skipped (no NumPy or PyTorch in this Python, or no
OpenCL device). Debian's /usr/bin/python3 with python3-torch and python3-numpy has both.

The ctypes structures below repeat the layout of include/clmha.h field by field; keep them in
step with the header (the sizes are checked on 64-bit platforms). Each struct starts with
struct_size, set to the Structure's own size (docs/abi.md): a library newer than these
definitions then reads only the fields they have and takes the others as zero.
"""

import ctypes
import os
import sys

SKIP = 77


def skip(why):
    print(f"skipped: {why}")
    sys.exit(SKIP)


try:
    import numpy as np
except ImportError as e:
    skip(f"NumPy is not importable in {sys.executable} ({e})")
try:
    import torch
except ImportError as e:
    skip(f"PyTorch is not importable in {sys.executable} ({e})")

# ---- the C declarations of include/clmha.h ----------------------------------------------------

c_size_t = ctypes.c_size_t
c_bool = ctypes.c_bool
cl_mem = ctypes.c_void_p  # an opaque pointer; unused on the host path

CLMHA_SUCCESS = 0
CLMHA_DEVICE_NOT_FOUND = -5

# enum clmha_mask_kind
CLMHA_MASK_NONE = 0
CLMHA_MASK_BOOL_IGNORE = 1  # non-zero = may NOT attend (PyTorch's bool masks)
CLMHA_MASK_BOOL_ATTEND = 2  # non-zero = may attend
CLMHA_MASK_FLOAT = 3        # float32, added to the scores


class LayerDesc(ctypes.Structure):
    """clmha_layer_desc"""
    _fields_ = [
        ("struct_size", c_size_t),  # ctypes.sizeof(LayerDesc): see sized()
        ("embed_dim", c_size_t),
        ("num_heads", c_size_t),
        ("kdim", c_size_t),
        ("vdim", c_size_t),
        ("bias", c_bool),
        ("add_bias_kv", c_bool),
        ("add_zero_attn", c_bool),
        ("batch_first", c_bool),
        ("dropout", ctypes.c_float),
    ]


class Tensor(ctypes.Structure):
    """clmha_tensor: a dense row-major tensor; the host path reads `data`."""
    _fields_ = [
        ("ndim", c_size_t),
        ("shape", c_size_t * 4),
        ("buffer", cl_mem),
        ("offset", c_size_t),
        ("data", ctypes.c_void_p),
    ]


class Mask(ctypes.Structure):
    """clmha_mask"""
    _fields_ = [
        ("kind", ctypes.c_int),  # enum clmha_mask_kind
        ("per_batch", c_bool),
        ("tensor", Tensor),
    ]


class DropoutRng(ctypes.Structure):
    """clmha_dropout_rng"""
    _fields_ = [("seed", ctypes.c_uint64), ("offset", ctypes.c_uint64)]


class ForwardArgs(ctypes.Structure):
    """clmha_forward_args"""
    _fields_ = [
        ("struct_size", c_size_t),  # ctypes.sizeof(ForwardArgs): see sized()
        ("query", Tensor),
        ("key", Tensor),
        ("value", Tensor),
        ("key_padding_mask", Mask),
        ("attn_mask", Mask),
        ("is_causal", c_bool),
        ("need_weights", c_bool),
        ("per_head_weights", c_bool),
        ("training", c_bool),
        ("rng", DropoutRng),
        ("impl", ctypes.c_int),  # enum clmha_impl; 0 = CLMHA_IMPL_AUTO
    ]


def sized(struct_type, **fields):
    """A zeroed struct_type with struct_size set (CLMHA_STRUCT_INIT in C) and @p fields."""
    return struct_type(struct_size=ctypes.sizeof(struct_type), **fields)


if ctypes.sizeof(ctypes.c_void_p) == 8:  # LP64 / LLP64 sizes, as the C compiler lays them out
    for struct, size in ((LayerDesc, 48), (Tensor, 64), (Mask, 72), (ForwardArgs, 376)):
        assert ctypes.sizeof(struct) == size, f"{struct.__doc__}: {ctypes.sizeof(struct)} bytes"
    assert ForwardArgs.rng.offset == 352 and ForwardArgs.impl.offset == 368
    assert Mask.tensor.offset == 8


def load_library(path):
    lib = ctypes.CDLL(path)
    ctx_p = ctypes.c_void_p
    layer_p = ctypes.c_void_p
    fns = {
        "clmha_version": (ctypes.c_char_p, []),
        "clmha_status_string": (ctypes.c_char_p, [ctypes.c_int]),
        "clmha_last_create_error": (ctypes.c_char_p, []),
        "clmha_context_create_from_env": (ctypes.c_int, [ctypes.POINTER(ctx_p)]),
        "clmha_context_release": (None, [ctx_p]),
        "clmha_context_last_error": (ctypes.c_char_p, [ctx_p]),
        "clmha_context_device_name": (ctypes.c_char_p, [ctx_p]),
        "clmha_layer_create": (ctypes.c_int,
                               [ctypes.POINTER(layer_p), ctx_p, ctypes.POINTER(LayerDesc)]),
        "clmha_layer_release": (None, [layer_p]),
        "clmha_layer_set_parameter": (ctypes.c_int, [layer_p, ctypes.c_char_p,
                                                     ctypes.POINTER(ctypes.c_float), c_size_t]),
        "clmha_layer_output_counts": (ctypes.c_int, [layer_p, ctypes.POINTER(ForwardArgs),
                                                     ctypes.POINTER(c_size_t),
                                                     ctypes.POINTER(c_size_t)]),
        "clmha_layer_forward_host": (ctypes.c_int, [layer_p, ctypes.POINTER(ForwardArgs),
                                                    ctypes.POINTER(ctypes.c_float), c_size_t,
                                                    ctypes.POINTER(ctypes.c_float), c_size_t]),
    }
    for name, (restype, argtypes) in fns.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    return lib


def float_ptr(array):
    return array.ctypes.data_as(ctypes.POINTER(ctypes.c_float))


def tensor(array):
    """A clmha_tensor describing a C-contiguous NumPy array (which must outlive the call)."""
    assert array.flags["C_CONTIGUOUS"] and 1 <= array.ndim <= 4
    t = Tensor()
    t.ndim = array.ndim
    for i, n in enumerate(array.shape):
        t.shape[i] = n
    t.data = array.ctypes.data
    return t


class ClmhaError(RuntimeError):
    pass


def main():
    if len(sys.argv) != 2:
        print(f"usage: {sys.argv[0]} path/to/libclmha.so", file=sys.stderr)
        return 2
    lib = load_library(sys.argv[1])
    print(f"clmha {lib.clmha_version().decode()} ({os.path.basename(sys.argv[1])}), "
          f"torch {torch.__version__}, numpy {np.__version__}")

    ctx = ctypes.c_void_p()
    st = lib.clmha_context_create_from_env(ctypes.byref(ctx))
    if st == CLMHA_DEVICE_NOT_FOUND:
        skip(f"no OpenCL device ({lib.clmha_last_create_error().decode()})")
    if st != CLMHA_SUCCESS:
        raise ClmhaError(lib.clmha_last_create_error().decode())
    layer = ctypes.c_void_p()

    def check(status, what):
        if status != CLMHA_SUCCESS:
            raise ClmhaError(f"{what}: {lib.clmha_status_string(status).decode()}: "
                             f"{lib.clmha_context_last_error(ctx).decode()}")

    try:
        print(f"device: {lib.clmha_context_device_name(ctx).decode()}")

        # The PyTorch layer.
        torch.manual_seed(0)
        E, H, N, L = 32, 4, 3, 7
        mha = torch.nn.MultiheadAttention(E, H, batch_first=True).eval()

        # The same layer in clmha, parameters copied by their state_dict names.
        desc = sized(LayerDesc, embed_dim=E, num_heads=H, bias=True, batch_first=True)
        check(lib.clmha_layer_create(ctypes.byref(layer), ctx, ctypes.byref(desc)),
              "clmha_layer_create")
        params = {}  # kept alive until the copies are done (they are when the call returns)
        for name, value in mha.state_dict().items():
            params[name] = np.ascontiguousarray(value.detach().numpy(), dtype=np.float32)
            check(lib.clmha_layer_set_parameter(layer, name.encode(), float_ptr(params[name]),
                                                params[name].size),
                  f"clmha_layer_set_parameter({name})")

        # Inputs: query (N, L, E); key and value are the query (ndim 0). Padding: the last two
        # keys of batch item 1 and the last key of item 2 (True = padding, as in PyTorch).
        rng = np.random.default_rng(0)
        query = rng.standard_normal((N, L, E), dtype=np.float32)
        kpm = np.zeros((N, L), dtype=np.bool_)
        kpm[1, -2:] = True
        kpm[2, -1] = True

        args = sized(ForwardArgs)
        args.query = tensor(query)
        args.key_padding_mask = Mask(kind=CLMHA_MASK_BOOL_IGNORE, tensor=tensor(kpm))
        args.need_weights = True  # averaged over heads, PyTorch's default

        out_count, w_count = c_size_t(), c_size_t()
        check(lib.clmha_layer_output_counts(layer, ctypes.byref(args), ctypes.byref(out_count),
                                            ctypes.byref(w_count)), "clmha_layer_output_counts")
        output = np.empty((N, L, E), dtype=np.float32)
        weights = np.empty((N, L, L), dtype=np.float32)
        assert (output.size, weights.size) == (out_count.value, w_count.value)
        check(lib.clmha_layer_forward_host(layer, ctypes.byref(args), float_ptr(output),
                                           output.size, float_ptr(weights), weights.size),
              "clmha_layer_forward_host")

        with torch.no_grad():
            q = torch.from_numpy(query)
            ref_out, ref_w = mha(q, q, q, key_padding_mask=torch.from_numpy(kpm),
                                 need_weights=True)
        err_out = float(np.max(np.abs(output - ref_out.numpy())))
        err_w = float(np.max(np.abs(weights - ref_w.numpy())))
        ok = err_out <= 1e-4 and err_w <= 1e-4
        print(f"output {output.shape}, weights {weights.shape}")
        print(f"max |clmha - torch|: output {err_out:.3g}, weights {err_w:.3g} "
              f"(tolerance 1e-4): {'PASS' if ok else 'FAIL'}")
        return 0 if ok else 1
    finally:
        lib.clmha_layer_release(layer)
        lib.clmha_context_release(ctx)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ClmhaError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
