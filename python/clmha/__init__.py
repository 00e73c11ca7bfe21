"""clmha: multi-head attention on any OpenCL device, from Python.

PyTorch's ``nn.MultiheadAttention`` (every option, forward and backward), KV-cache decoding and
grouped-query attention, on NumPy arrays (``clmha.Layer``), as a drop-in ``torch.nn`` module
(``clmha.torch.MultiheadAttention``) and on pyopencl buffers (``clmha.Context.from_pyopencl``);
PyTorch's ``scaled_dot_product_attention`` as a function on NumPy or pyopencl arrays
(``clmha.numpy.scaled_dot_product_attention``) and tensors, with autograd
(``clmha.torch.scaled_dot_product_attention``).

    import numpy as np, clmha
    layer = clmha.Layer(embed_dim=64, num_heads=8, batch_first=True)
    layer["in_proj_weight"] = np.random.randn(192, 64).astype(np.float32) * 0.1
    out, weights = layer.forward(np.random.randn(2, 10, 64).astype(np.float32),
                                 need_weights=True)

The device: ``$CLMHA_DEVICE`` (a spec as ``clmha devices`` prints), else the first GPU, else
the first OpenCL device; ``clmha.devices()`` lists them, ``clmha.Context(spec)`` picks one.
Licensed under the Apache License 2.0.
"""

import os as _os

from ._driver import register_pypi_pocl as _register_pypi_pocl

_register_pypi_pocl()  # before the first OpenCL call: clmha[pocl]'s driver where none is installed

from ._native import ffi as _ffi, lib as _lib
from ._errors import STATUS, Error
from ._context import Context, Device, default_context, devices
from ._layer import KVCache, Layer, Mask, Saved, dtype_name
from ._sdpa import alibi_slopes
from . import numpy  # noqa: E402  (clmha.numpy: attention as a function on NumPy arrays)

__version__ = _ffi.string(_lib.clmha_version()).decode()
__license__ = "Apache-2.0"


def get_include() -> str:
    """The folder holding clmha.h and clmha_version.h (the headers this package was built with)."""
    return _os.path.join(_os.path.dirname(__file__), "include")


__all__ = ["Context", "Device", "Error", "KVCache", "Layer", "Mask", "STATUS", "Saved",
           "alibi_slopes", "default_context", "devices", "dtype_name", "get_include",
           "__version__"]
