"""Scaled dot-product attention as a function: NumPy arrays to ``clmha_attention_args`` and the
host forms ``clmha_attention_forward_host`` / ``clmha_attention_backward_host``, shared by
``clmha.numpy.scaled_dot_product_attention`` and ``clmha.torch.scaled_dot_product_attention``.

The C function takes (N, H, L, D) or unbatched (H, L, D) tensors and the masks of
``clmha_attention_args``: any (a, b, c, S) with a 1 or N, b 1 or H, c 1 or L (broadcast as
SDPA broadcasts it; not along the keys). PyTorch's function takes (..., L, D) with any number of
leading dimensions and any mask that broadcasts to (..., L, S). ``Call`` maps the one onto the
other: 2-D tensors get a head dimension of 1, leading dimensions beyond N are folded into N, and
a mask is passed as it is, except along what the C function does not broadcast: the folded
leading dimensions (expanded where the mask has some of them but not all) and the keys (a
last dimension of 1 expanded to S); a float mask's gradient is summed back to the mask's own
shape.
"""

import math
from typing import Optional, Tuple

import numpy as np

from ._context import Context, default_context
from ._errors import check
from ._native import ffi, lib

_IMPLS = {"auto": lib.CLMHA_IMPL_AUTO, "fused": lib.CLMHA_IMPL_FUSED,
          "unfused": lib.CLMHA_IMPL_UNFUSED}

#: the dtypes the call takes: float32, computed as it is; float16, computed in float32 and
#: returned in float16
_INPUT_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))


def _ptr(a: Optional[np.ndarray], ctype: str = "float *"):
    return ffi.cast(ctype, ffi.from_buffer(a)) if a is not None else ffi.NULL


def _fill(t, a: np.ndarray, shape: Tuple[int, ...]) -> None:
    t.ndim = len(shape)
    for i, s in enumerate(shape):
        t.shape[i] = int(s)
    t.data = ffi.from_buffer(a)


def _number(name: str, value, kind=float):
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, not {value!r}")
    return kind(value)


class Call:
    """One call's ``clmha_attention_args``, with the float32 arrays it points into kept alive.

    ``query`` (..., H, L, D), ``key`` (..., H_kv, S, D), ``value`` (..., H_kv, S, D_v) NumPy
    arrays of one dtype (float32 or float16); ``attn_mask`` None or a bool (True = may attend)
    or floating NumPy array broadcasting to (..., H, L, S). The other arguments as
    ``scaled_dot_product_attention``'s, plus the dropout's Philox ``seed`` and ``offset``, the
    core ``impl``, the ``context`` (None: the cache's with ``kv_cache``, else the default
    context) and the KV-cache form's ``kv_cache`` (a ``clmha.KVCache``) and ``kv_append``
    (per-sequence counts of real new tokens).
    """

    def __init__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                 scale=None, enable_gqa=False, *, seed: int = 0, offset: int = 0,
                 impl: str = "auto", context: Optional[Context] = None, kv_cache=None,
                 kv_append=None):
        from ._layer import KVCache

        if kv_cache is not None and not isinstance(kv_cache, KVCache):
            raise TypeError(f"kv_cache must be a clmha.KVCache (KVCache.for_attention) or None, "
                            f"not {type(kv_cache).__name__}")
        if context is None:
            context = kv_cache.context if kv_cache is not None else default_context()
        if not isinstance(context, Context):
            raise TypeError(f"context must be a clmha.Context, not {type(context).__name__}")
        if not isinstance(impl, str) or impl not in _IMPLS:
            raise ValueError(f"impl must be 'auto', 'fused' or 'unfused', not {impl!r}")
        self.context = context
        arrays = []
        for name, a in (("query", query), ("key", key), ("value", value)):
            if not isinstance(a, np.ndarray):
                raise TypeError(f"{name} must be a numpy.ndarray, not {type(a).__name__}")
            if a.dtype not in _INPUT_DTYPES:
                raise TypeError(f"{name} is {a.dtype}: clmha's attention function computes in "
                                f"float32 and takes float32 (or float16) arrays")
            if a.ndim < 2:
                raise ValueError(f"{name} has shape {a.shape}: it must have at least 2 "
                                 f"dimensions (..., L, D)")
            arrays.append(a)
        if not (query.dtype == key.dtype == value.dtype):
            raise TypeError(f"query, key and value must have one dtype, not {query.dtype}, "
                            f"{key.dtype} and {value.dtype}")
        self.dtype = query.dtype
        nd = query.ndim
        if key.ndim != nd or value.ndim != nd:
            raise ValueError(f"query {query.shape}, key {key.shape} and value {value.shape} must "
                             f"have the same number of dimensions")
        if nd > 4 and not (query.shape[:-3] == key.shape[:-3] == value.shape[:-3]):
            raise ValueError(f"the leading dimensions of query {query.shape}, key {key.shape} "
                             f"and value {value.shape} must be equal (they are not broadcast)")
        self.shapes = tuple(a.shape for a in arrays)
        # The C call's shapes: 2-D gets a head dimension of 1, 5-D and more fold into N.
        self.c_shapes = tuple(self._c_shape(a.shape) for a in arrays)
        self.arrays = [np.ascontiguousarray(a, np.float32) for a in arrays]
        self.out_shape = query.shape[:-1] + value.shape[-1:]
        self.lse_shape = query.shape[:-1]

        c = ffi.new("clmha_attention_args *")
        c.struct_size = ffi.sizeof("clmha_attention_args")
        for field, a, shape in zip((c.query, c.key, c.value), self.arrays, self.c_shapes):
            _fill(field, a, shape)
        c.layout = lib.CLMHA_LAYOUT_NHLD
        c.is_causal = bool(is_causal)
        if scale is None:
            c.scale = 0.0  # the C function's default: 1/sqrt(D)
        else:
            scale = _number("scale", scale)
            # PyTorch's scale 0 is a factor of zero (every score 0); the C function reads 0 as
            # "the default". The smallest positive double is 0 once the cores round it to float.
            c.scale = scale if scale != 0.0 else math.ulp(0.0)
        c.dropout_p = _number("dropout_p", dropout_p)
        for name, v in (("seed", seed), ("offset", offset)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"{name} must be an int, not {v!r}")
        c.rng.seed = int(seed) & (2**64 - 1)
        c.rng.offset = int(offset) & (2**64 - 1)
        c.enable_gqa = bool(enable_gqa)
        c.impl = _IMPLS[impl]
        self.kv_cache = kv_cache  # kept alive while the call's struct points at it
        self.kv_append = None
        if kv_cache is not None:
            c.kv_cache = kv_cache._ptr
        if kv_append is not None:
            # The C function reads N counts: their number is checked here (against the cache's
            # batch; without a cache the C function refuses kv_append before reading it).
            self.kv_append = (kv_cache._append_counts(kv_append) if kv_cache is not None
                              else ffi.new("size_t[1]"))
            c.kv_append = self.kv_append
        self.c = c
        # The tensors and options first, without the mask: the C library's message for a bad
        # shape or option comes before any of the mask's.
        counts = ffi.new("size_t[3]")
        check(lib.clmha_attention_output_counts(context._ptr, c, counts, counts + 1,
                                                counts + 2), context._ptr)
        self.mask = None
        self.mask_shape = None
        self.mask_float = False
        if attn_mask is not None:
            self._set_mask(attn_mask)
            check(lib.clmha_attention_output_counts(context._ptr, c, counts, counts + 1,
                                                    counts + 2), context._ptr)
        self.output_count, self.lse_count = int(counts[0]), int(counts[1])

    @staticmethod
    def _c_shape(shape):
        if len(shape) == 2:
            return (1,) + tuple(shape)
        if len(shape) <= 4:
            return tuple(shape)
        return (int(np.prod(shape[:-3])),) + tuple(shape[-3:])

    def _set_mask(self, m) -> None:
        """The mask in a form the C function reads, and what undoes it for its gradient."""
        if not isinstance(m, np.ndarray):
            raise TypeError(f"attn_mask must be a numpy.ndarray or None, not {type(m).__name__}")
        if m.dtype == np.bool_:
            kind, dtype = lib.CLMHA_MASK_BOOL_ATTEND, np.bool_
        elif m.dtype.kind == "f":
            kind, dtype = lib.CLMHA_MASK_FLOAT, np.float32
        else:
            raise TypeError(f"attn_mask must be bool (True = may attend) or floating point, not "
                            f"{m.dtype}")
        q_shape, k_shape = self.shapes[0], self.shapes[1]
        L, S = q_shape[-2], k_shape[-2]
        target = q_shape[:-2] + (L, S)
        if m.ndim > len(target) or any(
                x not in (1, t) for x, t in zip((1,) * (len(target) - m.ndim) + m.shape,
                                                target)):
            raise ValueError(f"attn_mask of shape {m.shape} does not broadcast to {target} "
                             f"(the query's leading dimensions, L and S)")
        pm = (1,) * (len(target) - m.ndim) + m.shape
        c_q = self.c_shapes[0]
        n = c_q[0] if len(c_q) == 4 else 1
        lead, p_lead = target[:-3], pm[:-3]
        has_heads = len(target) >= 3
        ph, pL = (pm[-3] if has_heads else 1), pm[-2]
        # The leading dimensions folded into N: broadcast along all of them (1) or none (N).
        bsel = 1 if all(x == 1 for x in p_lead) else n
        e_lead = p_lead if bsel == 1 else lead
        expanded = e_lead + ((ph,) if has_heads else ()) + (pL, S)
        values = np.ascontiguousarray(np.broadcast_to(m.reshape(pm), expanded), dtype)
        c_shape = (bsel, ph, pL, S) if len(c_q) == 4 else (ph, pL, S)
        self.mask = values
        self.mask_shape = m.shape
        self.mask_pm = pm
        self.mask_expanded = expanded
        self.mask_float = kind == lib.CLMHA_MASK_FLOAT
        self.c.attn_mask.kind = kind
        _fill(self.c.attn_mask.tensor, values, c_shape)

    def _mask_grad(self, g: np.ndarray) -> np.ndarray:
        """The gradient of the C form of the mask summed back to the mask's own shape."""
        g = g.reshape(self.mask_expanded)
        axes = tuple(i for i, (p, e) in enumerate(zip(self.mask_pm, self.mask_expanded))
                     if p == 1 and e != 1)
        if axes:
            g = g.sum(axis=axes, keepdims=True)
        return g.reshape(self.mask_shape)

    def _result(self, a: np.ndarray) -> np.ndarray:
        return a.astype(self.dtype) if self.dtype != np.float32 else a

    def forward(self, lse: bool = False):
        """The output (and the log-sum-exp rows with ``lse``)."""
        out = np.empty(self.out_shape, np.float32)
        lse_a = np.empty(self.lse_shape, np.float32) if lse else None
        check(lib.clmha_attention_forward_host(
            self.context._ptr, self.c, _ptr(out), out.size, _ptr(lse_a),
            lse_a.size if lse else 0, ffi.NULL, 0), self.context._ptr)
        return (self._result(out), lse_a) if lse else self._result(out)

    def backward(self, grad_output, want=(True, True, True, True)):
        """(grad_query, grad_key, grad_value, grad_attn_mask): each None where ``want`` says no
        (the mask's also without a float mask)."""
        if not isinstance(grad_output, np.ndarray):
            raise TypeError(f"grad_output must be a numpy.ndarray, not "
                            f"{type(grad_output).__name__}")
        if grad_output.dtype.kind != "f":
            raise TypeError(f"grad_output must be floating point, not {grad_output.dtype}")
        if grad_output.shape != self.out_shape:
            raise ValueError(f"grad_output has shape {grad_output.shape}; the output's is "
                             f"{self.out_shape}")
        g = np.ascontiguousarray(grad_output, np.float32)
        grads = [np.empty(s, np.float32) if w else None
                 for s, w in zip(self.shapes, want[:3])]
        gm = (np.empty(self.mask.shape, np.float32)
              if want[3] and self.mask is not None and self.mask_float else None)
        check(lib.clmha_attention_backward_host(
            self.context._ptr, self.c, _ptr(g), g.size, *(_ptr(a) for a in grads), _ptr(gm)),
            self.context._ptr)
        out = [self._result(a) if a is not None else None for a in grads]
        out.append(self._mask_grad(gm) if gm is not None else None)
        return tuple(out)
