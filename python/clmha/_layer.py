"""clmha.Layer: one attention layer on NumPy arrays (or pyopencl arrays), its KV cache and its
saved state for the backward pass."""

import threading
from typing import Dict, Iterable, Optional, Sequence, Tuple, Union

import numpy as np

from ._context import Context, default_context
from ._device import (check_context, device_f32, elem_offset, event_to, events_wait_list,
                      fill_device_tensor, is_pyopencl_array, mem, wait_list)
from ._errors import check
from ._native import ffi, lib
from ._sdpa import (alibi_flag, lens_array, fill_variants, fill_window, mod_params_array, mod_source,
                    sinks_flag, softcap_value, window_bounds)

# ---- dtypes ------------------------------------------------------------------------------------

_DTYPE_CODES = {"float32": lib.CLMHA_DTYPE_F32, "float64": lib.CLMHA_DTYPE_F64,
                "float16": lib.CLMHA_DTYPE_F16, "bfloat16": lib.CLMHA_DTYPE_BF16}
_DTYPE_ALIASES = {"f32": "float32", "float": "float32", "f64": "float64", "double": "float64",
                  "f16": "float16", "half": "float16", "bf16": "bfloat16"}
_DTYPE_NAMES = {code: name for name, code in _DTYPE_CODES.items()}


def dtype_name(dtype) -> str:
    """"float32", "float64", "float16" or "bfloat16" for a name, a NumPy dtype or a torch dtype
    (None: float32). Anything else is a TypeError."""
    if dtype is None:
        return "float32"
    text = str(dtype)
    if text.startswith("torch."):
        text = text[len("torch."):]
    if not isinstance(dtype, str):
        try:
            text = np.dtype(dtype).name if not str(dtype).startswith("torch.") else text
        except TypeError:
            pass
    text = _DTYPE_ALIASES.get(text, text)
    if text not in _DTYPE_CODES:
        raise TypeError(f"unsupported dtype {dtype!r}: clmha layers are float32, float64, "
                        f"float16 or bfloat16")
    return text


# ---- masks -------------------------------------------------------------------------------------


class Mask:
    """A mask with its polarity and layout stated, for the masks PyTorch's module does not take.

    ``Mask(values, attend=True)``: a boolean mask whose True means "may attend"
    (``scaled_dot_product_attention``'s and continuiti's polarity; plain bool arrays given to
    ``forward`` keep ``nn.MultiheadAttention``'s, True = may NOT attend).
    ``per_batch=True``: a 3-D attn_mask of shape (N, L, S) shared by every head of each batch
    item (continuiti's layout) instead of PyTorch's (N*H, L, S).
    """

    def __init__(self, values, *, attend: bool = False, per_batch: bool = False):
        self.values = values
        self.attend = bool(attend)
        self.per_batch = bool(per_batch)

    def __repr__(self) -> str:
        return (f"clmha.Mask(shape={tuple(np.shape(self.values))}, attend={self.attend}, "
                f"per_batch={self.per_batch})")


_IMPLS = {"auto": lib.CLMHA_IMPL_AUTO, "fused": lib.CLMHA_IMPL_FUSED,
          "unfused": lib.CLMHA_IMPL_UNFUSED}


def _check_impl(impl) -> None:
    if not isinstance(impl, str) or impl not in _IMPLS:
        raise ValueError(f"impl must be 'auto', 'fused' or 'unfused', not {impl!r}")


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, not {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, not {value}")
    return int(value)


class _Args:
    """A clmha_forward_args being filled, with the Python objects it points into kept alive."""

    def __init__(self):
        self.c = ffi.new("clmha_forward_args *")
        self.c.struct_size = ffi.sizeof("clmha_forward_args")
        self.keep = []
        self.wait = []  # pyopencl events the device call waits for


def _check_array(name: str, a, ranks: Iterable[int]) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray (or a pyopencl.array.Array on a "
                        f"pyopencl context), not {type(a).__name__}")
    if a.ndim not in ranks:
        raise ValueError(f"{name} must have {' or '.join(map(str, ranks))} dimensions; its "
                         f"shape is {a.shape}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} is not C-contiguous (shape {a.shape}, strides {a.strides}): "
                         f"pass numpy.ascontiguousarray({name})")
    if any(s == 0 for s in a.shape):
        raise ValueError(f"{name} has an empty dimension (shape {a.shape})")
    return a


def _fill_tensor(t, array: np.ndarray, args: _Args) -> None:
    t.ndim = array.ndim
    for i, s in enumerate(array.shape):
        t.shape[i] = s
    t.data = ffi.from_buffer(array)
    args.keep.append(array)


class Layer:
    """One multi-head attention layer (``torch.nn.MultiheadAttention``'s configuration and
    parameters) on an OpenCL device.

    ``Layer(embed_dim, num_heads, *, dropout=0.0, bias=True, add_bias_kv=False,
    add_zero_attn=False, kdim=None, vdim=None, batch_first=False, num_kv_heads=None,
    dtype="float32", window=None, softcap=None, alibi=False, sinks=False, score_mod=None,
    mask_mod=None, mod_params=None, context=None)``: the fields of
    ``clmha_layer_desc``, with PyTorch's defaults. ``window``: None, or a sliding window
    (left, right): query i (at position i; with a KV cache, the cached length + i) attends key j
    only when i - left <= j <= i + right, -1 leaving a side unbounded; the keys of add_bias_kv
    and add_zero_attn are never windowed, and the window combines with the masks and is_causal.
    ``softcap``: None or 0 (off), or c > 0: every scaled score s, the appended keys' too,
    becomes c * tanh(s / c) (Gemma 2's logit soft-capping), before ALiBi and the masks;
    negative, NaN or infinite: ValueError. ``alibi``: ALiBi, the score of query head h at
    position i (as the window's) against key j gains -slope_h * |i - j| (the appended keys get
    none); the slopes are the layer's parameter ``alibi_slopes`` (H), which starts as
    ``clmha.alibi_slopes(H)`` and has no gradient. ``sinks``: attention sinks (gpt-oss's), the
    layer's parameter ``sinks`` (H), zero at creation, with a gradient: one logit per head in
    each row's softmax denominator with a zero value (a row's weights sum below 1; a fully
    masked row still gives a zero attention result).
    ``score_mod``, ``mask_mod``: user score and mask functions (FlexAttention's), OpenCL C
    source compiled into the layer's kernels (joined into ``clmha_layer_desc::mod_source``,
    ``layer.mod_source``): score_mod defines ``clmha_real clmha_score_mod(clmha_real s, int b,
    int h, int q, int k, __global const float *p)`` (the new score of batch item b, query head
    h, query position q (as the window's) and key k; after soft-capping and ALiBi, before the
    masks; the appended keys' scores are left alone) and, for ``backward``, its derivative in
    s ``clmha_score_mod_grad`` (same arguments; without it ``backward`` raises ``clmha.Error``
    UNSUPPORTED); mask_mod defines ``int clmha_mask_mod(int b, int h, int q, int k,
    __global const float *p)``, non-zero where q may attend k. clmha_real is float (double in
    a float64 layer). ``mod_params``: their p, a 1-D floating-point array (count,) stored as
    float32 (None: none); ``layer.mod_params = values`` (``set_mod_params``) replaces it, with
    the same count. A source that does not compile raises ``clmha.Error`` (BUILD_FAILED) with
    the build log; a callable, a source without its function, mod_params without a source,
    not floating point or not 1-D raise TypeError / ValueError. The functions and p are not
    written to layer files (``save``), and ``attend`` refuses a layer with them.
    Parameters start at zero: set them by PyTorch name (``layer["in_proj_weight"] = w``,
    ``load_state_dict``) or make the layer with ``Layer.load(path)`` or
    ``Layer.from_state_dict(...)``.

    A layer is used by one thread at a time (calls from several threads are serialised by a lock).
    """

    def __init__(self, embed_dim: int, num_heads: int, *, dropout: float = 0.0,
                 bias: bool = True, add_bias_kv: bool = False, add_zero_attn: bool = False,
                 kdim: Optional[int] = None, vdim: Optional[int] = None,
                 batch_first: bool = False, num_kv_heads: Optional[int] = None,
                 dtype="float32", window: Optional[Tuple[int, int]] = None,
                 softcap: Optional[float] = None, alibi: bool = False,
                 sinks: bool = False, score_mod: Optional[str] = None,
                 mask_mod: Optional[str] = None, mod_params=None,
                 context: Optional[Context] = None):
        for name, value in (("embed_dim", embed_dim), ("num_heads", num_heads),
                            ("kdim", kdim or 0), ("vdim", vdim or 0),
                            ("num_kv_heads", num_kv_heads or 0)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise TypeError(f"{name} must be a non-negative int, not {value!r}")
        if not isinstance(dropout, (float, int)) or isinstance(dropout, bool):
            raise TypeError(f"dropout must be a float, not {dropout!r}")
        window = window_bounds(window)
        softcap = softcap_value(softcap)
        alibi = alibi_flag(alibi)
        sinks = sinks_flag(sinks)
        source = mod_source(score_mod, mask_mod)
        params = mod_params_array(_to_numpy(mod_params), source)
        context = context if context is not None else default_context()
        if not isinstance(context, Context):
            raise TypeError(f"context must be a clmha.Context, not {type(context).__name__}")
        desc = ffi.new("clmha_layer_desc *")
        desc.struct_size = ffi.sizeof("clmha_layer_desc")
        desc.embed_dim = embed_dim
        desc.num_heads = num_heads
        desc.kdim = kdim or 0
        desc.vdim = vdim or 0
        desc.bias = bool(bias)
        desc.add_bias_kv = bool(add_bias_kv)
        desc.add_zero_attn = bool(add_zero_attn)
        desc.batch_first = bool(batch_first)
        desc.dropout = float(dropout)
        desc.num_kv_heads = num_kv_heads or 0
        desc.dtype = _DTYPE_CODES[dtype_name(dtype)]
        fill_window(desc, window)
        fill_variants(desc, softcap, alibi)
        desc.sinks = sinks
        if source is not None:
            source_c = ffi.new("char[]", source.encode("utf-8"))  # copied by the layer
            desc.mod_source = source_c
        if params is not None and params.size:
            desc.mod_params = ffi.cast("float *", ffi.from_buffer(params))
            desc.mod_params_count = params.size
        out = ffi.new("clmha_layer **")
        check(lib.clmha_layer_create(out, context._ptr, desc), context._ptr)
        self._adopt(out[0], context)
        self.score_mod = score_mod or None  # checked by mod_source()
        self.mask_mod = mask_mod or None
        if params is not None:
            self._mod_params = params.copy()

    def _adopt(self, ptr, context: Context) -> None:
        self._ptr = ffi.gc(ptr, lib.clmha_layer_release)
        self._context = context  # released after the layer (clmha also holds a reference)
        self._lock = threading.RLock()
        desc = ffi.new("clmha_layer_desc *")
        desc.struct_size = ffi.sizeof("clmha_layer_desc")
        check(lib.clmha_layer_get_desc(self._ptr, desc), context._ptr)
        self.embed_dim = int(desc.embed_dim)
        self.num_heads = int(desc.num_heads)
        self.kdim = int(desc.kdim)
        self.vdim = int(desc.vdim)
        self.bias = bool(desc.bias)
        self.add_bias_kv = bool(desc.add_bias_kv)
        self.add_zero_attn = bool(desc.add_zero_attn)
        self.batch_first = bool(desc.batch_first)
        self.dropout = float(desc.dropout)
        self.num_kv_heads = int(desc.num_kv_heads) or self.num_heads
        self.dtype = _DTYPE_NAMES[int(desc.dtype)]
        self.window = ((int(desc.window_left), int(desc.window_right)) if desc.window
                       else None)
        self.softcap = float(desc.softcap)
        self.alibi = bool(desc.alibi)
        self.sinks = bool(desc.sinks)
        self.mod_source = (ffi.string(desc.mod_source).decode("utf-8")
                           if desc.mod_source != ffi.NULL else None)
        self.score_mod = self.mask_mod = None  # the parts of mod_source, where known
        self.mod_params_count = int(desc.mod_params_count)
        self._mod_params = (np.zeros(self.mod_params_count, np.float32)
                            if self.mod_source is not None else None)
        if self.mod_params_count:  # p as the layer holds it (a layer file's mod_params)
            buf = ffi.from_buffer("float[]", self._mod_params)
            check(lib.clmha_layer_get_mod_params(self._ptr, buf, self.mod_params_count),
                  context._ptr)
        self.head_dim = self.embed_dim // self.num_heads
        self._impl = "auto"
        self._profiling = False

    # ---- files -------------------------------------------------------------------------------

    @classmethod
    def load(cls, path, context: Optional[Context] = None, *, dtype=None,
             prefix: Optional[str] = None, num_heads: Optional[int] = None,
             batch_first: Optional[bool] = None) -> "Layer":
        """A layer from a ``.safetensors`` layer file (``clmha_layer_load``): PyTorch's names,
        continuiti's or the classic module's; ``prefix`` picks one attention module out of a
        whole model's checkpoint, ``num_heads`` is needed where the file's metadata lacks it.
        The file's metadata ``window`` ("LEFT,RIGHT") gives the layer's sliding window
        (``layer.window``), ``softcap`` ("C") its soft-capping, ``alibi`` ("true") ALiBi
        (the slopes: the file's tensor ``alibi_slopes``, else the geometric ones) and
        ``mod_source`` its user functions (``layer.mod_source``, p from the tensor
        ``mod_params``); ``save`` writes them."""
        context = context if context is not None else default_context()
        out = ffi.new("clmha_layer **")
        path_b = _path_bytes(path)
        code = _DTYPE_CODES[dtype_name(dtype)]
        if prefix or num_heads or batch_first is not None:
            if not hasattr(lib, "clmha_layer_load_prefixed"):
                raise TypeError("this build of clmha has no clmha_layer_load_prefixed()")
            opts = ffi.new("clmha_load_options *")
            opts.struct_size = ffi.sizeof("clmha_load_options")
            prefix_b = ffi.new("char[]", prefix.encode("utf-8")) if prefix else ffi.NULL
            opts.prefix = prefix_b
            opts.num_heads = int(num_heads or 0)
            opts.dtype = code
            opts.batch_first = (lib.CLMHA_BATCH_FIRST_AUTO if batch_first is None else
                                lib.CLMHA_BATCH_FIRST_YES if batch_first else
                                lib.CLMHA_BATCH_FIRST_NO)
            check(lib.clmha_layer_load_prefixed(out, context._ptr, path_b, opts), context._ptr)
        else:
            check(lib.clmha_layer_load_as(out, context._ptr, path_b, code), context._ptr)
        self = cls.__new__(cls)
        self._adopt(out[0], context)
        return self

    def save(self, path) -> None:
        """Writes the layer as a ``.safetensors`` layer file (whole or not at all)."""
        with self._lock:
            check(lib.clmha_layer_save(self._ptr, _path_bytes(path)), self._context._ptr)

    # ---- parameters ----------------------------------------------------------------------------

    def _shape(self, name: str) -> Tuple[int, ...]:
        e, kv = self.embed_dim, self.num_kv_heads * self.head_dim
        shapes = {"in_proj_weight": (3 * e, e), "q_proj_weight": (e, e),
                  "k_proj_weight": (kv, self.kdim), "v_proj_weight": (kv, self.vdim),
                  "in_proj_bias": (e + 2 * kv,), "out_proj.weight": (e, e),
                  "out_proj.bias": (e,), "bias_k": (1, 1, kv), "bias_v": (1, 1, kv),
                  "alibi_slopes": (self.num_heads,), "sinks": (self.num_heads,)}
        if name == "alibi_slopes" and not self.alibi:
            raise KeyError("alibi_slopes: the layer has no ALiBi (made with alibi=False)")
        if name == "sinks" and not self.sinks:
            raise KeyError("sinks: the layer has no attention sinks (made with sinks=False)")
        if name not in shapes:
            raise KeyError(f"unknown parameter {name!r}; the layer's are "
                           f"{', '.join(self.parameter_names())}")
        return shapes[name]

    def parameter_names(self) -> Tuple[str, ...]:
        """The layer's parameters by ``state_dict()`` name, in PyTorch's order (a sinks layer's
        ``sinks`` and an ALiBi layer's ``alibi_slopes`` where ``clmha.torch.MultiheadAttention``
        has its parameter and its buffer: after bias_v, in that order)."""
        has = lambda n: lib.clmha_layer_parameter_count(self._ptr, n.encode()) > 0  # noqa: E731
        names = ["in_proj_weight"] if has("in_proj_weight") else [
            "q_proj_weight", "k_proj_weight", "v_proj_weight"]
        for n in ("in_proj_bias", "bias_k", "bias_v", "sinks", "alibi_slopes",
                  "out_proj.weight", "out_proj.bias"):
            if has(n):
                names.append(n)
        return tuple(names)

    def _host_dtype(self):
        return np.float64 if self.dtype == "float64" else np.float32

    def __getitem__(self, name: str) -> np.ndarray:
        """The parameter ``name`` (``state_dict()`` name) as a new array: float64 for a float64
        layer, float16 for a float16 one, else float32 (a bfloat16 layer's values)."""
        shape = self._shape(name)
        host = np.empty(shape, self._host_dtype())
        with self._lock:
            fn = (lib.clmha_layer_get_parameter_f64 if host.dtype == np.float64
                  else lib.clmha_layer_get_parameter)
            ptr = ffi.cast("double *" if host.dtype == np.float64 else "float *",
                           ffi.from_buffer(host))
            check(fn(self._ptr, name.encode(), ptr, host.size), self._context._ptr)
        return host.astype(np.float16) if self.dtype == "float16" else host

    def __setitem__(self, name: str, value) -> None:
        """Sets a parameter from an array of its PyTorch shape (rounded to the layer's dtype)."""
        shape = self._shape(name)
        value = _to_numpy(value)
        if not isinstance(value, np.ndarray) or value.dtype.kind != "f":
            raise TypeError(f"parameter {name} must be a floating-point array, not "
                            f"{getattr(value, 'dtype', type(value).__name__)}")
        if tuple(value.shape) != shape:
            raise ValueError(f"parameter {name} has shape {shape}; got {tuple(value.shape)}")
        wide = value.dtype == np.float64
        host = np.ascontiguousarray(value, np.float64 if wide else np.float32)
        with self._lock:
            fn = lib.clmha_layer_set_parameter_f64 if wide else lib.clmha_layer_set_parameter
            ptr = ffi.cast("double *" if wide else "float *", ffi.from_buffer(host))
            check(fn(self._ptr, name.encode(), ptr, host.size), self._context._ptr)

    def state_dict(self) -> Dict[str, np.ndarray]:
        """Every parameter by ``state_dict()`` name."""
        return {name: self[name] for name in self.parameter_names()}

    def load_state_dict(self, state_dict) -> None:
        """Sets every parameter from a mapping of ``state_dict()`` names to arrays or tensors.
        An ALiBi layer's ``alibi_slopes`` and a sinks layer's ``sinks`` may be left out
        (``nn.MultiheadAttention``'s state_dict has neither): the layer keeps its values."""
        missing = [n for n in self.parameter_names()
                   if n not in state_dict and n not in ("alibi_slopes", "sinks")]
        unexpected = [n for n in state_dict if n not in self.parameter_names()]
        if missing or unexpected:
            raise KeyError(f"state_dict does not match the layer: missing {missing}, "
                           f"unexpected {unexpected}")
        for name in self.parameter_names():
            if name in state_dict:
                self[name] = state_dict[name]

    @property
    def mod_params(self) -> Optional[np.ndarray]:
        """p of the layer's user functions (``score_mod``, ``mask_mod``): a float32 copy of the
        values last set, (``mod_params_count``,); None for a layer without them. Assigning sets
        them (``set_mod_params``)."""
        return None if self._mod_params is None else self._mod_params.copy()

    @mod_params.setter
    def mod_params(self, values) -> None:
        self.set_mod_params(values)

    def set_mod_params(self, values) -> None:
        """Replaces p of the layer's user functions (``clmha_layer_set_mod_params``): a 1-D
        floating-point array or tensor of ``mod_params_count`` values, stored as float32, read
        by the calls after this one (a blocking write after the work already queued). Without
        user functions, not floating point, not 1-D or another count: ValueError / TypeError."""
        params = mod_params_array(_to_numpy(values), self.mod_source)
        if params.size != self.mod_params_count:
            raise ValueError(f"mod_params has {params.size} values; the layer was made with "
                             f"{self.mod_params_count} (a new count needs a new layer)")
        with self._lock:
            check(lib.clmha_layer_set_mod_params(
                self._ptr, ffi.cast("float *", ffi.from_buffer(params)) if params.size
                else ffi.NULL, params.size), self._context._ptr)
        self._mod_params = params.copy()

    @classmethod
    def from_state_dict(cls, state_dict, num_heads: int, *, prefix: str = "",
                        context: Optional[Context] = None, dtype=None,
                        batch_first: Optional[bool] = None, dropout: float = 0.0,
                        add_zero_attn: bool = False,
                        window: Optional[Tuple[int, int]] = None,
                        softcap: Optional[float] = None,
                        alibi: Optional[bool] = None,
                        sinks: Optional[bool] = None, score_mod: Optional[str] = None,
                        mask_mod: Optional[str] = None, mod_params=None) -> "Layer":
        """A layer from the parameters of ``nn.MultiheadAttention``, continuiti's
        ``MultiHeadAttention`` (``query_project``, ``key_project``, ``value_project``,
        ``out_project``) or the classic split-heads module (``w_q``, ``w_k``, ``w_v``,
        ``w_concat``), arrays or tensors by ``state_dict()`` name; ``prefix`` picks one module's
        entries out of a whole model's ``state_dict()``. The two seed modules are batch-first.
        ``window``: a sliding window (left, right), ``softcap`` and ``alibi``, as ``Layer``'s;
        an ``alibi_slopes`` entry (a ``clmha.torch.MultiheadAttention``'s buffer) makes an ALiBi
        layer with those slopes (``alibi`` None: ALiBi exactly when the entry is there; True
        without it: the geometric slopes; False with it: ValueError); likewise a ``sinks``
        entry (a ``clmha.torch.MultiheadAttention``'s parameter) makes a sinks layer with those
        sinks (``sinks`` None: exactly when the entry is there; True without it: zeros).
        ``score_mod``, ``mask_mod`` and ``mod_params``: user functions, as ``Layer``'s."""
        from ._state_dict import translate

        config, params = translate(state_dict, num_heads, prefix)
        has_slopes = "alibi_slopes" in params
        if alibi is None:
            alibi = has_slopes
        elif has_slopes and not alibi_flag(alibi):
            raise ValueError("the state_dict has alibi_slopes but alibi is False")
        has_sinks = "sinks" in params
        if sinks is None:
            sinks = has_sinks
        elif has_sinks and not sinks_flag(sinks):
            raise ValueError("the state_dict has sinks but sinks is False")
        if batch_first is None:
            batch_first = config.pop("batch_first")
        else:
            config.pop("batch_first")
        layer = cls(num_heads=num_heads, context=context, dtype=dtype, batch_first=batch_first,
                    dropout=dropout, add_zero_attn=add_zero_attn, window=window,
                    softcap=softcap, alibi=alibi, sinks=sinks, score_mod=score_mod,
                    mask_mod=mask_mod, mod_params=mod_params, **config)
        layer.load_state_dict(params)  # without alibi_slopes: the geometric ones
        return layer

    # ---- forward -------------------------------------------------------------------------------

    def _input_dtypes(self):
        return {"float32": (np.float32,), "float64": (np.float64,),
                "float16": (np.float16, np.float32), "bfloat16": (np.float32,)}[self.dtype]

    def _host_input(self, name: str, a, ranks=(2, 3)) -> np.ndarray:
        a = _check_array(name, a, ranks)
        if a.dtype.type not in self._input_dtypes():
            allowed = " or ".join(np.dtype(d).name for d in self._input_dtypes())
            raise TypeError(f"{name} is {a.dtype}; a {self.dtype} layer takes {allowed} arrays")
        return np.ascontiguousarray(a, self._host_dtype())

    def _host_mask(self, name: str, m, field, args: _Args, attn: bool) -> None:
        attend, per_batch = False, False
        if isinstance(m, Mask):
            attend, per_batch, m = m.attend, m.per_batch, m.values
        m = _check_array(name, _to_numpy(m), (1, 2, 3))
        if m.dtype == np.bool_ or m.dtype == np.uint8:
            field.kind = lib.CLMHA_MASK_BOOL_ATTEND if attend else lib.CLMHA_MASK_BOOL_IGNORE
            m = m.view(np.uint8)
        elif m.dtype.kind == "f":
            if attend:
                raise ValueError(f"{name}: attend=True is for boolean masks")
            field.kind = lib.CLMHA_MASK_FLOAT
            m = np.ascontiguousarray(m, self._host_dtype())
        else:
            raise TypeError(f"{name} must be bool (or uint8) or floating point, not {m.dtype}")
        if per_batch and not attn:
            raise ValueError("per_batch is for attn_mask")
        field.per_batch = per_batch
        _fill_tensor(field.tensor, m, args)

    def _fill_args(self, query, key, value, key_padding_mask, attn_mask, is_causal,
                   need_weights, average_attn_weights, training, seed, offset, kv_cache,
                   kv_append, impl, device: bool, seq_lens=None, kv_seq_lens=None) -> _Args:
        args = _Args()
        c = args.c
        if seq_lens is not None:  # a packed batch: the lengths, kept alive with the call
            lens = lens_array("seq_lens", seq_lens)
            c.seq_lens, c.num_seqs = lens, len(lens)
            args.keep.append(lens)
            if kv_seq_lens is not None:
                kv = lens_array("kv_seq_lens", kv_seq_lens)
                if len(kv) != len(lens):
                    raise ValueError(f"kv_seq_lens has {len(kv)} lengths, seq_lens {len(lens)}: "
                                     "one per sequence")
                c.kv_seq_lens = kv
                args.keep.append(kv)
        elif kv_seq_lens is not None:
            raise ValueError("kv_seq_lens needs seq_lens (the queries' lengths)")
        if device:
            el = self._device_dtypes()
            fill_device_tensor(c.query, query, args, el)
            if key is not None and not (key is query and (value is None or value is query)):
                fill_device_tensor(c.key, key, args, el)
                if value is not None and value is not key:
                    fill_device_tensor(c.value, value, args, el)
            for name, m, field, attn in (("key_padding_mask", key_padding_mask,
                                          c.key_padding_mask, False),
                                         ("attn_mask", attn_mask, c.attn_mask, True)):
                if m is not None:
                    self._device_mask(name, m, field, args, attn, el)
        else:
            ranks = (2, 3)
            q = self._host_input("query", query, ranks)
            _fill_tensor(c.query, q, args)
            if key is not None and not (key is query and (value is None or value is query)):
                _fill_tensor(c.key, self._host_input("key", key, ranks), args)
                if value is not None and value is not key:
                    _fill_tensor(c.value, self._host_input("value", value, ranks), args)
            elif value is not None and value is not query:
                raise ValueError("value given without key")
            if key_padding_mask is not None:
                self._host_mask("key_padding_mask", key_padding_mask, c.key_padding_mask, args,
                                False)
            if attn_mask is not None:
                self._host_mask("attn_mask", attn_mask, c.attn_mask, args, True)
        c.is_causal = bool(is_causal)
        c.need_weights = bool(need_weights)
        c.per_head_weights = not average_attn_weights
        c.training = bool(training)
        c.rng.seed = int(seed) & (2**64 - 1)
        c.rng.offset = int(offset) & (2**64 - 1)
        c.impl = {"auto": lib.CLMHA_IMPL_AUTO, "fused": lib.CLMHA_IMPL_FUSED,
                  "unfused": lib.CLMHA_IMPL_UNFUSED}[impl]
        if kv_cache is not None:
            # A cache of attention as a function goes on to the C library, which refuses it.
            if not isinstance(kv_cache, KVCache) or kv_cache._layer not in (self, None):
                raise ValueError("kv_cache must be a KVCache made by this layer's kv_cache()")
            c.kv_cache = kv_cache._ptr
            args.keep.append(kv_cache)
            if kv_append is not None:
                counts = kv_cache._append_counts(kv_append)
                args.keep.append(counts)
                c.kv_append = counts
        return args

    def _output_shapes(self, args: _Args):
        counts = ffi.new("size_t[2]")
        check(lib.clmha_layer_output_counts(self._ptr, args.c, counts, counts + 1),
              self._context._ptr)
        q = args.c.query
        qshape = [int(q.shape[i]) for i in range(q.ndim)]
        out_shape = tuple(qshape[:-1] + [self.embed_dim])
        w_shape = None
        if counts[1]:
            unbatched = q.ndim == 2
            if self.batch_first and not unbatched:
                n, l = qshape[0], qshape[1]
            else:
                l, n = qshape[0], (1 if unbatched else qshape[1])
            s_total = int(counts[1]) // (n * l * (1 if not args.c.per_head_weights
                                                 else self.num_heads))
            w_shape = (n,) if not unbatched else ()
            w_shape += (self.num_heads,) if args.c.per_head_weights else ()
            w_shape += (l, s_total)
        return (int(counts[0]), out_shape), (int(counts[1]), w_shape)

    def forward(self, query, key=None, value=None, *, key_padding_mask=None, attn_mask=None,
                is_causal: bool = False, need_weights: bool = False,
                average_attn_weights: bool = True, training: bool = False, seed: int = 0,
                offset: int = 0, kv_cache: Optional["KVCache"] = None,
                kv_append: Optional[Sequence[int]] = None, impl: str = "auto",
                save: Optional["Saved"] = None, out=None, weights_out=None,
                seq_lens: Optional[Sequence[int]] = None,
                kv_seq_lens: Optional[Sequence[int]] = None):
        """PyTorch's forward on NumPy arrays: returns ``(output, weights or None)`` in PyTorch's
        shapes and layouts.

        query (L, N, E), (N, L, E) with batch_first, or (L, E) unbatched; key and value (S, N,
        kdim/vdim) likewise (None: self-attention, the query; value None: the key). Arrays are
        float32 for a float32 or bfloat16 layer, float64 for a float64 layer, float16 (or
        float32) for a float16 layer; results come back in the layer's NumPy dtype (bfloat16
        values as float32). key_padding_mask (N, S) and attn_mask (L, S) or (N*H, L, S): bool
        (True = may not attend, as PyTorch) or float (added to the scores); wrap them in
        ``clmha.Mask`` for the other polarity or continuiti's (N, L, S) layout.
        need_weights/average_attn_weights as PyTorch (but need_weights defaults to False here).
        training applies the layer's dropout from clmha's Philox stream (seed, offset).
        kv_cache: incremental decoding through a ``KVCache`` (kv_append: per-sequence counts of
        new tokens). impl: "auto", "fused" or "unfused". save: a ``Saved`` that keeps what
        ``backward`` needs.

        seq_lens: a packed batch (PyTorch's NestedTensor, FlashAttention's varlen): query (T, E)
        holds the sequences one after another, T = sum(seq_lens); key and value (T_kv,
        kdim/vdim) with kv_seq_lens (default: seq_lens); each sequence attends only within
        itself and the output is (T, E). No masks, weights or KV cache with it.

        With pyopencl arrays (on a context from ``Context.from_pyopencl``) the call runs on the
        device buffers: no host copy; it waits for the arrays' events and the results are new
        pyopencl arrays (or ``out``/``weights_out``) carrying the call's event.
        """
        if impl not in ("auto", "fused", "unfused"):
            raise ValueError(f"impl must be 'auto', 'fused' or 'unfused', not {impl!r}")
        if save is not None and (not isinstance(save, Saved) or save._layer is not self):
            raise ValueError("save must be a Saved made by this layer's saved()")
        device = is_pyopencl_array(query)
        with self._lock:
            args = self._fill_args(query, key, value, key_padding_mask, attn_mask, is_causal,
                                   need_weights, average_attn_weights, training, seed, offset,
                                   kv_cache, kv_append, impl, device, seq_lens, kv_seq_lens)
            if save is not None:
                args.c.save = save._ptr
            (out_count, out_shape), (w_count, w_shape) = self._output_shapes(args)
            if device:
                return self._forward_device(args, out_shape, w_shape, out, weights_out, save)
            host = self._host_dtype()
            output = np.empty(out_shape, host)
            weights = np.empty(w_shape, host) if w_count else None
            if host == np.float64:
                check(lib.clmha_layer_forward_host_f64(
                    self._ptr, args.c, ffi.cast("double *", ffi.from_buffer(output)), out_count,
                    ffi.cast("double *", ffi.from_buffer(weights)) if w_count else ffi.NULL,
                    w_count), self._context._ptr)
            else:
                check(lib.clmha_layer_forward_host(
                    self._ptr, args.c, ffi.cast("float *", ffi.from_buffer(output)), out_count,
                    ffi.cast("float *", ffi.from_buffer(weights)) if w_count else ffi.NULL,
                    w_count), self._context._ptr)
            if save is not None:
                save._args = args  # the backward pass needs the same arguments and arrays
                save._shapes = (out_shape, w_shape)
            if self.dtype == "float16":
                output = output.astype(np.float16)
                weights = weights.astype(np.float16) if weights is not None else None
            return output, weights

    __call__ = forward

    # ---- device buffers (pyopencl) ---------------------------------------------------------------

    def _device_dtypes(self):
        return {"float32": (np.dtype(np.float32),), "float64": (np.dtype(np.float64),),
                "float16": (np.dtype(np.float16),),
                "bfloat16": (np.dtype(np.uint16),)}[self.dtype]

    def _device_mask(self, name, m, field, args, attn, el):
        import pyopencl.array as cla

        attend, per_batch = False, False
        if isinstance(m, Mask):
            attend, per_batch, m = m.attend, m.per_batch, m.values
        queue = self._context.pyopencl_queue
        if isinstance(m, np.ndarray):  # a host mask: uploaded for the call
            m = cla.to_device(queue, np.ascontiguousarray(
                m.view(np.uint8) if m.dtype == np.bool_ else m.astype(el[0])))
        if not is_pyopencl_array(m):
            raise TypeError(f"{name} must be a pyopencl array or a numpy array")
        if m.dtype in (np.dtype(np.bool_), np.dtype(np.uint8)):
            field.kind = lib.CLMHA_MASK_BOOL_ATTEND if attend else lib.CLMHA_MASK_BOOL_IGNORE
            fill_device_tensor(field.tensor, m, args, (m.dtype,))
        else:
            field.kind = lib.CLMHA_MASK_FLOAT
            fill_device_tensor(field.tensor, m, args, el)
        field.per_batch = per_batch and attn

    def _forward_device(self, args, out_shape, w_shape, out, weights_out, save):
        import pyopencl.array as cla

        ctx = self._context
        if ctx.pyopencl_queue is None:
            raise ValueError("pyopencl arrays need a layer on a Context.from_pyopencl() context")
        queue = ctx.pyopencl_queue
        el = self._device_dtypes()[0]
        for a in args.keep:
            if is_pyopencl_array(a):
                check_context(ctx, "an array", a)
        if out is None:
            out = cla.empty(queue, out_shape, el)
        elif not is_pyopencl_array(out) or tuple(out.shape) != out_shape or out.dtype != el:
            raise ValueError(f"out must be a pyopencl array of shape {out_shape} and dtype {el}")
        args.wait.extend(out.events)
        if w_shape is not None:
            if weights_out is None:
                weights_out = cla.empty(queue, w_shape, el)
            elif (not is_pyopencl_array(weights_out) or tuple(weights_out.shape) != w_shape
                  or weights_out.dtype != el):
                raise ValueError(f"weights_out must be a pyopencl array of shape {w_shape}")
            args.wait.extend(weights_out.events)
        num_wait, waits = events_wait_list(args.wait)
        event = ffi.new("cl_event *")
        check(lib.clmha_layer_forward(
            self._ptr, args.c, mem(out), elem_offset(out),
            mem(weights_out) if w_shape else ffi.NULL,
            elem_offset(weights_out) if w_shape else 0, num_wait, waits, event), ctx._ptr)
        if save is not None:
            save._args = args
            save._shapes = (out_shape, w_shape)
        # the inputs too: they must stay unchanged until the call is done
        event_to(event, [out] + ([weights_out] if w_shape is not None else []) + args.keep)
        return out, (weights_out if w_shape is not None else None)

    # ---- preparation, attention core, profiling ------------------------------------------------

    def bake(self, batch: int, tgt_len: int, src_len: Optional[int] = None,
             need_weights: bool = False) -> None:
        """Sizes the layer's scratch for inputs up to ``batch`` x ``tgt_len`` x ``src_len``
        (default ``tgt_len``) and compiles what forward calls of those sizes run
        (``clmha_layer_bake``: one forward pass on zeros), so that they allocate and compile
        nothing; ``need_weights``: calls that return weights too (refused with
        ``impl="fused"``)."""
        batch = _positive_int("batch", batch)
        tgt_len = _positive_int("tgt_len", tgt_len)
        src_len = tgt_len if src_len is None else _positive_int("src_len", src_len)
        with self._lock:
            check(lib.clmha_layer_bake(self._ptr, batch, tgt_len, src_len, bool(need_weights)),
                  self._context._ptr)

    @property
    def scratch_bytes(self) -> int:
        """Device scratch the layer holds now, in bytes (grows on demand, never shrinks)."""
        return int(lib.clmha_layer_scratch_bytes(self._ptr))

    @property
    def impl(self) -> str:
        """The attention core of forward calls made with ``impl="auto"``
        (``clmha_layer_set_impl``): ``"auto"`` (fused unless the call asks for weights),
        ``"fused"`` (calls asking for weights are refused) or ``"unfused"``."""
        return self._impl

    @impl.setter
    def impl(self, value: str) -> None:
        _check_impl(value)
        with self._lock:
            check(lib.clmha_layer_set_impl(self._ptr, _IMPLS[value]), self._context._ptr)
            self._impl = value

    @property
    def profiling(self) -> bool:
        """Per-stage timing of later forward calls (``clmha_layer_set_profiling``; setting it
        either way drops earlier timings). A queue without profiling (a pyopencl queue made
        without ``PROFILING_ENABLE``) refuses True with ``clmha.Error``."""
        return self._profiling

    @profiling.setter
    def profiling(self, on: bool) -> None:
        if not isinstance(on, (bool, np.bool_)):
            raise TypeError(f"profiling must be a bool, not {on!r}")
        with self._lock:
            check(lib.clmha_layer_set_profiling(self._ptr, bool(on)), self._context._ptr)
            self._profiling = bool(on)

    def stage_times(self) -> Dict[str, float]:
        """The device time of each stage of the last forward call made with profiling on, in
        milliseconds, by stage name (``project``, ``split``, ``scores``, ``softmax``, ``av``,
        ``fused``, ``merge``, ``out_proj``, ``weights``; 0 for stages that did not run). Waits
        for that call. Raises ``clmha.Error`` when profiling is off, no profiled call was made
        or the last call failed."""
        ms = ffi.new("double[]", lib.CLMHA_STAGE_COUNT)
        with self._lock:
            check(lib.clmha_layer_stage_times(self._ptr, ms), self._context._ptr)
        return {ffi.string(lib.clmha_stage_name(i)).decode(): float(ms[i])
                for i in range(lib.CLMHA_STAGE_COUNT)}

    # ---- partial attention (attention across devices) --------------------------------------------

    def attend(self, query, key=None, value=None, *, appended_keys: bool = True,
               key_padding_mask=None, attn_mask=None, is_causal: bool = False,
               training: bool = False, seed: int = 0, offset: int = 0, impl: str = "auto",
               heads_out=None, lse_out=None, query_position: int = 0, key_position: int = 0):
        """Attention of the queries over this call's keys only, before the head merge and the
        output projection (``clmha_layer_attend``): what each device computes in ring attention.
        Merge the results of key ranges with ``Context.attention_merge`` and finish with
        ``project_heads``.

        Takes pyopencl arrays on a ``Context.from_pyopencl`` context and ``forward``'s
        arguments: the masks are this key range's slices of the whole masks;
        ``query_position`` and ``key_position`` are the sequence positions of this call's first
        query row and first key (0, 0: top-left on this call's own keys), which ``is_causal``,
        the sliding window, ALiBi and the user functions see; ``appended_keys``: this range
        holds the keys that add_bias_kv and add_zero_attn append, and the sinks (set it on
        exactly one of the ranges merged). The fused core runs it (every dtype: a 16-bit
        layer's inputs are 16-bit arrays, its heads and lse float32; a float64 layer's are all
        float64); ``impl="unfused"`` is refused (``clmha.Error``, as is a layer with a user
        attention core).

        Returns ``(heads, lse)``, new pyopencl arrays (or ``heads_out``/``lse_out``), float32
        (float64 for a float64 layer):
        heads (N*H, L, D), normalised over this call's keys, and lse (N*H*L,), the natural log
        of each row's sum of exp(score), -inf for a row with no key (its heads are zeros).
        Waits for the arrays' events; the call's event is attached to every array it used.
        """
        _check_impl(impl)
        for name, a in (("query", query), ("key", key), ("value", value)):
            if a is not None and not is_pyopencl_array(a):
                raise TypeError(f"attend runs on device buffers: {name} must be a "
                                f"pyopencl.array.Array, not {type(a).__name__}")
        ctx = self._context
        if ctx.pyopencl_queue is None:
            raise ValueError("pyopencl arrays need a layer on a Context.from_pyopencl() context")
        with self._lock:
            args = self._fill_args(query, key, value, key_padding_mask, attn_mask, is_causal,
                                   False, True, training, seed, offset, None, None, impl, True)
            for name, v in (("query_position", query_position),
                            ("key_position", key_position)):
                if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                    raise ValueError(f"{name} must be a non-negative integer, not {v!r}")
            args.c.query_position = int(query_position)
            args.c.key_position = int(key_position)
            for a in args.keep:
                if is_pyopencl_array(a):
                    check_context(ctx, "an array", a)
            q = args.c.query
            qshape = [int(q.shape[i]) for i in range(q.ndim)]
            if q.ndim == 2:
                n, l = 1, qshape[0]
            elif self.batch_first:
                n, l = qshape[0], qshape[1]
            else:
                l, n = qshape[0], qshape[1]
            heads_shape = (n * self.num_heads, l, self.head_dim)
            lse_shape = (n * self.num_heads * l,)
            queue = ctx.pyopencl_queue
            pd = self._partial_dtype()
            if heads_out is None:
                import pyopencl.array as cla
                heads_out = cla.empty(queue, heads_shape, pd)
            if lse_out is None:
                import pyopencl.array as cla
                lse_out = cla.empty(queue, lse_shape, pd)
            device_f32(ctx, "heads_out", heads_out, shape=heads_shape, dtype=pd)
            device_f32(ctx, "lse_out", lse_out, size=lse_shape[0], dtype=pd)
            inputs = [a for a in args.keep if is_pyopencl_array(a)]
            num_wait, waits = wait_list(inputs + [heads_out, lse_out])
            event = ffi.new("cl_event *")
            check(lib.clmha_layer_attend(
                self._ptr, args.c, bool(appended_keys),
                mem(heads_out), elem_offset(heads_out), mem(lse_out), elem_offset(lse_out),
                num_wait, waits, event), ctx._ptr)
            event_to(event, inputs + [heads_out, lse_out])
            return heads_out, lse_out

    def _partial_dtype(self):
        """The elements of ``attend``'s heads and lse: float64 for a float64 layer, else
        float32."""
        return np.float64 if self.dtype == "float64" else np.float32

    def project_heads(self, heads, batch: Optional[int] = None, tgt_len: Optional[int] = None,
                      *, out=None):
        """The end of a forward pass for (merged) ``attend`` results: the head merge and the
        output projection (``clmha_layer_project_heads``). ``heads``: a float32 pyopencl array
        (float64 for a float64 layer) (N*H, L, D); batch N and tgt_len L default to its shape. Returns a new pyopencl array
        shaped as the query with E features, (L, N, E) or (N, L, E) with batch_first, or
        ``out`` (N*L*E values, any shape) in the layer's device dtype (a 16-bit layer's output is
        16-bit: float16, or uint16 holding bfloat16; projected in float32 and rounded once).
        Waits for the arrays' events and attaches the call's event to both."""
        ctx = self._context
        if ctx.pyopencl_queue is None:
            raise ValueError("project_heads runs on pyopencl arrays: it needs a layer on a "
                             "Context.from_pyopencl() context")
        device_f32(ctx, "heads", heads, dtype=self._partial_dtype())
        if heads.ndim != 3 or heads.shape[0] % self.num_heads or heads.shape[2] != self.head_dim:
            raise ValueError(f"heads must have shape (N*{self.num_heads}, L, {self.head_dim}), "
                             f"not {tuple(heads.shape)}")
        batch = heads.shape[0] // self.num_heads if batch is None else _positive_int("batch",
                                                                                       batch)
        tgt_len = heads.shape[1] if tgt_len is None else _positive_int("tgt_len", tgt_len)
        if (batch * self.num_heads, tgt_len) != tuple(heads.shape[:2]):
            raise ValueError(f"heads of shape {tuple(heads.shape)} are not those of batch "
                             f"{batch} and tgt_len {tgt_len}")
        shape = (batch, tgt_len, self.embed_dim) if self.batch_first else \
            (tgt_len, batch, self.embed_dim)
        el = self._device_dtypes()[0]  # a 16-bit layer's output is 16-bit
        if out is None:
            import pyopencl.array as cla
            out = cla.empty(ctx.pyopencl_queue, shape, el)
        device_f32(ctx, "out", out, size=batch * tgt_len * self.embed_dim, dtype=el)
        with self._lock:
            num_wait, waits = wait_list([heads, out])
            event = ffi.new("cl_event *")
            check(lib.clmha_layer_project_heads(
                self._ptr, batch, tgt_len, mem(heads), elem_offset(heads), mem(out),
                elem_offset(out), num_wait, waits, event), ctx._ptr)
            event_to(event, [heads, out])
        return out

    # ---- caches and training -------------------------------------------------------------------

    def kv_cache(self, batch: int, capacity: Optional[int] = None, *, page_size: int = 0,
                 num_pages: int = 0, kv_dtype: str = "float32") -> "KVCache":
        """An empty KV cache for incremental decoding: ``batch`` sequences (1 for unbatched
        calls) of up to ``capacity`` tokens each; or, with ``page_size`` (a power of two from
        8) and ``num_pages``, a paged cache whose sequences draw pages of ``page_size`` tokens
        from a pool of ``num_pages`` (``KVCache.fork`` shares a prompt's pages). ``kv_dtype``:
        how keys and values are stored (``clmha_kv_cache_options::kv_dtype``): "float32" (the
        decode core's precision: doubles in a float64 layer's cache), "float16", "bfloat16",
        "int8" (one scale per token and head) or "int4" (one scale per 32 dimensions; an even
        head_dim); docs/accuracy.md states the error each adds."""
        return KVCache(self, batch, capacity, page_size=page_size, num_pages=num_pages,
                       kv_dtype=kv_dtype)

    def saved(self) -> "Saved":
        """An empty saved state for one ``forward(..., save=state)`` call and its ``backward``."""
        return Saved(self)

    def backward(self, saved: "Saved", grad_output, grad_weights=None, *,
                 inputs: bool = True, parameters: bool = True, masks: bool = True,
                 impl: str = "auto", grad_dtype: Optional[str] = None) -> Dict[str, np.ndarray]:
        """The gradients of the forward call that filled ``saved``, from the output's gradient
        (and the weights', when that call returned them): a dict with ``query`` (``key``,
        ``value`` for inputs given separately; in self-attention ``query`` is the whole
        gradient of the one tensor), each parameter by ``state_dict()`` name (a sinks layer's
        ``sinks`` too; not ``alibi_slopes``, which has none), and float masks' ``attn_mask`` /
        ``key_padding_mask``. Every dtype (``clmha_layer_backward``; a float64 layer's host
        call ``clmha_layer_backward_host_f64``, float64 arrays in and out). ``grad_output`` and
        ``grad_weights`` are arrays of the layer's input dtypes (as ``forward``'s query); the
        gradients come back in the layer's NumPy dtype (a 16-bit layer computes them in float32
        and rounds each once: float16 arrays, or float32 ones holding bfloat16 values), or as
        float32 unrounded with ``grad_dtype="float32"`` (``CLMHA_GRAD_F32``: for float32 master
        weights).

        After a forward call on pyopencl arrays, ``grad_output`` (and ``grad_weights``) are
        pyopencl arrays too and the gradients are new pyopencl arrays carrying the call's event:
        the backward pass runs on the device buffers, without host copies."""
        if not isinstance(saved, Saved) or saved._layer is not self or saved._args is None:
            raise ValueError("saved must be a Saved of this layer filled by forward(save=...)")
        args = saved._args
        device = args.c.query.buffer != ffi.NULL
        out_shape, w_shape = saved._shapes
        if grad_dtype not in (None, "float32"):
            raise ValueError(f"grad_dtype must be None (the layer's dtype) or 'float32', not "
                             f"{grad_dtype!r}")
        wide = grad_dtype == "float32" and self.dtype in ("float16", "bfloat16")
        b = ffi.new("clmha_backward_args *")
        b.struct_size = ffi.sizeof("clmha_backward_args")
        b.forward = args.c
        b.saved = saved._ptr
        b.grad_dtype = lib.CLMHA_GRAD_F32 if wide else lib.CLMHA_GRAD_LAYER
        keep = []
        dev = _Args()  # the device call's keep-alive list and wait list
        elems = self._device_dtypes()
        for name, value, ranks, shape, field in (
                ("grad_output", grad_output, (2, 3), out_shape, b.grad_output),
                ("grad_weights", grad_weights, (2, 3, 4), w_shape, b.grad_weights)):
            if value is None:
                continue
            if device:
                if not is_pyopencl_array(value):
                    raise TypeError(f"{name} must be a pyopencl array after a forward call on "
                                    f"pyopencl arrays")
                if shape is None or tuple(value.shape) != shape:
                    raise ValueError(f"{name} must have shape {shape}; got {tuple(value.shape)}")
                fill_device_tensor(field, value, dev, elems)
                continue
            a = self._host_input(name, _to_numpy(value), ranks)
            if shape is None or tuple(a.shape) != shape:
                raise ValueError(f"{name} must have shape {shape}; got {tuple(a.shape)}")
            _fill_tensor(field, a, _Keep(keep))
        result = {}
        queue = self._context.pyopencl_queue if device else None

        def want(field, name, shape):
            grad = getattr(b, field)
            if device:
                import pyopencl.array as cla

                arr = cla.empty(queue, shape, np.float32 if wide else elems[0])
                grad.buffer = mem(arr)
                grad.offset = elem_offset(arr)
            else:  # every gradient asked for is written whole; a float64 layer's in doubles
                arr = np.empty(shape, self._host_dtype())
                grad.data = ffi.cast("float *", ffi.from_buffer(arr))
            result[name] = arr
            keep.append(arr)

        c = args.c
        shape_of = lambda t: tuple(int(t.shape[i]) for i in range(t.ndim))  # noqa: E731
        if inputs:
            want("query", "query", shape_of(c.query))
            if c.key.ndim:
                want("key", "key", shape_of(c.key))
            if c.value.ndim:
                want("value", "value", shape_of(c.value))
        if parameters:
            for name in self.parameter_names():
                if name != "alibi_slopes":  # no gradient
                    want(name.replace(".", "_"), name, self._shape(name))
        if masks:
            for field in ("attn_mask", "key_padding_mask"):
                m = getattr(c, field)
                if m.kind == lib.CLMHA_MASK_FLOAT:
                    want(field, field, shape_of(m.tensor))
        b.impl = {"auto": lib.CLMHA_IMPL_AUTO, "fused": lib.CLMHA_IMPL_FUSED,
                  "unfused": lib.CLMHA_IMPL_UNFUSED}[impl]
        if not device:
            fn = (lib.clmha_layer_backward_host_f64 if self.dtype == "float64"
                  else lib.clmha_layer_backward_host)
            with self._lock:
                check(fn(self._ptr, b), self._context._ptr)
            if self.dtype == "float16" and not wide:  # float16 values: exact
                result = {k: v.astype(np.float16) for k, v in result.items()}
            return result
        num_wait, waits = events_wait_list(dev.wait)
        event = ffi.new("cl_event *")
        with self._lock:
            check(lib.clmha_layer_backward(self._ptr, b, num_wait, waits, event),
                  self._context._ptr)
        event_to(event, list(result.values()) + dev.keep)
        return result

    @property
    def context(self) -> Context:
        return self._context

    def __repr__(self) -> str:
        return (f"clmha.Layer(embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"kdim={self.kdim}, vdim={self.vdim}, bias={self.bias}, "
                f"add_bias_kv={self.add_bias_kv}, add_zero_attn={self.add_zero_attn}, "
                f"batch_first={self.batch_first}, dropout={self.dropout}, "
                f"num_kv_heads={self.num_kv_heads}, dtype={self.dtype!r}"
                + (f", window={self.window}" if self.window is not None else "")
                + (f", softcap={self.softcap}" if self.softcap else "")
                + (", alibi=True" if self.alibi else "")
                + (", sinks=True" if self.sinks else "")
                + (f", mod_source=<{len(self.mod_source)} chars>, "
                   f"mod_params_count={self.mod_params_count}" if self.mod_source else "")
                + ")")


class _Keep:
    """_fill_tensor's keep-alive list, for structs other than _Args."""

    def __init__(self, keep: list):
        self.keep = keep


class KVCache:
    """The keys and values of earlier tokens (``clmha_kv_cache``), for incremental decoding:
    each call appends its new key/value tokens and attends over everything the cache holds for
    its sequence.

    Two kinds, which refuse each other's calls (``clmha.Error`` with the C library's message):
    ``layer.kv_cache(batch, capacity)`` (or ``KVCache(layer, batch, capacity)``) holds a layer's
    projected keys and values, for ``layer.forward(..., kv_cache=cache)``, and keeps its layer
    alive; ``KVCache.for_attention(batch, kv_heads, head_dim, capacity)`` holds already
    projected ones, for ``clmha.numpy.scaled_dot_product_attention(..., kv_cache=cache)`` and
    ``clmha.torch.scaled_dot_product_attention(..., kv_cache=cache)``, and keeps its context
    alive."""

    def __init__(self, layer: Layer, batch: int, capacity: Optional[int] = None, *,
                 page_size: int = 0, num_pages: int = 0, kv_dtype: str = "float32"):
        if not isinstance(layer, Layer):
            raise TypeError("KVCache(layer, batch, capacity) takes a clmha.Layer")
        o = _options(batch, capacity, page_size, num_pages, kv_dtype)
        out = ffi.new("clmha_kv_cache **")
        with layer._lock:
            check(lib.clmha_kv_cache_create_with(out, layer._ptr, batch, o), layer._context._ptr)
        self._ptr = ffi.gc(out[0], lib.clmha_kv_cache_release)
        self._layer = layer
        self._context = layer._context
        self._sizes(batch)
        self.kv_heads = layer.num_kv_heads
        self.head_dim = layer.head_dim
        self.dtype = layer.dtype  # the calls' dtype

    def _sizes(self, batch) -> None:
        self.batch = int(batch)
        size = ffi.new("size_t[3]")
        check(lib.clmha_kv_cache_size(self._ptr, ffi.NULL, size), self._context._ptr)
        check(lib.clmha_kv_cache_pages(self._ptr, size + 1, size + 2, ffi.NULL),
              self._context._ptr)
        self.capacity = int(size[0])  # a paged cache's: the pool's tokens
        self.page_size, self.num_pages = int(size[1]), int(size[2])

    @classmethod
    def for_attention(cls, batch: int, kv_heads: int, head_dim: int,
                      capacity: Optional[int] = None, *, context: Optional[Context] = None,
                      page_size: int = 0, num_pages: int = 0,
                      kv_dtype: str = "float32", dtype=None) -> "KVCache":
        """An empty cache for attention as a function (``clmha_kv_cache_create_for``):
        ``batch`` sequences N (the product of the leading dimensions of the calls' tensors; 1
        for 3-D and 2-D ones) of at most ``capacity`` tokens, each ``kv_heads`` key/value heads
        (H_kv) of ``head_dim`` floats (D), on ``context`` (default
        ``clmha.default_context()``), where the calls must run. Pass it as ``kv_cache=`` to
        ``clmha.numpy.scaled_dot_product_attention`` or
        ``clmha.torch.scaled_dot_product_attention``: their key and value are then the new
        tokens, (N, H_kv, S_new, D), appended after each sequence's cached ones. A cache is
        used by one thread at a time. ``page_size`` and ``num_pages`` (instead of
        ``capacity``): a paged cache, and ``kv_dtype``, as ``Layer.kv_cache``'s. ``dtype``: that
        of the calls' tensors (``clmha_kv_cache_options::dtype``; None: float32): a float64
        cache holds doubles and serves float64 calls only; float32 serves float32, float16 and
        bfloat16 calls."""
        context = default_context() if context is None else context
        if not isinstance(context, Context):
            raise TypeError(f"context must be a clmha.Context, not {type(context).__name__}")
        _check_sizes(("kv_heads", kv_heads), ("head_dim", head_dim))
        name = dtype_name(dtype)
        o = _options(batch, capacity, page_size, num_pages, kv_dtype)
        o.dtype = _DTYPE_CODES[name]
        out = ffi.new("clmha_kv_cache **")
        check(lib.clmha_kv_cache_create_for_with(out, context._ptr, batch, kv_heads, head_dim,
                                                 o), context._ptr)
        self = cls.__new__(cls)
        self._ptr = ffi.gc(out[0], lib.clmha_kv_cache_release)
        self._layer = None
        self._context = context  # released after the cache
        self._sizes(batch)
        self.kv_heads = int(kv_heads)
        self.head_dim = int(head_dim)
        self.dtype = name
        return self

    @property
    def context(self) -> Context:
        """The context whose calls use the cache (its layer's, for a layer's cache)."""
        return self._context

    @property
    def layer(self) -> Optional[Layer]:
        """The layer the cache was made for; None for attention as a function."""
        return self._layer

    def _append_counts(self, kv_append):
        """``kv_append`` as the C array of ``self.batch`` counts (kept alive by the caller)."""
        counts = [kv_append] if isinstance(kv_append, (int, np.integer)) else list(kv_append)
        if len(counts) != self.batch:
            raise ValueError(f"kv_append has {len(counts)} counts; the cache holds "
                             f"{self.batch} sequences")
        for x in counts:
            if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 0:
                raise ValueError(f"kv_append's counts must be ints >= 0, not {x!r}")
        return ffi.new("size_t[]", [int(x) for x in counts])

    @property
    def lengths(self) -> np.ndarray:
        """The tokens each sequence holds."""
        lengths = ffi.new("size_t[]", self.batch)
        check(lib.clmha_kv_cache_lengths(self._ptr, lengths, self.batch), self._context._ptr)
        return np.array([int(x) for x in lengths], dtype=np.int64)

    def truncate(self, lengths: Union[int, Sequence[int]]) -> None:
        """Keeps the first ``lengths[n]`` tokens of sequence n (an int: of every sequence)."""
        if isinstance(lengths, (int, np.integer)):
            lengths = [int(lengths)] * self.batch
        lengths = [int(x) for x in lengths]
        if any(x < 0 for x in lengths):
            raise ValueError("lengths must not be negative")
        arr = ffi.new("size_t[]", lengths)
        check(lib.clmha_kv_cache_truncate(self._ptr, arr, len(lengths)), self._context._ptr)

    def reset(self) -> None:
        """Empties every sequence (a paged cache's pages go back to its pool)."""
        check(lib.clmha_kv_cache_reset(self._ptr), self._context._ptr)

    def fork(self, src: int, dst: int) -> None:
        """Makes sequence ``dst`` of a paged cache hold what ``src`` holds, sharing its pages
        (``clmha_kv_cache_fork``): a prompt decoded once, continued differently (parallel
        sampling, beam search); a shared, partly filled page is copied when a sequence appends
        into it. A contiguous cache raises ``clmha.Error`` (UNSUPPORTED)."""
        for name, v in (("src", src), ("dst", dst)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, not {v!r}")
        check(lib.clmha_kv_cache_fork(self._ptr, int(src), int(dst)), self._context._ptr)

    @property
    def free_pages(self) -> int:
        """A paged cache's pages that no sequence holds (0 for a contiguous cache)."""
        free = ffi.new("size_t *")
        check(lib.clmha_kv_cache_pages(self._ptr, ffi.NULL, ffi.NULL, free), self._context._ptr)
        return int(free[0])

    def __repr__(self) -> str:
        kind = "" if self._layer is not None else \
            f"kv_heads={self.kv_heads}, head_dim={self.head_dim}, "
        size = f"page_size={self.page_size}, num_pages={self.num_pages}" if self.page_size \
            else f"capacity={self.capacity}"
        return f"clmha.KVCache({kind}batch={self.batch}, {size}, " \
               f"lengths={self.lengths.tolist()})"


def _options(batch, capacity, page_size, num_pages, kv_dtype="float32"):
    """A cache's clmha_kv_cache_options: contiguous (capacity) or paged (page_size and
    num_pages); the C library checks the values."""
    _check_sizes(("batch", batch))
    for name, v in (("page_size", page_size), ("num_pages", num_pages)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(f"{name} must be an int >= 0, not {v!r}")
    if page_size:
        if capacity is not None:
            raise ValueError("a paged cache (page_size) takes num_pages, not capacity")
    else:
        _check_sizes(("capacity", capacity if capacity is not None else 0))
    o = ffi.new("clmha_kv_cache_options *")
    o.struct_size = ffi.sizeof("clmha_kv_cache_options")
    o.capacity = 0 if page_size else int(capacity)
    o.page_size, o.num_pages = int(page_size), int(num_pages)
    kinds = {"float32": lib.CLMHA_KV_FLOAT32, "float16": lib.CLMHA_KV_FLOAT16,
             "bfloat16": lib.CLMHA_KV_BFLOAT16, "int8": lib.CLMHA_KV_INT8,
             "int4": lib.CLMHA_KV_INT4}
    if kv_dtype not in kinds:
        raise ValueError(f"kv_dtype must be one of {', '.join(map(repr, kinds))}, "
                         f"not {kv_dtype!r}")
    o.kv_dtype = kinds[kv_dtype]
    return o


def _check_sizes(*pairs) -> None:
    for name, v in pairs:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
            raise ValueError(f"{name} must be a positive int, not {v!r}")


class Saved:
    """What one forward call keeps for its backward pass (``clmha_saved``). Keeps its layer
    alive (the library needs it released before the layer)."""

    def __init__(self, layer: Layer):
        out = ffi.new("clmha_saved **")
        check(lib.clmha_saved_create(out, layer._ptr), layer._context._ptr)
        self._ptr = ffi.gc(out[0], lib.clmha_saved_release)
        self._layer = layer
        self._args = None
        self._shapes = None

    @property
    def nbytes(self) -> int:
        """Device memory it holds."""
        return int(lib.clmha_saved_bytes(self._ptr))


def _to_numpy(x):
    """A torch tensor's values as NumPy (no copy for contiguous CPU float tensors); anything else
    as it is."""
    if hasattr(x, "detach") and hasattr(x, "numpy"):
        x = x.detach().cpu()
        return (x.float() if str(x.dtype) == "torch.bfloat16" else x).numpy()
    return x


def _path_bytes(path) -> bytes:
    import os

    if not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, not {type(path).__name__}")
    path = os.fsencode(path)
    if not path or b"\0" in path:
        raise ValueError("path must be non-empty and hold no NUL byte")
    return path
