"""Builds the C declarations of the `clmha._native` extension from include/clmha.h itself.

cffi in API mode: the declarations below are not written by hand. They are the header's own
text with the comments and preprocessor lines taken out (the status enum expanded from its
X-macro table), and the generated C file includes the real header, so the C compiler checks
every struct field, enum value and function signature against it (a field whose offset or
size differs from the compiler's fails the build or the import). Run by CMake at build time:

    python3 _ffi_build.py path/to/clmha.h OUTPUT.c
"""

import re
import sys

# The OpenCL types the header uses, as the Khronos headers define them on every platform that
# clmha supports (the C compiler checks the structs that hold them against the real headers).
_OPENCL_TYPES = """
typedef struct _cl_platform_id *cl_platform_id;
typedef struct _cl_device_id *cl_device_id;
typedef struct _cl_context *cl_context;
typedef struct _cl_command_queue *cl_command_queue;
typedef struct _cl_mem *cl_mem;
typedef struct _cl_event *cl_event;
typedef uint32_t cl_uint;
typedef int32_t cl_int;
typedef uint64_t cl_ulong;
typedef cl_ulong cl_bitfield;
typedef cl_bitfield cl_device_type;
"""


def declarations(header_text: str) -> str:
    """The header's declarations in the C subset that cffi's cdef() parses."""
    lines = header_text.splitlines()
    statuses = []
    out = []
    skipping_cplusplus = []  # stack of #if blocks: True where the block is C++-only
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if stripped.startswith("#"):
            directive = stripped
            while directive.endswith("\\") and i + 1 < len(lines):  # continuation lines
                i += 1
                directive = directive[:-1] + " " + lines[i].strip()
            for name, value in re.findall(r"X\((\w+),\s*(-?\d+),", directive):
                statuses.append((name, int(value)))
            word = directive[1:].split()[0] if directive[1:].split() else ""
            if word in ("if", "ifdef", "ifndef"):
                skipping_cplusplus.append(directive == "#ifdef __cplusplus")
            elif word in ("else", "elif") and skipping_cplusplus:
                skipping_cplusplus[-1] = False
            elif word == "endif" and skipping_cplusplus:
                skipping_cplusplus.pop()
            i += 1
            continue
        i += 1
        if any(skipping_cplusplus):
            continue
        line = re.sub(r"//.*", "", line)
        if "CLMHA_STATUS_MAP(" in line:
            line = "\n".join(f"    CLMHA_{n} = {v}," for n, v in statuses)
        line = line.replace("CLMHA_API ", "")
        if line.strip():
            out.append(line)
    if not statuses:
        raise SystemExit("_ffi_build.py: no CLMHA_STATUS_MAP entries found in the header")
    return _OPENCL_TYPES + "\n".join(out) + "\n"


def builder(header_path: str, module: str = "clmha._native", **source_options):
    """A cffi FFI builder for ``module`` from the header at ``header_path`` (``source_options``:
    set_source()'s include_dirs, libraries, ...)."""
    import cffi

    with open(header_path, encoding="utf-8") as f:
        text = f.read()
    ffi = cffi.FFI()
    ffi.cdef(declarations(text))
    ffi.set_source(module, "#include <clmha.h>\n", **source_options)
    return ffi


def main(argv):
    if len(argv) != 3:
        sys.stderr.write(__doc__)
        return 2
    ffi = builder(argv[1])
    ffi.emit_c_code(argv[2])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
