"""pyopencl arrays as the C library's device tensors: what the device forms of ``Layer`` (forward,
backward, attend, project_heads), ``Context.attention_merge`` and attention as a function
(``clmha.numpy.scaled_dot_product_attention`` on pyopencl arrays) share: the checks of an
array, its ``cl_mem`` and element offset, the wait list made of the arrays' events, and the
call's event handed to the arrays."""

import numpy as np

from ._native import ffi

F32 = (np.dtype(np.float32),)


def is_pyopencl_array(x) -> bool:
    """Whether @p x is a ``pyopencl.array.Array`` (without importing pyopencl)."""
    mod = type(x).__module__
    return mod.startswith("pyopencl") and hasattr(x, "base_data") and hasattr(x, "events")


def check_context(context, name: str, a) -> None:
    """@p a must be an array of @p context's OpenCL context (ValueError)."""
    if a.context.int_ptr != context.cl_context_int_ptr:
        raise ValueError(f"{name} is a pyopencl array of another OpenCL context than the "
                         f"clmha context's")


def device_f32(context, name: str, a, shape=None, size=None, dtype=np.float32):
    """@p a checked as a C-contiguous pyopencl array of @p dtype (float32) on @p context's
    OpenCL context."""
    if not is_pyopencl_array(a):
        raise TypeError(f"{name} must be a pyopencl.array.Array, not {type(a).__name__}")
    if a.dtype != np.dtype(dtype):
        raise TypeError(f"{name} must be {np.dtype(dtype).name}, not {a.dtype}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} of shape {a.shape} is not C-contiguous")
    check_context(context, name, a)
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, not {tuple(a.shape)}")
    if size is not None and a.size != size:
        raise ValueError(f"{name} must hold {size} values, not {a.size} (shape {a.shape})")
    return a


def mem(a):
    """The ``cl_mem`` of a pyopencl array."""
    return ffi.cast("cl_mem", a.base_data.int_ptr)


def elem_offset(a) -> int:
    """A pyopencl array's offset into its buffer in elements (pyopencl counts bytes)."""
    return a.offset // a.dtype.itemsize


def events_wait_list(events):
    """(count, ``cl_event[]`` or NULL) of pyopencl events (None entries dropped), kept alive by
    the caller for the call."""
    wait = [e for e in events if e is not None]
    c = (ffi.new("cl_event[]", [ffi.cast("cl_event", e.int_ptr) for e in wait])
         if wait else ffi.NULL)
    return len(wait), c


def wait_list(arrays):
    """The wait list of every event of @p arrays (see events_wait_list)."""
    return events_wait_list([e for a in arrays for e in a.events])


def event_to(event, arrays) -> None:
    """Hands the new event ``event[0]`` (a ``cl_event *`` the call filled; its reference is
    taken over) to each of @p arrays (pyopencl arrays; others are skipped)."""
    import pyopencl as cl

    evt = cl.Event.from_int_ptr(int(ffi.cast("intptr_t", event[0])), retain=False)
    for a in arrays:
        if is_pyopencl_array(a):
            a.add_event(evt)


def fill_device_tensor(t, array, args, element_dtypes) -> None:
    """A ``clmha_tensor`` @p t set to @p array's shape, buffer and offset; @p array goes to
    ``args.keep`` (kept alive) and its events to ``args.wait``."""
    if array.dtype not in element_dtypes:
        raise TypeError(f"a pyopencl array of dtype {array.dtype} where "
                        f"{' or '.join(str(d) for d in element_dtypes)} is expected")
    if not array.flags.c_contiguous:
        raise ValueError(f"pyopencl array of shape {array.shape} is not C-contiguous")
    fill_device_shape(t, array, array.shape)
    args.keep.append(array)
    args.wait.extend(array.events)


def fill_device_shape(t, array, shape) -> None:
    """A ``clmha_tensor`` @p t set to @p shape and @p array's buffer and offset."""
    t.ndim = len(shape)
    for i, s in enumerate(shape):
        t.shape[i] = int(s)
    t.buffer = mem(array)
    t.offset = elem_offset(array)
