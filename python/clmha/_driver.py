"""The CPU OpenCL driver from PyPI (``pip install clmha[pocl]``: pocl-binary-distribution).

The package links the system's OpenCL ICD loader (ocl-icd), which finds drivers through the
.icd files of /etc/OpenCL/vendors. PyPI's PoCL registers none there: its library sits in
pyopencl's wheel folder. When no system driver is registered (or CLMHA_PYPI_POCL=1), this module
points the loader at a private vendors folder naming that library (OCL_ICD_VENDORS) before the
first OpenCL call of the process. CLMHA_PYPI_POCL=0, or an OCL_ICD_VENDORS of the user's, leaves
the loader alone.
"""

import glob
import hashlib
import importlib.util
import os
import tempfile
from typing import Optional


def pypi_pocl_library() -> Optional[str]:
    """The path of PyPI's PoCL library, or None when pocl-binary-distribution is not installed."""
    if importlib.util.find_spec("pocl_binary_distribution") is None:
        return None
    spec = importlib.util.find_spec("pyopencl")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        found = sorted(glob.glob(os.path.join(folder, ".libs", "libpocl*.so*")))
        if found:
            return os.path.realpath(found[0])
    return None


def register_pypi_pocl() -> Optional[str]:
    """Points the ICD loader at PyPI's PoCL when that is wanted (see the module's text); returns
    the vendors folder it set, else None."""
    wanted = os.environ.get("CLMHA_PYPI_POCL", "")
    if wanted == "0" or os.environ.get("OCL_ICD_VENDORS"):
        return None
    if wanted != "1" and glob.glob("/etc/OpenCL/vendors/*.icd"):
        return None
    lib = pypi_pocl_library()
    if lib is None:
        return None
    tag = hashlib.sha256(lib.encode()).hexdigest()[:12]
    folder = os.path.join(tempfile.gettempdir(), f"clmha-icd-{os.getuid()}-{tag}")
    icd = os.path.join(folder, "pocl.icd")
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        if not os.path.exists(icd) or open(icd).read() != lib + "\n":
            tmp = f"{icd}.{os.getpid()}"
            with open(tmp, "w") as f:
                f.write(lib + "\n")
            os.replace(tmp, icd)
    except OSError:
        return None
    os.environ["OCL_ICD_VENDORS"] = folder
    return folder
