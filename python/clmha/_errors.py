"""clmha.Error and the status codes: every failing library call raises Error."""

from ._native import ffi, lib

#: The status codes of include/clmha.h (CLMHA_STATUS_MAP), by name without the CLMHA_ prefix.
STATUS = {
    name[len("CLMHA_"):]: getattr(lib, name)
    for name in dir(lib)
    if name.startswith("CLMHA_") and ffi.typeof("clmha_status").elements.get(getattr(lib, name))
    == name
}
_NAMES = {value: name for name, value in STATUS.items()}


class Error(RuntimeError):
    """A clmha call failed.

    Attributes:
        status: the library's status code (an int, negative; see ``clmha.STATUS``).
        status_name: its name without the ``CLMHA_`` prefix, e.g. ``"SHAPE_MISMATCH"``.
        message: the library's message: the argument, the shapes, the file or the driver call.
    """

    def __init__(self, status: int, message: str):
        self.status = int(status)
        self.status_name = _NAMES.get(self.status, str(self.status))
        self.message = message
        text = ffi.string(lib.clmha_status_string(status)).decode("utf-8", "replace")
        super().__init__(f"{text}: {message}" if message else text)


def check(status: int, context_ptr=None) -> None:
    """Raises Error for a failing ``status``, with the message of ``context_ptr`` (a clmha_context*)
    or, without one, clmha_last_create_error()."""
    if status == lib.CLMHA_SUCCESS:
        return
    if context_ptr is not None and context_ptr != ffi.NULL:
        message = ffi.string(lib.clmha_context_last_error(context_ptr))
    else:
        message = ffi.string(lib.clmha_last_create_error())
    raise Error(status, message.decode("utf-8", "replace"))
