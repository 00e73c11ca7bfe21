"""Compares regenerated golden data with the committed files, with stated tolerances.

PyTorch's results differ in the last digits between CPU models: its vectorised kernels (AVX2,
AVX-512 or none, chosen at run time) round differently, in the float32 parameters and inputs it
draws as well as in its float64 results. So `make_golden.py --check` and `make_cli_cases.py
--check` cannot compare bytes. They check instead that:

- every committed float32 input (parameters, query, key, value) is this case's draw from its fixed
  seeds, up to F32_TOLERANCE, and then use the committed values as they are;
- the float64 results that PyTorch computes on exactly those committed inputs agree with the
  committed ones within TOLERANCE, with NaN only where NaN is expected;
- in the float64 layer cases, whose inputs are float64, likewise: every committed input is the
  draw up to F64_DRAW_TOLERANCE, and the results agree within the tighter F64_TOLERANCE;
- everything else is identical: headers, shapes, options, masks (drawn by NumPy, whose generator
  is the same on every CPU), u8 values and the `args` files.

`make_sdpa_golden.py --check` draws all its inputs with NumPy, so they must be identical; its
float64 results are compared within TOLERANCE (golden_text_differs).

Reproduce the CPU dependence on one machine with ATEN_CPU_CAPABILITY=default|avx2|avx512: a
byte-for-byte comparison fails there for up to 57 of the 58 golden files, this one for none. The
tolerances sit far below what a real change of a case does (a changed seed, shape, mask or
formula, or a result computed in float32, moves values by 1e-8 or more).
"""

import io

import numpy as np


def tolerance_text(atol, rtol):
    return f"|have - want| <= {atol:g} + {rtol:g}*|want|"


ATOL = 1e-10
RTOL = 1e-9
TOLERANCE = tolerance_text(ATOL, RTOL)

# The float64 layer cases (make_golden.py F64_CASES) hold results that clmha must match to 1e-12:
# their recomputed results are held to this tighter bound (PyTorch's float64 results differ
# between CPU models by a few units in the last place, some 1e-15 at unit scale).
F64_ATOL = 1e-13
F64_RTOL = 1e-13
F64_TOLERANCE = tolerance_text(F64_ATOL, F64_RTOL)


def close(have, want, atol=ATOL, rtol=RTOL):
    """Returns None when the float arrays agree within |have - want| <= atol + rtol*|want|, else
    a reason."""
    have = np.asarray(have, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    if have.shape != want.shape:
        return f"shape {have.shape} != {want.shape}"
    nan_h, nan_w = np.isnan(have), np.isnan(want)
    if (nan_h != nan_w).any():
        return "NaN in different places"
    inf = np.isinf(want) | np.isinf(have)
    if (have[inf] != want[inf]).any():
        return "infinities differ"
    ok = ~(nan_w | inf)
    diff = np.abs(have[ok] - want[ok])
    bound = atol + rtol * np.abs(want[ok])
    if (diff > bound).any():
        i = int(np.argmax(diff - bound))
        return (f"max difference {diff[i]:.3g} > {bound[i]:.3g} "
                f"({tolerance_text(atol, rtol)})")
    return None


def golden_text_differs(have, want, atol=ATOL, rtol=RTOL):
    """Compares two golden .txt files; None when equal within the tolerance (close()'s, with
    atol and rtol), else a reason.

    Lines are compared one for one. A line inside an f64 tensor is compared as numbers; every
    other line must be identical."""
    hl, wl = have.splitlines(), want.splitlines()
    if len(hl) != len(wl):
        return f"{len(hl)} lines, expected {len(wl)}"
    in_f64 = False
    for n, (h, w) in enumerate(zip(hl, wl), 1):
        if w.startswith("tensor ") or w == "end" or w.startswith("#") or w.startswith("case "):
            in_f64 = w.startswith("tensor ") and w.split()[2] == "f64"
            if h != w:
                return f"line {n}: {h[:60]!r} != {w[:60]!r}"
            continue
        if not in_f64:
            if h != w:
                return f"line {n}: {h[:60]!r} != {w[:60]!r}"
            continue
        try:
            hv = [float(x) for x in h.split()]
            wv = [float(x) for x in w.split()]
        except ValueError:
            return f"line {n}: not numbers"
        why = close(hv, wv, atol, rtol)
        if why:
            return f"line {n}: {why}"
    return None


def file_differs(name, have, want):
    """Compares two files given as bytes; None when equal (float64 .npy within the tolerance)."""
    if have is None or want is None:
        return "missing" if have is None else "not expected"
    if name.endswith(".npy"):
        h = np.load(io.BytesIO(have), allow_pickle=False)
        w = np.load(io.BytesIO(want), allow_pickle=False)
        if h.dtype != w.dtype:
            return f"dtype {h.dtype} != {w.dtype}"
        if w.dtype == np.float64:
            return close(h, w)
        if h.shape != w.shape or not np.array_equal(h, w, equal_nan=True):
            return "values differ"
        return None
    return None if have == want else "bytes differ"


# Float32 inputs drawn by PyTorch (parameter initialisation, randn) may differ in the last bit
# or two between CPU models too (its vectorised kernels round a uniform draw's range once or twice,
# so the difference scales with the tensor's range, not each value); a committed input is accepted
# as "this case's draw" within this bound (one half-precision step for float16 layer files) and
# then used as it is.
F32_RTOL = 1e-6
F32_TOLERANCE = f"|committed - drawn| <= {F32_RTOL:g}*max|drawn|"


# The float64 inputs of the float64 layer cases (parameters by PyTorch's initialisation in
# float64, randn in float64) may likewise differ in their last bits between CPU models (fused
# multiply-adds in the vectorised kernels, the libm variant chosen at run time); a committed
# one is accepted as the draw within this bound, some 450 units in the last place of the largest
# value, and then used as it is.
F64_DRAW_RTOL = 1e-13
F64_DRAW_TOLERANCE = f"|committed - drawn| <= {F64_DRAW_RTOL:g}*max|drawn|"


class NotThisDraw(Exception):
    """A committed input is not what the generator draws for this case."""


def check_draw(name, committed, drawn):
    """Returns the committed array when it is the drawn one up to F32_TOLERANCE."""
    committed = np.asarray(committed)
    drawn = np.asarray(drawn)
    if committed.shape != drawn.shape:
        raise NotThisDraw(f"{name}: shape {committed.shape}, the case draws {drawn.shape}")
    if committed.dtype != drawn.dtype:
        raise NotThisDraw(f"{name}: dtype {committed.dtype}, the case draws {drawn.dtype}")
    if not np.array_equal(committed, drawn):
        c64 = committed.astype(np.float64)
        d64 = drawn.astype(np.float64)
        if not (np.isfinite(c64) == np.isfinite(d64)).all():
            raise NotThisDraw(f"{name}: non-finite values differ from the draw")
        fin = np.isfinite(d64)
        diff = np.abs(c64[fin] - d64[fin])
        scale = np.abs(d64[fin]).max() if fin.any() else 0.0
        # A float16 file holds the draw rounded to half precision: a last-bit difference of the
        # float32 draw may move it by one half-precision step.
        rtol = max(F32_RTOL, float(np.finfo(drawn.dtype).eps)) if drawn.dtype.kind == "f" \
            else F32_RTOL
        if (diff > rtol * scale).any():
            raise NotThisDraw(f"{name}: differs from the case's draw by up to "
                              f"{diff.max():.3g} ({F32_TOLERANCE})")
    return committed.astype(drawn.dtype, copy=True)


def check_draw_f64(name, committed, drawn):
    """Returns the committed float64 array when it is the drawn one up to F64_DRAW_TOLERANCE,
    with its non-finite values (-inf in masks) where the draw has them."""
    committed = np.asarray(committed, dtype=np.float64)
    drawn = np.asarray(drawn)
    if committed.shape != drawn.shape:
        raise NotThisDraw(f"{name}: shape {committed.shape}, the case draws {drawn.shape}")
    if drawn.dtype != np.float64:
        raise NotThisDraw(f"{name}: the case draws {drawn.dtype}, the file holds float64")
    fin = np.isfinite(drawn)
    if not np.array_equal(np.isfinite(committed), fin) or \
            (committed[~fin] != drawn[~fin]).any():
        raise NotThisDraw(f"{name}: non-finite values differ from the draw")
    diff = np.abs(committed[fin] - drawn[fin])
    scale = np.abs(drawn[fin]).max() if fin.any() else 0.0
    if (diff > F64_DRAW_RTOL * scale).any():
        raise NotThisDraw(f"{name}: differs from the case's draw by up to {diff.max():.3g} "
                          f"({F64_DRAW_TOLERANCE})")
    return committed.copy()


class GivenInputs:
    """The float32 tensors (tensors) and float64 tensors (tensors64) of a committed golden file,
    handed out only when they match the draw."""

    def __init__(self, text):
        self.tensors = {}
        self.tensors64 = {}
        lines = text.splitlines()
        i = 0
        while i < len(lines):
            words = lines[i].split()
            i += 1
            if not words or words[0] != "tensor":
                continue
            name, dtype, ndim = words[1], words[2], int(words[3])
            shape = tuple(int(d) for d in words[4:4 + ndim])
            count = int(np.prod(shape))
            values = []
            while len(values) < count:
                values += lines[i].split()
                i += 1
            if dtype == "f32":
                self.tensors[name] = np.array([np.float32(v) for v in values],
                                              dtype=np.float32).reshape(shape)
            elif dtype == "f64":
                self.tensors64[name] = np.array([float(v) for v in values],
                                                dtype=np.float64).reshape(shape)

    def take(self, name, drawn):
        if name not in self.tensors:
            raise NotThisDraw(f"{name}: not in the committed file")
        return check_draw(name, self.tensors[name], drawn)

    def take_f64(self, name, drawn):
        """take() for a float64 input (check_draw_f64)."""
        if name not in self.tensors64:
            raise NotThisDraw(f"{name}: not an f64 tensor of the committed file")
        return check_draw_f64(name, self.tensors64[name], drawn)
