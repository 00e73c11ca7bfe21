"""Fixtures of clmha's Python test suite: a module-scoped context, torch seeds; tests skip
cleanly without an OpenCL device or without PyTorch."""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))  # helpers.py

import clmha  # noqa: E402


@pytest.fixture(scope="session")
def has_device():
    if not clmha.devices():
        pytest.skip("no OpenCL device (clmha.devices() is empty)")
    return True


@pytest.fixture(scope="module")
def ctx(has_device):
    """One clmha context per test module."""
    return clmha.Context()


@pytest.fixture(scope="module")
def pcl(has_device):
    """(pyopencl context, in-order queue, clmha.Context.from_pyopencl of them) on the device
    clmha takes by default; skipped without pyopencl."""
    cl = pytest.importorskip("pyopencl")
    devs = [(p, d) for p in cl.get_platforms() for d in p.get_devices()]
    if not devs:
        pytest.skip("pyopencl sees no device")
    spec = clmha.devices()[0]
    pick = [d for p, d in devs if d.name == spec.device_name] or [devs[0][1]]
    context = cl.Context([pick[0]])
    queue = cl.CommandQueue(context)  # in order
    return context, queue, clmha.Context.from_pyopencl(context, queue)


@pytest.fixture
def torch_mod():
    """The torch module, seeded (tests needing PyTorch skip without it)."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(1234)
    return torch


@pytest.fixture
def rng():
    return np.random.default_rng(20240611)


def pytest_terminal_summary(terminalreporter):
    """Prints the max errors the tests measured (see helpers.record)."""
    from helpers import MEASURED
    if MEASURED:
        terminalreporter.write_sep("-", "clmha: measured max errors")
        for name in sorted(MEASURED):
            terminalreporter.write_line(f"{name:60s} {MEASURED[name]:.3g}")
