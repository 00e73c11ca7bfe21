"""The backward pass of float64 layers (torch.autograd.gradcheck through clmha.torch, and
PyTorch's float64 autograd within 1e-12), and of float16 and bfloat16 layers
(include/clmha.h, clmha_dtype) against PyTorch: each gradient's error, against float64 autograd on the same 16-bit values, at most
twice that of PyTorch's own computation in the dtype (or within one rounding of the dtype);
gradients as float32 (grad_dtype="float32"); the backward on pyopencl arrays of 16-bit elements;
and bfloat16 training with float32 master weights, and float16 with loss scaling, following the
float64 run's loss.

PyTorch's own bfloat16 error is that of nn.MultiheadAttention run natively in bfloat16 on the
CPU. PyTorch 1.13 cannot run float16 matmuls on the CPU, so its float16 error is that of an
emulation of CUDA's float16 autograd (emulated_f16 below): every product's result and every
gradient flowing back through it rounded to float16, float32 arithmetic inside, the softmax in
float32 (autocast's policy), as tools/make_golden.py emulates the float16 forward.
"""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import clmha  # noqa: E402
import clmha.torch as ct  # noqa: E402
from helpers import record, torch_mha  # noqa: E402

E, H, N, L = 32, 4, 2, 24
HALF_ULP = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}


class _Round16(torch.autograd.Function):
    """x rounded to float16 (a float16 kernel's result), and its gradient likewise."""

    @staticmethod
    def forward(ctx, x):
        return x.to(torch.float16).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        return g.to(torch.float16).to(g.dtype)


def emulated_f16(params, x):
    """Self-attention of nn.MultiheadAttention (batch_first, bias) as CUDA's float16 autocast
    computes it, in float32 tensors holding float16 values."""
    r = _Round16.apply
    w_in, b_in, w_o, b_o = (params[k] for k in ("in_proj_weight", "in_proj_bias",
                                                 "out_proj.weight", "out_proj.bias"))
    n, t, e = x.shape
    d = e // H
    q, k, v = r(x @ w_in.t() + b_in).chunk(3, dim=-1)
    split = lambda a: a.reshape(n, t, H, d).transpose(1, 2)  # noqa: E731
    q, k, v = split(q), split(k), split(v)
    s = r(r(q * d ** -0.5) @ k.transpose(-1, -2))
    p = r(torch.softmax(s, dim=-1))
    o = r(p @ v).transpose(1, 2).reshape(n, t, e)
    return r(o @ w_o.t() + b_o)


def _grads(out, gy, leaves):
    out.backward(gy)
    return {name: t.grad.double() for name, t in leaves.items()}


def _case(dtype, seed):
    """float64 reference gradients on 16-bit values, PyTorch's own in the dtype, clmha's."""
    g = torch.Generator().manual_seed(seed)
    tm = torch_mha(E, H, seed=seed, batch_first=True)
    sd16 = {k: v.to(dtype) for k, v in tm.state_dict().items()}
    x16 = torch.randn(N, L, E, generator=g).to(dtype)
    gy16 = torch.randn(N, L, E, generator=g).to(dtype)

    def leaves_of(module, x):
        named = dict(module.named_parameters())
        return {"query": x, **{k: named[k] for k in sd16}}

    ref = copy.deepcopy(tm).double()
    ref.load_state_dict({k: v.double() for k, v in sd16.items()})
    x = x16.double().requires_grad_()
    want = _grads(ref(x, x, x, need_weights=False)[0], gy16.double(), leaves_of(ref, x))

    if dtype == torch.bfloat16:
        own = copy.deepcopy(tm).to(dtype)
        own.load_state_dict(sd16)
        x = x16.clone().requires_grad_()
        theirs = _grads(own(x, x, x, need_weights=False)[0], gy16, leaves_of(own, x))
    else:
        params = {k: v.float().requires_grad_() for k, v in sd16.items()}
        x = x16.float().requires_grad_()
        theirs = _grads(emulated_f16(params, x), gy16.float(), {"query": x, **params})
        theirs = {k: v.to(torch.float16).double() for k, v in theirs.items()}  # .grad in f16

    cm = ct.MultiheadAttention(E, H, batch_first=True, dtype=dtype)
    cm.load_state_dict(sd16)
    x = x16.clone().requires_grad_()
    out = cm(x, x, x, need_weights=False)[0]
    assert out.dtype == dtype
    ours = _grads(out, gy16, leaves_of(cm, x))
    for name in want:
        assert dict(leaves_of(cm, x))[name].grad.dtype == dtype, name
    return want, theirs, ours


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_gradients_at_most_twice_pytorchs_error(ctx, dtype):
    worst = 0.0
    for seed in range(4):
        want, theirs, ours = _case(dtype, seed)
        for name, w in want.items():
            scale = float(w.abs().max())
            e_ours = float((ours[name] - w).abs().max())
            e_theirs = float((theirs[name] - w).abs().max())
            one_rounding = HALF_ULP[dtype] * scale * (1 + 1e-3)
            allowed = max(2 * e_theirs, one_rounding)
            ratio = e_ours / e_theirs if e_theirs else float("inf") if e_ours else 0.0
            record(f"backward {dtype} {name}: clmha / PyTorch error", min(ratio, 99.0))
            worst = max(worst, min(ratio, 99.0))
            assert e_ours <= allowed, (name, seed, e_ours, e_theirs, scale)
    record(f"backward {dtype}: worst clmha / PyTorch gradient error", worst)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_grad_dtype_float32(ctx, dtype):
    """grad_dtype="float32": the same gradients before their rounding to the dtype."""
    rng = np.random.default_rng(5)
    layer = clmha.Layer(E, H, batch_first=True, dtype=dtype, context=ctx)
    tm = torch_mha(E, H, seed=3, batch_first=True)
    layer.load_state_dict({k: v.numpy() for k, v in tm.state_dict().items()})
    x = rng.standard_normal((N, L, E)).astype(np.float32)
    gy = rng.standard_normal((N, L, E)).astype(np.float32)
    if dtype == "float16":
        x, gy = x.astype(np.float16), gy.astype(np.float16)
    saved = layer.saved()
    layer.forward(x, save=saved)
    g16 = layer.backward(saved, gy)
    g32 = layer.backward(saved, gy, grad_dtype="float32")
    with pytest.raises(ValueError):
        layer.backward(saved, gy, grad_dtype="float64")
    tdt = torch.float16 if dtype == "float16" else torch.bfloat16
    for name, a in g16.items():
        assert a.dtype == (np.float16 if dtype == "float16" else np.float32), name
        assert g32[name].dtype == np.float32, name
        rounded = torch.from_numpy(g32[name]).to(tdt).float().numpy()
        assert np.array_equal(rounded, np.asarray(a, np.float32)), name
        assert not np.array_equal(g32[name], np.asarray(a, np.float32)), name


def test_backward_on_16bit_device_arrays(pcl):
    """A bfloat16 layer's backward on pyopencl arrays of 16-bit elements gives the host call's
    gradients bit for bit."""
    import pyopencl.array as cla

    _, queue, c = pcl
    rng = np.random.default_rng(8)
    layer = clmha.Layer(E, H, batch_first=True, dtype="bfloat16", context=c)
    tm = torch_mha(E, H, seed=4, batch_first=True)
    layer.load_state_dict({k: v.numpy() for k, v in tm.state_dict().items()})
    bits = lambda a: torch.from_numpy(a).to(torch.bfloat16).view(torch.int16).numpy()  # noqa
    x = torch.from_numpy(rng.standard_normal((N, L, E)).astype(np.float32)).bfloat16().float()
    gy = torch.from_numpy(rng.standard_normal((N, L, E)).astype(np.float32)).bfloat16().float()
    x, gy = x.numpy(), gy.numpy()
    saved = layer.saved()
    layer.forward(x, save=saved)
    host = layer.backward(saved, gy)
    dsaved = layer.saved()
    xd = cla.to_device(queue, bits(x).view(np.uint16))
    layer.forward(xd, save=dsaved)
    dev = layer.backward(dsaved, cla.to_device(queue, bits(gy).view(np.uint16)))
    assert set(dev) == set(host)
    for name, a in dev.items():
        got = a.get()
        assert got.dtype == np.uint16, name
        assert np.array_equal(got.view(np.int16), bits(host[name])), name


def _train(dtype, steps=20, lr=0.05, scale=None):
    """20 SGD steps of a self-attention layer on a fixed regression target: the losses. float64
    in PyTorch (dtype None), else clmha in dtype with float32 master weights (the module's
    parameters hold their 16-bit copies; with scale, the loss is scaled before the backward and
    the float32 gradients unscaled, skipping a step whose gradients are not finite, as
    torch.cuda.amp.GradScaler does)."""
    torch.manual_seed(0)
    tm = torch_mha(E, H, seed=9, batch_first=True)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, L, E, generator=g)
    target = torch.randn(N, L, E, generator=g) * 0.5
    master = {k: v.double() for k, v in tm.state_dict().items()}
    if dtype is None:
        m = copy.deepcopy(tm).double()
    else:
        m = ct.MultiheadAttention(E, H, batch_first=True, dtype=dtype)
        x = x.to(dtype)
        master = {k: v.float() for k, v in master.items()}
    losses, skipped = [], 0
    for _ in range(steps):
        m.load_state_dict({k: v.to(m.out_proj.weight.dtype) for k, v in master.items()})
        m.zero_grad()
        xx = x.double() if dtype is None else x
        out = m(xx, xx, xx, need_weights=False)[0]
        loss = ((out.double() - target.double()) ** 2).mean()
        losses.append(float(loss))
        (loss * scale if scale else loss).backward()
        grads = {k: p.grad.to(master[k].dtype) / (scale or 1.0)
                 for k, p in m.named_parameters()}
        if not all(torch.isfinite(v).all() for v in grads.values()):
            skipped += 1
            continue
        for k in master:
            master[k] = master[k] - lr * grads[k]
    return np.array(losses), skipped


def test_training_bf16_and_f16_follow_float64(ctx):
    ref, _ = _train(None)
    bf16, _ = _train(torch.bfloat16)
    f16, skipped = _train(torch.float16, scale=2.0 ** 12)
    assert ref[-1] < 0.9 * ref[0]  # it learns
    for name, got, tol in (("bfloat16", bf16, 1e-2), ("float16", f16, 2e-3)):
        rel = np.abs(got - ref) / ref
        record(f"training {name}: max relative loss difference", rel.max())
        assert rel.max() <= tol, (name, rel.max(), got, ref)
    assert skipped == 0


def test_float64_gradcheck_and_pytorch(ctx):
    """A float64 module: torch.autograd.gradcheck (central differences against clmha's
    gradients, through the public module) on the query, key and a float mask, and every
    gradient within 1e-12 (relative to 1 + its largest value) of PyTorch's float64 autograd."""
    tm = torch_mha(8, 2, seed=6, batch_first=True).double()
    cm = ct.MultiheadAttention(8, 2, batch_first=True, dtype=torch.float64)
    cm.load_state_dict(tm.state_dict())
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(2, 5, 8, generator=g, dtype=torch.float64, requires_grad=True)
    am = torch.randn(4, 5, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, kv, am: cm(q, kv, kv, attn_mask=am, need_weights=False)[0], (q, kv, am),
        eps=1e-6, atol=1e-7, rtol=1e-6)
    gy = torch.randn(2, 4, 8, generator=g, dtype=torch.float64)
    grads = []
    for m in (cm, tm):
        for t in (q, kv, am):
            t.grad = None
        m.zero_grad()
        m(q, kv, kv, attn_mask=am, need_weights=False)[0].backward(gy)
        grads.append([q.grad.clone(), kv.grad.clone(), am.grad.clone()]
                     + [p.grad.clone() for p in m.parameters()])
    worst = max(float((a - b).abs().max() / (1 + b.abs().max())) for a, b in zip(*grads))
    record("float64 module gradients vs PyTorch float64 (relative)", worst)
    assert worst <= 1e-12
