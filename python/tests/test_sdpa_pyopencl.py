"""The device form of attention as a function: clmha.numpy.scaled_dot_product_attention and
_backward on pyopencl arrays (clmha_attention_forward/_backward on the arrays' buffers, on a
Context.from_pyopencl context), against the float64 formula written out with PyTorch
(helpers.sdpa_ref, with its autograd for the gradients): both layouts, GQA, is_causal, bool and
float masks (pyopencl or NumPy), the lse and the weights, views at an offset, the call's event
chained to later pyopencl work, and the errors. Skipped without pyopencl, PyTorch or a device."""

import threading
import time

import numpy as np
import pytest

cl = pytest.importorskip("pyopencl")
cla = pytest.importorskip("pyopencl.array")
torch = pytest.importorskip("torch")

import clmha  # noqa: E402
import clmha.numpy as cn  # noqa: E402
from helpers import record, sdpa_ref, sdpa_ref_np  # noqa: E402

TOL = 1e-5  # max abs error of float32 results on unit-scale inputs (gradients: times max(1, |g|))
N, H, L, S, D = 2, 4, 5, 7, 8
f = cn.scaled_dot_product_attention
fb = cn.scaled_dot_product_attention_backward


def _nhld(a, layout):
    """An (N, L, H, D) array as (N, H, L, D) (NLHD), else as it is."""
    return np.swapaxes(a, -3, -2) if layout == "NLHD" else a


def _inputs(rng, layout, kv_heads=H, lead=(N,)):
    """query, key, value as NumPy float32 arrays in @p layout."""
    shapes = [(H, L, D), (kv_heads, S, D), (kv_heads, S, D)]
    out = [rng.standard_normal(lead + s).astype(np.float32) for s in shapes]
    return [np.ascontiguousarray(_nhld(a, layout)) for a in out]


def _dev(queue, *arrays):
    return [cla.to_device(queue, a) for a in arrays]


def _err(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def _ref(q, k, v, m=None, layout="NHLD", **kw):
    """The float64 formula on NumPy arrays in @p layout; the output in that layout."""
    return _nhld(sdpa_ref_np(_nhld(q, layout), _nhld(k, layout), _nhld(v, layout), m, **kw),
                 layout)


def _ref_grads(q, k, v, m, gout, layout="NHLD", **kw):
    """The float64 formula's gradients of query, key, value (in @p layout) and of a float mask."""
    t = {n: torch.from_numpy(np.asarray(_nhld(a, layout), np.float64)).requires_grad_()
         for n, a in (("q", q), ("k", k), ("v", v))}
    mt = None
    if m is not None:
        mt = torch.from_numpy(m) if m.dtype == np.bool_ else \
            torch.from_numpy(m.astype(np.float64)).requires_grad_()
    out = sdpa_ref(t["q"], t["k"], t["v"], mt, **kw)
    out.backward(torch.from_numpy(np.ascontiguousarray(_nhld(gout, layout), np.float64)))
    grads = [_nhld(t[n].grad.numpy(), layout) for n in "qkv"]
    for g in grads:
        assert np.abs(g).max() > 0  # the comparison can fail
    return grads + [mt.grad.numpy() if mt is not None and mt.requires_grad else None]


def _check_grads(name, got, want):
    for a, r, n in zip(got, want, ("query", "key", "value", "attn_mask")):
        if r is None:
            assert a is None, n
            continue
        assert isinstance(a, cla.Array) and a.events, n  # carrying the call's event
        assert a.dtype == np.float32 and a.shape == r.shape, (n, a.shape, r.shape)
        e = record(f"sdpa pyopencl {name} grad", _err(a.get(), r))
        assert e <= TOL * max(1.0, float(np.abs(r).max())), (n, e)


# ---- forward -----------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["NHLD", "NLHD"])
@pytest.mark.parametrize("case", ["plain", "gqa_causal", "bool", "float", "unbatched"])
def test_forward(pcl, rng, layout, case):
    _, queue, c = pcl
    q, k, v = _inputs(rng, layout, kv_heads=2 if case == "gqa_causal" else H,
                      lead=() if case == "unbatched" else (N,))
    kw, mask = {}, None
    if case == "gqa_causal":
        kw = {"enable_gqa": True, "is_causal": True}
    elif case == "bool":
        mask = rng.random((N, 1, L, S)) < 0.6
        mask[..., 0] = True
    elif case == "float":
        mask = rng.standard_normal((H, L, S)).astype(np.float32)
    dq, dk, dv = _dev(queue, q, k, v)
    dm = cla.to_device(queue, mask) if mask is not None else None
    out = f(dq, dk, dv, dm, layout=layout, context=c, **kw)
    assert isinstance(out, cla.Array) and out.dtype == np.float32
    assert out.shape == q.shape  # D_v = D, in the query's layout
    evt = out.events[-1]
    assert evt in dq.events  # the inputs carry the call's event too
    ref = _ref(q, k, v, mask, layout, **kw)
    assert record(f"sdpa pyopencl forward {layout}", _err(out.get(), ref)) <= TOL
    assert evt.command_execution_status == cl.command_execution_status.COMPLETE
    # the same call on NumPy arrays (the host form) agrees
    host = f(q, k, v, mask, layout=layout, context=c, **kw)
    assert isinstance(host, np.ndarray) and _err(host, ref) <= TOL


def test_lse_and_weights(pcl, rng):
    _, queue, c = pcl
    q, k, v = _inputs(rng, "NLHD")
    mask = rng.random((L, S)) < 0.6
    mask[:, 0] = True
    dq, dk, dv = _dev(queue, q, k, v)
    out, lse = f(dq, dk, dv, mask, layout="NLHD", return_lse=True, context=c)
    assert lse.shape == (N, H, L) and lse.events  # (N, H, L) in either layout
    scores = np.einsum("nlhd,nshd->nhls", q.astype(np.float64), k.astype(np.float64)) / D ** 0.5
    scores = np.where(mask, scores, -np.inf)
    m = scores.max(-1, keepdims=True)
    want_lse = (m + np.log(np.exp(scores - m).sum(-1, keepdims=True)))[..., 0]
    assert record("sdpa pyopencl lse", _err(lse.get(), want_lse)) <= TOL
    assert _err(out.get(), _ref(q, k, v, mask, "NLHD")) <= TOL
    out2, lse2, w = f(dq, dk, dv, mask, layout="NLHD", return_lse=True, return_weights=True,
                      context=c)
    assert w.shape == (N, H, L, S)
    want_w = np.exp(scores - want_lse[..., None])
    assert record("sdpa pyopencl weights", _err(w.get(), want_w)) <= TOL
    assert _err(lse2.get(), want_lse) <= TOL and _err(out2.get(), out.get()) <= TOL


@pytest.mark.parametrize("kind", ["bool", "uint8", "float32"])
def test_device_masks(pcl, rng, kind):
    """pyopencl masks read where they are: bool or uint8 (non-zero = may attend), float32."""
    _, queue, c = pcl
    q, k, v = _inputs(rng, "NHLD")
    keep = rng.random((N, H, L, S)) < 0.6
    keep[..., 0] = True
    m = {"bool": keep, "uint8": keep.astype(np.uint8) * 3,
         "float32": rng.standard_normal((N, H, L, S)).astype(np.float32)}[kind]
    out = f(*_dev(queue, q, k, v), cla.to_device(queue, m), context=c)
    ref = _ref(q, k, v, m if kind == "float32" else keep)
    assert record("sdpa pyopencl device mask", _err(out.get(), ref)) <= TOL


def test_numpy_mask_expanded(pcl, rng):
    """A NumPy mask in a broadcast the C function does not read (along the keys: (N, 1, L, 1))
    is expanded and uploaded; its gradient comes back summed to its own shape. A pyopencl mask
    is read where it is: (N, H, 1, S) is, (N, 1, L, 1) is refused."""
    _, queue, c = pcl
    q, k, v = _inputs(rng, "NHLD")
    m = rng.standard_normal((N, 1, L, 1)).astype(np.float32)
    dq, dk, dv = _dev(queue, q, k, v)
    out = f(dq, dk, dv, m, context=c)
    assert _err(out.get(), _ref(q, k, v, m)) <= TOL
    gout = rng.standard_normal(out.shape).astype(np.float32)
    got = fb(cla.to_device(queue, gout), dq, dk, dv, m, context=c)
    _check_grads("expanded mask", got, _ref_grads(q, k, v, m, gout))
    with pytest.raises(ValueError, match="does not read"):  # on the device it is not expanded
        f(dq, dk, dv, cla.to_device(queue, m), context=c)
    rows = rng.standard_normal((N, H, 1, S)).astype(np.float32)
    out = f(dq, dk, dv, cla.to_device(queue, rows), context=c)
    assert _err(out.get(), _ref(q, k, v, rows)) <= TOL


def test_offset_views(pcl, rng):
    """Views into larger arrays (base_data + a nonzero offset): inputs, mask and grad_output."""
    _, queue, c = pcl
    q, k, v = _inputs(rng, "NHLD", lead=(N + 1,))
    m = rng.standard_normal((N + 1, 1, L, S)).astype(np.float32)
    gout = rng.standard_normal((N + 1, H, L, D)).astype(np.float32)
    big = _dev(queue, q, k, v, m, gout)
    views = [a[1:] for a in big]
    assert all(a.offset > 0 and a.base_data is b.base_data for a, b in zip(views, big))
    sub = [np.ascontiguousarray(a[1:]) for a in (q, k, v, m, gout)]
    out, lse = f(*views[:4], return_lse=True, context=c)
    assert record("sdpa pyopencl offset view", _err(out.get(), _ref(*sub[:4]))) <= TOL
    want = _ref_grads(*sub[:4], sub[4])
    _check_grads("offset view", fb(views[4], *views[:4], context=c), want)
    # with the forward's results, given as views too
    store = cla.zeros(queue, (2,) + out.shape, np.float32)
    store[1] = out
    lse_store = cla.zeros(queue, (3,) + lse.shape, np.float32)
    lse_store[2] = lse
    got = fb(views[4], *views[:4], output=store[1], lse=lse_store[2], context=c)
    _check_grads("offset view, given output", got, want)
    # the arrays around the views are untouched
    assert _err(big[0][:1].get(), q[:1]) == 0.0 and not store[0].get().any()


# ---- backward ----------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["NHLD", "NLHD"])
@pytest.mark.parametrize("mask", [None, "bool", "float"])
@pytest.mark.parametrize("given", ["rerun", "output", "output_lse"])
def test_backward(pcl, rng, layout, mask, given):
    _, queue, c = pcl
    q, k, v = _inputs(rng, layout, kv_heads=2)
    m = {None: None, "float": rng.standard_normal((N, 1, L, S)).astype(np.float32),
         "bool": rng.random((L, S)) < 0.7}[mask]
    if mask == "bool":
        m[:, 0] = True
    gout = rng.standard_normal(q.shape).astype(np.float32)
    dq, dk, dv = _dev(queue, q, k, v)
    dm = cla.to_device(queue, m) if m is not None else None
    kw = dict(enable_gqa=True, layout=layout, context=c)
    extra = {}
    if given != "rerun":
        out, lse = f(dq, dk, dv, dm, return_lse=True, **kw)
        extra = {"output": out, "lse": lse} if given == "output_lse" else {"output": out}
    got = fb(cla.to_device(queue, gout), dq, dk, dv, dm, **kw, **extra)
    assert len(got) == 4
    _check_grads(f"backward {layout}", got,
                 _ref_grads(q, k, v, m, gout, layout, enable_gqa=True))


def test_backward_causal_float_mask_shape(pcl, rng):
    """is_causal, and a float mask's gradient in the mask's own shape (a pyopencl mask)."""
    _, queue, c = pcl
    q, k, v = _inputs(rng, "NHLD")
    gout = rng.standard_normal(q.shape).astype(np.float32)
    dev = _dev(queue, q, k, v)
    got = fb(cla.to_device(queue, gout), *dev, is_causal=True, context=c)
    _check_grads("causal", got, _ref_grads(q, k, v, None, gout, is_causal=True))
    m = rng.standard_normal((N, 1, 1, S)).astype(np.float32)
    got = fb(cla.to_device(queue, gout), *dev, cla.to_device(queue, m), context=c)
    assert got[3].shape == (N, 1, 1, S)
    _check_grads("float mask", got, _ref_grads(q, k, v, m, gout))


# ---- events ------------------------------------------------------------------------------------

def _held_copy(other, dst, src, gate):
    """dst's contents copied from src on the queue @p other once @p gate completes (and src's
    events); the copy's event goes to dst.events."""
    dst.add_event(cl.enqueue_copy(other, dst.base_data, src.base_data, byte_count=src.nbytes,
                                  src_offset=src.offset, wait_for=src.events + [gate]))
    other.flush()


class _Gates:
    """User events that hold copies back, each released once: by release(), or by a timer (a
    safety net: were a call to wait on the host for its wait list, it would return only after
    the timer released its gate, and the status checks would fail instead of hanging)."""

    def __init__(self, context, count):
        self.events = [cl.UserEvent(context) for _ in range(count)]
        self.open = [False] * count
        self.lock = threading.Lock()
        self.timer = threading.Timer(20.0, self.release_all)
        self.timer.start()

    def release(self, i):
        with self.lock:
            if not self.open[i]:
                self.open[i] = True
                self.events[i].set_status(cl.command_execution_status.COMPLETE)

    def release_all(self):
        for i in range(len(self.events)):
            self.release(i)
        self.timer.cancel()


def _still_waiting(event):
    """Whether the call of @p event is still held back, half a second after it was enqueued
    (long enough for these small calls to finish, had they not waited)."""
    time.sleep(0.5)
    return event.command_execution_status != cl.command_execution_status.COMPLETE


def test_event_chaining(pcl, rng):
    """The calls wait for their inputs' events on the device and their results carry their
    event. The forward's query and then the backward's grad_output are written by copies on
    another queue, held back by user events: each call must neither run before its copy nor
    read the buffer early. pyopencl work on the results is enqueued with no finish."""
    context, queue, c = pcl
    q, k, v = _inputs(rng, "NHLD")
    dq, dk, dv = _dev(queue, q, k, v)
    out0 = f(dq, dk, dv, context=c)  # the first calls for these shapes build what they need
    fb(out0, dq, dk, dv, context=c, output=out0)[0].get()
    other = cl.CommandQueue(context)
    gated, gout = cla.zeros(queue, q.shape, np.float32), cla.zeros(queue, q.shape, np.float32)
    queue.finish()
    gates = _Gates(context, 2)
    try:
        _held_copy(other, gated, dq, gates.events[0])
        out = f(gated, dk, dv, context=c)
        assert _still_waiting(out.events[-1])
        doubled = out * 2 + 1  # a pyopencl kernel on the result, enqueued at once
        gates.release(0)
        out.events[-1].wait()
        _held_copy(other, gout, out, gates.events[1])
        grads = fb(gout, gated, dk, dv, context=c, output=out)
        assert _still_waiting(grads[0].events[-1])
    finally:
        gates.release_all()
    ref = _ref(q, k, v)
    # a copy on the other queue, ordered only by the call's event
    host = np.empty(out.shape, np.float32)
    cl.enqueue_copy(other, host, out.base_data, src_offset=out.offset, wait_for=out.events,
                    is_blocking=True)
    assert record("sdpa pyopencl chained", _err(host, ref)) <= TOL
    assert _err(doubled.get(), 2 * ref + 1) <= 2 * TOL
    _check_grads("chained", grads, _ref_grads(q, k, v, None, ref.astype(np.float32)))


# ---- KV cache ----------------------------------------------------------------------------------

def test_kv_cache_on_device(pcl, rng):
    """The KV-cache form on pyopencl arrays: a prefix, then one token at a time, gives the rows
    of the one-shot causal formula."""
    _, queue, c = pcl
    T = S
    q = rng.standard_normal((N, H, T, D)).astype(np.float32)
    _, k, v = _inputs(rng, "NHLD", kv_heads=2)
    cache = clmha.KVCache.for_attention(N, 2, D, T, context=c)
    ref = _ref(q, k, v, is_causal=True, enable_gqa=True)
    rows = [f(*_dev(queue, q[:, :, :3].copy(), k[:, :, :3].copy(), v[:, :, :3].copy()),
              is_causal=True, enable_gqa=True, kv_cache=cache).get()]
    for t in range(3, T):
        step = _dev(queue, *(np.ascontiguousarray(a[:, :, t:t + 1]) for a in (q, k, v)))
        rows.append(f(*step, is_causal=True, enable_gqa=True, kv_cache=cache).get())
    assert cache.lengths.tolist() == [T] * N
    got = np.concatenate(rows, axis=2)
    assert record("sdpa pyopencl kv cache", _err(got, ref)) <= TOL


# ---- errors ------------------------------------------------------------------------------------

def test_errors(pcl, rng):
    context, queue, c = pcl
    q, k, v = _inputs(rng, "NHLD")
    dq, dk, dv = _dev(queue, q, k, v)
    with pytest.raises(TypeError, match="float32"):
        f(cla.to_device(queue, q.astype(np.float64)), dk, dv, context=c)
    with pytest.raises(TypeError, match="float32"):
        f(dq, cla.to_device(queue, k.astype(np.float16)), dv, context=c)
    with pytest.raises(ValueError, match="not C-contiguous"):
        f(dq[:, :, ::2], dk, dv, context=c)
    with pytest.raises(ValueError, match="not C-contiguous"):
        f(dq, dk, dv, cla.to_device(queue, np.ones((S, L), bool)).T, context=c)
    other = cl.CommandQueue(cl.Context([queue.device]))
    with pytest.raises(ValueError, match="another OpenCL context"):
        f(dq, cla.to_device(other, k), dv, context=c)
    with pytest.raises(ValueError, match="another OpenCL context"):
        f(dq, dk, dv, cla.to_device(other, np.ones((L, S), bool)), context=c)
    with pytest.raises(TypeError, match="not a mix"):
        f(dq, k, dv, context=c)
    with pytest.raises(TypeError, match="not a mix"):
        f(q, dk, dv, context=c)
    with pytest.raises(ValueError, match="from_pyopencl"):
        f(dq, dk, dv, context=clmha.default_context())
    with pytest.raises(clmha.Error, match=r"must equal") as e:  # D 4 against the query's 8
        f(dq, cla.to_device(queue, k[..., :4].copy()), cla.to_device(queue, v[..., :4].copy()),
          context=c)
    assert e.value.status_name == "SHAPE_MISMATCH"
    with pytest.raises(clmha.Error, match="set enable_gqa"):
        f(dq, *_dev(queue, k[:, :2].copy(), v[:, :2].copy()), context=c)
    with pytest.raises(ValueError, match="same number of dimensions"):
        f(dq, dk[0], dv[0], context=c)
    with pytest.raises(ValueError, match="does not broadcast"):
        f(dq, dk, dv, cla.to_device(queue, np.ones((L + 1, S), bool)), context=c)
    with pytest.raises(TypeError, match="bool or uint8"):
        f(dq, dk, dv, cla.to_device(queue, np.ones((L, S), np.int32)), context=c)
    with pytest.raises(ValueError, match="layout"):
        f(dq, dk, dv, layout="NDHL", context=c)
    gout = cla.to_device(queue, rng.standard_normal(q.shape).astype(np.float32))
    with pytest.raises(TypeError, match="pyopencl"):
        fb(gout.get(), dq, dk, dv, context=c)
    with pytest.raises(ValueError, match="shape"):
        fb(gout[:1], dq, dk, dv, context=c)
    with pytest.raises(TypeError, match="float32"):
        fb(cla.to_device(queue, gout.get().astype(np.float64)), dq, dk, dv, context=c)
    with pytest.raises(ValueError, match="needs output"):
        fb(gout, dq, dk, dv, context=c, lse=cla.empty(queue, (N, H, L), np.float32))
    with pytest.raises(ValueError, match="shape"):
        fb(gout, dq, dk, dv, context=c, output=cla.empty(queue, (N, H, L), np.float32))
    with pytest.raises(ValueError, match="for pyopencl arrays"):
        fb(gout.get(), q, k, v, context=c, output=gout)
    # none of that broke anything: a good call still runs
    assert _err(f(dq, dk, dv, context=c).get(), _ref(q, k, v)) <= TOL
