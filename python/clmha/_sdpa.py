"""Scaled dot-product attention as a function: arrays to ``clmha_attention_args``, shared by
``clmha.numpy.scaled_dot_product_attention`` (and ``_backward``) and
``clmha.torch.scaled_dot_product_attention``. NumPy arrays go through the host forms
``clmha_attention_forward_host`` / ``clmha_attention_backward_host`` (float64 arrays: their
``_f64`` forms, computed in float64 with ``clmha_attention_args::dtype`` CLMHA_DTYPE_F64);
pyopencl arrays (on a
``Context.from_pyopencl`` context) through the device forms ``clmha_attention_forward`` /
``clmha_attention_backward``, on the arrays' own buffers, waiting for their events.

The C function takes (N, H, L, D) or unbatched (H, L, D) tensors ((N, L, H, D) and (L, H, D) in
the NLHD layout) and the masks of ``clmha_attention_args``: any (a, b, c, S) with a 1 or N, b 1
or H, c 1 or L (broadcast as SDPA broadcasts it; not along the keys). PyTorch's function takes
(..., L, D) with any number of leading dimensions and any mask that broadcasts to (..., L, S).
``Call`` maps the one onto the other: 2-D tensors get a head dimension of 1, leading dimensions
beyond N are folded into N (the arrays are contiguous: only the shapes given to the C function
change), and a mask is passed as it is, except along what the C function does not broadcast: the
folded leading dimensions (expanded where the mask has some of them but not all) and the keys (a
last dimension of 1 expanded to S); a float mask's gradient is summed back to the mask's own
shape.
"""

import math
import operator
import re
from typing import Optional, Tuple

import numpy as np

from ._context import Context, default_context
from ._device import (check_context, device_f32, elem_offset, event_to, events_wait_list,
                      fill_device_shape, is_pyopencl_array, mem)
from ._errors import check
from ._native import ffi, lib

_IMPLS = {"auto": lib.CLMHA_IMPL_AUTO, "fused": lib.CLMHA_IMPL_FUSED,
          "unfused": lib.CLMHA_IMPL_UNFUSED}
_LAYOUTS = {"NHLD": lib.CLMHA_LAYOUT_NHLD, "NLHD": lib.CLMHA_LAYOUT_NLHD}

#: the dtypes the call takes: float32 and float64, computed as they are (float64 on a device
#: with double precision); float16, computed in float32 and returned in float16 (NumPy arrays
#: only: pyopencl arrays are float32)
_INPUT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16))


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


def window_bounds(window) -> Optional[Tuple[int, int]]:
    """A sliding window as (left, right) ints, checked: None (no window) or a pair of ints, each
    -1 (that side unbounded) or from 0 to 2**63 - 1 (TypeError, ValueError otherwise)."""
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be None or a pair (left, right) of ints, not {window!r}")
    for name, v in zip(("left", "right"), window):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"window {name} must be an int, not {v!r}")
        if not -1 <= int(v) < 2 ** 63:
            raise ValueError(f"window {name} is {int(v)}: it must be -1 (unbounded) or from 0 "
                             f"to 2**63 - 1")
    return int(window[0]), int(window[1])


def fill_window(c, window) -> None:
    """Sets the window fields of a clmha_layer_desc or clmha_attention_args from
    window_bounds()."""
    c.window = window is not None
    c.window_left, c.window_right = window if window is not None else (0, 0)


def softcap_value(softcap) -> float:
    """Logit soft-capping as a float, checked: None or 0 is off (0.0), else a positive finite
    number c (every scaled score s becomes c * tanh(s / c)); a negative, NaN or infinite value
    is a ValueError, anything but a number a TypeError."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(
            softcap, (int, float, np.integer, np.floating)):
        raise TypeError(f"softcap must be None or a number, not {softcap!r}")
    value = float(softcap)
    if not value >= 0.0 or math.isinf(value):
        raise ValueError(f"softcap is {value}: it must be None or 0 (off) or a positive finite "
                         f"number")
    return value


def alibi_flag(alibi) -> bool:
    """ALiBi on or off: a bool (TypeError otherwise)."""
    if not isinstance(alibi, (bool, np.bool_)):
        raise TypeError(f"alibi must be a bool, not {alibi!r}")
    return bool(alibi)


def sinks_flag(sinks) -> bool:
    """A layer's attention sinks on or off: a bool (TypeError otherwise)."""
    if not isinstance(sinks, (bool, np.bool_)):
        raise TypeError(f"sinks must be a bool, not {sinks!r}")
    return bool(sinks)


def alibi_slopes(num_heads: int) -> np.ndarray:
    """The ALiBi paper's slopes for ``num_heads`` heads as float32 (``clmha_alibi_slopes``):
    2**(-8 (h + 1) / H) for H a power of two, else those of the largest power of two P below H
    followed by every other slope of 2P heads. What a layer with ``alibi=True`` starts with, and
    what ``alibi_slopes=None`` means in the attention function."""
    if isinstance(num_heads, bool) or not isinstance(num_heads, (int, np.integer)):
        raise TypeError(f"num_heads must be an int, not {num_heads!r}")
    if num_heads < 1:
        raise ValueError(f"num_heads must be at least 1, not {num_heads}")
    out = np.empty(int(num_heads), np.float32)
    check(lib.clmha_alibi_slopes(int(num_heads), ffi.cast("float *", ffi.from_buffer(out))))
    return out


def fill_variants(c, softcap: float, alibi: bool) -> None:
    """Sets softcap and alibi of a clmha_layer_desc or clmha_attention_args (values checked by
    softcap_value() and alibi_flag())."""
    c.softcap = softcap
    c.alibi = alibi


_MOD_NAMES = {"score_mod": "clmha_score_mod", "mask_mod": "clmha_mask_mod"}
_NO_MOD_SOURCE = ("mod_params is given without score_mod or mask_mod (it is the p of their "
                  "OpenCL C functions)")


def mod_text(name: str, source) -> Optional[str]:
    """One of the user functions' sources checked: ``score_mod`` (defining clmha_score_mod and
    optionally clmha_score_mod_grad) or ``mask_mod`` (defining clmha_mask_mod), OpenCL C source
    as a str; None or "" is none. A Python callable or anything but a str is a TypeError, a
    source that does not name its function (or holds a NUL character) a ValueError."""
    if source is None:
        return None
    if not isinstance(source, str):
        what = "a Python callable" if callable(source) else type(source).__name__
        raise TypeError(f"{name} must be OpenCL C source (a str) defining "
                        f"{_MOD_NAMES[name]}(...), not {what}: clmha compiles it into its "
                        f"kernels (FlexAttention's Python callables have no OpenCL form)")
    if not source:
        return None
    if "\0" in source:
        raise ValueError(f"{name} holds a NUL character")
    if not re.search(r"\b%s\b" % _MOD_NAMES[name], source):
        raise ValueError(f"{name} defines no {_MOD_NAMES[name]}: {name}= takes OpenCL C source "
                         f"defining {_MOD_NAMES[name]}(...)")
    return source


def mod_source(score_mod, mask_mod) -> Optional[str]:
    """The user functions' OpenCL C source (``clmha_layer_desc::mod_source``,
    ``clmha_attention_args::mod_source``): ``score_mod`` and ``mask_mod`` (checked by
    mod_text()) joined, score_mod first; None when both are none."""
    parts = [t for t in (mod_text("score_mod", score_mod), mod_text("mask_mod", mask_mod))
             if t is not None]
    return "\n".join(parts) if parts else None


def mod_params_array(mod_params, source: Optional[str]) -> Optional[np.ndarray]:
    """p of the user functions as a C-contiguous float32 NumPy array (count,), checked: None
    (none; the layer's p is then empty), or a 1-D floating-point array (a list or tuple of
    numbers too). Not floating point: TypeError; not 1-D: ValueError; given without
    score_mod or mask_mod (``source`` None): ValueError."""
    if mod_params is None:
        return None
    if source is None:
        raise ValueError(_NO_MOD_SOURCE)
    if isinstance(mod_params, (list, tuple)):
        try:
            mod_params = np.asarray(mod_params, np.float64)
        except (TypeError, ValueError) as e:
            raise TypeError(f"mod_params must be numbers: {e}") from None
    if not isinstance(mod_params, np.ndarray):
        raise TypeError(f"mod_params must be a 1-D floating-point array, not "
                        f"{type(mod_params).__name__}")
    if mod_params.dtype.kind != "f":
        raise TypeError(f"mod_params must be floating point (p is read as float32), not "
                        f"{mod_params.dtype}: convert it, e.g. with .astype(numpy.float32)")
    if mod_params.ndim != 1:
        raise ValueError(f"mod_params must be one-dimensional (count,); its shape is "
                         f"{mod_params.shape}")
    return np.ascontiguousarray(mod_params, np.float32)


def lens_array(name: str, lens):
    """A packed batch's lengths as a C size_t array (ints >= 0; a 1-D array or a sequence)."""
    if isinstance(lens, np.ndarray):
        if lens.ndim != 1 or lens.dtype.kind not in "iu":
            raise TypeError(f"{name} must be a 1-D integer array or a sequence of ints")
        lens = lens.tolist()
    try:
        values = [operator.index(x) for x in lens]
    except TypeError:
        raise TypeError(f"{name} must be a sequence of ints, not {lens!r}") from None
    if not values:
        raise ValueError(f"{name} is empty: a packed batch has at least one sequence")
    if any(x < 0 or x >= 2 ** 63 for x in values):
        raise ValueError(f"{name} must hold lengths >= 0, not {values}")
    return ffi.new("size_t[]", values)


def _layout(layout) -> str:
    name = layout.upper() if isinstance(layout, str) else None
    if name not in _LAYOUTS:
        raise ValueError(f"layout must be 'NHLD' (query (..., H, L, D), PyTorch's) or 'NLHD' "
                         f"(query (..., L, H, D), FlashAttention's), not {layout!r}")
    return name


def _nhld(shape, layout: str):
    """@p shape in (..., H, L, D) order: NLHD's sequence and head dimensions swapped."""
    if layout == "NLHD" and len(shape) >= 3:
        return tuple(shape[:-3]) + (shape[-2], shape[-3], shape[-1])
    return tuple(shape)


def _c_shape(shape, layout: str):
    """The shape the C function is given: 2-D gets a head dimension of 1, five and more
    dimensions fold into N."""
    if len(shape) == 2:
        return (1,) + tuple(shape) if layout == "NHLD" else (shape[0], 1, shape[1])
    if len(shape) <= 4:
        return tuple(shape)
    return (int(np.prod(shape[:-3])),) + tuple(shape[-3:])


class Call:
    """One call's ``clmha_attention_args``, with the arrays it points into kept alive.

    ``query`` (..., H, L, D), ``key`` (..., H_kv, S, D), ``value`` (..., H_kv, S, D_v) (with
    ``layout="NLHD"``: (..., L, H, D), (..., S, H_kv, D), (..., S, H_kv, D_v)): NumPy arrays of
    one dtype (float32, float64 or float16), or float32 C-contiguous pyopencl arrays (the
    device form, ``self.device``); ``attn_mask`` None or a bool (True = may attend) or floating
    array broadcasting to (..., H, L, S), NumPy (uploaded for a device call) or, for a device call,
    pyopencl (bool or uint8, or float32) in a shape the C function reads. The other arguments as
    ``scaled_dot_product_attention``'s, plus the dropout's Philox ``seed`` and ``offset``, the
    core ``impl``, the ``context`` (None: the cache's with ``kv_cache``, else the default
    context; a device call needs a ``Context.from_pyopencl`` context of the arrays' OpenCL
    context) and the KV-cache form's ``kv_cache`` (a ``clmha.KVCache``) and ``kv_append``
    (per-sequence counts of real new tokens), ``window``: None or a sliding window
    (left, right), -1 leaving a side unbounded (``clmha_attention_args::window``), ``softcap``
    (None or 0: off; c > 0: every scaled score s becomes c * tanh(s / c)), ``alibi`` (ALiBi:
    query head h at position i against key j gains -slope_h * |i - j|) and ``alibi_slopes``
    (with alibi: H slopes, a NumPy array or, for a device call, a float32 pyopencl array; None:
    the geometric ones of ``alibi_slopes()``) and ``sinks`` (None, or attention sinks: H
    logits, one per query head, each row's softmax denominator gaining exp(sinks_h - m) with a
    zero value; a NumPy array or, for a device call, a float32 pyopencl array), ``score_mod``
    and ``mask_mod`` (OpenCL C source defining clmha_score_mod (and clmha_score_mod_grad) and
    clmha_mask_mod, joined into ``clmha_attention_args::mod_source``) and ``mod_params``
    (their p: a 1-D floating-point NumPy array, float32 on the device, or for a device call a
    float32 pyopencl array).
    """

    def __init__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                 scale=None, enable_gqa=False, *, seed: int = 0, offset: int = 0,
                 impl: str = "auto", context: Optional[Context] = None, kv_cache=None,
                 kv_append=None, layout: str = "NHLD", window=None, softcap=None,
                 alibi: bool = False, alibi_slopes=None, sinks=None, score_mod=None,
                 mask_mod=None, mod_params=None, seq_lens=None, kv_seq_lens=None):
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
        self.layout = _layout(layout)
        self.context = context
        self.impl = impl
        tensors = (("query", query), ("key", key), ("value", value))
        on_device = [is_pyopencl_array(a) for _, a in tensors]
        self.device = on_device[0]
        if any(on_device) and not all(on_device):
            kinds = ", ".join(f"{n} {type(a).__module__}.{type(a).__name__}" for n, a in tensors)
            raise TypeError(f"query, key and value must be all NumPy arrays or all pyopencl "
                            f"arrays, not a mix ({kinds})")
        if self.device and context.pyopencl_queue is None:
            raise ValueError("pyopencl arrays need context=clmha.Context.from_pyopencl(ctx, "
                             "queue) of their OpenCL context (the device form runs on its "
                             "queue)")
        for name, a in tensors:
            if self.device:
                self._check_device_input(name, a)
            else:
                self._check_host_input(name, a)
        if not (query.dtype == key.dtype == value.dtype):
            raise TypeError(f"query, key and value must have one dtype, not {query.dtype}, "
                            f"{key.dtype} and {value.dtype}")
        self.dtype = query.dtype
        # The element of the C call: float64 arrays are computed in float64 (the host forms'
        # _f64 functions), the others in float32.
        self.f64 = not self.device and self.dtype == np.float64
        self.work = np.float64 if self.f64 else np.float32
        nd = query.ndim
        if key.ndim != nd or value.ndim != nd:
            raise ValueError(f"query {query.shape}, key {key.shape} and value {value.shape} must "
                             f"have the same number of dimensions")
        if nd > 4 and not (query.shape[:-3] == key.shape[:-3] == value.shape[:-3]):
            raise ValueError(f"the leading dimensions of query {query.shape}, key {key.shape} "
                             f"and value {value.shape} must be equal (they are not broadcast)")
        self.shapes = tuple(tuple(a.shape) for _, a in tensors)
        # The shapes in (..., H, L, D) order, which the mask, lse and weights follow.
        self.nhld = tuple(_nhld(s, self.layout) for s in self.shapes)
        # The C call's shapes: 2-D gets a head dimension of 1, 5-D and more fold into N.
        self.c_shapes = tuple(_c_shape(s, self.layout) for s in self.shapes)
        self.out_shape = self.shapes[0][:-1] + self.shapes[2][-1:]
        self.lse_shape = self.nhld[0][:-1]
        self.weights_shape = self.nhld[0][:-1] + self.nhld[1][-2:-1]
        self.keep = []  # device arrays the call reads (kept alive, given the call's event)
        self.wait = []  # their events

        c = ffi.new("clmha_attention_args *")
        c.struct_size = ffi.sizeof("clmha_attention_args")
        c.dtype = lib.CLMHA_DTYPE_F64 if self.f64 else lib.CLMHA_DTYPE_F32
        if self.device:
            self.arrays = [a for _, a in tensors]
            for field, a, shape in zip((c.query, c.key, c.value), self.arrays, self.c_shapes):
                fill_device_shape(field, a, shape)
                self._keep(a)
        else:
            self.arrays = [np.ascontiguousarray(a, self.work) for _, a in tensors]
            for field, a, shape in zip((c.query, c.key, c.value), self.arrays, self.c_shapes):
                _fill(field, a, shape)
        c.layout = _LAYOUTS[self.layout]
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
        self.window = window_bounds(window)
        fill_window(c, self.window)
        self.softcap = softcap_value(softcap)
        self.alibi = alibi_flag(alibi)
        fill_variants(c, self.softcap, self.alibi)
        self.c = c
        self.seq_lens = None  # a packed batch's lengths (C arrays kept alive with the call)
        if seq_lens is not None:
            self.seq_lens = lens_array("seq_lens", seq_lens)
            c.seq_lens, c.num_seqs = self.seq_lens, len(self.seq_lens)
            if kv_seq_lens is not None:
                self.kv_seq_lens = lens_array("kv_seq_lens", kv_seq_lens)
                if len(self.kv_seq_lens) != len(self.seq_lens):
                    raise ValueError(f"kv_seq_lens has {len(self.kv_seq_lens)} lengths, "
                                     f"seq_lens {len(self.seq_lens)}: one per sequence")
                c.kv_seq_lens = self.kv_seq_lens
        elif kv_seq_lens is not None:
            raise ValueError("kv_seq_lens needs seq_lens (the queries' lengths)")
        self.alibi_slopes = None
        if alibi_slopes is not None:
            self._set_slopes(alibi_slopes)
        self.sinks = None
        if sinks is not None:
            self._set_sinks(sinks)
        self.mod_source = mod_source(score_mod, mask_mod)
        if self.mod_source is not None:
            self._mod_source_c = ffi.new("char[]", self.mod_source.encode("utf-8"))
            c.mod_source = self._mod_source_c
        self.mod_params = None
        if mod_params is not None:
            self._set_mod_params(mod_params)
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
        # The tensors and options first, without the mask: the C library's message for a bad
        # shape or option comes before any of the mask's.
        counts = ffi.new("size_t[3]")
        check(lib.clmha_attention_output_counts(context._ptr, c, counts, counts + 1,
                                                counts + 2), context._ptr)
        self.mask = None
        self.mask_shape = None
        self.mask_float = False
        if attn_mask is not None and self.seq_lens is not None:
            raise ValueError("a packed call (seq_lens) takes no attn_mask: it has no "
                             "per-sequence shape (a mask_mod can mask within sequences)")
        if attn_mask is not None:
            self._set_mask(attn_mask)
            check(lib.clmha_attention_output_counts(context._ptr, c, counts, counts + 1,
                                                    counts + 2), context._ptr)
        self.output_count, self.lse_count = int(counts[0]), int(counts[1])
        self.weights_count = int(counts[2])
        if self.seq_lens is not None:  # (T, H, D_v) out, each sequence's (H, L_i) lse block
            self.lse_shape = (self.lse_count,)

    def _set_slopes(self, slopes) -> None:
        """The ALiBi slopes (H), checked here (ValueError: without alibi, or not H values), a
        NumPy array (uploaded for a device call) or, for a device call, a float32 pyopencl
        array read where it is."""
        if not self.alibi:
            raise ValueError("alibi_slopes is given but alibi is False (pass alibi=True)")
        self.alibi_slopes = self._per_head("alibi_slopes", slopes, self.c.alibi_slopes,
                                           "one slope per query head")

    def _set_sinks(self, sinks) -> None:
        """The attention sinks (H), checked (ValueError: not H values), as the slopes."""
        self.sinks = self._per_head("sinks", sinks, self.c.sinks, "one sink per query head")

    def _set_mod_params(self, values) -> None:
        """p of the user functions (count,): checked by mod_params_array() (a float32 pyopencl
        array, for a device call, is read where it is), uploaded for a device call."""
        if self.device and is_pyopencl_array(values):
            if self.mod_source is None:
                raise ValueError(_NO_MOD_SOURCE)
            device_f32(self.context, "mod_params", values)
            if len(values.shape) != 1:
                raise ValueError(f"mod_params must be one-dimensional (count,); its shape is "
                                 f"{tuple(values.shape)}")
            a = values
        elif is_pyopencl_array(values):
            raise TypeError("mod_params is a pyopencl array but query, key and value are NumPy "
                            "arrays")
        else:
            a = mod_params_array(values, self.mod_source)
        self.mod_params = a
        if not a.shape[0]:
            return  # an empty p: none
        if self.device:
            if not is_pyopencl_array(a):
                import pyopencl.array as cla

                a = cla.to_device(self.context.pyopencl_queue, a)
            fill_device_shape(self.c.mod_params, a, (a.shape[0],))
            self._keep(a)
        else:
            _fill(self.c.mod_params, a, (a.shape[0],))

    def _heads(self) -> int:
        if self.seq_lens is not None:  # packed (T, H, D)
            return self.shapes[0][1]
        q = self.nhld[0]
        return q[-3] if len(q) >= 3 else 1

    def _per_head(self, name: str, values, field, what: str):
        """@p values (H floats: a NumPy array or sequence, or for a device call a float32
        pyopencl array) checked and set into the clmha_tensor @p field."""
        heads = self._heads()
        if self.device and is_pyopencl_array(values):
            device_f32(self.context, name, values)
            a = values
        else:
            if is_pyopencl_array(values) or not hasattr(values, "__array__") and not isinstance(
                    values, (list, tuple)):
                raise TypeError(f"{name} must be a numpy.ndarray (or a sequence of "
                                f"floats) or None, not {type(values).__name__}")
            a = np.asarray(values)
            if a.dtype.kind not in "fiu":
                raise TypeError(f"{name} must be floating point, not {a.dtype}")
            a = np.ascontiguousarray(a, self.work)
        if tuple(a.shape) != (heads,):
            raise ValueError(f"{name} has shape {tuple(a.shape)}; it must be (H,) = "
                             f"({heads},), {what}")
        if self.device:
            if not is_pyopencl_array(a):
                import pyopencl.array as cla

                a = cla.to_device(self.context.pyopencl_queue, a)
            fill_device_shape(field, a, (heads,))
            self._keep(a)
        else:
            _fill(field, a, (heads,))
        return a

    @staticmethod
    def _check_host_input(name: str, a) -> None:
        if not isinstance(a, np.ndarray):
            raise TypeError(f"{name} must be a numpy.ndarray (or a pyopencl.array.Array), not "
                            f"{type(a).__name__}")
        if a.dtype not in _INPUT_DTYPES:
            raise TypeError(f"{name} is {a.dtype}: clmha's attention function takes float32, "
                            f"float64 (or float16) arrays")
        if a.ndim < 2:
            raise ValueError(f"{name} has shape {a.shape}: it must have at least 2 dimensions "
                             f"(..., L, D)")

    def _check_device_input(self, name: str, a) -> None:
        if a.dtype != np.float32:
            raise TypeError(f"{name} is a pyopencl array of {a.dtype}: the device form of "
                            f"clmha's attention function takes float32 arrays")
        if a.ndim < 2:
            raise ValueError(f"{name} has shape {a.shape}: it must have at least 2 dimensions "
                             f"(..., L, D)")
        if not a.flags.c_contiguous:
            raise ValueError(f"{name} (a pyopencl array of shape {a.shape}, strides "
                             f"{a.strides}) is not C-contiguous: the device form reads the "
                             f"buffer as it is (copy it first, e.g. with .copy())")
        check_context(self.context, name, a)

    def _keep(self, a) -> None:
        self.keep.append(a)
        self.wait.extend(a.events)

    def _set_mask(self, m) -> None:
        """The mask in a form the C function reads, and what undoes it for its gradient."""
        if self.device and is_pyopencl_array(m):
            return self._set_device_mask(m)
        if not isinstance(m, np.ndarray):
            also = " or a pyopencl.array.Array" if self.device else ""
            raise TypeError(f"attn_mask must be a numpy.ndarray{also} or None, not "
                            f"{type(m).__name__}")
        if m.dtype == np.bool_:
            kind, dtype = lib.CLMHA_MASK_BOOL_ATTEND, np.bool_
        elif m.dtype.kind == "f":
            kind, dtype = lib.CLMHA_MASK_FLOAT, self.work
        else:
            raise TypeError(f"attn_mask must be bool (True = may attend) or floating point, not "
                            f"{m.dtype}")
        pm, expanded, c_shape = self._mask_plan(m.shape)
        values = np.ascontiguousarray(np.broadcast_to(m.reshape(pm), expanded), dtype)
        self._mask_kind(m.shape, pm, expanded, kind)
        if self.device:  # uploaded for the call
            import pyopencl.array as cla

            self.mask = cla.to_device(self.context.pyopencl_queue,
                                      values.view(np.uint8) if dtype == np.bool_ else values)
            fill_device_shape(self.c.attn_mask.tensor, self.mask, c_shape)
            self._keep(self.mask)
        else:
            self.mask = values
            _fill(self.c.attn_mask.tensor, values, c_shape)

    def _set_device_mask(self, m) -> None:
        """A pyopencl mask, read where it is: it must be in a shape the C function reads."""
        if m.dtype in (np.dtype(np.bool_), np.dtype(np.uint8)):
            kind = lib.CLMHA_MASK_BOOL_ATTEND
        elif m.dtype == np.float32:
            kind = lib.CLMHA_MASK_FLOAT
        else:
            raise TypeError(f"attn_mask is a pyopencl array of {m.dtype}: the device form takes "
                            f"bool or uint8 (non-zero = may attend) or float32 masks")
        if not m.flags.c_contiguous:
            raise ValueError(f"attn_mask (a pyopencl array of shape {m.shape}) is not "
                             f"C-contiguous")
        check_context(self.context, "attn_mask", m)
        pm, expanded, c_shape = self._mask_plan(m.shape)
        if pm != expanded:
            raise ValueError(f"attn_mask of shape {m.shape} broadcasts to {self._mask_target()} "
                             f"in a way the C function does not read (it would be expanded to "
                             f"{expanded}): pass a pyopencl mask of shape (a, b, c, S) with a 1 or N, "
                             f"b 1 or H, c 1 or L, or a NumPy mask (expanded and uploaded)")
        self._mask_kind(m.shape, pm, expanded, kind)
        self.mask = m
        fill_device_shape(self.c.attn_mask.tensor, m, c_shape)
        self._keep(m)

    def _mask_target(self):
        q_shape, k_shape = self.nhld[0], self.nhld[1]
        return q_shape[:-2] + (q_shape[-2], k_shape[-2])

    def _mask_plan(self, shape):
        """(the mask's shape padded to the target's rank, the shape it is expanded to, the C
        function's shape of that) for a mask of @p shape."""
        target = self._mask_target()
        S = target[-1]
        if len(shape) > len(target) or any(
                x not in (1, t) for x, t in zip((1,) * (len(target) - len(shape)) + tuple(shape),
                                                target)):
            raise ValueError(f"attn_mask of shape {tuple(shape)} does not broadcast to {target} "
                             f"(the query's leading dimensions, H, L and S)")
        pm = (1,) * (len(target) - len(shape)) + tuple(shape)
        c_q = _c_shape(self.nhld[0], "NHLD")
        n = c_q[0] if len(c_q) == 4 else 1
        lead, p_lead = target[:-3], pm[:-3]
        has_heads = len(target) >= 3
        ph, pL = (pm[-3] if has_heads else 1), pm[-2]
        # The leading dimensions folded into N: broadcast along all of them (1) or none (N).
        bsel = 1 if all(x == 1 for x in p_lead) else n
        e_lead = p_lead if bsel == 1 else lead
        expanded = e_lead + ((ph,) if has_heads else ()) + (pL, S)
        c_shape = (bsel, ph, pL, S) if len(c_q) == 4 else (ph, pL, S)
        return pm, expanded, c_shape

    def _mask_kind(self, shape, pm, expanded, kind) -> None:
        self.mask_shape = tuple(shape)
        self.mask_pm = pm
        self.mask_expanded = expanded
        self.mask_float = kind == lib.CLMHA_MASK_FLOAT
        self.c.attn_mask.kind = kind

    def _mask_grad(self, g: np.ndarray) -> np.ndarray:
        """The gradient of the C form of the mask summed back to the mask's own shape."""
        g = g.reshape(self.mask_expanded)
        axes = tuple(i for i, (p, e) in enumerate(zip(self.mask_pm, self.mask_expanded))
                     if p == 1 and e != 1)
        if axes:
            g = g.sum(axis=axes, keepdims=True)
        return g.reshape(self.mask_shape)

    def _result(self, a: np.ndarray) -> np.ndarray:
        return a.astype(self.dtype) if self.dtype != a.dtype else a

    def forward(self, lse: bool = False, weights: bool = False):
        """The output, or a tuple of it and the log-sum-exp rows (with ``lse``) and the
        attention weights (with ``weights``): NumPy arrays, or for a device call new pyopencl
        arrays carrying the call's event."""
        if self.device:
            return self._forward_device(lse, weights)
        out = np.empty(self.out_shape, self.work)
        lse_a = np.empty(self.lse_shape, self.work) if lse else None
        w = np.empty(self.weights_shape, self.work) if weights else None
        forward = lib.clmha_attention_forward_host_f64 if self.f64 else \
            lib.clmha_attention_forward_host
        ct = "double *" if self.f64 else "float *"
        check(forward(self.context._ptr, self.c, _ptr(out, ct), out.size, _ptr(lse_a, ct),
                      lse_a.size if lse else 0, _ptr(w, ct), w.size if weights else 0),
              self.context._ptr)
        return self._results(self._result(out), lse_a,
                             self._result(w) if weights else None, lse, weights)

    @staticmethod
    def _results(out, lse_a, w, lse: bool, weights: bool):
        if not (lse or weights):
            return out
        return (out,) + ((lse_a,) if lse else ()) + ((w,) if weights else ())

    def _new(self, shape):
        import pyopencl.array as cla

        return cla.empty(self.context.pyopencl_queue, shape, np.float32)

    def _forward_device(self, lse: bool, weights: bool):
        out = self._new(self.out_shape)
        lse_a = self._new(self.lse_shape) if lse else None
        w = self._new(self.weights_shape) if weights else None
        num_wait, waits = events_wait_list(self.wait)
        event = ffi.new("cl_event *")
        check(lib.clmha_attention_forward(
            self.context._ptr, self.c, mem(out), elem_offset(out),
            mem(lse_a) if lse else ffi.NULL, elem_offset(lse_a) if lse else 0,
            mem(w) if weights else ffi.NULL, elem_offset(w) if weights else 0,
            num_wait, waits, event), self.context._ptr)
        # the inputs too: they must stay unchanged until the call is done
        event_to(event, [a for a in (out, lse_a, w) if a is not None] + self.keep)
        return self._results(out, lse_a, w, lse, weights)

    def backward(self, grad_output, want=(True, True, True, True, True), output=None,
                 lse=None):
        """(grad_query, grad_key, grad_value, grad_attn_mask), and with sinks grad_sinks (H)
        fifth: each None where ``want`` says no (the mask's also without a float mask). A
        device call takes ``grad_output`` as a pyopencl array, and optionally the forward's
        ``output`` (and ``lse``) instead of running the forward again; it returns all three
        input gradients (``want`` picks only the mask's and the sinks')."""
        want = tuple(want) + (True,) * (5 - len(want))
        if self.device:
            return self._backward_device(grad_output, want, output, lse)
        if output is not None or lse is not None:
            raise ValueError("output= and lse= are for pyopencl arrays: the host backward runs "
                             "the forward again")
        if not isinstance(grad_output, np.ndarray):
            raise TypeError(f"grad_output must be a numpy.ndarray, not "
                            f"{type(grad_output).__name__}")
        if grad_output.dtype.kind != "f":
            raise TypeError(f"grad_output must be floating point, not {grad_output.dtype}")
        if grad_output.shape != self.out_shape:
            raise ValueError(f"grad_output has shape {grad_output.shape}; the output's is "
                             f"{self.out_shape}")
        g = np.ascontiguousarray(grad_output, self.work)
        grads = [np.empty(s, self.work) if w else None
                 for s, w in zip(self.shapes, want[:3])]
        gm = (np.empty(self.mask_expanded, self.work)
              if want[3] and self.mask is not None and self.mask_float else None)
        backward = lib.clmha_attention_backward_host_f64 if self.f64 else \
            lib.clmha_attention_backward_host
        ct = "double *" if self.f64 else "float *"
        check(backward(self.context._ptr, self.c, _ptr(g, ct), g.size,
                       *(_ptr(a, ct) for a in grads), _ptr(gm, ct)), self.context._ptr)
        out = [self._result(a) if a is not None else None for a in grads]
        out.append(self._mask_grad(gm) if gm is not None else None)
        if self.sinks is not None:
            out.append(self._sinks_grad_host(g) if want[4] else None)
        return tuple(out)

    def _sinks_grad_host(self, g: np.ndarray) -> np.ndarray:
        """The sinks' gradient of the host form (clmha_attention_backward_host has none): the
        forward's output O and log-sum-exp rows (which include the sink) from the host forward
        again, then what the device backward's sinks_grad computes, in float64:
        dsinks_h = -sum over the rows (n, i) of head h of exp(sinks_h - lse) * (dO . O) (a sink
        is one more logit with a zero value: its score's gradient is P_sink (0 - D))."""
        out, lse = self.forward(lse=True)
        o = np.asarray(out, np.float64)
        go = np.asarray(g, np.float64)
        if self.seq_lens is not None:  # packed: each sequence's (H, L_i) block as (L_i, H)
            heads, rows, at = self._heads(), [], 0
            for length in self.seq_lens:
                rows.append(np.asarray(lse[at:at + heads * length]).reshape(heads, length).T)
                at += heads * length
            lse, o, go = np.concatenate(rows)[None], o[None], go[None]  # (1, T, H), (1, T, H, D)
            o, go = np.swapaxes(o, -3, -2), np.swapaxes(go, -3, -2)
            lse = np.swapaxes(lse, -2, -1)
        elif self.layout == "NLHD" and o.ndim >= 3:  # to (..., H, L, D_v), lse's order
            o, go = np.swapaxes(o, -3, -2), np.swapaxes(go, -3, -2)
        d = np.sum(o * go, axis=-1)  # (..., H, L)
        lse = np.asarray(lse, np.float64)
        heads = self._heads()
        d = d.reshape(-1, heads, d.shape[-1]) if d.ndim >= 2 else d.reshape(1, 1, -1)
        lse = lse.reshape(d.shape)
        sinks = np.asarray(self.sinks, np.float64).reshape(1, heads, 1)
        with np.errstate(over="ignore", invalid="ignore"):
            p_sink = np.where(np.isfinite(lse), np.exp(sinks - lse), 0.0)
        grad = -np.sum(np.where(d != 0.0, p_sink * d, 0.0), axis=(0, 2))
        return self._result(grad.astype(self.work))

    def _device_array(self, name: str, a, shape):
        if not is_pyopencl_array(a):
            raise TypeError(f"{name} must be a pyopencl.array.Array for a call on pyopencl "
                            f"arrays, not {type(a).__name__}")
        device_f32(self.context, name, a)
        if tuple(a.shape) != tuple(shape):
            raise ValueError(f"{name} has shape {tuple(a.shape)}; this call's is "
                             f"{tuple(shape)}")
        return a

    def _backward_device(self, grad_output, want, output, lse):
        if self.kv_cache is not None:
            raise ValueError("a call with kv_cache has no backward")
        go = self._device_array("grad_output", grad_output, self.out_shape)
        if output is None:
            if lse is not None:
                raise ValueError("lse= needs output= too (the forward's results of this call)")
            # As the host form: the forward again, with the log-sum-exp rows where they let the
            # fused backward run.
            # The sinks' gradient needs the log-sum-exp rows whatever the core.
            need_lse = (self.impl != "unfused" and not (want[3] and self.mask_float)) or (
                self.sinks is not None and want[4])
            res = self.forward(lse=need_lse)
            output, lse = res if need_lse else (res, None)
        else:
            self._device_array("output", output, self.out_shape)
            if lse is not None:
                self._device_array("lse", lse, self.lse_shape)
        grads = [self._new(s) for s in self.shapes]  # the device form writes all three
        gm = None
        if want[3] and self.mask is not None and self.mask_float:
            gm = self._new(self.mask_expanded)
        b = ffi.new("clmha_attention_backward_args *")
        b.struct_size = ffi.sizeof("clmha_attention_backward_args")
        b.forward = self.c
        b.output, b.output_offset = mem(output), elem_offset(output)
        if lse is not None:
            b.lse, b.lse_offset = mem(lse), elem_offset(lse)
        b.grad_output, b.grad_output_offset = mem(go), elem_offset(go)
        for a, buf, off in ((grads[0], "grad_query", "grad_query_offset"),
                            (grads[1], "grad_key", "grad_key_offset"),
                            (grads[2], "grad_value", "grad_value_offset"),
                            (gm, "grad_attn_mask", "grad_attn_mask_offset")):
            if a is not None:
                setattr(b, buf, mem(a))
                setattr(b, off, elem_offset(a))
        gs = None
        if self.sinks is not None and want[4]:
            if lse is None:
                raise ValueError("the sinks' gradient needs lse= too (the forward's log-sum-exp "
                                 "rows: the sinks' probabilities are exp(sinks - lse))")
            gs = self._new((self._heads(),))
            b.grad_sinks, b.grad_sinks_offset = mem(gs), elem_offset(gs)
        b.impl = _IMPLS[self.impl]
        reads = [output, go] + ([lse] if lse is not None else [])
        num_wait, waits = events_wait_list(self.wait + [e for a in reads for e in a.events])
        event = ffi.new("cl_event *")
        check(lib.clmha_attention_backward(self.context._ptr, b, num_wait, waits, event),
              self.context._ptr)
        written = [a for a in grads + [gm, gs] if a is not None]
        event_to(event, written + reads + self.keep)
        result = list(grads)
        if gm is None:
            result.append(None)
        elif self.mask_pm == self.mask_expanded:
            result.append(gm.reshape(self.mask_shape))
        else:
            # A NumPy mask the C function reads only expanded: its gradient is summed back on
            # the host (get() waits for the call) and uploaded.
            import pyopencl.array as cla

            result.append(cla.to_device(self.context.pyopencl_queue,
                                        np.ascontiguousarray(self._mask_grad(gm.get()))))
        if self.sinks is not None:
            result.append(gs)
        return tuple(result)
