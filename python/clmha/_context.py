"""Devices and contexts: what `clmha devices` lists, and the clmha_context a layer runs on."""


import threading
from dataclasses import dataclass
from typing import List, Optional, Union

from ._errors import Error, check
from ._native import ffi, lib

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

