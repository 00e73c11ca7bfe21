"""The OPENBLAS_CORETYPE that the benchmarks give PyTorch 1.13's OpenBLAS on this CPU.

OpenBLAS 0.3.21 (Debian 12) does not know AMD's family 19h (Zen 3 and 4) and takes such a CPU
for a Prescott: sgemm ~5x slower than it can run. The benchmarks therefore name the core type,
from the instruction sets /proc/cpuinfo lists: Cooperlake with AVX-512 BF16, SkylakeX with the
AVX-512 that kernel needs, Haswell with AVX2 and FMA (a CPU whose hypervisor hides AVX-512), and
nothing (OpenBLAS's own choice) otherwise. A CPUID that hides AVX-512 while the core still runs it
must not be given AVX-512 kernels: the peer would run code its CPU says it lacks.
"""


def cpu_flags(path="/proc/cpuinfo"):
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def coretype(flags=None):
    """The core type for OPENBLAS_CORETYPE, or None to leave OpenBLAS's own detection."""
    f = cpu_flags() if flags is None else flags
    if {"avx512f", "avx512vl", "avx512bw", "avx512dq"} <= f:
        return "Cooperlake" if "avx512_bf16" in f else "SkylakeX"
    if {"avx2", "fma"} <= f:
        return "Haswell"
    return None


def with_coretype(env, flags=None):
    """env with OPENBLAS_CORETYPE set for this CPU (a value already in env is kept)."""
    out = dict(env)
    ct = coretype(flags)
    if ct and "OPENBLAS_CORETYPE" not in out:
        out["OPENBLAS_CORETYPE"] = ct
    return out
