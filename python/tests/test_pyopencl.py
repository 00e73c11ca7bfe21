"""clmha.Context.from_pyopencl: forward on pyopencl arrays on the same device buffers."""

import numpy as np
import pytest

cl = pytest.importorskip("pyopencl")
cla = pytest.importorskip("pyopencl.array")

import clmha  # noqa: E402
from helpers import TOL, max_err, randn, record  # noqa: E402

E, H, N, L, S = 16, 2, 2, 5, 6


def _pair(ctx_pcl, rng, **opts):
    """The same parameters on a pyopencl-context layer and a plain one."""
    a = clmha.Layer(E, H, context=ctx_pcl, **opts)
    b = clmha.Layer(E, H, context=clmha.default_context(), **opts)
    for n in a.parameter_names():
        v = randn(rng, *a[n].shape, scale=0.4)
        a[n] = v
        b[n] = v
    return a, b


def test_context(pcl):
    context, queue, c = pcl
    assert c.pyopencl_queue is queue
    assert c.cl_context_int_ptr == context.int_ptr
    with pytest.raises(TypeError):
        clmha.Context.from_pyopencl(queue, context)


def test_forward_on_device_arrays(pcl, rng):
    context, queue, c = pcl
    a, b = _pair(c, rng)
    q, kv = randn(rng, L, N, E), randn(rng, S, N, E)
    kpm = np.zeros((N, S), bool)
    kpm[1, -2:] = True
    am = randn(rng, L, S)
    ref, rw = b.forward(q, kv, key_padding_mask=kpm, attn_mask=am, need_weights=True)
    dq, dkv = cla.to_device(queue, q), cla.to_device(queue, kv)
    # masks as numpy arrays (uploaded for the call)
    out, w = a.forward(dq, dkv, key_padding_mask=kpm, attn_mask=am, need_weights=True)
    assert isinstance(out, cla.Array) and isinstance(w, cla.Array)
    assert out.shape == ref.shape and w.shape == rw.shape
    assert out.events and w.events  # the call's event
    evt = out.events[-1]
    evt.wait()
    assert evt.command_execution_status == cl.command_execution_status.COMPLETE
    assert record("pyopencl forward", max_err(out.get(), ref)) <= TOL
    assert max_err(w.get(), rw) <= TOL
    # masks as pyopencl arrays
    dk = cla.to_device(queue, kpm.view(np.uint8))
    dm = cla.to_device(queue, am)
    out2, w2 = a.forward(dq, dkv, key_padding_mask=dk, attn_mask=dm)
    assert w2 is None
    assert max_err(out2.get(), ref) <= TOL
    # into given output arrays
    dst = cla.empty(queue, ref.shape, np.float32)
    out3, _ = a.forward(dq, dkv, key_padding_mask=kpm, attn_mask=am, out=dst)
    assert out3 is dst
    assert max_err(dst.get(), ref) <= TOL


def test_offset_sub_array(pcl, rng):
    context, queue, c = pcl
    a, b = _pair(c, rng)
    big = randn(rng, 2 * L, N, E)
    ref, _ = b.forward(np.ascontiguousarray(big[L:]))
    dbig = cla.to_device(queue, big)
    sub = dbig[L:]
    assert sub.offset > 0
    out, _ = a.forward(sub)
    assert record("pyopencl offset sub-array", max_err(out.get(), ref)) <= TOL


def test_errors(pcl, rng):
    context, queue, c = pcl
    a, b = _pair(c, rng)
    other_ctx = cl.Context([queue.device])
    other_q = cl.CommandQueue(other_ctx)
    x = cla.to_device(other_q, randn(rng, L, N, E))
    with pytest.raises(ValueError):
        a.forward(x)
    with pytest.raises(ValueError):  # a plain layer takes no device arrays
        b.forward(cla.to_device(queue, randn(rng, L, N, E)))
    with pytest.raises(TypeError):
        a.forward(cla.to_device(queue, randn(rng, L, N, E).astype(np.float64)))


def test_backward_on_device_arrays(pcl, rng):
    """forward(save=) and backward on pyopencl arrays: the gradients of every input, parameter
    and float mask against PyTorch's float64 autograd, as pyopencl arrays carrying the call's
    event."""
    pytest.importorskip("torch")
    from helpers import layer_of, torch_grads, torch_mha

    context, queue, c = pcl
    m = torch_mha(E, H, add_bias_kv=True)
    layer = layer_of(m, c)
    q, k, v = randn(rng, L, N, E), randn(rng, S, N, E), randn(rng, S, N, E)
    am = randn(rng, L, S, scale=0.5)
    gout, gw = randn(rng, L, N, E), randn(rng, N, L, S + 1)
    _, want = torch_grads(m, q, k, v, None, am, gout, gw)
    saved = layer.saved()
    dev = [cla.to_device(queue, a) for a in (q, k, v, am)]
    out, w = layer.forward(dev[0], dev[1], dev[2], attn_mask=dev[3], need_weights=True,
                           save=saved, impl="unfused")
    got = layer.backward(saved, cla.to_device(queue, gout), cla.to_device(queue, gw))
    assert set(got) == set(want)
    worst = 0.0
    for name, ref in want.items():
        assert isinstance(got[name], cla.Array) and got[name].events, name
        err = max_err(got[name].get(), ref) / (1 + float(np.abs(ref).max()))
        assert err <= TOL, (name, err)
        worst = max(worst, err)
    record("pyopencl backward (relative)", worst)
    with pytest.raises(TypeError):
        layer.backward(saved, gout)  # a host array after a device forward
