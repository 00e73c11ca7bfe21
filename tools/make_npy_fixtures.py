#!/usr/bin/env python3
"""Writes the small NumPy-made .npy files under tests/npy/ that tests/unit/test_npy.c reads.

Run with any Python that has NumPy:  python3 tools/make_npy_fixtures.py
The values are arange-based so the test knows them without NumPy; the files are committed, so the
test suite itself never needs Python or NumPy.
"""
import os

import numpy as np
from numpy.lib import format as npformat

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "npy")


def save(name, array, **kwargs):
    path = os.path.join(OUT, name)
    np.save(path, array, **kwargs)
    print(path)


def save_version(name, array, version):
    path = os.path.join(OUT, name)
    with open(path, "wb") as f:
        npformat.write_array(f, array, version=version)
    print(path)


def main():
    os.makedirs(OUT, exist_ok=True)
    # accepted
    save("f4_2x3x4.npy", np.arange(24, dtype=np.float32).reshape(2, 3, 4))
    save("f4_scalar.npy", np.array(3.5, dtype=np.float32))  # 0-D
    save("f4_0x3.npy", np.zeros((0, 3), dtype=np.float32))  # no elements
    save("f8_2x3.npy", np.arange(6, dtype=np.float64).reshape(2, 3) / 4 - 0.5)
    save("b1_2x3.npy", np.array([[True, False, True], [False, False, True]]))
    save("u1_5.npy", np.arange(5, dtype=np.uint8) * 50)
    save("f4_fortran_3x4.npy", np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4)))
    save("f4_fortran_2x3x4.npy",
         np.asfortranarray(np.arange(24, dtype=np.float32).reshape(2, 3, 4)))
    save_version("f4_v2_2x3.npy", np.arange(6, dtype=np.float32).reshape(2, 3), (2, 0))
    save_version("f4_v3_4.npy", np.arange(4, dtype=np.float32), (3, 0))
    # refused
    save("f4_big_endian.npy", np.arange(3, dtype=">f4"))
    save("i8_3.npy", np.arange(3, dtype=np.int64))
    save("object_3.npy", np.array([1, "a", None], dtype=object), allow_pickle=True)
    save("structured_2.npy", np.zeros(2, dtype=[("a", "<f4"), ("b", "<i4")]))


if __name__ == "__main__":
    main()
