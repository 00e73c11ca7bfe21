"""Devices and contexts: what `clmha devices` lists, and the clmha_context a layer runs on."""


import math
import numpy as np
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from ._device import device_f32, elem_offset, event_to, mem, wait_list
from ._errors import Error, check
from ._native import ffi, lib

_GEMM_KINDS = {"auto": lib.CLMHA_GEMM_AUTO, "clblast": lib.CLMHA_GEMM_CLBLAST,
               "host": lib.CLMHA_GEMM_HOST}
#: clmha_tuning_source values by lower-case name ("clblast", "builtin", "stored", ...)
_TUNING_SOURCES = {value: name[len("CLMHA_TUNING_SOURCE_"):].lower()
                   for value, name in ffi.typeof("clmha_tuning_source").elements.items()}
_MAX_TUNE_SHAPES = 4

_DEVICE_TYPES = {1 << 1: "cpu", 1 << 2: "gpu", 1 << 3: "accelerator", 1 << 0: "default",
                 1 << 4: "custom"}


@dataclass(frozen=True)
class Device:
    """One OpenCL device, as ``clmha devices`` prints it. ``spec`` selects exactly this device
    (``clmha.Context(device.spec)``)."""

    index: int
    spec: str
    type: str
    platform_name: str
    device_name: str
    driver_version: str
    compute_units: int
    global_mem_bytes: int
    local_mem_bytes: int
    max_alloc_bytes: int
    fp16: bool
    fp64: bool
    note: str

    def __str__(self) -> str:
        return f"{self.spec}  {self.type}  {self.platform_name} / {self.device_name}"


def _device_from_info(index: int, info) -> Device:
    kind = "other"
    for bit, name in _DEVICE_TYPES.items():
        if int(info.type) & bit:
            kind = name
            break
    text = lambda field: ffi.string(field).decode("utf-8", "replace")  # noqa: E731
    return Device(index=index, spec=text(info.spec), type=kind,
                  platform_name=text(info.platform_name), device_name=text(info.device_name),
                  driver_version=text(info.driver_version),
                  compute_units=int(info.compute_units),
                  global_mem_bytes=int(info.global_mem_bytes),
                  local_mem_bytes=int(info.local_mem_bytes),
                  max_alloc_bytes=int(info.max_alloc_bytes), fp16=bool(info.fp16),
                  fp64=bool(info.fp64),
                  note=ffi.string(lib.clmha_device_note(info)).decode("utf-8", "replace"))


def devices() -> List[Device]:
    """Every OpenCL device of every platform, in the order of ``clmha devices`` (empty when no
    OpenCL driver is installed)."""
    count = ffi.new("size_t *")
    check(lib.clmha_device_count(count))
    out = []
    for index in range(count[0]):
        info = ffi.new("clmha_device_info *")
        info.struct_size = ffi.sizeof("clmha_device_info")
        check(lib.clmha_device_describe(index, info))
        out.append(_device_from_info(index, info))
    return out


class Context:
    """A clmha context: one OpenCL device, its in-order queue and compiled programs.

    ``Context()`` takes ``$CLMHA_DEVICE``, else the first GPU, else the first device (as
    ``clmha_context_create_from_env``); ``Context("cpu")``, ``Context("0:1")``,
    ``Context("pocl")`` take a device spec as ``clmha --device`` does (``"P:D"``, ``gpu``, ``cpu``,
    ``accelerator``, or part of a platform or device name); a ``Device`` from ``clmha.devices()``
    works too. ``Context.from_pyopencl(ctx, queue)`` wraps a pyopencl context and queue.

    Layers keep their context alive; the context is released when the last of them is gone.
    """

    def __init__(self, device: Union[None, str, Device] = None):
        out = ffi.new("clmha_context **")
        if isinstance(device, Device):
            device = device.spec
        if device is None:
            check(lib.clmha_context_create_from_env(out))
        elif isinstance(device, str):
            check(lib.clmha_context_create(out, device.encode("utf-8")))
        else:
            raise TypeError(f"device must be None, a spec string or a clmha.Device, not "
                            f"{type(device).__name__}")
        self._ptr = ffi.gc(out[0], lib.clmha_context_release)
        self._pyopencl = None

    @classmethod
    def from_pyopencl(cls, context, queue) -> "Context":
        """Wraps a ``pyopencl.Context`` and an in-order ``pyopencl.CommandQueue`` of it (retained
        by clmha while this context lives). Layers made on it run ``forward`` on
        ``pyopencl.array.Array`` inputs without a host round trip."""
        try:
            import pyopencl as cl
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise TypeError(f"Context.from_pyopencl needs pyopencl ({e})") from e
        if not isinstance(context, cl.Context) or not isinstance(queue, cl.CommandQueue):
            raise TypeError("Context.from_pyopencl(context, queue) takes a pyopencl.Context and "
                            "a pyopencl.CommandQueue")
        self = cls.__new__(cls)
        out = ffi.new("clmha_context **")
        check(lib.clmha_context_create_from_cl(
            out, ffi.cast("cl_context", context.int_ptr),
            ffi.cast("cl_device_id", queue.device.int_ptr),
            ffi.cast("cl_command_queue", queue.int_ptr)))
        self._ptr = ffi.gc(out[0], lib.clmha_context_release)
        self._pyopencl = (context, queue)
        return self

    @property
    def device_name(self) -> str:
        """"platform name / device name"."""
        return ffi.string(lib.clmha_context_device_name(self._ptr)).decode("utf-8", "replace")

    @property
    def gemm(self) -> str:
        """Where the matrix products run: "host" (a host BLAS through native kernels) or
        "clblast"."""
        return "host" if lib.clmha_context_gemm(self._ptr) == lib.CLMHA_GEMM_HOST else "clblast"

    def set_gemm(self, kind: str) -> None:
        """Chooses where the context's matrix products run from now on
        (``clmha_context_set_gemm``): ``"auto"`` (the host BLAS on a CPU device that can run it,
        else CLBlast), ``"clblast"`` or ``"host"``. Call it before running layers on the
        context. ``"host"`` where it cannot run (not a CPU device, no native kernels, no host
        BLAS) raises ``clmha.Error`` (``UNSUPPORTED``) and leaves the context on CLBlast."""
        if not isinstance(kind, str):
            raise TypeError(f"kind must be a str, not {type(kind).__name__}")
        if kind not in _GEMM_KINDS:
            raise ValueError(f"kind must be 'auto', 'clblast' or 'host', not {kind!r}")
        check(lib.clmha_context_set_gemm(self._ptr, _GEMM_KINDS[kind]), self._ptr)

    @property
    def gemm_note(self) -> str:
        """One line saying where the matrix products run and why, e.g. "host BLAS oneDNN 2.6.3
        (libdnnl.so.2) through native kernels" or "CLBlast (asked for)"."""
        return self._text(lib.clmha_context_gemm_note)

    # ---- GEMM tuning ---------------------------------------------------------------------------

    @property
    def tuning_source(self) -> str:
        """Where the GEMM tuning in effect for the device comes from (``clmha_tuning_source``):
        ``"clblast"`` (CLBlast's own parameters), ``"builtin"`` (clmha's set for the device's
        class), ``"stored"`` (the device's tuning file), ``"imported"`` (``tuning_import``) or
        ``"tuned"`` (``tune`` in this process)."""
        value = int(lib.clmha_context_tuning_source(self._ptr))
        return _TUNING_SOURCES.get(value, str(value))

    @property
    def tuning_note(self) -> str:
        """One line saying which tuning is in effect and why (a stored file that was ignored
        says why here)."""
        return self._text(lib.clmha_context_tuning_note)

    def tuning_export(self) -> str:
        """The tuning in effect for the device as JSON (the tuning file's format). Raises
        ``clmha.Error`` (``NOT_READY``) when no tuning is applied (``tuning_source`` is
        ``"clblast"``)."""
        needed = ffi.new("size_t *")
        check(lib.clmha_context_tuning_export(self._ptr, ffi.NULL, 0, needed), self._ptr)
        for _ in range(3):  # again only if the tuning grew between the calls
            size = int(needed[0])
            buf = ffi.new("char[]", size)
            status = lib.clmha_context_tuning_export(self._ptr, buf, size, needed)
            if not (status == lib.CLMHA_INVALID_ARGUMENT and int(needed[0]) > size):
                break
        check(status, self._ptr)
        return ffi.string(buf).decode("utf-8", "replace")

    def tuning_import(self, json: str) -> None:
        """Checks a tuning in ``tuning_export``'s format and applies it to the device (every
        context on it in this process; nothing is written to disk). A tuning for another device,
        driver or CLBlast version raises ``clmha.Error`` (``UNSUPPORTED``), a malformed one
        ``clmha.Error`` (``INVALID_FILE``)."""
        if not isinstance(json, str):
            raise TypeError(f"json must be a str, not {type(json).__name__}")
        if "\0" in json:
            raise ValueError("json must hold no NUL character")
        check(lib.clmha_context_tuning_import(self._ptr, json.encode("utf-8")), self._ptr)

    def tune(self, budget_seconds: float = 300.0,
             shapes: Sequence[Tuple[int, int, int, int]] = ((8, 128, 512, 8),),
             store: bool = True, progress: Optional[Callable[[float, str], None]] = None,
             trace: bool = False, candidates: Optional[int] = None) -> Dict[str, Any]:
        """Tunes the device's GEMM kernels, fused-attention tiles and decode split for the given
        layer shapes (``clmha_context_tune``, ``clmha tune``); the fastest set found is applied
        to the device in this process and, with ``store``, written to its tuning file.

        :param budget_seconds: wall-clock budget (positive; the final check may run past it).
        :param shapes: one to four ``(batch, tgt_len, embed_dim, num_heads)`` tuples
            (``embed_dim`` a multiple of ``num_heads``).
        :param store: write the result to the device's tuning file.
        :param progress: called as ``progress(fraction, message)`` on this thread; with
            ``trace``, also with each trace line and ``fraction`` -1. An exception it raises is
            re-raised once the tuning has finished (later progress calls are then skipped).
        :param trace: also send trace lines (each candidate and why it was rejected) to
            ``progress`` (which it then needs).
        :param candidates: each search (CLBlast's two GEMM kernels, the fused tiles, the decode
            split) stops after this many candidates (``max_candidates``; ``clmha tune
            --candidates``); ``None``: as many as the budget allows. With a budget not reached,
            every run tries the same candidates.
        :returns: the report (``clmha_tune_report``) as a dict: ``default_gflops``,
            ``tuned_gflops``, ..., ``candidates``, ``rejected``, ``seconds``, ``improved``,
            ``stored``, ``layer``, ``parameters``, ``path``, ``message``, ...

        Do not run layers on the same device while it tunes.
        """
        if isinstance(budget_seconds, bool) or not isinstance(budget_seconds, (int, float)):
            raise TypeError(f"budget_seconds must be a number, not {budget_seconds!r}")
        if not math.isfinite(budget_seconds) or budget_seconds <= 0:
            raise ValueError(f"budget_seconds must be positive and finite, not {budget_seconds!r}")
        shapes = list(shapes)
        if not 1 <= len(shapes) <= _MAX_TUNE_SHAPES:
            raise ValueError(f"shapes must hold 1 to {_MAX_TUNE_SHAPES} shapes, not "
                             f"{len(shapes)}")
        for shape in shapes:
            if (not isinstance(shape, (tuple, list)) or len(shape) != 4
                    or any(isinstance(v, bool) or not isinstance(v, int) or v <= 0
                           for v in shape)):
                raise ValueError(f"each shape must be (batch, tgt_len, embed_dim, num_heads) of "
                                 f"positive ints, not {shape!r}")
            if shape[2] % shape[3]:
                raise ValueError(f"shape {tuple(shape)}: embed_dim must be a multiple of "
                                 f"num_heads")
        if candidates is not None and (isinstance(candidates, bool)
                                       or not isinstance(candidates, int)):
            raise TypeError(f"candidates must be an int or None, not {candidates!r}")
        if candidates is not None and not 1 <= candidates <= 1000000:
            raise ValueError(f"candidates must be from 1 to 1000000, not {candidates!r}")
        if progress is not None and not callable(progress):
            raise TypeError("progress must be callable or None")
        if trace and progress is None:
            raise ValueError("trace=True sends its lines to progress: give a progress callable")
        c_shapes = ffi.new("clmha_tune_shape[]", len(shapes))
        for i, (n, l, e, h) in enumerate(shapes):
            c_shapes[i].batch, c_shapes[i].tgt_len = n, l
            c_shapes[i].embed_dim, c_shapes[i].num_heads = e, h
        opts = ffi.new("clmha_tune_options *")
        opts.struct_size = ffi.sizeof("clmha_tune_options")
        opts.budget_seconds = float(budget_seconds)
        opts.shapes = c_shapes
        opts.num_shapes = len(shapes)
        opts.no_store = not store
        opts.trace = bool(trace)
        opts.max_candidates = candidates or 0
        raised: List[BaseException] = []

        def on_progress(fraction, message, _user_data):
            if raised:
                return
            try:
                progress(float(fraction), ffi.string(message).decode("utf-8", "replace")
                         if message != ffi.NULL else "")
            except BaseException as e:  # noqa: B902 - re-raised after the C call returns
                raised.append(e)

        callback = None
        if progress is not None:
            callback = ffi.callback("clmha_tune_progress_fn", on_progress)
            opts.progress = callback
        report = ffi.new("clmha_tune_report *")
        report.struct_size = ffi.sizeof("clmha_tune_report")
        try:
            check(lib.clmha_context_tune(self._ptr, opts, report), self._ptr)
        finally:
            del callback  # kept alive until the call has returned
        if raised:
            raise raised[0]
        return _struct_dict(report)

    def _text(self, fn, size: int = 1024) -> str:
        buf = ffi.new("char[]", size)
        check(fn(self._ptr, buf, size), self._ptr)
        return ffi.string(buf).decode("utf-8", "replace")

    # ---- partial attention ---------------------------------------------------------------------

    def attention_merge(self, heads, lse, other_heads, other_lse) -> None:
        """Merges the partial attention ``(other_heads, other_lse)`` into ``(heads, lse)`` in
        place (``clmha_attention_merge``): they become the attention over the keys of both, as
        ``Layer.attend`` returns them (float32 pyopencl arrays, or float64 ones of a float64
        layer, merged in float64 by ``clmha_attention_merge_f64``: heads (N*H, L, D), lse N*H*L
        values; the two pairs of the same shapes and dtype, not overlapping). Waits for the
        arrays' events and attaches the merge's event to all four."""
        if self._pyopencl is None:
            raise ValueError("attention_merge runs on pyopencl arrays: it needs a "
                             "Context.from_pyopencl() context")
        wide = getattr(heads, "dtype", None) == np.float64
        el = np.float64 if wide else np.float32
        arrays = [device_f32(self, name, a, dtype=el) for name, a in
                  (("heads", heads), ("lse", lse), ("other_heads", other_heads),
                   ("other_lse", other_lse))]
        if heads.ndim < 1 or tuple(other_heads.shape) != tuple(heads.shape):
            raise ValueError(f"heads {tuple(heads.shape)} and other_heads "
                             f"{tuple(other_heads.shape)} must have the same shape")
        if other_lse.size != lse.size:
            raise ValueError(f"lse ({lse.size} values) and other_lse ({other_lse.size}) differ")
        rows, head_dim = int(lse.size), int(heads.shape[-1])
        if rows * head_dim != heads.size:
            raise ValueError(f"heads {tuple(heads.shape)} does not hold lse.size={rows} rows of "
                             f"{head_dim} values")
        num_wait, waits = wait_list(arrays)
        event = ffi.new("cl_event *")
        merge = lib.clmha_attention_merge_f64 if wide else lib.clmha_attention_merge
        check(merge(
            self._ptr, rows, head_dim, mem(heads), elem_offset(heads), mem(lse), elem_offset(lse),
            mem(other_heads), elem_offset(other_heads), mem(other_lse), elem_offset(other_lse),
            num_wait, waits, event), self._ptr)
        event_to(event, arrays)

    @property
    def pyopencl_queue(self):
        """The pyopencl queue of a context made by from_pyopencl(), else None."""
        return self._pyopencl[1] if self._pyopencl else None

    @property
    def cl_context_int_ptr(self) -> int:
        """The OpenCL context handle as an integer (pyopencl's ``int_ptr`` convention)."""
        return int(ffi.cast("intptr_t", lib.clmha_context_cl_context(self._ptr)))

    def __repr__(self) -> str:
        return f"clmha.Context({self.device_name!r})"


def _struct_dict(struct) -> Dict[str, Any]:
    """A filled C struct's fields (but struct_size) as a dict, char arrays decoded."""
    out: Dict[str, Any] = {}
    for name, field in ffi.typeof(struct[0]).fields:
        if name == "struct_size":
            continue
        value = getattr(struct, name)
        if field.type.kind == "array" and field.type.item.cname == "char":
            value = ffi.string(value).decode("utf-8", "replace")
        elif field.type.cname == "_Bool":
            value = bool(value)
        out[name] = value
    return out


_default_lock = threading.Lock()
_default: Optional[Context] = None


def default_context() -> Context:
    """The process's shared context, made on first use from ``$CLMHA_DEVICE`` (as ``Context()``)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Context()
        return _default


__all__ = ["Device", "devices", "Context", "default_context", "Error"]

